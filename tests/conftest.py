"""Shared test set-up.

* Two modes (see pytest_configure): the CPU suite, where GPUs are hidden and the Triton kernels run in
  Triton's interpreter, the same on a laptop, in CI and on a CUDA machine; and `-m gpu`, the CUDA tests.
* GLASSBOX_POISON=1 makes kernels.py allocate its output buffers filled with NaN, so a kernel that forgets
  to write a tile fails the comparison instead of passing on lucky zeros (fla's conftest does the same).
* fp32 matmuls stay IEEE (no TF32), so fp32 comparisons measure the kernel, not the tensor cores (prism's top-k and
  clvq's search pick their own tl.dot precision, 3xTF32; the interpreter computes it in IEEE fp32 anyway).
* Every test starts from the same seeds.
* Every cache a test writes (tokens, activations, fine-tuned models) goes to one session folder (GLASSBOX_CACHE).
* `check_close` is the one relative-error helper of the suite (thresholds in its docstring), given to tests
  as the `assert_close` fixture, or imported (`from conftest import check_close`) where a helper needs it.
"""
import concurrent.futures
import importlib.util
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest


def interpreter_problem(triton_version=None, numpy_version=None):
    """Why Triton's interpreter cannot run the kernels with the installed versions, or None. Triton before 3.7
    turns a scalar kernel argument into a Python int with int() of a one-element array (`range(0, K, BLOCK)`
    fails), which NumPy 2.4 made a TypeError; 3.7 squeezes the array first. Seen here with numpy 2.4.6: 3.4.0,
    3.5.1 and 3.6.0 fail the kernel tests, 3.7.1 and 3.8.0 pass the RMSNorm ones, 3.9.0 the suite; with numpy
    2.3.5, 3.4.0 and 3.6.0 pass the suite. torch 2.11's CUDA build pins triton 3.6.0, so a CUDA machine with that
    torch and a new NumPy meets this."""
    def release(version):  # "3.6.0" -> (3, 6); "2.4rc1" -> (2, 4); None for what is not "MAJOR.MINOR..."
        m = re.match(r"(\d+)\.(\d+)", version)
        return (int(m[1]), int(m[2])) if m else None

    if triton_version is None or numpy_version is None:
        try:
            import triton
        except ImportError:  # no Triton: the kernel tests check the torch-only path instead
            return None
        import numpy

        triton_version, numpy_version = triton.__version__, numpy.__version__
    triton_release, numpy_release = release(triton_version), release(numpy_version)
    if triton_release and numpy_release and triton_release < (3, 7) and numpy_release >= (2, 4):
        return (f"the CPU suite runs the Triton kernels in Triton's interpreter, and triton {triton_version}'s "
                f"interpreter fails with numpy {numpy_version} (int() of a one-element array): "
                f"pip install 'numpy<2.4', or triton>=3.7")
    return None


def pytest_configure(config):
    """Runs before any test module is imported. The suite has two modes:
    * the CPU suite (the default, and CI): GPUs are hidden so it behaves the same on a CUDA machine, and the
      Triton kernels run on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1 must be set before triton
      is first imported, which is why this happens here and torch/triton are imported only afterwards);
    * `-m gpu`: the CUDA tests at realistic sizes, with compiled kernels."""
    markexpr = config.getoption("markexpr") or ""
    # A GPU run is one whose -m selects gpu-marked tests (plain or also slow) and neither unmarked nor slow-only
    # ones ("gpu", "gpu and not slow", "gpu and slow"), judged by evaluating the expression, so "slow" and
    # "not (gpu or slow)" stay CPU runs.
    from _pytest.mark.expression import Expression

    expr = Expression.compile(markexpr) if markexpr else None
    matches = lambda *marks: expr is None or expr.evaluate(lambda name, **kw: name in marks)
    gpu_run = (expr is not None and (matches("gpu") or matches("gpu", "slow")) and not matches()
               and not matches("slow"))
    if not gpu_run:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("GLASSBOX_POISON", "1")
    os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
    import torch

    if not torch.cuda.is_available():
        if gpu_run:  # skipping every test would exit 0 and pass for a GPU check that never ran
            raise pytest.UsageError("-m gpu selects the CUDA tests, but torch sees no CUDA device "
                                    f"(torch {torch.__version__}; a CPU build, or no driver)")
        os.environ["TRITON_INTERPRET"] = "1"
        problem = interpreter_problem()
        if problem:
            raise pytest.UsageError(problem)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if importlib.util.find_spec("transformers") is not None:  # clvq_vae's tests build HF models in this process:
        import clvq_vae  # keep transformers >= 5.25 off the repo's kernels.py (see the function)

        clvq_vae.transformers_without_hub_kernels()


import numpy as np  # noqa: E402
import torch  # noqa: E402  (torch reads CUDA_VISIBLE_DEVICES when CUDA is first initialised, in configure)

# Relative RMS thresholds per dtype of the tensor under test, measured against a float64 (exact) reference.
# fp32: reductions in a different order differ by ~1e-7 relative; 1e-5 leaves room for long sums.
# bf16: one rounding of the output alone is ~2e-3 relative RMS; fla uses 5e-3 for outputs and up to 8e-3 for
# gradients; we use 8e-3 for both. fp16 keeps 3 more significand bits (one rounding ~3e-4): 1e-3 and an atol of 1e-4,
# so a computation done in fp16 where it should be fp32 fails instead of passing on the absolute bound.
RATIO = {torch.float32: 1e-5, torch.float64: 1e-10, torch.bfloat16: 8e-3, torch.float16: 1e-3}
ATOL = {torch.float32: 1e-6, torch.float64: 1e-12, torch.bfloat16: 1e-3, torch.float16: 1e-4}


def check_close(name, ref, out, ratio=None, atol=None):
    """Pass if max|ref - out| <= atol; otherwise require no NaN/inf in `out` and
    rms(ref - out) / rms(ref) < ratio. Both default to the per-dtype tables above (keyed by out.dtype).
    `ref` is compared in float64, so a bf16 `out` is judged against the exact reference, not a rounded one.
    The atol shortcut needs a reference larger than atol (rms), or an all-zero one: below that every output of the
    same small size (zeros, the negation) would be within atol, so the ratio decides."""
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != reference {tuple(ref.shape)}"
    ratio = RATIO[out.dtype] if ratio is None else ratio
    atol = ATOL[out.dtype] if atol is None else atol
    r, o = ref.detach().double().cpu(), out.detach().double().cpu()
    assert torch.isfinite(o).all() or not torch.isfinite(r).all(), f"{name}: non-finite values in output"
    abs_err = (r - o).abs().max().item() if r.numel() else 0.0
    rms_ref = r.pow(2).mean().sqrt().item() if r.numel() else 0.0
    if abs_err <= atol and (rms_ref >= atol or rms_ref == 0.0):
        return
    err = (r - o).pow(2).mean().sqrt().item() / max(rms_ref, 1e-30)
    assert err < ratio, f"{name}: rel rms err {err:.3e} >= {ratio:.1e} (max abs err {abs_err:.3e})"


def compiled_ops(fn, *args):
    """Run fn under torch.compile with a backend that records the graphs dynamo captures (and runs them eagerly).
    -> (fn's output, the names of the calls in every captured graph and in the subgraphs it calls (an
    autograd.Function's forward and backward), such as 'mul', 'matmul', '_enter_autocast', 'detach').
    A function kept out of compiled graphs (torch.compiler.disable) leaves no op of its own in them; comparing the
    compiled output with the eager one cannot show that, since the eager backend computes the same either way."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(fn, backend=backend)(*args)
    modules = [m for g in graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)]  # with the bodies
    return out, [getattr(n.target, "__name__", str(n.target)) for m in modules for n in m.graph.nodes
                 if n.op in ("call_function", "call_method")]


ROOT = Path(__file__).resolve().parent.parent
# Command-line runs train on the first 200k tokens (the comedies) and score on a 10k-token val slice: the full
# corpus's 19k-row vocabulary and 122k-token val perplexity would dominate every tiny run.
SMALL_CORPUS = ["--max-tokens", "200000"]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    """One token cache folder for the whole session: each (corpus, tokenizer, budget) is tokenised once."""
    return _session_cache_dir(tmp_path_factory)


def _session_cache_dir(tmp_path_factory):
    path = tmp_path_factory.getbasetemp() / "token-cache"
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """What a test runs without --cache-dir (in-process or as a subprocess) caches into the session's folder too,
    never into the user's ~/.cache/glassbox or a GLASSBOX_CACHE of theirs (a test module may override cache_dir)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GLASSBOX_CACHE", str(_session_cache_dir(tmp_path_factory)))
        yield


def run_script(*args, cwd=ROOT, env=None, timeout=600):
    """Run a command the way a user would: offline, and without the tests' Triton interpreter."""
    env = {**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def run_one_and_ddp(script: str, args: list, tmp_path: Path, ckpt: str) -> tuple[dict, dict]:
    """`script args` in one process (out_dir tmp_path/one) and under torchrun with 2 gloo processes (tmp_path/two);
    -> the two checkpoints `ckpt`. The two runs go side by side (their start-up is mostly single-threaded imports,
    so together they take about a fifth less time on 2 cores); they share only caches, which every script writes
    atomically under a per-process temporary name."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        one = pool.submit(run_script, script, *args, "--out-dir", str(tmp_path / "one"))
        two = pool.submit(run_script, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script,
                          *args, "--out-dir", str(tmp_path / "two"), env={"OMP_NUM_THREADS": "1"})
        one, two = one.result(), two.result()
    assert one.returncode == 0, one.stderr[-2000:]
    assert two.returncode == 0, two.stderr[-3000:]
    return tuple(torch.load(tmp_path / d / ckpt, weights_only=True) for d in ("one", "two"))


def check_ddp_weights(a: dict, b: dict, lr: float, max_frac: float = 1e-4):
    """Weights after a few Adam steps in one process (a) and in DDP (b). The two sum gradients in different orders,
    and Adam turns rounding noise in a near-zero gradient into an update of up to lr (its first step is
    lr·sign(g)), so a handful of such elements may differ by a fraction of lr while everything else agrees to
    float precision. A broken DDP (no averaging, ranks on the same windows) moves most elements, or moves some by
    whole lr steps: every element must lie within lr/10, and at most max_frac of them outside rtol 1e-4."""
    n = bad = 0
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=lr / 10, msg=k)
        n += a[k].numel()
        bad += int((~torch.isclose(a[k].float(), b[k].float(), rtol=1e-4, atol=1e-5)).sum())
    assert bad <= max_frac * n, f"{bad} of {n} weights differ beyond rtol 1e-4"


def save_envelope(path, script: str, config: dict, history=None) -> None:
    """A checkpoint file with every key a script's load_checkpoint asks for, each of the kind it checks, and no
    weights: enough for the checks that read the stored config (a renamed file, a twin's recipe) before any model
    is built. `history` defaults to the script's empty one."""
    import importlib

    keys = importlib.import_module(script).HISTORY_KEYS
    torch.save({"format": "glassbox-checkpoint/1", "script": script, "model": {}, "optimizer": {}, "step": 5,
                "best_val_loss": 6.0, "tokenizer": {"name": "cl100k", "compacted": False, "kept": torch.empty(0)},
                "history": {k: [] for k in keys} if history is None else history,
                "rng": {"torch": 0, "data": 0, "cuda": 0}, "config": config}, path)


def fake_cuda_dispatch(monkeypatch, module, launcher: str) -> None:
    """Make `module`'s `auto` dispatch see CUDA tensors and Triton (both faked), with its Triton entry point
    `launcher` replaced by a failure: a call that should stay on the torch forms (float64) fails the test if not."""
    monkeypatch.setattr(module, "HAS_TRITON", True)
    monkeypatch.setattr(module, launcher, lambda *a, **k: pytest.fail("float64 reached the Triton path"))
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))


def check_bad_token_batches(call, generate) -> None:
    """A language model refuses an empty or 1-D token batch at `call` (its forward, or generate) and a negative
    top_k in `generate`, each with a one-line ValueError."""
    for shape in ((1, 0), (0, 4), (4,)):
        with pytest.raises(ValueError, match=r"idx must be \[B, T\] with B, T >= 1"):
            call(torch.zeros(shape, dtype=torch.long))
    with pytest.raises(ValueError, match=r"top_k must be >= 0 \(0: no top-k\), got -1"):
        generate(torch.zeros(1, 3, dtype=torch.long), 2, top_k=-1)


def half_written_save(obj, f, *args, **kwargs):
    """A stand-in for torch.save that writes the first bytes of its file and fails, as on a full disk."""
    Path(f).write_bytes(b"PK\x03\x04 the first bytes of a zip")
    raise OSError(28, "No space left on device")


def check_save_is_atomic(save, path: Path, monkeypatch) -> None:
    """save(step) writes a checkpoint to `path`. One at step 1; then a save of step 2 whose torch.save writes a few
    bytes and fails (half_written_save): the error reaches the caller, step 1's file still loads (a save written in
    place of the old file would have destroyed it) and nothing else is left in its folder."""
    save(1)
    with monkeypatch.context() as m:
        m.setattr(torch, "save", half_written_save)
        with pytest.raises(OSError, match="No space left on device"):
            save(2)
    assert torch.load(path, weights_only=True)["step"] == 1
    assert [f.name for f in path.parent.iterdir()] == [path.name]  # and the half-written file is removed


def run_main(main, argv, capsys, monkeypatch, env=None) -> subprocess.CompletedProcess:
    """A script's main(argv) in-process, as `python script.py ...` would run it (offline, without the suite's
    Triton interpreter, with `env` on top), returned like run_script's result: returncode, stdout, stderr.
    argparse's own errors exit through SystemExit. The suite runs a command in-process unless the process is what
    is under test (a script copied alone, torchrun, a missing package, each script's `python script.py` entry
    point once): a subprocess pays ~3 s of imports."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    capsys.readouterr()  # what the test printed before is not the command's
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, rc, out, err)


def call_main(main, argv, capsys, monkeypatch, env=None):
    """run_main -> (exit status, stderr)."""
    r = run_main(main, argv, capsys, monkeypatch, env)
    return r.returncode, r.stderr


@pytest.fixture
def assert_close():
    return check_close


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(42)
    np.random.seed(42)
    torch.manual_seed(42)
    yield


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def check_cuda_run(script: str, args: list, out_dir, ckpts: list[str], steps: int, peak) -> str:
    """A tiny end-to-end run on CUDA as a user's first GPU run makes it (bf16 autocast, the compiled Triton kernels,
    every analysis on CUDA tensors), then --resume extending it by 10 steps. Checks the first model's falling loss
    and its MFU column (a number where the GPU's peak is listed, `peak`; the scripts start it after 5 log
    intervals, so the run logs 6), that each checkpoint in `ckpts` reached steps + 10 and holds the CUDA generator
    of its device. Returns the first run's stdout."""
    assert steps % 6 == 0, "six log lines, the last past the MFU's five-interval warm-up"
    args = [*args, "--preset", "cpu", "--device", "cuda", "--log-interval", str(steps // 6), "--out-dir", str(out_dir)]
    r = run_script(script, *args, "--max-iters", str(steps))
    assert r.returncode == 0, r.stderr[-3000:]
    assert ": trained in" in r.stdout, r.stdout[-3000:]
    first = r.stdout[:r.stdout.index(": trained in")]  # the first model's lines (prism: the twin, clvq: CLVQ-VAE)
    lines = [ln for ln in first.splitlines() if ln.startswith("step ") and "| loss" in ln]
    losses = [float(ln.split("| loss ")[1].split()[0]) for ln in lines]
    assert len(lines) == 6 and losses[-1] < losses[0], lines
    assert ("| mfu -" not in lines[-1]) == (peak is not None), lines
    again = run_script(script, *args, "--max-iters", str(steps + 10), "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"at step {steps}" in again.stdout and "resumed from" in again.stdout
    for name in ckpts:
        ck = torch.load(Path(out_dir) / name, weights_only=True)
        assert ck["step"] == steps + 10 and isinstance(ck["rng"]["cuda"], torch.Tensor), name
    return r.stdout


def check_step_never_waits(model, optimizer, x, y, grad_clip: float, on_stats=None, warmup: int = 2) -> bool:
    """One training step as the scripts' train() runs it on CUDA (bf16 autocast, the NaN flag, on_stats(stats)
    for a model that returns (loss, stats), clipping when grad_clip > 0, AdamW), `warmup` times, then once under
    torch.cuda.set_sync_debug_mode("error"), where any call that makes the host wait for the GPU (.item(), a
    nonzero, a bincount without minlength, a device-to-host copy) raises, its traceback naming the op. A step that
    waits drains the GPU's queue: the launches after it are paid for in full, no longer hidden behind the kernels
    already queued, which the throughput benchmarks would show as a lower ratio to the dense model. The warm-up
    steps compile the Triton kernels and create the optimizer's state outside the check. Returns whether every
    loss was finite."""
    bad = torch.zeros((), dtype=torch.bool, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, y)
        loss, stats = out if isinstance(out, tuple) else (out, {})
        loss.backward()
        bad.logical_or_(~torch.isfinite(loss.detach()))
        if on_stats is not None:
            on_stats(stats)
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return not bool(bad)
