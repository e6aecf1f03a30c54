"""protot.py beyond the core op: the model and its O(1) cache, training (resume, NaN, DDP), checkpoints,
the command line, interventions, and that the script works when copied alone."""
import contextlib
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import common
from conftest import (SMALL_CORPUS, call_main, check_bad_token_batches, check_cuda_run,
                      check_ddp_weights, check_step_never_waits, run_main, run_one_and_ddp, run_script, save_envelope)
import protot
from protot import Config, ProtoT

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--layers", "2", "--d-model", "64", "--ctx", "64", "--batch-size", "8", "--max-iters", "30",
        "--log-interval", "10", "--eval-interval", "15", "--label-windows", "64", *SMALL_CORPUS, "--sample", "ROSALIND:\n"]


@pytest.fixture(scope="module")
def data(cache_dir):
    return common.load_data(cache_dir=cache_dir)


# ---------------------------------------------------------------- model

@pytest.mark.parametrize("mixer", ["proto", "attention"])
def test_cached_generation_matches_parallel_forward(mixer):
    """300 tokens fed one at a time through the per-layer cache give the parallel forward's logits."""
    cfg = Config(mixer=mixer, layers=3, d_model=32, n_protos=5, heads=2, dropout=0.0, kernels="torch")
    model = ProtoT(cfg, 50).double().eval()
    x = torch.randint(0, 50, (2, 300))
    with torch.no_grad():
        full = model(x)
        caches = [{} for _ in model.blocks]
        steps = [model(x[:, :1], caches=caches)] + [model(x[:, t:t + 1], caches=caches) for t in range(1, 300)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-9, atol=1e-9)
    if mixer == "proto":  # the cache is O(1): N [B, R, dv], M [B, R] and 4 conv values, whatever the position
        assert {k: tuple(v.shape) for k, v in caches[0].items()} == {"conv": (2, 4, 16), "N": (2, 5, 16), "M": (2, 5)}
        assert "conv" not in caches[2]


@pytest.mark.parametrize("mixer", ["proto", "attention"])
def test_an_empty_or_flat_batch_is_a_clear_error(mixer):
    model = ProtoT(Config(mixer=mixer, layers=1, d_model=16, n_protos=4, heads=2, kernels="torch"), 20)
    check_bad_token_batches(lambda idx: model.generate(idx, 2), model.generate)


@pytest.mark.parametrize("layer_id", [0, 1, 2])
def test_mixer_forward_follows_the_equations(layer_id):
    """The mixer written out from the spec, apart from the model's code: write gate softmax(x Pᵀ/|τ_w|) (1); V x
    blended half and half with the causal depthwise conv in layers 0-1 (2); the prefix mean by the recurrence;
    read gate softmax(W_r x Pᵀ/|τ_r|), or the write gate in layer 0 (5); output α U(Σ ρ PM) (6)."""
    cfg = Config(layers=3, d_model=16, n_protos=5, kernels="torch")
    torch.manual_seed(layer_id)
    m = protot.ProtoMixer(cfg, layer_id).double()
    with torch.no_grad():  # move every parameter off its initial value, so a term at its init cannot hide
        for p in m.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(2, 11, 16, dtype=torch.float64)
    w = torch.softmax(x @ m.P.t() / (m.tau_w.abs() + 1e-6), -1)  # |τ| + 1e-6: the code's guard against τ = 0
    rho = w if layer_id == 0 else torch.softmax((x @ m.W_r.weight.t()) @ m.P.t() / (m.tau_r.abs() + 1e-6), -1)
    v = x @ m.V.weight.t()
    if layer_id < 2:
        pad = torch.cat([torch.zeros(2, 4, v.shape[-1], dtype=v.dtype), v], 1)
        conv = torch.stack([sum(pad[:, t + j] * m.conv.weight[:, 0, j] for j in range(5)) for t in range(11)], 1)
        v = 0.5 * v + 0.5 * conv
    y = protot.prefix_mean_read_recurrent(w, v, rho, torch.sigmoid(m.gamma.float()))  # β in fp32, as trained
    # the mixer runs the prefix mean in fp32 (spec §3.2) whatever its inputs: fp32 tolerances
    torch.testing.assert_close(m(x), m.alpha * (y @ m.U.weight.t()), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("mixer", ["proto", "attention"])
def test_prefill_then_steps_and_chunks_match_parallel_forward(mixer):
    """A prefill, then one token at a time, then several at once (chunked prefill, scoring a continuation): the
    new tokens of a chunk see the cache and each other causally, as in the parallel forward."""
    cfg = Config(mixer=mixer, layers=2, d_model=32, n_protos=4, heads=2, dropout=0.0, kernels="torch")
    model = ProtoT(cfg, 40).double().eval()
    x = torch.randint(0, 40, (1, 64))
    with torch.no_grad():
        caches = [{} for _ in model.blocks]
        out = [model(x[:, :40], caches=caches)] + [model(x[:, t:t + 1], caches=caches) for t in range(40, 50)]
        out += [model(x[:, 50:57], caches=caches), model(x[:, 57:], caches=caches)]
        torch.testing.assert_close(torch.cat(out, 1), model(x), rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------- the sampler (spec §5.5)

OFF = dict(temperature=1.0, top_k=0, top_p=1.0, repetition_penalty=1.0, no_repeat_ngram_size=0)
NEG_INF = float("-inf")


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    """Every id already in the text, prompt included, once however often it occurs: 2 -> 1, -1 -> -2."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    ids = torch.tensor([[0, 1, 1], [3, 3, 3]])
    out = protot.sampling_logits(logits, ids, **{**OFF, "repetition_penalty": 2.0})
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0], [2.0, -1.0, 0.5, 1.5]]


def test_a_penalty_or_temperature_past_float32_stays_finite():
    """A penalty near 0 sends a seen positive logit past float32 (10 / 1.2e-38, the smallest penalty validate
    allows), a temperature near 0 any large logit: held at the largest float32 of its sign, the draw still works
    (inf - inf was a NaN softmax and multinomial's error)."""
    logits, ids = torch.tensor([[10.0, -1.0, 0.5, 1e38]]), torch.tensor([[0, 1]])
    out = protot.sampling_logits(logits, ids, **{**OFF, "repetition_penalty": 1.2e-38, "top_p": 0.9})
    assert out[0, 0] == torch.finfo(torch.float32).max and out[0, 1] < 0  # -1 · 1.2e-38: negative ones are multiplied
    assert out.softmax(-1).isfinite().all() and int(torch.multinomial(out.softmax(-1), 1)) == 0
    hot = protot.sampling_logits(logits, ids, **{**OFF, "temperature": 1e-9, "top_k": 2})  # 1e38 / 1e-6
    assert hot.isfinite().tolist() == [[True, False, False, True]] and hot.softmax(-1).isfinite().all()
    cold = protot.sampling_logits(torch.tensor([[-1e38, -2e38, -3e38]]), ids[:, :1], **{**OFF, "temperature": 1e-9})
    assert cold.softmax(-1).isfinite().all()  # every logit past -float32 max: held there, not -inf - -inf
    zero = protot.sampling_logits(torch.tensor([[0.0, 1.0, -1.0, 2.0]]), ids, **{**OFF, "repetition_penalty": 1.2e-38})
    assert zero[0, 0] == 0 and zero.softmax(-1).isfinite().all()  # 0 / the smallest penalty validate allows


def test_no_repeat_ngram_bans_the_token_that_would_repeat_an_ngram():
    def banned(ids, n, vocab=10):
        out = protot.sampling_logits(torch.zeros(1, vocab), torch.tensor([ids]), **{**OFF, "no_repeat_ngram_size": n})
        return [i for i, v in enumerate(out[0].tolist()) if v == NEG_INF]
    assert banned([5, 1, 2, 3, 7, 1, 2, 3], 4) == [7]  # the 3-gram (1, 2, 3) was followed by 7
    assert banned([5, 1, 2, 3, 7, 1, 2, 4], 4) == []   # (1, 2, 4) never occurred
    assert banned([5, 1, 2, 3, 7, 1, 2, 3], 5) == []   # n = 5: no earlier 5-gram starts with (7, 1, 2, 3)
    assert banned([1, 2, 3], 4) == []                  # shorter than an n-gram: nothing to repeat
    # 9 follows both (1, 2) and (3, 4); only (1, 2) is the text's last bigram, and 9 stays banned (a plain scatter
    # would let the later non-matching (3, 4) overwrite the ban)
    assert banned([1, 2, 9, 3, 4, 9, 1, 2], 3) == [9]
    assert banned([4, 8, 4], 2) == [8] and banned([4, 8, 4], 1) == [4, 8]  # n = 1: every token already there
    two = protot.sampling_logits(torch.zeros(2, 10), torch.tensor([[1, 2, 1], [1, 3, 1]]),
                                 **{**OFF, "no_repeat_ngram_size": 2})
    assert (two == NEG_INF).nonzero().tolist() == [[0, 2], [1, 3]]  # each row its own text
    # n = 1 once the text holds every id bans everything: that row is left unbanned (a NaN softmax otherwise),
    # the other row keeps its ban
    full = protot.sampling_logits(torch.zeros(2, 3), torch.tensor([[0, 1, 2], [0, 1, 1]]), **{**OFF, "no_repeat_ngram_size": 1})
    assert full[0].isfinite().all() and (full[1] == NEG_INF).tolist() == [True, True, False]


def test_top_k_top_p_and_temperature_on_known_distributions():
    """Temperature divides; top-k keeps the k largest; top-p keeps the fewest most likely tokens whose probability
    reaches p, always at least the top one, wherever they sit in the row."""
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    logits = probs.log()

    def kept(**kw):
        out = protot.sampling_logits(logits, torch.zeros(1, 1, dtype=torch.long), **{**OFF, **kw})
        assert torch.equal(out[out > NEG_INF], logits[out > NEG_INF])  # the kept logits are untouched
        return (out > NEG_INF).nonzero()[:, 1].tolist()
    assert kept(top_p=0.7) == [1, 3] and kept(top_p=0.4) == [1] and kept(top_p=0.1) == [1]
    assert kept(top_p=0.9) == [0, 1, 3] and kept(top_p=0.99) == [0, 1, 2, 3] and kept(top_p=1.0) == [0, 1, 2, 3]
    assert kept(top_k=2) == [1, 3] and kept(top_k=1) == [1] and kept(top_k=40) == [0, 1, 2, 3]
    x = torch.tensor([[1.0, -2.0, 3.0]])
    torch.testing.assert_close(protot.sampling_logits(x, torch.zeros(1, 1, dtype=torch.long),
                                                      **{**OFF, "temperature": 0.5}), 2 * x)
    # top-p after top-k: of the two kept (renormalised 0.625 / 0.375), 0.6 needs only the first
    assert kept(top_k=2, top_p=0.6) == [1] and kept(top_k=2, top_p=0.7) == [1, 3]


def test_sampler_matches_transformers_processors():
    """The same steps as Hugging Face generate(): penalty, n-gram ban, temperature, top-k, top-p, in that order."""
    lp = pytest.importorskip("transformers.generation.logits_process")
    g = torch.Generator().manual_seed(0)
    for penalty, n, temp, k, p in [(1.05, 4, 0.8, 40, 0.95), (1.5, 2, 0.7, 12, 0.6), (0.8, 3, 1.3, 0, 0.3)]:
        logits = 3 * torch.randn(3, 60, generator=g)
        ids = torch.randint(0, 8, (3, 30), generator=g)  # few distinct ids: repeats, and n-grams to ban
        hf = lp.LogitsProcessorList([lp.RepetitionPenaltyLogitsProcessor(penalty), lp.NoRepeatNGramLogitsProcessor(n),
                                     lp.TemperatureLogitsWarper(temp)] + [lp.TopKLogitsWarper(k) for _ in range(k > 0)]
                                    + [lp.TopPLogitsWarper(p)])
        ours = protot.sampling_logits(logits, ids, temp, k, p, penalty, n)
        assert (ours == NEG_INF).any()
        torch.testing.assert_close(ours, hf(ids, logits.clone()), rtol=0, atol=0)


def test_sampler_off_is_the_plain_temperature_top_k_sampler():
    """top-p 1, penalty 1 and no n-gram ban draw, for one generator, the very tokens of the sampler used before
    (temperature 0.8 and top-k 40 only), written out here as it was."""
    model = ProtoT(Config(layers=2, d_model=32, n_protos=4, dropout=0.0, kernels="torch"), 300).eval()
    with torch.no_grad():  # logits of std ~2 rather than ~0.1: a random model's distributions are then far from flat
        model.wte.weight.mul_(20)
    prompt = torch.randint(0, 300, (2, 5))
    g = torch.Generator().manual_seed(3)
    out = model.generate(prompt, 30, top_p=1.0, repetition_penalty=1.0, no_repeat_ngram_size=0, generator=g)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        caches = [{} for _ in model.blocks]
        logits, old = model(prompt, caches=caches)[:, -1], [prompt]
        for _ in range(30):
            logits = logits.float() / 0.8
            kth = torch.topk(logits, 40).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
            old.append(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
            logits = model(old[-1], caches=caches)[:, -1]
    assert torch.equal(out, torch.cat(old, 1))
    g = torch.Generator().manual_seed(3)
    assert not torch.equal(model.generate(prompt, 30, generator=g), out)  # the spec's sampler does change the draws


def test_temperature_zero_is_greedy_after_the_penalty_and_the_ngram_ban():
    """--temperature 0: the arg-max of the processed logits (penalty and n-gram ban still apply, as in HF's greedy
    search with processors), whatever the generator."""
    model = ProtoT(Config(layers=2, d_model=32, n_protos=4, dropout=0.0, kernels="torch"), 50).eval()
    prompt = torch.tensor([[3, 7, 3, 9, 1]])
    out = model.generate(prompt, 12, temperature=0, no_repeat_ngram_size=2, generator=torch.Generator().manual_seed(1))
    ref = prompt
    with torch.no_grad():
        for _ in range(12):
            logits = protot.sampling_logits(model(ref)[:, -1], ref, 0, 40, 0.95, 1.05, 2)
            ref = torch.cat([ref, logits.argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, ref)
    assert torch.equal(model.generate(prompt, 12, temperature=0, no_repeat_ngram_size=2,
                                      generator=torch.Generator().manual_seed(2)), out)
    bigrams = list(zip(out[0].tolist(), out[0, 1:].tolist()))
    assert len(set(bigrams)) == len(bigrams)  # the ban holds under greedy decoding too
    protot.validate(Config(temperature=0))  # and the flag accepts it, as in the other two language models


@pytest.mark.parametrize("mixer", ["proto", "attention"])
@pytest.mark.parametrize("sampler", [{}, dict(top_p=0.8, repetition_penalty=1.5, no_repeat_ngram_size=2)])
def test_cached_generation_draws_the_tokens_of_a_full_recompute(mixer, sampler):
    """generate() with the O(1) cache (KV cache for attention) against the whole text recomputed at every step,
    through the same sampler and generator: the same tokens. With --no-repeat-ngram-size 2 no bigram repeats."""
    cfg = Config(mixer=mixer, layers=2, d_model=32, n_protos=4, heads=2, dropout=0.0, kernels="torch")
    model = ProtoT(cfg, 50).double().eval()
    prompt = torch.tensor([[3, 7, 3, 9, 1], [4, 4, 2, 8, 6]])  # no bigram twice
    out = model.generate(prompt, 40, generator=torch.Generator().manual_seed(11), **sampler)
    g, ref = torch.Generator().manual_seed(11), prompt
    kw = {**dict(temperature=0.8, top_k=40, top_p=0.95, repetition_penalty=1.05, no_repeat_ngram_size=4), **sampler}
    with torch.no_grad():
        for _ in range(40):
            logits = protot.sampling_logits(model(ref)[:, -1], ref, **kw)
            ref = torch.cat([ref, torch.multinomial(torch.softmax(logits, -1), 1, generator=g)], 1)
    assert out.shape == (2, 45) and torch.equal(out, ref)
    if sampler:
        for row in out.tolist():
            bigrams = list(zip(row, row[1:]))
            assert len(set(bigrams)) == len(bigrams)


def test_model_structure_follows_the_spec():
    cfg = Config(layers=3, d_model=256, n_protos=32)
    model = ProtoT(cfg, 1000)
    m0, m1, m2 = model.mixers()
    assert m0.shared and not hasattr(m0, "W_r") and m0.tau_w.item() == 3.0  # layer 0: shared routing, τ_w = 3
    assert m1.tau_w.item() == 1.0 and m1.W_r.weight.shape == (256, 256)
    assert m0.conv is not None and m1.conv is not None and m2.conv is None   # conv in layers 0 and 1
    assert m2.V.weight.shape == (128, 256) and m2.U.weight.shape == (256, 128)  # d_v = d/2
    torch.testing.assert_close(m2.beta, torch.full((32,), 0.9))
    torch.testing.assert_close(m2.P.norm(dim=-1), torch.ones(32))
    assert m2.alpha.item() == 1.0
    assert model.blocks[0].ffn.W_g.weight.shape == (688, 256)               # floor(2.7·256/16)·16
    assert model.head.weight is model.wte.weight
    opt = protot.make_optimizer(model, cfg, "cpu")
    no_decay = {id(p) for p in opt.param_groups[1]["params"]}
    for name, p in model.named_parameters():
        leaf = name.split(".")[-1]
        assert (id(p) in no_decay) == (leaf in ("P", "gamma", "tau_w", "tau_r", "alpha") or "norm" in name), name


def test_interventions_mask_and_restore():
    cfg = Config(layers=2, d_model=32, n_protos=6, dropout=0.0, kernels="torch")
    model = ProtoT(cfg, 30).eval()
    x = torch.randint(0, 30, (2, 20))
    before = model(x)
    for m in model.mixers():
        m.record = True
    model(x)
    gates = [dict(m.last) for m in model.mixers()]  # unmasked
    with protot.intervention(model, [(1, 2)], "write-mask"):
        model(x)
        assert model.mixers()[1].last["w"][..., 2].abs().max() == 0      # no writes into prototype 2
        assert torch.equal(model.mixers()[1].last["rho"], gates[1]["rho"])  # the read gate is untouched
    with protot.intervention(model, [(0, 1)], "read-mask"):  # layer 0, which otherwise reads with its write gate
        model(x)
        assert model.mixers()[0].last["rho"][..., 1].abs().max() == 0
        assert torch.equal(model.mixers()[0].last["w"], gates[0]["w"])   # the write gate is untouched
    P = model.mixers()[1].P.detach().clone()
    with protot.intervention(model, [(1, 3)], "reinit"):
        assert not torch.equal(model.mixers()[1].P[3], P[3]) and torch.equal(model.mixers()[1].P[4], P[4])
    torch.testing.assert_close(model(x), before)  # everything restored
    # every prototype of a layer masked: that layer writes (or reads) nothing, finite logits, not softmax's 0/0
    for mode in ("write-mask", "read-mask"):
        for layer in (0, 1):  # layer 0 reads with its write gate
            with protot.intervention(model, [(layer, k) for k in range(6)], mode):
                out = model(x)
                assert torch.isfinite(out).all(), (mode, layer)
                assert model.mixers()[layer].last["rho" if mode == "read-mask" else "w"].abs().max() == 0
    # a unit listed twice under reinit gets its own row back (restored in reverse order)
    with protot.intervention(model, [(1, 2), (1, 2)], "reinit"):
        pass
    assert torch.equal(model.mixers()[1].P, P)
    assert protot.parse_units("1:2,0:1,1:2", 2, 6) == [(1, 2), (0, 1)]
    torch.testing.assert_close(model(x), before)
    with pytest.raises(protot.RunError, match="LAYER:PROTO"):
        protot.parse_units("3-1", 2, 6)
    with pytest.raises(protot.RunError, match="prototype in 0..5"):
        protot.parse_units("1:6", 2, 6)


def test_prompt_batch_targets_first_token_of_last_occurrence(data):
    tok = data.tokenizer
    x, last, tid = protot.prompt_batch(tok, ["The lady and the lady doth protest", "Good morrow, gentle lady"], "lady",
                                       "cpu")
    assert tok.decode(x[0, : last[0] + 1].tolist()) == "The lady and the"
    assert tok.decode(x[1, : last[1] + 1].tolist()) == "Good morrow, gentle"
    assert tid.tolist() == [tok.encode(" lady")[0]] * 2
    assert protot.find_word("Ladyship, no lady here", "lady") == 13 and protot.find_word("ladyship", "lady") == -1


def test_words_of_joins_subwords():
    words = protot.words_of([" Fr", "ail", "ty", ",", " thy", "\n", "name"], [1, 2, 3, 4, 5, 6, 7])
    assert words == [(" Frailty,", 2.5), (" thy", 5.0), ("\n", 6.0), ("name", 7.0)]


# ---------------------------------------------------------------- training

def tiny_cfg(tmp_path, cache_dir, **kw):
    base = dict(layers=2, d_model=32, n_protos=8, ctx=32, batch_size=4, max_iters=20, eval_interval=10,
                eval_iters=2, log_interval=5, out_dir=str(tmp_path), cache_dir=str(cache_dir), kernels="torch")
    return Config(**{**base, **kw})


def keep_checkpoint_at(monkeypatch, step: int, folder: Path):
    """Patch save_checkpoint to copy the checkpoint of `step` into `folder` too (a run cut there); -> the real
    save_checkpoint, to put back."""
    real_save = protot.save_checkpoint

    def save_and_keep(path, *a, **k):
        real_save(path, *a, **k)
        if a[3] == step:
            folder.mkdir()
            shutil.copy(path, folder / path.name)
    monkeypatch.setattr(protot, "save_checkpoint", save_and_keep)
    return real_save


def test_resume_is_bit_exact_on_cpu(tmp_path, cache_dir, monkeypatch):
    dist = dict(ddp=False, rank=0, local_rank=0, world=1)
    dev, auto = torch.device("cpu"), torch.autocast("cpu", enabled=False)

    def fresh_data():
        return common.load_data(cache_dir=cache_dir, seed=3)
    straight, hist_a = protot.train(tiny_cfg(tmp_path / "a", cache_dir), fresh_data(), dev, auto, dist,
                                    log=lambda m: None)

    real_save = keep_checkpoint_at(monkeypatch, 10, tmp_path / "b10")
    lines = []  # the cut run trains in the straight run's folder: a fresh run says it replaces the checkpoint there
    protot.train(tiny_cfg(tmp_path / "a", cache_dir), fresh_data(), dev, auto, dist, log=lines.append)
    assert [ln for ln in lines if ln.startswith("note:")] == [f"note: {tmp_path / 'a' / 'ckpt-proto.pt'} exists; this run trains from step 0 and replaces it (--resume continues it instead)"]
    monkeypatch.setattr(protot, "save_checkpoint", real_save)
    lines = []
    resumed, hist = protot.train(tiny_cfg(tmp_path / "b10", cache_dir, resume=True), fresh_data(), dev, auto, dist,
                                 log=lines.append)
    assert not any(ln.startswith("note:") for ln in lines)  # nothing changed: no warning that it will differ
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), name
    assert hist["step"] == [10, 20] and hist["val"] == hist_a["val"]  # the val stream resumes exactly too
    ck = torch.load(tmp_path / "b10" / "ckpt-proto.pt", weights_only=True)
    assert ck["step"] == 20 and ck["config"]["resume"] is True and ck["tokenizer"]["name"] == "cl100k"


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, cache_dir, monkeypatch):
    real_forward, calls = ProtoT.forward, []

    def forward(self, idx, targets=None, caches=None):
        out = real_forward(self, idx, targets, caches)
        if targets is not None and self.training:
            calls.append(1)
            if len(calls) > 12:
                return out * float("nan")
        return out
    monkeypatch.setattr(ProtoT, "forward", forward)
    cfg = tiny_cfg(tmp_path, cache_dir)
    with pytest.raises(protot.RunError, match="non-finite loss before step 15 \\(or non-finite weights\\); stopping \\(the last good checkpoint is .*ckpt-proto.pt, step 10\\)"):
        protot.train(cfg, common.load_data(cache_dir=cache_dir), torch.device("cpu"), torch.autocast("cpu", enabled=False),
                     dict(ddp=False, rank=0, local_rank=0, world=1), log=lambda m: None)
    ck = torch.load(protot.ckpt_path(cfg), weights_only=True)
    assert ck["step"] == 10 and all(torch.isfinite(v).all() for v in ck["model"].values() if v.is_floating_point())
    # a fresh run that fails before its first evaluation: the file there is the earlier run's, and says so
    calls[:] = [1] * 12
    with pytest.raises(protot.RunError, match="before step 5 .*\\(this run wrote no checkpoint; .*ckpt-proto.pt is an earlier run's\\)"):
        protot.train(cfg, common.load_data(cache_dir=cache_dir), torch.device("cpu"), torch.autocast("cpu", enabled=False),
                     dict(ddp=False, rank=0, local_rank=0, world=1), log=lambda m: None)


def test_gate_lag_finds_the_read_one_token_ahead():
    """Predict-and-consolidate (spec §1.1, §8.4): gates whose read at t copies the write at t + 1 peak at ℓ = +1,
    at ℓ = -1 for the opposite shift, at 0 for the same gate; a constant gate has no correlation and is left out."""
    g = torch.Generator().manual_seed(0)
    w = torch.softmax(2 * torch.randn(6, 40, 5, generator=g), -1)
    ahead = torch.cat([w[:, 1:], torch.rand(6, 1, 5, generator=g)], 1)      # ρ_t = w_(t+1)
    behind = torch.cat([torch.rand(6, 1, 5, generator=g), w[:, :-1]], 1)    # ρ_t = w_(t-1)
    for rho, lag in ((ahead, 1), (behind, -1), (w, 0)):
        out = protot.gate_lag(w, rho)
        i = out["lags"].index(lag)
        assert out["corr"][i] == pytest.approx(1.0) and out["peak"][i] == 1.0 and out["prototypes"] == 5
        assert max(c for j, c in enumerate(out["corr"]) if j != i) < 0.3
    flat = ahead.clone()
    flat[..., 0] = 0.2  # prototype 0's read never varies
    out = protot.gate_lag(w, flat)
    assert out["prototypes"] == 4 and out["corr"][out["lags"].index(1)] == pytest.approx(1.0)
    line = protot.gate_lag_line({"layer": 2, **out})
    assert line.startswith("layer 2: mean corr(ρ_t, w_t+ℓ) ℓ=-2 ") and "highest at ℓ=+1; 100% of 4 prototypes" in line


def test_tiny_run_end_to_end(tmp_path, cache_dir, capsys, monkeypatch):
    """The issue's tiny run: falling loss, a checkpoint, samples, the prototype labels and the HTML report."""
    r = run_script("protot.py", *TINY, "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir))
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "no GPU: running the CPU preset" in out
    losses = [float(line.split("| loss ")[1].split()[0]) for line in out.splitlines() if line.startswith("step ") and "| loss" in line]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5
    line = next(ln for ln in out.splitlines() if ln.startswith("step 10/30"))
    assert " ms | " in line and "tok/s | mfu -" in line
    for f in ("ckpt-proto.pt", "report.html", "prototypes.html", "prototypes.json", "results.json", "log-proto.txt"):
        assert (tmp_path / f).is_file(), f
    res = json.loads((tmp_path / "results.json").read_text())
    assert len(res["labels"]["cards"]) == 2 * 32 and res["ppl"]["proto"]["tokens"] == 10_000 - 1  # all of val
    assert (res["preset"], res["device"], res["dtype"]) == ("cpu", "cpu", "float32")  # what auto resolved to
    lag = res["labels"]["gate_lag"]  # layer 0 reads with its write gate: only layer 1 has a lag to measure
    assert [g["layer"] for g in lag] == [1] and lag[0]["lags"] == [-2, -1, 0, 1, 2] and lag[0]["prototypes"] == 32
    assert "gate lag, layer 1: mean corr(ρ_t, w_t+ℓ) ℓ=-2 " in out and "Read-write gate lag" in (tmp_path / "report.html").read_text()
    assert len(res["find_prototype"]["ranking"]) == 10 and "ppl_change" in res["find_prototype"]["ranking"][0]
    assert set(res["robustness"]) == set(protot.PERTURBATIONS)
    assert all(-1 <= r["proto"]["spearman"] <= 1 for r in res["robustness"].values())
    assert sum(" Spearman " in ln for ln in out.splitlines() if ln.startswith("robustness ")) == len(protot.PERTURBATIONS)
    assert list(res["samples"]) == ["proto"] and len(res["samples"]["proto"]) == 1  # per model, one per prompt
    assert res["samples"]["proto"][0].startswith("ROSALIND:\n") and len(res["samples"]["proto"][0]) > 100
    report = (tmp_path / "report.html").read_text()
    assert "data:image/png;base64" in report and "Robustness" in report

    # analyses on the saved checkpoint, without training: an intervention, then a mismatched architecture
    labels = (tmp_path / "prototypes.json").read_text()
    r = run_main(protot.main, ["--no-train", "--intervene", "1:3,0:2", "--mode", "read-mask", "--target", "queen",
                               "--no-robustness", "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)],
                 capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "read-mask L1 P3,L0 P2 on 'queen' (8 prompts): target probability max" in r.stdout
    assert (tmp_path / "analysis.json").is_file() and (tmp_path / "analysis.html").is_file()
    assert json.loads((tmp_path / "results.json").read_text()) == res  # the training run's results are kept
    assert (tmp_path / "analysis-prototypes.html").is_file() and (tmp_path / "prototypes.json").read_text() == labels
    # --no-report rewrites analysis.json and leaves the earlier analysis.html: the log says that page is not this run's
    page = (tmp_path / "analysis.html").read_text()
    r = run_main(protot.main, ["--no-train", "--no-report", "--no-labels", "--no-robustness", "--find-prototype", "off",
                               "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"report: none written (--no-report); {tmp_path / 'analysis.html'} is an earlier run's, not analysis.json's" \
        in r.stdout and (tmp_path / "analysis.html").read_text() == page
    rc, err = call_main(protot.main, ["--no-train", "--layers", "3", "--out-dir", str(tmp_path), "--cache-dir",
                                      str(cache_dir)], capsys, monkeypatch)
    assert rc == 1 and err.count("\n") == 1
    assert "was trained with layers=2 (asked 3); drop those flags or use another --out-dir" in err


@pytest.mark.parametrize("args,code,needle", [
    (["--mixer", "mamba"], 2, "invalid choice: 'mamba'"),
    (["--layerz", "6"], 2, "unrecognized arguments: --layerz"),
    (["--layers", "0"], 1, "error: --layers must be in [1, 1024]"),
    (["--layers", "10000000000000"], 1, "error: --layers must be in [1, 1024]"),
    (["--lr", "1e39"], 1, "--lr must be a finite number of at most 3.4e+38 (float32)"),
    (["--weight-decay", "1e300"], 1, "--weight-decay must be a finite number of at most 3.4e+38"),
    (["--out-dir", ""], 1, "--out-dir is empty (. names the current folder)"),
    (["--mixer", "attention", "--d-model", "30", "--heads", "4"], 1, "must split into --heads 4 heads"),
    (["--no-train", "--intervene", "0:1"], 1, "error: no checkpoint at"),
    (["--no-train", "--resume"], 1, "--resume continues training and --no-train trains nothing; give one"),
    (["--intervene", "x"], 1, "--intervene expects LAYER:PROTO"),
    (["--intervene", "0:1", "--target", " "], 1, "the target word is empty"),
    (["--prompts", "no/such/file.txt"], 1, "--prompts no/such/file.txt: no such file"),
    (["--prompts", "tests"], 1, "--prompts tests: a folder, not a file"),
    (["--intervene=-1:0"], 1, "--intervene -1:0: layer must be in 0.."),
    (["--d-model", "4"], 1, "--d-model must be >= 6"),
    (["--intervene", "0:3", "--target", "zzzzqqq"], 1, "no prompt contains the word 'zzzzqqq'"),  # before training
    (["--find-prototype", "zzzzqqq"], 1, "no prompt contains the word 'zzzzqqq'"),
    # a typed --target that the default find-prototype ranks after training: checked before it, like the others
    # (the tiny settings keep the run short where it is not)
    (["--target", "zzzzqqq", "--layers", "1", "--d-model", "16", "--ctx", "16", "--max-iters", "2", "--no-labels",
      "--no-robustness", *SMALL_CORPUS], 1, "no prompt contains the word 'zzzzqqq'"),
    (["--compare", "--heads", "3", "--d-model", "32"], 1, "must split into --heads 3 heads"),
    (["--heads", "0"], 1, "--heads must be >= 1"),
    (["--device", "tpu"], 1, "--device tpu: expected auto, cpu, cuda, cuda:N or mps"),
    (["--dtype", "bfloat16"], 1, "--dtype bfloat16 is bf16 autocast on CUDA"),
    (["--warmup-frac", "2"], 1, "--warmup-frac must be in [0, 1]"),
    (["--early-stop", "-1"], 1, "--early-stop must be >= 0 (0: off)"),
    (["--dataset", "fineweb-edu"], 1, "needs the Hugging Face hub, which is unreachable"),
    (["--kernels", "triton"], 1, "--kernels triton needs a CUDA device"),
    (["--mixer", "attention", "--find-prototype", "queen"], 1, "need --mixer proto"),
    (["--device", "meta"], 1, "--device meta: expected auto, cpu, cuda, cuda:N or mps"),  # torch.device takes it
    (["--device", "xpu"], 1, "--device xpu: expected auto"),
    (["--seed", "-1"], 1, "--seed must be in [0, 2**32)"),
    (["--top-p", "0"], 1, "--top-p must be in (0, 1]"), (["--top-p", "1.5"], 1, "--top-p must be in (0, 1]"),
    (["--top-p", "nan"], 1, "--top-p must be in (0, 1]"),
    (["--repetition-penalty", "0"], 1, "--repetition-penalty must be >= 1.2e-38 (1: off)"),
    (["--repetition-penalty", "1e-300"], 1, "--repetition-penalty must be >= 1.2e-38"),  # float32 rounds it to 0
    (["--repetition-penalty", "inf"], 1, "--repetition-penalty must be a finite number of at most 3.4e+38"),
    (["--no-repeat-ngram-size", "-1"], 1, "--no-repeat-ngram-size must be >= 0"),
    (["--lr", "inf"], 1, "--lr must be a finite number"), (["--weight-decay", "inf"], 1, "--weight-decay must be a"),
    (["--lr", "3e38"], 1, "--lr must be at most 3.4e+37 (Adam's first step, 10·lr, must fit float32)"),
    (["--bench", "--resume"], 1, "--bench times the model and its kernels on random data, with no checkpoint"),
    (["--bench", "--no-train"], 1, "drop --resume and --no-train"),
    (["--temperature", "-1"], 1, "--temperature must be >= 0 (0: greedy)"),
    (["--top-k", "-1"], 1, "--top-k must be >= 0"),
    (["--top-p", "0.9x"], 2, "argument --top-p: invalid float value: '0.9x'"),
    (["--bench", "--d-model", "36", "--layers", "1"], 1, "must split into --heads 4 heads"),  # bench times attention
    (["--out-dir", "/dev/null/x"], 1, "--out-dir /dev/null/x: cannot write there"),
    (["--ctx", "20000", *SMALL_CORPUS], 1, "--ctx 20000: the val split has 10,000 tokens, fewer than ctx + 1"),
])
def test_bad_input_is_one_line_and_nonzero(tmp_path, cache_dir, args, code, needle, capsys, monkeypatch):
    """In-process main() (what `python protot.py ...` runs), offline and without the tests' Triton interpreter;
    the subprocess form of the same path is covered by test_corrupt_checkpoint_is_one_line."""
    out = [] if "--out-dir" in args else ["--out-dir", str(tmp_path)]
    rc, err = call_main(protot.main, [*args, *out, "--cache-dir", str(cache_dir)], capsys, monkeypatch)
    assert rc == code and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_resume_from_the_command_line(tmp_path, cache_dir, capsys, monkeypatch):
    """A plain --resume takes the run's own settings from the checkpoint (not the preset's); --compare resumed
    after it stopped before the baseline's first checkpoint trains the baseline from step 0 with those settings;
    --max-iters extends a finished run."""
    small = ["--layers", "1", "--d-model", "32", "--n-protos", "4", "--heads", "2", "--ctx", "32", "--batch-size", "4",
             "--lr", "1e-3", "--eval-interval", "5", "--eval-iters", "1", "--log-interval", "5", *SMALL_CORPUS]
    quiet = ["--no-labels", "--no-robustness", "--no-report", "--find-prototype", "off", "--sample-tokens", "4",
             "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)]
    rc, err = call_main(protot.main, [*small, *quiet, "--max-iters", "10"], capsys, monkeypatch)
    assert rc == 0, err
    rc, err = call_main(protot.main, ["--compare", "--resume", *quiet], capsys, monkeypatch)
    assert rc == 0, err
    log = (tmp_path / "log-proto-attention.txt").read_text()
    assert "attention: no checkpoint at" in log and "training it from step 0" in log
    assert "CPU preset" not in log  # its settings are the checkpoint's, so no preset banner
    for mixer in ("proto", "attention"):
        c = torch.load(tmp_path / f"ckpt-{mixer}.pt", weights_only=True)
        assert c["step"] == 10 and c["config"]["mixer"] == mixer, mixer
        assert (c["config"]["batch_size"], c["config"]["lr"], c["config"]["max_iters"], c["config"]["d_model"]) == \
            (4, 1e-3, 10, 32), mixer
    # the baseline trained the batches a run of its own trains (and ProtoT trained): the comparison is paired
    alone = [a if a != str(tmp_path) else str(tmp_path / "alone") for a in quiet]
    rc, err = call_main(protot.main, [*small, *alone, "--mixer", "attention", "--max-iters", "10"], capsys, monkeypatch)
    assert rc == 0, err
    paired, own = (torch.load(d / "ckpt-attention.pt", weights_only=True)["model"] for d in (tmp_path, tmp_path / "alone"))
    assert all(torch.equal(paired[k], own[k]) for k in own)
    samples = json.loads((tmp_path / "results.json").read_text())["samples"]  # --compare samples both models
    assert set(samples) == {"proto", "attention"} and all(len(v) == 2 for v in samples.values())
    rc, err = call_main(protot.main, ["--resume", "--max-iters", "15", "--weight-decay", "0.5", *quiet], capsys,
                        monkeypatch)
    assert rc == 0, err
    c = torch.load(tmp_path / "ckpt-proto.pt", weights_only=True)
    assert c["step"] == 15 and c["config"]["lr"] == 1e-3 and c["config"]["batch_size"] == 4
    # the typed decay reaches the optimizer (load_state_dict would put the checkpoint's 0.1 back), and the log says
    # the result is not an uninterrupted run's
    assert [g["weight_decay"] for g in c["optimizer"]["param_groups"]] == [0.5, 0.0]
    assert "note: resuming with max_iters 10 -> 15, weight_decay 0.1 -> 0.5: the first 10 steps followed the " \
        "checkpoint's settings" in (tmp_path / "log-proto.txt").read_text()
    # a --max-iters below the checkpoint's step would train nothing and report a config not the model's
    rc, err = call_main(protot.main, ["--resume", "--max-iters", "12", *quiet], capsys, monkeypatch)
    assert rc == 1 and err.count("\n") == 1 and "ckpt-proto.pt is at step 15, past --max-iters 12" in err, err
    # typed analysis flags this run does not use are said in the log, not dropped unseen
    rc, err = call_main(protot.main, ["--no-train", "--target", "queen", "--mode", "reinit", *quiet], capsys,
                        monkeypatch)
    assert rc == 0, err
    log = (tmp_path / "log-proto.txt").read_text()
    assert "note: --target has no effect in this run" in log and "note: --mode has no effect in this run" in log
    # --compare --resume resumes each model with its own checkpoint's settings, not ProtoT's for both
    rc, err = call_main(protot.main, [*small, *quiet, "--mixer", "attention", "--lr", "5e-3", "--max-iters", "15"],
                        capsys, monkeypatch)
    assert rc == 0, err
    rc, err = call_main(protot.main, ["--compare", "--resume", "--max-iters", "20", *quiet], capsys, monkeypatch)
    assert rc == 0, err
    lrs = {m: torch.load(tmp_path / f"ckpt-{m}.pt", weights_only=True)["config"]["lr"] for m in ("proto", "attention")}
    assert lrs == {"proto": 1e-3, "attention": 5e-3}
    assert "ratio" in json.loads((tmp_path / "results.json").read_text())  # one budget, lrs of their own
    # a baseline trained apart on another budget: --no-train --compare gives no ratio, and says why
    rc, err = call_main(protot.main, [*small, *quiet, "--mixer", "attention", "--max-iters", "5"], capsys, monkeypatch)
    assert rc == 0, err
    rc, err = call_main(protot.main, ["--no-train", "--compare", *quiet], capsys, monkeypatch)
    assert rc == 0, err
    assert "ratio" not in json.loads((tmp_path / "analysis.json").read_text())
    assert "perplexity ratio not computed: ProtoT and attention were trained on different budgets (step 20 vs 5)" \
        in (tmp_path / "log-proto-attention.txt").read_text()
    rc, err = call_main(protot.main, ["--no-train", "--compare", *quiet, "--robustness"], capsys, monkeypatch)
    assert rc == 0, err  # the pair in memory is no one budget either: ProtoT's robustness alone, and why
    assert set(json.loads((tmp_path / "analysis.json").read_text())["robustness"]["typo"]) == {"pairs", "proto"}
    assert "robustness: not comparing with attention (" in (tmp_path / "log-proto-attention.txt").read_text()
    # nor does robustness set the two side by side (it loads the other mixer's checkpoint when it finds one)
    rc, err = call_main(protot.main, ["--no-train", *quiet, "--robustness"], capsys, monkeypatch)
    assert rc == 0, err
    assert set(json.loads((tmp_path / "analysis.json").read_text())["robustness"]["typo"]) == {"pairs", "proto"}
    assert "ckpt-attention.pt was trained on another budget: step 20 vs 5)" in (tmp_path / "log-proto.txt").read_text()


def test_labelling_needs_a_val_window_and_says_so_before_training(tmp_path, cache_dir, capsys, monkeypatch):
    text = tmp_path / "tiny.txt"
    text.write_text("To be, or not to be, that is the question. " * 7)  # val: the last ~10%, under 32 bytes
    rc, err = call_main(protot.main, ["--dataset", str(text), "--tokenizer", "bytes", "--compact", "none", "--ctx", "8",
                                      "--layers", "1", "--d-model", "16", "--out-dir", str(tmp_path / "out"),
                                      "--cache-dir", str(cache_dir)], capsys, monkeypatch)
    assert rc == 1 and "prototype labelling reads val windows of 32 tokens; the val split has" in err, err
    assert not (tmp_path / "out" / "ckpt-proto.pt").exists()


def test_byte_tokenizer_targets_the_words_first_letter_not_the_space():
    x, last, tid = protot.prompt_batch(common.Tokenizer("bytes", None), ["The old woman spoke."], "woman", "cpu")
    assert tid.tolist() == [ord("w")] and x[0, last[0]].item() == ord(" ")


def test_crossover_is_where_protot_stays_ahead():
    ctxs = [1, 2, 3, 4]
    assert protot.crossover(ctxs, [5, 1, 5, 6], [4, 2, 4, 5]) == 3  # the noisy win at 1 is no crossover
    assert protot.crossover(ctxs, [1, 1, 1, 1], [2, 2, 2, 2]) is None
    assert protot.crossover(ctxs, [3, 3, 3, 3], [2, 2, 2, 2]) == 1
    assert protot.crossover(ctxs, [1, 1, 1, 3], [2, 2, 2, 2]) is None  # a win at the last context alone is none
    assert protot.crossover(ctxs, [1, 1, 3, 3], [2, 2, 2, 2]) == 3


@pytest.mark.parametrize("name", ["protot", "prism", "dual_stream", "clvq_vae"])
def test_log_line_shows_a_slow_rate(name):
    import importlib

    log_line = importlib.import_module(name).log_line
    assert log_line(3, 10, 1.0, 1e-3, 5.0, 40.0, None).endswith("| 5.0 ms | 40 tok/s | mfu -")
    assert log_line(3, 10, 1.0, 1e-3, 5.0, 12345.0, 0.5).endswith("| 12.3k tok/s | mfu 50.0%")


def test_corrupt_checkpoint_is_one_line(tmp_path, cache_dir, capsys, monkeypatch):
    (tmp_path / "ckpt-proto.pt").write_bytes(b"not a checkpoint")
    rc, err = call_main(protot.main, ["--no-train", "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)], capsys,
                        monkeypatch)
    assert rc == 1 and "is not a readable checkpoint" in err and err.count("\n") == 1


@pytest.mark.slow
def test_ddp_two_cpu_processes_match_one(tmp_path, cache_dir):
    """torchrun with 2 gloo processes: each rank takes half of the global batch, so the result equals the
    single-process run up to float summation order. With --early-stop 1 every rank stops at the same evaluation
    as the single process (the val loss is all-reduced): at this seed the val loss first rises at step 21
    (7.2587 at step 18, 7.2654 at 21), a margin far above the two runs' float differences."""
    args = ["--layers", "1", "--d-model", "32", "--ctx", "32", "--batch-size", "8", "--max-iters", "30", "--lr", "0.01",
            "--eval-interval", "3", "--eval-iters", "1", "--log-interval", "3", "--dropout", "0", "--early-stop", "1",
            "--no-labels", "--no-robustness", "--no-report", "--find-prototype", "off", "--sample-tokens", "5",
            *SMALL_CORPUS, "--cache-dir", str(cache_dir)]
    common.load_data(max_tokens=int(SMALL_CORPUS[1]), cache_dir=cache_dir)  # the cache exists before the ranks start
    a, b = run_one_and_ddp("protot.py", args, tmp_path, "ckpt-proto.pt")
    torch.testing.assert_close(a["history"]["val"], b["history"]["val"], rtol=1e-5, atol=0)
    # the logged training loss is the global batch's, averaged over the ranks, not rank 0's half
    torch.testing.assert_close(a["history"]["train"], b["history"]["train"], rtol=1e-5, atol=0)
    assert a["step"] == b["step"] == 21 and a["best"]["step"] == b["best"]["step"] == 18, (a["step"], b["step"])
    check_ddp_weights(a["model"], b["model"], a["config"]["lr"])
    check_ddp_weights(a["best"]["model"], b["best"]["model"], a["config"]["lr"])


def test_robustness_compares_both_mixers_and_routing(data):
    models = {m: ProtoT(Config(mixer=m, layers=2, d_model=32, n_protos=4, heads=2, dropout=0.0), data.vocab_size).eval()
              for m in ("proto", "attention")}
    res = protot.robustness(models, data, pairs=3)
    assert set(res) == set(protot.PERTURBATIONS)
    for row in res.values():
        assert row["pairs"] == 3 and set(row) == {"pairs", "proto", "attention"}
        assert 0 <= row["proto"]["js"] <= np.log(2) + 1e-6 and 0 <= row["attention"]["top1"] <= 1
        assert all(-1 <= row[m]["spearman"] <= 1 for m in ("proto", "attention"))
        assert len(row["proto"]["route_js_per_layer"]) == 2 and "route_js_per_layer" not in row["attention"]
    assert protot.PERTURBATIONS["contraction"]("And it is not so", None) == "And 'tis not so"
    punctuation = protot.PERTURBATIONS["punctuation"]
    assert punctuation("No, sir.", None) == "No sir." and punctuation("Ay, my lord", None) == "Ay my lord"
    assert punctuation("Away, away!", None) == "Away away!" and punctuation("Away!", None) is None  # the end stays
    assert punctuation("", None) is None


def test_spearman_is_the_rank_correlation_with_ties_averaged():
    x = torch.tensor([0.3, -1.0, 2.5, 0.7, 0.1, 4.0])
    assert protot.spearman(x, x).item() == pytest.approx(1)
    assert protot.spearman(x, -x).item() == pytest.approx(-1)
    assert protot.spearman(torch.arange(6.0), torch.arange(6.0).flip(0)).item() == pytest.approx(-1)  # reversed
    assert protot.spearman(x, torch.exp(3 * x) + 7).item() == pytest.approx(1)  # any increasing map: ranks unchanged
    assert protot.spearman(torch.softmax(x, 0), x).item() == pytest.approx(1)
    # ties share the mean of the ranks they span: a -> 2, 3.5, 3.5, 6, 6, 6, 1 and b -> 6, 1, 5, 2.5, 2.5, 7, 4,
    # then the Pearson correlation of those ranks
    a = torch.tensor([1.0, 2.0, 2.0, 3.0, 3.0, 3.0, 0.0])
    b = torch.tensor([5.0, 1.0, 4.0, 2.0, 2.0, 7.0, 3.0])
    want = np.corrcoef([2, 3.5, 3.5, 6, 6, 6, 1], [6, 1, 5, 2.5, 2.5, 7, 4])[0, 1]
    assert protot.spearman(a, b).item() == pytest.approx(want, abs=1e-12) and abs(want) < 0.5
    assert torch.isnan(protot.spearman(torch.ones(5), x[:5]))  # a constant side has no ranks to correlate


def test_spearman_matches_scipy_on_probabilities_with_ties():
    stats = pytest.importorskip("scipy.stats")
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        logits = torch.randn(2, 5000, generator=g).round(decimals=1)  # many ties, as underflowed probabilities have
        p, q = torch.softmax(3 * logits, -1)
        want = stats.spearmanr(p.numpy(), q.numpy()).statistic
        assert protot.spearman(p, q).item() == pytest.approx(want, abs=1e-10)
    q = torch.softmax(4 * logits[0] + 0.3 * torch.randn(5000, generator=g), -1)  # two correlated distributions
    r = protot.spearman(p, q).item()
    assert r == pytest.approx(stats.spearmanr(p.numpy(), q.numpy()).statistic, abs=1e-10) and 0.5 < r < 1


def test_prompts_from_a_user_file(tmp_path, data):
    f = tmp_path / "prompts.txt"
    f.write_text("Mermaid, sing\n\nno target here\nI saw a mermaid on a dolphin's back\n")
    cfg = Config(prompts=str(f))
    assert protot.load_prompts(cfg, data, "mermaid") == ["I saw a mermaid on a dolphin's back"]  # needs context
    with pytest.raises(protot.RunError, match="no line of --prompts .*prompts.txt contains the word 'kraken'"):
        protot.load_prompts(cfg, data, "kraken")
    with pytest.raises(protot.RunError, match="--prompts .*missing.txt"):
        protot.load_prompts(Config(prompts=str(tmp_path / "missing.txt")), data, "mermaid")
    assert len(protot.load_prompts(Config(), data, "queen")) == 8  # the built-in set


def test_non_finite_weights_are_never_saved(tmp_path, cache_dir, monkeypatch):
    evals = []

    def poisoning_estimate(model, *a, **k):  # weights turn NaN while the loss still looks fine
        evals.append(1)
        if len(evals) == 2:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
        return 5.0
    monkeypatch.setattr(protot, "estimate_loss", poisoning_estimate)
    cfg = tiny_cfg(tmp_path, cache_dir)
    with pytest.raises(protot.RunError, match="non-finite loss before step 20"):
        protot.train(cfg, common.load_data(cache_dir=cache_dir), torch.device("cpu"),
                     torch.autocast("cpu", enabled=False), dict(ddp=False, rank=0, local_rank=0, world=1),
                     log=lambda m: None)
    assert torch.load(protot.ckpt_path(cfg), weights_only=True)["step"] == 10


# ---------------------------------------------------------------- early stopping, the best weights (spec §3.2)

VALS = [5.0, 4.0, 4.5, 3.9, 4.2, 4.3, 4.1, 4.0, 3.8, 3.7]  # forced val losses of evaluations 1, 2, ...


def forced_vals(monkeypatch, vals, weights=None):
    """estimate_loss returns `vals` in turn (and raises past them); `weights` collects the model's weights at each
    evaluation."""
    it = iter(vals)

    def fake(model, *a, **k):
        if weights is not None:
            weights.append({n: t.detach().clone() for n, t in model.state_dict().items()})
        return next(it)
    monkeypatch.setattr(protot, "estimate_loss", fake)


def train_tiny(cfg, log=lambda m: None):
    return protot.train(cfg, common.load_data(cache_dir=cfg.cache_dir), torch.device("cpu"),
                        torch.autocast("cpu", enabled=False), dict(ddp=False, rank=0, local_rank=0, world=1), log=log)


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("n,stop,best", [(1, 6, 4), (2, 12, 8), (0, 20, 20)])
def test_early_stop_stops_at_the_right_evaluation_and_keeps_the_best_weights(tmp_path, cache_dir, monkeypatch, n,
                                                                             stop, best):
    """--early-stop N stops at the N-th evaluation in a row without a new best val loss (N = 1: the paper's first
    rise), 0 never; the model returned holds the best evaluation's weights, not the last, and so does the
    checkpoint's "best", while its "model" stays the last (what --resume continues)."""
    weights, lines = [], []
    forced_vals(monkeypatch, VALS, weights)
    cfg = tiny_cfg(tmp_path, cache_dir, eval_interval=2, early_stop=n)
    model, hist = train_tiny(cfg, lines.append)
    assert hist["step"] == list(range(2, stop + 1, 2)) and hist["val"] == VALS[:stop // 2]
    assert (f"step {stop}: no val improvement in {n} evaluations; early stop" in lines) == (n > 0)
    at_best = weights[best // 2 - 1]
    assert model.weights_step == best and same_weights(model.state_dict(), at_best)
    assert same_weights(model.state_dict(), weights[-1]) == (best == stop)  # the weights did move after the best
    assert (f"restored the best evaluation's weights (step {best}, val loss {VALS[best // 2 - 1]:.4f})" in lines) \
        == (best != stop)
    ck = torch.load(protot.ckpt_path(cfg), weights_only=True)
    assert ck["step"] == stop and same_weights(ck["model"], weights[-1]) and ck["best_val_loss"] == VALS[best // 2 - 1]
    assert (ck["best"] is None) == (best == stop)  # kept apart only when not the last weights: one file, not two
    assert protot.best_of(ck)["step"] == best and same_weights(protot.best_of(ck)["model"], at_best)


def test_resume_after_an_early_stop_trains_no_further(tmp_path, cache_dir, monkeypatch):
    """A resumed run that had stopped early says so and trains nothing (its checkpoint untouched); a larger
    --early-stop continues it from the last weights, the evaluations since the best counted, the best kept."""
    forced_vals(monkeypatch, VALS)
    cfg = tiny_cfg(tmp_path, cache_dir, eval_interval=2, early_stop=1)
    first, _ = train_tiny(cfg)  # stops at step 6, best step 4
    saved = protot.ckpt_path(cfg).read_bytes()
    forced_vals(monkeypatch, [])  # an evaluation now would raise
    lines = []
    model, hist = train_tiny(dataclasses.replace(cfg, resume=True), lines.append)
    assert "note: the checkpoint's run stopped early at step 6 (no val improvement in --early-stop 1 evaluations): " \
        "nothing left to train (raise --early-stop, or 0 turns it off, to continue)" in lines
    assert hist["step"] == [2, 4, 6] and protot.ckpt_path(cfg).read_bytes() == saved
    assert model.weights_step == 4 and same_weights(model.state_dict(), first.state_dict())
    # the same checkpoint resumed with --early-stop 2: one evaluation since the best already, so one more stops it
    weights, lines = [], []
    forced_vals(monkeypatch, [4.1], weights)
    model, hist = train_tiny(dataclasses.replace(cfg, resume=True, early_stop=2), lines.append)
    assert any(ln.startswith("note: resuming with early_stop 1 -> 2") for ln in lines)
    assert hist["step"] == [2, 4, 6, 8] and "step 8: no val improvement in 2 evaluations; early stop" in lines
    assert not same_weights(weights[0], first.state_dict())  # it trained on, from step 6
    assert model.weights_step == 4 and same_weights(model.state_dict(), first.state_dict())


def test_resume_through_a_checkpoint_whose_best_is_not_its_last_is_bit_exact(tmp_path, cache_dir, monkeypatch):
    """Cut at step 10 (best: step 8, kept apart in the checkpoint) and resumed, the run stops where the
    uninterrupted one does, with the same last weights and the same best ones."""
    forced_vals(monkeypatch, VALS)
    straight, hist_a = train_tiny(tiny_cfg(tmp_path / "a", cache_dir, eval_interval=2, early_stop=2))
    real_save = keep_checkpoint_at(monkeypatch, 10, tmp_path / "b10")
    forced_vals(monkeypatch, VALS)
    train_tiny(tiny_cfg(tmp_path / "b", cache_dir, eval_interval=2, early_stop=2))
    monkeypatch.setattr(protot, "save_checkpoint", real_save)
    cut = torch.load(tmp_path / "b10" / "ckpt-proto.pt", weights_only=True)
    assert cut["step"] == 10 and cut["best"]["step"] == 8
    forced_vals(monkeypatch, VALS[5:])
    resumed, hist = train_tiny(tiny_cfg(tmp_path / "b10", cache_dir, eval_interval=2, early_stop=2, resume=True))
    assert hist == hist_a and hist["step"][-1] == 12 and resumed.weights_step == straight.weights_step == 8
    assert same_weights(resumed.state_dict(), straight.state_dict())
    a, b = (torch.load(p / "ckpt-proto.pt", weights_only=True) for p in (tmp_path / "a", tmp_path / "b10"))
    assert same_weights(a["model"], b["model"]) and same_weights(a["best"]["model"], b["best"]["model"])


QUIET = ["--layers", "1", "--d-model", "32", "--n-protos", "4", "--ctx", "32", "--batch-size", "4", "--eval-iters",
         "1", "--log-interval", "5", "--no-robustness", "--no-report", "--find-prototype", "off", "--sample-tokens",
         "4", *SMALL_CORPUS]


def test_the_final_evaluation_and_the_analyses_use_the_best_weights(tmp_path, cache_dir, capsys, monkeypatch):
    """After training and with --no-train: the perplexity, the labelling and the samples all get the best
    evaluation's weights (step 10 of 20 here), and the log and the results say which step's."""
    weights, seen = [], {}
    forced_vals(monkeypatch, [5.0, 4.0, 4.5, 4.6], weights)
    real_ppl, real_samples = protot.evaluate_ppl, protot.sample_texts

    def record(name, real=None):
        def fn(model, *a, **k):
            seen[name] = {n: t.detach().clone() for n, t in model.state_dict().items()}
            return real(model, *a, **k) if real else {}
        return fn
    monkeypatch.setattr(protot, "evaluate_ppl", record("ppl", real_ppl))
    monkeypatch.setattr(protot, "label_prototypes", record("labels"))
    monkeypatch.setattr(protot, "sample_texts", record("samples", real_samples))
    out = ["--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)]
    rc, err = call_main(protot.main, [*QUIET, *out, "--max-iters", "20", "--eval-interval", "5"], capsys, monkeypatch)
    assert rc == 0, err
    assert set(seen) == {"ppl", "labels", "samples"} and all(same_weights(w, weights[1]) for w in seen.values())
    assert not same_weights(weights[1], weights[-1])
    assert json.loads((tmp_path / "results.json").read_text())["ppl"]["proto"]["step"] == 10
    assert "with the weights of step 10, the best evaluation's" in (tmp_path / "log-proto.txt").read_text()
    seen.clear()
    rc, err = call_main(protot.main, ["--no-train", *QUIET, *out], capsys, monkeypatch)
    assert rc == 0, err
    assert set(seen) == {"ppl", "labels"} and all(same_weights(w, weights[1]) for w in seen.values())
    assert json.loads((tmp_path / "analysis.json").read_text())["ppl"]["proto"]["step"] == 10


def test_a_checkpoint_from_before_early_stop_loads_and_resumes(tmp_path, cache_dir, capsys, monkeypatch):
    """A checkpoint without "best" (nor early_stop in its config): --no-train analyses its last weights and says
    so; --resume --early-stop 1 takes those weights' val loss as the one to beat, not an earlier minimum whose
    weights are gone (4.2 after 4.0, 4.5 improves on 4.5, so it trains on)."""
    out = ["--out-dir", str(tmp_path), "--cache-dir", str(cache_dir), "--no-labels"]
    forced_vals(monkeypatch, [4.0, 4.5])
    rc, err = call_main(protot.main, [*QUIET, *out, "--max-iters", "10", "--eval-interval", "5"], capsys, monkeypatch)
    assert rc == 0, err
    path = tmp_path / "ckpt-proto.pt"
    ck = torch.load(path, weights_only=True)
    assert ck["best"]["step"] == 5  # the new format keeps the best apart; the old one had only the last weights
    del ck["best"], ck["config"]["early_stop"]
    torch.save(ck, path)
    rc, err = call_main(protot.main, ["--no-train", *QUIET, *out], capsys, monkeypatch)
    assert rc == 0, err
    log = (tmp_path / "log-proto.txt").read_text()
    assert "predates --early-stop: the analyses use its last weights (step 10)" in log
    assert "with the weights of step 10" in log
    forced_vals(monkeypatch, [4.2, 4.3])
    rc, err = call_main(protot.main, ["--resume", "--max-iters", "20", "--early-stop", "1", *out], capsys, monkeypatch)
    assert rc == 0, err
    ck = torch.load(path, weights_only=True)
    assert ck["step"] == 20 and ck["history"]["val"] == [4.0, 4.5, 4.2, 4.3] and ck["best"]["step"] == 15


@pytest.mark.gpu
@pytest.mark.slow  # .ci/gpu runs these last, with the time the benchmarks leave
def test_cuda_tiny_run_and_resume(tmp_path, cache_dir):
    """The tiny run on a GPU (the scan and RMSNorm kernels compiled, bf16 autocast), then --resume."""
    check_cuda_run("protot.py", [*TINY, "--cache-dir", str(cache_dir)], tmp_path, ["ckpt-proto.pt"], 30,
                   protot.peak_flops(torch.device("cuda")))


@pytest.mark.gpu
def test_cuda_training_step_never_waits_for_the_gpu():
    """The training step at the paper's widths (2 layers, batch 4, the Triton scan and RMSNorm): no wait for the
    GPU (check_step_never_waits)."""
    cfg = dataclasses.replace(Config(), layers=2, dropout=0.0)
    model = ProtoT(cfg, protot.BENCH_VOCAB).cuda()
    optimizer = protot.make_optimizer(model, cfg, "cuda")
    x, y = torch.randint(0, protot.BENCH_VOCAB, (2, 4, cfg.ctx), device="cuda")
    assert check_step_never_waits(model, optimizer, x, y, cfg.grad_clip)

def test_each_prompt_gets_its_own_seed(data):
    """The same prompt twice gives two samples: prompt i draws with seed + i (one seed for all made the default
    run's two samples the same text after a few tokens, the prefix mean having forgotten the prompts)."""
    model = ProtoT(Config(layers=1, d_model=16, n_protos=4, dropout=0.0), data.vocab_size).eval()
    a, b = protot.sample_texts(model, data.tokenizer, ["KING:", "KING:"], 24, torch.device("cpu"), seed=5)
    assert a != b and a.startswith("KING:") and b.startswith("KING:")
    assert a == protot.sample_text(model, data.tokenizer, "KING:", 24, torch.device("cpu"), 5)


def test_report_says_how_to_read_its_tables(tmp_path):
    """The configuration shows what "auto" became; robustness and the prototype search say their units, direction,
    the paper's figures and where a column is measured."""
    fp = {"target": "woman", "prompts": 8, "ranking": [{"unit": "L1 P3", "mean": -0.1, "max_drop": -0.2}]}
    rob = {"typo": {"pairs": 3, "proto": {"js": 0.01, "spearman": 0.8766, "top10": 0.9, "top1": 1.0,
                                          "route_js_per_layer": [0.1]}}}
    path = protot.write_report(tmp_path, Config(), {"preset": "cpu", "device": "cpu", "find_prototype": fp,
                                                    "robustness": rob}, {})
    report = path.read_text()
    assert "<td>auto → cpu</td>" in report
    assert "in nats (0 to ln 2 = 0.693), lower = more robust" in report and "typo .207 / .227" in report
    assert "<th>JS</th><th>Spearman</th>" in report and "<td>0.0100</td><td>0.877</td>" in report
    assert "rank correlation of the two distributions over the whole vocabulary (-1 to 1)" in report
    assert f"change on {protot.PPL_WINDOWS} val windows, measured for the top three only" in report


def test_interventions_report_a_rise_as_well_as_a_drop(tmp_path, monkeypatch):
    """Masking a unit can raise the target's probability (the paper: a masked "male" prototype, "women" +16.95%).
    Every prompt rises here: the results, the log line and the report show the largest rise, not only the most
    negative change (which was labelled "max")."""
    base = torch.tensor([0.1, 0.2, 0.4, 1e-8])  # the last is below 1e-6 and skipped
    inside = []

    @protot.contextlib.contextmanager
    def fake_intervention(model, units, mode, seed=0):
        inside.append(True)
        yield
        inside.pop()

    monkeypatch.setattr(protot, "load_prompts", lambda cfg, data, target: ["a", "b", "c", "d"])
    monkeypatch.setattr(protot, "prompt_batch", lambda tok, prompts, target, device: None)
    monkeypatch.setattr(protot, "target_probs", lambda model, batch: base * torch.tensor([1.1, 1.5, 1.2, 9.0])
                        if inside else base)
    monkeypatch.setattr(protot, "evaluate_ppl", lambda *a, **k: {"ppl": 100.0})
    monkeypatch.setattr(protot, "intervention", fake_intervention)
    data = type("D", (), {"tokenizer": None, "device": "cpu"})()
    cfg = Config(layers=2, d_model=16, n_protos=3)
    r = protot.run_intervention(None, data, cfg, [(1, 2)], "write-mask", "women", None)
    assert r["prompts"] == 3
    assert r["max_drop"] == pytest.approx(0.1) and r["max_rise"] == pytest.approx(0.5)
    assert r["mean"] == pytest.approx(0.8 / 3)
    assert protot.change_line(r) == "max drop +10.00% / max rise +50.00% / mean +26.67%"
    fp = protot.find_prototype(ProtoT(cfg, 30), data, cfg, "women", None)
    assert len(fp["ranking"]) == 2 * 3 and all(u["max_rise"] == pytest.approx(0.5) for u in fp["ranking"])
    assert all("ppl_change" in u for u in fp["ranking"][:3])
    report = protot.write_report(tmp_path, cfg, {"find_prototype": fp, "intervention": r}, {}).read_text()
    assert report.count("<th>max_rise</th>") == 2 and report.count("<td>+50.00%</td>") == 6 + 1


def test_find_prototype_measures_its_split_half_pick_on_the_other_half(data, tmp_path):
    """The best unit is picked on the prompts it is measured on; split_half ranks on a seeded random half of the
    prompts and measures that pick on the other half, which the selection never saw."""
    torch.manual_seed(0)
    cfg = Config(layers=2, d_model=32, n_protos=4, heads=2, dropout=0.0, ctx=32)  # short perplexity windows
    model = ProtoT(cfg, data.vocab_size).eval()
    fp = protot.find_prototype(model, data, cfg, "woman", contextlib.nullcontext())
    h = fp["split_half"]
    prompts = protot.PROMPTS["woman"]
    order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
    pick, held = (protot.prompt_batch(data.tokenizer, [prompts[i] for i in half], "woman", data.device)
                  for half in (order[:4], order[4:]))
    best = protot.rank_units(model, cfg, pick, protot.target_probs(model, pick))[0]
    assert h["unit"] == best["unit"] and h["selection_mean"] == best["mean"] and h["measured_on"] <= len(prompts) // 2
    base = protot.target_probs(model, held)
    with protot.intervention(model, [(best["layer"], best["proto"])], "write-mask"):
        rel = protot.relative(protot.target_probs(model, held), base)
    assert h["mean"] == pytest.approx(rel.mean().item()) and h["max_drop"] == pytest.approx(rel.min().item())
    assert "Split half: ranked on a random" in protot.write_report(tmp_path, cfg, {"find_prototype": fp}, {}).read_text()


def test_js_divergence_is_never_negative():
    """Nearly equal distributions: the two KL sums cancel to a rounding error, which was below 0 ("JS -0.0000")."""
    torch.manual_seed(2)
    p = torch.softmax(0.01 * torch.randn(64), -1)
    q = torch.softmax(p.log() + 1e-5 * torch.randn(64), -1)
    assert protot.js_divergence(p, q).item() >= 0 and protot.js_divergence(p, p).item() == 0


def test_report_names_each_models_samples_and_the_intervention_units(tmp_path):
    """--compare samples both models: each under its own heading, saying how it generates (ProtoT's O(1) state,
    the baseline's growing KV cache); an intervention's units are listed, not shown as a Python list."""
    iv = {"units": ["L1 P3", "L0 P2"], "mode": "read-mask", "target": "queen", "prompts": 8, "max_drop": -0.1,
          "mean": -0.05, "ppl": 100.0, "ppl_change": 0.01}
    samples = {"proto": ["KING: a"], "attention": ["KING: b"]}
    report = protot.write_report(tmp_path, Config(), {"intervention": iv, "samples": samples}, {}).read_text()
    assert "<td>L1 P3, L0 P2</td>" in report and "[&#x27;L1 P3&#x27;" not in report
    assert "<h3>ProtoT, O(1) recurrent cache</h3><pre>KING: a</pre>" in report
    assert "<h3>attention baseline, KV cache (grows with the position)</h3><pre>KING: b</pre>" in report
    report = protot.write_report(tmp_path, Config(mixer="attention"), {"samples": {"attention": ["x"]}}, {}).read_text()
    assert "O(1)" not in report and "paired comparison" not in report


def test_a_checkpoint_renamed_to_the_other_mixer_is_refused(tmp_path):
    cfg = Config(out_dir=str(tmp_path), layers=1, d_model=16, n_protos=4, heads=2)
    save_envelope(tmp_path / "ckpt-proto.pt", "protot",
                  dataclasses.asdict(dataclasses.replace(cfg, mixer="attention")))
    with pytest.raises(protot.RunError, match="holds a --mixer attention model, not proto"):
        protot.load_checkpoint(tmp_path / "ckpt-proto.pt", cfg)


def test_unused_flags_are_noted():
    """A typed flag whose analysis does not run in this invocation gets a note naming it and why."""
    def notes(explicit, mixers=("proto",), **kw):
        return [n.split(" has no effect")[0] for n in protot.unused_flags(Config(**kw), set(explicit), mixers)]
    assert notes({"target", "mode", "label_windows"}, train=False, labels=False) == \
        ["note: --mode", "note: --target", "note: --label-windows"]
    assert notes({"target", "prompts"}) == []  # a training run ranks --target (find-prototype auto), from --prompts
    assert notes({"target", "prompts"}, find_prototype="queen") == ["note: --target"]
    assert notes({"target", "prompts"}, train=False, find_prototype="queen") == ["note: --target"]
    assert notes({"target", "mode"}, train=False, intervene="0:1") == []
    assert notes({"target"}, ("attention",), mixer="attention") == ["note: --target"]  # no prototypes to rank
    assert protot.unused_flags(Config(mixer="attention"), {"label_windows"}, ("attention",)) == [
        "note: --label-windows has no effect in this run (no ProtoT model: --mixer attention has no prototypes to "
        "label)"]
    assert notes({"sample_tokens"}, train=False) == ["note: --sample-tokens"]
    assert notes({"sample_tokens"}, train=False, sample="KING:") == []
    assert notes({"top_p", "no_repeat_ngram_size"}, train=False) == ["note: --top-p", "note: --no-repeat-ngram-size"]
    assert notes({"top_p", "repetition_penalty", "temperature"}) == []  # a training run samples
    # one mixer's architecture flags on the other's model (and a --mixer under --compare, which trains both)
    assert notes({"n_protos", "ema", "conv_layers"}, ("attention",), mixer="attention") == [
        "note: --n-protos", "note: --ema", "note: --conv-layers"]
    assert notes({"heads"}) == ["note: --heads"] and notes({"heads", "n_protos"}, ("proto", "attention")) == []
    assert notes({"mixer"}, ("proto", "attention"), compare=True) == ["note: --mixer"] and notes({"mixer"}) == []


def test_the_other_mixers_flags_are_not_held_against_a_checkpoint(tmp_path, cache_dir):
    """An attention checkpoint stores the config's --n-protos, which its model never reads: a later --n-protos
    that differs is not 'trained with n_protos=7 (asked 4)'; for a ProtoT checkpoint it still is (and --heads the
    other way round)."""
    data = common.load_data(cache_dir=cache_dir)
    for mixer, other, same in (("attention", "n_protos", "heads"), ("proto", "heads", "n_protos")):
        cfg = Config(mixer=mixer, layers=1, d_model=16, heads=2, n_protos=7, ctx=16, kernels="torch",
                     out_dir=str(tmp_path))
        model = protot.build_model(cfg, data.vocab_size, torch.device("cpu"))
        path = tmp_path / f"ckpt-{mixer}.pt"
        protot.save_checkpoint(path, model, protot.make_optimizer(model, cfg, "cpu"), cfg, 1, 9.0, data.rng_state(),
                               data, {k: [] for k in protot.HISTORY_KEYS})
        asked = dataclasses.replace(cfg, train=False, **{other: 4})
        protot.load_checkpoint(path, asked, {other})  # no error: not part of this model
        with pytest.raises(protot.RunError, match=rf"was trained with {same}="):
            protot.load_checkpoint(path, dataclasses.replace(cfg, train=False, **{same: 8 if same == "heads" else 4}),
                                   {same})
