"""prism.py's core op, proto_topk: the float64 reference (normalise, GEMM, ReLU, stable sort) is the ground truth;
the chunked torch selection and the Triton kernel (under Triton's interpreter without a GPU, see conftest.py) must
pick the same prototypes in the same order, with the same activations and the same gradients into z and P, driven
by a random cotangent. Kernel outputs are NaN-poisoned (GLASSBOX_POISON=1).

Index comparison (check_winners): fp32 scores differ from the float64 truth by ~1e-7, so two prototypes whose true
cosines differ by less than that can swap. A position may differ from the reference only if the true score of the
prototype picked there differs from the reference's score at that position by at most TIE_TOL = 1e-6, and not by
0: exact ties (duplicated prototypes, the ReLU's zeros) must be broken by the lower index, exactly."""
import functools
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

import prism as op
from conftest import RATIO, check_close, compiled_ops

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TIE_TOL = 1e-6


def true_scores(z, P, precision="fp32"):
    """The float64 scores relu(ẑ · P̂ᵀ) [N, K] of the (possibly bf16-rounded) inputs, and the leaves z, P. With
    precision="bf16", of the unit vectors rounded to bf16 as the op rounds them (normalised in fp32 first), the
    rounding passing the gradient straight through: exact products, accumulated in float64."""
    z64 = z.detach().double().requires_grad_()
    P64 = P.detach().double().requires_grad_()

    def operand(t64, t):
        unit = F.normalize(t64, dim=-1)
        if precision == "bf16":
            rounded = F.normalize(t.detach().float(), dim=-1).to(torch.bfloat16).double()
            unit = unit + (rounded - unit.detach())
        return unit
    return (operand(z64, z) @ operand(P64, P).T).relu(), z64, P64


def check_winners(name, scores, idx, max_mismatch_frac=1e-3):
    """idx [N, k] against the order (score desc, index asc) of the float64 scores [N, K]: equal, except at near-ties
    (0 < |Δ true score| <= TIE_TOL). Returns the number of such positions."""
    k = idx.shape[1]
    assert idx.dtype == torch.long, f"{name}: idx dtype {idx.dtype}"
    assert ((idx >= 0) & (idx < scores.shape[1])).all(), f"{name}: index out of range"
    assert (idx.sort(1).values.diff(dim=1) > 0).all(), f"{name}: a prototype listed twice in one row"
    ref_sorted, ref_idx = torch.sort(scores, dim=1, descending=True, stable=True)
    ref_idx, ref_sorted = ref_idx[:, :k], ref_sorted[:, :k]
    idx = idx.to(ref_idx.device)
    differ = idx != ref_idx
    gap = (scores.gather(1, idx) - ref_sorted).abs()
    bad = differ & ((gap == 0) | (gap > TIE_TOL))
    assert not bad.any(), (f"{name}: {int(bad.sum())} winners differ from the reference, first at (row, slot) "
                           f"{bad.nonzero()[0].tolist()}: got {idx[bad][:5].tolist()}, "
                           f"want {ref_idx[bad][:5].tolist()}")
    assert differ.sum() <= max_mismatch_frac * idx.numel() + 2, f"{name}: {int(differ.sum())} near-tie swaps"
    return int(differ.sum())


def make_inputs(N, K, d, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    z = torch.randn(N, d).to(DEVICE, dtype)
    P = torch.randn(K, d, device=DEVICE)
    return z, P


def run(form, z, P, k, ga, precision="fp32"):
    """(idx, a, ∂z, ∂P) of (a · ga).sum() for one form."""
    z = z.detach().clone().requires_grad_()
    P = P.detach().clone().requires_grad_()
    idx, a = FORMS[form](z, P, k, precision=precision)
    (a * ga).sum().backward()
    return idx, a, z.grad, P.grad


def check_form(form, z, P, k, seed=1, precision="fp32"):
    """Winners against the float64 order; a and the gradients against the float64 truth at the form's own winners
    (identical to the reference's winners except at near-ties)."""
    torch.manual_seed(seed)
    ga = torch.randn(z.shape[0], k, device=DEVICE)
    idx, a, gz, gP = run(form, z, P, k, ga, precision)
    scores, z64, P64 = true_scores(z, P, precision)
    check_winners(form, scores.detach(), idx)
    a_true = scores.gather(1, idx)
    (a_true * ga.double()).sum().backward()
    assert a.dtype == torch.float32 and gz.dtype == z.dtype and gP.dtype == P.dtype
    check_close(f"{form} a", a_true, a)
    check_close(f"{form} dz", z64.grad, gz)
    check_close(f"{form} dP", P64.grad, gP)
    return idx, a


def torch_small_chunks(z, P, k, **kw):
    """The torch form with row chunks of 7 rows, so the chunk loop and its last partial chunk run."""
    with mock.patch.object(op, "_TOPK_CHUNK_ELEMS", 7 * P.shape[0]):
        return op.proto_topk(z, P, k, backend="torch", **kw)


def triton_small_blocks(z, P, k, **kw):
    """The kernel with 16-token, 16-prototype tiles and 32-column width chunks (the streamed-width path at any d)."""
    small = functools.partial(op._proto_topk_select_triton, BLOCK_N=16, BLOCK_K=16, BLOCK_D=32)
    with mock.patch.object(op, "_proto_topk_select_triton", small):
        return op.proto_topk(z, P, k, backend="triton", **kw)


FORMS = {  # each takes precision=; the proto_topk forms take pairs= too (the reference does not)
    "ref": op.proto_topk_ref,
    "torch": lambda z, P, k, **kw: op.proto_topk(z, P, k, backend="torch", **kw),
    "triton": lambda z, P, k, **kw: op.proto_topk(z, P, k, backend="triton", **kw),
    "torch-chunk7": torch_small_chunks,
    "triton-small": triton_small_blocks,
}

# (N, K, k, d): one row and one prototype; k = 1 and k = K; K not a power of two, with a last prototype tile holding
# one prototype; widths 16 and 40 (loaded whole, 40 padded) and 100, 200, 384, 768 (streamed in 64-column chunks,
# 100 and 200 with a padded last chunk)
SHAPES = [(1, 1, 1, 16), (37, 5, 1, 100), (37, 5, 5, 40), (37, 100, 8, 16), (200, 257, 32, 100),
          (37, 257, 8, 384), (200, 100, 32, 200), (5, 40, 8, 768)]


@pytest.mark.parametrize("form", ["ref", "torch", "triton"])
@pytest.mark.parametrize("N,K,k,d", [pytest.param(*s, id="N{}-K{}-k{}-d{}".format(*s)) for s in SHAPES])
def test_forms_agree(N, K, k, d, form):
    z, P = make_inputs(N, K, d)
    check_form(form, z, P, k)


@pytest.mark.parametrize("form", ["torch-chunk7", "triton-small"])
@pytest.mark.parametrize("N,K,k,d", [(37, 100, 8, 100), (20, 257, 32, 40)],
                         ids=["N37-K100-k8-d100", "N20-K257-k32-d40"])
def test_chunked_paths(N, K, k, d, form):
    """Several row chunks (torch); several token blocks, prototype tiles and masked width chunks (Triton)."""
    z, P = make_inputs(N, K, d)
    check_form(form, z, P, k)


BF16_SHAPES = [(1, 1, 1, 16), (37, 5, 5, 40), (200, 257, 32, 100), (37, 257, 8, 384), (5, 40, 8, 768)]


@pytest.mark.parametrize("form", ["ref", "torch", "triton", "torch-chunk7", "triton-small"])
@pytest.mark.parametrize("N,K,k,d", [pytest.param(*s, id="N{}-K{}-k{}-d{}".format(*s)) for s in BF16_SHAPES])
def test_bf16_dots_agree(N, K, k, d, form):
    """precision="bf16" (--dot-precision bf16): the winners, a and both gradients of every form are those of the
    bf16-rounded unit vectors' exact cosines (straight-through gradients), and a is not the fp32 cosine, so a form
    that skipped the rounding would fail."""
    if form == "triton-small" and N * K > 10000:
        pytest.skip("16×16 tiles over 200×257 take ~8 s in the interpreter; the other shapes cover the path")
    z, P = make_inputs(N, K, d)
    idx, a = check_form(form, z, P, k, precision="bf16")
    fp32 = true_scores(z, P)[0].detach().gather(1, idx)
    assert (a.double() - fp32).abs().max() > 1e-5 or N * d < 100, "a equals the fp32 cosines: no rounding"


def test_bf16_dots_reach_the_kernel_as_bf16_on_cuda_only():
    """The kernel's tl.dot operand type: bf16 for bf16 inputs on CUDA (the tensor cores); fp32 in Triton's
    interpreter, whose bf16 tl.dot multiplies bit patterns, and for fp32 inputs."""
    import triton.language as tl
    bf, f32 = torch.zeros(2, 16, dtype=torch.bfloat16), torch.zeros(2, 16)
    assert op._proto_topk_dot_t(bf, cuda=True) == tl.bfloat16
    assert op._proto_topk_dot_t(bf, cuda=False) == op._proto_topk_dot_t(f32, cuda=True) == tl.float32
    assert op._proto_topk_dot_t(bf) == (tl.bfloat16 if bf.is_cuda else tl.float32)


def test_bf16_operands_reach_the_kernel(monkeypatch):
    """Through the public proto_topk (with and without the pairs): precision="bf16" launches the kernel on bf16 z̄
    and P̄ with bf16 dots, as on CUDA (each launch is recorded with the CUDA choice of DOT_T, then run with the
    interpreter's fp32 operands); precision="fp32" launches fp32 operands and fp32 dots."""
    import triton.language as tl
    launches, kernel, dot_t = [], op._proto_topk_fwd, op._proto_topk_dot_t

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                launches.append((args[0].dtype, args[1].dtype, kw["DOT_T"]))
                return kernel[grid](*args, **{**kw, "DOT_T": dot_t(args[0])})
            return launch
    monkeypatch.setattr(op, "_proto_topk_fwd", Spy())
    monkeypatch.setattr(op, "_proto_topk_dot_t", lambda zn: dot_t(zn, cuda=True))
    z, P = make_inputs(37, 100, 64)
    for precision in ("fp32", "bf16"):
        for pairs in (None, "l2", "cosine"):
            op.proto_topk(z, P, 8, backend="triton", precision=precision, pairs=pairs)
    f32, bf16 = (torch.float32, torch.float32, tl.float32), (torch.bfloat16, torch.bfloat16, tl.bfloat16)
    assert launches == [f32] * 3 + [bf16] * 3


def test_a_bad_precision_is_refused():
    z, P = make_inputs(3, 5, 16)
    for form in ("ref", "torch"):
        with pytest.raises(ValueError, match="precision must be one of"):
            FORMS[form](z, P, 2, precision="fp16")


def tie_inputs():
    """Prototypes with exact copies (some across the 64-prototype tile boundary, some earlier than the original)
    and copies scaled by powers of two (the same normalised row, bit for bit, in fp32 and fp64; other scales can
    round differently and are not ties in fp32). Tokens: 4 along P_3, 4 along P_10, 1 zero row (all scores 0),
    and 40 with mostly negative cosines (many rows with fewer than k positive scores)."""
    torch.manual_seed(3)
    d, K = 16, 150
    common = torch.ones(d) / d ** 0.5
    P = 0.5 * torch.randn(K, d) + 3 * common  # a shared direction: tokens opposite it see mostly negative cosines
    P[140] = P[3]
    P[77] = 2 * P[3]
    P[100] = 0.5 * P[10]
    P[5] = 4 * P[10]
    P[64] = P[63]
    z = torch.cat([P[3] + 0.01 * torch.randn(4, d), P[10] + 0.01 * torch.randn(4, d), torch.zeros(1, d),
                   -3 * common + 2 * torch.randn(40, d)])
    return z.to(DEVICE), P.to(DEVICE)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("form", ["ref", "torch", "triton", "torch-chunk7", "triton-small"])
def test_ties_go_to_the_lower_index(form, precision):
    z, P = tie_inputs()
    k = 8
    Pn = F.normalize(P, dim=-1)
    assert torch.equal(Pn[77], Pn[3]) and torch.equal(Pn[140], Pn[3]) and torch.equal(Pn[5], Pn[10])
    scores = true_scores(z, P, precision)[0].detach()
    positives = (scores[9:] > 0).sum(1)
    assert (positives < k).sum() >= 10 and (positives == 0).any(), "too few rows with zero-activation winners"

    idx, a = check_form(form, z, P, k, precision=precision)
    assert (idx[:4, :3] == torch.tensor([3, 77, 140], device=idx.device)).all(), idx[:4, :3]
    assert (idx[4:8, :3] == torch.tensor([5, 10, 100], device=idx.device)).all(), idx[4:8, :3]
    assert torch.equal(idx[8], torch.arange(k, device=idx.device)), "a zero token's winners: prototypes 0..k-1"
    assert torch.equal(a[8], torch.zeros(k, device=a.device))
    for n in range(9, z.shape[0]):  # the zero-activation slots hold the lowest-index zero-score prototypes
        zero_slots = idx[n][a[n] == 0]
        lowest_zeros = (scores[n] == 0).nonzero()[:, 0][: len(zero_slots)]
        assert torch.equal(zero_slots.cpu(), lowest_zeros.cpu()), f"row {n}: {zero_slots} != {lowest_zeros}"
    assert (a[:, 0] >= a[:, -1]).all() and (a.diff(dim=1) <= 0).all(), "winners not sorted by score"


@pytest.mark.parametrize("form", ["torch", "triton"])
def test_bf16_tokens_and_autocast(form):
    """bf16 z: the scores are fp32 inside (a is fp32), ∂z comes back in bf16; inside a bf16 autocast region the
    selection still runs in fp32 and gives the same result as outside it."""
    z, P = make_inputs(37, 100, 64, dtype=torch.bfloat16)
    torch.manual_seed(1)
    ga = torch.randn(37, 8, device=DEVICE)
    idx, a, gz, gP = run(form, z, P, 8, ga)
    scores, z64, P64 = true_scores(z, P)
    check_winners(form, scores.detach(), idx)
    (scores.gather(1, idx) * ga.double()).sum().backward()
    assert a.dtype == torch.float32 and gz.dtype == torch.bfloat16 and gP.dtype == torch.float32
    check_close(f"{form} a", scores.gather(1, idx), a)
    check_close(f"{form} dz", z64.grad, gz)
    check_close(f"{form} dP", P64.grad, gP)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        idx_ac, a_ac = FORMS[form](z, P, 8)
    assert a_ac.dtype == torch.float32 and torch.equal(idx_ac, idx) and torch.equal(a_ac, a.detach())


@pytest.mark.parametrize("form", ["torch", "triton"])
def test_no_saved_tensor_of_size_N_K_or_N_k_d(form):
    """What autograd keeps: nothing of N·K (the score matrix) or N·k·d (the gathered winners) elements; the
    reference, which keeps its [N, K] scores, shows the hook sees them."""
    N, K, k, d = 37, 100, 8, 16
    z, P = make_inputs(N, K, d)
    banned = {N * K, N * k * d}
    assert not banned & {N * d, K * d, N * k, N, K}, "sizes must be distinguishable"

    def saved_sizes(fn):
        sizes = []
        zl, Pl = z.clone().requires_grad_(), P.clone().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(lambda x: sizes.append(x.numel()) or x, lambda x: x):
            idx, a = fn(zl, Pl, k)
            op.reconstruct(idx, a, Pl)
            op.proto_logit_slices(idx, a, Pl, torch.randn(50, d, device=DEVICE, requires_grad=True),
                                  torch.randint(0, 50, (N,), device=DEVICE))
        return set(sizes)

    assert N * K in saved_sizes(FORMS["ref"])
    sizes = saved_sizes(FORMS[form])
    assert sizes and not banned & sizes, f"{form}: saved tensors of sizes {sorted(banned & sizes)}"


def test_reconstruct_and_logit_slices():
    """Against einsum on gathered rows (which do build [N, k, d]), values and gradients into a, P and W."""
    N, K, k, d, V = 37, 100, 8, 24, 50
    torch.manual_seed(0)
    z, P = make_inputs(N, K, d)
    idx = op.proto_topk(z, P, k)[0]
    a = torch.rand(N, k, device=DEVICE)
    W = torch.randn(V, d, device=DEVICE)
    y = torch.randint(0, V, (N,), device=DEVICE)
    g_rec, g_slices = torch.randn(N, d, device=DEVICE), torch.randn(N, k, device=DEVICE)

    def both(fn_rec, fn_slices, dtype):
        leaves = [x.detach().to(dtype).requires_grad_() for x in (a, P, W)]
        a_, P_, W_ = leaves
        rec, slices = fn_rec(idx, a_, P_), fn_slices(idx, a_, P_, W_, y)
        ((rec * g_rec.to(dtype)).sum() + (slices * g_slices.to(dtype)).sum()).backward()
        return [rec, slices] + [x.grad for x in leaves]

    def rec_ref(idx, a, P):
        return torch.einsum("nk,nkd->nd", a, P[idx])

    def slices_ref(idx, a, P, W, y):
        return a * torch.einsum("nd,nkd->nk", W[y], P[idx])

    ref = both(rec_ref, slices_ref, torch.float64)
    out = both(op.reconstruct, op.proto_logit_slices, torch.float32)
    for name, r, o in zip(("zhat", "slices", "da", "dP", "dW"), ref, out):
        check_close(name, r, o)
    check_close("Σ_j slices = <W_y, zhat>", (W[y] * out[0]).sum(-1), out[1].sum(-1))


@pytest.mark.parametrize("form", ["_scatter_rows", "_scatter_rows_atomic", "_scatter_rows_bags"])
@pytest.mark.parametrize("N,K,k,d", [(1, 1, 1, 3), (1, 9, 4, 5), (37, 100, 8, 24), (64, 7, 7, 16)])
def test_scatter_rows_against_a_dense_sum(N, K, k, d, form):
    """∂P's scatter, out_i = Σ_{(n,j): idx_{n,j} = i} w_{n,j} X_n, in both forms (CUDA's index_add_ calls, the
    CPU's embedding_bag) and as dispatched, against a dense one-hot product in float64: prototypes nobody picked
    (empty bags) get zeros, the last prototype's bag ends at N·k, and every prototype is picked at K = k."""
    scatter = getattr(op, form)
    torch.manual_seed(N + K)
    idx = torch.stack([torch.randperm(K)[:k] for _ in range(N)]).to(DEVICE)
    w, X = torch.randn(N, k, device=DEVICE), torch.randn(N, d, device=DEVICE)
    onehot = F.one_hot(idx, K).double()  # [N, k, K]
    want = torch.einsum("nk,nki,nd->id", w.double(), onehot, X.double())
    got = scatter(idx, w, X, K)
    assert got.shape == (K, d) and got.dtype == X.dtype
    check_close(form, want, got)
    if form != "_scatter_rows_atomic" or DEVICE == "cpu":  # CUDA's index_add_ adds in the atomics' order
        assert torch.equal(got, scatter(idx, w, X, K)), "not deterministic"
    if form == "_scatter_rows" and DEVICE == "cpu":  # the CPU takes the bags
        assert torch.equal(got, op._scatter_rows_bags(idx, w, X, K))
    unpicked = onehot.sum((0, 1)) == 0
    assert (got[unpicked] == 0).all()


def test_dispatch(monkeypatch):
    z, P = make_inputs(5, 10, 16)
    with pytest.raises(ValueError, match="backend"):
        op.proto_topk(z, P, 2, backend="cuda")
    with pytest.raises(ValueError, match="expected"):
        op.proto_topk(z, P[:, :-1], 2)
    with pytest.raises(ValueError, match="expected"):
        op.proto_topk(z[0], P, 2)
    for k in (0, 11):
        with pytest.raises(ValueError, match="1 <= k <= K"):
            op.proto_topk(z, P, k)
    calls = []
    for name in ("_proto_topk_select_torch", "_proto_topk_select_triton"):
        fn = getattr(op, name)
        monkeypatch.setattr(op, name, lambda *a, fn=fn, name=name, **kw: calls.append(name) or fn(*a, **kw))
    op.proto_topk(z, P, 2, backend="triton")
    op.proto_topk(z, P, 2, backend="torch")
    op.proto_topk(z, P, 2)
    auto = "_proto_topk_select_triton" if DEVICE == "cuda" else "_proto_topk_select_torch"
    assert calls == ["_proto_topk_select_triton", "_proto_topk_select_torch", auto]
    # a k above the kernel's running list: auto takes the torch form (on CUDA too), triton refuses
    zk, Pk = make_inputs(5, 40, 16)
    calls.clear()
    op.proto_topk(zk, Pk, op.PROTO_TOPK_MAX_K + 1)
    assert calls == ["_proto_topk_select_torch"]
    with pytest.raises(ValueError, match=f"k <= {op.PROTO_TOPK_MAX_K}"):
        op.proto_topk(zk, Pk, op.PROTO_TOPK_MAX_K + 1, backend="triton")
    _, a = op.proto_topk(z.requires_grad_(), P, 2)
    assert type(a.grad_fn).__name__ == "WinnerCosineBackward"
    if DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            op.proto_topk(z, P, 2, backend="triton")


def test_nan_poisoning_catches_a_skipped_block():
    """Kernel outputs start as NaN / -1 in tests: launching all token blocks but the last leaves them there."""
    assert op._proto_topk_empty((3,), torch.float32, DEVICE).isnan().all()
    assert (op._proto_topk_empty((3,), torch.long, DEVICE) == -1).all()
    z, P = make_inputs(40, 30, 16)
    zn, Pn = F.normalize(z, dim=-1), F.normalize(P, dim=-1)
    k = 4
    KP, BLOCK_D, ONE_D = op._proto_topk_blocks(16, k)
    idx = op._proto_topk_empty((40, k), torch.long, DEVICE)
    a = op._proto_topk_empty((40, k), torch.float32, DEVICE)
    op._proto_topk_fwd[(2,)](zn, Pn, idx, a, 40, 30, 16, k, BLOCK_N=16, BLOCK_K=16, BLOCK_D=BLOCK_D, KP=KP,
                             ONE_D=ONE_D, DOT_PREC=op.PROTO_TOPK_DOT_PRECISION, DOT_T=op._proto_topk_dot_t(zn))
    assert not a[:32].isnan().any() and a[32:].isnan().all() and (idx[32:] == -1).all()
    assert torch.equal(idx[:32], op.proto_topk_ref(z, P, k)[0][:32])


@pytest.mark.parametrize("form", ["torch", "triton"])
def test_torch_compile_graph_breaks_around_the_selection(form):
    """Inside torch.compile the selection runs eagerly (no captured graph holds its scoring GEMM or its top-k) and
    the gradients still flow. The graph breaks are the decorator's: without it dynamo would break inside the
    torch selection's chunk loop, at its data-dependent nonzero (read from dynamo's graph-break counters)."""
    from torch._dynamo.utils import counters

    z, P = make_inputs(5, 10, 16)
    fn = functools.partial(op.proto_topk, k=3, backend=form)
    zc = z.clone().requires_grad_()
    counters.clear()
    (idx_c, a_c), ops = compiled_ops(fn, zc, P)
    breaks = list(counters["graph_break"])
    a_c.sum().backward()
    zl = z.clone().requires_grad_()
    idx, a = fn(zl, P)
    a.sum().backward()
    assert torch.equal(idx_c, idx) and torch.equal(a_c, a) and torch.equal(zc.grad, zl.grad)
    assert ops and not {"matmul", "topk", "_set_cublas_allow_tf32"} & set(ops), ops
    assert breaks and all("torch.compiler.disable" in b for b in breaks), breaks


class RecordTF32(torch.overrides.TorchFunctionMode):
    """Records the TF32 flag in force at every matmul that runs inside it."""

    MATMULS = (torch.matmul, torch.mm, torch.Tensor.__matmul__, torch.Tensor.matmul, torch.Tensor.mm)

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.MATMULS:
            self.seen.append(torch.backends.cuda.matmul.allow_tf32)
        return func(*args, **(kwargs or {}))


# ----------------------------------------------------------------------------------------------------------
# R1/R2's nearest pairs read off the selection's cosines (proto_topk(..., pairs=dist)) against nearest_pairs and a
# float64 truth

PAIR_FORMS = ("torch", "triton", "torch-chunk7", "triton-small")


def with_pairs(form, z, P, k, dist):
    """proto_topk(z, P, k, pairs=dist) in one of the forms: (idx, a, (proto_of_token, token_of_proto)), or
    (idx, a) for dist None."""
    return FORMS[form](z, P, k, pairs=dist)


def true_distances(z, P, dist):
    """[N, K] float64 distances in nearest_pairs' sense: squared L2, or 1 - cos."""
    z64, P64 = z.detach().double(), P.detach().double()
    if dist == "cosine":
        return 1 - F.normalize(z64, dim=-1) @ F.normalize(P64, dim=-1).T
    return (z64.pow(2).sum(-1, keepdim=True) + P64.pow(2).sum(-1) - 2 * z64 @ P64.T).clamp_min(0)


def check_pairs(name, z, P, dist, got):
    """Each token's and each prototype's neighbour is a nearest one in float64 up to fp32 rounding (tolerance
    1e-5 of the largest distance), and equals nearest_pairs' except at such near-ties."""
    pt, tp = got
    N, K = z.shape[0], P.shape[0]
    assert pt.dtype == tp.dtype == torch.long and pt.shape == (N,) and tp.shape == (K,), name
    assert ((pt >= 0) & (pt < K)).all() and ((tp >= 0) & (tp < N)).all(), f"{name}: index out of range"
    D = true_distances(z, P, dist).cpu()
    pt, tp = pt.cpu(), tp.cpu()
    tol = 1e-5 * D.abs().max().clamp_min(1e-3)
    gap_t = D.gather(1, pt[:, None])[:, 0] - D.min(1).values
    gap_p = D.gather(0, tp[None, :])[0] - D.min(0).values
    assert (gap_t <= tol).all(), f"{name}: token {int(gap_t.argmax())} got a prototype {float(gap_t.max()):.3g} farther"
    assert (gap_p <= tol).all(), f"{name}: prototype {int(gap_p.argmax())} got a token {float(gap_p.max()):.3g} farther"
    want_t, want_p = (w.cpu() for w in op.nearest_pairs(z, P, dist))
    swaps = int((pt != want_t).sum() + (tp != want_p).sum())
    assert swaps <= 1e-3 * (N + K) + 2, f"{name}: {swaps} neighbours differ from nearest_pairs'"


# (N, K, d): one token and one prototype; N across several token blocks and torch chunks; K across prototype tiles
# with a last tile of one; d loaded whole (16, 40) and streamed in chunks (100, 200)
PAIR_SHAPES = [(1, 1, 16), (37, 5, 100), (200, 257, 40), (70, 100, 200)]


@pytest.mark.parametrize("dist", ["l2", "cosine"])
@pytest.mark.parametrize("form", PAIR_FORMS)
@pytest.mark.parametrize("N,K,d", PAIR_SHAPES, ids=["N{}-K{}-d{}".format(*s) for s in PAIR_SHAPES])
def test_pairs_from_the_selection_match_nearest_pairs(N, K, d, form, dist):
    """Asking for the pairs changes nothing else: the winners, activations and gradients are those without."""
    z, P = make_inputs(N, K, d)
    z = z * torch.rand(N, 1, device=DEVICE) * 3  # norms that vary, so squared L2 and cosine pick differently
    k = min(K, 4)
    zl, Pl = z.clone().requires_grad_(), P.clone().requires_grad_()
    idx, a, near = with_pairs(form, zl, Pl, k, dist)
    check_pairs(f"{form} {dist}", z, P, dist, near)
    a.sum().backward()
    zb, Pb = z.clone().requires_grad_(), P.clone().requires_grad_()
    idx_b, a_b = with_pairs(form, zb, Pb, k, None)
    a_b.sum().backward()
    assert torch.equal(idx, idx_b) and torch.equal(a, a_b)
    assert torch.equal(zl.grad, zb.grad) and torch.equal(Pl.grad, Pb.grad)


@pytest.mark.parametrize("dist", ["l2", "cosine"])
@pytest.mark.parametrize("form", PAIR_FORMS)
def test_pairs_break_ties_by_the_lower_index(form, dist):
    """Exact copies of prototypes (P_140 = P_3, P_64 = P_63 across a tile boundary) and of tokens (row 70 = row 2,
    another token block and another torch chunk; row 3 = P_20, so prototype 20 is at distance 0 from both): the
    lower index wins, as in nearest_pairs."""
    z, P = tie_inputs()
    z = torch.cat([z, z[:30]])  # 79 rows: rows 49..78 copy rows 0..29
    z[70] = z[2]
    z[3] = z[52] = P[20]
    pt, tp = with_pairs(form, z, P, 8, dist)[2]
    check_pairs(f"{form} {dist}", z, P, dist, (pt, tp))
    assert int(tp[20]) == 3, "prototype 20's nearest tokens are rows 3 and 52 (distance 0): the lower wins"
    assert pt[0] == 3 and pt[49] == 3, "tokens near P_3 (copied as P_140): the lower index wins"
    if dist == "cosine":  # P_5 = 4 P_10 and P_100 = P_10 / 2 have P_10's cosines: the lowest of the three
        assert (pt[4:8] == 5).all(), pt[4:8]
    want_t, want_p = op.nearest_pairs(z, P, dist)
    assert torch.equal(pt.cpu(), want_t.cpu()) and torch.equal(tp.cpu(), want_p.cpu())


@pytest.mark.parametrize("form", ["torch", "triton"])
def test_pairs_stay_in_range_on_non_finite_tokens(form):
    """A diverged run (NaN or inf in z): the pairs are still valid indices (the losses, not a device-side index
    error, report the NaN)."""
    z, P = make_inputs(40, 30, 16)
    z[3] = float("nan")
    z[17, 2] = float("inf")
    for dist in ("l2", "cosine"):
        pt, tp = with_pairs(form, z, P, 4, dist)[2]
        assert ((pt >= 0) & (pt < 30)).all() and ((tp >= 0) & (tp < 40)).all(), (dist, pt, tp)


def test_pairs_refuse_a_bad_dist_and_no_tokens():
    z, P = make_inputs(5, 10, 16)
    with pytest.raises(ValueError, match="dist must be 'l2' or 'cosine', got 'cos'"):
        op.proto_topk(z, P, 2, pairs="cos")
    with pytest.raises(ValueError, match="no tokens"):
        op.proto_topk(z[:0], P, 2, pairs="l2")


def test_scoring_gemms_run_in_ieee_fp32_with_tf32_on():
    """setup_device turns TF32 on for training on CUDA; the torch forms' scoring GEMMs and nearest_pairs claim fp32
    (spec §7) and must turn it off around their matmuls (the Triton kernel's tl.dot is 3xTF32, near fp32), then
    restore it. The flag is only recorded here (on CPU it changes nothing), so this runs anywhere. The flags are set
    and restored by hand: torch.backends.cuda.matmul takes them through __setattr__ and has no __delattr__, which
    the monkeypatch of pytest >= 9.2 calls on undo for an attribute that is not in the instance's __dict__."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    try:
        z, P = make_inputs(20, 12, 16)
        for name, fn in (("ref", lambda: op.proto_topk_ref(z, P, 3)),
                         ("torch", lambda: op.proto_topk(z, P, 3, backend="torch")),
                         ("nearest_pairs", lambda: op.nearest_pairs(z, P, "l2")),
                         ("nearest_pairs cosine", lambda: op.nearest_pairs(z, P, "cosine"))):
            with RecordTF32() as rec:
                fn()
            assert rec.seen and not any(rec.seen), (name, rec.seen)
            assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32  # restored
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_imports_and_runs_without_triton():
    """With `import triton` failing, prism.py still imports, the torch form runs and 'triton' says why it cannot."""
    script = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch, prism as op\n"
        "z = torch.randn(6, 16); P = torch.randn(9, 16)\n"
        "assert not op.HAS_TRITON and op.proto_topk(z, P, 3)[0].shape == (6, 3)\n"
        "try:\n"
        "    op.proto_topk(z, P, 3, backend='triton')\n"
        "except RuntimeError as err:\n"
        "    assert 'needs the triton package' in str(err)\n"
        "else:\n"
        "    raise AssertionError('no RuntimeError')\n"
    )
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.gpu
class TestOnCUDA:
    """The compiled kernel at a realistic size (python -m pytest -m gpu on a CUDA machine)."""

    def test_triton_matches_reference_at_realistic_size(self):
        """N = K = 16384, d = 768, k = 16, bf16 z. Winners against the float64 order of the same (bf16-rounded)
        inputs, exact except at near-ties (|Δ true cosine| <= 1e-6, see check_winners); a and ∂z, ∂P against the
        float64 truth at the kernel's winners; the torch form must agree with the kernel."""
        torch.manual_seed(0)
        N, K, d, k = 16384, 16384, 768, 16
        z = torch.randn(N, d, device="cuda").bfloat16()
        P = torch.randn(K, d, device="cuda")
        ga = torch.randn(N, k, device="cuda")
        idx, a, gz, gP = run("triton", z, P, k, ga)
        scores, z64, P64 = true_scores(z, P)
        swaps = check_winners("cuda triton", scores.detach(), idx)
        print(f"near-tie swaps: {swaps} of {idx.numel()}")
        a_true = scores.gather(1, idx)
        (a_true * ga.double()).sum().backward()
        check_close("cuda a", a_true, a)
        check_close("cuda dz", z64.grad, gz, RATIO[torch.bfloat16], atol=1e-6)  # |dz| ~5e-3: bf16's atol would pass 20 % errors
        check_close("cuda dP", P64.grad, gP, RATIO[torch.float32] * 10)
        del scores, z64, P64, a_true
        idx_t, _ = op.proto_topk(z, P, k, backend="torch")
        assert (idx_t != idx).float().mean() < 1e-3

    def test_bf16_dots_at_realistic_size(self):
        """--dot-precision bf16 at the paper's training shape (16 × 1024 tokens, K = 8192, d = 768, bf16 z): the
        kernel's bf16 tensor-core dots give the winners of the bf16-rounded unit vectors' float64 cosines (up to
        near-ties), a and both gradients as the float64 straight-through truth, and the torch form agrees."""
        torch.manual_seed(0)
        N, K, d, k = 16384, 8192, 768, 16
        z = torch.randn(N, d, device="cuda").bfloat16()
        P = torch.randn(K, d, device="cuda")
        ga = torch.randn(N, k, device="cuda")
        idx, a, gz, gP = run("triton", z, P, k, ga, "bf16")
        scores, z64, P64 = true_scores(z, P, "bf16")
        swaps = check_winners("cuda triton bf16", scores.detach(), idx)
        print(f"near-tie swaps: {swaps} of {idx.numel()}")
        a_true = scores.gather(1, idx)
        (a_true * ga.double()).sum().backward()
        check_close("cuda bf16 a", a_true, a)
        check_close("cuda bf16 dz", z64.grad, gz, RATIO[torch.bfloat16], atol=1e-6)
        check_close("cuda bf16 dP", P64.grad, gP, RATIO[torch.float32] * 10)
        del scores, z64, P64, a_true
        idx_t, _ = op.proto_topk(z, P, k, backend="torch", precision="bf16")
        assert (idx_t != idx).float().mean() < 1e-3

    @pytest.mark.parametrize("dist", ["l2", "cosine"])
    def test_pairs_at_realistic_size(self, dist):
        """R1/R2's pairs from the kernel at the paper's training shape (16 × 1024 tokens, K = 8192, d = 768, bf16
        z): nearest in float64 up to rounding and nearly all equal to nearest_pairs' (check_pairs), and the same
        winners as without the pairs."""
        torch.manual_seed(0)
        N, K, d, k = 16384, 8192, 768, 16
        z = (torch.randn(N, d, device="cuda") * torch.rand(N, 1, device="cuda") * 3).bfloat16()
        P = torch.randn(K, d, device="cuda")
        idx, _, near = op.proto_topk(z, P, k, backend="triton", pairs=dist)
        check_pairs(f"cuda {dist}", z, P, dist, near)
        assert torch.equal(idx, op.proto_topk(z, P, k, backend="triton")[0])
