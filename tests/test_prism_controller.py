"""prism.py's controllers (spec §6.3): the 4-way cloze, the prototype gains, the SAE baseline, the experiment.
Tiny models and a stand-in corpus (a 30-token vocabulary), CPU, a few seconds in all."""
import types

import numpy as np
import pytest
import torch

import prism

TINY = dict(layers=1, d_model=16, heads=2, n_protos=12, topk=3, ctx=8, init="random", kernels="torch")
PIECES = ["\n", ",", ".", " a", " I"] + [" " + w for w in (
    "the and you that not with his your for this king lord love good what will shall thee have come "
    "sir more").split()] + [" King", " Love", "ing"]  # " King"/" Love": other casings of listed words


class Tok:
    """Stand-in tokenizer (decode is all the controller uses): one piece per id."""

    def decode(self, ids):
        return "".join(PIECES[int(i)] for i in ids)


class Data:
    """Stand-in for common.TokenData: Zipf-distributed token streams, the tokenizer, the device."""

    def __init__(self, n_val=3000, n_train=2000, seed=0):
        rng = np.random.default_rng(seed)
        p = 1.0 / np.arange(1, len(PIECES) + 1)
        self.splits = {s: rng.choice(len(PIECES), size=n, p=p / p.sum()).astype(np.uint16)
                       for s, n in (("val", n_val), ("train", n_train))}
        self.tokenizer, self.device, self.vocab_size = Tok(), torch.device("cpu"), len(PIECES)

    def tokens(self, split):
        return self.splits[split]


def tiny(head="prism", **kw):
    torch.manual_seed(0)
    cfg = prism.Config(**{**TINY, **kw}, head=head)
    return prism.PRISM(cfg, len(PIECES)).eval(), cfg


def cloze_of(data, n=200, seed=1, ctx=8):
    tokens = torch.from_numpy(data.tokens("val").astype("int64"))
    return prism.build_cloze(tokens, prism.cloze_words(data.tokenizer, tokens), ctx, n, seed)


# --- the controller is the model's head plus the gains' terms ------------------------------------------------


@torch.no_grad()
def test_zero_gains_give_the_models_own_logits():
    model, cfg = tiny()
    x = torch.randint(0, len(PIECES), (10, cfg.ctx))
    options = torch.randint(0, len(PIECES), (10, 4))
    z = prism.last_hidden(model, x, "cpu")
    feats = prism.prism_features(model, z, options)
    scores = prism.option_scores(feats, torch.zeros(cfg.n_protos))
    assert torch.equal(scores, model.head(z)["logits"].gather(1, options))  # exactly the head's logits
    torch.testing.assert_close(scores, model(x)[:, -1].gather(1, options))  # and the full forward's
    assert feats.K == cfg.n_protos and feats.idx.shape == (10, cfg.topk)


@torch.no_grad()
def test_unit_gain_adds_that_prototypes_term_where_it_is_active():
    model, cfg = tiny()
    x = torch.randint(0, len(PIECES), (32, cfg.ctx))
    options = torch.randint(0, len(PIECES), (32, 4))
    z = prism.last_hidden(model, x, "cpu")
    feats = prism.prism_features(model, z, options)
    idx, a = model.prototypes(z)
    i = int(idx[0, 0])
    active = (idx == i).any(1)
    assert active.any() and not active.all(), "the test needs rows with and without prototype i"
    c = torch.zeros(cfg.n_protos)
    c[i] = 1.0
    scores = prism.option_scores(feats, c)
    W = model.wte.weight
    a_i = (a * (idx == i)).sum(1)  # a_{t,i}, 0 where i is inactive
    expected = feats.base + a_i[:, None] * (W[options] @ model.P[i])  # logits + a_i (W p_i) at the options
    torch.testing.assert_close(scores, expected)
    assert torch.equal(scores[~active], feats.base[~active])  # untouched where i is not active
    # the same as the model's own controller, model.head(z, gain=c) (spec §6.3: r kept, the term scaled)
    torch.testing.assert_close(scores, model.head(z, gain=c)["logits"].gather(1, options), rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_sae_controller_scales_latents_inside_the_reconstruction():
    dense, cfg = tiny("dense")
    x = torch.randint(0, len(PIECES), (16, cfg.ctx))
    options = torch.randint(0, len(PIECES), (16, 4))
    z = prism.last_hidden(dense, x, "cpu")
    sae = prism.TopKSAE(cfg.d_model, cfg.n_protos, cfg.topk, generator=torch.Generator().manual_seed(0))
    idx, f = sae.encode(z)
    W = dense.wte.weight
    feats = prism.gain_features(lambda zz: torch.nn.functional.linear(zz, W), z, idx, f, sae.W_dec, W, options)
    c = torch.randn(cfg.n_protos)
    zhat = sae.decode(idx, f)
    zc = z - zhat + sae.decode(idx, f * (1 + c[idx]))  # W(z + Σ c_j f_j d_j): the latents scaled, the error kept
    torch.testing.assert_close(prism.option_scores(feats, c), (zc @ W.T).gather(1, options), rtol=1e-5, atol=1e-5)


# --- the cloze task ---------------------------------------------------------------------------------------------


def test_cloze_options_answers_split_and_determinism():
    data = Data()
    tok = data.tokenizer
    fit, ev = cloze_of(data)
    for d in (fit, ev):
        assert d.options.shape == (len(d.pos), 4) and len(d.pos) > 20
        words = [[tok.decode([int(o)]) for o in row] for row in d.options]
        assert all(len({w.lower() for w in row}) == 4 for row in words)  # 4 distinct words, casing included
        assert all(w[0] == " " and w[1:].isalpha() and len(w) > 3 for row in words for w in row)
        val = torch.from_numpy(data.tokens("val").astype("int64"))
        assert torch.equal(d.options.gather(1, d.answer[:, None])[:, 0], val[d.pos])  # the answer is the true word
        assert torch.equal(d.x[:, -1], val[d.pos - 1])  # the context ends just before the target
        assert torch.equal(d.pos, d.pos.sort().values) and len(set(d.pos.tolist())) == len(d.pos)
    mid = len(data.tokens("val")) // 2
    assert fit.pos.max() < mid <= (ev.pos - fit.x.shape[1]).min()  # no token shared between fit and eval
    assert len(set(ev.answer.tolist())) > 1  # the answer's slot is shuffled
    again = cloze_of(data)
    assert all(torch.equal(getattr(a, k), getattr(b, k)) for a, b in zip((fit, ev), again) for k in
               ("x", "options", "answer", "pos"))
    everything = cloze_of(data, n=10**6)  # n above the candidates: every listed position of each half
    val = torch.from_numpy(data.tokens("val").astype("int64"))
    listed = torch.isin(val, torch.tensor(prism.cloze_words(tok, val)))
    pos = torch.arange(len(val))
    assert torch.equal(everything[0].pos, pos[listed & (pos >= 8) & (pos < mid)])
    assert torch.equal(everything[1].pos, pos[listed & (pos >= mid + 8)])
    other = cloze_of(data, seed=2)
    assert not torch.equal(other[0].options, fit.options)


def test_cloze_distractors_come_from_the_answers_rank_band():
    data = Data()
    tokens = torch.from_numpy(data.tokens("val").astype("int64"))
    words = prism.cloze_words(data.tokenizer, tokens)
    assert data.tokenizer.decode([words[0]]) == " the" and PIECES.index(" King") not in words  # one casing per word
    fit, _ = prism.build_cloze(tokens, words, 8, 200, 0, band=2)
    rank = {w: r for r, w in enumerate(words)}
    r = torch.tensor([[rank[int(o)] for o in row] for row in fit.options])
    r_ans = r.gather(1, fit.answer[:, None])
    assert ((r - r_ans).abs() <= 4).all()  # ±2 ranks; the window shifts at the list's ends, never wider than 5


def test_cloze_needs_four_words():
    tokens = torch.tensor([5, 6, 7] * 50)
    assert prism.build_cloze(tokens, [5, 6, 7], 4, 20, 0) is None


# --- fitting the gains ------------------------------------------------------------------------------------------


def synthetic_task(N=300, K=12, k=3, d=16, V=30, seed=0):
    """A task only prototype 5 can solve: every example has the same true word w*, at a random slot, and a
    noisy base that favours a random option; prototype 5, active everywhere, is w*'s embedding direction, so
    raising its gain raises the true option's logit (by a_5 w* · p_5 = 1 per unit gain). The other active
    prototypes are random directions, which fit only the fit set's noise."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(V, d, generator=g)
    D = 0.3 * torch.randn(K, d, generator=g)  # the noise terms: logits of std ~0.6 per unit gain
    D[5] = 2 * W[7] / W[7].norm() ** 2  # w_7 · p_5 = 2
    others = torch.stack([torch.randperm(V - 1, generator=g)[:3] + 8 for _ in range(N)]) % V
    options = torch.cat([torch.full((N, 1), 7), others], 1)
    perm = torch.argsort(torch.rand(N, 4, generator=g), 1)
    options, answer = options.gather(1, perm), (perm == 0).int().argmax(1)
    # prototype 5 plus k-1 of 6..11, 0..3 (4 and 5 never drawn: prototype 4 is never active)
    idx = torch.stack([torch.cat([torch.tensor([5]), (torch.randperm(K - 2, generator=g)[: k - 1] + 6) % K])
                       for _ in range(N)])
    act = torch.full((N, k), 0.5)
    feats = prism.gain_features(lambda z: torch.zeros(len(z), V), torch.zeros(N, d), idx, act, D, W, options)
    feats.base = 3 * torch.randn(N, 4, generator=g)  # the frozen model's logits: no better than chance
    return feats, answer


def test_fitted_gains_raise_accuracy_and_l1_keeps_them_sparse():
    feats, answer = synthetic_task()
    zero = torch.zeros(feats.K)
    before = prism.accuracy(feats, answer, zero)
    c = prism.fit_gains(feats, answer, l1=3e-2)
    after = prism.accuracy(feats, answer, c)
    assert before < 0.5 and after > 0.9, (before, after)
    assert int(c.abs().argmax()) == 5 and c[5] > 0
    assert c.numel() == feats.K
    assert int((c.abs() > prism.NONZERO).sum()) <= 3  # most gains exactly zero
    assert int((c == 0).sum()) >= feats.K - 3
    never_active = torch.ones(feats.K, dtype=torch.bool)
    never_active[feats.idx.flatten()] = False
    assert never_active.any() and (c[never_active] == 0).all()
    dense_c = prism.fit_gains(feats, answer, l1=0.0)  # without L1 the noise prototypes get gains too
    assert int((dense_c.abs() > prism.NONZERO).sum()) > int((c.abs() > prism.NONZERO).sum())


def test_controller_row_counts_the_terms_active_on_the_fit_examples(monkeypatch):
    """Of the K trainable gains only those whose term fires on a fit example can move: the row says how many (here
    prototypes 5 and 6..11, 0..3: 11 of 12, prototype 4 never drawn), and a term whose activation is 0 wherever it
    is listed does not count."""
    monkeypatch.setattr(prism, "GAIN_STEPS", 20)
    feats, answer = synthetic_task()
    cloze = {s: types.SimpleNamespace(answer=answer) for s in ("fit", "eval")}
    row = prism.controller_row("x", {"fit": feats, "eval": feats}, cloze, 3e-2, "f")[0]
    assert row["trainable params"] == 12 and row["terms active on fit"] == 11
    assert row["non-zero gains"] <= row["terms active on fit"]
    silent = prism.GainFeatures(feats.base, feats.idx, feats.G.clone(), feats.K)
    silent.G.masked_fill_((feats.idx == 0)[:, None, :], 0.0)  # prototype 0 listed, with activation 0: cannot move
    row = prism.controller_row("x", {"fit": silent, "eval": silent}, cloze, 3e-2, "f")[0]
    assert row["terms active on fit"] == 10


# --- the SAE ------------------------------------------------------------------------------------------------------


def test_topk_sae_sparsity_unit_decoder_and_learning():
    g = torch.Generator().manual_seed(0)
    basis = torch.randn(6, 16, generator=g)
    z = torch.relu(torch.randn(2048, 6, generator=g)) @ basis + 0.01 * torch.randn(2048, 16, generator=g)
    untrained = prism.TopKSAE(16, 12, 3, generator=torch.Generator().manual_seed(0))
    sae = prism.train_sae(z, 12, 3, steps=200, seed=0, batch=512, lr=1e-2)
    idx, f = sae.encode(z)
    dense_f = torch.zeros(len(z), 12).scatter(1, idx, f)
    assert idx.shape == (len(z), 3) and ((dense_f != 0).sum(1) <= 3).all() and (f >= 0).all()
    torch.testing.assert_close(sae.W_dec.norm(dim=-1), torch.ones(12))
    with torch.no_grad():
        untrained.b_dec.copy_(z.mean(0))
        sae.b_enc.sub_(100.0)  # every pre-activation negative: ReLU after the top-k leaves no latent on
        assert (sae.encode(z)[1] == 0).all()
        sae.b_enc.add_(100.0)
    assert prism.fvu(sae, z) < 0.5 * prism.fvu(untrained, z) and prism.fvu(sae, z) < 0.3


# --- the experiment -----------------------------------------------------------------------------------------------


def test_controller_experiment_table_and_skip(monkeypatch):
    monkeypatch.setitem(prism.CONTROLLER_SIZES, "cpu", dict(examples=300, sae_windows=32, sae_steps=50))
    monkeypatch.setattr(prism, "GAIN_STEPS", 100)
    data = Data()
    model, cfg = tiny()
    dense, _ = tiny("dense")
    lines = []
    res = prism.controller_experiment(model, dense, data, cfg, lines.append)
    rows = res["table"]
    assert [r["model/controller"] for r in rows] == ["PRISM + prototype gains", "dense twin + SAE latent gains"]
    for r in rows:
        assert 0 <= r["acc before"] <= 1 and 0 <= r["acc after"] <= 1
        assert r["gain (points)"] == pytest.approx(100 * (r["acc after"] - r["acc before"]))
        assert r["trainable params"] == cfg.n_protos and 0 <= r["non-zero gains"] <= cfg.n_protos
    assert res["examples"]["fit"] > 0 and res["examples"]["eval"] > 0
    assert "25%" in res["summary"] and res["summary"] in lines
    assert all(0 <= t["proto"] < cfg.n_protos for t in res["top_gains"]) and len(res["top_gains"]) <= 3
    assert 0 <= res["sae"]["fvu_val"] and res["sae"]["latents"] == cfg.n_protos and res["sae"]["k"] == cfg.topk
    assert sum(line.startswith("controller") for line in lines) == 3  # the task, PRISM, the SAE

    again = prism.controller_experiment(model, dense, data, cfg, lambda m: None)
    assert again["table"] == rows  # deterministic

    lines = []
    res = prism.controller_experiment(model, None, data, cfg, lines.append)
    assert [r["model/controller"] for r in res["table"]] == ["PRISM + prototype gains"]
    assert any("SAE" in line and "skipped" in line for line in lines) and res["sae"] is None


def test_controller_experiment_skips_a_tiny_val_split():
    data = Data(n_val=12)
    model, cfg = tiny()
    lines = []
    assert prism.controller_experiment(model, None, data, cfg, lines.append) == {}
    assert len(lines) == 1 and "too small" in lines[0]
