"""dual_stream.py's core op, amp_attention: the explicit reference in float64 is the ground truth; the torch form
(SDPA plus blocked statistics) and the Triton kernels (under Triton's interpreter without a GPU, see conftest.py)
must match it on o, the entropy, the max weight and on dq, dk, dv, driven by a random cotangent, without and with
ALiBi's bias. Kernel outputs are NaN-poisoned (GLASSBOX_POISON=1)."""
import dataclasses
import math
import os

import pytest
import torch

import dual_stream as op
from conftest import check_close, compiled_ops, fake_cuda_dispatch


needs_triton = pytest.mark.skipif(
    not op.HAS_TRITON or (os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available()),
    reason="needs triton and CUDA or TRITON_INTERPRET=1")


def _inputs(B, H, T, d_h, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, d_h, generator=g).to(dtype) for _ in range(4))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return [t.to(device) for t in (q, k, v, do)]


def _run(fn, q, k, v, do):
    """Forward and backward of `fn`: (o, entropy, max_weight, dq, dk, dv)."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o, ent, maxw = fn(*leaves)
    dq, dk, dv = torch.autograd.grad(o, leaves, do)
    return o, ent, maxw, dq, dk, dv


def _truth(q, k, v, do, alpha):
    """The reference in float64 on the same (possibly bf16-rounded) inputs."""
    return _run(lambda *x: op.amp_attention_reference(*x, alpha), q.double(), k.double(), v.double(), do.double())


def _compare(ref, out, ratio=None, atol=None):
    """check_close on (o, entropy, max_weight, dq, dk, dv); `ratio` and `atol` map a name to an override."""
    for name, r, o in zip(("o", "entropy", "max_weight", "dq", "dk", "dv"), ref, out):
        check_close(name, r, o, ratio=(ratio or {}).get(name), atol=(atol or {}).get(name))


def _single_key_atol(q, k, v, do, alpha):
    """With T = 1 the only weight is p = 1 whatever the logits, so dq = dk = 0 exactly and a relative error means
    nothing. The fp32 forms return the roundoff of dS = p·(dP − Δ), with dP = dO·v and Δ = dO·o equal in exact
    arithmetic (o = v), scaled by α/√d_h·k for dq (q for dk): bounded by eps32·α/√d_h·|dO|·|v|·max(|q|, |k|)."""
    scale = alpha / math.sqrt(q.shape[-1])
    q, k, v, do = (t.double().norm(dim=-1) for t in (q, k, v, do))  # per-row norms over d_h
    bound = (2**-23 * scale * do * v * torch.maximum(q, k)).max().item()
    return {"dq": bound, "dk": bound}


SHAPES = [(2, 2, T, d_h) for T in (1, 33, 200) for d_h in (16, 64)]


@needs_triton
@pytest.mark.parametrize("alpha", [1.0, 16.0])
@pytest.mark.parametrize("shape", SHAPES + [(1, 3, 77, 24), (1, 2, 77, 100)], ids=str)  # odd T, d_h
def test_triton_matches_reference(shape, alpha):
    q, k, v, do = _inputs(*shape)
    out = _run(lambda *x: op.amp_attention(*x, alpha, backend="triton"), q, k, v, do)
    assert out[0].dtype == q.dtype and out[1].dtype == out[2].dtype == torch.float32
    _compare(_truth(q, k, v, do, alpha), out, atol=_single_key_atol(q, k, v, do, alpha) if shape[2] == 1 else None)


@needs_triton
@pytest.mark.parametrize("block", [(16, 16), (64, 64), (16, 32), (32, 16)], ids=str)
@pytest.mark.parametrize("shape", [(1, 2, 200, 64), (1, 2, 77, 24)], ids=str)
def test_triton_forced_tiles(shape, block, monkeypatch):
    """_amp_launch_config picks 32-wide tiles for fp32 dots and 64-wide ones only for bf16 on CUDA, so the
    interpreter would never run the 64-wide loop bounds (the causal start of the dk/dv loop, the partial last
    tile). Force other tile sizes on fp32 inputs, square and not (BLOCK_M < BLOCK_N puts a query tile's start
    inside a key tile, where the forward's unmasked stage must stop short): the kernels must be right at any."""
    config = op._amp_launch_config

    def forced(q, cuda=None):
        return dict(config(q, cuda), BLOCK_M=block[0], BLOCK_N=block[1])

    monkeypatch.setattr(op, "_amp_launch_config", forced)
    q, k, v, do = _inputs(*shape)
    out = _run(lambda *x: op.amp_attention(*x, 4.0, backend="triton"), q, k, v, do)
    _compare(_truth(q, k, v, do, 4.0), out)


@pytest.mark.parametrize("alpha", [1.0, 16.0])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_matches_reference(shape, alpha):
    q, k, v, do = _inputs(*shape)
    out = _run(lambda *x: op.amp_attention(*x, alpha, backend="torch"), q, k, v, do)
    _compare(_truth(q, k, v, do, alpha), out, atol=_single_key_atol(q, k, v, do, alpha) if shape[2] == 1 else None)


# With 16-bit inputs Δ = rowsum(dO ⊙ O) reads the bf16-rounded O (as in FlashAttention). In dS = P ⊙ (dP − Δ)
# that rounding is not relative to dS: as α grows the rows saturate, dP − Δ shrinks and dq, dk with it, while the
# error of Δ stays ~2⁻⁹·|dO|·|O|. At α = 16 this alone costs dq, dk a relative error of 6e-3 to 9e-3 with
# round-to-nearest (GPU; torch's own bf16 SDPA backward is at 7e-3 to 1e-2 here), and 2e-2 to 3.5e-2 under
# TRITON_INTERPRET=1, whose fp32 → bf16 casts truncate. Hence 5e-2 for dq, dk at α = 16, still far below what a
# wrong term gives (O(1)); everything else holds the bf16 default.
BF16_CASES = [((2, 2, 200, 64), 1.0, None), ((1, 3, 77, 24), 1.0, None),
              ((1, 3, 77, 24), 16.0, {"dq": 5e-2, "dk": 5e-2})]


@needs_triton
@pytest.mark.parametrize("shape,alpha,ratio", BF16_CASES, ids=str)
def test_triton_bf16(shape, alpha, ratio):
    # o and the gradients are bf16 (8e-3, the bf16 default). The statistics are fp32 computed from bf16 inputs
    # that convert to fp32 exactly, so they meet the fp32 tolerance: only the logits' fp32 rounding enters.
    q, k, v, do = _inputs(*shape, dtype=torch.bfloat16)
    out = _run(lambda *x: op.amp_attention(*x, alpha, backend="triton"), q, k, v, do)
    assert out[0].dtype == torch.bfloat16 and out[1].dtype == torch.float32
    _compare(_truth(q, k, v, do, alpha), out, ratio=ratio)


FORMS = {
    "reference": lambda *x, **kw: op.amp_attention(*x, backend="reference", **kw),
    "torch": lambda *x, **kw: op.amp_attention(*x, backend="torch", **kw),
    "triton": pytest.param(lambda *x, **kw: op.amp_attention(*x, backend="triton", **kw), marks=needs_triton),
}


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_statistics_bounds(form):
    q, k, v, _ = _inputs(2, 2, 33, 16)
    _, ent, maxw = form(q, k, v, 2.0)
    assert ent[..., 0].abs().max() < 1e-6 and (maxw[..., 0] - 1).abs().max() < 1e-6  # row 0 sees key 0 only
    log_n = torch.arange(1, 34, dtype=torch.float64, device=q.device).log()
    assert (ent.double() <= log_n + 1e-5).all() and (ent >= -1e-6).all()  # 0 <= H <= log(t + 1)
    assert (maxw.double() >= (-log_n).exp() - 1e-6).all() and (maxw <= 1 + 1e-6).all()  # 1/(t+1) <= max p <= 1
    # Equal keys make every row uniform: the entropy reaches log(t + 1) and the max weight 1/(t + 1)
    _, ent, maxw = form(q, k[..., :1, :].expand_as(k).contiguous(), v, 2.0)
    check_close("uniform entropy", log_n.expand_as(ent), ent)
    check_close("uniform max_weight", (-log_n).exp().expand_as(maxw), maxw)


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_large_alpha_is_hard_attention(form):
    alpha = 1e4
    q, k, v, _ = _inputs(1, 2, 33, 16, seed=1)
    x = alpha / 4 * (q.double() @ k.double().transpose(-2, -1))  # logits, √16 = 4
    x = x.masked_fill(torch.ones(33, 33, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    top2 = x[..., 1:, :].topk(2, dim=-1).values
    assert (top2[..., 0] - top2[..., 1]).min() > 20  # the premise: a winner by e^20 in every row
    o, ent, maxw = form(q, k, v, alpha)
    assert ent.abs().max() < 1e-6 and (maxw - 1).abs().max() < 1e-6
    hard = torch.take_along_dim(v, x.argmax(-1)[..., None], dim=-2)  # v of the argmax key, per row
    check_close("o", hard, o)


@needs_triton
def test_triton_statistics_are_non_differentiable():
    q, k, v, do = _inputs(2, 2, 33, 16)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    o, ent, maxw = op.amp_attention(*leaves, 4.0, backend="triton")
    assert o.requires_grad and not ent.requires_grad and not maxw.requires_grad
    # The statistics can sit in a loss without changing the gradients
    loss = (o * do).sum() + 10 * ent.sum() + 10 * maxw.sum()
    grads = torch.autograd.grad(loss, leaves)
    ref = _truth(q, k, v, do, 4.0)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref[3:]):
        check_close(name, r, g)


def test_torch_statistics_are_non_differentiable():
    q, k, v, _ = _inputs(1, 2, 33, 16)
    o, ent, maxw = op.amp_attention(*(t.clone().requires_grad_() for t in (q, k, v)), backend="torch")
    assert o.requires_grad and not ent.requires_grad and not maxw.requires_grad


def _saved_sizes(fn, *args):
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*args)
    return sizes


@needs_triton
def test_triton_saves_no_attention_matrix():
    T, d_h = 200, 16  # T·T = 40000 elements, far above one head's q, k, v, o (3200) or lse (200)
    q, k, v = (t.requires_grad_() for t in _inputs(1, 1, T, d_h)[:3])
    saved = _saved_sizes(lambda *x: op.amp_attention(*x, backend="triton"), q, k, v)
    assert T * d_h in saved and max(saved) < T * T, saved  # q, k, v, o, lse and nothing of size T×T
    # The hook does see a T×T tensor where there is one: the reference saves p
    assert max(_saved_sizes(lambda *x: op.amp_attention(*x, backend="reference"), q, k, v)) >= T * T


def test_torch_block_statistics():
    q, k, v, _ = _inputs(2, 2, 33, 16)
    _, ent, maxw = op.amp_attention_torch(q, k, v, 3.0, block=7)  # 5 query blocks, the last one of 5 rows
    _, ref_ent, ref_maxw = op.amp_attention_reference(q.double(), k.double(), v.double(), 3.0)
    check_close("entropy", ref_ent, ent)
    check_close("max_weight", ref_maxw, maxw)


def test_torch_statistics_stay_fp32_under_bf16_autocast():
    """The model runs under bf16 autocast on a GPU; the torch form's entropy and max weight must still be the fp32
    numbers (in bf16, α = 16 misses the entropy by ~0.06)."""
    q, k, v, _ = _inputs(1, 2, 64, 32)
    _, ref_ent, ref_maxw = op.amp_attention_reference(q.double(), k.double(), v.double(), 16.0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, ent, maxw = op.amp_attention_torch(q, k, v, 16.0)
    assert ent.dtype == maxw.dtype == torch.float32
    check_close("entropy under autocast", ref_ent, ent)
    check_close("max_weight under autocast", ref_maxw, maxw)


def test_dispatch():
    q, k, v, _ = _inputs(1, 2, 9, 16)
    o, ent, maxw = op.amp_attention(q, k, v, stats=False, backend="torch")
    assert ent is None and maxw is None
    if not q.is_cuda:  # auto takes the torch form on CPU: its stats=False gives None
        assert op.amp_attention(q, k, v, stats=False)[1] is None
    with pytest.raises(ValueError, match="backend must be one of"):
        op.amp_attention(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match=r"\(2, 9, 16\)"):
        op.amp_attention(q[0], k[0], v[0])
    with pytest.raises(ValueError, match="shape"):
        op.amp_attention(q, k[..., :8, :], v)


@needs_triton
def test_triton_returns_free_statistics():
    q, k, v, _ = _inputs(1, 2, 9, 16)
    o, ent, maxw = op.amp_attention(q, k, v, stats=False, backend="triton")
    ref = op.amp_attention_reference(q.double(), k.double(), v.double())
    check_close("entropy", ref[1], ent)
    check_close("max_weight", ref[2], maxw)


@needs_triton
def test_nan_poisoning_catches_a_skipped_block(monkeypatch):
    """Kernel outputs start as NaN in tests: launching every query block but the last leaves them there (the
    poisoning forced on here, whatever the environment says)."""
    monkeypatch.setenv("GLASSBOX_POISON", "1")
    q, k, v, _ = _inputs(1, 2, 40, 16)
    cfg = op._amp_launch_config(q)
    B, H, T, d_h = q.shape
    o = op._amp_empty(q.shape, q.dtype, q.device)
    lse, ent, maxw = (op._amp_empty((B, H, T), torch.float32, q.device) for _ in range(3))
    blocks = -(-T // cfg["BLOCK_M"])
    assert blocks >= 2
    op._amp_attn_fwd[(blocks - 1, B * H)](q, k, v, o, lse, ent, maxw, lse, op.LOG2E / math.sqrt(d_h), T, d_h, **cfg,
                                          HAS_BIAS=False)
    done = (blocks - 1) * cfg["BLOCK_M"]
    for t in (o, lse, ent, maxw):
        assert not t[:, :, :done].isnan().any() and t[:, :, done:].isnan().all()
    torch.testing.assert_close(o[:, :, :done], op.amp_attention_reference(q, k, v)[0][:, :, :done])


# ---------------------------------------------------------------- ALiBi (spec §11.5): a per-head bias −b_h·(t − s)

def get_slopes_reference(n):
    """The ALiBi paper's get_slopes (Press et al. 2022, github.com/ofirpress/attention_with_linear_biases,
    fairseq/models/transformer.py), transcribed: the recursion that dual_stream.alibi_slopes writes as a loop."""
    def get_slopes_power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return get_slopes_power_of_2(closest) + get_slopes_reference(2 * closest)[0::2][:n - closest]


def test_alibi_slopes_are_the_papers():
    assert op.alibi_slopes(8).tolist() == [2.0 ** -i for i in range(1, 9)]  # the paper's 1/2, 1/4, ..., 1/256
    assert op.alibi_slopes(6).tolist() == [1 / 4, 1 / 16, 1 / 64, 1 / 256, 1 / 2, 1 / 8]  # 4's, then 8's odd ones
    assert op.alibi_slopes(3).tolist() == [1 / 16, 1 / 256, 1 / 4]
    for H in range(1, 33):
        torch.testing.assert_close(op.alibi_slopes(H), torch.tensor(get_slopes_reference(H)), rtol=1e-7, atol=0)


def _slopes(H, alpha, scaling, device):
    """The slope as the op takes it: s_h (bias not amplified) or α·s_h (α·(q·kᵀ/√d_h − s_h·(t − s)))."""
    return (op.alibi_slopes(H) * (alpha if scaling == "scaled" else 1.0)).to(device)


def _truth_alibi(q, k, v, do, alpha, slopes):
    return _run(lambda *x: op.amp_attention_reference(*x, alpha, slopes.double()), q.double(), k.double(), v.double(),
                do.double())


# H = 6 (the default, not a power of two: the paper's recipe for the odd heads) and H = 3; T not a multiple of the
# 32-wide tiles; d_h 24 and 100, not powers of two; α = 4 with the bias amplified or not
ALIBI_SHAPES = [(1, 6, 77, 24), (2, 3, 40, 100)]


@needs_triton
@pytest.mark.parametrize("scaling", ["scaled", "unscaled"])
@pytest.mark.parametrize("shape", ALIBI_SHAPES, ids=str)
def test_triton_alibi_matches_reference(shape, scaling):
    q, k, v, do = _inputs(*shape)
    slopes = _slopes(shape[1], 4.0, scaling, q.device)
    out = _run(lambda *x: op.amp_attention(*x, 4.0, backend="triton", slopes=slopes), q, k, v, do)
    _compare(_truth_alibi(q, k, v, do, 4.0, slopes), out)


@pytest.mark.parametrize("scaling", ["scaled", "unscaled"])
@pytest.mark.parametrize("shape", ALIBI_SHAPES, ids=str)
def test_torch_alibi_matches_reference(shape, scaling):
    q, k, v, do = _inputs(*shape)
    slopes = _slopes(shape[1], 4.0, scaling, q.device)
    ref = _truth_alibi(q, k, v, do, 4.0, slopes)
    _compare(ref, _run(lambda *x: op.amp_attention(*x, 4.0, backend="torch", slopes=slopes), q, k, v, do))
    _, ent, maxw = op.amp_attention_torch(q, k, v, 4.0, block=7, slopes=slopes)  # the blocked statistics' offsets
    check_close("entropy, 7-row blocks", ref[1], ent)
    check_close("max_weight, 7-row blocks", ref[2], maxw)


@needs_triton
@pytest.mark.parametrize("block", [16, 64])
def test_triton_alibi_forced_tiles(block, monkeypatch):
    """The bias at other square tiles (see test_triton_forced_tiles): t − s must come from the right rows and columns
    in every tile, the partial last one included."""
    config = op._amp_launch_config
    monkeypatch.setattr(op, "_amp_launch_config",
                        lambda q, cuda=None: dict(config(q, cuda), BLOCK_M=block, BLOCK_N=block))
    q, k, v, do = _inputs(1, 3, 77, 24)
    slopes = _slopes(3, 2.0, "scaled", q.device)
    out = _run(lambda *x: op.amp_attention(*x, 2.0, backend="triton", slopes=slopes), q, k, v, do)
    _compare(_truth_alibi(q, k, v, do, 2.0, slopes), out)


@needs_triton
def test_triton_alibi_bf16():
    """16-bit inputs with the bias: o and the gradients within the bf16 default, the statistics in fp32."""
    q, k, v, do = _inputs(1, 3, 77, 24, dtype=torch.bfloat16)
    slopes = _slopes(3, 1.0, "scaled", q.device)
    out = _run(lambda *x: op.amp_attention(*x, 1.0, backend="triton", slopes=slopes), q, k, v, do)
    assert out[0].dtype == torch.bfloat16 and out[1].dtype == torch.float32
    _compare(_truth_alibi(q, k, v, do, 1.0, slopes), out)


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_alibi_without_content_is_a_geometric_recency_window(form):
    """q = k = 0 leaves only the bias: row t weighs key s by r^(t − s) / Σ_{j<=t} r^j with r = e^(−b_h), closed
    forms written here without the op: o, the entropy and the max weight (the diagonal's, 1 / Σ r^j). The wrong sign
    would put the weight on the first keys instead."""
    B, H, T, d_h = 2, 3, 40, 16
    q, k, v, _ = _inputs(B, H, T, d_h)
    q, k = torch.zeros_like(q), torch.zeros_like(k)
    slopes = torch.tensor([2.0, 0.5, 0.05], device=q.device)
    t = torch.arange(T, dtype=torch.float64, device=q.device)
    lag = (t[:, None] - t[None, :])  # t − s
    w = torch.where(lag >= 0, torch.exp(-slopes.double()[:, None, None] * lag), 0.0)  # [H, T, T]
    p = w / w.sum(-1, keepdim=True)
    o, ent, maxw = form(q, k, v, 3.0, slopes=slopes)  # α multiplies q·kᵀ = 0: it cannot matter
    check_close("o", (p @ v.double()), o)
    check_close("entropy", torch.special.entr(p).sum(-1).expand(B, H, T), ent)
    check_close("max_weight", (1 / w.sum(-1)).expand(B, H, T), maxw)
    assert (maxw[:, 0, 1:] > 0.8).all()  # b = 2: the diagonal holds 1 − e^(−2) = 86% and more


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_zero_slopes_are_no_bias(form):
    """The bias path with every slope 0 gives the bias-free op (slopes=None): the same numbers, another code path."""
    q, k, v, _ = _inputs(1, 3, 40, 16)
    plain = form(q, k, v, 4.0)
    zero = form(q, k, v, 4.0, slopes=torch.zeros(3, device=q.device))
    for name, a, b in zip(("o", "entropy", "max_weight"), plain, zero):
        check_close(name, a, b)


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_alpha_zero_is_the_causal_mean(form):
    """α = 0 sets every logit to 0: each row is the mean of v over its visible keys (CPU SDPA with is_causal
    returns NaN at scale 0, so the torch form passes the causal mask instead)."""
    q, k, v, _ = _inputs(1, 3, 20, 16)
    o, ent, maxw = form(q, k, v, 0.0)
    n = torch.arange(1, 21, dtype=torch.float64, device=q.device)
    check_close("o", v.double().cumsum(-2) / n[:, None], o)
    check_close("entropy", n.log().expand_as(ent), ent)
    check_close("max_weight", (1 / n).expand_as(maxw), maxw)


@pytest.mark.parametrize("form", FORMS.values(), ids=FORMS.keys())
def test_slopes_and_alpha_get_no_gradient_on_any_backend(form):
    """The docstring's contract, the same on every backend: slopes are a constant (a learnable one would train on
    CPU and silently not on CUDA otherwise) and α is a number; a tensor α that wants a gradient is refused."""
    q, k, v, _ = _inputs(1, 2, 9, 16)
    slopes = torch.tensor([0.5, 0.25], device=q.device, requires_grad=True)
    q = q.clone().requires_grad_()
    o, _, _ = form(q, k, v, torch.tensor(2.0), slopes=slopes)
    o.sum().backward()
    assert slopes.grad is None and q.grad is not None
    with pytest.raises(ValueError, match="alpha is one number and gets no gradient; pass a float"):
        form(q, k, v, torch.tensor(2.0, requires_grad=True))


def test_float64_is_refused_by_the_fp32_kernels(monkeypatch):
    """backend='triton' computes in fp32: float64 is refused, not returned as double with fp32 digits; the torch
    forms keep it (auto takes them for float64 on CUDA too)."""
    q, k, v, _ = (t.double() for t in _inputs(1, 2, 9, 16))
    with pytest.raises(ValueError, match="computes in float32; float64 inputs take backend='auto' or 'torch'"):
        op.amp_attention(q, k, v, 2.0, backend="triton")
    fake_cuda_dispatch(monkeypatch, op, "_amp_attention_triton")  # where auto would take Triton
    assert op.amp_attention(q, k, v, 2.0)[0].dtype == torch.float64


def test_slopes_must_be_one_per_head():
    q, k, v, _ = _inputs(1, 3, 9, 16)
    with pytest.raises(ValueError, match=r"slopes must be one per head, \[3\], got \(6,\)"):
        op.amp_attention(q, k, v, slopes=op.alibi_slopes(6))


@pytest.mark.gpu
class TestOnCUDA:
    """The compiled kernels at the benchmark's size and the model's Triton path (python -m pytest -m gpu)."""

    def test_triton_matches_reference_at_realistic_size(self):
        """B4 H6 T2048 d_h64 in bf16 (dots on the tensor cores in bf16, p and dS rounded to bf16 as in
        FlashAttention): o within the bf16 default; dq, dk, dv within 2e-2, the rounding of p and dS at this
        length (torch's own bf16 SDPA backward is at ~1e-2 on such inputs); statistics in fp32 within 1e-4."""
        for alpha in (1.0, 16.0):
            q, k, v, do = (t.cuda() for t in _inputs(4, 6, 2048, 64, dtype=torch.bfloat16))
            out = _run(lambda *x: op.amp_attention(*x, alpha, backend="triton"), q, k, v, do)
            ref = _truth(q, k, v, do, alpha)
            grads = 2e-2 if alpha == 1.0 else 5e-2  # α = 16: the Δ rounding of BF16_CASES
            _compare(ref, out, ratio={"entropy": 1e-4, "max_weight": 1e-4, "dq": grads, "dk": grads, "dv": 2e-2})

    @pytest.mark.parametrize("mixing", ["kronecker", "identity"])
    @pytest.mark.parametrize("bf16", [False, True])
    def test_model_triton_path_matches_torch_path(self, mixing, bf16):
        """The same weights and batch through --kernels triton and --kernels torch: loss and every gradient, in fp32
        and under bf16 autocast (training's path; identity mixing hands the kernel an fp32 v, cast to q's dtype)."""
        cfg = op.Config(layers=2, d_model=384, heads=6, ctx=256, dropout=0.0, mixing=mixing)
        grads, losses = {}, {}
        for backend in ("torch", "triton"):
            torch.manual_seed(0)
            m = op.DualStream(dataclasses.replace(cfg, kernels=backend), 1000).cuda()
            x = torch.randint(0, 1000, (4, 256), generator=torch.Generator().manual_seed(1)).cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
                loss = m(x, x)
            loss.backward()
            losses[backend] = loss.detach()
            grads[backend] = {n: p.grad for n, p in m.named_parameters()}
        check_close("loss", losses["torch"], losses["triton"], ratio=1e-2 if bf16 else None)
        for n, g in grads["torch"].items():  # bf16: two roundings of p and dS apart (the kernel's and SDPA's)
            check_close(n, g, grads["triton"][n], ratio=5e-2 if bf16 else 1e-4)


@needs_triton
def test_torch_compile_graph_breaks_around_triton():
    """torch.compiler.disable on the Triton launch: dynamo traces the rest of the function, calls the kernels
    eagerly (no captured graph holds the autograd.Function) and the gradients flow."""
    q, k, v, do = _inputs(1, 2, 33, 16)
    fn = lambda q, k, v: op.amp_attention(q * 2, k, v, 4.0, backend="triton")
    eager = _run(fn, q, k, v, do)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    (o, ent, maxw), ops = compiled_ops(fn, *leaves)
    grads = torch.autograd.grad(o, leaves, do)
    for name, want, got in zip(("o", "entropy", "max_weight", "dq", "dk", "dv"), eager, (o, ent, maxw, *grads)):
        assert torch.equal(want, got), name
    assert ops == ["mul"], ops  # the q * 2 alone
