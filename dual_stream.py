"""dual_stream.py — the Dual-Stream Transformer, channelized mixing and its diagnostics, in one file.

Paper: "The Dual-Stream Transformer: Channelized Architecture for Interpretable Language Modeling",
J. C. Kerce and A. Fox, arXiv 2603.07461 (2026). No code was released; the block follows the authors' later
reference document (gpt-oss-interpretability, `neuro-symb-v2`). Spec used here: shared/papers/dual_stream.md.

The residual stream is split in two, x = x_t + x_e. The token stream x_t starts as the token embeddings and only
attention writes to it; the context stream x_e starts at zero and only the FFNs write to it. Q, K and the FFN read
the sum through a channel-aware LayerNorm (CLN: statistics per head slice), V the token stream through its own
(2). Per block (spec §1, §9):

    (1) h     = CLN_1(x_t + x_e)                              Q and K read the combined state (dense projections)
    (2) v     = Mix_V( CLN_v(x_t) )                           V reads the token stream (--v-source)
    (3) y     = softmax( α · q kᵀ / √d_h + causal ) v         α = 1 in training; the amplification probe raises it
    (4) x_t  += Mix_O(y)                                      attention writes only x_t
    (5) x_e  += FFN( CLN_2(x_t + x_e) )                       the FFN writes only x_e
    (6) logits = E · CLN_f(x_t + x_e)                         tied head, RoPE on q, k (or ALiBi), no position embeddings

Channelized mixing (spec §3) acts on the "payload" projections Mix_V and Mix_O, with x split into H heads of d_h:
    identity      y_g = x_g                       0 parameters
    independent   y_g = W_g x_g                   H·d_h² (block-diagonal: no flow between heads)
    kronecker     y_g = Σ_h A[g, h] x_h           H² (A ⊗ I: heads exchange scalars, no within-head transform)
    dense         y = W x                         d² (a standard transformer)
and the FFN is dense (d → 4d → d) or independent (one d_h → 4d_h → d_h MLP per head). Neither the Kronecker nor
the block-diagonal matrix is ever built. Update modes: `token-factor` (above), `fts` (x_t frozen at the embeddings,
attention writes x_e) and `single` (one stream, x += attn(CLN(x)); x += ffn(CLN(x)), the same switches otherwise).

Core op: amp_attention(q, k, v, α, slopes) -> (o, entropy, max_weight): Eq. (3), with ALiBi's bias when slopes are
given, plus, per head and query, the entropy of the attention row and its largest weight, computed in the same
online-softmax pass (a Triton kernel, forward and backward for o) so these statistics never need a T×T matrix
(the specialisation probes, which read whole attention maps, build them for their few windows); a torch reference
sits beside it.

Choices where the spec is open (most a switch where the result may depend on it; the sweep's FTS row and the
offline corpus are fixed)
  * V source: CLN_v(x_t), a CLN of its own (--v-source xt-cln, the 2026 code's reading); xt-raw and combined
    are the alternatives. With xt-cln every layer has one more CLN (d gains): the spec's parameter table counts
    two norms per block, so its totals are matched exactly by xt-raw and exceeded by L·d by xt-cln (a test).
  * CLN affine: a gain per element, [H, d_h] = d values (--cln-gain element), no bias (the table's count);
    --cln-gain head gives the 2025 code's one scalar per head (CLN only: with --norm layernorm it is an error),
    --cln-bias adds biases, --norm layernorm swaps CLN for a standard LayerNorm everywhere.
  * Mixing points: the spec (§3, §11.2) lists four, V, O, FFN up and FFN down (the authors' keys attn_v_mixing,
    attn_out_mixing, ffn_up_mixing, ffn_down_mixing). --mixing sets V and O together and --ffn-mixing FFN up and
    down together, as every configuration of the spec's sweep does (its table, the authors' signatures such as
    ind-ind/ind-ind); --attn-v-mixing, --attn-out-mixing, --ffn-up-mixing and --ffn-down-mixing set one point
    alone (e.g. Kronecker V with dense O). With one FFN projection per head and the other dense, the 4d hidden
    units are read as H consecutive groups of 4d_h. A split is stored in one spelling (--mixing holds V's,
    --attn-out-mixing O's where it differs; the FFN likewise), so either way of typing it finds its checkpoint.
  * FFN mixing: dense by default (the headline sweep varies V and O jointly); --ffn-mixing independent.
  * Ablation point: a stream is removed at the readout (the authors' tooling: lm_head(ln_f(x_t)) or x_e alone).
    --ablate-at all adds rows that drop a stream's writes in every block (x_t stays the embedding, x_e stays
    zero), so the other stream is computed without it: attention writes dropped with the readout kept as
    x_t + x_e (then the embedding plus x_e), attention writes dropped and x_t left out of the readout, and FFN
    writes dropped (ABLATIONS names each row by what it removes). In FTS mode nothing writes x_t, so the first row
    would equal the unablated model and the other two would repeat the readout rows; they are skipped with a
    note. Reading a stream as zero instead would zero every activation of this bias-free model when x_t is the
    one removed: the loss would be ln V whatever the weights.
  * Initialisation: N(0, 0.02) for embeddings, Q, K, dense/independent V and the Kronecker A's (lineage code);
    the output projections (O, FFN down) N(0, 0.02/√(2L)) as GPT-2; --kron-out-init scaled gives the Kronecker
    A_O the same scaling (tft-gtp). FTS normalises the frozen x_t once with a CLN (--fts-cln-at-init, default on).
  * Weight decay (0.1) on every matrix, the Kronecker A's (H×H) included; norm gains are not decayed. The spec
    does not say how the authors grouped A: decay pulls its entries toward 0, so the hub tables read smaller
    values than without it, while the hub ratios (column mass over the mean) do not depend on A's scale.
  * Position (spec §1, §8, §11.5): RoPE θ = 10⁴ on q and k (--pos rope, the 2026 configs and the default) or ALiBi
    (--pos alibi, the 2025 lineage): no rotation, a fixed bias −s_h·(t − s) on head h's logits with Press et al.'s
    slopes (alibi_slopes; H = 6: 1/4, 1/16, 1/64, 1/256, 1/2, 1/8); no position embeddings either way. Whether
    amplification scales the bias is open (spec §5, §11.5). --alibi-alpha scaled (the default) amplifies the whole
    logit, α·(q·kᵀ/√d_h − s_h·(t − s)): the trained attention at temperature 1/α, as "the logits are multiplied by α
    before the softmax" (the glossary) reads, tending to the argmax of what each head already prefers, distance
    included, which is the discrete-selection test. --alibi-alpha unscaled sharpens only the content term,
    α·q·kᵀ/√d_h − s_h·(t − s), so the distance penalty fades against it as α grows and the loss increase then also
    counts the position signal lost. At α = 1 (training) both are one model: --alibi-alpha is an analysis setting
    kept with the checkpoint but not in its name, while --pos names it (ckpt-...-pos-alibi.pt) and is checked on
    loading: an ALiBi model has a RoPE model's weights, so only the stored --pos tells them apart, and typing the
    other is a one-line error. The three forms of the core op take the bias as per-head slopes (Triton: a constexpr
    HAS_BIAS, so the RoPE kernels compile as before). No dropout inside the softmax (the kernel has none); dropout
    on the embedding and both residual branches.
  * The sweep's FTS row uses independent V/O mixing (the summary's "safety-critical" operating point).
  * Data: the paper's instructional corpus is not public; offline the embedded plays, online
    `--dataset tinystories` (the closest public match).
  * Tokenizer: cl100k compacted to the 19,446 ids seen in training on the plays (vocabulary 19,447 with unk), not the
    spec's full GPT-2 vocabulary (§11.4): cl100k ships with the package, so the default runs offline (gpt2 needs
    tiktoken's one-time download), and the compacted softmax is small. So the GPU default (`--preset paper` changes
    nothing) is the paper's architecture as the spec reconstructs it (6 layers, H = 6; d = 384 inferred, §8) with
    this file's ctx 256, batch 64 and 10,000 steps (the paper's are unknown) on the embedded corpus: 10,000 × 64 ×
    256 = 163.8M tokens, about 138 passes over the 1.18M training tokens, and fewer embedding parameters than the
    paper's 29M. The paper's count needs the GPT-2 vocabulary, `--tokenizer gpt2 --compact none` (online once;
    vocabulary 50,257): 28,153,776 parameters for the default Kronecker model (the spec's 28.15M plus L·d = 2,304 for
    --v-source xt-cln), 29,922,816 with --mixing dense.
  * Head specialisation has no published definition (spec §7): distinctiveness is the mean pairwise
    Jensen–Shannon divergence (base 2, in [0, 1]) between heads' attention rows, per layer; the coreference probe
    is a built-in set of two-name sentences where a pronoun refers to one of them, scored per head by the
    attention mass from the pronoun to the right name minus the mass to the other one. The spec's logit gap has
    a family of its own, COREF_GAP_TEMPLATES (in the attention probe's a verb follows the pronoun, so no next
    token there is a name): short scenes closed by a question such as "The one who wept was", so that the next
    token is the antecedent, the one name of the pronoun's gender. It is scored as logit(right name's first
    token) − logit(wrong name's) at the last position (mean, standard error, fraction above 0), and per head by
    direct logit attribution (Wang et al. 2022): the head's write (Mix_O of its output alone) through CLN_f, its
    per-slice scale frozen at that position, and the tied head, on E[right] − E[wrong]. That is well defined in
    every mode, token-factor included, since the readout reads x_t + x_e, the sum of every write; it counts a
    head's direct effect only, not what later layers make of its write. --head-sweep trains H = 2, 3, 6, 12 at
    fixed d on the same batches and compares both probes per H (spec §7, §10.5).
    Hubs are reported per Kronecker matrix and layer, and their growth across depth ("amplified about 3.5× in
    deeper layers", spec §7, §10.4; hub_growth): the deepest layer's hub head, its off-diagonal column mass there
    over its mass in the first layer, beside the median of the same growth for random matrices and the hub ratios
    of both layers (the other reading of "3.5×": the hub against the other heads).
  * Amplification rows give the loss, its perplexity exp(loss) (spec §5, §11.6) and the increase over α = 1;
    the greedy samples are at most AMP_SAMPLE_TOKENS = 40 tokens, whatever --sample-tokens says.
  * Sweep cost vs the paper: its "fully independent +8 %" is set beside the ind/ind row (V/O and FFN all
    independent), the spec's recommendation; which projections the paper varied is unconfirmed (spec §3), so
    the +8 % might belong to V/O-only independent mixing (the "independent" row) instead.
  * Checkpoint and log names (variant): mode and mixing (a split point spelled as its flag, e.g.
    -attn-out-mixing-dense), then every other architecture setting in NAME_KEYS that differs from its default,
    spelled as its flag (e.g. ckpt-token-factor-kronecker-heads-3.pt; dropout and --alibi-alpha are not named); the
    sizes of either preset keep the plain name, so `python dual_stream.py` writes ckpt-token-factor-kronecker.pt on a
    CPU and on a GPU.

Commands
    python dual_stream.py                          # train (Kronecker, token-factor), amplification, ablation,
                                                   # specialisation, samples, out/dual_stream/report.html
                                                   # (no GPU: a CPU preset of about 5 minutes, announced)
    python dual_stream.py --sweep                  # 7 configurations on one budget: val loss vs dense
    python dual_stream.py --head-sweep             # H = 2, 3, 6, 12 at fixed d: specialisation per H
    python dual_stream.py --mixing independent --ffn-mixing independent    # fully independent
    python dual_stream.py --mode fts --mixing independent                 # frozen token stream
    python dual_stream.py --mixing kronecker --attn-out-mixing dense      # one mixing point alone
    python dual_stream.py --pos alibi                                     # ALiBi instead of RoPE (spec §11.5)
    python dual_stream.py --no-train --pos alibi --alibi-alpha unscaled   # amplification leaving the bias as is
    python dual_stream.py --no-train --amplify 1,4,16 --ablate-at all     # analyses of a trained checkpoint
    python dual_stream.py --bench                  # training tok/s per mixing vs dense; the mixing maps alone;
                                                   # kernel vs SDPA
    python dual_stream.py --dataset tinystories --max-tokens 100000000     # online
    torchrun --standalone --nproc_per_node=8 dual_stream.py               # DDP

Expected (CPU preset, 2 cores, 2026-12-01): `python dual_stream.py` takes about 4.5 minutes (4 min 29 s, the
token cache's build included, 243 s of it training); the logged loss falls from 6.95 (step 20) to 5.25 (step
300) and val perplexity ends near 335 (cl100k compacted to 19,447 ids, 614k tokens seen). At this budget amplification
barely moves the loss (+0.2% at α = 16, against the paper's 16-27%) and, at the readout, removing x_e hurts far
more than removing x_t (+86% vs +3%; third-party write-ups of the paper: +9.5% vs +36%): a short run on plays is not
the paper's regime, and the README says so.
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
    from kernels import cross_entropy, layer_norm
except ImportError:
    def layer_norm(x, weight, bias, groups=1, eps=1e-5, backend="auto"):
        xg = x.unflatten(-1, (groups, x.shape[-1] // groups))
        y = F.layer_norm(xg.float(), xg.shape[-1:], eps=eps).flatten(-2) * weight.float()
        return (y if bias is None else y + bias.float()).to(x.dtype)

    def cross_entropy(logits, target, ignore_index=-100, reduction="mean", inplace_grad=False, backend="auto"):
        return F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction)


# -----------------------------------------------------------------------------
# Config


# The amplification's greedy samples are capped at this many tokens, whatever --sample-tokens says (its help
# text says so): there is one per α per model (35 in a sweep with the default α's), read side by side against
# α = 1's, and the log prints only their first 160 characters; a short sample keeps that comparison readable and
# the decoding cheap.
AMP_SAMPLE_TOKENS = 40


@dataclass
class Config:
    # model (spec §1-4; the paper's 6-layer, 6-head, d = 384 models)
    mode: Literal["token-factor", "fts", "single"] = field(
        default="token-factor", metadata={"help": "attention writes x_t (token-factor) or x_e (fts: x_t frozen); single: one stream"})
    mixing: Literal["identity", "independent", "kronecker", "dense"] = field(
        default="kronecker", metadata={"help": "channelized mixing of the attention V and O projections"})
    ffn_mixing: Literal["dense", "independent"] = field(default="dense", metadata={"help": "dense FFN, or one MLP per head"})
    # the four mixing points one by one (spec §3, §11.2); "same" follows the pair's flag above
    attn_v_mixing: Literal["same", "identity", "independent", "kronecker", "dense"] = field(
        default="same", metadata={"help": "mixing of V alone (same: --mixing)"})
    attn_out_mixing: Literal["same", "identity", "independent", "kronecker", "dense"] = field(
        default="same", metadata={"help": "mixing of O alone (same: --mixing)"})
    ffn_up_mixing: Literal["same", "dense", "independent"] = field(
        default="same", metadata={"help": "mixing of the FFN up-projection alone (same: --ffn-mixing)"})
    ffn_down_mixing: Literal["same", "dense", "independent"] = field(
        default="same", metadata={"help": "mixing of the FFN down-projection alone (same: --ffn-mixing)"})
    v_source: Literal["xt-cln", "xt-raw", "combined"] = field(
        default="xt-cln", metadata={"help": "V reads CLN_v(x_t), x_t, or CLN_1(x_t + x_e) (single mode: always CLN_1(x))"})
    norm: Literal["cln", "layernorm"] = field(default="cln", metadata={"help": "channel-aware LayerNorm, or a standard one"})
    cln_gain: Literal["element", "head"] = field(default="element", metadata={"help": "CLN gain per element or one per head"})
    cln_bias: bool = field(default=False, metadata={"help": "norms have a bias"})
    kron_out_init: Literal["normal", "scaled"] = field(default="normal", metadata={"help": "Kronecker A_O ~ N(0, 0.02), or /sqrt(2L)"})
    fts_cln_at_init: bool = field(default=True, metadata={"help": "fts: normalise the frozen x_t once with a CLN"})
    layers: int = field(default=6, metadata={"help": "transformer blocks"})
    heads: int = field(default=6, metadata={"help": "attention heads H (the channels)"})
    d_model: int = field(default=384, metadata={"help": "model width d = H·d_h"})
    dropout: float = field(default=0.1, metadata={"help": "dropout (embedding, residual branches)"})
    # position (spec §1, §11.5): no position embeddings either way
    pos: Literal["rope", "alibi"] = field(default="rope", metadata={
        "help": "position (spec §11.5): RoPE θ = 1e4 on q, k (the 2026 configs) or ALiBi biases (the 2025 code)"})
    alibi_alpha: Literal["scaled", "unscaled"] = field(default="scaled", metadata={
        "help": "--pos alibi, amplification α (spec §5, §11.5): α·(q·kᵀ/√d_h − bias) (scaled) or α·q·kᵀ/√d_h − bias"})
    # data (common.py)
    dataset: str = field(default="shakespeare", metadata={"help": "shakespeare | tinystories | fineweb-edu | PATH"})
    tokenizer: Literal["cl100k", "gpt2", "bytes"] = field(default="cl100k", metadata={"help": "tokenizer"})
    compact: str = field(default="train", metadata={"help": "vocabulary compaction: none | train | N"})
    max_tokens: Optional[int] = field(default=None, metadata={"help": "training-token budget of the corpus"})
    cache_dir: Optional[str] = field(default=None, metadata={"help": "token cache folder"})
    # training (the authors' 2026 trainer: AdamW (0.9, 0.95), wd 0.1, warmup + cosine, clip 1.0)
    preset: Literal["auto", "cpu", "paper"] = field(default="auto", metadata={"help": "auto: paper on a GPU, cpu otherwise"})
    batch_size: int = field(default=64, metadata={"help": "global batch (sequences per step, all ranks)"})
    ctx: int = field(default=256, metadata={"help": "training context length"})
    lr: float = field(default=1e-3, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine floor as a fraction of lr"})
    warmup_frac: float = field(default=0.02, metadata={"help": "warmup as a fraction of max_iters"})
    max_iters: int = field(default=10000, metadata={"help": "optimizer steps"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay on matrices"})
    grad_clip: float = field(default=1.0, metadata={"help": "max gradient norm (0: off)"})
    eval_interval: int = field(default=500, metadata={"help": "steps between evaluations and checkpoints"})
    eval_iters: int = field(default=20, metadata={"help": "val batches per evaluation"})
    log_interval: int = field(default=50, metadata={"help": "steps between log lines"})
    seed: int = field(default=1337, metadata={"help": "random seed"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N | mps"})
    dtype: Literal["auto", "float32", "bfloat16"] = field(default="auto", metadata={"help": "auto: bf16 autocast on CUDA GPUs with native bf16 (sm_80+), else float32"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model"})
    kernels: Literal["auto", "triton", "torch"] = field(default="auto", metadata={"help": "Triton kernels on CUDA (auto)"})
    out_dir: str = field(default="out/dual_stream", metadata={"help": "checkpoints, logs and reports"})
    resume: bool = field(default=False, metadata={"help": "continue from out_dir's checkpoint"})
    train: bool = field(default=True, metadata={"help": "train (--no-train: load out_dir's checkpoints)"})
    # analyses (the default run does all that apply)
    sweep: bool = field(default=False, metadata={"help": "train the 7 sweep configurations on one budget and compare"})
    head_sweep: bool = field(
        default=False, metadata={"help": "train H = 2, 3, 6, 12 heads at fixed d on one budget: specialisation per H"})
    amplify: str = field(default="1,2,4,8,16", metadata={"help": "attention amplification factors α ('' off)"})
    ablation: bool = field(default=True, metadata={"help": "stream ablation (remove x_t or x_e)"})
    ablate_at: Literal["readout", "all"] = field(
        default="readout", metadata={"help": "remove a stream at the readout; all: also rows with its writes dropped in every block"})
    specialization: bool = field(default=True, metadata={"help": "head distinctiveness, Kronecker hubs, coreference probes"})
    analysis_windows: int = field(default=128, metadata={"help": "val windows for the amplification and ablation losses"})
    sample: Optional[str] = field(default=None, metadata={"help": "generate from this prompt"})
    sample_tokens: int = field(default=100, metadata={
        "help": f"tokens per sample (the amplification's greedy samples: at most {AMP_SAMPLE_TOKENS})"})
    temperature: float = field(default=0.8, metadata={"help": "sampling temperature (0: greedy)"})
    top_k: int = field(default=40, metadata={"help": "sample among the k most likely tokens (0: off)"})
    bench: bool = field(default=False, metadata={"help": "benchmarks only (training tok/s per mixing, attention kernel)"})
    report: bool = field(default=True, metadata={"help": "write out_dir/report.html (analysis.html with --no-train)"})


# A CPU has ~1/1000 of a GPU's FLOPs: the preset keeps the six heads and the block but narrows the width to
# d_h = 32, trims the depth to 4 and shortens context and run so that training and every analysis take ~5 minutes.
CPU_PRESET = dict(layers=4, d_model=192, ctx=128, batch_size=16, max_iters=300, lr=2e-3, dropout=0.0,
                  eval_interval=100, eval_iters=5, log_interval=20, analysis_windows=48)
# A checkpoint fixes ARCH_KEYS (asking for other values is an error); --resume and --no-train take every other
# setting from it too unless typed (MERGED_KEYS: all but how and where this invocation runs). --pos is an
# architecture key (an ALiBi model has RoPE's weights, so only the stored config tells them apart); --alibi-alpha
# is not: training runs at α = 1, where both readings are one model, so a checkpoint is analysed under either (its
# stored value unless typed).
POINT_KEYS = ("attn_v_mixing", "attn_out_mixing", "ffn_up_mixing", "ffn_down_mixing")
ARCH_KEYS = ("mode", "mixing", "ffn_mixing", *POINT_KEYS, "v_source", "norm", "cln_gain", "cln_bias", "fts_cln_at_init", "layers",
             "heads", "d_model", "pos", "dataset", "tokenizer", "compact", "max_tokens")
RUNTIME_KEYS = ("mode", "mixing", "ffn_mixing", *POINT_KEYS, "preset", "device", "dtype", "compile", "kernels",
                "out_dir", "cache_dir", "resume", "train", "sweep", "head_sweep", "bench", "report", "sample",
                "amplify", "ablation", "ablate_at", "specialization", "analysis_windows", "sample_tokens",
                "temperature", "top_k")
MERGED_KEYS = tuple(f.name for f in fields(Config) if f.name not in RUNTIME_KEYS)


# -----------------------------------------------------------------------------
# Core op: amp_attention(q, k, v, alpha, slopes=None) -> (o, entropy, max_weight),
#                                                      o = softmax(α·q·kᵀ/√d_h − b_h·(t − s) + causal) · v
#
# Causal attention with an inference-time amplification α of the logits, plus two per-head diagnostics of the
# attention pattern, for every batch b, head h and query row t (keys s <= t):
#
#     p_ts       = softmax_s(α · q_t · k_s / √d_h − b_h · (t − s))     (keys s > t masked to -inf)
#     o_t        = Σ_s p_ts v_s
#     entropy_t  = -Σ_s p_ts log p_ts                       nats; 0 for a one-hot row, log(t+1) for a uniform one
#     max_weight = max_s p_ts
#
# Both statistics fall out of the online-softmax pass that computes o, without a T×T matrix. With the running
# max m, l = Σ_s exp(x_s − m) and S = Σ_s exp(x_s − m)·(x_s − m) over the logits x_s seen so far, a new key
# tile with max m' moves the max to m_new = max(m, m'), and with c = exp(m − m_new) the old sums become
#
#     l ← c · l                  S ← c · (S + (m − m_new) · l)          (then add the tile's own terms)
#
# and at the end, since log p_s = x_s − m − log l,
#
#     entropy = log l − S / l            max_weight = exp(m − m) / l = 1 / l
#
# S is kept relative to m (not Σ exp(x − m)·x) so that no large m cancels against S/l: with α = 16 the logits
# reach tens while a peaked row's entropy is ~0.01. The kernels work in base 2 (x·log2(e), exp2), which only
# rescales the identity by ln 2.
#
# `slopes` [H] (None: no bias, the RoPE model) adds ALiBi's linear bias −b_h·(t − s) to head h's logits after the
# α scale: b_h is the slope as it acts, so the model passes s_h (bias not amplified) or α·s_h (amplified with the
# rest of the logit), see ChannelAttention. The bias enters the statistics like any logit; it does not depend on
# q, k, v, so the backward is unchanged but for the recomputed p, which includes it.
#
# Shapes: q, k, v [B, H, T, d_h], all the same shape; o [B, H, T, d_h] in q's dtype, differentiable in q, k, v.
# entropy, max_weight [B, H, T] fp32 (fp64 for fp64 inputs in the reference and torch forms), non-differentiable:
# they are read-outs, their gradients are never asked for and are ignored.
#
# The same op in three forms (fla's naive → fused):
#   1. amp_attention_reference  explicit [T, T] scores in fp32 (fp64 for fp64 inputs), softmax, entr: the truth
#   2. amp_attention_torch      o from F.scaled_dot_product_attention (CPU training; with slopes the bias and the
#                               causal mask go in as one float [H, T, T] attn_mask); statistics without grad in
#                               query blocks of `block` rows, so they hold O(block·T) scores, never T×T
#   3. AmpAttention             Triton kernels in the style of the fused-attention tutorial (06): a forward that
#                               writes o, the statistics and the logsumexp, and the usual recompute-p backward
# Dispatch (`backend` in AMP_BACKENDS): "reference" → 1; "torch" → 2; "triton" → 3 (on CPU only under
# TRITON_INTERPRET=1); "auto" → 3 for CUDA tensors when triton imports and d_h <= AMP_MAX_HEAD_DIM, else 2.
# `stats=False` only saves work in the torch form; the kernels produce the statistics for free and return them.

AMP_BACKENDS = ("auto", "triton", "torch", "reference")
AMP_MAX_HEAD_DIM = 128  # widest head given to the kernels (compiled for sm_90 up to here, <= 115 KB of shared memory)
LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x · log2(e)); the kernels spell it out (no globals in @jit)


def _amp_up(t):
    """Statistics precision: fp32, or fp64 for fp64 inputs (so the tests can build a float64 ground truth)."""
    return t if t.dtype == torch.float64 else t.float()


def alibi_bias(slopes, rows, cols):
    """ALiBi's bias −slopes_h·(t − s) for query positions `rows` and key positions `cols` -> [H, len(rows), len(cols)]
    in slopes' dtype (keys after the query get a positive value: the causal mask covers them)."""
    return -slopes[:, None, None] * (rows[:, None] - cols[None, :]).to(slopes.dtype)


def amp_attention_reference(q, k, v, alpha=1.0, slopes=None):
    T, d_h = q.shape[-2:]
    scores = alpha / math.sqrt(d_h) * (_amp_up(q) @ _amp_up(k).transpose(-2, -1))  # [B, H, T, T]
    if slopes is not None:
        pos = torch.arange(T, device=q.device)
        scores = scores + alibi_bias(slopes.to(q.device, scores.dtype), pos, pos)
    future = torch.ones(T, T, dtype=torch.bool, device=q.device).triu(1)
    p = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    o = (p @ _amp_up(v)).to(q.dtype)
    p = p.detach()  # the statistics are read-outs, not part of the graph
    return o, torch.special.entr(p).sum(-1), p.amax(-1)  # entr(p) = -p·log p, with entr(0) = 0


def amp_attention_torch(q, k, v, alpha=1.0, stats=True, block=128, slopes=None):
    T, d_h = q.shape[-2:]
    scale = alpha / math.sqrt(d_h)
    pos = torch.arange(T, device=q.device)
    if slopes is None and scale == 0:  # α = 0: CPU SDPA's is_causal path returns NaN at scale 0; a mask does not
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=pos[:, None] >= pos[None, :], scale=0.0)
    elif slopes is None:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:  # the bias and the causal mask as one additive [H, T, T] mask (SDPA takes no is_causal beside one)
        up = torch.float64 if q.dtype == torch.float64 else torch.float32
        bias = alibi_bias(slopes.to(q.device, up), pos, pos).masked_fill(pos[None, :] > pos[:, None], float("-inf"))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=scale)
    if not stats:
        return o, None, None
    entropy = q.new_empty(q.shape[:-1], dtype=_amp_up(q).dtype)
    max_weight = torch.empty_like(entropy)
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):  # fp32 statistics under bf16 autocast too
        qf, kf = _amp_up(q), _amp_up(k)
        for t0 in range(0, T, block):
            t1 = min(t0 + block, T)  # rows t0..t1-1 see keys 0..t1-1 only
            scores = scale * (qf[..., t0:t1, :] @ kf[..., :t1, :].transpose(-2, -1))  # [B, H, t1 - t0, t1]
            if slopes is not None:
                scores = scores + alibi_bias(slopes.to(q.device, scores.dtype), pos[t0:t1], pos[:t1])
            future = torch.arange(t1, device=q.device) > torch.arange(t0, t1, device=q.device)[:, None]
            p = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
            entropy[..., t0:t1] = torch.special.entr(p).sum(-1)
            max_weight[..., t0:t1] = p.amax(-1)
    return o, entropy, max_weight


# Kernels. One program owns a [BLOCK, BLOCK_D] tile of one (batch, head) and walks the other sequence axis in
# tiles, only up to (forward, dq) or from (dk, dv) the causal diagonal. The head dim is padded to BLOCK_D and the
# sequence to a multiple of BLOCK with masked loads (padding reads 0), so any d_h <= AMP_MAX_HEAD_DIM and any T
# work. All accumulation is fp32. The dot operands (DOT_T) are the inputs' own 16-bit type on CUDA, with p and dS
# rounded to it before their products (FlashAttention's choice, tensor-core speed); fp32 inputs, and every input
# under the interpreter (numpy has no bf16), use fp32 operands at IEEE precision (TF32 would cost ~1e-3 relative
# error), so the CPU tests compare the same maths in fp32.

@triton.jit
def _amp_fwd_tiles(q, K, V, rows, dims, dim_ok, m_i, l_i, s_i, acc, lo, hi, T, DH, qk_scale, slope,
                   BLOCK_N: tl.constexpr, DOT_T: tl.constexpr, HAS_BIAS: tl.constexpr, MASKED: tl.constexpr):
    """The forward's online softmax over the key tiles lo..hi; MASKED applies the causal mask and the sequence end
    (the diagonal tile), else every key is visible (tiles wholly before the query tile)."""
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + tl.arange(0, BLOCK_N)
        if MASKED:
            col_ok = cols < T
            kT = tl.load(K + cols[None, :] * DH + dims[:, None], mask=dim_ok[:, None] & col_ok[None, :], other=0.0)
            v = tl.load(V + cols[:, None] * DH + dims[None, :], mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
        else:
            kT = tl.load(K + cols[None, :] * DH + dims[:, None], mask=dim_ok[:, None], other=0.0)
            v = tl.load(V + cols[:, None] * DH + dims[None, :], mask=dim_ok[None, :], other=0.0)
        x = tl.dot(q, kT.to(DOT_T), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]
        if HAS_BIAS:
            x -= slope * (rows[:, None] - cols[None, :]).to(tl.float32)
        if MASKED:
            visible = (cols[None, :] <= rows[:, None]) & col_ok[None, :]
            x = tl.where(visible, x, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(x, 1))
        c = tl.exp2(m_i - m_new)
        xc = x - m_new[:, None]
        p = tl.exp2(xc)  # 0 on masked keys
        if MASKED:
            xc = tl.where(visible, xc, 0.0)  # p·xc would be 0·(-inf) there
        s_i = c * (s_i + (m_i - m_new) * l_i) + tl.sum(p * xc, 1)
        l_i = c * l_i + tl.sum(p, 1)
        acc = acc * c[:, None] + tl.dot(p.to(DOT_T), v.to(DOT_T), input_precision="ieee")
        m_i = m_new
    return m_i, l_i, s_i, acc


@triton.jit
def _amp_attn_fwd(
    Q,  # pointer to the queries [B, H, T, DH]
    K,  # pointer to the keys [B, H, T, DH]
    V,  # pointer to the values [B, H, T, DH]
    Out,  # pointer to the output [B, H, T, DH]
    LSE,  # pointer to the logsumexp of the scaled logits [B, H, T] (fp32, nats), saved for the backward
    ENT,  # pointer to the attention entropy [B, H, T] (fp32, nats)
    MAXW,  # pointer to the largest attention weight [B, H, T] (fp32)
    Slopes,  # pointer to the ALiBi slope b of each (batch, head) [B·H] (fp32); read only if HAS_BIAS
    qk_scale,  # α / √d_h · log2(e): logits in base 2, so exp2 stands for exp
    T,  # sequence length
    DH,  # head dim
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per inner step
    BLOCK_D: tl.constexpr,  # next power of two >= DH, at least 16 (tl.dot's minimum)
    DOT_T: tl.constexpr,  # operand dtype of tl.dot: the inputs' own 16-bit type on CUDA, else tl.float32
    HAS_BIAS: tl.constexpr,  # add −b·(t − s) to the logits (ALiBi); False compiles the bias-free kernel
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)  # B·H·T·DH can pass 2³¹
    Q, K, V, Out = Q + bh * T * DH, K + bh * T * DH, V + bh * T * DH, Out + bh * T * DH
    LSE, ENT, MAXW = LSE + bh * T, ENT + bh * T, MAXW + bh * T
    slope = 0.0
    if HAS_BIAS:
        slope = tl.load(Slopes + bh) * 1.4426950408889634  # in base 2, as the logits
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < T, dims < DH
    q = tl.load(Q + rows[:, None] * DH + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(DOT_T)
    # Running max m, l = Σ 2^(x − m), S = Σ 2^(x − m)·(x − m) and acc = Σ 2^(x − m)·v (x in base 2). m starts
    # finite so that the first rescale (m − m_new)·l is 0·finite; key 0 is visible to every row, so the first
    # tile always lifts m to a real logit.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    s_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Key tiles wholly before this query tile need no causal mask; from the one holding key start_m on, up to the
    # diagonal, they do (the tutorial's two stages; `split` keeps any BLOCK_M, BLOCK_N pair right)
    split = start_m // BLOCK_N * BLOCK_N
    m_i, l_i, s_i, acc = _amp_fwd_tiles(q, K, V, rows, dims, dim_ok, m_i, l_i, s_i, acc, 0, split, T, DH, qk_scale,
                                        slope, BLOCK_N, DOT_T, HAS_BIAS, MASKED=False)
    m_i, l_i, s_i, acc = _amp_fwd_tiles(q, K, V, rows, dims, dim_ok, m_i, l_i, s_i, acc, split,
                                        tl.minimum(start_m + BLOCK_M, T), T, DH, qk_scale, slope, BLOCK_N, DOT_T,
                                        HAS_BIAS, MASKED=True)
    tl.store(Out + rows[:, None] * DH + dims[None, :], (acc / l_i[:, None]).to(Out.dtype.element_ty),
             mask=row_ok[:, None] & dim_ok[None, :])
    log2_l = tl.log2(l_i)
    ln2 = 0.6931471805599453  # back from base 2 to nats
    tl.store(LSE + rows, (m_i + log2_l) * ln2, mask=row_ok)
    tl.store(ENT + rows, (log2_l - s_i / l_i) * ln2, mask=row_ok)
    tl.store(MAXW + rows, 1.0 / l_i, mask=row_ok)


# Backward, with P the softmax, dP = dO·Vᵀ and scale = α/√d_h:
#
#     dV = Pᵀ·dO      dS = P ⊙ (dP − Δ),   Δ_t = Σ_s P_ts dP_ts = dO_t · O_t
#     dQ = scale · dS·K      dK = scale · dSᵀ·Q
#
# P is recomputed tile by tile from q, k and the saved logsumexp: P = 2^(x − LSE·log2(e)). Δ comes first from a
# small kernel; then one kernel per key tile accumulates dK, dV over the query tiles at or after the diagonal, and
# one per query tile accumulates dQ over the key tiles up to it. As in the tutorial every gradient tile has a
# single owner, so there are no atomics; the tutorial runs both loops in one program, here they are two kernels.

@triton.jit
def _amp_attn_bwd_preprocess(
    Out,  # pointer to the forward output [B, H, T, DH]
    DO,  # pointer to the output gradient [B, H, T, DH]
    Delta,  # pointer to Δ = rowsum(dO ⊙ O) [B, H, T] (fp32)
    T,  # sequence length
    DH,  # head dim
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_D: tl.constexpr,  # next power of two >= DH, at least 16
):
    bh = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    mask = (rows < T)[:, None] & (dims < DH)[None, :]
    offs = bh * T * DH + rows[:, None] * DH + dims[None, :]
    o = tl.load(Out + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + bh * T + rows, tl.sum(o * do, 1), mask=rows < T)


@triton.jit
def _amp_attn_bwd_dkdv(
    Q,  # pointer to the queries [B, H, T, DH]
    K,  # pointer to the keys [B, H, T, DH]
    V,  # pointer to the values [B, H, T, DH]
    DO,  # pointer to the output gradient [B, H, T, DH]
    LSE,  # pointer to the forward's logsumexp [B, H, T] (fp32, nats)
    Delta,  # pointer to Δ = rowsum(dO ⊙ O) [B, H, T] (fp32)
    DK,  # pointer to the key gradient [B, H, T, DH]
    DV,  # pointer to the value gradient [B, H, T, DH]
    Slopes,  # pointer to the ALiBi slope b of each (batch, head) [B·H] (fp32); read only if HAS_BIAS
    qk_scale,  # α / √d_h · log2(e)
    sm_scale,  # α / √d_h
    T,  # sequence length
    DH,  # head dim
    BLOCK_M: tl.constexpr,  # query rows per inner step
    BLOCK_N: tl.constexpr,  # keys per program
    BLOCK_D: tl.constexpr,  # next power of two >= DH, at least 16
    DOT_T: tl.constexpr,  # operand dtype of tl.dot: the inputs' own 16-bit type on CUDA, else tl.float32
    HAS_BIAS: tl.constexpr,  # the forward's ALiBi bias, recomputed into p
):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1).to(tl.int64)
    Q, K, V, DO = Q + bh * T * DH, K + bh * T * DH, V + bh * T * DH, DO + bh * T * DH
    DK, DV, LSE, Delta = DK + bh * T * DH, DV + bh * T * DH, LSE + bh * T, Delta + bh * T
    if HAS_BIAS:
        slope = tl.load(Slopes + bh) * 1.4426950408889634  # in base 2, as the logits
    cols = start_n + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    tile_mask = (cols < T)[:, None] & (dims < DH)[None, :]
    k = tl.load(K + cols[:, None] * DH + dims[None, :], mask=tile_mask, other=0.0).to(DOT_T)
    v = tl.load(V + cols[:, None] * DH + dims[None, :], mask=tile_mask, other=0.0).to(DOT_T)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for start_m in range(start_n // BLOCK_M * BLOCK_M, T, BLOCK_M):  # causal: rows before start_n see none
        rows = start_m + tl.arange(0, BLOCK_M)
        row_ok = rows < T
        qT = tl.load(Q + rows[None, :] * DH + dims[:, None], mask=(dims < DH)[:, None] & row_ok[None, :], other=0.0)
        qT = qT.to(DOT_T)
        do = tl.load(DO + rows[:, None] * DH + dims[None, :], mask=row_ok[:, None] & (dims < DH)[None, :],
                     other=0.0).to(DOT_T)
        lse = tl.load(LSE + rows, mask=row_ok, other=0.0) * 1.4426950408889634  # to base 2
        delta = tl.load(Delta + rows, mask=row_ok, other=0.0)
        # Everything transposed, [BLOCK_N, BLOCK_M]: key s, query t
        visible = (cols[:, None] <= rows[None, :]) & row_ok[None, :]
        xT = tl.dot(k, qT, input_precision="ieee") * qk_scale
        if HAS_BIAS:
            xT -= slope * (rows[None, :] - cols[:, None]).to(tl.float32)
        pT = tl.where(visible, tl.exp2(xT - lse[None, :]), 0.0)
        dv += tl.dot(pT.to(DOT_T), do, input_precision="ieee")
        dpT = tl.dot(v, tl.trans(do), input_precision="ieee")
        dsT = pT * (dpT - delta[None, :])
        dk += tl.dot(dsT.to(DOT_T), tl.trans(qT), input_precision="ieee")
    tl.store(DK + cols[:, None] * DH + dims[None, :], (dk * sm_scale).to(DK.dtype.element_ty), mask=tile_mask)
    tl.store(DV + cols[:, None] * DH + dims[None, :], dv.to(DV.dtype.element_ty), mask=tile_mask)


@triton.jit
def _amp_attn_bwd_dq(
    Q,  # pointer to the queries [B, H, T, DH]
    K,  # pointer to the keys [B, H, T, DH]
    V,  # pointer to the values [B, H, T, DH]
    DO,  # pointer to the output gradient [B, H, T, DH]
    LSE,  # pointer to the forward's logsumexp [B, H, T] (fp32, nats)
    Delta,  # pointer to Δ = rowsum(dO ⊙ O) [B, H, T] (fp32)
    DQ,  # pointer to the query gradient [B, H, T, DH]
    Slopes,  # pointer to the ALiBi slope b of each (batch, head) [B·H] (fp32); read only if HAS_BIAS
    qk_scale,  # α / √d_h · log2(e)
    sm_scale,  # α / √d_h
    T,  # sequence length
    DH,  # head dim
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per inner step
    BLOCK_D: tl.constexpr,  # next power of two >= DH, at least 16
    DOT_T: tl.constexpr,  # operand dtype of tl.dot: the inputs' own 16-bit type on CUDA, else tl.float32
    HAS_BIAS: tl.constexpr,  # the forward's ALiBi bias, recomputed into p
):
    start_m = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1).to(tl.int64)
    Q, K, V, DO, DQ = Q + bh * T * DH, K + bh * T * DH, V + bh * T * DH, DO + bh * T * DH, DQ + bh * T * DH
    LSE, Delta = LSE + bh * T, Delta + bh * T
    slope = 0.0
    if HAS_BIAS:
        slope = tl.load(Slopes + bh) * 1.4426950408889634  # in base 2, as the logits
    rows = start_m + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    row_ok, dim_ok = rows < T, dims < DH
    tile_mask = row_ok[:, None] & dim_ok[None, :]
    q = tl.load(Q + rows[:, None] * DH + dims[None, :], mask=tile_mask, other=0.0).to(DOT_T)
    do = tl.load(DO + rows[:, None] * DH + dims[None, :], mask=tile_mask, other=0.0).to(DOT_T)
    lse = tl.load(LSE + rows, mask=row_ok, other=0.0) * 1.4426950408889634  # to base 2
    delta = tl.load(Delta + rows, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(0, tl.minimum(start_m + BLOCK_M, T), BLOCK_N):  # causal: no key tile past the diagonal
        cols = start_n + tl.arange(0, BLOCK_N)
        col_ok = cols < T
        kT = tl.load(K + cols[None, :] * DH + dims[:, None], mask=dim_ok[:, None] & col_ok[None, :], other=0.0)
        vT = tl.load(V + cols[None, :] * DH + dims[:, None], mask=dim_ok[:, None] & col_ok[None, :], other=0.0)
        kT, vT = kT.to(DOT_T), vT.to(DOT_T)
        visible = (cols[None, :] <= rows[:, None]) & col_ok[None, :]
        x = tl.dot(q, kT, input_precision="ieee") * qk_scale
        if HAS_BIAS:
            x -= slope * (rows[:, None] - cols[None, :]).to(tl.float32)
        p = tl.where(visible, tl.exp2(x - lse[:, None]), 0.0)
        dp = tl.dot(do, vT, input_precision="ieee")
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(DOT_T), tl.trans(kT), input_precision="ieee")
    tl.store(DQ + rows[:, None] * DH + dims[None, :], (dq * sm_scale).to(DQ.dtype.element_ty), mask=tile_mask)


def _amp_empty(shape, dtype, device):
    """torch.empty for kernel outputs, NaN-filled under GLASSBOX_POISON=1 (tests) so unwritten tiles show up."""
    if os.environ.get("GLASSBOX_POISON") == "1":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _amp_launch_config(q, cuda=None):
    """Tile sizes and the dot operand type. Square tiles (BLOCK_M = BLOCK_N) keep the causal loop bounds simple; wide
    heads and fp32 dots get 32-wide tiles so that the tiles stay in registers: compiled for sm_90
    (tests/test_sm90_compile.py), 64-wide fp32 tiles at d_h = 64 spill 1-12 KB per thread, 32-wide ones at most
    0.3 KB, and 64-wide bf16 ones nothing. `cuda` overrides q.is_cuda (that test records the CUDA choice on CPU)."""
    T, d_h = q.shape[-2:]
    block_d = max(16, triton.next_power_of_2(d_h))
    # On CUDA 16-bit inputs go to the tensor cores as they are (p and dS rounded to that type, as FlashAttention
    # does); the interpreter has no bf16 (numpy), so there, and for fp32 inputs, the dots run in fp32.
    native = (q.is_cuda if cuda is None else cuda) and q.dtype in (torch.bfloat16, torch.float16)
    dot_t = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[q.dtype] if native else tl.float32
    block = max(16, min(64 if block_d <= 64 and native else 32, triton.next_power_of_2(T)))
    return dict(BLOCK_M=block, BLOCK_N=block, BLOCK_D=block_d, DOT_T=dot_t)


class AmpAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alpha, slopes=None):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        B, H, T, d_h = q.shape
        o = _amp_empty(q.shape, q.dtype, q.device)
        lse, entropy, max_weight = (_amp_empty((B, H, T), torch.float32, q.device) for _ in range(3))
        cfg = _amp_launch_config(q)
        sm_scale = alpha / math.sqrt(d_h)
        # one slope per program (batch, head), b·H + h; without a bias the kernels get lse as a never-read stand-in
        bias = None if slopes is None else slopes.detach().to(q.device, torch.float32).repeat(B).contiguous()
        _amp_attn_fwd[(triton.cdiv(T, cfg["BLOCK_M"]), B * H)](
            q, k, v, o, lse, entropy, max_weight, lse if bias is None else bias, sm_scale * LOG2E, T, d_h, **cfg,
            HAS_BIAS=bias is not None)
        ctx.mark_non_differentiable(entropy, max_weight)
        ctx.save_for_backward(q, k, v, o, lse)  # O(T·d_h) per head: p is recomputed, never stored
        ctx.sm_scale, ctx.bias = sm_scale, bias  # the bias' [B·H] slopes: a constant, not an input with a gradient
        return o, entropy, max_weight

    @staticmethod
    def backward(ctx, do, dentropy, dmax_weight):  # the statistics are non-differentiable: their grads are ignored
        q, k, v, o, lse = ctx.saved_tensors
        do = do.contiguous()
        B, H, T, d_h = q.shape
        cfg = _amp_launch_config(q)
        delta = _amp_empty((B, H, T), torch.float32, q.device)
        _amp_attn_bwd_preprocess[(triton.cdiv(T, cfg["BLOCK_M"]), B * H)](
            o, do, delta, T, d_h, BLOCK_M=cfg["BLOCK_M"], BLOCK_D=cfg["BLOCK_D"])
        dq, dk, dv = (_amp_empty(t.shape, t.dtype, t.device) for t in (q, k, v))
        bias = lse if ctx.bias is None else ctx.bias
        scales = (ctx.sm_scale * LOG2E, ctx.sm_scale, T, d_h)
        kw = dict(cfg, HAS_BIAS=ctx.bias is not None)
        _amp_attn_bwd_dkdv[(triton.cdiv(T, cfg["BLOCK_N"]), B * H)](
            q, k, v, do, lse, delta, dk, dv, bias, *scales, **kw)
        _amp_attn_bwd_dq[(triton.cdiv(T, cfg["BLOCK_M"]), B * H)](q, k, v, do, lse, delta, dq, bias, *scales, **kw)
        return dq, dk, dv, None, None


# Triton launches stay out of torch.compile graphs: torch.compiler.disable makes dynamo graph-break here.
@torch.compiler.disable
def _amp_attention_triton(q, k, v, alpha, slopes=None):
    return AmpAttention.apply(q, k, v, float(alpha), slopes)


def amp_attention(q, k, v, alpha=1.0, stats=True, backend="auto", slopes=None):
    """Causal attention amplified by α, with per-row entropy and max weight: (o, entropy, max_weight).
    q, k, v [B, H, T, d_h]. With stats=False the torch form returns None for the statistics. slopes [H]: ALiBi's
    bias −slopes_h·(t − s) added to the amplified logits (None: no bias); a constant, it gets no gradient on
    every backend, as α (a number, the analysis's amplification)."""
    if backend not in AMP_BACKENDS:
        raise ValueError(f"backend must be one of {AMP_BACKENDS}, got {backend!r}")
    if isinstance(alpha, torch.Tensor):
        if alpha.requires_grad or alpha.numel() != 1:
            raise ValueError("amp_attention: alpha is one number and gets no gradient; pass a float")
        alpha = float(alpha)
    slopes = None if slopes is None else slopes.detach()
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"amp_attention: q, k, v must share one [B, H, T, d_h] shape, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if slopes is not None and tuple(slopes.shape) != (q.shape[1],):
        raise ValueError(f"amp_attention: slopes must be one per head, [{q.shape[1]}], got {tuple(slopes.shape)}")
    if backend == "reference":
        return amp_attention_reference(q, k, v, alpha, slopes)
    fits = q.shape[-1] <= AMP_MAX_HEAD_DIM
    double = q.dtype == torch.float64
    if backend == "triton" and double:
        raise ValueError("backend='triton' computes in float32; float64 inputs take backend='auto' or 'torch'")
    if backend == "torch" or (backend == "auto" and not (HAS_TRITON and q.is_cuda and fits and not double)):
        return amp_attention_torch(q, k, v, alpha, stats, slopes=slopes)
    if not HAS_TRITON:
        raise RuntimeError(f"backend='triton' needs the triton package, which failed to import: {TRITON_ERROR}")
    if not (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError("backend='triton' needs CUDA tensors or TRITON_INTERPRET=1 (Triton's CPU interpreter)")
    if not fits:
        raise ValueError(f"backend='triton' supports d_h <= {AMP_MAX_HEAD_DIM}, got {q.shape[-1]}; use 'torch'")
    return _amp_attention_triton(q, k, v, alpha, slopes)


# -----------------------------------------------------------------------------
# Model


def channel_norm(cfg: Config, dim: int) -> nn.Module:
    """CLN (spec §2): LayerNorm statistics per head slice; --norm layernorm gives the standard LayerNorm."""
    groups = cfg.heads if cfg.norm == "cln" else 1
    return ChannelLayerNorm(dim, groups, per_group_gain=cfg.norm == "cln" and cfg.cln_gain == "head",
                            bias=cfg.cln_bias, backend=cfg.kernels)


class ChannelLayerNorm(nn.Module):
    """CLN(x)_{h,i} = γ_{h,i} (x_{h,i} - μ_h) / sqrt(σ_h² + ε) + β_{h,i}, μ_h and σ_h² over the d_h entries of head h
    (kernels.py's grouped LayerNorm). per_group_gain: one γ (and β) per head, broadcast over its d_h entries."""

    eps = 1e-5

    def __init__(self, dim: int, groups: int, per_group_gain: bool = False, bias: bool = False, backend="auto"):
        super().__init__()
        self.groups, self.backend = groups, backend
        n = groups if per_group_gain else dim
        self.weight = nn.Parameter(torch.ones(n))
        self.bias = nn.Parameter(torch.zeros(n)) if bias else None

    def _full(self, p, dim):
        return p if p is None or p.shape[0] == dim else p.repeat_interleave(dim // self.groups)

    def forward(self, x):
        D = x.shape[-1]
        return layer_norm(x, self._full(self.weight, D), self._full(self.bias, D), self.groups, self.eps, self.backend)

    def frozen(self, x, c):
        """The norm linearised at x with its scale frozen (direct logit attribution): γ ⊙ (c − μ_h(c)) / σ_h(x) for
        a term c [..., D] of x, σ_h(x) = sqrt(var_h(x) + ε) per head slice h. Linear in c, so the terms of x add up to
        CLN(x) − β exactly; the centring is the norm's own (a projection per slice), only σ is frozen."""
        D = x.shape[-1]
        sigma = (x.unflatten(-1, (self.groups, -1)).var(-1, unbiased=False, keepdim=True) + self.eps).sqrt()
        cg = c.unflatten(-1, (self.groups, -1))
        return ((cg - cg.mean(-1, keepdim=True)) / sigma).flatten(-2) * self._full(self.weight, D)


def mixing_points(cfg: Config) -> tuple[str, str, str, str]:
    """(V, O, FFN up, FFN down): each mixing point's own flag, or its pair's (--mixing, --ffn-mixing) if "same"."""
    return tuple(pair if own == "same" else own for own, pair in
                 ((cfg.attn_v_mixing, cfg.mixing), (cfg.attn_out_mixing, cfg.mixing),
                  (cfg.ffn_up_mixing, cfg.ffn_mixing), (cfg.ffn_down_mixing, cfg.ffn_mixing)))


def canonical_mixing(cfg: Config) -> Config:
    """One spelling per architecture, so that a checkpoint's stored flags compare equal however they were typed:
    --mixing holds V's mixing and --attn-out-mixing O's only where it differs (FFN: --ffn-mixing holds up's)."""
    v, o, up, down = mixing_points(cfg)
    return replace(cfg, mixing=v, attn_v_mixing="same", attn_out_mixing="same" if o == v else o,
                   ffn_mixing=up, ffn_up_mixing="same", ffn_down_mixing="same" if down == up else down)


def grouped_linear(x, w):
    """x [..., G, n_in] through G separate maps w [G, n_out, n_in] -> [..., G, n_out]: a block-diagonal map that
    is never built, G batched GEMMs; G = 1 is a plain dense linear."""
    if w.shape[0] == 1:
        return F.linear(x, w[0])
    return torch.einsum("...gi,goi->...go", x, w)


class HeadMix(nn.Module):
    """One channelized d×d map (spec §3) on x [..., H·d_h]; `matrix()` builds the equivalent d×d matrix (tests)
    that forward never forms."""

    def __init__(self, kind: str, heads: int, d: int, std: float):
        super().__init__()
        self.kind, self.H, self.dh = kind, heads, d // heads
        shape = {"identity": None, "independent": (heads, self.dh, self.dh), "kronecker": (heads, heads),
                 "dense": (d, d)}[kind]
        self.weight = None if shape is None else nn.Parameter(torch.randn(shape) * std)

    def forward(self, x):
        if self.kind == "identity":
            return x
        if self.kind == "dense":
            return F.linear(x, self.weight)
        xs = x.unflatten(-1, (self.H, self.dh))                   # [..., H, d_h]
        if self.kind == "independent":                           # y_g = W_g x_g: H batched d_h×d_h GEMMs
            return grouped_linear(xs, self.weight).flatten(-2)
        return torch.einsum("...hd,gh->...gd", xs, self.weight).flatten(-2)   # kronecker: y_g = Σ_h A[g,h] x_h

    def matrix(self) -> torch.Tensor:
        """The full d×d matrix (tests only), on the weight's device (identity: the CPU), differentiable in the weight."""
        d = self.H * self.dh
        if self.kind == "identity":
            return torch.eye(d)
        w = self.weight
        if self.kind == "dense":
            return w
        if self.kind == "independent":
            return torch.block_diag(*w)
        return torch.kron(w, torch.eye(self.dh, device=w.device, dtype=w.dtype))


def rope(x, theta: float = 10000.0):
    """Rotary embedding of x [B, H, T, d_h]: channel pairs (i, i + d_h/2) rotated by t·θ^(-2i/d_h) (LLaMA layout)."""
    T, dh = x.shape[-2], x.shape[-1]
    inv = theta ** (-torch.arange(0, dh, 2, device=x.device, dtype=torch.float32) / dh)
    ang = torch.arange(T, device=x.device, dtype=torch.float32)[:, None] * inv
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    x1, x2 = x[..., : dh // 2], x[..., dh // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1)


def alibi_slopes(heads: int) -> torch.Tensor:
    """ALiBi's fixed per-head slopes s_h (Press et al. 2022, arXiv 2108.12409; its reference `get_slopes`): for H a
    power of two the geometric sequence 2^(-8/H), 2^(-16/H), ..., 2^(-8) (H = 8: 1/2, 1/4, ..., 1/256); otherwise
    those of the largest power of two n below H, then every other slope of 2n (the odd ones, which n's lack) for the
    H − n heads left (H = 6: 1/4, 1/16, 1/64, 1/256, then 1/2, 1/8). The authors' 2025 tft-gtp code takes the extra
    heads as 2^(-8/2n)^i, i = 1, 2, ... instead (H = 6: 1/2, 1/4, so 1/4 twice); this file follows the paper."""
    def power_of_two(n):
        return [2.0 ** (-8.0 * (i + 1) / n) for i in range(n)]
    n = 1 << (heads.bit_length() - 1)  # the largest power of two <= H
    return torch.tensor(power_of_two(n) + power_of_two(2 * n)[0::2][:heads - n], dtype=torch.float32)


class ChannelAttention(nn.Module):
    """Eqs. (1)-(4) between the norms: dense Q, K of h; V = Mix_V(v_in); y = amp_attention; out = Mix_O(y).
    `alpha` is the amplification (1 in training); with `record` set the forward keeps the per-head mean entropy
    and max weight of the last call, and with `keep_maps` the explicit attention maps (analyses only).
    Position (--pos): RoPE on q and k, or ALiBi's bias −s_h·(t − s) on the logits, with α applied to the whole
    logit (--alibi-alpha scaled: α·(q·kᵀ/√d_h − s_h·(t − s))) or to q·kᵀ alone (unscaled)."""

    def __init__(self, cfg: Config):
        super().__init__()
        d, H = cfg.d_model, cfg.heads
        self.H, self.kernels = H, cfg.kernels
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        out_std = 0.02 / math.sqrt(2 * cfg.layers)
        v_mix, o_mix = mixing_points(cfg)[:2]
        self.mix_v = HeadMix(v_mix, H, d, 0.02)
        kron_std = out_std if cfg.kron_out_init == "scaled" else 0.02
        self.mix_o = HeadMix(o_mix, H, d, kron_std if o_mix == "kronecker" else out_std)
        self.pos, self.alibi_alpha = cfg.pos, cfg.alibi_alpha
        # fixed, a function of H: not saved, so an ALiBi state_dict is a RoPE one's (the config tells them apart)
        self.register_buffer("slopes", alibi_slopes(H) if cfg.pos == "alibi" else None, persistent=False)
        self.alpha, self.record, self.keep_maps, self.last = 1.0, False, False, {}

    def bias_slopes(self) -> Optional[torch.Tensor]:
        """The per-head slope b_h of the bias −b_h·(t − s) that amp_attention adds to the amplified logits: None with
        RoPE; α·s_h with --alibi-alpha scaled, s_h unscaled (equal at α = 1, so training is the same either way)."""
        if self.slopes is None:
            return None
        return self.slopes * self.alpha if self.alibi_alpha == "scaled" else self.slopes

    def heads_of(self, x):
        B, T, _ = x.shape
        return x.view(B, T, self.H, -1).transpose(1, 2)          # [B, H, T, d_h]

    def forward(self, h, v_in):
        q, k = self.heads_of(self.q(h)), self.heads_of(self.k(h))
        if self.pos == "rope":  # ALiBi replaces the rotation: its bias is the only position signal
            q, k = rope(q), rope(k)
        v = self.heads_of(self.mix_v(v_in)).to(q.dtype)  # identity mixing under autocast leaves v in fp32
        slopes = self.bias_slopes()
        y, entropy, max_weight = amp_attention(q, k, v, self.alpha, stats=self.record, backend=self.kernels,
                                               slopes=slopes)
        if self.record:
            self.last = {"entropy": entropy.float().mean((0, 2)), "max_weight": max_weight.float().mean((0, 2))}
        if self.keep_maps:  # fp32 maps, as the op's statistics: .float() alone would not stop autocast's bf16 GEMM
            with torch.autocast(q.device.type, enabled=False):
                s = self.alpha * (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
                if slopes is not None:
                    pos = torch.arange(s.shape[-1], device=s.device)
                    s = s + alibi_bias(slopes.float(), pos, pos)
                causal = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
                self.last["maps"] = s.masked_fill(~causal, float("-inf")).softmax(-1)   # [B, H, T, T]
        return self.mix_o(y.transpose(1, 2).flatten(2))


class FFN(nn.Module):
    """GELU MLP, d → 4d → d, each projection dense ([1, out, in]) or independent ([H, out/H, in/H]: one map per
    head). Both independent is one d_h → 4d_h → d_h MLP per head (no flow between heads); with one of each, the
    hidden units are read as H consecutive groups of 4d_h."""

    def __init__(self, cfg: Config):
        super().__init__()
        d, H = cfg.d_model, cfg.heads
        up, down = ((H if m == "independent" else 1) for m in mixing_points(cfg)[2:])
        out_std = 0.02 / math.sqrt(2 * cfg.layers)
        self.up = nn.Parameter(torch.randn(up, 4 * d // up, d // up) * 0.02)
        self.down = nn.Parameter(torch.randn(down, d // down, 4 * d // down) * out_std)

    def forward(self, x):
        hid = F.gelu(grouped_linear(x.unflatten(-1, (self.up.shape[0], -1)), self.up))   # [..., G_up, 4d/G_up]
        if self.up.shape[0] != self.down.shape[0]:  # regroup the hidden units for the down-projection
            hid = hid.flatten(-2).unflatten(-1, (self.down.shape[0], -1))
        return grouped_linear(hid, self.down).flatten(-2)


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.mode, self.v_source = cfg.mode, cfg.v_source
        self.ln_1 = channel_norm(cfg, cfg.d_model)
        self.ln_v = channel_norm(cfg, cfg.d_model) if cfg.v_source == "xt-cln" and cfg.mode != "single" else None
        self.attn = ChannelAttention(cfg)
        self.ln_2 = channel_norm(cfg, cfg.d_model)
        self.ffn = FFN(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x_t, x_e, drop: Optional[str] = None):
        """One block, Eqs. (1)-(5). Single mode carries its one stream in x_t (x_e is None). drop = "x_t" | "x_e"
        discards the writes into that stream (ablation at every layer), so later sublayers never see them."""
        h = self.ln_1(x_t if x_e is None else x_t + x_e)
        if x_e is None or self.v_source == "combined":
            v_in = h
        else:
            v_in = self.ln_v(x_t) if self.ln_v is not None else x_t
        a = self.drop(self.attn(h, v_in))
        if self.mode == "fts":
            x_e = x_e + a if drop != "x_e" else x_e              # x_t stays the (normalised) embedding
        elif drop != "x_t":
            x_t = x_t + a
        f = self.drop(self.ffn(self.ln_2(x_t if x_e is None else x_t + x_e)))
        if x_e is None:
            return x_t + f, None
        return x_t, x_e + f if drop != "x_e" else x_e


# Where a stream is removed (spec §6, §11.7): from the readout only; its writes in every block only (the readout
# keeps x_t + x_e, so "no attention writes" is told apart from "no x_t at all"); or both.
ABLATE_AT = ("readout", "writes", "all")


class DualStream(nn.Module):
    """Embedding → blocks (two streams) → CLN_f(x_t + x_e) → tied head. forward(idx) gives logits; with targets,
    the mean cross-entropy (kernels.py's fused kernel on CUDA)."""

    def __init__(self, cfg: Config, vocab_size: int):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.wte = nn.Embedding(vocab_size, cfg.d_model)
        nn.init.normal_(self.wte.weight, 0.0, 0.02)
        self.ln_embed = channel_norm(cfg, cfg.d_model) if cfg.mode == "fts" and cfg.fts_cln_at_init else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = channel_norm(cfg, cfg.d_model)
        for name, p in self.named_parameters():  # Q and K: N(0, 0.02) as every other input projection
            if name.endswith((".q.weight", ".k.weight")):
                nn.init.normal_(p, 0.0, 0.02)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def attentions(self) -> list[ChannelAttention]:
        return [b.attn for b in self.blocks]

    def streams(self, idx, ablate: Optional[str] = None, at: str = "readout"):
        """-> (x_t, x_e) after the last block (x_e None in single mode). ablate = "x_t" | "x_e" with at = "writes"
        or "all" drops that stream's writes in every block: x_t stays the embedding (token-factor: no attention
        writes), x_e stays zero (no FFN writes; in FTS no attention writes either), so the other stream is
        computed without them. (Reading x_t as zero instead would zero every activation of a bias-free model: the
        loss would be ln V whatever the weights.)"""
        if idx.dim() != 2 or 0 in idx.shape:
            raise ValueError(f"idx must be [B, T] with B, T >= 1, got {tuple(idx.shape)}")
        x_t = self.wte(idx)
        if self.ln_embed is not None:
            x_t = self.ln_embed(x_t)
        x_t = self.drop(x_t)
        x_e = None if self.cfg.mode == "single" else torch.zeros_like(x_t)
        if at not in ABLATE_AT:
            raise ValueError(f"at must be one of {', '.join(ABLATE_AT)}, not {at!r}")
        drop = None if at == "readout" else ablate
        for block in self.blocks:
            x_t, x_e = block(x_t, x_e, drop)
        return x_t, x_e

    def readout(self, x_t, x_e, ablate: Optional[str] = None):
        """Eq. (6); ablate drops one stream from the sum (the authors' lm_head(ln_f(x_e)) and lm_head(ln_f(x_t)))."""
        if x_e is None:
            x = x_t
        else:
            x = x_e if ablate == "x_t" else x_t if ablate == "x_e" else x_t + x_e
        return F.linear(self.ln_f(x), self.wte.weight)

    def forward(self, idx, targets=None, ablate: Optional[str] = None, at: str = "readout"):
        if ablate is not None and self.cfg.mode == "single":
            raise ValueError("stream ablation needs two streams (--mode token-factor or fts)")
        # "writes" keeps the full readout x_t + x_e; "readout" and "all" drop the stream from it too
        logits = self.readout(*self.streams(idx, ablate, at), ablate=None if at == "writes" else ablate)
        if targets is None:
            return logits
        return cross_entropy(logits.flatten(0, 1), targets.flatten(), backend=self.cfg.kernels).float()

    @contextlib.contextmanager
    def probe(self, alpha: float = 1.0, record: bool = False, keep_maps: bool = False):
        """Inside the block every attention uses amplification α and keeps its statistics / maps."""
        for a in self.attentions():
            a.alpha, a.record, a.keep_maps, a.last = alpha, record, keep_maps, {}
        try:
            yield
        finally:
            for a in self.attentions():
                a.alpha, a.record, a.keep_maps = 1.0, False, False

    @torch.no_grad()
    def generate(self, idx, new_tokens, temperature=0.8, top_k=40, generator=None):
        """nanoGPT's sampler (the window cropped to ctx); temperature 0 is greedy."""
        if top_k < 0:  # 0 turns top-k off; a negative k would fail inside torch.topk
            raise ValueError(f"top_k must be >= 0 (0: no top-k), got {top_k}")
        for _ in range(new_tokens):
            logits = self(idx[:, -self.cfg.ctx:])[:, -1].float()
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / max(temperature, 1e-6)  # a tiny temperature: near-greedy, not inf/NaN
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            idx = torch.cat([idx, nxt], 1)
        return idx


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
    """Linear warmup over warmup_frac of the steps, then cosine from lr to min_lr_ratio·lr."""
    warmup = max(1, int(cfg.warmup_frac * cfg.max_iters))
    if it < warmup:
        return cfg.lr * (it + 1) / warmup
    progress = min(1.0, (it - warmup) / max(1, cfg.max_iters - warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: nn.Module, cfg: Config, device_type: str):
    """AdamW (0.9, 0.95) as the authors' trainer, weight decay on matrices (embedding, projections, mixes, FFN)
    but not on norm gains and biases."""
    decay, no_decay = [], []
    for p in model.parameters():
        (no_decay if p.dim() < 2 else decay).append(p)
    groups = [dict(params=decay, weight_decay=cfg.weight_decay), dict(params=no_decay, weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, fused=device_type == "cuda")


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
               "dropout")
# What only training reads: typed with --no-train, each keeps the checkpoint's value (a note says so), so that the
# config and the report describe the run that trained the model, not flags that changed nothing
TRAINING_KEYS = tuple(k for k in RESUME_KEYS if k != "ctx") + ("eval_interval", "eval_iters", "log_interval")


# What --resume cannot change: the run goes on from the checkpoint's random state, so a typed seed would
# only be written into the stored config, which would then no longer describe the run
FIXED_ON_RESUME = ("seed",)


def resume_note(saved: dict, cfg: Config, step: int) -> Optional[str]:
    """The line a resumed run logs when it cannot equal an uninterrupted one: nothing left to train, or settings
    changed since the checkpoint (the usual case: a smaller --max-iters first, then --resume with a larger one,
    whose cosine schedule the first steps did not follow). None when it resumes as if never stopped. A
    checkpoint past --max-iters is check_steps' error, before anything trains."""
    if step >= cfg.max_iters:
        return (f"note: the checkpoint is at step {step}, --max-iters {cfg.max_iters}: nothing left to train (raise "
                "--max-iters to continue)")
    changed = [f"{k} {saved[k]} -> {getattr(cfg, k)}" for k in RESUME_KEYS if k in saved and saved[k] != getattr(cfg, k)]
    if changed:
        return (f"note: resuming with {', '.join(changed)}: the first {step} steps followed the checkpoint's "
                "settings (its learning-rate schedule included), so the result will differ from an uninterrupted "
                "run with these settings")
    return None


def flops_per_token(model: DualStream, cfg: Config, ctx: int) -> float:
    """Training FLOPs per token: 6·N for the matmuls (PaLM appendix B; the tied head once) plus attention's
    12·L·d·T. The mixes are counted by their parameters: exact for dense and block-diagonal; a Kronecker mix costs
    d·H multiply-adds per token against its H² parameters, so MFU slightly understates Kronecker models."""
    return 6 * model.n_params() + 12 * cfg.layers * cfg.d_model * ctx


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
    """Mean val loss over eval_iters random val batches (the val generator, saved in checkpoints)."""
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
def evaluate_ppl(model, data, ctx: int, autocast, batch_size: int = 8, max_windows: Optional[int] = None,
                 **forward_kw) -> dict:
    """Exact token-weighted perplexity over the val split: every token predicted once (common.iter_eval), or over
    its first max_windows windows (fewer where the split holds fewer). forward_kw (ablate, at) evaluates an ablated
    model. -> loss, ppl, and the tokens and windows it read (a report names what a loss was measured on).
    The unk id (compaction's image of every id unseen in training, so never a training target) is scored like any
    token; "unk_tokens" counts those targets and "loss_known"/"ppl_known" leave them out."""
    model.eval()
    unk = -1 if data.tokenizer.unk is None else data.tokenizer.unk  # -1: no compaction, every target is known
    # Σ nll and targets, all and known (not unk), windows: summed on the device, read once at the end
    sums = torch.zeros(5, dtype=torch.float64, device=data.device)
    for i, (x, y) in enumerate(data.iter_eval("val", batch_size, ctx)):
        if max_windows is not None:
            if i * batch_size >= max_windows:
                break
            x, y = x[:max_windows - i * batch_size], y[:max_windows - i * batch_size]  # exactly max_windows
        with autocast:
            logits = model(x, **forward_kw)
        nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").double()
        known = y.flatten() != unk
        sums += torch.stack([nll.sum(), nll.new_tensor(y.numel()), (nll * known).sum(), known.sum().double(),
                             nll.new_tensor(y.shape[0])])
    if dist_ready():
        import torch.distributed as dist

        dist.all_reduce(sums)
    total, count, total_known, count_known, windows = sums.tolist()
    known = total_known / count_known if count_known else None  # None: every target is unk
    return {"loss": total / count, "ppl": perplexity(total / count), "tokens": int(count), "windows": int(windows),
            "unk_tokens": int(count - count_known), "loss_known": known,
            "ppl_known": None if known is None else perplexity(known)}


def on_windows(windows: int, tokens: int) -> str:
    """What an analysis loss was measured on, as the report and the log say it: the first --analysis-windows val
    windows, not the whole split of the validation figures (so the loss at α = 1 need not match those)."""
    return f"{windows} val window{'s' if windows != 1 else ''} ({tokens:,} tokens)"


def dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def any_rank(flag: torch.Tensor) -> bool:
    """True if `flag` is set on any rank (all ranks must stop together, or the others hang in a collective)."""
    if dist_ready():
        flag = flag.float()
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


# Model settings beyond mode and mixing that name a checkpoint and its log when they differ from the defaults, so
# that the sweeps' architectures in one --out-dir never overwrite each other; each only where it changes the model
# (v_source is unused by the single stream, --kron-out-init by the other mixings, --fts-cln-at-init outside fts).
NAME_KEYS = {"heads": lambda c: True, "pos": lambda c: True, "v_source": lambda c: c.mode != "single",
             "norm": lambda c: True, "cln_gain": lambda c: True, "cln_bias": lambda c: True,
             "kron_out_init": lambda c: mixing_points(c)[1] == "kronecker",
             "fts_cln_at_init": lambda c: c.mode == "fts"}
# The sizes of either preset (the default command on a GPU and on a CPU) keep the plain name: existing
# checkpoints stay valid; any other depth or width is named.
PRESET_SIZES = ((Config.layers, Config.d_model), (CPU_PRESET["layers"], CPU_PRESET["d_model"]))


def variant(cfg: Config) -> str:
    """The name of a configuration: update mode, V/O mixing, the FFN when it is per head, then every NAME_KEYS
    setting that differs from its default (spelled as its flag) and the size unless it is a preset's. Mixing is
    named by its resolved points, so one architecture has one name however its flags were typed."""
    v, o, up, down = mixing_points(cfg)
    name = f"{cfg.mode}-{v}" + (f"-attn-out-mixing-{o}" if o != v else "")
    if up == down == "independent":
        name += "-ffn-independent"
    elif up != down:  # one projection per head, the other dense: the per-head one is named
        name += "-ffn-up-mixing-independent" if up == "independent" else "-ffn-down-mixing-independent"
    for k, applies in NAME_KEYS.items():
        v, flag = getattr(cfg, k), k.replace("_", "-")
        if applies(cfg) and v != getattr(Config, k):
            name += f"-{flag}" if v is True else f"-no-{flag}" if v is False else f"-{flag}-{v}"
    if (cfg.layers, cfg.d_model) not in PRESET_SIZES:
        name += f"-layers-{cfg.layers}-d-model-{cfg.d_model}"
    return name


def ckpt_path(cfg: Config) -> Path:
    return Path(cfg.out_dir) / f"ckpt-{variant(cfg)}.pt"


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
                    history) -> None:
    """One file: written to a temporary name, then renamed (a crash never leaves half a checkpoint)."""
    state = {
        "format": "glassbox-checkpoint/1", "script": "dual_stream", "config": asdict(cfg),
        "model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step, "best_val_loss": best,
        "tokenizer": data.tokenizer.state_dict(),
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


def damaged_fields(ck: dict) -> list[str]:
    """The fields of a checkpoint that read but hold the wrong kind of value (a file edited or damaged by hand), so
    that loading it is one line rather than a traceback deep in train() or the analyses."""
    tok, hist = ck["tokenizer"], ck["history"]
    ok = {"step": type(ck["step"]) is int and ck["step"] >= 0,
          "best_val_loss": type(ck["best_val_loss"]) in (int, float) and not math.isnan(ck["best_val_loss"]),
          "history": history_ok(hist),
          "model": isinstance(ck["model"], dict), "optimizer": isinstance(ck["optimizer"], dict),
          "tokenizer": isinstance(tok, dict) and isinstance(tok.get("name"), str)
          and type(tok.get("compacted")) is bool and isinstance(tok.get("kept"), torch.Tensor)}
    return [k for k, good in ok.items() if not good]


def load_checkpoint(path: Path, cfg: Config, explicit=()) -> tuple[dict, Config]:
    """Load with weights_only=True; the architecture comes from the checkpoint, and an architecture flag given
    on the command line that disagrees with it is an error (one line) rather than a silent mismatch."""
    if not path.exists():  # the architecture flags name the file (variant): say which ones this folder holds
        there = sorted(p.name for p in path.parent.glob("ckpt-*.pt"))
        raise RunError(f"no checkpoint at {path} " + (f"({path.parent} holds {', '.join(there)}: the architecture "
                       "flags name the file)" if there else "(train first, or point --out-dir at one)"))
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
        # a saved tensor or list is no checkpoint: ck["config"] on a tensor would print a torch warning first
        ok = isinstance(ck, dict) and ck.get("format") == "glassbox-checkpoint/1" and ck.get("script") == "dual_stream"
        if ok:
            saved = dict(ck["config"])
            missing = [k for k in CKPT_KEYS if k not in ck] or [f"rng.{k}" for k in RNG_KEYS if k not in ck["rng"]]
    except Exception as e:  # truncated file, not a checkpoint, unpickling refused
        raise RunError(f"{path} is not a readable checkpoint ({type(e).__name__}); delete it or retrain") from None
    if not ok:
        raise RunError(f"{path} is not a dual_stream.py checkpoint")
    if missing:
        raise RunError(f"{path} is an incomplete checkpoint (no {', '.join(missing)}); delete it or retrain")
    damaged = damaged_fields(ck)
    if damaged:
        raise RunError(f"{path} is a damaged checkpoint ({', '.join(damaged)}: not what save_checkpoint writes); "
                       "delete it or retrain")
    try:  # a file renamed by hand: its name says one architecture, its contents another (the rows would say both)
        named = {k: saved[k] for k in (*ARCH_KEYS, *NAME_KEYS) if k in saved}  # what variant() names the file by
        held = ckpt_path(replace(Config(train=False), **named)).name
    except (TypeError, ValueError):  # stored values no variant takes: stored_config_error below names them
        held = path.name
    if path.name.startswith("ckpt-") and held != path.name:  # a path named otherwise claims no architecture
        raise RunError(f"{path} holds the model of {held}, not the architecture its name says; rename it back or "
                       "retrain")

    def typed_otherwise(keys) -> str:  # "k=stored (asked typed)" for each typed key that differs from the checkpoint
        return ", ".join(f"{k}={saved.get(k, getattr(Config, k))!r} (asked {getattr(cfg, k)!r})" for k in keys
                         if k in explicit and getattr(cfg, k) != saved.get(k, getattr(Config, k)))

    diff = typed_otherwise(ARCH_KEYS)
    if diff:
        raise RunError(f"{path} was trained with {diff}; drop those flags or use another --out-dir")
    diff = typed_otherwise(FIXED_ON_RESUME) if cfg.resume else ""
    if diff:
        raise RunError(f"{path} was trained with {diff}, which --resume cannot change (it continues from the "
                       "checkpoint's random state); drop those flags, or train afresh in another --out-dir")
    keep = () if cfg.train else TRAINING_KEYS  # --no-train: what trained the model, whatever was typed
    taken = {k: saved[k] for k in ARCH_KEYS + MERGED_KEYS if k in saved and (k not in explicit or k in keep)}
    merged = replace(cfg, **taken)
    from common import stored_config_error

    why = stored_config_error(replace(Config(train=False), **taken), validate)  # the stored values, as a loaded model
    if why:
        raise RunError(f"{path} stores {why}; delete it or retrain")
    return ck, merged


def build_model(cfg: Config, vocab_size: int, device) -> DualStream:
    torch.manual_seed(cfg.seed)
    return DualStream(cfg, vocab_size).to(device)


def train(cfg: Config, data, device, autocast, dist_info, explicit=(), log=print, ck=None,
          start_rng: Optional[dict] = None) -> tuple[DualStream, dict]:
    """The nanoGPT-shaped loop. Returns the trained (unwrapped) model and its history. With cfg.resume it
    continues from `ck`, the checkpoint already loaded by the caller (read from out_dir when not given).
    `start_rng` is the data streams' state to start from: every configuration of a sweep trains and evaluates
    on the same batches."""
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
    problem = memory_floor_problem(lambda: DualStream(cfg, data.vocab_size), device, micro * cfg.ctx,
                                   data.vocab_size, cfg.d_model, cfg.layers, bf16)
    if problem is not None:
        raise RunError(problem)
    model = build_model(cfg, data.vocab_size, device)
    optimizer = make_optimizer(model, cfg, device.type)
    step, best, history = 0, float("inf"), {k: [] for k in HISTORY_KEYS}
    if rank:  # ranks other than 0 draw their own dropout masks (DDP broadcasts rank 0's initial weights)
        torch.manual_seed(cfg.seed + rank)
    if cfg.resume:
        if ck is None:
            ck, _ = load_checkpoint(path, cfg, explicit)
        load_weights(model, ck["model"], path)
        try:
            restore_optimizer(optimizer, ck["optimizer"])
            step, best, history = ck["step"], ck["best_val_loss"], ck["history"]
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
        note = resume_note(ck["config"], cfg, step)
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
    log(f"{variant(cfg)}: {raw.n_params() / 1e6:.2f}M parameters ({(raw.n_params() - raw.wte.weight.numel()) / 1e6:.2f}M "
        f"without the embedding), vocab {data.vocab_size}, {tokens_per_step:,} tokens per step, {cfg.max_iters} steps")
    # The data generator's state is taken before each prefetch, so a checkpoint resumes with the batch that the
    # uninterrupted run would have used next (bit-exact resume on CPU).
    data_rng = data.rng_state()
    x, y = data.get_batch("train", micro, cfg.ctx)
    t0, t0_step, mfu_ema, start = time.time(), step, None, step
    bad = torch.zeros((), dtype=torch.bool, device=device)  # any non-finite loss since the last check
    while True:
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
            best = min(best, val)
            if rank == 0:  # the train stream as it was before the prefetch, the val stream as it is now
                rng = {**data_rng, "val": data.rng_state()["val"]}
                save_checkpoint(path, raw, optimizer, cfg, step, best, rng, data, history)
            saved = step  # rank 0 wrote it: every rank names it
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
    return raw, history


# -----------------------------------------------------------------------------
# Analyses: the sweep, attention amplification, stream ablation, head specialisation, benchmarks, report

# The sweep (spec §3, §8, §10.1): V/O mixing varied jointly in token-factor mode with a dense FFN, plus the fully
# independent model (FFN per head too), the frozen token stream (with independent V/O, the summary's
# "safety-critical" operating point) and the single-stream dense baseline. Costs are relative to token-factor dense.
SWEEP = {
    "dense": dict(mode="token-factor", mixing="dense", ffn_mixing="dense"),
    "kronecker": dict(mode="token-factor", mixing="kronecker", ffn_mixing="dense"),
    "independent": dict(mode="token-factor", mixing="independent", ffn_mixing="dense"),
    "identity": dict(mode="token-factor", mixing="identity", ffn_mixing="dense"),
    "fully independent": dict(mode="token-factor", mixing="independent", ffn_mixing="independent"),
    "fts independent": dict(mode="fts", mixing="independent", ffn_mixing="dense"),
    "single-stream dense": dict(mode="single", mixing="dense", ffn_mixing="dense"),
}
# The paper's +8 % is set beside the ind/ind row ("fully independent": V/O and FFN independent, the spec's
# recommendation, §3); which projections the paper varied is unconfirmed, so it may be V/O-only ("independent").
PAPER_COST = {"kronecker": "+2.5%", "fully independent": "+8%", "fts independent": "+8% (summary)"}
PAPER_COST_LINE = "paper: Kronecker +2.5%, fully independent +8%; the summary: FTS independent +8%"
# The other reference figures, each with its source as the spec tags it (§5-§7): the paper itself, the project's
# summary, or third-party write-ups of the paper (the spec's [secondary]); reading the ablation at the readout is
# this file's (spec §6: whether a stream was also zeroed in every layer is not known).
REPORTED_AMPLIFICATION = "paper: 16-27% degradation for α up to 16; the summary: Kronecker 16%, independent 27%"
REPORTED_ABLATION = ("third-party write-ups of the paper: +36% without x_t, +9.5% without x_e (read here as a "
                     "readout ablation)")
REPORTED_HUB = "third-party write-ups of the paper: head 0 amplified about 3.5× in deeper layers"
REPORTED_HEAD_SWEEP = "the paper's summary: distinctiveness and coreference scores rise with the number of heads"
# The head sweep (spec §7, §10.5: "distinctiveness and coreference scores rise with the number of heads"): H at
# fixed d (d_h = d/H), the run's mode and mixing, every model on the same batches as in the sweep above.
HEAD_SWEEP = (2, 3, 6, 12)


def configurations(cfg: Config) -> dict[str, Config]:
    """name -> config of every model this run trains or loads: the sweep, or the one configuration asked for."""
    tied = dict.fromkeys(POINT_KEYS, "same")  # the sweep's rows tie V with O and FFN up with down
    if cfg.sweep:
        return {name: replace(cfg, **kw, **tied) for name, kw in SWEEP.items()}
    if cfg.head_sweep:
        return {f"H={h}": replace(cfg, heads=h) for h in HEAD_SWEEP}
    name = next((n for n, kw in SWEEP.items() if variant(replace(cfg, **kw, **tied)) == variant(cfg)), variant(cfg))
    return {name: cfg}


# What the sweep's models must share for "vs dense" to be the cost of the mixing: the data and the tokens seen.
BUDGET_KEYS = ("dataset", "tokenizer", "compact", "max_tokens", "batch_size", "ctx", "step")


def budget_diff(budgets: dict) -> str:
    """'' when every model's settings (config dicts with the steps trained, "step") share BUDGET_KEYS; else what
    differs, from the first model's view."""
    first = next(iter(budgets.values()), {})
    return ", ".join(f"{k} {first.get(k)!r} vs {b.get(k)!r} ({name})" for k in BUDGET_KEYS
                     for name, b in budgets.items() if b.get(k) != first.get(k))


def sweep_table(models: dict, ppl: dict, compare: bool = True) -> list[dict]:
    """Parameters, val loss and its relative cost to token-factor dense (spec §10.1); no cost when the models
    were not trained on one budget (compare=False)."""
    from common import unk_targets_cell

    base = ppl.get("dense", {}).get("loss") if compare else None
    rows = []
    for name, m in models.items():
        n, emb = m.n_params(), m.wte.weight.numel()
        row = {"model": name, "config": variant(m.cfg), "params (M)": n / 1e6, "non-embedding (M)": (n - emb) / 1e6,
               "val loss": ppl[name]["loss"], "ppl": ppl[name]["ppl"],
               "without the unk targets": unk_targets_cell(ppl[name])}
        if base is not None:
            row["vs dense"] = f"{ppl[name]['loss'] / base - 1:+.2%}"
            row["paper"] = PAPER_COST.get(name, "0%" if name == "dense" else "")
        rows.append(row)
    return rows


def head_sweep_table(models: dict, ppl: dict, spec: dict) -> list[dict]:
    """Per H: val loss, distinctiveness (mean over layers, and per layer), the coreference probe's best head
    (its accuracy, right name ahead, and margin; chance 50%, 0) and the logit gap (mean, standard error, fraction
    above 0, chance 50%) with its best head by direct logit attribution. Each best head is picked on the prompts
    it is scored on; the held-out columns are split_half's: picked on one half, scored on the other."""
    rows = []
    held_out = lambda h: f"L{h['layer']}h{h['head']} {h['mean']:+.3g} ± {h['stderr']:.2g}" if h else ""  # noqa: E731
    for name, m in models.items():
        s, c, g = spec[name], spec[name]["coreference"], spec[name]["coreference_gap"]
        b, gb = c.get("best", {}), g.get("best", {})
        rows.append({"heads": m.cfg.heads, "d_h": m.cfg.d_model // m.cfg.heads, "val loss": ppl[name]["loss"],
                     "distinctiveness": sum(s["distinctiveness"]) / max(len(s["distinctiveness"]), 1),
                     "per layer": per_layer(s["distinctiveness"]),
                     "coref best head": f"L{b['layer']}h{b['head']}" if b else "",
                     "coref accuracy": b.get("accuracy", ""), "coref margin": b.get("margin", ""),
                     "coref prompts": c.get("prompts", 0), "coref held-out margin": held_out(c.get("split_half")),
                     "logit gap": g.get("gap", ""),
                     "logit gap stderr": g.get("stderr", ""), "logit gap > 0": g.get("accuracy", ""),
                     "gap best head": f"L{gb['layer']}h{gb['head']}" if gb else "", "gap best head DLA": gb.get("gap", ""),
                     "gap held-out DLA": held_out(g.get("split_half")), "gap prompts": g.get("prompts", 0)})
    return rows


def parse_alphas(spec: str) -> list[float]:
    """'1,2,4,8,16' -> [1.0, 2.0, ...], each α once, in the order given; α in [1e-6, 1e6] (a one-line error
    otherwise): far above that α·q·kᵀ overflows fp32, and far below it an α under fp32's smallest number is 0, so
    every figure would be NaN."""
    try:
        alphas = [float(a) for a in spec.split(",")] if spec.strip() else []  # '' is off; 1,,2 an error
    except ValueError:
        raise RunError(f"--amplify {spec!r}: expected comma-separated numbers such as 1,2,4,8,16") from None
    if any(not 1e-6 <= a <= 1e6 for a in alphas):
        raise RunError(f"--amplify {spec!r}: every α must be in [1e-6, 1e6]")
    return list(dict.fromkeys(alphas))


@torch.no_grad()
def amplification(model: DualStream, data, cfg: Config, alphas: list[float], autocast) -> dict:
    """Attention amplification (spec §5): every head of every layer uses softmax(α·qkᵀ/√d_h) at inference. For each
    α: val loss over analysis_windows windows, its perplexity exp(loss) (spec §5, §11.6) and its relative increase
    over α = 1 (always measured), the mean attention entropy (nats) and max weight per layer, from the kernel's
    statistics, and a greedy sample of at most AMP_SAMPLE_TOKENS tokens.
    windows and tokens say what the losses were measured on (fewer windows where the split holds fewer)."""
    model.eval()
    rows, samples = [], {}
    prompt = (cfg.sample or "HAMLET:\n").replace("\\n", "\n")
    ids = torch.tensor([data.tokenizer.encode(prompt) or [data.tokenizer.eot]], device=data.device)
    L = len(model.blocks)
    for alpha in [1.0] + [a for a in alphas if a != 1.0]:  # α = 1 first: the base of every increase
        total, count, windows = 0.0, 0, 0
        # Entropy and max weight: each batch's mean over (window, head, query) weighted by its queries, so a short
        # last batch counts what its queries do, like the loss beside it.
        ent, maxw, queries = torch.zeros(L), torch.zeros(L), 0
        with model.probe(alpha=alpha, record=True):
            for i, (x, y) in enumerate(data.iter_eval("val", 8, cfg.ctx)):
                if i * 8 >= cfg.analysis_windows:
                    break
                x, y = x[:cfg.analysis_windows - i * 8], y[:cfg.analysis_windows - i * 8]  # exactly that many
                with autocast:
                    logits = model(x)
                total += F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum").item()
                count += y.numel()
                windows += y.shape[0]
                ent += torch.stack([a.last["entropy"].mean().cpu() for a in model.attentions()]) * y.numel()
                maxw += torch.stack([a.last["max_weight"].mean().cpu() for a in model.attentions()]) * y.numel()
                queries += y.numel()
            out = model.generate(ids, min(cfg.sample_tokens, AMP_SAMPLE_TOKENS), temperature=0)
        samples[str(alpha)] = data.tokenizer.decode(out[0].tolist())
        rows.append({"alpha": alpha, "loss": total / count, "ppl": perplexity(total / count),
                     "entropy": (ent / queries).tolist(), "max_weight": (maxw / queries).tolist()})
    base = rows[0]["loss"]
    for r in rows:
        r["degradation"] = r["loss"] / base - 1
    return {"rows": rows, "samples": samples, "windows": windows, "tokens": count}


# Each row of the stream ablation, (stream, at) -> exactly what it removes (token-factor: attention writes x_t and
# the FFN x_e). x_e at "writes" is not a row: with x_e = 0 the readout x_t + x_e is x_t, the "all" row.
ABLATIONS = {
    ("x_t", "readout"): "x_t from the readout (logits from x_e)",
    ("x_e", "readout"): "x_e from the readout (logits from x_t)",
    ("x_t", "writes"): "attention writes in every block (logits from x_t + x_e, x_t = the embedding)",
    ("x_t", "all"): "attention writes in every block and x_t from the readout (logits from x_e: no direct "
                    "embedding path either)",
    ("x_e", "all"): "FFN writes in every block (x_e = 0: logits from x_t)",
}
# FTS: nothing writes x_t (Block.forward ignores drop="x_t" there), and the readout from x_t alone never sees x_e's
# writes. So the ("x_t", "writes") row would equal the unablated model, and the two "all" rows would repeat the
# readout rows exactly; the three are skipped with this note (log, results, report).
FTS_ALL_NOTE = ("--ablate-at all skipped in fts mode: x_t has no writes to drop, so dropping attention writes "
                "with the readout kept would equal the unablated model, and the readout from x_t never reads x_e, "
                "so the two at-every-layer rows would repeat the readout rows")


def ablation(model: DualStream, data, cfg: Config, autocast) -> list[dict]:
    """Stream ablation (spec §6): remove x_t or x_e at the readout (and, with --ablate-at all, the ABLATIONS rows
    that drop a stream's writes in every block, see DualStream.streams), no retraining; relative change of the val
    loss (REPORTED_ABLATION: +36% without x_t, +9.5% without x_e). Each row keeps the windows and tokens the
    losses were measured on (the first analysis_windows val windows, as the amplification's)."""
    base = evaluate_ppl(model, data, cfg.ctx, autocast, max_windows=cfg.analysis_windows)
    full = base["loss"]
    keys = [("x_t", "readout"), ("x_e", "readout")]
    if cfg.ablate_at == "all" and model.cfg.mode == "token-factor":
        keys += [("x_t", "writes"), ("x_t", "all"), ("x_e", "all")]
    rows = []
    for stream, at in keys:
        loss = evaluate_ppl(model, data, cfg.ctx, autocast, max_windows=cfg.analysis_windows, ablate=stream,
                            at=at)["loss"]
        rows.append({"removed": ABLATIONS[stream, at], "stream": stream, "at": at, "loss": loss, "full": full,
                     "change": loss / full - 1, "windows": base["windows"], "tokens": base["tokens"]})
    return rows


def js_divergence(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen–Shannon divergence in bits (so in [0, 1]) between distributions along the last dim."""
    m = 0.5 * (p + q)
    kl = lambda a: torch.where(a > 0, a * (a.clamp_min(1e-30).log2() - m.clamp_min(1e-30).log2()), 0.0).sum(-1)  # noqa: E731
    return 0.5 * (kl(p) + kl(q))


DISTINCT_WINDOWS, DISTINCT_WIDTH, DISTINCT_SKIP = 8, 128, 8  # what distinctiveness reads, and its label says


def distinct_sizes(model: DualStream, data, width: int = DISTINCT_WIDTH, skip: int = DISTINCT_SKIP) -> tuple[int, int]:
    """-> (width, skip) as distinctiveness reads them: windows of at most the model's ctx and the val split, and
    at least one query row left after the skipped ones."""
    width = min(width, model.cfg.ctx, len(data.tokens("val")) - 1)
    return width, min(skip, width - 1)


def distinctiveness_on(width: int, skip: int) -> str:
    """What distinctiveness measured, as the log and the report say it."""
    return (f"mean pairwise JS in bits over heads and query rows {skip} on, in the first {DISTINCT_WINDOWS} val "
            f"windows of {width} tokens")


@torch.no_grad()
def distinctiveness(model: DualStream, data, windows: int = DISTINCT_WINDOWS, width: int = DISTINCT_WIDTH,
                    skip: int = DISTINCT_SKIP) -> list[float]:
    """Attention-pattern distinctiveness per layer (spec §7, our operationalisation): the mean over head pairs and
    query rows of the JS divergence between the two heads' attention rows, on `windows` val windows. The first
    `skip` rows (a handful of keys, nearly forced patterns) are left out."""
    model.eval()
    width, skip = distinct_sizes(model, data, width, skip)
    x = next(iter(data.iter_eval("val", windows, width)))[0]
    with model.probe(keep_maps=True):
        model(x)
        maps = [a.last["maps"][:, :, skip:] for a in model.attentions()]  # [B, H, T', T] per layer
    H = maps[0].shape[1]
    if H < 2:  # no pair of heads to compare: [] (printed n/a), not a 0 that reads as "identical heads"
        return []
    return [torch.stack([js_divergence(p[:, g], p[:, h]).mean() for g in range(H) for h in range(g + 1, H)])
            .mean().item() for p in maps]


def per_layer(values: list[float]) -> str:
    """Distinctiveness per layer as printed: three decimals each, n/a for a one-head model."""
    return " ".join(f"{v:.3f}" for v in values) if values else "n/a (one head)"


def hub_ratio(A: torch.Tensor) -> tuple[int, float, torch.Tensor]:
    """-> (hub, ratio, column mass): the off-diagonal column mass Σ_{g≠h} |A[g, h]| (how much head h feeds the
    others), the head where it is largest, and its ratio to the mean of the other heads'."""
    A = A.abs() * (1 - torch.eye(A.shape[0], device=A.device))
    col = A.sum(0)
    hub = int(col.argmax())
    others = torch.cat([col[:hub], col[hub + 1:]])
    return hub, (col[hub] / others.mean().clamp_min(1e-12)).item() if len(others) else 1.0, col


def chance_hub_ratio(H: int, draws: int = 2000) -> float:
    """The median hub ratio of random N(0, 1) H×H matrices: a ratio near it says nothing about learned hubs. The
    median, not the mean: at H = 2 the ratio is |X|/|Y| of two normals, whose mean does not exist."""
    g = torch.Generator().manual_seed(0)
    return torch.tensor([hub_ratio(torch.randn(H, H, generator=g))[1] for _ in range(draws)]).median().item()


def kronecker_maps(model: DualStream) -> list[tuple[int, str, torch.Tensor]]:
    """(layer, "V" | "O", A) for every Kronecker mixing matrix of the model, in layer order, V before O."""
    return [(i, name, mix.weight.detach().float().cpu()) for i, a in enumerate(model.attentions())
            for name, mix in (("V", a.mix_v), ("O", a.mix_o)) if mix.kind == "kronecker"]


def hubs(model: DualStream) -> Optional[list[dict]]:
    """Hub structure of the Kronecker mixing matrices (spec §7, §10.4), per layer and for A_V and A_O (those that
    are Kronecker): the hub (hub_ratio), its ratio against the chance level of random matrices, the row mass
    Σ_h |A[g, h]| and the diagonal dominance |A[g, g]| / row mass."""
    maps = kronecker_maps(model)
    if not maps:
        return None
    rows, chance = [], chance_hub_ratio(model.cfg.heads)
    for i, name, A in maps:
        hub, ratio, col = hub_ratio(A)
        row = A.abs().sum(1)
        rows.append({"layer": i, "matrix": name, "hub": hub, "hub ratio": ratio, "chance ratio": chance,
                     "diag dominance": (A.diagonal().abs() / row.clamp_min(1e-12)).mean().item(),
                     "off-diag column mass": [round(v, 4) for v in col.tolist()],
                     "row mass (with diag)": [round(v, 4) for v in row.tolist()]})
    return rows


def hub_growth(model: DualStream) -> Optional[dict]:
    """Growth of the hub across depth (spec §7, §10.4: head 0 "amplified about 3.5× in deeper layers"), per Kronecker
    matrix kind present in two layers or more: the deepest layer's hub head h, its off-diagonal column mass there over
    its mass in the first layer ("growth"; the paper's 3.5× read as the hub's own strength growing with depth), the
    hub ratios of both layers (the other reading: the hub against the other heads, per layer), and the median growth
    of random N(0, 1) matrix pairs (chance; above 1, since h is the deepest layer's largest column)."""
    maps, out = kronecker_maps(model), {}
    chance = chance_hub_growth(model.cfg.heads) if maps else None
    for kind in ("V", "O"):
        layers = [(i, A) for i, name, A in maps if name == kind]
        if len(layers) < 2:
            continue
        (first, A0), (deep, A1) = layers[0], layers[-1]
        hub, growth, ratio0, ratio, common = _hub_growth(A0, A1)
        out[kind] = {"head": hub, "first layer": first, "deepest layer": deep, "growth": growth,
                     "chance growth": chance, "hub ratio first": ratio0, "hub ratio deepest": ratio,
                     "common growth": common}
    return out or None


def _hub_growth(A0: torch.Tensor, A1: torch.Tensor) -> tuple[int, float, float, float, float]:
    """(hub head h of A1, its column mass in A1 over that in A0, hub ratio of A0, hub ratio of A1, every head's
    off-diagonal mass in A1 over that in A0). The growth moves with A's scale, which random pairs drawn at one scale
    cannot show: the last figure is that common growth, and growth / common the growth of the hub's share."""
    hub, ratio, col = hub_ratio(A1)
    _, ratio0, col0 = hub_ratio(A0)
    return (hub, (col[hub] / col0[hub].clamp_min(1e-12)).item(), ratio0, ratio,
            (col.sum() / col0.sum().clamp_min(1e-12)).item())


def chance_hub_growth(H: int, draws: int = 2000) -> float:
    """hub_growth's growth for two independent random N(0, 1) H×H matrices, the median over `draws` pairs."""
    g = torch.Generator().manual_seed(0)

    def growth():
        A1 = torch.randn(H, H, generator=g)  # the deep matrix first: the draws' order fixes the figure
        return _hub_growth(torch.randn(H, H, generator=g), A1)[1]
    return torch.tensor([growth() for _ in range(draws)]).median().item()


def hub_growth_text(g: dict) -> str:
    """One hub_growth entry as the log and the report print it."""
    return (f"L{g['first layer']}→L{g['deepest layer']} {g['growth']:.2f}x (column mass of head {g['head']}, the "
            f"deepest hub; random matrices {g['chance growth']:.2f}x; hub ratio {g['hub ratio first']:.1f}x → "
            f"{g['hub ratio deepest']:.1f}x; every head's off-diagonal mass {g['common growth']:.2f}x, so the hub's "
            f"share {g['growth'] / max(g['common growth'], 1e-12):.2f}x)")


def kronecker_figure(model: DualStream) -> Optional[str]:
    """Heatmaps of every layer's A_V and A_O (those that are Kronecker; signed, one colour scale and colorbar per
    matrix) as a base64 PNG: one row per matrix kind, one column per layer."""
    maps = kronecker_maps(model)
    if not maps:
        return None
    kinds = sorted({name for _, name, _ in maps}, key="VO".index)
    L = len(model.blocks)

    def draw(fig):
        axes = fig.subplots(len(kinds), L, squeeze=False)
        for i, name, A in maps:
            lim = A.abs().max().item() or 1.0
            ax = axes[kinds.index(name)][i]
            im = ax.imshow(A.numpy(), cmap="RdBu_r", vmin=-lim, vmax=lim)
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04).ax.tick_params(labelsize=6)  # each map has its own scale
            ax.set_xticks(range(A.shape[1]))  # heads are whole: matplotlib's default ticks fall at 0.5 for H = 3
            ax.set_yticks(range(A.shape[0]))
            ax.set_title(f"layer {i} A_{name}", fontsize=8)
            ax.set_xlabel("from head h", fontsize=7)
            ax.set_ylabel("to head g", fontsize=7)
            ax.tick_params(labelsize=6)
    return figure(draw, size=(2.2 * L, 2.3 * len(kinds)))


# Built-in coreference probe (spec §7; the paper's metric is not public): two names of different gender, then a
# pronoun that can only refer to one of them. Names are characters of the embedded plays.
COREF_NAMES = (("Romeo", "Juliet"), ("Hamlet", "Ophelia"), ("Orlando", "Rosalind"), ("Benedick", "Beatrice"),
               ("Antonio", "Portia"), ("Sebastian", "Viola"))
COREF_TEMPLATES = ("{A} met {B} in the garden, and {p} said", "{A} wrote to {B} at night, and then {p} wept",
                   "When {A} saw {B} at the gate, {p} smiled", "{A} gave {B} a ring because {p} loved")
# The logit gap's family (spec §7: "score the logit gap ... per head"): a scene with the pronoun's clause closed,
# then a question whose answer is the next token: the pronoun's antecedent, the one name of its gender. In
# COREF_TEMPLATES a verb follows the pronoun, so no position's next token is a name there. Short, so that even in
# bytes every prompt fits a context of 64 (the longest, with the shared " Be" of Benedick/Beatrice: 64 tokens).
COREF_GAP_TEMPLATES = ("{A} met {B}, and {p} spoke. The one who spoke was",
                       "{A} saw {B}, and {p} smiled. The one who smiled was",
                       "{A} wrote to {B}; {p} wept. The one who wept was",
                       "{A} kissed {B}; {p} sighed. The one who sighed was")


def coref_prompts(templates=COREF_TEMPLATES) -> list[tuple[str, str, str, str]]:
    """(text, pronoun, right name, wrong name): every pair, both orders, pronoun pointing at either name."""
    out = []
    for m, f in COREF_NAMES:
        for t in templates:
            for a, b in ((m, f), (f, m)):
                for right, pron in ((m, "he"), (f, "she")):
                    out.append((t.format(A=a, B=b, p=pron), pron, right, f if right == m else m))
    return out


def coref_positions(tok, text: str, pron: str, right: str, wrong: str):
    """-> (ids, pronoun's last token, right name's tokens, wrong name's tokens), or None when the text does not
    decode token by token (then character spans are unknown). Spans come from decoding one token at a time."""
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    if "".join(pieces) != text:
        return None
    ends = [sum(len(p) for p in pieces[:i + 1]) for i in range(len(pieces))]
    spans = list(zip([0] + ends[:-1], ends))

    def covering(start, n):
        return [i for i, (s, e) in enumerate(spans) if s < start + n and e > start]
    q = covering(text.index(f" {pron} ") + 1, len(pron))
    r, w = covering(text.index(right), len(right)), covering(text.index(wrong), len(wrong))
    return ids, q[-1], r, w


def coref_gap_tokens(tok, text: str, right: str, wrong: str):
    """-> (context ids, right name's token, wrong name's token): the prompt's tokens, then those the two names
    " right" and " wrong" share (none in cl100k, where each name's first token differs; in bytes the space, and
    " Be" for Benedick/Beatrice), so that the next token is each name's first distinct one (a multi-token name is
    scored by it). None when the prompt does not decode as typed (a token lost to the vocabulary compaction), a
    name merges into the prompt's last token, or a scored token is the compaction's unknown id (then the gap
    compares nothing)."""
    ids = tok.encode(text)
    r, w = tok.encode(f"{text} {right}"), tok.encode(f"{text} {wrong}")
    if tok.decode(ids) != text or r[:len(ids)] != ids or w[:len(ids)] != ids:
        return None
    k = next((i for i in range(len(ids), min(len(r), len(w))) if r[i] != w[i]), None)
    if k is None or tok.unk in (r[k], w[k]) or not f"{text} {right}".startswith(tok.decode(r[:k])):
        return None
    return r[:k], r[k], w[k]


def over_prompts(values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-prompt scores [n, ...] -> (mean, its standard error, fraction of prompts above 0: chance 50%)."""
    x = torch.stack(values)
    mean = x.mean(0)
    stderr = (((x - mean) ** 2).mean(0) / max(len(values) - 1, 1)).sqrt()
    return mean, stderr, (x > 0).float().mean(0)


def split_half(values: list[torch.Tensor], seed: int = 0) -> dict:
    """The best head picked on a random half of the prompts and scored on the other half, which the pick never
    saw: the best of L·H noisy means is flattered by its own selection, and this is the figure it would earn
    elsewhere. The halves are a seeded permutation's, not even/odd: coref_prompts alternates the pronoun, so parity
    would pick on "he" and score on "she". Per-prompt scores [n][L, H] -> {layer, head, selection (its mean on the
    picking half), mean, stderr, accuracy (on the other half), prompts (that half's)}; {} with fewer than 4."""
    if len(values) < 4:
        return {}
    order = torch.randperm(len(values), generator=torch.Generator().manual_seed(seed)).tolist()
    half = len(values) // 2
    picked = over_prompts([values[i] for i in order[:half]])[0]
    mean, stderr, accuracy = over_prompts([values[i] for i in order[half:]])
    best, H = int(picked.flatten().argmax()), picked.shape[-1]
    return {"layer": best // H, "head": best % H, "selection": picked.flatten()[best].item(),
            "mean": mean.flatten()[best].item(), "stderr": stderr.flatten()[best].item(),
            "accuracy": accuracy.flatten()[best].item(), "prompts": len(values) - half}


def split_half_text(h: dict) -> str:
    """split_half's result, for the log and the report."""
    return (f"split half: the best head on a random half of the prompts, L{h['layer']}h{h['head']} "
            f"({h['selection']:+.3g} there), scores {h['mean']:+.3g} ± {h['stderr']:.2g} on the other {h['prompts']} "
            f"(> 0 in {h['accuracy']:.0%})") if h else "split half: fewer than 4 prompts"


NO_COREF = ("coreference probe: no usable prompt (each has a token lost to the vocabulary compaction, so it does "
            "not decode token by token, or is longer than --ctx)")
NO_COREF_GAP = ("coreference logit gap: no usable prompt (each has a token lost to the vocabulary compaction, or "
                "is longer than --ctx)")


@torch.no_grad()
def coreference(model: DualStream, tok, device) -> dict:
    """Per (layer, head): mean over the probe of the attention mass from the pronoun's token to the right name's
    tokens minus the mass to the wrong name's, and the fraction of prompts where the right name gets more (chance
    50%). The best head is the largest of L·H noisy means: its standard error, the mean over heads and a split half
    (its pick on a random half of the prompts, scored on the other half) come with it."""
    model.eval()
    H = model.cfg.heads
    margins = []
    for prompt in coref_prompts():
        pos = coref_positions(tok, *prompt)
        if pos is None or len(pos[0]) > model.cfg.ctx:
            continue
        ids, q, r, w = pos
        with model.probe(keep_maps=True):
            model(torch.tensor([ids], device=device))
            maps = torch.stack([a.last["maps"][0, :, q].float().cpu() for a in model.attentions()])  # [L, H, T]
        margins.append(maps[..., r].sum(-1) - maps[..., w].sum(-1))
    if not margins:
        return {"prompts": 0}
    margin, stderr, correct = over_prompts(margins)
    best = int(margin.flatten().argmax())
    return {"prompts": len(margins), "margin": margin.tolist(), "accuracy": correct.tolist(),
            "mean_margin": margin.mean().item(), "split_half": split_half(margins),
            "best": {"layer": best // H, "head": best % H, "margin": margin.flatten()[best].item(),
                     "stderr": stderr.flatten()[best].item(), "accuracy": correct.flatten()[best].item()},
            "layer_best_margin": margin.max(1).values.tolist()}


# Direct logit attribution of the gap, per head (Wang et al. 2022, IOI's per-head "logit difference"). The readout
# reads the sum of every write, x = embedding + Σ_l (attention_l + FFN_l), in each mode (token-factor: attention
# writes x_t and the FFN x_e, and CLN_f reads x_t + x_e; FTS: both write x_e; single: one stream), and Mix_O is
# linear without bias, so head h's write is Mix_O applied to y with every other head's slice zeroed (under
# Kronecker mixing A[:, h] spreads it over every slice, still the head's own). With CLN_f's per-slice scale frozen
# at the last position (ChannelLayerNorm.frozen), each term c scores (E[right] − E[wrong]) · frozen(x, c), and the
# terms plus the bias's term (E[right] − E[wrong]) · β sum to the model's gap. A head's score is its direct effect
# only: what it does through later layers' Q, K and V is not counted.
@torch.no_grad()
def logit_gap_attribution(model: DualStream, ids: list[int], right: int, wrong: int, device) -> dict:
    """One prompt: the model's gap logit[right] − logit[wrong] at the last position, and its terms: the embedding,
    each (layer, head) [L, H], each layer's FFN [L] and the norm's bias."""
    model.eval()
    writes, hooks = {}, []

    def keep(key):
        def hook(module, inputs, output):
            writes[key] = (inputs, output)
        return hook
    hooks.append(model.drop.register_forward_hook(keep("embed")))   # the embedding as x starts (FTS: normalised)
    hooks.append(model.ln_f.register_forward_hook(keep("x")))
    for i, b in enumerate(model.blocks):
        hooks.append(b.attn.mix_o.register_forward_hook(keep(("y", i))))
        hooks.append(b.ffn.register_forward_hook(keep(("ffn", i))))
    try:
        logits = model(torch.tensor([ids], device=device))[0, -1]
    finally:
        for h in hooks:
            h.remove()
    ln, H = model.ln_f, model.cfg.heads
    x = writes["x"][0][0][0, -1]
    direction = model.wte.weight[right] - model.wte.weight[wrong]     # the tied head's row difference

    def score(c):
        return ln.frozen(x, c) @ direction
    heads = []
    for i, b in enumerate(model.blocks):
        y = writes[("y", i)][0][0][0, -1]                              # [d]: the heads' outputs before Mix_O
        only = torch.eye(H, dtype=y.dtype, device=y.device).repeat_interleave(y.shape[-1] // H, 1) * y   # [H, d]
        heads.append(score(b.attn.mix_o(only)))
    bias = 0.0 if ln.bias is None else (ln._full(ln.bias, x.shape[-1]) @ direction).item()
    return {"gap": (logits[right] - logits[wrong]).item(), "embed": score(writes["embed"][1][0, -1]).item(),
            "heads": torch.stack(heads).double().cpu(), "bias": bias,
            "ffn": torch.stack([score(writes[("ffn", i)][1][0, -1]) for i in range(len(model.blocks))]).double().cpu()}


@torch.no_grad()
def coreference_gap(model: DualStream, tok, device) -> dict:
    """Over COREF_GAP_TEMPLATES' prompts: the model's logit gap, right name's first token minus the wrong one's at
    the last position (mean, standard error, fraction of prompts above 0: chance 50%), and its direct logit
    attribution per (layer, head) with the best head, beside the embedding's, each FFN's and the bias's terms."""
    terms = [logit_gap_attribution(model, *pos, device) for pos in
             (coref_gap_tokens(tok, text, right, wrong) for text, _, right, wrong in coref_prompts(COREF_GAP_TEMPLATES))
             if pos is not None and len(pos[0]) <= model.cfg.ctx]
    if not terms:
        return {"prompts": 0}
    H = model.cfg.heads
    gap, gap_se, gap_pos = over_prompts([torch.tensor(t["gap"], dtype=torch.float64) for t in terms])
    heads, heads_se, heads_pos = over_prompts([t["heads"] for t in terms])
    best = int(heads.flatten().argmax())
    return {"prompts": len(terms), "gap": gap.item(), "stderr": gap_se.item(), "accuracy": gap_pos.item(),
            "heads": heads.tolist(), "heads_accuracy": heads_pos.tolist(),
            "split_half": split_half([t["heads"] for t in terms]),
            "best": {"layer": best // H, "head": best % H, "gap": heads.flatten()[best].item(),
                     "stderr": heads_se.flatten()[best].item(), "accuracy": heads_pos.flatten()[best].item()},
            "embed": sum(t["embed"] for t in terms) / len(terms), "bias": sum(t["bias"] for t in terms) / len(terms),
            "ffn": over_prompts([t["ffn"] for t in terms])[0].tolist()}


def gap_text(g: dict) -> str:
    """The logit gap's summary, one line (log and report)."""
    if not g.get("prompts"):
        return NO_COREF_GAP
    b = g["best"]
    return (f"coreference logit gap ({g['prompts']} prompts, right name's first token minus the wrong one's): "
            f"{g['gap']:+.3f} ± {g['stderr']:.3f}, right name ahead in {g['accuracy']:.0%} (chance 50%); per head, "
            f"direct logit attribution: best L{b['layer']}h{b['head']} {b['gap']:+.3g} ± {b['stderr']:.2g} (> 0 in {b['accuracy']:.0%}), "
            f"{split_half_text(g['split_half'])}, "
            f"embedding {g['embed']:+.3g}, FFN per layer " + " ".join(f"{v:+.3g}" for v in g["ffn"]))


@torch.no_grad()
def head_specialization(model: DualStream, data, device) -> dict:
    return {"distinctiveness": distinctiveness(model, data), "on": distinctiveness_on(*distinct_sizes(model, data)),
            "hubs": hubs(model), "hub_growth": hub_growth(model),
            "coreference": coreference(model, data.tokenizer, device),
            "coreference_gap": coreference_gap(model, data.tokenizer, device)}


def sample_text(model, tok, prompt: str, n: int, device, seed: int, temperature: float = 0.8, top_k: int = 40) -> str:
    ids = tok.encode(prompt.replace("\\n", "\n").replace("\\t", "\t")) or [tok.eot]  # "\n" typed in a shell
    g = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=device), n, temperature, top_k, generator=g)
    return tok.decode(out[0].tolist())


BENCH_VOCAB = 50304  # GPT-2's vocabulary padded to a multiple of 64 (nanoGPT)


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


def bench(cfg: Config, vocab_size: int, device, autocast, log=print) -> dict:
    """Training tokens/s of each V/O mixing strategy (token-factor, dense FFN) and of the fully independent model,
    relative to dense, measured side by side (steps alternated so drift hits all alike, random tokens); the mixing
    maps alone (bench_mixing); then the attention kernel against SDPA and the explicit reference."""
    B, T = min(cfg.batch_size, 16), cfg.ctx
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "batch": B, "ctx": T}
    log(f"bench: {cfg.layers} layers, d={cfg.d_model}, {cfg.heads} heads, vocab {vocab_size}, batch {B}x{T}, "
        f"kernels {cfg.kernels}")
    runs = {}
    for name in ("dense", "kronecker", "independent", "identity", "fully independent"):
        c = replace(cfg, **SWEEP[name], **dict.fromkeys(POINT_KEYS, "same"), dropout=0.0)
        torch.manual_seed(cfg.seed)
        m = DualStream(c, vocab_size).to(device)
        runs[name] = (m, make_optimizer(m, c, device.type))
        res.setdefault("mixing_points", {})[name] = mixing_points(c)  # (V, O, FFN up, FFN down)
    x = torch.randint(0, vocab_size, (B, T), device=device)
    y = torch.randint(0, vocab_size, (B, T), device=device)

    def step(name):
        m, opt = runs[name]
        with autocast:
            loss = m(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
    times = {n: [] for n in runs}
    reps = 20 if device.type == "cuda" else 5
    for i in range(reps + 2):
        for n in runs:
            t = time.perf_counter()
            step(n)
            if i >= 2:  # two warm-up rounds
                times[n].append(time.perf_counter() - t)
    tok_s = {n: B * T / sorted(v)[len(v) // 2] for n, v in times.items()}
    res["train_tok_s"] = tok_s
    res["ratio_to_dense"] = {n: tok_s[n] / tok_s["dense"] for n in tok_s}
    log("training tokens/s: " + ", ".join(f"{n} {v:,.0f} ({res['ratio_to_dense'][n]:.1%})" for n, v in tok_s.items())
        + " (ratios to dense; goal: kronecker and independent >= 95%)")
    step_ms = {n: 1e3 * B * T / v for n, v in tok_s.items()}
    res["mixing"] = bench_mixing(runs, cfg, B, T, step_ms, device, autocast, log)
    res["kernel"] = bench_kernel(cfg, device, log)
    return res


def bench_mixing(runs: dict, cfg: Config, B: int, T: int, step_ms: dict, device, autocast, log=print) -> dict:
    """Where a mixing strategy's step time goes: the first block's two attention maps alone (Mix_V on the fp32
    token stream, then Mix_O on its bf16 output under autocast, forward + backward, the model's own modules) for
    dense, kronecker and independent, times the 2 maps per layer's L layers, beside the whole step's difference
    to dense. A map's difference near the step's says the map is the cost; a step's well above it, that something
    around the maps is (another launch, a copy, a wait)."""
    x = torch.randn(B, T, cfg.d_model, device=device, requires_grad=True)
    out = {}
    for name in ("dense", "kronecker", "independent"):
        attn = runs[name][0].blocks[0].attn
        with torch.no_grad(), autocast:  # the output's dtype (bf16 under autocast), so the timed calls cast nothing
            g = torch.randn(B, T, cfg.d_model, device=device).to(attn.mix_o(attn.mix_v(x)).dtype)

        def maps():
            with autocast:
                y = attn.mix_o(attn.mix_v(x))
            y.backward(g)
            attn.zero_grad(set_to_none=True)
            x.grad = None
        ms = 1e3 * bench_time(maps, device)
        out[name] = {"ms": ms, "per_step_ms": ms * cfg.layers, "step_minus_dense_ms": step_ms[name] - step_ms["dense"]}
    log("mixing maps alone (Mix_V then Mix_O, forward + backward, one layer; x L = " + str(cfg.layers) + " per step): "
        + ", ".join(f"{n} {v['ms']:.3f} ms ({v['per_step_ms'] - out['dense']['per_step_ms']:+.2f} ms a step vs dense; "
                    f"the whole step's difference {v['step_minus_dense_ms']:+.2f} ms)" for n, v in out.items()
                    if n != "dense")
        + f"; dense {out['dense']['ms']:.3f} ms")
    return out


BENCH_KERNEL_CTX = {"cuda": (256, 512, 1024, 2048, 4096), "cpu": (256, 512, 1024)}  # looked up per call: tests shorten


def bench_kernel(cfg: Config, device, log=print) -> dict:
    """amp_attention (o plus entropy and max weight) against SDPA (o only) and the explicit reference, forward and
    forward + backward, B·H = 4·6 heads of d_h = 64. On CUDA the Triton kernel in bf16 at ctx 256 … 4096; without
    one the blocked torch form (what the model runs there) in fp32 at ctx 256 … 1024 (BENCH_KERNEL_CTX), where the
    statistics take a second blocked pass: it is timed also without them ("torch-o", what training runs). On CUDA
    the forwards are also timed replayed from a CUDA graph, the GPU's time without the host's launch costs (with a
    warm L2: the replays skip do_bench's cache flush), which dominated below ctx 4k on an H200."""
    cuda = device.type == "cuda" and HAS_TRITON
    name, backend = ("triton", "triton") if cuda else ("torch", "torch")
    dtype, lengths = (torch.bfloat16, BENCH_KERNEL_CTX["cuda"]) if cuda else (torch.float32, BENCH_KERNEL_CTX["cpu"])
    out = {"form": name, "dtype": str(dtype).removeprefix("torch.")}
    B, H, dh = 4, 6, 64
    forms = {name: lambda q, k, v: amp_attention(q, k, v, 1.0, backend=backend)[0],
             "sdpa": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
             "reference": lambda q, k, v: amp_attention_reference(q, k, v, 1.0)[0]}
    if not cuda:
        forms["torch-o"] = lambda q, k, v: amp_attention(q, k, v, 1.0, stats=False, backend="torch")[0]
    for T in lengths:
        q, k, v = (torch.randn(B, H, T, dh, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        row = {}
        for form, fn in forms.items():
            fwd = bench_time(lambda: fn(q, k, v), device)
            fb = bench_time(lambda: torch.autograd.grad(fn(q, k, v), (q, k, v), do), device)
            row[form] = {"fwd_ms": 1e3 * fwd, "fwd_bwd_ms": 1e3 * fb}
        if cuda:  # the GPU's time alone: a CUDA graph replays the launches without the host's per-call costs
            for form in (name, "sdpa"):
                with torch.no_grad():
                    row[form]["graph_fwd_ms"] = triton.testing.do_bench_cudagraph(
                        lambda: forms[form](q, k, v), quantiles=[0.5])
            row["graph_fwd_vs_sdpa"] = row[name]["graph_fwd_ms"] / row["sdpa"]["graph_fwd_ms"]
        row["fwd_vs_sdpa"] = row[name]["fwd_ms"] / row["sdpa"]["fwd_ms"]
        row["fwd_bwd_vs_sdpa"] = row[name]["fwd_bwd_ms"] / row["sdpa"]["fwd_bwd_ms"]
        row["fwd_vs_reference"] = row[name]["fwd_ms"] / row["reference"]["fwd_ms"]
        out[f"T{T}"] = row
        o_only = (f"; in a CUDA graph fwd {row[name]['graph_fwd_ms']:.3f} ms ({row['graph_fwd_vs_sdpa']:.2f}x SDPA's)"
                  if cuda else f"; o alone (training's call) fwd {row['torch-o']['fwd_ms']:.3f} ms "
                               f"({row['torch-o']['fwd_ms'] / row['sdpa']['fwd_ms']:.2f}x SDPA's)")
        log(f"kernel ({name}, {out['dtype']}) T={T}: o + statistics fwd {row[name]['fwd_ms']:.3f} ms "
            f"({row['fwd_vs_sdpa']:.2f}x SDPA's time{', goal <= 1.3x' if cuda else ''}; {row['fwd_vs_reference']:.2f}x "
            f"the reference's), fwd+bwd {row[name]['fwd_bwd_ms']:.3f} ms ({row['fwd_bwd_vs_sdpa']:.2f}x SDPA's)"
            + o_only)
    return out


def figure(draw, size=(6, 3.5)) -> str:
    """draw(fig) on a fresh matplotlib figure -> base64 PNG (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=size)
    draw(fig)
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def loss_figure(histories: dict) -> str:
    """Train (faint) and val (markers) loss per model, one colour per model: a colour per line would repeat after
    matplotlib's ten, and the sweep's 7 models draw 14 lines."""
    from matplotlib.ticker import MaxNLocator

    def draw(fig):
        ax = fig.add_subplot()
        for i, (name, h) in enumerate(histories.items()):
            color = f"C{i % 10}"
            if h["train"]:
                ax.plot(*zip(*h["train"]), color=color, label=f"{name} train", alpha=0.45)
            if h["val"]:
                ax.plot(h["step"], h["val"], "o--", color=color, ms=3, label=f"{name} val")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend(fontsize=7)
    return figure(draw)


def amplification_figure(amp: dict) -> str:
    """Relative val-loss increase against α per model, and mean attention entropy per layer against α."""
    def draw(fig):
        ax1, ax2 = fig.subplots(1, 2)
        for name, a in amp.items():
            alphas = [r["alpha"] for r in a["rows"]]
            ax1.plot(alphas, [100 * r["degradation"] for r in a["rows"]], "o-", label=name)
        ax1.set_xscale("log", base=2)
        ax1.set_xlabel("α")
        windows = next(iter(amp.values())).get("windows")  # the same first windows for every model
        ax1.set_ylabel("loss increase (%)" + (f", {windows} val windows" if windows else ""))
        ax1.legend(fontsize=7)
        name, a = next(iter(amp.items()))
        for r in a["rows"]:
            ax2.plot(range(len(r["entropy"])), r["entropy"], "o-", label=f"α={r['alpha']:g}")
        ax2.set_xticks(range(len(a["rows"][0]["entropy"])))  # layers are whole: matplotlib would put ticks at 0.5
        ax2.set_xlabel("layer")
        ax2.set_ylabel(f"mean attention entropy (nats), {name}")
        ax2.legend(fontsize=7)
    return figure(draw, (10, 3.5))


def table_html(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{fmt(r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def resolved_config(cfg: Config, results: dict) -> dict:
    """The configuration as the report shows it: a setting left at auto says what it resolved to (auto → cpu), as
    the report's header line does."""
    row = asdict(cfg)
    for k in ("preset", "device", "dtype"):
        if row[k] == "auto" and results.get(k):
            row[k] = f"auto → {results[k]}"
    # a sweep's models differ in these: the base value would read as every model's
    for k in (tuple(SWEEP["dense"]) if cfg.sweep else ()) + (("heads",) if cfg.head_sweep else ()):
        row[k] = "swept (per model below)"
    return row


def greedy_samples(samples: dict) -> list[tuple[str, Optional[str]]]:
    """-> (α as printed, sample, or None where it is byte-identical to α = 1's): greedy decoding of a weak model
    often gives the same text at several α, which the report and the log then name instead of repeating."""
    base = samples.get("1.0")
    return [(f"{float(k):g}", None if k != "1.0" and s == base else s) for k, s in samples.items()]


def write_report(out_dir: Path, cfg: Config, results: dict, histories: dict, name: str = "report") -> Path:
    img = '<img src="data:image/png;base64,{}">'.format
    parts = [f"<h1>Dual-Stream Transformer report</h1><p>{html.escape(time.strftime('%Y-%m-%d %H:%M'))}, preset "
             f"{html.escape(results.get('preset', ''))}, device {html.escape(results.get('device', ''))}</p>",
             "<h2>Configuration</h2>" + table_html([resolved_config(cfg, results)], list(asdict(cfg)))]
    if histories:
        parts.append("<h2>Training</h2>" + img(loss_figure(histories)))
    if results.get("models"):
        parts.append("<h2>Validation (every token once)</h2>" + table_html(results["models"], list(results["models"][0]))
                     + (f"<p>Val loss vs dense not computed: {html.escape(results['vs_dense_skipped'])}</p>"
                        if "vs_dense_skipped" in results else "")
                     + (f"<p>Not shown: {html.escape(results['missing'])}</p>" if "missing" in results else ""))
    if results.get("amplification"):
        amp = results["amplification"]
        # every model reads the same first windows of the same split: one count for the whole table
        first = next(iter(amp.values()))
        where = on_windows(first["windows"], first["tokens"])
        loss_col = f"loss on {first['windows']} val windows"
        rows = [{"model": m, "alpha": r["alpha"], loss_col: r["loss"], "ppl": r["ppl"],
                 "increase": f"{r['degradation']:+.1%}",
                 "mean entropy (nats)": sum(r["entropy"]) / len(r["entropy"]),
                 "entropy per layer (nats)": " ".join(f"{e:.2f}" for e in r["entropy"]),
                 "max weight per layer": " ".join(f"{e:.2f}" for e in r["max_weight"])}
                for m, a in amp.items() for r in a["rows"]]
        parts.append(f"<h2>Attention amplification</h2><p>{REPORTED_AMPLIFICATION}. "
                     f"Losses on the first {where}, set by --analysis-windows, not on the whole split of the validation "
                     "table above, so the loss at α = 1 need not match it. Attention entropy in nats, the mean over "
                     "each layer's heads and queries (the first query, with one key and entropy 0, "
                     "included).</p>" + img(amplification_figure(amp))
                     + table_html(rows, list(rows[0])))
        for m, a in amp.items():
            parts.append(f"<h3>Greedy samples, {html.escape(m)}</h3><p>temperature 0, so a weak model repeats "
                         "itself at any α: compare each sample with α = 1's</p>" + "".join(
                             f"<pre>α={k}: {html.escape(s) if s is not None else 'same as α=1'}</pre>"
                             for k, s in greedy_samples(a["samples"])))
    if results.get("ablation"):
        first = next(rs[0] for rs in results["ablation"].values() if rs)
        w = first["windows"]
        named = {"loss": f"loss on {w} val windows", "full": f"full, {w} val windows"}
        rows = [{"model": m, **{named.get(k, k): (f"{v:+.1%}" if k == "change" else v) for k, v in r.items()
                               if k not in ("windows", "tokens")}}  # in the caption
                for m, rs in results["ablation"].items() for r in rs]
        notes = "".join(f"<p>{html.escape(m)}: {html.escape(n)}</p>" for m, n in results.get("ablation_notes", {}).items())
        parts.append(f"<h2>Stream ablation</h2><p>{REPORTED_ABLATION}. Losses "
                     f"on the first {on_windows(w, first['tokens'])}, set by --analysis-windows, as the amplification's; "
                     "full: both streams kept</p>" + table_html(rows, list(rows[0])) + notes)
    if results.get("head_sweep"):
        rows = results["head_sweep"]
        parts.append(f"<h2>Head sweep</h2><p>{REPORTED_HEAD_SWEEP}; this run's figures:</p>"
                     + table_html(rows, list(rows[0])))
    for m, s in results.get("specialization", {}).items():
        parts.append(f"<h2>Head specialisation, {html.escape(m)}</h2><p>distinctiveness ({html.escape(s['on'])}) "
                     "per layer: " + per_layer(s["distinctiveness"]) + "</p>")
        if s.get("hubs"):
            parts.append(img(s["figure"]) + table_html(s["hubs"], list(s["hubs"][0])))
        for kind, g in (s.get("hub_growth") or {}).items():
            parts.append(f"<p>A_{kind} hub growth across depth ({REPORTED_HUB}): "
                         f"{hub_growth_text(g)}</p>")
        c = s["coreference"]
        if c.get("prompts"):
            b = c["best"]
            parts.append(f"<p>coreference probe, {c['prompts']} prompts: best head layer {b['layer']} head {b['head']} "
                         f"(attention margin {b['margin']:+.3f} ± {b['stderr']:.3f}, right > wrong in {b['accuracy']:.0%}, "
                         f"chance 50%); mean margin over heads {c['mean_margin']:+.3f}; best margin per layer "
                         + " ".join(f"{v:+.3f}" for v in c["layer_best_margin"])
                         + f"; {html.escape(split_half_text(c['split_half']))}</p>")
        else:
            parts.append(f"<p>{NO_COREF}</p>")
        parts.append(f"<p>{html.escape(gap_text(s['coreference_gap']))}</p>")
    for m, samples in results.get("samples", {}).items():
        parts.append(f"<h2>Samples ({html.escape(m)})</h2>" + "".join(f"<pre>{html.escape(s)}</pre>" for s in samples))
    path = out_dir / f"{name}.html"
    path.write_text("<!doctype html><meta charset=utf-8><title>Dual-Stream report</title><style>body{font-family:"
                    "sans-serif;max-width:1100px}table{border-collapse:collapse;font-size:12px}td,th{border:1px "
                    "solid #ccc;padding:2px 6px}pre{background:#f6f6f6;padding:6px;white-space:pre-wrap}</style>"
                    + "".join(parts))
    return path


# -----------------------------------------------------------------------------
# main


class Logger:
    """print() on rank 0, and the same lines appended to out_dir/log-<variant>.txt (log-sweep.txt for a sweep,
    log-head-sweep-<variant>.txt for a head sweep)."""

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
MAX_LAYERS = 1024  # the model is built block by block before any memory runs out: --layers 1e20 would never end


def validate(cfg: Config, explicit=()) -> None:
    """Every bad flag value found before anything is trained, each as one line."""
    seeds = [f.name for f in fields(cfg) if f.name.endswith("seed") and not 0 <= getattr(cfg, f.name) < 2**32]
    if seeds:  # torch.manual_seed overflows past 64 bits with a traceback; numpy's legacy seeding past 32
        raise RunError(f"--{seeds[0].replace('_', '-')} must be in [0, 2**32)")
    for ok, msg in ((cfg.heads >= 1, "--heads must be >= 1"), (cfg.d_model >= 1, "--d-model must be >= 1")):
        if not ok:  # before the checks below divide by them
            raise RunError(msg)
    checks = [(1 <= cfg.layers <= MAX_LAYERS, f"--layers must be in [1, {MAX_LAYERS}]"),
              # --head-sweep's H = 2, 3, 6, 12 replace --heads: checked below, naming them
              (cfg.head_sweep or cfg.d_model % cfg.heads == 0,
               f"--d-model {cfg.d_model} must split into --heads {cfg.heads} heads"),
              (cfg.head_sweep or cfg.pos == "alibi" or (cfg.d_model // cfg.heads) % 2 == 0,
               "the head size d_model/heads must be even (RoPE rotates pairs; --pos alibi takes any)"),
              (cfg.ctx >= 1, "--ctx must be >= 1"), (cfg.batch_size >= 1, "--batch-size must be >= 1"),
              (cfg.max_iters >= 1, "--max-iters must be >= 1"),
              (cfg.eval_interval >= 1 and cfg.log_interval >= 1 and cfg.eval_iters >= 1, "intervals must be >= 1"),
              (cfg.lr > 0, "--lr must be > 0"), (0 <= cfg.dropout < 1, "--dropout must be in [0, 1)"),
              (0 <= cfg.min_lr_ratio <= 1, "--min-lr-ratio must be in [0, 1]"),
              (0 <= cfg.warmup_frac <= 1, "--warmup-frac must be in [0, 1]"),
              (cfg.weight_decay >= 0, "--weight-decay must be >= 0"), (cfg.grad_clip >= 0, "--grad-clip must be >= 0"),
              (cfg.analysis_windows >= 1, "--analysis-windows must be >= 1"),
              (cfg.sample_tokens >= 0, "--sample-tokens must be >= 0"),
              (cfg.temperature >= 0, "--temperature must be >= 0 (0: greedy)"),
              (cfg.top_k >= 0, "--top-k must be >= 0 (0: off)"),
              (cfg.train or not cfg.resume, "--resume continues training and --no-train trains nothing; give one"),
              (not cfg.bench or cfg.train and not cfg.resume, "--bench times the model and its kernels on random "
                                                              "data, with no checkpoint: drop --resume and --no-train"),
              # a standard LayerNorm has one group: a gain per head would be silently a gain per element
              (cfg.norm == "cln" or cfg.cln_gain == "element", "--cln-gain head needs --norm cln (a LayerNorm has no "
               "heads)"),
              (cfg.out_dir.strip() != "", "--out-dir is empty (. names the current folder)"),
              (not Path(cfg.out_dir).exists() or Path(cfg.out_dir).is_dir(), f"--out-dir {cfg.out_dir} is a file")]
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
    parse_alphas(cfg.amplify)
    typed = [k for k in (*SWEEP["dense"], *POINT_KEYS) if k in explicit]
    if cfg.sweep and typed:
        raise RunError(f"--sweep trains its own seven configurations; drop --{typed[0].replace('_', '-')}")
    if cfg.head_sweep:
        hs = ", ".join(map(str, HEAD_SWEEP))
        for ok, msg in ((not cfg.sweep, "--sweep and --head-sweep are separate runs; give one"),
                        ("heads" not in explicit, f"--head-sweep trains H = {hs}; drop --heads"),
                        (cfg.specialization, "--head-sweep compares the specialisation analyses; drop --no-specialization"),
                        (all(cfg.d_model % ((2 if cfg.pos == "rope" else 1) * h) == 0 for h in HEAD_SWEEP),
                         f"--head-sweep needs --d-model {cfg.d_model} to split into "
                         f"{'even ' if cfg.pos == 'rope' else ''}heads for H = {hs}")):
            if not ok:
                raise RunError(msg)


def unused_flags(cfg: Config, explicit) -> list[str]:
    """Typed flags that this invocation does not use (an analysis that is off, a model setting this architecture
    lacks), each with why: notes for the log. Such a flag does no harm, but it should not pass unseen."""
    amplify = bool(parse_alphas(cfg.amplify))
    models = configurations(cfg).values()  # a sweep uses a setting if any of its models does (NAME_KEYS' rule)
    shapes = {"v_source": "--mode single reads V from CLN_1(x)", "kron_out_init": "no Kronecker output mixing",
              "fts_cln_at_init": "it applies to --mode fts only"}
    why = {**{k: (any(NAME_KEYS[k](c) for c in models), msg) for k, msg in shapes.items()},
           "ablate_at": (cfg.ablation and (cfg.mode != "single" or cfg.sweep),  # a --head-sweep keeps the mode
                         "stream ablation is off, or --mode single has one stream and nothing to remove"),
           "analysis_windows": (amplify or cfg.ablation, "it sizes amplification and stream ablation, and both are off"),
           "sample_tokens": (cfg.train or cfg.sample is not None or amplify, "no samples: a --no-train run samples "
                             "only with --sample, or in amplification's greedy texts"),
           **{k: (cfg.train or cfg.sample is not None, "no samples: a --no-train run samples only with --sample "
                  "(amplification's texts are greedy)") for k in ("temperature", "top_k")},
           "alibi_alpha": (cfg.pos == "alibi" and amplify, "it sets how amplification scales ALiBi's bias: it needs "
                           "--pos alibi and --amplify (training runs at α = 1, where both readings agree)")}
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


def load_model(ck: dict, c: Config, data, device, path: Path) -> DualStream:
    check_tokenizer(ck, data, path)
    model = DualStream(c, data.vocab_size).to(device)
    load_weights(model, ck["model"], path)
    return model


def run(cfg: Config, explicit) -> int:
    from common import DataError, load_data, preset_banner, to_json, unk_targets_note, unknown_note

    preset = apply_preset(cfg, explicit)
    validate(cfg, explicit)
    cfg = canonical_mixing(cfg)
    alphas = parse_alphas(cfg.amplify)
    device, autocast, dist_info = setup_device(cfg)
    if cfg.kernels == "triton" and not HAS_TRITON:
        raise RunError(f"--kernels triton needs the triton package, which failed to import ({TRITON_ERROR})")
    if cfg.kernels == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RunError("--kernels triton needs a CUDA device (or TRITON_INTERPRET=1, Triton's slow CPU interpreter)")
    rank = dist_info["rank"]
    confs = configurations(cfg)
    widest = max(c.d_model // c.heads for c in confs.values())  # the head sweep's H = 2 is the widest
    if cfg.kernels == "triton" and widest > AMP_MAX_HEAD_DIM:
        raise RunError(f"--kernels triton: the attention kernel takes heads up to {AMP_MAX_HEAD_DIM} wide, not "
                       f"{widest}; use --kernels auto (the torch form for wide heads)")
    swept = tuple(SWEEP["dense"]) + (("heads",) if cfg.head_sweep else ())  # what differs between the models
    loaded = {}  # --no-train / --resume: the architecture and the data come from the checkpoints
    if (not cfg.train or cfg.resume) and not cfg.bench:
        for name, c in confs.items():
            path = ckpt_path(c)
            if (cfg.sweep or cfg.head_sweep) and not path.exists():  # a sweep uses what exists (--resume trains the rest from scratch)
                continue
            loaded[name] = (path, *load_checkpoint(path, c, explicit))
        if not loaded and not cfg.train:
            flag = "--head-sweep" if cfg.head_sweep else "--sweep"
            there = sorted(p.name for p in Path(cfg.out_dir).glob("ckpt-*.pt"))
            raise RunError(f"no {flag} checkpoints in {cfg.out_dir} (" + (f"it holds {', '.join(there)}: the "
                           "architecture flags name the files" if there else f"run {flag} first") + ")")
    if cfg.train:
        check_steps(loaded)
    # --no-train over a sweep shows the members whose checkpoints exist: the others are named, not dropped unseen
    missing = [name for name in confs if name not in loaded] if not cfg.train and not cfg.bench else []
    if loaded:
        saved = next(iter(loaded.values()))[2]
        cfg = replace(cfg, **{k: getattr(saved, k) for k in ARCH_KEYS + MERGED_KEYS if k not in swept})
        confs = {name: (loaded[name][2] if name in loaded else
                        replace(c, **{k: getattr(cfg, k) for k in MERGED_KEYS if k not in swept}))
                 for name, c in confs.items() if cfg.train or name in loaded}
    out_dir = Path(cfg.out_dir)
    log_name = ("sweep" if cfg.sweep else f"head-sweep-{variant(replace(cfg, heads=Config.heads))}" if cfg.head_sweep
                else variant(cfg))
    log = Logger(None if cfg.bench else out_dir / f"log-{log_name}.txt", rank)
    if preset == "cpu" and not cfg.bench and cfg.train and not cfg.resume:  # a resumed run keeps its own settings
        log(preset_banner(cfg, explicit, device, f"about {5 * len(confs)} minutes on 2 CPU cores", CPU_PRESET,
                          RUNTIME_KEYS))
    log("config: " + json.dumps(asdict(cfg)))
    for note in [] if cfg.bench else unused_flags(cfg, explicit):
        log(note)
    log(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton "
        f"{getattr(triton, '__version__', 'absent')}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    torch.manual_seed(cfg.seed + rank)
    if cfg.bench:  # random tokens: no corpus needed
        overridden = [f"--{k.replace('_', '-')}" for k in ("mode", "mixing", "ffn_mixing", *POINT_KEYS) if k in explicit]
        if overridden:  # the bench sets them per strategy (SWEEP)
            log(f"note: --bench times every mixing strategy of the sweep side by side; {', '.join(overridden)} "
                f"{'is' if len(overridden) == 1 else 'are'} not used")
        res = bench(cfg, BENCH_VOCAB, device, autocast, log)
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
    # what the auto settings resolved to, for the report (its configuration table shows "auto → cpu")
    results = {"preset": preset, "device": str(device),
               "dtype": "bfloat16" if isinstance(autocast, torch.autocast) else "float32"}
    if missing:
        results["missing"] = (f"no checkpoint in {cfg.out_dir} for {', '.join(missing)}: left out of this run "
                              f"(--{'head-' * cfg.head_sweep}sweep --resume trains them)")
        log(f"note: {results['missing']}")
    histories, models, budgets = {}, {}, {}  # budgets: the data and tokens each model was trained on
    start_rng = data.rng_state()
    for name, c in confs.items():
        c = replace(c, resume=cfg.resume and name in loaded)
        if cfg.train:
            ck = None
            if name in loaded:  # --resume
                path, ck, _ = loaded[name]
                check_tokenizer(ck, data, path)
            elif cfg.resume:
                log(f"{name}: no checkpoint at {ckpt_path(c)} yet; training it from step 0")
            t0 = time.time()
            models[name], histories[name] = train(c, data, device, autocast, dist_info, explicit, log, ck, start_rng)
            log(f"{name}: trained in {time.time() - t0:.0f}s; checkpoint {ckpt_path(c)}")
            budgets[name] = {**asdict(c), "step": c.max_iters}
        else:
            path, ck, c = loaded[name]
            models[name], histories[name] = load_model(ck, c, data, device, path), ck["history"]
            budgets[name] = {**ck["config"], "step": ck["step"]}  # as trained, whatever this command typed
    if dist_info["ddp"]:  # the analyses run on rank 0 alone, over the whole val split
        torch.distributed.destroy_process_group()
        data.rank, data.world_size = 0, 1
    if rank != 0:
        return 0
    ppl = {}
    for name, m in models.items():
        ppl[name] = evaluate_ppl(m, data, cfg.ctx, autocast)
        log(f"{name}: val loss {ppl[name]['loss']:.4f}, perplexity {ppl[name]['ppl']:.2f} over "
            f"{ppl[name]['tokens']:,} tokens" + unk_targets_note(ppl[name]))
    differ = budget_diff(budgets) if cfg.sweep else ""
    # checkpoints trained or extended apart: the loss gap would not be the mixing's cost; no dense: no base
    skipped = (f"the models were trained on different budgets ({differ})" if differ else
               "no token-factor dense model (its checkpoint is not in --out-dir)" if cfg.sweep and "dense" not in models
               else "")
    if skipped:
        results["vs_dense_skipped"] = skipped
        log(f"sweep: val loss vs dense not computed: {skipped}")
    results["models"] = sweep_table(models, ppl, compare=not skipped)
    if cfg.sweep:
        log(f"sweep (val loss relative to token-factor dense; {PAPER_COST_LINE}):")
        for r in results["models"]:
            log(f"  {r['model']:<20} {r['params (M)']:6.2f}M params ({r['non-embedding (M)']:5.2f}M non-embedding) "
                f"val loss {r['val loss']:.4f}  {r.get('vs dense', '')}")
    if alphas:
        results["amplification"] = {}
        for name, m in models.items():
            a = results["amplification"][name] = amplification(m, data, cfg, alphas, autocast)
            log(f"amplification, {name} (loss on {on_windows(a['windows'], a['tokens'])}; attention entropy in nats, "
                "mean over layers): " + ", ".join(
                    f"α={r['alpha']:g} loss {r['loss']:.3f} ppl {r['ppl']:.1f} ({r['degradation']:+.1%}, entropy "
                    f"{sum(r['entropy']) / len(r['entropy']):.2f})" for r in a["rows"]))
            # α = 1's greedy sample beside the last α's: greedy decoding of a weak model loops at any α
            greedy = dict(greedy_samples(a["samples"]))
            for k in dict.fromkeys(["1", f"{alphas[-1]:g}"]):
                log(f"  greedy at α={k}: " + (greedy[k].replace("\n", " / ")[:160] if greedy[k] is not None
                                             else "same as α=1"))
    if cfg.ablation:
        results["ablation"] = {}
        for name, m in models.items():
            if m.cfg.mode == "single":
                log(f"ablation, {name}: one stream, nothing to remove")
                continue
            rows = results["ablation"][name] = ablation(m, data, cfg, autocast)
            log(f"ablation, {name} (change of the loss on {on_windows(rows[0]['windows'], rows[0]['tokens'])}, "
                f"{rows[0]['full']:.3f} with both streams; {REPORTED_ABLATION}):")
            for r in rows:
                log(f"  {r['change']:+7.1%}  without {r['removed']}")
            if cfg.ablate_at == "all" and m.cfg.mode == "fts":
                results.setdefault("ablation_notes", {})[name] = FTS_ALL_NOTE
                log(f"  {FTS_ALL_NOTE}")
    if cfg.specialization:
        results["specialization"] = {}
        for name, m in models.items():
            s = results["specialization"][name] = head_specialization(m, data, device)
            line = f"distinctiveness ({s['on']}) per layer " + per_layer(s["distinctiveness"])
            fig = kronecker_figure(m)
            if fig is not None:
                png = out_dir / f"{'' if cfg.train else 'analysis-'}kronecker-{variant(m.cfg)}.png"
                png.write_bytes(base64.b64decode(fig))
                s["figure"] = fig
                kind = "O" if any(h["matrix"] == "O" for h in s["hubs"]) else "V"  # A_O's hubs, else A_V's
                deep = [h for h in s["hubs"] if h["matrix"] == kind]
                line += (f"; A_{kind} hubs " + " ".join(f"L{h['layer']}:h{h['hub']}({h['hub ratio']:.1f}x)" for h in deep)
                         + f" (random matrices: {deep[0]['chance ratio']:.1f}x)")
                if (s.get("hub_growth") or {}).get(kind):
                    line += f"; A_{kind} hub growth {hub_growth_text(s['hub_growth'][kind])}"
                line += f"; {png}"
            c = s["coreference"]
            if c.get("prompts"):
                line += (f"; coreference ({c['prompts']} prompts): best head L{c['best']['layer']}h{c['best']['head']} "
                         f"margin {c['best']['margin']:+.3f} ± {c['best']['stderr']:.3f}, right name first in "
                         f"{c['best']['accuracy']:.0%} (chance 50%); mean over heads {c['mean_margin']:+.3f}; "
                         f"{split_half_text(c['split_half'])}")
            else:
                line += f"; {NO_COREF}"
            line += f"; {gap_text(s['coreference_gap'])}"
            log(f"specialisation, {name}: {line}")
    if cfg.head_sweep:
        rows = results["head_sweep"] = head_sweep_table(models, ppl, results["specialization"])
        log(f"head sweep (spec §7, §10.5; {REPORTED_HEAD_SWEEP}):")
        for r in rows:
            held = lambda col: f", held out {r[col]}" if r[col] else ""  # noqa: E731
            coref = (f"coreference best head {r['coref best head']} right name first in {r['coref accuracy']:.0%} "
                     f"(margin {r['coref margin']:+.3f}{held('coref held-out margin')})" if r["coref prompts"]
                     else "coreference: no usable prompt")
            coref += (f"  logit gap {r['logit gap']:+.3f} ± {r['logit gap stderr']:.3f}, > 0 in {r['logit gap > 0']:.0%}"
                      f", best head by DLA {r['gap best head']} "
                      f"({r['gap best head DLA']:+.3g}{held('gap held-out DLA')})" if r["gap prompts"]
                      else "  logit gap: no usable prompt")
            log(f"  H={r['heads']:<3} d_h={r['d_h']:<4} val loss {r['val loss']:.4f}  distinctiveness {r['distinctiveness']:.3f} "
                f"(per layer {r['per layer']})  {coref}")
    if cfg.sample is not None or cfg.train:
        prompts = [cfg.sample] if cfg.sample is not None else ["HAMLET:\n"]
        note = unknown_note(data.tokenizer, cfg.sample) if cfg.sample is not None else None
        if note:  # a typed prompt the compacted vocabulary cannot spell: say so beside the sample
            log(note)
        results["samples"] = {}
        for name, m in models.items():
            m.eval()
            results["samples"][name] = [sample_text(m, data.tokenizer, p, cfg.sample_tokens, device, cfg.seed,
                                                       cfg.temperature, cfg.top_k)
                                        for p in prompts]
            for s in results["samples"][name]:
                log(f"sample ({name}): " + s.replace("\n", "\n        "))
    tag = "results" if cfg.train else "analysis"  # an analysis-only run never overwrites the training run's report
    strip = {k: v for k, v in results.items() if k != "specialization"}
    strip["specialization"] = {m: {k: v for k, v in s.items() if k != "figure"}
                               for m, s in results.get("specialization", {}).items()}
    (out_dir / f"{tag}.json").write_text(to_json(strip))
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

    cfg, args = parse_config(Config, argv, "The Dual-Stream Transformer: channelized mixing and its diagnostics "
                                           "(arXiv 2603.07461).")
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
