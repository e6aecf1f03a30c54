"""Every Triton kernel of the repo compiles for an H100/H200 (sm_90), checked on a machine without a GPU.

The rest of the CPU suite runs the kernels in Triton's interpreter, which executes the Python body with NumPy and
so accepts programs the real compiler rejects (a tl.dot tile under 16, a type the lowering does not support, more
shared memory than an SM has). This file closes that gap without a GPU:

1. record: the LM training steps (paper configurations, tiny batch, fp32 and bf16 autocast), the benchmarks'
   op shapes and the clvq search run in the interpreter, and every kernel launch is recorded with the argument
   types, the 16-byte alignment facts and the constexpr values that Triton's JIT would specialise on;
2. compile: a second process without the interpreter compiles each distinct launch to a cubin for
   GPUTarget("cuda", 90, 32) with Triton's own ptxas (shipped in the triton wheel; no driver, no GPU), and
   reads the registers, stack frame (where ptxas spills) and shared memory of each with the wheel's cuobjdump.

The test fails if a kernel does not compile, needs more shared memory than sm_90 gives one block (227 KiB), or
was never launched by the workloads (so a new kernel cannot escape the check). Run as a script it prints the
table of resources:

    python tests/test_sm90_compile.py
    python tests/test_sm90_compile.py --protot-tiles   # the shapes behind protot's tile limit (minutes of ptxas)
"""
import concurrent.futures
import importlib
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("kernels", "protot", "prism", "dual_stream", "clvq_vae")
SM90_SHARED_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (cudaDevAttrMaxSharedMemoryPerBlockOptin)
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _nvidia_bin(name):
    import triton
    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return path if path.is_file() else None


# ----------------------------------------------------------------------------------------------------------
# 1. Record the launches (interpreter process)

def _encode(value):
    """A constexpr value as JSON: numbers, bools and None as they are, a tl.dtype by name."""
    import triton.language as tl
    if isinstance(value, tl.dtype):
        return {"tl.dtype": value.name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"constexpr of type {type(value).__name__} not recorded")


def _describe(fn, args, kwargs):
    """One launch as the JIT would specialise it: (type, alignment) of each runtime argument through Triton's own
    specialiser, the constexprs (an int argument equal to 1 becomes one, as in the JIT), the launch options."""
    import triton.language as tl
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    kwargs = dict(kwargs)
    options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
    sig = inspect.signature(fn)
    bound = sig.bind(*args, **kwargs)
    bound.apply_defaults()
    signature, constexprs, aligned, declared = {}, {}, [], []
    for i, (name, p) in enumerate(sig.parameters.items()):
        value = bound.arguments[name]
        if p.annotation is tl.constexpr or p.annotation in ("tl.constexpr", "constexpr"):
            signature[name], constexprs[name] = "constexpr", _encode(value)
            declared.append(name)
            continue
        ty, key = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = ty
        if ty == "constexpr":
            constexprs[name] = _encode(value)
        elif key == "D":
            aligned.append(i)
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constexprs": constexprs,
            "aligned": aligned, "declared": declared, "options": options}


# Launches whose outputs steer host code (prism and clvq_vae index with the winners) still run in the interpreter;
# the others are only recorded: their outputs stay the poison/empty buffers, which no later launch's types or
# block sizes depend on, and the recording takes seconds instead of minutes.
EXECUTE = ("prism", "clvq_vae")


@contextmanager
def recording():
    """Record every interpreted launch, running only those of the EXECUTE modules. dual_stream's launch settings
    are the ones it picks on CUDA (16-bit q, k, v go to the tensor cores as they are, in wider tiles), which the
    interpreter could not run; its launches are only recorded. So are prism's and clvq_vae's tl.dot operand types
    (bf16 operands stay bf16 on CUDA): their bf16 launches run in the interpreter with outputs nobody reads
    (_op_shapes)."""
    from triton.runtime.interpreter import InterpretedFunction
    import clvq_vae
    import dual_stream
    import prism

    launches, run, launch_config = [], InterpretedFunction.run, dual_stream._amp_launch_config
    dot_t, vq_dot_t = prism._proto_topk_dot_t, clvq_vae._vq_dot_t
    assert "dual_stream" not in EXECUTE

    def recorded_run(self, *args, grid, warmup, **kwargs):
        launches.append(_describe(self.fn, args, kwargs))
        if self.fn.__module__ in EXECUTE:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recorded_run
    dual_stream._amp_launch_config = lambda q: launch_config(q, cuda=True)
    prism._proto_topk_dot_t = lambda zn: dot_t(zn, cuda=True)
    clvq_vae._vq_dot_t = lambda x, e: vq_dot_t(x, e, cuda=True)
    try:
        yield launches
    finally:
        InterpretedFunction.run = run
        dual_stream._amp_launch_config = launch_config
        prism._proto_topk_dot_t = dot_t
        clvq_vae._vq_dot_t = vq_dot_t


def _lm_step(mod, dtype_autocast, V=5000, T=64):
    """One forward + backward of the script's model in its paper configuration (Config defaults) with the Triton
    kernels forced on, at batch 1 and T tokens: the block sizes depend on the widths, not on B or T (T >= 64)."""
    import torch
    cfg = mod.Config(kernels="triton")
    if mod.__name__ == "prism":  # K is a runtime argument of the kernel (a multiple of 16 either way), and
        cfg.n_protos = 512         # the interpreter runs this one, so a smaller K keeps the recording short
    model = mod.build_model(cfg, V, torch.device("cpu"))
    if hasattr(model, "ready"):  # prism: the prototype head joins after its warm-up; record it, not the twin
        model.ready = True
    idx = torch.randint(V, (1, T + 1))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype_autocast):
        out = model(idx[:, :-1], idx[:, 1:])
    loss = out[0] if isinstance(out, tuple) else out
    loss.backward()


def _op_shapes():
    """The ops at the shapes of each script's --bench (the widths that set the block sizes) and at the extreme widths
    they accept, tiny in N, B and T."""
    import torch
    import clvq_vae
    import dual_stream
    import kernels
    import prism
    import protot

    bf16 = torch.bfloat16
    for D in (256, 384, 768, 1024, 4096):                     # kernels.py --bench: norms in bf16; and bf16 weights
        for dtype, w_dtype in ((torch.float32,) * 2, (bf16, torch.float32), (bf16, bf16)):  # (models cast to bf16)
            x = torch.randn(2, D, dtype=dtype, requires_grad=True)
            w, b = (torch.randn(D, dtype=w_dtype, requires_grad=True) for _ in range(2))
            kernels.rms_norm(x, w, backend="triton").float().sum().backward()
            for g in (1, 6, 12):
                if D % g == 0:
                    kernels.layer_norm(x, w, b, g, backend="triton").float().sum().backward()
    for V in (100277, 16384):                                 # cross-entropy: kernels.py --bench's vocabulary and
        for dtype in (torch.float32, bf16):                   # an aligned one (protot --bench's 16k: V % 16 == 0
            for inplace in (False, True):                     # specialises the strides)
                z = torch.randn(2, V, dtype=dtype, requires_grad=True)
                kernels.cross_entropy(z, torch.tensor([3, V - 1]), inplace_grad=inplace, backend="triton").sum().backward()
    for R, dv in ((32, 128), (32, 64)):                       # protot --bench
        args = [torch.softmax(torch.randn(1, 40, R), -1).requires_grad_(), torch.randn(1, 40, dv, dtype=bf16).requires_grad_(),
                torch.softmax(torch.randn(1, 40, R), -1).requires_grad_(), torch.sigmoid(torch.randn(R)).requires_grad_()]
        protot.prefix_mean_read(*args, backend="triton").float().sum().backward()
    # T = 40 above takes the forward carry's 4-chunk scan step; --bench's contexts (and training at ctx >= 256) take
    # the 16-chunk one. R, d_v and NC are runtime arguments, so small ones that are multiples of 16 like theirs
    # (R 32, d_v 128, NC 64 and up) give the same launch
    slots, masses = torch.zeros(1, 32, 16, 16), torch.zeros(1, 32, 16)
    protot._prefix_mean_fwd_carry[(3, 1)](slots, masses, torch.full((16,), 0.9), 16, 16, 32, BT=protot._BT,
                                          CB=protot._carry_step(32), TILE=protot._CARRY_TILE)
    # prism --bench: d = 768, k = 16, bf16 z, K = 4096...16384; K is a runtime argument (the block sizes depend on d
    # and k only), so K = 512 gives the same launch and the interpreter runs it in seconds less
    z, P = torch.randn(70, 768, dtype=bf16, requires_grad=True), torch.randn(512, 768, requires_grad=True)
    prism.proto_topk(z, P, 16, backend="triton")[1].sum().backward()
    prism.proto_topk(z, P, 16, backend="triton", pairs="cosine")  # --dist cosine (training records the L2 launch)
    for d, k in ((256, 1), (1600, prism.PROTO_TOPK_MAX_K)):   # prism's extremes: k = 1 and 32, GPT-2 XL's width
        z, P = torch.randn(70, d, dtype=bf16, requires_grad=True), torch.randn(300, d, requires_grad=True)
        prism.proto_topk(z, P, k, backend="triton")[1].sum().backward()
    # --dot-precision bf16 at the paper's d = 768, k = 16: training's launch (with the L2 pairs) and --bench's
    # (without); the selection alone, as under recording() the interpreter runs bf16 tl.dots it cannot compute
    zn, Pn = (torch.nn.functional.normalize(torch.randn(n, 768), dim=-1).to(bf16) for n in (70, 512))
    for pairs, norms in ((None, {}), ("l2", dict(zr=torch.ones(70), pr=torch.ones(512)))):
        prism._proto_topk_select_triton(zn, Pn, 16, pairs=pairs, **norms)
    for T in (64, 256):                                       # dual_stream --bench: d_h = 64, bf16
        q, k, v = (torch.randn(1, 2, T, 64, dtype=bf16, requires_grad=True) for _ in range(3))
        dual_stream.amp_attention(q, k, v, 1.0, backend="triton")[0].float().sum().backward()
        # --pos alibi: the bias is a constexpr branch (HAS_BIAS) of all three kernels, so a launch of its own
        dual_stream.amp_attention(q, k, v, 1.0, backend="triton", slopes=dual_stream.alibi_slopes(2))[0].float().sum().backward()
    for d_h in (16, 128):                                     # dual_stream's narrowest and widest heads
        for dtype in (torch.float32, bf16):
            q, k, v = (torch.randn(1, 2, 70, d_h, dtype=dtype, requires_grad=True) for _ in range(3))
            dual_stream.amp_attention(q, k, v, 1.0, backend="triton")[0].float().sum().backward()
    cfg = clvq_vae.Config()
    for d in (384, 768):                                      # clvq_vae: training draws, inference nearest, init
        x, e = torch.randn(70, d), torch.randn(cfg.codebook_size, d)
        for k, temperature in ((cfg.top_k, cfg.temperature), (1, 0.0)):
            clvq_vae.vq_search(x, e, k, temperature, generator=torch.Generator().manual_seed(0), backend="triton")
        clvq_vae.vq_search(x.to(bf16), e, cfg.top_k, cfg.temperature, generator=torch.Generator().manual_seed(0),
                           backend="triton")
        for k, temperature in ((cfg.top_k, cfg.temperature), (1, 0.0)):  # --dot-precision bf16: the selection alone
            clvq_vae._vq_select_triton(x.to(bf16), e.to(bf16), k, temperature, torch.rand(70))  # (as prism's above)
    x, e = torch.randn(70, 768), torch.randn(cfg.codebook_size, 768)  # the widest list the kernel takes
    clvq_vae.vq_search(x, e, clvq_vae.VQ_MAX_K, cfg.temperature, generator=torch.Generator().manual_seed(0),
                       backend="triton")


def _protot_tiles():
    """protot's scan at the largest state tiles it accepts (RP·BDV = 16384, R up to 512) and at ones it refuses
    (RP·BDV = 32768, R = 1024): the measurement behind protot._PREFIX_MEAN_MAX_TILE. Minutes of ptxas, so not part
    of the test."""
    import torch
    import protot

    for R, dv in ((128, 128), (64, 256), (32, 512), (256, 64), (512, 32), (256, 128), (1024, 32)):
        args = [torch.softmax(torch.randn(1, 40, R), -1).requires_grad_(), torch.randn(1, 40, dv).requires_grad_(),
                torch.softmax(torch.randn(1, 40, R), -1).requires_grad_(), torch.sigmoid(torch.randn(R)).requires_grad_()]
        protot._prefix_mean_read_triton(*args).sum().backward()


def record_launches(workload=None):
    """All distinct launches of the workloads (needs TRITON_INTERPRET=1 before triton is imported)."""
    import torch
    import dual_stream
    import prism
    import protot

    assert os.environ.get("TRITON_INTERPRET") == "1", "recording needs Triton's interpreter"
    torch.manual_seed(0)
    with recording() as launches:
        if workload is not None:
            workload()
        else:
            for mod in (protot, prism, dual_stream):
                for autocast in (False, True):
                    _lm_step(mod, autocast)
            _op_shapes()
    distinct = {}  # one launch per kernel, declared constexprs, pointer types, options and 16-divisible arguments
    for v in launches:  # (vectorised loads change registers); an int equal to 1 changes little of the code
        declared = {k: v["constexprs"][k] for k in v["declared"]}
        key = [v["module"], v["name"], declared, [t for t in v["signature"].values() if t.startswith("*")],
               v["options"], v["aligned"]]
        distinct.setdefault(json.dumps(key, sort_keys=True), v)
    return list(distinct.values())


def launched_kernels():
    """(module, name) of every jit function the scripts launch with a grid, found in their source (`name[grid](`),
    so that a kernel added later is checked too."""
    found = set()
    for module in SCRIPTS:
        src = (ROOT / f"{module}.py").read_text()
        for name in re.findall(r"@triton\.jit\s*\ndef (\w+)\(", src):
            if re.search(rf"\b{name}\[", src):
                found.add((module, name))
    return found


# ----------------------------------------------------------------------------------------------------------
# 2. Compile for sm_90 (a process without the interpreter)

def _compile_one(launch):
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from triton.runtime.jit import JITFunction

    fn = getattr(importlib.import_module(launch["module"]), launch["name"])
    while not isinstance(fn, JITFunction):  # @triton.heuristics / @triton.autotune wrap the JITFunction
        fn = fn.fn
    decode = lambda v: getattr(tl, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(
        v["tl.dtype"], v["tl.dtype"])) if isinstance(v, dict) else v
    constexprs = {k: decode(v) for k, v in launch["constexprs"].items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i in launch["aligned"]}
    row = {k: launch[k] for k in ("module", "name", "options")}
    row["constexprs"] = {k: launch["constexprs"][k] for k in launch["declared"]}
    row["dtypes"] = [t for t in launch["signature"].values() if t.startswith("*")]  # in argument order
    row["aligned"] = len(launch["aligned"])
    try:
        kernel = triton.compile(ASTSource(fn, launch["signature"], constexprs, attrs),
                                target=GPUTarget("cuda", 90, 32), options=launch["options"])
    except Exception as e:  # the message is the finding
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"[:500]
        return row
    row["shared"] = kernel.metadata.shared
    row["num_warps"] = kernel.metadata.num_warps
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(_nvidia_bin("cuobjdump")), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    row.update(regs=int(m[1]), stack=int(m[2])) if m else row.update(usage=usage[-300:])  # spills land in STACK
    return row


def _pythonpath():
    """The repo first, then the caller's PYTHONPATH: a child must import the same triton as its parent, or the
    launches recorded with one version would be compiled by another."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)


def compile_all(launches, workers=2):
    """Compile in a fresh process (the interpreter must be off when triton is imported); -> one row per launch."""
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "launches.json", Path(tmp) / "compiled.json"
        src.write_text(json.dumps(launches))
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=_pythonpath(), TRITON_DEFAULT_FP_FUSION="1")
        # its own session, so that a timeout ends the worker pool too, not only the child that started it
        import triton
        child = subprocess.Popen([sys.executable, __file__, "--compile", str(src), str(dst), str(workers),
                                  triton.__file__],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                                 start_new_session=True)
        try:
            out, err = child.communicate(timeout=900)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            raise
        assert child.returncode == 0, out[-3000:] + err[-3000:]
        return json.loads(dst.read_text())


def format_rows(rows):
    # pointers: one letter per pointer argument (f fp32, b bf16, h fp16, l int64, i int32); aligned: how many
    # arguments are 16-byte aligned pointers or ints divisible by 16 (the JIT's tt.divisibility)
    lines = [f"{'kernel':<34} {'constexprs':<52} {'pointers':<14} {'al':>2} {'warps':>5} {'regs':>4} {'stack B':>7} "
             f"{'smem B':>7}"]
    letter = {"*fp32": "f", "*bf16": "b", "*fp16": "h", "*i64": "l", "*i32": "i"}
    for r in sorted(rows, key=lambda r: (r["module"], r["name"], json.dumps(r["constexprs"], sort_keys=True))):
        cx = ",".join(f"{k}={v['tl.dtype'] if isinstance(v, dict) else v}" for k, v in r["constexprs"].items())
        ptrs = "".join(letter.get(t, "?") for t in r["dtypes"])
        head = f"{r['module']}.{r['name']:<{33 - len(r['module'])}} {cx[:52]:<52} {ptrs[:14]:<14} {r['aligned']:>2}"
        if "error" in r:
            lines.append(f"{head} ERROR {r['error']}")
        else:
            lines.append(f"{head} {r['num_warps']:>5} {r.get('regs', '?'):>4} {r.get('stack', '?'):>7} {r['shared']:>7}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------
# The test

@pytest.mark.skipif(sys.platform != "linux", reason="the triton wheel ships ptxas for Linux only")
def test_every_kernel_compiles_for_sm90():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("records launches in the interpreter; on a CUDA machine `pytest -m gpu` compiles them for real")
    if _nvidia_bin("ptxas") is None or _nvidia_bin("cuobjdump") is None:
        pytest.skip("this triton wheel ships no ptxas/cuobjdump")
    try:  # Triton internals (as of 3.9): the JIT's specialiser and ahead-of-time compile entry points
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
        from triton.runtime.jit import native_specialize_impl  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this triton lacks an internal the check uses ({e})")
    launches = record_launches()
    missing = launched_kernels() - {(x["module"], x["name"]) for x in launches}
    assert not missing, f"kernels the workloads never launched (add a workload): {sorted(missing)}"
    rows = compile_all(launches)
    print(format_rows(rows))
    failed = [r for r in rows if "error" in r]
    assert not failed, "kernels that do not compile for sm_90:\n" + format_rows(failed)
    big = [r for r in rows if r["shared"] > SM90_SHARED_LIMIT]
    assert not big, "kernels needing more shared memory than an sm_90 block has:\n" + format_rows(big)
    assert all("regs" in r for r in rows), "cuobjdump gave no resource usage"


if __name__ == "__main__":
    if sys.argv[1:2] == ["--compile"]:  # the compiling child of compile_all
        sys.path.insert(0, str(ROOT))
        import triton
        assert triton.__file__ == sys.argv[5], f"compiling with {triton.__file__}, recorded with {sys.argv[5]}"
        launches, workers = json.loads(Path(sys.argv[2]).read_text()), int(sys.argv[4])
        with concurrent.futures.ProcessPoolExecutor(workers) as pool:
            rows = list(pool.map(_compile_one, launches))
        Path(sys.argv[3]).write_text(json.dumps(rows))
    else:  # the table, by hand: record in the interpreter (a child with TRITON_INTERPRET=1), then compile
        if os.environ.get("TRITON_INTERPRET") != "1":
            env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=_pythonpath())
            sys.exit(subprocess.run([sys.executable, __file__] + sys.argv[1:], env=env).returncode)
        sys.path.insert(0, str(ROOT))
        tiles = sys.argv[1:2] == ["--protot-tiles"]
        rows = compile_all(record_launches(_protot_tiles if tiles else None), workers=os.cpu_count() or 2)
        print(format_rows(rows))
        if tiles:  # the last shape is meant to be over the limit
            print(f"sm_90 limit: {SM90_SHARED_LIMIT} B of shared memory per block")
        else:
            sys.exit(1 if any("error" in r or r["shared"] > SM90_SHARED_LIMIT for r in rows) else 0)
