"""clvq_vae.py's prompted zero-shot path for decoder LMs (spec §5.2, §6.1 step 1; --decoder-prompt): the prompt
wraps each passage, the label words are single tokens, the classifier is the LM's next-token logits of the label
tokens at the prompt's end, the activation cache is keyed by the prompt, the passage's words keep their rows and
positions, encoders ignore the switch and --decoder-prompt none is the old path. Offline, on a tiny GPT-2 with
its LM head built in tmp_path."""
import pytest
import torch

import clvq_vae as C
from common import DataError
from test_clvq_data import _save_tiny_bert, _tiny_bpe_tokenizer

CPU = dict(ddp=False, rank=0, local_rank=0, world=1)


@pytest.fixture(scope="module", autouse=True)
def _offline():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


def _save_gpt2(folder, positions=1024, head=True, tie=True):
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

    folder.mkdir(parents=True, exist_ok=True)
    tok = _tiny_bpe_tokenizer()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=positions, bos_token_id=0,
                     eos_token_id=0, tie_word_embeddings=tie)
    (GPT2LMHeadModel if head else GPT2Model)(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _save_gpt2(tmp_path_factory.mktemp("tiny-gpt2-lm"))


@pytest.fixture(scope="module")
def lm(folder):
    """The tiny GPT-2 loaded for the prompt, with the plays' prompt set (as load_activations does)."""
    src = C.load_source_model(str(folder), causal_lm=True)
    src.prompt = C.dataset_prompt("shakespeare", ["comedies", "tragedies"])
    return src


TEXTS = ["the cat sat on the mat .", "a dog ran", "the cats sat , o'er the mat"]


def _hand_logits(src, text):
    """The LM's own next-token logits at the end of the prompted string, from its full forward (logits head)."""
    pre, post = src.prompt.parts()
    ids = src.tokenizer(pre + " ".join(C.split_words(text)) + post, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        return src.lm(input_ids=ids).logits[0, -1]


def test_prompts_follow_the_paper_pattern_and_fit_the_labels():
    p = C.dataset_prompt("shakespeare", ["comedies", "histories", "tragedies"])
    assert p.labels == ("0", "1", "2") and p.template.count("{x}") == 1
    assert "Respond with 0 for comedies, 1 for histories or 2 for tragedies. PASSAGE: {x}. CLASSIFICATION: " \
        in p.template
    assert C.dataset_prompt("imdb", ["neg", "pos"]).template.endswith(
        "Respond with 1 for positive or 0 for negative. REVIEW: {x}. CLASSIFICATION: ")
    assert "0 for World, 1 for Sports, 2 for Business or 3 for Sci/Tech" in \
        C.dataset_prompt("ag_news", ["World", "Sports", "Business", "Sci/Tech"]).template
    for bad in [("ag_news", ["a", "b", "c", "d"]), ("imdb", ["pos", "neg"]), ("wiki", ["a", "b"])]:
        with pytest.raises(DataError) as e:
            C.dataset_prompt(*bad)
        assert "\n" not in str(e.value) and "--decoder-prompt none" in str(e.value)


def test_the_prompt_wraps_the_text_and_label_words_are_single_tokens(lm):
    words, enc = C._encode(lm, TEXTS)
    pre, post = lm.prompt.parts()
    for ws, ids in zip(words, enc["input_ids"]):
        assert ids == lm.tokenizer(pre + " ".join(ws) + post)["input_ids"]
    ids = C.label_token_ids(lm, lm.prompt.labels)
    assert [lm.tokenizer.convert_ids_to_tokens(i) for i in ids] == ["0", "1"]
    with pytest.raises(DataError) as e:
        C.label_token_ids(lm, ["0", "tragedy"])  # "tragedy" is no token of this vocabulary
    assert "'tragedy'" in str(e.value) and "single tokens" in str(e.value) and "\n" not in str(e.value)


def test_the_classifier_is_the_lms_next_token_logits_of_the_label_tokens(lm):
    head = C.label_token_head(lm, TEXTS[0])
    ids = C.label_token_ids(lm, ["0", "1"])
    feats = C.top_features(lm, TEXTS)  # batched: right padding, so each row's last token is at another position
    for text, f in zip(TEXTS, feats):
        want = _hand_logits(lm, text)[ids]
        torch.testing.assert_close(head(f), want, rtol=1e-5, atol=1e-5)
    # IG explains that logit: target = the argmax over the label tokens, f(x) = its logit
    words, enc = C._encode(lm, TEXTS[1:2])
    ig = C.integrated_gradients(lm, head, enc["input_ids"][0], enc["special_tokens_mask"][0], 1, steps=8)
    want = _hand_logits(lm, TEXTS[1])[ids]
    assert ig["target"] == int(want.argmax()) and ig["f_x"] == pytest.approx(float(want.max()), abs=1e-4)
    assert float(ig["attr"].sum()) == pytest.approx(ig["f_x"] - ig["f_base"], abs=2e-3)  # complete (pad baseline)


def test_the_cache_key_changes_with_the_prompt(folder, tmp_path):
    src = C.load_source_model(str(folder), causal_lm=True)
    args = ("toy", ["the cat"], [0], (1, 2), 0, None, tmp_path)
    bare, spec = C.activation_cache_path(src, *args)
    assert "prompt" not in spec  # the unprompted key is the one from before prompts existed
    src.prompt = C.dataset_prompt("shakespeare", ["comedies", "tragedies"])
    plays, spec = C.activation_cache_path(src, *args)
    assert spec["prompt"] == src.prompt.template
    src.prompt = C.Prompt(src.prompt.template.replace("genre", "kind"), ("0", "1"))
    other, _ = C.activation_cache_path(src, *args)
    assert len({bare, plays, other}) == 3


def test_passage_words_keep_their_rows_and_positions_under_the_prompt(lm):
    acts = C.extract_activations(lm, TEXTS, layers=(1, 2), min_count=0, max_per_type=None)
    pre, post = lm.prompt.parts()
    for s, text in enumerate(TEXTS):
        words = C.split_words(text)
        rows = acts.sent == s
        assert [acts.words[i] for i in rows.nonzero()[:, 0]] == words  # the passage's words only, in order
        assert acts.pos[rows].tolist() == list(range(len(words)))
        # by hand: each word's last subword = the token covering the word's last character in the prompted string
        prompted = pre + " ".join(words) + post
        enc = lm.tokenizer(prompted, return_offsets_mapping=True, return_tensors="pt")
        offs = enc["offset_mapping"][0].tolist()
        last, c = [], len(pre)
        for w in words:
            end = c + len(w) - 1
            last.append(max(t for t, (a, b) in enumerate(offs) if a <= end < b))
            c += len(w) + 1
        with torch.no_grad():
            hs = lm.model(input_ids=enc["input_ids"], output_hidden_states=True).hidden_states
        torch.testing.assert_close(acts.x_l[rows], hs[1][0, last])
        torch.testing.assert_close(acts.x_h[rows], hs[2][0, last])
    assert not acts.special.any() and len(acts.words) == sum(len(C.split_words(t)) for t in TEXTS)


def test_a_prompted_passage_past_the_window_is_one_line(tmp_path):
    src = C.load_source_model(str(_save_gpt2(tmp_path / "short", positions=64)), causal_lm=True)
    src.prompt = C.dataset_prompt("shakespeare", ["comedies", "tragedies"])
    with pytest.raises(DataError) as e:
        C.extract_activations(src, ["the cat sat"], layers=(1, 2), min_count=0, max_per_type=None)
    assert "longer than" in str(e.value) and "64 tokens" in str(e.value) and "\n" not in str(e.value)


def test_a_model_without_a_trained_lm_head_is_refused_for_the_prompt(tmp_path):
    folder = _save_gpt2(tmp_path / "bare", head=False, tie=False)  # untied: the LM head would be random
    with pytest.raises(DataError) as e:
        C.load_source_model(str(folder), causal_lm=True)
    assert "no trained LM head" in str(e.value) and "\n" not in str(e.value)
    assert C.load_source_model(str(folder)).lm is None  # without the prompt it loads as before


def _load(src, tmp_path, monkeypatch, **kw):
    monkeypatch.setattr(C, "load_source_model", lambda *a, **k: src)
    lines = []
    cfg = C.Config(model="tiny", cache_dir=str(tmp_path), per_class=3, dev_per_class=2, max_words=60, min_count=1,
                   layer_l=1, layer_h=2, **kw)
    return (*C.load_activations(cfg, torch.device("cpu"), CPU, lines.append), lines)


def test_load_activations_prompts_a_decoder_by_default(folder, tmp_path, monkeypatch):
    src = C.load_source_model(str(folder), causal_lm=True)
    bare = C.load_source_model(str(folder))  # before _load replaces the loader
    src, tr, dv, lines = _load(src, tmp_path, monkeypatch)
    assert src.prompt == C.dataset_prompt("shakespeare", ["comedies", "tragedies"]) and src.head is None
    assert any(line.startswith("prompt: tiny is a decoder, used zero-shot") for line in lines)
    assert not any("no prompt" in line for line in lines)
    for acts in (tr, dv):  # the rows are the passages' words, never the template's
        assert all(acts.words[i] == C.split_words(acts.texts[int(acts.sent[i])])[int(acts.pos[i])]
                   for i in range(len(acts.words)))
    assert len(dv.words) == sum(len(C.split_words(t)) for t in dv.texts)
    assert (tmp_path / "clvq-activations").exists()
    bare_tr = _load(bare, tmp_path, monkeypatch, decoder_prompt="none")[1]
    assert not torch.equal(tr.x_l, bare_tr.x_l)  # another cache entry: the prompted states differ


def test_encoders_ignore_the_prompt_switch(tmp_path, monkeypatch):
    folder = _save_tiny_bert(tmp_path / "bert")
    got, srcs = {}, {m: C.load_source_model(str(folder), causal_lm=m == "paper") for m in ("paper", "none")}
    for mode in ("paper", "none"):
        src, tr, _, _ = _load(srcs[mode], tmp_path, monkeypatch, decoder_prompt=mode, finetune_epochs=0)
        assert src.prompt is None and src.lm is None and src.readout == "encoder"
        got[mode] = tr
    assert torch.equal(got["paper"].x_l, got["none"].x_l) and got["paper"].words == got["none"].words


def test_decoder_prompt_none_is_the_unprompted_path(folder, tmp_path, monkeypatch):
    src = C.load_source_model(str(folder))
    src, tr, _, lines = _load(src, tmp_path, monkeypatch, decoder_prompt="none")
    assert src.prompt is None and src.lm is None and src.readout == "decoder"
    assert ("fine-tuning: tiny is a decoder, not fine-tuned: the frozen LM + a trained linear head, no prompt "
            "(not the paper's prompted zero-shot use, §5.2)") in lines
    words, enc = C._encode(src, TEXTS)  # the bare joined words, truncated to the window as before
    want = src.tokenizer([" ".join(w) for w in words], truncation=True, max_length=src.max_tokens,
                         return_offsets_mapping=True)
    assert enc["input_ids"] == want["input_ids"] and enc["offset_mapping"] == want["offset_mapping"]


def test_fidelity_runs_with_the_prompted_classifier(lm):
    texts = ["the cat sat on the mat", "a dog ran on the mat", "the cats sat", "a cat ran"] * 3
    labels = [1, 0, 1, 0] * 3
    train = C.extract_activations(lm, texts, labels, layers=(1, 2), min_count=0, max_per_type=None)
    dev = C.extract_activations(lm, texts[::-1], labels[::-1], layers=(1, 2), min_count=0, max_per_type=None)
    cfg = C.Config(d_model=32, codebook_size=4, kmeans_restarts=1, kmeans_iters=3, probe_folds=2, ig_steps=4,
                   probe_epochs=5)
    method = C.kmeans_method(cfg, train.x_l, torch.device("cpu"), log=lambda s: None)
    lines = []
    table, info = C.run_fidelity(cfg, lm, train, dev, [method], lines.append)
    assert info["classifier"].startswith("the prompted LM's next-token logits of '0', '1'")
    head = C.label_token_head(lm, texts[0])
    ids = C.label_token_ids(lm, ["0", "1"])
    pred = [int(_hand_logits(lm, t)[ids].argmax()) for t in dev.texts]
    acc = sum(p == y for p, y in zip(pred, dev.labels)) / len(pred)
    assert info["head_dev_accuracy"] == pytest.approx(acc)  # zero-shot: the argmax over the label tokens
    assert head.weight.requires_grad is False and table[0]["method"] == "k-means"
    assert len(info["salient_rows"]) == len(dev.texts)  # one per sentence
    for r, s in zip(info["salient_rows"], range(len(dev.texts))):
        assert int(dev.sent[r]) == s  # the salient row is one of the sentence's own words


def test_salient_rows_under_the_prompt_may_pick_the_passages_last_word(lm):
    """§6.1 excludes the input's last token: with a prompt that is the template's end (no row), so every word of the
    passage is a candidate, its last one included (unprompted, the last row is the input's last token)."""
    texts = ["the cat sat on the mat", "a dog ran on the mat", "the cats sat", "a cat ran", "the dog sat on a mat",
             "a cat sat", "the mat ran", "a dog sat on the cat"]
    acts = C.extract_activations(lm, texts, [0] * len(texts), layers=(1, 2), min_count=0, max_per_type=None)
    head = C.label_token_head(lm, texts[0])
    sal = C.salient_rows(C.Config(ig_steps=4), lm, head, acts, log=lambda s: None)
    words, enc = C._encode(lm, texts)
    b, last_wins = acts.bounds, 0
    for s in range(len(texts)):
        ig = C.integrated_gradients(lm, head, enc["input_ids"][s], enc["special_tokens_mask"][s], 1, 4)
        ws = C.word_scores(ig["attr"], words[s], enc["offset_mapping"][s], enc["special_tokens_mask"][s])
        rows = list(range(int(b[s]), int(b[s + 1])))
        best = max(rows, key=lambda r: (float(ws[int(acts.pos[r])]), -r))
        assert int(sal["rows"][s]) == best and sal["targets"][s] == ig["target"]
        last_wins += best == rows[-1]
    assert last_wins > 0  # the passage's last word was picked somewhere, so this test can fail


RUN = ["--per-class", "6", "--dev-per-class", "2", "--max-words", "60", "--min-count", "1", "--layer-l", "1",
       "--layer-h", "2", "--codebook-size", "6", "--dec-layers", "1", "--dec-heads", "2", "--dec-ffn", "16",
       "--init-restarts", "1", "--init-iters", "2", "--batch-size", "4", "--max-iters", "2", "--baselines", "",
       "--no-cards", "--kernels", "torch"]


def test_a_decoder_run_explains_the_prompted_lm_end_to_end(folder, tmp_path, capsys, monkeypatch):
    from conftest import call_main

    out = tmp_path / "out"
    rc, err = call_main(C.main, ["--model", str(folder), *RUN, "--ig-steps", "2", "--probe-folds", "2",
                                 "--probe-epochs", "5", "--out-dir", str(out), "--cache-dir", str(tmp_path)],
                        capsys, monkeypatch)
    assert rc == 0, err
    log = (out / "log-clvq-l1-h2.txt").read_text()
    assert "prompt: " in log and "classifier = the prompted LM's next-token logits of '0', '1'" in log
    res = __import__("json").loads((out / "results.json").read_text())
    assert res["fidelity_info"]["classifier"].startswith("the prompted LM's")
    config = torch.load(out / "ckpt-clvq-l1-h2.pt", weights_only=True)["config"]
    assert config["decoder_prompt"] == "paper" and config["lr"] == 1e-3  # a decoder's lr (spec §4), not 5e-3
    assert f"note: {folder} is a decoder LM: the spec's settings for it, lr=0.001 (§2.1, §4; a typed flag wins)" in log


def test_decoder_and_llama_source_models_take_the_spec_settings():
    """Spec §2.1, §4: lr 1e-3 and batch 64 for decoder LLMs, K = 600 for LLaMA; a typed flag, and the CPU preset's
    own values, win; an encoder keeps the defaults."""
    from types import SimpleNamespace

    def src(kind, model_type):
        return SimpleNamespace(kind=kind, model=SimpleNamespace(config=SimpleNamespace(model_type=model_type)))
    cfg, changed = C.apply_source_settings(C.Config(), (), "paper", src("decoder", "llama"))
    assert (cfg.lr, cfg.batch_size, cfg.codebook_size) == (1e-3, 64, 600)
    assert changed == ["lr=0.001", "batch_size=64", "codebook_size=600"]
    cfg, changed = C.apply_source_settings(C.Config(), ("lr",), "paper", src("decoder", "qwen2"))
    assert (cfg.lr, cfg.batch_size, cfg.codebook_size) == (5e-3, 64, 400) and changed == ["batch_size=64"]
    cfg, changed = C.apply_source_settings(C.Config(batch_size=32, codebook_size=128), (), "cpu",
                                           src("decoder", "llama"))
    assert (cfg.lr, cfg.batch_size, cfg.codebook_size) == (1e-3, 32, 128) and changed == ["lr=0.001"]
    assert C.apply_source_settings(C.Config(), (), "paper", src("encoder", "bert")) == (C.Config(), [])


def test_a_typed_decoder_prompt_is_noted_for_an_encoder(tmp_path, capsys, monkeypatch):
    from conftest import call_main

    folder = _save_tiny_bert(tmp_path / "bert")
    out = tmp_path / "out"
    rc, err = call_main(C.main, ["--model", str(folder), *RUN, "--finetune-epochs", "0", "--no-fidelity",
                                 "--decoder-prompt", "paper", "--out-dir", str(out), "--cache-dir", str(tmp_path)],
                        capsys, monkeypatch)
    assert rc == 0, err
    log = (out / "log-clvq-l1-h2.txt").read_text()
    assert f"note: --decoder-prompt has no effect in this run ({folder} is an encoder, fine-tuned per task)" in log
    assert "prompt: " not in log
