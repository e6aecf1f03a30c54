"""prism.py — PRISM, prototype language models with native training-data attribution, in one file.

Paper: "Prototype Language Models" (PRISM: Prototypes for Interpretable Sequence Modeling), D. Ley, G. Nguyen,
H. Lakkaraju, J. Adebayo, arXiv 2607.00510 (2026). No official code is public; spec used here:
shared/papers/prism.md, which separates what the paper states from what it reconstructs.

A GPT-2 decoder (nanoGPT: learned positions, pre-LayerNorm, GELU MLP, tied head, no biases) whose output layer
is a *prototype head*. With z_t the final hidden state after ln_f, K prototypes p_i and the tied head W:

    (1) s_{t,i} = cos(z_t, p_i);  A_t = top-k_i ReLU(s_{t,i});  a_{t,i} = ReLU(s_{t,i}) for i in A_t     (§2.1)
    (2) ẑ_t = Σ_{i∈A_t} a_{t,i} p_i,   r_t = z_t - ẑ_t                                                    (§2.1)
    (3) l_t = W r_t + Σ_{i∈A_t} a_{t,i} W p_i   (= W z_t: the slices sum exactly to the dense logit)       (§2.3)
    (4) L = CE + λ_rec |r_t|²/|z_t|² + λ_1 mean_i min_t dist(p_i, z_t) + λ_2 mean_t min_i dist(z_t, p_i)    (§3.3)

Because (3) equals W z, the prototypes change the model only through the losses and the gradient routing
(--resid-grad: full, detach-zhat (default, r = z - sg(ẑ)), detach-r). The core op is (1):
`proto_topk(z, P, k)`, a torch reference, an exact chunked torch form and a Triton kernel that keeps a running
top-k per token without ever holding the N×K score matrix; the backward runs through the k winners only. ẑ is an
embedding_bag, and a prototype's logit contribution a_{t,i} w_y·p_i is k dot products: no K×V matrix anywhere.

Analyses (the default run does all of them and writes out/prism/report.html):
  * the dense twin (--head dense, same backbone, seed and recipe), the CE gap at every evaluation;
  * per evaluation |r|/|z|, REC, R1, R2, the mean number of non-zero activations per token (<= k, §7), coverage
    R̄1(τ)/R2(τ) at τ = 0.5, 0.7, 0.9, prototypes used, dead (under DDP reduced to the global batch's values);
  * prototype cards (top training contexts by a_{t,i}, the logit signature's top tokens) and a per-token logit
    decomposition of a generated text into prototype slices plus the residual slice (§1, §5.4);
  * training-data attribution (§5.3): a cache of per-sequence prototype-space gradient summaries
    g_{m,i} = Σ_t a_{t,i} δ_t with an inverted index prototype -> sequences, block-diagonal curvature
    A_ii·S + λ (S of the true labels' δ, or of drawn targets' with --attr-s fisher); baselines: exact
    prototype-space gradients with the damped empirical Fisher of the true-label window gradients
    (--attr-exact-curvature fisher: the true Fisher, from targets sampled from the model) inverted exactly, dense
    gradient similarity, EK-FAC through kronfluence (with --ekfac, when kronfluence is installed);
  * suppression (§2.4, §6.3): drop keyword-matched prototypes' terms, keeping r from the unsuppressed ẑ;
  * a sparse linear controller over active prototypes vs the same controller over a top-k SAE on the twin (§6.3).

Choices where the paper is silent (spec §9), each a switch where results depend on it:
  * --resid-grad detach-zhat: logits stay W z, CE reaches P and the backbone gets the dense gradient plus the
    share through the cosines in a. Under full CE gives P no gradient (the prototype terms cancel); attribution
    then takes the gradient along the prototype path with r held fixed (spec §2.3 A), the same quantity the
    other two routings train P with (P reaches the logits only through ẑ in them).
  * --act relu_cos (raw ReLU-cosine weights on unnormalised prototypes); relu_cos_znorm, relu_cos_sum1.
  * k = 16, K = 8192 on the GPT-2-small default (the spec's parameter arithmetic for "130M"). Top-k before or
    after the ReLU selects the same non-zero set, so there is no switch for it.
  * --dot-precision fp32: the selection's cosines in fp32 (spec §7: bf16 ties among near-equal cosines make the
    top-k noisy; the kernel's dots run 3xTF32, near fp32). bf16 rounds the unit vectors z̄, P̄ to bf16 and keeps the
    accumulation in fp32, spec §7's sketch ("bf16 GEMM with fp32 accumulation") and its stated minimum: one
    tensor-core product instead of three and half the bytes, which the paper's 97.3% throughput may rest on (it does
    not say). a and the pairs are then the rounded vectors' cosines, gradients pass the rounding straight through,
    and near-equal cosines may swap. A switch because the throughput depends on it; `--bench` times both.
  * REC relative (--rec); R1/R2 squared L2 *per dimension* (|a-b|²/d, so λ does not scale with d; --dist cosine),
    batch-local (under DDP R1's minimum is over each rank's tokens; the gradient all-reduce then averages per-rank
    minima), gradient into both sides unless --r1-detach-z; λ_rec = 1, λ_1 = λ_2 = 0.1. --rec absolute is
    |r|²/d, the spec's |r|² per dimension, for the same reason as R1/R2. --dist defaults to l2 for every --act
    (the spec: L2 for the raw weights of relu_cos, cosine otherwise), so that --act changes one thing alone;
    type --dist cosine with relu_cos_znorm or relu_cos_sum1 for the spec's choice. The nearest pairs are read
    off the top-k selection's own cosines (fp32; 3xTF32 dots in the kernel) (proto_topk(..., pairs=dist):
    |z - p|² = |z|² + |p|² - 2|z||p|cos), not found by a second [N, K] GEMM; a different rounding of the same
    distances, so a near-tie may go the other way, ties to the lower index (nearest_pairs remains the separate
    search, for evaluation's cosine coverage and the push). Spec §9.4's all-gathered
    R1/R2 is not implemented (no switch): on one device the two are the same, and gathering every rank's
    hidden states each step would add a collective and world× the distance matrix for a DDP-only difference.
  * Initialisation: --init-steps of dense warm-up, then k-means++ (D² sampling) over one batch of hidden states,
    rows scaled by one least-squares factor so ẑ starts at z's scale; --init random starts from N(0, 1) rows, not
    the spec's "small" normal: N(0, 1) rows have the norm of post-LayerNorm states (~√d), so the prototypes start
    at the hidden states' scale.
    --revive-dead (off: not in the paper) re-seeds prototypes unused since the last evaluation.
  * --push-interval N (0: off; spec §9.5's optional push): every N steps each prototype takes the direction of its
    nearest token (cosine) in the batch and keeps its norm (a full copy would undo REC's scale: ẑ overshoots);
    Adam's moments of P restart at 0.
  * z after ln_f, W tied in both PRISM and the twin (no switch to untie, which spec §9.6 suggests: not
    implemented: every run uses the spec's default, tied as in nanoGPT/GPT-2, and an untied head would add V×d
    parameters to both models), no LM-head bias; nanoGPT's GPT-2 recipe (AdamW 0.9/0.95, weight decay 0.1
    except on P and norms, grad clip 1.0); P made last so the twin's backbone init is identical.
  * Coverage: R̄1(τ) = fraction of prototypes whose nearest val token (eval batches) has cos ≥ τ; R2(τ) =
    fraction of val tokens whose nearest prototype has cos ≥ τ.
  * Attribution (§5.3, reconstructed): the cache holds g_{m,i} = Σ_t a_{t,i} δ_t with a held fixed (the
    linear-layer view), δ_t = Wᵀ(softmax(W z_t) - e_y); the exact baseline keeps a's dependence on P and
    inverts a damped Fisher of window gradients (Woodbury); each damping is relative to the mean (non-zero)
    eigenvalue of its own curvature. The exact reference is the spec's "full prototype-space gradients" baseline
    with --attr-exact-curvature empirical (default): the damped empirical Fisher of the true-label window
    gradients, computed exactly (no sampling), so the same checkpoint always gives the same yardstick.
    --attr-exact-curvature fisher inverts the true Fisher E_{ỹ~p_model}[g̃ g̃ᵀ] instead, which for softmax CE is
    the Gauss–Newton matrix §5.3 reads the curvature as (the empirical one is a known poor stand-in for it,
    Kunstner et al. 2019), sampled as kronfluence's EK-FAC does (S = --attr-fisher-samples targets ỹ drawn from
    the model's softmax at every position of each window, seeded by --seed; the scores still take the
    true-label gradients). It was the default for a day (2026-12-03) and was measured to be no yardstick at the
    sizes this file runs: its curvature has rank M·S, far below K·d, and the same reference built from other
    draws (--seed + 1; every fisher run logs this re-draw agreement) kept only 0.44/0.62 of its own
    top-10/top-100 at S = 1 and 0.31/0.57 at S = 4 on the CPU preset's checkpoint, no more than the cached
    method shares with it (0.49/0.67, 0.45/0.63; all at --attr-damping 1e-3, the default then; at 0.1 on
    2026-12-05's checkpoint the re-draw keeps 0.56/0.71 and the cached method 0.50/0.70, still below it).
    --attr-exact-curvature ggn (2026-12-05) inverts the Gauss–Newton matrix of the linear-layer view,
    H = (1/N) Σ_t (a_t a_tᵀ) ⊗ Wᵀ(diag p_t − p_t p_tᵀ)W, summed exactly over every training token: the matrix
    the cache's A_ii·S and K-FAC's A ⊗ S approximate, with no sampling and no rank limit, so the curvature-alone
    diagnostic then measures those approximations themselves (BlockGGN: block-sparse over
    the live prototypes, solved for all queries at once by block-Jacobi conjugate gradients; its build costs
    (pairs)·V·d², CPU-preset sizes). On the CPU preset's checkpoint (2026-12-05, λ = 0.1) the block curvature
    alone keeps 0.47 of its top-10 and kfac's co-usage curvature 0.82: the co-usage the blocks drop is most of
    their loss. The overlaps measure agreement with the chosen reference. The kfac cache itself keeps less
    (0.48). Every run logs its fixed-a gradients' error e = g − g^c in the cache's curvature's eigenbasis
    (fixed_a_spectrum). On that checkpoint, over the training windows and weighted as the ranking at λ weights
    it, |e|/|g| is 0.21–0.23 in the block basis at every damping swept, but 0.51 at 1e-3 and 0.38 at 0.1 in
    kfac's. The error is largest in kfac's directions with eigenvalues 1e-3 to 1e-2 of the damping's scale,
    which the inverse weights up as λ falls: they hold 0.09 % of Σ|g|² but 1.0 % of Σ|e|² (|e|/|g| 0.66 within
    them).
    The cache's S is spec §5.3's E[δδᵀ] of the true-label δ (--attr-s empirical, the default); --attr-s fisher takes the δ̃ of targets drawn from the model
    instead, K-FAC's true-Fisher factor, with the exact fisher reference's draws (same --seed). On the CPU preset's
    checkpoint against the true-Fisher reference (2026-12-03) the two agree to a query or two: cached 0.49/0.67
    top-10/top-100 with the labels' S, 0.47/0.67 with the drawn one, the curvature alone 0.47/0.66 with either.
    Against that reference such differences are within its re-draw noise (above). The cached curvature (block and
    kfac) is cross-entropy only: §5.3's local per-prototype terms from R1 (≈2I per nearest prototype) and REC
    (a_i a_j) are left out, and the damping λ stands in for them. Dense TracIn runs twice: recomputing the
    training gradients per query batch, and from a cache of CountSketched training gradients with the prototype
    cache's bytes (spec §5.3: time at matched cache memory). A query is one val prediction; every method's time
    includes its forward. EK-FAC's time is one batched scoring pass over the Q queries divided by Q (labelled
    so, like the dense TracIn batch row); the cached and exact times are one query at a time. Overlaps are
    reported beside their chance level
    n/M (a random ranking of the M windows). Two diagnostics split the gap to exact into its two causes, each with
    the other held equal: the cached vs exact gradients with no curvature in either ranking (plain dot products)
    and with the cache's curvature in both; and the exact gradients ranked with the cache's curvature vs the
    exact ranking (the curvature alone: the cache's token statistics against the exact reference's curvature,
    whichever each is). Measured with the empirical reference (before the fisher default; --attr-damping 1e-3,
    the default then), on the CPU preset the curvature alone loses as much as the whole cached
    method (0.42/0.65 top-10/100 against its 0.43/0.65), the fixed-a gradients alone less (0.79/0.89 kept with
    the cache's curvature in both, 0.84/0.95 with none): the two losses do not compound.
  * Damping λ (--attr-damping, default 0.1 of each curvature's mean non-zero eigenvalue). The spec says "damped"
    and no more. 0.1 is the factor of kronfluence's heuristic (its damping_factor=None: 0.1 × each module's mean
    eigenvalue), which the EK-FAC baseline here takes, so every method is damped by the same factor (here of the
    mean non-zero eigenvalue: a rank-M curvature's zeros would otherwise leave it undamped); it was 1e-3 until
    2026-12-05. The overlap
    with exact depends on it more than on any other choice here: the exact reference's Fisher has rank M (256
    windows on the CPU preset) in K·d dimensions, so at small λ its inverse ranks by how a window's gradient
    sits among the other windows' (a regression on them), not by curvature, while at large λ both methods tend
    to plain gradient dot products. Every run therefore also ranks at λ = 1e-3, 1e-2, 0.1, 1, 10 (the damping
    sweep: log, results.json, report; the gradients reused, only the exact reference's N×N factor redone, N = M,
    or M·S for fisher). On the CPU preset's
    checkpoint (2026-12-05) the cached method keeps 0.41, 0.44, 0.54, 0.55, 0.59 of the exact top-10 at those
    dampings; with the cache's curvature in both rankings the gradients keep 0.79-0.82 at every one.
  * The retraining check (--attr-retrain N, off by default: it trains once per query and method). Spec §5.1
    names "retraining-based validation of the attribution claims" as the paper's open limitation; the overlaps
    above only compare estimators with each other. For N of the queries, each method's top --attr-retrain-k
    (10) windows are left out of a continued training from the trained weights on the M attribution windows
    (--attr-retrain-epochs 1 of plain SGD at --attr-retrain-lr 0.1, --attr-retrain-batch windows a step, by
    default the model's training batch, at most M; all parameters, CE, fp32, the same batches in every run, a
    window left out losing only its own gradient), and so are 10 random windows; Δ is the query's loss minus that
    after the same training with nothing left out; a divergent SGD (a non-finite loss) is an error. Windows that
    really helped the query give Δ > 0, above the random ones'. Each method is also compared with the cached one
    query by query (a paired difference: the queries' own spread cancels). Plain SGD, not AdamW: with SGD a
    left-out window removes its own gradient and nothing else, while Adam divides every step by a running
    gradient scale that the left-out window is part of.
    Retraining from scratch per query and method is out of a CPU's reach, and we would expect its run-to-run
    noise to swamp 10 windows of 256. In one small step TracIn's score is the check's own linear prediction
    (below), and there TracIn's top k is the largest predicted Δ by construction, so a short check could favour
    it; curvature-based scores (exact, EK-FAC) are meant for the response at convergence, which more
    --attr-retrain-epochs approach (an expectation). So that prediction is logged beside every Δ, lr·epochs/(B·T)
    times the left-out windows' dense TracIn scores, with its fit to the measured Δ over every (method, query)
    pair (correlation, and the least-squares slope through 0). On the CPU preset's checkpoint (2026-12-05) every
    method's top 10 raised the query's loss above random windows' on average, over 16 queries at 1 epoch and at
    4: cached +0.027 and +0.058 nats, exact +0.034 and +0.064, EK-FAC +0.045 and +0.089, dense TracIn +0.080
    and +0.127, random +0.002 and -0.001 (README: the table rows and the paired comparisons). Both runs are far
    from first order (correlation 0.50 and 0.10, measured ≈ 0.21 and 0.06 × predicted), yet the methods' means
    rank as their predictions do; at lr 0.01 the fit is 0.97, slope 0.65.
    The dense methods (TracIn, its sketch, EK-FAC's measurement) take the query's gradient of W z, the loss's
    value (query_ce): the head's logits equal W z under every routing, but not their gradient: under
    detach-zhat autograd through the head adds ẑ's routed share, and under detach-r the backbone's gradient
    comes through that share alone; a surrogate that trains P, not what a training step changes the query's
    loss by. With the loss's gradient, leaving windows out of one small SGD step moves the query's loss by
    lr/(B·T) times their TracIn scores (a test, which also shows the head's gradient off under both routings);
    before the twenty-third session (2026-12-05) the dense methods used the head's gradient. The prototype-space
    methods keep the head's gradient by design: the loss's own gradient in P is zero (§2.3). P reaches the check
    only through the continued training, by ẑ's share of the backbone's gradient (detach-zhat, detach-r); under
    full the check's losses do not depend on P at all (a test).
  * Suppression keywords default to `auto`: of the words (4+ letters) that live cards are about, the one the
    model generates most, so that the default run suppresses prototypes that fire, measured on a word whose
    rate can move (a fixed word such as "lord" matched only a dead card of the CPU preset: a no-op). The word is
    chosen on generations from other seeds than those its rate is measured on before and after: chosen on the
    "before" texts themselves, its rate there would be inflated, and any edit would seem to lower it. A live
    card (active on the card windows) matches when a keyword is one of its signature's top 3 tokens, or is the
    activating token or the next token in at least half of its top contexts; dead cards never match.
  * Controllers: a 4-way cloze from the val text (fit on the first half of the stream, scored on the second;
    distractors within ±5 frequency ranks), proximal Adam with L1, K gains for both controllers.
Commands
    python prism.py                        # dense twin + PRISM, evaluations, every analysis, out/prism/report.html
                                           # (no GPU: a CPU preset of about 7 minutes, announced)
    python prism.py --head dense           # the dense twin alone
    python prism.py --no-train --suppress-keywords love,heart --no-attribution --no-controller
                                           # suppression on the saved checkpoint (plus the cards it matches)
    python prism.py --no-train --suppress 3,17 --suppress-factor -1 --no-attribution --no-controller
                                           # push those prototypes away
    python prism.py --no-train --attr-curvature kfac --ekfac        # attribution with co-usage, EK-FAC
    python prism.py --no-train --attr-exact-curvature ggn           # against the exact Gauss–Newton matrix
    python prism.py --no-train --attr-retrain 16                    # the retraining check over 16 queries
    python prism.py --bench                # training tok/s PRISM / dense (fp32 and bf16 dots), each head alone,
                                           # R1/R2's pairs from the selection vs a separate search, top-k kernel
                                           # vs torch at K = 4k..16k (fp32 scores: kernel 3xTF32, torch IEEE;
                                           # and the kernel with bf16 dots)
    python prism.py --dot-precision bf16   # the selection's dots on bf16 operands (fp32 accumulation)
    python prism.py --push-interval 100    # also push the prototypes onto their nearest tokens every 100 steps
    python prism.py --dataset fineweb-edu --max-tokens 2000000000  # the paper's data (online)
    torchrun --standalone --nproc_per_node=8 prism.py              # DDP

Expected (CPU preset, 2 cores): `python prism.py` takes about 4 minutes on 2026-12-04's machine (3 min 56 s;
about 7 on 2026-12-03's) for the twin, PRISM and every analysis, with the same figures in every run on one machine;
at the present code PRISM's val loss ends 1.55% above the twin's (6.80 vs 6.70 nats, cl100k compacted to 19,447
ids, 410k training tokens each; +0.61% with --revive-dead), and (2026-12-05's run) a cached attribution query is
2.2 x 10^3 times faster than dense TracIn for one query alone (143x per query in a batch of 16, 21x against dense
TracIn from a gradient sketch of the cache's size); the cached ranking keeps 0.54/0.71 of the exact (empirical-Fisher)
top-10/top-100 at the default damping (0.41/0.65 at 1e-3, the default before 2026-12-05; 2026-12-05's run took
4 min 57 s, part of it beside a test job). The README's PRISM table has every figure, and the earlier code's.
"""
from __future__ import annotations

import base64
import contextlib
import copy
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
from collections import Counter
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
    from kernels import LayerNorm, cross_entropy
except ImportError:
    class LayerNorm(nn.Module):
        def __init__(self, dim, groups=1, eps=1e-5, bias=True, backend="auto"):
            super().__init__()
            self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

        def forward(self, x):
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def cross_entropy(logits, target, ignore_index=-100, reduction="mean", inplace_grad=False, backend="auto"):
        loss = F.cross_entropy(logits.float().flatten(0, -2), target.flatten(), ignore_index=ignore_index,
                               reduction=reduction)
        return loss.view(target.shape) if reduction == "none" else loss


# -----------------------------------------------------------------------------
# Config


@dataclass
class Config:
    # model: a GPT-2-style backbone and the prototype head (spec §2)
    head: Literal["prism", "dense"] = field(default="prism", metadata={"help": "prototype head, or the dense twin"})
    layers: int = field(default=12, metadata={"help": "transformer blocks"})
    d_model: int = field(default=768, metadata={"help": "model width d"})
    heads: int = field(default=12, metadata={"help": "attention heads"})
    dropout: float = field(default=0.0, metadata={"help": "dropout (embedding, attention, residual branches)"})
    n_protos: int = field(default=8192, metadata={"help": "prototypes K"})
    topk: int = field(default=16, metadata={"help": "active prototypes k per token"})
    dot_precision: Literal["fp32", "bf16"] = field(default="fp32", metadata={
        "help": "the top-k selection's cosines: fp32 (spec §7), or bf16 operands with fp32 accumulation (faster on "
                "tensor cores; near-equal cosines may swap)"})
    act: Literal["relu_cos", "relu_cos_znorm", "relu_cos_sum1"] = field(
        default="relu_cos", metadata={"help": "activation a: ReLU(cos), times |z|, or renormalised to sum 1"})
    resid_grad: Literal["full", "detach-zhat", "detach-r"] = field(
        default="detach-zhat", metadata={"help": "gradient routing of r = z - ẑ (spec §2.3)"})
    lambda_rec: float = field(default=1.0, metadata={"help": "weight of the reconstruction loss REC"})
    lambda_r1: float = field(default=0.1, metadata={"help": "weight of R1 (each prototype to its nearest token)"})
    lambda_r2: float = field(default=0.1, metadata={"help": "weight of R2 (each token to its nearest prototype)"})
    rec: Literal["relative", "absolute"] = field(default="relative", metadata={"help": "REC = |r|²/|z|² or |r|²/d"})
    dist: Literal["l2", "cosine"] = field(default="l2", metadata={"help": "R1/R2 distance: squared L2 per dim, or 1-cos"})
    r1_detach_z: bool = field(default=False, metadata={"help": "R1 moves only the prototypes (stop-grad on z)"})
    init: Literal["kmeans++", "random"] = field(default="kmeans++", metadata={"help": "prototype initialisation"})
    init_steps: int = field(default=200, metadata={"help": "dense warm-up steps before k-means++ seeding of P"})
    revive_dead: bool = field(default=False, metadata={"help": "at each evaluation, re-seed prototypes unused since the last "
                                                      "one from badly reconstructed tokens (not in the paper)"})
    push_interval: int = field(default=0, metadata={"help": "every N steps, turn each prototype onto its nearest token "
                                                    "in the batch, keeping its norm (spec §9.5; 0: off)"})
    # data (common.py)
    dataset: str = field(default="shakespeare", metadata={"help": "shakespeare | tinystories | fineweb-edu | PATH"})
    tokenizer: Literal["cl100k", "gpt2", "bytes"] = field(default="cl100k", metadata={"help": "tokenizer"})
    compact: str = field(default="train", metadata={"help": "vocabulary compaction: none | train | N"})
    max_tokens: Optional[int] = field(default=None, metadata={"help": "training-token budget of the corpus"})
    cache_dir: Optional[str] = field(default=None, metadata={"help": "token cache folder"})
    # training (nanoGPT's GPT-2 recipe)
    preset: Literal["auto", "cpu", "paper"] = field(default="auto", metadata={"help": "auto: paper on a GPU, cpu otherwise"})
    batch_size: int = field(default=32, metadata={"help": "global batch (sequences per step, all ranks)"})
    ctx: int = field(default=1024, metadata={"help": "training context length"})
    lr: float = field(default=6e-4, metadata={"help": "peak learning rate"})
    min_lr_ratio: float = field(default=0.1, metadata={"help": "cosine floor as a fraction of lr"})
    warmup_frac: float = field(default=0.02, metadata={"help": "warmup as a fraction of max_iters"})
    max_iters: int = field(default=20000, metadata={"help": "optimizer steps"})
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay on matrices"})
    grad_clip: float = field(default=1.0, metadata={"help": "max gradient norm (0: off)"})
    eval_interval: int = field(default=1000, metadata={"help": "steps between evaluations and checkpoints"})
    eval_iters: int = field(default=20, metadata={"help": "val batches per evaluation"})
    log_interval: int = field(default=50, metadata={"help": "steps between log lines"})
    seed: int = field(default=1337, metadata={"help": "random seed"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N | mps"})
    dtype: Literal["auto", "float32", "bfloat16"] = field(default="auto", metadata={"help": "auto: bf16 autocast on CUDA GPUs with native bf16 (sm_80+), else float32"})
    compile: bool = field(default=False, metadata={"help": "torch.compile the model"})
    kernels: Literal["auto", "triton", "torch"] = field(default="auto", metadata={"help": "Triton kernels on CUDA (auto)"})
    out_dir: str = field(default="out/prism", metadata={"help": "checkpoints, logs and reports"})
    resume: bool = field(default=False, metadata={"help": "continue from out_dir's checkpoint"})
    train: bool = field(default=True, metadata={"help": "train (--no-train: load out_dir's checkpoints)"})
    twin: bool = field(default=True, metadata={"help": "also train the dense twin on the same budget (gap, SAE controller)"})
    # analyses (the default run does all that apply)
    cards: bool = field(default=True, metadata={"help": "prototype cards and a logit decomposition"})
    card_windows: int = field(default=2048, metadata={"help": "training windows scanned for the cards"})
    attribution: bool = field(default=True, metadata={"help": "training-data attribution and its baselines"})
    attr_seqs: int = field(default=1024, metadata={"help": "training sequences in the attribution set"})
    attr_queries: int = field(default=32, metadata={"help": "query tokens (val predictions) to attribute"})
    attr_ctx: int = field(default=256, metadata={"help": "length of the attribution set's training windows (<= ctx)"})
    attr_damping: float = field(default=0.1, metadata={"help": "curvature damping λ, relative to the mean non-zero eigenvalue of each method's curvature (0.1: the factor of kronfluence's heuristic, which the EK-FAC baseline uses)"})
    attr_curvature: Literal["block", "kfac"] = field(default="block", metadata={"help": "cached curvature: per-prototype blocks or with co-usage"})
    attr_exact_curvature: Literal["empirical", "fisher", "ggn"] = field(default="empirical", metadata={"help": "the exact reference's curvature: empirical, the Fisher of the true-label window gradients (deterministic); fisher, the true Fisher (= Gauss-Newton for softmax CE) sampled from targets drawn from the model's softmax (a Monte-Carlo estimate: the run logs its re-draw agreement); or ggn, the Gauss-Newton matrix of the linear-layer view summed exactly over every training token (block-sparse over the live prototypes, solved by conjugate gradients; CPU-preset sizes)"})
    attr_fisher_samples: int = field(default=1, metadata={"help": "targets drawn per training window for --attr-exact-curvature fisher (S: the curvature's rank is M·S), and per token for --attr-s fisher"})
    attr_s: Literal["empirical", "fisher"] = field(default="empirical", metadata={"help": "the cache's S = E[δδᵀ]: empirical, δ of the true labels (spec §5.3's formula), or fisher, δ of targets drawn from the model's softmax (K-FAC's true-Fisher factor; the exact fisher reference's draws)"})
    ekfac: bool = field(default=False, metadata={"help": "also rank with EK-FAC through kronfluence (if installed)"})
    attr_retrain: int = field(default=0, metadata={"help": "queries to check by retraining (0: off): each method's top --attr-retrain-k windows for the query left out of a continued training on the attribution set, against as many random windows (the paper's open limitation)"})
    attr_retrain_k: int = field(default=10, metadata={"help": "windows each method leaves out per query in the retraining check"})
    attr_retrain_epochs: int = field(default=1, metadata={"help": "epochs over the attribution set in each continued training of the retraining check"})
    attr_retrain_lr: float = field(default=0.1, metadata={"help": "the retraining check's plain-SGD learning rate"})
    attr_retrain_batch: int = field(default=0, metadata={"help": "windows per step in the retraining check (0: the model's training --batch-size, the checkpoint's under --no-train)"})
    suppress_keywords: str = field(default="auto", metadata={"help": "WORD[,WORD..]: suppress prototypes whose live cards match; auto: of the words live cards are about, the one generated most (not when --suppress is typed alone); '' off"})
    suppress: str = field(default="", metadata={"help": "ID[,ID..]: suppress these prototypes"})
    suppress_factor: float = field(default=0.0, metadata={"help": "kept fraction of suppressed terms (0 drops, <0 pushes away)"})
    controller: bool = field(default=True, metadata={"help": "sparse prototype controller vs SAE controller (4-way cloze)"})
    controller_l1: float = field(default=1e-3, metadata={"help": "L1 penalty on the controller gains"})
    sample: Optional[str] = field(default=None, metadata={"help": "generate from this prompt"})
    sample_tokens: int = field(default=100, metadata={"help": "tokens per sample"})
    temperature: float = field(default=0.8, metadata={
        "help": "sampling temperature of every generated text (samples, suppression, the decomposed text; top-k 40; "
                "0: greedy)"})
    bench: bool = field(default=False, metadata={"help": "benchmarks only (training tok/s vs dense, top-k kernel)"})
    report: bool = field(default=True, metadata={"help": "write out_dir/report.html (analysis.html with --no-train)"})


# A CPU has ~1/1000 of a GPU's FLOPs: the preset shrinks the backbone, the bank and the steps so that the dense
# twin, PRISM and every analysis finish in about 7 minutes on 2026-12-03's machine (about 4 on 2026-12-02's).
CPU_PRESET = dict(layers=4, d_model=128, heads=4, n_protos=512, topk=8, ctx=128, batch_size=16, lr=2e-3,
                  max_iters=200, init_steps=20, eval_interval=50, eval_iters=5, log_interval=20,
                  card_windows=512, attr_seqs=256, attr_queries=16, attr_ctx=128)
# A checkpoint fixes ARCH_KEYS (asking for other values is an error); --resume and --no-train take every other
# setting from it too unless typed (MERGED_KEYS: all but how and where this invocation runs).
ARCH_KEYS = ("head", "layers", "d_model", "heads", "n_protos", "topk", "act", "resid_grad", "ctx", "dataset",
             "tokenizer", "compact", "max_tokens")
ANALYSIS_KEYS = ("cards", "card_windows", "attribution", "attr_seqs", "attr_queries", "attr_ctx", "attr_damping",
                 "attr_curvature", "attr_exact_curvature", "attr_s", "attr_fisher_samples", "ekfac", "attr_retrain",
                 "attr_retrain_k", "attr_retrain_epochs", "attr_retrain_lr", "attr_retrain_batch",
                 "suppress_keywords", "suppress", "suppress_factor", "controller", "controller_l1", "sample",
                 "sample_tokens", "temperature")
RUNTIME_KEYS = ("head", "preset", "device", "dtype", "compile", "kernels", "out_dir", "cache_dir", "resume", "train",
                "twin", "bench", "report") + ANALYSIS_KEYS
MERGED_KEYS = tuple(f.name for f in fields(Config) if f.name not in RUNTIME_KEYS)
# The recipe a dense twin must share with PRISM for the CE gap at equal steps to mean anything.
TWIN_KEYS = ("layers", "d_model", "heads", "dropout", "dataset", "tokenizer", "compact", "max_tokens", "batch_size", "ctx",
             "lr", "min_lr_ratio", "warmup_frac", "max_iters", "weight_decay", "grad_clip", "eval_interval", "seed")
# The same for the final val loss gap, with the steps trained (the evaluation points do not matter there).
GAP_KEYS = tuple(k for k in TWIN_KEYS if k != "eval_interval") + ("step",)
# -----------------------------------------------------------------------------
# Core op: proto_topk(z, P, k) -> (idx, a),   a_{n,j} = relu(cos(z_n, P_{idx_{n,j}})) for the k best prototypes

# Every final hidden state z_n is explained by its k most similar prototypes. With z̄ = z/max(|z|, eps),
# P̄ = P/max(|P|, eps) (F.normalize, eps = 1e-12) and all scores in fp32 (the spec; z may be bf16 under autocast):
#
#     s_{n,i} = relu(z̄_n · P̄_i)                                       [N, K], never stored by the fast forms
#     idx_n   = the k prototypes with the largest s_{n,i}, ordered by (score descending, index ascending)
#     a_{n,j} = s_{n, idx_{n,j}}                                      [N, k], differentiable in z and P
#
# Ties are broken by the lower prototype index, deterministically. They are common: the ReLU leaves many exact zeros
# (a token with fewer than k positive cosines fills its remaining slots with the lowest-index zero-score
# prototypes), and duplicated prototypes or prototypes equal up to a positive scale have identical cosines.
# Top-k before or after the ReLU selects the same set of non-zero activations (the ReLU is monotone and keeps
# every positive score); only which zero-activation slots are listed differs, and those contribute nothing to
# a, to its gradient, or to the reconstruction. So there is no switch: the ReLU comes first.
#
# Shapes: z [N, d], P [K, d], 1 <= k <= K. idx [N, k] int64 (not differentiable); a [N, k] fp32.
#
# The op in three forms:
#   1. proto_topk_ref            normalise, one [N, K] GEMM, ReLU, stable sort, first k: the readable truth
#   2. _proto_topk_select_torch  row chunks of z, an exact two-key top-k per chunk (the CPU path)
#   3. _proto_topk_fwd           Triton: tiles over prototypes, a running top-k per token in registers
# Forms 2 and 3 only select (no autograd); WinnerCosine then attaches the gradient of the k winners:
#
#     ∂z̄_n = Σ_j g_{n,j} P̄_{idx_{n,j}}         g_{n,j} = ∂L/∂a_{n,j} · [z̄_n · P̄_{idx_{n,j}} > 0]  (ReLU)
#     ∂P̄_i = Σ_{(n,j): idx_{n,j} = i} g_{n,j} z̄_n
#
# O((N + K)·d) memory: an embedding_bag for ∂z̄; for ∂P̄ k index_add_ calls of [N, d] rows on CUDA, elsewhere one
# embedding_bag with a bag per prototype (_scatter_rows). The selection holds at most a [chunk, K] block of
# scores (torch, <= _TOPK_CHUNK_ELEMS) or a [BLOCK_N, BLOCK_K] tile (Triton), and autograd saves nothing of size
# N×K or N×k×d. The normalisations stay outside, in plain autograd, so the gradients reaching z and P are exact.
#
# Dispatch (`backend` in PROTO_TOPK_BACKENDS): "auto" = Triton when the tensors are on CUDA and triton imports,
# else the chunked torch form; "triton" = the kernel (on CPU only under TRITON_INTERPRET=1); "torch" = chunked.
#
# Precision (`precision`, --dot-precision): "fp32" computes every score above in fp32 (spec §7: bf16 ties among
# thousands of near-equal cosines make the top-k noisy; the kernel's tl.dot runs 3xTF32, PROTO_TOPK_DOT_PRECISION).
# "bf16" rounds z̄ and P̄ to bf16 and accumulates their products in fp32 (spec §7's sketch: "bf16 GEMM with fp32
# accumulation", its fallback "at least keep the GEMM accumulators in fp32"): one tensor-core product instead of
# three, half the bytes loaded. The scores, a and the pairs are then the exact cosines of the rounded vectors up to
# fp32 summation (bf16 x bf16 products are exact in fp32), so the torch forms compute them from the rounded values in
# fp32 and agree with the kernel as the fp32 forms do; near-equal cosines (closer than bf16's 2^-8 relative rounding
# of the vectors moves them) may swap against "fp32". The backward is WinnerCosine's fp32 formula either way.
#
# R1/R2's nearest pairs ride along (pairs="l2" or "cosine", what training asks for): the same cosines, before the
# ReLU, give each token's nearest prototype and each prototype's nearest token, with |z - p|² = |z|² + |p|² -
# 2|z||p|cos for squared L2 (_pair_scores). A separate nearest_pairs would run a second [N, K] GEMM in IEEE fp32
# every step; here the kernel keeps a running best per token and writes each token block's best per prototype
# ([cdiv(N, BLOCK_N), K], reduced after the launch). Ties go to the lower index, as in nearest_pairs.

PROTO_TOPK_BACKENDS = ("auto", "triton", "torch")
PROTO_TOPK_MAX_K = 32  # the longest running list the kernel keeps in registers (compiled for sm_90 in the tests);
                       # "auto" takes the torch form above it, "triton" refuses
# tl.dot's precision in the kernel: 3xTF32 (each fp32 operand split into a TF32 head and tail, three tensor-core
# products) comes close to fp32 accuracy (the CUDA test's near-tie tolerance, 1e-6 on a cosine, holds). On an H200
# (2026-12-04, `--bench`) the top-k's fwd+bwd at N = K = 16384, d = 768, k = 16 took 11.2 ms, against 36.4 with
# "ieee" (FMA units). Plain TF32 would reorder near-equal cosines. "ieee" stays a choice.
PROTO_TOPK_DOT_PRECISION = "tf32x3"
PROTO_TOPK_PRECISIONS = ("fp32", "bf16")  # the scores' operands (section header); accumulation is fp32 in both
_PAIRS_CODE = {"l2": 1, "cosine": 2}  # the kernel's PAIRS switch
_TOPK_CHUNK_ELEMS = 1 << 22  # score entries per row chunk of the torch form (16 MiB of fp32 scores)


@contextlib.contextmanager
def full_fp32():
    """IEEE fp32 matmuls inside: setup_device turns TF32 on for the backbone's GEMMs on CUDA (a no-op elsewhere),
    and this turns it off again where fp32 is claimed. (a) The scoring GEMMs of the core op's torch forms and of
    nearest_pairs: spec §7 asks for fp32 cosines and selection, TF32's 10-bit mantissa would reorder near-equal
    cosines, and the Triton kernel's tl.dot is near-fp32 (3xTF32), so the forms agree only if the torch ones are
    too. (b) The kernel benchmark's torch reference, so that it compares like precision. (c) Attribution: the exact
    baseline's Cholesky of M λ' I + G Gᵀ needs more than TF32 when λ' is 1e-3 of the mean eigenvalue (the damping
    sweep's smallest), and every method runs in the same precision, so the timings stay comparable. The flags are
    process-global: the model's callers (nearest_pairs, the torch selection) are @torch.compiler.disable'd, so
    no compiled graph toggles them."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# ----------------------------------------------------------------------------------------------------------
# 1. The reference (materialises the [N, K] scores; the ground truth for the other forms)

def _rounded(t, precision):
    """The score operands of `precision` (section header): t itself for "fp32", else t rounded to bf16 (through
    fp32, as the op rounds) and held in t's dtype, so that the products are exact and only the accumulation rounds."""
    if precision not in PROTO_TOPK_PRECISIONS:
        raise ValueError(f"precision must be one of {PROTO_TOPK_PRECISIONS}, got {precision!r}")
    return t if precision == "fp32" else t.float().to(torch.bfloat16).to(t.dtype)


def proto_topk_ref(z, P, k, precision="fp32"):
    """normalise, GEMM, ReLU, stable sort, first k. Scores in fp32, or fp64 when z or P is fp64 (tests build a
    float64 truth), of the normalised vectors rounded to bf16 first under precision="bf16". A stable descending
    sort keeps equal scores in index order: lower index first on ties.
    Returns (idx [N, k] int64, a [N, k]); a is differentiable in z and P through plain autograd (under "bf16" the
    rounding passes the gradient straight through, as WinnerCosine does)."""
    dt = torch.float64 if torch.float64 in (z.dtype, P.dtype) else torch.float32

    def operand(t):  # the rounding's gradient is the identity (straight through)
        t = F.normalize(t.to(dt), dim=-1)
        return t + (_rounded(t.detach(), precision) - t.detach())
    # the spec's fp32 scores (§7), even inside an autocast region and with TF32 on (full_fp32)
    with torch.autocast(z.device.type, enabled=False), full_fp32():
        scores = (operand(z) @ operand(P).T).relu()  # [N, K]
    idx = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
    return idx, scores.gather(1, idx)


# ----------------------------------------------------------------------------------------------------------
# 2. The chunked torch selection (no autograd: it runs on detached z̄, P̄)

class _NearestPairs:
    """R1/R2's nearest pairs gathered over row chunks of scores to maximise (g2 over the prototypes, g1 over the
    tokens; _pair_scores): each token's best prototype (argmax: the lowest index on ties), and each prototype's
    best token so far, an earlier chunk (the lower token index) keeping it on equal scores. The torch selection
    and nearest_pairs both fold their chunks here."""

    def __init__(self, N: int, K: int, device):
        self.proto_of_token = torch.empty(N, dtype=torch.long, device=device)
        self.best = torch.full((K,), float("-inf"), device=device)
        self.token_of_proto = torch.zeros(K, dtype=torch.long, device=device)

    def add(self, r0: int, g2, g1) -> None:
        self.proto_of_token[r0:r0 + g2.shape[0]] = g2.argmax(1)
        col, arg = g1.max(0)
        better = col > self.best  # strict: on equal scores the earlier chunk keeps it
        self.best = torch.where(better, col, self.best)
        self.token_of_proto = torch.where(better, arg + r0, self.token_of_proto)

    def result(self):
        """-> (proto_of_token [N], token_of_proto [K])"""
        return self.proto_of_token, self.token_of_proto


# Selection only (no autograd), with a data-dependent nonzero and a Python loop over chunks: kept out of
# torch.compile graphs too, so dynamo neither unrolls the loop nor breaks the graph inside it.
@torch.compiler.disable
def _proto_topk_select_torch(zn, Pn, k, pairs=None, zr=None, pr=None):
    """Exact top-k under (score desc, index asc), a row chunk of z at a time: at most _TOPK_CHUNK_ELEMS scores.

    torch.topk's order among equal scores is unspecified, so it only supplies the k-th largest score t_n (an
    element of s, exact). Then the winners are every score > t_n plus, of the scores == t_n, the lowest-index
    ones until there are k; a stable sort of those k by score (they are gathered in index order) gives the
    output order. With `pairs` ("l2" or "cosine"; zr, pr the rows' norms for "l2") the same cosines also give
    R1/R2's nearest pairs (_pair_scores) -> (idx, act, (proto_of_token, token_of_proto)); else (idx, act, None)."""
    N, K = zn.shape[0], Pn.shape[0]
    idx = torch.empty(N, k, dtype=torch.long, device=zn.device)
    act = torch.empty(N, k, dtype=zn.dtype, device=zn.device)
    near = None if pairs is None else _NearestPairs(N, K, zn.device)
    rows = max(1, _TOPK_CHUNK_ELEMS // K)
    for r0 in range(0, N, rows):
        with full_fp32():  # fp32 like the Triton kernel's 3xTF32 tl.dot: TF32 would reorder near-equal cosines (§7)
            s = zn[r0:r0 + rows] @ Pn.T  # [C, K]
        if near is not None:  # before the ReLU: a nearest pair may have a negative cosine
            near.add(r0, *_pair_scores(s, pairs, None if zr is None else zr[r0:r0 + rows], pr))
        s = s.relu_()
        C = s.shape[0]
        kth = s.topk(k, dim=1, sorted=False).values.amin(1, keepdim=True)  # [C, 1]: t_n
        above = s > kth
        at = s == kth
        need = k - above.sum(1, keepdim=True)  # >= 1: fewer than k scores lie strictly above the k-th largest
        take = above | (at & (at.cumsum(1) <= need))  # exactly k per row
        chosen = take.nonzero()[:, 1].view(C, k)  # row-major: ascending prototype index within each row
        vals = s.gather(1, chosen)
        order = torch.sort(vals, dim=1, descending=True, stable=True).indices  # stable: index order kept on ties
        idx[r0:r0 + rows] = chosen.gather(1, order)
        act[r0:r0 + rows] = vals.gather(1, order)
    return idx, act, None if near is None else near.result()


def _pair_scores(s, pairs, zr, pr):
    """R1/R2's nearest pairs from the cosines s = z̄·P̄ᵀ [C, K] (spec §3.3, nearest_pairs' definition): g2 to
    maximise over prototypes (R2: each token's nearest prototype), g1 over tokens (R1: each prototype's nearest
    token). Squared L2, |z - p|² = |z|² + |p|² - 2|z||p|cos: the term constant along the maximised axis is dropped
    (g2 = 2|z||p|cos - |p|², g1 = 2|z||p|cos - |z|²); cosine distance: both are s."""
    if pairs == "cosine":
        return s, s
    zp = torch.outer(2 * zr, pr).mul_(s)
    return zp - (pr * pr)[None, :], zp.sub_((zr * zr)[:, None])  # g2 first: g1 reuses zp's buffer


# ----------------------------------------------------------------------------------------------------------
# 3. The Triton forward kernel
#
# One program owns BLOCK_N tokens and walks over the prototypes in tiles of BLOCK_K, keeping a running top-k per
# token in registers: KP = max(2, next power of two >= k) slots of (score, index). Slots j < k start as
# placeholders (-inf, K + j) that any real prototype beats (scores are >= 0 after the ReLU) and that are unique,
# so "the worst slot" is always one slot; slots j >= k are padding, (+inf, -1), never the worst and never output.
#
# Order: (s, i) beats (s', i') iff s > s' or (s == s' and i < i'). Per tile:
#   scores   S = relu(z̄_blk · P̄_tileᵀ) [BLOCK_N, BLOCK_K] by tl.dot (fp32, 3xTF32: PROTO_TOPK_DOT_PRECISION; or
#            bf16 operands into the fp32 accumulator: _proto_topk_dot_t),
#            over d chunks when d is large;
#            padded d columns load as 0 and add nothing, padded prototypes (i >= K) are masked out of `alive`
#            (their score would be 0 with an index above every real one, so they could never win anyway);
#   merge    alive = the tile's candidates that beat the row's current worst slot. While any row has one:
#            take each row's best alive candidate, put it in place of that row's worst slot, recompute the worst,
#            and drop from `alive` the candidate and everything that no longer beats the new worst.
# Each pass fills one slot per row, and after k passes a row's list holds the tile's k best, so nothing alive
# remains: at most k passes per tile, and in practice far fewer: once the lists are good a tile rarely holds more
# than one or two entrants for any row of the block (for random scores a row sees about k·(1 + ln(K/k)) entrants in
# all), so the merge costs a few reductions per tile next to a BLOCK_N·BLOCK_K·d GEMM.
# At the end the k slots are written out best-first (k selection passes over KP registers). Stores: idx [N, k]
# int64 and the winners' fp32 scores [N, k]; the [N, K] score matrix never leaves a tile.


@triton.jit
def _topk_beats(s, i, s_ref, i_ref):
    """(s, i) beats (s_ref, i_ref) under (score descending, index ascending)."""
    return (s > s_ref) | ((s == s_ref) & (i < i_ref))


@triton.jit
def _topk_worst(run_s, run_i):
    """The worst slot per row: lowest score, highest index among equal scores (indices in a row are unique)."""
    worst_s = tl.min(run_s, axis=1)
    worst_i = tl.max(tl.where(run_s == worst_s[:, None], run_i, -1), axis=1)
    return worst_s, worst_i


@triton.jit
def _proto_topk_fwd(
    Z,  # pointer to the normalised tokens z̄ [N, D] (fp32, or bf16 for precision="bf16"; P the same)
    P,  # pointer to the normalised prototypes P̄ [K, D]
    Idx,  # pointer to the winners' indices [N, KTOP] (int64)
    A,  # pointer to the winners' scores a [N, KTOP] (fp32)
    N,  # tokens
    K,  # prototypes
    D,  # width
    KTOP,  # k
    BLOCK_N: tl.constexpr,  # tokens per program
    BLOCK_K: tl.constexpr,  # prototypes per tile
    BLOCK_D: tl.constexpr,  # width per chunk (the whole padded row when ONE_D)
    KP: tl.constexpr,  # slots of the running list: a power of two >= k
    ONE_D: tl.constexpr,  # BLOCK_D >= D: load the token rows once, one tl.dot per tile
    DOT_PREC: tl.constexpr,  # tl.dot's input_precision for fp32 operands: PROTO_TOPK_DOT_PRECISION
    DOT_T: tl.constexpr,  # tl.dot's operand type: bf16 for bf16 inputs on CUDA, else fp32 (_proto_topk_dot_t)
    Zr=None,  # PAIRS == 1: pointer to the tokens' norms |z| [N] (fp32)
    Pr=None,  # PAIRS == 1: pointer to the prototypes' norms |p| [K] (fp32)
    R2Idx=None,  # PAIRS: pointer to each token's nearest prototype [N] (int64)
    R1Val=None,  # PAIRS: pointer to each prototype's best score within each token block [cdiv(N, BLOCK_N), K] (fp32)
    R1Idx=None,  # PAIRS: pointer to the token holding it [cdiv(N, BLOCK_N), K] (int32)
    PAIRS: tl.constexpr = 0,  # R1/R2's nearest pairs from the same cosines: 0 none, 1 squared L2, 2 cosine
):
    BIG: tl.constexpr = 2147483647  # an index above every real and placeholder index
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    if PAIRS != 0:  # each token's nearest prototype so far: (score, index); index 0 until a finite score beats -inf
        r2_s = tl.full([BLOCK_N], float("-inf"), tl.float32)
        r2_i = tl.zeros([BLOCK_N], dtype=tl.int32)
        if PAIRS == 1:
            zr = tl.load(Zr + rows, mask=row_ok, other=0.0)
    cols = tl.arange(0, BLOCK_D)
    z_ptrs = Z + rows.to(tl.int64)[:, None] * D + cols[None, :]
    if ONE_D:
        z = tl.load(z_ptrs, mask=row_ok[:, None] & (cols < D)[None, :], other=0.0).to(DOT_T)
    slot = tl.arange(0, KP)
    real = slot < KTOP
    run_s = tl.broadcast_to(tl.where(real, float("-inf"), float("inf"))[None, :], (BLOCK_N, KP))
    run_i = tl.broadcast_to(tl.where(real, K + slot, -1)[None, :], (BLOCK_N, KP))
    worst_s, worst_i = _topk_worst(run_s, run_i)
    for k0 in range(0, K, BLOCK_K):
        protos = k0 + tl.arange(0, BLOCK_K)
        proto_ok = protos < K
        p_ptrs = P + protos.to(tl.int64)[:, None] * D + cols[None, :]
        if ONE_D:
            p = tl.load(p_ptrs, mask=proto_ok[:, None] & (cols < D)[None, :], other=0.0).to(DOT_T)
            s = tl.dot(z, tl.trans(p), input_precision=DOT_PREC)  # [BLOCK_N, BLOCK_K]
        else:
            s = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                col_ok = (d0 + cols) < D
                zc = tl.load(z_ptrs + d0, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(DOT_T)
                pc = tl.load(p_ptrs + d0, mask=proto_ok[:, None] & col_ok[None, :], other=0.0).to(DOT_T)
                s += tl.dot(zc, tl.trans(pc), input_precision=DOT_PREC)
        ids = protos[None, :]  # [1, BLOCK_K]
        if PAIRS != 0:  # _pair_scores on this tile, before the ReLU; NaN and padding score -inf
            if PAIRS == 1:
                pr = tl.load(Pr + protos, mask=proto_ok, other=0.0)
                zp = s * (2 * zr)[:, None] * pr[None, :]
                g2 = zp - (pr * pr)[None, :]
                g1 = zp - (zr * zr)[:, None]
            else:
                g2 = s
                g1 = s
            g2 = tl.where(proto_ok[None, :] & (g2 == g2), g2, float("-inf"))
            g1 = tl.where(row_ok[:, None] & (g1 == g1), g1, float("-inf"))
            t2 = tl.max(g2, axis=1)  # R2: the tile's best prototype per token, the lowest index on ties ...
            t2_i = tl.min(tl.where(g2 == t2[:, None], ids, BIG), axis=1)
            better = t2 > r2_s  # ... and an earlier tile's keeps it on equal scores
            r2_s = tl.where(better, t2, r2_s)
            r2_i = tl.where(better, t2_i, r2_i)
            t1 = tl.max(g1, axis=0)  # R1: this block's best token per prototype, the lowest row on ties
            t1_i = tl.min(tl.where(g1 == t1[None, :], rows[:, None], BIG), axis=0)
            tl.store(R1Val + pid.to(tl.int64) * K + protos, t1, mask=proto_ok)
            tl.store(R1Idx + pid.to(tl.int64) * K + protos, t1_i, mask=proto_ok)
        s = tl.maximum(s, 0.0)  # the ReLU
        alive = proto_ok[None, :] & _topk_beats(s, ids, worst_s[:, None], worst_i[:, None])
        while tl.max(tl.sum(alive.to(tl.int32), axis=1), axis=0) > 0:
            cand = tl.where(alive, s, float("-inf"))
            best_s = tl.max(cand, axis=1)
            best_i = tl.min(tl.where(alive & (cand == best_s[:, None]), ids, BIG), axis=1)
            put = (best_i < BIG)[:, None] & (run_i == worst_i[:, None])  # rows with a candidate: its worst slot
            run_s = tl.where(put, best_s[:, None], run_s)
            run_i = tl.where(put, best_i[:, None], run_i)
            worst_s, worst_i = _topk_worst(run_s, run_i)
            alive = alive & (ids != best_i[:, None]) & _topk_beats(s, ids, worst_s[:, None], worst_i[:, None])
    # Write the k real slots best-first
    left = tl.broadcast_to(real[None, :], (BLOCK_N, KP))
    out = rows.to(tl.int64) * KTOP
    for j in range(KTOP):
        cand = tl.where(left, run_s, float("-inf"))
        best_s = tl.max(cand, axis=1)
        best_i = tl.min(tl.where(left & (cand == best_s[:, None]), run_i, BIG), axis=1)
        tl.store(Idx + out + j, best_i.to(tl.int64), mask=row_ok)
        tl.store(A + out + j, best_s, mask=row_ok)
        left = left & (run_i != best_i[:, None])
    if PAIRS != 0:
        tl.store(R2Idx + rows, r2_i.to(tl.int64), mask=row_ok)


def _proto_topk_empty(shape, dtype, device):
    """Kernel output buffers: torch.empty, or NaN-filled under GLASSBOX_POISON=1 (tests) so an unwritten row shows
    (integer buffers get -1, which no index takes)."""
    if os.environ.get("GLASSBOX_POISON") == "1":
        fill = float("nan") if dtype.is_floating_point else -1
        return torch.full(shape, fill, dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _proto_topk_blocks(d, k):
    """KP (slots), BLOCK_D, ONE_D. Rows up to 64 wide are loaded once per program; wider ones are streamed in
    chunks of 64 columns per prototype tile (whole fp32 rows of a [64, 128+] token block plus the prototype tile
    would not fit in registers). tl.dot needs every dimension >= 16."""
    KP = max(2, 1 << (k - 1).bit_length())
    DP = max(16, 1 << (d - 1).bit_length())
    BLOCK_D = min(DP, 64)
    return KP, BLOCK_D, BLOCK_D >= d


def _proto_topk_dot_t(zn, cuda=None):
    """tl.dot's operand type: bf16 inputs go to the tensor cores as bf16 on CUDA; Triton's interpreter has no bf16
    arithmetic (numpy stores it as uint16: a bf16 tl.dot multiplies the bit patterns), so there, and for fp32
    inputs, the operands are fp32, which holds bf16 values exactly: the same products, accumulated in fp32 either
    way. `cuda` overrides zn.is_cuda (tests/test_sm90_compile.py records the CUDA choice on the CPU)."""
    native = (zn.is_cuda if cuda is None else cuda) and zn.dtype == torch.bfloat16
    return tl.bfloat16 if native else tl.float32


# Triton launches stay out of torch.compile graphs: torch.compiler.disable makes dynamo graph-break here.
@torch.compiler.disable
def _proto_topk_select_triton(zn, Pn, k, pairs=None, zr=None, pr=None, BLOCK_N=64, BLOCK_K=64, BLOCK_D=None):
    """Launch _proto_topk_fwd on z̄ [N, d], P̄ [K, d], both fp32 or both bf16 (bf16 dots, fp32 accumulation; other
    dtypes are cast to fp32): (idx [N, k] int64, a [N, k] fp32, pairs or None), as
    _proto_topk_select_torch. R1's per-block bests [cdiv(N, BLOCK_N), K] are reduced here, the first block on
    equal scores. BLOCK_D forces the width chunking (tests); the default is _proto_topk_blocks'."""
    N, d = zn.shape
    K = Pn.shape[0]
    KP, block_d, one_d = _proto_topk_blocks(d, k)
    if BLOCK_D is not None:
        block_d, one_d = BLOCK_D, BLOCK_D >= d
    if not zn.dtype == Pn.dtype == torch.bfloat16:  # bf16 operands stay bf16 (precision="bf16")
        zn, Pn = zn.float(), Pn.float()
    zn, Pn = zn.contiguous(), Pn.contiguous()
    idx = _proto_topk_empty((N, k), torch.long, zn.device)
    act = _proto_topk_empty((N, k), torch.float32, zn.device)
    grid = (triton.cdiv(N, BLOCK_N),)
    extra = {}
    if pairs is not None:
        extra = dict(R2Idx=_proto_topk_empty((N,), torch.long, zn.device),
                     R1Val=_proto_topk_empty((grid[0], K), torch.float32, zn.device),
                     R1Idx=_proto_topk_empty((grid[0], K), torch.int32, zn.device), PAIRS=_PAIRS_CODE[pairs])
        if pairs == "l2":
            extra.update(Zr=zr.float().contiguous(), Pr=pr.float().contiguous())
    _proto_topk_fwd[grid](
        zn, Pn, idx, act, N, K, d, k,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, BLOCK_D=block_d, KP=KP, ONE_D=one_d, DOT_PREC=PROTO_TOPK_DOT_PRECISION,
        DOT_T=_proto_topk_dot_t(zn), num_warps=4, **extra)
    if pairs is None:
        return idx, act, None
    block = extra["R1Val"].argmax(0, keepdim=True)  # the first maximal block (torch.argmax's documented tie rule)
    return idx, act, (extra["R2Idx"], extra["R1Idx"].gather(0, block)[0].long())


# ----------------------------------------------------------------------------------------------------------
# The backward through the k winners only

def _gathered_rows_sum(idx, Y, w):
    """out_n = Σ_j w_{n,j} Y_{idx_{n,j}}  [N, d]: an embedding_bag, no [N, k, d] gather."""
    return F.embedding_bag(idx, Y, per_sample_weights=w.to(Y.dtype), mode="sum")


def _scatter_rows(idx, w, X, rows):
    """out_i = Σ_{(n,j): idx_{n,j} = i} w_{n,j} X_n  [rows, d], with no [N, k, d] tensor (and no sparse-matrix
    coalesce, which would sync the host on CUDA). On CUDA k index_add_ calls of [N, d] rows: atomics spread the
    work over the N tokens whatever the prototype usage. Elsewhere one embedding_bag with a bag per output row
    (_scatter_rows_bags): deterministic, and faster on the CPU. Not on CUDA, whose embedding_bag sums each bag
    with one thread per feature: when the usage collapses onto a few prototypes, as it does in PRISM's early
    steps, a handful of bags of ~N·k/live rows would each be walked serially."""
    return (_scatter_rows_atomic if X.is_cuda else _scatter_rows_bags)(idx, w, X, rows)


def _scatter_rows_atomic(idx, w, X, rows):
    """_scatter_rows as k index_add_ calls, one [N, d] product per slot j."""
    out = torch.zeros(rows, X.shape[1], dtype=X.dtype, device=X.device)
    for j in range(idx.shape[1]):
        out.index_add_(0, idx[:, j], w[:, j, None].to(X.dtype) * X)
    return out


def _scatter_rows_bags(idx, w, X, rows):
    """_scatter_rows as one embedding_bag: the (n, j) pairs sorted by i (stable, so each row's terms add in token
    order), bag i starting where searchsorted puts i (no bincount: no host sync), empty bags summing to 0."""
    flat = idx.flatten()
    order = torch.argsort(flat, stable=True)
    offsets = torch.searchsorted(flat[order], torch.arange(rows, device=idx.device))  # bag i starts here
    tokens = torch.div(order, idx.shape[1], rounding_mode="floor")
    return F.embedding_bag(tokens, X, offsets, mode="sum", per_sample_weights=w.flatten()[order].to(X.dtype))


class WinnerCosine(torch.autograd.Function):
    """a = relu(z̄_n · P̄_{idx_{n,j}}) for the k winners, with the selection's scores passed in (no recomputation).
    zs, Ps are the operands the scores were computed from (z̄, P̄ themselves, or rounded to bf16: the rounding
    passes the gradient straight through). Saves zs [N, d], Ps [K, d], idx and a [N, k]; the backward is the
    formula in the section header, with zs and Ps in place of z̄ and P̄."""

    @staticmethod
    def forward(ctx, zn, Pn, idx, act, zs, Ps):
        ctx.save_for_backward(zs, Ps, idx, act)
        return act.clone()  # a new tensor: returning an input would re-parent the caller's buffer

    @staticmethod
    def backward(ctx, grad_a):
        zn, Pn, idx, act = ctx.saved_tensors
        g = torch.where(act > 0, grad_a, 0.0)  # the ReLU: no gradient where cos <= 0
        grad_zn = _gathered_rows_sum(idx, Pn, g) if ctx.needs_input_grad[0] else None
        grad_Pn = _scatter_rows(idx, g, zn, Pn.shape[0]) if ctx.needs_input_grad[1] else None
        return grad_zn, grad_Pn, None, None, None, None


def proto_topk(z, P, k, backend="auto", pairs=None, precision="fp32"):
    """The k most similar prototypes per token (section header): z [N, d], P [K, d], 1 <= k <= K.
    Returns idx [N, k] int64, sorted by (score desc, index asc), and a [N, k] fp32 = relu(cos), differentiable
    in z and P with every backend. Scores are fp32 whatever the inputs' dtype (bf16 z is cast).
    pairs="l2" or "cosine" also returns, as a third item, what nearest_pairs(z, P, pairs) returns (R1/R2's
    nearest neighbours), read off the same cosines, so training runs one N×K GEMM, not two (the two agree up
    to fp32 rounding: near-equal distances may pick the other neighbour).
    precision="bf16" computes the scores from z̄ and P̄ rounded to bf16, with fp32 accumulation (section header)."""
    if backend not in PROTO_TOPK_BACKENDS:
        raise ValueError(f"backend must be one of {PROTO_TOPK_BACKENDS}, got {backend!r}")
    if precision not in PROTO_TOPK_PRECISIONS:
        raise ValueError(f"precision must be one of {PROTO_TOPK_PRECISIONS}, got {precision!r}")
    if pairs is not None:
        _check_dist(pairs)
        if z.shape[0] == 0:
            raise ValueError("proto_topk: no tokens, so no prototype has a nearest one (pairs)")
    if z.dim() != 2 or P.dim() != 2 or z.shape[1] != P.shape[1]:
        raise ValueError(f"proto_topk: expected z [N, d], P [K, d]; got z {tuple(z.shape)}, P {tuple(P.shape)}")
    if not 1 <= k <= P.shape[0]:
        raise ValueError(f"proto_topk: need 1 <= k <= K = {P.shape[0]}, got k = {k}")
    if backend == "triton" and k > PROTO_TOPK_MAX_K:
        raise ValueError(f"backend='triton' takes k <= {PROTO_TOPK_MAX_K}, got k = {k} (backend='auto' uses torch)")
    use_triton = backend == "triton" or (backend == "auto" and HAS_TRITON and z.is_cuda and k <= PROTO_TOPK_MAX_K)
    if use_triton and not HAS_TRITON:
        raise RuntimeError(f"backend='triton' needs the triton package, which failed to import: {TRITON_ERROR}")
    if use_triton and not (z.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        raise RuntimeError("backend='triton' needs CUDA tensors or TRITON_INTERPRET=1 (Triton's CPU interpreter)")
    with torch.autocast(z.device.type, enabled=False):
        zn = F.normalize(z.float(), dim=-1)  # plain autograd: exact gradients into z and P
        Pn = F.normalize(P.float(), dim=-1)
        zs, Ps = _rounded(zn.detach(), precision), _rounded(Pn.detach(), precision)  # the scores' operands
        with torch.no_grad():
            select = _proto_topk_select_triton if use_triton else _proto_topk_select_torch
            # non-finite rows (a diverged run) select like zero vectors, so the loss, not the index maths, reports them
            def clean(t):
                return t.nan_to_num(0.0, 0.0, 0.0)
            norms = ({"zr": clean(z.detach().float().norm(dim=-1)), "pr": clean(P.detach().float().norm(dim=-1))}
                     if pairs == "l2" else {})
            zc, Pc = clean(zs), clean(Ps)
            if use_triton and precision == "bf16":  # the kernel loads bf16 and runs bf16 tl.dots (exact casts)
                zc, Pc = zc.to(torch.bfloat16), Pc.to(torch.bfloat16)
            idx, act, near = select(zc, Pc, k, pairs=pairs, **norms)
        a = WinnerCosine.apply(zn, Pn, idx, act, zs, Ps)
        return (idx, a) if pairs is None else (idx, a, near)


# ----------------------------------------------------------------------------------------------------------
# Uses of the winners: the reconstruction and the per-prototype logit contributions

def reconstruct(idx, a, P):
    """The reconstruction ẑ_n = Σ_j a_{n,j} P_{idx_{n,j}}  [N, d] (an embedding_bag: no [N, k, d] gather), in the
    promoted dtype of a and P; differentiable in a and P."""
    dt = torch.promote_types(a.dtype, P.dtype)
    return F.embedding_bag(idx, P.to(dt), per_sample_weights=a.to(dt), mode="sum")


class _GatheredDot(torch.autograd.Function):
    """out_{n,j} = x_n · Y_{idx_{n,j}}  [N, k], computed slot by slot (O(N·d) at a time); saves x, Y and idx only.
    ∂x_n = Σ_j g_{n,j} Y_{idx_{n,j}},  ∂Y_i = Σ_{idx_{n,j} = i} g_{n,j} x_n (as in WinnerCosine)."""

    @staticmethod
    def forward(ctx, x, Y, idx):
        ctx.save_for_backward(x, Y, idx)
        return torch.stack([(Y[idx[:, j]] * x).sum(-1) for j in range(idx.shape[1])], 1)

    @staticmethod
    def backward(ctx, grad):
        x, Y, idx = ctx.saved_tensors
        grad_x = _gathered_rows_sum(idx, Y, grad) if ctx.needs_input_grad[0] else None
        grad_Y = _scatter_rows(idx, grad, x, Y.shape[0]) if ctx.needs_input_grad[1] else None
        return grad_x, grad_Y, None


def proto_logit_slices(idx, a, P, W, y):
    """The share of each winner in token n's logit for class y_n (a linear head W [V, d] applied to the
    reconstruction): out_{n,j} = a_{n,j} · <W_{y_n}, P_{idx_{n,j}}>  [N, k]; Σ_j out_{n,j} = <W_{y_n}, ẑ_n>.
    k dot products per token: no [K, V] or [N, k, d] tensor. Differentiable in a, P and W."""
    dt = torch.promote_types(torch.promote_types(a.dtype, P.dtype), W.dtype)
    w_y = F.embedding(y, W.to(dt))  # [N, d]: the target class's head row per token
    return a.to(dt) * _GatheredDot.apply(w_y, P.to(dt), idx)


# -----------------------------------------------------------------------------
# Model: a GPT-2 backbone (nanoGPT) and the prototype head


def _check_dist(dist):
    if dist not in ("l2", "cosine"):
        raise ValueError(f"dist must be 'l2' or 'cosine', got {dist!r}")


@torch.compiler.disable  # toggles the TF32 flags (full_fp32): kept out of torch.compile graphs
@torch.no_grad()
def nearest_pairs(z, P, dist="l2", chunk=4096):
    """R1/R2's nearest neighbours (spec §3.3): for each token its nearest prototype, for each prototype its nearest
    token, in row chunks so the N×K distance matrix is never whole. Selection only; the losses recompute the
    winners' distances with autograd. -> (proto_of_token [N], token_of_proto [K])."""
    _check_dist(dist)
    if z.shape[0] == 0:
        raise ValueError("nearest_pairs: no tokens, so no prototype has a nearest one")
    if torch.is_autocast_enabled(z.device.type):  # bf16 would reorder near neighbours: fp32 like proto_topk
        with torch.autocast(z.device.type, enabled=False):
            return nearest_pairs(z, P, dist, chunk)
    z, P = z.detach().float(), P.detach().float()
    if dist == "cosine":  # the cosines themselves (a zero row has cosine 0 with all, like F.cosine_similarity)
        z, P = F.normalize(z, dim=-1), F.normalize(P, dim=-1)
    else:
        pp, zz = P.pow(2).sum(-1), z.pow(2).sum(-1)
    near = _NearestPairs(z.shape[0], P.shape[0], z.device)
    for s in range(0, z.shape[0], chunk):
        with full_fp32():  # IEEE fp32 (TF32 is on for the backbone on CUDA): this GEMM runs at the fp32 rate
            dot = z[s:s + chunk] @ P.T  # -|z-p|² = 2 z·p - |z|² - |p|²
        if dist == "cosine":
            near.add(s, dot, dot)
        else:
            near.add(s, 2 * dot - pp, 2 * dot - zz[s:s + chunk, None])
    return near.result()


def pair_distance(a, b, dist="l2"):
    """Squared L2 per dimension (|a-b|²/d, so λ does not grow with d), or 1 - cos."""
    _check_dist(dist)
    if dist == "cosine":
        return 1 - F.cosine_similarity(a, b, dim=-1)
    return (a - b).pow(2).mean(-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        d = cfg.d_model
        self.heads, self.dropout = cfg.heads, cfg.dropout
        self.c_attn = nn.Linear(d, 3 * d, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.c_attn(x).split(C, 2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.resid_drop(self.c_proj(y.transpose(1, 2).reshape(B, T, C)))


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=False)
        self.c_proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=False)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln_1 = LayerNorm(cfg.d_model, bias=False, backend=cfg.kernels)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.d_model, bias=False, backend=cfg.kernels)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PRISM(nn.Module):
    """GPT-2 decoder (learned positions, pre-LayerNorm, GELU MLP, tied head, no biases) whose output layer is the
    prototype head when cfg.head == "prism", and the plain tied head W z when "dense" (the twin)."""

    def __init__(self, cfg: Config, vocab_size: int):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        d = cfg.d_model
        self.wte = nn.Embedding(vocab_size, d)
        self.wpe = nn.Embedding(cfg.ctx, d)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = LayerNorm(d, bias=False, backend=cfg.kernels)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by 1/sqrt(2L)
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.layers))
        if cfg.head == "prism":  # made last, so the backbone's initial weights equal the dense twin's
            # N(0, 1) rows have the norm of post-LayerNorm states (~sqrt(d)); k-means++ replaces them after warm-up
            self.P = nn.Parameter(torch.randn(cfg.n_protos, d, generator=torch.Generator().manual_seed(cfg.seed)))
            self.register_buffer("proto_ready", torch.tensor(cfg.init == "random"))
        self.ready = cfg.head == "prism" and cfg.init == "random"
        self.register_load_state_dict_post_hook(PRISM._after_load)  # a loaded model runs as the one saved

    @staticmethod
    def _init_weights(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()  # nanoGPT's count

    def sync_ready(self):
        """The Python flag mirrors the `proto_ready` buffer, read after a load or a broadcast, not every step (a
        device sync). load_state_dict calls it itself (_after_load)."""
        self.ready = self.cfg.head == "prism" and bool(self.proto_ready)

    @staticmethod
    def _after_load(module, incompatible_keys):
        module.sync_ready()

    def hidden(self, idx):
        """z [B, T, d]: the final hidden state after ln_f, the tensor the LM head consumes (spec §2.2)."""
        if idx.dim() != 2 or 0 in idx.shape:
            raise ValueError(f"idx must be [B, T] with B, T >= 1, got {tuple(idx.shape)}")
        T = idx.shape[1]
        if T > self.cfg.ctx:  # nanoGPT asserts this; an error names it instead of an embedding IndexError
            raise ValueError(f"sequence length {T} > ctx {self.cfg.ctx}: the learned position table has ctx rows")
        x = self.drop(self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x)

    def prototypes(self, z, pairs=None):
        """Active set A_t and activations a_t (spec §2.1 steps 1-3): top-k of ReLU(cos(z_t, p_i)), then the
        --act variant. -> idx [..., k] (int64), a [..., k] (fp32); with pairs="l2"/"cosine" also R1/R2's nearest
        pairs over the flattened tokens (proto_topk's third item)."""
        shape = z.shape[:-1]
        zf = z.reshape(-1, z.shape[-1])
        idx, a, *near = proto_topk(zf, self.P, self.cfg.topk, backend=self.cfg.kernels, pairs=pairs,
                                   precision=self.cfg.dot_precision)
        if self.cfg.act == "relu_cos_znorm":
            a = a * zf.float().norm(dim=-1, keepdim=True)
        elif self.cfg.act == "relu_cos_sum1":
            a = a / a.sum(-1, keepdim=True).clamp_min(1e-6)
        return idx.view(*shape, -1), a.view(*shape, -1), *near

    def head(self, z, suppress=None, factor=0.0, gain=None, pairs=None) -> dict:
        """The prototype head (spec §2.1): ẑ = Σ a_i p_i, r = z - ẑ, logits = W r + Σ a_i W p_i (= W z).

        One matmul with W, of the routed sum below; --resid-grad decides which way CE's gradient flows (§2.3):
          full         W r + W ẑ: the prototype terms cancel in the gradient (P gets no CE gradient; attribution
                       takes the prototype path with r held fixed, spec §2.3 A)
          detach-zhat  W (z - sg(ẑ)) + W ẑ: a and P get W ẑ's share; z the dense gradient plus that share's
                       (ẑ depends on z through the cosines in a)
          detach-r     W sg(z - ẑ) + W ẑ: CE reaches the backbone only through the cosines in a
        suppress (bool [K]) drops those prototypes' terms, keeping r from the *unsuppressed* reconstruction
        (§2.4: recomputing r would give W z back), times `factor` kept; gain ([K]) adds c_i a_i W p_i (§6.3).
        pairs (cfg.dist, for aux_losses) adds "pairs": R1/R2's nearest pairs from the selection's own cosines."""
        idx, a, *near = self.prototypes(z, pairs)
        zf = z.to(torch.promote_types(z.dtype, torch.float32))
        zhat = reconstruct(idx.flatten(0, -2), a.flatten(0, -2), self.P).view(zf.shape)
        r = zf - zhat
        if self.cfg.resid_grad == "detach-zhat":
            routed = (zf - zhat.detach()) + zhat
        elif self.cfg.resid_grad == "detach-r":
            routed = r.detach() + zhat
        else:  # full: r + ẑ is z; using z itself saves the rounding
            routed = zf
        if suppress is not None:
            dropped = a * suppress[idx].to(a.dtype)
            routed = routed - (1 - factor) * reconstruct(idx.flatten(0, -2), dropped.flatten(0, -2), self.P).view(zf.shape)
        if gain is not None:
            routed = routed + reconstruct(idx.flatten(0, -2), (a * gain[idx]).flatten(0, -2), self.P).view(zf.shape)
        logits = F.linear(routed.to(self.wte.weight.dtype), self.wte.weight)  # autocast may still run it in bf16
        return {"logits": logits, "idx": idx, "a": a, "zhat": zhat, "r": r, **({"pairs": near[0]} if near else {})}

    def aux_losses(self, z, out, r1_each: bool = False) -> dict:
        """REC, R1, R2 (spec §3.3), each with full gradient unless --r1-detach-z; batch-local under DDP (R1's
        minimum is over this rank's tokens: the all-reduced gradient then averages per-rank minima). r1_each adds
        "r1_each" [K], each prototype's distance to its nearest token, R1 before the mean (the evaluation
        min-reduces it across ranks)."""
        cfg = self.cfg
        zf = z.reshape(-1, z.shape[-1])
        zf = zf.to(torch.promote_types(zf.dtype, torch.float32))
        r = out["r"].reshape(zf.shape)
        if cfg.rec == "relative":
            rec = (r.pow(2).sum(-1) / zf.pow(2).sum(-1).clamp_min(1e-6)).mean()
        else:
            rec = r.pow(2).mean(-1).mean()
        # the head's selection found them when asked (head(z, pairs=cfg.dist)); else the separate search
        proto_of_token, token_of_proto = out["pairs"] if "pairs" in out else nearest_pairs(zf, self.P, cfg.dist)
        # index_select, not zf[...]: advanced indexing's backward is index_put_(accumulate=True), whose CPU kernel
        # adds duplicate rows in thread order (runs differed in the last bits); index_add_ is deterministic on CPU (on CUDA both use atomics)
        near_tokens = zf.index_select(0, token_of_proto)
        P = self.P.to(zf.dtype)
        d1 = pair_distance(P, near_tokens.detach() if cfg.r1_detach_z else near_tokens, cfg.dist)  # [K]
        r2 = pair_distance(zf, P.index_select(0, proto_of_token), cfg.dist).mean()
        return {"rec": rec, "r1": d1.mean(), "r2": r2, **({"r1_each": d1} if r1_each else {})}

    def forward(self, idx, targets=None):
        """-> logits [B, T, V] without targets; with targets (loss, stats), stats holding detached parts."""
        z = self.hidden(idx)
        if targets is not None:
            return self.head_loss(z, targets)
        return self.head(z)["logits"] if self.ready else F.linear(z, self.wte.weight)

    def head_loss(self, z, targets):
        """forward's output layer and losses from the final hidden states z [B, T, d] -> (loss, stats); apart from
        the backbone so that --bench can time the head alone."""
        if not self.ready:  # the dense twin, and PRISM during its warm-up (P joins the graph at zero weight so
            logits = F.linear(z, self.wte.weight)  # that DDP sees every parameter used)
            ce = cross_entropy(logits, targets, backend=self.cfg.kernels)
            loss = ce + 0.0 * self.P.sum() if self.cfg.head == "prism" else ce
            return loss, {"ce": ce.detach()}
        out = self.head(z, pairs=self.cfg.dist)
        ce = cross_entropy(out["logits"], targets, backend=self.cfg.kernels)
        aux = self.aux_losses(z, out)
        cfg = self.cfg
        loss = ce + cfg.lambda_rec * aux["rec"] + cfg.lambda_r1 * aux["r1"] + cfg.lambda_r2 * aux["r2"]
        stats = {"ce": ce.detach(), **{k: v.detach() for k, v in aux.items()}, "idx": out["idx"].detach(),
                 "a": out["a"].detach()}
        return loss, stats

    @torch.no_grad()
    def seed_prototypes(self, z, generator):
        """k-means++ seeding (D² sampling, squared L2) of P from hidden states z [N, d] (spec §3.4): each new
        prototype is a token drawn with probability proportional to its squared distance to the nearest chosen one."""
        z = z.reshape(-1, z.shape[-1]).float()
        K = self.P.shape[0]
        if z.shape[0] < K:
            raise ValueError(f"k-means++ seeding needs at least K={K} hidden states, got {z.shape[0]}")
        chosen = [int(torch.randint(z.shape[0], (1,), generator=generator, device=z.device))]
        d2 = (z - z[chosen[0]]).pow(2).sum(-1)
        for _ in range(K - 1):
            j = int(torch.multinomial(d2.clamp_min(0) + 1e-12, 1, generator=generator))
            chosen.append(j)
            d2 = torch.minimum(d2, (z - z[j]).pow(2).sum(-1))
        self.P.copy_(z[chosen].to(self.P.dtype))
        # With raw ReLU-cosine weights (--act relu_cos) ẑ sums up to k prototypes of |z|'s size and overshoots z
        # several-fold; one least-squares scale s = <z, ẑ> / <ẑ, ẑ> over the batch (cosines do not change) starts
        # ẑ at z's scale, and REC takes it from there.
        idx, a = self.prototypes(z)
        zhat = reconstruct(idx, a, self.P)
        self.P.mul_((z * zhat).sum() / zhat.pow(2).sum().clamp_min(1e-12))
        self.proto_ready.fill_(True)
        self.ready = True

    @torch.no_grad()
    def generate(self, idx, new_tokens, temperature=0.8, top_k=40, generator=None, **head_kw):
        """nanoGPT's sampler (the window cropped to ctx; temperature 0 is greedy); head_kw (suppress, factor, gain)
        edit the prototype head."""
        if top_k < 0:  # 0 turns top-k off; a negative k would fail inside torch.topk
            raise ValueError(f"top_k must be >= 0 (0: no top-k), got {top_k}")
        for _ in range(new_tokens):
            z = self.hidden(idx[:, -self.cfg.ctx:])[:, -1:]
            logits = (self.head(z, **head_kw)["logits"] if self.ready else F.linear(z, self.wte.weight))[:, -1]
            if temperature <= 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits.float() / max(temperature, 1e-6)  # a tiny temperature: near-greedy, not inf/NaN
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
    """Linear warmup over warmup_frac of the steps, then cosine from lr to min_lr_ratio·lr: nanoGPT's GPT-2 recipe.
    The spec gives no schedule; it asks only that the twin use the identical recipe (spec §4.4, §8)."""
    warmup = max(1, int(cfg.warmup_frac * cfg.max_iters))
    if it < warmup:
        return cfg.lr * (it + 1) / warmup
    progress = min(1.0, (it - warmup) / max(1, cfg.max_iters - warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


NO_DECAY = ("P",)


def make_optimizer(model: nn.Module, cfg: Config, device_type: str):
    """AdamW (0.9, 0.95) as nanoGPT, weight decay on matrices (embedding, projections) but not on P or norms."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.dim() < 2 or name.split(".")[-1] in NO_DECAY else decay).append(p)
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
RESUME_KEYS = ("max_iters", "lr", "min_lr_ratio", "warmup_frac", "batch_size", "weight_decay", "grad_clip", "dropout",
               "lambda_rec", "lambda_r1", "lambda_r2", "rec", "dist", "r1_detach_z", "revive_dead", "push_interval",
               "dot_precision")
# What only training reads: typed with --no-train, each keeps the checkpoint's value (a note says so), so that the
# config and the report describe the run that trained the model, not flags that changed nothing. dot_precision is
# read by every forward, and kept so that the analyses select prototypes as training did (its note says that)
TRAINING_KEYS = RESUME_KEYS + ("eval_interval", "eval_iters", "log_interval")  # (ctx is architecture here)
# ... and, before the prototypes are seeded (step < init_steps), how and when they will be
SEED_KEYS = ("init", "init_steps")


# What --resume cannot change: the run goes on from the checkpoint's random state (a typed seed would only be
# written into the stored config), and once the prototypes are seeded (step >= init_steps) SEED_KEYS too
FIXED_ON_RESUME = ("seed",)


def resume_note(saved: dict, cfg: Config, step: int) -> Optional[str]:
    """The line a resumed run logs when it cannot equal an uninterrupted one: nothing left to train, or settings
    changed since the checkpoint (the usual case: a smaller --max-iters first, then --resume with a larger one,
    whose cosine schedule the first steps did not follow). None when it resumes as if never stopped. A checkpoint
    past --max-iters is check_steps' error, before anything trains."""
    if step >= cfg.max_iters:
        return (f"note: the checkpoint is at step {step}, --max-iters {cfg.max_iters}: nothing left to train (raise "
                "--max-iters to continue)")
    keys = RESUME_KEYS + SEED_KEYS * (step < saved.get("init_steps", 0))
    changed = [f"{k} {saved[k]} -> {getattr(cfg, k)}" for k in keys if k in saved and saved[k] != getattr(cfg, k)]
    if changed:
        return (f"note: resuming with {', '.join(changed)}: the first {step} steps followed the checkpoint's "
                "settings (its learning-rate schedule included), so the result will differ from an uninterrupted "
                "run with these settings")
    return None


def flops_per_token(model: PRISM, cfg: Config, ctx: int) -> float:
    """Training FLOPs per token: 6·N for the backbone's matmuls (PaLM appendix B; the tied head once), plus
    attention's 12·L·d·T. P is no dense layer, so it is counted apart: the head scores all K prototypes, and R1/R2's
    nearest pairs come from the same scores (one K·d GEMM, forward only: 2·K·d), and only the k winners carry
    gradients (their cosines and the reconstruction: 2·k·d each forward, twice that backward, 12·k·d)."""
    n, prototypes = model.n_params(), 0
    if cfg.head == "prism":
        K, d = model.P.shape
        n -= K * d
        prototypes = 2 * K * d + 12 * cfg.topk * d
    return 6 * n + prototypes + 12 * cfg.layers * cfg.d_model * ctx


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


TAUS = (0.5, 0.7, 0.9)  # coverage thresholds on cosine similarity (spec §4.2: R̄1, R2 at several τ)


@torch.no_grad()
def estimate_loss(model, data, cfg: Config, autocast, batch_size) -> dict:
    """Over eval_iters random val batches (the val generator, saved in checkpoints): CE and, once the prototype
    head is live, |r|/|z|, REC, R1, R2, nnz (the mean number of non-zero activations per token after the ReLU,
    <= k: spec §7) and coverage. Coverage (spec §4.2, our definitions): R̄1(τ) = fraction of prototypes whose
    nearest val token (over all the batches) has cos ≥ τ; R2(τ) = fraction of val tokens whose nearest prototype
    has cos ≥ τ.

    Under DDP each rank holds its slice of the global batch (common.get_batch: batch_size windows per rank), and
    every figure is reduced to the global batch's, the value one process computes from the same global batch:
    the per-token means (CE, |r|/|z|, REC, R2, nnz) are averaged over ranks (equal token counts); R1's
    per-prototype minima are min-reduced before the mean over prototypes (R1 of the global batch, not the
    batch-local R1 the training loss uses, §3.3); R̄1's per-prototype best cosines are max-reduced; R2's counts
    of tokens at or above τ are summed."""
    raw = model.module if hasattr(model, "module") else model
    device = next(raw.parameters()).device
    model.eval()
    sums, n = {}, 0
    proto_best, r1_each = None, []
    above = torch.zeros(len(TAUS) + 1, dtype=torch.float64, device=device)  # tokens with cos >= τ, then all tokens
    for _ in range(cfg.eval_iters):
        x, y = data.get_batch("val", batch_size, cfg.ctx)
        with autocast:
            z = raw.hidden(x)
            parts = {}
            if raw.ready:
                out = raw.head(z, pairs=cfg.dist)
                aux = raw.aux_losses(z, out, r1_each=True)
                r1_each.append(aux.pop("r1_each").float())  # R1 = its mean, taken after the reduction below
                parts = {k: aux[k].item() for k in ("rec", "r2")}
                zf = z.reshape(-1, z.shape[-1]).float()
                parts["r_over_z"] = (out["r"].reshape(zf.shape).norm(dim=-1) / zf.norm(dim=-1).clamp_min(1e-6)).mean().item()
                parts["nnz"] = (out["a"] > 0).sum(-1).float().mean().item()
                logits = out["logits"]
                # coverage on cosines: nearest pairs in cosine, then their cosine values
                pt, tp = nearest_pairs(zf, raw.P, "cosine")
                tb = F.cosine_similarity(zf, raw.P[pt].float(), dim=-1)
                above += torch.stack([(tb >= t).sum() for t in TAUS] + [torch.tensor(tb.numel(), device=device)])
                pb = F.cosine_similarity(raw.P.float(), zf[tp], dim=-1)
                proto_best = pb if proto_best is None else torch.maximum(proto_best, pb)
            else:
                logits = F.linear(z, raw.wte.weight)
            parts["ce"] = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()).item()
        for k, v in parts.items():
            sums[k] = sums.get(k, 0.0) + v
        n += 1
    model.train()
    keys = sorted(sums)  # the same on every rank: raw.ready is
    means = torch.tensor([sums[k] / n for k in keys], dtype=torch.float64, device=device)
    d1 = torch.stack(r1_each) if r1_each else None  # [eval_iters, K]
    if dist_ready():
        import torch.distributed as dist

        dist.all_reduce(means)
        means /= dist.get_world_size()
        if d1 is not None:
            dist.all_reduce(d1, op=dist.ReduceOp.MIN)
            dist.all_reduce(proto_best, op=dist.ReduceOp.MAX)
            dist.all_reduce(above)
    res = dict(zip(keys, means.tolist()))
    if d1 is not None:
        res["r1"] = d1.mean().item()  # equal K per batch: the mean of the per-batch R1
        res["cover_r1"] = {t: (proto_best >= t).float().mean().item() for t in TAUS}
        res["cover_r2"] = {t: (above[i] / above[-1]).item() for i, t in enumerate(TAUS)}
    return res


def perplexity(loss: float) -> float:
    """exp(loss), infinite past float range (a diverged or heavily intervened model) rather than an OverflowError."""
    return math.exp(loss) if loss < 709 else math.inf


@torch.no_grad()
def evaluate_ppl(model, data, ctx: int, autocast, batch_size: int = 8, max_windows: Optional[int] = None,
                 head_kw: Optional[dict] = None) -> dict:
    """Exact token-weighted perplexity over the val split: every token predicted once (common.iter_eval).
    head_kw (suppress, factor, gain) evaluates an edited prototype head; with suppress, "fired" counts the
    (token, suppressed prototype) activations a > 0 it met: 0 means the edit cannot change a logit here.
    The unk id (compaction's image of every id unseen in training, so never a training target) is scored like any
    token; "unk_tokens" counts those targets and "loss_known"/"ppl_known" leave them out."""
    model.eval()
    unk = -1 if data.tokenizer.unk is None else data.tokenizer.unk  # -1: no compaction, every target is known
    # Σ nll and targets, all and known (not unk), suppressed activations met: summed on the device, read once
    sums = torch.zeros(5, dtype=torch.float64, device=data.device)
    for i, (x, y) in enumerate(data.iter_eval("val", batch_size, ctx)):
        if max_windows is not None:
            if i * batch_size >= max_windows:
                break
            x, y = x[:max_windows - i * batch_size], y[:max_windows - i * batch_size]  # exactly max_windows
        with autocast:
            if head_kw:
                out = model.head(model.hidden(x), **head_kw)
                logits = out["logits"]
                if head_kw.get("suppress") is not None:
                    sums[4] += (head_kw["suppress"][out["idx"]] & (out["a"] > 0)).sum()
            else:
                logits = model(x)
        nll = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").double()
        known = y.flatten() != unk
        sums[:4] += torch.stack([nll.sum(), nll.new_tensor(y.numel()), (nll * known).sum(), known.sum().double()])
    if dist_ready():
        import torch.distributed as dist

        dist.all_reduce(sums)
    total, count, total_known, count_known, fired = sums.tolist()
    known = total_known / count_known if count_known else None  # None: every target is unk
    res = {"loss": total / count, "ppl": perplexity(total / count), "tokens": int(count),
           "unk_tokens": int(count - count_known), "loss_known": known,
           "ppl_known": None if known is None else perplexity(known)}
    if head_kw and head_kw.get("suppress") is not None:
        res["fired"] = int(fired)
    return res


def dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def any_rank(flag: torch.Tensor) -> bool:
    """True if `flag` is set on any rank (all ranks must stop together, or the others hang in a collective)."""
    if dist_ready():
        flag = flag.float()
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


def ckpt_path(cfg: Config) -> Path:
    return Path(cfg.out_dir) / f"ckpt-{cfg.head}.pt"


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
HISTORY_KEYS = ("step", "train", "val", "evals")  # the lists train() appends to


def save_checkpoint(path: Path, model, optimizer, cfg: Config, step: int, best: float, data_rng, data,
                    history) -> None:
    """One file: written to a temporary name, then renamed (a crash never leaves half a checkpoint)."""
    state = {
        "format": "glassbox-checkpoint/1", "script": "prism", "config": asdict(cfg),
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
    pairs, and one number per evaluation in each other list (evals: a dict per evaluation)."""
    def num(v):
        return type(v) in (int, float)
    return (isinstance(hist, dict) and all(isinstance(hist.get(k), list) for k in HISTORY_KEYS)
            and all(type(s) is int for s in hist["step"])
            and all(isinstance(p, (list, tuple)) and len(p) == 2 and type(p[0]) is int and num(p[1])
                    for p in hist["train"])
            and all(len(hist[k]) == len(hist["step"]) and all((isinstance(v, dict) if k == "evals" else num(v)) for v in hist[k])
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
    if not path.exists():
        raise RunError(f"no checkpoint at {path} (train first, or point --out-dir at one)")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
        # a saved tensor or list is no checkpoint: ck["config"] on a tensor would print a torch warning first
        ok = isinstance(ck, dict) and ck.get("format") == "glassbox-checkpoint/1" and ck.get("script") == "prism"
        if ok:
            saved = dict(ck["config"])
            for c in (saved, ck["config"]):  # checkpoints from before --dot-precision selected in fp32 (resume_note
                c.setdefault("dot_precision", "fp32")  # reads ck["config"])
            missing = [k for k in CKPT_KEYS if k not in ck] or [f"rng.{k}" for k in RNG_KEYS if k not in ck["rng"]]
    except Exception as e:  # truncated file, not a checkpoint, unpickling refused
        raise RunError(f"{path} is not a readable checkpoint ({type(e).__name__}); delete it or retrain") from None
    if not ok:
        raise RunError(f"{path} is not a prism.py checkpoint")
    if missing:
        raise RunError(f"{path} is an incomplete checkpoint (no {', '.join(missing)}); delete it or retrain")
    if saved.get("head") != cfg.head:  # a file renamed by hand: the name says one head, the contents another
        raise RunError(f"{path} holds a --head {saved.get('head')} model, not {cfg.head}")
    damaged = damaged_fields(ck)
    if damaged:
        raise RunError(f"{path} is a damaged checkpoint ({', '.join(damaged)}: not what save_checkpoint writes); "
                       "delete it or retrain")

    def typed_otherwise(keys) -> str:  # "k=stored (asked typed)" for each typed key that differs from the checkpoint
        return ", ".join(f"{k}={saved.get(k)!r} (asked {getattr(cfg, k)!r})" for k in keys
                         if k in explicit and getattr(cfg, k) != saved.get(k))

    diff = typed_otherwise(ARCH_KEYS)
    if diff:
        raise RunError(f"{path} was trained with {diff}; drop those flags or use another --out-dir")
    seeded = saved.get("head") == "prism" and ck["step"] >= saved.get("init_steps", 0)  # the twin has no prototypes
    diff = typed_otherwise(FIXED_ON_RESUME + SEED_KEYS * seeded) if cfg.resume else ""
    if diff:
        raise RunError(f"{path} was trained with {diff}, which --resume cannot change (it continues from the "
                       "checkpoint's random state and prototypes); drop those flags, or train afresh in another "
                       "--out-dir")
    keep = () if cfg.train else TRAINING_KEYS  # --no-train: what trained the model, whatever was typed
    taken = {k: saved[k] for k in ARCH_KEYS + MERGED_KEYS if k in saved and (k not in explicit or k in keep)}
    merged = replace(cfg, **taken)
    from common import stored_config_error

    why = stored_config_error(replace(Config(train=False), **taken), validate)  # the stored values, as a loaded model
    if why:
        raise RunError(f"{path} stores {why}; delete it or retrain")
    return ck, merged


def build_model(cfg: Config, vocab_size: int, device) -> PRISM:
    torch.manual_seed(cfg.seed)
    return PRISM(cfg, vocab_size).to(device)


@torch.no_grad()
def global_states(raw: PRISM, x, dist_info) -> torch.Tensor:
    """The hidden states z [N, d] (fp32, eval mode, no dropout) of every rank's batch, gathered: the seeding and
    the revival draw from one global batch, so K may exceed one rank's tokens."""
    was = raw.training
    raw.eval()
    z = raw.hidden(x).float().reshape(-1, raw.cfg.d_model)
    raw.train(was)
    if dist_info["ddp"]:
        parts = [torch.empty_like(z) for _ in range(dist_info["world"])]
        torch.distributed.all_gather(parts, z)
        z = torch.cat(parts)
    return z


def seed_from_batch(raw: PRISM, x, cfg: Config, dist_info) -> None:
    """k-means++ seeding of P from this step's hidden states (spec §3.4): every rank's batch gathered, seeded on
    rank 0 and broadcast (DDP keeps one set of weights). A generator of its own, so the data and dropout streams
    are the same as with --init random."""
    z = global_states(raw, x, dist_info)
    if dist_info["rank"] == 0:
        raw.seed_prototypes(z, torch.Generator(device=x.device).manual_seed(cfg.seed))
    if dist_info["ddp"]:
        torch.distributed.broadcast(raw.P.data, 0)
        torch.distributed.broadcast(raw.proto_ready, 0)
        raw.sync_ready()


@torch.no_grad()
def revive_dead(raw: PRISM, optimizer, usage, x, cfg: Config, step: int, dist_info) -> int:
    """Dead-prototype replacement (vector quantisation's dead-code restart; the paper has none): prototypes
    that no token activated since the last evaluation are re-seeded from this batch's hidden states, drawn with
    probability ∝ |r|²/|z|² (tokens the bank explains worst), scaled like the live prototypes; their Adam moments
    restart at 0. Drawn on rank 0 from all ranks' states and broadcast; seeded by (seed, step), so resume is exact.
    -> the number of prototypes re-seeded."""
    dead = (usage == 0).nonzero().squeeze(1)
    if len(dead) == 0 or len(dead) == len(usage):
        return 0
    z = global_states(raw, x, dist_info)
    dead = dead[:len(z)]  # at most one new prototype per token
    if dist_info["rank"] == 0:
        r = raw.head(z)["r"]
        weight = r.pow(2).sum(-1) / z.pow(2).sum(-1).clamp_min(1e-6)
        g = torch.Generator(device=z.device).manual_seed(cfg.seed * 1000003 + step)
        pick = torch.multinomial(weight + 1e-12, len(dead), replacement=False, generator=g)
        live = usage > 0
        scale = raw.P[live].norm(dim=-1).mean() / z.norm(dim=-1).mean().clamp_min(1e-6)
        raw.P[dead] = (z[pick] * scale).to(raw.P.dtype)
    if dist_info["ddp"]:
        torch.distributed.broadcast(raw.P.data, 0)
    state = optimizer.state.get(raw.P, {})
    for key in ("exp_avg", "exp_avg_sq"):
        if key in state:
            state[key][dead] = 0
    return len(dead)


@torch.no_grad()
def push_prototypes(raw: PRISM, optimizer, x, dist_info) -> float:
    """The optional push (spec §9.5; the paper's use of one is unconfirmed, ProtoPNet's "projection" is the model):
    each prototype is turned onto the direction of its nearest token (by cosine, the head's similarity) among the
    hidden states of this batch, all ranks' gathered, and keeps its norm. The head sees only directions, so each
    prototype then matches a training token exactly (cos = 1, "exactly matched to a training data point", spec
    §3.1), while the norm, which with --act relu_cos carries the scale REC learned (spec §2.2 (a)), stays: a
    prototype set to the token itself would make ẑ, a sum of up to k such rows, overshoot z several-fold (the
    reason for the seeding's rescale). Adam's moments of P restart at 0, as for --revive-dead: they describe the
    old positions' trajectories. Computed on rank 0 from the gathered states and broadcast.
    -> the mean cosine of the prototypes with their tokens before the push."""
    z = global_states(raw, x, dist_info)
    before = torch.zeros((), device=z.device)
    if dist_info["rank"] == 0:
        _, token_of_proto = nearest_pairs(z, raw.P, "cosine")
        near = z[token_of_proto]
        before = F.cosine_similarity(raw.P.float(), near, dim=-1).mean()
        norm = raw.P.float().norm(dim=-1, keepdim=True)
        raw.P.copy_((F.normalize(near, dim=-1) * norm).to(raw.P.dtype))
    if dist_info["ddp"]:
        torch.distributed.broadcast(raw.P.data, 0)
        torch.distributed.broadcast(before, 0)
    state = optimizer.state.get(raw.P, {})
    for key in ("exp_avg", "exp_avg_sq"):
        if key in state:
            state[key].zero_()
    return before.item()


def eval_line(step: int, ev: dict, twin_val: Optional[float], used: Optional[int], K: int, k: int) -> str:
    s = f"step {step}: val loss {ev['ce']:.4f} (ppl {perplexity(ev['ce']):.1f})"
    if twin_val is not None:
        s += f" | gap to dense {ev['ce'] - twin_val:+.4f} ({(ev['ce'] - twin_val) / twin_val:+.1%})"
    if "r_over_z" in ev:
        s += (f" | |r|/|z| {ev['r_over_z']:.3f} | REC {ev['rec']:.3f} R1 {ev['r1']:.3f} R2 {ev['r2']:.3f}"
              f" | non-zero a {ev['nnz']:.2f}/{k} | cover "
              + " ".join(f"τ{t}: {ev['cover_r1'][t]:.2f}/{ev['cover_r2'][t]:.2f}" for t in TAUS))
    if used is not None:
        s += f" | prototypes used {used}/{K}, dead {K - used}"
    if ev.get("revived"):
        s += f" (re-seeded {ev['revived']})"
    return s


def train(cfg: Config, data, device, autocast, dist_info, explicit=(), log=print, ck=None,
          twin: Optional[dict] = None, start_rng: Optional[dict] = None) -> tuple[PRISM, dict]:
    """The nanoGPT-shaped loop. Returns the trained (unwrapped) model and its history. With cfg.resume it
    continues from `ck`, the checkpoint already loaded by the caller (read from out_dir when not given).
    `twin` is the dense twin's history, for the CE gap at each evaluation; `start_rng`, the data streams' state
    to start from (the same for the twin and PRISM, so both train and evaluate on the same batches)."""
    from common import memory_floor_problem

    rank, world = dist_info["rank"], dist_info["world"]
    if cfg.batch_size % world:
        raise RunError(f"--batch-size {cfg.batch_size} must be divisible by the {world} ranks")
    micro = cfg.batch_size // world
    path = ckpt_path(cfg)
    if start_rng is not None and not cfg.resume:  # the twin and PRISM see the same batches
        data.set_rng_state(start_rng)
    # sizes that cannot fit stop here with one line (a CPU run would be killed with no message)
    bf16 = getattr(autocast, "fast_dtype", None) == torch.bfloat16  # a torch.autocast, or a nullcontext (fp32)
    problem = memory_floor_problem(lambda: PRISM(cfg, data.vocab_size), device, micro * cfg.ctx,
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
    prism = cfg.head == "prism"
    log(f"{cfg.head}: {raw.n_params() / 1e6:.2f}M parameters"
        + (f" (prototype bank {cfg.n_protos}x{cfg.d_model} = {cfg.n_protos * cfg.d_model / 1e6:.2f}M, k={cfg.topk})" if prism else "")
        + f", vocab {data.vocab_size}, {tokens_per_step:,} tokens per step, {cfg.max_iters} steps")
    twin_val = dict(zip(twin["step"], twin["val"])) if twin else {}
    usage = torch.zeros(cfg.n_protos if prism else 1, dtype=torch.int32, device=device)  # activations since last eval
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
            ev = estimate_loss(model, data, cfg, autocast, micro)  # reduced over the ranks
            if dist_ready():
                torch.distributed.all_reduce(usage)
            val = ev["ce"]
            if not math.isfinite(val) or not all(torch.isfinite(p).all() for p in raw.parameters()):
                raise RunError(nan_message(step, path, saved))  # never save non-finite weights
            used = int((usage > 0).sum()) if prism and raw.ready else None
            ev.update(step=step, used=used)
            if cfg.revive_dead and used is not None and step < cfg.max_iters:
                ev["revived"] = revive_dead(raw, optimizer, usage, x, cfg, step, dist_info)
            history["step"].append(step)
            history["val"].append(val)
            history["evals"].append(ev)
            log(eval_line(step, ev, twin_val.get(step), used, cfg.n_protos, cfg.topk))
            usage.zero_()
            best = min(best, val)
            if rank == 0:  # the train stream as it was before the prefetch, the val stream as it is now
                rng = {**data_rng, "val": data.rng_state()["val"]}
                save_checkpoint(path, raw, optimizer, cfg, step, best, rng, data, history)
            saved = step  # rank 0 wrote it: every rank names it
            t0, t0_step = time.time(), step  # evaluation time is not training time
        if step >= cfg.max_iters:
            break
        if prism and not raw.ready and step >= cfg.init_steps:
            seed_from_batch(raw, x, cfg, dist_info)
            optimizer.state.pop(raw.P, None)  # Adam's moments of the warm-up's zero gradients would damp P's start
            log(f"step {step}: prototypes seeded by k-means++ from {cfg.batch_size * cfg.ctx:,} hidden states after the dense warm-up")
            t0, t0_step = time.time(), step  # one-off work, like evaluation, is not training time
        elif prism and raw.ready and cfg.push_interval and step > 0 and step % cfg.push_interval == 0:
            # before this step's forward, on the batch it trains on, after the evaluation's checkpoint: a run
            # resumed from that checkpoint redoes the same push at its first step
            cos = push_prototypes(raw, optimizer, x, dist_info)
            log(f"step {step}: prototypes pushed onto their nearest tokens (mean cosine before {cos:.3f})")
            t0, t0_step = time.time(), step
        lr = get_lr(cfg, step)
        for g in optimizer.param_groups:
            g["lr"] = lr
        with autocast:
            loss, stats = model(x, y)
        data_rng = data.rng_state()
        x, y = data.get_batch("train", micro, cfg.ctx)  # prefetch while the backward runs (async on CUDA)
        loss.backward()
        bad |= ~torch.isfinite(loss.detach())
        if "idx" in stats:  # index_add, not a boolean mask: no device sync
            usage.index_add_(0, stats["idx"].flatten(), (stats["a"] > 0).flatten().to(usage.dtype))
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
# Analyses: prototype cards, logit decomposition, attribution, suppression, controller, benchmarks, report


def token_pieces(tok, ids) -> list[str]:
    return [tok.decode([int(i)]) for i in ids]


def train_windows(data, n: int, width: int) -> torch.Tensor:
    """n windows of `width + 1` training tokens (inputs and next-token targets), [n, width + 1], spread evenly
    over the whole split (deterministic), so cards, attribution and the SAE see every part of the corpus."""
    tokens = data.tokens("train")
    slots = (len(tokens) - 1) // width
    n = min(n, slots)
    starts = torch.div(torch.arange(n) * slots, n, rounding_mode="floor") * width
    idx = starts[:, None] + torch.arange(width + 1)[None, :]
    return torch.from_numpy(tokens[: slots * width + 1].astype("int64"))[idx]


@torch.no_grad()
def signatures(model: PRISM, top: int = 10, chunk: int = 1024) -> torch.Tensor:
    """Each prototype's logit signature W p_i, top tokens only: [K, top] ids, computed in chunks of prototypes
    (the K×V matrix is never whole)."""
    W = model.wte.weight.float()
    return torch.cat([(model.P[i:i + chunk].float() @ W.T).topk(top, dim=-1).indices
                      for i in range(0, model.P.shape[0], chunk)])


@torch.no_grad()
def prototype_cards(model: PRISM, data, cfg: Config, top: int = 5, before: int = 12) -> dict:
    """Spec §5.4: each prototype's nearest training contexts (the tokens where its activation a_{t,i} is largest,
    over card_windows training windows) and its logit signature's top tokens. -> {"cards": [...], ...}."""
    model.eval()
    windows = train_windows(data, cfg.card_windows, cfg.ctx)
    n, K = windows.shape[0], model.P.shape[0]
    protos, acts, pos = [], [], []
    for s in range(0, n, 16):
        x = windows[s:s + 16, :-1].to(data.device)
        idx, a = model.prototypes(model.hidden(x))
        flat_pos = (torch.arange(s, s + x.shape[0], device=x.device)[:, None] * cfg.ctx
                    + torch.arange(cfg.ctx, device=x.device)[None, :])[..., None].expand_as(idx)
        keep = a > 0
        protos.append(idx[keep].cpu())
        acts.append(a[keep].float().cpu())
        pos.append(flat_pos[keep].cpu())
    protos, acts, pos = torch.cat(protos), torch.cat(acts), torch.cat(pos)
    uses = torch.bincount(protos, minlength=K)
    # sort by prototype, then activation descending: each prototype's top entries are the first of its run
    by_act = torch.argsort(acts, descending=True, stable=True)
    order = by_act[torch.argsort(protos[by_act], stable=True)]
    starts = torch.cumsum(uses, 0) - uses
    sig = signatures(model)
    tok = data.tokenizer
    flat = windows[:, :-1].reshape(-1)
    nxt = windows[:, 1:].reshape(-1)
    cards = []
    for i in range(K):
        entries = order[starts[i]: starts[i] + min(top, int(uses[i]))]
        contexts = []
        for e in entries.tolist():
            p = int(pos[e])
            w0 = p - p % cfg.ctx  # contexts never cross into the previous window
            lo = max(w0, p - before)
            contexts.append({"a": float(acts[e]), "before": tok.decode(flat[lo:p].tolist()),
                             "token": tok.decode([int(flat[p])]), "next": tok.decode([int(nxt[p])])})
        cards.append({"proto": i, "uses": int(uses[i]), "contexts": contexts,
                      "signature": token_pieces(tok, sig[i].tolist())})
    return {"cards": cards, "windows": n, "tokens": n * cfg.ctx,
            "used": int((uses > 0).sum()), "dead": int((uses == 0).sum())}


def cards_html(cards: list[dict], limit: int = 300) -> str:
    rows = []
    for c in sorted(cards, key=lambda c: -c["uses"])[:limit]:
        ctx = "".join(f'<div class="ctx">{html.escape(x["before"])}<b style="background:rgba(255,140,0,'
                      f'{min(1.0, x["a"]):.2f})">{html.escape(x["token"])}</b><i>→{html.escape(x["next"])}</i> '
                      f'<small>a={x["a"]:.2f}</small></div>' for x in c["contexts"])
        sig = " ".join(f"<code>{html.escape(s)}</code>" for s in c["signature"])
        rows.append(f'<div class="card"><h3>prototype {c["proto"]} <small>{c["uses"]} activations</small></h3>'
                    f'<div>logit signature: {sig}</div>{ctx}</div>')
    return ("<!doctype html><meta charset=utf-8><title>PRISM prototype cards</title><style>body{font-family:"
            "sans-serif}.card{border:1px solid #ccc;margin:8px;padding:6px}.ctx{font-family:monospace;white-space:"
            "pre-wrap;margin:2px 0;border-bottom:1px dotted #eee}</style><h1>Prototype cards (most used first)</h1>"
            + "".join(rows))


@torch.no_grad()
def logit_decomposition(model: PRISM, ids: torch.Tensor, tok, prompt_len: int = 0) -> dict:
    """Spec §1, §5.4: every token's logit as prototype slices a_{t,i} (w_y · p_i) plus the residual slice
    w_y · r_t; they sum to the logit w_y · z_t (exactly, up to float rounding: reported). The first prompt_len
    tokens of ids are the prompt: their rows say so ("prompt"), the rest are the generated continuation."""
    model.eval()
    x, y = ids[:, :-1], ids[0, 1:]
    z = model.hidden(x)[0].float()
    out = model.head(z)
    W = model.wte.weight.float()
    w_y = W[y]  # [T, d]
    slices = proto_logit_slices(out["idx"], out["a"], model.P, W, y)  # [T, k]
    resid = (w_y * out["r"]).sum(-1)
    logit = (w_y * z).sum(-1)
    err = (slices.sum(-1) + resid - logit).abs().max().item()
    rows = []
    S, on, ids = slices.tolist(), (out["a"] > 0).tolist(), out["idx"].tolist()
    for t in range(len(y)):  # the 4 largest slices by name; the other active ones summed, so each row adds up
        active = sorted((j for j in range(len(S[t])) if on[t][j]), key=lambda j: -abs(S[t][j]))
        rows.append({"token": tok.decode([int(y[t])]), "prompt": t + 1 < prompt_len, "logit": logit[t].item(),
                     "residual": resid[t].item(), "prototypes": [(ids[t][j], S[t][j]) for j in active[:4]],
                     "other": (len(active[4:]), sum(S[t][j] for j in active[4:]))})
    return {"rows": rows, "max_abs_error": err, "max_abs_logit": logit.abs().max().item()}


WORD = re.compile(r"[A-Za-z']+")  # what keyword_rate counts as a word


def keywords_of(spec: str) -> list[str]:
    """'Love, crown' -> ['love', 'crown']. Each keyword must be a word as keyword_rate counts them (letters and
    apostrophes), else its rate could never move: a one-line error."""
    kws = [w.strip().lower() for w in spec.split(",")]  # an empty item (love,,crown) is an error, as in --suppress
    bad = [w for w in kws if not WORD.fullmatch(w)]
    if bad or not kws:
        raise RunError(f"--suppress-keywords {spec!r}: expected words (letters and apostrophes) such as love,crown, "
                       "or auto")
    return kws


def card_words(card: dict, sig_top: int = 3) -> set[str]:
    """The words (whole tokens, lower-cased) a card is *about*: its signature's top `sig_top` tokens, and any
    token that is the activating token or the token after it in at least half of its top contexts. (Any mention
    among ten signature tokens would select a large part of a small bank.)"""
    words = {s.strip().lower() for s in card["signature"][:sig_top]}
    ctx = [{x["token"].strip().lower(), x["next"].strip().lower()} for x in card["contexts"]]
    for w in set().union(*ctx) if ctx else ():
        if 2 * sum(w in c for c in ctx) >= len(ctx):
            words.add(w)
    return words - {""}


def match_keywords(cards: list[dict], keywords: list[str], sig_top: int = 3) -> list[int]:
    """Live prototypes (active on the card windows) whose card is about a keyword. A dead prototype never fires,
    so suppressing it changes nothing: it is never selected."""
    kw = set(keywords)
    return [c["proto"] for c in cards if c["uses"] > 0 and card_words(c, sig_top) & kw]


def auto_keyword(cards: list[dict], generated: Optional[list[str]] = None, min_letters: int = 4) -> list[str]:
    """--suppress-keywords auto: among the words of min_letters+ letters that live cards are about, the one the
    model generates most (its rate in `generated`: unsuppressed generations from SELECTION_SEED_OFFSET's seeds,
    not those the rate is then measured on), so that the before/after rate can move; ties, and no generations,
    go to the uses-weighted card score. [] when no live card is about such a word."""
    score: dict[str, int] = {}
    for c in cards:
        if c["uses"] > 0:
            for w in card_words(c):
                if w.isalpha() and len(w) >= min_letters:
                    score[w] = score.get(w, 0) + c["uses"]
    counts = Counter(w.lower() for t in generated or [] for w in WORD.findall(t))  # keyword_rate's words
    return [min(score, key=lambda w: (-counts[w], -score[w], w))] if score else []


def parse_ids(spec: str, K: int) -> list[int]:
    try:
        ids = [int(s) for s in spec.split(",")]  # an empty item (3,,17, or a trailing comma) is an error
    except ValueError:
        raise RunError(f"--suppress {spec!r}: expected prototype ids like 3,17,42") from None
    bad = [i for i in ids if not 0 <= i < K]
    if bad or not ids:
        raise RunError(f"--suppress {spec!r}: ids must be in [0, {K})")
    return sorted(set(ids))  # 3,3 suppresses one prototype, and counts as one


def keyword_rate(texts: list[str], keywords: list[str]) -> float:
    """Keyword occurrences per 1,000 generated words."""
    words = [w.lower() for t in texts for w in WORD.findall(t)]
    kw = set(keywords)
    return 1000 * sum(w in kw for w in words) / max(1, len(words))


SUPPRESS_PROMPTS = ["ROMEO:\n", "JULIET:\n", "KING:\nMy lords,", "HAMLET:\n", "OTHELLO:\n", "First Lord:\n",
                    "PORTIA:\n", "BENEDICK:\n"]


# --suppress-keywords auto picks its word on generations drawn from these seeds, never those the rate is measured
# on: a word chosen for being frequent in a sample is over-represented in that sample, so measuring "before" on it
# would show a fall after any edit that changes the texts at all (regression to the mean), a targeted one or not.
SELECTION_SEED_OFFSET = 10_000


@torch.no_grad()
def suppression_generations(model: PRISM, data, cfg: Config, head_kw: dict, samples_per_prompt: int = 2,
                            seed_offset: int = 0) -> list:
    """The generations the keyword rate is counted in: SUPPRESS_PROMPTS × samples_per_prompt, seeded per
    (prompt, sample), so the texts before and after a suppression differ only by the suppression. seed_offset
    SELECTION_SEED_OFFSET draws the auto keyword's own, disjoint set."""
    model.eval()
    texts, tok = [], data.tokenizer
    for p_i, prompt in enumerate(SUPPRESS_PROMPTS):
        ids_p = torch.tensor([tok.encode(prompt)], device=data.device)
        for s in range(samples_per_prompt):
            g = torch.Generator(device=data.device).manual_seed(cfg.seed + seed_offset + 100 * p_i + s)
            out = model.generate(ids_p, cfg.sample_tokens, cfg.temperature, generator=g, **head_kw)
            texts.append(tok.decode(out[0, ids_p.shape[1]:].tolist()))
    return texts


@torch.no_grad()
def suppression(model: PRISM, data, cfg: Config, ids: list[int], keywords: list[str], autocast,
                samples_per_prompt: int = 2, ppl_windows: int = 64, before: Optional[list[str]] = None) -> dict:
    """Spec §2.4, §6.3: drop the selected prototypes' terms at inference (r kept from the unsuppressed
    reconstruction), then the keywords' rate in generations (same prompts, same seeds) and val perplexity,
    before and after. `before`: the unsuppressed generations when already made (suppression_generations)."""
    model.eval()
    mask = torch.zeros(model.P.shape[0], dtype=torch.bool, device=model.P.device)
    mask[ids] = True
    kw = {"suppress": mask, "factor": cfg.suppress_factor}
    texts = {"before": before if before is not None else suppression_generations(model, data, cfg, {},
                                                                                 samples_per_prompt),
             "after": suppression_generations(model, data, cfg, kw, samples_per_prompt)}
    ev0 = evaluate_ppl(model, data, cfg.ctx, autocast, max_windows=ppl_windows)
    ev1 = evaluate_ppl(model, data, cfg.ctx, autocast, max_windows=ppl_windows, head_kw=kw)
    ppl0, ppl1 = ev0["ppl"], ev1["ppl"]
    # why an unchanged before/after is a no-op rather than a null result: how often the suppressed prototypes
    # fired in the val windows, and how many generations the edit changed at all
    changed = sum(b != a for b, a in zip(texts["before"], texts["after"]))
    return {"prototypes": ids, "fraction": len(ids) / model.P.shape[0], "keywords": keywords,
            "factor": cfg.suppress_factor, "generations": len(texts["before"]), "generations_changed": changed,
            "rate_before": keyword_rate(texts["before"], keywords), "rate_after": keyword_rate(texts["after"], keywords),
            "ppl_before": ppl0, "ppl_after": ppl1, "ppl_change": ppl1 / ppl0 - 1, "ppl_tokens": ev0["tokens"],
            "fired_val": ev1["fired"], "no_effect": changed == 0 and ppl1 == ppl0,
            "example": {"prompt": SUPPRESS_PROMPTS[0], "before": texts["before"][0], "after": texts["after"][0]}}


def suppression_effect(r: dict) -> str:
    """How much a suppression touched, from suppression()'s counts: an unchanged before/after then reads as a no-op
    (prototypes that never fired) rather than as a measured null effect."""
    s = (f"the suppressed prototypes fired {r['fired_val']:,} times over the {r['ppl_tokens']:,} val tokens and "
         f"changed {r['generations_changed']} of the {r['generations']} generations")
    return ("no effect: " + s) if r["no_effect"] else s


# --- Training-data attribution (spec §5.3; the paper's algorithm is not public, this is the reconstruction) ---
#
# The prototype bank P (K×d) is the parameter block. Per token t: ẑ_t = Σ_{i∈A_t} a_{t,i} p_i, a linear
# layer with a k-sparse input a_t, and δ_t = ∂CE_t/∂ẑ_t = Wᵀ(softmax(W z_t) − e_{y_t}). With a held fixed
# (the linear-layer / K-FAC view) ∇_P CE_t has rows a_{t,i} δ_t for i ∈ A_t, so a training sequence m gives
#     g_{m,i} = Σ_{t∈m} a_{t,i} δ_t   for i ∈ U(m), the prototypes m uses,
# and the influence of m on a query q is I(m, q) = g_qᵀ (H + λI)⁻¹ g_m with H ≈ A ⊗ S, A = E[a aᵀ] (K×K,
# the prototype co-usage) and S = E[δ δᵀ] (d×d), means over the training tokens.
#   block  H_ii = A_ii S: I(m, q) = Σ_{i∈U(q)∩U(m)} g_{q,i}ᵀ (A_ii S + λI)⁻¹ g_{m,i}; only the postings of the
#          query's active prototypes are read, and a sequence sharing no prototype with q is never touched (0).
#   kfac   H = A ⊗ S with the co-usage A: both eigenbases invert it; the preconditioned query gradient is dense
#          over the bank (A's eigenvectors couple the prototypes), so every posting is scored.
# λ = attr_damping × mean of the non-zero A_ii (live prototypes) × mean eig(S): the mean eigenvalue of the live
# blocks A_ii ⊗ S, so dead prototypes do not lower the damping.
# Scores are ranked in descending order (proponents first: a positive score means a gradient step on m
# lowers the query's loss). Baselines: the exact prototype-space estimator (exact per-sequence gradients,
# the activations' dependence on P included, with a damped Fisher of window gradients inverted by Woodbury:
# the true Fisher of targets sampled from the model, or the empirical one of the true labels), dense
# TracIn over every parameter (recomputed per query batch, and from a CountSketch cache of the same bytes as
# the prototype cache), and EK-FAC through kronfluence (optional).
# Every prototype-space gradient here is taken along ẑ with r held fixed: δ_t from the closed form, ∇_P by a
# vector-Jacobian product through the prototype path, never autograd of CE through the head. Under detach-zhat
# and detach-r that is ∇_P CE as trained; under full, whose CE gives P no gradient, it is spec §2.3's variant
# (A), and the experiment says so (ROUTING_LABEL).

PROTOTYPE_ANALYSES = ("cards", "attribution", "ekfac", "suppress", "suppress_keywords", "controller")  # PRISM's
ROUTING_LABEL = "prototype path, r held fixed (spec §2.3 A)"  # what the gradients are under --resid-grad full
EXACT_CURVATURE_LABEL = {"ggn": "damped Gauss–Newton matrix of the linear-layer view, exact over every training token",
                         "fisher": "damped true Fisher (≈ Gauss–Newton), targets drawn from the model",
                         "empirical": "damped empirical Fisher of the true-label gradients"}
CACHE_S_LABEL = {"fisher": "token statistics of targets drawn from the model", "empirical": "true-label token statistics"}
ATTR_CHUNK = 2 ** 24  # elements of the largest temporary (N×V probabilities, posting products): 64 MB in fp32
ATTR_TOKENS = 16384   # tokens per batched forward pass
# relative dampings every attribution run also ranks at (damping_sweep): how much of the cached-vs-exact gap is
# the choice of λ. Cheap: the gradients are reused, only the exact reference's N×N factor is redone per value
# (ggn: its conjugate-gradient solve)
ATTR_DAMPING_SWEEP = (1e-3, 1e-2, 1e-1, 1.0, 10.0)
GGN_MAX_BYTES = 8 * 2**30  # --attr-exact-curvature ggn refuses to build past this peak (blocks, per-pair sums; float64)


def attr_clock(device) -> float:
    """perf_counter after the device has finished its queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


@torch.no_grad()
def token_deltas(z, y, W, chunk=ATTR_CHUNK, u=None):
    """δ_t = ∂CE_t/∂ẑ_t = Wᵀ(softmax(W z_t) − e_{y_t}) for z [N, d], y [N] -> [N, d] fp32, in closed form (no
    autograd). Under detach-zhat and detach-r the logits are W(sg(·) + ẑ), so ẑ receives the gradient a dense
    head's z would, and their value is W z (§2.3); under full, ∂CE/∂ẑ with r held fixed (§2.3 A). Token chunks
    keep the N×V probabilities within `chunk`. With uniforms u [S, N] in [0, 1), also S targets per token drawn
    from the same probabilities, ỹ_{s,t} ~ softmax(W z_t) (draw_targets), and their δ̃ -> (δ, δ̃ [S, N, d],
    ỹ [S, N] int64): one softmax per chunk serves the labels and every draw."""
    W = W.float()
    out = torch.empty(z.shape, dtype=torch.float32, device=z.device)
    if u is not None:
        out_drawn = torch.empty(u.shape[0], *z.shape, dtype=torch.float32, device=z.device)
        drawn = torch.empty(u.shape, dtype=torch.long, device=z.device)
    step = max(1, chunk // W.shape[0])
    for s in range(0, z.shape[0], step):
        p = torch.softmax(z[s:s + step].float() @ W.T, dim=-1)
        rows = torch.arange(p.shape[0], device=p.device)
        for j in range(0 if u is None else u.shape[0]):
            ys = drawn[j, s:s + step] = draw_targets(p, u[j, s:s + step])
            q = p.clone()
            q[rows, ys] -= 1
            out_drawn[j, s:s + step] = q @ W
        p[rows, y[s:s + step]] -= 1
        out[s:s + step] = p @ W
    return out if u is None else (out, out_drawn, drawn)


def draw_targets(p, u):
    """One draw per row of the probabilities p [n, V] by inverse CDF from the uniforms u [n] in [0, 1) -> [n] int64.
    The CDF is scaled by its last entry, so a sum a few ulps off 1 cannot push a draw past the vocabulary.
    The uniforms come from a seeded CPU generator, so the draws are the same on every device (up to the cumsum's
    rounding) and do not touch the global RNG."""
    cdf = p.cumsum(-1)
    return torch.searchsorted(cdf, u[:, None] * cdf[:, -1:]).squeeze(1).clamp_max_(p.shape[-1] - 1)


def uniforms(gen, S: int, n: int, device):
    """S rows of n uniforms from the CPU generator `gen`, one call per row (the order every build draws in)."""
    return torch.stack([torch.rand(n, generator=gen) for _ in range(S)]).to(device)


def fisher_draws_problem(M: int, T: int, d: int, S: int, device, exact: bool) -> Optional[str]:
    """The one-line error when S drawn targets per token cannot fit (--attr-fisher-samples 1e9 asked for hundreds
    of GB after the training, and the out-of-memory line named --batch-size), or None. The floor: one batched
    pass's uniforms, draws and their δ̃ (token_deltas: S·n·(4 + 8 + 4d) bytes over its n tokens); for the exact
    reference also the M·S·T drawn targets it keeps beside the larger of that and the (M·S)² float64 Gram."""
    from common import memory_problem

    n = min(M, max(1, ATTR_TOKENS // T)) * T
    per_pass = ("one pass's draws and their δ̃", S * n * (12 + 4 * d))
    parts = dict([per_pass])
    if exact:
        gram = ("the sampled gradients' Gram (float64)", 8 * (M * S) ** 2)
        parts = {"the drawn targets": 4 * M * S * T, **dict([max(per_pass, gram, key=lambda kv: kv[1])])}
    return memory_problem(parts, torch.device(device), "--attr-fisher-samples or --attr-seqs")


def sequence_sums(seq_of_token, idx, a, delta, K: int, chunk=ATTR_CHUNK):
    """g_{m,i} = Σ_{t∈m} a_{t,i} δ_t for every (sequence, prototype) pair with some a_{t,i} > 0, by sort/segment
    ops (no loop over tokens). seq_of_token [N], idx/a [N, k], delta [N, d] -> (keys m·K + i [U], sorted by
    sequence then prototype; g [U, d])."""
    keep = a > 0
    tok = torch.arange(idx.shape[0], device=idx.device)[:, None].expand_as(idx)[keep]
    keys = seq_of_token[tok] * K + idx[keep]
    a_kept = a[keep].float()
    ukeys, inv = torch.unique(keys, return_inverse=True)
    g = torch.zeros(len(ukeys), delta.shape[1], device=delta.device)
    step = max(1, chunk // delta.shape[1])  # the a·δ products of one chunk of (token, slot) entries at a time
    for s in range(0, len(keys), step):
        g.index_add_(0, inv[s:s + step], a_kept[s:s + step, None] * delta[tok[s:s + step]])
    return ukeys, g


def tensor_bytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


@dataclass
class ProtoIndex:
    """An inverted index in CSR layout (spec §7): the postings of prototype i are rows indptr[i]:indptr[i+1] of
    `seq` (the training sequence, int32) and `G` (its d-vector), sequences ascending within a prototype."""
    indptr: torch.Tensor  # [K + 1] int64
    seq: torch.Tensor     # [nnz] int32
    G: torch.Tensor       # [nnz, d] fp32

    @staticmethod
    def from_keys(keys, vecs, K: int) -> "ProtoIndex":
        """keys m·K + i sorted by (m, i), vecs [U, d] -> the index by prototype (a stable sort keeps m ascending)."""
        proto = keys % K
        order = torch.argsort(proto, stable=True)
        indptr = F.pad(torch.cumsum(torch.bincount(proto, minlength=K), 0), (1, 0))
        return ProtoIndex(indptr, (keys // K)[order].to(torch.int32), vecs[order])

    def postings(self, protos):
        """CSR gather without a Python loop: the rows of the postings of `protos` [n] and, per row, its
        position in `protos`."""
        start = self.indptr[protos]
        count = self.indptr[protos + 1] - start
        slot = torch.repeat_interleave(torch.arange(len(protos), device=protos.device), count)
        first = torch.cumsum(count, 0) - count
        return start[slot] + torch.arange(len(slot), device=protos.device) - first[slot], slot

    def proto_of_rows(self):
        K = len(self.indptr) - 1
        return torch.repeat_interleave(torch.arange(K, device=self.indptr.device), self.indptr.diff())

    def nbytes(self) -> int:
        return tensor_bytes(self.indptr, self.seq, self.G)


@dataclass
class AttrCache:
    """The cached attribution state (spec §5.3, §7), from one forward pass over the M training windows: the
    index prototype -> (sequences, g_{m,i}), and the curvature factors A_ii, S (and the co-usage A for kfac)
    with their eigendecompositions."""
    index: ProtoIndex
    A_diag: torch.Tensor            # [K]   A_ii = mean_t a_{t,i}²
    lam_S: torch.Tensor             # [d]   S = mean_t δ_t δ_tᵀ = Q_S diag(λ_S) Q_Sᵀ (δ of drawn targets or labels)
    Q_S: torch.Tensor               # [d, d]
    lam: float                      # damping λ
    M: int
    curvature: str = "block"
    lam_A: Optional[torch.Tensor] = None  # kfac: A = mean_t a_t a_tᵀ = Q_A diag(λ_A) Q_Aᵀ
    Q_A: Optional[torch.Tensor] = None

    def nbytes(self) -> int:
        return self.index.nbytes() + tensor_bytes(self.A_diag, self.lam_S, self.Q_S, self.lam_A, self.Q_A)


def eigh_psd(S):
    """Eigendecomposition of a symmetric PSD matrix in float64 (fp32 eigh loses the small eigenvalues that the
    damping is relative to), negative rounding clamped to 0, returned in fp32."""
    lam, Q = torch.linalg.eigh(S.double())
    return lam.clamp_min(0).float(), Q.float()


@torch.no_grad()
def build_attr_cache(model: PRISM, windows, curvature: str = "block", damping: float = 0.1, s_curvature: str = "empirical",
                     samples: int = 1, seed: int = 0) -> AttrCache:
    """Step 1 of §5.3: one pass (batched, no grad, δ in closed form) over the training windows [M, T + 1] builds
    the index of g_{m,i} and, from the same tokens, A_ii = mean a², S = mean δδᵀ (and A = mean a aᵀ for kfac,
    accumulated as k×k outer products per token: never an N×K matrix). The index always holds the true-label δ;
    S takes them too for s_curvature "empirical", and for "fisher" the δ̃ of `samples` targets per token drawn
    from the model's softmax, K-FAC's true-Fisher factor E_{ỹ~p}[δ̃δ̃ᵀ] (uniforms from a CPU generator seeded
    with `seed`, in build_exact's order: the same draws as the exact fisher reference with the same seed)."""
    model.eval()
    K, d = model.P.shape
    device = model.P.device
    W = model.wte.weight.float()
    M, T = windows.shape[0], windows.shape[1] - 1
    S = torch.zeros(d, d, device=device)
    A_diag = torch.zeros(K, device=device)
    A = torch.zeros(K * K, device=device) if curvature == "kfac" else None
    keys, vecs = [], []
    fisher = s_curvature == "fisher"
    if fisher and (problem := fisher_draws_problem(M, T, d, samples, device, exact=False)) is not None:
        raise RunError(problem)
    gen = torch.Generator().manual_seed(seed)
    B = max(1, ATTR_TOKENS // T)
    for s in range(0, M, B):
        w = windows[s:s + B].to(device)
        z = model.hidden(w[:, :-1]).float().flatten(0, 1)
        idx, a = model.prototypes(z)
        a = a.float()
        if fisher:
            delta, drawn, _ = token_deltas(z, w[:, 1:].flatten(), W, u=uniforms(gen, samples, z.shape[0], device))
            for d_s in drawn:
                S += d_s.T @ d_s / samples
        else:
            delta = token_deltas(z, w[:, 1:].flatten(), W)
            S += delta.T @ delta
        A_diag.index_add_(0, idx.flatten(), a.pow(2).flatten())
        if A is not None:  # entry (i_j, i_l) of a_t a_tᵀ is a_{t,j} a_{t,l}
            A.index_add_(0, (idx[:, :, None] * K + idx[:, None, :]).flatten(),
                         (a[:, :, None] * a[:, None, :]).flatten())
        seq_of_token = torch.arange(s, s + w.shape[0], device=device).repeat_interleave(T)
        k_, g_ = sequence_sums(seq_of_token, idx, a, delta, K)
        keys.append(k_)
        vecs.append(g_)
    N = M * T
    S /= N
    A_diag /= N
    lam_S, Q_S = eigh_psd(S)
    # relative to the mean non-zero eigenvalue, as the exact reference's: A_ii ⊗ S has a zero block for every
    # prototype no training token activates (most of a CPU-preset bank), so a mean over all K·d would damp less
    live = A_diag[A_diag > 0]
    lam = damping * (live.mean().item() if live.numel() else 0.0) * lam_S.mean().item()
    if not lam > 0:
        raise RunError("no training token activates a prototype (every a is 0): nothing to attribute")
    index = ProtoIndex.from_keys(torch.cat(keys), torch.cat(vecs), K)
    cache = AttrCache(index, A_diag, lam_S, Q_S, lam, M, curvature)
    if A is not None:
        cache.lam_A, cache.Q_A = eigh_psd(A.view(K, K) / N)
    return cache


@torch.no_grad()
def query_state(model: PRISM, xq, yq):
    """Step 2's forward: one val prediction per row of xq [Q, T] (the target yq [Q] follows the last position)
    -> its active prototypes idx [Q, k], activations a [Q, k] and δ_q [Q, d]; g_{q,i} = a_{q,i} δ_q."""
    z = model.hidden(xq)[:, -1].float()
    idx, a = model.prototypes(z)
    return idx, a.float(), token_deltas(z, yq, model.wte.weight)


@torch.no_grad()
def precondition(cache: AttrCache, i, g):
    """(H + λI)⁻¹ applied to a query gradient whose non-zero rows are g [n, d] at prototypes i [n] -> (the
    prototypes the result reaches [n'] (None: all K, in order), its rows there [n', d]), with the cache's
    curvature.
    block: v_i = (A_ii S + λI)⁻¹ g_i = Q_S diag(1/(A_ii λ_S + λ)) Q_Sᵀ g_i: the same rows i.
    kfac:  V = (A ⊗ S + λI)⁻¹ G = Q_A [(Q_Aᵀ G Q_S) / (λ_A λ_Sᵀ + λ)] Q_Sᵀ: A's eigenvectors couple the
           prototypes, so V is dense over the bank (cost K²d)."""
    u = g @ cache.Q_S  # rows in S's eigenbasis
    if cache.curvature == "kfac":
        core = (cache.Q_A[i].T @ u) / (cache.lam_A[:, None] * cache.lam_S[None] + cache.lam)
        return None, cache.Q_A @ core @ cache.Q_S.T
    return i, (u / (cache.A_diag[i, None] * cache.lam_S + cache.lam)) @ cache.Q_S.T


@torch.no_grad()
def score_postings(index: ProtoIndex, i, v, M: int, dtype=torch.float32, chunk=ATTR_CHUNK):
    """scores[m] = Σ_i g_{m,i}·v_i over the postings of the prototypes i [n] (v [n, d]) -> (scores [M] in dtype,
    scored [M] bool: the sequences touched). Only those postings are read, a chunk of rows at a time. i = None:
    every prototype (v [K, d]), read in place in the index's order, each row's prototype found by bisecting
    indptr (no gather of G, no per-posting index arrays)."""
    scores = torch.zeros(M, dtype=dtype, device=v.device)
    scored = torch.zeros(M, dtype=torch.bool, device=v.device)
    step = max(1, chunk // index.G.shape[1])
    if i is None:
        for s in range(0, len(index.seq), step):
            e = min(s + step, len(index.seq))
            proto = torch.searchsorted(index.indptr, torch.arange(s, e, device=v.device), right=True) - 1
            seq = index.seq[s:e].long()
            scores.index_add_(0, seq, (index.G[s:e] * v[proto]).sum(-1).to(dtype))
            scored[seq] = True
        return scores, scored
    rows, slot = index.postings(i)
    seq = index.seq[rows].long()
    for s in range(0, len(rows), step):
        scores.index_add_(0, seq[s:s + step], (index.G[rows[s:s + step]] * v[slot[s:s + step]]).sum(-1).to(dtype))
    scored[seq] = True
    return scores, scored


@torch.no_grad()
def cached_scores(cache: AttrCache, idx, a, delta):
    """Step 2 for one query (idx, a [k], delta [d]) -> (scores [M], scored [M] bool: the sequences touched): the
    query's gradient rows g_{q,i} = a_{q,i} δ_q at its active prototypes, preconditioned, then dotted with the
    postings. block reads the postings of the query's active prototypes only; kfac's V is dense over the bank,
    so it scores every posting."""
    active = a > 0
    i = idx[active]
    return score_postings(cache.index, *precondition(cache, i, a[active, None] * delta), cache.M)


def proto_vjp(model: PRISM, z, delta):
    """(∂ẑ/∂P)ᵀ δ summed over the tokens of z [N, d] (fixed, no grad), delta [N, d] -> [K, d]: autograd through
    the model's own prototype path (top-k cosines, the --act variant, the reconstruction), so the
    activations' dependence on P is included. Under detach-zhat and detach-r P reaches the logits only through
    ẑ, with ∂CE_t/∂ẑ_t = δ_t, so this is the exact ∇_P Σ_t CE_t, and the T×V logits are never differentiated
    (under full, §2.3 A's gradient with r held fixed)."""
    with torch.enable_grad():
        idx, a = model.prototypes(z)
        zhat = reconstruct(idx, a, model.P)
        return torch.autograd.grad(zhat, model.P, delta)[0].float()


@dataclass
class ExactAttr:
    """Step 3, the spec's "full prototype-space gradients" upper bound: no linear-layer view, no block
    approximation. The exact per-sequence gradients g_m = ∇_P L_m along the prototype path (proto_vjp), stored
    row-sparse in the same CSR index (a sequence's gradient is non-zero only on the rows of the prototypes it
    activates, so this is the cache's size, where the dense [M, K·d] matrix would be 103 GB at M = 4096,
    K = 8192, d = 768). The curvature is F = G̃ᵀG̃/N over N row-sparse gradients G̃, inverted by Woodbury:
      empirical  G̃ = G (N = M), the true-label gradients themselves; with the Cholesky factor of M λ' I + G Gᵀ,
                     G (F + λ'I)⁻¹ g_q = (1/λ') [I − G Gᵀ (M λ' I + G Gᵀ)⁻¹] G g_q = M (M λ' I + G Gᵀ)⁻¹ G g_q.
      fisher     the true Fisher E_{ỹ~p_model}[g̃ g̃ᵀ] (= the Gauss–Newton matrix for softmax CE, spec §5.3's
                 reading), sampled: G̃ holds S gradients per window (row m·S + s), same routing and a(P), with
                 targets ỹ_t drawn from the model's softmax at every position (N = M·S). The scores still take the
                 true-label G and g_q, so the push-through form above does not apply; with the Cholesky factor of
                 N λ' I + G̃ G̃ᵀ (N×N) and the cross Gram C = G G̃ᵀ (M×N),
                     G (F + λ'I)⁻¹ g_q = (1/λ') [G g_q − C (N λ' I + G̃ G̃ᵀ)⁻¹ G̃ g_q].
    λ' = attr_damping × |G̃|²_F / N², the mean *non-zero* eigenvalue of F (its rank is at most N, so the
    mean over all K·d eigenvalues would be ~N/(Kd) smaller and leave the inverse effectively undamped).
      ggn        the Gauss–Newton matrix of the linear-layer view, summed exactly over every training token
                 (BlockGGN; the gradients stay the exact ones above); no factor: (H + λ'I)⁻¹ g_q by conjugate
                 gradients, λ' = attr_damping × trace(H) / (live·d), its mean eigenvalue over the live rows.
    Each method's λ is relative to the mean eigenvalue of its own curvature, so a rescaled curvature ranks alike."""
    index: ProtoIndex
    L: Optional[torch.Tensor]  # [N, N] float64, Cholesky factor of N λ' I + G̃ G̃ᵀ (None for ggn)
    lam: float
    M: int
    curvature: str = "empirical"
    fisher: Optional[ProtoIndex] = None   # fisher: G̃, the sampled-target gradients, N = M·S rows
    C: Optional[torch.Tensor] = None      # fisher: [M, N] float64, G G̃ᵀ
    targets: Optional[torch.Tensor] = None  # fisher: [M, S, T] the drawn ỹ (int32), kept to audit G̃ (not scored)
    ggn: Optional["BlockGGN"] = None        # ggn: the curvature itself, solved per query (no factor)

    def nbytes(self) -> int:
        return (self.index.nbytes() + tensor_bytes(self.L, self.C) + (self.fisher.nbytes() if self.fisher else 0)
                + (self.ggn.nbytes() if self.ggn else 0))

    def redamped(self, ratio: float) -> "ExactAttr":
        """The same reference with λ' × ratio: the undamped Gram G̃ G̃ᵀ = L Lᵀ − N λ' I recovered from the factor
        (float64), damped again and re-factored; the gradients, C and the draws are shared, not copied. ggn has no
        factor: only λ' changes."""
        if self.ggn is not None:
            return replace(self, lam=self.lam * ratio)
        N = len(self.L)
        eye = torch.eye(N, dtype=self.L.dtype, device=self.L.device)
        lam = self.lam * ratio
        L, info = torch.linalg.cholesky_ex(self.L @ self.L.T + N * (lam - self.lam) * eye)
        if info.item():
            raise RunError(f"the exact baseline's N λ' I + G̃ G̃ᵀ at {ratio:g} × its damping is not positive definite "
                           "in float precision; choose another --attr-damping")
        return replace(self, L=L, lam=lam)


def gram(index: ProtoIndex, M: int, other: Optional[ProtoIndex] = None, N: int = 0, chunk=4 * ATTR_CHUNK):
    """G Gᵀ [M, M] from the row-sparse G, or with `other` (N rows) the cross Gram G G̃ᵀ [M, N]: the columns of a
    few prototypes at a time made dense ([M, c·d]), then one GEMM each, never the whole [M, K·d] matrix."""
    K, d = len(index.indptr) - 1, index.G.shape[1]
    sides = [(index, M, index.proto_of_rows())]
    if other is not None:
        sides.append((other, N, other.proto_of_rows()))
    out = torch.zeros(M, N if other is not None else M, device=index.G.device)
    c = max(1, chunk // (max(M, N) * d))

    def dense(ix, rows, proto, i0, i1):
        r0, r1 = int(ix.indptr[i0]), int(ix.indptr[i1])
        if r0 == r1:
            return None
        D = torch.zeros(rows, i1 - i0, d, device=ix.G.device)
        D[ix.seq[r0:r1].long(), proto[r0:r1] - i0] = ix.G[r0:r1]
        return D.view(rows, -1)
    for i0 in range(0, K, c):
        i1 = min(K, i0 + c)
        D = [dense(*side, i0, i1) for side in sides]
        if all(x is not None for x in D):
            out += D[0] @ D[-1].T
    return out


@torch.no_grad()
def build_exact(model: PRISM, windows, damping: float = 0.1, curvature: str = "empirical", samples: int = 1,
                seed: int = 0) -> ExactAttr:
    """The exact gradient of every training sequence (z and δ batched without grad, then one prototype-path
    vector-Jacobian product per sequence), its non-zero rows kept; for the fisher curvature also `samples`
    gradients per sequence with targets drawn from the model's softmax (uniforms from a CPU generator seeded with
    `seed`: the same draws in every run); then the curvature's Gram and its damped Cholesky factor."""
    model.eval()
    K, d = model.P.shape
    device = model.P.device
    W = model.wte.weight.float()
    M, T = windows.shape[0], windows.shape[1] - 1
    fisher = curvature == "fisher"
    S = samples if fisher else 1
    if fisher and (problem := fisher_draws_problem(M, T, d, S, device, exact=True)) is not None:
        raise RunError(problem)
    gen = torch.Generator().manual_seed(seed)
    true, sampled = ([], []), ([], [])  # (keys, rows) of G and of G̃
    states = []  # ggn: the tokens' final states, kept for build_ggn (no second forward pass)
    targets = torch.zeros(M, S, T, dtype=torch.int32) if fisher else None

    def keep(out, n, g):
        rows = g.ne(0).any(-1).nonzero().squeeze(1)  # U(m): the rows this sequence's gradient reaches
        out[0].append(n * K + rows)
        out[1].append(g[rows])
    B = max(1, ATTR_TOKENS // T)
    for s in range(0, M, B):
        w = windows[s:s + B].to(device)
        z = model.hidden(w[:, :-1]).float()
        if curvature == "ggn":
            states.append(z.flatten(0, 1))
        if fisher:  # ỹ ~ softmax(W z_t) at every position, S times, from the softmax the labels' δ takes
            delta, drawn, y = token_deltas(z.flatten(0, 1), w[:, 1:].flatten(), W,
                                           u=uniforms(gen, S, z.shape[0] * T, device))
        else:
            delta = token_deltas(z.flatten(0, 1), w[:, 1:].flatten(), W)
        delta = delta.view(z.shape)
        for b in range(w.shape[0]):  # one vector-Jacobian product per sequence: its own gradient
            keep(true, s + b, proto_vjp(model, z[b], delta[b]))
        for j in range(S if fisher else 0):  # then the same gradient with each draw's targets
            targets[s:s + w.shape[0], j] = y[j].view(-1, T).cpu().int()
            delta_j = drawn[j].view(z.shape)
            for b in range(w.shape[0]):
                keep(sampled, (s + b) * S + j, proto_vjp(model, z[b], delta_j[b]))
    index = ProtoIndex.from_keys(torch.cat(true[0]), torch.cat(true[1]), K)
    if curvature == "ggn":  # build_ggn refuses a bank no token activates, so mean_eig > 0
        ggn = build_ggn(model, torch.cat(states))
        return ExactAttr(index, None, damping * ggn.mean_eig, M, curvature, ggn=ggn)
    curv = ProtoIndex.from_keys(torch.cat(sampled[0]), torch.cat(sampled[1]), K) if fisher else index
    N = M * S
    # G̃ᵀG̃/N has rank <= N: its mean *non-zero* eigenvalue is ~|G̃|²/N², the scale λ' is relative to
    lam = damping * curv.G.pow(2).sum().item() / (N * N)
    if not lam > 0:
        raise RunError("every training sequence has a zero prototype-space gradient: nothing to attribute")
    L, info = torch.linalg.cholesky_ex(gram(curv, N).double() + N * lam * torch.eye(N, dtype=torch.float64,
                                                                                     device=device))
    if info.item():
        raise RunError(f"the exact baseline's N λ' I + G̃ G̃ᵀ ({curvature}) is not positive definite in float "
                       f"precision; raise --attr-damping (now {damping:g})")
    if not fisher:
        return ExactAttr(index, L, lam, M)
    return ExactAttr(index, L, lam, M, curvature, curv, gram(index, M, curv, N).double(), targets)


@dataclass
class BlockGGN:
    """--attr-exact-curvature ggn: the Gauss–Newton matrix of CE in prototype space in the linear-layer view (a
    held fixed), the matrix that K-FAC's A ⊗ S and the cache's blocks A_ii·S approximate, summed exactly over the
    N training tokens instead:
        H = (1/N) Σ_t (a_t a_tᵀ) ⊗ B_t,   B_t = Wᵀ(diag p_t − p_t p_tᵀ)W = E_{ỹ~p_t}[δ̃ δ̃ᵀ]   (d×d),
    so block (i, j) = (1/N) Σ_t a_{t,i} a_{t,j} B_t = Wᵀ diag(c_ij) W − (1/N) Σ_t a_{t,i} a_{t,j} u_t u_tᵀ with
    c_ij = (1/N) Σ_t a_{t,i} a_{t,j} p_t and u_t = Wᵀ p_t. Only prototypes that some token uses (live) and pairs
    that some token uses together have blocks: the matrix is block-sparse, stored as its non-zero d×d blocks
    (both (i, j) and (j, i)), and (H + λI)⁻¹ b is solved by conjugate gradients preconditioned with the inverse
    diagonal blocks (ggn_solve), never as a dense (live·d)² matrix. Its cost is (pairs)·V·d² + N·k²·d² flops:
    CPU-preset sizes (the run logs its live prototypes and blocks), not the paper's."""
    live: torch.Tensor    # [L] the live prototypes (ascending)
    rows: torch.Tensor    # [nb] block row, as a position in `live`
    cols: torch.Tensor    # [nb] block column
    blocks: torch.Tensor  # [nb, d, d] float64
    mean_eig: float       # trace(H) / (L·d): the mean eigenvalue over the live rows, the damping's scale

    def nbytes(self) -> int:
        return tensor_bytes(self.live, self.rows, self.cols, self.blocks)


@torch.no_grad()
def build_ggn(model: PRISM, z, chunk: int = 2048) -> BlockGGN:
    """BlockGGN from the training tokens' final states z [N, d] (build_exact's forward pass, no grad): per token
    its active prototypes and a, and p_t = softmax(W z_t); the pair sums c_ij and Σ a a u uᵀ as sparse
    [pairs × tokens] products, then Wᵀ diag(c_ij) W for a few pairs at a time."""
    model.eval()
    K, d = model.P.shape
    device = model.P.device
    W = model.wte.weight.float()
    z = z.float()
    idx, a = model.prototypes(z)
    a = a.float()
    N, k = idx.shape
    key = (idx[:, :, None] * K + idx[:, None, :]).flatten(1)  # [N, k²] ordered pairs (i, j) of each token
    weight = (a[:, :, None] * a[:, None, :]).flatten(1)
    # each unordered pair once, and only where both activations are non-zero: a top-k member with a = 0 gives
    # no block (nor, through a, any gradient: it is not live)
    upper = ((idx[:, :, None] <= idx[:, None, :]).flatten(1)) & (weight > 0)
    pairs, pair_of = torch.unique(key[upper], return_inverse=True)
    if not len(pairs):
        raise RunError("no training token activates a prototype (every a is 0): nothing to attribute")
    i, j = pairs // K, pairs % K
    off = (i != j).nonzero().squeeze(1)  # each off-diagonal block also goes in transposed, as block (j, i)
    V, nb = W.shape[0], len(pairs) + len(off)
    # the peak: c_ij and Σ a a u uᵀ beside the blocks, and one token chunk's p and u uᵀ
    need = (len(pairs) * (V + d * d) + nb * d * d + min(chunk, N) * (V + d * d)) * 8
    if need > GGN_MAX_BYTES:
        raise RunError(f"--attr-exact-curvature ggn would hold {need / 2**30:.1f} GiB ({len(pairs):,} pairs of "
                       f"prototypes used together, d = {d}, V = {V:,}), over its {GGN_MAX_BYTES / 2**30:g} GiB "
                       "limit: it is meant for CPU-preset sizes; use --attr-exact-curvature empirical or fisher")
    tok = torch.arange(N, device=device)[:, None].expand_as(key)[upper]
    w_ = weight[upper].double() / N
    c = torch.zeros(len(pairs), V, dtype=torch.float64, device=device)      # c_ij [pairs, V]
    uu = torch.zeros(len(pairs), d * d, dtype=torch.float64, device=device)  # (1/N) Σ a a u uᵀ
    for s in range(0, N, chunk):
        sel = (tok >= s) & (tok < s + chunk)
        p = torch.softmax(z[s:s + chunk] @ W.T, dim=-1).double()
        u = p @ W.double()
        mix = torch.sparse_coo_tensor(torch.stack([pair_of[sel], tok[sel] - s]), w_[sel],
                                      (len(pairs), len(p)), check_invariants=True).coalesce()
        c += torch.sparse.mm(mix, p)
        uu += torch.sparse.mm(mix, (u[:, :, None] * u[:, None, :]).flatten(1))
    blocks = torch.empty(nb, d, d, dtype=torch.float64, device=device)  # filled in place: no second copy
    blocks[:len(pairs)] = -uu.view(-1, d, d)
    del uu
    Wd = W.double()
    step = max(1, ATTR_CHUNK // (V * d))
    for b in range(0, len(pairs), step):
        e = min(b + step, len(pairs))
        blocks[b:e] += (Wd.T[None] * c[b:e, None, :]) @ Wd
    del c
    for b in range(0, len(off), step):
        blocks[len(pairs) + b:len(pairs) + b + step] = blocks[off[b:b + step]].transpose(1, 2)
    live = torch.unique(torch.cat([i, j]))
    pos = torch.full((K,), -1, dtype=torch.long, device=device)
    pos[live] = torch.arange(len(live), device=device)
    rows = torch.cat([pos[i], pos[j][off]])
    cols = torch.cat([pos[j], pos[i][off]])
    trace = blocks[:len(pairs)][i == j].diagonal(dim1=1, dim2=2).sum().item()
    return BlockGGN(live, rows, cols, blocks, trace / (len(live) * d))


def ggn_solve(ggn: BlockGGN, b, lam: float, rtol: float = 1e-8, maxiter: int = 2000):
    """(H + λI)⁻¹ b for b [R, L, d] (R right-hand sides on the live rows) by conjugate gradients in float64,
    each side with its own step sizes, every side's product with H in one pass over the blocks (the pass is
    memory-bound: R sides cost little more than one). Preconditioned with the inverse of each diagonal block
    H_ii + λI (block Jacobi: exact when no two prototypes are used together, the paper's localised curvature).
    Stops when every side has |r| <= rtol |b|; RunError if one has not within maxiter."""
    R, L, d = b.shape
    eye = torch.eye(d, dtype=torch.float64, device=b.device)
    diag = ggn.rows == ggn.cols
    D = torch.zeros(L, d, d, dtype=torch.float64, device=b.device)
    D[ggn.rows[diag]] = ggn.blocks[diag]
    D_inv = torch.cholesky_inverse(torch.linalg.cholesky(D + lam * eye))

    def H(x):  # x [R, L, d]: the blocks times each side's columns, [nb, d, d] @ [nb, d, R]
        y = (ggn.blocks @ x[:, ggn.cols].permute(1, 2, 0)).permute(2, 0, 1)
        return (lam * x).index_add_(1, ggn.rows, y)

    def precondition(r):
        return (D_inv @ r.permute(1, 2, 0)).permute(2, 0, 1)

    def dot(u, v):  # per side, [R, 1, 1]
        return (u * v).sum((1, 2), keepdim=True)
    b = b.double()
    x = torch.zeros_like(b)
    r = b.clone()
    zr = precondition(r)
    p = zr.clone()
    rz = dot(r, zr)
    bound = rtol * b.flatten(1).norm(dim=1)
    for _ in range(maxiter):
        done = r.flatten(1).norm(dim=1) <= bound
        if done.all():
            return x
        Hp = H(p)
        alpha = torch.where(done[:, None, None], 0.0, rz / dot(p, Hp))  # a finished side stays where it is
        x += alpha * p
        r -= alpha * Hp
        zr = precondition(r)
        rz, rz_old = dot(r, zr), rz
        p = zr + torch.where(done[:, None, None], 0.0, rz / rz_old) * p
    if (r.flatten(1).norm(dim=1) <= bound).all():
        return x
    raise RunError(f"the ggn reference's conjugate gradients did not reach a relative residual of {rtol:g} in "
                   f"{maxiter} steps at λ' = {lam / ggn.mean_eig:g} × its mean eigenvalue; raise --attr-damping")


@torch.no_grad()
def exact_scores(ex: ExactAttr, g_q, curvature: bool = True):
    """The scores G (H + λ'I)⁻¹ g_q for one query's exact gradient g_q [K, d] -> [M]. Woodbury for the Fisher
    curvatures (ExactAttr: M (M λ' I + G Gᵀ)⁻¹ G g_q for the empirical one, (1/λ') [G g_q − C (N λ' I + G̃ G̃ᵀ)⁻¹
    G̃ g_q] for the sampled fisher): G g_q (and G̃ g_q) read only the postings of the rows where g_q is non-zero,
    the solve then touches every sequence. ggn: conjugate gradients (exact_scores_batch).
    curvature=False: G g_q alone, the plain gradient dot products (the diagnostic without curvature)."""
    if curvature and ex.ggn is not None:
        return exact_scores_batch(ex, [g_q])[0]
    rows_q = g_q.ne(0).any(-1).nonzero().squeeze(1)
    Gg = score_postings(ex.index, rows_q, g_q[rows_q], ex.M, torch.float64)[0]
    if not curvature:
        return Gg.float()
    if ex.fisher is None:
        return (ex.M * torch.cholesky_solve(Gg[:, None], ex.L)[:, 0]).float()
    Fg = score_postings(ex.fisher, rows_q, g_q[rows_q], len(ex.L), torch.float64)[0]  # G̃ g_q
    return ((Gg - ex.C @ torch.cholesky_solve(Fg[:, None], ex.L)[:, 0]) / ex.lam).float()


@torch.no_grad()
def exact_scores_batch(ex: ExactAttr, grads) -> torch.Tensor:
    """exact_scores for several queries' g_q [K, d] -> [Q, M]. The ggn curvature solves them together (one pass
    over its blocks per step serves every query); a query's rows outside the live prototypes meet no training
    gradient, so they score nothing and are left out of the solve. The others, one query at a time."""
    if ex.ggn is None:
        return torch.stack([exact_scores(ex, g_q) for g_q in grads])
    v = ggn_solve(ex.ggn, torch.stack([g_q[ex.ggn.live] for g_q in grads]), ex.lam)
    return torch.stack([score_postings(ex.index, ex.ggn.live, v_q, ex.M, torch.float64)[0].float() for v_q in v])


@torch.no_grad()
def exact_scores_with_cache_curvature(ex: ExactAttr, cache: AttrCache, g_q):
    """The exact gradients (query g_q [K, d] and every g_m) ranked with the cache's curvature, Σ g_qᵀ (H + λI)⁻¹ g_m
    with H = A_ii S blocks or A ⊗ S -> [M]: the diagnostic that tells the cache's two approximations apart. Against
    the cached scores only the gradients differ (a held fixed or not); against the exact scores only the
    curvature (the cache's token statistics or the exact reference's damped Fisher of window gradients, true or
    empirical)."""
    rows_q = g_q.ne(0).any(-1).nonzero().squeeze(1)
    return score_postings(ex.index, *precondition(cache, rows_q, g_q[rows_q]), ex.M)[0]


@torch.no_grad()
def damping_sweep(cache: AttrCache, ex: ExactAttr, states, query_grads, damping: float,
                  grid=ATTR_DAMPING_SWEEP, own: Optional[dict] = None) -> list:
    """The cached and exact rankings again at every relative damping of `grid` and the run's own (`damping`, the
    λ that built cache and ex): each method's λ keeps its own scale (the mean non-zero eigenvalue of its
    curvature) and takes the new factor. states: each query's (idx, a, δ) (query_state), query_grads: its exact
    g_q. -> one dict per damping (attr_damping: the relative factor), ascending: the cached method against
    exact, and the two one-at-a-time diagnostics (the cache's curvature in both rankings; the exact gradients
    with the cache's curvature against exact), top-10/top-100 overlaps each. own: the run's figures at `damping`
    (the same keys), taken as that row instead of recomputing them. A λ at which the exact reference fails
    (RunError) gives a row {attr_damping, skipped: the reason}. At small λ the empirical reference's rank-M
    Fisher is barely damped and ranks by its own inverse; as λ grows both sides tend to plain gradient dot
    products (gradients_only)."""
    out = []
    for rel in sorted(set(grid) | {damping}):
        if rel == damping and own is not None:
            out.append({"attr_damping": rel, **own})
            continue
        c = replace(cache, lam=cache.lam * rel / damping)
        try:  # a reference that fails at this λ (a factor, or conjugate gradients short of it) costs its row
            e = ex if rel == damping else ex.redamped(rel / damping)
            exact = exact_scores_batch(e, query_grads)
        except RunError as err:
            out.append({"attr_damping": rel, "skipped": str(err)})
            continue
        cached = torch.stack([cached_scores(c, *state)[0] for state in states])
        cache_curv = torch.stack([exact_scores_with_cache_curvature(e, c, g_q) for g_q in query_grads])
        out.append({"attr_damping": rel, "cached": overlaps(cached, exact),
                    "same_curvature": overlaps(cached, cache_curv), "curvature_only": overlaps(cache_curv, exact)})
    return out


@torch.no_grad()
def fixed_a_spectrum(cache: AttrCache, ex: ExactAttr, states, query_grads, damping: float,
                     grid=ATTR_DAMPING_SWEEP, chunk=ATTR_CHUNK) -> dict:
    """Where the cache's fixed-a gradients g^c differ from the exact ones g (a's dependence on P included), in the
    eigenbasis of the cache's curvature H: per eigen-direction v_j (eigenvalue μ_j) the energies Σ_m (v_jᵀ g_m)²
    and Σ_m (v_jᵀ e_m)² of the training windows' exact gradients and errors e_m = g_m − g^c_m, and the queries'
    alike (states: their (idx, a, δ); query_grads: their exact g_q). -> {"lam0": λ₀, "block": …, "kfac": …}, kfac
    only when the cache holds A's eigenbasis; each curvature's entry holds
      sweep  per relative damping of the grid and the run's own: ρ = sqrt(Σ_m e_mᵀ(H + λI)⁻¹e_m /
             Σ_m g_mᵀ(H + λI)⁻¹g_m), the error's size in the metric the ranking at that λ uses, for the training
             windows ("train") and the queries ("query");
      bands  μ/λ₀ (λ₀ = the cache's λ / damping: the live blocks' mean eigenvalue, the damping's scale) cut at the
             grid's values, so the directions below rel are those the damping dominates at --attr-damping rel:
             per band its number of directions, its share of Σ|g|² and of Σ|e|², and |e|/|g| within it (training
             windows and queries; None where the band holds no gradient).
    Eigenbases: block, (prototype i's row) ⊗ (S's eigenvector b), μ = A_ii λ_S,b; kfac, (A's eigenvector a) ⊗
    (S's b), μ = λ_A,a λ_S,b; K·d directions each. Only the rows some gradient uses are read (a prototype no
    window or query uses has a zero row in every gradient), a few windows at a time: kfac costs K·L·d per window
    for L such rows."""
    K, d = len(cache.index.indptr) - 1, len(cache.lam_S)
    device = cache.lam_S.device
    used = (cache.index.indptr.diff() > 0) | (ex.index.indptr.diff() > 0)
    for (idx, a, _), g_q in zip(states, query_grads):
        used[idx[a > 0]] = True
        used |= g_q.ne(0).any(-1)
    rows = used.nonzero().squeeze(1)
    pos = torch.full((K,), -1, dtype=torch.long, device=device)
    pos[rows] = torch.arange(len(rows), device=device)
    kfac = cache.curvature == "kfac"
    Q_A = cache.Q_A[rows] if kfac else None  # [L, K]: A's eigenvectors' entries on the used rows

    def energies(pairs):
        """pairs: (exact, fixed-a) gradient batches [n, L, d] -> {curvature: (Σ (vᵀg)², Σ (vᵀe)²), each [K, d]}."""
        out = {name: [torch.zeros(K, d, dtype=torch.float64, device=device) for _ in range(2)]
               for name in ("block", "kfac")[:1 + kfac]}
        for g, g_c in pairs:
            for j, x in enumerate((g, g - g_c)):
                u = x @ cache.Q_S  # rows in S's eigenbasis
                out["block"][j][rows] += u.double().pow(2).sum(0)
                if kfac:  # Q_Aᵀ over the rows: [n, K, d], within the chunk
                    out["kfac"][j] += torch.einsum("la,nld->nad", Q_A, u).double().pow(2).sum(0)
        return out

    def window_rows(index, proto, m0, m1):
        sel = (index.seq >= m0) & (index.seq < m1)
        x = torch.zeros(m1 - m0, len(rows), d, device=device)
        x[index.seq[sel].long() - m0, pos[proto[sel]]] = index.G[sel]
        return x
    protos = (ex.index.proto_of_rows(), cache.index.proto_of_rows())
    step = max(1, chunk // (K * d))
    train = energies((window_rows(ex.index, protos[0], m0, min(m0 + step, ex.M)),
                      window_rows(cache.index, protos[1], m0, min(m0 + step, ex.M))) for m0 in range(0, ex.M, step))

    def query_rows(idx, a, delta, g_q):
        g_c = torch.zeros(1, len(rows), d, device=device)
        g_c[0, pos[idx[a > 0]]] = a[a > 0, None] * delta
        return g_q[rows][None].float(), g_c
    query = energies(query_rows(*state, g_q) for state, g_q in zip(states, query_grads))
    lam0 = cache.lam / damping
    eig = {"block": cache.A_diag[:, None] * cache.lam_S[None]}  # μ per direction, [K, d]
    if kfac:
        eig["kfac"] = cache.lam_A[:, None] * cache.lam_S[None]

    def ratio(num, den):
        return math.sqrt(num / den) if den > 0 else None

    def share(e, m):
        return (e[m].sum() / e.sum()).item() if e.sum() > 0 else None
    edges = sorted(grid)
    bounds = list(zip([None] + edges, edges + [None]))
    out = {"lam0": lam0}
    for name, (eG, eE) in train.items():
        mu = eig[name].double()
        qG, qE = query[name]
        sweep = []
        for rel in sorted(set(grid) | {damping}):
            w = 1 / (mu + rel * lam0)
            sweep.append({"attr_damping": rel, "train": ratio((eE * w).sum().item(), (eG * w).sum().item()),
                          "query": ratio((qE * w).sum().item(), (qG * w).sum().item())})
        bands = []
        for lo, hi in bounds:
            m = torch.ones_like(mu, dtype=torch.bool)
            if lo is not None:
                m &= mu >= lo * lam0
            if hi is not None:
                m &= mu < hi * lam0
            bands.append({"band": [lo, hi], "directions": int(m.sum()),
                          "gradient share": share(eG, m), "error share": share(eE, m),
                          "train": ratio(eE[m].sum().item(), eG[m].sum().item()),
                          "query": ratio(qE[m].sum().item(), qG[m].sum().item())})
        out[name] = {"sweep": sweep, "bands": bands}
    return out


def exact_query_grad(model: PRISM, xq, yq):
    """The query's exact prototype-space gradient ∇_P CE of its one prediction (xq [T], target yq) -> [K, d]."""
    with torch.no_grad():
        z = model.hidden(xq[None])[0, -1:].float()
    return proto_vjp(model, z, token_deltas(z, yq.reshape(1), model.wte.weight))


def dense_scores(model: PRISM, windows, xq, yq) -> tuple:
    """Step 4, dense gradient similarity over every parameter (TracIn at the final checkpoint): score(m, q) =
    ∇_θ L_m · ∇_θ L_q, L_m the summed CE of training window m, L_q the query's CE. Nothing is stored: the Q
    query gradients are computed once, then each training gradient is recomputed and dotted with all of them,
    which is what a post-hoc method pays per query batch. -> (scores [Q, M], seconds and bytes held, each as
    {"single": one query alone, "batch": per query in a batch of Q})."""
    model.eval()
    device = model.P.device
    params = [p for p in model.parameters() if p.requires_grad]

    def flat_grad(loss):
        return flat_param_grad(loss, params)
    with torch.enable_grad():  # warm-up (first-call allocations), untimed, as for the cached and exact methods
        flat_grad(query_ce(model, xq[:1], yq[0]))
        w = windows[0].to(device)
        flat_grad(F.cross_entropy(model(w[None, :-1])[0].float(), w[1:], reduction="sum"))
    t0 = attr_clock(device)
    with torch.enable_grad():
        gq = torch.stack([flat_grad(query_ce(model, xq[j:j + 1], yq[j])) for j in range(len(xq))])
        t1 = attr_clock(device)
        scores = torch.empty(len(xq), windows.shape[0], device=device)
        for m in range(windows.shape[0]):
            w = windows[m].to(device)
            g = flat_grad(F.cross_entropy(model(w[None, :-1])[0].float(), w[1:], reduction="sum"))
            scores[:, m] = gq @ g
    t2 = attr_clock(device)
    # one query alone pays its own gradient and all M training gradients; a batch of Q shares the M. Memory is
    # what the method holds, as for the cached and exact rows: one query alone its gradient and one training
    # gradient at a time, a batch its Q query gradients and one training gradient
    seconds = {"single": (t1 - t0) / len(xq) + (t2 - t1), "batch": (t2 - t0) / len(xq)}
    grad = gq.shape[1] * gq.element_size()
    return scores, seconds, {"single": 2 * grad, "batch": (len(xq) + 1) * grad}


def flat_param_grad(loss, params) -> torch.Tensor:
    """∇ loss over every parameter in `params`, flattened into one fp32 vector (zeros where unused)."""
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1).float() for g, p in zip(grads, params)])


def query_ce(model: PRISM, x, y, reduction: str = "mean"):
    """The queries' loss: CE of each row's last-position prediction (x [B, T], targets y [B]) as the plain W z of
    that position alone (the other positions' logits would cost time and change nothing). The head's logits have
    this value, but under detach-zhat and detach-r not this gradient, which is the one a training step changes the
    loss by (module docstring, the retraining check)."""
    z = model.hidden(x)[:, -1]
    return F.cross_entropy(F.linear(z, model.wte.weight).float(), y.reshape(-1), reduction=reduction)


def sketched_dense_scores(model: PRISM, windows, xq, yq, nbytes: int, seed: int = 0) -> dict:
    """Step 4b, dense TracIn at matched cache memory (spec §5.3: "wall-clock per query at matched cache memory").
    Every training window's all-parameter gradient is CountSketched once into D = nbytes / (4 M) float32
    buckets and cached, so a query pays one backward, its sketch and M dot products, as the cached prototype
    method pays one forward and its postings. Parameter j goes to bucket h(j) with sign s(j), from 2-universal
    hashes ((α j + β) mod p, p = 2³¹ - 1, seeded) computed on the fly from j, so the sketch holds no state beside
    the cache: E[<Sg, Sh>] = <g, h>. -> dict(scores [Q, M], seconds per query (one at a time, hashing included),
    bytes (the M×D sketches), setup seconds, D, hash_seconds: the hashing's share of the seconds)."""
    model.eval()
    device = model.P.device
    params = [p for p in model.parameters() if p.requires_grad]
    n, M = sum(p.numel() for p in params), windows.shape[0]
    D = max(1, nbytes // (4 * M))
    p31 = 2**31 - 1
    a_h, b_h, a_s, b_s = torch.randint(1, p31, (4,), generator=torch.Generator().manual_seed(seed)).tolist()

    def hashes():
        j = torch.arange(n, device=device)
        return (a_h * j + b_h) % p31 % D, 1.0 - 2.0 * ((a_s * j + b_s) % p31 % 2)  # bucket h(j), sign s(j)

    def sketch(loss, hashed=None):
        bucket, sign = hashed if hashed is not None else hashes()
        return torch.zeros(D, device=device).index_add_(0, bucket, sign * flat_param_grad(loss, params))
    t0 = attr_clock(device)
    with torch.enable_grad():
        hashed = hashes()  # held while the cache is built, then dropped: a query recomputes it
        cache = torch.stack([sketch(F.cross_entropy(model(w[None, :-1])[0].float(), w[1:], reduction="sum"), hashed)
                             for w in windows.to(device)])  # [M, D]
        del hashed
        setup = attr_clock(device) - t0
        sketch(query_ce(model, xq[:1], yq[0]))  # warm-up, untimed
        scores, times, hash_times = [], [], []
        for j in range(len(xq)):
            t0 = attr_clock(device)
            hashed = hashes()  # part of the query's cost (no state beside the cache), timed apart to be seen
            hash_times.append(attr_clock(device) - t0)
            scores.append(cache @ sketch(query_ce(model, xq[j:j + 1], yq[j]), hashed))
            times.append(attr_clock(device) - t0)
    return {"scores": torch.stack(scores), "seconds": sum(times) / len(xq), "bytes": tensor_bytes(cache),
            "setup": setup, "D": D, "hash_seconds": sum(hash_times) / len(xq)}


def ekfac_scores(model: PRISM, windows, xq, yq, log, damping: Optional[float] = None) -> Optional[dict]:
    """Step 5 (optional): EK-FAC influence (Grosse et al. 2023) through kronfluence, over the backbone's Linear
    modules (kronfluence tracks nn.Linear/Conv2d: the tied embedding/head and P are outside its view; the MLP
    and attention projections are the usual EK-FAC set). Factors are fitted on the M training windows (true
    Fisher: targets sampled from the model), train loss = summed CE, measurement = the query's CE (query_ce's
    W z); damping None is kronfluence's heuristic, 0.1 × the mean eigenvalue per module. A deep copy is prepared
    (kronfluence wraps modules in place); the global RNG is restored afterwards. -> None if not installed."""
    try:
        from kronfluence.analyzer import Analyzer, prepare_model
        from kronfluence.arguments import FactorArguments, ScoreArguments
        from kronfluence.task import Task
        from kronfluence.utils.dataset import DataLoaderKwargs
    except ImportError:
        pin = torch.__version__.split("+")[0]  # kronfluence needs torchvision, whose newest release pulls another torch
        log(f"EK-FAC: kronfluence is not installed (pip install kronfluence torch=={pin}: the pin keeps this torch); "
            "skipped")
        return None
    if "RANK" in os.environ:  # kronfluence's accelerate state would join the (already closed) torchrun group
        log("EK-FAC: skipped under torchrun (kronfluence would start a process group); run it single-process")
        return None
    import logging
    import tempfile
    import warnings

    class LanguageModelTask(Task):
        def compute_train_loss(self, batch, model, sample=False):
            x, y = batch
            logits = model(x).float().flatten(0, 1)
            if sample:  # the true Fisher: targets drawn from the model's own predictions
                with torch.no_grad():
                    y = torch.multinomial(torch.softmax(logits.detach(), -1), 1).squeeze(1)
            return F.cross_entropy(logits, y.reshape(-1), reduction="sum")

        def compute_measurement(self, batch, model):  # the loss's own gradient, as for the other dense methods
            x, y = batch
            return query_ce(model, x, y, reduction="sum")

    device = model.P.device
    task = LanguageModelTask()
    tracked = prepare_model(copy.deepcopy(model), task)
    train = torch.utils.data.TensorDataset(windows[:, :-1].cpu(), windows[:, 1:].cpu())
    query = torch.utils.data.TensorDataset(xq.cpu(), yq.cpu())
    B = max(1, min(64, ATTR_TOKENS // windows.shape[1]))
    devices = [device] if device.type == "cuda" else []
    with tempfile.TemporaryDirectory() as tmp, torch.random.fork_rng(devices), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # kronfluence's torch.cuda.amp.GradScaler deprecations
        analyzer = Analyzer("prism", tracked, task, cpu=device.type != "cuda", disable_tqdm=True, output_dir=tmp,
                            log_level=logging.WARNING)
        analyzer.set_dataloader_kwargs(DataLoaderKwargs(num_workers=0))
        t0 = attr_clock(device)
        analyzer.fit_all_factors("ekfac", train, per_device_batch_size=B, overwrite_output_dir=True,
                                 factor_args=FactorArguments(strategy="ekfac"))
        t1 = attr_clock(device)
        analyzer.compute_pairwise_scores("scores", "ekfac", query, train, per_device_query_batch_size=len(query),
                                         per_device_train_batch_size=B, overwrite_output_dir=True,
                                         score_args=ScoreArguments(damping_factor=damping))
        t2 = attr_clock(device)
        scores = analyzer.load_pairwise_scores("scores")["all_modules"].to(device).float()
        factors = analyzer.load_all_factors("ekfac")
    # what scoring reads: both eigenbases and the corrected eigenvalues of every module (not the covariances)
    held = sum(tensor_bytes(t) for name in ("activation_eigenvectors", "gradient_eigenvectors", "lambda_matrix")
               for t in factors.get(name, {}).values())
    return {"scores": scores, "setup": t1 - t0, "seconds": t2 - t1, "bytes": held}


def val_queries(data, Q: int, ctx: int, device):
    """Q evenly spaced val windows of ctx tokens and, for each, the token after its last position (the one
    prediction attributed). Deterministic: the same queries in every run. -> (xq [Q, ctx], yq [Q])."""
    tokens = data.tokens("val")
    if len(tokens) < ctx + 1:
        raise RunError(f"the val split has {len(tokens)} tokens, fewer than --ctx + 1 = {ctx + 1}: no query window")
    span = len(tokens) - ctx  # window starts 0 … span - 1: more queries than that are the same windows again
    starts = torch.linspace(0, span - 1, min(Q, span)).long().unique()  # fewer if the split is that short
    w = torch.from_numpy(tokens[(starts[:, None] + torch.arange(ctx + 1)[None, :]).numpy()].astype("int64"))
    return w[:, :-1].to(device), w[:, -1].to(device)


def topn_overlap(scores, ref, n: int) -> float:
    """|top-n(scores) ∩ top-n(ref)| / n per query, averaged; scores and ref [Q, M], n capped at M."""
    n = min(n, scores.shape[1])
    a, b = scores.topk(n, dim=1).indices, ref.topk(n, dim=1).indices
    return sum(len(set(x.tolist()) & set(y.tolist())) for x, y in zip(a, b)) / (n * scores.shape[0])


def overlaps(scores, ref) -> dict:
    """Top-10 and top-100 overlap of scores with ref [Q, M] (topn_overlap), keyed as in the results."""
    return {f"top-{n} overlap": topn_overlap(scores, ref, n) for n in (10, 100)}


def overlap_text(o: dict) -> str:
    """An overlaps() dict as the log and report print it: "0.54/0.71" (top-10/top-100)."""
    return f"{o['top-10 overlap']:.2f}/{o['top-100 overlap']:.2f}"


def band_label(lo: Optional[float], hi: Optional[float]) -> str:
    """A band of μ/λ₀ as text: "<0.001", "0.001-0.01", ">=10"."""
    return f"<{hi:g}" if lo is None else f">={lo:g}" if hi is None else f"{lo:g}-{hi:g}"


def ratio_text(x: Optional[float]) -> str:
    """An |e|/|g| figure as the log and report print it: two decimals, n/a for None (a band that holds no gradient)."""
    return "n/a" if x is None else f"{x:.2f}"


def percent(x: Optional[float]) -> str:
    """A share as a percentage to two significant digits (a band can hold 0.0042 % of the energy), n/a for None."""
    return "n/a" if x is None else f"{100 * x:.2g}%"


def spectrum_lines(spectrum: dict) -> list[str]:
    """fixed_a_spectrum's result as log lines, one per curvature."""
    def figures(xs):
        return ", ".join(map(ratio_text, xs))
    lines = []
    for name in ("block", "kfac"):
        if name not in spectrum:
            continue
        s = spectrum[name]
        bands = "; ".join(f"{band_label(*b['band'])} {figures([b['train']])} ({figures([b['query']])}), "
                          f"{percent(b['gradient share'])} of Σ|g|²" for b in s["bands"])
        lines.append(f"attribution, the fixed-a gradients' error e = g - g^c in the {name} curvature's eigenbasis: "
                     f"|e|/|g| weighted by (H + λI)⁻¹ {figures(r['train'] for r in s['sweep'])} over the training "
                     f"windows ({figures(r['query'] for r in s['sweep'])} over the queries) at --attr-damping "
                     + ", ".join(f"{r['attr_damping']:g}" for r in s["sweep"])
                     + f"; by band of eigenvalue μ/λ₀ (λ₀ {spectrum['lam0']:.3g}, the damping's scale), |e|/|g| "
                     f"within it (queries'), its share of Σ|g|²: {bands}")
    return lines


def plus_minus(mean: float, se: Optional[float]) -> str:
    """A mean and its standard error as the log and report print them: "+0.0266 ± 0.0104" (the mean alone when
    there is no error: a single query)."""
    return f"{mean:+.4f}" + (f" ± {se:.4f}" if se is not None else "")


def chance_overlap(n: int, M: int) -> float:
    """topn_overlap's expectation for a ranking drawn at random: each of the reference's top n is among the random
    top n with probability n/M, so the expected overlap is n/M (n capped at M, as there). The level an overlap
    has to beat to say anything."""
    return min(n, M) / M


# The retraining check (spec §5.1: "retraining-based validation of the attribution claims is still needed", the
# paper's own limitation). A high I(m, q) claims that window m helped prediction q, so training without m should
# leave q's loss higher. The check continues training the trained model on the M attribution windows (why not
# from scratch, why plain SGD: the module docstring), all parameters, fp32, no dropout, the same batches in every
# run: once with nothing left out, once with each method's top k for q left out, once with k random windows left
# out. A window left out is dropped from its batch while the batch's CE sum is still divided by the batch size
# (the short last batch's too), so exactly that window's gradient is removed and every window weighs the same.
# Δ = L_q(left out) − L_q(nothing left out): top-k windows that really were q's proponents give Δ > 0, above the
# random windows'. CE only: the auxiliary losses are batch-level (R1's nearest token to each prototype), so no
# single window can be left out of them. On CUDA the scatters' atomics make two runs differ in the last bits:
# the nothing-left-out run is repeated, and the gap between the two is logged as Δ's noise floor.

def retrain_query_losses(work: PRISM, start: dict, windows, left_out, xq, yq, order, lr: float,
                         batch: int) -> torch.Tensor:
    """Continue training `work` from the state dict `start` on windows [M, T+1] without the rows `left_out`, in the
    fixed batch order `order` [epochs, M], by plain SGD at lr on the mean CE per window over `batch` windows;
    -> the queries' losses CE(yq | xq) [Q] after."""
    work.load_state_dict(start)
    work.eval()  # no dropout: every run sees the same function
    keep = torch.ones(len(windows), dtype=torch.bool, device=windows.device)
    keep[torch.as_tensor(list(left_out), dtype=torch.long, device=windows.device)] = False
    params = [p for p in work.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=lr)
    with torch.enable_grad():
        for epoch in order:
            for b in epoch.to(windows.device).split(batch):
                kept = b[keep[b]]
                if len(kept) == 0:  # a batch of left-out windows only: a zero gradient, no step
                    continue
                w = windows[kept]
                logits = work(w[:, :-1]).float()
                loss = F.cross_entropy(logits.flatten(0, 1), w[:, 1:].flatten()) * len(kept) / batch
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
    with torch.no_grad():
        return query_ce(work, xq, yq, reduction="none")


def retrain_check(model: PRISM, windows, xq, yq, rankings: dict, cfg: Config, log,
                  tracin: Optional[torch.Tensor] = None) -> dict:
    """The retraining check over --attr-retrain queries (evenly spread over the Q), each ranking in `rankings`
    ({name: scores [Q, M]}) and k random windows per query: Δ per query, its mean and standard error over the
    queries, and in how many queries a method's Δ is above the random windows'. With `tracin` (dense TracIn's
    scores [Q, M]) also the check's first-order prediction of every Δ, lr·epochs/(B·T) × the left-out windows'
    TracIn scores (B the batch, T the window's targets: the check's loss is each window's summed CE / (B·T)), and
    how well it fits the measured Δ. The model is left as it was."""
    M, k, n = len(windows), cfg.attr_retrain_k, min(cfg.attr_retrain, len(xq))
    if k >= M:
        raise RunError(f"--attr-retrain-k {k} leaves no window of the attribution set's {M} to train on; "
                       f"use at most {M - 1}")
    picked = torch.linspace(0, len(xq) - 1, n).round().long().unique().tolist()
    gen = torch.Generator().manual_seed(cfg.seed)
    order = torch.stack([torch.randperm(M, generator=gen) for _ in range(cfg.attr_retrain_epochs)])
    work = copy.deepcopy(model)  # the runs train a copy: the analyses after this one see the trained model
    start = {key: v.clone() for key, v in model.state_dict().items()}
    batch = cfg.attr_retrain_batch or cfg.batch_size
    if batch > M:  # each window's loss is weighted 1/batch: past M, every step would shrink by M/batch unseen
        log(f"note: retraining check: batches of {batch} windows, more than the attribution set's {M}; using {M} "
            "(one full batch per epoch)")
        batch = M
    done = {}  # left-out set -> the picked queries' losses (two methods' equal top-k train once)
    t0 = time.time()

    def train_without(left_out):
        out = retrain_query_losses(work, start, windows, left_out, xq[picked], yq[picked], order,
                                   cfg.attr_retrain_lr, batch)
        if not out.isfinite().all():  # the check's plain SGD diverged: every Δ would be NaN
            epochs = f"{cfg.attr_retrain_epochs} epoch{'s' * (cfg.attr_retrain_epochs > 1)}"
            raise RunError(f"the retraining check diverged (a non-finite query loss after {epochs} of SGD at "
                           f"--attr-retrain-lr {cfg.attr_retrain_lr:g}); lower --attr-retrain-lr")
        return out

    def losses(left_out):
        key = frozenset(int(m) for m in left_out)
        if key not in done:
            done[key] = train_without(key)
        return done[key]
    base = losses(())
    noise = float((train_without(()) - base).abs().max())  # a repeat: the arithmetic's own run-to-run gap
    with torch.no_grad():
        before = query_ce(model, xq[picked], yq[picked], reduction="none")
    deltas = {name: [] for name in rankings}
    deltas["random windows"] = []
    left = {name: [] for name in deltas}  # the sets left out, per query: for the first-order prediction
    for i, j in enumerate(picked):
        for name, scores in rankings.items():
            left[name].append(scores[j].topk(k).indices)
        left["random windows"].append(torch.randperm(M, generator=gen)[:k])
        for name in deltas:
            deltas[name].append(float(losses(left[name][-1])[i] - base[i]))
    # to first order the check removes lr/(B·T)·Σ_{m∈S} ∇ΣCE_m once per epoch from the descent, so Δ ≈ that
    # times ∇L_q (a test): TracIn's scores in the check's own units
    scale = cfg.attr_retrain_lr * cfg.attr_retrain_epochs / (batch * (windows.shape[1] - 1))
    predicted = None if tracin is None else {
        name: [scale * float(tracin[j, s.to(tracin.device)].sum()) for j, s in zip(picked, sets)]
        for name, sets in left.items()}
    rand = deltas["random windows"]
    first = next(iter(rankings), None)  # the cached method: every other one is also compared with it, query by query

    def mean_se(d):
        return statistics.fmean(d), statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else None

    def row(name, d):
        mean, se = mean_se(d)
        out = {"method": name, "delta": mean, "se": se, "per_query": d,
               "above random": None if name == "random windows" else sum(x > r for x, r in zip(d, rand))}
        if name not in (first, "random windows"):  # paired: the queries' own spread cancels, unlike two SEs
            diff = [x - c for x, c in zip(d, deltas[first])]
            out["vs first"] = dict(zip(("delta", "se"), mean_se(diff)), above=sum(x > 0 for x in diff))
        if predicted is not None:
            out["predicted"], out["predicted_per_query"] = statistics.fmean(predicted[name]), predicted[name]
        return out
    rows = [row(name, d) for name, d in deltas.items()]
    out = {"queries": picked, "k": k, "seqs": M, "epochs": cfg.attr_retrain_epochs, "lr": cfg.attr_retrain_lr,
           "batch": batch, "first": first, "shift": float((base - before).mean()), "noise": noise,
           "runs": len(done) + 1, "seconds": time.time() - t0, "rows": rows, "first_order": None}
    if predicted is not None:  # every (method, query) pair: measured Δ against its prediction
        xs = [x for name in deltas for x in predicted[name]]
        ys = [y for name in deltas for y in deltas[name]]
        if len(set(xs)) > 1 and len(set(ys)) > 1:  # a correlation needs spread in both
            out["first_order"] = {"pairs": len(xs), "r": statistics.correlation(xs, ys),
                                  "slope": statistics.linear_regression(xs, ys, proportional=True).slope}
    queries = f"{len(picked)} quer{'ies' if len(picked) > 1 else 'y'}"
    log(f"attribution, retraining check: {queries}; for each, a method's top {k} of the {M} windows left "
        f"out of {cfg.attr_retrain_epochs} epoch{'s' * (cfg.attr_retrain_epochs > 1)} of plain SGD (lr "
        f"{cfg.attr_retrain_lr:g}, batches of {batch}, all parameters, CE) continued from the trained "
        f"weights; Δ = the query's loss minus that after the same training with nothing left out (which moved the "
        f"queries' loss by {out['shift']:+.4f} nats on average; repeated, it gave the same losses to "
        f"{noise:.1e} nats, Δ's noise floor); {out['runs']} runs, {out['seconds']:.0f}s")
    if out["first_order"] is not None:
        fo = out["first_order"]
        log(f"attribution, retraining check, first order: the prediction lr·epochs/(B·T) × the left-out windows' "
            f"dense TracIn scores vs the measured Δ over the {fo['pairs']} (method, query) pairs: correlation "
            f"{fo['r']:.3f}, measured = {fo['slope']:.3f} × predicted (least squares through 0); near 1 and 1, the "
            "check is in TracIn's linear regime, where TracIn's own top k is the largest predicted Δ by construction")
    for r in rows:
        above = "" if r["above random"] is None else \
            f", above the random windows' in {r['above random']}/{len(picked)} queries"
        if "predicted" in r:
            above += f", first-order prediction {r['predicted']:+.4f}"
        if "vs first" in r:
            v = r["vs first"]
            above += (f"; minus {first}'s, query by query: {plus_minus(v['delta'], v['se'])}, above it in "
                      f"{v['above']}/{len(picked)}")
        log(f"attribution, retraining check, {r['method']}: Δ {plus_minus(r['delta'], r['se'])} nats (mean ± "
            f"standard error over the queries){above}")
    return out


def attribution_experiment(model: PRISM, dense, data, cfg: Config, log) -> dict:
    """Spec §5.3, §8.5: cached prototype attribution against its baselines on Q val predictions and M training
    windows: time per query, memory, and top-10/top-100 overlap with the exact prototype-space ranking. All the
    methods attribute the same PRISM model, so `dense` (the twin) is not used."""
    with full_fp32():
        return run_attribution(model, data, cfg, log)


def run_attribution(model: PRISM, data, cfg: Config, log) -> dict:
    if not model.ready:
        raise RunError("attribution needs live prototypes (training stopped inside the warm-up)")
    model.eval()
    device = model.P.device
    windows = train_windows(data, cfg.attr_seqs, cfg.ctx).to(device)
    M = windows.shape[0]
    if M < 2:
        raise RunError(f"the training split holds {M} window of --ctx {cfg.ctx} tokens; attribution needs 2 or more")
    xq, yq = val_queries(data, cfg.attr_queries, cfg.ctx, device)
    Q = len(xq)
    for flag, asked, got, split in (("attr-seqs", cfg.attr_seqs, M, "training"),
                                    ("attr-queries", cfg.attr_queries, Q, "val")):
        if got < asked:  # a small corpus: said, not silently fewer
            log(f"note: --{flag} {asked}: the {split} split holds {got} distinct windows of --ctx {cfg.ctx}; "
                f"using {got}")
    rows, ranked = [], {}

    def add_row(name, scores, ms, mem, scored, setup, batched=False):
        """scored: the sequences each query scored, one count per query (an int: every query scores them all)."""
        ranked[name] = scores
        per_query = scored if isinstance(scored, list) else [scored]
        rows.append({"method": name, "ms/query": ms, "memory MB": mem / 2**20,
                     "scored": sum(per_query) / len(per_query), "scored min": min(per_query), "setup s": setup,
                     "batched": batched})

    # 1-2. the cache, then one forward and a few postings per query
    t0 = attr_clock(device)
    cache = build_attr_cache(model, windows, cfg.attr_curvature, cfg.attr_damping, cfg.attr_s, cfg.attr_fisher_samples,
                             cfg.seed)
    setup = attr_clock(device) - t0
    query_state(model, xq[:1], yq[:1])  # warm-up (first-call allocations), untimed
    scores, times, touched, states = [], [], [], []
    for j in range(Q):
        t0 = attr_clock(device)
        idx, a, delta = query_state(model, xq[j:j + 1], yq[j:j + 1])
        s, scored = cached_scores(cache, idx[0], a[0], delta[0])
        times.append(attr_clock(device) - t0)
        scores.append(s)
        touched.append(int(scored.sum()))
        states.append((idx[0], a[0], delta[0]))  # for the no-curvature diagnostic below
    cached_name = f"PRISM cached ({cfg.attr_curvature})"
    add_row(cached_name, torch.stack(scores), 1e3 * sum(times) / Q, cache.nbytes(), touched, setup)
    # 3. exact prototype-space gradients
    t0 = attr_clock(device)
    ex = build_exact(model, windows, cfg.attr_damping, cfg.attr_exact_curvature, cfg.attr_fisher_samples, cfg.seed)
    setup = attr_clock(device) - t0
    if ex.ggn is not None:  # its size, which decides where it can run
        log(f"attribution, the Gauss–Newton reference: {len(ex.ggn.live)} live prototypes, {len(ex.ggn.rows):,} "
            f"non-zero {model.P.shape[1]}×{model.P.shape[1]} blocks, {ex.ggn.nbytes() / 2**20:.0f} MB")
    exact_query_grad(model, xq[0], yq[0])
    if ex.ggn is None:  # one query at a time, as the cached method
        scores, times, query_grads = [], [], []
        for j in range(Q):
            t0 = attr_clock(device)
            g_q = exact_query_grad(model, xq[j], yq[j])
            scores.append(exact_scores(ex, g_q))
            times.append(attr_clock(device) - t0)
            query_grads.append(g_q)
        exact_ms, scores = 1e3 * sum(times) / Q, torch.stack(scores)
    else:  # ggn: one conjugate-gradient solve for every query, timed as a batch and labelled so
        t0 = attr_clock(device)
        query_grads = [exact_query_grad(model, xq[j], yq[j]) for j in range(Q)]
        scores = exact_scores_batch(ex, query_grads)
        exact_ms = 1e3 * (attr_clock(device) - t0) / Q
    exact_dots = [exact_scores(ex, g_q, curvature=False) for g_q in query_grads]  # untimed: the diagnostics below
    exact_cache_curv = [exact_scores_with_cache_curvature(ex, cache, g_q) for g_q in query_grads]
    add_row("prototype-space exact", scores, exact_ms, ex.nbytes(), M, setup, batched=ex.ggn is not None)
    # The fisher reference is a Monte-Carlo estimate (S drawn targets per window): the same reference built from
    # other draws (--seed + 1) gives its own noise floor; an overlap with exact at or below the re-draw's is
    # within the reference's sampling noise. The empirical reference draws nothing, so it has none.
    redraw = None
    if ex.fisher is not None:
        ex2 = build_exact(model, windows, cfg.attr_damping, cfg.attr_exact_curvature, cfg.attr_fisher_samples,
                          cfg.seed + 1)
        redraw = overlaps(exact_scores_batch(ex2, query_grads), scores)
        del ex2
    # Diagnostics: the cached and exact rankings differ in two ways, the gradients (a held fixed in the cache) and
    # the curvature (the cache's A_ii·S or A ⊗ S of token statistics, --attr-s, vs the exact reference's damped
    # Fisher of window gradients: the true Fisher of sampled targets, or the empirical one of the true labels).
    # Each is measured with the other held equal: no curvature in either (the same cache at damping 1e9:
    # (C + λI)⁻¹ -> I/λ, plain dot products), or the cache's curvature in both; and the curvature alone, the exact
    # gradients ranked with the cache's curvature against the exact ranking.
    plain = replace(cache, curvature="block", lam=1e9 * cache.A_diag.mean().item() * cache.lam_S.mean().item())
    plain_scores = torch.stack([cached_scores(plain, *state)[0] for state in states])
    gradients_only = overlaps(plain_scores, torch.stack(exact_dots))
    same_curvature = overlaps(ranked[cached_name], torch.stack(exact_cache_curv))
    curvature_only = overlaps(torch.stack(exact_cache_curv), ranked["prototype-space exact"])
    sweep = damping_sweep(cache, ex, states, query_grads, cfg.attr_damping, own={
        "cached": overlaps(ranked[cached_name], ranked["prototype-space exact"]),
        "same_curvature": same_curvature, "curvature_only": curvature_only})
    # where the fixed-a gradients' error lies in the cache's curvature (the block one's, and kfac's when it is the
    # cache's): how much of it the inverse at each damping weights up
    spectrum = fixed_a_spectrum(cache, ex, states, query_grads, cfg.attr_damping)
    # 4. dense gradient similarity (nothing precomputed: its whole cost is per query batch)
    s, seconds, mem = dense_scores(model, windows, xq, yq)
    add_row("dense TracIn (all parameters)", s, 1e3 * seconds["single"], mem["single"], M, 0.0)
    add_row(f"dense TracIn, batch of {Q} queries", s, 1e3 * seconds["batch"], mem["batch"], M, 0.0, batched=True)
    sk = sketched_dense_scores(model, windows, xq, yq, cache.nbytes(), seed=cfg.seed)
    sketch_name = "dense TracIn, CountSketch cache at matched memory"
    add_row(sketch_name, sk["scores"], 1e3 * sk["seconds"], sk["bytes"], M, sk["setup"])
    compared = [cached_name, "prototype-space exact", "dense TracIn (all parameters)", sketch_name]  # one row each
    # 5. EK-FAC
    vs_ekfac = None
    if cfg.ekfac:
        if cfg.attr_damping != 0.1:  # kronfluence takes one absolute damping or its per-module heuristic, not ours
            log(f"note: EK-FAC takes kronfluence's heuristic damping, 0.1 x each module's mean eigenvalue, not "
                f"--attr-damping {cfg.attr_damping:g}")
        ek = ekfac_scores(model, windows, xq, yq, log)
        if ek is not None:
            # one batched scoring pass over the Q queries, divided by Q: a per-query time of a batch, like the
            # dense TracIn batch row (the factor fitting is its setup, as the cache's build is the cached method's)
            add_row(f"EK-FAC (kronfluence), batch of {Q} queries", ek["scores"], 1e3 * ek["seconds"] / Q, ek["bytes"],
                    M, ek["setup"], batched=True)
            # the paper also reports overlap with EK-FAC's rankings (spec §5.1): every other ranking against it
            vs_ekfac = {name: overlaps(ranked[name], ek["scores"]) for name in compared}
            compared.append(rows[-1]["method"])
    # what each method's memory figure counts (the tensors it holds, on every device)
    memory_notes = {cached_name: "the cache (index, A_ii, S's eigenbasis; A's for kfac)",
                     "prototype-space exact": {
                         "empirical": "row-sparse exact gradients + M×M Cholesky factor",
                         "fisher": "row-sparse exact gradients, and sampled-target ones (M·S rows) + their M·S×M·S "
                                   "Cholesky factor + the M×M·S cross Gram",
                         "ggn": "row-sparse exact gradients + the Gauss–Newton matrix's non-zero d×d blocks"}[
                         ex.curvature],
                     "dense TracIn (all parameters)": "its query gradient + one training gradient at a time",
                     f"dense TracIn, batch of {Q} queries": f"the {Q} query gradients + one training gradient",
                     sketch_name: f"the M x D training-gradient sketches, D = {sk['D']:,} (the hash is "
                                  "computed from the parameter index each query: no stored state; it takes "
                                  f"{1e3 * sk['hash_seconds']:.1f} of the query's {1e3 * sk['seconds']:.1f} ms, and "
                                  "while a query runs, 12 bytes per parameter beside its gradient, not counted)",
                     f"EK-FAC (kronfluence), batch of {Q} queries":
                         "eigenbases and corrected eigenvalues of the Linear modules"}
    # overlaps with the exact ranking, the table, the log
    ref = ranked["prototype-space exact"]
    chance = {n: chance_overlap(n, M) for n in (10, 100)}  # a random ranking's expected overlap, n/M
    table = []
    for r in rows:
        s = ranked[r["method"]]
        table.append({"method": r["method"], "ms/query": r["ms/query"], "memory MB": r["memory MB"],
                      **overlaps(s, ref),
                      "top-10 chance": chance[10], "top-100 chance": chance[100],
                      "sequences scored": r["scored"], "sequences scored (min)": r["scored min"],
                      "setup s": r["setup s"], "memory holds": memory_notes[r["method"]]})
        # a mean over queries: 255.9 printed :.0f would read as "every query scored all 256"
        scored = (f"{M}/{M} sequences scored by every query" if r["scored min"] == M else
                  f"{r['scored']:.1f}/{M} sequences scored per query (min {r['scored min']})")
        log(f"attribution {r['method']}: {r['ms/query']:.2f} ms/query, {r['memory MB']:.3g} MB "
            f"({memory_notes[r['method']]}), top-10/top-100 "
            f"overlap with exact {overlap_text(table[-1])} (chance "
            f"{chance[10]:.2f}/{chance[100]:.2f}), {scored}, setup {r['setup s']:.1f}s")
    by = {r["method"]: r for r in table}
    c = by[cached_name]
    speed = {name: by[name]["ms/query"] / c["ms/query"] for name in by if name != cached_name}
    # like with like: the cached time is one query at a time; a batch row is one pass over Q queries divided by Q
    def than(name):
        x = speed[name]
        return f"{x:.3g}x faster than {name}" if x >= 1 else f"{1 / x:.3g}x slower than {name}"
    alone = [than(r["method"]) for r in rows if r["method"] != cached_name and not r["batched"]]
    batch = [than(r["method"]) for r in rows if r["batched"]]
    full = model.cfg.resid_grad == "full"  # CE gives P no gradient: every prototype-space gradient is §2.3 A's
    gradients = ROUTING_LABEL if full else f"CE's gradient through ẑ (--resid-grad {model.cfg.resid_grad})"
    label = f"; gradients: {gradients}" if full else ""
    exact_curv = EXACT_CURVATURE_LABEL[cfg.attr_exact_curvature]
    if cfg.attr_exact_curvature == "fisher":
        exact_curv += f", {cfg.attr_fisher_samples} draw{'s' * (cfg.attr_fisher_samples > 1)} per window"
    summary = (f"cached prototype attribution ({cfg.attr_curvature}{label}) "
               f"takes {c['ms/query']:.2f} ms per query, one "
               "query at a time (setup excluded for every method): " + ", ".join(alone) + ", each also one query at a "
               "time" + ("; against per-query times of one batched pass over " + f"{Q} queries (which favours them): "
                         + ", ".join(batch) if batch else "")
               + f"; it keeps {c['top-10 overlap']:.0%} of the exact prototype-space top-10 (curvature: "
               f"{exact_curv}) and "
               f"{c['top-100 overlap']:.0%} of its top-100 (chance {chance[10]:.0%} and {chance[100]:.0%}; {Q} "
               f"queries, {M} training windows of {cfg.ctx} tokens; paper: ~470x faster than EK-FAC, ~80% of the "
               "top sequences preserved)")
    log(summary)
    if redraw is not None:
        log(f"attribution, the exact reference re-drawn (its {exact_curv} from --seed + 1) vs itself: top-10/top-100 "
            f"overlap {overlap_text(redraw)}, its own sampling noise: an overlap with exact at or below it is within "
            "that noise")
    log(f"attribution, gradients alone (no curvature in either ranking): cached vs exact top-10/top-100 overlap "
        f"{overlap_text(gradients_only)}: what the cache's fixed-a gradients keep before any curvature (the cached "
        f"method itself: {overlap_text(c)})")
    log(f"attribution, one approximation at a time: with the cache's {cfg.attr_curvature} curvature in both rankings, "
        f"cached vs exact gradients {overlap_text(same_curvature)} (the fixed-a gradients alone); exact gradients "
        f"ranked with the cache's curvature vs the exact ranking {overlap_text(curvature_only)} (the curvature alone: "
        f"the cache's {CACHE_S_LABEL[cfg.attr_s]} vs the exact {exact_curv})")
    if vs_ekfac is not None:
        log("attribution, against EK-FAC's ranking: top-10/top-100 overlap "
            + ", ".join(f"{name} {overlap_text(o)}" for name, o in vs_ekfac.items())
            + f" (chance {chance[10]:.2f}/{chance[100]:.2f})")
    for r in sweep:  # λ is what the paper leaves open and the exact reference depends on most (README)
        own = " (this run's, the rows above)" if r["attr_damping"] == cfg.attr_damping else ""
        if "skipped" in r:
            log(f"attribution, damping sweep, --attr-damping {r['attr_damping']:g}: skipped: {r['skipped']}")
            continue
        log(f"attribution, damping sweep, --attr-damping {r['attr_damping']:g}{own}: top-10/top-100 overlap cached "
            f"vs exact {overlap_text(r['cached'])}, with the cache's curvature in both "
            f"{overlap_text(r['same_curvature'])}, the curvature alone {overlap_text(r['curvature_only'])}")
    for line in spectrum_lines(spectrum):
        log(line)
    # 6. the retraining check (off by default: a continued training per query and method)
    retrain = None
    if cfg.attr_retrain:
        retrain = retrain_check(model, windows, xq, yq, {name: ranked[name] for name in compared}, cfg, log,
                                tracin=ranked["dense TracIn (all parameters)"])
    # the first query's most influential training windows, decoded (for the report)
    tok = data.tokenizer
    first = ranked[cached_name][0]
    top = first.topk(min(3, M))
    examples = {"query": tok.decode(xq[0].tolist()), "target": tok.decode([int(yq[0])]),
                "top": [{"seq": int(m), "score": float(v), "text": tok.decode(windows[m].tolist())}
                        for v, m in zip(top.values.tolist(), top.indices.tolist())]}
    return {"table": table, "summary": summary, "queries": Q, "seqs": M, "ctx": cfg.ctx,
            "chance": {"top-10 overlap": chance[10], "top-100 overlap": chance[100]},
            "curvature": cfg.attr_curvature, "gradients": gradients,
            "cache_s": {"s": cfg.attr_s, "label": CACHE_S_LABEL[cfg.attr_s]},
            "exact_curvature": {"curvature": cfg.attr_exact_curvature, "label": exact_curv,
                                "samples": cfg.attr_fisher_samples if ex.fisher is not None else None},
            "damping": {"cached": cache.lam, "exact": ex.lam},
            "gradients_only": gradients_only, "same_curvature": same_curvature, "curvature_only": curvature_only,
            "reference_redraw": redraw,
            "vs_ekfac": vs_ekfac,
            "damping_sweep": sweep,
            "fixed_a_spectrum": spectrum,
            "retrain": retrain,
            "speedup": speed, "cache": {"postings": len(cache.index.seq), "bytes": cache.nbytes(),
                                        "prototypes per sequence": len(cache.index.seq) / M},
            "memory_notes": memory_notes,
            "examples": examples}


# Controllers (spec §6.3, §9 item 9). The paper fits its controllers on four lm-eval multiple-choice tasks; offline
# there are none, so the task here is a 4-way cloze built from the held-out (val) text, the same for PRISM and for
# the SAE baseline on the dense twin.

# Examples (fit + eval), SAE training windows and SAE steps per device. The CPU sizes keep the whole analysis near
# 30 s at the CPU preset (K=512, d=128, 4 layers, ctx 128); MPS counts as CPU.
CONTROLLER_SIZES = {"cpu": dict(examples=1200, sae_windows=64, sae_steps=300),
                    "cuda": dict(examples=8000, sae_windows=512, sae_steps=3000)}
# The frequent-word list, and the ± rank band the distractors come from. The targets follow the text, so frequent
# words are the answer more often than their rank neighbours: on the Shakespeare val split a context-free scorer
# (word counts) picks the right option 47% of the time with ±50 ranks, 34-38% with ±20, 25-29% with ±5 (chance 25%).
CLOZE_WORDS, CLOZE_BAND = 500, 5
GAIN_STEPS, GAIN_LR = 500, 0.05  # proximal Adam on the gains, full batch, for both controllers
NONZERO = 1e-3  # |c_i| above this counts as a non-zero gain


def cloze_words(tok, tokens: torch.Tensor, n_words: int = CLOZE_WORDS, min_len: int = 3) -> list[int]:
    """The n_words most frequent ids in `tokens` that decode to one whole word after a space (" king": letters only,
    at least min_len of them), most frequent first. One casing per word (its most frequent), so no two options are
    the same word ("King" / "king")."""
    counts = torch.bincount(tokens)
    words, seen = [], set()
    for i in torch.argsort(counts, descending=True, stable=True).tolist():
        if counts[i] == 0 or len(words) == n_words:
            break
        w = tok.decode([i])
        if len(w) > min_len and w[0] == " " and w[1:].isalpha() and w[1:].lower() not in seen:
            seen.add(w[1:].lower())
            words.append(i)
    return words


@dataclass
class Cloze:
    """4-way cloze examples: x [N, T] the T tokens before the target, options [N, 4] token ids, answer [N] the
    true word's slot in options, pos [N] the target's position in the val stream."""
    x: torch.Tensor
    options: torch.Tensor
    answer: torch.Tensor
    pos: torch.Tensor


def build_cloze(tokens: torch.Tensor, words: list[int], ctx: int, n: int, seed: int,
                band: int = CLOZE_BAND) -> Optional[tuple[Cloze, Cloze]]:
    """-> (fit, eval), up to n // 2 examples each; None when there are fewer than 4 words or an empty half.

    Split by position: fit targets lie in the first half of the stream, eval targets *and their contexts* in the
    second, so the two sets share no token. In each half the targets are drawn (seeded) among the positions whose
    token is a listed word and that have ctx tokens of context inside the half, then sorted. Distractors: 3 other
    listed words within ±band frequency ranks of the answer (the window is shifted at the ends of the list to keep its
    width), so always choosing the more frequent word does not win; the 4 options are then shuffled."""
    if len(words) < 4:
        return None
    g = torch.Generator().manual_seed(seed)
    n_w = len(words)
    rank = torch.full((max(int(tokens.max()), max(words)) + 1,), -1, dtype=torch.long)
    rank[torch.tensor(words)] = torch.arange(n_w)
    pos_all, mid = torch.arange(len(tokens)), len(tokens) // 2
    listed = rank[tokens] >= 0
    sets = []
    for keep in ((pos_all >= ctx) & (pos_all < mid), pos_all >= mid + ctx):
        cand = pos_all[keep & listed]
        if len(cand) == 0:
            return None
        pos = cand[torch.randperm(len(cand), generator=g)[: n // 2]].sort().values
        r = rank[tokens[pos]]
        width = min(n_w, 2 * band + 1)
        lo = (r - band).clamp(0, n_w - width)
        window = lo[:, None] + torch.arange(width)  # [N, width] candidate ranks, the answer's own masked out
        score = torch.rand(window.shape, generator=g).masked_fill(window == r[:, None], -1.0)
        distract = window.gather(1, score.topk(3, dim=1).indices)
        ranks = torch.cat([r[:, None], distract], 1)  # slot 0 is the answer before the shuffle
        perm = torch.argsort(torch.rand(ranks.shape, generator=g), dim=1)
        options = torch.tensor(words)[ranks.gather(1, perm)]
        x = tokens[pos[:, None] - ctx + torch.arange(ctx)]
        sets.append(Cloze(x, options, (perm == 0).int().argmax(1), pos))
    return sets[0], sets[1]


@torch.no_grad()
def last_hidden(model: PRISM, x: torch.Tensor, device, batch: int = 64) -> torch.Tensor:
    """z at each context's last position [N, d] (post-ln_f, fp32): the state that predicts the cloze word."""
    return torch.cat([model.hidden(x[s:s + batch].to(device))[:, -1].float() for s in range(0, len(x), batch)])


@dataclass
class GainFeatures:
    """What a gain controller needs of each example, computed once from the frozen model (spec §6.3):
    base [N, 4] the options' logits at c = 0 (the model's own), idx [N, k] the active terms (prototypes or SAE
    latents), G [N, 4, k] each active term's logit on each option, act_j (w_o · d_j); K the number of gains.
    Under gains c the option logits are base + Σ_j c[idx_j] G[:, :, j]: k terms per example, no V-wide matmul."""
    base: torch.Tensor
    idx: torch.Tensor
    G: torch.Tensor
    K: int


@torch.no_grad()
def gain_features(logits_fn, z, idx, act, D, W, options, chunk: int = 256) -> GainFeatures:
    """logits_fn(z) -> the model's full logits (gathered at the options, in chunks: [N, V] is never whole);
    D [K, d] the directions the gains scale (prototypes p_i or SAE decoder rows d_j), act [N, k] their weights."""
    base = torch.cat([logits_fn(z[s:s + chunk]).float().gather(1, options[s:s + chunk])
                      for s in range(0, len(z), chunk)])
    G = torch.einsum("nod,nkd->nok", W[options].float(), D[idx].float()) * act.float()[:, None, :]
    return GainFeatures(base, idx, G, D.shape[0])


@torch.no_grad()
def prism_features(model: PRISM, z, options) -> GainFeatures:
    """The prototype controller l' = W(z + Σ_{i∈A} c_i a_i p_i) (spec §6.3, = W r + Σ (1 + c_i) a_i W p_i with r
    kept, as model.head(z, gain=c) computes it); base is model.head's own logits."""
    idx, a = model.prototypes(z)
    return gain_features(lambda zz: model.head(zz)["logits"], z, idx, a, model.P, model.wte.weight, options)


def option_scores(feats: GainFeatures, c: torch.Tensor) -> torch.Tensor:
    """The 4 options' logits under gains c, [N, 4]. The harness scores an option by its full-vocabulary log-probability;
    for single-token options that is the logit minus a log-normaliser shared by the four, so the 4-way softmax, the
    cross-entropy and the argmax below are the same with either."""
    return feats.base + (feats.G * c[feats.idx][:, None, :]).sum(-1)


@torch.no_grad()
def accuracy(feats: GainFeatures, answer: torch.Tensor, c: torch.Tensor) -> float:
    return int((option_scores(feats, c).argmax(-1) == answer).sum()) / len(answer)


def fit_gains(feats: GainFeatures, answer: torch.Tensor, l1: float, steps: int = GAIN_STEPS,
              lr: float = GAIN_LR) -> torch.Tensor:
    """Gains c ∈ R^K from 0, minimising the 4-way cross-entropy of the true option + l1·‖c‖₁ by proximal Adam,
    full batch, a fixed number of steps (deterministic): an Adam step on the cross-entropy, then the L1 term's proximal
    step in Adam's own diagonal metric, a soft threshold of lr·l1/(√v̂ + ε) per gain. It gives exact zeros (a
    subgradient of |c| inside Adam only oscillates around 0): a gain moves off zero only while its cross-entropy
    gradient outweighs l1 (the lasso's optimality condition), and a term never active keeps c_i = 0."""
    c = torch.zeros(feats.K, device=feats.G.device, requires_grad=True)
    m, v = torch.zeros_like(c), torch.zeros_like(c)
    b1, b2, eps = 0.9, 0.999, 1e-8
    for t in range(1, steps + 1):
        (grad,) = torch.autograd.grad(F.cross_entropy(option_scores(feats, c), answer), c)
        with torch.no_grad():
            m.mul_(b1).add_(grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            denom = (v / (1 - b2 ** t)).sqrt() + eps
            c -= lr * (m / (1 - b1 ** t)) / denom
            c.copy_(c.sign() * (c.abs() - lr * l1 / denom).clamp_min(0))
    return c.detach()


class TopKSAE(nn.Module):
    """A top-k sparse autoencoder (Gao et al. 2024, "Scaling and evaluating sparse autoencoders"):
    f = ReLU(TopK_k(W_enc (z - b_dec) + b_enc)), ẑ = Σ_j f_j d_j + b_dec, with unit-norm decoder rows d_j.
    encode returns the same sparse form as PRISM's prototypes (ids [N, k], weights [N, k])."""

    def __init__(self, d: int, n_latents: int, k: int, generator=None):
        super().__init__()
        self.k = k
        W_dec = F.normalize(torch.randn(n_latents, d, generator=generator), dim=-1)
        self.W_dec = nn.Parameter(W_dec)
        self.W_enc = nn.Parameter(W_dec.clone())  # encoder initialised as the decoder's transpose (Gao et al.)
        self.b_enc = nn.Parameter(torch.zeros(n_latents))
        self.b_dec = nn.Parameter(torch.zeros(d))

    def encode(self, z):
        pre = F.linear(z.float() - self.b_dec, self.W_enc, self.b_enc)
        f, idx = pre.topk(self.k, dim=-1)
        return idx, f.relu()

    def decode(self, idx, f):
        return reconstruct(idx, f, self.W_dec) + self.b_dec

    def forward(self, z):
        return self.decode(*self.encode(z))

    @torch.no_grad()
    def normalize_decoder(self):
        self.W_dec.div_(self.W_dec.norm(dim=-1, keepdim=True).clamp_min(1e-12))


@torch.no_grad()
def fvu(sae: TopKSAE, z: torch.Tensor, chunk: int = 4096) -> float:
    """Fraction of variance unexplained, Σ|z - ẑ|² / Σ|z - mean z|²."""
    err = sum((sae(z[s:s + chunk]) - z[s:s + chunk]).pow(2).sum().item() for s in range(0, len(z), chunk))
    return err / (z - z.mean(0)).pow(2).sum().item()


def train_sae(z: torch.Tensor, n_latents: int, k: int, steps: int, seed: int, batch: int = 1024,
              lr: float = 1e-3) -> TopKSAE:
    """Adam on the normalised MSE (= the batch's FVU), minibatches drawn without replacement (seeded), decoder rows
    renormalised after every step; b_dec starts at the mean state. No auxiliary dead-latent loss."""
    g = torch.Generator().manual_seed(seed)
    sae = TopKSAE(z.shape[1], n_latents, k, generator=g).to(z.device)
    with torch.no_grad():
        sae.b_dec.copy_(z.mean(0))
    var = (z - z.mean(0)).pow(2).sum(-1).mean()
    opt = torch.optim.Adam(sae.parameters(), lr=lr)
    order, s = torch.randperm(len(z), generator=g), 0
    for _ in range(steps):
        if s + batch > len(z):  # a new epoch, a new order (the partial last batch is dropped)
            order, s = torch.randperm(len(z), generator=g), 0
        zb = z[order[s:s + batch].to(z.device)]
        s += batch
        loss = (sae(zb) - zb).pow(2).sum(-1).mean() / var
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sae.normalize_decoder()
    return sae


def controller_row(name: str, feats: dict, cloze: dict, l1: float, features: str) -> tuple[dict, torch.Tensor, dict]:
    """Fit gains on the fit split, score the eval split before (c = 0) and after. -> (table row, c, fit accuracies)."""
    dev = feats["fit"].G.device
    ans = {s: cloze[s].answer.to(dev) for s in cloze}
    c = fit_gains(feats["fit"], ans["fit"], l1, GAIN_STEPS, GAIN_LR)  # looked up now: tests shorten them
    zero = torch.zeros_like(c)
    before, after = accuracy(feats["eval"], ans["eval"], zero), accuracy(feats["eval"], ans["eval"], c)
    fit_acc = {"before": accuracy(feats["fit"], ans["fit"], zero), "after": accuracy(feats["fit"], ans["fit"], c)}
    # a gain whose term never fires on the fit examples gets no gradient: of the K trainable gains, only the
    # terms active there can move, and the two controllers differ in how many that is
    fit = feats["fit"]
    active = int(torch.unique(fit.idx[fit.G.abs().sum(1) > 0]).numel())  # terms with a non-zero logit on an option
    row = {"model/controller": name, "features": features, "acc before": before, "acc after": after,
           "gain (points)": 100 * (after - before), "non-zero gains": int((c.abs() > NONZERO).sum()),
           "trainable params": c.numel(), "terms active on fit": active}
    return row, c, fit_acc


@torch.no_grad()
def top_gains(model: PRISM, feats: GainFeatures, c: torch.Tensor, tok, n: int = 3, top: int = 5) -> list[dict]:
    """The n largest |c_i| (non-zero only): the prototype id (its card in prototypes.html, analysis-prototypes.html
    for --no-train), the gain, in how many fit examples it is active, and its logit signature's top tokens."""
    n = min(n, int((c.abs() > NONZERO).sum()))
    ids = c.abs().topk(n).indices.tolist() if n else []
    W = model.wte.weight.float()
    return [{"proto": i, "gain": c[i].item(), "active in fit examples": int((feats.idx == i).any(1).sum()),
             "signature": token_pieces(tok, (model.P[i].float() @ W.T).topk(top).indices.tolist())} for i in ids]


def controller_experiment(model, dense, data, cfg, log) -> dict:
    """Spec §6.3: a sparse linear controller over PRISM's active prototypes, l' = W(z + Σ_{i∈A} c_i a_i p_i),
    against the same controller over a top-k SAE's latents on the dense twin, l' = W(z + Σ_j c_j f_j d_j) (latents
    scaled inside the SAE reconstruction, the SAE error kept), on a 4-way cloze (build_cloze). Both: K gains (the SAE
    has as many latents as PRISM has prototypes, and the same k), the same L1 weight --controller-l1, the same
    optimiser and steps (fit_gains), the same fit/eval split; backbones frozen. dense=None: the SAE side is skipped.
    -> {"table", "summary", "examples", "top_gains", ...}; {} (one log line) when the val split is too small."""
    tok, dev = data.tokenizer, data.device
    sizes = CONTROLLER_SIZES["cuda" if dev.type == "cuda" else "cpu"]
    tokens = torch.from_numpy(data.tokens("val").astype("int64"))
    words = cloze_words(tok, tokens)
    sets = build_cloze(tokens, words, cfg.ctx, sizes["examples"], cfg.seed)
    if sets is None:
        why = (f"only {len(words)} whole-word tokens (a byte or character tokenizer has almost none)" if len(words) < 4
               else f"the val split ({len(tokens):,} tokens) is too small")
        log(f"controller: {why} for the 4-way cloze; skipped")
        return {}
    cloze = dict(zip(("fit", "eval"), sets))
    # the frequency shortcut left: a context-free scorer, each option's count in the fit half of the stream
    counts = torch.bincount(tokens[: len(tokens) // 2], minlength=int(tokens.max()) + 1)
    unigram = int((counts[cloze["eval"].options].argmax(1) == cloze["eval"].answer).sum()) / len(cloze["eval"].pos)
    K, k = model.P.shape[0], model.cfg.topk
    log(f"controller task: 4-way cloze on the val split, {len(cloze['fit'].pos)} fit examples (first half of the "
        f"stream) / {len(cloze['eval'].pos)} eval (second half), context {cfg.ctx} tokens; chance 25%, a context-free "
        f"unigram scorer {unigram:.1%}")
    model.eval()
    with torch.no_grad():
        feats = {s: prism_features(model, last_hidden(model, d.x, dev), d.options.to(dev)) for s, d in cloze.items()}
    row, c, fit_acc = controller_row("PRISM + prototype gains", feats, cloze, cfg.controller_l1,
                                     f"{K} prototypes, k={k}")
    rows, fit_accs = [row], {"prism": fit_acc}
    tops = top_gains(model, feats["fit"], c, tok)
    log(f"controller PRISM: eval accuracy {row['acc before']:.1%} -> {row['acc after']:.1%} "
        f"({row['gain (points)']:+.2f} points; fit {fit_acc['before']:.1%} -> {fit_acc['after']:.1%}), "
        f"{row['non-zero gains']}/{K} non-zero gains ({row['terms active on fit']} prototypes active on the fit "
        f"examples, the only gains that can move); largest: "
        + (", ".join(f"p{t['proto']} {t['gain']:+.2f} ({' '.join(t['signature'][:3])!r})" for t in tops) or "none"))
    sae_info = None
    if dense is None:
        log("controller SAE: no dense twin (--no-twin, or no ckpt-dense.pt); the SAE controller is skipped")
    else:
        dense.eval()
        with torch.no_grad():
            windows = train_windows(data, sizes["sae_windows"], cfg.ctx)[:, :-1]
            z_train = torch.cat([dense.hidden(windows[s:s + 16].to(dev)).flatten(0, 1).float()
                                 for s in range(0, len(windows), 16)])
        sae = train_sae(z_train, K, k, sizes["sae_steps"], cfg.seed)
        with torch.no_grad():
            z_d = {s: last_hidden(dense, d.x, dev) for s, d in cloze.items()}
            feats_d = {}
            for s, d in cloze.items():
                idx, f = sae.encode(z_d[s])
                feats_d[s] = gain_features(lambda zz: F.linear(zz, dense.wte.weight), z_d[s], idx, f, sae.W_dec,
                                           dense.wte.weight, d.options.to(dev))
            used = torch.zeros(K, dtype=torch.bool, device=dev)
            for s in range(0, len(z_train), 4096):
                used[sae.encode(z_train[s:s + 4096])[0].flatten()] = True
        sae_info = {"latents": K, "k": k, "train_tokens": len(z_train), "steps": sizes["sae_steps"],
                    "fvu_train": fvu(sae, z_train), "fvu_val": fvu(sae, z_d["eval"]), "dead": int((~used).sum())}
        row_d, _, fit_acc_d = controller_row("dense twin + SAE latent gains", feats_d, cloze, cfg.controller_l1,
                                             f"{K} SAE latents, k={k}, FVU {sae_info['fvu_val']:.3f}")
        rows.append(row_d)
        fit_accs["sae"] = fit_acc_d
        log(f"controller SAE: top-k SAE on {len(z_train):,} dense-twin training states, FVU "
            f"{sae_info['fvu_train']:.3f} (train) / {sae_info['fvu_val']:.3f} (val), {sae_info['dead']} dead latents; "
            f"eval accuracy {row_d['acc before']:.1%} -> {row_d['acc after']:.1%} ({row_d['gain (points)']:+.2f} "
            f"points; fit {fit_acc_d['before']:.1%} -> {fit_acc_d['after']:.1%}), {row_d['non-zero gains']}/{K} "
            f"non-zero gains ({row_d['terms active on fit']} latents active on the fit examples)")
    n_fit, n_eval = len(cloze["fit"].pos), len(cloze["eval"].pos)
    sae_part = (f"the SAE controller {rows[1]['acc before']:.1%} -> {rows[1]['acc after']:.1%} "
                f"({rows[1]['gain (points)']:+.2f} points)" if len(rows) > 1 else "no SAE controller (no dense twin)")
    summary = (f"4-way cloze on held-out {cfg.dataset} text (chance 25%, unigram scorer {unigram:.1%}), gains fitted "
               f"on {n_fit} examples and scored on {n_eval} others: the prototype controller moves accuracy "
               f"{row['acc before']:.1%} -> {row['acc after']:.1%} ({row['gain (points)']:+.2f} points), {sae_part} "
               "(paper: +2.72 vs +0.32 points on four multiple-choice tasks)")
    log(summary)
    return {"table": rows, "summary": summary, "examples": {"fit": n_fit, "eval": n_eval}, "top_gains": tops,
            "fit_accuracy": fit_accs, "unigram_accuracy": unigram, "sae": sae_info,
            "task": f"4-way cloze, val split, fit = first half / eval = second half of the stream, {cfg.ctx}-token "
                    f"contexts, distractors within ±{CLOZE_BAND} ranks among the {CLOZE_WORDS} most frequent words, "
                    f"l1 {cfg.controller_l1}, {GAIN_STEPS} proximal-Adam steps (lr {GAIN_LR})"}


def sample_text(model, tok, prompt: str, n: int, device, seed: int, temperature: float = 0.8) -> str:
    ids = tok.encode(prompt.replace("\\n", "\n").replace("\\t", "\t")) or [tok.eot]  # "\n" typed in a shell
    g = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(torch.tensor([ids], device=device), n, temperature, generator=g)
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


# bench's models: (--head, --dot-precision) per run name
BENCH_RUNS = {"dense": ("dense", "fp32"), "prism": ("prism", "fp32"), "prism_bf16": ("prism", "bf16")}
BENCH_PRISMS = ("prism", "prism_bf16")


def bench(cfg: Config, vocab_size: int, device, autocast, log=print) -> dict:
    """Training tokens/s of PRISM, with fp32 and with bf16 dots in the top-k selection (whatever --dot-precision
    says: both are timed), and of its dense twin (same backbone, same recipe, random tokens, steps alternated so
    drift hits all alike), their heads alone (bench_head), R1/R2's pairs read off the selection against a separate
    search (bench_pairs), and the top-k kernel against the torch reference (bench_kernel)."""
    B, T = min(cfg.batch_size, 16), cfg.ctx
    res = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "batch": B, "ctx": T}
    log(f"bench: {cfg.layers} layers, d={cfg.d_model}, K={cfg.n_protos}, k={cfg.topk}, vocab {vocab_size}, "
        f"batch {B}x{T}")
    runs = {}
    for h, (head, precision) in BENCH_RUNS.items():
        c = replace(cfg, head=head, init="random", dropout=0.0, dot_precision=precision)
        torch.manual_seed(cfg.seed)
        m = PRISM(c, vocab_size).to(device)
        runs[h] = (m, make_optimizer(m, c, device.type))
    x = torch.randint(0, vocab_size, (B, T), device=device)
    y = torch.randint(0, vocab_size, (B, T), device=device)

    def step(h):
        m, opt = runs[h]
        with autocast:
            loss, _ = m(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
    times = {h: [] for h in runs}
    reps = 20 if device.type == "cuda" else 9
    for i in range(reps + 2):
        for h in runs:
            t = time.perf_counter()
            step(h)
            if i >= 2:  # two warm-up rounds
                times[h].append(time.perf_counter() - t)
    tok_s = {h: B * T / sorted(v)[len(v) // 2] for h, v in times.items()}
    res["train_tok_s"] = tok_s
    res["throughput_ratio"] = tok_s["prism"] / tok_s["dense"]
    res["throughput_ratio_bf16"] = tok_s["prism_bf16"] / tok_s["dense"]
    log(f"training tokens/s: dense {tok_s['dense']:,.0f}, PRISM {tok_s['prism']:,.0f}: "
        f"PRISM / dense = {res['throughput_ratio']:.1%} (paper: 97.3% at XL); with bf16 dots "
        f"{tok_s['prism_bf16']:,.0f}: {res['throughput_ratio_bf16']:.1%}")
    step_extra = {h: 1e3 * B * T * (1 / tok_s[h] - 1 / tok_s["dense"]) for h in BENCH_PRISMS}
    res["head"] = bench_head(runs, x, y, step_extra, device, autocast, log)
    res["pairs"] = bench_pairs(device, log)
    res["kernel"] = bench_kernel(device, log)
    return res


def bench_head(runs: dict, x, y, step_extra_ms: dict, device, autocast, log=print) -> dict:
    """Where PRISM's extra step time goes: each model's output layer and losses alone (head_loss, forward +
    backward from fixed final hidden states of the bench batch), and within each PRISM's the top-k selection with
    its R1/R2 pairs (the model's own prototypes(), forward + backward through a), timed side by side. The head's
    extra time near the whole step's (step_extra_ms, per PRISM run) says the head is the cost; a step's extra well
    above it, that something around the head is (a wait for the GPU, say)."""
    ms, hidden = {}, {}
    for h, (m, _) in runs.items():
        with torch.no_grad(), autocast:
            z = hidden[h] = m.hidden(x).requires_grad_()

        def head():
            with autocast:
                loss, _ = m.head_loss(z, y)
            loss.backward()
            m.zero_grad(set_to_none=True)
            z.grad = None
        ms[h] = 1e3 * bench_time(head, device)
    out = {"dense_ms": ms["dense"]}
    for h in BENCH_PRISMS:
        m = runs[h][0]
        zf = hidden[h].detach().flatten(0, 1).requires_grad_()

        def topk():  # the model's own selection (its backend, --dot-precision and --act), with the pairs
            with autocast:
                _, a, _ = m.prototypes(zf, pairs=m.cfg.dist)
            a.sum().backward()
            m.zero_grad(set_to_none=True)
            zf.grad = None
        sfx = h[len("prism"):]  # "" or "_bf16"
        out.update({f"prism{sfx}_ms": ms[h], f"extra{sfx}_ms": ms[h] - ms["dense"],
                    f"topk{sfx}_ms": 1e3 * bench_time(topk, device), f"step_extra{sfx}_ms": step_extra_ms[h]})
        log(f"head alone, forward + backward from fixed hidden states: dense {ms['dense']:.2f} ms, PRISM"
            f"{' (bf16 dots)' if sfx else ''} {ms[h]:.2f} ms ({out[f'extra{sfx}_ms']:+.2f} ms; its top-k with the "
            f"pairs {out[f'topk{sfx}_ms']:.2f} ms); the whole step's extra {step_extra_ms[h]:+.2f} ms")
    return out


BENCH_PAIRS_SHAPE = {"cuda": (16384, 8192, 768), "cpu": (2048, 8192, 768)}  # (N, K, d), looked up per call: tests shrink


def bench_pairs(device, log=print) -> dict:
    """R1/R2's nearest pairs as training finds them (read off the top-k selection's cosines) against the selection
    followed by a separate nearest_pairs search (a second [N, K] GEMM, IEEE fp32): forward only (the pairs carry no
    gradient), squared L2, k = 16, fp32 z, the --preset paper sizes on CUDA (the Triton kernel), N = 2048 without
    one (the chunked torch form)."""
    N, K, d = BENCH_PAIRS_SHAPE["cuda" if device.type == "cuda" else "cpu"]
    z, P = torch.randn(N, d, device=device), torch.randn(K, d, device=device)

    def separate():
        proto_topk(z, P, 16)
        nearest_pairs(z, P, "l2")
    with torch.no_grad():
        ms = {name: 1e3 * bench_time(fn, device) for name, fn in
              (("separate", separate), ("fused", lambda: proto_topk(z, P, 16, pairs="l2")))}
    out = {"N": N, "K": K, "d": d, "fused_ms": ms["fused"], "separate_ms": ms["separate"],
           "speedup": ms["separate"] / ms["fused"]}
    log(f"pairs: N = {N:,}, K = {K:,}, d = {d}, k = 16, squared L2: top-k with R1/R2's pairs {ms['fused']:.2f} ms, "
        f"top-k then nearest_pairs {ms['separate']:.2f} ms ({out['speedup']:.2f}x)")
    return out


def bench_kernel(device, log=print) -> dict:
    """proto_topk: the Triton kernel (running top-k, no N×K scores) against the torch reference (normalise,
    GEMM, ReLU, torch.topk), forward + backward, N = 16,384 tokens, d = 768, k = 16, bf16 z; time and peak memory.
    Like precision: the kernel's tl.dot is 3xTF32 (near-fp32), so the reference runs under full_fp32 (IEEE; run() turns
    TF32 on for training), not as a TF32 GEMM, which would time a cheaper and less precise reference. The kernel
    with bf16 dots (--dot-precision bf16) is timed beside them, against the same fp32 reference."""
    if device.type != "cuda" or not HAS_TRITON:
        log("kernel: the Triton top-k needs a CUDA GPU; skipped")
        return {}
    out = {"precision": f"fp32 scores: kernel tl.dot {PROTO_TOPK_DOT_PRECISION}, torch IEEE GEMMs (TF32 off); "
                        "triton_bf16: bf16 dots, fp32 accumulation"}
    N, d, k = 16384, 768, 16
    log(f"kernel: proto_topk forward + backward, N = {N:,}, d = {d}, k = {k}, bf16 z; {out['precision']}")

    def reference(z, P):  # what one would write in torch: the N×K scores, then torch.topk
        s = (F.normalize(z.float(), dim=-1) @ F.normalize(P.float(), dim=-1).T).relu()
        a, idx = s.topk(k, dim=-1)
        return idx, a
    for K in (4096, 8192, 16384):
        z = torch.randn(N, d, device=device, dtype=torch.bfloat16, requires_grad=True)
        P = torch.randn(K, d, device=device, requires_grad=True)
        ga = torch.randn(N, k, device=device)
        row = {}
        for name, fn in (("torch", reference), ("triton", lambda z, P: proto_topk(z, P, k, backend="triton")),
                         ("triton_bf16", lambda z, P: proto_topk(z, P, k, backend="triton", precision="bf16"))):
            def fb():
                with full_fp32():  # forward and backward: the torch reference's GEMMs in IEEE fp32
                    _, a = fn(z, P)
                    (a * ga).sum().backward()
            z.grad = P.grad = None  # each form allocates its own gradients inside the measured peak
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
            fb()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated(device) - base
            row[name] = {"ms": 1e3 * bench_time(fb, device), "peak_mb": peak / 2**20}
        row["speedup"] = row["torch"]["ms"] / row["triton"]["ms"]
        row["speedup_bf16"] = row["torch"]["ms"] / row["triton_bf16"]["ms"]
        out[f"K{K}"] = row
        log(f"kernel K={K}: triton {row['triton']['ms']:.2f} ms ({row['speedup']:.2f}x faster than torch), peak "
            f"{row['triton']['peak_mb']:.0f} MB vs {row['torch']['peak_mb']:.0f} MB; with bf16 dots "
            f"{row['triton_bf16']['ms']:.2f} ms ({row['speedup_bf16']:.2f}x), "
            f"peak {row['triton_bf16']['peak_mb']:.0f} MB")
    return out


def loss_figure(histories: dict) -> str:
    """Training and val loss curves as a base64 PNG (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, h in histories.items():
        if h["train"]:
            ax.plot(*zip(*h["train"]), label=f"{name} train (total loss)", alpha=0.7)
        if h["val"]:
            ax.plot(h["step"], h["val"], "o-", label=f"{name} val CE")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def table_html(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        return f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "".join("<tr>" + "".join(f"<td>{fmt(r.get(c, ''))}</td>" for c in cols) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def resolved(asked: str, got: str) -> str:
    """'auto → cpu': the value asked for and the one the run used, so the configuration and the header agree."""
    return asked if not got or asked == got else f"{asked} → {got}"


def write_report(out_dir: Path, cfg: Config, results: dict, histories: dict, name: str = "report") -> Path:
    from common import unk_targets_cell

    preset, device = (resolved(getattr(cfg, k), results.get(k, "")) for k in ("preset", "device"))
    parts = [f"<h1>PRISM report</h1><p>{html.escape(time.strftime('%Y-%m-%d %H:%M'))}, preset "
             f"{html.escape(preset)}, device {html.escape(device)}</p>",
             "<h2>Configuration</h2>" + table_html([{**asdict(cfg), "preset": preset, "device": device,
                                                    "dtype": resolved(cfg.dtype, results.get("dtype", ""))}],
                                                   list(asdict(cfg)))]
    if histories:
        parts.append(f'<h2>Training</h2><img src="data:image/png;base64,{loss_figure(histories)}">')
        evals = histories.get("prism", {}).get("evals", [])
        # the column names carry their definitions: CE is estimate_loss's sample of val batches (the Validation
        # table below predicts every token), and `used` counts the training activations since the previous
        # evaluation (train's usage), not the val batches
        ce = f"val CE ({cfg.eval_iters} batches)"
        used = f"used (of K={cfg.n_protos}, since the last eval)"
        rows = [{"step": e["step"], ce: e["ce"], "|r|/|z|": e.get("r_over_z", ""), "REC": e.get("rec", ""),
                 "R1": e.get("r1", ""), "R2": e.get("r2", ""), "non-zero a": e.get("nnz", ""),
                 used: "" if e.get("used") is None else e["used"],
                 **{f"R̄1/R2 τ={t}": f"{e['cover_r1'][t]:.2f} / {e['cover_r2'][t]:.2f}" for t in TAUS if "cover_r1" in e}}
                for e in evals]
        if rows:
            parts.append("<h3>PRISM evaluations</h3>"
                         f"<p>{html.escape(ce)}: the mean cross-entropy over {cfg.eval_iters} random val batches of "
                         f"{cfg.batch_size} × {cfg.ctx} tokens ({cfg.eval_iters * cfg.batch_size * cfg.ctx:,} tokens, "
                         "not every val token: the Validation table does that); the other figures are over the same "
                         f"batches. {html.escape(used)}: prototypes active on at least one training token in the "
                         f"{cfg.eval_interval} training steps since the previous evaluation, or since the seeding "
                         "for the first one (blank before the prototypes are seeded); K minus it are dead.</p>"
                         + table_html(rows, list(rows[-1])))
    if "ppl" in results:
        parts.append("<h2>Validation (every token once)</h2>" + table_html(
            [{"model": k, "loss": v["loss"], "ppl": v["ppl"], "tokens": v["tokens"],
              "without the unk targets": unk_targets_cell(v)}
             for k, v in results["ppl"].items()], ["model", "loss", "ppl", "tokens", "without the unk targets"]))
        if "gap" in results:
            parts.append(f"<p>PRISM val loss vs the dense twin: {results['gap']:+.2%} (paper: within 5%)</p>")
        elif "gap_skipped" in results:
            parts.append(f"<p>PRISM val loss vs the dense twin not computed: {html.escape(results['gap_skipped'])}</p>")
    if "cards" in results:
        c = results["cards"]
        parts.append(f'<h2>Prototype cards</h2><p>{c["used"]} prototypes active, {c["dead"]} never, over '
                     f'{c["tokens"]:,} training tokens: <a href="{c["file"]}">{c["file"]}</a> (and its .json)</p>')
    if "decomposition" in results:
        d = results["decomposition"]
        # repr(): a newline or a space token would otherwise be a blank cell
        rows = [{"token": repr(r["token"]), "in": "prompt" if r.get("prompt") else "generated", "logit": r["logit"],
                 "residual slice": r["residual"],
                 "largest prototype slices": ", ".join(f"p{i}: {v:+.2f}" for i, v in r["prototypes"]),
                 "other active slices (n: sum)": f"{r['other'][0]}: {r['other'][1]:+.2f}" if r["other"][0] else "—"}
                for r in d["rows"]]
        n_prompt = sum(bool(r.get("prompt")) for r in d["rows"])
        parts.append(f"<h2>Logit decomposition of a prompt and its generated continuation</h2><p>Each row is the "
                     f"logit of the token shown (the model's next-token target); the rows marked prompt "
                     f"({n_prompt} of {len(rows)}, first) are the prompt's tokens, the others generated. The "
                     f"largest slices, the other active ones' sum and the residual add up to the logit, max |error| "
                     f"{d['max_abs_error']:.2e}</p>" + table_html(rows, list(rows[0]) if rows else []))
    if results.get("attribution"):
        a = results["attribution"]
        # the JSON keeps the plain key; the header says it is a mean over the queries (255.9 of 256, not "all")
        mean = "sequences scored (mean per query)"
        rows = [{(mean if k == "sequences scored" else k): v for k, v in r.items()} for r in a["table"]]
        parts.append("<h2>Training-data attribution</h2>" + f"<p>{html.escape(a.get('summary', ''))}</p>"
                     + table_html(rows, list(rows[0])))
        if a.get("gradients_only"):
            g = a["gradients_only"]
            parts.append(f"<p>Without curvature in either ranking (gradients alone), cached vs exact top-10/top-100 "
                         f"overlap {overlap_text(g)}.</p>")
        if a.get("same_curvature"):
            g, cv = a["same_curvature"], a["curvature_only"]
            parts.append(f"<p>One approximation at a time: with the cache's curvature in both rankings, cached vs exact "
                         f"gradients {overlap_text(g)} (the gradients alone); the exact gradients ranked with the "
                         f"cache's curvature vs the exact ranking {overlap_text(cv)} (the curvature alone).</p>")
        if a.get("vs_ekfac"):
            rows = [{"method": name, **o} for name, o in a["vs_ekfac"].items()]
            parts.append("<p>Each ranking against EK-FAC's (the paper also reports overlap with EK-FAC):</p>"
                         + table_html(rows, list(rows[0])))
        if a.get("damping_sweep"):
            rows = [{"--attr-damping": f"{r['attr_damping']:g}", **{f"{name} {n}": (
                         f"{r[key][f'{n} overlap']:.2f}" if "skipped" not in r else "skipped")
                     for key, name in (("cached", "cached vs exact"), ("same_curvature", "cache's curvature in both"),
                                       ("curvature_only", "curvature alone")) for n in ("top-10", "top-100")}}
                    for r in a["damping_sweep"]]
            parts.append("<p>The same rankings at other dampings (each method's λ relative to its own curvature's mean "
                         "non-zero eigenvalue; the gradients reused):</p>" + table_html(rows, list(rows[0])))
        for curv, s in (a.get("fixed_a_spectrum") or {}).items():
            if curv == "lam0":
                continue
            rows = [{"μ/λ₀": band_label(*b["band"]), "directions": b["directions"],
                     "share of Σ|g|²": percent(b["gradient share"]), "share of Σ|e|²": percent(b["error share"]),
                     **{f"|e|/|g|, {who}": ratio_text(b[key])
                        for key, who in (("train", "training windows"), ("query", "queries"))}} for b in s["bands"]]
            parts.append(f"<p>Where the cache's fixed-a gradients g^c differ from the exact ones g, e = g − g^c, in the "
                         f"{curv} curvature H's eigenbasis, by band of eigenvalue μ over λ₀ = "
                         f"{a['fixed_a_spectrum']['lam0']:.3g} (the damping's scale: at --attr-damping x the damping "
                         "dominates the directions below x). Weighted by (H + λI)⁻¹ as the ranking weights them, "
                         "|e|/|g| is " + ", ".join(
                             f"{r['train']:.2f} ({r['query']:.2f} for the queries) at {r['attr_damping']:g}"
                             if r["query"] is not None else f"{r['train']:.2f} at {r['attr_damping']:g}"
                             for r in s["sweep"]) + ".</p>" + table_html(rows, list(rows[0])))
        if a.get("retrain"):
            rt = a["retrain"]
            n = len(rt["queries"])
            rows = [{"left out": r["method"], "Δ query loss (nats)": plus_minus(r["delta"], r["se"]),
                     "queries above random": "" if r["above random"] is None else f"{r['above random']}/{n}",
                     **({"first-order prediction (nats)": f"{r['predicted']:+.4f}"} if "predicted" in r else {}),
                     f"Δ minus {rt['first']}'s, paired": plus_minus(r["vs first"]["delta"], r["vs first"]["se"])
                     if "vs first" in r else "",
                     "queries above it": f"{r['vs first']['above']}/{n}" if "vs first" in r else ""}
                    for r in rt["rows"]]
            parts.append(f"<p>Retraining check ({n} quer{'ies' if n > 1 else 'y'}): each method's top {rt['k']} "
                         f"of the {rt['seqs']} windows left out of {rt['epochs']} epoch(s) of plain SGD (lr "
                         f"{rt['lr']:g}, batches of {rt['batch']}) continued from the trained weights; Δ is the "
                         "query's loss minus that after the same training with nothing left out (proponents left "
                         f"out: Δ &gt; 0, above the random windows'; noise floor {rt['noise']:.1e} nats)."
                         + ("" if not rt.get("first_order") else
                            " The first-order prediction is lr·epochs/(B·T) × the left-out windows' dense TracIn "
                            f"scores; over the {rt['first_order']['pairs']} (method, query) pairs the measured Δ "
                            f"correlates with it at {rt['first_order']['r']:.3f}, measured = "
                            f"{rt['first_order']['slope']:.3f} × predicted (near 1 and 1: TracIn's linear regime, "
                            "where TracIn's top k has the largest prediction by construction).")
                         + "</p>" + table_html(rows, list(rows[0])))
        if a.get("cache_s"):
            parts.append(f"<p>The cache's S = E[δδᵀ]: {html.escape(a['cache_s']['label'])} "
                         f"(--attr-s {html.escape(a['cache_s']['s'])}).</p>")
        if a.get("exact_curvature"):
            parts.append(f"<p>The exact reference's curvature: {html.escape(a['exact_curvature']['label'])} "
                         f"(--attr-exact-curvature {html.escape(a['exact_curvature']['curvature'])}).</p>")
        if a.get("reference_redraw"):
            r = a["reference_redraw"]
            parts.append(f"<p>The exact reference re-drawn (its targets drawn from --seed + 1) vs itself: top-10/top-100 "
                         f"overlap {overlap_text(r)}. The reference is a Monte-Carlo "
                         f"estimate: an overlap with exact at or below this is within its sampling noise.</p>")
    for r in results.get("suppression", []):
        kw = r["keywords"]  # none: --suppress IDS whose signatures hold no word, so no rate was measured
        on = f"first {r['ppl_tokens']:,} val tokens"  # a subset: not the Validation table's whole split
        row = {"prototypes": r["prototypes"], "share of the bank": f"{r['fraction']:.2%}", "factor": r["factor"],
               "generations": r["generations"], "keyword rate before (per 1k words)": r["rate_before"] if kw else "—",
               "keyword rate after (per 1k words)": r["rate_after"] if kw else "—", f"val ppl before ({on})":
               r["ppl_before"], f"val ppl after ({on})": r["ppl_after"], "ppl change": f"{r['ppl_change']:+.2%}"}
        effect = f"<p>{html.escape(suppression_effect(r))}.</p>" if "fired_val" in r else ""
        title = ", ".join(kw) if kw else "prototypes " + ", ".join(map(str, r["prototypes"])) + "; no keyword rate"
        parts.append(f"<h2>Suppression ({html.escape(title)})</h2>" + table_html([row], list(row))
                     + effect + (f"<p>The first generation, from the prompt {html.escape(repr(r['example']['prompt']))} "
                                 "(its continuation only), without and with the suppression:</p>"
                                 if "prompt" in r["example"] else "")
                     + f"<pre>before: {html.escape(r['example']['before'])}\n\n"
                       f"after: {html.escape(r['example']['after'])}</pre>")
    if results.get("controller"):
        c = results["controller"]
        # accuracies in %, as the summary prints them beside the gain in points ("40.0% -> 40.2% (+0.17 points)")
        rows = [{**r, "acc before": f"{r['acc before']:.1%}", "acc after": f"{r['acc after']:.1%}",
                 "gain (points)": f"{r['gain (points)']:+.2f}"} for r in c["table"]]
        parts.append("<h2>Controllers (4-way cloze)</h2>" + f"<p>{html.escape(c.get('summary', ''))}</p>"
                     + table_html(rows, list(rows[0])))
    if results.get("samples"):
        heads = results["samples"]
        # run() samples every head from the same prompt with the same generator seed: a paired comparison
        paired = (f"<p>The same prompt and generator seed ({cfg.seed}) for each head: a paired comparison, the "
                  "differences come from the head.</p>" if len(heads) > 1 else "")
        parts.append(f"<h2>Samples ({html.escape(', '.join(heads))})</h2>" + paired
                     + "".join(f"<h3>{html.escape(h)}</h3>" + "".join(f"<pre>{html.escape(s)}</pre>" for s in samples)
                               for h, samples in heads.items()))
    path = out_dir / f"{name}.html"
    path.write_text("<!doctype html><meta charset=utf-8><title>PRISM report</title><style>body{font-family:"
                    "sans-serif;max-width:1100px}table{border-collapse:collapse;font-size:12px}td,th{border:1px "
                    "solid #ccc;padding:2px 6px}pre{background:#f6f6f6;padding:6px;white-space:pre-wrap}</style>"
                    + "".join(parts))
    return path


# -----------------------------------------------------------------------------
# main


class Logger:
    """print() on rank 0, and the same lines appended to out_dir/log-<head>.txt."""

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


def validate(cfg: Config) -> None:
    """Every bad flag value found before anything is trained, each as one line."""
    seeds = [f.name for f in fields(cfg) if f.name.endswith("seed") and not 0 <= getattr(cfg, f.name) < 2**32]
    if seeds:  # torch.manual_seed overflows past 64 bits with a traceback; numpy's legacy seeding past 32
        raise RunError(f"--{seeds[0].replace('_', '-')} must be in [0, 2**32)")
    checks = [(1 <= cfg.layers <= MAX_LAYERS, f"--layers must be in [1, {MAX_LAYERS}]"), (cfg.heads >= 1, "--heads must be >= 1"),
              (cfg.d_model >= 1, "--d-model must be >= 1"),
              (cfg.heads < 1 or cfg.d_model % cfg.heads == 0,
               f"--d-model {cfg.d_model} must split into --heads {cfg.heads} heads"),
              (cfg.n_protos >= 1, "--n-protos must be >= 1"),
              (1 <= cfg.topk <= cfg.n_protos, "--topk must be in [1, --n-protos]"),
              (cfg.ctx >= 1, "--ctx must be >= 1"), (cfg.batch_size >= 1, "--batch-size must be >= 1"),
              (cfg.max_iters >= 1, "--max-iters must be >= 1"),
              (cfg.train or not cfg.resume, "--resume continues training and --no-train trains nothing; give one"),
              (not cfg.bench or cfg.train and not cfg.resume, "--bench times the model and its kernels on random "
                                                              "data, with no checkpoint: drop --resume and --no-train"),
              (cfg.eval_interval >= 1 and cfg.log_interval >= 1 and cfg.eval_iters >= 1, "intervals must be >= 1"),
              (cfg.lr > 0, "--lr must be > 0"), (0 <= cfg.dropout < 1, "--dropout must be in [0, 1)"),
              (0 <= cfg.min_lr_ratio <= 1, "--min-lr-ratio must be in [0, 1]"),
              (0 <= cfg.warmup_frac <= 1, "--warmup-frac must be in [0, 1]"),
              (cfg.weight_decay >= 0, "--weight-decay must be >= 0"), (cfg.grad_clip >= 0, "--grad-clip must be >= 0"),
              (min(cfg.lambda_rec, cfg.lambda_r1, cfg.lambda_r2) >= 0, "loss weights --lambda-* must be >= 0"),
              (cfg.init_steps >= 0, "--init-steps must be >= 0"), (cfg.push_interval >= 0, "--push-interval must be >= 0"),
              (cfg.card_windows >= 1 and cfg.attr_seqs >= 2 and cfg.attr_queries >= 1 and cfg.attr_ctx >= 1,
               "--card-windows, --attr-queries, --attr-ctx must be >= 1 and --attr-seqs >= 2"),
              (cfg.attr_fisher_samples >= 1, "--attr-fisher-samples must be >= 1"),
              (cfg.attr_retrain >= 0, "--attr-retrain must be >= 0 (0: off)"),
              (cfg.attr_retrain_k >= 1, "--attr-retrain-k must be >= 1"),
              (1 <= cfg.attr_retrain_epochs <= 1000, "--attr-retrain-epochs must be in [1, 1000]"),
              (0 < cfg.attr_retrain_lr <= 1e3, "--attr-retrain-lr must be in (0, 1e3]"),
              (cfg.attr_retrain_batch >= 0, "--attr-retrain-batch must be >= 0 (0: the training --batch-size)"),
              (cfg.attr_retrain == 0 or cfg.attr_retrain_k < cfg.attr_seqs,
               "--attr-retrain-k must be below --attr-seqs (the check trains on the windows not left out)"),
              (abs(cfg.suppress_factor) <= 100, "--suppress-factor must be in [-100, 100] (1 keeps the terms, 0 drops "
                                                "them, -1 pushes away)"),
              (0 < cfg.attr_damping <= 1e6, "--attr-damping must be in (0, 1e6]"), (cfg.controller_l1 >= 0, "--controller-l1 must be >= 0"),
              (cfg.sample_tokens >= 0, "--sample-tokens must be >= 0"),
              (cfg.temperature >= 0, "--temperature must be >= 0 (0: greedy)"),
              (cfg.out_dir.strip() != "", "--out-dir is empty (. names the current folder)"),
              (not Path(cfg.out_dir).exists() or Path(cfg.out_dir).is_dir(), f"--out-dir {cfg.out_dir} is a file")]
    for ok, msg in checks:
        if not ok:
            raise RunError(msg)
    if cfg.train and not cfg.resume:  # a resumed run: once its settings are merged (run)
        check_seeding(cfg)
    if cfg.suppress and cfg.train and not cfg.resume:  # otherwise K comes from the checkpoint (checked in run)
        parse_ids(cfg.suppress, cfg.n_protos)
    if cfg.suppress_keywords:
        keywords_of(cfg.suppress_keywords)
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


def check_seeding(cfg: Config) -> None:
    """A PRISM run that starts from step 0 must be able to seed its K prototypes from one batch (spec §3.4)."""
    if cfg.head != "prism" or cfg.init != "kmeans++":
        return
    tokens = cfg.batch_size * cfg.ctx  # the global batch: the ranks' states are gathered for the seeding
    if cfg.init_steps >= cfg.max_iters:
        raise RunError(f"--init-steps {cfg.init_steps} leaves no step for the prototypes (--max-iters {cfg.max_iters})")
    if tokens < cfg.n_protos:
        raise RunError(f"k-means++ seeding draws K={cfg.n_protos} prototypes from one batch of {tokens} tokens; "
                       "raise --batch-size/--ctx or use --init random")


def attribution_runs(cfg: Config) -> bool:
    """The attribution experiment needs the prototype head (under --resid-grad full too: spec §2.3 A)."""
    return cfg.head == "prism" and cfg.attribution


def unused_flags(cfg: Config, explicit) -> list[str]:
    """Typed flags that this invocation does not use (an analysis that is off, a prototype setting of the dense
    head), each with why: notes for the log. Such a flag does no harm, but it should not pass unseen."""
    prism = cfg.head == "prism"
    attribution = (attribution_runs(cfg), "attribution is off: --no-attribution, or --head dense")
    suppression = prism and bool(cfg.suppress or cfg.suppress_keywords)
    why = {"suppress_factor": (suppression, "no suppression runs: "
                               "--suppress and --suppress-keywords are empty, or --head dense"),
           **{k: attribution for k in ("attr_seqs", "attr_queries", "attr_ctx", "attr_damping", "attr_curvature",
                                         "attr_exact_curvature", "attr_s", "ekfac", "attr_retrain")},
           **{k: (attribution_runs(cfg) and cfg.attr_retrain > 0, "no retraining check: --attr-retrain 0, "
                  "--no-attribution or --head dense") for k in ("attr_retrain_k", "attr_retrain_epochs",
                                                                 "attr_retrain_lr", "attr_retrain_batch")},
           "attr_fisher_samples": (attribution_runs(cfg) and "fisher" in (cfg.attr_exact_curvature, cfg.attr_s),
                                   "no sampled curvature: --attr-exact-curvature and --attr-s empirical, "
                                   "--no-attribution or --head dense"),
           "controller_l1": (prism and cfg.controller, "the controllers are off: --no-controller, or --head dense"),
           "card_windows": (prism and bool(cfg.cards or cfg.suppress_keywords), "no cards are built: --no-cards and "
                            "no --suppress-keywords, or --head dense"),
           "twin": (prism, "--head dense trains the twin alone"),
           **{k: (prism, "--head dense has no prototypes") for k in (
               "n_protos", "topk", "dot_precision", "act", "resid_grad", "lambda_rec", "lambda_r1", "lambda_r2", "rec",
               "dist", "r1_detach_z", "init", "init_steps", "revive_dead", "push_interval")},
           "sample_tokens": (cfg.train or cfg.sample is not None or suppression, "no samples: a --no-train run "
                             "samples only with --sample, or in suppression's generations"),
           "temperature": (cfg.train or cfg.sample is not None or suppression or prism and cfg.cards, "no text is "
                           "generated: a --no-train run generates only with --sample, suppression or the cards' "
                           "decomposed text")}
    if not cfg.train:  # load_checkpoint kept the checkpoint's value: the typed one went unused, whatever else
        why.update(dict.fromkeys(TRAINING_KEYS, (False, "--no-train trains nothing: the checkpoint's value stays")))
        if prism:  # (the dense head's note above stays: it has no prototypes to select)
            why["dot_precision"] = (False, "--no-train keeps the checkpoint's value, so that the analyses select "
                                           "prototypes as training did")
    return [f"note: --{k.replace('_', '-')} has no effect in this run ({msg})" for k, (used, msg) in why.items()
            if k in explicit and not used and getattr(cfg, k) is not False]  # --no-X of an idle analysis: nothing to say


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


def load_model(ck: dict, c: Config, data, device, path: Path) -> PRISM:
    check_tokenizer(ck, data, path)
    model = PRISM(c, data.vocab_size).to(device)
    load_weights(model, ck["model"], path)
    return model


def twin_history(cfg: Config, histories: dict, log=print) -> Optional[dict]:
    """The dense twin's history for the CE gap: from this run, else from its checkpoint in out_dir if any, when
    that twin was trained with this run's settings (a gap at equal steps to another recipe would mislead)."""
    if "dense" in histories:
        return histories["dense"]
    path = ckpt_path(replace(cfg, head="dense"))
    if not path.exists():
        return None
    try:
        ck = load_checkpoint(path, replace(cfg, head="dense"))[0]
    except RunError as e:  # an unreadable twin only costs the gap column
        log(f"gap to dense: not computed, {e}")
        return None
    recipe = [k for k in TWIN_KEYS if k in ck["config"] and ck["config"][k] != getattr(cfg, k)]
    if recipe:
        log(f"gap to dense: not computed, {path} was trained with other settings ("
            + ", ".join(f"{k}={ck['config'][k]!r}, here {getattr(cfg, k)!r}" for k in recipe[:3]) + ")")
        return None
    return ck["history"]


def run(cfg: Config, explicit) -> int:
    from common import DataError, load_data, preset_banner, to_json, unk_targets_note, unknown_note

    preset = apply_preset(cfg, explicit)
    validate(cfg)
    if cfg.suppress and "suppress_keywords" not in explicit:  # --suppress IDS alone: those ids, not also auto's
        cfg = replace(cfg, suppress_keywords="")
    typed = [k for k in PROTOTYPE_ANALYSES if k in explicit and getattr(cfg, k)]
    if cfg.head == "dense" and typed:
        raise RunError(f"--{typed[0].replace('_', '-')} is a prototype analysis: it needs --head prism")
    device, autocast, dist_info = setup_device(cfg)
    if cfg.kernels == "triton" and not HAS_TRITON:
        raise RunError(f"--kernels triton needs the triton package, which failed to import ({TRITON_ERROR})")
    if cfg.kernels == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RunError("--kernels triton needs a CUDA device (or TRITON_INTERPRET=1, Triton's slow CPU interpreter)")
    rank = dist_info["rank"]
    heads = ("dense", "prism") if cfg.head == "prism" and cfg.twin else (cfg.head,)
    loaded = {}  # --no-train / --resume: the architecture and the data come from the checkpoints
    if not cfg.train or cfg.resume:
        present = {h: ckpt_path(replace(cfg, head=h)).exists() for h in heads}
        for h in sorted(heads, key=lambda h: h != cfg.head):  # the asked head first: an error names its file
            # a missing twin: --resume trains it from scratch, --no-train goes without it; a missing PRISM beside
            # its twin (a run stopped while the twin trained): --resume resumes the twin, then trains PRISM
            if not present[h] and (h != cfg.head or (cfg.resume and any(present.values()))):
                continue
            path = ckpt_path(replace(cfg, head=h))
            loaded[h] = (path, *load_checkpoint(path, replace(cfg, head=h), explicit))
        saved = loaded.get(cfg.head, next(iter(loaded.values())))[2]
        cfg = replace(cfg, **{k: getattr(saved, k) for k in ARCH_KEYS + MERGED_KEYS if k != "head"})
        if cfg.train:  # against the settings both heads train with (the asked head's), not each file's own
            check_steps({h: (path, ck, replace(cfg, head=h)) for h, (path, ck, _) in loaded.items()})
        heads = tuple(h for h in heads if h in loaded) if not cfg.train else heads
        if cfg.train and "prism" in heads and "prism" not in loaded:  # PRISM starts from step 0 after all
            check_seeding(replace(cfg, head="prism"))
    if cfg.kernels == "triton" and cfg.topk > PROTO_TOPK_MAX_K:  # k as trained: after the checkpoint's settings
        raise RunError(f"--kernels triton: the top-k kernel takes --topk up to {PROTO_TOPK_MAX_K}, not {cfg.topk}; "
                       "use --kernels auto (the torch form for a larger k)")
    if cfg.suppress:
        parse_ids(cfg.suppress, cfg.n_protos)
    attr_asked = cfg.attr_ctx  # the attribution set's windows are training windows: at most ctx tokens long
    cfg = replace(cfg, attr_ctx=min(cfg.attr_ctx, cfg.ctx))
    out_dir = Path(cfg.out_dir)
    log = Logger(None if cfg.bench else out_dir / f"log-{cfg.head}.txt", rank)
    if preset == "cpu" and not cfg.bench and cfg.train and not cfg.resume:  # a resumed run keeps its own settings
        log(preset_banner(cfg, explicit, device, "about 7 minutes on 2 CPU cores", CPU_PRESET, RUNTIME_KEYS))
    log("config: " + json.dumps(asdict(cfg)))
    for note in [] if cfg.bench else unused_flags(cfg, explicit):
        log(note)
    if attr_asked > cfg.ctx and attribution_runs(cfg) and not cfg.bench:
        whose = "" if "attr_ctx" in explicit else "the CPU preset's " if preset == "cpu" else "the default "
        log(f"note: {whose}--attr-ctx {attr_asked} is longer than --ctx {cfg.ctx}: the attribution windows are "
            f"{cfg.ctx} tokens")
    log(f"python {sys.version.split()[0]}, torch {torch.__version__}, triton "
        f"{getattr(triton, '__version__', 'absent')}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    torch.manual_seed(cfg.seed + rank)
    if cfg.bench:  # random tokens: no corpus needed
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
    results = {"preset": preset, "device": str(device),
               "dtype": "bfloat16" if isinstance(autocast, torch.autocast) else "float32"}
    histories, models, recipes = {}, {}, {}  # recipes: what each model was trained with, for the final gap
    start_rng = data.rng_state()
    for h in heads:  # the dense twin first, so PRISM's evaluations can print the gap to it
        c = replace(cfg, head=h, resume=cfg.resume and h in loaded)
        if cfg.train:
            ck = None
            if h in loaded:  # --resume
                path, ck, _ = loaded[h]
                check_tokenizer(ck, data, path)
            elif cfg.resume:
                log(f"{h}: no checkpoint at {ckpt_path(c)} yet; training it from step 0")
            t0 = time.time()
            models[h], histories[h] = train(c, data, device, autocast, dist_info, explicit, log, ck,
                                            twin=twin_history(c, histories, log) if h == "prism" else None,
                                            start_rng=start_rng)
            log(f"{h}: trained in {time.time() - t0:.0f}s; checkpoint {ckpt_path(c)}")
            recipes[h] = {**asdict(c), "step": c.max_iters}
        else:
            path, ck, c = loaded[h]
            models[h], histories[h] = load_model(ck, c, data, device, path), ck["history"]
            recipes[h] = {**ck["config"], "step": ck["step"]}  # as trained, whatever this command typed
    if dist_info["ddp"]:  # the analyses run on rank 0 alone, over the whole val split
        torch.distributed.destroy_process_group()
        data.rank, data.world_size = 0, 1
    if rank != 0:
        return 0
    results["ppl"] = {}
    for h, m in models.items():
        results["ppl"][h] = evaluate_ppl(m, data, cfg.ctx, autocast)
        log(f"{h}: val loss {results['ppl'][h]['loss']:.4f}, perplexity {results['ppl'][h]['ppl']:.2f} over "
            f"{results['ppl'][h]['tokens']:,} tokens" + unk_targets_note(results["ppl"][h]))
    differ = [k for k in GAP_KEYS if len(recipes) == 2 and recipes["prism"].get(k) != recipes["dense"].get(k)]
    if differ:  # --no-train beside a twin trained apart: the gap would not be the prototype head's cost
        results["gap_skipped"] = ("PRISM and the dense twin were trained with other recipes (" + ", ".join(
            f"{k} {recipes['prism'].get(k)!r} vs {recipes['dense'].get(k)!r}" for k in differ) + ")")
        log(f"val loss gap to the dense twin not computed: {results['gap_skipped']}")
    elif len(results["ppl"]) == 2:
        d, p = results["ppl"]["dense"]["loss"], results["ppl"]["prism"]["loss"]
        results["gap"] = p / d - 1
        log(f"val loss PRISM {p:.4f} vs dense twin {d:.4f}: {results['gap']:+.2%} (paper: within 5%)")
    elif cfg.head == "prism" and cfg.twin and "dense" not in models:  # --no-train beside no twin: said once, here
        log(f"note: no dense twin at {ckpt_path(replace(cfg, head='dense'))}: the val loss gap and the SAE controller "
            "on the twin are skipped")
    model = models.get("prism")
    if model is None:
        log("--head dense: the prototype analyses (cards, attribution, suppression, controllers) need --head prism")
    elif not model.ready:
        log("the prototypes were never seeded (training stopped inside the warm-up): no prototype analyses")
        model = None
    if model is not None:
        model.eval()
        cards = None
        if cfg.cards or cfg.suppress_keywords:
            cards = prototype_cards(model, data, cfg)
            stem = "prototypes" if cfg.train else "analysis-prototypes"  # never over the training run's
            (out_dir / f"{stem}.json").write_text(json.dumps(cards))
            (out_dir / f"{stem}.html").write_text(cards_html(cards["cards"]))
            results["cards"] = {**{k: v for k, v in cards.items() if k != "cards"}, "file": f"{stem}.html"}
            log(f"prototype cards: {cards['used']}/{model.P.shape[0]} prototypes active over {cards['tokens']:,} "
                f"training tokens; {out_dir / (stem + '.html')}")
        if cfg.cards:
            prompt = torch.tensor([data.tokenizer.encode("KING:\nMy lords,")], device=device)
            text = model.generate(prompt, 24, cfg.temperature,
                                  generator=torch.Generator(device=device).manual_seed(cfg.seed))
            window = text[:, -(cfg.ctx + 1):]  # positions < ctx; the prompt's first tokens may fall outside
            dec = logit_decomposition(model, window, data.tokenizer,
                                      prompt_len=max(0, prompt.shape[1] - (text.shape[1] - window.shape[1])))
            results["decomposition"] = dec
            n_prompt = sum(r["prompt"] for r in dec["rows"])
            log(f"logit decomposition of {len(dec['rows'])} positions of a prompt and its generated continuation "
                f"({n_prompt} prompt, {len(dec['rows']) - n_prompt} generated): prototype slices + residual = logit, "
                f"max |error| {dec['max_abs_error']:.2e} (largest |logit| {dec['max_abs_logit']:.1f})")
        if cfg.attribution:
            results["attribution"] = attribution_experiment(model, models.get("dense"), data,
                                                            replace(cfg, ctx=cfg.attr_ctx), log)
        targets = []
        if cfg.suppress:
            targets.append(("ids", parse_ids(cfg.suppress, cfg.n_protos), []))
        if cfg.suppress_keywords:
            kws = keywords_of(cfg.suppress_keywords)
            if kws == ["auto"]:
                chosen_on = suppression_generations(model, data, cfg, {}, seed_offset=SELECTION_SEED_OFFSET)
                kws = auto_keyword(cards["cards"], chosen_on)
                if not kws:
                    log("suppression: no live prototype card is about a word of 4+ letters; nothing to suppress")
                else:
                    rate = keyword_rate(chosen_on, kws)
                    never = ("; never generated there, so its measured rate is likely 0 and cannot fall: the "
                             "perplexity change still shows the edit's cost") if rate == 0 else ""
                    log(f"suppression: auto keyword {kws[0]!r}, of the words live cards are about the one the model "
                        f"generates most ({rate:.2f} per 1k words in {len(chosen_on)} generations of their own, other "
                        f"seeds than the rate's before and after{never}; --suppress-keywords WORD,... chooses)")
            if kws:
                targets.append(("keywords", match_keywords(cards["cards"], kws), kws))
        before = None  # the unsuppressed generations, the same for every target: made once, when first needed
        for kind, ids, kws in targets:
            if not ids:
                log(f"suppression: no live prototype card matches {', '.join(kws)}; nothing to suppress")
                continue
            if kind == "ids":  # --suppress IDS: measure the words those prototypes promote most (top 3 of each
                sig = signatures(model, top=3)  # signature); punctuation and fragments are no word to count
                kws = sorted({p.strip().lower() for i in ids for p in token_pieces(data.tokenizer, sig[i].tolist())
                              if WORD.fullmatch(p.strip())})
            if len(ids) > 0.1 * cfg.n_protos:
                log(f"suppression: warning, {len(ids)} of {cfg.n_protos} prototypes match ({len(ids) / cfg.n_protos:.0%} of "
                    "the bank); the keywords are too common for a targeted edit")
            if before is None:
                before = suppression_generations(model, data, cfg, {})
            r = suppression(model, data, cfg, ids, kws, autocast, before=before)
            results.setdefault("suppression", []).append(r)
            measured = (f"for {', '.join(kws)}: keyword rate {r['rate_before']:.2f} -> {r['rate_after']:.2f} per 1k "
                        f"words over {r['generations']} generations" if kws else
                        "(no word among their signatures' top tokens: no keyword rate)")
            log(f"suppression of {len(ids)} prototypes ({r['fraction']:.2%} of the bank) {measured}; val perplexity over "
                f"{r['ppl_tokens']:,} tokens {r['ppl_before']:.2f} -> {r['ppl_after']:.2f} ({r['ppl_change']:+.2%}); "
                + suppression_effect(r))
        if cfg.controller:
            results["controller"] = controller_experiment(model, models.get("dense"), data, cfg, log)
    if cfg.sample is not None or cfg.train:
        prompts = [cfg.sample] if cfg.sample is not None else ["HAMLET:\n"]
        note = unknown_note(data.tokenizer, cfg.sample) if cfg.sample is not None else None
        if note:  # a typed prompt the compacted vocabulary cannot spell: say so beside the sample
            log(note)
        results["samples"] = {}
        if len(models) > 1:  # one prompt, one seed: the samples differ only where the heads do
            log(f"samples: the same prompt and generator seed ({cfg.seed}) for each head, a paired comparison: the "
                "differences come from the head")
        for h, m in models.items():
            m.eval()
            results["samples"][h] = [sample_text(m, data.tokenizer, p, cfg.sample_tokens, device, cfg.seed,
                                                 cfg.temperature) for p in prompts]
            for s in results["samples"][h]:
                log(f"sample ({h}): " + s.replace("\n", "\n        "))
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

    cfg, args = parse_config(Config, argv, "PRISM, prototype language models with native training-data "
                                           "attribution (arXiv 2607.00510).")
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
