"""
Generic Triton kernels shared by the paper scripts: RMSNorm, LayerNorm with groups, fused cross-entropy.
=========================================================================================================

Each op comes in the same order, as in the Triton tutorials (05-layer-norm is the model for the norms):
`<op>_ref` (plain torch, written like the equation, fp32 maths (fp64 for fp64 inputs); the norms return the
input dtype, the cross-entropy an fp32 loss), the `@triton.jit` kernels, an `autograd.Function` gluing them,
and one public function `<op>(..., backend=...)`.

RMSNorm, over the last dim D of x, for any leading shape (rows are flattened to M):

    r = 1 / sqrt(mean(x²) + eps)      x̂ = x · r      y = x̂ ⊙ w
    backward, with g = dy ⊙ w:        dx = r · (g − x̂ · mean(g ⊙ x̂))      dw = Σ_rows dy ⊙ x̂

(since ∂r/∂x = −r³ · x / D, dx = r · g − r³ · x · Σ(g ⊙ x) / D, which is the line above).

LayerNorm with groups: D is split into G contiguous slices of n = D/G and each slice is normalised on its own
(G = 1 is the usual LayerNorm, G = H is Dual-Stream's channel-aware LayerNorm); w and b span the full D.
A grouped LayerNorm of [M, D] is a plain LayerNorm of the [M·G, n] view whose row i uses the columns
(i mod G)·n ... (i mod G)·n + n − 1 of w and b; the kernels work on that view. Means below are over a slice:

    μ = mean(x)      r = 1 / sqrt(mean((x − μ)²) + eps)      x̂ = (x − μ) · r      y = x̂ ⊙ w + b
    backward, with g = dy ⊙ w:
        dx = r · (g − mean(g) − x̂ · mean(g ⊙ x̂))      dw = Σ_rows dy ⊙ x̂      db = Σ_rows dy

(x̂ depends on x directly and through μ and r: the path through μ gives −mean(g), the one through r gives
−x̂ · mean(g ⊙ x̂)).

Both norms: the forward runs one program per row (per slice) with the whole row in registers and saves the
fp32 statistics (r, and μ for LayerNorm). The backward runs a few programs per SM; each one walks a
contiguous block of rows, writes dx row by row and accumulates its partial dw (db) in registers, then stores
it as one row of a [num_blocks, D] fp32 buffer that torch sums over blocks: a two-stage reduction without
atomics, so the result is deterministic (Liger-Kernel's RMSNorm does the same; the tutorial uses locks).

Cross-entropy over a vocabulary of V, per row z of the [N, V] logits with target t:

    loss = lse(z) − z_t      lse(z) = log Σ exp(z) = m + log Σ exp(z − m)   (any m; the max keeps exp ≤ 1)
    ∂loss/∂z = ∂lse/∂z − onehot(t) = softmax(z) − onehot(t) = exp(z − lse) − onehot(t)

One program per row sweeps the row twice in the same launch. Sweep 1 is an online log-sum-exp over tiles of
the row: with the running max m and running sum s = Σ exp(z − m) so far, a tile with max m' updates
m_new = max(m, m'), s ← s · exp(m − m_new) + Σ_tile exp(z − m_new). Sweep 2 writes the gradient, already
multiplied by 1/n_valid for reduction="mean", in the logits' dtype (fp16 logits: unscaled, since p/n_valid would
fall below fp16's range before a loss scale could lift it; the backward applies 1/n_valid with grad_output). Rows
whose target is `ignore_index` get loss 0 and gradient 0. The backward only rescales the stored gradient by the
incoming grad_output, in place.
So no fp32 copy of the logits ever exists and at most one [N, V] buffer (the gradient) comes on top of the
logits; F.cross_entropy by contrast saves a log-softmax copy for backward and builds further [N, V]
temporaries there. `inplace_grad=True` writes the gradient into the logits' own storage (as Liger-Kernel's
fused linear + cross-entropy does): no extra memory at all, at the price of overwriting the caller's logits.

Block sizes: a norm row (or slice) is one masked block of the next power of two >= its width, at most
MAX_NORM_WIDTH; the cross-entropy sweeps a row in tiles of min(next power of two >= V, MAX_BLOCK_V).

Dispatch: every public function and module takes `backend` in BACKENDS = ("auto", "triton", "torch"):
  auto   - Triton if the tensor is on CUDA and triton imports, the torch reference otherwise (also for norm
           rows wider than MAX_NORM_WIDTH, where `triton` raises, and for float64, which the kernels would
           compute in fp32: `triton` refuses it, so a gradcheck never passes fp32 numbers off as double);
  triton - always Triton; on CPU this needs TRITON_INTERPRET=1 (Triton's interpreter, how the tests run it);
  torch  - the reference (for cross-entropy, torch's fused F.cross_entropy, which computes the same thing).
The module imports without triton (e.g. on macOS): `auto` then always takes the reference. The functions
that launch Triton are decorated with torch.compiler.disable, so torch.compile graph-breaks around them.

Benchmark (CUDA only): Triton vs torch eager at realistic bf16 shapes, fwd and fwd+bwd times (do_bench median
and 20/80% quantiles), fwd+bwd peak memory, and fwd+bwd again replayed from a CUDA graph (do_bench_cudagraph):
the GPU's time without the host's launch costs, which a Python autograd.Function pays more of than torch's own
fused ops and which dominate at small sizes (the replays skip do_bench's L2 flush, so they run with a warm L2).
Side by side in one table headed by GPU and versions:

    python kernels.py --bench [--bench-json out.json]
"""
import argparse
import functools
import json
import os
import sys
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    HAS_TRITON, TRITON_ERROR = True, None
except ImportError as err:  # no Triton on this platform (e.g. macOS): the references still work
    HAS_TRITON, TRITON_ERROR = False, err
    # Stand-ins so the kernel definitions below still parse; they are never called without triton.
    triton = types.SimpleNamespace(jit=lambda fn: fn, heuristics=lambda values: lambda fn: fn)
    tl = types.SimpleNamespace(constexpr=None)

BACKENDS = ("auto", "triton", "torch")
MAX_NORM_WIDTH = 16384  # widest row (or slice) a norm kernel holds in registers; `auto` sends wider to torch
MAX_BLOCK_V = 4096  # vocabulary tile of the cross-entropy kernel; larger V is swept in tiles of this size


def _check_backend(backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def _use_triton(x, backend):
    """True if a call on `x` takes the Triton path under `backend` (rules in the module docstring)."""
    if _check_backend(backend) == "torch":
        return False
    if x.dtype == torch.float64:  # the kernels compute in fp32: double precision stays with the reference
        if backend == "triton":
            raise ValueError("backend='triton' computes in float32; float64 inputs take backend='auto' or 'torch'")
        return False
    if backend == "auto":
        return HAS_TRITON and x.is_cuda
    if not HAS_TRITON:
        raise RuntimeError(f"backend='triton' needs the triton package, which failed to import: {TRITON_ERROR}")
    if not (x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError("backend='triton' needs a CUDA tensor or TRITON_INTERPRET=1 (Triton's interpreter)")
    return True


def _fits_norm_kernel(width, backend):
    """Rows wider than MAX_NORM_WIDTH do not fit in registers: `auto` routes them to the reference."""
    if triton.next_power_of_2(width) <= MAX_NORM_WIDTH:
        return True
    if backend == "triton":
        raise ValueError(f"norm width {width} exceeds the Triton kernel's limit of {MAX_NORM_WIDTH}; "
                         "use backend='auto' or 'torch'")
    return False


def _empty(shape, dtype, device):
    """torch.empty for kernel outputs, NaN-filled under GLASSBOX_POISON=1 (tests) so unwritten tiles show up."""
    if os.environ.get("GLASSBOX_POISON") == "1":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _num_warps(block):
    return min(max(block // 256, 1), 8)  # tutorial 05's heuristic: one warp per 256 elements, at most 8


@functools.lru_cache(maxsize=None)
def _sm_count(device_index):
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _row_blocks(x, rows):
    """Split `rows` into contiguous blocks for the backward programs: 4 programs per SM on CUDA, 8 otherwise."""
    programs = 4 * _sm_count(x.device.index) if x.is_cuda else 8
    rows_per_program = max(1, triton.cdiv(rows, programs))
    return triton.cdiv(rows, rows_per_program), rows_per_program


def _up(t):
    """Reference precision: fp32, or fp64 for fp64 inputs (so tests can build a float64 ground truth)."""
    return t if t.dtype == torch.float64 else t.float()


# ----------------------------------------------------------------------------------------------------------
# RMSNorm

def rms_norm_ref(x, weight, eps=1e-6):
    xf = _up(x)
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * r * _up(weight)).to(x.dtype)


@triton.jit
def _rms_norm_fwd(
    X,  # pointer to the input [M, D]
    Y,  # pointer to the output [M, D]
    W,  # pointer to the weight [D]
    Rstd,  # pointer to the per-row 1/rms [M] (fp32)
    D,  # row width
    eps,  # epsilon added to mean(x²)
    BLOCK_D: tl.constexpr,  # next power of two >= D
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    # Compute 1/rms and save it for the backward
    rstd = 1 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    tl.store(Rstd + row, rstd)
    # Normalize, scale and write y
    w = tl.load(W + cols, mask=mask).to(tl.float32)
    tl.store(Y + row * D + cols, (x * rstd * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_dx_fused(
    X,  # pointer to the input [M, D]
    DY,  # pointer to the output gradient [M, D]
    DX,  # pointer to the input gradient [M, D]
    W,  # pointer to the weight [D]
    Rstd,  # pointer to the per-row 1/rms [M] (fp32)
    DW,  # pointer to the partial weight gradients [num_blocks, D] (fp32), one row per program
    M,  # number of rows
    D,  # row width
    rows_per_program,  # rows walked by each program
    BLOCK_D: tl.constexpr,  # next power of two >= D
):
    block = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_D], dtype=tl.float32)
    row_start = block * rows_per_program
    for r in range(row_start, tl.minimum(row_start + rows_per_program, M)):
        row = tl.cast(r, tl.int64)
        x = tl.load(X + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row)
        # Compute dx = r · (g − x̂ · mean(g ⊙ x̂)) with g = dy ⊙ w
        xhat = x * rstd
        g = dy * w
        dx = (g - xhat * (tl.sum(g * xhat, axis=0) / D)) * rstd
        tl.store(DX + row * D + cols, dx.to(DX.dtype.element_ty), mask=mask)
        # Accumulate this block's partial dw
        dw += dy * xhat
    tl.store(DW + block * D + cols, dw, mask=mask)


class RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        shape = x.shape
        x = x.reshape(-1, shape[-1]).contiguous()  # (M, D)
        M, D = x.shape
        y = _empty((M, D), x.dtype, x.device)
        rstd = _empty((M,), torch.float32, x.device)
        BLOCK_D = triton.next_power_of_2(D)
        _rms_norm_fwd[(M,)](x, y, weight, rstd, D, eps, BLOCK_D=BLOCK_D, num_warps=_num_warps(BLOCK_D))
        ctx.save_for_backward(x, weight, rstd)
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        M, D = x.shape
        dx = _empty((M, D), x.dtype, x.device)
        num_blocks, rows_per_program = _row_blocks(x, M)
        dw = _empty((num_blocks, D), torch.float32, x.device)
        BLOCK_D = triton.next_power_of_2(D)
        _rms_norm_bwd_dx_fused[(num_blocks,)](
            x, dy.reshape(M, D).contiguous(), dx, weight, rstd, dw, M, D, rows_per_program,
            BLOCK_D=BLOCK_D, num_warps=_num_warps(BLOCK_D))
        return dx.view(dy.shape), dw.sum(0).to(weight.dtype), None


# Triton launches stay out of torch.compile graphs: torch.compiler.disable makes dynamo graph-break here
# (fla's choice; modded-nanogpt's alternative is a torch.library custom op with a fake implementation).
@torch.compiler.disable
def _rms_norm_triton(x, weight, eps):
    return RMSNormFn.apply(x, weight.contiguous(), eps)


def rms_norm(x, weight, eps=1e-6, backend="auto"):
    """y = x / sqrt(mean(x²) + eps) * weight over the last dim; x [..., D], weight [D]; y in x's dtype."""
    if weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: weight shape {tuple(weight.shape)} != last dim of x {tuple(x.shape[-1:])}")
    if _use_triton(x, backend) and _fits_norm_kernel(x.shape[-1], backend):
        return _rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, backend="auto"):
        super().__init__()
        self.eps, self.backend = eps, _check_backend(backend)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, self.backend)

    def extra_repr(self):
        return f"{self.weight.shape[0]}, eps={self.eps}, backend={self.backend!r}"


# ----------------------------------------------------------------------------------------------------------
# LayerNorm with groups

def layer_norm_ref(x, weight, bias, groups=1, eps=1e-5):
    D = x.shape[-1]
    xg = _up(x).unflatten(-1, (groups, D // groups))  # (..., G, n): statistics per slice
    mean = xg.mean(-1, keepdim=True)
    var = (xg - mean).pow(2).mean(-1, keepdim=True)
    y = ((xg - mean) * torch.rsqrt(var + eps)).flatten(-2) * _up(weight)  # (..., D)
    if bias is not None:
        y = y + _up(bias)
    return y.to(x.dtype)


@triton.heuristics({"HAS_BIAS": lambda args: args["B"] is not None})
@triton.jit
def _layer_norm_fwd(
    X,  # pointer to the input, viewed as [M·G, n]: one row per (row, group) slice
    Y,  # pointer to the output, same view
    W,  # pointer to the weight [D], D = G·n
    B,  # pointer to the bias [D], or None
    Mean,  # pointer to the per-slice mean [M·G] (fp32)
    Rstd,  # pointer to the per-slice 1/std [M·G] (fp32)
    n,  # slice width D / G
    G,  # number of groups
    eps,  # epsilon added to the variance
    HAS_BIAS: tl.constexpr,  # B is not None
    BLOCK_N: tl.constexpr,  # next power of two >= n
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    x = tl.load(X + row * n + cols, mask=mask, other=0.0).to(tl.float32)
    # Compute mean and variance of the slice, save them for the backward
    mean = tl.sum(x, axis=0) / n
    xc = tl.where(mask, x - mean, 0.0)
    rstd = 1 / tl.sqrt(tl.sum(xc * xc, axis=0) / n + eps)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)
    # Normalize and apply the affine map of this slice's columns of w and b
    wcols = (row % G) * n + cols
    y = xc * rstd * tl.load(W + wcols, mask=mask).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(B + wcols, mask=mask).to(tl.float32)
    tl.store(Y + row * n + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.heuristics({"HAS_BIAS": lambda args: args["DB"] is not None})
@triton.jit
def _layer_norm_bwd_dx_fused(
    X,  # pointer to the input, viewed as [M·G, n]
    DY,  # pointer to the output gradient, same view
    DX,  # pointer to the input gradient, same view
    W,  # pointer to the weight [D]
    Mean,  # pointer to the per-slice mean [M·G] (fp32)
    Rstd,  # pointer to the per-slice 1/std [M·G] (fp32)
    DW,  # pointer to the partial weight gradients [num_blocks, D] (fp32), one row per block of rows
    DB,  # pointer to the partial bias gradients [num_blocks, D] (fp32), or None
    M,  # number of rows of the [M, D] input
    n,  # slice width D / G
    G,  # number of groups
    rows_per_program,  # rows walked by each program
    HAS_BIAS: tl.constexpr,  # DB is not None
    BLOCK_N: tl.constexpr,  # next power of two >= n
):
    # Program (block, group) handles one slice of the rows block·rows_per_program, ... (fewer in the last block)
    block = tl.program_id(0)
    group = tl.program_id(1)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < n
    wcols = group * n + cols  # this slice's columns of w and of the partial-gradient rows
    w = tl.load(W + wcols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = block * rows_per_program
    for r in range(row_start, tl.minimum(row_start + rows_per_program, M)):
        row = tl.cast(r, tl.int64) * G + group  # the slice's row in the [M·G, n] view
        x = tl.load(X + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(Mean + row)
        rstd = tl.load(Rstd + row)
        # Compute dx = r · (g − mean(g) − x̂ · mean(g ⊙ x̂)) with g = dy ⊙ w
        xhat = tl.where(mask, (x - mean) * rstd, 0.0)
        g = dy * w
        dx = (g - tl.sum(g, axis=0) / n - xhat * (tl.sum(g * xhat, axis=0) / n)) * rstd
        tl.store(DX + row * n + cols, dx.to(DX.dtype.element_ty), mask=mask)
        # Accumulate this block's partial dw and db
        dw += dy * xhat
        db += dy
    tl.store(DW + block * G * n + wcols, dw, mask=mask)
    if HAS_BIAS:
        tl.store(DB + block * G * n + wcols, db, mask=mask)


class LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, groups, eps):
        shape = x.shape
        x = x.reshape(-1, shape[-1]).contiguous()  # (M, D), read by the kernels as (M·G, n)
        M, D = x.shape
        n = D // groups
        y = _empty((M, D), x.dtype, x.device)
        mean = _empty((M * groups,), torch.float32, x.device)
        rstd = _empty((M * groups,), torch.float32, x.device)
        BLOCK_N = triton.next_power_of_2(n)
        _layer_norm_fwd[(M * groups,)](x, y, weight, bias, mean, rstd, n, groups, eps,
                                       BLOCK_N=BLOCK_N, num_warps=_num_warps(BLOCK_N))
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.groups, ctx.bias_dtype = groups, None if bias is None else bias.dtype
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        M, D = x.shape
        G = ctx.groups
        dx = _empty((M, D), x.dtype, x.device)
        num_blocks, rows_per_program = _row_blocks(x, M)
        dw = _empty((num_blocks, D), torch.float32, x.device)
        db = None if ctx.bias_dtype is None else _empty((num_blocks, D), torch.float32, x.device)
        BLOCK_N = triton.next_power_of_2(D // G)
        _layer_norm_bwd_dx_fused[(num_blocks, G)](
            x, dy.reshape(M, D).contiguous(), dx, weight, mean, rstd, dw, db, M, D // G, G, rows_per_program,
            BLOCK_N=BLOCK_N, num_warps=_num_warps(BLOCK_N))
        db = None if db is None else db.sum(0).to(ctx.bias_dtype)
        return dx.view(dy.shape), dw.sum(0).to(weight.dtype), db, None, None


@torch.compiler.disable  # graph break around the Triton launches, as for RMSNorm
def _layer_norm_triton(x, weight, bias, groups, eps):
    return LayerNormFn.apply(x, weight.contiguous(), None if bias is None else bias.contiguous(), groups, eps)


def layer_norm(x, weight, bias, groups=1, eps=1e-5, backend="auto"):
    """LayerNorm over `groups` contiguous slices of the last dim; x [..., D], weight and bias (or None) [D]."""
    D = x.shape[-1]
    if groups < 1 or D % groups:
        raise ValueError(f"layer_norm: the last dim {D} must split into groups={groups} equal slices")
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape != (D,):
            raise ValueError(f"layer_norm: {name} shape {tuple(p.shape)} != last dim of x ({D},)")
    if _use_triton(x, backend) and _fits_norm_kernel(D // groups, backend):
        return _layer_norm_triton(x, weight, bias, groups, eps)
    return layer_norm_ref(x, weight, bias, groups, eps)


class LayerNorm(nn.Module):
    def __init__(self, dim, groups=1, eps=1e-5, bias=True, backend="auto"):
        super().__init__()
        if groups < 1 or dim % groups:
            raise ValueError(f"LayerNorm: dim {dim} must split into groups={groups} equal slices")
        self.groups, self.eps, self.backend = groups, eps, _check_backend(backend)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x):
        return layer_norm(x, self.weight, self.bias, self.groups, self.eps, self.backend)

    def extra_repr(self):
        return (f"{self.weight.shape[0]}, groups={self.groups}, eps={self.eps}, bias={self.bias is not None}, "
                f"backend={self.backend!r}")


# ----------------------------------------------------------------------------------------------------------
# Cross-entropy over a large vocabulary

def cross_entropy_ref(logits, target, ignore_index=-100, reduction="mean"):
    z = _up(logits).reshape(-1, logits.shape[-1])  # (N, V)
    t = target.reshape(-1)  # (N,)
    valid = t != ignore_index
    z_t = z.gather(1, t.where(valid, 0)[:, None])[:, 0]
    loss = (torch.logsumexp(z, -1) - z_t).where(valid, 0.0)  # lse(z) − z_t, 0 on ignored rows
    if reduction == "none":
        return loss.view(target.shape)
    return loss.sum() if reduction == "sum" else loss.sum() / valid.sum()  # 0/0 = nan when all are ignored


@triton.heuristics({"HAS_GRAD": lambda args: args["Grad"] is not None})
@triton.jit
def _cross_entropy_fwd(
    Logits,  # pointer to the logits [N, V]
    Target,  # pointer to the targets [N] (integer)
    Loss,  # pointer to the per-row loss [N] (fp32)
    Grad,  # pointer to the gradient [N, V] in the logits' dtype (may be Logits itself), or None
    Scale,  # pointer to the gradient scale [] (fp32): 1/n_valid for reduction="mean", else 1
    V,  # vocabulary size
    ignore_index,  # target value of rows that get loss 0 and gradient 0
    HAS_GRAD: tl.constexpr,  # Grad is not None
    BLOCK_V: tl.constexpr,  # vocabulary tile
):
    row = tl.program_id(0).to(tl.int64)
    target = tl.load(Target + row)
    if target == ignore_index:
        tl.store(Loss + row, 0.0)
        if HAS_GRAD:
            for start in range(0, V, BLOCK_V):
                cols = start + tl.arange(0, BLOCK_V)
                tl.store(Grad + row * V + cols, tl.zeros([BLOCK_V], dtype=Grad.dtype.element_ty), mask=cols < V)
        return
    # Sweep 1: online log-sum-exp, rescaling the running sum whenever the running max grows
    m = float("-inf")
    s = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(Logits + row * V + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a leading all -inf tile: exp(-inf + inf) is NaN
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref), axis=0)
        m = m_new
    lse = m + tl.log(s)
    # loss = lse − z_t; an out-of-range target reads nothing and gives a NaN loss
    z_t = tl.load(Logits + row * V + target, mask=(target >= 0) & (target < V), other=float("nan")).to(tl.float32)
    tl.store(Loss + row, lse - z_t)
    # Sweep 2: gradient softmax − onehot, scaled, in the logits' dtype (overwrites the row when Grad is Logits)
    if HAS_GRAD:
        scale = tl.load(Scale)
        for start in range(0, V, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            z = tl.load(Logits + row * V + cols, mask=cols < V, other=0.0).to(tl.float32)
            g = tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)
            tl.store(Grad + row * V + cols, (g * scale).to(Grad.dtype.element_ty), mask=cols < V)


@triton.jit
def _cross_entropy_bwd(
    Grad,  # pointer to the stored gradient [N, V], rescaled in place
    Factor,  # pointer to the fp32 factors: one per row, or one for all rows (factor_stride 0)
    V,  # vocabulary size
    factor_stride,  # 1: row i takes Factor[i]; 0: every row takes Factor[0]
    BLOCK_V: tl.constexpr,  # vocabulary tile (one per program along axis 1)
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    f = tl.load(Factor + row * factor_stride)
    g = tl.load(Grad + row * V + cols, mask=cols < V, other=0.0).to(tl.float32)
    tl.store(Grad + row * V + cols, (g * f).to(Grad.dtype.element_ty), mask=cols < V)  # fp32 product, one rounding


class CrossEntropyFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, ignore_index, reduction, inplace_grad, needs_grad):
        V = logits.shape[-1]
        z = logits.contiguous()  # (..., V), read by the kernel as (N, V); the caller's logits when contiguous
        t = target.contiguous()  # (...), read as (N,)
        N = z.numel() // V
        n_valid = (t != ignore_index).sum()  # stays on the device: no host sync
        loss = _empty((N,), torch.float32, z.device)
        grad = scale = later = None
        if needs_grad:
            grad = z if inplace_grad else _empty(z.shape, z.dtype, z.device)
            scale = 1.0 / n_valid if reduction == "mean" else torch.ones((), device=z.device)
            if z.dtype == torch.float16:  # p/n_valid would fall below fp16's range before a loss scale (applied in
                scale, later = torch.ones((), device=z.device), scale  # the backward) could lift it: apply it there
        BLOCK_V = min(triton.next_power_of_2(V), MAX_BLOCK_V)
        _cross_entropy_fwd[(N,)](z, t, loss, grad, scale, V, ignore_index, BLOCK_V=BLOCK_V, num_warps=8)
        if needs_grad:
            if inplace_grad:  # a node that saved these logits now fails loudly instead of reading gradients
                torch.autograd.graph.increment_version(logits)
            ctx.grad, ctx.reduction, ctx.later = grad, reduction, later
        if reduction == "none":
            return loss.view(target.shape)
        return loss.sum() if reduction == "sum" else loss.sum() / n_valid  # 0/0 = nan when all are ignored

    @staticmethod
    def backward(ctx, dloss):
        # The stored gradient is d(loss)/d(logits) for grad_output 1: rescale it in place, hence only once.
        grad, ctx.grad = ctx.grad, None
        if grad is None:
            raise RuntimeError("cross_entropy (Triton): backward can run only once per forward")
        # A kernel, not grad.mul_(dloss): that (a 0-dim fp32 factor on a 16-bit gradient) ran as torch's generic
        # elementwise kernel, most of the backward; on an H200 fwd+bwd at 4096 × 100277 bf16 went from 2.41 ms to
        # 1.54 (kernels.py --bench, 2026-12-04).
        factor = dloss.reshape(-1).float()  # [N] for reduction="none" (possibly an expanded view), else [1]
        factor = (factor if ctx.later is None else factor * ctx.later).contiguous()  # fp16: 1/n_valid applied here
        N, V = grad.numel() // grad.shape[-1], grad.shape[-1]
        BLOCK_V = min(triton.next_power_of_2(V), MAX_BLOCK_V)
        _cross_entropy_bwd[(N, triton.cdiv(V, BLOCK_V))](grad, factor, V, int(factor.numel() > 1), BLOCK_V=BLOCK_V,
                                                         num_warps=8)
        return grad, None, None, None, None, None


@torch.compiler.disable  # graph break around the Triton launch, as for the norms
def _cross_entropy_triton(logits, target, ignore_index, reduction, inplace_grad):
    needs_grad = logits.requires_grad and torch.is_grad_enabled()
    return CrossEntropyFn.apply(logits, target, ignore_index, reduction, inplace_grad, needs_grad)


def cross_entropy(logits, target, ignore_index=-100, reduction="mean", inplace_grad=False, backend="auto"):
    """Cross-entropy of logits [..., V] (fp32/bf16/fp16) against integer targets [...], like F.cross_entropy.

    reduction: "mean" (over rows whose target is not ignore_index; nan if there are none, as in torch), "sum",
    or "none" (per-row losses of shape [...]). The loss comes back in fp32 whatever the logits' dtype (the torch
    path: fp64 for fp64 logits), as F.cross_entropy under autocast: a bf16 loss would round the logged value to
    1/32 near 6. With fp16 logits the Triton path stores softmax − onehot unscaled and applies 1/n_valid in the
    backward with the incoming gradient, so that a loss scaler's factor arrives before the one rounding: p/n_valid
    alone falls below fp16's range at realistic N·V.

    inplace_grad (Triton path only): write the gradient into the logits' own storage instead of a new buffer.
    This saves one [N, V] buffer but overwrites the caller's logits during the forward, so it is only safe when
    nothing else reads them afterwards, e.g. logits = head(h), whose matmul backward needs h and W, not the
    logits. (An autograd node that saved the logits raises at backward instead of reading gradients.)
    The backward of the Triton path rescales its stored gradient in place, so it runs once per forward.

    Targets outside [0, V) other than ignore_index make the torch path raise (F.cross_entropy: IndexError on
    CPU) and the reference too (gather: RuntimeError on CPU; both a device-side assert on CUDA); the Triton path does not check them (that would cost a device sync),
    it reads nothing out of bounds and returns a NaN loss for those rows.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross_entropy: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"cross_entropy: target shape {tuple(target.shape)} != logits shape without the "
                         f"vocabulary dim {tuple(logits.shape[:-1])}")
    if _use_triton(logits, backend):
        return _cross_entropy_triton(logits, target, ignore_index, reduction, inplace_grad)
    # Off the Triton path: torch's fused log-softmax + NLL, the same maths as cross_entropy_ref in one kernel
    # (about 2x faster on a CPU, where the vocabulary-sized softmax dominates a small model's step).
    loss = F.cross_entropy(_up(logits).reshape(-1, logits.shape[-1]), target.reshape(-1).long(),
                           ignore_index=ignore_index, reduction=reduction)  # int32 targets, as the Triton path
    return loss.view(target.shape) if reduction == "none" else loss


# ----------------------------------------------------------------------------------------------------------
# Benchmark: python kernels.py --bench

def _bf16_leaves(*shapes):
    return tuple(torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes)


def _ce_inputs(N, V):
    return *_bf16_leaves((N, V)), torch.randint(V, (N,), device="cuda")


def _bench_cases():
    """Yield (op, shape, make_inputs, providers): providers map a name to a function of the inputs, Triton
    first. Each provider gets fresh inputs, so an in-place gradient never leaks into the next one."""
    for rows in (4096, 16384):
        for D in (256, 384, 768, 1024, 4096):
            inputs = functools.partial(_bf16_leaves, (rows, D), (D,), (D,))  # x, weight, bias
            yield "rms_norm", f"{rows}x{D}", inputs, {
                "triton": lambda x, w, b: rms_norm(x, w, backend="triton"),
                "reference": lambda x, w, b: rms_norm_ref(x, w),
                "F.rms_norm": lambda x, w, b: F.rms_norm(x, w.shape, w, 1e-6)}
            for g in (1, 6, 12):
                if D % g:
                    continue
                fused = ({"F.layer_norm": lambda x, w, b: F.layer_norm(x, w.shape, w, b)} if g == 1 else
                         {"F.group_norm": lambda x, w, b, g=g: F.group_norm(x, g, w, b)})  # grouped LN of (M, D)
                yield f"layer_norm g={g}", f"{rows}x{D}", inputs, {
                    "triton": lambda x, w, b, g=g: layer_norm(x, w, b, g, backend="triton"),
                    "reference": lambda x, w, b, g=g: layer_norm_ref(x, w, b, g), **fused}
    for N in (4096, 8192):
        for V in (32768, 100277):
            # Each provider reads a view of the leaf logits, as a model's head output is not a leaf: autograd then
            # takes the in-place gradient as the leaf's .grad as it is (on the leaf itself, it would copy it)
            yield "cross_entropy", f"{N}x{V}", functools.partial(_ce_inputs, N, V), {
                "triton": lambda z, t: cross_entropy(z.view_as(z), t, backend="triton"),
                "triton inplace": lambda z, t: cross_entropy(z.view_as(z), t, inplace_grad=True, backend="triton"),
                "F.cross_entropy": lambda z, t: F.cross_entropy(z.view_as(z), t)}


def _measure(fn, inputs):
    """do_bench (median, 20% and 80% quantiles, ms) of fwd and of fwd+bwd, the peak memory (MiB) that one
    fwd+bwd allocates beyond what was allocated before it, and do_bench_cudagraph's fwd+bwd (the same quantiles;
    None, with the reason printed, if the call cannot be captured in a CUDA graph)."""
    from triton.testing import do_bench, do_bench_cudagraph

    leaves = [t for t in inputs if t.requires_grad]
    with torch.no_grad():
        dy = torch.randn_like(fn(*inputs))
    fwd = do_bench(lambda: fn(*inputs), quantiles=[0.5, 0.2, 0.8])
    fwd_bwd = do_bench(lambda: fn(*inputs).backward(dy), quantiles=[0.5, 0.2, 0.8], grad_to_none=leaves)
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn(*inputs).backward(dy)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20
    try:
        graph = do_bench_cudagraph(lambda: fn(*inputs).backward(dy), grad_to_none=leaves, quantiles=[0.5, 0.2, 0.8])
    except Exception as e:  # a capture error: report it and go on with the other rows
        print(f"cuda graph: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        graph = None
    return fwd, fwd_bwd, peak, graph


def _ms(q):
    return f"{q[0]:.3f} ({q[1]:.3f}-{q[2]:.3f})"


def _print_table(header, rows):
    """One line per (case, provider); each torch provider's ratios compare it with the Triton row of its case."""
    print(header)
    print("speed = torch ms / triton ms (>1: Triton faster); mem = triton peak / torch peak (<1: Triton smaller)")
    print("the fwd of Triton's cross-entropy includes writing the gradient; peak = fwd+bwd beyond the inputs; "
          "graph = fwd+bwd replayed from a CUDA graph (GPU time, no host launch cost)")
    fmt = "{:<16} {:<12} {:<16} {:>22} {:>6} {:>22} {:>6} {:>9} {:>5} {:>22} {:>6}"
    title = fmt.format("op", "shape", "provider", "fwd ms (p20-p80)", "speed", "fwd+bwd ms (p20-p80)", "speed",
                       "peak MiB", "mem", "graph fwd+bwd ms", "speed")
    print(title)
    print("-" * len(title))
    triton_rows = {(r["op"], r["shape"]): r for r in rows if r["provider"] == "triton"}
    for r in rows:
        t = triton_rows[r["op"], r["shape"]]
        graphs = r["graph_fwd_bwd_ms"] and t["graph_fwd_bwd_ms"]
        ratios = ("", "", "", "") if r["provider"].startswith("triton") else (
            f"{r['fwd_ms'][0] / t['fwd_ms'][0]:.2f}", f"{r['fwd_bwd_ms'][0] / t['fwd_bwd_ms'][0]:.2f}",
            f"{t['peak_mib'] / r['peak_mib']:.2f}",
            f"{r['graph_fwd_bwd_ms'][0] / t['graph_fwd_bwd_ms'][0]:.2f}" if graphs else "")
        print(fmt.format(r["op"], r["shape"], r["provider"], _ms(r["fwd_ms"]), ratios[0], _ms(r["fwd_bwd_ms"]),
                         ratios[1], f"{r['peak_mib']:.1f}", ratios[2],
                         _ms(r["graph_fwd_bwd_ms"]) if r["graph_fwd_bwd_ms"] else "n/a", ratios[3]))


def bench(json_path=None):
    """Triton vs torch eager on bf16 at realistic sizes, measured side by side in one run."""
    if not torch.cuda.is_available():
        print("kernels.py --bench needs a CUDA GPU; none is available here, so there is nothing to measure.")
        return
    if not HAS_TRITON:
        print(f"kernels.py --bench needs triton, which failed to import: {TRITON_ERROR}")
        return
    machine = dict(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda, torch=torch.__version__,
                   triton=triton.__version__)
    rows = []
    for op, shape, make_inputs, providers in _bench_cases():
        for provider, fn in providers.items():
            fwd, fwd_bwd, peak, graph = _measure(fn, make_inputs())
            rows.append(dict(op=op, shape=shape, provider=provider, fwd_ms=fwd, fwd_bwd_ms=fwd_bwd,
                             peak_mib=peak, graph_fwd_bwd_ms=graph))
            torch.cuda.empty_cache()
    _print_table(" | ".join(f"{k} {v}" for k, v in machine.items()), rows)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(dict(machine=machine, rows=rows), f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kernels.py", allow_abbrev=False,
                                     description="Generic Triton kernels of glassbox (see the docstring).")
    parser.add_argument("--bench", action="store_true", help="time Triton vs torch eager (needs a CUDA GPU)")
    parser.add_argument("--bench-json", metavar="PATH", help="run the benchmark and also write its rows as JSON")
    parser.error = lambda message: parser.exit(2, f"{parser.prog}: error: {message}\n")  # one line, exit 2
    args = parser.parse_args(argv)
    if args.bench_json:  # checked before the benchmark, not after minutes of it
        folder = os.path.dirname(os.path.abspath(args.bench_json))
        if os.path.isdir(args.bench_json) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            parser.exit(1, f"{parser.prog}: error: --bench-json {args.bench_json}: cannot write there\n")
    if args.bench or args.bench_json:
        bench(args.bench_json)
    else:
        parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
