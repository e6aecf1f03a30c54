"""clvq_vae.py's data section: source model loading, word alignment, the frequency filter, the activation cache,
sentence representations, padding and the labelled passages. Offline, on tiny random HF models built in tmp_path."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import clvq_vae as C
from common import DataError
from conftest import half_written_save


@pytest.fixture(scope="module", autouse=True)
def _offline():
    """No test here may touch the network: the hub is off for the whole module (module-scoped fixtures included)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


# A hand-made WordPiece vocabulary: "unbelievably" -> un ##believ ##ably, "cats" -> cat ##s, so the last
# subword differs from the first one and from the whole word.
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "##s", "sat", "un", "##believ", "##ably",
         "tragic", "o", "'", "er", ",", "!", ".", "a", "dog", "ran", "on", "mat", "hills", "my", "house"]


def _save_tiny_bert(folder, seed=0, layers=2):
    from transformers import BertConfig, BertModel, BertTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    tok = BertTokenizer(vocab=str(folder / "vocab.txt"))
    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=len(VOCAB), hidden_size=32, num_hidden_layers=layers, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64)
    BertModel(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _tiny_bpe_tokenizer():
    """A byte-level BPE tokenizer that prepends a BOS <s> (as LLaMA's does), trained on a few lines (the digits
    are single tokens: the byte alphabet)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["the cat sat on the mat", "a dog ran", "the cats sat"] * 5,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "<pad>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", pad_token="<pad>")


def _save_tiny_gpt2(folder):
    """A byte-level BPE decoder (_tiny_bpe_tokenizer) without an LM head, 64 positions."""
    from transformers import GPT2Config, GPT2Model

    folder.mkdir(parents=True, exist_ok=True)
    tok = _tiny_bpe_tokenizer()
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2, n_positions=64,
                     bos_token_id=0, eos_token_id=0)
    GPT2Model(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return C.load_source_model(str(_save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    return C.load_source_model(str(_save_tiny_gpt2(tmp_path_factory.mktemp("tiny-gpt2"))))


def test_tiny_bert_loads_through_the_model_path(bert):
    assert (bert.kind, bert.n_layers, bert.d_model, bert.max_tokens) == ("encoder", 2, 32, 64)
    assert bert.tokenizer.is_fast and not bert.model.training


def test_default_model_is_the_packaged_minilm():
    folder = C._packaged_folder(C.DEFAULT_MODEL)
    assert (folder / "model.safetensors").exists() and (folder / "tokenizer.json").exists()
    src = C.load_source_model()  # offline (HF_HUB_OFFLINE=1): must come from the package folder
    assert (src.kind, src.n_layers, src.d_model) == ("encoder", 6, 384)


def test_last_subword_is_chosen(bert):
    text = "the cats unbelievably sat!"
    acts = C.extract_activations(bert, [text], layers=(1, 2), min_count=0, max_per_type=None)
    assert acts.words == ["[CLS]", "the", "cats", "unbelievably", "sat", "!", "[SEP]"]
    assert acts.pos.tolist() == [-1, 0, 1, 2, 3, 4, 5]
    enc = bert.tokenizer(text, return_tensors="pt")
    toks = bert.tokenizer.convert_ids_to_tokens(enc["input_ids"][0])
    assert toks == ["[CLS]", "the", "cat", "##s", "un", "##believ", "##ably", "sat", "!", "[SEP]"]
    hs = bert.model(**enc, output_hidden_states=True).hidden_states
    expect = [0, 1, 3, 6, 7, 8, 9]  # [CLS], the, ##s, ##ably, sat, !, [SEP]
    torch.testing.assert_close(acts.x_l, hs[1][0, expect])
    torch.testing.assert_close(acts.x_h, hs[2][0, expect])
    assert not torch.allclose(acts.x_l[3], hs[1][0, 4])  # not the first subword "un"
    # offsets on the joined words agree with word_ids on pre-split words for a WordPiece tokenizer
    words = C.split_words(text)
    pre = bert.tokenizer(words, is_split_into_words=True)
    by_ids = {w: t for t, w in enumerate(pre.word_ids()) if w is not None}
    enc2 = bert.tokenizer(" ".join(words), return_offsets_mapping=True, return_special_tokens_mask=True)
    assert C.align_words(words, enc2["offset_mapping"], enc2["special_tokens_mask"]) == \
        [by_ids[i] for i in range(len(words))]


def test_word_split_is_moses_like():
    assert C.split_words("O'er the hills, my father's house!--") == \
        ["O'er", "the", "hills", ",", "my", "father's", "house", "!", "-", "-"]


def test_align_marks_truncated_word_missing():
    # "unbelievably" is cut after "un##believ": its last subword is gone, so it has no row
    words = ["the", "unbelievably"]
    offsets = [(0, 0), (0, 3), (4, 6), (6, 12)]
    assert C.align_words(words, offsets, [1, 0, 0, 0]) == [1, -1]


def test_frequency_filter_min_count_and_cap():
    units = [["[CLS]", "a", "b", "a", "c"], ["[CLS]", "a", "b", "d"], ["[CLS]", "a", "b", "c"]]
    keep = C.frequency_filter(units, min_count=2, max_per_type=2, exempt={"[CLS]"})
    assert keep == [[True, True, True, True, True],     # a(1) b(1) a(2) c(1)
                    [True, False, True, False],         # a capped, b(2), d below min_count
                    [True, False, False, True]]         # a, b capped; c(2); [CLS] exempt from the cap
    assert C.frequency_filter(units, min_count=0, max_per_type=None) == [[True] * len(u) for u in units]


def test_encoder_keeps_every_cls_and_caps_sep(bert):
    texts = ["the cat sat.", "the dog ran.", "a cat ran.", "the mat.", "my house!"]
    acts = C.extract_activations(bert, texts, layers=(0, 2), min_count=2, max_per_type=2)
    words = acts.words
    assert words.count("[CLS]") == 5 and words.count("[SEP]") == 2
    assert words.count("the") == 2 and words.count(".") == 2 and "house" not in words  # cap, min_count
    assert acts.bounds.tolist()[-1] == acts.x_l.shape[0] and bool((acts.sent[1:] >= acts.sent[:-1]).all())
    r = C.sentence_representations(acts)  # [CLS] at layer l: hidden_states[0][:, 0] here
    enc = bert.tokenizer(texts[3], return_tensors="pt")
    torch.testing.assert_close(r[3], bert.model(**enc, output_hidden_states=True).hidden_states[0][0, 0])
    xl, xh, mask = C.pad_sentences(acts, [3, 0])
    b = acts.bounds
    assert mask.sum(1).tolist() == [int(b[4] - b[3]), int(b[1] - b[0])]
    torch.testing.assert_close(xh[1, :int(b[1])], acts.x_h[:int(b[1])])
    assert xl[0, int(b[4] - b[3]):].abs().sum() == 0


def test_decoder_drops_bos_and_mean_pools(gpt2):
    assert gpt2.kind == "decoder"
    texts = ["the dogs sat on the mat", "a dog ran"]
    acts = C.extract_activations(gpt2, texts, layers=(1, 2), min_count=0, max_per_type=None)
    assert acts.words == C.split_words(texts[0]) + C.split_words(texts[1]) and not acts.special.any()
    enc = gpt2.tokenizer(texts[0], return_tensors="pt")
    toks = gpt2.tokenizer.convert_ids_to_tokens(enc["input_ids"][0])
    assert toks == ["<s>", "the", "Ġdog", "s", "Ġsat", "Ġon", "Ġthe", "Ġmat"]  # BOS, and "dogs" in two pieces
    hs = gpt2.model(**enc, output_hidden_states=True).hidden_states
    last = [1, 3, 4, 5, 6, 7]  # no BOS row; "dogs" -> "s"
    # batched with the shorter sentence, right padding changes nothing for the causal model
    torch.testing.assert_close(acts.x_l[acts.sent == 0], hs[1][0, last])
    torch.testing.assert_close(acts.x_h[acts.sent == 0], hs[2][0, last])
    torch.testing.assert_close(C.sentence_representations(acts)[0], hs[1][0, last].mean(0))
    torch.testing.assert_close(C.sentence_representations(acts, "last")[0], hs[1][0, 7])
    with pytest.raises(DataError):
        C.sentence_representations(acts, "cls")


def test_layers_are_checked(bert):
    with pytest.raises(DataError, match="0 <= l <= h <= 2"):
        C.extract_activations(bert, ["the cat"], layers=(2, 3))


def test_cache_is_reused_and_keyed(bert, tmp_path, monkeypatch):
    texts, labels = ["the cat sat.", "a dog ran!"], [0, 1]
    a = C.cached_activations(bert, "toy", texts, labels, (1, 2), 0, None, cache_dir=tmp_path)
    files = list((tmp_path / "clvq-activations").iterdir())
    assert len(files) == 1 and not files[0].name.startswith(".")

    def boom(*args, **kw):
        raise AssertionError("extracted again instead of reusing the cache")

    monkeypatch.setattr(C, "extract_activations", boom)
    b = C.cached_activations(bert, "toy", texts, labels, (1, 2), 0, None, cache_dir=tmp_path)
    assert torch.equal(a.x_l, b.x_l) and torch.equal(a.x_h, b.x_h) and a.words == b.words and b.labels == labels
    base = dict(dataset="toy", texts=texts, labels=labels, layers=(1, 2), min_count=0, max_per_type=None)
    for other in [dict(layers=(0, 2)), dict(min_count=2), dict(texts=texts[::-1]), dict(labels=[1, 0]),
                  dict(max_per_type=1), dict(dataset="other")]:  # each a part of the key
        with pytest.raises(AssertionError, match="extracted again"):
            C.cached_activations(bert, **{**base, **other}, cache_dir=tmp_path)
    # a file whose stored key is not the one its name stands for (renamed, or written by other code) is refused
    sd = torch.load(files[0], weights_only=True)
    sd["spec"]["n"] += 1
    torch.save(sd, files[0])
    with pytest.raises(DataError, match=r"activation cache .* is unreadable \(ValueError\); delete it"):
        C.cached_activations(bert, **base, cache_dir=tmp_path)
    # a NaN row (a damaged file) is the cache's error, not a non-finite loss blamed on training
    sd["spec"]["n"] -= 1
    sd["x_l"][1, 0] = float("nan")
    torch.save(sd, files[0])
    with pytest.raises(DataError, match=r"activation cache .* holds non-finite activations \(a damaged file\); delete"):
        C.cached_activations(bert, **base, cache_dir=tmp_path)


def test_a_failed_cache_write_is_one_line_and_keeps_the_old_file(tmp_path, monkeypatch):
    """_save_cache writes a temporary file and renames it: a write that fails (a full disk) is a one-line DataError
    naming the file, the file already there is intact and no temporary file is left."""
    path = tmp_path / "clvq-activations" / "x.pt"
    C._save_cache({"v": 1}, path, "activation cache")
    monkeypatch.setattr(torch, "save", half_written_save)
    with pytest.raises(DataError, match=f"^activation cache {re.escape(str(path))}: No space left on device$"):
        C._save_cache({"v": 2}, path, "activation cache")
    monkeypatch.undo()
    assert torch.load(path, weights_only=True) == {"v": 1} and [f.name for f in path.parent.iterdir()] == ["x.pt"]


def test_cache_key_changes_with_the_weights(tmp_path):
    s1 = C.load_source_model(str(_save_tiny_bert(tmp_path / "m1", seed=1, layers=1)))
    s2 = C.load_source_model(str(_save_tiny_bert(tmp_path / "m2", seed=2, layers=1)))
    p1, _ = C.activation_cache_path(s1, "toy", ["x"], [0], (0, 1), 5, 20, tmp_path)
    p2, _ = C.activation_cache_path(s2, "toy", ["x"], [0], (0, 1), 5, 20, tmp_path)
    assert s1.fingerprint != s2.fingerprint and p1 != p2


@pytest.mark.parametrize("damage", ["garbage", "truncate", "wrong-layout", "wrong-width"])
def test_corrupt_cache_is_one_line_error_naming_the_file(bert, tmp_path, damage):
    texts, labels = ["the cat sat."], [0]
    C.cached_activations(bert, "toy", texts, labels, (1, 2), 0, None, cache_dir=tmp_path)
    (path,) = (tmp_path / "clvq-activations").iterdir()
    if damage == "garbage":
        path.write_bytes(b"not a torch file")
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:200])
    else:  # rows that do not line up, or of another width than the source model's (consistent among themselves)
        sd = torch.load(path, weights_only=True)
        if damage == "wrong-layout":
            sd["x_h"] = sd["x_h"][:1]
        else:
            sd["x_l"], sd["x_h"] = sd["x_l"][:, :16], sd["x_h"][:, :16]
        torch.save(sd, path)
    with pytest.raises(DataError) as e:
        C.cached_activations(bert, "toy", texts, labels, (1, 2), 0, None, cache_dir=tmp_path)
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg and "delete it" in msg


def test_offline_hub_name_fails_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty HF cache: nothing to fall back on
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    with pytest.raises(DataError) as e:
        C.load_source_model("FacebookAI/roberta-base")
    msg = str(e.value)
    assert "\n" not in msg and "offline" in msg and C.DEFAULT_MODEL in msg
    with pytest.raises(DataError, match="does not exist"):
        C.load_source_model(str(tmp_path / "no-such-model"))
    (tmp_path / "weights.txt").write_text("not a model")  # a file, which was reported as missing
    with pytest.raises(DataError, match=r"--model .*weights.txt is a file; it takes a model folder"):
        C.load_source_model(str(tmp_path / "weights.txt"))


def test_passages_are_balanced_bounded_and_seeded():
    a = C.load_passages("shakespeare", "train", per_class=15, max_words=80, seed=3)
    b = C.load_passages("shakespeare", "train", per_class=15, max_words=80, seed=3)
    assert a.label_names == ["comedies", "tragedies"] and a.texts == b.texts
    assert sorted(a.labels) == [0] * 15 + [1] * 15 and a.labels != sorted(a.labels)  # shuffled
    assert all(40 <= len(t.split()) and len(C.split_words(t)) <= 80 for t in a.texts)
    assert set(a.splits) == {"train"} and not {"Twelfth Night", "Macbeth"} & set(a.groups)
    dev = C.load_passages("shakespeare", "val", per_class=None)
    assert set(dev.groups) == {"Twelfth Night", "Macbeth"} and dev.labels.count(0) == dev.labels.count(1)
    with pytest.raises(DataError, match="fewer than"):
        C.load_passages("shakespeare", "val", per_class=10_000)


def test_hub_passages_balanced_with_stand_in(monkeypatch):
    import common

    rows = {"train": [{"text": f"news story {i} .", "label": i % 4} for i in range(40)],
            "test": [{"text": f"test story {i}", "label": i % 4} for i in range(8)]}
    monkeypatch.setattr(common, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(common, "_hub_stream", lambda name, split: iter(rows[split]))
    monkeypatch.setattr(common, "_hub_label_names", lambda name: ["World", "Sports", "Business", "Sci/Tech"])
    tr = C.load_passages("ag_news", "train", per_class=5, max_examples=30)
    assert sorted(tr.labels) == sorted([0, 1, 2, 3] * 5) and all(t.startswith("news") for t in tr.texts)
    # IMDB streams sorted by label: a short stream has one class only, and the error says what to do
    rows["train"] = [{"text": f"review {i}", "label": 0} for i in range(20)]
    monkeypatch.setattr(common, "_hub_label_names", lambda name: ["neg", "pos"])
    with pytest.raises(DataError, match="pos \\(0\\).*raise --max-examples"):
        C.load_passages("imdb", "train", per_class=5, max_examples=20)


def test_broken_model_folder_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DataError) as e:
        C.load_source_model(str(tmp_path))
    assert "\n" not in str(e.value) and "could not be loaded" in str(e.value)
    # weights and config without the tokenizer's files: transformers makes a tokenizer of the specials alone, which
    # would turn every word into [UNK] and train on it; refused instead
    folder = _save_tiny_bert(tmp_path / "no-tokenizer")
    for f in folder.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            f.unlink()
    with pytest.raises(DataError, match=rf"tokenizer has \d+ tokens against the model's vocab_size {len(VOCAB)}"):
        C.load_source_model(str(folder))


# ---------------------------------------------------------------- fine-tuning the source encoder (§5.3)

TOY = (["the cat sat on the mat.", "the cats sat!", "the cat sat, the cat sat."] * 4,
       ["a dog ran on my house.", "a dog ran!", "my dog ran, a dog ran."] * 4)
TOY_TEXTS, TOY_LABELS = TOY[0] + TOY[1], [0] * 12 + [1] * 12


def test_finetune_learns_the_task_and_is_cached(tmp_path, monkeypatch):
    """Fine-tuning fits the toy task (loss falls, the head separates the classes), changes the weights and the
    fingerprint (so the activation cache key changes), and a second load reuses the file: same weights, same
    head, no training."""
    folder = _save_tiny_bert(tmp_path / "m")
    src = C.load_source_model(str(folder))
    base_fp, base_w = src.fingerprint, src.model.embeddings.word_embeddings.weight.clone()
    lines = []
    C.cached_finetune(src, TOY_TEXTS, TOY_LABELS, 2, epochs=8, lr=3e-3, batch=4, seed=0, cache_dir=tmp_path,
                      log=lines.append)
    losses = [float(ln.split("loss ")[1].split()[0]) for ln in lines if "epoch" in ln]
    assert len(losses) == 8 and losses[-1] < 0.5 * losses[0], lines
    feats = C.top_features(src, TOY_TEXTS)
    assert (src.head(feats).argmax(-1) == torch.tensor(TOY_LABELS)).float().mean() == 1.0
    assert src.fingerprint != base_fp and not torch.equal(src.model.embeddings.word_embeddings.weight, base_w)
    assert not any(p.requires_grad for p in src.model.parameters()) and not src.model.training
    p1, _ = C.activation_cache_path(src, "toy", TOY_TEXTS, TOY_LABELS, (1, 2), 0, None, tmp_path)

    monkeypatch.setattr(C, "finetune_source", lambda *a, **k: (_ for _ in ()).throw(AssertionError("retrained")))
    again = C.load_source_model(str(folder))
    lines = []
    C.cached_finetune(again, TOY_TEXTS, TOY_LABELS, 2, epochs=8, lr=3e-3, batch=4, seed=0, cache_dir=tmp_path,
                      log=lines.append)
    assert lines[0].startswith("fine-tuning: reusing ") and again.fingerprint == src.fingerprint
    assert torch.equal(again.head.weight, src.head.weight)
    assert C.activation_cache_path(again, "toy", TOY_TEXTS, TOY_LABELS, (1, 2), 0, None, tmp_path)[0] == p1
    with pytest.raises(AssertionError, match="retrained"):  # other settings: another key, trained again
        C.cached_finetune(C.load_source_model(str(folder)), TOY_TEXTS, TOY_LABELS, 2, epochs=7, lr=3e-3, batch=4,
                          seed=0, cache_dir=tmp_path)


@pytest.mark.parametrize("damage", ["garbage", "truncate", "stored-key"])
def test_corrupt_finetune_cache_is_one_line(tmp_path, damage):
    """An unreadable file, or one whose stored key is not the one its name stands for: one line, naming it."""
    folder = _save_tiny_bert(tmp_path / "m")
    kw = dict(epochs=1, lr=1e-3, batch=8, seed=0, cache_dir=tmp_path, log=lambda m: None)
    C.cached_finetune(C.load_source_model(str(folder)), TOY_TEXTS, TOY_LABELS, 2, **kw)
    (path,) = (tmp_path / "clvq-finetuned").iterdir()
    if damage == "stored-key":
        sd = torch.load(path, weights_only=True)
        sd["spec"]["epochs"] += 1
        torch.save(sd, path)
    else:
        path.write_bytes(b"not a torch file" if damage == "garbage" else path.read_bytes()[:300])
    with pytest.raises(DataError) as e:
        C.cached_finetune(C.load_source_model(str(folder)), TOY_TEXTS, TOY_LABELS, 2, **kw)
    assert str(path) in str(e.value) and "\n" not in str(e.value) and "delete it" in str(e.value)


def test_decoders_are_not_finetuned(gpt2, tmp_path, monkeypatch):
    """load_activations fine-tunes encoders only; a decoder is left frozen and says so (here --decoder-prompt none: a
    trained linear head, no prompt; the prompted default is tests/test_clvq_prompt.py's)."""
    monkeypatch.setattr(C, "cached_finetune", lambda *a, **k: (_ for _ in ()).throw(AssertionError("fine-tuned")))
    monkeypatch.setattr(C, "load_source_model", lambda *a, **k: gpt2)
    lines = []
    cfg = C.Config(model="tiny-gpt2", cache_dir=str(tmp_path), per_class=3, dev_per_class=2, max_words=60,
                   min_count=1, layer_l=1, layer_h=2, decoder_prompt="none")
    src, tr, _ = C.load_activations(cfg, torch.device("cpu"), dict(ddp=False, rank=0, local_rank=0, world=1),
                                    lines.append)
    assert src.head is None and len(tr.texts) == 6
    assert ("fine-tuning: tiny-gpt2 is a decoder, not fine-tuned: the frozen LM + a trained linear head, no prompt "
            "(not the paper's prompted zero-shot use, §5.2)") in lines


def test_hub_kernels_are_turned_off_only_beside_glassbox_kernels(tmp_path):
    """transformers 5.25 imports Hugging Face's `kernels` by that name and loads models with hub kernels by default;
    beside glassbox's kernels.py the name is ours, so clvq_vae turns hub kernels off there, and changes nothing where
    `kernels` is another package or none (clvq_vae.py copied alone)."""
    code = "import os, clvq_vae; clvq_vae.transformers_without_hub_kernels(); print(os.environ.get('USE_HUB_KERNELS'))"
    root = Path(C.__file__).resolve().parent
    shutil.copy(root / "clvq_vae.py", tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("USE_HUB_KERNELS", "PYTHONPATH")}
    runs = [subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
            for cwd in (root, tmp_path)]
    assert [r.stdout.split()[-1:] for r in runs] == [["NO"], ["None"]], [r.stderr[-2000:] for r in runs]
