"""The planner on placement="stream" at the 3B shape: state slots, the streamed share, and a what-if.

Runs anywhere (planner arithmetic and its list simulation; predictions, not measurements):
    python bench/stream_plan.py [--batch 1 4]
Prints, per batch (seq 4096, cast_on_device, a weight slot per layer as "stream" resolves it):
  slots    the steady step with the first 15 layers streamed through 2, 4, 8 and 36 state slots
           (placement.state_slots' choice on the H200: 7);
  share    the steady step for each even number of streamed layers: the best one, against what
           placement.stream_share picks from a host AdamW rate (--host-rate, G params/s; 2.29 is what
           20 streamed layers implied on the H200 on 2026-12-01 with the isolated 55 GB/s);
  what-if  the best step when a streamed layer's fp32 state is loaded in the forward (12 bytes/param
           instead of 4 of weights) and its backward loads nothing: the design log's rejected lever.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import sys

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
from shapes import qwen_config  # noqa: E402

from megatrain_nb.machine import placement as placing  # noqa: E402
from megatrain_nb.machine import planner, simulate  # noqa: E402

L = 36


HW = planner.H200  # with --host-rate as its host AdamW (main)


HEAD = {}  # the head group's placement: {L: "device", -1: "device"} as "stream" places it (--head device)


def steady(cfg, batch: int, streamed: int) -> float:
    p = planner.plan(cfg, batch=batch, seq=4096, hardware=HW, cast_on_device=True, weight_slots=L,
                     placement=dict.fromkeys(range(streamed), "device") | HEAD)
    return p.steady_step_ms


def state_in_forward() -> dict:
    """The simulator's namespace with streamed layers' state loaded in the forward (none in the backward)."""
    src = inspect.getsource(simulate)
    src = src.replace('s = self.use(k, op, at, f_slot, t["h2d"], end)',
                      's = self.use(k, op, at, f_slot, t["h2d"] * (3 if op.layer in self.streamed else 1), end)')
    src = src.replace('got = self.load(op.layer, "bwd", t["state_bytes"], 0.0, t["state_in"], self.sslot_free[j],',
                      'got = 0.0 if True else self.load(op.layer, "bwd", t["state_bytes"], 0.0, t["state_in"], '
                      'self.sslot_free[j],')
    ns = dict(simulate.__dict__)
    exec(compile(src, simulate.__file__, "exec"), ns)  # noqa: S102  (the repo's own simulator, two lines changed)
    return ns


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--host-rate", type=float, default=1.8, help="host AdamW in a stream step, G params/s, as the engine "
                    "measures it (a 3B x 4 trace of 2026-12-02: 1.8, bench/copy_rates.py)")
    ap.add_argument("--head", choices=["device", "host"], default="device",
                    help="the (tied) head group: streamed as 'stream' places it (Note: [Streamed head]), or on the host")
    ap.add_argument("--sweep", action="store_true", help="print the steady step for every even share")
    a = ap.parse_args(argv)
    global HW, HEAD
    HW = dataclasses.replace(planner.H200, host_adam_params_per_s=a.host_rate * 1e9)
    HEAD = {L: "device", -1: "device"} if a.head == "device" else {}
    cfg = qwen_config("3b", seq=4096)
    rule = placing.state_slots
    for b in a.batch:
        row = []
        for k in (2, 4, 8, L):
            placing.state_slots = lambda n, *_, k=k: 0 if not n else k
            row.append(f"{k}: {steady(cfg, b, 15):.0f} ms")
        placing.state_slots = rule
        print(f"3B x {b}, 15 streamed, state slots  " + ", ".join(row))
        sweep = {n: steady(cfg, b, n) for n in range(0, L + 1, 2)}
        best = min(sweep, key=sweep.get)
        sh = planner.plan(cfg, batch=b, seq=4096, cast_on_device=True, weight_slots=L).shape
        numel = {-1: sh["embed_params"], **dict.fromkeys(range(L), sh["params_per_layer"]), L: sh["head_params"]}
        extras = placing.stream_extras(numel, sh["tied"], bool(HEAD))  # as DeviceUpdates.stream_rate
        if a.sweep:
            print(f"3B x {b}, steady ms by streamed layers: " + ", ".join(f"{n}: {v:.0f}" for n, v in sweep.items()))
        pick = round(L * placing.stream_share(a.host_rate * 1e9, placing.PCIE_IN_STEP_BYTES_PER_S, cached=True,
                                              window=placing.HOST_WINDOW, **extras))
        old = round(L * placing.stream_share(a.host_rate * 1e9, placing.PCIE_BYTES_PER_S, cached=True, **extras))
        print(f"3B x {b}, share: best {best} streamed ({sweep[best]:.0f} ms, "
              f"{6 * 3.0859e9 * 4096 * b / sweep[best] / 1e9:.1f} model TFLOPS); the in-step rule picks {pick} "
              f"({steady(cfg, b, pick):.0f} ms), the isolated rate {old} ({steady(cfg, b, old):.0f} ms)")
        ns = state_in_forward()
        saved = planner.simulate, planner.simulate_steady
        planner.simulate, planner.simulate_steady = ns["simulate"], ns["simulate_steady"]
        try:
            what = {n: steady(cfg, b, n) for n in range(0, L + 1, 2)}
        finally:
            planner.simulate, planner.simulate_steady = saved
        w = min(what, key=what.get)
        print(f"3B x {b}, what-if state in the forward: best {w} streamed, {what[w]:.0f} ms "
              f"(against {sweep[best]:.0f} ms without)")


if __name__ == "__main__":
    main()
