"""protot.py's core op, prefix_mean_read: the recurrence (in float64) is the ground truth; the chunked torch form
and the Triton kernels (under Triton's interpreter without a GPU, see conftest.py) must match it on y and on every
gradient (w, v, ρ, β), driven by a random cotangent. Kernel outputs are NaN-poisoned (GLASSBOX_POISON=1)."""
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import protot as op
from conftest import RATIO, SMALL_CORPUS, check_close as assert_close, compiled_ops, fake_cuda_dispatch, run_main

ROOT = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


BETAS = {  # β = σ(γ) per channel, in (0, 1)
    "sigmoid": lambda R: torch.randn(R).sigmoid(),
    "near0": lambda R: torch.logspace(-4, -2, R),  # 1e-4 .. 1e-2: the prefix mean is ~the previous value
    "near1": lambda R: 1 - torch.logspace(-4, -3, R),  # 1-1e-4 .. 0.999: long memory, tiny (1-β) writes
}


def make_inputs(B, T, R, dv, beta="sigmoid", dtype=torch.float32, sharpness=2.0, seed=42):
    """w and ρ are softmaxes over R of random logits (larger `sharpness`: more near-empty channels)."""
    torch.manual_seed(seed)
    w = (sharpness * torch.randn(B, T, R)).softmax(-1)
    rho = (sharpness * torch.randn(B, T, R)).softmax(-1)
    v = torch.randn(B, T, dv)
    dy = torch.randn(B, T, dv)
    xs = [x.to(DEVICE, dtype) for x in (w, v, rho)] + [BETAS[beta](R).to(DEVICE)]
    return xs, dy.to(DEVICE, dtype)


def forward_backward(fn, inputs, dy):
    """y and the gradients of (y · dy).sum() for w, v, ρ, β (zeros where y does not depend on an input)."""
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    y = fn(*leaves)
    (y * dy).sum().backward()
    return [y] + [torch.zeros_like(x) if x.grad is None else x.grad for x in leaves]


def reference(inputs, dy):
    """The float64 recurrence on the same (possibly bf16-rounded) inputs."""
    return forward_backward(op.prefix_mean_read_recurrent, [x.double() for x in inputs], dy.double())


def triton_form(w, v, rho, beta):
    return op.prefix_mean_read(w, v, rho, beta, backend="triton")


FORMS = {
    "chunked": op.prefix_mean_read_chunked,
    "chunked-C8": lambda w, v, rho, beta: op.prefix_mean_read_chunked(w, v, rho, beta, chunk=8),
    "triton": triton_form,
}
NAMES = ("y", "dw", "dv", "drho", "dbeta")


def check_against_reference(forms, inputs, dy, ratio):
    ref = reference(inputs, dy)
    for form in forms:
        for name, r, o in zip(NAMES, ref, forward_backward(FORMS[form], inputs, dy)):
            assert_close(f"{form} {name}", r, o, ratio)


SHAPES = [(1, 1, 5, 24), (2, 17, 5, 24), (2, 17, 32, 128), (1, 37, 5, 100), (1, 100, 32, 24), (2, 100, 5, 128),
          (2, 100, 32, 128)]


@pytest.mark.parametrize("beta", list(BETAS))
@pytest.mark.parametrize("B,T,R,dv", [pytest.param(*s, id="B{}-T{}-R{}-D{}".format(*s)) for s in SHAPES])
def test_forms_agree(B, T, R, dv, beta):
    inputs, dy = make_inputs(B, T, R, dv, beta)
    check_against_reference(FORMS, inputs, dy, RATIO[torch.float32])


def test_forms_agree_where_the_clamp_bites():
    """Sharp write gates and long memory leave many channels with M_{t-1} < eps: the clamp's own gradient
    (∂β through eps/(1-β), zero ∂M there) must match too."""
    inputs, dy = make_inputs(2, 100, 32, 24, "near1", sharpness=8.0)
    w, _, _, beta = inputs
    mass = torch.zeros(2, 32, device=DEVICE)
    clamped = 0
    for t in range(1, 100):
        mass = beta * mass + (1 - beta) * w[:, t - 1]
        clamped += (mass < op.MASS_EPS).sum().item()
    assert clamped > 100, f"only {clamped} clamped (t, channel) pairs: the test would not exercise the clamp"
    check_against_reference(FORMS, inputs, dy, RATIO[torch.float32])


def test_beta_rounded_to_one_keeps_gradients_finite():
    """β = σ(γ) rounds to exactly 1.0 in fp32 once γ >= 16.7 (a γ that drifted up in a long run). Such a channel
    never gets write mass (1-β = 0), reads 0, and σ'(γ) = 0, so ∂γ must be 0: not 0·inf = NaN from the clamp's
    eps/(1-β). y and all four gradients (∂β too) of every form match the float64 recurrence on the same β, and so
    does ∂γ = ∂β·σ'(γ)."""
    inputs, dy = make_inputs(2, 40, 4, 24)
    gamma = torch.tensor([17.0, 2.0, 0.0, -1.0], device=DEVICE)
    inputs[3] = gamma.sigmoid()
    assert inputs[3][0].item() == 1.0
    dsigmoid = inputs[3] * (1 - inputs[3])  # fp32 σ'(γ), exactly 0 for the saturated channel
    ref = reference(inputs, dy)
    for form in FORMS:
        out = forward_backward(FORMS[form], inputs, dy)
        for name, r, o in zip((*NAMES, "dgamma"), [*ref, ref[4].float() * dsigmoid], [*out, out[4] * dsigmoid]):
            assert torch.isfinite(o).all(), f"{form} {name}: non-finite"
            assert_close(f"{form} {name}", r, o, RATIO[torch.float32])


@pytest.mark.slow
def test_long_sequence():
    """T > 2048 with decays from 1e-3 to 1-1e-4 side by side, chunked and Triton against the float64 recurrence."""
    inputs, dy = make_inputs(1, 2050, 8, 16)
    inputs[3] = torch.tensor([1e-3, 0.3, 0.5, 0.8, 0.9, 0.99, 0.999, 0.9999], device=DEVICE)
    check_against_reference(["chunked", "triton"], inputs, dy, RATIO[torch.float32])


def test_carry_over_partial_tiles_and_scan_steps():
    """The forward carry scans 16 chunks per step over 128 slot elements per program: R·d_v = 280 (two full tiles and
    a partial one) and 19 chunks (a full step and a partial one), then R = 130 (two mass programs), against the
    float64 recurrence."""
    assert (op._CARRY_CB, op._CARRY_TILE, op._carry_step(19)) == (16, 128, 16)  # the shapes below straddle them
    assert [op._carry_step(n) for n in (1, 2, 3, 7, 16, 17)] == [2, 2, 4, 8, 16, 16]
    inputs, dy = make_inputs(2, 300, 7, 40)
    check_against_reference(["triton"], inputs, dy, RATIO[torch.float32])
    # R = 130 > TILE: the masses take two programs, the second starting at mass element 128
    inputs, dy = make_inputs(1, 300, 130, 16)
    check_against_reference(["triton"], inputs, dy, RATIO[torch.float32])


@pytest.mark.parametrize("b,exact_until,wrong_from,zero_from", [(0.9, 200, 240, 470), (0.5, 30, 40, 75)])
def test_official_shortcut_collapses(b, exact_until, wrong_from, zero_from):
    """Spec §1.3: the official β^s-cumsum matches early on, goes wrong once β^t nears its 1e-12 guard and then
    reads ~0 (the README's and docstring's figures: β = 0.9 off by over 1 % past ~230 tokens, below 1e-3 of the
    exact value from ~470; β = 0.5 past ~35, from ~75); the exact forms match the recurrence everywhere."""
    (w, v, rho, _), _ = make_inputs(1, 1024, 4, 8)
    beta = torch.full((4,), b, device=DEVICE)
    with torch.no_grad():
        ref = op.prefix_mean_read_recurrent(w.double(), v.double(), rho.double(), beta.double())
        official = op.prefix_mean_read_official(w, v, rho, beta)
        assert_close(f"official, t < {exact_until}", ref[:, :exact_until], official[:, :exact_until], ratio=1e-3)
        err = (official.double() - ref).norm(dim=-1) / ref.norm(dim=-1)  # [B, T], per position
        assert (err[:, wrong_from:] > 0.01).all(), f"official shortcut within 1 % somewhere past t = {wrong_from}"
        late_err = (official[:, zero_from:] - ref[:, zero_from:]).norm() / ref[:, zero_from:].norm()
        assert late_err > 0.999, f"official shortcut at t > {zero_from}: rel err {late_err:.4f}, expected ~1 (collapse)"
        assert (official[:, zero_from:].norm(dim=-1) < 1e-3 * ref[:, zero_from:].norm(dim=-1)).all()
        for form in ("chunked", "triton"):
            assert_close(f"{form}, all t", ref, FORMS[form](w, v, rho, beta), RATIO[torch.float32])


def test_decode_steps_reproduce_the_parallel_output():
    """Spec §4: 300 O(1) decode steps give the same y as the parallel forms."""
    (w, v, rho, beta), _ = make_inputs(2, 300, 5, 24)
    with torch.no_grad():
        state = op.prefix_mean_init_state(2, 5, 24, DEVICE)
        steps = []
        for t in range(300):
            y_t, state = op.prefix_mean_step(state, w[:, t], v[:, t], rho[:, t], beta)
            steps.append(y_t)
        stepped = torch.stack(steps, 1)
        ref = op.prefix_mean_read_recurrent(w.double(), v.double(), rho.double(), beta.double())
        assert_close("decode", ref, stepped, RATIO[torch.float32])
        for form in ("chunked", "triton"):
            assert_close(f"decode vs {form}", FORMS[form](w, v, rho, beta), stepped, RATIO[torch.float32])
    assert state[0].shape == (2, 5, 24) and state[1].shape == (2, 5) and state[0].dtype == torch.float32


@pytest.mark.parametrize("beta", ["sigmoid", "near1"])
def test_bf16_inputs(beta):
    """bf16 w, v, ρ (β fp32): fp32 state maths inside, y and gradients in bf16, judged with bf16 thresholds."""
    inputs, dy = make_inputs(2, 100, 32, 128, beta, dtype=torch.bfloat16)
    ref = reference(inputs, dy)
    for form in ("chunked", "triton"):
        out = forward_backward(FORMS[form], inputs, dy)
        assert [o.dtype for o in out] == [torch.bfloat16] * 4 + [torch.float32]
        for name, r, o in zip(NAMES, ref, out):
            assert_close(f"{form} {name}", r, o, RATIO[torch.bfloat16], atol=1e-3)


@pytest.mark.parametrize("backend", ["auto", "torch", "recurrent", "triton"])
def test_public_op_under_autocast_at_length_zero_and_in_float64(backend):
    """What a caller of the copied op may pass: under a bf16 autocast the state maths stay fp32 (the model turns
    autocast off itself; the op must not rely on it); T = 0 reads nothing and keeps every input in the graph;
    float64 runs in float64 on the torch forms and is refused by the fp32 kernels rather than silently rounded."""
    inputs, dy = make_inputs(2, 100, 8, 32, "near1")
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = op.prefix_mean_read(*inputs, backend=backend)
    assert y.dtype == torch.float32
    assert_close("y under autocast", reference(inputs, dy)[0], y, RATIO[torch.float32])
    empty = [x[:, :0] if x.dim() == 3 else x for x in inputs]
    out = forward_backward(lambda *a: op.prefix_mean_read(*a, backend=backend), empty, dy[:, :0])
    assert [tuple(o.shape) for o in out] == [(2, 0, 32), (2, 0, 8), (2, 0, 32), (2, 0, 8), (8,)]
    assert not out[-1].any()
    double = [x.double() for x in inputs]
    if backend == "triton":
        with pytest.raises(ValueError, match="computes in float32; float64 inputs take backend='auto' or 'torch'"):
            op.prefix_mean_read(*double, backend=backend)
    else:
        assert_close("float64", reference(inputs, dy)[0], op.prefix_mean_read(*double, backend=backend),
                     RATIO[torch.float64])


def test_auto_keeps_float64_off_the_kernels_even_on_cuda(monkeypatch):
    """On a CUDA-like dispatch (faked) `auto` would take Triton; float64 goes to the chunked form instead."""
    inputs, dy = make_inputs(1, 20, 5, 24)
    fake_cuda_dispatch(monkeypatch, op, "_prefix_mean_read_triton")
    y = op.prefix_mean_read(*[x.double() for x in inputs])
    monkeypatch.undo()
    assert_close("float64", reference(inputs, dy)[0], y, RATIO[torch.float64])


def test_dispatch(monkeypatch):
    (w, v, rho, beta), _ = make_inputs(1, 20, 5, 24)
    with pytest.raises(ValueError, match="backend"):
        op.prefix_mean_read(w, v, rho, beta, backend="cuda")
    with pytest.raises(ValueError, match="expected"):
        op.prefix_mean_read(w, v[:, :-1], rho, beta)
    assert torch.equal(op.prefix_mean_read(w, v, rho, beta, backend="recurrent"),
                       op.prefix_mean_read_recurrent(w, v, rho, beta))
    y = op.prefix_mean_read(w.requires_grad_(), v, rho, beta, backend="triton")
    assert type(y.grad_fn).__name__ == "PrefixMeanReadBackward", "backend='triton' must run the Triton kernels"
    if DEVICE == "cpu":
        calls = []
        chunked = op.prefix_mean_read_chunked
        monkeypatch.setattr(op, "prefix_mean_read_chunked", lambda *a: calls.append(1) or chunked(*a))
        assert torch.equal(op.prefix_mean_read(w, v, rho, beta), chunked(w, v, rho, beta))
        assert calls == [1], "backend='auto' on CPU must take the chunked torch form"
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            op.prefix_mean_read(w, v, rho, beta, backend="triton")


def test_tiles_over_the_shared_memory_limit_are_refused(cache_dir, tmp_path, capsys, monkeypatch):
    """R·d_v past what the kernels' state tile may use on sm_90 (see _PREFIX_MEAN_MAX_TILE): one clear error, from
    the op and from the command line, and the limit sits where tests/test_sm90_compile.py measured it."""
    assert op._prefix_mean_fits(128, 128) and op._prefix_mean_fits(32, 512) and op._prefix_mean_fits(65, 128)
    assert op._prefix_mean_fits(512, 32) and op._prefix_mean_fits(256, 33)  # d_v 33 pads to 64
    # R·d_v = 32768 compiles with triton 3.9 but needs 280 KiB with triton 3.6: refused for every version
    assert not op._prefix_mean_fits(256, 128) and not op._prefix_mean_fits(129, 128) and not op._prefix_mean_fits(32, 513)
    assert not op._prefix_mean_fits(1024, 16)  # R·d_v = 16384, but R over 512
    (w, v, rho, beta), _ = make_inputs(1, 3, 256, 128)
    with pytest.raises(ValueError, match="supports R·d_v up to 16384 and R up to 512"):
        op.prefix_mean_read(w, v, rho, beta, backend="triton")
    interpret = dict(capsys=capsys, monkeypatch=monkeypatch, env={"TRITON_INTERPRET": "1"})
    r = run_main(op.main, ["--kernels", "triton", "--n-protos", "200", "--d-model", "256", "--out-dir", str(tmp_path),
                           "--cache-dir", str(cache_dir)], **interpret)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr
    assert "supports --n-protos × d_v up to 16384" in r.stderr and "got 200 × 128" in r.stderr
    # --resume takes the architecture from the checkpoint, so the check must see the checkpoint's R, not the default
    args = ["--layers", "1", "--d-model", "32", "--ctx", "32", "--batch-size", "4", "--eval-iters", "1", "--no-labels",
            "--no-robustness", "--no-report", "--find-prototype", "off", "--sample-tokens", "0", *SMALL_CORPUS,
            "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir)]
    r = run_main(op.main, [*args, "--n-protos", "600", "--max-iters", "1", "--kernels", "torch"], capsys, monkeypatch)
    assert r.returncode == 0, r.stderr[-2000:]
    r = run_main(op.main, [*args, "--max-iters", "2", "--resume", "--kernels", "triton"], **interpret)
    assert r.returncode == 1 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert "got 600 × 16" in r.stderr


def test_nan_poisoning_catches_a_skipped_tile():
    """Kernel outputs start as NaN in tests: launching the read kernel on all chunks but the last leaves NaN."""
    assert op._prefix_mean_empty((3,), torch.float32, DEVICE).isnan().all()
    (w, v, rho, beta), _ = make_inputs(1, 40, 5, 24)
    B, T, R = w.shape
    NC = -(-T // op._BT)
    RP, BDV, _ = op._prefix_mean_blocks(R, 24)
    states = op._prefix_mean_empty((B, NC, R, 24), torch.float32, DEVICE)
    masses = op._prefix_mean_empty((B, NC, R), torch.float32, DEVICE)
    op._prefix_mean_fwd_chunk[(NC, B)](w, v, beta, states, masses, T, R, 24, NC, BT=op._BT, RP=RP, BDV=BDV)
    op._prefix_mean_fwd_carry[(2, B)](states, masses, beta, R, 24, NC, BT=op._BT, CB=op._carry_step(NC),
                                      TILE=op._CARRY_TILE)
    y = op._prefix_mean_empty((B, T, 24), torch.float32, DEVICE)
    mass_prev = op._prefix_mean_empty((B, T, R), torch.float32, DEVICE)
    op._prefix_mean_fwd_read[(NC - 1, B)](w, v, rho, beta, states, masses, y, mass_prev, T, R, 24, NC, op.MASS_EPS,
                                          BT=op._BT, RP=RP, BDV=BDV)
    done = (NC - 1) * op._BT
    assert not y[:, :done].isnan().any() and y[:, done:].isnan().all()


def test_no_saved_tensor_of_size_B_T_R_dv():
    """What autograd keeps for the backward: nothing of size [B, T, R, dv] (the chunked form keeps its
    [B, T/C, C, C, R] scores inputs, smaller while C < dv)."""
    (w, v, rho, beta), _ = make_inputs(2, 100, 32, 128)
    full = 2 * 100 * 32 * 128
    for form in ("chunked", "triton"):
        sizes = []
        leaves = [x.clone().requires_grad_() for x in (w, v, rho, beta)]
        with torch.autograd.graph.saved_tensors_hooks(lambda x: sizes.append(x.numel()) or x, lambda x: x):
            FORMS[form](*leaves)
        assert 0 < max(sizes) < full, f"{form}: saved a tensor of {max(sizes)} elements (B·T·R·dv = {full})"


def test_torch_compile_graph_breaks_around_triton():
    """torch.compiler.disable on the Triton launch: dynamo traces the rest and calls the kernels eagerly (no captured
    graph holds the autograd.Function)."""
    (w, v, rho, beta), _ = make_inputs(1, 20, 5, 24)
    got, ops = compiled_ops(lambda w, v, rho, beta: triton_form(w * 2, v, rho, beta), w, v, rho, beta)
    assert_close("compiled", triton_form(w * 2, v, rho, beta), got, RATIO[torch.float32], atol=0)
    assert ops == ["mul"], ops  # the w * 2 alone


def test_imports_and_runs_without_triton():
    """With `import triton` failing, protot.py still imports, the torch forms run and 'triton' says why it cannot."""
    script = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch, protot as op\n"
        "w = torch.rand(1, 20, 5).softmax(-1); v = torch.randn(1, 20, 8); beta = torch.rand(5)\n"
        "assert not op.HAS_TRITON and op.prefix_mean_read(w, v, w, beta).shape == (1, 20, 8)\n"
        "try:\n"
        "    op.prefix_mean_read(w, v, w, beta, backend='triton')\n"
        "except RuntimeError as err:\n"
        "    assert 'needs the triton package' in str(err)\n"
        "else:\n"
        "    raise AssertionError('no RuntimeError')\n"
    )
    env = {k: val for k, val in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.gpu
class TestOnCUDA:
    """The compiled kernels at the benchmark's sizes (python -m pytest -m gpu on a CUDA machine)."""

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
    @pytest.mark.parametrize("B,T,R,dv", [(8, 2048, 32, 128), (3, 4100, 200, 40)], ids=str)
    def test_triton_matches_chunked_at_realistic_size(self, dtype, B, T, R, dv):
        """The benchmark's shape, and one where the forward carry has partial tiles, a partial last scan step
        (257 chunks) and two programs for the masses (R = 200), which only compiled kernels run in parallel."""
        torch.manual_seed(0)
        w = (2 * torch.randn(B, T, R, device="cuda")).softmax(-1).to(dtype)
        rho = (2 * torch.randn(B, T, R, device="cuda")).softmax(-1).to(dtype)
        v = torch.randn(B, T, dv, device="cuda", dtype=dtype)
        beta = torch.rand(R, device="cuda") * 0.999
        dy = torch.randn(B, T, dv, device="cuda", dtype=dtype)
        inputs = [w, v, rho, beta]
        ref = forward_backward(op.prefix_mean_read_chunked, [x.double() for x in inputs], dy.double())
        out = forward_backward(lambda *a: op.prefix_mean_read(*a, backend="triton"), inputs, dy)
        for name, r, o in zip(NAMES, ref, out):
            assert_close(f"cuda {name}", r, o, RATIO[dtype] if name != "dbeta" else RATIO[torch.float32] * 100)

    def test_auto_takes_the_chunked_form_past_the_tile_limit(self, monkeypatch):
        """On CUDA, backend='auto' runs the Triton scan where its tile fits and the chunked form where it does not
        (R 600 pads to 1024 > 512; R 256 × d_v 128 is over R·d_v = 16384): never the kernel with a tile that cannot
        launch."""
        calls = []
        chunked = op.prefix_mean_read_chunked
        monkeypatch.setattr(op, "prefix_mean_read_chunked", lambda *a: calls.append(a[0].shape[-1]) or chunked(*a))
        for R, dv in ((32, 16), (600, 16), (256, 128)):
            w, rho = ((2 * torch.randn(2, 64, R, device="cuda")).softmax(-1) for _ in range(2))
            v = torch.randn(2, 64, dv, device="cuda")
            y = op.prefix_mean_read(w.requires_grad_(), v, rho, torch.rand(R, device="cuda"))
            assert (type(y.grad_fn).__name__ == "PrefixMeanReadBackward") == (R == 32)
        assert calls == [600, 256]

    def test_model_triton_path_matches_torch_path(self):
        """Same weights, kernels torch (chunked scan, torch RMSNorm and cross-entropy) vs triton: logits, loss and
        every parameter gradient, in fp32 and under bf16 autocast."""
        torch.manual_seed(0)
        cfg = op.Config(layers=2, d_model=256, dropout=0.0)
        ref_model = op.ProtoT(replace(cfg, kernels="torch"), 1000).cuda()
        model = op.ProtoT(replace(cfg, kernels="triton"), 1000).cuda()
        model.load_state_dict(ref_model.state_dict())
        x, y = (torch.randint(0, 1000, (4, 1024), device="cuda") for _ in range(2))
        with torch.no_grad():
            assert_close("logits", ref_model(x), model(x), RATIO[torch.float32] * 10)
        for dtype, ratio in ((torch.float32, RATIO[torch.float32] * 10), (torch.bfloat16, 5e-2)):
            grads = []
            for m in (ref_model, model):
                m.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
                    loss = m(x, y)
                loss.backward()
                grads.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
            (ref_loss, ref_g), (loss, g) = grads
            assert_close(f"loss {dtype}", ref_loss, loss, ratio)
            assert ref_g.keys() == g.keys()
            for n in ref_g:
                assert_close(f"grad {n} {dtype}", ref_g[n], g[n], ratio)
