"""Compact Adam moments (compact_state.py): the maps, the codec, the host kernel against the torch path and the
reference libraries (torchao, bitsandbytes), determinism, subnormals and the fallback without a kernel."""
import math
import warnings

import pytest
import torch

from megatrain_nb.host import compact_host as ch
from megatrain_nb.host import compact_state as cs

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8)


def _step_size(kind: str, which: int) -> float:
    """One quantization step, relative to a block's absmax: half the largest gap of the map, or its least
    entry where that is above 0 (int4's second moment has no zero: it rounds (0, 1/16) up to 1/16)."""
    q = cs.qmaps(kind)[which]
    return max(float((q[1:] - q[:-1]).max()) / 2, float(q[0]))


def _block_tol(lay, slab_a, slab_b, which) -> torch.Tensor:
    """(n,) one code apart at each position (two quantizations each within half a gap of the same value):
    the larger of its block's two scales times twice the half step."""
    B = cs.BLOCK[lay.kind]
    s = torch.maximum(cs.parts(slab_a, lay)[1], cs.parts(slab_b, lay)[1])
    return (s.repeat_interleave(B)[:lay.n] * 2 * _step_size(lay.kind, which)).mul_(1.0001).add_(1e-30)


def _assert_moments_close(lay, a, b):
    for which in (0, 1):
        da, db = cs.dequantize(a, lay, which), cs.dequantize(b, lay, which)
        assert bool(((da - db).abs() <= _block_tol(lay, a, b, which)).all()), f"moment {which}"
        for x, y, o in lay.span_offsets():
            assert torch.equal(da[x:y], db[x:y])


def _unit(kind, n_big=9000, seed=0, grad_dtype=torch.bfloat16):
    """A unit with small tensors (exempt spans) between quantized ones, and moments from a few earlier steps."""
    shapes = [("a.weight", 0, n_big), ("a.bias", n_big, 300), ("b.weight", n_big + 300, n_big + 77),
              ("b.norm", 2 * n_big + 377, 64)]
    lay = cs.layout_for(kind, shapes, keep=())
    g = torch.Generator().manual_seed(seed)
    n = lay.n
    p = torch.randn(n, generator=g)
    grad = (torch.randn(n, generator=g) * 1e-2).to(grad_dtype)
    m, v = torch.zeros(lay.words), torch.zeros(lay.words)
    mf = torch.randn(n, generator=g) * 1e-3
    vf = torch.rand(n, generator=g) * 1e-5
    cs.quantize_into(m, lay, 0, mf)
    cs.quantize_into(v, lay, 1, vf)
    return lay, p, grad, m, v


# ---- maps and codec --------------------------------------------------------------------------------------

def test_maps_equal_torchao():
    pytest.importorskip("torchao", reason="torchao not installed (the dev extra installs it)")
    from torchao.optim import subclass_4bit, subclass_8bit
    from torchao.optim.quant_utils import create_dynamic_map

    m8, v8 = cs.qmaps("int8")
    assert torch.equal(m8, torch.tensor(create_dynamic_map(signed=True), dtype=torch.float32))
    assert torch.equal(v8, torch.tensor(create_dynamic_map(signed=False), dtype=torch.float32))
    assert torch.equal(m8, torch.tensor(subclass_8bit.get_qmap_signed()))
    assert torch.equal(v8, torch.tensor(subclass_8bit.get_qmap_unsigned()))
    m4, v4 = cs.qmaps("int4")
    assert torch.equal(m4, torch.tensor(subclass_4bit.get_qmap_signed()))
    assert torch.equal(v4, torch.tensor(subclass_4bit.get_qmap_unsigned()))


@pytest.mark.parametrize("kind", cs.KINDS)
def test_thresholds_reproduce_nearest_code(kind):
    for q in cs.qmaps(kind):
        t = ch._thresholds(q)
        x = torch.cat([t, torch.nextafter(t, torch.tensor(-math.inf)), q, torch.rand(20000) * 2 - 1])
        count = torch.searchsorted(t, x, right=True)  # thresholds at or below x
        assert torch.equal(count, cs.codes_of(x, q).long())


@pytest.mark.parametrize("kind", cs.KINDS)
def test_round_trip_within_one_step(kind):
    lay, _, _, _, _ = _unit(kind)
    g = torch.Generator().manual_seed(1)
    for which in (0, 1):
        x = torch.randn(lay.n, generator=g) * 1e-3
        x = x.abs() if which else x
        slab = torch.zeros(lay.words)
        cs.quantize_into(slab, lay, which, x)
        back = cs.dequantize(slab, lay, which)
        B = cs.BLOCK[kind]
        xk = x.clone()
        for a, b, _ in lay.span_offsets():
            xk[a:b] = 0
        pad = torch.zeros(lay.nblocks * B)
        pad[:lay.n] = xk
        absmax = pad.view(-1, B).abs().amax(-1).repeat_interleave(B)[:lay.n]
        err = (back - x).abs()
        keep = torch.zeros(lay.n, dtype=torch.bool)
        for a, b, _ in lay.span_offsets():
            keep[a:b] = True
            assert torch.equal(back[a:b], x[a:b])  # kept spans exact
        assert bool((err[~keep] <= absmax[~keep] * _step_size(kind, which) * 1.0001).all())


@pytest.mark.parametrize("kind", cs.KINDS)
def test_zero_slab_is_zero_moment(kind):
    lay, *_ = _unit(kind)
    for which in (0, 1):
        assert torch.equal(cs.dequantize(torch.zeros(lay.words), lay, which), torch.zeros(lay.n))


@pytest.mark.parametrize("kind", cs.KINDS)
def test_dequantize_writes_the_alignment_tail(kind):
    """Note: [Alignment tail] ``out`` as long as a unit's flat slab: the positions past the moment's end get zero,
    whatever ``out`` held (a resident group's device moments are made with ``torch.empty``)."""
    lay, _, _, m, v = _unit(kind)
    for which, slab in enumerate((m, v)):
        out = torch.full((lay.n + 37,), float("nan"))
        cs.dequantize(slab, lay, which, out=out)
        assert torch.equal(out[:lay.n], cs.dequantize(slab, lay, which))
        assert torch.equal(out[lay.n:], torch.zeros(37))
    with pytest.raises(ValueError, match=f"at least {lay.n}"):
        cs.dequantize(m, lay, 0, out=torch.empty(lay.n - 1))


# ---- the host kernel against the torch path -----------------------------------------------------------

@pytest.mark.parametrize("kind", cs.KINDS)
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_update_host_equals_update_torch(kind, grad_dtype):
    assert ch.kernel() is not None, "the C kernel did not build here"
    lay, p, grad, m, v = _unit(kind, grad_dtype=grad_dtype)
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    kw = dict(HYPER, weight_decay=0.1, step=torch.tensor(3.0), grad_scale=0.5)
    ch.update_host(lay, p, grad, m, v, **kw)
    cs.update_torch(lay, p2, grad, m2, v2, **kw)
    _assert_moments_close(lay, m, m2)
    torch.testing.assert_close(p, p2, rtol=1e-6, atol=1e-7)
    for a, b, _ in lay.span_offsets():  # exempt spans: torch's fused AdamW in both
        assert torch.equal(p[a:b], p2[a:b])


# ---- the reference libraries ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind,block", [("int8", 256), ("int4", 128)])
def test_one_update_equals_torchao(kind, block):
    pytest.importorskip("torchao", reason="torchao not installed (the dev extra installs it)")
    from torchao.optim.adam import single_param_adam
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    n = 64 * block
    lay = cs.layout_for(kind, [("w", 0, n)], keep=())
    g = torch.Generator().manual_seed(2)
    p = torch.randn(n, generator=g)
    grad = torch.randn(n, generator=g) * 1e-2
    m0, v0 = torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-5
    State = OptimState8bit if kind == "int8" else OptimState4bit
    am, av = State.zeros(n, signed=True, block_size=block), State.zeros(n, signed=False, block_size=block)
    am.copy_(m0)
    av.copy_(v0)
    m, v = torch.zeros(lay.words), torch.zeros(lay.words)
    cs.quantize_into(m, lay, 0, m0)
    cs.quantize_into(v, lay, 1, v0)
    assert torch.equal(cs.parts(m, lay)[0], am.codes) and torch.equal(cs.parts(v, lay)[0], av.codes)
    pa = p.clone()
    single_param_adam(pa, grad, torch.tensor(4.0), am, av, None, torch.tensor(HYPER["lr"]), *HYPER["betas"], 0.01,
                      HYPER["eps"], True, False)
    ch.update_host(lay, p, grad, m, v, **HYPER, weight_decay=0.01, step=torch.tensor(4.0))
    torch.testing.assert_close(p, pa, rtol=1e-6, atol=1e-7)
    for which, st in ((0, am), (1, av)):
        ours = cs.dequantize((m, v)[which], lay, which)
        tol = torch.maximum(cs.parts((m, v)[which], lay)[1], st.scale).repeat_interleave(block)
        assert bool(((ours - st.dequantize().flatten()).abs() <= tol * 2 * _step_size(kind, which) * 1.0001).all())


def test_int8_codes_equal_bitsandbytes():
    bnb_f = pytest.importorskip("bitsandbytes.functional", reason="bitsandbytes not installed (dev extra)")
    lay = cs.layout_for("int8", [("w", 0, 256 * 32)], keep=())
    x = torch.randn(lay.n, generator=torch.Generator().manual_seed(3)) * 1e-3
    try:
        codes, state = bnb_f.quantize_blockwise(x, code=bnb_f.create_dynamic_map(signed=True), blocksize=256)
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        pytest.skip(f"bitsandbytes has no CPU quantize_blockwise here: {e}")
    slab = torch.zeros(lay.words)
    cs.quantize_into(slab, lay, 0, x)
    ours, scales, _ = cs.parts(slab, lay)
    torch.testing.assert_close(scales, state.absmax.float())
    ours_x, theirs_x = cs.dequantize(slab, lay, 0), bnb_f.dequantize_blockwise(codes, state)
    tol = scales.repeat_interleave(256) * 2 * _step_size("int8", 0) * 1.0001
    assert bool(((ours_x - theirs_x).abs() <= tol).all())
    assert (ours != codes).float().mean() < 0.01  # nearest entry both; ties and rounding may differ


# ---- determinism, subnormals, fallback ---------------------------------------------------------------

def _bits(x: torch.Tensor) -> torch.Tensor:
    """A slab's words as int32: code words may read as NaN, which never equals itself."""
    return x.view(torch.int32)


def _steps(kind, threads, n_steps=3):
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        lay, p, grad, m, v = _unit(kind, n_big=20000)
        for t in range(1, n_steps + 1):
            ch.update_host(lay, p, grad, m, v, **HYPER, weight_decay=0.01, step=torch.tensor(float(t)))
        return p, m, v
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("kind", cs.KINDS)
def test_bitwise_deterministic_and_thread_count_independent(kind):
    a, b, c = _steps(kind, 2), _steps(kind, 2), _steps(kind, 1)
    for x, y, z in zip(a, b, c):
        assert torch.equal(_bits(x), _bits(y)) and torch.equal(_bits(x), _bits(z))


@pytest.mark.parametrize("kind", cs.KINDS)
def test_subnormal_moments_flush(kind):
    lay = cs.layout_for(kind, [("w", 0, 8192)], keep=())
    p = torch.randn(lay.n)
    grad = torch.zeros(lay.n, dtype=torch.bfloat16)
    m, v = torch.zeros(lay.words), torch.zeros(lay.words)
    sub = torch.full((lay.n,), 1e-39)  # subnormal fp32
    cs.quantize_into(m, lay, 0, sub)
    cs.quantize_into(v, lay, 1, sub)
    assert bool((cs.dequantize(m, lay, 0) < 1.2e-38).all())
    p_sub, m_sub, v_sub = p.clone(), m.clone(), v.clone()
    ch.update_host(lay, p_sub, grad, m_sub, v_sub, **HYPER, weight_decay=0.0, step=torch.tensor(2.0))
    # flushed expectation: with denormals as zero the moments start and stay zero, the parameters do not move
    p0, m0, v0 = p.clone(), torch.zeros(lay.words), torch.zeros(lay.words)
    ch.update_host(lay, p0, grad, m0, v0, **HYPER, weight_decay=0.0, step=torch.tensor(2.0))
    assert torch.equal(p_sub, p) and torch.equal(p0, p)
    assert torch.equal(_bits(m_sub), _bits(m0)) and torch.equal(_bits(v_sub), _bits(v0))
    assert float(torch.tensor([1e-30]) * 1e-10) > 0  # the caller's thread got its own float mode back


def test_fallback_without_kernel(monkeypatch):
    lay, p, grad, m, v = _unit("int8")
    p2, m2, v2 = p.clone(), m.clone(), v.clone()
    monkeypatch.setattr(ch, "_lib", False)  # as after a failed build
    monkeypatch.setattr(ch, "_warned_fallback", False, raising=False)
    kw = dict(HYPER, weight_decay=0.1, step=torch.tensor(2.0))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ch.update_host(lay, p, grad, m, v, **kw)
        ch.update_host(lay, p, grad, m, v, **kw)
    assert len([x for x in w if "torch ops" in str(x.message)]) == 1
    cs.update_torch(lay, p2, grad, m2, v2, **kw)
    cs.update_torch(lay, p2, grad, m2, v2, **kw)
    assert torch.equal(p, p2) and torch.equal(_bits(m), _bits(m2)) and torch.equal(_bits(v), _bits(v2))
