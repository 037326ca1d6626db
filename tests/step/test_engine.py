"""Engine behaviour that the equivalence tests do not pin down: the activation policy's lifetime."""
import pytest
import torch

from conftest import make_config
from megatrain_nb import Session


def _batch(vocab, b, t):
    return {"input_ids": torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(b * t))}


def test_activation_policy_is_chosen_again_when_tokens_grow(monkeypatch):
    cfg = make_config("llama", num_hidden_layers=3)
    s = Session.from_config(cfg, seed=0)  # checkpoint_every=None: the policy comes from free memory
    chosen = []
    real = s.engine._keep_now

    def spy(i):
        chosen.append(i)
        return real(i)

    monkeypatch.setattr(s.engine, "_keep_now", spy)
    s.step(_batch(cfg.vocab_size, 2, 8))
    assert chosen == [0, 1, 2] and s.engine._keep_tokens == 16
    s.step(_batch(cfg.vocab_size, 2, 8))  # same size: the policy stands (keep[i] is read back)
    s.step(_batch(cfg.vocab_size, 1, 8))  # fewer tokens: still fits, stands
    assert s.engine._keep_tokens == 16
    s.step(_batch(cfg.vocab_size, 4, 8))  # more tokens than it was chosen for: chosen again
    assert s.engine._keep_tokens == 32
    s.close()


def test_fixed_checkpointing_is_never_rechosen():
    cfg = make_config("llama", num_hidden_layers=3)
    s = Session.from_config(cfg, seed=0, checkpoint_every=1)
    s.step(_batch(cfg.vocab_size, 1, 8))
    s.step(_batch(cfg.vocab_size, 4, 8))
    assert s.engine.keep == [False, False, False]
    assert s.history[-1].recomputed_layers == 3
    s.close()


def test_step_records_keep_steps_for_a_later_resolve():
    """A caller can keep several steps' raw records (no GPU wait) and resolve them after; reading the trace
    consumes them, and a session without a trace has none."""
    cfg = make_config("llama", num_hidden_layers=2)
    s = Session.from_config(cfg, seed=0)
    kept = []
    for _ in range(2):
        s.step(_batch(cfg.vocab_size, 1, 8))
        kept.append(s.engine.step_records())
    assert kept[0] is not kept[1] and all(r is not None for r in kept)
    first, last = (s.engine.rec.resolve(r).to_dataframe() for r in kept)
    assert set(first.layer[first.op == "fwd"]) == {0, 1} and len(first) and len(last)
    assert len(s.trace.to_dataframe()) == len(last)  # the engine's own trace is the last step's
    assert s.engine.step_records() is None  # read: nothing pending
    s.tracing = False
    s.step(_batch(cfg.vocab_size, 1, 8))
    assert s.engine.step_records() is None
    s.close()


def test_offloaded_checkpoints_train_bitwise_like_device_checkpoints():
    """Parking block inputs in host memory and fetching them back changes no bit of the training."""
    cfg = make_config("llama", num_hidden_layers=5)
    batches = [_batch(cfg.vocab_size, 4, 8 + k) for k in range(3)]  # a new shape each step: buffers re-made
    runs = {}
    for offload in (False, True):
        for k in (1, 2):
            s = Session.from_config(cfg, seed=0, checkpoint_every=k, micro_batch_size=2, offload_checkpoints=offload)
            runs[(offload, k)] = [s.step(b).loss for b in batches]
            s.engine.drain()
            runs[(offload, k, "w")] = [s.store.units[u].master.clone() for u in s.store.order]
            if offload:
                assert not s.engine.offload.parked and not s.engine.offload.fetched  # every park came back
            s.close()
    for k in (1, 2):
        assert runs[(True, k)] == runs[(False, k)]
        assert all(torch.equal(a, b) for a, b in zip(runs[(True, k, "w")], runs[(False, k, "w")]))


def test_small_inputs_go_to_the_device_before_any_load_of_the_step(hf_dir, monkeypatch):
    """Masks, position ids and labels are copied at the step's start: enqueued later, on the compute stream,
    a small copy in waits behind every weight and state load then in flight (the 3B x 4 "stream" loss:
    206 ms where it takes 74)."""
    from conftest import VOCAB, make_batches

    s = Session.from_pretrained(hf_dir("llama"), lr=1e-3)
    try:
        e, order = s.engine, []
        for name in ("_small_inputs", "_gather", "_plan", "_load_head"):
            real = getattr(e, name)
            monkeypatch.setattr(e, name, lambda *a, _n=name, _r=real, **k: order.append(_n) or _r(*a, **k))
        s.step(make_batches(VOCAB, 1)[0])
        assert order[0] == "_small_inputs" and order.count("_small_inputs") == 1
    finally:
        monkeypatch.undo()
        s.close()


def test_the_default_loss_chunk_holds_1024_tokens_across_the_rows(monkeypatch):
    """loss_chunk_tokens=None: a chunk's logits stay at 1024 tokens however many rows (shape.loss_positions);
    before, 1024 positions times the rows (3B x 16: 16K tokens of logits, ~23 GiB beside the activations).
    An int stays positions, in training and in evaluate; the loss is the same either way."""
    cfg = make_config("llama", num_hidden_layers=2)
    batch = _batch(cfg.vocab_size, 4, 600)  # 2400 tokens: 256 positions a chunk by default, 3 chunks
    losses = {}
    for setting, want in ((None, [(4, 256), (4, 256), (4, 88)]), (1024, [(4, 600)]), (250, [(4, 250), (4, 250), (4, 100)])):
        s = Session.from_config(cfg, seed=0, loss_chunk_tokens=setting)
        seen = []
        real = s.engine.arch.logits

        def spy(params, x, real=real, seen=seen):
            seen.append(tuple(x.shape[:2]))
            return real(params, x)

        monkeypatch.setattr(s.engine.arch, "logits", spy)
        try:
            losses[setting] = s.step(batch).loss
            assert seen == want, (setting, seen)
            seen.clear()
            s.evaluate([batch])
            assert seen == want, (setting, seen)
        finally:
            s.close()
    assert losses[None] == pytest.approx(losses[1024], rel=1e-6) == losses[250]


def test_the_adam_workers_threads_apply_to_its_own_thread_only():
    """AdamWorker.threads (bench/throughput.py --host-threads): the worker's updates run with that many intra-op
    threads from its next step on; the driver's thread keeps its own."""
    import threading

    from megatrain_nb.step.workers import AdamWorker, Box

    before, seen = torch.get_num_threads(), []
    w = AdamWorker([0], lambda u, lr, scale: seen.append(torch.get_num_threads()), threading.Event())
    try:
        w.threads = before + 1  # differs from the driver's whatever the machine
        st = w.begin(step=0, lr=1e-3, gate=False, clip=lambda n: (1.0, 0.0), loss=Box(value=1.0, ready=True))
        w.land(0, 1.0, step=0)
        w.wait_version(0, 1)
        assert st["landed"] == {0: 1.0} and seen == [before + 1]
        assert torch.get_num_threads() == before
    finally:
        w.close()


@pytest.mark.parametrize("norms, want", [({0: 1.0, 1: 1.0, 2: 1.0}, [2, 0, 1]),
                                         ({0: 1.0, 1: 1.0, 2: float("nan")}, [0, 1])],
                         ids=["finite", "non_finite_device_unit"])
def test_the_adam_worker_counts_a_device_updated_unit_first_unless_its_norm_is_non_finite(norms, want):
    """Note: [Early state]: a landed unit that the device updated (``AdamWorker.noop``) is counted before the host
    updates that landed ahead of it, so that a load of it need not wait behind them; a non-finite one keeps its
    place, and the units after it are skipped as ever."""
    import threading

    from megatrain_nb.step.workers import AdamWorker, Box

    calls = []
    w = AdamWorker([0, 1, 2], lambda u, lr, scale: calls.append(u), threading.Event())
    w.noop = lambda u: u == 2
    try:
        loss = Box()
        w.begin(step=0, lr=1e-3, gate=False, clip=lambda n: (1.0, 0.0), loss=loss)
        for u in (0, 1, 2):  # every unit lands before the worker reads the loss
            w.land(u, norms[u], step=0)
        loss.put(1.0)
        w.wait_all(1)
        assert calls == want
    finally:
        w.close()
