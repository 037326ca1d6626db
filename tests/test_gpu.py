"""The CUDA pipeline against native PyTorch on the same GPU. Marked gpu: skipped without CUDA.

Run on the H200 with `python -m pytest -q -m gpu tests/test_gpu.py`; results are logged in
docs/benchmarks.md.
"""
import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import GPU_MIXED, gpu_batches, gpu_config, gpu_run
from megatrain_nb import Session

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture
def model_dir(tmp_path):
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(gpu_config()).save_pretrained(tmp_path)
    return tmp_path


STREAMED = {0: "device", 2: "device", 3: "resident"}  # state streamed through for two layers
STREAMED_HEAD = {-1: "device", 0: "device", 2: "device", 4: "device"}  # and a tied head group (Note: [Streamed head])


@pytest.mark.parametrize("placement", ["host", "auto", "stream", {u: "resident" for u in range(-1, 5)}, GPU_MIXED, STREAMED])
def test_bf16_stream_matches_native_autocast(model_dir, placement):
    """One step: weights agree to bf16 rounding. 20 steps: loss curves within 2%.

    Bound: Adam's first update is lr * g / (|g| + eps) ~ lr * sign(g), so two runs whose bf16
    gradients differ only by rounding can differ by at most 2 * lr per weight (a sign flip of a
    near-zero gradient). Over 20 steps bf16 matmul rounding (2^-8 relative) perturbs the loss by
    well under 1%; 2% leaves room for the different placement of casts (autocast keeps RMSNorm
    products in fp32; the stream computes the whole layer in bf16).
    """
    lr = 1e-4
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    opt = torch.optim.AdamW(ref.parameters(), lr=lr, weight_decay=0.0)
    s = Session.from_pretrained(model_dir, device="cuda", lr=lr, checkpoint_every=None, placement=placement)
    ref_losses, our_losses = [], []
    for k, ids in enumerate(gpu_batches(20)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = ref(input_ids=ids.cuda(), labels=ids.cuda()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
        our_losses.append(s.step({"input_ids": ids}).loss)
        if k == 0:
            s.engine.drain()
            ref_sd = {n: p.detach().cpu() for n, p in ref.named_parameters()}
            worst = 0.0
            for u in s.store.order:
                for n, v in s.store.views(u).items():
                    worst = max(worst, (v - ref_sd[n]).abs().max().item())
            assert worst <= 2 * lr + 1e-6, f"after one step a weight differs by {worst} > 2*lr"
    rel = [abs(a - b) / abs(b) for a, b in zip(our_losses, ref_losses)]
    print("native", [round(x, 4) for x in ref_losses])
    print("stream", [round(x, 4) for x in our_losses])
    assert max(rel) < 0.02, rel
    assert our_losses[-1] < our_losses[0] - 0.5  # it trains
    if placement == "auto":  # a tiny model fits: after the measuring step every unit is resident
        assert set(s.placement.placement) == {"resident"}, s.placement
    if placement == "stream":  # Note: [Streamed head]: the head group streams its state (an untied embedding not)
        tied = ref.config.tie_word_embeddings
        assert s.placement.set_index("unit").placement[4] == "device", s.placement
        assert s.placement.set_index("unit").placement[-1] == ("device" if tied else "host"), s.placement
    s.close()


def test_bf16_stream_of_a_tied_model_matches_native_autocast(tmp_path):
    """Placement "stream" with a tied embedding: the head group streams, its rows come from the head slot."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(gpu_config(tied=True)).save_pretrained(tmp_path)
    test_bf16_stream_matches_native_autocast(tmp_path, "stream")


@pytest.mark.parametrize("placement", ["host", GPU_MIXED, STREAMED, STREAMED_HEAD])
@pytest.mark.parametrize("lane,delay", [("h2d", 20_000_000), ("compute", 20_000_000), ("d2h", 20_000_000),
                                        ("host-pack", 0.02), ("host-unpack", 0.02), ("host-adam", 0.02)])
def test_deliberate_delays_leave_results_bit_identical(tmp_path, lane, delay, placement):
    """A missing wait would let a delayed stream's data be read too early; the result would change.
    With resident units mixed in, the device-update lane (end of the step, compute stream) is covered; with
    the tied head group streamed, its state's lanes and the rows gathered from the head slot."""
    torch.manual_seed(0)
    tied = placement is STREAMED_HEAD  # an untied embedding does not stream
    AutoModelForCausalLM.from_config(gpu_config(attn="eager", tied=tied)).save_pretrained(tmp_path)
    base_l, base_w = gpu_run(tmp_path, {}, checkpoint_every=2, placement=placement)
    again_l, again_w = gpu_run(tmp_path, {}, checkpoint_every=2, placement=placement)
    assert base_l == again_l and all(torch.equal(a, b) for a, b in zip(base_w, again_w)), "not deterministic"
    l, w = gpu_run(tmp_path, {lane: delay}, checkpoint_every=2, placement=placement)
    assert l == base_l
    assert all(torch.equal(a, b) for a, b in zip(w, base_w))


def test_kept_activations_equal_recompute(tmp_path):
    """Keeping a layer's graph (weights re-bound through SlotRefs) equals recomputing it, bitwise."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(gpu_config(attn="eager")).save_pretrained(tmp_path)
    a = gpu_run(tmp_path, {}, checkpoint_every=0)
    b = gpu_run(tmp_path, {}, checkpoint_every=1)
    c = gpu_run(tmp_path, {}, checkpoint_every=3)
    assert a[0] == b[0] == c[0]
    assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a[1], b[1], c[1]))


@pytest.mark.parametrize("placement", ["host", STREAMED])
def test_early_rows_train_bit_identical_to_waiting_for_the_embedding(model_dir, placement):
    """Note: [Early rows] on CUDA: with the host AdamW slowed, each forward takes its embedding rows ahead of
    the embedding's whole update (served every step after the first), bitwise as when it waits."""
    runs = {}
    for early in (True, False):
        s = Session.from_pretrained(model_dir, device="cuda", lr=1e-3, weight_decay=0.1, placement=placement)
        try:
            s.engine.early.on = early
            s.engine.delays = {"host-adam": 0.1}  # 0.02 s left the embedding's update ahead of its rows now and
            # then (on the H200: 0 or 2 of 3 steps served early, with and without split masters)
            losses = [s.step({"input_ids": ids}).loss for ids in gpu_batches(4, seed=2)]
            s.engine.drain()
            runs[early] = (losses, s.engine.early.count, [s.store.units[u].master.clone() for u in s.store.order])
        finally:
            s.close()
    (l1, n1, w1), (l0, n0, w0) = runs[True], runs[False]
    assert n1 >= 3 and n0 == 0
    assert l1 == l0 and all(torch.equal(a, b) for a, b in zip(w1, w0))


@pytest.mark.parametrize("slots", [None, 2], ids=["held", "two_slots"])
def test_split_masters_train_bitwise_equal_on_cuda(tmp_path, slots):
    """Note: [Split master] on CUDA: "device" layers' masters held as [R | D] (D alone comes in where every
    layer keeps its weight slot, both planes with two slots) train bit for bit as fp32 masters, the tied head
    group streamed beside them; and their state loads carry 10 bytes a parameter where R is held."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(gpu_config(tied=True)).save_pretrained(tmp_path)
    runs = {}
    for split in (False, True):
        s = Session.from_pretrained(tmp_path, device="cuda", lr=1e-3, weight_decay=0.1, placement=STREAMED_HEAD,
                                    split_master=split, weight_slots=4 if slots is None else slots)
        try:
            losses = [s.step({"input_ids": ids}).loss for ids in gpu_batches(4, seed=3)]
            df = s.trace.to_dataframe()
            assert s.store.split == ({0, 2} if split else set())
            s.engine.drain()
            runs[split] = (losses, [t.clone() for u in s.store.order for t in
                                    (s.store.units[u].master, s.store.units[u].exp_avg, s.store.units[u].exp_avg_sq)],
                           set(df[(df.op == "state-in") & (df.layer == 0)].bytes), s.store.units[0].layout.numel)
        finally:
            s.close()
    (l0, w0, b0, n), (l1, w1, b1, _) = runs[False], runs[True]
    assert l1 == l0 and all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(w0, w1))
    assert b0 == {12 * n} and b1 == {(10 if slots is None else 12) * n}


@pytest.mark.parametrize("lane,delay", [("h2d", 20_000_000), ("compute", 20_000_000), ("d2h", 20_000_000),
                                        ("host-pack", 0.02)])
def test_deliberate_delays_with_split_masters_and_held_weights(tmp_path, lane, delay):
    """Note: [Split master] where D alone comes in: the join reads the held weight slot on the optimizer
    stream, so a missing wait (the slot refilled or its R read too early) would change the result."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(gpu_config(attn="eager")).save_pretrained(tmp_path)
    base_l, base_w = gpu_run(tmp_path, {}, checkpoint_every=2, placement=STREAMED, weight_slots=4)
    l, w = gpu_run(tmp_path, {lane: delay}, checkpoint_every=2, placement=STREAMED, weight_slots=4)
    assert l == base_l
    assert all(torch.equal(a, b) for a, b in zip(w, base_w))


def test_split_master_kernels_equal_the_torch_ops():
    """Note: [Split master]: the CUDA kernels give the bits the CPU's torch ops give, ties included, and join
    gives every bit back."""
    from megatrain_nb.host import split_master as sm
    g = torch.Generator().manual_seed(0)
    n = (1 << 22) + 6
    m = torch.randn(n, generator=g) * torch.logspace(-30, 30, n)
    m.view(torch.int32)[:8192] = (m.view(torch.int32)[:8192] & ~0xFFFF) | 0x8000  # exact ties
    v = torch.rand(n, generator=g)
    out = {}
    for dev in ("cpu", "cuda"):
        mm, vv = m.to(dev, copy=True), v.to(dev, copy=True)
        r, d = (torch.empty(n, dtype=torch.int16, device=dev) for _ in range(2))
        sm.split_into(mm, r, d, vv)
        split = (r.cpu(), d.cpu(), vv.view(torch.int32).cpu().clone())  # join clears the marks in place
        back = torch.empty_like(mm)
        sm.join_into(back, r, d, vv)
        out[dev] = (*split, back.view(torch.int32).cpu(), vv.view(torch.int32).cpu())
    assert sm._kernels() is not None, "Triton missing: the CUDA path fell back to torch's ops"
    assert (out["cpu"][2] < 0).sum() > 1000  # ties marked
    assert all(torch.equal(a, b) for a, b in zip(out["cpu"], out["cuda"]))
    assert torch.equal(out["cuda"][3], m.view(torch.int32)) and torch.equal(out["cuda"][4], v.view(torch.int32))


def test_mapped_reads_bypass_the_copy_engine_and_are_exact(model_dir):
    """Note: [Mapped reads]: on the GPU the step's scalar reads are kernel writes into mapped host memory
    (not copies queued behind state write-backs), and they give every value back exactly."""
    import math
    s = Session.from_pretrained(model_dir, device="cuda", lr=1e-3, placement=STREAMED)
    try:
        io = s.engine.io
        assert io.norm_mapped is not None and io.loss_mapped is not None, "mapped host memory did not work here"
        for x in (3.25, -0.0, float("inf"), float("nan"), 1e-42):
            src = torch.tensor([x], device="cuda")
            x = float(src.cpu())  # the fp32 value (1e-42 is a subnormal: 1.0005e-42)
            got = io._read(src, io.norm_host[1:2], None, io.norm_mapped[1:2])
            assert (math.isnan(got) and math.isnan(x)) or (got == x and math.copysign(1, got) == math.copysign(1, x))
        r = [s.step({"input_ids": ids}) for ids in gpu_batches(2, seed=4)]
        assert all(math.isfinite(x.grad_norm) and x.grad_norm > 0 for x in r)
    finally:
        s.close()


@pytest.mark.parametrize("state", ["int8", "int4"])
@pytest.mark.parametrize("placement", ["auto", "stream", "host", GPU_MIXED, STREAMED])
def test_compact_optimizer_state_trains_within_noise_of_fp32(model_dir, state, placement):
    """optimizer_state int8 / int4 under every placement: 20 steps within 2% of the fp32 run's losses, and the
    unit's moments stay compact on the host (its slabs are their codes' words, Note: [Compact slab])."""
    def run(st):
        s = Session.from_pretrained(model_dir, device="cuda", lr=1e-4, placement=placement, optimizer_state=st)
        losses = [s.step({"input_ids": ids}).loss for ids in gpu_batches(20)]
        frame, rep = s.placement, s.memory_report()
        s.close()
        return losses, frame, rep
    ref, _, ref_rep = run("fp32")
    ours, frame, rep = run(state)
    rel = [abs(a - b) / abs(b) for a, b in zip(ours, ref)]
    print("fp32", [round(x, 4) for x in ref])
    print(state, [round(x, 4) for x in ours])
    assert max(rel) < 0.02, rel
    assert ours[-1] < ours[0] - 0.5
    assert rep["bytes_per_param"] < ref_rep["bytes_per_param"] - 4
    assert any(m.startswith(state) for m in frame.moments), frame


@pytest.mark.parametrize("lane,delay", [("h2d", 20_000_000), ("d2h", 20_000_000), ("host-adam", 0.02)])
def test_deliberate_delays_with_compact_state_leave_results_bit_identical(tmp_path, lane, delay):
    """Streamed compact state: a missing wait around its load, update or write-back would change the result."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(gpu_config(attn="eager")).save_pretrained(tmp_path)
    kw = dict(checkpoint_every=2, placement=STREAMED, optimizer_state="int8")
    base_l, base_w = gpu_run(tmp_path, {}, **kw)
    again_l, again_w = gpu_run(tmp_path, {}, **kw)
    assert base_l == again_l and all(torch.equal(a, b) for a, b in zip(base_w, again_w)), "not deterministic"
    l, w = gpu_run(tmp_path, {lane: delay}, **kw)
    assert l == base_l
    assert all(torch.equal(a, b) for a, b in zip(w, base_w))


def _params_close(a: torch.Tensor, b: torch.Tensor, k: int, lr: float) -> None:
    """Two paths' masters after step ``k``: the first step's update reads no stored moment (equal to 1e-6); later,
    a moment one code apart (the paths round the same arithmetic in different orders, FMA on the device) moves
    its parameter by a part of lr, so: 99% of them within 1e-6, none further than 2 lr a step."""
    d = (a - b).abs()
    if k == 0:
        assert d.max() < 1e-6, d.max()
        return
    assert (d > 1e-6).float().mean() < 0.01, (k, (d > 1e-6).float().mean())
    assert d.max() <= 2 * lr * (k + 1), (k, d.max())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_compact_update_on_cuda_equals_the_host_kernel(kind):
    """The device's torch-op update and the host's C kernel: params within 1e-6 after the first step, moments
    within one quantization step after it and k + 1 after k + 1 steps (the kernels round the same arithmetic in
    different orders, FMA on the device, and a moment one code apart stays apart); the kept (fp32) span within
    2e-5 (torch's fused AdamW on CUDA and on the CPU: below)."""
    from megatrain_nb.host import compact_host, compact_state as cs

    torch.manual_seed(0)
    n = (1 << 20) + 300
    lay = cs.layout_for(kind, [("a", 0, 1000), ("b", 1000, n - 1000)], keep=())
    p = torch.randn(n)
    m, v = torch.zeros(lay.words), torch.zeros(lay.words)
    pd, md, vd = p.cuda(), m.cuda(), v.cuda()
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for k in range(3):
        g = torch.randn(n).bfloat16()
        compact_host.update_host(lay, p, g, m, v, step=torch.tensor(k + 1.0), **hp)
        cs.update_torch(lay, pd, g.cuda(), md, vd, step=torch.tensor(k + 1.0, device="cuda"), **hp)
        _params_close(pd.cpu(), p, k, hp["lr"])
        for which, (a, b) in enumerate(((m, md), (v, vd))):
            b = b.cpu()
            x, y = cs.dequantize(a, lay, which), cs.dequantize(b, lay, which)
            scale = torch.maximum(cs.parts(a, lay)[1], cs.parts(b, lay)[1]).repeat_interleave(cs.BLOCK[kind])[:n]
            step = (k + 1) * cs.qmaps(kind)[which].diff().max() * scale
            # the kept (fp32) span: torch's fused AdamW on both sides, whose CUDA kernel takes 1 - beta2 in fp32
            # (0.999f: 1.3e-5 off 0.001) where the CPU's takes it in double; so 2e-5 of v, plus rounding
            tol = step + 2e-5 * x.abs() + 1e-7 * x.abs().max()
            bad = (x - y).abs() > tol
            assert not bad.any(), (k, which, int(bad.sum()), bad.nonzero()[:5].flatten().tolist(),
                                   ((x - y).abs() / tol)[bad][:5].tolist())


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_compact_cuda_kernel_equals_the_torch_ops(kind):
    """The Triton kernel against update_torch's ops on the same CUDA tensors, a skipped step included."""
    from megatrain_nb.host import compact_cuda, compact_state as cs

    if not compact_cuda.available():
        pytest.skip("Triton is not installed")
    torch.manual_seed(0)
    n = 300 * cs.BLOCK[kind] + 77
    lay = cs.layout_for(kind, [("a", 0, 1000), ("b", 1000, n - 2000), ("c", n - 1000, 1000)], keep=())
    p = torch.randn(n, device="cuda")
    m, v = torch.zeros(lay.words, device="cuda"), torch.zeros(lay.words, device="cuda")
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    hp = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    for k, (t, skip) in enumerate([(1, 0), (2, 0), (3, 1), (3, 0)]):  # the third step is skipped
        g = torch.randn(n, device="cuda").bfloat16()
        found, step = torch.tensor(float(skip), device="cuda"), torch.tensor(float(t), device="cuda")
        compact_cuda.update(lay, p, g, m, v, step=step, found_inf=found, **hp)
        kernel, compact_cuda._KERNEL[0] = compact_cuda._KERNEL[0], None  # the torch ops for the reference
        try:
            cs.update_torch(lay, p2, g, m2, v2, step=step, found_inf=found, **hp)
        finally:
            compact_cuda._KERNEL[0] = kernel
        _params_close(p, p2, k, hp["lr"])
        for which, (a, b) in enumerate(((m, m2), (v, v2))):
            x, y = cs.dequantize(a, lay, which), cs.dequantize(b, lay, which)
            scale = cs.parts(a, lay)[1].repeat_interleave(cs.BLOCK[kind])[:n]
            assert ((x - y).abs() <= cs.qmaps(kind)[which].diff().max().cuda() * scale + 1e-5 * x.abs() + 1e-12).all(), k
