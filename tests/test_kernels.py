"""kernels.py: each op's Triton path (Triton's interpreter on CPU, the GPU under `-m gpu`) against a float64
reference, output and every gradient, on awkward shapes; then dispatch, NaN poisoning, the modules, importing
without triton and the --bench entry point.

Triton's interpreter casts fp32 -> bf16 by truncation (a GPU rounds to nearest even), so bf16 errors here are
up to twice what a GPU gives; conftest's bf16 threshold allows for that."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import compiled_ops, fake_cuda_dispatch
import kernels
from kernels import (BACKENDS, LayerNorm, RMSNorm, cross_entropy, cross_entropy_ref, layer_norm, layer_norm_ref,
                     rms_norm, rms_norm_ref)

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
LEADS = [pytest.param((1,), id="1row"), pytest.param((13,), id="13rows"), pytest.param((2, 3), id="2x3rows")]
EPS = 1e-2  # norm eps in the comparisons: large enough that a kernel ignoring it fails in fp32


def fwd_bwd(fn, inputs, dy):
    """y = fn(*leaves) on fresh leaf copies of `inputs` (None stays None), then (y * dy).sum().backward().
    Returns y and the gradients of the non-None inputs."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in inputs]
    y = fn(*leaves)
    (y * dy).sum().backward()
    return y, [t.grad for t in leaves if t is not None]


def check_norm(assert_close, fn, ref, inputs, names):
    """fn (the Triton path) vs ref on float64 copies of the same inputs: y and the gradients named in `names`."""
    x = inputs[0]
    dy = torch.randn_like(x)
    y, grads = fwd_bwd(fn, inputs, dy)
    y_ref, grads_ref = fwd_bwd(ref, [None if t is None else t.double() for t in inputs], dy.double())
    assert y.dtype == x.dtype and [g.dtype for g in grads] == [t.dtype for t in inputs if t is not None]
    for name, r, o in zip(["y", *names], [y_ref, *grads_ref], [y, *grads]):
        assert_close(name, r, o)


# ----------------------------------------------------------------------------------------------------------
# RMSNorm and LayerNorm against their references

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [1, 7, 100, 384, 1000], ids=lambda D: f"D{D}")
@pytest.mark.parametrize("lead", LEADS)
def test_rms_norm(assert_close, lead, D, dtype):
    x = torch.randn(*lead, D, dtype=dtype)
    w = (1 + 0.5 * torch.randn(D)).to(dtype)
    check_norm(assert_close, lambda x, w: rms_norm(x, w, EPS, backend="triton"),
               lambda x, w: rms_norm_ref(x, w, EPS), [x, w], ["dx", "dw"])


LN_WIDTHS = [(1, 1), (7, 1), (100, 1), (1000, 1), (384, 1), (384, 3), (384, 6), (6, 6), (90, 3), (300, 12)]  # (D, groups)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D, groups", [pytest.param(D, G, id=f"D{D}-G{G}") for D, G in LN_WIDTHS])
@pytest.mark.parametrize("lead", LEADS)
def test_layer_norm(assert_close, lead, D, groups, dtype):
    x = torch.randn(*lead, D, dtype=dtype) * 2 + 1
    w, b = (1 + 0.5 * torch.randn(D)).to(dtype), torch.randn(D).to(dtype)
    check_norm(assert_close, lambda x, w, b: layer_norm(x, w, b, groups, EPS, backend="triton"),
               lambda x, w, b: layer_norm_ref(x, w, b, groups, EPS), [x, w, b], ["dx", "dw", "db"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_without_bias(assert_close, dtype):
    x, w = torch.randn(13, 384, dtype=dtype), torch.randn(384).to(dtype)
    check_norm(assert_close, lambda x, w: layer_norm(x, w, None, 6, EPS, backend="triton"),
               lambda x, w: layer_norm_ref(x, w, None, 6, EPS), [x, w], ["dx", "dw"])


def test_norms_with_bf16_input_and_fp32_weights(assert_close):
    """The usual mixed-precision layout: y and dx in the input's dtype, dw and db in the parameters' dtype."""
    x, w, b = torch.randn(2, 3, 100, dtype=torch.bfloat16), torch.randn(100), torch.randn(100)
    check_norm(assert_close, lambda x, w: rms_norm(x, w, backend="triton"), rms_norm_ref, [x, w], ["dx", "dw"])
    check_norm(assert_close, lambda x, w, b: layer_norm(x, w, b, 4, backend="triton"),
               lambda x, w, b: layer_norm_ref(x, w, b, 4), [x, w, b], ["dx", "dw", "db"])


def test_norms_on_an_empty_batch():
    x, w, b = (torch.randn(*shape, requires_grad=True) for shape in ((0, 7), (7,), (7,)))
    (rms_norm(x, w, backend="triton").sum() + layer_norm(x, w, b, backend="triton").sum()).backward()
    assert x.grad.shape == (0, 7) and torch.equal(w.grad, torch.zeros(7)) and torch.equal(b.grad, torch.zeros(7))


def test_references_match_torch(assert_close):
    """The references themselves, against torch's own norms (F.group_norm is the grouped LayerNorm of [M, D])."""
    x, w, b = (torch.randn(*shape, dtype=torch.float64) for shape in ((5, 12), (12,), (12,)))
    assert_close("rms_norm_ref", F.rms_norm(x, (12,), w, 1e-6), rms_norm_ref(x, w))
    assert_close("layer_norm_ref", F.layer_norm(x, (12,), w, b), layer_norm_ref(x, w, b))
    for groups in (3, 4, 12):
        assert_close(f"layer_norm_ref G={groups}", F.group_norm(x, groups, w, b), layer_norm_ref(x, w, b, groups))


def test_norm_argument_checks(monkeypatch):
    x, w = torch.randn(2, 12), torch.randn(12)
    with pytest.raises(ValueError, match="groups=5"):
        layer_norm(x, w, None, groups=5)
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(x, torch.randn(11))
    with pytest.raises(ValueError, match="bias shape"):
        layer_norm(x, w, torch.randn(3))
    monkeypatch.setattr(kernels, "MAX_NORM_WIDTH", 8)
    with pytest.raises(ValueError, match="exceeds the Triton kernel's limit of 8"):
        rms_norm(x, w, backend="triton")
    with pytest.raises(ValueError, match="exceeds the Triton kernel's limit of 8"):
        layer_norm(x, w, None, groups=1, backend="triton")
    layer_norm(x, w, None, groups=2, backend="triton")  # slices of 6 fit


# ----------------------------------------------------------------------------------------------------------
# Cross-entropy against F.cross_entropy in float64

CE_SHAPES = [pytest.param((1,), 1, id="N1-V1"), pytest.param((17,), 5, id="N17-V5"),
             pytest.param((2, 3), 1000, id="2x3-V1000"), pytest.param((8,), 5001, id="N8-V5001")]


def ce_truth(logits, target, dloss, reduction, ignore_index=-100):
    """F.cross_entropy on a float64 copy; returns the loss and d(loss · dloss)/d(logits)."""
    z = logits.detach().double().requires_grad_()
    loss = F.cross_entropy(z.flatten(0, -2), target.flatten(), ignore_index=ignore_index, reduction=reduction)
    loss = loss.view(target.shape) if reduction == "none" else loss
    (loss * dloss.double()).sum().backward()
    return loss, z.grad


@pytest.mark.parametrize("inplace", [False, True], ids=["grad-buffer", "inplace-grad"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [*DTYPES, pytest.param(torch.float16, id="fp16")])
@pytest.mark.parametrize("lead, V", CE_SHAPES)
def test_cross_entropy(assert_close, lead, V, dtype, reduction, inplace):
    logits = (2 * torch.randn(*lead, V)).to(dtype)
    target = torch.randint(V, lead)
    target.view(-1)[1::3] = -100  # rows 1, 4, 7, ... are ignored
    z = logits.clone().requires_grad_()
    loss = cross_entropy(z, target, reduction=reduction, inplace_grad=inplace, backend="triton")
    dloss = torch.randn(loss.shape).to(dtype)
    (loss * dloss).sum().backward()
    loss_ref, grad_ref = ce_truth(logits, target, dloss, reduction)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)  # fp32 whatever the logits
    assert_close("loss", loss_ref, loss)
    assert_close("dlogits", grad_ref, z.grad)
    if inplace:  # the caller's logits now hold the gradient
        assert_close("logits storage", grad_ref, z.detach())
    else:
        assert torch.equal(z.detach(), logits)


@pytest.mark.parametrize("grad_output", ["expanded", "transposed"])
def test_cross_entropy_none_with_a_strided_grad_output(assert_close, grad_output):
    """reduction="none" under loss.sum() hands the backward an expanded (stride-0) grad_output, and under a
    transposed weight a non-contiguous one: the backward kernel reads one factor per row, so it must see them in
    row order (a kernel fed the view's raw storage gave gradients off by up to 1.0)."""
    logits = 2 * torch.randn(4, 6, 300)
    target = torch.randint(300, (4, 6))
    z = logits.clone().requires_grad_()
    loss = cross_entropy(z, target, reduction="none", backend="triton")  # [4, 6]
    weight = torch.randn(6, 4).t() if grad_output == "transposed" else torch.ones(4, 6)
    (loss.sum() if grad_output == "expanded" else (loss * weight).sum()).backward()
    loss_ref, grad_ref = ce_truth(logits, target, weight, "none")
    assert_close("loss", loss_ref, loss)
    assert_close("dlogits", grad_ref, z.grad)


def test_cross_entropy_many_vocabulary_tiles(assert_close):
    """V = 4.5 tiles of MAX_BLOCK_V; each row's max sits in another tile (last, first, middle) and is large
    enough (exp(100) overflows fp32) that the online log-sum-exp must track the running max to stay finite."""
    V = int(4.5 * kernels.MAX_BLOCK_V)
    logits = torch.randn(3, V)
    logits[0, V - 1] = logits[1, 0] = logits[2, V // 2] = 100.0
    target = torch.tensor([V - 1, 7, V // 2])
    z = logits.clone().requires_grad_()
    loss = cross_entropy(z, target, reduction="none", backend="triton")
    dloss = torch.randn(3)
    (loss * dloss).sum().backward()
    loss_ref, grad_ref = ce_truth(logits, target, dloss, "none")
    assert_close("loss", loss_ref, loss)
    assert_close("dlogits", grad_ref, z.grad)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_all_ignored_matches_torch(reduction):
    """All rows ignored: "mean" is 0/0 = nan like F.cross_entropy, "sum" is 0; the gradient is 0 either way."""
    logits, target = torch.randn(4, 9), torch.full((4,), 3)
    z, z_ref = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = cross_entropy(z, target, ignore_index=3, reduction=reduction, backend="triton")
    loss_ref = F.cross_entropy(z_ref, target, ignore_index=3, reduction=reduction)
    torch.testing.assert_close(loss, loss_ref, equal_nan=True)
    loss.sum().backward()
    loss_ref.sum().backward()
    assert torch.equal(z.grad, torch.zeros(4, 9)) and torch.equal(z_ref.grad, z.grad)


def test_cross_entropy_without_grad_writes_no_gradient(assert_close):
    logits, target = torch.randn(5, 33), torch.randint(33, (5,), dtype=torch.int32)
    before = logits.clone()
    loss = cross_entropy(logits, target, inplace_grad=True, backend="triton")  # logits do not require grad
    with torch.no_grad():
        z = logits.clone().requires_grad_()
        loss_no_grad = cross_entropy(z, target, inplace_grad=True, backend="triton")
    assert torch.equal(logits, before) and torch.equal(z.detach(), before)
    assert not loss.requires_grad and not loss_no_grad.requires_grad
    assert_close("loss", F.cross_entropy(before.double(), target.long()), loss)


def test_relative_error_helper(assert_close):
    """The helper the kernel tests stand on: within atol passes only for a reference above atol (or all zero); a
    small reference is judged by the ratio, so zeros or the negation of it fail; NaN in the output fails."""
    ref = torch.full((1000,), 4e-4, dtype=torch.float64)
    for wrong in (torch.zeros(1000), -ref):
        with pytest.raises(AssertionError, match="rel rms err"):
            assert_close("small", ref, wrong.to(torch.bfloat16))
    assert_close("small, close", ref, (ref * (1 + 1e-3)).to(torch.bfloat16))  # bf16 rounding of 4e-4: ratio ~1e-3
    assert_close("zeros", torch.zeros(5), torch.full((5,), 1e-7))
    assert_close("large", torch.full((4,), 3.0), torch.full((4,), 3.0 + 5e-7))  # within atol 1e-6
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close("nan", torch.ones(3), torch.tensor([1.0, float("nan"), 1.0]))


def test_cross_entropy_leading_masked_tile(assert_close):
    """A row whose first vocabulary tile is all -inf (a masked block of ids) still has a finite loss and gradient:
    the online log-sum-exp must not form exp(-inf + inf)."""
    V = kernels.MAX_BLOCK_V + 904  # two tiles
    logits = torch.randn(3, V, dtype=torch.float64)
    logits[0, :kernels.MAX_BLOCK_V] = float("-inf")
    target = torch.tensor([V - 1, 5, 17])
    z, z_ref = logits.float().clone().requires_grad_(), logits.clone().requires_grad_()
    loss = cross_entropy(z, target, backend="triton")
    loss_ref = F.cross_entropy(z_ref, target)
    loss.backward()
    loss_ref.backward()
    assert torch.isfinite(loss) and torch.isfinite(z.grad).all()
    assert_close("loss", loss_ref, loss)
    assert_close("dlogits", z_ref.grad, z.grad)


def test_cross_entropy_fp16_gradient_survives_loss_scaling():
    """fp16 logits under a loss scale (GradScaler's 2^16): the off-target gradient p/N is below fp16's normal
    range here, so 1/N must be applied with the scale in the backward, not rounded into fp16 before it (that
    flushed 6-70 % of the entries to 0 at realistic sizes)."""
    N, V = 512, 2048
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(N, V, generator=g).half(), torch.randint(V, (N,), generator=g)
    z = logits.clone().requires_grad_()
    (cross_entropy(z, target, backend="triton") * 65536).backward()
    z_ref = logits.double().requires_grad_()
    F.cross_entropy(z_ref, target).backward()
    off = torch.ones(N, V, dtype=torch.bool)
    off[torch.arange(N), target] = False
    got, want = z.grad.double()[off] / 65536, z_ref.grad[off]
    assert (got == 0).sum() == 0
    assert ((got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item() < 1e-3  # fp16: ~3e-4 per rounding


def test_inplace_gradient_is_not_copied_for_a_non_leaf():
    """inplace_grad costs no [N, V] buffer when the logits are not a leaf (a head's output; --bench uses a view for
    that reason): the leaf's .grad is the logits' own storage, not a copy."""
    z, t = torch.randn(4, 33, requires_grad=True), torch.randint(33, (4,))
    cross_entropy(z.view_as(z), t, inplace_grad=True, backend="triton").backward()
    assert z.grad.data_ptr() == z.data_ptr()


def test_cross_entropy_int32_targets_on_both_paths():
    logits, target = torch.randn(4, 11), torch.randint(11, (4,), dtype=torch.int32)
    assert torch.equal(cross_entropy(logits, target, backend="torch"), F.cross_entropy(logits, target.long()))
    torch.testing.assert_close(cross_entropy(logits, target, backend="triton"), F.cross_entropy(logits, target.long()))


def test_cross_entropy_out_of_range_targets():
    """The Triton path gives NaN for a target outside [0, V) (no device sync to check); the torch path and the
    reference raise."""
    logits, target = torch.randn(3, 10), torch.tensor([10, -5, 2])
    loss = cross_entropy(logits, target, reduction="none", backend="triton")
    assert loss[:2].isnan().all() and loss[2].isfinite()
    with pytest.raises(IndexError, match="out of bounds"):
        cross_entropy(logits, target, backend="torch")
    with pytest.raises(RuntimeError, match="out of bounds"):
        cross_entropy_ref(logits, target)


def test_cross_entropy_backward_runs_once():
    z = torch.randn(4, 11, requires_grad=True)
    loss = cross_entropy(z, torch.randint(11, (4,)), backend="triton")
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="only once"):
        loss.backward()


def test_inplace_grad_fails_loudly_if_the_logits_were_saved():
    """tanh saves its output for backward; overwriting that output must raise, not give wrong gradients."""
    h = torch.randn(4, 11, requires_grad=True)
    loss = cross_entropy(torch.tanh(h), torch.randint(11, (4,)), inplace_grad=True, backend="triton")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_ref_matches_torch(assert_close, reduction, dtype):
    logits, target = torch.randn(2, 5, 40).to(dtype), torch.randint(40, (2, 5))
    target[0, 1] = target[1, 4] = -100
    z = logits.clone().requires_grad_()
    loss = cross_entropy_ref(z, target, reduction=reduction)
    dloss = torch.randn(loss.shape).to(dtype)
    (loss * dloss).sum().backward()
    loss_ref, grad_ref = ce_truth(logits, target, dloss, reduction)
    assert_close("loss", loss_ref, loss)
    fp32 = torch.float64 if dtype == torch.float64 else torch.float32
    assert loss.dtype == fp32 and cross_entropy(logits, target, reduction=reduction, backend="torch").dtype == fp32
    assert_close("dlogits", grad_ref, z.grad)


def test_cross_entropy_argument_checks():
    logits, target = torch.randn(4, 7), torch.randint(7, (4,))
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, target, reduction="avg")
    with pytest.raises(ValueError, match="target shape"):
        cross_entropy(logits, target[:3])


# ----------------------------------------------------------------------------------------------------------
# Dispatch, poisoning, modules, torch.compile

def op_args(op):
    x = torch.randn(3, 12)
    return {"rms_norm": (x, torch.randn(12)), "layer_norm": (x, torch.randn(12), torch.randn(12)),
            "cross_entropy": (x, torch.randint(12, (3,)))}[op]


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "cross_entropy"])
def test_dispatch(monkeypatch, op, assert_close):
    """auto on CPU takes the reference, triton takes the Triton wrapper, torch the reference."""
    calls = []
    monkeypatch.setattr(kernels, f"_{op}_triton", lambda *args: calls.append(args) or "triton path")
    fn, ref, args = getattr(kernels, op), getattr(kernels, f"{op}_ref"), op_args(op)
    if op == "cross_entropy":  # the torch path of cross-entropy is F.cross_entropy (checked against the ref below)
        ref = lambda z, t: F.cross_entropy(z, t)
        assert_close("F.cross_entropy vs cross_entropy_ref", cross_entropy_ref(*args), ref(*args))
    assert torch.equal(fn(*args, backend="auto"), ref(*args)) and not calls
    assert torch.equal(fn(*args, backend="torch"), ref(*args)) and not calls
    assert fn(*args, backend="triton") == "triton path" and len(calls) == 1


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "cross_entropy"])
def test_bad_backend_and_triton_without_interpreter(monkeypatch, op):
    fn, args = getattr(kernels, op), op_args(op)
    with pytest.raises(ValueError, match="backend must be one of .*'auto', 'triton', 'torch'"):
        fn(*args, backend="cuda")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="needs a CUDA tensor or TRITON_INTERPRET=1"):
        fn(*args, backend="triton")


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm", "cross_entropy"])
def test_float64_stays_with_the_reference(monkeypatch, op):
    """The kernels compute in fp32: float64 under `auto` takes the reference, even where Triton would run (a
    CUDA-like dispatch, faked), and `triton` refuses it instead of returning fp32 numbers as double."""
    fn, args = getattr(kernels, op), [a.double() if a.is_floating_point() else a for a in op_args(op)]
    with pytest.raises(ValueError, match="computes in float32; float64 inputs take backend='auto' or 'torch'"):
        fn(*args, backend="triton")
    fake_cuda_dispatch(monkeypatch, kernels, f"_{op}_triton")
    assert fn(*args, backend="auto").dtype == torch.float64


def test_backends_constant():
    assert BACKENDS == ("auto", "triton", "torch")


def test_poisoning_is_active_and_catches_an_unwritten_tail(assert_close):
    """The suite runs with GLASSBOX_POISON=1, so outputs start as NaN: a launch whose block is narrower than
    the row leaves the tail unwritten, and the comparison fails on it instead of passing on lucky zeros."""
    assert os.environ.get("GLASSBOX_POISON") == "1", "conftest sets GLASSBOX_POISON=1; poisoning is off in this run"
    assert kernels._empty((2, 3), torch.bfloat16, "cpu").isnan().all()
    x, w = torch.randn(3, 100), torch.ones(100)
    y, rstd = kernels._empty((3, 100), torch.float32, "cpu"), kernels._empty((3,), torch.float32, "cpu")
    kernels._rms_norm_fwd[(3,)](x, y, w, rstd, 100, 1e-6, BLOCK_D=64)
    assert y[:, 64:].isnan().all()
    with pytest.raises(AssertionError, match="non-finite"):
        assert_close("y", rms_norm_ref(x, w), y)


def test_modules_match_functions(assert_close):
    rms, ln = RMSNorm(12, backend="triton"), LayerNorm(12, groups=3, backend="triton")
    ln_nobias = LayerNorm(12, bias=False)
    assert dict(rms.named_parameters()).keys() == {"weight"} and torch.equal(rms.weight, torch.ones(12))
    assert dict(ln.named_parameters()).keys() == {"weight", "bias"} and torch.equal(ln.bias, torch.zeros(12))
    assert dict(ln_nobias.named_parameters()).keys() == {"weight"} and ln_nobias.bias is None
    with torch.no_grad():
        for p in (rms.weight, ln.weight, ln.bias):
            p.normal_()
    x = torch.randn(2, 5, 12)
    for module, fn in ((rms, lambda x: rms_norm(x, rms.weight, backend="triton")),
                       (ln, lambda x: layer_norm(x, ln.weight, ln.bias, groups=3, backend="triton"))):
        y = module(x)
        y.sum().backward()
        assert torch.equal(y, fn(x))
        assert all(p.grad is not None for p in module.parameters())
    assert "backend='triton'" in repr(rms) and "groups=3" in repr(ln)
    with pytest.raises(ValueError, match="groups=5"):
        LayerNorm(12, groups=5)
    with pytest.raises(ValueError, match="backend must be one of"):
        RMSNorm(12, backend="cuda")


def test_torch_compile_graph_breaks_around_triton(assert_close):
    """torch.compiler.disable on the Triton wrappers: dynamo traces the rest and calls the kernels eagerly."""
    x, w = torch.randn(3, 20), torch.randn(20)
    f = lambda x, w: rms_norm(x * 2, w, backend="triton") + 1
    got, ops = compiled_ops(f, x, w)
    assert_close("compiled", f(x, w), got)
    assert sorted(ops) == ["add", "mul"], ops  # the x * 2 and the + 1 alone


# ----------------------------------------------------------------------------------------------------------
# Without triton (a subprocess), and the --bench entry point

NO_TRITON = """
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError, as on a platform without Triton
import torch, kernels
assert not kernels.HAS_TRITON
x, w, t = torch.randn(3, 8), torch.randn(8), torch.tensor([1, 2, 7])
assert torch.equal(kernels.rms_norm(x, w), kernels.rms_norm_ref(x, w))
assert torch.equal(kernels.LayerNorm(8, groups=2)(x), kernels.layer_norm_ref(x, torch.ones(8), torch.zeros(8), 2))
assert torch.equal(kernels.cross_entropy(x, t), torch.nn.functional.cross_entropy(x, t))
try:
    kernels.rms_norm(x, w, backend="triton")
except RuntimeError as e:
    print(e)
"""


def run_python(*args):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})


def test_imports_and_runs_without_triton():
    r = run_python("-c", NO_TRITON)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("backend='triton' needs the triton package, which failed to import")


def test_bench_without_gpu_says_so_and_exits_0(capsys):
    assert kernels.main(["--bench"]) == 0  # the suite hides the GPUs
    assert capsys.readouterr().out.strip().splitlines() == [
        "kernels.py --bench needs a CUDA GPU; none is available here, so there is nothing to measure."]


def test_bench_json_that_cannot_be_written_fails_before_the_benchmark(capsys, monkeypatch, tmp_path):
    """On a GPU the benchmark takes minutes: a --bench-json path that cannot be written is refused first, in one line
    (it was a traceback after the whole run). bench() must not start; the GPU check is faked to reach that point."""
    monkeypatch.setattr(kernels, "bench", lambda path: pytest.fail("the benchmark started"))
    for bad in (tmp_path / "missing" / "x.json", tmp_path):
        with pytest.raises(SystemExit) as e:
            kernels.main(["--bench", "--bench-json", str(bad)])
        assert e.value.code == 1 and capsys.readouterr().err == f"kernels.py: error: --bench-json {bad}: cannot write there\n"
    ran = []
    monkeypatch.setattr(kernels, "bench", ran.append)
    assert kernels.main(["--bench-json", str(tmp_path / "ok.json")]) == 0 and ran == [str(tmp_path / "ok.json")]


def test_unknown_flag_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        kernels.main(["--benchh"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == "kernels.py: error: unrecognized arguments: --benchh\n"
    with pytest.raises(SystemExit) as e:  # no abbreviations, as in the scripts' parsers
        kernels.main(["--bench-js", "x.json"])
    assert e.value.code == 2 and "unrecognized arguments: --bench-js x.json" in capsys.readouterr().err


def test_bench_table(capsys):
    """The CUDA-only table, fed with made-up timings for every benchmark case, prints one line per row."""
    rows = [dict(op=op, shape=shape, provider=p, fwd_ms=(i + 1.0, 0.9, 1.1), fwd_bwd_ms=(2.0, 1.9, 2.1),
                 peak_mib=10.0 * (i + 1), graph_fwd_bwd_ms=None if op == "layer_norm g=12" else (0.5 * (i + 1), 0.4, 0.6))
            for op, shape, _, providers in kernels._bench_cases() for i, p in enumerate(providers)]
    kernels._print_table("gpu X | cuda Y", rows)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "gpu X | cuda Y" and len(out) == 5 + len(rows)  # header, 2 legend lines, titles, rule
    assert {r["op"] for r in rows} == {"rms_norm", "layer_norm g=1", "layer_norm g=6", "layer_norm g=12",
                                       "cross_entropy"}
    assert out[-1].split() == ["cross_entropy", "8192x100277", "F.cross_entropy", "3.000", "(0.900-1.100)", "3.00",
                               "2.000", "(1.900-2.100)", "1.00", "30.0", "0.33", "1.500", "(0.400-0.600)", "3.00"]
    uncaptured = next(line for line in out if line.split()[:4] == ["layer_norm", "g=12", "4096x768", "reference"])
    assert uncaptured.split()[-2:] == ["0.50", "n/a"]  # no graph time, no ratio


# ----------------------------------------------------------------------------------------------------------
# Realistic sizes on a GPU (pytest -m gpu; an error without CUDA)

@pytest.mark.gpu
class TestRealisticSizesOnGPU:
    def test_rms_norm(self, assert_close):
        x, w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16), torch.randn(4096, device="cuda")
        check_norm(assert_close, lambda x, w: rms_norm(x, w, backend="triton"), rms_norm_ref, [x, w], ["dx", "dw"])

    @pytest.mark.parametrize("groups", [1, 16])
    def test_layer_norm(self, assert_close, groups):
        x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        w, b = torch.randn(4096, device="cuda"), torch.randn(4096, device="cuda")
        check_norm(assert_close, lambda x, w, b: layer_norm(x, w, b, groups, backend="triton"),
                   lambda x, w, b: layer_norm_ref(x, w, b, groups), [x, w, b], ["dx", "dw", "db"])

    @pytest.mark.parametrize("inplace", [False, True], ids=["grad-buffer", "inplace-grad"])
    def test_cross_entropy(self, assert_close, inplace):
        logits = 2 * torch.randn(4096, 100277, device="cuda", dtype=torch.bfloat16)
        target = torch.randint(100277, (4096,), device="cuda")
        target[::7] = -100
        z = logits.clone().requires_grad_()
        loss = cross_entropy(z, target, inplace_grad=inplace)  # auto takes Triton on CUDA
        dloss = torch.randn((), device="cuda").to(torch.bfloat16)
        (loss * dloss).backward()
        loss_ref, grad_ref = ce_truth(logits, target, dloss, "mean")
        assert_close("loss", loss_ref, loss)
        # every |dlogit| is below |dloss|/3510 here, mostly under the bf16 atol: atol=0 makes the relative check decide
        assert_close("dlogits", grad_ref, z.grad, atol=0)
        if inplace:  # the logits' storage holds the gradient only if auto took the Triton kernel
            assert_close("logits storage", grad_ref, z.detach(), atol=0)
        else:
            assert torch.equal(z.detach(), logits)

    def test_cross_entropy_memory(self):
        """logits = h @ Wᵀ, fwd+bwd peak beyond h and W: inplace < grad buffer < F.cross_entropy."""
        h = torch.randn(4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        W = torch.randn(100277, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        target = torch.randint(100277, (4096,), device="cuda")

        def peak(loss_fn):
            h.grad = W.grad = None
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss_fn(h @ W.T, target).backward()
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - before

        (h @ W.T).sum().backward()  # warm-up: cuBLAS's workspace would otherwise count in the first measurement
        inplace = peak(lambda z, t: cross_entropy(z, t, inplace_grad=True))
        buffer = peak(cross_entropy)
        torch_peak = peak(F.cross_entropy)
        assert inplace < buffer < torch_peak, (inplace, buffer, torch_peak)

    def test_auto_takes_triton_and_wide_rows_take_the_reference(self, monkeypatch, assert_close):
        calls = []
        monkeypatch.setattr(kernels, "_rms_norm_triton", lambda *args: calls.append(args) or "triton path")
        x = torch.randn(4, 2 * kernels.MAX_NORM_WIDTH, device="cuda")
        w = torch.randn(x.shape[-1], device="cuda")
        assert rms_norm(x[:, :64], w[:64]) == "triton path"
        assert_close("wide", rms_norm_ref(x, w), rms_norm(x, w))
        assert len(calls) == 1
