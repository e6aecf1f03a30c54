"""prism.py beyond the core op: the prototype head's identity and gradient routing, suppression (and the
recompute-the-residual trap), the losses, seeding, training (resume, NaN, DDP), checkpoints, the command line,
and that the script works when copied alone."""
import contextlib
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import common
from conftest import (SMALL_CORPUS, call_main, check_bad_token_batches, check_close, check_cuda_run,
                      check_ddp_weights, check_step_never_waits, compiled_ops, run_main, run_one_and_ddp, run_script,
                      save_envelope)
import prism
from prism import Config, PRISM

ROOT = Path(__file__).resolve().parents[1]
V = 40
TINY = ["--layers", "1", "--d-model", "32", "--heads", "2", "--n-protos", "24", "--topk", "4", "--ctx", "32",
        "--batch-size", "4", "--max-iters", "30", "--init-steps", "10", "--eval-interval", "15", "--eval-iters", "2",
        "--log-interval", "10", "--card-windows", "16", "--attr-seqs", "24", "--attr-queries", "3",
        "--sample-tokens", "12", "--lr", "4e-3", *SMALL_CORPUS]


def tiny_model(**kw):
    cfg = Config(**{**dict(layers=1, d_model=16, heads=2, n_protos=12, topk=3, ctx=8, init="random", kernels="torch"),
                    **kw})
    torch.manual_seed(0)
    return PRISM(cfg, V).double()


def batch(B=2, T=8):
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


# ---------------------------------------------------------------- the head

@pytest.mark.parametrize("mode", ["full", "detach-zhat", "detach-r"])
def test_logits_equal_the_dense_head_in_every_routing(mode):
    """§2.3: W r + Σ a W p = W z, whatever the routing."""
    m = tiny_model(resid_grad=mode)
    x, _ = batch()
    z = m.hidden(x)
    out = m.head(z)
    torch.testing.assert_close(out["logits"], F.linear(z, m.wte.weight), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out["r"] + out["zhat"], z, rtol=1e-12, atol=1e-12)
    assert (out["a"] >= 0).all() and out["idx"].shape == (2, 8, 3)


@pytest.mark.parametrize("mode,precision", [("full", "fp32"), ("detach-r", "fp32"), ("detach-zhat", "bf16")])
def test_triton_model_matches_the_torch_model(mode, precision):
    """--kernels triton (the top-k selection and the gathered-dot kernels, the LayerNorms, the cross-entropy) and
    --kernels torch on the same weights: the training loss with its R1/R2 terms, every statistic and every
    parameter's gradient (with --dot-precision bf16 too)."""
    out = {}
    x, y = batch(3, 8)
    for backend in ("torch", "triton"):
        m = tiny_model(resid_grad=mode, kernels=backend, lambda_r1=0.1, lambda_r2=0.1, dot_precision=precision).float()
        loss, stats = m(x, y)
        loss.backward()
        out[backend] = loss.detach(), stats, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
    (loss_t, stats_t, grads_t), (loss_k, stats_k, grads_k) = out["torch"], out["triton"]
    check_close("loss", loss_t, loss_k)
    assert set(stats_t) == set(stats_k) and {"ce", "r1", "r2"} <= set(stats_t)
    for k, v in stats_t.items():  # the means close, the counts (R2's coverage) equal
        v, w = torch.as_tensor(v), torch.as_tensor(stats_k[k])
        if v.is_floating_point():
            check_close(k, v, w)
        else:
            assert torch.equal(v, w), k
    assert set(grads_t) == set(grads_k) and "P" in grads_t
    for n, g in grads_t.items():
        check_close(n, g, grads_k[n])


def test_dot_precision_reaches_the_selection():
    """--dot-precision: the model's winners and activations are proto_topk_ref's at that precision (bf16: the
    cosines of the bf16-rounded unit vectors), and the two precisions give different activations; a resumed run
    that changes it says the result will differ."""
    x, _ = batch()
    acts = {}
    for precision in ("fp32", "bf16"):
        m = tiny_model(dot_precision=precision).float()
        z = m.hidden(x).flatten(0, 1)
        idx, a = m.prototypes(z)
        ref_idx, ref_a = prism.proto_topk_ref(z, m.P, m.cfg.topk, precision=precision)
        assert torch.equal(idx, ref_idx)
        check_close(precision, ref_a, a)
        acts[precision] = a
    assert (acts["fp32"] - acts["bf16"]).abs().max() > 1e-5
    saved = dataclasses.asdict(Config())
    note = prism.resume_note(saved, dataclasses.replace(Config(), dot_precision="bf16"), 10)
    assert note and "dot_precision fp32 -> bf16" in note


def test_a_checkpoint_from_before_dot_precision_selects_in_fp32(tmp_path):
    """A checkpoint saved before --dot-precision existed (no key in its config) selected in fp32: it loads as fp32
    whatever a --no-train run types (with a note that says why), and a --resume with bf16 says the run changes."""
    path = tmp_path / "ckpt-prism.pt"
    config = dataclasses.asdict(Config(out_dir=str(tmp_path)))
    del config["dot_precision"]
    save_envelope(path, "prism", config)
    asked = Config(out_dir=str(tmp_path), train=False, dot_precision="bf16")
    ck, merged = prism.load_checkpoint(path, asked, explicit={"dot_precision"})
    assert merged.dot_precision == "fp32"
    assert [n for n in prism.unused_flags(merged, {"dot_precision"}) if "--dot-precision" in n] == [
        "note: --dot-precision has no effect in this run (--no-train keeps the checkpoint's value, so that the "
        "analyses select prototypes as training did)"]
    note = prism.resume_note(ck["config"], dataclasses.replace(Config(), dot_precision="bf16"), 3)
    assert note and "dot_precision fp32 -> bf16" in note


def ce_grads(m, x, y, ce_of_z):
    """Gradients of a CE for the backbone's z and for P, given how the logits are formed from z."""
    z = m.hidden(x).detach().requires_grad_()
    gz, gp = torch.autograd.grad(ce_of_z(z), [z, m.P], allow_unused=True)
    return gz, (torch.zeros_like(m.P) if gp is None else gp)


@pytest.mark.parametrize("act", ["relu_cos", "relu_cos_znorm", "relu_cos_sum1"])
@pytest.mark.parametrize("mode", ["full", "detach-zhat", "detach-r"])
def test_gradient_routing(mode, act):
    """--resid-grad (§2.3), against an independent recomputation of ẑ = Σ ReLU(cos(z, p_i)) p_i on the active set:
    full         z gets the dense gradient, P none (the prototype terms cancel);
    detach-zhat  P gets the gradient of W ẑ's share, W(c + ẑ(z, P)) with c = z - ẑ fixed, and z the dense
                 gradient plus that share's (ẑ depends on z through the cosines in a);
    detach-r     z and P both get only the share (CE reaches the backbone through the cosines alone)."""
    m = tiny_model(resid_grad=mode, act=act)
    x, y = batch()
    idx = m.head(m.hidden(x))["idx"].detach()

    def ce(logits):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def share(z):
        Pi = m.P[idx]                                                          # [B, T, k, d]
        a = F.cosine_similarity(z.unsqueeze(-2), Pi, dim=-1).relu()
        if act == "relu_cos_znorm":
            a = a * z.norm(dim=-1, keepdim=True)
        elif act == "relu_cos_sum1":
            a = a / a.sum(-1, keepdim=True).clamp_min(1e-6)
        zhat = (a.unsqueeze(-1) * Pi).sum(-2)
        return ce(F.linear((z - zhat).detach() + zhat, m.wte.weight))
    gz, gp = ce_grads(m, x, y, lambda z: ce(m.head(z)["logits"]))
    dz, _ = ce_grads(m, x, y, lambda z: ce(F.linear(z, m.wte.weight)))
    sz, sp = ce_grads(m, x, y, share)
    assert sp.abs().max() > 1e-6 and not torch.allclose(sz, dz)
    torch.testing.assert_close(gz, {"full": dz, "detach-zhat": dz + sz, "detach-r": sz}[mode], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(gp, torch.zeros_like(sp) if mode == "full" else sp, rtol=1e-5, atol=1e-8)  # P's scatter runs in fp32


def test_suppression_keeps_the_unsuppressed_residual():
    """§2.4: l' = W z - Σ_{i∈A∩S} a_i W p_i. Masking before top-k and recomputing r would give W z back
    (the trap): the suppressed logits must differ from W z exactly where a suppressed prototype is active."""
    m = tiny_model()
    x, _ = batch()
    z = m.hidden(x)
    out = m.head(z)
    S = torch.zeros(12, dtype=torch.bool)
    S[out["idx"][0, 0, 0]] = True  # a prototype active at the first token
    sup = m.head(z, suppress=S)["logits"]
    W = m.wte.weight
    active = (S[out["idx"]] & (out["a"] > 0))                                  # [B, T, k]
    drop = (out["a"] * active).unsqueeze(-1) * m.P[out["idx"]]                 # [B, T, k, d]
    torch.testing.assert_close(sup, F.linear(z - drop.sum(-2), W), rtol=1e-12, atol=1e-12)
    touched = active.any(-1)
    assert touched[0, 0] and (sup - out["logits"]).abs().amax(-1)[touched].min() > 1e-8
    torch.testing.assert_close(sup[~touched], out["logits"][~touched], rtol=0, atol=0)
    half = m.head(z, suppress=S, factor=0.5)["logits"]                        # a kept fraction in between
    torch.testing.assert_close(half, (sup + out["logits"]) / 2, rtol=1e-10, atol=1e-12)
    # the trap: recompute with the suppressed prototypes removed from the bank -> back to W z exactly
    m2 = tiny_model()
    with torch.no_grad():
        m2.P[S] = -m2.P[S]  # (any change to the bank) still gives W z when r is recomputed
    torch.testing.assert_close(m2.head(z)["logits"], out["logits"], rtol=1e-12, atol=1e-12)


def test_controller_gain_adds_active_terms():
    m = tiny_model()
    x, _ = batch()
    z = m.hidden(x)
    out = m.head(z)
    c = torch.zeros(12, dtype=torch.float64)
    torch.testing.assert_close(m.head(z, gain=c)["logits"], out["logits"], rtol=0, atol=0)
    i = int(out["idx"][0, 0, 0])
    c[i] = 1.0
    a_i = (out["a"] * (out["idx"] == i)).sum(-1, keepdim=True)                # 0 where i is inactive
    torch.testing.assert_close(m.head(z, gain=c)["logits"], out["logits"] + a_i * (m.wte.weight @ m.P[i]),
                               rtol=1e-12, atol=1e-12)


def test_losses_follow_their_definitions():
    m = tiny_model(dist="l2")
    x, _ = batch()
    z = m.hidden(x)
    out = m.head(z)
    aux = m.aux_losses(z, out)
    zf = z.reshape(-1, 16)
    torch.testing.assert_close(aux["rec"], ((zf - out["zhat"].reshape(zf.shape)).pow(2).sum(-1) / zf.pow(2).sum(-1)).mean())
    d = torch.cdist(zf, m.P).pow(2) / 16                                       # squared L2 per dimension
    torch.testing.assert_close(aux["r1"], d.min(0).values.mean())
    torch.testing.assert_close(aux["r2"], d.min(1).values.mean())
    mc = tiny_model(dist="cosine")
    aux = mc.aux_losses(z, mc.head(z))
    cos = F.normalize(zf, dim=-1) @ F.normalize(mc.P, dim=-1).T
    torch.testing.assert_close(aux["r1"], (1 - cos.max(0).values).mean())
    torch.testing.assert_close(aux["r2"], (1 - cos.max(1).values).mean())
    # --r1-detach-z: R1 moves only the prototypes
    md = tiny_model(r1_detach_z=True)
    zz = md.hidden(x).detach().requires_grad_()
    assert torch.autograd.grad(md.aux_losses(zz, md.head(zz))["r1"], zz, allow_unused=True)[0] is None


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("dist", ["l2", "cosine"])
def test_training_takes_the_nearest_pairs_from_the_selection(dist, kernels, monkeypatch):
    """The training forward reads R1/R2's pairs off the top-k selection's cosines (head(z, pairs=dist)), with no
    second search; the losses equal those of the separate nearest_pairs search (the Triton kernel in fp32, under
    the interpreter without a GPU; the torch form in float64)."""
    m = tiny_model(dist=dist, kernels=kernels)
    if kernels == "triton":
        m = m.float()
    x, y = batch()
    z = m.hidden(x)
    want = m.aux_losses(z, m.head(z))
    out = m.head(z, pairs=dist)
    assert "pairs" in out and "pairs" not in m.head(z)
    got = m.aux_losses(z, out)
    for k in ("rec", "r1", "r2"):
        torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)

    def no_search(*args, **kwargs):
        raise AssertionError("the training forward ran a separate nearest_pairs search")
    monkeypatch.setattr(prism, "nearest_pairs", no_search)
    _, stats = m(x, y)
    for k in ("r1", "r2"):
        torch.testing.assert_close(stats[k], want[k].detach(), rtol=1e-6, atol=1e-7)


def test_evaluation_takes_the_nearest_pairs_from_the_selection(monkeypatch):
    """estimate_loss's R1/R2 come from the head's pairs too: the one separate search left is the cosine one of
    the coverage figures, whatever --dist is."""
    m = tiny_model(dist="l2", eval_iters=2)
    calls = []
    search = prism.nearest_pairs
    monkeypatch.setattr(prism, "nearest_pairs", lambda z, P, dist="l2", **kw: calls.append(dist) or search(z, P, dist, **kw))

    class Val:
        def get_batch(self, split, batch_size, ctx):
            assert split == "val"
            return batch(batch_size, ctx)
    res = prism.estimate_loss(m, Val(), m.cfg, contextlib.nullcontext(), 2)
    assert calls == ["cosine", "cosine"] and {"r1", "r2", "cover_r1"} <= set(res)


def test_training_loss_is_ce_plus_the_weighted_terms():
    """The loss the optimizer sees is CE + λ_rec·REC + λ1·R1 + λ2·R2, each weight its own (distinct values, so a
    dropped or swapped term shows)."""
    m = tiny_model(lambda_rec=0.3, lambda_r1=0.7, lambda_r2=1.9).eval()
    assert m.ready
    loss, s = m(*batch())
    torch.testing.assert_close(loss.detach(), s["ce"] + 0.3 * s["rec"] + 0.7 * s["r1"] + 1.9 * s["r2"])
    assert min(s["rec"], s["r1"], s["r2"]) > 0


def test_aux_loss_gradients_are_bitwise_reproducible_on_cpu():
    """R1/R2 gather the nearest rows many times over (here 8192 tokens onto 4 prototypes); a gather whose backward
    adds duplicate rows in thread order (index_put_ with accumulate, what P[idx] and z[idx] do) made training
    runs differ in the last bits, so no CPU figure reproduced. Five backward passes must agree bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(2, threads))
    try:
        g = torch.Generator().manual_seed(0)
        z = torch.randn(8192, 16, generator=g, requires_grad=True)
        P = torch.nn.Parameter(torch.randn(4, 16, generator=g))
        m = tiny_model()
        m.P = P
        out = {"r": torch.zeros(8192, 16)}
        grads = []
        for _ in range(5):
            aux = m.aux_losses(z, out)
            grads.append(torch.autograd.grad(aux["r1"] + aux["r2"], (z, P)))
        for gz, gp in grads[1:]:
            assert torch.equal(gz, grads[0][0]) and torch.equal(gp, grads[0][1])
    finally:
        torch.set_num_threads(threads)


def test_nearest_pairs_chunked_equals_brute_force():
    z, P = torch.randn(37, 8, dtype=torch.float64), torch.randn(11, 8, dtype=torch.float64)
    pt, tp = prism.nearest_pairs(z, P, "l2", chunk=5)
    d = torch.cdist(z.float(), P.float())
    assert torch.equal(pt, d.argmin(1)) and torch.equal(tp, d.argmin(0))
    pt, tp = prism.nearest_pairs(z, P, "cosine", chunk=5)
    cos = F.normalize(z, dim=-1) @ F.normalize(P, dim=-1).T
    assert torch.equal(pt, cos.argmax(1)) and torch.equal(tp, cos.argmax(0))


def test_nearest_pairs_and_pair_distance_refuse_a_bad_dist_and_no_tokens():
    """A misspelt dist would silently compute L2; zero tokens would name token 0 of an empty set."""
    z, P = torch.randn(5, 8), torch.randn(3, 8)
    for call in (lambda: prism.nearest_pairs(z, P, "cos"), lambda: prism.pair_distance(z, z, "cos")):
        with pytest.raises(ValueError, match="dist must be 'l2' or 'cosine', got 'cos'"):
            call()
    with pytest.raises(ValueError, match="no tokens, so no prototype has a nearest one"):
        prism.nearest_pairs(z[:0], P)


def test_nearest_pairs_ignore_autocast():
    """Under bf16 autocast (CUDA training) the neighbour search still runs in fp32. Pairs of prototypes 0.01 apart,
    tokens near the first of each: bf16 dot products (8 significand bits) misorder such pairs, fp32 does not."""
    P = torch.randn(20, 64)
    P = torch.cat([P, P + 0.01 * torch.randn(20, 64)])
    z = P[:20].repeat(15, 1) + 0.05 * torch.randn(300, 64)
    want = prism.nearest_pairs(z, P, "l2")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = (2 * (z @ P.T).float() - P.pow(2).sum(-1)).argmax(1)  # the search's score, as autocast computes it
        got = prism.nearest_pairs(z, P, "l2")
    assert not torch.equal(bf16, want[0])  # the premise: in bf16 these neighbours change
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_nearest_pairs_runs_eagerly_inside_torch_compile():
    """It toggles the TF32 flags, so it is kept out of compiled graphs (the model's forward calls it): dynamo
    graph-breaks around it, and no captured graph holds its distance GEMM."""
    z, P = torch.randn(30, 8), torch.randn(7, 8)
    got, ops = compiled_ops(lambda z, P: prism.nearest_pairs(z * 2, P, "l2"), z, P)
    want = prism.nearest_pairs(z * 2, P, "l2")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert ops == ["mul"], ops  # the z * 2 alone: the search is not in the graph


def test_seeding_draws_hidden_states_and_is_remembered():
    m = tiny_model(init="kmeans++")
    assert not m.ready and not bool(m.proto_ready)
    x, y = batch(4, 8)
    loss, stats = m(x, y)  # warm-up: dense head, P in the graph at zero weight
    assert set(stats) == {"ce"}
    z = m.hidden(x).detach().reshape(-1, 16)
    m.seed_prototypes(z, torch.Generator().manual_seed(0))
    assert m.ready and bool(m.proto_ready)
    # every prototype is a hidden state of the batch times one common scale (cosines kept)
    cos = F.normalize(m.P, dim=-1) @ F.normalize(z, dim=-1).T
    assert (cos.max(1).values > 1 - 1e-9).all()
    scale = m.P.norm(dim=-1) / z[cos.argmax(1)].norm(dim=-1)
    torch.testing.assert_close(scale, scale[:1].expand_as(scale))
    m2 = tiny_model(init="kmeans++")
    assert not m2.ready
    m2.load_state_dict(m.state_dict())  # the flag follows the loaded buffer: the prototype head runs, as in m
    assert m2.ready
    m.eval(), m2.eval()
    (loss, stats), (loss2, stats2) = m(x, y), m2(x, y)
    assert set(stats2) == set(stats) != {"ce"} and loss2.item() == loss.item()
    with pytest.raises(ValueError, match="needs at least K=12 hidden states"):
        tiny_model(init="kmeans++").seed_prototypes(z[:5], torch.Generator())


def test_a_sequence_longer_than_ctx_or_empty_is_a_clear_error():
    m = tiny_model()  # ctx 8: the learned position table has 8 rows
    with pytest.raises(ValueError, match="sequence length 9 > ctx 8: the learned position table has ctx rows"):
        m(torch.zeros(1, 9, dtype=torch.long))
    check_bad_token_batches(m, m.generate)


def test_temperature_zero_is_greedy():
    """--temperature 0 takes the arg-max of each step's logits, whatever the generator, for both heads."""
    for twin in (False, True):
        m = tiny_model(head="dense") if twin else tiny_model()
        m.eval()
        idx = torch.tensor([[1, 2, 3]])
        out = m.generate(idx, 4, temperature=0, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            ref = idx
            for _ in range(4):
                z = m.hidden(ref)[:, -1:]
                logits = (m.head(z)["logits"] if m.ready else F.linear(z, m.wte.weight))[:, -1]
                ref = torch.cat([ref, logits.argmax(-1, keepdim=True)], 1)
        assert torch.equal(out, ref)
        assert torch.equal(m.generate(idx, 4, temperature=0, generator=torch.Generator().manual_seed(6)), out)
    prism.validate(Config(temperature=0))  # and the flag accepts it, as in the other two language models


def test_dense_twin_shares_the_backbone_init():
    torch.manual_seed(0)
    a = PRISM(Config(layers=2, d_model=32, heads=2, n_protos=8, ctx=16), V)
    torch.manual_seed(0)
    b = PRISM(Config(head="dense", layers=2, d_model=32, heads=2, n_protos=8, ctx=16), V)
    sb = b.state_dict()
    for k, v in a.state_dict().items():
        if k not in ("P", "proto_ready"):
            assert torch.equal(v, sb[k]), k
    assert set(a.state_dict()) - set(sb) == {"P", "proto_ready"}
    assert not hasattr(b, "P")
    opt = prism.make_optimizer(a, a.cfg, "cpu")
    no_decay = {id(p) for p in opt.param_groups[1]["params"]}
    assert id(a.P) in no_decay and id(a.wte.weight) not in no_decay


def test_logit_decomposition_sums_to_the_logit(tmp_path):
    m = tiny_model(topk=6)  # more active slices than the 4 a row names: the rest are summed in "other"

    class Tok:
        def decode(self, ids):
            return "".join(chr(97 + i % 26) for i in ids)
    dec = prism.logit_decomposition(m.float(), torch.randint(0, V, (1, 9)), Tok(), prompt_len=4)
    assert len(dec["rows"]) == 8 and dec["max_abs_error"] < 1e-4
    assert any(r["other"][0] > 0 for r in dec["rows"])
    for r in dec["rows"]:  # the slices named, the others' sum and the residual: each row adds up to its logit
        assert len(r["prototypes"]) + r["other"][0] <= 6 and (r["other"][0] == 0 or len(r["prototypes"]) == 4)
        assert abs(sum(v for _, v in r["prototypes"]) + r["other"][1] + r["residual"] - r["logit"]) < 1e-4
    # row t is the logit of token t + 1: the prompt's tokens 1..3, then the five generated ones
    assert [r["prompt"] for r in dec["rows"]] == [True] * 3 + [False] * 5


class SuppressionData:
    """What suppression() reads from common's data: a tokenizer, the device and iter_eval over the val split."""

    class Tok:
        unk = None  # no compaction: every target is a known token

        def encode(self, s):
            return [ord(ch) % V for ch in s]

        def decode(self, ids):
            return "".join(chr(97 + i % 26) for i in ids)

    def __init__(self):
        self.tokenizer, self.device = self.Tok(), torch.device("cpu")
        self.val = torch.randint(0, V, (4 * 8 + 1,), generator=torch.Generator().manual_seed(2))

    def iter_eval(self, split, batch_size, ctx):
        starts = range(0, len(self.val) - ctx, ctx)
        yield (torch.stack([self.val[s:s + ctx] for s in starts]),
               torch.stack([self.val[s + 1:s + ctx + 1] for s in starts]))


def test_attribution_says_when_the_corpus_holds_fewer_windows_than_asked():
    """--attr-seqs and --attr-queries larger than the splits hold are cut to what they hold, and the log says so
    (the table would otherwise read as if every asked window was attributed)."""
    import numpy as np

    class AttrData(SuppressionData):
        def __init__(self):
            super().__init__()
            g = np.random.default_rng(0)
            self.split = {"train": g.integers(0, V, 5 * 8 + 1).astype(np.uint16),
                          "val": g.integers(0, V, 3 * 8 + 1).astype(np.uint16)}

        def tokens(self, split):
            return self.split[split]
    m = tiny_model().float()  # init random: the prototypes are live
    lines = []
    prism.run_attribution(m, AttrData(), dataclasses.replace(m.cfg, attr_seqs=100, attr_queries=50), lines.append)
    assert [ln for ln in lines if ln.startswith("note:")] == [
        "note: --attr-seqs 100: the training split holds 5 distinct windows of --ctx 8; using 5",
        "note: --attr-queries 50: the val split holds 17 distinct windows of --ctx 8; using 17"]
    lines.clear()
    prism.run_attribution(m, AttrData(), dataclasses.replace(m.cfg, attr_seqs=5, attr_queries=4), lines.append)
    assert not [ln for ln in lines if ln.startswith("note:")]


def test_suppression_counts_how_often_the_suppressed_prototypes_fired():
    """An unchanged before/after must read as a no-op when the prototypes never fired (a zero row: cos 0, a = 0),
    and the count must be the (token, suppressed prototype) activations a > 0 of the val windows."""
    m = tiny_model().float()
    cfg = dataclasses.replace(m.cfg, sample_tokens=3)
    data = SuppressionData()
    x, _ = next(data.iter_eval("val", 8, 8))
    out = m.head(m.hidden(x))
    live = int(out["idx"][0, 0, 0])
    r = prism.suppression(m, data, cfg, [live], ["abc"], contextlib.nullcontext())
    assert r["fired_val"] == int(((out["idx"] == live) & (out["a"] > 0)).sum()) > 0 and not r["no_effect"]
    assert r["ppl_tokens"] == 32 and 0 <= r["generations_changed"] <= r["generations"] == 16
    assert prism.suppression_effect(r).startswith(f"the suppressed prototypes fired {r['fired_val']:,} times over "
                                                  "the 32 val tokens and changed ")
    with torch.no_grad():
        m.P[live] = 0  # a prototype that cannot fire
    r = prism.suppression(m, data, cfg, [live], ["abc"], contextlib.nullcontext())
    assert r["fired_val"] == 0 and r["generations_changed"] == 0 and r["no_effect"]
    assert r["ppl_before"] == r["ppl_after"] and r["rate_before"] == r["rate_after"]
    assert prism.suppression_effect(r) == ("no effect: the suppressed prototypes fired 0 times over the 32 val tokens "
                                           "and changed 0 of the 16 generations")


def test_report_says_its_units_and_resolved_settings(tmp_path):
    """Every figure in the report with its unit and definition: the resolved preset and device, the evaluation
    columns, the decomposition's prompt rows, the attribution's mean, the suppression's units and no-op, the
    controllers' accuracies in %, and the samples' pairing."""
    cfg = Config(n_protos=24, eval_iters=2, batch_size=4, ctx=32, eval_interval=15, seed=7)
    ev = {"step": 15, "ce": 5.0, "r_over_z": 0.5, "rec": 0.3, "r1": 0.1, "r2": 0.2, "nnz": 3.5, "used": 20,
          "cover_r1": {t: 0.5 for t in prism.TAUS}, "cover_r2": {t: 0.5 for t in prism.TAUS}}
    histories = {"prism": {"train": [[10, 6.0]], "val": [5.0, 4.0], "step": [15, 30],
                           "evals": [{"step": 15, "ce": 5.0, "used": None}, {**ev, "step": 30}]}}
    row = {"token": "\n", "logit": 1.0, "residual": 0.5, "prototypes": [(3, 0.5)], "other": (0, 0.0)}
    results = {
        "preset": "cpu", "device": "cpu",
        "decomposition": {"rows": [{**row, "prompt": True}, {**row, "token": " lord", "prompt": False}],
                          "max_abs_error": 1e-7},
        "attribution": {"summary": "s", "table": [{"method": "PRISM cached (block)", "sequences scored": 255.9,
                                                   "sequences scored (min)": 255}]},
        "suppression": [{"keywords": ["love"], "prototypes": [3], "fraction": 1 / 24, "factor": 0.0,
                         "generations": 16, "generations_changed": 0, "rate_before": 2.5, "rate_after": 2.5,
                         "ppl_before": 90.0, "ppl_after": 90.0, "ppl_change": 0.0, "ppl_tokens": 8192, "fired_val": 0,
                         "no_effect": True, "example": {"prompt": "ROMEO:\n", "before": "a", "after": "a"}}],
        "controller": {"summary": "40.0% -> 40.2% (+0.17 points)",
                       "table": [{"model/controller": "PRISM", "acc before": 0.4, "acc after": 0.401667,
                                  "gain (points)": 0.1667}]},
        "samples": {"dense": ["HAMLET:\nx"], "prism": ["HAMLET:\ny"]}}
    html = prism.write_report(tmp_path, cfg, results, histories).read_text()
    assert "preset auto → cpu, device auto → cpu" in html and html.count("<td>auto → cpu</td>") == 2
    assert "<th>val CE (2 batches)</th>" in html and "<th>used (of K=24, since the last eval)</th>" in html
    assert "over 2 random val batches of 4 × 32 tokens (256 tokens" in html and "in the 15 training steps" in html
    evals = html.split("<h3>PRISM evaluations</h3>")[1].split("</table>")[0]
    assert "<td>None</td>" not in evals and "<td>20</td>" in evals  # no prototypes yet at the first: a blank cell
    assert "Logit decomposition of a prompt and its generated continuation" in html
    assert "the rows marked prompt (1 of 2, first) are the prompt's tokens" in html
    assert "<td>&#x27;\\n&#x27;</td><td>prompt</td>" in html and "<td>&#x27; lord&#x27;</td><td>generated</td>" in html
    assert "<th>sequences scored (mean per query)</th>" in html and "<th>sequences scored (min)</th>" in html
    assert "<th>share of the bank</th>" in html and "<td>4.17%</td>" in html
    assert "<th>keyword rate before (per 1k words)</th>" in html and "<h2>Suppression (love)</h2>" in html
    assert "<th>val ppl before (first 8,192 val tokens)</th>" in html  # a subset of the Validation table's split
    assert "no effect: the suppressed prototypes fired 0 times over the 8,192 val tokens" in html
    # --suppress IDS whose signatures hold no word: no rate was measured, so none is shown (not a measured 0)
    no_kw = {**results["suppression"][0], "keywords": [], "prototypes": [3, 5], "rate_before": 0.0, "rate_after": 0.0}
    html_ids = prism.write_report(tmp_path, cfg, {"suppression": [no_kw]}, {}).read_text()
    assert "<h2>Suppression (prototypes 3, 5; no keyword rate)</h2>" in html_ids
    assert html_ids.count("<td>—</td>") == 2 and "<td>0.0</td>" not in html_ids
    assert "The first generation, from the prompt &#x27;ROMEO:\\n&#x27; (its continuation only)" in html
    assert "<td>40.0%</td><td>40.2%</td><td>+0.17</td>" in html and "<td>0.4</td>" not in html
    assert "same prompt and generator seed (7) for each head: a paired comparison" in html


# ---------------------------------------------------------------- training and the command line

def tiny_cfg(tmp_path, cache_dir, **kw):
    base = dict(layers=1, d_model=32, heads=2, n_protos=16, topk=4, ctx=32, batch_size=4, max_iters=20,
                init_steps=5, eval_interval=10, eval_iters=2, log_interval=5, out_dir=str(tmp_path),
                cache_dir=str(cache_dir), kernels="torch", dropout=0.1)
    return Config(**{**base, **kw})


DIST = dict(ddp=False, rank=0, local_rank=0, world=1)


@pytest.mark.parametrize("revive,push", [(False, 0), (True, 0), (False, 5)])
def test_resume_is_bit_exact_on_cpu(tmp_path, cache_dir, monkeypatch, revive, push):
    """Across the k-means++ seeding (step 5) and a checkpoint at step 10 (with --revive-dead, after a revival; with
    --push-interval 5, before the push of step 10, which the resumed run must redo)."""
    dev, auto = torch.device("cpu"), torch.autocast("cpu", enabled=False)

    def fresh_data():
        return common.load_data(cache_dir=cache_dir, seed=3)
    lines = []
    straight, hist_a = prism.train(tiny_cfg(tmp_path / "a", cache_dir, revive_dead=revive, push_interval=push),
                                   fresh_data(), dev, auto, DIST, log=lines.append)
    pushes = [ln.split(":")[0] for ln in lines if "prototypes pushed onto their nearest tokens" in ln]
    assert pushes == (["step 10", "step 15"] if push else [])  # not at the seeding step 5
    real_save = prism.save_checkpoint

    def save_and_keep(path, *a, **k):  # keep a copy of the step-10 checkpoint
        real_save(path, *a, **k)
        if a[3] == 10:
            (tmp_path / "b10").mkdir()
            shutil.copy(path, tmp_path / "b10" / path.name)
    monkeypatch.setattr(prism, "save_checkpoint", save_and_keep)
    lines = []  # the cut run trains in the straight run's folder: a fresh run says it replaces the checkpoint there
    prism.train(tiny_cfg(tmp_path / "a", cache_dir, revive_dead=revive, push_interval=push), fresh_data(), dev, auto,
                DIST, log=lines.append)
    assert [ln for ln in lines if ln.startswith("note:")] == [f"note: {tmp_path / 'a' / 'ckpt-prism.pt'} exists; this run trains from step 0 and replaces it (--resume continues it instead)"]
    monkeypatch.setattr(prism, "save_checkpoint", real_save)
    lines = []
    resumed, hist = prism.train(tiny_cfg(tmp_path / "b10", cache_dir, resume=True, revive_dead=revive,
                                         push_interval=push), fresh_data(), dev, auto, DIST, log=lines.append)
    assert not any(ln.startswith("note:") for ln in lines)  # nothing changed: no warning that it will differ
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert hist["step"] == [10, 20] and hist["val"] == hist_a["val"]
    assert hist["evals"][-1]["used"] is not None and "cover_r1" in hist["evals"][-1]
    assert 0 < hist["evals"][-1]["nnz"] <= 4  # spec §7: non-zero activations per token, at most k
    assert ("revived" in hist["evals"][0]) == revive


def stepped_model():
    """A tiny float32 PRISM after one AdamW step (so P has non-zero moments), its optimizer and the batch."""
    m = tiny_model().float()
    opt = prism.make_optimizer(m, m.cfg, "cpu")
    x, y = batch(4, 8)
    loss, _ = m(x, y)
    loss.backward()
    opt.step()
    return m, opt, x


def test_revive_dead_reseeds_only_the_dead_and_resets_their_moments():
    m, opt, x = stepped_model()
    usage = torch.ones(12, dtype=torch.int32)
    usage[[2, 7]] = 0
    before = m.P.detach().clone()
    n = prism.revive_dead(m, opt, usage, x, m.cfg, 5, DIST)
    assert n == 2
    assert torch.equal(m.P[usage > 0], before[usage > 0]) and not torch.equal(m.P[[2, 7]], before[[2, 7]])
    z = m.hidden(x).detach().reshape(-1, 16)
    cos = F.normalize(m.P[[2, 7]], dim=-1) @ F.normalize(z, dim=-1).T
    assert (cos.max(1).values > 1 - 1e-5).all()  # each revived prototype is a (scaled) hidden state
    st = opt.state[m.P]
    assert st["exp_avg"][[2, 7]].abs().sum() == 0 and st["exp_avg"][usage > 0].abs().sum() > 0
    assert prism.revive_dead(m, opt, torch.ones(12, dtype=torch.int32), x, m.cfg, 5, DIST) == 0


def test_push_turns_each_prototype_onto_its_nearest_token():
    """--push-interval (spec §9.5): each prototype takes the direction of its nearest token (by cosine) in the batch
    and keeps its norm; Adam's moments of P restart at 0."""
    m, opt, x = stepped_model()
    before = m.P.detach().clone()
    z = m.eval().hidden(x).detach().reshape(-1, 16)
    m.train()
    near = (F.normalize(before, dim=-1) @ F.normalize(z, dim=-1).T).max(1)
    cos = prism.push_prototypes(m, opt, x, DIST)
    assert cos == pytest.approx(near.values.mean().item(), abs=1e-6) and cos < 0.99
    torch.testing.assert_close(m.P.norm(dim=-1), before.norm(dim=-1))
    torch.testing.assert_close(F.normalize(m.P, dim=-1), F.normalize(z[near.indices], dim=-1))
    st = opt.state[m.P]
    assert st["exp_avg"].abs().sum() == 0 and st["exp_avg_sq"].abs().sum() == 0


def test_suppression_ids_and_keywords_are_parsed_once_each():
    assert prism.parse_ids("3,3, 1", 8) == [1, 3]  # a repeated id is one prototype, and counts as one
    assert prism.keywords_of(" Love, crown's ") == ["love", "crown's"]


def test_a_checkpoint_renamed_to_the_other_head_is_refused(tmp_path):
    cfg = prism.Config(out_dir=str(tmp_path), layers=1, d_model=16, heads=2, n_protos=8, topk=2)
    save_envelope(tmp_path / "ckpt-prism.pt", "prism", dataclasses.asdict(dataclasses.replace(cfg, head="dense")))
    with pytest.raises(prism.RunError, match="holds a --head dense model, not prism"):
        prism.load_checkpoint(tmp_path / "ckpt-prism.pt", cfg)


def test_match_keywords_needs_the_card_to_be_about_the_word():
    def ctx(tok, nxt):
        return {"token": tok, "next": nxt, "a": 1.0, "before": ""}
    cards = [{"proto": 0, "uses": 3, "signature": [" lord", "a", "b"], "contexts": []},
             {"proto": 1, "uses": 2, "signature": ["a", "b", "c", " lord"], "contexts": [ctx(" my", " Lord"), ctx(" x", " y")]},
             {"proto": 2, "uses": 3, "signature": ["a", "b", "c", " lord"], "contexts": [ctx(" x", " y"), ctx(" x", " y"), ctx(" lord", ",")]},
             {"proto": 3, "uses": 0, "signature": [" lord", " king", "b"], "contexts": []}]  # dead: never fires
    assert prism.match_keywords(cards, ["lord"]) == [0, 1]
    assert prism.match_keywords(cards, ["lord"], sig_top=4) == [0, 1, 2]
    assert prism.match_keywords(cards, ["king"]) == []
    # auto: the 4+ letter word the live cards are about, weighted by uses: "lord" (cards 0 and 1: 3 + 2 uses)
    # beats "king" (only the dead card) and the short "my", "x", "y"
    assert prism.auto_keyword(cards) == ["lord"]
    assert prism.auto_keyword([cards[3]]) == [] and prism.auto_keyword(cards[2:3]) == []
    # with generations: the candidate the model generates most wins over the card score ("lord" is a candidate,
    # "king" is not: only the dead card is about it)
    cards[1]["signature"] = ["a", "b", " good"]
    assert prism.auto_keyword(cards) == ["lord"]
    assert prism.auto_keyword(cards, ["good king, good morrow", "my lord"]) == ["good"]
    assert prism.auto_keyword(cards, ["king king king"]) == ["lord"]  # no candidate generated: the card score


def test_gap_needs_a_twin_trained_with_the_same_recipe(tmp_path):
    """--no-twin reads the twin's history from its checkpoint; a twin of another recipe gives no gap (and says
    why) rather than a gap at equal step numbers between two different schedules."""
    cfg = prism.Config(out_dir=str(tmp_path), head="prism")
    hist = {**{k: [] for k in prism.HISTORY_KEYS}, "step": [5], "val": [6.0], "evals": [{"ce": 6.0}]}

    def twin(**kw):
        save_envelope(tmp_path / "ckpt-dense.pt", "prism",
                      dataclasses.asdict(dataclasses.replace(cfg, head="dense", **kw)), hist)
    twin(n_protos=7, topk=4)
    assert prism.twin_history(cfg, {}) == hist  # prototype settings do not matter to the twin
    twin(lr=1.0)
    lines = []
    assert prism.twin_history(cfg, {}, lines.append) is None
    assert "gap to dense: not computed" in lines[0] and f"lr=1.0, here {cfg.lr}" in lines[0]
    torch.save({"foo": 1}, tmp_path / "ckpt-dense.pt")  # not a checkpoint: no gap, a line that says why
    assert prism.twin_history(cfg, {}, lines.append) is None and "ckpt-dense.pt is not a prism.py checkpoint" in lines[1]


def test_twin_and_prism_train_on_the_same_batches(tmp_path, cache_dir):
    """Before the seeding PRISM trains exactly like its twin (same init, same batches, P at zero weight), so
    the two histories agree until then: the per-evaluation gap compares like with like."""
    dev, auto = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    data = common.load_data(cache_dir=cache_dir, seed=3)
    start = data.rng_state()
    kw = dict(max_iters=12, init_steps=11, eval_interval=10, log_interval=2, dropout=0.1)
    _, twin = prism.train(tiny_cfg(tmp_path, cache_dir, head="dense", **kw), data, dev, auto, DIST,
                          log=lambda m: None, start_rng=start)
    _, proto = prism.train(tiny_cfg(tmp_path, cache_dir, **kw), data, dev, auto, DIST, log=lambda m: None,
                           twin=twin, start_rng=start)
    assert proto["train"][:5] == twin["train"][:5] and proto["val"][0] == twin["val"][0]


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, cache_dir, monkeypatch):
    real_forward, calls = PRISM.forward, []

    def forward(self, idx, targets=None):
        out = real_forward(self, idx, targets)
        if targets is not None and self.training:
            calls.append(1)
            if len(calls) > 12:
                return out[0] * float("nan"), out[1]
        return out
    monkeypatch.setattr(PRISM, "forward", forward)
    cfg = tiny_cfg(tmp_path, cache_dir)
    with pytest.raises(prism.RunError, match="non-finite loss before step 15 \\(or non-finite weights\\); stopping \\(the last good checkpoint is"):
        prism.train(cfg, common.load_data(cache_dir=cache_dir), torch.device("cpu"),
                    torch.autocast("cpu", enabled=False), DIST, log=lambda m: None)
    ck = torch.load(prism.ckpt_path(cfg), weights_only=True)
    assert ck["step"] == 10 and all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())


def test_tiny_run_end_to_end(tmp_path, cache_dir, capsys, monkeypatch):
    """The issue's tiny run: falling loss, checkpoints of PRISM and its twin, the report, the attribution and
    suppression tables."""
    r = run_script("prism.py", *TINY, "--suppress", "0,1", "--suppress-keywords", "auto", "--out-dir", str(tmp_path),
                   "--cache-dir", str(cache_dir))  # both suppressions: the ids, and the auto keyword (typed)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "no GPU: running the CPU preset" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("step ") and "| loss" in ln]
    assert len(lines) == 6  # 3 log lines for the twin, 3 for PRISM
    # the preset's attribution windows (128 tokens) are longer than this --ctx: clipped, said, and the config
    # line shows the length used
    assert "note: the CPU preset's --attr-ctx 128 is longer than --ctx 32: the attribution windows are 32 tokens" in out
    assert '"attr_ctx": 32' in next(ln for ln in out.splitlines() if ln.startswith("config: "))
    dense_losses = [float(ln.split("| loss ")[1].split()[0]) for ln in lines[:3]]
    assert dense_losses[-1] < dense_losses[0] - 0.5
    assert " ms | " in lines[0] and "tok/s | mfu -" in lines[0]
    assert "prototypes seeded by k-means++" in out and "gap to dense" in out and "|r|/|z|" in out
    assert "| non-zero a " in out and "/4 | cover" in out  # spec §7: mean non-zero activations per token, of k
    for f in ("ckpt-prism.pt", "ckpt-dense.pt", "report.html", "prototypes.html", "prototypes.json", "results.json"):
        assert (tmp_path / f).is_file(), f
    res = json.loads((tmp_path / "results.json").read_text())
    assert set(res["ppl"]) == {"dense", "prism"} and "gap" in res
    assert (res["preset"], res["device"], res["dtype"]) == ("cpu", "cpu", "float32")  # what auto resolved to
    assert res["decomposition"]["max_abs_error"] < 1e-3
    assert [r["method"] for r in res["attribution"]["table"]][:2] == ["PRISM cached (block)", "prototype-space exact"]
    assert len(res["controller"]["table"]) == 2
    sup = res["suppression"][0]  # by id; then by the auto keyword, when a live card is about a 4+ letter word
    assert sup["prototypes"] == [0, 1] and sup["keywords"] and "rate_after" in sup and "ppl_change" in sup
    if len(res["suppression"]) == 2:
        word = out.split("suppression: auto keyword '")[1].split("'")[0]
        assert res["suppression"][1]["keywords"] == [word]
        live = {c["proto"] for c in json.loads((tmp_path / "prototypes.json").read_text())["cards"] if c["uses"]}
        assert set(res["suppression"][1]["prototypes"]) <= live  # never a dead prototype
    else:
        assert "no live prototype card is about a word of 4+ letters" in out
    report = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64" in report and "Suppression" in report
    assert "preset auto → cpu, device auto → cpu" in report  # the header and the configuration, resolved
    assert "samples: the same prompt and generator seed (1337) for each head, a paired comparison" in out
    assert " prompt, " in out.split("logit decomposition of ")[1].split("\n")[0]
    assert all({"fired_val", "generations_changed", "no_effect"} <= set(s) for s in res["suppression"])
    assert "the suppressed prototypes fired " in out

    # analyses on the saved checkpoints, without training; then a mismatched architecture
    cards = (tmp_path / "prototypes.json").read_text()
    temperatures, generate = [], prism.PRISM.generate  # --temperature reaches the samples and suppression's texts

    def spy(self, idx, new_tokens, temperature=0.8, top_k=40, generator=None, **head_kw):
        temperatures.append(temperature)
        return generate(self, idx, new_tokens, temperature, top_k, generator, **head_kw)
    monkeypatch.setattr(prism.PRISM, "generate", spy)
    short = ["--sample-tokens", "12", "--card-windows", "16"]  # the training run's, not the defaults' 100 and 512
    r = run_main(prism.main, ["--no-train", "--suppress", "0,1", "--no-attribution", "--no-controller",
                              "--sample", "KING:", "--temperature", "0.5", *short,
                              "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(temperatures) > 2 and set(temperatures) == {0.5}
    assert "suppression of 2 prototypes" in r.stdout and "auto keyword" not in r.stdout  # the ids typed, alone
    assert (tmp_path / "analysis-prototypes.html").is_file() and (tmp_path / "prototypes.json").read_text() == cards
    # the auto keyword is chosen on generations of its own: chosen on the "before" texts, its rate there would be
    # inflated and any edit would seem to lower it
    draws, chosen_on = [], []
    generations, auto_keyword = prism.suppression_generations, prism.auto_keyword
    monkeypatch.setattr(prism, "suppression_generations", lambda model, data, cfg, head_kw, samples_per_prompt=2,
                        seed_offset=0: draws.append((seed_offset, bool(head_kw), generations(
                            model, data, cfg, head_kw, samples_per_prompt, seed_offset=seed_offset))) or draws[-1][2])
    monkeypatch.setattr(prism, "auto_keyword", lambda cards, generated: chosen_on.append(generated) or auto_keyword(
        cards, generated))
    r = run_main(prism.main, ["--no-train", "--suppress", "0,1", "--suppress-keywords", "auto", "--no-attribution",
                              "--no-controller", "--no-report", *short, "--out-dir", str(tmp_path), "--cache-dir",
                              str(cache_dir)], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-3000:]
    unsuppressed = [(offset, texts) for offset, edited, texts in draws if not edited]
    assert [offset for offset, _ in unsuppressed] == [prism.SELECTION_SEED_OFFSET, 0]  # "before" made once, shared
    assert chosen_on == [unsuppressed[0][1]] and unsuppressed[0][1] != unsuppressed[1][1]
    assert sum(edited for _, edited, _ in draws) == len(json.loads((tmp_path / "analysis.json").read_text())["suppression"])
    assert all(offset == 0 for offset, edited, _ in draws if edited)  # "after" on the seeds of "before"
    rc, err = call_main(prism.main, ["--no-train", "--layers", "3", "--out-dir", str(tmp_path), "--cache-dir",
                                     str(cache_dir)], capsys, monkeypatch)
    assert rc == 1 and err.count("\n") == 1
    assert "was trained with layers=1 (asked 3); drop those flags or use another --out-dir" in err
    rc, err = call_main(prism.main, ["--no-train", "--n-protos", "48", "--out-dir", str(tmp_path), "--cache-dir",
                                     str(cache_dir)], capsys, monkeypatch)  # PRISM's file, not the twin's, is named
    assert rc == 1 and "ckpt-prism.pt was trained with n_protos=24 (asked 48)" in err, err


def test_resume_from_the_command_line(tmp_path, cache_dir, capsys, monkeypatch):
    """--resume takes the run's own settings from the checkpoint (not the preset's), continues a run stopped
    while the twin was training, and extends a finished one when --max-iters is raised."""
    args = ["--layers", "1", "--d-model", "32", "--heads", "2", "--n-protos", "16", "--topk", "4", "--ctx", "32",
            "--batch-size", "4", "--eval-interval", "5", "--eval-iters", "1", "--log-interval", "5", "--init-steps", "3",
            "--no-cards", "--no-attribution", "--no-controller", "--suppress-keywords", "", "--no-report",
            "--sample-tokens", "4", *SMALL_CORPUS, "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)]
    # as if stopped after the twin
    r = run_main(prism.main, [*args, "--head", "dense", "--max-iters", "10"], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_main(prism.main, ["--resume", "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir), "--no-cards",
                              "--no-attribution", "--no-controller", "--suppress-keywords", "", "--no-report"],
                 capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resumed from" in r.stdout and "ckpt-dense.pt at step 10" in r.stdout
    assert "prism: no checkpoint at" in r.stdout and "training it from step 0" in r.stdout
    ck = torch.load(tmp_path / "ckpt-prism.pt", weights_only=True)
    assert ck["step"] == 10 and ck["config"]["batch_size"] == 4 and ck["config"]["max_iters"] == 10
    r = run_main(prism.main, ["--resume", "--max-iters", "15", "--out-dir", str(tmp_path), "--cache-dir",
                              str(cache_dir), "--no-cards", "--no-attribution", "--no-controller",
                              "--suppress-keywords", "", "--no-report"], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-2000:]
    assert torch.load(tmp_path / "ckpt-prism.pt", weights_only=True)["step"] == 15
    assert "ckpt-prism.pt at step 10" in r.stdout
    assert "note: resuming with max_iters 10 -> 15: the first 10 steps followed the checkpoint's settings" in r.stdout
    assert "val loss PRISM" in r.stdout  # one recipe: the final gap is given
    # a --max-iters below the checkpoints' step would train nothing and report a config not the models'
    rc, err = call_main(prism.main, ["--resume", "--max-iters", "12", "--out-dir", str(tmp_path), "--cache-dir",
                                     str(cache_dir)], capsys, monkeypatch)
    assert rc == 1 and err.count("\n") == 1 and "ckpt-prism.pt is at step 15, past --max-iters 12" in err, err
    # a twin trained apart with another recipe: --no-train gives no final gap, and says why
    rc, err = call_main(prism.main, [*args, "--head", "dense", "--max-iters", "5"], capsys, monkeypatch)
    assert rc == 0, err
    rc, err = call_main(prism.main, ["--no-train", "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir),
                                     "--no-cards", "--no-attribution", "--no-controller", "--suppress-keywords", "",
                                     "--no-report"], capsys, monkeypatch)
    assert rc == 0, err
    assert "gap" not in json.loads((tmp_path / "analysis.json").read_text())
    assert "gap to the dense twin not computed: PRISM and the dense twin were trained with other recipes (max_iters " \
        "15 vs 5, step 15 vs 5)" in (tmp_path / "log-prism.txt").read_text()
    # both heads resume with the asked head's settings: a twin extended apart past PRISM's --max-iters is an error
    # too, not a twin "trained for" 15 steps beside PRISM
    rc, err = call_main(prism.main, ["--resume", "--head", "dense", "--max-iters", "20", "--out-dir", str(tmp_path),
                                     "--cache-dir", str(cache_dir), "--no-report"], capsys, monkeypatch)
    assert rc == 0, err
    rc, err = call_main(prism.main, ["--resume", "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)], capsys,
                        monkeypatch)
    assert rc == 1 and err.count("\n") == 1 and "ckpt-dense.pt is at step 20, past --max-iters 15" in err, err


def test_resume_checks_the_seeding_of_a_prism_that_starts_from_step_0(tmp_path, cache_dir, capsys, monkeypatch):
    """A twin trained with a K too large for one batch: --resume resumes it, but PRISM would start from step 0
    and could not seed K prototypes. One line before anything trains, not a traceback after the twin."""
    args = ["--layers", "1", "--d-model", "16", "--heads", "2", "--ctx", "16", "--batch-size", "2", "--n-protos",
            "100", "--init-steps", "1", "--eval-iters", "1", "--no-report", "--sample-tokens", "2", *SMALL_CORPUS,
            "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)]
    rc, err = call_main(prism.main, [*args, "--head", "dense", "--max-iters", "2"], capsys, monkeypatch)
    assert rc == 0, err
    rc, err = call_main(prism.main, ["--resume", "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)], capsys,
                        monkeypatch)
    assert rc == 1 and "k-means++ seeding draws K=100 prototypes from one batch of 32 tokens" in err, err
    assert err.count("\n") == 1


@pytest.mark.parametrize("args,code,needle", [
    (["--head", "sparse"], 2, "invalid choice: 'sparse'"),
    (["--resid-grad", "none"], 2, "invalid choice: 'none'"),
    (["--layerz", "6"], 2, "unrecognized arguments: --layerz"),
    (["--layers", "0"], 1, "error: --layers must be in [1, 1024]"),
    (["--layers", "10000000000000"], 1, "error: --layers must be in [1, 1024]"),
    (["--lr", "1e39"], 1, "--lr must be a finite number of at most 3.4e+38 (float32)"),
    (["--lr", "3e38"], 1, "--lr must be at most 3.4e+37 (Adam's first step, 10·lr, must fit float32)"),
    (["--bench", "--resume"], 1, "--bench times the model and its kernels on random data, with no checkpoint"),
    (["--bench", "--no-train"], 1, "drop --resume and --no-train"),
    (["--weight-decay", "1e300"], 1, "--weight-decay must be a finite number of at most 3.4e+38"),
    (["--out-dir", ""], 1, "--out-dir is empty (. names the current folder)"),
    (["--d-model", "30", "--heads", "4"], 1, "must split into --heads 4 heads"),
    (["--topk", "0"], 1, "--topk must be in [1, --n-protos]"),
    (["--n-protos", "100000"], 1, "k-means++ seeding draws K=100000 prototypes from one batch"),
    (["--init-steps", "400"], 1, "--init-steps 400 leaves no step for the prototypes"),
    (["--suppress", "x"], 1, "--suppress 'x': expected prototype ids"),
    (["--suppress", "999999"], 1, "ids must be in [0, 512)"),
    (["--suppress", "3,,17"], 1, "--suppress '3,,17': expected prototype ids"),  # as protot's --intervene 1:1,
    (["--no-train"], 1, "error: no checkpoint at"),
    (["--no-train", "--resume"], 1, "--resume continues training and --no-train trains nothing; give one"),
    (["--device", "tpu"], 1, "--device tpu: expected auto, cpu, cuda, cuda:N or mps"),
    (["--dataset", "tinystories"], 1, "needs the Hugging Face hub, which is unreachable"),
    (["--kernels", "triton"], 1, "--kernels triton needs a CUDA device"),
    (["--attr-damping", "0"], 1, "--attr-damping must be in (0, 1e6]"),
    (["--attr-damping", "1e308"], 1, "--attr-damping must be in (0, 1e6]"),
    (["--attr-retrain", "-1"], 1, "--attr-retrain must be >= 0 (0: off)"),
    (["--attr-retrain-k", "0"], 1, "--attr-retrain-k must be >= 1"),
    (["--attr-retrain-epochs", "1001"], 1, "--attr-retrain-epochs must be in [1, 1000]"),
    (["--attr-retrain-lr", "0"], 1, "--attr-retrain-lr must be in (0, 1e3]"),
    (["--attr-retrain-batch", "-1"], 1, "--attr-retrain-batch must be >= 0 (0: the training --batch-size)"),
    (["--attr-retrain", "2", "--attr-seqs", "10", "--attr-retrain-k", "10"], 1,
     "--attr-retrain-k must be below --attr-seqs (the check trains on the windows not left out)"),
    (["--suppress-factor", "nan"], 1, "--suppress-factor must be in [-100, 100]"),
    (["--suppress-factor", "1e30"], 1, "--suppress-factor must be in [-100, 100]"),
    (["--heads", "0"], 1, "error: --heads must be >= 1"),
    (["--d-model", "0"], 1, "error: --d-model must be >= 1"),
    (["--suppress-keywords", ","], 1, "--suppress-keywords ',': expected words"),
    (["--suppress-keywords", "love,:"], 1, "--suppress-keywords 'love,:': expected words"),
    (["--suppress-keywords", "love,,crown"], 1, "--suppress-keywords 'love,,crown': expected words"),
    (["--head", "dense", "--attribution"], 1, "--attribution is a prototype analysis: it needs --head prism"),
    (["--head", "dense", "--suppress-keywords", "love"], 1, "--suppress-keywords is a prototype analysis"),
    (["--suppress-factor", "nan"], 1, "--suppress-factor must be in [-100, 100]"),
    (["--suppress-factor", "1e30"], 1, "--suppress-factor must be in [-100, 100]"),
    (["--device", "meta"], 1, "--device meta: expected auto, cpu, cuda, cuda:N or mps"),  # torch.device takes it
    (["--seed", "99999999999999999999999"], 2, "argument --seed: invalid int value: '99999999999999999999999' (past 64 bits)"),
    (["--seed", "9223372036854775807"], 1, "--seed must be in [0, 2**32)"),
    (["--temperature", "-1"], 1, "--temperature must be >= 0 (0: greedy)"),
    (["--temperature", "inf"], 1, "must be a finite number"),
    (["--out-dir", "/dev/null/x"], 1, "--out-dir /dev/null/x: cannot write there"),
    (["--ctx", "20000", *SMALL_CORPUS], 1, "--ctx 20000: the val split has 10,000 tokens, fewer than ctx + 1"),
])
def test_bad_input_is_one_line_and_nonzero(tmp_path, cache_dir, args, code, needle, capsys, monkeypatch):
    """In-process main() (what `python prism.py ...` runs), offline and without the tests' Triton interpreter;
    the subprocess form of the same path is covered by test_corrupt_checkpoint_is_one_line."""
    out = [] if "--out-dir" in args else ["--out-dir", str(tmp_path)]
    rc, err = call_main(prism.main, [*args, *out, "--cache-dir", str(cache_dir)], capsys, monkeypatch)
    assert rc == code and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("preset,cuda,needle", [
    ("cpu", True, "running the CPU preset (--preset cpu) ("),  # asked for: on a GPU machine it must not say "no GPU"
    ("auto", False, "no GPU: running the CPU preset ("),
])
def test_cpu_preset_message_says_why(tmp_path, capsys, monkeypatch, preset, cuda, needle):
    import common as c

    def stop(*a, **k):
        raise c.DataError("stop here")
    monkeypatch.setattr(c, "load_data", stop)  # the message comes before the data; stop there
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    rc = prism.main(["--preset", preset, "--device", "cpu", "--out-dir", str(tmp_path)])
    out = capsys.readouterr()
    assert rc == 1 and "stop here" in out.err
    assert needle in out.out and ("no GPU" in out.out) == (not cuda)


def test_corrupt_checkpoint_is_one_line(tmp_path, cache_dir, capsys, monkeypatch):
    (tmp_path / "ckpt-prism.pt").write_bytes(b"not a checkpoint")
    rc, err = call_main(prism.main, ["--no-train", "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)], capsys,
                        monkeypatch)
    assert rc == 1 and "is not a readable checkpoint" in err and err.count("\n") == 1


@pytest.mark.slow
def test_ddp_two_cpu_processes_match_one(tmp_path, cache_dir):
    """torchrun with 2 gloo processes: each rank takes half of the global batch; P is seeded by k-means++ on rank 0
    from every rank's states and broadcast, so the seeded bank is the single process's (without the broadcast rank
    1 would keep its unseeded P and the weights would part). R1 and R2 are batch-local (their nearest neighbours are per
    rank), so the equality is checked with λ1 = λ2 = 0; then a seeded run with R1 on must simply work."""
    args = ["--layers", "1", "--d-model", "32", "--heads", "2", "--n-protos", "16", "--topk", "4", "--ctx", "32",
            "--batch-size", "8", "--max-iters", "6", "--init-steps", "2", "--eval-interval", "3", "--eval-iters", "2",
            "--log-interval", "3", "--lambda-r1", "0", "--lambda-r2", "0", "--no-twin", "--no-cards",
            "--no-attribution", "--no-controller", "--suppress-keywords", "", "--no-report", "--sample-tokens", "5",
            *SMALL_CORPUS, "--cache-dir", str(cache_dir)]
    common.load_data(max_tokens=int(SMALL_CORPUS[1]), cache_dir=cache_dir)  # the cache exists before the ranks start
    a, b = run_one_and_ddp("prism.py", [*args, "--init", "kmeans++"], tmp_path, "ckpt-prism.pt")
    torch.testing.assert_close(a["history"]["val"], b["history"]["val"], rtol=1e-5, atol=0)
    # the logged training loss is the global batch's, averaged over the ranks, not rank 0's half
    torch.testing.assert_close(a["history"]["train"], b["history"]["train"], rtol=1e-5, atol=0)
    check_ddp_weights(a["model"], b["model"], a["config"]["lr"])
    # every evaluation figure is reduced over the ranks to the global batch's (not rank 0's half): per-token means
    # averaged, R1's per-prototype minima and R̄1's best cosines min/max-reduced, R2's coverage counts summed
    for ea, eb in zip(a["history"]["evals"], b["history"]["evals"], strict=True):
        for key in ("r_over_z", "rec", "r1", "r2", "nnz"):
            assert eb[key] == pytest.approx(ea[key], rel=1e-4), (ea["step"], key, ea[key], eb[key])
        for key in ("cover_r1", "cover_r2"):
            assert eb[key] == pytest.approx(ea[key], abs=1e-6), (ea["step"], key, ea[key], eb[key])
    seeded = run_script("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "prism.py", *args,
                        "--lambda-r1", "0.1", "--out-dir", str(tmp_path / "seeded"), env={"OMP_NUM_THREADS": "1"})
    assert seeded.returncode == 0 and "prototypes seeded by k-means++" in seeded.stdout, seeded.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.slow  # .ci/gpu runs these last, with the time the benchmarks leave
def test_cuda_tiny_run_and_resume(tmp_path, cache_dir):
    """The tiny run on a GPU (twin, PRISM with the top-k kernel, attribution, suppression, controllers), then
    --resume of both models."""
    out = check_cuda_run("prism.py", [*TINY, "--suppress", "0,1", "--cache-dir", str(cache_dir)], tmp_path,
                         ["ckpt-dense.pt", "ckpt-prism.pt"], 30, prism.peak_flops(torch.device("cuda")))
    assert "attribution PRISM cached (block)" in out and "suppression of 2 prototypes" in out


@pytest.mark.gpu
@pytest.mark.parametrize("head,precision", [("dense", "fp32"), ("prism", "fp32"), ("prism", "bf16")])
def test_cuda_training_step_never_waits_for_the_gpu(head, precision):
    """The training step with its prototype usage counter, at the paper's widths (2 layers, d = 768, K = 8192,
    k = 16, batch 4 × 1024, the Triton kernels, each --dot-precision): no wait for the GPU (check_step_never_waits)."""
    cfg = dataclasses.replace(Config(), layers=2, head=head, init="random", dropout=0.0, dot_precision=precision)
    model = PRISM(cfg, prism.BENCH_VOCAB).cuda()
    optimizer = prism.make_optimizer(model, cfg, "cuda")
    x, y = torch.randint(0, prism.BENCH_VOCAB, (2, 4, cfg.ctx), device="cuda")
    usage = torch.zeros(cfg.n_protos, dtype=torch.int32, device="cuda")

    def count_usage(stats):
        if "idx" in stats:
            usage.index_add_(0, stats["idx"].flatten(), (stats["a"] > 0).flatten().to(usage.dtype))
    assert check_step_never_waits(model, optimizer, x, y, cfg.grad_clip, count_usage)
    assert (usage.sum() > 0) == (head == "prism")

def test_triton_k_limit_applies_to_the_checkpoints_k(tmp_path, cache_dir, capsys, monkeypatch):
    """--no-train takes k from the checkpoint, so the Triton kernel's k limit is checked against it (one line, not
    the op's traceback); under the interpreter, so that the CUDA check passes."""
    rc, err = call_main(prism.main, [
        "--layers", "1", "--d-model", "16", "--heads", "2", "--n-protos", "48", "--topk", "40", "--ctx", "16",
        "--batch-size", "4", "--max-iters", "4", "--init-steps", "2", "--eval-interval", "2", "--eval-iters", "1",
        "--log-interval", "2", "--no-twin", "--no-cards", "--no-attribution", "--no-controller",
        "--suppress-keywords", "", "--sample-tokens", "2", "--no-report", "--kernels", "torch", *SMALL_CORPUS,
        "--cache-dir", str(cache_dir), "--out-dir", str(tmp_path)], capsys, monkeypatch)
    assert rc == 0, err[-2000:]
    rc, err = call_main(prism.main, ["--no-train", "--kernels", "triton", *SMALL_CORPUS, "--cache-dir", str(cache_dir),
                                     "--out-dir", str(tmp_path)], capsys, monkeypatch, env={"TRITON_INTERPRET": "1"})
    assert rc == 1 and err == ("error: --kernels triton: the top-k kernel takes --topk up to 32, not "
                                              "40; use --kernels auto (the torch form for a larger k)\n"), err


def test_unused_flags_are_noted():
    """A typed flag whose analysis does not run in this invocation gets a note naming it and why; a --no-X of an
    analysis that is off anyway gets none."""
    def notes(explicit, **kw):
        return [n.split(" has no effect")[0] for n in prism.unused_flags(Config(**kw), set(explicit))]
    assert notes({"attr_seqs", "attr_curvature", "ekfac"}, attribution=False, ekfac=True) == \
        ["note: --attr-seqs", "note: --attr-curvature", "note: --ekfac"]
    assert notes({"ekfac"}, attribution=False, ekfac=False) == []
    # the retraining check's settings need the check: --attr-retrain 0 (its default) leaves them idle
    assert notes({"attr_retrain_k", "attr_retrain_epochs", "attr_retrain_lr"}) == \
        ["note: --attr-retrain-k", "note: --attr-retrain-epochs", "note: --attr-retrain-lr"]
    assert notes({"attr_retrain_k", "attr_retrain_lr", "attr_retrain_batch"}, attr_retrain=4) == []
    assert notes({"attr_retrain_batch"}) == ["note: --attr-retrain-batch"]
    assert notes({"attr_retrain", "attr_retrain_k"}, attribution=False, attr_retrain=4) == \
        ["note: --attr-retrain", "note: --attr-retrain-k"]
    assert notes({"suppress_factor"}, suppress_keywords="") == ["note: --suppress-factor"]
    assert notes({"suppress_factor"}, suppress_keywords="", suppress="3") == []
    assert notes({"suppress_factor"}) == []  # the default auto keyword suppresses
    assert notes({"controller_l1", "card_windows"}, controller=False, cards=False, suppress_keywords="") == \
        ["note: --controller-l1", "note: --card-windows"]
    assert notes({"card_windows"}, cards=False) == []  # the auto keyword reads the cards
    assert notes({"twin", "attr_seqs"}, head="dense") == ["note: --attr-seqs", "note: --twin"]
    # the dense head has no prototypes: their settings are noted, not dropped unseen; --no-revive-dead says nothing
    assert notes({"n_protos", "topk", "lambda_rec", "init", "push_interval", "revive_dead"}, head="dense",
                 push_interval=2, revive_dead=True) == ["note: --n-protos", "note: --topk", "note: --lambda-rec",
                                                        "note: --init", "note: --revive-dead", "note: --push-interval"]
    assert notes({"revive_dead"}, head="dense") == [] and notes({"n_protos", "init"}) == []
    assert notes({"dot_precision"}, head="dense", dot_precision="bf16") == ["note: --dot-precision"]
    assert notes({"dot_precision"}, dot_precision="bf16") == []
    # a --no-train run generates for suppression (the auto keyword by default) with --sample-tokens
    assert notes({"sample_tokens"}, train=False) == []
    assert notes({"sample_tokens"}, train=False, suppress_keywords="") == ["note: --sample-tokens"]
    assert notes({"sample_tokens"}, train=False, suppress_keywords="", sample="KING:") == []
    # --temperature also samples the cards' decomposed text, which a --no-train run builds unless --no-cards
    assert notes({"temperature"}, train=False, suppress_keywords="") == []
    assert notes({"temperature"}, train=False, suppress_keywords="", cards=False) == ["note: --temperature"]
    # attribution runs under every gradient routing (full: along the prototype path, spec §2.3 A): no note
    assert notes({"attr_seqs"}, resid_grad="full") == []
    assert notes({"attr_seqs"}, resid_grad="detach-r") == []


def test_full_routing_run_attributes(tmp_path, cache_dir, capsys, monkeypatch):
    """A tiny run with --resid-grad full (asked for --attribution explicitly) attributes instead of refusing: non-zero
    scores, labelled in the log and the report as the prototype path's gradients with r held fixed (spec §2.3 A)."""
    rc, err = call_main(prism.main, [*TINY, "--max-iters", "12", "--init-steps", "4", "--eval-interval", "12",
                                     "--resid-grad", "full", "--attribution", "--no-twin", "--no-cards",
                                     "--no-controller", "--suppress-keywords", "", "--out-dir", str(tmp_path),
                                     "--cache-dir", str(cache_dir)], capsys, monkeypatch)
    assert rc == 0, err
    res = json.loads((tmp_path / "results.json").read_text())
    att = res["attribution"]
    assert att["gradients"] == "prototype path, r held fixed (spec §2.3 A)"
    assert any(e["score"] != 0 for e in att["examples"]["top"])
    label = "; gradients: prototype path, r held fixed (spec §2.3 A))"
    assert label in (tmp_path / "log-prism.txt").read_text()
    assert label in (tmp_path / "report.html").read_text()
    assert "--attr-seqs has no effect" not in (tmp_path / "log-prism.txt").read_text()  # TINY types it: used
    # the docstring's keyword suppression on the saved checkpoint runs the suppression alone: no attribution or
    # controller (the cards are built, the keywords match against them)
    rc, err = call_main(prism.main, ["--no-train", "--suppress-keywords", "love,heart", "--no-attribution",
                                     "--no-controller", "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)],
                        capsys, monkeypatch)
    assert rc == 0, err
    res = json.loads((tmp_path / "analysis.json").read_text())
    assert "attribution" not in res and "controller" not in res
    log = (tmp_path / "log-prism.txt").read_text()  # the training run above suppressed nothing
    assert "suppression of " in log or "no live prototype card matches love, heart" in log, log[-2000:]
    # trained with --no-twin, so no ckpt-dense.pt: the --no-train run (twin on by default) says what it skips
    assert log.count(f"note: no dense twin at {tmp_path / 'ckpt-dense.pt'}: the val loss gap and the SAE") == 1


def test_resume_note_counts_the_seeding_settings_only_before_the_seeding():
    """--init-steps and --init shape a resumed run only while the prototypes are not yet seeded."""
    c = Config()
    saved = dataclasses.asdict(c)
    assert "init_steps 200 -> 50" in prism.resume_note(saved, dataclasses.replace(c, init_steps=50), 10)
    assert prism.resume_note(saved, dataclasses.replace(c, init_steps=50), 300) is None
    assert prism.resume_note(saved, dataclasses.replace(c, init="random"), 300) is None


def test_bench_head_times_each_models_own_selection(monkeypatch):
    """bench_head's top-k timing runs each PRISM's own prototypes() (its --dot-precision, --act and backend), with
    R1/R2's pairs, as training's head does."""
    seen, real = [], PRISM.prototypes
    monkeypatch.setattr(PRISM, "prototypes", lambda self, z, pairs=None: seen.append(
        (self.cfg.dot_precision, self.cfg.act, pairs)) or real(self, z, pairs))
    runs = {h: (tiny_model(head=head, dot_precision=p, act="relu_cos_sum1").float(), None)
            for h, (head, p) in prism.BENCH_RUNS.items()}
    x, y = batch()
    out = prism.bench_head(runs, x, y, {"prism": 1.0, "prism_bf16": 2.0}, torch.device("cpu"), contextlib.nullcontext(),
                           log=lambda s: None)
    # each model's head, then each PRISM's top-k alone, each in bench_time's 4 calls on the CPU (a warm-up, 3 timed)
    fp32, bf16 = [("fp32", "relu_cos_sum1", "l2")] * 4, [("bf16", "relu_cos_sum1", "l2")] * 4
    assert seen == fp32 + bf16 + fp32 + bf16
    assert out["step_extra_bf16_ms"] == 2.0 and min(out["topk_ms"], out["topk_bf16_ms"]) > 0


def test_bench_on_cpu(capsys, monkeypatch):
    """--bench without a GPU: PRISM's training rate against its dense twin, the two heads alone, the pairs read off
    the selection against a separate search (at a small shape here), and the kernel's line saying it needs CUDA."""
    monkeypatch.setitem(prism.BENCH_PAIRS_SHAPE, "cpu", (64, 96, 24))
    r = run_main(prism.main, ["--bench", "--layers", "1", "--d-model", "16", "--heads", "2", "--ctx", "8",
                              "--batch-size", "2", "--n-protos", "12", "--topk", "3"], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "PRISM / dense = " in r.stdout and "kernel: the Triton top-k needs a CUDA GPU; skipped" in r.stdout
    assert "pairs: N = 64, K = 96, d = 24, k = 16, squared L2: top-k with R1/R2's pairs " in r.stdout
    assert "head alone, forward + backward from fixed hidden states: dense " in r.stdout
    assert "PRISM (bf16 dots) " in r.stdout and "; with bf16 dots " in r.stdout
    res = json.loads(r.stdout[r.stdout.index("\n{") + 1:])
    assert set(res["train_tok_s"]) == {"dense", "prism", "prism_bf16"} and res["throughput_ratio"] > 0
    assert res["throughput_ratio_bf16"] == pytest.approx(res["train_tok_s"]["prism_bf16"] / res["train_tok_s"]["dense"])
    head = res["head"]
    step_ms = {h: 1e3 * 2 * 8 / v for h, v in res["train_tok_s"].items()}  # batch 2 × ctx 8
    for run, sfx in (("prism", ""), ("prism_bf16", "_bf16")):
        assert min(head["dense_ms"], head[f"prism{sfx}_ms"], head[f"topk{sfx}_ms"]) > 0
        assert head[f"extra{sfx}_ms"] == pytest.approx(head[f"prism{sfx}_ms"] - head["dense_ms"])
        assert head[f"step_extra{sfx}_ms"] == pytest.approx(step_ms[run] - step_ms["dense"])
    assert res["pairs"]["N"] == 64 and res["pairs"]["speedup"] > 0 and res["kernel"] == {}
