"""dual_stream.py beyond the core op: the spec's parameter table, the structural guarantees (head isolation under
independent mixing, the frozen token stream, single-stream = a standard pre-norm GPT), amplification at α = 1,
the ablations, the analyses, training (resume, NaN, DDP), checkpoints, the command line, and that the script
works when copied alone."""
import json
import math
import re
import shutil
import types
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import common
import dual_stream as ds
from conftest import (SMALL_CORPUS, call_main, check_bad_token_batches, check_close, check_cuda_run,
                      check_ddp_weights, check_step_never_waits, run_main, run_script, run_one_and_ddp)
from dual_stream import Config, DualStream

ROOT = Path(__file__).resolve().parents[1]
V = 40
DIST = dict(ddp=False, rank=0, local_rank=0, world=1)
# a 40k-token slice of the plays (val: 2k): a few thousand ids, so the full-val evaluations of every run are quick.
# The tiny run reads it in bytes, so that every coreference prompt decodes token by token (in cl100k compacted to
# a slice, most names are unknown ids).
MAX_TOKENS = 40_000
TINY = ["--layers", "2", "--d-model", "24", "--heads", "3", "--ctx", "64", "--batch-size", "8", "--max-iters", "30", "--lr", "1e-2",
        "--eval-interval", "15", "--eval-iters", "2", "--log-interval", "10", "--analysis-windows", "4",
        "--sample-tokens", "8", "--amplify", "4,16", "--max-tokens", str(MAX_TOKENS), "--tokenizer", "bytes"]


def tiny_model(vocab=V, **kw):
    cfg = Config(**{**dict(layers=2, d_model=24, heads=3, ctx=16, dropout=0.0, kernels="torch"), **kw})
    torch.manual_seed(0)
    return DualStream(cfg, vocab).double()


def tokens(B=2, T=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


# ---------------------------------------------------------------- structure

# spec §8: d = 384, L = 6, H = 6, GPT-2 vocabulary, tied, no biases; (total, non-embedding) in millions
SPEC_TABLE = {("dense", "dense"): (29.92, 10.62), ("independent", "dense"): (28.45, 9.15),
              ("kronecker", "dense"): (28.15, 8.85), ("identity", "dense"): (28.15, 8.85),
              ("independent", "independent"): (22.55, 3.25), ("kronecker", "independent"): (22.25, 2.95)}


@pytest.mark.parametrize("mixing,ffn", list(SPEC_TABLE))
def test_parameter_counts_match_the_spec_table(mixing, ffn):
    """The table counts two norms per block (gains only): V read from x_t directly. With CLN_v (the default
    xt-cln) every block has one more CLN, d gains more."""
    counts = {}
    for v_source in ("xt-raw", "xt-cln"):
        with torch.device("meta"):
            m = DualStream(Config(mixing=mixing, ffn_mixing=ffn, v_source=v_source), 50257)
        counts[v_source] = m.n_params()
        emb = m.wte.weight.numel()
    total, non_emb = SPEC_TABLE[(mixing, ffn)]
    assert (round(counts["xt-raw"] / 1e6, 2), round((counts["xt-raw"] - emb) / 1e6, 2)) == (total, non_emb)
    assert counts["xt-cln"] - counts["xt-raw"] == 6 * 384
    d, H = 384, 6  # and exactly, term by term
    mix = {"dense": d * d, "independent": d * d // H, "kronecker": H * H, "identity": 0}[mixing]
    ffn_params = 8 * d * d // (H if ffn == "independent" else 1)
    assert counts["xt-raw"] == emb + 6 * (2 * d * d + 2 * mix + ffn_params + 2 * d) + d


@pytest.mark.parametrize("v,o,up,down", [("kronecker", "dense", "dense", "dense"), ("identity", "independent",
                                                                                      "independent", "dense"),
                                          ("dense", "kronecker", "dense", "independent")])
def test_each_mixing_point_has_its_own_parameters(v, o, up, down):
    """The four mixing points (spec §3, §11.2) set one by one: each map has its own kind and its own count,
    term by term as in the table above."""
    cfg = Config(v_source="xt-raw", attn_v_mixing=v, attn_out_mixing=o, ffn_up_mixing=up, ffn_down_mixing=down)
    with torch.device("meta"):
        m = DualStream(cfg, 50257)
    d, H = 384, 6
    mix = {"dense": d * d, "independent": d * d // H, "kronecker": H * H, "identity": 0}
    ffn = {"dense": 4 * d * d, "independent": 4 * d * d // H}
    assert (m.blocks[0].attn.mix_v.kind, m.blocks[0].attn.mix_o.kind) == (v, o)
    assert m.n_params() == m.wte.weight.numel() + 6 * (2 * d * d + mix[v] + mix[o] + ffn[up] + ffn[down] + 2 * d) + d


@pytest.mark.parametrize("up,down", [("dense", "dense"), ("independent", "independent"), ("independent", "dense"),
                                     ("dense", "independent")])
def test_ffn_equals_its_matrices(up, down):
    """Each FFN projection, dense or per head, is the d×4d (4d×d) matrix it stands for: blockdiag of the per-head
    maps, the hidden units taken as H consecutive groups of 4d_h."""
    f = tiny_model(ffn_up_mixing=up, ffn_down_mixing=down).blocks[0].ffn
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    W_up, W_down = torch.block_diag(*f.up), torch.block_diag(*f.down)
    assert W_up.shape == (96, 24) and W_down.shape == (24, 96)
    torch.testing.assert_close(f(x), F.gelu(x @ W_up.T) @ W_down.T)
    assert f.up.shape[0] == (3 if up == "independent" else 1) and f.down.shape[0] == (3 if down == "independent" else 1)
    if up == down == "independent":  # bit for bit (fp32) the two-einsum MLP per head that the README's sweep ran
        f, xs = f.float(), x.float().unflatten(-1, (3, -1))
        ref = torch.einsum("...hf,hdf->...hd", F.gelu(torch.einsum("...hd,hfd->...hf", xs, f.up)), f.down)
        assert torch.equal(f(xs.flatten(-2)), ref.flatten(-2))


def test_initial_write_scales_at_step_0():
    """The README's figures on the sweep's worst two-stream models, identity and dense: the attention writes into x_t
    at step 0, at the CPU preset's sizes, over four seeds and 1,000 token ids (with a few dozen, tokens repeat
    within a window and their averages grow), as multiples of the embedding's rms (N(0, 0.02)). Identity, with no
    V or O map, writes averages of the normalised x_t: about 10x the embedding in the first block, about 140x
    summed over the 4. Dense writes about 0.28x in the first block (about 1.2x over the 4), about ten times the
    Kronecker branch (fan-in d against H through V and O, 32x, less the sqrt(2L) of dense O's scaled init)."""
    rel = {"dense": [], "kronecker": [], "identity": []}
    for seed in range(4):
        for mixing in rel:
            cfg = replace(Config(), **ds.CPU_PRESET, mixing=mixing, kernels="torch")
            torch.manual_seed(seed)
            model = DualStream(cfg, 1000).eval()
            idx = torch.randint(0, 1000, (4, cfg.ctx), generator=torch.Generator().manual_seed(seed))
            block = model.blocks[0]
            with torch.no_grad():
                x_0 = model.wte(idx)
                first = block.attn(block.ln_1(x_0), block.ln_v(x_0))  # token-factor, x_e = 0 at the first block
                x_t, _ = model.streams(idx)                           # after every block's attention write
            emb = x_0.pow(2).mean().sqrt().item()
            assert abs(emb - 0.02) < 0.002
            rel[mixing].append((first.pow(2).mean().sqrt().item() / emb, (x_t - x_0).pow(2).mean().sqrt().item() / emb))
    assert all(8 < one < 13 and 100 < total < 180 for one, total in rel["identity"]), rel["identity"]
    assert all(0.2 < one < 0.4 and 0.9 < total < 1.6 for one, total in rel["dense"]), rel["dense"]
    assert all(8 < d[0] / k[0] < 14 for d, k in zip(rel["dense"], rel["kronecker"])), rel


def test_amplify_takes_each_alpha_once_in_order():
    assert ds.parse_alphas("4,1,4,16") == [4.0, 1.0, 16.0] and ds.parse_alphas(" ") == []


def test_an_empty_or_flat_batch_is_a_clear_error():
    m = tiny_model()
    check_bad_token_batches(m, m.generate)


def test_one_architecture_has_one_spelling():
    """Kronecker V with dense O, typed from either pair flag, is one configuration: one name, one stored spelling;
    a split pair is never named after a sweep row."""
    a = Config(mixing="kronecker", attn_out_mixing="dense")
    b = Config(mixing="dense", attn_v_mixing="kronecker")
    assert ds.mixing_points(a) == ds.mixing_points(b) == ("kronecker", "dense", "dense", "dense")
    assert ds.canonical_mixing(a) == ds.canonical_mixing(b) == a
    assert ds.variant(a) == ds.variant(b) == "token-factor-kronecker-attn-out-mixing-dense"
    assert list(ds.configurations(b)) == ["token-factor-kronecker-attn-out-mixing-dense"]
    tied = Config(mixing="dense", attn_v_mixing="kronecker", attn_out_mixing="kronecker")
    assert ds.canonical_mixing(tied) == Config() and list(ds.configurations(tied)) == ["kronecker"]
    up = Config(ffn_up_mixing="independent")
    assert ds.variant(up) == ds.variant(Config(ffn_mixing="independent", ffn_down_mixing="dense")) == \
        "token-factor-kronecker-ffn-up-mixing-independent"
    assert ds.variant(Config(ffn_down_mixing="independent")) == "token-factor-kronecker-ffn-down-mixing-independent"
    assert ds.variant(Config(ffn_mixing="independent", ffn_down_mixing="independent")) == \
        "token-factor-kronecker-ffn-independent"
    # --kron-out-init names the run only where O is Kronecker
    assert ds.variant(replace(b, kron_out_init="scaled")) == ds.variant(b)
    assert ds.variant(Config(mixing="dense", attn_out_mixing="kronecker", kron_out_init="scaled")).endswith(
        "-attn-out-mixing-kronecker-kron-out-init-scaled")


@pytest.mark.parametrize("kind", ["identity", "independent", "kronecker", "dense"])
def test_head_mix_equals_its_matrix(kind):
    """Forward never builds the d×d matrix; the result is the matrix's (blockdiag(W_h) or A ⊗ I for the
    structured ones)."""
    torch.manual_seed(0)
    mix = ds.HeadMix(kind, 4, 32, 0.3).double()
    x = torch.randn(3, 5, 32, dtype=torch.float64, requires_grad=True)
    g = torch.randn(3, 5, 32, dtype=torch.float64)
    y = mix(x)
    torch.testing.assert_close(y, x @ mix.matrix().double().T)
    n = {"identity": 0, "independent": 4 * 8 * 8, "kronecker": 16, "dense": 32 * 32}[kind]
    assert sum(p.numel() for p in mix.parameters()) == n
    if kind == "identity":
        return
    # the gradients too: into x, and into the weight through the matrix it stands for
    gx, gw = torch.autograd.grad((y * g).sum(), (x, mix.weight))
    rx, rw = torch.autograd.grad(((x @ mix.matrix().T) * g).sum(), (x, mix.weight))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)


@pytest.mark.parametrize("kind", ["independent", "kronecker", "dense"])
def test_head_mix_under_autocast_computes_in_bf16(kind):
    """Under bf16 autocast each structured mixing runs in bf16 like the dense one, and stays close to fp32."""
    torch.manual_seed(0)
    mix = ds.HeadMix(kind, 4, 32, 0.3)
    x = torch.randn(3, 5, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = mix(x)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    check_close(f"{kind} bf16", mix(x), y.float(), ratio=2e-2)

def test_cln_is_layernorm_per_head_slice():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 24, dtype=torch.float64) * 3 + 1
    for gain in ("element", "head"):
        cln = ds.channel_norm(Config(heads=3, cln_gain=gain, cln_bias=True, kernels="torch"), 24).double()
        with torch.no_grad():
            cln.weight.uniform_(0.5, 1.5)
            cln.bias.uniform_(-1, 1)
        w = cln.weight if gain == "element" else cln.weight.repeat_interleave(8)
        b = cln.bias if gain == "element" else cln.bias.repeat_interleave(8)
        ref = F.layer_norm(x.view(2, 5, 3, 8), (8,), eps=1e-5).flatten(-2) * w + b
        torch.testing.assert_close(cln(x), ref)
        assert cln.weight.shape == ((24,) if gain == "element" else (3,))


def test_independent_mixing_keeps_heads_isolated():
    """With independent V/O mixing and the attention pattern held fixed (Q, K inputs unchanged), a perturbation in
    one head of x_t changes only that head of the attention output; Kronecker mixing spreads it (so the check can
    fail)."""
    for mixing, isolated in (("independent", True), ("kronecker", False), ("dense", False)):
        m = tiny_model(mixing=mixing)
        block = m.blocks[0]
        torch.manual_seed(1)
        x_t, h = torch.randn(2, 9, 24, dtype=torch.float64), torch.randn(2, 9, 24, dtype=torch.float64)
        bumped = x_t.clone()
        bumped[..., 8:16] += torch.randn(2, 9, 8, dtype=torch.float64)  # head 1 of 3
        delta = (block.attn(h, block.ln_v(bumped)) - block.attn(h, block.ln_v(x_t))).abs().view(2, 9, 3, 8)
        assert delta[:, :, 1].max() > 1e-6
        others = max(delta[:, :, 0].max(), delta[:, :, 2].max()).item()
        assert (others == 0.0) == isolated, (mixing, others)
    # isolation needs both points: independent from --mixing, one point overridden (ignoring it would isolate)
    for point, kinds in (("attn_out_mixing", ("independent", "kronecker")),
                         ("attn_v_mixing", ("kronecker", "independent"))):
        m = tiny_model(mixing="independent", **{point: "kronecker"})
        block = m.blocks[0]
        assert (block.attn.mix_v.kind, block.attn.mix_o.kind) == kinds
        x_t, h = torch.randn(2, 9, 24, dtype=torch.float64), torch.randn(2, 9, 24, dtype=torch.float64)
        bumped = x_t.clone()
        bumped[..., 8:16] += torch.randn(2, 9, 8, dtype=torch.float64)  # not a constant: CLN would remove it
        delta = (block.attn(h, block.ln_v(bumped)) - block.attn(h, block.ln_v(x_t))).abs().view(2, 9, 3, 8)
        assert delta[:, :, 0].max() > 1e-6, kinds


def test_independent_ffn_keeps_heads_isolated():
    """One MLP per head: a perturbation in head 1 of the FFN input changes head 1 of its output only."""
    for ffn, isolated in (("independent", True), ("dense", False)):
        f = tiny_model(ffn_mixing=ffn).blocks[0].ffn
        x = torch.randn(2, 5, 24, dtype=torch.float64)
        bumped = x.clone()
        bumped[..., 8:16] += 1.0
        delta = (f(bumped) - f(x)).abs().view(2, 5, 3, 8)
        assert delta[:, :, 1].max() > 1e-6 and (max(delta[:, :, 0].max(), delta[:, :, 2].max()) == 0) == isolated


@pytest.mark.parametrize("v_source", ["xt-cln", "xt-raw", "combined"])
def test_v_source(v_source):
    """V reads CLN_v(x_t), x_t itself, or the block's CLN_1(x_t + x_e)."""
    m = tiny_model(v_source=v_source)
    block, seen = m.blocks[1], {}
    block.attn.register_forward_pre_hook(lambda mod, args: seen.update(h=args[0], v_in=args[1]))
    x_t, x_e = (torch.randn(2, 5, 24, dtype=torch.float64) for _ in range(2))
    block(x_t, x_e)
    want = {"xt-cln": lambda: block.ln_v(x_t), "xt-raw": lambda: x_t, "combined": lambda: seen["h"]}[v_source]()
    torch.testing.assert_close(seen["v_in"], want)
    torch.testing.assert_close(seen["h"], block.ln_1(x_t + x_e))
    assert (block.ln_v is not None) == (v_source == "xt-cln")


def test_fts_keeps_the_token_stream_frozen():
    """In FTS mode x_t is bit-identical at the input of every layer (the normalised embedding); attention writes x_e."""
    m = tiny_model(mode="fts", layers=3)
    seen = []
    for b in m.blocks:
        b.register_forward_pre_hook(lambda mod, args: seen.append(args[0].clone()))
    x, _ = tokens()
    x_t, x_e = m.streams(x)
    assert len(seen) == 3 and all(torch.equal(s, seen[0]) for s in seen) and torch.equal(x_t, seen[0])
    torch.testing.assert_close(seen[0], m.ln_embed(m.wte(x)))
    assert x_e.abs().sum() > 0


def test_token_factor_streams_are_written_by_their_own_sublayers():
    """Attention writes only x_t, the FFN only x_e: zeroing every FFN leaves x_e at zero, zeroing every attention
    output leaves x_t at the embedding."""
    m = tiny_model()
    x, _ = tokens()
    with torch.no_grad():
        for b in m.blocks:
            b.ffn.down.zero_()
    x_t, x_e = m.streams(x)
    assert x_e.abs().max() == 0 and not torch.equal(x_t, m.wte(x))
    m = tiny_model()
    with torch.no_grad():
        for b in m.blocks:
            b.attn.mix_o.weight.zero_()
    x_t, x_e = m.streams(x)
    assert torch.equal(x_t, m.wte(x)) and x_e.abs().max() > 0


def rotate_half_rope(x, theta=10000.0):
    """RoPE written the GPT-NeoX way (x·cos + rotate_half(x)·sin), independently of dual_stream.rope."""
    T, dh = x.shape[-2], x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    ang = torch.outer(torch.arange(T, dtype=torch.float64), freqs)
    emb = torch.cat([ang, ang], -1)
    rot = torch.cat([-x[..., dh // 2:], x[..., : dh // 2]], -1)
    return x * emb.cos() + rot * emb.sin()


def test_single_stream_dense_is_a_standard_prenorm_gpt():
    """--mode single --mixing dense --norm layernorm is a plain pre-LN GPT (RoPE, GELU MLP, tied head), written
    here from scratch with the model's weights."""
    m = tiny_model(mode="single", mixing="dense", norm="layernorm")
    x, _ = tokens()
    H, dh = 3, 8
    with torch.no_grad():
        for p in m.parameters():  # norms away from 1 so they matter
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
        h = m.wte.weight[x]
        for b in m.blocks:
            a = F.layer_norm(h, (24,), b.ln_1.weight, eps=1e-5)
            q, k, v = (t.view(2, 16, H, dh).transpose(1, 2) for t in
                       (a @ b.attn.q.weight.T, a @ b.attn.k.weight.T, a @ b.attn.mix_v.weight.T))
            q, k = rotate_half_rope(q), rotate_half_rope(k)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
            s = s.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
            y = (s.softmax(-1) @ v).transpose(1, 2).reshape(2, 16, 24)
            h = h + y @ b.attn.mix_o.weight.T
            f = F.layer_norm(h, (24,), b.ln_2.weight, eps=1e-5)
            h = h + F.gelu(f @ b.ffn.up[0].T) @ b.ffn.down[0].T
        ref = F.layer_norm(h, (24,), m.ln_f.weight, eps=1e-5) @ m.wte.weight.T
    torch.testing.assert_close(m(x), ref)


# ---------------------------------------------------------------- position: RoPE or ALiBi (spec §11.5)

@pytest.mark.parametrize("scaling", ["scaled", "unscaled"])
def test_alibi_attention_is_the_biased_softmax_without_rope(scaling):
    """One ChannelAttention with --pos alibi, written out from its weights: no rotation of q, k, and the logits
    α·q·kᵀ/√d_h − b_h·(t − s) with b_h = α·s_h (scaled) or s_h (unscaled); its output and its kept maps."""
    m = tiny_model(pos="alibi", alibi_alpha=scaling, mixing="dense")
    a, T, H, dh, alpha = m.blocks[0].attn, 16, 3, 8, 4.0
    h = torch.randn(2, T, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    q, k, v = (t.view(2, T, H, dh).transpose(1, 2) for t in (h @ a.q.weight.T, h @ a.k.weight.T, h @ a.mix_v.weight.T))
    t = torch.arange(T, dtype=torch.float64)
    slopes = ds.alibi_slopes(H).double() * (alpha if scaling == "scaled" else 1.0)
    s = alpha * (q @ k.transpose(-1, -2)) / math.sqrt(dh) - slopes[:, None, None] * (t[:, None] - t[None, :])
    p = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1)
    ref = (p @ v).transpose(1, 2).reshape(2, T, 24) @ a.mix_o.weight.T
    a.alpha, a.keep_maps = alpha, True
    torch.testing.assert_close(a(h, h), ref)
    torch.testing.assert_close(a.last["maps"], p.float())


def test_alibi_changes_only_the_position_encoding(monkeypatch):
    """--pos alibi: the same parameters (the slopes are a fixed, unsaved buffer) and different logits; RoPE is never
    called; the two --alibi-alpha readings are one model at α = 1 and differ once amplified."""
    rope, alibi = tiny_model(), tiny_model(pos="alibi")
    assert {n: p.shape for n, p in rope.state_dict().items()} == {n: p.shape for n, p in alibi.state_dict().items()}
    assert all(torch.equal(a, b) for a, b in zip(rope.state_dict().values(), alibi.state_dict().values()))
    x, _ = tokens()
    assert not torch.allclose(rope(x), alibi(x))
    monkeypatch.setattr(ds, "rope", lambda *a: pytest.fail("rope() called with --pos alibi"))
    with torch.no_grad():
        logits = alibi(x)
        unscaled = tiny_model(pos="alibi", alibi_alpha="unscaled")
        assert torch.equal(unscaled(x), logits)
        with alibi.probe(alpha=4.0), unscaled.probe(alpha=4.0):
            assert not torch.allclose(alibi(x), unscaled(x))


def test_alibi_model_trains():
    """A few AdamW steps on one batch lower the loss of a --pos alibi model (gradients flow through the biased op)."""
    m = tiny_model(pos="alibi").float()
    x, y = tokens()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for _ in range(6):
        loss = m(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("scaling", ["scaled", "unscaled"])
def test_alibi_model_triton_path_matches_torch_path(scaling):
    """--kernels triton and --kernels torch on the same ALiBi model: loss and every gradient at α = 1 (training),
    and the logits amplified by α = 4 (where the two readings of the bias differ)."""
    grads, losses, amplified = {}, {}, {}
    x, y = tokens()
    for backend in ("torch", "triton"):
        m = tiny_model(pos="alibi", alibi_alpha=scaling, kernels=backend, layers=1).float()  # a layer: interpreter time
        loss = m(x, y)
        loss.backward()
        losses[backend], grads[backend] = loss.detach(), {n: p.grad for n, p in m.named_parameters()}
        with torch.no_grad(), m.probe(alpha=4.0):
            amplified[backend] = m(x)
    check_close("loss", losses["torch"], losses["triton"])
    for n, g in grads["torch"].items():
        check_close(n, g, grads["triton"][n])
    check_close("logits at α = 4", amplified["torch"], amplified["triton"])


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_alpha_one_reproduces_the_training_loss_exactly(backend):
    m = tiny_model(kernels=backend).float()
    x, y = tokens()
    loss = m(x, y)
    with m.probe(alpha=1.0, record=True):
        probed = m(x, y)
        ent = [a.last["entropy"] for a in m.attentions()]
    assert torch.equal(loss, probed) and all(e.shape == (3,) for e in ent)
    with m.probe(alpha=16.0):
        assert not torch.equal(m(x, y), loss)
    assert all(a.alpha == 1.0 and not a.record for a in m.attentions())  # the probe restores training mode


def test_amplification_sharpens_attention():
    m = tiny_model()
    x, _ = tokens()
    ent = {}
    for alpha in (1.0, 16.0, 1e4):
        with m.probe(alpha=alpha, record=True):
            m(x)
            ent[alpha] = torch.stack([a.last["entropy"] for a in m.attentions()])
    assert (ent[16.0] < ent[1.0]).all() and ent[1e4].max() < 0.1


def test_readout_ablation_reads_one_stream():
    m = tiny_model()
    x, _ = tokens()
    x_t, x_e = m.streams(x)
    torch.testing.assert_close(m(x, ablate="x_e"), F.linear(m.ln_f(x_t), m.wte.weight))
    torch.testing.assert_close(m(x, ablate="x_t"), F.linear(m.ln_f(x_e), m.wte.weight))


def test_ablation_at_every_layer_is_a_model_without_that_stream():
    """Removing x_e at every layer = the same model with every FFN output zeroed (x_e never written); removing
    x_t = every attention output zeroed (x_t stays the embedding) and the readout from x_e alone."""
    m = tiny_model()
    x, _ = tokens()
    ablated = m(x, ablate="x_e", at="all")
    with torch.no_grad():
        for b in m.blocks:
            b.ffn.down.zero_()
    torch.testing.assert_close(ablated, m(x))
    m = tiny_model()
    ablated = m(x, ablate="x_t", at="all")
    with torch.no_grad():
        for b in m.blocks:
            b.attn.mix_o.weight.zero_()
    x_t, x_e = m.streams(x)
    torch.testing.assert_close(ablated, F.linear(m.ln_f(x_e), m.wte.weight))
    assert ablated.std() > 0  # not the constant a zeroed x_t would give
    # "writes": the same model without attention writes, read out from x_t + x_e (x_t = the embedding); it is
    # not the "all" row, which also leaves the embedding out of the readout
    writes = tiny_model()(x, ablate="x_t", at="writes")
    torch.testing.assert_close(writes, m(x))
    torch.testing.assert_close(x_t, m.wte(x))
    assert (writes - ablated).abs().max() > 1e-3
    with pytest.raises(ValueError, match="two streams"):
        tiny_model(mode="single")(x, ablate="x_t")
    with pytest.raises(ValueError, match="at must be one of readout, writes, all"):
        m(x, ablate="x_t", at="layer")


class FakeData:
    """The three things evaluate_ppl reads from common's data: iter_eval, device and the tokenizer's unk id."""
    device = torch.device("cpu")
    tokenizer = types.SimpleNamespace(unk=None)

    def iter_eval(self, split, batch_size, ctx):
        yield tokens(B=batch_size, T=ctx, seed=2)


def test_evaluate_ppl_reads_exactly_max_windows():
    """--analysis-windows 3 is 3 windows, not the 8 of a whole batch."""
    res = ds.evaluate_ppl(tiny_model(), FakeData(), 16, torch.autocast("cpu", enabled=False), max_windows=3)
    assert res["tokens"] == 3 * 16 and res["windows"] == 3
    assert res["unk_tokens"] == 0 and res["loss_known"] == res["loss"]  # no compaction: every target is known


def test_evaluate_ppl_reports_the_loss_without_the_unk_targets():
    """The unk id (every id unseen in training) is never a training target: the final evaluation counts its targets
    and gives the loss without them beside the loss over all, and the log line says both."""
    data, model = FakeData(), tiny_model().eval()
    x, y = tokens(B=8, T=16, seed=2)
    data.tokenizer = types.SimpleNamespace(unk=int(y[0, 0]))
    res = ds.evaluate_ppl(model, data, 16, torch.autocast("cpu", enabled=False))
    with torch.no_grad():
        nll = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
    known = y.flatten() != data.tokenizer.unk
    assert res["unk_tokens"] == int((~known).sum()) > 0
    assert res["loss"] == pytest.approx(nll.mean().item())
    assert res["loss_known"] == pytest.approx(nll[known].mean().item())
    note = common.unk_targets_note(res)
    assert f"without its {res['unk_tokens']:,} unk targets (ids unseen in training) loss {res['loss_known']:.4f}" \
        in note
    assert common.unk_targets_note({**res, "unk_tokens": 0}) == ""
    assert common.unk_targets_cell(res) == (f"loss {res['loss_known']:.4f}, ppl {res['ppl_known']:.2f} "
                                            f"({res['unk_tokens']:,} left out)")
    assert common.unk_targets_cell({**res, "unk_tokens": 0}) == "—"


def test_evaluate_ppl_when_every_target_is_unk():
    """A vocabulary compacted to almost nothing (--compact 2) can leave no known val target: the loss without the
    unk targets is then undefined (None in the JSON, said in the log and the report), not 0 and perplexity 1."""
    class AllUnk(FakeData):
        def iter_eval(self, split, batch_size, ctx):
            x, y = tokens(B=batch_size, T=ctx, seed=2)
            yield x, torch.full_like(y, 5)
    data = AllUnk()
    data.tokenizer = types.SimpleNamespace(unk=5)
    res = ds.evaluate_ppl(tiny_model().eval(), data, 16, torch.autocast("cpu", enabled=False))
    assert res["unk_tokens"] == res["tokens"] == 8 * 16 and res["loss_known"] is None and res["ppl_known"] is None
    assert res["loss"] > 0
    assert common.unk_targets_note(res) == ("; every one of its 128 targets is unk (ids unseen in training), so there "
                                            "is no loss without them: a larger --compact keeps more ids")
    assert common.unk_targets_cell(res) == "none: all 128 targets are unk"
    assert ds.sweep_table({"dense": tiny_model()}, {"dense": res})[0]["without the unk targets"] == \
        "none: all 128 targets are unk"


def test_ablation_rows_say_what_they_remove_and_fts_skips_the_repeats():
    """Token-factor with --ablate-at all: five distinct rows, "no attention writes" (readout x_t + x_e) apart from
    "no x_t at all". FTS: dropping x_t's writes with the readout kept equals the unablated model (nothing writes
    x_t), and the two at-every-layer passes equal the readout ones exactly, so the three are skipped."""
    cfg = Config(ctx=16, analysis_windows=8, ablate_at="all")  # a random tiny model: x_e rows differ by ~1e-7
    auto = torch.autocast("cpu", enabled=False)
    rows = ds.ablation(tiny_model(), FakeData(), cfg, auto)
    assert [(r["stream"], r["at"]) for r in rows] == [("x_t", "readout"), ("x_e", "readout"), ("x_t", "writes"),
                                                      ("x_t", "all"), ("x_e", "all")]
    assert len({r["removed"] for r in rows}) == 5 and len({round(r["loss"], 9) for r in rows}) == 5
    assert "attention writes" in rows[2]["removed"] and "x_t + x_e" in rows[2]["removed"]
    assert all(r["windows"] == 8 and r["tokens"] == 8 * 16 for r in rows)  # what the losses were measured on
    m = tiny_model(mode="fts")
    x, _ = tokens()
    for stream in ("x_t", "x_e"):
        for at in ("writes", "all"):
            torch.testing.assert_close(m(x, ablate=stream, at=at), m(x, ablate=stream) if at == "all" or
                                       stream == "x_e" else m(x))
    rows = ds.ablation(m, FakeData(), cfg, auto)
    assert [(r["stream"], r["at"]) for r in rows] == [("x_t", "readout"), ("x_e", "readout")]


def test_amplification_names_its_windows():
    """The amplification's losses are on --analysis-windows val windows, not the whole split: it says how many."""
    data = FakeData()
    data.tokenizer = types.SimpleNamespace(encode=lambda s: [1, 2], eot=0, decode=lambda ids: " ".join(map(str, ids)))
    cfg = Config(ctx=16, analysis_windows=3, sample_tokens=4)
    a = ds.amplification(tiny_model(), data, cfg, [16.0], torch.autocast("cpu", enabled=False))
    assert a["windows"] == 3 and a["tokens"] == 3 * 16 and set(a["samples"]) == {"1.0", "16.0"}
    assert all(r["ppl"] == math.exp(r["loss"]) for r in a["rows"])  # spec §5, §11.6: perplexity beside the loss
    assert ds.on_windows(48, 6144) == "48 val windows (6,144 tokens)" and ds.on_windows(1, 64) == "1 val window (64 tokens)"


def test_amplification_statistics_are_means_over_queries():
    """Entropy and max weight are the mean over every (window, head, query), as the report says: with 12 windows
    read 8 + 4, the short batch weighs half as much as the full one, so the figures equal one pass over all 12."""
    x, _ = tokens(B=12, seed=3)
    x[8:] = 5  # 4 windows of one repeated token, attending unlike the random ones

    class TwoBatches(FakeData):
        def iter_eval(self, split, batch_size, ctx):
            yield from ((x[i:i + batch_size], x[i:i + batch_size]) for i in range(0, len(x), batch_size))

    data = TwoBatches()
    data.tokenizer = types.SimpleNamespace(encode=lambda s: [1, 2], eot=0, decode=lambda ids: "")
    m = tiny_model()
    with torch.no_grad():  # a random tiny model attends almost uniformly: sharpen it so the windows differ
        for a in m.attentions():
            a.q.weight.mul_(300)
    a = ds.amplification(m, data, Config(ctx=16, analysis_windows=12, sample_tokens=1), [],
                         torch.autocast("cpu", enabled=False))
    with m.probe(record=True):
        m(x)
        ent = [a_.last["entropy"].mean().item() for a_ in m.attentions()]
        maxw = [a_.last["max_weight"].mean().item() for a_ in m.attentions()]
        per_batch = []
        for part in (x[:8], x[8:]):
            m(part)
            per_batch.append(m.attentions()[0].last["entropy"].mean().item())
    assert a["windows"] == 12
    assert a["rows"][0]["entropy"] == pytest.approx(ent, rel=1e-6)  # summed in fp32
    assert a["rows"][0]["max_weight"] == pytest.approx(maxw, rel=1e-6)
    assert abs(sum(per_batch) / 2 - ent[0]) > 1e-2 * ent[0]  # so a mean over batches would fail


def test_amplification_samples_are_capped():
    """The amplification's greedy samples stop at AMP_SAMPLE_TOKENS new tokens whatever --sample-tokens says (and
    the flag's help says so); fewer when asked for fewer."""
    data = FakeData()
    data.tokenizer = types.SimpleNamespace(encode=lambda s: [1, 2], eot=0, decode=lambda ids: " ".join(map(str, ids)))
    auto = torch.autocast("cpu", enabled=False)
    for asked, got in ((ds.AMP_SAMPLE_TOKENS + 20, ds.AMP_SAMPLE_TOKENS), (3, 3)):
        a = ds.amplification(tiny_model(), data, Config(ctx=16, analysis_windows=1, sample_tokens=asked), [], auto)
        assert len(a["samples"]["1.0"].split()) == 2 + got  # the 2 prompt ids, then the new tokens
    help_text = next(f for f in fields(Config) if f.name == "sample_tokens").metadata["help"]
    assert f"at most {ds.AMP_SAMPLE_TOKENS}" in help_text


def drawn_figures(monkeypatch) -> list:
    """Every matplotlib figure saved from here on (the report's figures are PNGs: their axes are read here)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    figs, save = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figs.append(self), save(self, *a, **k))[1])
    return figs


def test_figures_have_colorbars_and_whole_layer_ticks(monkeypatch):
    """Each Kronecker heatmap has its own colour scale, so each has a colorbar, and ticks whole heads; the
    entropy-per-layer panel ticks whole layers only (not 0.5)."""
    figs = drawn_figures(monkeypatch)
    ds.kronecker_figure(tiny_model(mixing="kronecker").float())
    bars = [ax for ax in figs[0].axes if ax.get_label() == "<colorbar>"]
    assert len(bars) == 4  # 2 layers × (A_V, A_O)
    maps = [ax for ax in figs[0].axes if ax not in bars]
    assert all(list(ax.get_xticks()) == list(ax.get_yticks()) == [0, 1, 2] for ax in maps)  # whole heads
    rows = [{"alpha": a, "degradation": 0.0, "entropy": [1.0, 0.5]} for a in (1.0, 16.0)]
    ds.amplification_figure({"kronecker": {"rows": rows, "windows": 48}})
    assert list(figs[1].axes[1].get_xticks()) == [0, 1]
    assert figs[1].axes[0].get_ylabel() == "loss increase (%), 48 val windows"  # not the whole split's val loss


def test_loss_figure_gives_each_model_one_colour(monkeypatch):
    """The sweep draws 7 models (14 lines): one colour per model for its train and val curves, so no two models
    share a colour (a colour per line repeats after matplotlib's ten: dense val and fts val were both orange)."""
    figs = drawn_figures(monkeypatch)
    hist = {"step": [2, 4], "train": [[1, 3.0], [2, 2.5], [3, 2.4], [4, 2.2]], "val": [2.6, 2.3]}
    names = list(ds.SWEEP)
    ds.loss_figure({n: hist for n in names})
    lines = {ln.get_label(): ln.get_color() for ln in figs[0].axes[0].get_lines()}
    assert len(lines) == 14
    assert all(lines[f"{n} train"] == lines[f"{n} val"] for n in names)
    assert len({lines[f"{n} val"] for n in names}) == 7
    assert all(t == int(t) for t in figs[0].axes[0].get_xticks())  # whole steps


def test_report_says_what_each_figure_measures(tmp_path):
    """The report's analysis losses name their windows and tokens (they differ from the whole-split validation),
    entropies are in nats with the mean over layers shown, greedy samples equal to α = 1's are named rather than
    repeated, and settings left at auto show what they resolved to."""
    rows = [{"alpha": a, "loss": 5.6 + a / 100, "ppl": math.exp(5.6 + a / 100), "degradation": a / 1000,
             "entropy": [1.5, 1.25], "max_weight": [0.5, 0.6]} for a in (1.0, 2.0, 16.0)]
    amp = {"rows": rows, "windows": 48, "tokens": 6144,
           "samples": {"1.0": "To be a man, To be a man", "2.0": "To be a man, To be a man", "16.0": "I, I, I"}}
    ablation = [{"removed": "x_t", "stream": "x_t", "at": "readout", "loss": 6.0, "full": 5.61, "change": 0.07,
                 "windows": 48, "tokens": 6144}]
    results = {"preset": "cpu", "device": "cpu", "dtype": "float32", "amplification": {"kronecker": amp},
               "ablation": {"kronecker": ablation}}
    report = ds.write_report(tmp_path, Config(), results, {}).read_text()
    assert report.count("48 val windows (6,144 tokens)") == 2 and "<th>loss on 48 val windows</th>" in report
    assert "<th>full, 48 val windows</th>" in report and "<th>windows</th>" not in report
    assert "<th>entropy per layer (nats)</th>" in report and "<th>mean entropy (nats)</th>" in report
    assert "<th>ppl</th>" in report  # spec §5, §11.6: perplexity beside the loss
    assert "<td>1.375</td>" in report  # the mean over the layers, as the log prints it
    assert "α=1: To be a man" in report and "α=2: same as α=1" in report and "α=16: I, I, I" in report
    assert report.count("<td>auto → ") == 3 and "auto → cpu" in report and "auto → float32" in report
    explicit = ds.write_report(tmp_path, Config(preset="cpu", device="cpu"), results, {}).read_text()
    assert "auto → cpu" not in explicit and "auto → float32" in explicit


def test_variant_names_every_architecture_setting():
    """Two architectures of the sweeps never share a checkpoint name; the default command's names (either preset's
    sizes) stay."""
    base = Config()
    assert ds.variant(base) == ds.variant(replace(base, **{k: ds.CPU_PRESET[k] for k in ("layers", "d_model")})) \
        == "token-factor-kronecker"
    assert ds.variant(replace(base, mixing="independent", ffn_mixing="independent")) == \
        "token-factor-independent-ffn-independent"
    changed = dict(heads=3, v_source="xt-raw", norm="layernorm", cln_gain="head", cln_bias=True,
                   kron_out_init="scaled", layers=2)
    names = {ds.variant(replace(base, **{k: v})) for k, v in changed.items()}
    names.add(ds.variant(replace(base, mode="fts", fts_cln_at_init=False)))
    assert len(names) == len(changed) + 1 and ds.variant(base) not in names
    assert ds.variant(replace(base, heads=3)) == "token-factor-kronecker-heads-3"
    assert ds.variant(replace(base, mode="fts", fts_cln_at_init=False)) == "fts-kronecker-no-fts-cln-at-init"
    assert ds.variant(replace(base, mixing="dense", kron_out_init="scaled")) == "token-factor-dense"  # no effect
    paths = {ds.ckpt_path(c) for c in ds.configurations(Config(head_sweep=True)).values()}
    assert len(paths) == len(ds.HEAD_SWEEP)
    # --pos names the run; --alibi-alpha does not (one model at α = 1, analysed under either reading)
    assert ds.variant(replace(base, pos="alibi")) == "token-factor-kronecker-pos-alibi"
    assert ds.variant(replace(base, pos="alibi", alibi_alpha="unscaled")) == "token-factor-kronecker-pos-alibi"
    assert "pos" in ds.ARCH_KEYS and "alibi_alpha" not in ds.ARCH_KEYS + ds.RUNTIME_KEYS
    assert all(c.pos == "alibi" for c in ds.configurations(Config(sweep=True, pos="alibi")).values())


# ---------------------------------------------------------------- analyses

def test_js_divergence_bounds():
    p = torch.tensor([[1.0, 0.0, 0.0], [0.2, 0.3, 0.5]])
    q = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]])
    torch.testing.assert_close(ds.js_divergence(p, q), torch.tensor([1.0, 0.0]))


def test_hubs_find_the_heaviest_column():
    m = tiny_model(mixing="kronecker").float()
    with torch.no_grad():
        for a in m.attentions():
            a.mix_o.weight.fill_(0.1)
            a.mix_o.weight[:, 2] = 1.0
    rows = [r for r in ds.hubs(m) if r["matrix"] == "O"]
    assert all(r["hub"] == 2 for r in rows)
    # off the diagonal, column 2 holds two 1s and columns 0, 1 two 0.1s each; the diagonal never counts
    assert rows[0]["hub ratio"] == pytest.approx(2.0 / 0.2)
    assert ds.hubs(tiny_model(mixing="dense")) is None
    only_o = tiny_model(mixing="dense", attn_out_mixing="kronecker").float()
    assert [(r["layer"], r["matrix"]) for r in ds.hubs(only_o)] == [(0, "O"), (1, "O")]
    assert ds.kronecker_figure(only_o) is not None and ds.kronecker_figure(tiny_model(mixing="dense")) is None
    only_v = tiny_model(mixing="dense", attn_v_mixing="kronecker").float()
    assert [(r["layer"], r["matrix"]) for r in ds.hubs(only_v)] == [(0, "V"), (1, "V")]


def test_hub_growth_compares_the_deepest_hub_with_the_first_layer():
    """Spec §7, §10.4 ("amplified about 3.5× in deeper layers"): the deepest layer's hub head, its off-diagonal column
    mass there over the same head's in the first layer, and both layers' hub ratios; only where a matrix kind is
    Kronecker in two layers or more."""
    m = tiny_model(mixing="kronecker", layers=3).float()
    with torch.no_grad():
        for i, mass in ((0, 0.5), (1, 9.0), (2, 1.75)):  # layer 1 (not first, not deepest) must not enter
            w = m.blocks[i].attn.mix_o.weight
            w.fill_(0.1)
            w[:, 2] = mass
    g = ds.hub_growth(m)
    assert set(g) == {"V", "O"}
    o = g["O"]
    assert (o["head"], o["first layer"], o["deepest layer"]) == (2, 0, 2)
    # off the diagonal, column 2 holds 2·0.5 = 1.0 in layer 0 and 2·1.75 = 3.5 in layer 2: 3.5× (the paper's figure)
    assert o["growth"] == pytest.approx(3.5) and o["hub ratio first"] == pytest.approx(1.0 / 0.2)
    assert o["hub ratio deepest"] == pytest.approx(3.5 / 0.2) and o["chance growth"] == ds.chance_hub_growth(3)
    assert "L0→L2 3.50x (column mass of head 2" in ds.hub_growth_text(o)
    # every head's off-diagonal mass, 1.4 → 3.9: the hub's share grew 3.5 / (3.9 / 1.4) = 1.26×, said beside it
    assert o["common growth"] == pytest.approx(3.9 / 1.4)
    assert "every head's off-diagonal mass 2.79x, so the hub's share 1.26x)" in ds.hub_growth_text(o)
    A = torch.rand(4, 4, generator=torch.Generator().manual_seed(0))  # a matrix scaled up, no hub of its own:
    growth, common = ds._hub_growth(A, 3 * A)[1::3]                    # all of its growth is the common growth
    assert growth == pytest.approx(3.0) and common == pytest.approx(3.0)
    with torch.no_grad():  # the deepest hub moves to head 0: its growth is head 0's, whatever layer 0's hub was
        m.blocks[2].attn.mix_o.weight.copy_(torch.tensor([[0.0, 0.1, 0.1], [3.0, 0.0, 0.1], [3.0, 0.1, 0.0]]))
    assert ds.hub_growth(m)["O"]["head"] == 0 and ds.hub_growth(m)["O"]["growth"] == pytest.approx(6.0 / 0.2)
    assert ds.hub_growth(tiny_model(mixing="dense")) is None and ds.hub_growth(tiny_model(layers=1)) is None
    assert set(ds.hub_growth(tiny_model(mixing="dense", attn_out_mixing="kronecker"))) == {"O"}
    # random matrices: the deepest layer's largest column over the same column elsewhere, a median above 1
    assert 1.2 < ds.chance_hub_growth(6, 500) < 1.7 and 1.2 < ds.chance_hub_growth(6) < 1.7


def test_coref_prompts_point_at_the_right_name():
    prompts = ds.coref_prompts()
    assert len(prompts) == len(ds.COREF_NAMES) * len(ds.COREF_TEMPLATES) * 4
    male = {m for m, _ in ds.COREF_NAMES}
    for text, pron, right, wrong in prompts:
        assert f" {pron} " in text and right in text and wrong in text
        assert (pron == "he") == (right in male)


def test_coref_positions_with_bytes():
    """One token per character: the pronoun is its last letter, each name its letters."""
    tok = common.Tokenizer("bytes")
    text = "Romeo met Juliet in the garden, and she said"
    ids, q, r, w = ds.coref_positions(tok, text, "she", "Juliet", "Romeo")
    assert len(ids) == len(text) and q == text.index(" she ") + 3
    assert r == list(range(10, 16)) and w == list(range(0, 5))


def test_coreference_scores_an_oracle_head(monkeypatch):
    """Attention maps replaced by an oracle: head 0 puts all of the pronoun's mass on the right name, heads 1-2
    split it between the two names. Head 0 must score margin 1 and accuracy 1, the others margin 0."""
    tok = common.Tokenizer("bytes")
    m = tiny_model(tok.vocab_size, ctx=64).float()
    where = {tuple(ds.coref_positions(tok, *p)[0]): ds.coref_positions(tok, *p)[1:] for p in ds.coref_prompts()}
    seen = {}
    real_model, real_attn = DualStream.forward, ds.ChannelAttention.forward

    def model_forward(self, idx, *a, **k):
        seen["ids"] = tuple(idx[0].tolist())
        return real_model(self, idx, *a, **k)

    def attn_forward(self, h, v_in):
        out = real_attn(self, h, v_in)
        if self.keep_maps:
            q, r, w = where[seen["ids"]]
            T = h.shape[1]
            maps = torch.zeros(1, 3, T, T)
            maps[0, 0, q, r[0]] = 1.0
            maps[0, 1:, q, r[0]] = maps[0, 1:, q, w[0]] = 0.5
            self.last["maps"] = maps
        return out
    monkeypatch.setattr(DualStream, "forward", model_forward)
    monkeypatch.setattr(ds.ChannelAttention, "forward", attn_forward)
    res = ds.coreference(m, tok, "cpu")
    assert res["prompts"] == len(ds.coref_prompts())
    assert res["best"] == {"layer": 0, "head": 0, "margin": 1.0, "accuracy": 1.0, "stderr": 0.0}
    assert res["margin"][1][2] == 0.0 and res["accuracy"][1][2] == 0.0
    n = len(ds.coref_prompts())
    assert res["split_half"] == {"layer": 0, "head": 0, "selection": 1.0, "mean": 1.0, "stderr": 0.0, "accuracy": 1.0,
                                 "prompts": n - n // 2}


def test_split_half_scores_one_halfs_pick_on_the_other():
    """The best head on a seeded random half of the prompts is scored on the other half: a head that wins the
    picking half by chance and is 0 elsewhere shows 0 there, where the pick on every prompt reports its flattered
    mean."""
    order = torch.randperm(7, generator=torch.Generator().manual_seed(0)).tolist()
    values = [torch.zeros(2, 3) for _ in range(7)]
    for i in order[:3]:
        values[i][1, 2] = 1.0  # L1h2 wins the picking half alone
    for i in order[3:]:
        values[i][0, 1] = 1.0  # L0h1 the other
    h = ds.split_half(values)
    assert (h["layer"], h["head"], h["prompts"]) == (1, 2, 4)
    assert h["selection"] == 1.0 and h["mean"] == 0.0 and h["accuracy"] == 0.0
    assert ds.split_half(values[:3]) == {} and "fewer than 4 prompts" in ds.split_half_text({})
    assert ds.split_half_text(h).startswith("split half: the best head on a random half of the prompts, L1h2 (+1 there)")


def test_coref_gap_prompts_end_before_the_antecedent():
    """The logit gap's family: one pronoun, of the right name's gender and not the wrong one's, and the prompt
    ends where a name comes next: in cl100k the next token is each name's own first token (distinct within a
    pair); in bytes the space, then the first letters where they differ (Benedick/Beatrice: " Be", then n vs a)."""
    prompts = ds.coref_prompts(ds.COREF_GAP_TEMPLATES)
    assert len(prompts) == len(ds.COREF_NAMES) * len(ds.COREF_GAP_TEMPLATES) * 4 and len(set(prompts)) == len(prompts)
    male = {m for m, _ in ds.COREF_NAMES}
    cl100k, raw = common.Tokenizer("cl100k"), common.Tokenizer("bytes")
    for text, pron, right, wrong in prompts:
        assert re.findall(r"\b(?:he|she|him|his|her|hers)\b", text, re.I) == [pron]  # one pronoun, nothing else
        assert (pron == "he") == (right in male) != (wrong in male)
        assert text.count(right) == text.count(wrong) == 1 and text.endswith(" was")
        ids, r, w = ds.coref_gap_tokens(cl100k, text, right, wrong)
        assert ids == cl100k.encode(text) and r != w
        assert f" {right}".startswith(cl100k.decode([r])) and f" {wrong}".startswith(cl100k.decode([w]))
        ids, r, w = ds.coref_gap_tokens(raw, text, right, wrong)
        k = next(i for i, (a, b) in enumerate(zip(right, wrong)) if a != b)
        assert raw.decode(ids) == f"{text} {right[:k]}" and (r, w) == (ord(right[k]), ord(wrong[k]))
    # a multi-token name is scored by its first token: " Ophelia" is " O", "ph", "elia" in cl100k
    ids, r, w = ds.coref_gap_tokens(cl100k, *[p for p in prompts if p[2] == "Ophelia"][0][::2], "Hamlet")
    assert cl100k.decode([r]) == " O" and cl100k.decode([w]) == " Ham"


def test_coref_gap_skips_names_lost_to_the_compaction():
    """Compacted to one prompt's tokens plus " Romeo": the right name's " Juliet" (in the prompt only as the
    sentence's first word, "Juliet") is the unknown id, so that prompt is skipped; a prompt whose own tokens
    are lost does not decode as typed and is skipped too; with " Juliet" kept it is scored."""
    enc = common.Tokenizer("cl100k").enc
    text = "Juliet met Romeo, and she spoke. The one who spoke was"
    assert (text, "she", "Juliet", "Romeo") in ds.coref_prompts(ds.COREF_GAP_TEMPLATES)
    kept = sorted(set(enc.encode(text)) | set(enc.encode(" Romeo")))
    tok = common.Tokenizer("cl100k", kept)
    assert ds.coref_gap_tokens(tok, text, "Juliet", "Romeo") is None
    assert ds.coref_gap_tokens(tok, text.replace("met", "saw"), "Juliet", "Romeo") is None
    tok = common.Tokenizer("cl100k", sorted(set(kept) | set(enc.encode(" Juliet"))))
    ids, r, w = ds.coref_gap_tokens(tok, text, "Juliet", "Romeo")
    assert tok.decode(ids) == text and tok.decode([r]) == " Juliet" and tok.decode([w]) == " Romeo"


def test_coref_gap_equals_the_logits_by_hand(monkeypatch):
    """On a tiny random model (random norm gains and biases): each prompt's gap is logit(right) − logit(wrong) at
    the last position of the prompt and the names' shared bytes, the byte ids picked by hand; the summary is their
    mean, standard error and fraction above 0. Two pairs (32 prompts, one pair sharing " Be") keep it fast."""
    monkeypatch.setattr(ds, "COREF_NAMES", (("Romeo", "Juliet"), ("Benedick", "Beatrice")))
    tok = common.Tokenizer("bytes")
    m = tiny_model(tok.vocab_size, ctx=128, cln_bias=True)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.copy_(torch.randn_like(p))
    gaps = []
    for text, _, right, wrong in ds.coref_prompts(ds.COREF_GAP_TEMPLATES):
        k = next(i for i, (a, b) in enumerate(zip(right, wrong)) if a != b)
        with torch.no_grad():
            logits = m(torch.tensor([list(f"{text} {right[:k]}".encode())]))[0, -1]
        gaps.append((logits[ord(right[k])] - logits[ord(wrong[k])]).item())
    gaps = torch.tensor(gaps, dtype=torch.float64)
    res = ds.coreference_gap(m, tok, "cpu")
    assert res["prompts"] == len(gaps) == 32 and 0 < res["accuracy"] < 1
    assert res["gap"] == pytest.approx(gaps.mean().item(), abs=1e-12)
    assert res["stderr"] == pytest.approx((gaps.std() / math.sqrt(len(gaps))).item(), rel=1e-9)
    assert res["accuracy"] == pytest.approx((gaps > 0).double().mean().item())
    assert ds.coreference_gap(tiny_model(tok.vocab_size, ctx=32), tok, "cpu") == {"prompts": 0}  # longer than ctx
    assert ds.NO_COREF_GAP in ds.gap_text({"prompts": 0})


@pytest.mark.parametrize("kw", [dict(), dict(mixing="dense", cln_bias=True), dict(mixing="independent", mode="fts"),
                                dict(mode="single", mixing="dense", norm="layernorm", cln_bias=True),
                                dict(cln_gain="head", pos="alibi", attn_out_mixing="independent")])
def test_logit_gap_attribution_sums_to_the_gap(kw):
    """Direct logit attribution: embedding + every head + every FFN + the norm's bias = the model's gap (norm
    scale frozen at the last position); each layer's heads add up to that layer's whole attention write scored
    alone; a head whose write is zero (its Mix_O column cleared) scores exactly 0."""
    tok = common.Tokenizer("bytes")
    m = tiny_model(tok.vocab_size, ctx=128, layers=3, **kw)
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 1:
                p.copy_(1 + torch.randn_like(p))
        o = m.blocks[1].attn.mix_o  # layer 1's head 2 writes nothing: its part of Mix_O cleared
        {"dense": lambda: o.weight[:, 16:], "kronecker": lambda: o.weight[:, 2], "independent": lambda: o.weight[2]
         }[o.kind]().zero_()
    writes = []
    hooks = [b.attn.register_forward_hook(lambda mod, i, o: writes.append(o[0, -1])) for b in m.blocks]
    hooks.append(m.ln_f.register_forward_hook(lambda mod, i, o: writes.append(i[0][0, -1])))
    text, _, right, wrong = ds.coref_prompts(ds.COREF_GAP_TEMPLATES)[7]
    ids, r, w = ds.coref_gap_tokens(tok, text, right, wrong)
    t = ds.logit_gap_attribution(m, ids, r, w, "cpu")
    for h in hooks:
        h.remove()
    assert t["heads"].shape == (3, 3) and t["ffn"].shape == (3,) and (t["bias"] != 0) == m.cfg.cln_bias
    total = t["embed"] + t["heads"].sum().item() + t["ffn"].sum().item() + t["bias"]
    assert total == pytest.approx(t["gap"], abs=1e-10) and abs(t["gap"]) > 1e-3
    x, direction = writes[-1], m.wte.weight[r] - m.wte.weight[w]
    for layer in range(3):
        whole = (m.ln_f.frozen(x, writes[layer]) @ direction).item()
        assert t["heads"][layer].sum().item() == pytest.approx(whole, abs=1e-12)
    assert t["heads"][1, 2] == 0.0 and (t["heads"][1, :2] != 0).all()


# ---------------------------------------------------------------- training, checkpoints, command line

def tiny_cfg(tmp_path, cache_dir, **kw):
    base = dict(layers=1, d_model=24, heads=3, ctx=32, batch_size=4, max_iters=20, eval_interval=10, eval_iters=2,
                log_interval=5, out_dir=str(tmp_path), cache_dir=str(cache_dir), kernels="torch", dropout=0.1)
    return Config(**{**base, **kw})


def test_resume_is_bit_exact_on_cpu(tmp_path, cache_dir, monkeypatch):
    dev, auto = torch.device("cpu"), torch.autocast("cpu", enabled=False)

    def fresh_data():
        return common.load_data(cache_dir=cache_dir, seed=3)
    straight, hist_a = ds.train(tiny_cfg(tmp_path / "a", cache_dir), fresh_data(), dev, auto, DIST, log=lambda m: None)
    real_save = ds.save_checkpoint

    def save_and_keep(path, *a, **k):  # keep a copy of the step-10 checkpoint
        real_save(path, *a, **k)
        if a[3] == 10:
            (tmp_path / "b10").mkdir()
            shutil.copy(path, tmp_path / "b10" / path.name)
    monkeypatch.setattr(ds, "save_checkpoint", save_and_keep)
    lines = []  # the cut run trains in the straight run's folder: a fresh run says it replaces the checkpoint there
    ds.train(tiny_cfg(tmp_path / "a", cache_dir), fresh_data(), dev, auto, DIST, log=lines.append)
    path = ds.ckpt_path(tiny_cfg(tmp_path / "a", cache_dir))
    assert [ln for ln in lines if ln.startswith("note:")] == [f"note: {path} exists; this run trains from step 0 and replaces it (--resume continues it instead)"]
    monkeypatch.setattr(ds, "save_checkpoint", real_save)
    lines = []
    resumed, hist = ds.train(tiny_cfg(tmp_path / "b10", cache_dir, resume=True), fresh_data(), dev, auto, DIST,
                             log=lines.append)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert hist["step"] == [10, 20] and hist["val"] == hist_a["val"]
    assert not any(ln.startswith("note:") for ln in lines)  # nothing changed: no warning that it will differ


def test_resume_applies_typed_settings_and_says_when_it_cannot_match(tmp_path, cache_dir):
    """--resume after a shorter run: a --weight-decay typed with it is what the optimizer uses (load_state_dict
    used to put the checkpoint's back, while the config claimed the new one), and the log says the result cannot
    equal an uninterrupted run (the first steps followed another cosine schedule), or that there is nothing left
    to train when the checkpoint is already at --max-iters."""
    dev, auto = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    cfg = tiny_cfg(tmp_path, cache_dir, max_iters=10)
    ds.train(cfg, common.load_data(cache_dir=cache_dir), dev, auto, DIST, log=lambda m: None)
    lines = []
    ds.train(replace(cfg, resume=True, max_iters=14, weight_decay=0.5), common.load_data(cache_dir=cache_dir), dev,
             auto, DIST, log=lines.append)
    assert ("note: resuming with max_iters 10 -> 14, weight_decay 0.1 -> 0.5: the first 10 steps followed the "
            "checkpoint's settings") in "\n".join(lines)
    ck = torch.load(ds.ckpt_path(cfg), weights_only=True)
    assert ck["step"] == 14 and [g["weight_decay"] for g in ck["optimizer"]["param_groups"]] == [0.5, 0.0]
    lines = []
    ds.train(replace(cfg, resume=True, max_iters=14, weight_decay=0.5), common.load_data(cache_dir=cache_dir), dev,
             auto, DIST, log=lines.append)
    assert "note: the checkpoint is at step 14, --max-iters 14: nothing left to train" in "\n".join(lines)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, cache_dir, monkeypatch):
    real_forward, calls = DualStream.forward, []

    def forward(self, idx, targets=None, **kw):
        out = real_forward(self, idx, targets, **kw)
        if targets is not None and self.training:
            calls.append(1)
            if len(calls) > 12:
                return out * float("nan")
        return out
    monkeypatch.setattr(DualStream, "forward", forward)
    cfg = tiny_cfg(tmp_path, cache_dir)
    with pytest.raises(ds.RunError, match="non-finite loss before step 15 \\(or non-finite weights\\); stopping \\(the last good checkpoint is"):
        ds.train(cfg, common.load_data(cache_dir=cache_dir), torch.device("cpu"), torch.autocast("cpu", enabled=False),
                 DIST, log=lambda m: None)
    ck = torch.load(ds.ckpt_path(cfg), weights_only=True)
    assert ck["step"] == 10 and all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())


def test_sweep_configurations_train_on_the_same_batches(tmp_path, cache_dir):
    """The sweep names its seven configurations, and each trains from the same data state: a second run after
    the first has advanced the streams still sees the same batches (identical histories)."""
    names = list(ds.configurations(Config(sweep=True)))
    assert names == ["dense", "kronecker", "independent", "identity", "fully independent", "fts independent",
                     "single-stream dense"]
    assert ds.configurations(Config(mixing="independent", ffn_mixing="independent")).keys() == {"fully independent"}
    data = common.load_data(cache_dir=cache_dir, seed=3)
    start = data.rng_state()
    dev, auto = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    _, a = ds.train(tiny_cfg(tmp_path / "a", cache_dir, max_iters=5, log_interval=1), data, dev, auto, DIST,
                    log=lambda m: None, start_rng=start)
    _, b = ds.train(tiny_cfg(tmp_path / "b", cache_dir, max_iters=5, log_interval=1), data, dev, auto, DIST,
                    log=lambda m: None, start_rng=start)
    assert a["train"] == b["train"] and a["val"] == b["val"]


def test_tiny_run_end_to_end(tmp_path, cache_dir, capsys, monkeypatch):
    """The issue's tiny run: falling loss, a checkpoint, samples and the report with the amplification, ablation
    and specialisation results; then the same analyses on the checkpoint without training."""
    r = run_script("dual_stream.py", *TINY, "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "no GPU: running the CPU preset" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("step ") and "| loss" in ln]
    assert len(lines) == 3 and " ms | " in lines[0] and "tok/s | mfu -" in lines[0]
    losses = [float(ln.split("| loss ")[1].split()[0]) for ln in lines]
    assert losses[-1] < losses[0] and losses[-1] < math.log(257) - 2  # falling, and far below uniform over bytes
    name = "token-factor-kronecker-heads-3-layers-2-d-model-24"  # the architecture flags name the files
    for f in (f"ckpt-{name}.pt", "report.html", "results.json", f"kronecker-{name}.png", f"log-{name}.txt"):
        assert (tmp_path / f).is_file(), f
    res = json.loads((tmp_path / "results.json").read_text())
    amp = res["amplification"]["kronecker"]
    assert [r["alpha"] for r in amp["rows"]] == [1.0, 4.0, 16.0] and amp["rows"][0]["degradation"] == 0.0  # α = 1 added
    assert amp["rows"][2]["entropy"][0] < amp["rows"][0]["entropy"][0] and set(amp["samples"]) == {"1.0", "4.0", "16.0"}
    assert [(r["stream"], r["at"]) for r in res["ablation"]["kronecker"]] == [("x_t", "readout"), ("x_e", "readout")]
    spec = res["specialization"]["kronecker"]
    assert len(spec["distinctiveness"]) == 2 and len(spec["hubs"]) == 4 and spec["coreference"]["prompts"] > 0
    gap = spec["coreference_gap"]  # the logit gap (spec §7): the model's, and per head by direct attribution
    assert gap["prompts"] > 0 and 0 <= gap["accuracy"] <= 1 and len(gap["heads"]) == 2 and len(gap["heads"][0]) == 3
    assert f"; coreference logit gap ({gap['prompts']} prompts, right name's first token minus" in out
    assert set(spec["hub_growth"]) == {"V", "O"} and spec["hub_growth"]["O"]["deepest layer"] == 1
    assert "; A_O hub growth L0→L1 " in out and "A_O hub growth across depth" in (tmp_path / "report.html").read_text()
    assert amp["windows"] == 4 and amp["tokens"] == 4 * 64 and res["ablation"]["kronecker"][0]["windows"] == 4
    # the analysis losses say what they were measured on; the greedy samples at α = 1 and the last α side by side
    assert "amplification, kronecker (loss on 4 val windows (256 tokens); attention entropy in nats, mean over " \
           "layers): α=1 loss" in out
    assert all(r["ppl"] == math.exp(r["loss"]) for r in amp["rows"])  # the perplexity beside each loss (spec §5)
    assert f"α=1 loss {amp['rows'][0]['loss']:.3f} ppl {amp['rows'][0]['ppl']:.1f} (" in out
    assert "ablation, kronecker (change of the loss on 4 val windows (256 tokens), " in out
    assert "\n  greedy at α=1: " in out and "\n  greedy at α=16: " in out
    report = (tmp_path / "report.html").read_text()
    for needle in ("Attention amplification", "Stream ablation", "Head specialisation", "data:image/png;base64",
                   "<td>auto → cpu</td>", f"coreference logit gap ({gap['prompts']} prompts"):
        assert needle in report, needle

    arch = ["--layers", "2", "--d-model", "24", "--heads", "3"]
    r = run_main(ds.main, ["--no-train", *arch, "--amplify", "1,2", "--ablate-at", "all", "--no-specialization",
                           "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads((tmp_path / "analysis.json").read_text())
    assert [(r["stream"], r["at"]) for r in res["ablation"]["kronecker"]][2:] == [("x_t", "writes"), ("x_t", "all"),
                                                                                  ("x_e", "all")]
    assert "without attention writes in every block (logits from x_t + x_e" in r.stdout
    assert "specialization" not in res or not res["specialization"]
    png = (tmp_path / f"kronecker-{name}.png").read_bytes()
    asked, generate = [], ds.DualStream.generate  # the sampling flags reach the sampler

    def spy(self, idx, new_tokens, temperature=0.8, top_k=40, generator=None):
        asked.append((temperature, top_k))
        return generate(self, idx, new_tokens, temperature, top_k, generator)
    monkeypatch.setattr(ds.DualStream, "generate", spy)
    rc, err = call_main(ds.main, ["--no-train", *arch, "--amplify", "", "--no-ablation", "--analysis-windows", "4",
                                  "--sample", "KING:", "--sample-tokens", "3", "--temperature", "0.5", "--top-k", "5",
                                  "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)], capsys, monkeypatch)
    assert rc == 0, err
    assert asked == [(0.5, 5)]
    m = ds.DualStream(ds.Config(layers=1, d_model=24, heads=3, ctx=8), 50)  # a tiny temperature: near-greedy,
    ids = torch.zeros(1, 2, dtype=torch.long)                                  # not an overflow to NaN
    assert torch.equal(generate(m, ids, 4, 1e-40, 0, torch.Generator().manual_seed(0)), generate(m, ids, 4, 0))
    assert "note: --analysis-windows has no effect in this run" in "".join(
        p.read_text() for p in tmp_path.glob("log-*.txt"))  # typed, and nothing it sizes runs: said, not dropped
    assert (tmp_path / f"analysis-kronecker-{name}.png").is_file() and (tmp_path / f"kronecker-{name}.png").read_bytes() == png
    # mismatches
    rc, err = call_main(ds.main, ["--no-train", *arch, "--max-tokens", "30000", "--out-dir", str(tmp_path),
                                  "--cache-dir", str(cache_dir)], capsys, monkeypatch)
    assert rc == 1 and err.count("\n") == 1
    assert "was trained with max_tokens=40000 (asked 30000); drop those flags or use another --out-dir" in err
    # a --max-iters below the checkpoint's step would train nothing and report a config not the model's
    rc, err = call_main(ds.main, ["--resume", *arch, "--max-iters", "1", "--out-dir", str(tmp_path), "--cache-dir",
                                  str(cache_dir)], capsys, monkeypatch)
    assert rc == 1 and err.count("\n") == 1 and f"ckpt-{name}.pt is at step" in err and "past --max-iters 1" in err, err
    rc, err = call_main(ds.main, ["--no-train", "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)], capsys,
                        monkeypatch)
    assert rc == 1 and err.count("\n") == 1 and f"holds ckpt-{name}.pt" in err


def test_sweep_from_the_command_line(tmp_path, cache_dir, capsys, monkeypatch):
    """--sweep trains the seven configurations and prints the cost table; --no-train --sweep reads what exists."""
    args = ["--layers", "1", "--d-model", "24", "--heads", "3", "--ctx", "64", "--batch-size", "2", "--max-iters", "4",
            "--eval-interval", "4", "--eval-iters", "1", "--log-interval", "4", "--analysis-windows", "2",
            "--amplify", "1,16", "--no-specialization", "--no-report", "--sample-tokens", "2", "--max-tokens", str(MAX_TOKENS), "--out-dir",
            str(tmp_path), "--cache-dir", str(cache_dir)]
    r = run_main(ds.main, ["--sweep", *args], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sweep (val loss relative to token-factor dense; paper: Kronecker +2.5%, fully independent +8%; the " \
           "summary: FTS independent +8%)" in r.stdout
    res = json.loads((tmp_path / "results.json").read_text())
    rows = {row["model"]: row for row in res["models"]}
    assert len(rows) == 7 and rows["dense"]["vs dense"] == "+0.00%"
    assert rows["kronecker"]["params (M)"] < rows["dense"]["params (M)"]
    assert "single-stream dense" not in res["ablation"] and "ablation, single-stream dense: one stream" in r.stdout
    (tmp_path / "ckpt-token-factor-identity-heads-3-layers-1-d-model-24.pt").unlink()
    r = run_main(ds.main, ["--sweep", "--no-train", *args], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(json.loads((tmp_path / "analysis.json").read_text())["models"]) == 6
    assert json.loads((tmp_path / "analysis.json").read_text())["models"][0]["vs dense"] == "+0.00%"
    missing = f"no checkpoint in {tmp_path} for identity: left out of this run (--sweep --resume trains them)"
    assert f"note: {missing}" in r.stdout and json.loads((tmp_path / "analysis.json").read_text())["missing"] == missing
    # one model extended apart (a single run writes the sweep model's file): no cost vs dense, and the run says why
    r = run_main(ds.main, ["--resume", "--mixing", "kronecker", *args, "--max-iters", "6", "--amplify", "",
                           "--no-ablation"], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_main(ds.main, ["--sweep", "--no-train", *args, "--amplify", "", "--no-ablation"], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-3000:]
    assert not any("vs dense" in row for row in json.loads((tmp_path / "analysis.json").read_text())["models"])
    assert "sweep: val loss vs dense not computed: the models were trained on different budgets (step 4 vs 6 " \
           "(kronecker))" in r.stdout
    # no dense checkpoint: no base for the cost, and the run says so (the header alone left blank columns)
    (tmp_path / "ckpt-token-factor-dense-heads-3-layers-1-d-model-24.pt").unlink()
    (tmp_path / "ckpt-token-factor-kronecker-heads-3-layers-1-d-model-24.pt").unlink()  # the one extended apart
    r = run_main(ds.main, ["--sweep", "--no-train", *args, "--amplify", "", "--no-ablation"], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "sweep: val loss vs dense not computed: no token-factor dense model (its checkpoint is not in " \
           "--out-dir)" in r.stdout
    assert "for dense, kronecker, identity: left out of this run" in r.stdout


def test_head_sweep_from_the_command_line(tmp_path, cache_dir, capsys, monkeypatch):
    """--head-sweep (spec §7, §10.5) trains H = 2, 3, 6, 12 at fixed d into four checkpoints and prints the
    distinctiveness and the coreference best head per H."""
    r = run_main(ds.main, ["--head-sweep", "--layers", "1", "--d-model", "24", "--ctx", "64", "--batch-size", "2",
                           "--max-iters", "2", "--eval-interval", "2", "--eval-iters", "1", "--log-interval", "2",
                           "--amplify", "", "--no-ablation", "--no-report", "--sample-tokens", "2", "--tokenizer",
                           "bytes", "--max-tokens", str(MAX_TOKENS), "--out-dir", str(tmp_path), "--cache-dir",
                           str(cache_dir)], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["head_sweep"]
    assert [(row["heads"], row["d_h"]) for row in rows] == [(2, 12), (3, 8), (6, 4), (12, 2)]
    assert all(0 <= row["distinctiveness"] <= 1 and row["coref prompts"] > 0 for row in rows)
    assert all(row["gap prompts"] > 0 and row["gap best head"] and 0 <= row["logit gap > 0"] <= 1 for row in rows)
    assert r.stdout.count(", best head by DLA L0h") == 4
    # the best heads picked on one half of the prompts and scored on the other (split_half), beside the picks
    held = [row[col] for row in rows for col in ("coref held-out margin", "gap held-out DLA")]
    assert all(h.startswith("L0h") and " ± " in h for h in held) and r.stdout.count(", held out L0h") == 8
    assert "head sweep (spec §7, §10.5" in r.stdout and "  H=12  d_h=2    val loss" in r.stdout
    assert len(list(tmp_path.glob("ckpt-*.pt"))) == 4 and (tmp_path / "log-head-sweep-token-factor-kronecker-"
                                                         "layers-1-d-model-24.txt").is_file()


def test_resume_from_the_command_line(tmp_path, cache_dir, capsys, monkeypatch):
    """--resume takes the run's settings from the checkpoint (not the preset's) and extends a finished run when
    --max-iters is raised; a split mixing pair typed the other way round finds the same checkpoint."""
    args = ["--layers", "1", "--d-model", "24", "--heads", "3", "--ctx", "64", "--batch-size", "2", "--eval-interval",
            "5", "--eval-iters", "1", "--log-interval", "5", "--amplify", "", "--no-ablation", "--no-specialization",
            "--no-report", "--sample-tokens", "2", "--max-tokens", str(MAX_TOKENS), "--cache-dir", str(cache_dir)]
    r = run_main(ds.main, [*[a for a in args if a != "--no-specialization"], "--max-iters", "10", "--out-dir",
                           str(tmp_path), "--mixing", "kronecker", "--attn-out-mixing", "dense"], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "A_V hubs L0:h" in r.stdout  # V is the only Kronecker map: its hubs are the ones logged
    r = run_main(ds.main, ["--resume", "--max-iters", "15", "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir),
                           "--amplify", "", "--no-ablation", "--no-specialization", "--no-report",
                           "--layers", "1", "--d-model", "24", "--heads", "3",  # the architecture names the checkpoint
                           "--mixing", "dense", "--attn-v-mixing", "kronecker"], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-2000:]
    name = "ckpt-token-factor-kronecker-attn-out-mixing-dense-heads-3-layers-1-d-model-24.pt"
    assert "resumed from" in r.stdout and f"{name} at step 10" in r.stdout
    ck = torch.load(tmp_path / name, weights_only=True)
    assert ck["step"] == 15 and ck["config"]["batch_size"] == 2 and ck["config"]["d_model"] == 24
    assert [ck["config"][k] for k in ("mixing", "attn_v_mixing", "attn_out_mixing")] == ["kronecker", "same", "dense"]


@pytest.mark.parametrize("args,code,needle", [
    (["--mixing", "circulant"], 2, "invalid choice: 'circulant'"),
    (["--mode", "triple"], 2, "invalid choice: 'triple'"),
    (["--layerz", "6"], 2, "unrecognized arguments: --layerz"),
    (["--layers", "0"], 1, "error: --layers must be in [1, 1024]"),
    (["--layers", "10000000000000"], 1, "error: --layers must be in [1, 1024]"),
    (["--lr", "1e39"], 1, "--lr must be a finite number of at most 3.4e+38 (float32)"),
    (["--lr", "3e38"], 1, "--lr must be at most 3.4e+37 (Adam's first step, 10·lr, must fit float32)"),
    (["--head-sweep", "--d-model", "16"], 1, "--head-sweep needs --d-model 16 to split into even heads for H = 2, 3, 6, 12"),
    (["--head-sweep", "--d-model", "18"], 1, "--head-sweep needs --d-model 18 to split into even heads for H = 2, 3, 6"),
    (["--bench", "--resume"], 1, "--bench times the model and its kernels on random data, with no checkpoint"),
    (["--bench", "--no-train"], 1, "drop --resume and --no-train"),
    (["--weight-decay", "1e300"], 1, "--weight-decay must be a finite number of at most 3.4e+38"),
    (["--out-dir", ""], 1, "--out-dir is empty (. names the current folder)"),
    (["--heads", "0"], 1, "error: --heads must be >= 1"),
    (["--d-model", "-12"], 1, "error: --d-model must be >= 1"),
    (["--sweep", "--mixing", "dense"], 1, "--sweep trains its own seven configurations; drop --mixing"),
    (["--sweep", "--attn-out-mixing", "dense"], 1, "--sweep trains its own seven configurations; drop --attn-out-mixing"),
    (["--ffn-up-mixing", "kronecker"], 2, "invalid choice: 'kronecker'"),
    (["--pos", "sinusoidal"], 2, "invalid choice: 'sinusoidal'"),
    (["--alibi-alpha", "half"], 2, "invalid choice: 'half'"),
    (["--d-model", "30", "--heads", "4"], 1, "must split into --heads 4 heads"),
    (["--d-model", "30", "--heads", "6"], 1, "the head size d_model/heads must be even"),
    (["--amplify", "1,x"], 1, "--amplify '1,x': expected comma-separated numbers"),
    (["--amplify", ",,"], 1, "--amplify ',,': expected comma-separated numbers"),  # '' is off; ,, a typo
    (["--amplify", "1,-2"], 1, "every α must be in [1e-6, 1e6]"),
    (["--amplify", "1,1e300"], 1, "every α must be in [1e-6, 1e6]"),
    (["--amplify", "1,1e-46"], 1, "every α must be in [1e-6, 1e6]"),  # 0 in fp32: NaN figures
    (["--no-train"], 1, "error: no checkpoint at"),
    (["--no-train", "--sweep"], 1, "no --sweep checkpoints in"),
    (["--no-train", "--head-sweep"], 1, "(run --head-sweep first)"),
    (["--no-train", "--resume"], 1, "--resume continues training and --no-train trains nothing; give one"),
    (["--device", "tpu"], 1, "--device tpu: expected auto, cpu, cuda, cuda:N or mps"),
    (["--dataset", "tinystories"], 1, "needs the Hugging Face hub, which is unreachable"),
    (["--kernels", "triton"], 1, "--kernels triton needs a CUDA device"),
    (["--lr", "nan"], 1, "--lr must be > 0"),
    (["--grad-clip", "inf"], 1, "--grad-clip must be a finite number"),
    (["--norm", "layernorm", "--cln-gain", "head"], 1, "--cln-gain head needs --norm cln"),
    (["--head-sweep", "--heads", "3"], 1, "--head-sweep trains H = 2, 3, 6, 12; drop --heads"),
    (["--head-sweep", "--sweep"], 1, "--sweep and --head-sweep are separate runs"),
    (["--head-sweep", "--d-model", "36"], 1, "--head-sweep needs --d-model 36 to split into even heads"),
    (["--head-sweep", "--no-specialization"], 1, "--head-sweep compares the specialisation analyses"),
    (["--device", "meta"], 1, "--device meta: expected auto, cpu, cuda, cuda:N or mps"),  # torch.device takes it
    (["--seed", "99999999999999999999999"], 2, "argument --seed: invalid int value: '99999999999999999999999' (past 64 bits)"),
    (["--seed", "9223372036854775807"], 1, "--seed must be in [0, 2**32)"),
    (["--temperature", "-1"], 1, "--temperature must be >= 0 (0: greedy)"), (["--top-k", "-1"], 1, "--top-k must be"),
    (["--out-dir", "/dev/null/x"], 1, "--out-dir /dev/null/x: cannot write there"),
    (["--ctx", "20000", *SMALL_CORPUS], 1, "--ctx 20000: the val split has 10,000 tokens, fewer than ctx + 1"),
])
def test_bad_input_is_one_line_and_nonzero(tmp_path, cache_dir, args, code, needle, capsys, monkeypatch):
    """In-process main() (what `python dual_stream.py ...` runs), offline and without the tests' Triton interpreter;
    the subprocess form of the same path is covered by test_corrupt_checkpoint_is_one_line."""
    out = [] if "--out-dir" in args else ["--out-dir", str(tmp_path)]
    rc, err = call_main(ds.main, [*args, *out, "--cache-dir", str(cache_dir)], capsys, monkeypatch)
    assert rc == code and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_bench_on_cpu(tmp_path, capsys, monkeypatch):
    """--bench without a GPU: the mixing throughput table (ratios to dense), and the torch form of the op against
    SDPA and the reference (at two short lengths here: the CPU's 256 … 1024 take seconds)."""
    monkeypatch.setitem(ds.BENCH_KERNEL_CTX, "cpu", (64, 128))
    maps, real = [], ds.HeadMix.forward

    def spy(self, x):  # which map runs, and whether its backward does
        y = real(self, x)
        maps.append(self.kind)
        if y.requires_grad:
            y.register_hook(lambda g: maps.append(f"{self.kind} backward"))
        return y
    monkeypatch.setattr(ds.HeadMix, "forward", spy)
    real_kernel = ds.bench_kernel
    monkeypatch.setattr(ds, "bench_kernel", lambda *a, **k: maps.append("end of the maps") or real_kernel(*a, **k))
    r = run_main(ds.main, ["--bench", "--layers", "2", "--d-model", "24", "--heads", "3", "--ctx", "16",
                           "--batch-size", "2", "--out-dir", str(tmp_path), "--attn-out-mixing", "dense"], capsys,
                 monkeypatch)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "training tokens/s: dense" in r.stdout and "kernel (torch, float32) T=128" in r.stdout
    assert "note: --bench times every mixing strategy of the sweep side by side; --attn-out-mixing is not used" \
        in r.stdout  # the bench sets each strategy's maps itself
    res = json.loads(r.stdout[r.stdout.index("\n{") + 1:])
    assert set(res["ratio_to_dense"]) == {"dense", "kronecker", "independent", "identity", "fully independent"}
    assert res["ratio_to_dense"]["dense"] == 1.0
    # each model is its sweep row, whatever mixing flags were typed (--attn-out-mixing dense above)
    assert res["mixing_points"]["kronecker"] == ["kronecker", "kronecker", "dense", "dense"]
    assert res["mixing_points"]["fully independent"] == ["independent"] * 4
    assert res["kernel"]["form"] == "torch" and set(res["kernel"]["T64"]) >= {"torch", "sdpa", "reference", "torch-o"}
    # the mixing maps alone, beside each step's difference to dense (the maps of each model's first block)
    assert ("mixing maps alone (Mix_V then Mix_O, forward + backward, one layer; x L = 2 per step): kronecker "
            in r.stdout)
    mixing = res["mixing"]
    assert set(mixing) == {"dense", "kronecker", "independent"} and min(v["ms"] for v in mixing.values()) > 0
    step_ms = {n: 1e3 * 2 * 16 / v for n, v in res["train_tok_s"].items()}  # batch 2 × ctx 16
    for n, v in mixing.items():
        assert v["step_minus_dense_ms"] == pytest.approx(step_ms[n] - step_ms["dense"])
        assert v["per_step_ms"] == pytest.approx(2 * v["ms"])  # the two maps of each of 2 layers
        if n != "dense":
            per_step = v["per_step_ms"] - mixing["dense"]["per_step_ms"]
            assert f"{n} {v['ms']:.3f} ms ({per_step:+.2f} ms a step" in r.stdout
    # after the training steps, each strategy's own two maps: once without gradients (the output's dtype), then
    # forward and backward in each of bench_time's 4 calls on the CPU (a warm-up and 3 timed)
    timed = maps[:maps.index("end of the maps")]
    kinds = ("dense", "kronecker", "independent")
    expected = sum(([k, k] + [k, k, f"{k} backward", f"{k} backward"] * 4 for k in kinds), [])
    assert timed[-len(expected):] == expected
    # the timed form returns the statistics, which training does not ask for: the log says so and times both
    assert "T=128: o + statistics fwd " in r.stdout and "; o alone (training's call) fwd " in r.stdout


def test_alibi_checkpoint_never_loads_as_rope(tmp_path, cache_dir, capsys, monkeypatch):
    """An ALiBi model has a RoPE model's weights, so only the stored --pos tells them apart: its checkpoint has its own
    name, a RoPE command does not find it, and one that reaches it (a file renamed by hand) is a one-line error that
    names the file the model belongs in, whether --pos is typed or not (taken as it is, every row and the report
    would name the architecture of the file name, not of the model analysed)."""
    cfg = tiny_cfg(tmp_path, cache_dir, pos="alibi", max_iters=2, eval_interval=2)
    ds.train(cfg, common.load_data(cache_dir=cache_dir), torch.device("cpu"), torch.autocast("cpu", enabled=False),
             DIST, log=lambda m: None)
    alibi = ds.ckpt_path(cfg)
    assert alibi.name == "ckpt-token-factor-kronecker-heads-3-pos-alibi-layers-1-d-model-24.pt" and alibi.is_file()
    arch = ["--layers", "1", "--d-model", "24", "--heads", "3", "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)]
    rc, err = call_main(ds.main, ["--no-train", *arch], capsys, monkeypatch)
    assert rc == 1 and "no checkpoint at" in err and alibi.name in err and err.count("\n") == 1, err
    rope = ds.ckpt_path(replace(cfg, pos="rope"))
    shutil.copy(alibi, rope)
    held = f"{rope} holds the model of {alibi.name}, not the architecture its name says; rename it back or retrain"
    for typed in (["--pos", "rope"], []):
        rc, err = call_main(ds.main, ["--no-train", *typed, *arch], capsys, monkeypatch)
        assert rc == 1 and err == f"error: {held}\n", err
    ck = torch.load(alibi, weights_only=True)
    del ck["config"]["pos"]  # a checkpoint from before --pos existed: RoPE, under the RoPE name
    torch.save(ck, rope)
    with pytest.raises(ds.RunError, match=r"trained with pos='rope' \(asked 'alibi'\)"):
        ds.load_checkpoint(rope, cfg, explicit={"pos"})
    assert ds.load_checkpoint(rope, replace(cfg, pos="rope"))[1].pos == "rope"
    # a setting that names the file without being architecture (--kron-out-init) is the file's own name, not a rename
    scaled = tiny_cfg(tmp_path, cache_dir, kron_out_init="scaled", max_iters=2, eval_interval=2)
    ds.train(scaled, common.load_data(cache_dir=cache_dir), torch.device("cpu"), torch.autocast("cpu", enabled=False),
             DIST, log=lambda m: None)
    assert "-kron-out-init-scaled-" in ds.ckpt_path(scaled).name
    assert ds.load_checkpoint(ds.ckpt_path(scaled), scaled)[1].kron_out_init == "scaled"
    # and an output name taken by a folder is one line from main (the OSError it raises, mapped)
    (tmp_path / "analysis.json").mkdir()
    rc, err = call_main(ds.main, ["--no-train", "--pos", "alibi", "--amplify", "", "--no-ablation", "--no-specialization",
                                  *arch], capsys, monkeypatch)
    assert rc == 1 and err.startswith(f"error: {tmp_path / 'analysis.json'}: Is a directory; check") and \
        err.count("\n") == 1, err


def test_corrupt_checkpoint_is_one_line(tmp_path, cache_dir):
    (tmp_path / "ckpt-token-factor-kronecker.pt").write_bytes(b"not a checkpoint")
    r = run_script("dual_stream.py", "--no-train", "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir))
    assert r.returncode == 1 and "is not a readable checkpoint" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.slow
def test_ddp_two_cpu_processes_match_one(tmp_path, cache_dir):
    """torchrun with 2 gloo processes, each rank half of the global batch: the same weights as one process."""
    args = ["--layers", "1", "--d-model", "24", "--heads", "3", "--ctx", "32", "--batch-size", "8", "--max-iters", "6",
            "--eval-interval", "3", "--eval-iters", "2", "--log-interval", "3", "--dropout", "0", "--amplify", "",
            "--no-ablation", "--no-specialization", "--no-report", "--sample-tokens", "5",
            "--max-tokens", str(MAX_TOKENS), "--cache-dir", str(cache_dir)]
    common.load_data(max_tokens=MAX_TOKENS, cache_dir=cache_dir)  # the cache exists before the ranks start
    a, b = run_one_and_ddp("dual_stream.py", args, tmp_path, "ckpt-token-factor-kronecker-heads-3-layers-1-d-model-24.pt")
    torch.testing.assert_close(a["history"]["val"], b["history"]["val"], rtol=1e-5, atol=0)
    # the logged training loss is the global batch's, averaged over the ranks, not rank 0's half
    torch.testing.assert_close(a["history"]["train"], b["history"]["train"], rtol=1e-5, atol=0)
    check_ddp_weights(a["model"], b["model"], a["config"]["lr"])


@pytest.mark.gpu
@pytest.mark.slow  # .ci/gpu runs these last, with the time the benchmarks leave
def test_cuda_tiny_run_and_resume(tmp_path, cache_dir):
    """The tiny run on a GPU (the attention kernel with its statistics, the CLN kernel, bf16 autocast), then
    --resume."""
    out = check_cuda_run("dual_stream.py", [*TINY, "--cache-dir", str(cache_dir)], tmp_path,
                         ["ckpt-token-factor-kronecker-heads-3-layers-2-d-model-24.pt"], 30,
                         ds.peak_flops(torch.device("cuda")))
    assert "amplification," in out and "ablation," in out and "specialisation," in out


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["dense", "kronecker", "independent"])
def test_cuda_training_step_never_waits_for_the_gpu(name):
    """The training step of the mixings the throughput goal names, at the paper's widths (2 layers, batch 4 × 256,
    the attention and CLN kernels): no wait for the GPU (check_step_never_waits)."""
    cfg = replace(Config(), **ds.SWEEP[name], **dict.fromkeys(ds.POINT_KEYS, "same"), layers=2, dropout=0.0)
    model = DualStream(cfg, ds.BENCH_VOCAB).cuda()
    optimizer = ds.make_optimizer(model, cfg, "cuda")
    x, y = torch.randint(0, ds.BENCH_VOCAB, (2, 4, cfg.ctx), device="cuda")
    assert check_step_never_waits(model, optimizer, x, y, cfg.grad_clip)

def test_chance_hub_ratio_is_a_stable_median():
    """At H = 2 the ratio is |X|/|Y| of two normals (no mean): the median settles, near 2.5, whatever the draws."""
    assert 2.2 < ds.chance_hub_ratio(2, 500) < 2.9 and 2.2 < ds.chance_hub_ratio(2, 2000) < 2.9
    assert 1.4 < ds.chance_hub_ratio(6, 500) < 1.7


def test_one_head_has_no_distinctiveness():
    """No pair of heads: [] and n/a, not a 0.000 that reads as identical heads."""
    model = ds.DualStream(ds.Config(layers=1, heads=1, d_model=16, ctx=16), 40)
    data = types.SimpleNamespace(tokens=lambda split: torch.arange(200) % 40,
                                 iter_eval=lambda split, n, w: iter([(torch.arange(2 * w).view(2, w) % 40, None)]))
    assert ds.distinctiveness(model, data, width=12) == [] and ds.per_layer([]) == "n/a (one head)"
    assert ds.per_layer([0.5, 0.25]) == "0.500 0.250"


def test_unused_flags_are_noted():
    """A typed flag whose analysis does not run in this invocation gets a note naming it and why."""
    def notes(explicit, **kw):
        return [n.split(" has")[0] for n in ds.unused_flags(Config(**kw), explicit)]
    every = {"ablate_at", "analysis_windows", "sample_tokens"}
    assert notes(every) == []
    assert notes(every, ablation=False) == ["note: --ablate-at"]
    assert notes(every, ablation=False, amplify="") == ["note: --ablate-at", "note: --analysis-windows"]
    assert notes(every, ablation=False, amplify="", train=False) == \
        ["note: --ablate-at", "note: --analysis-windows", "note: --sample-tokens"]
    assert notes(every, amplify="", train=False) == ["note: --sample-tokens"]  # ablation uses the windows
    assert notes(every, amplify="", train=False, sample="KING:") == []
    assert notes(set(), ablation=False, amplify="", train=False) == []  # defaults, not typed: nothing to say
    assert notes({"ablate_at"}, mode="single") == ["note: --ablate-at"]  # one stream: nothing to remove
    assert notes({"ablate_at"}, mode="single", sweep=True) == []  # the sweep's two-stream models use it
    assert notes({"alibi_alpha"}) == ["note: --alibi-alpha"]  # RoPE: no bias to scale
    assert notes({"alibi_alpha"}, pos="alibi") == []
    assert notes({"alibi_alpha"}, pos="alibi", amplify="") == ["note: --alibi-alpha"]  # α = 1 only: both agree
    # model settings this architecture lacks (NAME_KEYS' rule): noted; a sweep with a model that has them: not
    shape = {"v_source", "kron_out_init", "fts_cln_at_init"}
    assert notes(shape, mode="single") == ["note: --v-source", "note: --fts-cln-at-init"]  # Kronecker by default
    assert notes(shape, mode="fts", mixing="kronecker") == []
    assert notes(shape, mode="single", sweep=True) == []
    assert notes(shape, mixing="identity") == ["note: --kron-out-init", "note: --fts-cln-at-init"]


def test_alibi_takes_odd_heads():
    """RoPE rotates channel pairs, so its heads must be even; ALiBi has no such limit (the head sweep's too)."""
    with pytest.raises(ds.RunError, match="the head size d_model/heads must be even"):
        ds.validate(Config(d_model=30, heads=6))
    ds.validate(Config(d_model=30, heads=6, pos="alibi"))
    with pytest.raises(ds.RunError, match="--d-model 36 to split into even heads"):
        ds.validate(Config(d_model=36, head_sweep=True))
    ds.validate(Config(d_model=36, head_sweep=True, pos="alibi"))
    with pytest.raises(ds.RunError, match="--d-model 30 to split into heads for"):
        ds.validate(Config(d_model=30, head_sweep=True, pos="alibi"))
    m = DualStream(Config(layers=1, d_model=15, heads=3, pos="alibi", kernels="torch"), V)  # d_h = 5
    assert m(tokens()[0]).shape == (2, 16, V)


def test_report_config_marks_what_a_sweep_varies():
    """The report's configuration row holds the base settings; under a sweep the swept ones would read as every
    model's (mixing kronecker beside seven models of which one is Kronecker), so they say they are swept."""
    row = ds.resolved_config(Config(sweep=True), {"preset": "cpu"})
    assert row["mode"] == row["mixing"] == row["ffn_mixing"] == "swept (per model below)" and row["heads"] == 6
    assert row["preset"] == "auto → cpu"
    row = ds.resolved_config(Config(head_sweep=True), {})
    assert row["heads"] == "swept (per model below)" and row["mixing"] == "kronecker"
    assert ds.resolved_config(Config(), {})["mixing"] == "kronecker"


def test_distinctiveness_says_the_rows_and_width_it_read():
    """The label follows the clamps: a ctx below 128 reads windows of ctx tokens, and below 9 fewer skipped rows
    (ctx 4 skips 3, leaving one), not the '8 on, min(128, ctx)' of the defaults."""
    data = types.SimpleNamespace(tokens=lambda split: torch.arange(5000) % 40)
    for ctx, width, skip in ((256, 128, 8), (64, 64, 8), (4, 4, 3), (1, 1, 0)):
        model = ds.DualStream(ds.Config(layers=1, heads=2, d_model=16, ctx=ctx), 40)
        assert ds.distinct_sizes(model, data) == (width, skip)
        assert ds.distinctiveness_on(width, skip) == (f"mean pairwise JS in bits over heads and query rows {skip} on, "
                                                      f"in the first 8 val windows of {width} tokens")
    short = types.SimpleNamespace(tokens=lambda split: torch.arange(51) % 40)  # the val split caps it too
    assert ds.distinct_sizes(ds.DualStream(ds.Config(layers=1, heads=2, d_model=16, ctx=256), 40), short) == (50, 8)
