"""protot.py — ProtoT, the Prototype Transformer, in one file.

Paper: "Prototype Transformer: towards language model architectures interpretable by design",
Y. Yordanov et al., arXiv 2602.11852 (ICML 2026). Official code: github.com/YDYordanov/prototype_transformer.
Spec used here: shared/papers/protot.md (the mixer maths is the official code's `ProtoBroadcastMixerUpgraded`).

ProtoT is a LLaMA-3-style decoder (pre-RMSNorm, SwiGLU FFN, tied head, no positional encoding) whose
self-attention is replaced by a *prototype mixer*: R learnable prototypes P_k per layer define R channels;
every token writes into the channels, every token reads a convex mix of the channels' past summaries.
With x̃_t = RMSNorm(h_t) (the block's pre-norm):

    (1) write gate   w_t = softmax_k( <x̃_t, P_k> / |τ_w| )                       over prototypes, not tokens
    (2) value        v_t = V x̃_t   (V: d -> d/2);  layers 0, 1: v_t <- ½ v_t + ½ DWConv5(v)_t   (causal)
    (3) state        N_t = β ⊙ N_{t-1} + (1-β) ⊙ w_t v_tᵀ,   M_t = β ⊙ M_{t-1} + (1-β) ⊙ w_t,   β_k = σ(γ_k)
    (4) prefix mean  PM_{t,k} = N_{t-1,k} / max(M_{t-1,k}, 1e-6)          strictly past-only, PM_0 = 0, fp32
    (5) read gate    ρ_t = softmax_k( <W_r x̃_t, P_k> / |τ_r| )                  layer 0: ρ_t = w_t (shared)
    (6) output       y_t = α · U( Σ_k ρ_{t,k} PM_{t,k} )                          (U: d/2 -> d, α init 1)

Eqs. (3)-(6) between the gates and U are the core op `prefix_mean_read(w, v, ρ, β) -> Σ_k ρ_tk PM_tk`, here in three
forms: the recurrence as defined, a chunked torch form (matmuls within chunks, the state carried across chunks,
decay factors exp((t-1-s)·ln β), the past-only lag, so nothing overflows), and Triton kernels (forward and
backward; they never store a [B, T, R, d_v] tensor, and the forward carries the state across chunks as a parallel
scan: 1/16 of the dependent steps of a loop over the chunks, on 8 times its programs). Generation uses the
recurrence: per layer a cache (N, M, the conv's last 4 values) and an O(1) step per token.

What differs from the official code, and why
  * The EMA is exact at every length. The official code computes the discounted sums as
    β^t Σ_{s≤t} u_s / (β^s + 1e-12) with a cumsum; as β^t nears ~1e-12 the prefix mean goes wrong, then collapses
    to 0 (β = 0.9: off by over 1 % past ~230 tokens, below 1e-3 of the exact value from ~470; β = 0.5: past ~35,
    from ~75). `--ema official` reproduces that shortcut
    to match the paper's numbers; tests/test_protot_op.py::test_official_shortcut_collapses shows where it fails
    and the exact scan does not. Every figure in the README was measured with `--ema exact` (spec §9.1).
  * Layer 0 reads with its write gate and has no W_r (the official code builds an unused one; the parameter
    count here is d² + 1 smaller: W_r and τ_r).
  * Data: packed windows of the token stream (common.get_batch) instead of one padded document per example;
    the embedded corpus is 38 long plays, for which one-document-per-example would leave 34 examples. There is
    no flag for the padded layout and no <bos> (spec §9.5 asks for both as switches).
  * Tokenizer: cl100k compacted to the ids seen in training (offline, and a small softmax on CPU), not the
    paper's 16k lowercased BPE; perplexities, and the --max-tokens budget of --dataset fineweb-edu, are in
    cl100k tokens and not comparable with the paper's 90.5 / 78.7.
  * Perplexity is token-weighted over the whole val split (every token predicted once); the official metric,
    exp of the mean of per-batch means, is not reported (spec §9.6 asks for both).
  * A budget of --max-iters steps (warmup + cosine), evaluated every --eval-interval steps, not 10 epochs. As in
    the official run_clm.py, the final evaluation and every analysis use the best evaluation's weights (the
    checkpoint keeps them beside the last ones, which --resume continues), and the log names their step. Its
    early stopping, at the first epoch whose dev perplexity rises, is `--early-stop 1`; the default is 0 (off):
    an evaluation here is not an epoch but --eval-iters random val batches, noisy enough that one worse
    estimate would stop a run that still improves, and the CPU preset's four evaluations would cut its cosine
    decay, which gives the last gains. The best-weights reload keeps the paper's model selection without that.
    A GPU default run (10,000 steps × 32 × 256 = 81.9M tokens) on the embedded plays (1.18M training tokens) is
    about 69 epochs; `--early-stop N` (N evaluations without a new best) ends it once it overfits, and
    `--dataset fineweb-edu` (online) is closer to the paper's data.
  * Warmup rises linearly from lr/warmup_steps, not from 1e-8 × lr (the official start factor): a simpler
    schedule that differs only over the first 2% of steps.
  * Labelling scans --label-windows contiguous val windows of 32 tokens (1024; 512 in the CPU preset), not
    4,000 dev sequences: the embedded val split is one stream.
  * Sampling is spec §5.5's (temperature 0.8, top-k 40, top-p 0.95, repetition penalty 1.05, no-repeat 4-gram,
    each a flag) with Hugging Face generate()'s semantics and order, the prompt counted in the penalty and the
    n-grams; no figure here scores the samples (the paper's Elo needs an LLM judge, and offline there is none).
  * Robustness reports JS, Spearman rank correlation, top-10 overlap and top-1 agreement (spec §5.4), means over
    the pairs. The paper's metric code is not public, so its Spearman's support is not known: here it ranks the
    whole (compacted) vocabulary, ties averaged, and JS uses the natural log (the paper's base is not stated). The
    slices are five of this corpus (typo, synonym, punctuation, contraction, casing), not the paper's seven
    datasets, nor its semantic interventions; punctuation keeps a line's final mark, so that clean and perturbed
    predict after the same token.
  * Not switchable, though spec §9 asks: force_write / force_read clamping is not exposed, as no analysis here
    clamps (§9.9); the head is always tied, as in the reproduction command (§9.12).
  * Not here: GLUE fine-tuning (spec §5.5, §9.9: its hyperparameters are unknown, and its data is online only).
  * Predict-and-consolidate (spec §1.1, §8.4: "the read gate fires for a concept one token before the write
    gate") has no published measure; here, on the labelling windows, per layer that reads with its own gate:
    the Pearson correlation of ρ_tk with w_(t+ℓ)k over every (window, t), per prototype, for ℓ = -2..2, its mean
    over prototypes and the share of prototypes that peak at ℓ = +1 (gate_lag; in the log, the JSON and the
    report).
  * Smaller choices: RMSNorm eps 1e-6 (nn.RMSNorm's default is ~1.2e-7); the conv exists only in the layers
    that use it; an intervention's perplexity change is measured on 64 val windows, not on the prompt
    sentences; prototype cards rank contexts by mean token (not word) activation; with `--ema official` the
    generation cache holds the exact state, so cached decoding matches the shortcut only where it is still exact.
Following the spec: R = 32, d_v = d/2, β init 0.9, τ_w = 3 in layer 0 and 1 elsewhere, α = 1,
SwiGLU hidden floor(2.7·d/16)·16, dropout 0.1 (embedding, FFN hidden, both residual branches), AdamW with weight
decay 0.1 on matrices but not on P, γ, τ, α or norms, 2% warmup then cosine to 0.1x, no gradient clipping.

Commands
    python protot.py --layers 6                  # train, evaluate, analyse, write out/protot/report.html
                                                 # (no GPU: a CPU preset of about 5 minutes, announced)
    python protot.py --compare                   # ProtoT and the attention baseline, same batches: ppl ratio
    python protot.py --mixer attention           # the LLaMA baseline (RoPE, causal SDPA), same block otherwise
    python protot.py --no-train --find-prototype woman            # rank (layer, prototype) by masking effect,
                                                                  # with a split half: picked on a random half
                                                                  # of the prompts, measured on the other half
    python protot.py --no-train --intervene 3:7 --mode write-mask --target woman
    python protot.py --no-train --sample "HAMLET:\n"              # generation with the O(1) cache
    python protot.py --bench                     # tokens/s vs context, decode ms/token, scan kernel vs chunked
    python protot.py --dataset fineweb-edu --max-tokens 250000000 # the paper's data (online)
    python protot.py --early-stop 1              # the paper's early stopping: at the first evaluation with no new best
    torchrun --standalone --nproc_per_node=8 protot.py           # DDP

Expected (CPU preset, 2 cores, 2026-12-01): `python protot.py --layers 6` takes about 5 minutes, the loss falls
from ~7.2 to ~5.7 and val perplexity ends near 436 (cl100k compacted to 19,447 ids, 655k training tokens).
"""
from __future__ import annotations

import base64
import contextlib
import datetime
import html
import io
import json
import math
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Literal, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl

    HAS_TRITON, TRITON_ERROR = True, None
except ImportError as err:  # no Triton (e.g. macOS): the module still imports and the torch forms work

    class _NoTriton:  # stand-ins so the kernel definitions below still parse; they are never launched
        jit = staticmethod(lambda fn: fn)
        constexpr = None

    HAS_TRITON, TRITON_ERROR = False, err
    triton = tl = _NoTriton

try:  # generic Triton kernels (kernels.py beside this file); a copied-out script falls back to plain torch
    from kernels import RMSNorm, cross_entropy
except ImportError:
    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-6, backend="auto"):
            super().__init__()
            self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

        def forward(self, x):
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def cross_entropy(logits, target, ignore_index=-100, reduction="mean", inplace_grad=False, backend="auto"):
        return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction)


# -----------------------------------------------------------------------------
# Config


@dataclass
class Config:
    # model (spec §1-2; the paper's small configuration)
    mixer: Literal["proto", "attention"] = field(default="proto", metadata={"help": "prototype mixer or the LLaMA baseline"})
    layers: int = field(default=6, metadata={"help": "transformer blocks"})
    d_model: int = field(default=256, metadata={"help": "model width d"})
    n_protos: int = field(default=32, metadata={"help": "prototypes R per layer"})
    heads: int = field(default=4, metadata={"help": "attention heads (baseline only)"})
    value_dim: Literal["half", "full"] = field(default="half", metadata={"help": "d_v = d/2 (paper) or d"})
    ema: Literal["exact", "official"] = field(default="exact", metadata={"help": "exact EMA, or the official b^s cumsum shortcut"})
    shared_routing: bool = field(default=True, metadata={"help": "layer 0 reads with its write gate"})
    conv_layers: int = field(default=2, metadata={"help": "first layers whose values get the causal conv"})
    dropout: float = field(default=0.1, metadata={"help": "dropout (embedding, FFN hidden, residual branches)"})
    # data (common.py)
    dataset: str = field(default="shakespeare", metadata={"help": "shakespeare | tinystories | fineweb-edu | PATH"})
    tokenizer: Literal["cl100k", "gpt2", "bytes"] = field(default="cl100k", metadata={"help": "tokenizer"})
    compact: str = field(default="train", metadata={"help": "vocabulary compaction: none | train | N"})
    max_tokens: Optional[int] = field(default=None, metadata={"help": "training-token budget of the corpus"})
    cache_dir: Optional[str] = field(default=None, metadata={"help": "token cache folder"})
    # training
    preset: Literal["auto", "cpu", "paper"] = field(default="auto", metadata={"help": "auto: paper on a GPU, cpu otherwise"})
    batch_size: int = field(default=32, metadata={"help": "global batch (sequences per step, all ranks)"})
    ctx: int = field(default=256, metadata={"help": "training context length"})
    lr: float = field(default=2e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine floor as a fraction of lr"})
    warmup_frac: float = field(default=0.02, metadata={"help": "warmup as a fraction of max_iters"})
    max_iters: int = field(default=10000, metadata={"help": "optimizer steps"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay on matrices"})
    grad_clip: float = field(default=0.0, metadata={"help": "max gradient norm (0: off, as in the paper)"})
    eval_interval: int = field(default=500, metadata={"help": "steps between evaluations and checkpoints"})
    early_stop: int = field(default=0, metadata={
        "help": "stop after this many evaluations without improvement (0: off; 1: the paper's rule)"})
    eval_iters: int = field(default=20, metadata={"help": "val batches per evaluation"})
    log_interval: int = field(default=50, metadata={"help": "steps between log lines"})
    seed: int = field(default=1337, metadata={"help": "random seed"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N | mps"})
    dtype: Literal["auto", "float32", "bfloat16"] = field(default="auto", metadata={"help": "auto: bf16 autocast on CUDA GPUs with native bf16 (sm_80+), else float32"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model"})
    kernels: Literal["auto", "triton", "torch"] = field(default="auto", metadata={"help": "Triton kernels on CUDA (auto)"})
    out_dir: str = field(default="out/protot", metadata={"help": "checkpoints, logs and reports"})
    resume: bool = field(default=False, metadata={"help": "continue from out_dir's checkpoint"})
    train: bool = field(default=True, metadata={"help": "train (--no-train: load out_dir's checkpoint)"})
    # analyses (the default run does all that apply)
    compare: bool = field(default=False, metadata={"help": "train ProtoT and attention on the same batches, print the ppl ratio"})
    labels: bool = field(default=True, metadata={"help": "prototype labelling (top contexts, half-lives)"})
    label_windows: int = field(default=1024, metadata={"help": "val windows of 32 tokens scanned for labelling"})
    intervene: str = field(default="", metadata={"help": "LAYER:PROTO[,LAYER:PROTO...] to intervene on"})
    mode: Literal["write-mask", "read-mask", "reinit"] = field(default="write-mask", metadata={"help": "intervention"})
    target: str = field(default="woman", metadata={"help": "target word of --intervene"})
    prompts: Optional[str] = field(default=None, metadata={"help": "file of prompt sentences (one per line)"})
    find_prototype: str = field(default="auto", metadata={"help": "WORD: rank every (layer, prototype) by masking effect; auto: --target after training; off"})
    robustness: bool = field(default=True, metadata={"help": "perturbation robustness analysis"})
    sample: Optional[str] = field(default=None, metadata={"help": "generate from this prompt"})
    sample_tokens: int = field(default=200, metadata={"help": "tokens per sample"})
    # the sampler (spec §5.5, Hugging Face generate()'s processors; see sampling_logits)
    temperature: float = field(default=0.8, metadata={"help": "sampling temperature (0: greedy)"})
    top_k: int = field(default=40, metadata={"help": "sample among the k most likely tokens (0: off)"})
    top_p: float = field(default=0.95, metadata={"help": "nucleus: the fewest tokens holding this probability (1: off)"})
    repetition_penalty: float = field(default=1.05, metadata={"help": "divides (multiplies when negative) the logit "
                                                                       "of every token already in the text (1: off)"})
    no_repeat_ngram_size: int = field(default=4, metadata={"help": "never repeat an n-gram of this many tokens (0: off)"})
    bench: bool = field(default=False, metadata={"help": "benchmarks only (tokens/s vs context, decode, kernel)"})
    report: bool = field(default=True, metadata={"help": "write out_dir/report.html (analysis.html with --no-train)"})


# A CPU has ~1/1000 of a GPU's FLOPs: the preset keeps the paper's architecture (layers, R, d_v = d/2, the
# layer-0/1 specials) but shrinks width, context, batch and steps so the whole run takes about 5 minutes.
CPU_PRESET = dict(d_model=128, ctx=128, batch_size=16, max_iters=320, lr=3e-3, eval_interval=80, eval_iters=5,
                  log_interval=20, label_windows=512)
# A checkpoint fixes ARCH_KEYS (asking for other values is an error); --resume and --no-train take every other
# setting from it too unless typed (MERGED_KEYS: all but how and where this invocation runs), so a plain
# --resume continues the run's own schedule, not the preset's or the defaults'.
ARCH_KEYS = ("mixer", "layers", "d_model", "n_protos", "heads", "value_dim", "ema", "shared_routing",
             "conv_layers", "dataset", "tokenizer", "compact", "max_tokens")
# the architecture keys one mixer alone reads: the other's model is the same whatever they say
MIXER_KEYS = {"proto": ("n_protos", "value_dim", "ema", "shared_routing", "conv_layers"), "attention": ("heads",)}
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "repetition_penalty", "no_repeat_ngram_size")  # no weight changes
ANALYSIS_KEYS = ("labels", "label_windows", "intervene", "mode", "target", "prompts", "find_prototype", "robustness",
                 "sample", "sample_tokens") + SAMPLING_KEYS
RUNTIME_KEYS = ("mixer", "preset", "device", "dtype", "compile", "kernels", "out_dir", "cache_dir", "resume", "train",
                "compare", "bench", "report") + ANALYSIS_KEYS
MERGED_KEYS = tuple(f.name for f in fields(Config) if f.name not in RUNTIME_KEYS)
# What --compare's two models must share for their perplexity ratio to compare the mixers: the data and the
# tokens seen (steps of batch × ctx). The learning rate may differ: the paper tunes it per model.
BUDGET_KEYS = ("dataset", "tokenizer", "compact", "max_tokens", "batch_size", "ctx", "step")


def value_width(cfg: Config) -> int:
    """d_v, the width of V and of the prototype states: d/2 (the paper) or d (--value-dim full)."""
    return cfg.d_model // 2 if cfg.value_dim == "half" else cfg.d_model


# -----------------------------------------------------------------------------
# Core op: prefix_mean_read(w, v, rho, beta) -> y,   y_t = Σ_k ρ_tk · N_{t-1,k} / max(M_{t-1,k}, eps)

# Each token t spreads one unit of write mass over R prototype channels (w_t, a softmax over k), every channel keeps
# an exponentially discounted average of the values written to it, and the token reads a convex mix (ρ_t) of the
# channel averages built from the tokens *before* it. Per batch row, with β_k = σ(γ_k) ∈ (0, 1):
#
#     N_t = β ⊙ N_{t-1} + (1-β) ⊙ w_t v_tᵀ          N: [R, dv]      N_{-1} = 0
#     M_t = β ⊙ M_{t-1} + (1-β) ⊙ w_t               M: [R]          M_{-1} = 0
#     PM_{t,k} = N_{t-1,k} / max(M_{t-1,k}, 1e-6)   (strictly past-only: PM_0 = 0)
#     y_t = Σ_k ρ_{t,k} PM_{t,k}
#
# Shapes: w, ρ [B, T, R]; v, y [B, T, dv]; β [R]. State maths in fp32 (fp64 for fp64 inputs); y in v's dtype.
#
# The same op in three forms (fla's naive → chunk chain), plus the official shortcut and the decode step:
#   1. prefix_mean_read_recurrent  the recurrence above, a Python loop over prefix_mean_step (the readable truth)
#   2. prefix_mean_read_chunked    pure torch, chunked linear attention: the CPU training path (autograd)
#   3. PrefixMeanRead              Triton kernels, forward and backward, never storing a [B, T, R, dv] tensor
#   -  prefix_mean_read_official   the official code's β^s-cumsum shortcut, kept only to show it collapsing (§1.3)
#   -  prefix_mean_step            O(1)-per-token decode: read the state, then write token t into it (§4)
#
# Dispatch (`backend` in PREFIX_MEAN_BACKENDS): "auto" = Triton when the tensors are on CUDA, triton imports and
# R·d_v fits the kernel's tiles (_prefix_mean_fits), else the chunked torch form; "triton" = Triton (on CPU only
# under TRITON_INTERPRET=1); "torch" = chunked; "recurrent" = form 1.

MASS_EPS = 1e-6  # clamp on the channel mass M before dividing: near-empty channels read ~0 instead of blowing up
PREFIX_MEAN_BACKENDS = ("auto", "triton", "torch", "recurrent")


def _state_dtype(*tensors):
    """The precision of the state maths: fp32, or fp64 when any input is fp64 (so tests can build a float64 truth)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


# ----------------------------------------------------------------------------------------------------------
# 1. The recurrence (the readable truth) and the O(1) decode step

def prefix_mean_init_state(B, R, dv, device=None, dtype=torch.float32):
    """Empty decode state (N [B, R, dv], M [B, R]): R·(dv+1) floats per sequence, whatever the context length."""
    return torch.zeros(B, R, dv, device=device, dtype=dtype), torch.zeros(B, R, device=device, dtype=dtype)


def prefix_mean_step(state, w_t, v_t, rho_t, beta):
    """One decode step (spec §4): read the state *before* token t, then write token t into it.

        y_t = Σ_k ρ_{t,k} N_k / max(M_k, eps)                     (read first: past-only)
        N  <- β ⊙ N + (1-β) ⊙ w_t v_tᵀ,   M <- β ⊙ M + (1-β) ⊙ w_t   (then write)

    state = (N [B, R, dv], M [B, R]) in fp32 (from prefix_mean_init_state); w_t, rho_t [B, R]; v_t [B, dv];
    beta [R]. Returns (y_t [B, dv] in v_t's dtype, new state)."""
    N, M = state
    out_dtype = v_t.dtype
    w_t, v_t, rho_t, beta = (x.to(N.dtype) for x in (w_t, v_t, rho_t, beta))
    prefix_mean = N / M.clamp_min(MASS_EPS)[..., None]  # (B, R, dv): PM_{t,k}
    y_t = torch.einsum("bk,bkd->bd", rho_t, prefix_mean)
    N = beta[:, None] * N + ((1 - beta) * w_t)[..., None] * v_t[:, None, :]
    M = beta * M + (1 - beta) * w_t
    return y_t.to(out_dtype), (N, M)


def prefix_mean_read_recurrent(w, v, rho, beta, state=None):
    """The op exactly as defined, one token at a time (autograd gives its gradients):

        for t = 0 .. T-1:   y_t = Σ_k ρ_{t,k} N_{t-1,k} / max(M_{t-1,k}, eps)
                            N_t = β ⊙ N_{t-1} + (1-β) ⊙ w_t v_tᵀ,   M_t = β ⊙ M_{t-1} + (1-β) ⊙ w_t

    O(T) sequential steps: the ground truth for the other forms, not a training path. Given a decode `state`
    (N_{-1}, M_{-1}) it starts from there instead of empty and returns (y, (N_{T-1}, M_{T-1})): cached generation."""
    cached = state is not None
    if not cached:
        state = prefix_mean_init_state(w.shape[0], w.shape[-1], v.shape[-1], w.device, _state_dtype(w, v, rho, beta))
    ys = []
    # unbind, not w[:, t]: the backward of T selects would build T full-size zero gradients
    for w_t, v_t, rho_t in zip(w.unbind(1), v.unbind(1), rho.unbind(1)):
        y_t, state = prefix_mean_step(state, w_t, v_t, rho_t, beta)
        ys.append(y_t)
    y = torch.stack(ys, dim=1)  # (B, T, dv)
    return (y, state) if cached else y


# ----------------------------------------------------------------------------------------------------------
# 2. The chunked form (pure torch; the CPU training path)

def prefix_mean_read_chunked(w, v, rho, beta, chunk=64):
    """The same op as linear attention over chunks of C tokens, with per-channel decay and no division by β^s.

    Rescaling: (1-β) multiplies every write of both N and M, so it cancels in N/M except at the clamp. This form
    (and the kernels) carries Ñ = N/(1-β), M̃ = M/(1-β) and clamps M̃ at eps/(1-β): the same PM, but ∂β is no
    longer a difference of two terms of size 1/(1-β) (in fp32 that cancellation costs ~4 digits at β = 0.9999).

    Write ρ'_{t,k} = ρ_{t,k} / max(M̃_{t-1,k}, eps/(1-β_k)). Then y_t = Σ_k ρ'_{t,k} Ñ_{t-1,k}: linear attention
    with R-dimensional keys w, queries ρ', values v and a fixed decay β_k per key channel (like retention/GLA).
    Split the sequence into chunks; row i (0 ≤ i < C) of chunk n is token t = nC + i, and S_n = Ñ_{nC-1},
    m_n = M̃_{nC-1} are the state and mass carried into the chunk. Unrolling the recurrence inside a chunk:

        Ñ_{t-1} = β^i ⊙ S_n + Σ_{j<i} D[i,j] ⊙ w_j v_jᵀ      D[i,j,k] = exp((i-1-j) · ln β_k)  for j < i
        M̃_{t-1} = β^i ⊙ m_n + Σ_{j<i} D[i,j] ⊙ w_j                         (0 for j ≥ i)

    D is strictly lower-triangular: that *is* the past-only shift (token j reaches rows i > j only). Its entries
    are exps of non-positive numbers, so they lie in [0, 1]: nothing is divided by β^s, nothing overflows, and
    an underflow to 0 is the correct value. Contracting with ρ':

        y_t = (ρ'_t ⊙ β^i) · S_n + Σ_{j<i} A[i,j] v_j        A[i,j] = Σ_k ρ'_{i,k} D[i,j,k] w_{j,k}
        S_{n+1} = β^C ⊙ S_n + Σ_j β^(C-1-j) ⊙ w_j v_jᵀ,   m_{n+1} likewise with w_j      (a scan over chunks)

    Memory: the carried states are [B, T/C, R, dv]; the intra-chunk scores need a transient [B, T/C, C, C, R]
    (C/dv the size of a [B, T, R, dv] tensor, which is never formed). Cost O(T·(C·R + C·dv + R·dv))."""
    B, T, R = w.shape
    dv = v.shape[-1]
    dt = _state_dtype(w, v, rho, beta)
    C = chunk
    NC = -(-T // C)
    pad = NC * C - T  # zero rows at the end write no mass and read nothing
    w = F.pad(w.to(dt), (0, 0, 0, pad)).view(B, NC, C, R)
    rho = F.pad(rho.to(dt), (0, 0, 0, pad)).view(B, NC, C, R)
    v_ = F.pad(v.to(dt), (0, 0, 0, pad)).view(B, NC, C, dv)
    log_beta = beta.to(dt).log()  # (R,)
    one_minus_beta = 1 - beta.to(dt)  # (R,)

    i = torch.arange(C, device=w.device, dtype=dt)
    lag = i[:, None] - 1 - i[None, :]  # (C, C): (t-1) - s, the steps between a write and a later read
    decay = torch.where((lag >= 0)[..., None], torch.exp(lag.clamp_min(0)[..., None] * log_beta), 0.0)  # (C, C, R)
    decay_in = torch.exp(i[:, None] * log_beta)  # (C, R): β^i, how row i sees the carried state
    decay_out = torch.exp((C - 1 - i)[:, None] * log_beta)  # (C, R): weight of row j in the state leaving

    # Each chunk's own writes into the state it hands on, then the carry across chunks (a scan over NC)
    out = w * decay_out  # (B, NC, C, R)
    own_state = out.transpose(-1, -2) @ v_  # (B, NC, R, dv)
    own_mass = out.sum(2)  # (B, NC, R)
    decay_chunk = torch.exp(C * log_beta)  # (R,): β^C
    state = w.new_zeros(B, R, dv)
    mass = w.new_zeros(B, R)
    states, masses = [], []
    for n in range(NC):
        states.append(state)
        masses.append(mass)
        state = decay_chunk[:, None] * state + own_state[:, n]
        mass = decay_chunk * mass + own_mass[:, n]
    states = torch.stack(states, 1)  # (B, NC, R, dv): S_n = Ñ_{nC-1}
    masses = torch.stack(masses, 1)  # (B, NC, R): m_n = M̃_{nC-1}

    # Mass before each token, then the read weights ρ' = ρ / max(M̃_{t-1}, eps/(1-β)), written per branch: where
    # the clamp bites (M = (1-β)M̃ < eps), ρ' = ρ(1-β)/eps. Never dividing by 1-β keeps a β rounded to 1.0 (γ >= 16.7
    # in fp32: no mass, reads 0) finite with the recurrence's gradient, instead of eps/0 = inf and 0·inf = NaN.
    mass_prev = decay_in * masses[:, :, None, :] + torch.einsum("ijk,bnjk->bnik", decay, w)  # (B, NC, C, R)
    clamped = one_minus_beta * mass_prev < MASS_EPS
    rho_s = torch.where(clamped, rho * one_minus_beta / MASS_EPS, rho / torch.where(clamped, 1.0, mass_prev))

    # y = read of the carried state + intra-chunk linear attention
    scores = torch.einsum("bnik,ijk,bnjk->bnij", rho_s, decay, w)  # (B, NC, C, C): A[i, j]
    y = (rho_s * decay_in) @ states + scores @ v_  # (B, NC, C, dv)
    return y.reshape(B, NC * C, dv)[:, :T].to(v.dtype)


def prefix_mean_read_official(w, v, rho, beta):
    """The official code's shortcut (spec §1.3), for comparison only: discounted sums by a rescaled cumsum,

        S_t = β^t Σ_{s≤t} (1-β) u_s / (β^s + 1e-12)      (exact: S_t = Σ_{s≤t} (1-β) β^(t-s) u_s)

    in fp32 for N (u = w v) and M (u = w), then rolled right by one step (past-only) before the division.
    Once β^t drops below ~1e-12 (t ≈ 262 for β = 0.9) the 1e-12 dominates, S_t collapses towards 0, the mass
    falls under the clamp and the prefix mean reads ~0. Like the official code it builds [B, T, R, dv]."""
    T = w.shape[1]
    b = beta.float()  # (R,)
    b_pow = b ** torch.arange(T, device=w.device, dtype=torch.float32)[:, None]  # (T, R): β^t
    w32 = w.float()
    N = torch.cumsum(((1 - b) * w32 / (b_pow + 1e-12))[..., None] * v.float()[:, :, None, :], 1) * b_pow[..., None]
    M = torch.cumsum((1 - b) * w32 / (b_pow + 1e-12), 1) * b_pow  # (B, T, R)
    N_prev = F.pad(N[:, :-1], (0, 0, 0, 0, 1, 0))  # (B, T, R, dv): rolled right by one, zero at t = 0
    M_prev = F.pad(M[:, :-1], (0, 0, 1, 0))  # (B, T, R)
    prefix_mean = N_prev / M_prev.clamp_min(MASS_EPS)[..., None]
    return torch.einsum("btk,btkd->btd", rho.float(), prefix_mean).to(v.dtype)


# ----------------------------------------------------------------------------------------------------------
# 3. Triton kernels
#
# The chunked form again (rescaled sums Ñ, M̃ and the clamp at eps/(1-β)), with chunks of BT = 16 tokens, small
# enough for the [BT, BT, R] decay tensor to stay in registers, and R padded to RP = max(16, next power of two)
# with masks. Six kernels; none stores anything of size [B, T, R, dv]:
#
#   forward   _prefix_mean_fwd_chunk  grid (NC, B): each chunk's discounted sums, stored one slot on [B, NC, R, dv]
#             _prefix_mean_fwd_carry  grid (R·dv/128 + R/128, B): in place, S_n = β^BT S_{n-1} + slot_n, m_n
#                                     likewise, as a scan over up to 16 chunks a step (tl.associative_scan); a
#                                     single loop over the chunks would give batch 1 only d_v/32 programs, each
#                                     walking T/16 dependent steps (an H200 timed that form's forward at batch 1
#                                     at no more than 3.3M tokens/s, and this one's at 7.2M at ctx 64k)
#             _prefix_mean_fwd_read   grid (NC, B): intra-chunk maths + read of S_n, store y and M̃_{t-1} [B, T, R]
#   backward  _prefix_mean_bwd_read   grid (NC, B): ∂ρ, ∂M̃_{t-1} and the clamp's share of ∂β
#             _prefix_mean_bwd_state  grid (dv blocks, B): reverse scan, store the adjoints dS_{n+1}, dm_{n+1}
#             _prefix_mean_bwd_write  grid (NC, B): ∂w, ∂v and the decays' share of ∂β
#
# Backward, with g_t = ∂L/∂y_t, D_t = max(M̃_{t-1}, c), c = eps/(1-β), ρ' = ρ/D and y_t = Σ_k ρ'_{t,k} Ñ_{t-1,k}:
#   ∂ρ'_{t,k} = g_t · Ñ_{t-1,k}     ∂ρ_{t,k} = ∂ρ'_{t,k} / D_{t,k}     ∂M̃_{t-1,k} = -ρ'_{t,k} ∂ρ_{t,k}  where M̃ ≥ c
#   and Ñ_{t-1,k} receives ρ'_{t,k} g_t. Ñ_{t-1} and M̃_{t-1} are sums of discounted writes β^lag w_j v_j and
#   β^lag w_j, so the write side is linear attention run backwards: inside a chunk through D[i,j,k], across
#   chunks through the adjoints of the carried state, dS_n = β^BT dS_{n+1} + Σ_i β^i ρ'_i g_iᵀ (dm_n likewise
#   with ∂M̃ in place of ρ' g). ∂β has two parts:
#     decays  every factor's derivative, d(β^lag)/dβ = lag β^(lag-1), times the gradient flowing through it, per
#             chunk, so lags stay ≤ BT (no long fp32 running sum; torch adds up the [B, NC, R] partials);
#     clamp   where M̃ < c the read is PM = (1-β) Ñ / eps, which adds -Σ_t ρ_{t,k} ∂ρ'_{t,k} / eps.
#   (Spec §6 gives the same gradients for the unscaled N, M as a token-by-token reverse scan.)

_BT = 16  # tokens per chunk in the kernels
_CARRY_CB, _CARRY_TILE = 16, 128  # the carry's longest scan step (chunks) and elements per program


@triton.jit
def _prefix_mean_fwd_chunk(
    W,  # pointer to the write gates w [B, T, R]
    V,  # pointer to the values v [B, T, DV]
    Beta,  # pointer to the decays β [R] (fp32)
    S,  # pointer to the slots [B, NC, R, DV] (fp32): slot n gets chunk n-1's discounted sum (0 for n = 0)
    Mc,  # pointer to the mass slots [B, NC, R] (fp32), likewise
    T,  # sequence length
    R,  # number of prototype channels
    DV,  # value width
    NC,  # number of chunks, cdiv(T, BT)
    BT: tl.constexpr,  # tokens per chunk
    RP: tl.constexpr,  # R padded to a power of two >= 16
    BDV: tl.constexpr,  # DV padded to a power of two >= 16
):
    n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    j = tl.arange(0, BT)
    k = tl.arange(0, RP)
    d = tl.arange(0, BDV)
    k_ok = k < R
    d_ok = d < DV
    beta = tl.load(Beta + k, mask=k_ok, other=0.5)  # padded channels get a harmless β; their w is 0
    decay_out = tl.exp((BT - 1 - j).to(tl.float32)[:, None] * tl.log(beta)[None, :])  # [BT, RP]: β^(BT-1-j)
    t = (n - 1) * BT + j  # the previous chunk's tokens: none for n = 0, whose slot is the zero initial state
    t_ok = (t >= 0) & (t < T)
    w = tl.load(W + (b * T + t[:, None]) * R + k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
    v = tl.load(V + (b * T + t[:, None]) * DV + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    written = w.to(tl.float32) * decay_out  # [BT, RP]
    # Σ_j β^(BT-1-j) w_j v_jᵀ and Σ_j β^(BT-1-j) w_j over chunk n-1
    chunk = b * NC + n
    tl.store(S + (chunk * R + k[:, None]) * DV + d[None, :],
             tl.dot(tl.trans(written), v.to(tl.float32), input_precision="ieee"), mask=k_ok[:, None] & d_ok[None, :])
    tl.store(Mc + chunk * R + k, tl.sum(written, axis=0), mask=k_ok)


@triton.jit
def _decay_combine(a1, x1, a2, x2):
    """Two steps s -> a·s + x composed: the associative operator of a first-order linear recurrence."""
    return a1 * a2, x1 * a2 + x2


@triton.jit
def _prefix_mean_carry_tile(S, Beta, b, e0, E, DV, NC, BT: tl.constexpr, CB: tl.constexpr, TILE: tl.constexpr):
    """In place over the slots of TILE elements (element e of a row belongs to channel e // DV):
    S_n = β^BT S_{n-1} + slot_n, CB chunks per step, each step a scan along the chunks plus the carry in."""
    e = e0 + tl.arange(0, TILE)
    e_ok = e < E
    beta = tl.load(Beta + e // DV, mask=e_ok, other=0.5)
    decay = tl.broadcast_to(tl.exp(BT * tl.log(beta))[None, :], (CB, TILE))  # β^BT, as the read kernels form it
    c = tl.arange(0, CB)
    carry = tl.zeros([TILE], dtype=tl.float32)  # S_{n0-1}
    for n0 in range(0, NC, CB):
        ptrs = S + (b * NC + n0 + c[:, None]) * E + e[None, :]
        ok = ((n0 + c) < NC)[:, None] & e_ok[None, :]
        decay_in, partial = tl.associative_scan((decay, tl.load(ptrs, mask=ok, other=0.0)), 0, _decay_combine)
        # S_{n0+c} = Σ_{m≤c} β^(BT(c-m)) slot_{n0+m} + β^(BT(c+1)) S_{n0-1}
        state = partial + decay_in * carry[None, :]
        tl.store(ptrs, state, mask=ok)
        carry = tl.sum(tl.where(c[:, None] == CB - 1, state, 0.0), axis=0)


@triton.jit
def _prefix_mean_fwd_carry(
    S,  # pointer to the slots [B, NC, R, DV] (fp32), turned in place into the states S_n = Ñ_{n·BT-1}
    Mc,  # pointer to the mass slots [B, NC, R] (fp32), turned into the masses m_n = M̃_{n·BT-1}
    Beta,  # pointer to the decays β [R] (fp32)
    R,  # number of prototype channels
    DV,  # value width
    NC,  # number of chunks
    BT: tl.constexpr,  # tokens per chunk
    CB: tl.constexpr,  # chunks per scan step
    TILE: tl.constexpr,  # elements of a slot row per program
):
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    state_tiles = tl.cdiv(R * DV, TILE)
    if pid < state_tiles:
        _prefix_mean_carry_tile(S, Beta, b, pid * TILE, R * DV, DV, NC, BT, CB, TILE)
    else:  # the last cdiv(R, TILE) programs of each batch row carry the masses
        _prefix_mean_carry_tile(Mc, Beta, b, (pid - state_tiles) * TILE, R, 1, NC, BT, CB, TILE)


@triton.jit
def _prefix_mean_fwd_read(
    W,  # pointer to the write gates w [B, T, R]
    V,  # pointer to the values v [B, T, DV]
    Rho,  # pointer to the read gates ρ [B, T, R]
    Beta,  # pointer to the decays β [R] (fp32)
    S,  # pointer to the carried states [B, NC, R, DV] (fp32)
    Mc,  # pointer to the carried masses [B, NC, R] (fp32)
    Y,  # pointer to the output y [B, T, DV]
    Mp,  # pointer to the mass before each token M̃_{t-1} [B, T, R] (fp32), saved for the backward
    T,  # sequence length
    R,  # number of prototype channels
    DV,  # value width
    NC,  # number of chunks
    eps,  # MASS_EPS
    BT: tl.constexpr,  # tokens per chunk
    RP: tl.constexpr,  # R padded to a power of two >= 16
    BDV: tl.constexpr,  # DV padded to a power of two >= 16 (a program handles whole value rows)
):
    n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BT)
    k = tl.arange(0, RP)
    d = tl.arange(0, BDV)
    t = n * BT + i
    t_ok, k_ok, d_ok = t < T, k < R, d < DV
    tk = (b * T + t[:, None]) * R + k[None, :]
    tk_ok = t_ok[:, None] & k_ok[None, :]
    w = tl.load(W + tk, mask=tk_ok, other=0.0).to(tl.float32)
    rho = tl.load(Rho + tk, mask=tk_ok, other=0.0).to(tl.float32)
    v = tl.load(V + (b * T + t[:, None]) * DV + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
    chunk = b * NC + n
    state = tl.load(S + (chunk * R + k[:, None]) * DV + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    mass = tl.load(Mc + chunk * R + k, mask=k_ok, other=0.0)
    beta = tl.load(Beta + k, mask=k_ok, other=0.5)
    log_beta = tl.log(beta)
    mass_floor = eps / (1 - beta)  # the clamp on M, rescaled like M̃
    # Decays: β^i for the carried state, D[i,j,k] = β^(i-1-j) for j < i inside the chunk
    decay_in = tl.exp(i.to(tl.float32)[:, None] * log_beta[None, :])  # [BT, RP]
    lag = i[:, None] - 1 - i[None, :]  # [BT, BT]
    decay = tl.where((lag >= 0)[:, :, None],
                     tl.exp(tl.maximum(lag, 0).to(tl.float32)[:, :, None] * log_beta[None, None, :]), 0.0)
    written = decay * w[None, :, :]  # [BT, BT, RP]: row j's discounted write as seen from row i
    # M̃_{t-1} = β^i m_n + Σ_{j<i} D[i,j] w_j, then ρ' = ρ / max(M̃_{t-1}, eps/(1-β))
    mass_prev = decay_in * mass[None, :] + tl.sum(written, axis=1)
    rho_s = rho / tl.maximum(mass_prev, mass_floor[None, :])
    # y_t = (ρ'_t ⊙ β^i) · S_n + Σ_j A[i,j] v_j with A[i,j] = Σ_k ρ'_{i,k} D[i,j,k] w_{j,k}
    scores = tl.sum(rho_s[:, None, :] * written, axis=2)  # [BT, BT]
    y = tl.dot(rho_s * decay_in, state, input_precision="ieee")
    y += tl.dot(scores, v.to(tl.float32), input_precision="ieee")
    tl.store(Y + (b * T + t[:, None]) * DV + d[None, :], y.to(Y.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])
    tl.store(Mp + tk, mass_prev, mask=tk_ok)


@triton.jit
def _prefix_mean_bwd_read(
    W,  # pointer to the write gates w [B, T, R]
    V,  # pointer to the values v [B, T, DV]
    Rho,  # pointer to the read gates ρ [B, T, R]
    Beta,  # pointer to the decays β [R] (fp32)
    S,  # pointer to the carried states [B, NC, R, DV] (fp32)
    Mp,  # pointer to the mass before each token M̃_{t-1} [B, T, R] (fp32)
    DY,  # pointer to the output gradient g [B, T, DV]
    DRho,  # pointer to the read-gate gradient ∂ρ [B, T, R]
    DMp,  # pointer to the mass gradient ∂M̃_{t-1} [B, T, R] (fp32)
    DBeta,  # pointer to the per-chunk partial decay gradients [B, NC, R] (fp32): this kernel writes the clamp part
    T,  # sequence length
    R,  # number of prototype channels
    DV,  # value width
    NC,  # number of chunks
    eps,  # MASS_EPS
    BT: tl.constexpr,  # tokens per chunk
    RP: tl.constexpr,  # R padded to a power of two >= 16
    BDV: tl.constexpr,  # DV padded to a power of two >= 16
):
    n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BT)
    k = tl.arange(0, RP)
    d = tl.arange(0, BDV)
    t = n * BT + i
    t_ok, k_ok, d_ok = t < T, k < R, d < DV
    tk = (b * T + t[:, None]) * R + k[None, :]
    tk_ok = t_ok[:, None] & k_ok[None, :]
    td = (b * T + t[:, None]) * DV + d[None, :]
    td_ok = t_ok[:, None] & d_ok[None, :]
    w = tl.load(W + tk, mask=tk_ok, other=0.0).to(tl.float32)
    rho = tl.load(Rho + tk, mask=tk_ok, other=0.0).to(tl.float32)
    mass_prev = tl.load(Mp + tk, mask=tk_ok, other=0.0)
    v = tl.load(V + td, mask=td_ok, other=0.0).to(tl.float32)
    g = tl.load(DY + td, mask=td_ok, other=0.0).to(tl.float32)
    kd = ((b * NC + n) * R + k[:, None]) * DV + d[None, :]
    state = tl.load(S + kd, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    beta = tl.load(Beta + k, mask=k_ok, other=0.5)
    log_beta = tl.log(beta)
    mass_floor = eps / (1 - beta)
    decay_in = tl.exp(i.to(tl.float32)[:, None] * log_beta[None, :])
    lag = i[:, None] - 1 - i[None, :]
    decay = tl.where((lag >= 0)[:, :, None],
                     tl.exp(tl.maximum(lag, 0).to(tl.float32)[:, :, None] * log_beta[None, None, :]), 0.0)
    written = decay * w[None, :, :]  # [BT, BT, RP]
    clamped = tl.maximum(mass_prev, mass_floor[None, :])
    rho_s = rho / clamped
    # ∂ρ'_{i,k} = g_i · Ñ_{t-1,k} = β^i (g_i · S_{n,k}) + Σ_{j<i} D[i,j,k] w_{j,k} (g_i · v_j)
    g_dot_v = tl.dot(g, tl.trans(v), input_precision="ieee")  # [BT, BT]
    g_dot_s = tl.dot(g, tl.trans(state), input_precision="ieee")  # [BT, RP]
    drho_s = decay_in * g_dot_s + tl.sum(written * g_dot_v[:, :, None], axis=1)
    # ∂ρ = ∂ρ' / D;   ∂M̃_{t-1} = -ρ' ∂ρ where the clamp is not active
    drho = drho_s / clamped
    unclamped = mass_prev >= mass_floor[None, :]
    tl.store(DRho + tk, drho.to(DRho.dtype.element_ty), mask=tk_ok)
    tl.store(DMp + tk, tl.where(unclamped, -rho_s * drho, 0.0), mask=tk_ok)
    # The clamp's part of ∂β: where clamped, PM = (1-β) Ñ / eps
    dbeta = -tl.sum(tl.where(unclamped, 0.0, rho * drho_s), axis=0) / eps
    tl.store(DBeta + (b * NC + n) * R + k, dbeta, mask=k_ok)


@triton.jit
def _prefix_mean_bwd_state(
    Rho,  # pointer to the read gates ρ [B, T, R]
    Mp,  # pointer to the mass before each token M̃_{t-1} [B, T, R] (fp32)
    DMp,  # pointer to the mass gradient ∂M̃_{t-1} [B, T, R] (fp32)
    DY,  # pointer to the output gradient g [B, T, DV]
    Beta,  # pointer to the decays β [R] (fp32)
    DS,  # pointer to the state adjoints [B, NC, R, DV] (fp32): entry n holds dS_{n+1}, the state leaving chunk n
    DMc,  # pointer to the mass adjoints [B, NC, R] (fp32): entry n holds dm_{n+1}
    T,  # sequence length
    R,  # number of prototype channels
    DV,  # value width
    NC,  # number of chunks
    eps,  # MASS_EPS
    BT: tl.constexpr,  # tokens per chunk
    RP: tl.constexpr,  # R padded to a power of two >= 16
    BD: tl.constexpr,  # block of value columns handled by this program
):
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BT)
    k = tl.arange(0, RP)
    d = pid_d * BD + tl.arange(0, BD)
    k_ok = k < R
    d_ok = d < DV
    beta = tl.load(Beta + k, mask=k_ok, other=0.5)
    log_beta = tl.log(beta)
    mass_floor = eps / (1 - beta)
    decay_chunk = tl.exp(BT * log_beta)
    decay_in = tl.exp(i.to(tl.float32)[:, None] * log_beta[None, :])  # [BT, RP]: β^i
    dstate = tl.zeros([RP, BD], dtype=tl.float32)
    dmass = tl.zeros([RP], dtype=tl.float32)
    for r in range(NC):
        n = NC - 1 - r  # walk the chunks backwards
        # Store the adjoint of the state leaving chunk n: it collects the reads of all later chunks
        chunk = b * NC + n
        tl.store(DS + (chunk * R + k[:, None]) * DV + d[None, :], dstate, mask=k_ok[:, None] & d_ok[None, :])
        if pid_d == 0:
            tl.store(DMc + chunk * R + k, dmass, mask=k_ok)
        t = n * BT + i
        t_ok = t < T
        tk = (b * T + t[:, None]) * R + k[None, :]
        tk_ok = t_ok[:, None] & k_ok[None, :]
        rho = tl.load(Rho + tk, mask=tk_ok, other=0.0).to(tl.float32)
        rho_s = rho / tl.maximum(tl.load(Mp + tk, mask=tk_ok, other=0.0), mass_floor[None, :])
        dmass_prev = tl.load(DMp + tk, mask=tk_ok, other=0.0)
        g = tl.load(DY + (b * T + t[:, None]) * DV + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        # dS_n = β^BT dS_{n+1} + Σ_i β^i ρ'_i g_iᵀ,   dm_n = β^BT dm_{n+1} + Σ_i β^i ∂M̃_{t-1}
        read = tl.trans(rho_s * decay_in)  # [RP, BT]
        dstate = decay_chunk[:, None] * dstate + tl.dot(read, g.to(tl.float32), input_precision="ieee")
        dmass = decay_chunk * dmass + tl.sum(decay_in * dmass_prev, axis=0)


@triton.jit
def _prefix_mean_bwd_write(
    W,  # pointer to the write gates w [B, T, R]
    V,  # pointer to the values v [B, T, DV]
    Rho,  # pointer to the read gates ρ [B, T, R]
    Beta,  # pointer to the decays β [R] (fp32)
    S,  # pointer to the carried states [B, NC, R, DV] (fp32): S_n
    Mc,  # pointer to the carried masses [B, NC, R] (fp32): m_n
    Mp,  # pointer to the mass before each token M̃_{t-1} [B, T, R] (fp32)
    DY,  # pointer to the output gradient g [B, T, DV]
    DMp,  # pointer to the mass gradient ∂M̃_{t-1} [B, T, R] (fp32)
    DS,  # pointer to the state adjoints [B, NC, R, DV] (fp32): dS_{n+1}
    DMc,  # pointer to the mass adjoints [B, NC, R] (fp32): dm_{n+1}
    DW,  # pointer to the write-gate gradient ∂w [B, T, R]
    DVal,  # pointer to the value gradient ∂v [B, T, DV]
    DBeta,  # pointer to the per-chunk partial decay gradients [B, NC, R] (fp32): this kernel adds the decay part
    T,  # sequence length
    R,  # number of prototype channels
    DV,  # value width
    NC,  # number of chunks
    eps,  # MASS_EPS
    BT: tl.constexpr,  # tokens per chunk
    RP: tl.constexpr,  # R padded to a power of two >= 16
    BDV: tl.constexpr,  # DV padded to a power of two >= 16
):
    n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    i = tl.arange(0, BT)  # rows of the chunk: as readers they are i, as writers j
    k = tl.arange(0, RP)
    d = tl.arange(0, BDV)
    t = n * BT + i
    t_ok, k_ok, d_ok = t < T, k < R, d < DV
    tk = (b * T + t[:, None]) * R + k[None, :]
    tk_ok = t_ok[:, None] & k_ok[None, :]
    td = (b * T + t[:, None]) * DV + d[None, :]
    td_ok = t_ok[:, None] & d_ok[None, :]
    kd = ((b * NC + n) * R + k[:, None]) * DV + d[None, :]
    kd_ok = k_ok[:, None] & d_ok[None, :]
    w = tl.load(W + tk, mask=tk_ok, other=0.0).to(tl.float32)
    rho = tl.load(Rho + tk, mask=tk_ok, other=0.0).to(tl.float32)
    dmass_prev = tl.load(DMp + tk, mask=tk_ok, other=0.0)
    v = tl.load(V + td, mask=td_ok, other=0.0).to(tl.float32)
    g = tl.load(DY + td, mask=td_ok, other=0.0).to(tl.float32)
    state = tl.load(S + kd, mask=kd_ok, other=0.0)
    dstate = tl.load(DS + kd, mask=kd_ok, other=0.0)
    mass = tl.load(Mc + (b * NC + n) * R + k, mask=k_ok, other=0.0)
    dmass = tl.load(DMc + (b * NC + n) * R + k, mask=k_ok, other=0.0)
    beta = tl.load(Beta + k, mask=k_ok, other=0.5)
    log_beta = tl.log(beta)
    rho_s = rho / tl.maximum(tl.load(Mp + tk, mask=tk_ok, other=0.0), eps / (1 - beta)[None, :])
    # The decays of the forward, and their derivatives in β: d(β^x)/dβ = x β^(x-1)
    fi = i.to(tl.float32)[:, None]  # [BT, 1]
    ddecay_in = tl.where(fi > 0, fi * tl.exp(tl.maximum(fi - 1, 0.0) * log_beta[None, :]), 0.0)  # of β^i
    out_lag = BT - 1 - fi  # [BT, 1]: steps from row j to the end of the chunk
    decay_out = tl.exp(out_lag * log_beta[None, :])  # β^(BT-1-j)
    ddecay_out = tl.where(out_lag > 0, out_lag * tl.exp(tl.maximum(out_lag - 1, 0.0) * log_beta[None, :]), 0.0)
    lag = (i[:, None] - 1 - i[None, :]).to(tl.float32)[:, :, None]  # [BT, BT, 1]
    decay = tl.where(lag >= 0, tl.exp(tl.maximum(lag, 0.0) * log_beta[None, None, :]), 0.0)  # D[i,j,k]
    ddecay = tl.where(lag > 0, lag * tl.exp((tl.maximum(lag, 1.0) - 1) * log_beta[None, None, :]), 0.0)
    # q[i,j,k]: the gradient reaching the discounted write D[i,j,k] w_{j,k} from reader row i, through
    # Ñ_{t-1} (ρ'_{i,k} g_i · v_j) and through M̃_{t-1} (∂M̃_{t-1})
    g_dot_v = tl.dot(g, tl.trans(v), input_precision="ieee")  # [BT(i), BT(j)]
    q = rho_s[:, None, :] * g_dot_v[:, :, None] + dmass_prev[:, None, :]  # [BT, BT, RP]
    v_dot_ds = tl.dot(v, tl.trans(dstate), input_precision="ieee")  # [BT(j), RP]: v_j · dS_{n+1,k}
    into_next = v_dot_ds + dmass[None, :]  # what row j's write into the next chunk's state receives
    # ∂w_{j,k} = Σ_i D[i,j,k] q[i,j,k] + β^(BT-1-j) (v_j · dS_{n+1,k} + dm_{n+1,k})
    dw = tl.sum(decay * q, axis=0) + decay_out * into_next
    tl.store(DW + tk, dw.to(DW.dtype.element_ty), mask=tk_ok)
    # ∂v_j = Σ_i A[i,j] g_i + Σ_k β^(BT-1-j) w_{j,k} dS_{n+1,k}
    scores = tl.sum(rho_s[:, None, :] * decay * w[None, :, :], axis=2)  # [BT(i), BT(j)]: A[i, j]
    dv = tl.dot(tl.trans(scores), g, input_precision="ieee")
    dv += tl.dot(decay_out * w, dstate, input_precision="ieee")
    tl.store(DVal + td, dv.to(DVal.dtype.element_ty), mask=td_ok)
    # The decays' part of ∂β, added to the clamp part left by _prefix_mean_bwd_read
    g_dot_s = tl.dot(g, tl.trans(state), input_precision="ieee")  # [BT, RP]: g_i · S_{n,k}
    dbeta = tl.load(DBeta + (b * NC + n) * R + k, mask=k_ok, other=0.0)
    dbeta += tl.sum(tl.sum(ddecay * w[None, :, :] * q, axis=0), axis=0)  # writes read inside the chunk
    dbeta += tl.sum(ddecay_in * (rho_s * g_dot_s + dmass_prev * mass[None, :]), axis=0)  # reads of S_n, m_n
    dbeta += BT * tl.exp((BT - 1) * log_beta) * (tl.sum(state * dstate, axis=1) + mass * dmass)  # S_n, m_n carried on
    dbeta += tl.sum(ddecay_out * w * into_next, axis=0)  # writes into the next chunk's state
    tl.store(DBeta + (b * NC + n) * R + k, dbeta, mask=k_ok)


def _prefix_mean_empty(shape, dtype, device):
    """Kernel output buffers: torch.empty, or NaN-filled under GLASSBOX_POISON=1 (tests) so an unwritten tile shows."""
    if os.environ.get("GLASSBOX_POISON") == "1":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _prefix_mean_blocks(R, dv):
    """Padded sizes: RP (channels), BDV (a whole value row), BD (value block of the backward state scan)."""
    RP = max(16, 1 << (R - 1).bit_length())  # tl.dot needs every dimension >= 16
    BDV = max(16, 1 << (dv - 1).bit_length())
    return RP, BDV, min(BDV, 32)


# The kernels hold [RP, BDV] state tiles; their shared memory depends on the Triton version's compiler as much as on
# the shape. Compiled for sm_90 (python tests/test_sm90_compile.py --protot-tiles), the largest block at
# RP·BDV = 16384 (R 128 × d_v 128, 64 × 256, 32 × 512, 256 × 64, 512 × 32) needs at most 194 KiB with triton 3.6
# (torch 2.11's) and 164 KiB with 3.9, under the 227 KiB an sm_90 block may use. At 32768 triton 3.6's
# _prefix_mean_bwd_write needs 280-322 KiB (3.9: 148-194 KiB), so it could not launch. Larger shapes take the
# chunked torch form (auto) or are an error (triton). At 16384 the backward kernels already spill up to 20 KB per
# thread (the default R 32 × d_v 128: under 1 KB): where the chunked form overtakes them is for a GPU to measure.
_PREFIX_MEAN_MAX_TILE = 16384


def _carry_step(NC):
    """Chunks per scan step of the forward carry: _CARRY_CB, or fewer (a power of two >= 2) when the sequence has
    fewer chunks, so that a short sequence scans no padding (the interpreter runs the scan's combine element by
    element, so padding is what made the CPU tests slow)."""
    return min(_CARRY_CB, max(2, triton.next_power_of_2(NC)))


def _prefix_mean_fits(R, dv):
    # The backward state kernel holds [RP, 32] tiles whatever d_v: R 1024 × d_v 32 needs 324 KiB, R 512 × d_v 32 164 KiB.
    RP, BDV, _ = _prefix_mean_blocks(R, dv)
    return RP * BDV <= _PREFIX_MEAN_MAX_TILE and RP <= 512


class PrefixMeanRead(torch.autograd.Function):
    """Triton prefix-mean read. Saves w, v, ρ, β, the carried states [B, T/16, R, dv] and masses, and M̃_{t-1}
    [B, T, R] (the rescaled mass M/(1-β)); nothing of size [B, T, R, dv] exists in the forward or the backward."""

    @staticmethod
    def forward(ctx, w, v, rho, beta):
        B, T, R = w.shape
        dv = v.shape[-1]
        w, v, rho = w.contiguous(), v.contiguous(), rho.contiguous()
        beta32 = beta.detach().float().contiguous()
        NC = triton.cdiv(T, _BT)
        RP, BDV, _ = _prefix_mean_blocks(R, dv)
        states = _prefix_mean_empty((B, NC, R, dv), torch.float32, v.device)
        masses = _prefix_mean_empty((B, NC, R), torch.float32, v.device)
        _prefix_mean_fwd_chunk[(NC, B)](w, v, beta32, states, masses, T, R, dv, NC, BT=_BT, RP=RP, BDV=BDV, num_warps=4)
        _prefix_mean_fwd_carry[(triton.cdiv(R * dv, _CARRY_TILE) + triton.cdiv(R, _CARRY_TILE), B)](
            states, masses, beta32, R, dv, NC, BT=_BT, CB=_carry_step(NC), TILE=_CARRY_TILE, num_warps=4)
        y = _prefix_mean_empty((B, T, dv), v.dtype, v.device)
        mass_prev = _prefix_mean_empty((B, T, R), torch.float32, v.device)
        _prefix_mean_fwd_read[(NC, B)](
            w, v, rho, beta32, states, masses, y, mass_prev, T, R, dv, NC, MASS_EPS,
            BT=_BT, RP=RP, BDV=BDV, num_warps=4)
        ctx.save_for_backward(w, v, rho, beta32, states, masses, mass_prev)
        ctx.beta_dtype = beta.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        w, v, rho, beta32, states, masses, mass_prev = ctx.saved_tensors
        B, T, R = w.shape
        dv = v.shape[-1]
        dy = dy.contiguous()
        NC = states.shape[1]
        RP, BDV, BD = _prefix_mean_blocks(R, dv)
        drho = _prefix_mean_empty((B, T, R), rho.dtype, v.device)
        dmass_prev = _prefix_mean_empty((B, T, R), torch.float32, v.device)
        dbeta = _prefix_mean_empty((B, NC, R), torch.float32, v.device)
        _prefix_mean_bwd_read[(NC, B)](
            w, v, rho, beta32, states, mass_prev, dy, drho, dmass_prev, dbeta, T, R, dv, NC, MASS_EPS,
            BT=_BT, RP=RP, BDV=BDV, num_warps=4)
        dstates = _prefix_mean_empty((B, NC, R, dv), torch.float32, v.device)
        dmasses = _prefix_mean_empty((B, NC, R), torch.float32, v.device)
        _prefix_mean_bwd_state[(triton.cdiv(dv, BD), B)](
            rho, mass_prev, dmass_prev, dy, beta32, dstates, dmasses, T, R, dv, NC, MASS_EPS,
            BT=_BT, RP=RP, BD=BD, num_warps=4)
        dw = _prefix_mean_empty((B, T, R), w.dtype, v.device)
        dval = _prefix_mean_empty((B, T, dv), v.dtype, v.device)
        _prefix_mean_bwd_write[(NC, B)](
            w, v, rho, beta32, states, masses, mass_prev, dy, dmass_prev, dstates, dmasses, dw, dval, dbeta,
            T, R, dv, NC, MASS_EPS, BT=_BT, RP=RP, BDV=BDV, num_warps=4)
        return dw, dval, drho, dbeta.sum((0, 1)).to(ctx.beta_dtype)


# Triton launches stay out of torch.compile graphs: torch.compiler.disable makes dynamo graph-break here.
@torch.compiler.disable
def _prefix_mean_read_triton(w, v, rho, beta):
    return PrefixMeanRead.apply(w, v, rho, beta)


def prefix_mean_read(w, v, rho, beta, backend="auto"):
    """y_t = Σ_k ρ_{t,k} N_{t-1,k} / max(M_{t-1,k}, eps) (module docstring); w, ρ [B, T, R], v [B, T, dv], β [R].
    Returns y [B, T, dv] in v's dtype; differentiable in w, v, ρ and β with every backend. The state maths run in
    fp32 (float64 for float64 inputs, which `auto` keeps on the torch form) whatever autocast is on."""
    if backend not in PREFIX_MEAN_BACKENDS:
        raise ValueError(f"backend must be one of {PREFIX_MEAN_BACKENDS}, got {backend!r}")
    if w.dim() != 3 or rho.shape != w.shape or v.shape[:2] != w.shape[:2] or beta.shape != w.shape[-1:]:
        raise ValueError(f"prefix_mean_read: expected w, rho [B, T, R], v [B, T, dv], beta [R]; got w "
                         f"{tuple(w.shape)}, v {tuple(v.shape)}, rho {tuple(rho.shape)}, beta {tuple(beta.shape)}")
    if w.shape[1] == 0:  # nothing to read; every input stays in the graph (zero gradients), as with Triton
        return v + 0 * (w.sum() + rho.sum() + beta.sum())
    double = torch.float64 in (w.dtype, v.dtype, rho.dtype, beta.dtype)
    if backend == "triton" and double:
        raise ValueError("backend='triton' computes in float32; float64 inputs take backend='auto' or 'torch'")
    fits = _prefix_mean_fits(w.shape[-1], v.shape[-1])
    takes_triton = HAS_TRITON and v.is_cuda and fits and not double
    if backend in ("recurrent", "torch") or (backend == "auto" and not takes_triton):
        form = prefix_mean_read_recurrent if backend == "recurrent" else prefix_mean_read_chunked
        with torch.autocast(v.device.type, enabled=False):  # the state maths stay fp32 under a caller's autocast
            return form(w, v, rho, beta)
    if not HAS_TRITON:
        raise RuntimeError(f"backend='triton' needs the triton package, which failed to import: {TRITON_ERROR}")
    if not (v.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError("backend='triton' needs CUDA tensors or TRITON_INTERPRET=1 (Triton's CPU interpreter)")
    if not fits:
        raise ValueError(f"backend='triton' supports R·d_v up to {_PREFIX_MEAN_MAX_TILE} and R up to 512 after padding "
                         f"to powers of two (shared memory), got R={w.shape[-1]}, d_v={v.shape[-1]}; use 'torch'")
    return _prefix_mean_read_triton(w, v, rho, beta)


# -----------------------------------------------------------------------------
# Model


def _fp32(t):
    """fp32 for the routing and state maths (fp64 stays fp64, so tests can compare in double precision)."""
    return t if t.dtype == torch.float64 else t.float()


def prefix_state(w, v, beta):
    """The EMA state (N_T, M_T) after a whole sequence, Eq. (3) summed in closed form with decays
    β^(T-1-s) = exp((T-1-s)·ln β): what a cached generation starts from after a parallel prefill."""
    T = w.shape[1]
    beta = _fp32(beta)
    age = torch.arange(T - 1, -1, -1, device=w.device, dtype=beta.dtype)
    coef = torch.exp(age[:, None] * torch.log(beta)[None, :]) * (1 - beta)     # [T, R]: (1-β)·β^(T-1-s)
    cw = _fp32(w) * coef                                                          # [B, T, R]
    return torch.einsum("btr,btd->brd", cw, _fp32(v)), cw.sum(1)


def _gate_softmax(s, masked: bool):
    """Softmax over the prototypes, in fp32. Under an intervention mask a row may have every logit at -inf (every
    prototype of the layer masked): its gate is then all zeros, the mask's limit (no write: prefix mean 0; no
    read: y = 0), not softmax's 0/0."""
    p = torch.softmax(_fp32(s), -1)
    return p.masked_fill(torch.isneginf(s).all(-1, keepdim=True), 0.0) if masked else p


class ProtoMixer(nn.Module):
    """The prototype mixer of one layer, Eqs. (1)-(6). Interventions set `write_mask` / `read_mask` (bool [R],
    True = masked: logit -inf) or swap rows of P; `record = True` keeps the last gates for the analyses."""

    def __init__(self, cfg: Config, layer_id: int):
        super().__init__()
        d, R = cfg.d_model, cfg.n_protos
        dv = value_width(cfg)
        self.layer_id, self.kernels, self.ema = layer_id, cfg.kernels, cfg.ema
        self.P = nn.Parameter(F.normalize(torch.randn(R, d) / math.sqrt(d), dim=-1))  # unit rows at init only
        self.gamma = nn.Parameter(torch.full((R,), math.log(0.9 / 0.1)))                # β = σ(γ) = 0.9
        self.tau_w = nn.Parameter(torch.tensor(3.0 if layer_id == 0 else 1.0))          # layer 0: softer routing
        self.shared = layer_id == 0 and cfg.shared_routing
        if not self.shared:
            self.W_r = nn.Linear(d, d, bias=False)
            self.tau_r = nn.Parameter(torch.tensor(1.0))
        self.V = nn.Linear(d, dv, bias=False)
        self.U = nn.Linear(dv, d, bias=False)
        self.conv = nn.Conv1d(dv, dv, 5, groups=dv, bias=False) if layer_id < cfg.conv_layers else None
        self.alpha = nn.Parameter(torch.tensor(1.0))
        self.write_mask = self.read_mask = None
        self.record, self.last = False, {}

    @property
    def beta(self):
        return torch.sigmoid(_fp32(self.gamma))

    def gates(self, x):
        """(w, ρ) of Eqs. (1) and (5), with intervention masks applied to the logits."""
        s_w = x @ self.P.t() / (self.tau_w.abs() + 1e-6)
        if self.write_mask is not None:
            s_w = s_w.masked_fill(self.write_mask, float("-inf"))
        w = _gate_softmax(s_w, self.write_mask is not None)
        if self.shared and self.read_mask is None:
            return w, w  # layer 0 reads with its write gate (a write mask therefore masks the read too)
        s_r = s_w if self.shared else self.W_r(x) @ self.P.t() / (self.tau_r.abs() + 1e-6)
        if self.read_mask is not None:
            s_r = s_r.masked_fill(self.read_mask, float("-inf"))
        return w, _gate_softmax(s_r, self.read_mask is not None or (self.shared and self.write_mask is not None))

    def forward(self, x, cache=None):
        """x: [B, T, d], the block's pre-normed input. cache None: the parallel form. cache a dict: recurrent
        generation, the cache updated in place (an empty dict = prefill from the start; then T = 1 steps)."""
        w, rho = self.gates(x)
        v = self.V(x)                                                                      # [B, T, dv]
        if self.conv is not None:  # Eq. (2): depthwise causal conv over taps t-4..t
            past = cache.get("conv") if cache is not None else None
            if past is None:
                past = v.new_zeros(v.shape[0], 4, v.shape[-1])
            seq = torch.cat([past, v], 1)
            v = 0.5 * v + 0.5 * F.conv1d(seq.transpose(1, 2), self.conv.weight, groups=v.shape[-1]).transpose(1, 2)
            if cache is not None:
                cache["conv"] = seq[:, -4:].detach()
        if self.record:
            self.last = {"w": w.detach(), "rho": rho.detach()}
        beta = self.beta
        with torch.autocast(x.device.type, enabled=False):  # the EMA runs in fp32 (spec §3.2), never in bf16
            y = self.prefix_mean(w, v, rho, beta, cache)
        return self.alpha * self.U(y.to(x.dtype))

    def prefix_mean(self, w, v, rho, beta, cache):
        if cache is not None and "N" in cache:  # O(1) step(s) from the cached state
            y, (cache["N"], cache["M"]) = prefix_mean_read_recurrent(w, v, rho, beta, state=(cache["N"], cache["M"]))
        else:
            if self.ema == "official":
                y = prefix_mean_read_official(w, v, rho, beta)
            else:
                y = prefix_mean_read(w, v, rho, beta, backend=self.kernels)
            if cache is not None:  # note: with --ema official the cache holds the exact state, not the shortcut's
                cache["N"], cache["M"] = prefix_state(w, v, beta)
        return y


class RotaryAttention(nn.Module):
    """The LLaMA baseline's mixer: multi-head causal attention (SDPA) with rotary position embeddings."""

    def __init__(self, cfg: Config, layer_id: int):
        super().__init__()
        if cfg.d_model % cfg.heads or (cfg.d_model // cfg.heads) % 2:
            raise ValueError(f"--d-model {cfg.d_model} must split into --heads {cfg.heads} heads of even size")
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.record, self.last = False, {}

    @staticmethod
    def rope(x, offset=0):
        """Rotate channel pairs (i, i + hd/2) by angle t·10000^(-2i/hd) (LLaMA's layout)."""
        T, hd = x.shape[-2], x.shape[-1]
        inv = 10000.0 ** (-torch.arange(0, hd, 2, device=x.device, dtype=torch.float32) / hd)
        ang = torch.arange(offset, offset + T, device=x.device, dtype=torch.float32)[:, None] * inv
        cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)

    def forward(self, x, cache=None):
        B, T, d = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)  # (B, H, T, hd)
        offset = 0
        if cache is not None:  # KV cache for generation
            offset = cache["k"].shape[2] if "k" in cache else 0
        q, k = self.rope(q, offset), self.rope(k, offset)
        if cache is not None:
            if "k" in cache:
                k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
            cache["k"], cache["v"] = k, v
        if offset == 0 or T == 1:  # a fresh sequence is causal; one new token sees every cached key
            y = F.scaled_dot_product_attention(q, k, v, is_causal=offset == 0)
        else:  # several new tokens after a prefill: query i sees the cache and the new keys up to its own
            pos = torch.arange(offset + T, device=x.device)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=pos[offset:, None] >= pos[None, :])
        return self.proj(y.transpose(1, 2).reshape(B, T, d))


class SwiGLU(nn.Module):
    def __init__(self, d, dropout):
        super().__init__()
        hidden = int(2.7 * d / 16) * 16  # 688 for d = 256 (spec §2)
        self.W_g = nn.Linear(d, hidden, bias=False)
        self.W_u = nn.Linear(d, hidden, bias=False)
        self.W_o = nn.Linear(hidden, d, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return self.W_o(self.drop(F.silu(self.W_g(x)) * self.W_u(x)))


class Block(nn.Module):
    def __init__(self, cfg: Config, layer_id: int):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, backend=cfg.kernels)
        self.mixer = (ProtoMixer if cfg.mixer == "proto" else RotaryAttention)(cfg, layer_id)
        self.norm2 = RMSNorm(cfg.d_model, backend=cfg.kernels)
        self.ffn = SwiGLU(cfg.d_model, cfg.dropout)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, h, cache=None):
        h = h + self.drop(self.mixer(self.norm1(h), cache))
        return h + self.drop(self.ffn(self.norm2(h)))


class ProtoT(nn.Module):
    """Embedding -> dropout -> blocks -> RMSNorm -> tied head. `forward(idx)` gives logits; with targets, the
    mean cross-entropy (fused kernel from kernels.py on CUDA)."""

    def __init__(self, cfg: Config, vocab_size: int):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.wte = nn.Embedding(vocab_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.d_model, backend=cfg.kernels)
        self.head = nn.Linear(cfg.d_model, vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied (the reproduction command's --TIE_HEAD)
        nn.init.normal_(self.wte.weight, std=0.02)

    def forward(self, idx, targets=None, caches=None):
        if idx.dim() != 2 or 0 in idx.shape:
            raise ValueError(f"idx must be [B, T] with B, T >= 1, got {tuple(idx.shape)}")
        h = self.drop(self.wte(idx))
        for i, block in enumerate(self.blocks):
            h = block(h, None if caches is None else caches[i])
        logits = self.head(self.norm(h))
        if targets is None:
            return logits
        return cross_entropy(logits.flatten(0, 1), targets.flatten(), backend=self.cfg.kernels).float()

    def mixers(self):
        return [b.mixer for b in self.blocks]

    def n_params(self):
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(self, idx, new_tokens, temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.05,
                 no_repeat_ngram_size=4, generator=None):
        """Sample with the recurrent cache: one parallel prefill, then O(1) per token for ProtoT
        (the attention baseline uses a KV cache, whose cost grows with the position). Each token is drawn from
        sampling_logits (the defaults are spec §5.5's sampler), which sees the whole text so far; temperature 0 is
        greedy."""
        if top_k < 0:  # 0 turns top-k off; a negative k would fail inside torch.topk
            raise ValueError(f"top_k must be >= 0 (0: no top-k), got {top_k}")
        caches = [{} for _ in self.blocks]
        logits = self(idx, caches=caches)[:, -1]
        for _ in range(new_tokens):
            logits = sampling_logits(logits, idx, temperature, top_k, top_p, repetition_penalty, no_repeat_ngram_size)
            if temperature <= 0:  # greedy, after the penalty and the n-gram ban (as HF's greedy search with processors)
                nxt = logits.argmax(-1, keepdim=True)
            else:
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            idx = torch.cat([idx, nxt], 1)
            logits = self(nxt, caches=caches)[:, -1]
        return idx


def sampling_logits(logits, ids, temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.05,
                    no_repeat_ngram_size=4):
    """The logits the next token is drawn from: Hugging Face generate()'s processors, in its order (spec §5.5).
    logits [B, V] (the model's, for the next token); ids [B, T], the text so far, prompt included. fp32 out.

        repetition penalty   each id in ids: a logit > 0 divided by the penalty, one < 0 multiplied by it
        no-repeat n-gram     -inf for each token that would complete an n-gram already in ids (unless that is
                             every token, which HF would turn into NaN probabilities: then the row is left as is)
        temperature          divide by it
        top-k                -inf below the k-th largest logit
        top-p                -inf outside the fewest most likely tokens whose probability reaches p (the top one stays)

    1 (penalty, top-p) or 0 (top-k, n-gram) turns a step off; with all four off this is the plain
    temperature sampler. A logit pushed past float32's range (a penalty or a temperature near 0) is held at the
    largest float32 of its sign, so no step meets inf - inf (validate keeps the penalty above float32's smallest
    normal number: below, it would round to 0 and 0 / 0 is NaN)."""
    logits, n, T = logits.float(), no_repeat_ngram_size, ids.shape[1]
    big = torch.finfo(torch.float32).max
    if repetition_penalty != 1:
        seen = logits.gather(1, ids)
        seen = torch.where(seen < 0, seen * repetition_penalty, seen / repetition_penalty).clamp(-big, big)
        logits = logits.scatter(1, ids, seen)
    if n and T >= n:  # n-gram s = ids[s : s+n], s = 0 .. T-n: its first n-1 tokens against the last n-1 of ids
        hit = (ids.unfold(1, n - 1, 1)[:, :T - n + 1] == ids[:, None, T - n + 1:]).all(-1)  # (B, T-n+1)
        # scatter_add, not scatter: a token can follow several (n-1)-grams, only some of them equal to the last
        banned = torch.zeros_like(logits).scatter_add_(1, ids[:, n - 1:], hit.float()) > 0
        banned &= ~banned.all(-1, keepdim=True)  # every token banned (small n, small vocabulary): no ban, not NaN
        logits = logits.masked_fill(banned, float("-inf"))
    banned = logits == float("-inf")
    logits = (logits / max(temperature, 1e-6)).clamp(-big, big).masked_fill(banned, float("-inf"))
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1:  # ascending, as HF: drop the least likely tokens while their total stays <= 1 - p
        ordered, order = logits.sort(-1)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return logits


# -----------------------------------------------------------------------------
# Training


class RunError(Exception):
    """A user-fixable problem (bad checkpoint, bad flag combination, NaN loss): one line, non-zero exit."""


DDP_TIMEOUT_HOURS = 2  # the process group's collective timeout; prepare big corpora first (python common.py)


def setup_device(cfg: Config):
    """-> (device, autocast context, DDP info). torchrun sets RANK/LOCAL_RANK/WORLD_SIZE (nanoGPT's detection)."""
    from common import rendezvous_note, torchrun_problem

    if (problem := torchrun_problem()) is not None:  # RANK set by hand, or torchrun's other variables missing
        raise RunError(problem)
    ddp = int(os.environ.get("RANK", -1)) != -1
    rank, local_rank, world = 0, 0, 1
    if cfg.device == "auto":
        device = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    else:
        device = cfg.device
    if ddp:
        import torch.distributed as dist

        # rank 0 alone prepares the data (a token cache to build can take hours) while the others wait at a
        # barrier: NCCL's default 10-minute timeout would abort them
        if (note := rendezvous_note(DDP_TIMEOUT_HOURS)) is not None:  # ranks started by hand, not by torchrun
            print(note, file=sys.stderr, flush=True)
        dist.init_process_group(backend="nccl" if device.startswith("cuda") else "gloo",
                                timeout=datetime.timedelta(hours=DDP_TIMEOUT_HOURS))
        rank, local_rank, world = dist.get_rank(), int(os.environ.get("LOCAL_RANK", 0)), dist.get_world_size()
        if device.startswith("cuda"):
            device = f"cuda:{local_rank}"
            torch.cuda.set_device(device)
    if not re.fullmatch(r"cpu|mps|cuda(:\d+)?", device):  # torch.device also takes xpu, meta, ...: not run here
        raise RunError(f"--device {device}: expected auto, cpu, cuda, cuda:N or mps")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RunError(f"--device {device}: CUDA is not available")
    if device.startswith("cuda:"):  # Triton launches on the current device: make it the one asked for
        index = torch.device(device).index
        if index >= torch.cuda.device_count():
            raise RunError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA devices")
        torch.cuda.set_device(index)
    if device == "mps" and not torch.backends.mps.is_available():
        raise RunError("--device mps: MPS is not available on this machine")
    if cfg.dtype == "bfloat16" and not device.startswith("cuda"):
        raise RunError("--dtype bfloat16 is bf16 autocast on CUDA; on this device the run is float32 (drop the flag)")
    device_type = "cuda" if device.startswith("cuda") else ("mps" if device == "mps" else "cpu")
    dtype = cfg.dtype
    if dtype == "auto":
        # bf16 where the tensor cores have it (sm_80+); emulated bf16 on older GPUs would be slow
        bf16 = device_type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False)
        dtype = "bfloat16" if bf16 else "float32"
    if dtype == "bfloat16" and device_type == "cuda":
        autocast = torch.autocast("cuda", dtype=torch.bfloat16)
    else:  # no autocast off CUDA (nanoGPT PR #698: MPS is treated as CPU here)
        autocast = contextlib.nullcontext()
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    return torch.device(device), autocast, dict(ddp=ddp, rank=rank, local_rank=local_rank, world=world)


def get_lr(cfg: Config, it: int) -> float:
    """Linear warmup over warmup_frac of the steps, then cosine from lr to min_lr_ratio·lr (spec §3.2)."""
    warmup = max(1, int(cfg.warmup_frac * cfg.max_iters))
    if it < warmup:
        return cfg.lr * (it + 1) / warmup
    progress = min(1.0, (it - warmup) / max(1, cfg.max_iters - warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


NO_DECAY = ("P", "gamma", "tau_w", "tau_r", "alpha")


def make_optimizer(model: nn.Module, cfg: Config, device_type: str):
    """AdamW, weight decay on matrices (embedding, projections, conv) but not on P, γ, τ, α or norms."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 or name.split(".")[-1] in NO_DECAY else decay).append(p)
    groups = [dict(params=decay, weight_decay=cfg.weight_decay), dict(params=no_decay, weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999), eps=1e-8, fused=device_type == "cuda")


def restore_optimizer(optimizer, state: dict) -> None:
    """optimizer.load_state_dict, keeping this run's hyperparameters: load_state_dict would put back the saved
    groups' settings too, so a --weight-decay typed with --resume would be silently ignored (the lr is set every
    step anyway). With nothing typed they are the checkpoint's own values, so the resume stays bit-exact."""
    fresh = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for g, f in zip(optimizer.param_groups, fresh):
        g.update(f)


# What shapes the weights a resumed run continues to (not the eval and log cadence): a value typed with --resume
# that differs from the checkpoint's means the result is no longer that of one uninterrupted run.
RESUME_KEYS = ("max_iters", "lr", "min_lr_ratio", "warmup_frac", "batch_size", "ctx", "weight_decay", "grad_clip",
               "dropout", "early_stop")
# What only training reads: typed with --no-train, each keeps the checkpoint's value (a note says so), so that the
# config and the report describe the run that trained the model, not flags that changed nothing
TRAINING_KEYS = tuple(k for k in RESUME_KEYS if k != "ctx") + ("eval_interval", "eval_iters", "log_interval")


# What --resume cannot change: the run goes on from the checkpoint's random state, so a typed seed would
# only be written into the stored config, which would then no longer describe the run
FIXED_ON_RESUME = ("seed",)


def resume_note(saved: dict, cfg: Config, step: int, stopped: bool = False) -> Optional[str]:
    """The line a resumed run logs when it cannot equal an uninterrupted one: nothing left to train (at
    --max-iters, or the run had stopped early), or settings changed since the checkpoint (the usual case: a smaller
    --max-iters first, then --resume with a larger one, whose cosine schedule the first steps did not follow).
    None when it resumes as if never stopped. A checkpoint past --max-iters is check_steps' error, before anything
    trains."""
    if stopped and saved.get("early_stop") == cfg.early_stop:
        return (f"note: the checkpoint's run stopped early at step {step} (no val improvement in --early-stop "
                f"{cfg.early_stop} evaluations): nothing left to train (raise --early-stop, or 0 turns it off, to "
                "continue)")
    if stopped:  # a --early-stop typed now, which the checkpoint's run did not stop by
        return (f"note: the checkpoint at step {step} has gone --early-stop {cfg.early_stop} evaluations without a val "
                f"improvement (its run had --early-stop {saved.get('early_stop')}), so it stops at once: nothing left "
                "to train")
    if step >= cfg.max_iters:
        return (f"note: the checkpoint is at step {step}, --max-iters {cfg.max_iters}: nothing left to train (raise "
                "--max-iters to continue)")
    changed = [f"{k} {saved[k]} -> {getattr(cfg, k)}" for k in RESUME_KEYS if k in saved and saved[k] != getattr(cfg, k)]
    if changed:
        return (f"note: resuming with {', '.join(changed)}: the first {step} steps followed the checkpoint's "
                "settings (its learning-rate schedule included), so the result will differ from an uninterrupted "
                "run with these settings")
    return None


def flops_per_token(model: ProtoT, cfg: Config, ctx: int) -> float:
    """Training FLOPs per token: 6·N for the matmuls (PaLM appendix B; the tied head counted once as a matmul),
    plus the mixer's non-parameter work: attention 12·L·d·T; the prototype scan ~6·L·3·R·d_v, and P's second
    use in each layer that reads with its own gate (W_r x̃ · P, Eq. 5; 6·N counts P once, for the write gate)."""
    n = model.n_params()
    if cfg.mixer == "attention":
        return 6 * n + 12 * cfg.layers * cfg.d_model * ctx
    dv = value_width(cfg)
    read_layers = cfg.layers - int(cfg.shared_routing)
    return 6 * n + 6 * cfg.layers * 3 * cfg.n_protos * dv + 6 * read_layers * cfg.n_protos * cfg.d_model


# Dense peak FLOP/s of each GPU's bf16 tensor cores (spec sheets, without sparsity). The first name the device's
# name contains wins, so NVL, PCIe and L40S come before the names they contain. An fp32 run's matmuls use TF32
# (setup_device), half the bf16 rate on all of these.
PEAK_BF16 = {"H200 NVL": 835e12, "H200": 989e12, "H100 NVL": 835e12, "H100 PCIe": 756e12, "H100": 989e12,
             "H800 PCIe": 756e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "L40": 181e12,
             "L4": 121e12, "4090": 165e12}


def peak_flops(device: torch.device, bf16: bool = True) -> Optional[float]:
    """The peak the MFU is measured against: bf16, or TF32 (half) for an fp32 run; None off CUDA or for a GPU
    not listed."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    return peak if peak is None or bf16 else peak / 2


def log_line(step, max_iters, loss, lr, ms, tok_s, mfu) -> str:
    """The one log format of every glassbox script."""
    mfu_s = f"{100 * mfu:.1f}%" if mfu is not None else "-"
    rate = f"{tok_s / 1e3:.1f}k" if tok_s >= 1e3 else f"{tok_s:.0f}"  # 0.0k would hide a slow run
    return f"step {step}/{max_iters} | loss {loss:.4f} | lr {lr:.2e} | {ms:.1f} ms | {rate} tok/s | mfu {mfu_s}"


@torch.no_grad()
def estimate_loss(model, data, cfg: Config, autocast, batch_size) -> float:
    """Mean loss over eval_iters random val batches (the val generator, saved in checkpoints)."""
    model.eval()
    losses = []
    for _ in range(cfg.eval_iters):
        x, y = data.get_batch("val", batch_size, cfg.ctx)
        with autocast:
            losses.append(model(x, y).item())
    model.train()
    return sum(losses) / len(losses)


def perplexity(loss: float) -> float:
    """exp(loss), infinite past float range (a diverged or heavily intervened model) rather than an OverflowError."""
    return math.exp(loss) if loss < 709 else math.inf


@torch.no_grad()
def evaluate_ppl(model, data, ctx: int, autocast, batch_size: int = 8, max_windows: Optional[int] = None) -> dict:
    """Exact token-weighted perplexity over the val split: every token predicted once (common.iter_eval).
    The unk id (compaction's image of every id unseen in training, so never a training target) is scored like any
    token; "unk_tokens" counts those targets and "loss_known"/"ppl_known" leave them out."""
    model.eval()
    unk = -1 if data.tokenizer.unk is None else data.tokenizer.unk  # -1: no compaction, every target is known
    # Σ nll and targets, all and known (not unk): summed on the device, read once at the end
    sums = torch.zeros(4, dtype=torch.float64, device=data.device)
    for i, (x, y) in enumerate(data.iter_eval("val", batch_size, ctx)):
        if max_windows is not None:
            if i * batch_size >= max_windows:
                break
            x, y = x[:max_windows - i * batch_size], y[:max_windows - i * batch_size]  # exactly max_windows
        with autocast:
            logits = model(x)
        nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").double()
        known = y.flatten() != unk
        sums += torch.stack([nll.sum(), nll.new_tensor(y.numel()), (nll * known).sum(), known.sum().double()])
    if dist_ready():
        import torch.distributed as dist

        dist.all_reduce(sums)
    total, count, total_known, count_known = sums.tolist()
    known = total_known / count_known if count_known else None  # None: every target is unk
    return {"loss": total / count, "ppl": perplexity(total / count), "tokens": int(count),
            "unk_tokens": int(count - count_known), "loss_known": known,
            "ppl_known": None if known is None else perplexity(known)}


def dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def any_rank(flag: torch.Tensor) -> bool:
    """True if `flag` is set on any rank (all ranks must stop together, or the others hang in a collective)."""
    if dist_ready():
        flag = flag.float()
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def ckpt_path(cfg: Config) -> Path:
    return Path(cfg.out_dir) / f"ckpt-{cfg.mixer}.pt"


def nan_message(step: int, path: Path, saved: Optional[int]) -> str:
    """saved: the step of this run's last checkpoint (written, or resumed from), None before its first; a file
    already at path is then an earlier run's, which this one would have replaced at its first evaluation."""
    if saved is not None:
        keep = f"the last good checkpoint is {path}, step {saved}"
    else:
        keep = f"this run wrote no checkpoint; {path} is an earlier run's" if path.exists() else "no checkpoint was written"
    return f"non-finite loss before step {step} (or non-finite weights); stopping ({keep})"


CKPT_KEYS = ("config", "model", "optimizer", "step", "best_val_loss", "tokenizer", "history", "rng")  # what
RNG_KEYS = ("torch", "data", "cuda")                               # save_checkpoint writes, and resume reads
HISTORY_KEYS = ("step", "train", "val")  # the lists train() appends to


def save_checkpoint(path: Path, model, optimizer, cfg: Config, step: int, best: float, data_rng, data,
                    history, best_weights: Optional[dict] = None) -> None:
    """One file: written to a temporary name, then renamed (a crash never leaves half a checkpoint). `model` is
    the last state (what --resume continues); `best_weights` = {"step", "model"}, the best evaluation's weights
    (val loss `best`), stored under "best" only when they are not the last ones, so the file doubles only after
    an evaluation without improvement (best_of reads it back)."""
    state = {
        "format": "glassbox-checkpoint/1", "script": "protot", "config": asdict(cfg),
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "best_val_loss": best,
        "best": best_weights, "tokenizer": data.tokenizer.state_dict(),
        "corpus": getattr(data, "meta", {}).get("fingerprint"),  # its contents (check_tokenizer)
        "history": history,
        "rng": {"torch": torch.get_rng_state(), "data": data_rng,
                "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)  # atomic: a crash or a full disk leaves the last checkpoint whole
    finally:
        tmp.unlink(missing_ok=True)  # no half-written file left beside it


def history_ok(hist) -> bool:
    """history holds the lists train() appends to, each of the kind it appends: step ints, train [step, loss]
    pairs, and one number per evaluation in each other list."""
    def num(v):
        return type(v) in (int, float)
    return (isinstance(hist, dict) and all(isinstance(hist.get(k), list) for k in HISTORY_KEYS)
            and all(type(s) is int for s in hist["step"])
            and all(isinstance(p, (list, tuple)) and len(p) == 2 and type(p[0]) is int and num(p[1])
                    for p in hist["train"])
            and all(len(hist[k]) == len(hist["step"]) and all(num(v) for v in hist[k])
                    for k in HISTORY_KEYS if k not in ("step", "train")))


def same_layout(state, like) -> bool:
    """state is a state dict with like's keys and tensor shapes (the best weights against the last ones)."""
    return (isinstance(state, dict) and state.keys() == like.keys()
            and all(isinstance(v, torch.Tensor) and isinstance(like[k], torch.Tensor) and v.shape == like[k].shape
                    for k, v in state.items()))


def damaged_fields(ck: dict) -> list[str]:
    """The fields of a checkpoint that read but hold the wrong kind of value (a file edited or damaged by hand), so
    that loading it is one line rather than a traceback deep in train() or the analyses."""
    tok, hist = ck["tokenizer"], ck["history"]
    ok = {"step": type(ck["step"]) is int and ck["step"] >= 0,
          "best_val_loss": type(ck["best_val_loss"]) in (int, float) and not math.isnan(ck["best_val_loss"]),
          "history": history_ok(hist),
          "model": isinstance(ck["model"], dict), "optimizer": isinstance(ck["optimizer"], dict),
          "tokenizer": isinstance(tok, dict) and isinstance(tok.get("name"), str)
          and type(tok.get("compacted")) is bool and isinstance(tok.get("kept"), torch.Tensor),
          "best": ck.get("best") is None or isinstance(ck["best"], dict) and type(ck["best"].get("step")) is int
          and isinstance(ck["model"], dict) and same_layout(ck["best"].get("model"), ck["model"])}
    return [k for k, good in ok.items() if not good]


def load_checkpoint(path: Path, cfg: Config, explicit=()) -> tuple[dict, Config]:
    """Load with weights_only=True; the architecture comes from the checkpoint, and an architecture flag given
    on the command line that disagrees with it is an error (one line) rather than a silent mismatch."""
    if not path.exists():
        raise RunError(f"no checkpoint at {path} (train first, or point --out-dir at one)")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
        # a saved tensor or list is no checkpoint: ck["config"] on a tensor would print a torch warning first
        ok = isinstance(ck, dict) and ck.get("format") == "glassbox-checkpoint/1" and ck.get("script") == "protot"
        if ok:
            saved = dict(ck["config"])
            if saved.get("grad_clip") == math.inf:  # accepted before 2026-12-03, which refuses non-finite flags:
                saved["grad_clip"] = 0.0            # clipping at inf multiplies by 1.0, the same steps as off (0)
            missing = [k for k in CKPT_KEYS if k not in ck] or [f"rng.{k}" for k in RNG_KEYS if k not in ck["rng"]]
    except Exception as e:  # truncated file, not a checkpoint, unpickling refused
        raise RunError(f"{path} is not a readable checkpoint ({type(e).__name__}); delete it or retrain") from None
    if not ok:
        raise RunError(f"{path} is not a protot.py checkpoint")
    if missing:
        raise RunError(f"{path} is an incomplete checkpoint (no {', '.join(missing)}); delete it or retrain")
    if saved.get("mixer") != cfg.mixer:  # a file renamed by hand: the name says one mixer, the contents another
        raise RunError(f"{path} holds a --mixer {saved.get('mixer')} model, not {cfg.mixer}")
    damaged = damaged_fields(ck)
    if damaged:
        raise RunError(f"{path} is a damaged checkpoint ({', '.join(damaged)}: not what save_checkpoint writes); "
                       "delete it or retrain")

    def typed_otherwise(keys) -> str:  # "k=stored (asked typed)" for each typed key that differs from the checkpoint
        return ", ".join(f"{k}={saved.get(k)!r} (asked {getattr(cfg, k)!r})" for k in keys
                         if k in explicit and getattr(cfg, k) != saved.get(k))

    other = MIXER_KEYS["attention" if saved.get("mixer") == "proto" else "proto"]  # no part of this model
    diff = typed_otherwise(k for k in ARCH_KEYS if k not in other)
    if diff:
        raise RunError(f"{path} was trained with {diff}; drop those flags or use another --out-dir")
    diff = typed_otherwise(FIXED_ON_RESUME) if cfg.resume else ""
    if diff:
        raise RunError(f"{path} was trained with {diff}, which --resume cannot change (it continues from the "
                       "checkpoint's random state); drop those flags, or train afresh in another --out-dir")
    keep = () if cfg.train else TRAINING_KEYS  # --no-train: what trained the model, whatever was typed
    taken = {k: saved[k] for k in MERGED_KEYS if k in saved and (k not in explicit or k in keep)}
    merged = replace(cfg, **taken)
    from common import stored_config_error

    why = stored_config_error(replace(Config(train=False), **taken), validate)  # the stored values, as a loaded model
    if why:
        raise RunError(f"{path} stores {why}; delete it or retrain")
    return ck, merged


def best_of(ck: dict) -> dict:
    """{"step", "model"}: the best evaluation's weights, which the final evaluation and the analyses use (spec §3.2:
    the best checkpoint is reloaded). "best" is None when they are the last weights; a checkpoint written before
    --early-stop has no "best", and its last weights stand for the best (the earlier ones were not kept)."""
    return ck.get("best") or {"step": ck["step"], "model": ck["model"]}


def evals_since_best(history: dict, best_step: int) -> int:
    """Evaluations after the best one, --early-stop's count: recomputed from the history, so no counter is saved
    and a checkpoint from before --early-stop resumes with it too."""
    return sum(s > best_step for s in history.get("step", []))


def budget_steps(ck: dict) -> int:
    """The steps a checkpoint's run was given (BUDGET_KEYS' "step"): --max-iters once it finished, there or by
    --early-stop, else the step it reached (an interrupted run). As in the paper, --compare sets models of one
    budget side by side, each with its best evaluation's weights, wherever each stopped."""
    c = ck["config"]
    stopped = bool(c.get("early_stop")) and evals_since_best(ck["history"], best_of(ck)["step"]) >= c["early_stop"]
    return c["max_iters"] if stopped else ck["step"]


def build_model(cfg: Config, vocab_size: int, device) -> ProtoT:
    torch.manual_seed(cfg.seed)
    return ProtoT(cfg, vocab_size).to(device)


def train(cfg: Config, data, device, autocast, dist_info, explicit=(), log=print, ck=None,
          start_rng: Optional[dict] = None) -> tuple[ProtoT, dict]:
    """The nanoGPT-shaped loop. Returns the trained (unwrapped) model, with the best evaluation's weights (its step
    as `model.weights_step`), and its history. With cfg.resume it continues from `ck`, the checkpoint already
    loaded by the caller (read from out_dir when not given). `start_rng` is the data streams' state to start
    from: under --compare ProtoT and the baseline train and evaluate on the same batches."""
    from common import memory_floor_problem

    rank, world = dist_info["rank"], dist_info["world"]
    if cfg.batch_size % world:
        raise RunError(f"--batch-size {cfg.batch_size} must be divisible by the {world} ranks")
    micro = cfg.batch_size // world
    path = ckpt_path(cfg)
    if start_rng is not None and not cfg.resume:
        data.set_rng_state(start_rng)
    # sizes that cannot fit stop here with one line (a CPU run would be killed with no message)
    bf16 = getattr(autocast, "fast_dtype", None) == torch.bfloat16  # a torch.autocast, or a nullcontext (fp32)
    problem = memory_floor_problem(lambda: ProtoT(cfg, data.vocab_size), device, micro * cfg.ctx,
                                   data.vocab_size, cfg.d_model, cfg.layers, bf16)
    if problem is not None:
        raise RunError(problem)
    model = build_model(cfg, data.vocab_size, device)
    optimizer = make_optimizer(model, cfg, device.type)
    step, best, history = 0, float("inf"), {k: [] for k in HISTORY_KEYS}
    best_weights = None  # {"step", "model"}: the best evaluation's weights, a CPU copy (val loss `best`)
    stopped = False  # a resumed run that had already stopped early trains no further
    if rank:  # ranks other than 0 draw their own dropout masks (DDP broadcasts rank 0's initial weights)
        torch.manual_seed(cfg.seed + rank)
    if cfg.resume:
        if ck is None:
            ck, _ = load_checkpoint(path, cfg, explicit)
        load_weights(model, ck["model"], path)
        try:
            restore_optimizer(optimizer, ck["optimizer"])
            step, best, history, best_weights = ck["step"], ck["best_val_loss"], ck["history"], best_of(ck)
            if "best" not in ck:  # from before --early-stop: its last weights stand for the best, so their val
                best = history["val"][-1]  # loss is the one to beat (not an earlier minimum whose weights are gone)
            torch.set_rng_state(ck["rng"]["torch"])
            data.set_rng_state(ck["rng"]["data"])
        except (RuntimeError, ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
            raise RunError(f"{path} cannot be resumed ({type(e).__name__}: {str(e).splitlines()[0]})") from None
        cuda_rng = ck["rng"]["cuda"]  # this device's generator (before 2026-12-02: a list of every device's)
        if torch.cuda.is_available() and cuda_rng is not None and len(cuda_rng):
            here = torch.cuda.current_device()
            if isinstance(cuda_rng, list):
                cuda_rng = cuda_rng[here] if here < len(cuda_rng) else None
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng)
        if rank:  # the checkpoint holds rank 0's generator: the other ranks keep dropout masks of their own
            torch.manual_seed(cfg.seed + rank + world * step)  # distinct per (rank, step)
        log(f"resumed from {path} at step {step}")
        stopped = bool(cfg.early_stop) and evals_since_best(history, best_weights["step"]) >= cfg.early_stop
        note = resume_note(ck["config"], cfg, step, stopped)
        if note:
            log(note)
    elif path.exists():  # a fresh run writes over an earlier run's checkpoint (another preset's sizes, say)
        log(f"note: {path} exists; this run trains from step 0 and replaces it (--resume continues it instead)")
    saved = step if cfg.resume else None  # the step of this run's last checkpoint (nan_message)
    raw = model
    if cfg.compile:
        model = torch.compile(model)
    if dist_info["ddp"]:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[dist_info["local_rank"]] if device.type == "cuda" else None)
    fpt, peak = flops_per_token(raw, cfg, cfg.ctx), peak_flops(device, bf16)
    tokens_per_step = cfg.batch_size * cfg.ctx
    log(f"{cfg.mixer}: {raw.n_params() / 1e6:.2f}M parameters, vocab {data.vocab_size}, "
        f"{tokens_per_step:,} tokens per step, {cfg.max_iters} steps")
    # The data generator's state is taken before each prefetch, so a checkpoint resumes with the batch that the
    # uninterrupted run would have used next (bit-exact resume on CPU).
    data_rng = data.rng_state()
    x, y = data.get_batch("train", micro, cfg.ctx)
    t0, t0_step, mfu_ema, start = time.time(), step, None, step
    bad = torch.zeros((), dtype=torch.bool, device=device)  # any non-finite loss since the last check
    while not stopped:
        if step > start and (step % cfg.eval_interval == 0 or step == cfg.max_iters):
            if any_rank(bad):
                raise RunError(nan_message(step, path, saved))
            val = estimate_loss(model, data, cfg, autocast, micro)
            if dist_ready():
                t = torch.tensor([val], device=device)
                torch.distributed.all_reduce(t)
                val = t.item() / world
            if not math.isfinite(val) or not all(torch.isfinite(p).all() for p in raw.parameters()):
                raise RunError(nan_message(step, path, saved))  # never save non-finite weights
            history["step"].append(step)
            history["val"].append(val)
            log(f"step {step}: val loss {val:.4f} (ppl {perplexity(val):.1f})")
            if val < best:  # the weights change from here on: keep these
                best = val
                best_weights = {"step": step,
                                "model": {k: v.detach().cpu().clone() for k, v in raw.state_dict().items()}}
            if rank == 0:  # the train stream as it was before the prefetch, the val stream as it is now
                rng = {**data_rng, "val": data.rng_state()["val"]}
                save_checkpoint(path, raw, optimizer, cfg, step, best, rng, data, history,
                                best_weights if best_weights["step"] != step else None)
            saved = step  # rank 0 wrote it: every rank names it
            # val is all-reduced above, the same float on every rank, so every rank stops at this evaluation
            if cfg.early_stop and evals_since_best(history, best_weights["step"]) >= cfg.early_stop:
                log(f"step {step}: no val improvement in {cfg.early_stop} evaluations; early stop")
                break
            t0, t0_step = time.time(), step  # evaluation time is not training time
        if step >= cfg.max_iters:
            break
        lr = get_lr(cfg, step)
        for g in optimizer.param_groups:
            g["lr"] = lr
        with autocast:
            loss = model(x, y)
        data_rng = data.rng_state()
        x, y = data.get_batch("train", micro, cfg.ctx)  # prefetch while the backward runs (async on CUDA)
        loss.backward()
        bad |= ~torch.isfinite(loss.detach())
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        if step % cfg.log_interval == 0 or step == cfg.max_iters:
            lossf = loss.detach().clone()
            if world > 1:  # the global batch's mean (equal micro-batches), not rank 0's share alone
                torch.distributed.all_reduce(lossf)
                lossf /= world
            lossf = lossf.item()  # syncs the device, so the timing below is real
            if any_rank(bad):
                raise RunError(nan_message(step, path, saved))
            dt = (time.time() - t0) / (step - t0_step)
            tok_s = tokens_per_step / dt
            if peak and step > 5 * cfg.log_interval:  # skip warm-up/compile steps, smooth like nanoGPT
                m = fpt * tok_s / (peak * world)
                mfu_ema = m if mfu_ema is None else 0.9 * mfu_ema + 0.1 * m
            history["train"].append([step, lossf])
            log(log_line(step, cfg.max_iters, lossf, lr, dt * 1000, tok_s, mfu_ema))
            t0, t0_step = time.time(), step
    if best_weights["step"] != step:  # the final evaluation and the analyses get the best weights (spec §3.2)
        raw.load_state_dict(best_weights["model"])
        log(f"restored the best evaluation's weights (step {best_weights['step']}, val loss {best:.4f})")
    raw.weights_step = best_weights["step"]
    return raw, history


# -----------------------------------------------------------------------------
# Analyses: prototype labelling, interventions, robustness, samples, benchmarks, report


def half_lives(model: ProtoT) -> list[list[float]]:
    """t_1/2 = ln 0.5 / ln β_k per (layer, prototype), in tokens."""
    return [(math.log(0.5) / torch.log(m.beta)).tolist() for m in model.mixers()]


def token_pieces(tok, ids) -> list[str]:
    return [tok.decode([int(i)]) for i in ids]


def words_of(pieces: list[str], acts: list[float]) -> list[tuple[str, float]]:
    """Join subword pieces into words (a piece starting with whitespace, or following one that ends with it,
    starts a new word); a word's activation is the mean of its pieces'."""
    words: list[tuple[str, list[float]]] = []
    for p, a in zip(pieces, acts):
        if not words or p[:1].isspace() or words[-1][0][-1:].isspace():
            words.append((p, [a]))
        else:
            words[-1] = (words[-1][0] + p, words[-1][1] + [a])
    return [(w, sum(a) / len(a)) for w, a in words]


LABEL_WIDTH = 32  # tokens per labelling context
GATE_LAGS = (-2, -1, 0, 1, 2)


def gate_lag(w: torch.Tensor, rho: torch.Tensor, lags=GATE_LAGS) -> dict:
    """"Predict-and-consolidate" (spec §1.1, §8.4): the paper reports that a prototype's read gate fires for a concept
    one token before its write gate. For w, ρ [n, T, R] of one layer and each lag ℓ, the Pearson correlation over
    every (window, t) of ρ_tk with w_(t+ℓ)k, per prototype k; ℓ = +1 pairs the read at t with the write at t + 1.
    -> dict(lags, corr: the mean over prototypes per lag, peak: the share of prototypes whose correlation peaks at
    each lag, prototypes: how many had a defined correlation at every lag (a gate constant over the windows has
    none))."""
    T = w.shape[1]
    per_lag = []
    for lag in lags:
        r = rho[:, max(0, -lag):T - max(0, lag)].flatten(0, 1).double()     # [pairs, R]: ρ_t ...
        x = w[:, max(0, lag):T + min(0, lag)].flatten(0, 1).double()        # ... beside w_(t+ℓ)
        r, x = r - r.mean(0), x - x.mean(0)
        per_lag.append((r * x).sum(0) / (r.norm(dim=0) * x.norm(dim=0)))   # NaN where a gate is constant
    c = torch.stack(per_lag)                                                # [lags, R]
    ok = ~c.isnan().any(0)
    c = c[:, ok]
    peak = c.argmax(0) if c.numel() else torch.zeros(0, dtype=torch.long)
    return {"lags": list(lags), "corr": c.mean(1).tolist() if c.numel() else [None] * len(lags),
            "peak": [(peak == i).float().mean().item() if c.numel() else None for i in range(len(lags))],
            "prototypes": int(ok.sum())}


@torch.no_grad()
def label_prototypes(model: ProtoT, data, cfg: Config, out_dir: Path, top: int = 10, width: int = LABEL_WIDTH,
                     stem: str = "prototypes") -> dict:
    """Spec §5.1: for every (layer, prototype), the val contexts of `width` tokens with the highest mean
    write-gate probability, words coloured by activation (out_dir/<stem>.html) and listed (<stem>.json), with
    the half-life; and, from the same windows, each layer's read-write gate lag (gate_lag; not layer 0 when it
    reads with its write gate)."""
    model.eval()
    tokens = data.tokens("val")
    n = min(cfg.label_windows, (len(tokens) - 1) // width)
    windows = torch.from_numpy(tokens[: n * width].astype("int64")).view(n, width)
    for m in model.mixers():
        m.record = True
    acts, reads = [[] for _ in model.blocks], [[] for _ in model.blocks]
    for i in range(0, n, 64):
        model(windows[i:i + 64].to(data.device))
        for l, m in enumerate(model.mixers()):
            acts[l].append(m.last["w"].float().cpu())
            if not m.shared:  # layer 0 reads with its write gate: no lag to measure, nothing to keep
                reads[l].append(m.last["rho"].float().cpu())
    for m in model.mixers():
        m.record, m.last = False, {}
    hl = half_lives(model)
    cards = []
    for l in range(len(model.blocks)):
        w = torch.cat(acts[l])                                # [n, width, R]
        score = w.mean(1)                                     # [n, R]: mean activation per context
        for k in range(w.shape[-1]):
            best = torch.topk(score[:, k], min(top, n)).indices.tolist()
            contexts = [{"score": score[j, k].item(),
                         "words": words_of(token_pieces(data.tokenizer, windows[j]), w[j, :, k].tolist())}
                        for j in best]
            cards.append({"layer": l, "proto": k, "half_life": hl[l][k], "contexts": contexts})
    lag = [{"layer": l, **gate_lag(torch.cat(acts[l]), torch.cat(reads[l]))}
           for l, m in enumerate(model.mixers()) if not m.shared]
    (out_dir / f"{stem}.json").write_text(json.dumps(cards))
    (out_dir / f"{stem}.html").write_text(prototype_html(cards))
    return {"cards": cards, "windows": n, "file": f"{stem}.html", "gate_lag": lag}


def gate_lag_line(g: dict) -> str:
    """One layer's gate_lag as the log and the report say it."""
    if not g["prototypes"]:
        return f"layer {g['layer']}: no prototype with a varying read and write gate"
    best = g["lags"][max(range(len(g["lags"])), key=lambda i: g["corr"][i])]
    return (f"layer {g['layer']}: mean corr(ρ_t, w_t+ℓ) " + ", ".join(
        f"ℓ={lag:+d} {c:.3f}" for lag, c in zip(g["lags"], g["corr"])) + f"; highest at ℓ={best:+d}; "
        f"{g['peak'][g['lags'].index(1)]:.0%} of {g['prototypes']} prototypes peak at ℓ=+1")


def prototype_html(cards: list[dict]) -> str:
    rows = []
    for c in cards:
        ctx_html = []
        for ctx in c["contexts"]:
            peak = max(a for _, a in ctx["words"]) or 1.0
            spans = "".join(f'<span style="background:rgba(255,140,0,{a / peak:.2f})">{html.escape(wd)}</span>'
                            for wd, a in ctx["words"])
            ctx_html.append(f'<div class="ctx">{spans}</div>')
        rows.append(f'<div class="card"><h3>L{c["layer"]} P{c["proto"]} '
                    f'<small>half-life {c["half_life"]:.1f} tokens</small></h3>{"".join(ctx_html)}</div>')
    return ("<!doctype html><meta charset=utf-8><title>ProtoT prototypes</title><style>body{font-family:sans-serif}"
            ".card{border:1px solid #ccc;margin:8px;padding:6px}.ctx{font-family:monospace;white-space:pre-wrap;"
            "margin:2px 0;border-bottom:1px dotted #eee}</style><h1>Prototypes: top write-gate contexts</h1>"
            + "".join(rows))


# Built-in prompt sentences for the embedded corpus (written for this file, in the plays' register).
PROMPTS = {
    "woman": ["Frailty, thy name is woman", "I am a woman, and when I think I must speak",
              "Do you not know I am a woman", "She is a woman, therefore may be woo'd",
              "There was never yet fair woman but she made mouths in a glass",
              "Let still the woman take an elder than herself", "I have a woman's longing",
              "He that is more than a youth is not for me, and he that is less than a man, I am not for him; give me a woman"],
    "lady": ["The lady doth protest too much", "Good morrow, gentle lady", "My gracious lady, you are welcome home",
             "Is this the lady", "I know the lady well", "Speak to the lady, sir", "Fair lady, a word with you",
             "Here comes the lady"],
    "queen": ["Long live the queen", "God save the queen", "The king and queen are coming",
              "Madam, the queen", "Where is the queen", "I would I were a queen",
              "Go tell the queen", "The queen, my lord, is dead"],
    "daughter": ["I have a daughter", "My daughter is not yet of age", "Your daughter, sir, is here",
                 "Where is my daughter", "Thy daughter and thy crown", "She is my only daughter",
                 "Give me my daughter", "O my daughter"],
}


def load_prompts(cfg: Config, data, target: str) -> list[str]:
    """--prompts FILE, else the built-in set for the target, else val lines that contain the target word."""
    if cfg.prompts:
        try:
            lines = [ln.strip() for ln in Path(cfg.prompts).read_text(encoding="utf-8").splitlines() if ln.strip()]
        except OSError as e:
            raise RunError(f"--prompts {cfg.prompts}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise RunError(f"--prompts {cfg.prompts}: not a UTF-8 text file") from None
    elif target.lower() in PROMPTS:
        lines = PROMPTS[target.lower()]
    else:
        text = data.tokenizer.decode(data.tokens("val")[:200_000].tolist())
        lines = [ln for ln in text.splitlines() if "\ufffd" not in ln and find_word(ln, target) > 0][:16]
    lines = [ln for ln in lines if find_word(ln, target) > 0]
    if not lines:
        raise RunError(f"no line of --prompts {cfg.prompts} contains the word {target!r} after some context" if cfg.prompts
                       else f"no prompt contains the word {target!r} after some context; pass --prompts FILE")
    return lines


def find_word(text: str, word: str) -> int:
    """Index of the last whole-word, case-insensitive occurrence of `word` in `text` (-1 if none)."""
    low, w = text.lower(), word.lower()
    if not w.strip():
        return -1
    i = len(low)
    while True:
        i = low.rfind(w, 0, i)
        if i < 0:
            return -1
        before = low[i - 1] if i else " "
        after = low[i + len(w)] if i + len(w) < len(low) else " "
        if not before.isalnum() and not after.isalnum():
            return i


def prompt_batch(tok, prompts: list[str], target: str, device):
    """Right-padded prefixes (text before the target's last occurrence), their lengths, and the id of the
    target's first token as it would follow that prefix (spec §5.3: first BPE token, last occurrence)."""
    seqs, tids = [], []
    for p in prompts:
        i = find_word(p, target)
        prefix, piece = p[:i], p[i:i + len(target)]
        if prefix.endswith(" "):
            prefix, piece = prefix[:-1], " " + piece
        ids = tok.encode(prefix)
        tid = tok.encode(piece)[0]
        if tok.decode([tid]).isspace():  # a byte-level tokenizer spells the space alone: the word's first token
            prefix, piece = prefix + piece[0], piece[1:]  # is then its first letter, after the space
            ids, tid = tok.encode(prefix), tok.encode(piece)[0]
        if ids and tid != tok.unk:
            seqs.append(ids)
            tids.append(tid)
    if not seqs:
        raise RunError(f"the target {target!r} or its prompts are out of the model's vocabulary")
    T = max(map(len, seqs))
    x = torch.full((len(seqs), T), tok.eot, dtype=torch.long)
    for r, s in enumerate(seqs):
        x[r, : len(s)] = torch.tensor(s)
    return x.to(device), torch.tensor([len(s) - 1 for s in seqs], device=device), torch.tensor(tids, device=device)


@torch.no_grad()
def target_probs(model, batch) -> torch.Tensor:
    x, last, tid = batch
    probs = torch.softmax(model(x).float(), -1)
    return probs[torch.arange(len(x), device=x.device), last, tid]


@contextlib.contextmanager
def intervention(model: ProtoT, units: list[tuple[int, int]], mode: str, seed: int = 0):
    """Apply an intervention to (layer, prototype) units inside the block, undo it on exit (spec §5.3):
    write-mask: write logit -inf (no writes, mass 0, prefix mean 0); read-mask: read logit -inf;
    reinit: P_k <- randn/sqrt(d), not renormalised."""
    mixers = model.mixers()
    saved = []
    g = torch.Generator().manual_seed(seed)
    for l, k in units:
        m = mixers[l]
        if mode == "reinit":
            saved.append((m, m.P.data[k].clone(), k))
            m.P.data[k] = (torch.randn(m.P.shape[1], generator=g) / math.sqrt(m.P.shape[1])).to(m.P)
        else:
            attr = "write_mask" if mode == "write-mask" else "read_mask"
            if getattr(m, attr) is None:
                setattr(m, attr, torch.zeros(m.P.shape[0], dtype=torch.bool, device=m.P.device))
            getattr(m, attr)[k] = True
    try:
        yield
    finally:
        for m, row, k in reversed(saved):  # reversed: a unit listed twice gets its original row back
            m.P.data[k] = row
        for m in mixers:
            m.write_mask = m.read_mask = None


def parse_units(spec: str, layers: Optional[int], n_protos: Optional[int]) -> list[tuple[int, int]]:
    """'1:3,2:7' -> [(1, 3), (2, 7)]; the ranges checked once the model is known (layers, n_protos not None)."""
    units = []
    for part in spec.split(","):
        try:
            l, k = (int(s) for s in part.split(":"))
        except ValueError:
            raise RunError(f"--intervene expects LAYER:PROTO[,LAYER:PROTO...], got {part!r}") from None
        if layers is not None and not (0 <= l < layers and 0 <= k < n_protos):
            raise RunError(f"--intervene {part}: layer must be in 0..{layers - 1}, prototype in 0..{n_protos - 1}")
        if (l, k) not in units:
            units.append((l, k))
    return units


MIN_BASE_PROB = 1e-6  # the official script skips sentences whose baseline probability is below this


def relative(new: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    if not torch.isfinite(new).all():
        raise RunError("the intervened model gives non-finite probabilities")
    keep = base >= MIN_BASE_PROB
    return (new[keep] - base[keep]) / base[keep]


def kept_prompts(base: torch.Tensor, target: str) -> int:
    n = int((base >= MIN_BASE_PROB).sum())
    if n == 0:
        raise RunError(f"no prompt gives {target!r} a baseline probability of at least 1e-6; try other prompts")
    return n


def change_stats(rel: torch.Tensor) -> dict:
    """The most negative, the most positive and the mean relative change over the prompts. Masking a unit can
    raise the target's probability as well as lower it (the paper's masked "male" prototype: "women" +16.95%)."""
    return {"max_drop": rel.min().item(), "max_rise": rel.max().item(), "mean": rel.mean().item()}


def change_line(r: dict, digits: int = 2) -> str:
    """The log's "max drop D% / max rise R% / mean M%", each signed."""
    return " / ".join(f"{name} {r[key]:+.{digits}%}" for name, key in
                      (("max drop", "max_drop"), ("max rise", "max_rise"), ("mean", "mean")))


PPL_WINDOWS = 64  # val windows behind an intervention's perplexity change (the full split per unit would be slow)


def run_intervention(model, data, cfg, units, mode, target, autocast, ppl_windows=PPL_WINDOWS, ppl0=None) -> dict:
    """The target's probability and the perplexity on ppl_windows val windows, before and with `units` masked.
    ppl0: the unmasked perplexity over the same ppl_windows when the caller has it (find_prototype measures three
    units against one)."""
    prompts = load_prompts(cfg, data, target)
    batch = prompt_batch(data.tokenizer, prompts, target, data.device)
    base = target_probs(model, batch)
    n = kept_prompts(base, target)
    if ppl0 is None:
        ppl0 = evaluate_ppl(model, data, cfg.ctx, autocast, max_windows=ppl_windows)["ppl"]
    with intervention(model, units, mode, cfg.seed):
        new = target_probs(model, batch)
        ppl1 = evaluate_ppl(model, data, cfg.ctx, autocast, max_windows=ppl_windows)["ppl"]
    rel = relative(new, base)
    return {"units": [f"L{l} P{k}" for l, k in units], "mode": mode, "target": target, "prompts": n,
            **change_stats(rel), "ppl": ppl0, "ppl_change": ppl1 / ppl0 - 1}


def rank_units(model, cfg, batch, base) -> list[dict]:
    """Every (layer, prototype) with the relative change of the target's probability when its write gate is
    masked, the most negative mean first."""
    ranking = []
    for l in range(len(model.blocks)):
        for k in range(cfg.n_protos):
            with intervention(model, [(l, k)], "write-mask"):
                rel = relative(target_probs(model, batch), base)
            ranking.append({"unit": f"L{l} P{k}", "layer": l, "proto": k, **change_stats(rel)})
    return sorted(ranking, key=lambda r: r["mean"])


def find_prototype(model, data, cfg, target, autocast, top: int = 10) -> dict:
    """Rank every (layer, prototype) by the mean relative change of the target's probability when its write
    gate is masked; the perplexity change is measured for the top three. The best unit is picked on the same
    prompts its change is measured on, which flatters it; with 4+ prompts `split_half` also ranks on a random half
    (a seeded permutation, so a prompt file's order cannot line the halves up with its structure) and measures
    that half's best unit on the other half, a figure the selection did not see."""
    prompts = load_prompts(cfg, data, target)
    batch = prompt_batch(data.tokenizer, prompts, target, data.device)
    base = target_probs(model, batch)
    n = kept_prompts(base, target)
    ranking = rank_units(model, cfg, batch, base)
    ppl0 = evaluate_ppl(model, data, cfg.ctx, autocast, max_windows=PPL_WINDOWS)["ppl"]
    for r in ranking[:3]:
        r.update(run_intervention(model, data, cfg, [(r["layer"], r["proto"])], "write-mask", target, autocast,
                                  ppl0=ppl0))
    out = {"target": target, "prompts": n, "ranking": ranking[:top]}
    if len(prompts) >= 4:
        order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
        half = len(prompts) // 2
        pick, held = (prompt_batch(data.tokenizer, [prompts[i] for i in part], target, data.device)
                      for part in (order[:half], order[half:]))
        pick_base, held_base = target_probs(model, pick), target_probs(model, held)
        counts = [int((p >= MIN_BASE_PROB).sum()) for p in (pick_base, held_base)]
        if all(counts):
            best = rank_units(model, cfg, pick, pick_base)[0]
            with intervention(model, [(best["layer"], best["proto"])], "write-mask"):
                rel = relative(target_probs(model, held), held_base)
            out["split_half"] = {"unit": best["unit"], "selected_on": counts[0], "measured_on": counts[1],
                                 "selection_mean": best["mean"], **change_stats(rel)}
    return out


def split_half_text(h: dict) -> str:
    """find_prototype's split half, for the log and the report."""
    return (f"ranked on a random {h['selected_on']} prompts alone, their best {h['unit']} ({h['selection_mean']:+.1%} "
            f"there), measured on the other {h['measured_on']}: {change_line(h, 1)}")


# Perturbations of val lines that keep the meaning (spec §5.4), each a function line -> line (or None).
SYNONYMS = {"good": "fine", "lord": "master", "speak": "talk", "love": "adore", "great": "mighty",
            "little": "small", "fair": "lovely", "dead": "slain", "leave": "quit", "sweet": "dear",
            "friend": "comrade", "fear": "dread", "kill": "slay", "tell": "say", "king": "monarch",
            "happy": "glad", "poor": "wretched", "true": "honest", "man": "fellow", "night": "evening"}
PUNCTUATION_MARKS = ",;:.!?"
CONTRACTIONS = {"it is": "'tis", "do not": "don't", "I am": "I'm", "I will": "I'll", "is not": "isn't",
                "over": "o'er", "never": "ne'er", "even": "e'en", "it was": "'twas", "will not": "won't"}


def _typo(line, rng):
    words = [i for i, w in enumerate(line.split(" ")) if len(w) >= 4 and w.isalpha()]
    if not words:
        return None
    ws = line.split(" ")
    i = words[int(rng.integers(len(words)))]
    j = int(rng.integers(1, len(ws[i]) - 2))
    ws[i] = ws[i][:j] + ws[i][j + 1] + ws[i][j] + ws[i][j + 2:]
    return " ".join(ws)


def _table(table):
    def apply(line, rng):
        for a, b in table.items():
            i = find_word(line, a)
            if i >= 0:
                return line[:i] + b + line[i + len(a):]
        return None
    return apply


def _punctuation(line, rng):
    # Marks inside the line go, a final one stays: stripping it too would set the prediction after a full stop
    # beside the prediction after a word, a different next token rather than the same text less its commas.
    body, end = (line[:-1], line[-1]) if line and line[-1] in PUNCTUATION_MARKS else (line, "")
    s = body.translate(str.maketrans("", "", PUNCTUATION_MARKS)) + end
    return s if s != line else None


PERTURBATIONS = {
    "typo": _typo,
    "synonym": _table(SYNONYMS),
    "punctuation": _punctuation,
    "contraction": _table(CONTRACTIONS),
    "casing": lambda line, rng: line.lower() if line.lower() != line else None,
}


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen–Shannon divergence in nats (so in [0, ln 2]) between distributions along the last dim."""
    m = 0.5 * (p + q)
    kl = lambda a, b: (a * (a.clamp_min(1e-12).log() - b.clamp_min(1e-12).log())).sum(-1)
    # clamped at 0: for nearly equal p and q the two sums cancel to a rounding error either side of 0 (the log
    # printed "JS -0.0000"), and a divergence is never negative
    return (0.5 * kl(p, m) + 0.5 * kl(q, m)).clamp_min(0)


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Spearman rank correlation of two 1-D tensors: the Pearson correlation of their ranks, tied values sharing
    the mean of the ranks they span (as scipy.stats.spearmanr; nan when one side is constant, as there too)."""
    def ranks(x):  # ties span the sorted positions [searchsorted left, right): mean rank (left + 1 + right) / 2
        s = x.sort().values
        return (torch.searchsorted(s, x) + torch.searchsorted(s, x, right=True) + 1).double() / 2
    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return (ra * rb).sum() / (ra.square().sum() * rb.square().sum()).sqrt()


@torch.no_grad()
def robustness(models: dict, data, pairs: int = 48, topk: int = 10, seed: int = 0) -> dict:
    """Next-token Jensen-Shannon divergence, Spearman rank correlation over the whole vocabulary, top-k overlap
    and top-1 agreement between clean and perturbed val lines (spec §5.4), each a mean over the pairs, per
    perturbation and model; for ProtoT also how far each layer's write gate moves (JS of the last token's
    routing). Lines are model inputs of up to 48 tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    tok = data.tokenizer
    text = tok.decode(data.tokens("val")[:100_000].tolist())
    lines = [ln.strip() for ln in text.splitlines() if len(ln.split()) >= 6 and "\ufffd" not in ln]
    out = {}
    for name, fn in PERTURBATIONS.items():
        clean, pert = [], []
        for ln in lines:
            p = fn(ln, rng)
            if p and p != ln:
                clean.append(ln)
                pert.append(p)
            if len(clean) == pairs:
                break
        if not clean:
            continue
        row = {"pairs": len(clean)}
        for label, model in models.items():
            model.eval()
            stats = {"js": [], "spearman": [], "topk": [], "top1": [], "route": []}
            for a, b in zip(clean, pert):
                ids = [torch.tensor([tok.encode(s)[-48:]], device=data.device) for s in (a, b)]
                for m in model.mixers():
                    m.record = True
                routes, probs = [], []
                for x in ids:
                    probs.append(torch.softmax(model(x)[0, -1].float(), -1))
                    routes.append([m.last["w"][0, -1] for m in model.mixers() if "w" in m.last])
                for m in model.mixers():
                    m.record, m.last = False, {}
                stats["js"].append(js_divergence(*probs).item())
                stats["spearman"].append(spearman(*probs).item())
                ta, tb = (set(torch.topk(p, topk).indices.tolist()) for p in probs)
                stats["topk"].append(len(ta & tb) / topk)
                stats["top1"].append(float(probs[0].argmax() == probs[1].argmax()))
                if routes[0]:
                    stats["route"].append([js_divergence(ra, rb).item() for ra, rb in zip(*routes)])
            row[label] = {k: sum(stats[k]) / len(clean) for k in ("js", "spearman")}
            row[label].update({f"top{topk}": sum(stats["topk"]) / len(clean), "top1": sum(stats["top1"]) / len(clean)})
            if stats["route"]:
                row[label]["route_js_per_layer"] = [sum(c) / len(c) for c in zip(*stats["route"])]
        out[name] = row
    return out


def sample_text(model, tok, prompt: str, n: int, device, seed: int, **sampler) -> str:
    """One sample; `sampler`: generate's settings (SAMPLING_KEYS), the spec's where not given."""
    ids = tok.encode(prompt.replace("\\n", "\n").replace("\\t", "\t")) or [tok.eot]  # "\n" typed in a shell
    g = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=device), n, generator=g, **sampler)
    return tok.decode(out[0].tolist())


def sample_texts(model, tok, prompts: list[str], n: int, device, seed: int, **sampler) -> list[str]:
    """One sample per prompt, prompt i drawn with seed + i: the prefix mean forgets a prompt within a few
    half-lives, so with one seed every prompt would be continued with the same draws and soon the same text."""
    return [sample_text(model, tok, p, n, device, seed + i, **sampler) for i, p in enumerate(prompts)]


BENCH_VOCAB = 16000  # the paper's vocabulary size (spec §3.1)


def bench_time(fn, device, reps=3) -> float:
    """Median seconds of fn() after one warm-up call; triton.testing.do_bench on CUDA, else the clock between
    synchronisations (a CUDA or MPS call returns before its work is done)."""
    if device.type == "cuda" and HAS_TRITON:
        return triton.testing.do_bench(fn, quantiles=[0.5]) / 1e3
    sync = {"cuda": torch.cuda.synchronize, "mps": torch.mps.synchronize}.get(device.type, lambda: None)
    fn()
    times = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def crossover(ctxs: list[int], protot_tok_s: list[float], attention_tok_s: list[float]) -> Optional[int]:
    """The context from which ProtoT is faster at every longer one, over at least two contexts: a single win,
    noisy in the middle of the sweep or at its last context, is no crossover (the GPU sweep runs to 64k so that
    the paper's 32k can be confirmed)."""
    return next((T for i, T in enumerate(ctxs[:-1])
                 if all(p > a for p, a in zip(protot_tok_s[i:], attention_tok_s[i:]))), None)


@torch.no_grad()
def bench(cfg: Config, vocab_size: int, device, log=print) -> dict:
    """Forward tokens/s against context (ProtoT torch and Triton paths, attention), the crossover, decode
    ms/token at positions 256 and 16k, and the scan kernel vs the chunked reference. Batch 1, model dims of
    this run, measured side by side in one process."""
    gpu = device.type == "cuda"
    ctxs = [1024, 2048, 4096, 8192, 16384, 32768, 65536] if gpu else [256, 512, 1024, 2048, 4096, 8192]
    variants = {"protot-torch": dict(mixer="proto", kernels="torch"), "attention": dict(mixer="attention",
                                                                                        kernels="torch")}
    if cfg.ema == "official":  # the forward's; the decode figure times the exact recurrent step either way
        log("bench: --ema official is the b^s-cumsum shortcut, which has no kernel: protot-torch times its torch "
            "form; the decode ms/token times the exact recurrent step (the cache is always exact)")
    elif gpu and HAS_TRITON and _prefix_mean_fits(cfg.n_protos, value_width(cfg)):
        variants["protot-triton"] = dict(mixer="proto", kernels="triton")
        variants["attention"]["kernels"] = "triton"  # the same norm and loss kernels as the path it is compared to
    elif gpu and HAS_TRITON:
        log(f"bench: R {cfg.n_protos} × d_v {value_width(cfg)} is past the scan kernel's tile limit; "
            "timing the chunked torch form only")
    dtype = torch.bfloat16 if gpu else torch.float32
    res = {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "ctx": ctxs, "tok_s": {}, "ema": cfg.ema}
    log(f"bench: {cfg.layers} layers, d={cfg.d_model}, R={cfg.n_protos}, vocab {vocab_size}, batch 1, {dtype}, "
        f"--ema {cfg.ema}")
    log(f"{'ctx':>7} " + " ".join(f"{v:>15}" for v in variants) + "   (forward tokens/s)")
    models = {k: ProtoT(replace(cfg, **v, dropout=0.0), vocab_size).to(device, dtype).eval()
              for k, v in variants.items()}
    for k in variants:
        res["tok_s"][k] = []
    # off CUDA each point is the median of `reps` timed calls: with 3 the CPU's 8k/1k ratio moved across the
    # 10 of the issue from run to run; 7 at most doubles the sweep (the whole CPU bench took 16 s with 3).
    # CUDA times with do_bench instead.
    res["reps"] = reps = 3 if gpu else 7
    for T in ctxs:
        x = torch.randint(0, vocab_size, (1, T), device=device)
        row = []
        for k, m in models.items():
            s = bench_time(lambda: m(x), device, reps=reps)
            res["tok_s"][k].append(T / s)
            row.append(f"{T / s:>15,.0f}")
        log(f"{T:>7} " + " ".join(row))
    scan = "protot-triton" if "protot-triton" in res["tok_s"] else "protot-torch"  # the path the model runs here
    p, a = res["tok_s"][scan], res["tok_s"]["attention"]
    res["scaling_path"] = scan
    i1k = ctxs.index(1024)
    res["protot_time_ratio_8k_1k"] = (8192 / p[ctxs.index(8192)]) / (1024 / p[i1k])
    res["attention_time_ratio_8k_1k"] = (8192 / a[ctxs.index(8192)]) / (1024 / a[i1k])
    res["crossover_ctx"] = crossover(ctxs, p, a)
    log(f"time(8k)/time(1k): {scan} {res['protot_time_ratio_8k_1k']:.1f}, attention "
        f"{res['attention_time_ratio_8k_1k']:.1f} (linear = 8); ProtoT faster at every ctx from "
        f"{res['crossover_ctx'] or '> ' + str(ctxs[-1])}"
        + (f" (faster at {ctxs[-1]} alone: one point is no crossover)" if not res["crossover_ctx"] and p[-1] > a[-1]
           else ""))
    # decode: the O(1) step at position 256 and at 16k
    m = models["protot-triton" if "protot-triton" in models else "protot-torch"]
    res["decode_ms"] = {}
    for pos in (256, 16384):
        caches = [{} for _ in m.blocks]
        m(torch.randint(0, vocab_size, (1, pos), device=device), caches=caches)
        nxt = torch.randint(0, vocab_size, (1, 1), device=device)
        snap = [{k: v.clone() for k, v in c.items()} for c in caches]

        def step():
            for c, s in zip(caches, snap):
                c.update({k: v.clone() for k, v in s.items()})
            m(nxt, caches=caches)
        res["decode_ms"][pos] = 1e3 * bench_time(step, device, reps=20)
    log(f"decode ms/token: position 256 {res['decode_ms'][256]:.2f}, position 16384 {res['decode_ms'][16384]:.2f} "
        f"(ratio {res['decode_ms'][16384] / res['decode_ms'][256]:.2f})")
    res["kernel"] = bench_kernel(device, log)
    return res


def bench_kernel(device, log=print) -> dict:
    """prefix_mean_read, Triton scan vs the chunked torch form, forward and forward+backward."""
    if device.type != "cuda" or not HAS_TRITON:
        log("kernel: the Triton scan needs a CUDA GPU; skipped")
        return {}
    out = {}
    for B, T, R, dv in [(8, 2048, 32, 128), (8, 4096, 32, 128), (4, 8192, 32, 64)]:
        args = [torch.softmax(torch.randn(B, T, R, device=device), -1).requires_grad_(),
                torch.randn(B, T, dv, device=device, dtype=torch.bfloat16).requires_grad_(),
                torch.softmax(torch.randn(B, T, R, device=device), -1).requires_grad_(),
                torch.sigmoid(torch.randn(R, device=device)).requires_grad_()]
        row = {}
        for name in ("torch", "triton"):
            fwd = lambda: prefix_mean_read(*args, backend=name)
            t_fwd = bench_time(fwd, device)  # bench() runs under no_grad: the forward builds no graph
            with torch.enable_grad():
                fb = lambda: prefix_mean_read(*args, backend=name).float().sum().backward()
                row[name] = (t_fwd, bench_time(fb, device))
        key = f"B{B} T{T} R{R} dv{dv}"
        out[key] = {"fwd_speedup": row["torch"][0] / row["triton"][0], "fwdbwd_speedup": row["torch"][1] / row["triton"][1],
                    "ms": {k: [1e3 * t for t in v] for k, v in row.items()}}
        log(f"kernel {key}: triton fwd {1e3 * row['triton'][0]:.2f} ms ({out[key]['fwd_speedup']:.1f}x faster than chunked), "
            f"fwd+bwd {1e3 * row['triton'][1]:.2f} ms ({out[key]['fwdbwd_speedup']:.1f}x faster)")
    return out


def loss_figure(histories: dict) -> str:
    """Training and val loss curves as a base64 PNG (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, h in histories.items():
        if h["train"]:
            ax.plot(*zip(*h["train"]), label=f"{name} train", alpha=0.7)
        if h["val"]:
            ax.plot(h["step"], h["val"], "o-", label=f"{name} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


PCT_COLUMNS = {"mean", "max_drop", "max_rise", "ppl_change"}  # relative changes, shown as percentages


def table_html(rows: list[dict], cols: list[str]) -> str:
    def fmt(c, v):
        if isinstance(v, float):
            return f"{v:+.2%}" if c in PCT_COLUMNS else f"{v:.4g}"
        return html.escape(str(v))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{fmt(c, r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def write_report(out_dir: Path, cfg: Config, results: dict, histories: dict, name: str = "report") -> Path:
    from common import unk_targets_cell

    shown = asdict(cfg)
    for key in ("preset", "device", "dtype"):  # the flag as typed and what the run made of it: "auto → cpu"
        if results.get(key) and results[key] != shown[key]:
            shown[key] = f"{shown[key]} → {results[key]}"
    parts = [f"<h1>ProtoT report</h1><p>{html.escape(time.strftime('%Y-%m-%d %H:%M'))}, preset "
             f"{html.escape(results.get('preset', ''))}, device {html.escape(results.get('device', ''))}</p>",
             "<h2>Configuration</h2>" + table_html([shown], list(shown))]
    if histories:
        parts.append(f'<h2>Training</h2><img src="data:image/png;base64,{loss_figure(histories)}">')
    if "ppl" in results:
        parts.append("<h2>Perplexity (val, every token once)</h2>" + table_html(
            [{"model": k, "ppl": f"{v['ppl']:.2f}", "tokens": v["tokens"], "weights of step": v.get("step", ""),
              "without the unk targets": unk_targets_cell(v)}
             for k, v in results["ppl"].items()],
            ["model", "ppl", "tokens", "weights of step", "without the unk targets"]))
        if "ratio" in results:
            parts.append(f"<p>ProtoT / attention perplexity ratio: {results['ratio']:.3f} (paper: 90.5 / 78.7 = 1.150)</p>")
        elif "ratio_skipped" in results:
            parts.append(f"<p>ProtoT / attention perplexity ratio not computed: {html.escape(results['ratio_skipped'])}"
                         "</p>")
    if "labels" in results:
        hl = [c["half_life"] for c in results["labels"]["cards"]]
        parts.append(f'<h2>Prototypes</h2><p>{len(hl)} prototypes labelled from {results["labels"]["windows"]} '
                     f'val contexts: <a href="{results["labels"]["file"]}">{results["labels"]["file"]}</a> (and its '
                     f'.json). Half-lives: '
                     f'min {min(hl):.1f}, median {statistics.median(hl):.1f}, max {max(hl):.1f} tokens '
                     f'(init ln 0.5 / ln 0.9 = 6.6).</p>')
        if results["labels"].get("gate_lag"):
            parts.append("<h3>Read-write gate lag</h3><p>paper: the read gate fires for a concept one token before "
                         "the write gate (ℓ = +1 pairs the read at t with the write at t + 1), on the same val "
                         "contexts:</p><ul>" + "".join(f"<li>{html.escape(gate_lag_line(g))}</li>"
                                                       for g in results["labels"]["gate_lag"]) + "</ul>")
    if "find_prototype" in results:
        fp = results["find_prototype"]
        parts.append(f"<h2>Which prototype carries '{html.escape(fp['target'])}'?</h2><p>write-mask of each "
                     f"(layer, prototype), {fp['prompts']} prompts, ranked by mean change of the target's "
                     "probability (paper: -16.6% max for 'women' with &lt;1% perplexity change). mean, max_drop and "
                     "max_rise: the mean, the most negative and the most positive relative change over the prompts; "
                     f"ppl_change: the perplexity change on {PPL_WINDOWS} val windows, measured for the top three "
                     "only</p>" + table_html(fp["ranking"], ["unit", "mean", "max_drop", "max_rise", "ppl_change"]))
        if "split_half" in fp:
            parts.append("<p>The best unit above is picked on the prompts it is measured on. Split half: "
                         f"{html.escape(split_half_text(fp['split_half']))}.</p>")
    if "intervention" in results:
        iv = {**results["intervention"], "units": ", ".join(results["intervention"]["units"])}  # not a list's repr
        parts.append(f"<h2>Intervention</h2><p>{html.escape(iv['mode'])} of {html.escape(iv['units'])} together. "
                     "max_drop, max_rise and mean: the most negative, the most positive and the mean relative change "
                     "of the target's probability over the prompts; ppl_change: the perplexity change on "
                     f"{PPL_WINDOWS} val windows</p>" + table_html(
                         [iv], ["units", "mode", "target", "prompts", "max_drop", "max_rise", "mean", "ppl_change"]))
    if "robustness" in results:
        rows = []
        for kind, r in results["robustness"].items():
            for model in (k for k in r if k != "pairs"):
                rows.append({"perturbation": kind, "model": model, "pairs": r["pairs"], "JS": f"{r[model]['js']:.4f}",
                             "Spearman": f"{r[model]['spearman']:.3f}", "top-10 overlap": f"{r[model]['top10']:.3f}",
                             "top-1 agreement": f"{r[model]['top1']:.3f}",
                             "routing JS per layer": " ".join(f"{v:.3f}" for v in r[model].get("route_js_per_layer", []))})
        parts.append("<h2>Robustness (next-token distribution, clean vs perturbed)</h2><p>Means over the pairs. JS: "
                     "Jensen-Shannon divergence in nats (0 to ln 2 = 0.693), lower = more robust; Spearman: rank "
                     "correlation of the two distributions over the whole vocabulary (-1 to 1), top-10 overlap and "
                     "top-1 agreement: higher = more robust. Paper, ProtoT / LLaMA JS: typo .207 / .227, synonym "
                     ".113 / .145, punctuation .398 / .174, contraction .082 (ProtoT).</p>" + table_html(
            rows, ["perturbation", "model", "pairs", "JS", "Spearman", "top-10 overlap", "top-1 agreement",
                   "routing JS per layer"]))
    if "samples" in results:
        # how each model generates: ProtoT's recurrent state is O(1) per token, the baseline's KV cache grows
        how = {"proto": "ProtoT, O(1) recurrent cache", "attention": "attention baseline, KV cache (grows with the position)"}
        parts.append("<h2>Samples</h2>" + (f"<p>The same prompts and generator seeds ({cfg.seed} + i for prompt i) for "
                                           "each model: a paired comparison, the differences come from the mixer.</p>"
                                           if len(results["samples"]) > 1 else "")
                     + "".join(f"<h3>{html.escape(how.get(k, k))}</h3>" + "".join(f"<pre>{html.escape(s)}</pre>" for s in v)
                               for k, v in results["samples"].items()))
    path = out_dir / f"{name}.html"
    path.write_text("<!doctype html><meta charset=utf-8><title>ProtoT report</title><style>body{font-family:"
                    "sans-serif;max-width:1100px}table{border-collapse:collapse;font-size:12px}td,th{border:1px "
                    "solid #ccc;padding:2px 6px}pre{background:#f6f6f6;padding:6px;white-space:pre-wrap}</style>"
                    + "".join(parts))
    return path


# -----------------------------------------------------------------------------
# main


class Logger:
    """print() on rank 0, and the same lines appended to out_dir/log-<mixer>.txt (log-proto-attention.txt
    with --compare)."""

    def __init__(self, path: Optional[Path], rank: int):
        self.path, self.rank = path, rank
        if path is not None and rank == 0:
            try:  # an unusable --out-dir is found here, before any work
                path.parent.mkdir(parents=True, exist_ok=True)
                open(path, "a").close()
            except OSError as e:
                raise RunError(f"--out-dir {path.parent}: cannot write there ({e.strerror or e})") from None

    def __call__(self, msg: str) -> None:
        if self.rank != 0:
            return
        print(msg, flush=True)
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(msg + "\n")


def apply_preset(cfg: Config, explicit) -> str:
    preset = cfg.preset if cfg.preset != "auto" else ("paper" if torch.cuda.is_available() else "cpu")
    if preset == "cpu":
        for k, v in CPU_PRESET.items():
            if k not in explicit:
                setattr(cfg, k, v)
    return preset


FLOAT32_MAX = torch.finfo(torch.float32).max  # every float flag must fit: AdamW steps in float32
ADAM_LR_MAX = FLOAT32_MAX * (1 - 0.9)  # Adam's first step divides lr by 1 − β1
FLOAT32_TINY = torch.finfo(torch.float32).tiny  # the smallest repetition penalty that float32 does not round to 0
MAX_LAYERS = 1024  # the model is built block by block before any memory runs out: --layers 1e20 would never end


def validate(cfg: Config) -> None:
    """Every bad flag value found before anything is trained, each as one line."""
    seeds = [f.name for f in fields(cfg) if f.name.endswith("seed") and not 0 <= getattr(cfg, f.name) < 2**32]
    if seeds:  # torch.manual_seed overflows past 64 bits with a traceback; numpy's legacy seeding past 32
        raise RunError(f"--{seeds[0].replace('_', '-')} must be in [0, 2**32)")
    checks = [(1 <= cfg.layers <= MAX_LAYERS, f"--layers must be in [1, {MAX_LAYERS}]"), (cfg.d_model % 2 == 0, "--d-model must be even"),
              (cfg.d_model >= 6, "--d-model must be >= 6 (below, the SwiGLU width floor(2.7·d/16)·16 is 0)"),
              (cfg.n_protos >= 1, "--n-protos must be >= 1"), (cfg.ctx >= 1, "--ctx must be >= 1"),
              (cfg.batch_size >= 1, "--batch-size must be >= 1"), (cfg.max_iters >= 1, "--max-iters must be >= 1"),
              (cfg.train or not cfg.resume, "--resume continues training and --no-train trains nothing; give one"),
              (not cfg.bench or cfg.train and not cfg.resume, "--bench times the model and its kernels on random "
                                                              "data, with no checkpoint: drop --resume and --no-train"),
              (cfg.eval_interval >= 1 and cfg.log_interval >= 1 and cfg.eval_iters >= 1, "intervals must be >= 1"),
              (cfg.lr > 0, "--lr must be > 0"), (0 <= cfg.dropout < 1, "--dropout must be in [0, 1)"),
              (0 <= cfg.min_lr_ratio <= 1, "--min-lr-ratio must be in [0, 1]"),
              (0 <= cfg.warmup_frac <= 1, "--warmup-frac must be in [0, 1]"),
              (cfg.weight_decay >= 0, "--weight-decay must be >= 0"), (cfg.grad_clip >= 0, "--grad-clip must be >= 0"),
              (cfg.early_stop >= 0, "--early-stop must be >= 0 (0: off)"),
              (0 <= cfg.conv_layers <= MAX_LAYERS, f"--conv-layers must be in [0, {MAX_LAYERS}]"), (cfg.label_windows >= 1, "--label-windows must be >= 1"),
              (cfg.sample_tokens >= 0, "--sample-tokens must be >= 0"), (cfg.heads >= 1, "--heads must be >= 1"),
              (cfg.temperature >= 0, "--temperature must be >= 0 (0: greedy)"),
              (cfg.top_k >= 0, "--top-k must be >= 0 (0: off)"),
              (0 < cfg.top_p <= 1, "--top-p must be in (0, 1] (1: off)"),
              (FLOAT32_TINY <= cfg.repetition_penalty, f"--repetition-penalty must be >= {FLOAT32_TINY:.1e} (1: off)"),
              (cfg.no_repeat_ngram_size >= 0, "--no-repeat-ngram-size must be >= 0 (0: off)"),
              (cfg.out_dir.strip() != "", "--out-dir is empty (. names the current folder)"),
              (not Path(cfg.out_dir).exists() or Path(cfg.out_dir).is_dir(), f"--out-dir {cfg.out_dir} is a file")]
    if cfg.mixer == "attention" or cfg.compare or cfg.bench:  # --bench times the attention baseline too
        checks.append((cfg.d_model % cfg.heads == 0 and (cfg.d_model // cfg.heads) % 2 == 0,
                       f"--d-model {cfg.d_model} must split into --heads {cfg.heads} heads of even size"))
    for ok, msg in checks:
        if not ok:
            raise RunError(msg)
    # finite and in float32's range: --lr inf or 1e39 passes "> 0", then trains to a NaN loss or overflows in AdamW
    bad = [f.name for f in fields(cfg) if isinstance(v := getattr(cfg, f.name), float) and not abs(v) <= FLOAT32_MAX]
    if bad:
        raise RunError(f"--{bad[0].replace('_', '-')} must be a finite number of at most {FLOAT32_MAX:.1e} (float32)")
    # Adam's first step is lr / (1 − β1) = 10·lr (β1 = 0.9) in float32: past FLOAT32_MAX / 10, a traceback
    big = [f.name for f in fields(cfg) if (f.name == "lr" or f.name.endswith("_lr")) and getattr(cfg, f.name)
           > ADAM_LR_MAX]
    if big:
        raise RunError(f"--{big[0].replace('_', '-')} must be at most {ADAM_LR_MAX:.1e} (Adam's first step, 10·lr, "
                       "must fit float32)")
    if (cfg.intervene or cfg.find_prototype not in ("auto", "off")) and cfg.mixer != "proto" and not cfg.compare:
        raise RunError("--intervene and --find-prototype need --mixer proto")
    if cfg.intervene:
        parse_units(cfg.intervene, None, None)  # the syntax now; the ranges once the model is known
    if (cfg.intervene and not cfg.target.strip()) or not cfg.find_prototype.strip():
        raise RunError("the target word is empty (--target, --find-prototype WORD; --find-prototype off skips it)")
    if cfg.prompts and not Path(cfg.prompts).is_file():
        raise RunError(f"--prompts {cfg.prompts}: " + ("a folder, not a file" if Path(cfg.prompts).is_dir() else "no such file"))


def budget_diff(a: dict, b: dict) -> str:
    """'' when two models' settings (config dicts with the steps trained, "step") share BUDGET_KEYS; else what
    differs, 'step 20 vs 5'."""
    return ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in BUDGET_KEYS if a.get(k) != b.get(k))


def ranks_target(cfg: Config) -> bool:
    """--find-prototype auto ranks --target after a training run that has no --intervene of its own."""
    return cfg.find_prototype == "auto" and cfg.train and not cfg.intervene


def unused_flags(cfg: Config, explicit, mixers) -> list[str]:
    """Typed analysis flags that this invocation does not use, each with why: notes for the log. A flag left in a
    command whose analysis is off does no harm, but it should not pass unseen."""
    proto = "proto" in mixers
    auto = ranks_target(cfg)
    rank = proto and (auto or cfg.find_prototype not in ("auto", "off"))  # find-prototype runs
    why = {"mode": (proto and cfg.intervene, "it is the edit of --intervene, and there is none"),
           "target": (proto and (cfg.intervene or auto), "it is the word of --intervene, and of --find-prototype auto "
                      "after training, and neither runs here; --find-prototype WORD ranks a word without training"),
           "prompts": (proto and (cfg.intervene or rank), "it feeds --intervene and --find-prototype, and neither runs "
                       "here"),
           "label_windows": (proto and cfg.labels, "prototype labelling is off" if proto else "no ProtoT model: "
                             "--mixer attention has no prototypes to label"),
           **dict.fromkeys(("sample_tokens",) + SAMPLING_KEYS,
                           (cfg.train or cfg.sample is not None, "no samples: a --no-train run samples only with --sample"))}
    why.update(dict.fromkeys(MIXER_KEYS["proto"], (proto, "--mixer attention has no prototypes")))
    why["heads"] = ("attention" in mixers, "it sizes the attention baseline's heads, and --mixer proto has none")
    why["mixer"] = (not cfg.compare, "--compare trains both mixers")
    if not cfg.train:  # load_checkpoint kept the checkpoint's value: the typed one went unused, whatever else
        why.update(dict.fromkeys(TRAINING_KEYS, (False, "--no-train trains nothing: the checkpoint's value stays")))
    return [f"note: --{k.replace('_', '-')} has no effect in this run ({msg})" for k, (used, msg) in why.items()
            if k in explicit and not used]


def check_steps(loaded: dict) -> None:
    """--resume: a checkpoint already past its --max-iters (typed lower) would train nothing and report a config
    that is not the model's: one line instead."""
    for path, ck, c in loaded.values():
        if isinstance(ck["step"], int) and ck["step"] > c.max_iters:
            raise RunError(f"{path} is at step {ck['step']}, past --max-iters {c.max_iters}: --resume continues a run "
                           "(raise --max-iters), --no-train analyses it as it is")


def check_tokenizer(ck: dict, data, path: Path) -> None:
    """A checkpoint only makes sense with the token map, and the corpus contents, it was trained with (a checkpoint
    from before the contents were stored, 2026-12-05, is checked on its map alone)."""
    saved, current = ck["tokenizer"], data.tokenizer.state_dict()
    if saved["name"] != current["name"] or saved["compacted"] != current["compacted"] or \
            not torch.equal(saved["kept"], current["kept"]):
        raise RunError(f"{path} was trained with another token map ({saved['name']}, "
                       f"{len(saved['kept']) + 1 if saved['compacted'] else 'full'} ids) than this data's "
                       f"({current['name']}, {data.vocab_size} ids); the corpus or its cache changed")
    corpus = getattr(data, "meta", {}).get("fingerprint")  # a file edited in place keeps its name and maybe its map
    if ck.get("corpus") is not None and corpus is not None and ck["corpus"] != corpus:
        raise RunError(f"{path} was trained on other contents of --dataset {ck['config']['dataset']} (the files changed "
                       "since); restore them, or retrain on these")


def load_weights(model: nn.Module, state: dict, path: Path) -> None:
    """load_state_dict, with one line for a checkpoint of another shape or one that holds NaN/inf weights."""
    try:
        model.load_state_dict(state)
    except (RuntimeError, TypeError, AttributeError) as e:  # a wrong shape or key; a value that is no tensor
        raise RunError(f"{path} does not fit this model ({str(e).splitlines()[-1].strip()})") from None
    if not all(t.isfinite().all() for t in model.state_dict().values() if t.is_floating_point()):
        raise RunError(f"{path} holds non-finite weights (a diverged or damaged run); delete it or retrain")


def load_model(ck: dict, c: Config, data, device, path: Path) -> ProtoT:
    """The checkpoint's model for the analyses: the best evaluation's weights (best_of), their step as
    `model.weights_step`."""
    check_tokenizer(ck, data, path)
    model = ProtoT(c, data.vocab_size).to(device)
    best = best_of(ck)
    load_weights(model, best["model"], path)
    model.weights_step = best["step"]
    return model


def run(cfg: Config, explicit) -> int:
    from common import DataError, load_data, preset_banner, to_json, unk_targets_note, unknown_note

    preset = apply_preset(cfg, explicit)
    validate(cfg)
    device, autocast, dist_info = setup_device(cfg)
    if cfg.kernels == "triton" and not HAS_TRITON:
        raise RunError(f"--kernels triton needs the triton package, which failed to import ({TRITON_ERROR})")
    if cfg.kernels == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RunError("--kernels triton needs a CUDA device (or TRITON_INTERPRET=1, Triton's slow CPU interpreter)")
    rank = dist_info["rank"]
    mixers = ("proto", "attention") if cfg.compare else (cfg.mixer,)
    loaded = {}  # --no-train / --resume: the architecture and the data come from the checkpoint
    if not cfg.train or cfg.resume:
        for mixer in mixers:
            path = ckpt_path(replace(cfg, mixer=mixer))
            if cfg.train and cfg.compare and not path.exists() and mixer != mixers[0]:
                continue  # --compare stopped before this mixer's first checkpoint: it trains from step 0
            loaded[mixer] = (path, *load_checkpoint(path, replace(cfg, mixer=mixer), explicit))
        saved = loaded[mixers[0]][2]
        cfg = replace(cfg, **{k: getattr(saved, k) for k in MERGED_KEYS})
        if cfg.train:
            check_steps(loaded)
    dv = value_width(cfg)  # after the merge: --resume / --no-train take n_protos and d_model from the checkpoint
    if cfg.kernels == "triton" and (cfg.mixer == "proto" or cfg.compare) and not _prefix_mean_fits(cfg.n_protos, dv):
        raise RunError(f"--kernels triton: the scan kernel supports --n-protos × d_v up to {_PREFIX_MEAN_MAX_TILE} "
                       f"and --n-protos up to 512 (padded to powers of two), got {cfg.n_protos} × {dv}; use --kernels auto or torch")
    if cfg.intervene:
        parse_units(cfg.intervene, cfg.layers, cfg.n_protos)
    out_dir = Path(cfg.out_dir)
    log = Logger(None if cfg.bench else out_dir / f"log-{'-'.join(mixers)}.txt", rank)  # --compare: log-proto-attention
    if preset == "cpu" and not cfg.bench and cfg.train and not cfg.resume:  # a resumed run keeps its own settings
        log(preset_banner(cfg, explicit, device, "about 5 minutes on 2 CPU cores", CPU_PRESET, RUNTIME_KEYS))
    log("config: " + json.dumps(asdict(cfg)))
    for note in [] if cfg.bench else unused_flags(cfg, explicit, mixers):
        log(note)
    log(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton "
        f"{getattr(triton, '__version__', 'absent')}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    torch.manual_seed(cfg.seed + rank)
    if cfg.bench:  # random tokens over the paper's 16k vocabulary: no corpus needed
        res = bench(cfg, BENCH_VOCAB, device, log)
        if rank == 0:
            print(json.dumps(res, indent=1, default=str))
        return 0

    def get_data():
        return load_data(cfg.dataset, cfg.tokenizer, cfg.compact, cfg.max_tokens, cfg.cache_dir, device, cfg.seed,
                         rank, dist_info["world"])
    error = None
    if rank == 0:  # rank 0 builds the token cache; the others wait, then reuse it (or meet the same error)
        try:
            data = get_data()
        except DataError as e:
            error = e
    if dist_info["ddp"]:
        torch.distributed.barrier()
    if error is not None:
        raise error
    if rank != 0:
        data = get_data()
    data.check_ctx(cfg.ctx)  # before any step: a window longer than a split cannot be drawn from it
    if cfg.labels and "proto" in mixers and len(data.tokens("val")) <= LABEL_WIDTH:  # and not after training
        raise RunError(f"prototype labelling reads val windows of {LABEL_WIDTH} tokens; the val split has "
                       f"{len(data.tokens('val'))} (a larger corpus, or --no-labels)")
    # a typed --target or --prompts that the default find-prototype will use after training
    auto_typed = ranks_target(cfg) and bool({"target", "prompts"} & set(explicit))
    if "proto" in mixers:  # the typed targets' prompts, before training rather than after it
        for word in [cfg.target] * bool(cfg.intervene or auto_typed) + [cfg.find_prototype] * (cfg.find_prototype not in
                                                                                               ("auto", "off")):
            prompt_batch(data.tokenizer, load_prompts(cfg, data, word), word, "cpu")
    results = {"preset": preset, "device": str(device),
               "dtype": "bfloat16" if isinstance(autocast, torch.autocast) else "float32"}
    histories, models, budgets = {}, {}, {}  # budgets: what each model was trained on, for --compare's ratio
    start_rng = data.rng_state()  # each model from the same data state: a paired comparison, batch for batch
    for mixer in mixers:
        c = replace(cfg, mixer=mixer)
        if cfg.train:
            ck = None
            if mixer in loaded:  # --resume, with this checkpoint's own settings (--compare: each its own)
                path, ck, c = loaded[mixer]
                check_tokenizer(ck, data, path)
            elif cfg.resume:
                c = replace(c, resume=False)
                log(f"{mixer}: no checkpoint at {ckpt_path(c)} yet; training it from step 0")
            t0 = time.time()
            models[mixer], histories[mixer] = train(c, data, device, autocast, dist_info, explicit, log, ck,
                                                    start_rng)
            log(f"{mixer}: trained in {time.time() - t0:.0f}s; checkpoint {ckpt_path(c)}")
            budgets[mixer] = {**asdict(c), "step": c.max_iters}
        else:
            path, ck, c = loaded[mixer]
            models[mixer], histories[mixer] = load_model(ck, c, data, device, path), ck["history"]
            budgets[mixer] = {**ck["config"], "step": budget_steps(ck)}  # as trained, whatever this command typed
            if "best" not in ck:
                log(f"note: {path} predates --early-stop: the analyses use its last weights (step {ck['step']}), "
                    "the best evaluation's were not kept")
    if dist_info["ddp"]:  # the analyses run on rank 0 alone, over the whole val split
        torch.distributed.destroy_process_group()
        data.rank, data.world_size = 0, 1
    if rank != 0:
        return 0
    results["ppl"] = {}
    for mixer, m in models.items():
        results["ppl"][mixer] = {**evaluate_ppl(m, data, cfg.ctx, autocast), "step": m.weights_step}
        ppl = results["ppl"][mixer]
        log(f"{mixer}: val perplexity {ppl['ppl']:.2f} over {ppl['tokens']:,} tokens with the weights of step "
            f"{m.weights_step}, the best evaluation's (the analyses use them too)" + unk_targets_note(ppl))
    differ = budget_diff(budgets["proto"], budgets["attention"]) if cfg.compare else ""
    if differ:  # e.g. --no-train --compare beside a baseline trained apart: a ratio would not compare the mixers
        results["ratio_skipped"] = f"ProtoT and attention were trained on different budgets ({differ})"
        log(f"perplexity ratio not computed: {results['ratio_skipped']}")
    elif cfg.compare:
        results["ratio"] = results["ppl"]["proto"]["ppl"] / results["ppl"]["attention"]["ppl"]
        log(f"perplexity ProtoT {results['ppl']['proto']['ppl']:.2f} vs attention "
            f"{results['ppl']['attention']['ppl']:.2f}: ratio {results['ratio']:.3f} (paper 90.5 / 78.7 = 1.150)")
    model = models.get("proto")
    if model is not None:
        model.eval()
        if cfg.labels:
            stem = "prototypes" if cfg.train else "analysis-prototypes"  # never over the training run's
            results["labels"] = label_prototypes(model, data, cfg, out_dir, stem=stem)
            log(f"prototype labels: {out_dir / (stem + '.html')}, {out_dir / (stem + '.json')}")
            for g in results["labels"].get("gate_lag", []):  # paper: the read fires one token before the write
                log("gate lag, " + gate_lag_line(g))
        auto = cfg.find_prototype == "auto"
        target = cfg.target if ranks_target(cfg) else \
            ("" if cfg.find_prototype in ("auto", "off") else cfg.find_prototype)
        if target:
            try:
                fp = find_prototype(model, data, cfg, target, autocast)
            except RunError as e:
                if not auto:
                    raise
                log(f"find-prototype skipped: {e}")  # the default analysis does not fail a finished run
            else:
                results["find_prototype"] = fp
                log(f"find-prototype {target!r} ({fp['prompts']} prompts): " + ", ".join(
                    f"{r['unit']} {r['mean']:+.1%}" for r in fp["ranking"][:5]))
                best = fp["ranking"][0]
                log(f"  best {best['unit']}: target probability {change_line(best, 1)}, perplexity on "
                    f"{PPL_WINDOWS} val windows {best['ppl_change']:+.2%}")
                if "split_half" in fp:  # the best unit above is chosen on the prompts it is measured on
                    log("  split half: " + split_half_text(fp["split_half"]))
        if cfg.intervene:
            r = run_intervention(model, data, cfg, parse_units(cfg.intervene, cfg.layers, cfg.n_protos), cfg.mode,
                                 cfg.target, autocast)
            results["intervention"] = r
            log(f"{cfg.mode} {','.join(r['units'])} on {cfg.target!r} ({r['prompts']} prompts): target probability "
                f"{change_line(r)}; perplexity on {PPL_WINDOWS} val windows {r['ppl']:.2f} "
                f"{r['ppl_change']:+.2%}")
    if cfg.robustness:
        # --compare over two budgets: the asked mixer's model alone, then the other's checkpoint is refused below
        rob_models = {cfg.mixer: models[cfg.mixer]} if differ else dict(models)
        other = "attention" if "attention" not in rob_models else "proto"
        oc = replace(cfg, mixer=other)
        if len(rob_models) == 1 and ckpt_path(oc).exists():  # the other mixer's checkpoint, when not in memory
            try:  # trained on the same data, or no comparison (a token map alone does not tell the corpus)
                ck, oc = load_checkpoint(ckpt_path(oc), oc, ("dataset", "tokenizer", "compact", "max_tokens"))
                differ = budget_diff(next(iter(budgets.values())), {**ck["config"], "step": budget_steps(ck)})
                if differ:  # side by side, a model trained on other tokens would pass for the other mixer's figure
                    raise RunError(f"{ckpt_path(oc)} was trained on another budget: {differ}")
                rob_models[other] = load_model(ck, oc, data, device, ckpt_path(oc))
            except RunError as e:
                log(f"robustness: not comparing with {other} ({e})")
        results["robustness"] = robustness(rob_models, data, seed=cfg.seed)
        if not results["robustness"]:
            log("robustness: skipped, no val line of 6+ words that a perturbation changes")
        for name, r in results["robustness"].items():
            log(f"robustness {name:12s} " + "  ".join(f"{k}: JS {v['js']:.4f} Spearman {v['spearman']:.3f} top1 "
                                                     f"{v['top1']:.2f}" for k, v in r.items() if k != "pairs"))
    if cfg.sample is not None or cfg.train:
        prompts = [cfg.sample] if cfg.sample is not None else ["HAMLET:\n", "KING:\nMy lords,"]
        note = unknown_note(data.tokenizer, cfg.sample) if cfg.sample is not None else None
        if note:  # a typed prompt the compacted vocabulary cannot spell: say so beside the sample
            log(note)
        results["samples"] = {}  # per model, as prism.py and dual_stream.py keep theirs
        if len(models) > 1:  # --compare: both models, one prompt and seed each, so the texts differ by the model
            log(f"samples: the same prompts and generator seeds ({cfg.seed} + i for prompt i) for each model, a "
                "paired comparison: the differences come from the mixer")
        for mixer, m in models.items():
            m.eval()
            results["samples"][mixer] = sample_texts(m, data.tokenizer, prompts, cfg.sample_tokens, device, cfg.seed,
                                                     **{k: getattr(cfg, k) for k in SAMPLING_KEYS})
            for s in results["samples"][mixer]:
                log(f"sample ({mixer}): " + s.replace("\n", "\n        "))
    tag = "results" if cfg.train else "analysis"  # an analysis-only run never overwrites the training run's report
    (out_dir / f"{tag}.json").write_text(to_json(results))
    page = "report" if cfg.train else "analysis"
    if cfg.report:
        log(f"report: {write_report(out_dir, cfg, results, histories, page)}")
    elif (out_dir / f"{page}.html").exists():  # --no-report: the page there does not show this run's results
        log(f"report: none written (--no-report); {out_dir / f'{page}.html'} is an earlier run's, not {tag}.json's")
    return 0


def main(argv=None) -> int:
    try:  # the model and its core op run alone; training and the analyses read their data through common.py
        from common import DataError, memory_error, parse_config
    except ImportError as e:
        print(f"error: {Path(__file__).name} trains and analyses with glassbox's common.py beside it ({e})",
              file=sys.stderr)
        return 1

    cfg, args = parse_config(Config, argv, "ProtoT, the Prototype Transformer (arXiv 2602.11852).")
    try:
        return run(cfg, args.explicit)
    except (RunError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # an allocation that does not fit, or a path the system refuses, is no bug: one line
        if (message := memory_error(e)) is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    finally:
        if dist_ready():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
