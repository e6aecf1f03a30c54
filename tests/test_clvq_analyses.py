"""Tests of clvq_vae.py's analyses section: baselines (§6.4), concept-ablation fidelity (§6.1), concept cards and
the coherence proxy (§7, §6.2), and --bench. Offline, CPU, on a tiny random BERT built in tmp_path."""
import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

import clvq_vae as cv

# A hand-made WordPiece vocabulary: "unbelievably" -> un ##believ ##ably and "cats" -> cat ##s, so a word's
# score (max over its subwords) differs from its first and its last subword.
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "##s", "sat", "un", "##believ", "##ably",
         "tragic", "o", "'", "er", ",", "!", ".", "a", "dog", "ran", "on", "mat", "hills", "my", "house"]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A tiny random 3-layer BERT (hidden 32) loaded through the --model PATH route."""
    from transformers import BertConfig, BertModel, BertTokenizer

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        folder = tmp_path_factory.mktemp("tiny-bert")
        (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
        tok = BertTokenizer(vocab=str(folder / "vocab.txt"))
        torch.manual_seed(0)
        cfg = BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64)
        BertModel(cfg).save_pretrained(folder)
        tok.save_pretrained(folder)
        return cv.load_source_model(str(folder))


def _texts(n, seed=0):
    """n short sentences over the tiny vocabulary; label 1 iff the sentence mentions a cat."""
    g = torch.Generator().manual_seed(seed)
    nouns, verbs, rest = ["cat", "dog", "house", "mat", "hills"], ["sat", "ran"], ["the", "a", "my", "tragic", "on"]
    texts, labels = [], []
    for i in range(n):
        pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
        noun = "cat" if i % 2 else pick(nouns[1:])
        words = [pick(rest), noun, pick(verbs), pick(rest), pick(nouns[1:]), pick([".", "!", ","])]
        texts.append(" ".join(words))
        labels.append(int(noun == "cat"))
    return texts, labels


# ---- Integrated Gradients -------------------------------------------------------------------------------------

@pytest.mark.parametrize("baseline", ["pad", "id0"])
def test_ig_is_complete(bert, baseline):
    """Σ_t a_t = f(x) - f(baseline) (completeness), with enough Gauss-Legendre steps, through a real HF model.
    (The token baselines: from the zero baseline this model's post-LN blocks, whose biases are zero, are
    scale-invariant along the path except within ~LN-eps of α = 0, a near-jump no quadrature resolves; the next
    test.)"""
    torch.manual_seed(1)
    head = torch.nn.Linear(32, 2).requires_grad_(False)
    enc = bert.tokenizer("the cats unbelievably sat on my mat !", return_special_tokens_mask=True)
    ig = cv.integrated_gradients(bert, head, enc["input_ids"], enc["special_tokens_mask"], layer=1, steps=40,
                                 baseline=baseline, batch=16)
    gap = ig["f_x"] - ig["f_base"]
    assert abs(gap) > 1e-3  # a non-trivial path
    assert abs(ig["attr"].sum().item() - gap) < 1e-3 * abs(gap)  # relative: one step misses by ~4% here
    assert ig["attr"].shape == (len(enc["input_ids"]),)
    # the target is the head's prediction on the unmodified sentence
    out = bert.model(input_ids=torch.tensor([enc["input_ids"]]), output_hidden_states=True)
    assert ig["target"] == int(head(out.hidden_states[-1][:, 0]).argmax())


def test_token_baselines_replace_the_words_or_every_token(bert):
    """f(baseline) is the head on the model run from the replaced tokens: pad keeps [CLS] and [SEP] (Captum's BERT
    recipe), id0 puts token 0 everywhere, the specials too (Captum's default, the official encoder script's)."""
    torch.manual_seed(1)
    head = torch.nn.Linear(32, 2).requires_grad_(False)
    enc = bert.tokenizer("the cats sat on my mat", return_special_tokens_mask=True)
    ids, spec = torch.tensor([enc["input_ids"]]), torch.tensor([enc["special_tokens_mask"]]).bool()
    f_base = {}
    for baseline, replaced in (("pad", torch.where(spec, ids, bert.tokenizer.pad_token_id)),
                               ("id0", torch.zeros_like(ids))):
        ig = cv.integrated_gradients(bert, head, enc["input_ids"], enc["special_tokens_mask"], 1, steps=2,
                                     baseline=baseline)
        with torch.no_grad():
            f = head(bert.model(input_ids=replaced, output_hidden_states=True).hidden_states[-1][:, 0])
        f_base[baseline] = ig["f_base"]
        assert ig["f_base"] == pytest.approx(f[0, ig["target"]].item(), rel=1e-5, abs=1e-6), baseline
    assert abs(f_base["pad"] - f_base["id0"]) > 1e-4  # here [PAD] is id 0: they differ at [CLS] and [SEP] only


def test_zeros_baseline_misses_the_gap_only_with_zero_biases(bert):
    """integrated_gradients' note on --ig-baseline zeros, measured: the tiny BERT as initialised has zero biases,
    so from the zero baseline every post-LN block above l is scale-invariant along the path (but within ~LN-eps
    of α = 0) and the sum of the attributions misses the gap (Σa ≈ 0); with non-zero biases, as a trained model
    has, the path is not scale-invariant and the same steps close the gap."""
    torch.manual_seed(1)
    head = torch.nn.Linear(32, 2).requires_grad_(False)
    enc = bert.tokenizer("the cats unbelievably sat on my mat !", return_special_tokens_mask=True)

    def missed(src):
        ig = cv.integrated_gradients(src, head, enc["input_ids"], enc["special_tokens_mask"], layer=1, steps=40,
                                     baseline="zeros", batch=16)
        gap = ig["f_x"] - ig["f_base"]
        assert abs(gap) > 1e-2
        return abs(ig["attr"].sum().item() - gap) / abs(gap)
    assert all(p.abs().max() == 0 for n, p in bert.model.named_parameters() if n.endswith(".bias"))
    assert missed(bert) > 0.9
    biased = copy.deepcopy(bert)
    with torch.no_grad():
        for n, p in biased.model.named_parameters():
            if n.endswith(".bias"):
                p.normal_(0.0, 0.1, generator=torch.Generator().manual_seed(2))
    assert missed(biased) < 1e-2


def test_ig_too_few_steps_is_visibly_incomplete(bert):
    """The completeness check has power: one step leaves a gap that 40 steps close."""
    torch.manual_seed(1)
    head = torch.nn.Linear(32, 2).requires_grad_(False)
    enc = bert.tokenizer("the cats unbelievably sat on my mat !", return_special_tokens_mask=True)
    ig1 = cv.integrated_gradients(bert, head, enc["input_ids"], enc["special_tokens_mask"], 1, steps=1)
    gap = ig1["f_x"] - ig1["f_base"]
    assert abs(ig1["attr"].sum().item() - gap) > 1e-2 * abs(gap)


def test_word_scores_take_the_max_over_subwords(bert):
    words = cv.split_words("the cats unbelievably sat!")
    enc = bert.tokenizer(" ".join(words), return_offsets_mapping=True, return_special_tokens_mask=True)
    toks = bert.tokenizer.convert_ids_to_tokens(enc["input_ids"])
    assert toks == ["[CLS]", "the", "cat", "##s", "un", "##believ", "##ably", "sat", "!", "[SEP]"]
    attr = torch.tensor([9.0, 1.0, -4.0, 2.0, 0.5, -3.0, 1.0, 0.0, 2.0, 7.0])
    s = cv.word_scores(attr, words, enc["offset_mapping"], enc["special_tokens_mask"])
    a = (attr / attr.norm()).abs()
    torch.testing.assert_close(s, torch.stack([a[1], a[2], a[5], a[7], a[8]]))  # specials never count


# ---- ablation ---------------------------------------------------------------------------------------------------

def test_projection_removes_the_direction_exactly():
    g = torch.Generator().manual_seed(0)
    r, e = torch.randn(50, 64, generator=g), 5 * torch.randn(50, 64, generator=g)
    rp = cv.project_out(r, e)
    eh = e / e.norm(dim=-1, keepdim=True)
    assert (rp * eh).sum(-1).abs().max() < 1e-5 * r.norm(dim=-1).max()
    # what is left is r minus its component along ê, nothing else
    torch.testing.assert_close(rp, r - (r * eh).sum(-1, keepdim=True) * eh, atol=1e-5, rtol=1e-5)
    # a zero direction (id -1) removes nothing
    torch.testing.assert_close(cv.project_out(r[:3], torch.zeros(3, 64)), r[:3])


@pytest.mark.parametrize("where", ["last", "first", "zero first"])
def test_subspace_projection_removes_every_basis_vector(where):
    """A dependent (or zero) direction anywhere in the list removes nothing of its own and keeps the others'
    span whole (a QR with its column zeroed lost part of the later directions when it was not last)."""
    g = torch.Generator().manual_seed(1)
    r, B = torch.randn(20, 32, generator=g), torch.randn(20, 3, 32, generator=g)
    extra = torch.zeros_like(B[:, :1]) if where == "zero first" else B[:, :1] + 2 * B[:, 1:2]  # the span stays 3-d
    B = torch.cat([B, extra] if where == "last" else [extra, B], 1)
    rp = cv.project_out(r, B)
    assert torch.einsum("sd,smd->sm", rp, B).abs().max() < 1e-4
    # rank 3 removed, no more: |r'|² = |r|² - |P r|² with P the 3-d projector
    Q = torch.linalg.qr(B[:, -3:].double().transpose(1, 2) if where != "last" else
                        B[:, :3].double().transpose(1, 2))[0]
    left = r.double().pow(2).sum(-1) - torch.einsum("sd,sdm->sm", r.double(), Q).pow(2).sum(-1)
    torch.testing.assert_close(rp.double().pow(2).sum(-1), left, atol=1e-4, rtol=1e-5)
    one = cv.project_out(r, B[:, -1])  # one direction: r − (r·ê)ê
    e = F.normalize(B[:, -1].double(), dim=-1)
    torch.testing.assert_close(one.double(), r.double() - (r.double() * e).sum(-1, keepdim=True) * e)


# ---- baselines ------------------------------------------------------------------------------------------------

def test_sae_keeps_exactly_k_latents():
    torch.manual_seed(0)
    sae = cv.TranscoderSAE(16, 64, 5)
    x = torch.randn(40, 16)
    f, idx = sae.encode(x)
    pre = torch.relu(sae.enc(x))
    assert ((f != 0).sum(-1) == 5).all()  # the encoder bias 0.1 keeps more than k positive here
    torch.testing.assert_close(f.gather(1, idx), pre.topk(5, -1).values)
    assert (idx[:, 0] == pre.argmax(-1)).all()  # the concept is the argmax latent
    y, _ = sae(x)
    assert y.shape == x.shape


def test_relu_sae_keeps_every_positive_latent():
    """--sae-k 0: the official ReLU SAE (§6.4), f = ReLU(W_enc x + b_enc); its concept is still the argmax latent,
    and the ablation's top rows are the most active ones."""
    torch.manual_seed(0)
    sae = cv.TranscoderSAE(16, 64, 0)
    x = torch.randn(40, 16)
    f, idx = sae.encode(x)
    pre = torch.relu(sae.enc(x))
    assert torch.equal(f, pre) and (idx[:, 0] == pre.argmax(-1)).all() and idx.shape == (40, 1)
    assert torch.equal(sae.encode(x, top=7)[1], pre.topk(7, -1).indices)
    cfg = cv.Config(d_model=16, sae_ablate_k=7)
    m = cv.sae_method(cfg, sae, torch.device("cpu"), dict(seconds=0.0))
    assert m.name == "ReLU SAE" and m.settings["ablate_k"] == 7
    torch.testing.assert_close(m.ablation(x, m.assign(x)), sae.enc.weight.detach()[pre.topk(7, -1).indices])
    cfg = cv.Config(sae_latents=32, sae_k=0, sae_l1=1e-4, sae_steps=30)
    y = torch.randn(200, 16)
    trained, info = cv.train_sae(cfg, x.repeat(5, 1), y, torch.device("cpu"), log=lambda s: None)
    assert trained.k == 0 and info["k"] == 0 and info["l1"] == 1e-4 and 0 < info["fvu"] < 2
    f = trained.encode(x.repeat(5, 1))[0]
    assert info["active_per_row"] == round((f != 0).sum().item() / 200, 1) and info["active_per_row"] > 0
    lines = []  # without its L1 weight the ReLU SAE is not sparse at all: said, not left to the user to notice
    cv.train_sae(replace(cfg, sae_l1=0.0, sae_steps=1), x.repeat(5, 1), y, torch.device("cpu"), log=lines.append)
    assert lines[0].startswith("note: --sae-k 0 with --sae-l1 0 trains a ReLU SAE with no sparsity penalty")


def test_sae_method_ablates_the_top_encoder_rows():
    torch.manual_seed(0)
    cfg = cv.Config(d_model=16)
    cfg.sae_ablate_k = 3
    sae = cv.TranscoderSAE(16, 64, 5)
    m = cv.sae_method(cfg, sae, torch.device("cpu"), dict(seconds=0.0))
    x = torch.randn(7, 16)
    ids = m.assign(x)
    B = m.ablation(x, ids)
    top = sae.encode(x)[1][:, :3]
    assert B.shape == (7, 3, 16) and (ids == top[:, 0]).all()
    torch.testing.assert_close(B, sae.enc.weight.detach()[top])


def test_kmeans_baseline_assigns_each_row_its_nearest_centroid():
    g = torch.Generator().manual_seed(0)
    centers = 10 * torch.randn(6, 8, generator=g)
    x = (centers[torch.arange(300) % 6] + torch.randn(300, 8, generator=g))
    cfg = cv.Config(d_model=8, codebook_size=6, kernels="torch")
    cfg.kmeans_restarts, cfg.kmeans_iters = 2, 10
    m = cv.kmeans_method(cfg, x, torch.device("cpu"), log=lambda s: None)
    ids = m.assign(x)
    C = m.ablation(x[:6], torch.arange(6))[:, 0]  # the centroids
    assert (ids == torch.cdist(x, C).argmin(-1)).all()
    # Lloyd's fixed point: each centroid is its members' mean, and the 6 planted clusters are found
    for k in range(6):
        torch.testing.assert_close(C[k], x[ids == k].mean(0), atol=1e-4, rtol=1e-4)
    assert len(torch.unique(ids)) == 6
    assert m.ablation(x[:1], torch.tensor([-1])).abs().sum() == 0



@pytest.mark.parametrize("seeding", ["random", "kmeans++"])
def test_kmeans_stops_at_its_fixed_point_with_the_same_result(seeding, monkeypatch):
    """Lloyd's iterations end once the assignment repeats: the centroids are those of running every iteration
    (here a 200-pass run against one whose stop never fires), and --init-iters 1e9 ends at once instead of for
    ever."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(400, 8, generator=g) + 4 * torch.randn(5, 8, generator=g)[torch.arange(400) % 5]
    cfg = cv.Config(d_model=8, codebook_size=7, kernels="torch", init="kmeans", init_seeding=seeding,
                    init_restarts=2, init_iters=200)
    passes = []
    real = cv.vq_search
    monkeypatch.setattr(cv, "vq_search", lambda *a, **k: passes.append(1) or real(*a, **k))
    C, assign = cv.VectorQuantizer(cfg)._kmeans(x, torch.Generator().manual_seed(0))
    assert len(passes) < 2 * 40  # both restarts stopped early (each pass plus the final search)
    monkeypatch.setattr(cv.torch, "equal", lambda a, b: False)  # the stop never fires: all 200 passes
    C_all, assign_all = cv.VectorQuantizer(cfg)._kmeans(x, torch.Generator().manual_seed(0))
    monkeypatch.undo()
    assert torch.equal(C, C_all) and torch.equal(assign, assign_all)
    cfg.init_iters = 10 ** 9
    C_big, _ = cv.VectorQuantizer(cfg)._kmeans(x, torch.Generator().manual_seed(0))
    assert torch.equal(C_big, C)


# ---- the probe test -------------------------------------------------------------------------------------------

def test_fidelity_drops_only_for_the_carrying_direction():
    """Synthetic §6.1: the label lives along one known direction u. Removing u (every sentence's concept) takes
    the probe to chance; removing a random direction, or a direction orthogonal to u, barely moves it."""
    g = torch.Generator().manual_seed(0)
    S, d = 240, 16
    u = torch.zeros(d)
    u[0] = 1.0
    y = torch.arange(S) % 2
    r = torch.randn(S, d, generator=g) * torch.cat([torch.tensor([0.3]), torch.ones(d - 1)]) + \
        (2.0 * y[:, None] - 1) * 1.5 * u
    other = torch.zeros(d)
    other[1] = 1.0
    rows = cv.probe_fidelity(r, y.tolist(), {"carrier": u.expand(S, 1, d).clone(),
                                             "orthogonal": other.expand(S, 1, d).clone()}, folds=4, seed=42)
    by = {w["method"]: w for w in rows}
    assert by["carrier"]["acc_orig"] > 0.95 and by["carrier"]["acc_orig"] == by["orthogonal"]["acc_orig"]
    assert by["carrier"]["acc_concept"] < 0.7 and by["carrier"]["drop_concept"] > 0.25
    assert by["carrier"]["acc_random"] > 0.85
    assert by["orthogonal"]["acc_concept"] > 0.9
    assert all(w["folds"] == 4 and w["n_sentences"] == S and w["rank"] == 1 for w in rows)


def test_centred_projection_keeps_the_shared_mean_so_the_random_control_is_informative():
    """--fidelity-projection centred: r' = r - ((r - μ)·ê)ê. Representations with a large shared mean (like
    MiniLM's [CLS]): the paper's projection of a random direction moves every r by -(μ·ê)ê and costs the probe
    accuracy that says nothing about the direction; the centred one leaves the random control near the
    original while the carrying direction still takes the probe to chance."""
    g = torch.Generator().manual_seed(0)
    S, d = 240, 16
    u = torch.zeros(d)
    u[0] = 1.0
    y = torch.arange(S) % 2
    r = torch.full((d,), 10.0) + torch.randn(S, d, generator=g) * torch.cat([torch.tensor([0.3]), torch.ones(d - 1)]) \
        + (2.0 * y[:, None] - 1) * 1.5 * u
    rows = {c: cv.probe_fidelity(r, y.tolist(), {"carrier": u.expand(S, 1, d).clone()}, folds=4, seed=42, centred=c,
                                 log=lambda s: None)[0] for c in (False, True)}
    assert rows[False]["acc_random"] < 0.9 < rows[True]["acc_random"]
    assert rows[True]["acc_concept"] < 0.6 and rows[True]["acc_orig"] > 0.95
    # the shift that explains it: the raw projection moves r by about |μ·ê| = 10 for the carrier, several spreads
    # (spread = RMS |r - μ| = √(0.3² + 1.5² + 15) ≈ 4.2), the centred one by |(r - μ)·u| ≈ 1.5 only
    spread = (r - r.mean(0)).norm(dim=1).pow(2).mean().sqrt().item()
    assert rows[False]["shift_concept"] == pytest.approx((r[:, 0] - 0).abs().mean().item() / spread, rel=1e-5)
    assert rows[True]["shift_concept"] == pytest.approx((r[:, 0] - r[:, 0].mean()).abs().mean().item() / spread,
                                                        rel=1e-5)
    assert rows[False]["shift_concept"] > 2 > 0.5 > rows[True]["shift_concept"]
    B = torch.randn(S, 2, d, generator=g)
    mu = r.mean(0)
    out = cv.project_out(r, B, mu)
    Q = cv.orthonormal_rows(B)
    assert torch.einsum("sd,smd->sm", (out - mu).double(), Q).abs().max() < 1e-4  # nothing of r - μ left in span(B)


def test_probe_needs_two_sentences_of_each_class_and_says_when_it_uses_fewer_folds():
    """Too few sentences is an error, not a probe trained on nothing (which once printed 0.000 for every method);
    fewer sentences of a class than --probe-folds runs with fewer folds and says so."""
    r, B = torch.randn(6, 4), {"m": torch.randn(6, 1, 4)}
    with pytest.raises(ValueError, match="needs >= 2 classes"):
        cv.probe_fidelity(r[:0], [], {"m": B["m"][:0]}, folds=3)  # no sentence at all
    for labels in ([0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 0, 1]):
        with pytest.raises(ValueError, match="needs >= 2 classes with >= 2 sentences each"):
            cv.probe_fidelity(r, labels, B, folds=3)
    lines = []
    rows = cv.probe_fidelity(r, [0, 0, 0, 0, 1, 1], B, folds=3, log=lines.append, epochs=5)
    assert rows[0]["folds"] == 2 and any("2 folds, not 3" in ln for ln in lines)
    rows = cv.probe_fidelity(r, [0, 0, 2, 2, 2, 0], B, folds=3, log=lines.append, epochs=5)  # label 1 absent
    assert rows[0]["folds"] == 3


def test_sae_with_a_diverging_loss_stops_with_one_line():
    cfg = cv.Config(sae_latents=8, sae_k=2, sae_steps=20, sae_lr=1e30)
    x = torch.randn(64, 4)
    with pytest.raises(cv.RunError, match="baseline SAE: non-finite loss at step"):
        cv.train_sae(cfg, x, x, torch.device("cpu"), log=lambda s: None)



def test_sae_that_cannot_fit_stops_before_it_is_built(monkeypatch):
    """--sae-latents 2**31 asked for terabytes after the main model had trained, and the out-of-memory line
    named --batch-size: the SAE's floor is checked before it is built and names --sae-latents."""
    import common

    cfg = cv.Config(sae_latents=2 ** 31, sae_k=1, sae_steps=1)
    monkeypatch.setattr(common, "available_memory", lambda device: 2 ** 30)
    monkeypatch.setattr(cv, "TranscoderSAE", lambda *a, real=cv.TranscoderSAE: real(*a) if torch.get_default_device(
        ).type == "meta" else pytest.fail("built an SAE that cannot fit"))
    x = torch.randn(64, 16)
    with pytest.raises(cv.RunError, match=r"^this run needs at least 1,056 GiB of memory \(weights, gradients and "
                                          r"AdamW's moments 1,056 GiB\) .*; lower --sae-latents, or the model's size"):
        cv.train_sae(cfg, x, x, torch.device("cpu"), log=lambda s: None)


def test_l_equal_h_does_not_retrain_its_own_model_as_the_vq_baseline():
    """With l = h the run's model is the single-layer VQ-VAE (same name, same checkpoint): the baseline is
    skipped, not trained a second time over the same file."""
    acts = _acts([["a", "b"], ["c"]])
    acts = replace(acts, layers=(1, 1))
    cfg = cv.Config(d_model=4, codebook_size=2, baselines="vq", kernels="torch")
    model = cv.CLVQVAE(cfg)
    model.init_codebook(acts.x_l)
    lines, fits = [], []
    methods = cv.build_methods(cfg, acts, acts, model, lambda *a: fits.append(a), "cpu", log=lines.append)
    assert [m.name for m in methods] == ["CLVQ-VAE l1->h1"] and not fits
    assert any("skipped, the model of this run has l = h already" in ln for ln in lines)


def test_fidelity_table_header_lines_up_with_its_values():
    row = dict(method="CLVQ-VAE l4->h6", acc_orig=0.674, acc_orig_std=0.171, acc_concept=0.569, acc_concept_std=0.2,
               acc_random=0.503, acc_random_std=0.1, drop_concept=0.156, drop_random=0.254, rank=1,
               shift_concept=14.71, shift_random=5.2)
    head, line = cv.fidelity_table([row, dict(row, method="SAE", drop_random=1.0, rank=5)]).splitlines()[:2]
    assert "15.6%" in line and "25.4%" in line
    labels = ["rank", "original", "concept-ablated", "random-ablated", "concept drop", "random drop", "shift ÷ spread"]
    values = ["1", "0.674 ± 0.171", "0.569 ± 0.200", "0.503 ± 0.100", "15.6%", "25.4%", "14.71 / 5.20"]
    for label, value in zip(labels, values):  # right-aligned: each label ends where its column's values end
        assert head.index(label) + len(label) == line.index(value) + len(value), label
        assert head[head.index(label) - 2:head.index(label)] == "  "  # two spaces from the column before


def test_stratified_folds_balance_classes():
    y = torch.tensor([0] * 30 + [1] * 10)
    f = cv.stratified_folds(y, 5, seed=42)
    for k in range(5):
        assert ((f == k) & (y == 0)).sum() == 6 and ((f == k) & (y == 1)).sum() == 2


# ---- cards and coherence ----------------------------------------------------------------------------------------

def _acts(words_per_sent, d=4):
    """Activations for hand sentences: [CLS] + words + [SEP] per sentence, rows in order."""
    words, sent, pos, special, texts = [], [], [], [], []
    for s, ws in enumerate(words_per_sent):
        texts.append(" ".join(ws))
        units = [("[CLS]", -1, True)] + [(w, i, False) for i, w in enumerate(ws)] + [("[SEP]", len(ws), True)]
        for w, p, sp in units:
            words.append(w), sent.append(s), pos.append(p), special.append(sp)
    n = len(words)
    return cv.Activations(torch.zeros(n, d), torch.zeros(n, d), torch.tensor(sent), torch.tensor(pos),
                          torch.tensor(special), words, texts, [0] * len(texts), (1, 2), "encoder",
                          {"start": "[CLS]", "end": "[SEP]"}, {})


def test_cards_escape_and_highlight():
    acts = _acts([["a", "<b>", "&", "c"], ["x", "<b>", "y"], ["p", "q"]])
    codes = torch.tensor([0 if w == "[CLS]" else 1 if w == "<b>" else 2 for w in acts.words])
    m = cv.ConceptMethod("toy <i>", 3, lambda x: codes, lambda x, i: None, {})
    cards = cv.concept_cards(m, acts, codes, n_cards=3)
    by = {c["code"]: c for c in cards}
    assert by[1]["top_words"] == [("<b>", 2)] and len(by[1]["examples"]) == 2 and by[1]["sentences"] == []
    assert len(by[0]["sentences"]) == 3 and by[0]["special_fraction"] == 1.0  # a sentence-level code
    page = cv.cards_html({m.name: cards})
    assert "<mark>&lt;b&gt;</mark>" in page and "toy &lt;i&gt;" in page
    assert "<b>" not in page and "<i>" not in page and "&amp;" in page
    assert page.count('class="card"') == 3
    # a fragment for the report (no document of its own, no <h1>/<h2> above the report's heading) ...
    assert not any(t in page.lower() for t in ("<!doctype", "<title>", "<style>", "<h1>", "<h2>"))
    # ... and a document for cards.html
    doc = cv.cards_page(page)
    assert doc.lower().startswith("<!doctype") and doc.count("<title>") == 1 and doc.endswith(page)


def test_coherence_proxy_beats_chance_only_for_coherent_codes():
    g = torch.Generator().manual_seed(0)
    d = 32
    base = torch.randn(2, d, generator=g)
    vecs = {f"a{i}": base[0] + 0.2 * torch.randn(d, generator=g) for i in range(10)}
    vecs.update({f"b{i}": base[1] + 0.2 * torch.randn(d, generator=g) for i in range(10)})
    vecs.update({f"r{i}": torch.randn(d, generator=g) for i in range(40)})
    words = [w for w in vecs for _ in range(3)]
    coherent = torch.tensor([0 if w[0] == "a" else 1 if w[0] == "b" else 2 + int(w[1:]) % 4 for w in words])
    good = cv.coherence_proxy(words, coherent, vecs, draws=5)
    assert good["score"] > good["chance"] + 0.2
    shuffled = coherent[torch.randperm(len(words), generator=g)]
    bad = cv.coherence_proxy(words, shuffled, vecs, draws=5)
    assert abs(bad["score"] - bad["chance"]) < 0.1 and bad["score"] < good["score"] - 0.2


def test_coherence_proxy_counts_types_that_share_a_vector_once():
    """Spellings of one token (case variants under an uncased tokenizer, words ending in one subword under 'last')
    have one vector: a code of such spellings is one type, not a perfectly coherent group of several, and adding
    spellings of its members' tokens leaves a code's score as it was."""
    g = torch.Generator().manual_seed(1)
    v = torch.randn(6, 16, generator=g)
    vecs = {"the": v[0], "The": v[0], "THE": v[0], "dost": v[1], "hast": v[1], "king": v[2], "queen": v[3],
            "x": v[4], "y": v[5]}
    one_token = cv.coherence_proxy(["the", "The", "THE", "x", "y"], torch.tensor([0, 0, 0, 1, 1]), vecs, draws=2)
    assert one_token["codes_scored"] == 1 and one_token["types"] == 5 and one_token["vectors"] == 3  # code 0 not scored
    plain = cv.coherence_proxy(["dost", "king", "queen"], torch.zeros(3, dtype=torch.long), vecs, draws=2)
    spelled = cv.coherence_proxy(["dost", "hast", "king", "queen", "The"], torch.tensor([0, 0, 0, 0, -1]), vecs,
                                 draws=2)
    assert spelled["score"] == pytest.approx(plain["score"], abs=1e-12) and spelled["score"] < 0.9
    assert spelled["types"] == 4 and spelled["vectors"] == 3


def test_type_vectors_use_the_last_subword(bert):
    v = cv.type_vectors(bert, ["cats", "unbelievably", "[CLS]"], how="last")
    W = bert.model.get_input_embeddings().weight
    ids = bert.tokenizer.convert_tokens_to_ids
    torch.testing.assert_close(v["cats"], W[ids("##s")])
    torch.testing.assert_close(v["unbelievably"], W[ids("##ably")])
    torch.testing.assert_close(v["[CLS]"], W[ids("[CLS]")])
    m = cv.type_vectors(bert, ["cats"], how="mean")
    torch.testing.assert_close(m["cats"], W[[ids("cat"), ids("##s")]].mean(0))


# ---- bench and the whole section ---------------------------------------------------------------------------------

def test_bench_runs_on_cpu_at_tiny_sizes():
    out = cv.bench(cv.Config(), torch.device("cpu"), log=lambda s: None, sizes=[(64, 16, 8), (100, 20, 12)])
    assert out["kernel"] == "torch" and len(out["rows"]) == 2
    for r in out["rows"]:
        assert r["agree"] == 1.0  # the chunked form draws the same codes as the reference from the same uniforms
        assert 0 <= r["agree_bf16"] <= 1  # bf16-rounded distances: near-equal codes may swap
        assert min(r["kernel_ms"], r["kernel_bf16_ms"], r["reference_ms"], r["cdist+topk_ms"]) > 0
        assert r["vs_cdist_bf16"] == pytest.approx(r["cdist+topk_ms"] / r["kernel_bf16_ms"])
        assert r["kernel_peak_mb"] is None  # CPU: time only


def _tiny_fit(calls):
    def fit_fn(cfg, train, dev, device, log, variant):
        calls.append((variant, torch.equal(train.x_h, train.x_l)))
        torch.manual_seed(0)
        model = cv.CLVQVAE(cfg).to(device)
        xl, xh, mask = cv.pad_sentences(train, range(len(train.texts)))
        model.init_codebook(xl, mask)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for _ in range(5):
            loss = model(xl, xh, mask)["loss"]
            opt.zero_grad()
            loss.backward()
            opt.step()
        return model.eval()
    return fit_fn


def test_run_analyses_end_to_end_on_a_tiny_bert(bert):
    texts, labels = _texts(40)
    train = cv.extract_activations(bert, texts, labels, layers=(1, 3), min_count=0, max_per_type=None)
    dtexts, dlabels = _texts(24, seed=1)
    order = sorted(range(24), key=lambda i: -dlabels[i])  # class 1 first: the 20 scored are 12 + 8, chance 0.6
    dtexts, dlabels = [dtexts[i] for i in order], [dlabels[i] for i in order]
    dev = cv.extract_activations(bert, dtexts, dlabels, layers=(1, 3), min_count=0, max_per_type=None)
    cfg = cv.Config(d_model=32, codebook_size=6, dec_layers=1, dec_heads=2, dec_ffn=32, init_iters=5,
                    init_restarts=1, kernels="torch")
    for k, v in dict(sae_latents=16, sae_k=4, sae_steps=20, sae_ablate_k=2, probe_folds=3, ig_steps=4,
                     kmeans_restarts=1, kmeans_iters=5, cards_per_method=3, fidelity_sentences=20).items():
        setattr(cfg, k, v)
    calls = []
    fit = _tiny_fit(calls)
    model = fit(cfg, train, dev, torch.device("cpu"), print, "clvq")
    res = cv.run_analyses(cfg, bert, train, dev, model, fit, torch.device("cpu"), log=lambda s: None)
    import json

    json.dumps({k: v for k, v in res.items() if k != "models"})  # JSON-able, but for the baselines' models
    assert calls[-1] == ("vq-l1-h1", True)  # the single-layer baseline is trained on x_l -> x_l
    assert list(res["models"]) == ["VQ-VAE l1->h1"] and res["models"]["VQ-VAE l1->h1"] is not model
    names = [w["method"] for w in res["fidelity"]]
    assert names == ["CLVQ-VAE l1->h3", "k-means", "VQ-VAE l1->h1", "top-k SAE"]
    assert set(res["coherence"]) == set(names) and list(res["baselines"]) == names[1:]  # CLVQ-VAE is no baseline
    for b in res["baselines"].values():
        assert isinstance(b["fit_seconds"], float) and "seconds" not in b["settings"]  # the time once
    orig = {w["acc_orig"] for w in res["fidelity"]}
    assert len(orig) == 1  # one probe per fold, shared by every method
    for w in res["fidelity"]:
        assert all(0 <= w[k] <= 1 for k in ("acc_orig", "acc_concept", "acc_random"))
        assert w["n_sentences"] == 20 and w["folds"] == 3  # the first 20 dev sentences (fidelity_sentences)
    assert res["fidelity"][-1]["rank"] == 2  # the SAE removes a 2-d encoder subspace
    for n in names:
        assert cv.html.escape(n) in res["cards_html"]
    assert res["fidelity_info"]["sentences"] == 20
    assert res["fidelity_info"]["probe_chance"] == pytest.approx(0.6)  # from the class balance, not 1 / classes
    assert len(res["fidelity_info"]["salient_codes"]["k-means"]) == 20


def test_salient_rows_stay_in_their_sentence_and_skip_the_last_token(bert):
    texts, labels = _texts(12)
    acts = cv.extract_activations(bert, texts, labels, layers=(1, 3), min_count=0, max_per_type=None)
    torch.manual_seed(2)
    head = torch.nn.Linear(32, 2).requires_grad_(False)
    cfg = cv.Config()
    cfg.ig_steps = 4
    sal = cv.salient_rows(cfg, bert, head, acts, log=lambda s: None)
    b = acts.bounds
    for s, r in enumerate(sal["rows"].tolist()):
        assert int(b[s]) <= r < int(b[s + 1]) - 1  # never the final [SEP]
        assert acts.words[r] != "[SEP]"
    # the chosen unit is the best-scored one by the section's own word scores
    words, enc = cv._encode(bert, texts[:1])
    ig = cv.integrated_gradients(bert, head, enc["input_ids"][0], enc["special_tokens_mask"][0], 1, 4)
    ws = cv.word_scores(ig["attr"], words[0], enc["offset_mapping"][0], enc["special_tokens_mask"][0])
    a_cls = (ig["attr"] / ig["attr"].norm()).abs()[0]
    best = int(ws.argmax())
    expect_pos = -1 if a_cls > ws[best] else best
    assert int(acts.pos[int(sal["rows"][0])]) == expect_pos


def test_salient_rows_exclude_the_last_row_when_it_is_a_word(bert):
    """With the filter capping [SEP] (as on train), most sentences end on a word row: the last row is still
    excluded ("last token excluded", §6.1), and the pick is the best of the others by the section's scores."""
    texts, labels = _texts(30, seed=3)
    acts = cv.extract_activations(bert, texts, labels, layers=(1, 3), min_count=0, max_per_type=3)
    torch.manual_seed(2)
    head = torch.nn.Linear(32, 2).requires_grad_(False)
    cfg = cv.Config()
    cfg.ig_steps = 4
    sal = cv.salient_rows(cfg, bert, head, acts, log=lambda s: None)
    words, enc = cv._encode(bert, texts)
    b, last_would_win = acts.bounds, 0
    for s in range(len(texts)):
        ig = cv.integrated_gradients(bert, head, enc["input_ids"][s], enc["special_tokens_mask"][s], 1, 4)
        ws = cv.word_scores(ig["attr"], words[s], enc["offset_mapping"][s], enc["special_tokens_mask"][s])
        a0 = float((ig["attr"] / ig["attr"].norm()).abs()[0])
        rows = list(range(int(b[s]), int(b[s + 1])))
        score = {r: a0 if int(acts.pos[r]) == -1 else float(ws[int(acts.pos[r])]) if
                 0 <= int(acts.pos[r]) < len(words[s]) else float("-inf") for r in rows}
        cand = rows[:-1] if len(rows) > 1 else rows  # a sentence left with one row ([CLS]) keeps it
        assert int(sal["rows"][s]) == max(cand, key=lambda r: score[r])
        last_would_win += max(rows, key=lambda r: score[r]) == rows[-1]
    assert last_would_win > 0  # the exclusion changed the pick somewhere, so this test can fail
