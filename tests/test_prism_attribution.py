"""prism.py's training-data attribution (spec §5.3): the cache, its block and Kronecker-factored scores, the exact
prototype-space baseline (Woodbury, with the empirical or the sampled true Fisher), the dense TracIn baseline and
the experiment, each against a brute-force reference on a tiny model."""
import copy
import dataclasses
import html
import statistics
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import prism
from prism import Config, PRISM

V = 30


def tiny(resid_grad="detach-zhat", n_protos=12, topk=3, ctx=8, **kw):
    cfg = Config(layers=1, d_model=16, heads=2, n_protos=n_protos, topk=topk, ctx=ctx, init="random",
                 kernels="torch", resid_grad=resid_grad, **kw)
    return PRISM(cfg, V).eval()


def windows_of(M, ctx, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (M, ctx + 1), generator=g)


def dense_rows(index, M, K):
    """The CSR index as a dense [M, K, d] tensor (zeros where a sequence does not use a prototype)."""
    out = torch.zeros(M, K, index.G.shape[1], dtype=torch.float64)
    proto = index.proto_of_rows()
    out[index.seq.long(), proto] = index.G.double()
    return out


def linear_view_grad(model, x, y):
    """∇_P Σ_t CE_t with the activations a held fixed (the linear-layer view), by autograd: logits =
    W(z − sg(ẑ) + ẑ) where ẑ = Σ a_i p_i with a detached, so only ẑ's linear dependence on P is differentiated."""
    P = model.P
    with torch.no_grad():
        z = model.hidden(x[None])[0].float()
        idx, a = model.prototypes(z)
    zhat = prism.reconstruct(idx, a.detach(), P)
    logits = F.linear(z - zhat.detach() + zhat, model.wte.weight.float())
    return torch.autograd.grad(F.cross_entropy(logits, y, reduction="sum"), P)[0]


@pytest.mark.parametrize("resid_grad,topk,T", [("detach-zhat", 3, 8), ("detach-r", 12, 2)])
def test_cache_vectors_and_curvature_match_autograd(resid_grad, topk, T, assert_close):
    """g_{m,i} in the index is row i of the linear-layer-view autograd gradient of sequence m's CE w.r.t. P;
    A_ii = mean a², S = mean δδᵀ with δ_t = ∂CE_t/∂ẑ_t from autograd. topk = K puts zero activations
    (negative cosines) in the top-k: they must not become postings."""
    model = tiny(resid_grad, topk=topk, ctx=T)
    K, d = model.P.shape
    w = windows_of(6, T)
    cache = prism.build_attr_cache(model, w)
    G = dense_rows(cache.index, 6, K)
    for m in range(6):
        assert_close(f"g_m{m}", linear_view_grad(model, w[m, :-1], w[m, 1:]), G[m].float())
    # curvature statistics from per-token autograd deltas
    with torch.no_grad():
        z = model.hidden(w[:, :-1]).float().flatten(0, 1)
        idx, a = model.prototypes(z)
    zhat = torch.zeros_like(z, requires_grad=True)
    logits = F.linear(z - zhat.detach() + zhat, model.wte.weight.float())
    ce = F.cross_entropy(logits, w[:, 1:].flatten(), reduction="sum")
    delta = torch.autograd.grad(ce, zhat)[0]  # per-token CE_t depends only on its own ẑ_t
    dense_a = torch.zeros(len(z), K).scatter_(1, idx, a)
    S = cache.Q_S @ torch.diag(cache.lam_S) @ cache.Q_S.T
    assert_close("S", delta.T @ delta / len(z), S, ratio=1e-4)
    assert_close("A_ii", dense_a.pow(2).mean(0), cache.A_diag)
    # every posting is a (sequence, prototype) pair with some a > 0, and no pair is missing
    used = torch.zeros(6, K, dtype=torch.bool)
    used[torch.arange(6).repeat_interleave(T)[:, None].expand_as(idx)[a > 0], idx[a > 0]] = True
    assert torch.equal(G.ne(0).any(-1), used) and len(cache.index.seq) == int(used.sum())
    assert topk < K or not used.all()  # some prototype is in a top-k but never active in some sequence
    assert cache.index.seq.dtype == torch.int32 and cache.index.G.dtype == torch.float32


def brute_block(cache, G, idx, a, delta):
    """Σ_{i∈U(q)∩U(m)} g_{q,i}ᵀ (A_ii S + λI)⁻¹ g_{m,i} with explicit d×d inverses, for every m."""
    S = (cache.Q_S @ torch.diag(cache.lam_S) @ cache.Q_S.T).double()
    d = S.shape[0]
    scores = torch.zeros(G.shape[0], dtype=torch.float64)
    for j in range(len(idx)):
        if a[j] <= 0:
            continue
        i = int(idx[j])
        H_inv = torch.linalg.inv(cache.A_diag[i].double() * S + cache.lam * torch.eye(d, dtype=torch.float64))
        scores += G[:, i] @ (H_inv @ (a[j].double() * delta.double()))
    return scores


def test_block_scores_match_brute_force_and_skip_disjoint_sequences(assert_close):
    model = tiny(n_protos=64, topk=2, ctx=4)
    M = 40
    w = windows_of(M, 4, seed=1)
    cache = prism.build_attr_cache(model, w, "block", damping=1e-2)
    # λ relative to the mean non-zero eigenvalue of A_ii ⊗ S, as the exact reference's: prototypes no window
    # activates (zero blocks) do not dilute it
    live = cache.A_diag[cache.A_diag > 0]
    assert len(live) < 64 and cache.lam == pytest.approx(1e-2 * live.mean().item() * cache.lam_S.mean().item())
    G = dense_rows(cache.index, M, 64)
    xq = windows_of(3, 4, seed=2)
    idx, a, delta = prism.query_state(model, xq[:, :-1], xq[:, -1])
    disjoint_seen = 0
    for q in range(3):
        scores, scored = prism.cached_scores(cache, idx[q], a[q], delta[q])
        assert_close(f"scores q{q}", brute_block(cache, G, idx[q], a[q], delta[q]), scores, ratio=1e-4)
        shares = G[:, idx[q][a[q] > 0]].ne(0).any(-1).any(-1)  # m uses one of the query's active prototypes
        assert torch.equal(scored, shares)
        assert (scores[~shares] == 0).all()
        disjoint_seen += int((~shares).sum())
    assert disjoint_seen > 0, "the test needs sequences that share no prototype with a query"


def test_cache_at_huge_damping_ranks_by_plain_gradient_dot_products(assert_close):
    """The attribution's no-curvature diagnostic: at damping 1e9, λ·scores are the plain dot products
    Σ_i g_{m,i}·g_{q,i} of the cached gradients (g_{q,i} = a_{q,i} δ_q)."""
    model = tiny(n_protos=64, topk=2, ctx=4)
    M = 40
    w = windows_of(M, 4, seed=1)
    cache = prism.build_attr_cache(model, w, "block", damping=1e9)
    G = dense_rows(cache.index, M, 64)                                     # [M, K, d]
    xq = windows_of(3, 4, seed=2)
    idx, a, delta = prism.query_state(model, xq[:, :-1], xq[:, -1])
    for q in range(3):
        g_q = torch.zeros(64, G.shape[-1], dtype=torch.float64)
        g_q[idx[q]] = a[q, :, None].double() * delta[q].double()
        plain = (G.double() * g_q).sum((1, 2))
        assert_close(f"plain dots q{q}", plain, cache.lam * prism.cached_scores(cache, idx[q], a[q], delta[q])[0],
                     ratio=1e-4)


def test_kfac_scores_match_explicit_kronecker_inverse(assert_close):
    model = tiny()
    K, d = model.P.shape
    M = 10
    w = windows_of(M, 8, seed=3)
    cache = prism.build_attr_cache(model, w, "kfac", damping=1e-2)
    # the co-usage matrix against its definition, A = mean_t a_t a_tᵀ
    with torch.no_grad():
        idx_t, a_t = model.prototypes(model.hidden(w[:, :-1]).float().flatten(0, 1))
    dense_a = torch.zeros(len(idx_t), K).scatter_(1, idx_t, a_t).double()
    A = dense_a.T @ dense_a / len(dense_a)
    assert_close("A", A, (cache.Q_A @ torch.diag(cache.lam_A) @ cache.Q_A.T), ratio=1e-4)
    S = (cache.Q_S @ torch.diag(cache.lam_S) @ cache.Q_S.T).double()
    H = torch.kron(A, S) + cache.lam * torch.eye(K * d, dtype=torch.float64)  # row-major vec of K×d
    G = dense_rows(cache.index, M, K).reshape(M, K * d)
    xq = windows_of(2, 8, seed=4)
    idx, a, delta = prism.query_state(model, xq[:, :-1], xq[:, -1])
    for q in range(2):
        Gq = torch.zeros(K, d, dtype=torch.float64)
        Gq[idx[q]] = a[q, :, None].double() * delta[q].double()
        scores, scored = prism.cached_scores(cache, idx[q], a[q], delta[q])
        assert_close(f"kfac q{q}", G @ torch.linalg.solve(H, Gq.reshape(-1)), scores, ratio=1e-4)
        assert torch.equal(scored, G.ne(0).any(-1))


def test_kfac_equals_block_when_co_usage_is_diagonal(assert_close):
    """With k = 1 every token activates one prototype, so A is diagonal and A ⊗ S is block-diagonal: both
    curvatures must give the same scores."""
    model = tiny(n_protos=8, topk=1)
    w = windows_of(12, 8, seed=5)
    block = prism.build_attr_cache(model, w, "block")
    kfac = prism.build_attr_cache(model, w, "kfac")
    xq = windows_of(2, 8, seed=6)
    idx, a, delta = prism.query_state(model, xq[:, :-1], xq[:, -1])
    for q in range(2):
        assert_close("kfac=block", prism.cached_scores(block, idx[q], a[q], delta[q])[0],
                     prism.cached_scores(kfac, idx[q], a[q], delta[q])[0], ratio=1e-4)


def test_exact_baseline_gradients_and_woodbury(assert_close):
    model = tiny()
    K, d = model.P.shape
    M = 8
    w = windows_of(M, 8, seed=7)
    ex = prism.build_exact(model, w, damping=1e-2)
    G = dense_rows(ex.index, M, K)
    for m in range(M):  # the full forward's CE gradient w.r.t. P (cosine path included; z does not depend on P)
        logits = model(w[m:m + 1, :-1])[0].float()
        ref = torch.autograd.grad(F.cross_entropy(logits, w[m, 1:], reduction="sum"), model.P)[0]
        assert_close(f"exact g_m{m}", ref, G[m].float())
    # they differ from the linear-layer view (the activations' dependence on P is part of the exact gradient)
    assert (linear_view_grad(model, w[0, :-1], w[0, 1:]) - G[0].float()).abs().max() > 1e-4
    G = G.reshape(M, -1)
    lam = 1e-2 * G.pow(2).sum() / (M * M)  # relative to the mean non-zero eigenvalue of GᵀG/M
    assert ex.lam == pytest.approx(lam.item(), rel=1e-5)
    H = G.T @ G / M + lam * torch.eye(K * d, dtype=torch.float64)
    xq = windows_of(2, 8, seed=8)
    for q in range(2):
        g_q = prism.exact_query_grad(model, xq[q, :-1], xq[q, -1])
        logits = model(xq[q:q + 1, :-1])[0, -1].float()
        assert_close("exact g_q", torch.autograd.grad(F.cross_entropy(logits, xq[q, -1]), model.P)[0], g_q)
        assert_close(f"woodbury q{q}", G @ torch.linalg.solve(H, g_q.double().reshape(-1)),
                     prism.exact_scores(ex, g_q), ratio=1e-4)
        assert_close(f"plain dots q{q}", G @ g_q.double().reshape(-1), prism.exact_scores(ex, g_q, curvature=False))


@pytest.mark.parametrize("curvature", ["empirical", "fisher"])
@pytest.mark.parametrize("ratio", [1e-2, 1.0, 30.0])
def test_redamped_exact_equals_a_rebuild_at_that_damping(curvature, ratio, assert_close):
    """ExactAttr.redamped(r) recovers the undamped Gram from the factor and re-factors it: the same scores as a
    reference built at r × the damping, for both curvatures (fisher's C and draws shared), smaller and larger."""
    model = tiny()
    w = windows_of(10, 8, seed=3)
    ex = prism.build_exact(model, w, damping=1e-2, curvature=curvature, samples=2, seed=1)
    want = prism.build_exact(model, w, damping=1e-2 * ratio, curvature=curvature, samples=2, seed=1)
    got = ex.redamped(ratio)
    assert got.lam == pytest.approx(want.lam, rel=1e-12) and ex.lam == pytest.approx(want.lam / ratio, rel=1e-12)
    assert got.index is ex.index and got.C is ex.C and got.fisher is ex.fisher  # shared, not copied
    xq = windows_of(3, 8, seed=4)
    for q in range(3):
        g_q = prism.exact_query_grad(model, xq[q, :-1], xq[q, -1])
        assert_close(f"redamped q{q}", prism.exact_scores(want, g_q), prism.exact_scores(got, g_q), ratio=1e-5)
    if ratio != 1.0:  # and the damping matters: the scores at the original damping are not these
        g_q = prism.exact_query_grad(model, xq[0, :-1], xq[0, -1])
        a, b = prism.exact_scores(ex, g_q), prism.exact_scores(got, g_q)
        assert not torch.allclose(a / a.norm(), b / b.norm(), rtol=0, atol=1e-3)


def test_damping_sweep_reranks_both_methods_at_each_damping():
    """damping_sweep at the run's own damping repeats the run's overlaps exactly; at another it equals a cache
    and a reference built there; at a huge one both methods rank by plain gradient dot products (the
    gradients-alone diagnostic), and the curvature alone then agrees with exact."""
    model = tiny()
    w = windows_of(24, 8, seed=5)
    xq = windows_of(4, 8, seed=6)
    states = [tuple(t[0] for t in prism.query_state(model, xq[q:q + 1, :-1], xq[q:q + 1, -1])) for q in range(4)]
    grads = [prism.exact_query_grad(model, xq[q, :-1], xq[q, -1]) for q in range(4)]
    cache, ex = prism.build_attr_cache(model, w, damping=1e-2), prism.build_exact(model, w, damping=1e-2)

    def ranked(c, e):
        cached = torch.stack([prism.cached_scores(c, *st)[0] for st in states])
        exact = torch.stack([prism.exact_scores(e, g) for g in grads])
        cc = torch.stack([prism.exact_scores_with_cache_curvature(e, c, g) for g in grads])
        return {"cached": prism.overlaps(cached, exact), "same_curvature": prism.overlaps(cached, cc),
                "curvature_only": prism.overlaps(cc, exact)}
    sweep = prism.damping_sweep(cache, ex, states, grads, 1e-2, grid=(0.3, 1e-3, 1e6))
    assert [r["attr_damping"] for r in sweep] == [1e-3, 1e-2, 0.3, 1e6]  # the run's own added, ascending
    assert all(set(r) == {"attr_damping", "cached", "same_curvature", "curvature_only"} for r in sweep)
    assert {k: v for k, v in sweep[1].items() if k != "attr_damping"} == ranked(cache, ex)
    for r in sweep[::2]:
        want = ranked(prism.build_attr_cache(model, w, damping=r["attr_damping"]),
                      prism.build_exact(model, w, damping=r["attr_damping"]))
        assert {k: v for k, v in r.items() if k != "attr_damping"} == want, r["attr_damping"]
    # the run's own figures, when given, are that row as they are (not recomputed); the other rows are unchanged
    own = {"cached": {"top-10 overlap": 0.5}, "same_curvature": {}, "curvature_only": {}}
    given = prism.damping_sweep(cache, ex, states, grads, 1e-2, grid=(0.3, 1e-3, 1e6), own=own)
    assert given[1] == {"attr_damping": 1e-2, **own} and given[::2] == sweep[::2]
    plain = torch.stack([prism.exact_scores(ex, g, curvature=False) for g in grads])
    huge = prism.replace(cache, lam=cache.lam * 1e8)
    cached_plain = torch.stack([prism.cached_scores(huge, *st)[0] for st in states])
    assert sweep[-1]["cached"] == prism.overlaps(cached_plain, plain)
    assert sweep[-1]["curvature_only"] == {"top-10 overlap": 1.0, "top-100 overlap": 1.0}
    assert sweep[0] != sweep[-1]  # the damping moves the rankings: a sweep that ignored it would fail here


def test_damping_sweep_row_that_fails_is_skipped_not_the_runs_end(monkeypatch, tmp_path):
    """A reference that fails at another damping (RunError: a factor, or conjugate gradients) skips that row
    with its reason, in the results, the log and the report; the run's own figures and every other line stand."""
    build = prism.ExactAttr.redamped

    def fail_small(self, ratio):
        if ratio < 1:
            raise prism.RunError(f"the exact baseline's factor at {ratio:g} × its damping failed (stood in)")
        return build(self, ratio)
    monkeypatch.setattr(prism.ExactAttr, "redamped", fail_small)
    cfg = Config(layers=1, d_model=16, heads=2, n_protos=12, topk=3, ctx=8, init="random", kernels="torch",
                 attr_seqs=12, attr_queries=2, attr_damping=1e-2)
    lines = []
    res = prism.attribution_experiment(PRISM(cfg, V).eval(), None, StandIn(), cfg, lines.append)
    sweep = res["damping_sweep"]
    assert len(res["table"]) == 5 and [r["attr_damping"] for r in sweep] == [1e-3, 1e-2, 0.1, 1.0, 10.0]
    assert sweep[0] == {"attr_damping": 1e-3,
                        "skipped": "the exact baseline's factor at 0.1 × its damping failed (stood in)"}
    assert all("skipped" not in r for r in sweep[1:])
    assert ("attribution, damping sweep, --attr-damping 0.001: skipped: the exact baseline's factor at 0.1 × its "
            "damping failed (stood in)") in lines
    assert sum(ln.startswith("attribution, damping sweep, --attr-damping") for ln in lines) == 5
    html_text = prism.write_report(tmp_path, cfg, {"attribution": res}, {}).read_text()
    assert "<tr><td>0.001</td>" + "<td>skipped</td>" * 6 + "</tr>" in html_text


def final_states(model, w):
    """The training tokens' final states z [N, d] of windows w [M, T + 1], as build_exact hands them to build_ggn."""
    with torch.no_grad():
        return model.hidden(w[:, :-1]).float().flatten(0, 1)


def dense_ggn(model, w):
    """The linear-view Gauss–Newton matrix by brute force, [K·d, K·d] float64: (1/N) Σ_t (a_t a_tᵀ) ⊗ B_t with
    B_t = Wᵀ(diag p_t − p_t p_tᵀ)W built per token."""
    K, d = model.P.shape
    W = model.wte.weight.double()
    z = final_states(model, w)
    with torch.no_grad():
        idx, a = model.prototypes(z)
    H = torch.zeros(K * d, K * d, dtype=torch.float64)
    for t in range(len(z)):
        p = torch.softmax(z[t].double() @ W.T, -1)
        a_t = torch.zeros(K, dtype=torch.float64).index_put_((idx[t],), a[t].double().clamp_min(0))
        H += torch.kron(torch.outer(a_t, a_t), W.T @ (torch.diag(p) - torch.outer(p, p)) @ W)
    return H / len(z)


def dense_solve_scores(G, H, lam, grads):
    """G (H + λI)⁻¹ g_q by a dense solve for each query gradient [K, d] -> [Q, M] float64 (G [M, K·d])."""
    eye = torch.eye(len(H), dtype=torch.float64)
    return torch.stack([G @ torch.linalg.solve(H + lam * eye, g.double().reshape(-1)) for g in grads])


@pytest.mark.parametrize("topk,seed", [(3, 3), (12, 5)])
def test_ggn_blocks_are_the_gauss_newton_matrix(topk, seed, assert_close):
    """build_ggn's non-zero blocks assemble to the brute-force matrix, with nothing outside them; mean_eig is
    its trace over the live rows; the scores are G (H + λI)⁻¹ g_q by a dense solve, one query or several."""
    model = tiny(topk=topk, n_protos=40)
    K, d = model.P.shape
    w = windows_of(6, 8, seed=seed)
    H = dense_ggn(model, w)
    ggn = prism.build_ggn(model, final_states(model, w), chunk=7)  # token chunks that do not divide N = 48
    got = torch.zeros_like(H)
    for r, c, blk in zip(ggn.rows, ggn.cols, ggn.blocks):
        i, j = ggn.live[r].item(), ggn.live[c].item()
        got[i * d:(i + 1) * d, j * d:(j + 1) * d] = blk
    assert_close("GGN", H, got, ratio=1e-6)  # p_t from a float32 softmax, as the run's
    assert len(set(zip(ggn.rows.tolist(), ggn.cols.tolist()))) == len(ggn.rows)  # each block once
    live_rows = torch.cat([torch.arange(i * d, (i + 1) * d) for i in ggn.live.tolist()])
    assert ggn.mean_eig == pytest.approx(H.diagonal()[live_rows].mean().item(), rel=1e-9)
    dead = torch.ones(K, dtype=torch.bool)
    dead[ggn.live] = False
    assert dead.any() == (topk == 3)  # k = 3 leaves prototypes no token uses: they get no block, nor any curvature
    assert H.view(K, d, K, d)[dead].abs().sum() == 0
    ex = prism.build_exact(model, w, damping=1e-2, curvature="ggn")
    assert ex.curvature == "ggn" and ex.L is None and ex.lam == pytest.approx(1e-2 * ggn.mean_eig, rel=1e-12)
    G = dense_rows(ex.index, 6, K).reshape(6, -1)
    xq = windows_of(3, 8, seed=seed + 1)
    grads = [prism.exact_query_grad(model, xq[q, :-1], xq[q, -1]) for q in range(3)]
    want = dense_solve_scores(G, H, ex.lam, grads)
    assert_close("ggn scores, batch", want, prism.exact_scores_batch(ex, grads), ratio=1e-6)
    assert_close("ggn scores, one", want[1], prism.exact_scores(ex, grads[1]), ratio=1e-6)
    want30 = dense_solve_scores(G, H, 30 * ex.lam, grads)
    assert_close("ggn redamped", want30, prism.exact_scores_batch(ex.redamped(30.0), grads), ratio=1e-6)


def test_ggn_leaves_out_top_k_members_whose_activation_is_zero(assert_close):
    """A prototype in every token's top-k whose activation is always 0 (ReLU of a negative cosine, forced here)
    is not live: no block, not in the trace the damping is relative to, and no row of any exact gradient, so
    leaving it out of the solve is exact (the scores match a dense solve over every row)."""
    model = tiny(topk=12)  # k = K: every prototype is in every top-k list
    K, d = model.P.shape
    prototypes = model.prototypes

    def zero_for_0(z):
        idx, a = prototypes(z)
        return idx, torch.where(idx == 0, torch.zeros_like(a), a)
    model.prototypes = zero_for_0
    w = windows_of(6, 8, seed=4)
    H = dense_ggn(model, w)
    ggn = prism.build_ggn(model, final_states(model, w))
    assert 0 not in ggn.live.tolist() and len(ggn.live) == K - 1
    live_rows = torch.cat([torch.arange(i * d, (i + 1) * d) for i in ggn.live.tolist()])
    assert ggn.mean_eig == pytest.approx(H.diagonal()[live_rows].mean().item(), rel=1e-9)
    ex = prism.build_exact(model, w, damping=1e-2, curvature="ggn")
    G = dense_rows(ex.index, 6, K)
    assert G[:, 0].abs().max() == 0 and G.abs().max() > 0
    xq = windows_of(2, 8, seed=5)
    grads = [prism.exact_query_grad(model, xq[q, :-1], xq[q, -1]) for q in range(2)]
    want = dense_solve_scores(G.reshape(6, -1), H, ex.lam, grads)
    assert_close("ggn scores", want, prism.exact_scores_batch(ex, grads), ratio=1e-6)


def test_ggn_with_no_active_prototype_is_a_one_line_error():
    model = tiny()
    prototypes = model.prototypes
    model.prototypes = lambda z: (lambda idx, a: (idx, torch.zeros_like(a)))(*prototypes(z))
    with pytest.raises(prism.RunError, match="^no training token activates a prototype"):
        prism.build_exact(model, windows_of(4, 8), curvature="ggn")


def test_ggn_too_large_is_a_one_line_error(monkeypatch):
    """Past GGN_MAX_BYTES (its blocks and per-pair sums) the ggn reference refuses, saying how much and why,
    before it allocates them."""
    model = tiny()
    z = final_states(model, windows_of(6, 8, seed=2))
    full = prism.build_ggn(model, z)
    pairs = (len(full.rows) + (full.rows == full.cols).sum().item()) // 2
    need = (pairs * (V + 16 * 16) + len(full.rows) * 16 * 16 + 48 * (V + 16 * 16)) * 8  # the peak; N = 48 tokens
    monkeypatch.setattr(prism, "GGN_MAX_BYTES", need - 1)
    with pytest.raises(prism.RunError, match=rf"^--attr-exact-curvature ggn would hold 0.0 GiB \({pairs:,} pairs of "
                                             r"prototypes used together, d = 16, V = 30\), over its .* GiB limit: it "
                                             r"is meant for CPU-preset sizes; use --attr-exact-curvature empirical or "
                                             r"fisher$"):
        prism.build_ggn(model, z)
    monkeypatch.setattr(prism, "GGN_MAX_BYTES", need)
    prism.build_ggn(model, z)


def test_ggn_solve_is_conjugate_gradients_to_tolerance_or_a_one_line_error(assert_close):
    """ggn_solve matches a dense solve for several sides at once, stops early on a side already solved (b = 0),
    and a solve that cannot reach the tolerance is a RunError that says what to change."""
    model = tiny()
    ggn = prism.build_ggn(model, final_states(model, windows_of(6, 8, seed=2)))
    L, d = len(ggn.live), model.P.shape[1]
    Hl = torch.zeros(L * d, L * d, dtype=torch.float64)
    for r, c, blk in zip(ggn.rows, ggn.cols, ggn.blocks):
        Hl[r * d:(r + 1) * d, c * d:(c + 1) * d] = blk
    lam = 1e-2 * ggn.mean_eig
    b = torch.randn(3, L, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    b[1] = 0
    x = prism.ggn_solve(ggn, b, lam, rtol=1e-10)
    want = torch.linalg.solve(Hl + lam * torch.eye(L * d, dtype=torch.float64), b.reshape(3, -1).T).T
    assert_close("cg", want, x.reshape(3, -1), ratio=1e-7)
    assert x[1].abs().max() == 0
    with pytest.raises(prism.RunError, match=r"^the ggn reference's conjugate gradients did not reach a relative "
                                             r"residual of 1e-10 in 1 steps at λ' = 0.01 × its mean eigenvalue; "
                                             r"raise --attr-damping$"):
        prism.ggn_solve(ggn, b, lam, rtol=1e-10, maxiter=1)


def sample_targets(z, W, u, chunk=prism.ATTR_CHUNK):
    """One draw per token through token_deltas (the labels, here 0, are not used) -> ỹ [N]."""
    return prism.token_deltas(z, torch.zeros(len(z), dtype=torch.long), W, chunk, u=u[None])[2][0]


def test_sampled_targets_follow_the_models_softmax():
    """ỹ ~ softmax(W z) by inverse CDF: over 20,000 draws at one hidden state, every token's frequency lies within
    5 standard errors of its probability (an off-by-one in the CDF lookup shifts mass to a neighbour and fails)."""
    g = torch.Generator().manual_seed(0)
    W = torch.randn(V, 16, generator=g)
    z = torch.randn(1, 16, generator=g).expand(20000, 16)
    p = torch.softmax(z[0] @ W.T, -1).double()
    y = sample_targets(z, W, torch.rand(20000, generator=g), chunk=V * 999)  # several chunks
    freq = torch.bincount(y, minlength=V).double() / len(y)
    se = (p * (1 - p) / len(y)).sqrt()
    assert ((freq - p).abs() / se).max() < 5 and y.min() >= 0 and y.max() < V
    assert ((freq.roll(1) - p).abs() / se).max() > 5  # the same check rejects a shifted draw
    assert sample_targets(z[:3], W, torch.tensor([0.0, 1 - 1e-7, 0.5])).tolist()[:2] == \
        [int(p.gt(0).nonzero()[0]), int(p.gt(0).nonzero()[-1])]  # the CDF's two ends: the first and last tokens


def test_fisher_curvature_is_the_empirical_fisher_of_the_sampled_targets(assert_close):
    """--attr-exact-curvature fisher: G̃ holds S = 2 exact gradients per window, each the full forward's CE
    gradient w.r.t. P with the window's labels replaced by the drawn targets (so G̃ᵀG̃/N is the empirical Fisher
    of those samples, N = M·S); λ' is relative to its mean non-zero eigenvalue, and the Woodbury scores are
    G (G̃ᵀG̃/N + λ'I)⁻¹ g_q with the true-label G and g_q, against a direct dense solve."""
    model = tiny()
    K, d = model.P.shape
    M, S, T = 6, 2, 8
    w = windows_of(M, T, seed=7)
    ex = prism.build_exact(model, w, damping=1e-2, curvature="fisher", samples=S, seed=3)
    emp = prism.build_exact(model, w, damping=1e-2)
    assert ex.curvature == "fisher" and ex.targets.shape == (M, S, T) and len(ex.L) == M * S
    assert not torch.equal(ex.targets[:, 0].long(), w[:, 1:])  # drawn, not the labels
    G, Gt = dense_rows(ex.index, M, K), dense_rows(ex.fisher, M * S, K)
    assert_close("true-label G", dense_rows(emp.index, M, K), G)
    for m in range(M):
        logits = model(w[m:m + 1, :-1])[0].float()
        for j in range(S):
            ref = torch.autograd.grad(F.cross_entropy(logits, ex.targets[m, j].long(), reduction="sum"), model.P,
                                      retain_graph=True)[0]
            assert_close(f"g̃_{m},{j}", ref, Gt[m * S + j].float())
    G, Gt = G.reshape(M, -1), Gt.reshape(M * S, -1)
    lam = 1e-2 * Gt.pow(2).sum() / (M * S) ** 2
    assert ex.lam == pytest.approx(lam.item(), rel=1e-5)
    H = Gt.T @ Gt / (M * S) + lam * torch.eye(K * d, dtype=torch.float64)
    xq = windows_of(2, T, seed=8)
    for q in range(2):
        g_q = prism.exact_query_grad(model, xq[q, :-1], xq[q, -1])
        ref = G @ torch.linalg.solve(H, g_q.double().reshape(-1))
        got = prism.exact_scores(ex, g_q)
        assert_close(f"fisher woodbury q{q}", ref, got, ratio=1e-4)
        assert_close(f"plain dots q{q}", G @ g_q.double().reshape(-1), prism.exact_scores(ex, g_q, curvature=False))
        # the curvature matters: the empirical reference ranks with another matrix
        assert (prism.exact_scores(emp, g_q) - got).abs().max() > 1e-3 * got.abs().max()
    assert ex.nbytes() > emp.nbytes()


def test_fisher_draws_are_deterministic_under_the_seed():
    """The same seed draws the same targets and gives the same scores; another seed other draws; the global RNG
    is left alone (the draws come from their own generator)."""
    model = tiny()
    w = windows_of(5, 8, seed=9)
    state = torch.get_rng_state()
    a, b = (prism.build_exact(model, w, 1e-2, "fisher", 1, seed=11) for _ in range(2))
    c = prism.build_exact(model, w, 1e-2, "fisher", 1, seed=12)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.targets, b.targets) and torch.equal(a.fisher.G, b.fisher.G) and torch.equal(a.L, b.L)
    assert not torch.equal(a.targets, c.targets)
    g_q = prism.exact_query_grad(model, w[0, :-1], w[0, -1])
    assert torch.equal(prism.exact_scores(a, g_q), prism.exact_scores(b, g_q))
    assert not torch.equal(prism.exact_scores(a, g_q), prism.exact_scores(c, g_q))


def test_cache_fisher_s_is_the_second_moment_of_the_drawn_targets_deltas(assert_close):
    """--attr-s fisher: S = mean over tokens and draws of δ̃δ̃ᵀ, δ̃_t the autograd ∂CE/∂ẑ_t of a target drawn from the
    model's softmax: the exact fisher reference's draws under the same seed (so the curvature-alone diagnostic
    compares two curvatures of the same samples). The index and A_ii are the true-label cache's; S is not."""
    model = tiny()
    M, S, T = 6, 2, 8
    w = windows_of(M, T, seed=7)
    fisher = prism.build_attr_cache(model, w, "block", 1e-2, "fisher", samples=S, seed=3)
    labels = prism.build_attr_cache(model, w, "block", 1e-2)
    ex = prism.build_exact(model, w, damping=1e-2, curvature="fisher", samples=S, seed=3)
    with torch.no_grad():
        z = model.hidden(w[:, :-1]).float().flatten(0, 1)
    zhat = torch.zeros_like(z, requires_grad=True)
    logits = F.linear(z - zhat.detach() + zhat, model.wte.weight.float())
    want = torch.zeros(z.shape[1], z.shape[1])
    for j in range(S):
        ce = F.cross_entropy(logits, ex.targets[:, j].flatten().long(), reduction="sum")
        delta = torch.autograd.grad(ce, zhat, retain_graph=True)[0]
        want += delta.T @ delta / (len(z) * S)
    got = fisher.Q_S @ torch.diag(fisher.lam_S) @ fisher.Q_S.T
    assert_close("S fisher", want, got, ratio=1e-4)
    true_S = labels.Q_S @ torch.diag(labels.lam_S) @ labels.Q_S.T
    assert (got - true_S).abs().max() > 1e-2 * true_S.abs().max()  # the labels' S is another matrix
    assert torch.equal(fisher.index.G, labels.index.G) and torch.equal(fisher.A_diag, labels.A_diag)
    assert fisher.lam == pytest.approx(1e-2 * fisher.A_diag.mean().item() * fisher.lam_S.mean().item())
    again = prism.build_attr_cache(model, w, "block", 1e-2, "fisher", samples=S, seed=3)
    other = prism.build_attr_cache(model, w, "block", 1e-2, "fisher", samples=S, seed=4)
    assert torch.equal(again.lam_S, fisher.lam_S) and not torch.equal(other.lam_S, fisher.lam_S)


@pytest.mark.parametrize("args,code,needle", [
    (["--attr-exact-curvature", "hessian"], 2, "invalid choice: 'hessian'"),
    (["--attr-fisher-samples", "0"], 1, "error: --attr-fisher-samples must be >= 1"),
    (["--attr-s", "ggn"], 2, "invalid choice: 'ggn'"),
])
def test_bad_exact_curvature_is_one_line(tmp_path, args, code, needle, capsys, monkeypatch):
    from conftest import call_main
    rc, err = call_main(prism.main, [*args, "--out-dir", str(tmp_path)], capsys, monkeypatch)
    assert rc == code and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_fisher_samples_flag_is_noted_when_nothing_is_sampled():
    """--attr-fisher-samples only shapes the fisher curvatures (the exact reference's, the cache's S): typed beside
    two empirical ones it gets a note."""
    def notes(**kw):
        return [n.split(" has no effect")[0] for n in prism.unused_flags(Config(**kw), {"attr_fisher_samples"})]
    assert notes(attr_exact_curvature="empirical") == ["note: --attr-fisher-samples"]  # --attr-s is empirical
    assert notes(attr_exact_curvature="empirical", attr_s="fisher") == []
    assert notes() == ["note: --attr-fisher-samples"]  # both empirical by default
    assert notes(attr_exact_curvature="fisher") == []
    assert notes(attribution=False) == ["note: --attr-fisher-samples"]


@pytest.mark.parametrize("curvature", ["empirical", "fisher", "ggn"])
def test_experiment_reports_the_exact_curvature(curvature, tmp_path, monkeypatch):
    """A tiny run says which curvature the exact reference inverted and which S the cache holds: the JSON, the
    summary, the curvature-alone log line and the report; and the reference it ranked with was built with that
    curvature, S and the seed, the cache with that S, the same draws and seed. ggn (no S of its own: the cache
    keeps the labels') solves every query at once, and its row says it is a batch."""
    s_curv = "empirical" if curvature == "ggn" else curvature
    cfg = Config(layers=1, d_model=16, heads=2, n_protos=12, topk=3, ctx=8, init="random", kernels="torch",
                 attr_seqs=12, attr_queries=2, attr_damping=1e-2, attr_exact_curvature=curvature, attr_s=s_curv,
                 attr_fisher_samples=2, seed=5)
    built, build = [], prism.build_exact
    monkeypatch.setattr(prism, "build_exact", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
    cache_args, build_cache = [], prism.build_attr_cache
    monkeypatch.setattr(prism, "build_attr_cache", lambda *a, **k: cache_args.append(a[2:]) or build_cache(*a, **k))
    model, lines = PRISM(cfg, V).eval(), []
    res = prism.attribution_experiment(model, None, StandIn(), cfg, lines.append)
    label = prism.EXACT_CURVATURE_LABEL[curvature] + (", 2 draws per window" if curvature == "fisher" else "")
    assert res["exact_curvature"] == {"curvature": curvature, "label": label,
                                      "samples": 2 if curvature == "fisher" else None}
    one_at_a_time = [ln for ln in lines if ln.startswith("attribution, one approximation at a time")]
    assert f"(curvature: {label})" in res["summary"] and one_at_a_time[0].endswith(f"vs the exact {label})")
    s_label = prism.CACHE_S_LABEL[s_curv]  # the cache's S: drawn targets, as many and seeded alike, or labels
    assert res["cache_s"] == {"s": s_curv, "label": s_label}
    assert f"the cache's {s_label} vs the exact" in one_at_a_time[0]
    assert cache_args == [("block", 1e-2, s_curv, 2, 5)]
    html_text = prism.write_report(tmp_path, cfg, {"attribution": res}, {}).read_text()
    assert f"(--attr-exact-curvature {curvature})" in html_text and f"(--attr-s {s_curv})" in html_text
    exact_row = res["table"][1]
    assert exact_row["method"] == "prototype-space exact" and exact_row["memory holds"] == {
        "empirical": "row-sparse exact gradients + M×M Cholesky factor",
        "fisher": "row-sparse exact gradients, and sampled-target ones (M·S rows) + their M·S×M·S Cholesky factor "
                  "+ the M×M·S cross Gram",
        "ggn": "row-sparse exact gradients + the Gauss–Newton matrix's non-zero d×d blocks"}[curvature]
    alone, batched = res["summary"].split("; it keeps")[0].split("; against per-query times of one batched pass")
    assert ("prototype-space exact" in batched) == (curvature == "ggn") != ("prototype-space exact" in alone)
    assert "The same rankings at other dampings" in html_text  # the damping sweep's table, a row per damping
    header = "".join(f"<th>{h}</th>" for h in ["--attr-damping"] + [
        f"{name} {n}" for name in ("cached vs exact", "cache&#x27;s curvature in both", "curvature alone")
        for n in ("top-10", "top-100")])
    assert header in html_text
    for r in res["damping_sweep"]:  # every cell, in the header's order
        cells = [f"{r['attr_damping']:g}"] + [f"{r[key][f'{n} overlap']:.2f}" for key in
                                              ("cached", "same_curvature", "curvature_only")
                                              for n in ("top-10", "top-100")]
        assert "<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>" in html_text
    ex = built[0]
    assert ex.curvature == curvature and (ex.L is None if curvature == "ggn" else
                                          len(ex.L) == (24 if curvature == "fisher" else 12))
    assert (ex.ggn is not None) == (curvature == "ggn")
    size = [ln for ln in lines if ln.startswith("attribution, the Gauss–Newton reference")]
    assert size == ([] if ex.ggn is None else [
        f"attribution, the Gauss–Newton reference: {len(ex.ggn.live)} live prototypes, {len(ex.ggn.rows):,} non-zero "
        f"16×16 blocks, {ex.ggn.nbytes() / 2**20:.0f} MB"])
    if curvature == "fisher":  # the analysis seed: the draws of a rebuild with --seed 5
        again = build(model, prism.train_windows(StandIn(), 12, 8), 1e-2, "fisher", 2, seed=5)
        assert torch.equal(ex.targets, again.targets)
        # the reference's noise floor: the same reference from other draws (--seed + 1), ranked against it
        redrawn = built[1]
        assert len(built) == 2 and torch.equal(redrawn.targets, build(model, prism.train_windows(StandIn(), 12, 8),
                                                                      1e-2, "fisher", 2, seed=6).targets)
        assert not torch.equal(redrawn.targets, ex.targets)
        r = res["reference_redraw"]
        assert set(r) == {"top-10 overlap", "top-100 overlap"} and all(0 <= v <= 1 for v in r.values())
        assert any(ln.startswith("attribution, the exact reference re-drawn") and
                   f"{r['top-10 overlap']:.2f}/{r['top-100 overlap']:.2f}" in ln for ln in lines)
        assert "The exact reference re-drawn" in html_text
    else:  # the empirical reference draws nothing: no noise floor to measure
        assert len(built) == 1 and res["reference_redraw"] is None and "re-drawn" not in html_text


@pytest.mark.parametrize("curvature", ["block", "kfac"])
def test_exact_gradients_with_the_cache_curvature(curvature, assert_close):
    """The diagnostic that separates the cache's approximations: the exact per-sequence gradients and the exact
    query gradient, preconditioned with the cache's (A_ii S + λI)⁻¹ blocks or (A ⊗ S + λI)⁻¹, against explicit
    inverses; with the linear-view gradients in their place it is the cached method itself."""
    model = tiny()
    K, d = model.P.shape
    M = 8
    w = windows_of(M, 8, seed=7)
    cache = prism.build_attr_cache(model, w, curvature, damping=1e-2)
    ex = prism.build_exact(model, w, damping=1e-2)
    G = dense_rows(ex.index, M, K)                                          # [M, K, d] exact
    S = (cache.Q_S @ torch.diag(cache.lam_S) @ cache.Q_S.T).double()
    if curvature == "kfac":
        A = (cache.Q_A @ torch.diag(cache.lam_A) @ cache.Q_A.T).double()
    else:
        A = torch.diag(cache.A_diag.double())
    H = torch.kron(A, S) + cache.lam * torch.eye(K * d, dtype=torch.float64)
    xq = windows_of(2, 8, seed=8)
    for q in range(2):
        g_q = prism.exact_query_grad(model, xq[q, :-1], xq[q, -1])
        ref = G.reshape(M, -1) @ torch.linalg.solve(H, g_q.double().reshape(-1))
        assert_close(f"{curvature} q{q}", ref, prism.exact_scores_with_cache_curvature(ex, cache, g_q), ratio=1e-4)
    # the same function over the cache's own (linear-view) index and query rows gives the cached scores
    idx, a, delta = prism.query_state(model, xq[:1, :-1], xq[:1, -1])
    g_lin = torch.zeros(K, d).index_put_((idx[0],), a[0, :, None] * delta[0], accumulate=True)
    own = prism.ExactAttr(cache.index, torch.eye(M, dtype=torch.float64), 1.0, M)
    assert_close("cached", prism.cached_scores(cache, idx[0], a[0], delta[0])[0],
                 prism.exact_scores_with_cache_curvature(own, cache, g_lin), ratio=1e-5)


def test_score_postings_by_chunks_and_over_the_whole_bank(assert_close):
    """Postings scored a few rows at a time give the one-chunk scores, both for a set of prototypes and for the
    whole bank read in place (i = None, each row's prototype bisected from indptr, empty prototypes included)."""
    torch.manual_seed(0)
    K, d, M = 9, 5, 7
    keys = torch.unique(torch.randint(0, M, (40,)) * K + torch.randint(0, K - 2, (40,)))  # the last two are empty
    index = prism.ProtoIndex.from_keys(keys, torch.randn(len(keys), d), K)
    G = dense_rows(index, M, K)
    V = torch.randn(K, d)
    for i in (torch.tensor([3, 0, 5]), None):
        v = V if i is None else V[i]
        ref = (G * (V if i is None else torch.zeros(K, d).index_copy(0, i, v)).double()).sum((1, 2))
        for chunk in (d, 3 * d, 2 ** 20):  # one row, three rows, everything at once
            scores, scored = prism.score_postings(index, i, v, M, chunk=chunk)
            assert_close(f"i={i} chunk={chunk}", ref, scores)
            used = G.ne(0).any(-1)
            assert torch.equal(scored, (used if i is None else used[:, i]).any(-1))


@pytest.mark.parametrize("resid_grad", ["detach-zhat", "detach-r", "full"])
def test_dense_baseline_is_the_dot_product_of_flattened_gradients(resid_grad, assert_close):
    """Dense TracIn: each training window's gradient as the model trains (the head's routing) dotted with the
    query's loss gradient, the gradient of its value: the same model routed "full" (logits W z in value and
    gradient), which under the other routings differs from autograd through the head."""
    model = tiny(resid_grad)
    plain = copy.deepcopy(model)
    plain.cfg = dataclasses.replace(model.cfg, resid_grad="full")
    w = windows_of(5, 8, seed=9)
    xq = windows_of(3, 8, seed=10)
    calls, hidden = [], model.hidden
    model.hidden = lambda idx: calls.append(idx.shape[0]) or hidden(idx)  # every pass, query or training window
    scores, seconds, held = prism.dense_scores(model, w, xq[:, :-1], xq[:, -1])
    del model.hidden
    # an untimed warm-up (one query, one training window), as the cached and exact methods have, then Q + M passes
    assert len(calls) == 2 + 3 + 5
    params = [p for p in model.parameters() if p.requires_grad]

    def grad_of(loss):
        model.zero_grad(set_to_none=False)
        loss.backward()
        return torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1).clone()
                          for p in params]).double()  # under full, CE gives P no gradient
    gm = [grad_of(F.cross_entropy(model(w[m:m + 1, :-1])[0], w[m, 1:], reduction="sum")) for m in range(5)]
    model.zero_grad(set_to_none=True)
    gq, through_head = [], []
    for j in range(3):
        loss = F.cross_entropy(plain(xq[j:j + 1, :-1])[0, -1], xq[j, -1])
        gq.append(prism.flat_param_grad(loss, list(plain.parameters())).double())  # P: zeros, as in W z
        through_head.append(grad_of(F.cross_entropy(model(xq[j:j + 1, :-1])[0, -1], xq[j, -1])))
    model.zero_grad(set_to_none=True)
    ref = torch.stack([torch.stack([q @ m for m in gm]) for q in gq])
    assert_close("TracIn", ref, scores, ratio=1e-4)
    routed = torch.stack([torch.stack([q @ m for m in gm]) for q in through_head])
    assert (resid_grad == "full") == bool(((routed - ref).abs() < 1e-6 * ref.abs().max()).all())
    n = sum(p.numel() for p in params)  # held: one query alone its gradient and one training gradient; a batch
    assert seconds["single"] > seconds["batch"] > 0 and held == {"single": 2 * n * 4, "batch": (3 + 1) * n * 4}


def test_sketched_dense_baseline_is_an_unbiased_sketch_of_the_dense_dot_products():
    """CountSketch keeps dot products in expectation: over sketch seeds, every score's mean lies within 5
    standard errors of dense TracIn's (the same check rejects a 30 % bias), one sketch is not exact, and the
    cache holds M x D float32 = the bytes asked for."""
    model = tiny()
    M = 6
    w = windows_of(M, 8, seed=3)
    xq = windows_of(2, 8, seed=4)
    dense, *_ = prism.dense_scores(model, w, xq[:, :-1], xq[:, -1])
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    runs = [prism.sketched_dense_scores(model, w, xq[:, :-1], xq[:, -1], nbytes=4 * M * (n // 8), seed=s)
            for s in range(32)]
    assert all(r["D"] == n // 8 and r["bytes"] == 4 * M * (n // 8) for r in runs)
    assert all(0 < r["hash_seconds"] < r["seconds"] for r in runs)  # the hashing's share of a query, timed apart
    S = torch.stack([r["scores"] for r in runs]).double()  # [seeds, Q, M]
    mean, se = S.mean(0), S.std(0) / len(runs) ** 0.5

    def z(target):
        return ((mean - target.double()) / se.clamp_min(1e-12)).abs().max().item()
    assert z(dense) < 5 < z(1.3 * dense)
    assert (S[0] - dense.double()).abs().max() > 0  # one sketch is an estimate, not the dense scores


def test_full_routing_attributes_along_the_prototype_path(assert_close):
    """--resid-grad full: CE gives P no gradient through the head, so attribution takes spec §2.3 A's gradient,
    along the prototype path with r held fixed. That is the quantity the other routings train P with: the cache
    and the exact baseline of a full-routing model equal those of the same weights under detach-zhat, and the
    exact gradients are not the (zero) autograd gradient of CE through the full-routing head."""
    torch.manual_seed(0)
    ref = tiny("detach-zhat")
    model = tiny("full")
    model.load_state_dict(ref.state_dict())
    K = model.P.shape[0]
    w = windows_of(6, 8, seed=3)
    got, want = prism.build_attr_cache(model, w), prism.build_attr_cache(ref, w)
    assert torch.equal(got.index.seq, want.index.seq) and got.index.G.abs().max() > 0
    assert_close("cache g_{m,i}", want.index.G, got.index.G)
    assert_close("A_ii", want.A_diag, got.A_diag)
    assert_close("S eigenvalues", want.lam_S, got.lam_S)
    ex, ex_ref = prism.build_exact(model, w, damping=1e-2), prism.build_exact(ref, w, damping=1e-2)
    G, G_ref = dense_rows(ex.index, 6, K), dense_rows(ex_ref.index, 6, K)
    assert_close("exact g_m", G_ref, G)
    assert G.abs().max() > 0
    for m in range(6):  # autograd of CE through the full-routing head gives P nothing: not what the exact takes
        logits = model(w[m:m + 1, :-1])[0].float()
        through_head = torch.autograd.grad(F.cross_entropy(logits, w[m, 1:], reduction="sum"), model.P,
                                           allow_unused=True)[0]  # the logits are W z: P is not in CE's graph
        assert (through_head is None or through_head.abs().max() == 0) and G[m].abs().max() > 0
    xq = windows_of(2, 8, seed=4)
    for q in range(2):
        g_q = prism.exact_query_grad(model, xq[q, :-1], xq[q, -1])
        assert_close(f"exact g_q{q}", prism.exact_query_grad(ref, xq[q, :-1], xq[q, -1]), g_q)
        assert prism.exact_scores(ex, g_q).abs().max() > 0


def test_full_routing_experiment_scores_and_labels():
    """A tiny attribution run under --resid-grad full: non-zero scores, labelled as spec §2.3 A's gradients."""
    cfg = Config(layers=1, d_model=16, heads=2, n_protos=12, topk=3, ctx=8, init="random", kernels="torch",
                 resid_grad="full", attr_seqs=20, attr_queries=3, attr_damping=1e-2)
    torch.manual_seed(0)
    lines = []
    res = prism.attribution_experiment(PRISM(cfg, V).eval(), None, StandIn(), cfg, lines.append)
    assert res["gradients"] == prism.ROUTING_LABEL == "prototype path, r held fixed (spec §2.3 A)"
    assert "; gradients: prototype path, r held fixed (spec §2.3 A))" in res["summary"] and res["summary"] in lines
    assert [r["method"] for r in res["table"]][:2] == ["PRISM cached (block)", "prototype-space exact"]
    assert any(e["score"] != 0 for e in res["examples"]["top"])
    assert res["table"][0]["sequences scored"] > 0


class StandInTokenizer:
    def decode(self, ids):
        return " ".join(f"w{i}" for i in ids)


class StandIn:
    """The parts of common.TokenData the experiment reads: token arrays, the tokenizer, the device."""

    def __init__(self, n_train=600, n_val=300, seed=0):
        rng = np.random.default_rng(seed)
        self.split = {"train": rng.integers(0, V, n_train).astype(np.uint16),
                      "val": rng.integers(0, V, n_val).astype(np.uint16)}
        self.tokenizer, self.device, self.vocab_size = StandInTokenizer(), torch.device("cpu"), V

    def tokens(self, split):
        return self.split[split]


def nested_close(a, b, rel=1e-12):
    """Two results of nested dicts and lists equal, floats to a relative `rel` (another summation order)."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(nested_close(a[k], b[k], rel) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(nested_close(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= rel * max(abs(a), abs(b))
    return a == b


@pytest.mark.parametrize("curvature", ["block", "kfac"])
@pytest.mark.parametrize("n_protos,topk,M,T", [(12, 3, 16, 8), (24, 3, 3, 2)])
def test_fixed_a_spectrum_against_the_explicit_curvature(curvature, n_protos, topk, M, T, assert_close):
    """fixed_a_spectrum against the explicit K·d × K·d curvature H (A_ii·S blocks, or A ⊗ S from the cache's
    factors): the weighted error ratio by a dense solve, sqrt(tr E(H + λI)⁻¹Eᵀ / tr G(H + λI)⁻¹Gᵀ), and each
    band's directions, energy shares and |e|/|g| from H's own eigendecomposition; the error is the exact gradients
    (build_exact) minus the cache's fixed-a ones, over the training windows and, apart, the queries. The second
    case leaves prototypes unused and has queries on prototypes no window uses (the function reads only the used
    rows). Read a window at a time, or two of three, the same figures."""
    model = tiny(n_protos=n_protos, topk=topk, ctx=T)
    K, d = model.P.shape
    damping, grid = 1e-2, (1e-3, 0.3, 10.0)
    w = windows_of(M, T, seed=7)
    cache = prism.build_attr_cache(model, w, curvature, damping=damping)
    ex = prism.build_exact(model, w, damping=damping)
    xq = windows_of(3, T, seed=8)
    states = [tuple(t[0] for t in prism.query_state(model, xq[q:q + 1, :-1], xq[q:q + 1, -1])) for q in range(3)]
    grads = [prism.exact_query_grad(model, xq[q, :-1], xq[q, -1]) for q in range(3)]
    if n_protos == 24:  # the case it is for: unused rows, and rows that only a query uses
        windows_use = cache.index.indptr.diff() > 0
        query_use = torch.zeros(K, dtype=torch.bool)
        for (idx, a, _), g_q in zip(states, grads):
            query_use[idx[a > 0]] = True
            query_use |= g_q.ne(0).any(-1)
        assert not (windows_use | query_use).all() and (query_use & ~windows_use).any()
    out = prism.fixed_a_spectrum(cache, ex, states, grads, damping, grid=grid)
    for chunk in (K * d, 2 * K * d):  # a window per chunk; two, the last chunk short when M is odd
        assert nested_close(out, prism.fixed_a_spectrum(cache, ex, states, grads, damping, grid=grid, chunk=chunk))
    assert set(out) == {"lam0", "block", *(["kfac"] if curvature == "kfac" else [])}
    S = (cache.Q_S.double() * cache.lam_S.double()) @ cache.Q_S.double().T
    A = {"block": torch.diag(cache.A_diag.double())}
    if curvature == "kfac":
        A["kfac"] = (cache.Q_A.double() * cache.lam_A.double()) @ cache.Q_A.double().T
    G = dense_rows(ex.index, M, K).reshape(M, -1)
    E = G - dense_rows(cache.index, M, K).reshape(M, -1)
    Gq = torch.stack(grads).double().reshape(3, -1)
    Gq_c = torch.zeros(3, K, d, dtype=torch.float64)
    for q, (idx, a, delta) in enumerate(states):
        Gq_c[q, idx] = a[:, None].double() * delta.double()  # a = 0 rows stay 0
    Eq = Gq - Gq_c.reshape(3, -1)
    assert E.abs().max() > 0 and Eq.abs().max() > 0  # the exact gradients see a's dependence on P: e is not 0
    lam0 = cache.lam / damping
    assert out["lam0"] == lam0
    for name, A_ in A.items():
        H = torch.kron(A_, S)
        sweep = out[name]["sweep"]
        assert [r["attr_damping"] for r in sweep] == sorted(set(grid) | {damping})
        for r in sweep:
            Hl = H + r["attr_damping"] * lam0 * torch.eye(K * d, dtype=torch.float64)

            def weighted(X):
                return (X * torch.linalg.solve(Hl, X.T).T).sum()
            assert_close(f"{name} train {r['attr_damping']}", (weighted(E) / weighted(G)).sqrt(),
                         torch.tensor(r["train"], dtype=torch.float64), ratio=1e-4)
            assert_close(f"{name} query {r['attr_damping']}", (weighted(Eq) / weighted(Gq)).sqrt(),
                         torch.tensor(r["query"], dtype=torch.float64), ratio=1e-4)
        mu, V = torch.linalg.eigh(H)
        eG, eE, eqG, eqE = ((X @ V).pow(2).sum(0) for X in (G, E, Gq, Eq))
        bands = out[name]["bands"]
        edges = [None, *sorted(grid), None]
        assert [tuple(b["band"]) for b in bands] == list(zip(edges[:-1], edges[1:]))
        assert sum(b["directions"] for b in bands) == K * d
        for b in bands:
            lo, hi = b["band"]
            m = torch.ones(K * d, dtype=torch.bool)
            if lo is not None:
                m &= mu >= lo * lam0
            if hi is not None:
                m &= mu < hi * lam0
            assert b["directions"] == int(m.sum()), (name, b["band"])
            for key, want in (("gradient share", eG[m].sum() / eG.sum()), ("error share", eE[m].sum() / eE.sum()),
                              ("train", (eE[m].sum() / eG[m].sum()).sqrt()),
                              ("query", (eqE[m].sum() / eqG[m].sum()).sqrt())):
                if b[key] is None:  # a band where no gradient lies
                    assert eqG[m].sum() < 1e-12 * eqG.sum() if key == "query" else eG[m].sum() < 1e-12 * eG.sum()
                else:
                    assert_close(f"{name} {b['band']} {key}", want, torch.tensor(b[key], dtype=torch.float64),
                                 ratio=1e-4, atol=1e-9)
    # the log: one line per curvature, each band's label and figures
    lines = prism.spectrum_lines(out)
    assert len(lines) == len(A)
    for ln, name in zip(lines, A):
        assert f"in the {name} curvature's eigenbasis" in ln
        assert f"{out[name]['sweep'][0]['train']:.2f}, " in ln and "<0.001 " in ln and ">=10 " in ln


@pytest.mark.parametrize("curvature", ["block", "kfac"])
def test_experiment_table(curvature, tmp_path):
    cfg = Config(layers=1, d_model=16, heads=2, n_protos=12, topk=3, ctx=8, init="random", kernels="torch",
                 attr_seqs=30, attr_queries=4, attr_curvature=curvature, attr_damping=1e-2)
    model = PRISM(cfg, V).eval()
    lines = []
    res = prism.attribution_experiment(model, None, StandIn(), cfg, lines.append)
    assert res["queries"] == 4 and res["seqs"] == 30
    names = [r["method"] for r in res["table"]]
    assert names == [f"PRISM cached ({curvature})", "prototype-space exact", "dense TracIn (all parameters)",
                     "dense TracIn, batch of 4 queries", "dense TracIn, CountSketch cache at matched memory"]
    sk = res["table"][4]
    assert sk["memory MB"] <= res["table"][0]["memory MB"]
    # The summary's speed phrases follow the table's measured times, each in its own direction; which way the
    # times go is the benchmark's business (timing on a busy 2-core runner is noise), not this test's
    cached = res["table"][0]["ms/query"]
    for r in res["table"][1:]:
        x = r["ms/query"] / cached
        phrase = f"{x:.3g}x faster than {r['method']}" if x >= 1 else f"{1 / x:.3g}x slower than {r['method']}"
        assert phrase in res["summary"], (phrase, res["summary"])
    for r in res["table"]:
        assert set(r) >= {"method", "ms/query", "memory MB", "top-10 overlap", "top-100 overlap", "sequences scored"}
        assert 0 <= r["top-10 overlap"] <= 1 and 0 <= r["top-100 overlap"] <= 1
        assert r["ms/query"] > 0 and r["memory MB"] > 0 and 0 < r["sequences scored"] <= 30
        assert r["sequences scored (min)"] <= r["sequences scored"]  # the mean over queries, beside its minimum
    # the log never rounds a mean to "all of them": a mean with its minimum, or every query scored every window
    cached = res["table"][0]
    low = cached["sequences scored (min)"]
    scored = ("30/30 sequences scored by every query" if low == 30 else
              f"{cached['sequences scored']:.1f}/30 sequences scored per query (min {low})")
    assert scored in lines[0] and all("30/30 sequences scored by every query" in ln for ln in lines[1:5])
    exact = res["table"][1]
    assert exact["top-10 overlap"] == 1 and exact["top-100 overlap"] == 1  # n capped at M = 30: all of them
    sweep = res["damping_sweep"]  # the grid, with the run's own 1e-2 among it
    assert [r["attr_damping"] for r in sweep] == sorted(set(prism.ATTR_DAMPING_SWEEP) | {1e-2})
    spectrum = prism.spectrum_lines(res["fixed_a_spectrum"])  # block's, and kfac's when the cache is kfac
    assert len(spectrum) == 1 + (curvature == "kfac") and set(res["fixed_a_spectrum"]) == {
        "lam0", "block", *(["kfac"] if curvature == "kfac" else [])}
    assert len(lines) == 8 + len(sweep) + len(spectrum) and lines[5] == res["summary"]
    assert lines[8 + len(sweep):] == spectrum
    # the report: per curvature, the sentence with the weighted ratios and one row per band, every cell
    report = prism.write_report(tmp_path, cfg, {"attribution": res}, {})
    assert report.name == "report.html"  # the report's own name, whatever the tables inside it are called
    html_text = report.read_text()
    for name in ("block", "kfac")[:len(spectrum)]:
        s = res["fixed_a_spectrum"][name]
        assert f"in the {name} curvature H's eigenbasis" in html_text
        r = s["sweep"][0]
        assert f"{r['train']:.2f} ({r['query']:.2f} for the queries) at {r['attr_damping']:g}" in html_text
        for b in s["bands"]:
            cells = [prism.band_label(*b["band"]), str(b["directions"]), prism.percent(b["gradient share"]),
                     prism.percent(b["error share"])] + ["n/a" if b[k] is None else f"{b[k]:.2f}" for k in ("train", "query")]
            assert "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>" in html_text, cells
    assert res["reference_redraw"] is None  # the default empirical reference draws nothing: no re-draw to measure
    assert res["vs_ekfac"] is None  # no --ekfac: nothing to compare with
    # the diagnostics: gradients alone (no curvature; the cache's curvature in both) and curvature alone
    for key in ("gradients_only", "same_curvature", "curvature_only"):
        g = res[key]
        assert set(g) == {"top-10 overlap", "top-100 overlap"} and all(0 <= v <= 1 for v in g.values())
    assert lines[6].startswith("attribution, gradients alone (no curvature in either ranking): cached vs exact")
    assert lines[7].startswith(f"attribution, one approximation at a time: with the cache's {curvature} curvature")
    # the sweep at the run's own damping is the run's figures; one line per damping, in the grid's order

    def pair(o):
        return f"{o['top-10 overlap']:.2f}/{o['top-100 overlap']:.2f}"
    own = next(r for r in sweep if r["attr_damping"] == 1e-2)
    assert own["cached"] == {k: res["table"][0][k] for k in ("top-10 overlap", "top-100 overlap")}
    assert own["same_curvature"] == res["same_curvature"] and own["curvature_only"] == res["curvature_only"]
    for ln, r in zip(lines[8:], sweep):
        own_mark = " (this run's, the rows above)" if r["attr_damping"] == 1e-2 else ""
        assert ln == (f"attribution, damping sweep, --attr-damping {r['attr_damping']:g}{own_mark}: top-10/top-100 "
                      f"overlap cached vs exact {pair(r['cached'])}, with the cache's curvature in both "
                      f"{pair(r['same_curvature'])}, the curvature alone {pair(r['curvature_only'])}")
    # the chance level n/M beside every overlap: in the table, the log lines, the summary and results
    assert res["chance"] == {"top-10 overlap": 10 / 30, "top-100 overlap": 1.0}
    assert all(r["top-10 chance"] == 10 / 30 and r["top-100 chance"] == 1.0 for r in res["table"])
    assert all("(chance 0.33/1.00)" in ln for ln in lines[:5])
    assert "(chance 33% and 100%;" in res["summary"]
    ex = res["examples"]
    assert len(ex["top"]) == 3 and all(e["text"].startswith("w") and len(e["text"].split()) == 9 for e in ex["top"])
    assert [e["score"] for e in ex["top"]] == sorted((e["score"] for e in ex["top"]), reverse=True)
    assert len(ex["query"].split()) == 8 and ex["target"].startswith("w")


def test_topn_overlap():
    ref = torch.tensor([[5.0, 4, 3, 2, 1, 0]])
    assert prism.topn_overlap(ref, ref, 3) == 1
    assert prism.topn_overlap(torch.tensor([[0.0, 1, 2, 3, 4, 5]]), ref, 3) == 0
    assert prism.topn_overlap(torch.tensor([[5.0, 0, 3, 2, 1, 4]]), ref, 2) == 0.5
    assert prism.topn_overlap(torch.tensor([[0.0, 1, 2, 3, 4, 5]]), ref, 100) == 1  # n capped at M


def test_chance_overlap_is_a_random_rankings_expectation():
    g = torch.Generator().manual_seed(0)
    M, Q = 50, 4000
    ref = torch.rand(Q, M, generator=g)
    for n in (1, 10, 25):
        got = prism.topn_overlap(torch.rand(Q, M, generator=g), ref, n)
        assert abs(got - prism.chance_overlap(n, M)) < 0.02 and prism.chance_overlap(n, M) == n / M
    assert prism.chance_overlap(100, M) == 1.0  # n capped at M, as in topn_overlap


def test_batched_rows_are_labelled_and_compared_as_batches(monkeypatch):
    """EK-FAC's time is one batched scoring pass over the Q queries, divided by Q: its row says so, like the dense
    TracIn batch row, and the summary compares the cached per-query time with the batch rows apart from the rows
    timed one query at a time. (kronfluence is stood in for: only the bookkeeping is under test.)"""
    cfg = Config(layers=1, d_model=16, heads=2, n_protos=12, topk=3, ctx=8, init="random", kernels="torch",
                 attr_seqs=10, attr_queries=3, ekfac=True)
    monkeypatch.setattr(prism, "ekfac_scores", lambda model, w, xq, yq, log: {
        "scores": torch.randn(len(xq), w.shape[0]), "setup": 1.0, "seconds": 0.3, "bytes": 1024})
    lines = []
    res = prism.attribution_experiment(PRISM(cfg, V).eval(), None, StandIn(), cfg, lines.append)
    ek = res["table"][-1]
    assert ek["method"] == "EK-FAC (kronfluence), batch of 3 queries" and ek["ms/query"] == pytest.approx(100.0)
    assert ek["method"] in res["memory_notes"] and all(r["method"] in res["memory_notes"] for r in res["table"])
    alone, batched = res["summary"].split("; against per-query times of one batched pass over 3 queries")
    assert "prototype-space exact" in alone and "dense TracIn (all parameters)" in alone and "batch of" not in alone
    assert "dense TracIn, batch of 3 queries" in batched and "EK-FAC (kronfluence), batch of 3 queries" in batched


@pytest.mark.parametrize("stand_in", ["cached", "dense"])
def test_every_ranking_is_compared_with_ekfacs(stand_in, monkeypatch, tmp_path):
    """With --ekfac the cached, exact, dense and sketch rankings are each compared with EK-FAC's (the paper's
    other yardstick). EK-FAC is stood in for by a ranking the run also makes, recomputed alike: against itself it
    overlaps fully, and against exact it overlaps as the table's row for that method does (overlap is symmetric)."""
    cfg = Config(layers=1, d_model=16, heads=2, n_protos=12, topk=3, ctx=8, init="random", kernels="torch",
                 attr_seqs=30, attr_queries=3, ekfac=True)

    def fake_ekfac(model, w, xq, yq, log):
        if stand_in == "dense":
            scores = prism.dense_scores(model, w, xq, yq)[0]
        else:
            cache = prism.build_attr_cache(model, w, cfg.attr_curvature, cfg.attr_damping)
            scores = torch.stack([prism.cached_scores(cache, *(t[0] for t in prism.query_state(
                model, xq[j:j + 1], yq[j:j + 1])))[0] for j in range(len(xq))])
        return {"scores": scores, "setup": 1.0, "seconds": 0.3, "bytes": 1024}
    monkeypatch.setattr(prism, "ekfac_scores", fake_ekfac)
    lines = []
    res = prism.attribution_experiment(PRISM(cfg, V).eval(), None, StandIn(), cfg, lines.append)
    names = ["PRISM cached (block)", "prototype-space exact", "dense TracIn (all parameters)",
             "dense TracIn, CountSketch cache at matched memory"]
    assert list(res["vs_ekfac"]) == names
    itself = names[0] if stand_in == "cached" else names[2]
    assert res["vs_ekfac"][itself] == {"top-10 overlap": 1.0, "top-100 overlap": 1.0}
    row = next(r for r in res["table"] if r["method"] == itself)
    assert res["vs_ekfac"]["prototype-space exact"] == {k: row[k] for k in ("top-10 overlap", "top-100 overlap")}
    assert any(o["top-10 overlap"] < 1 for o in res["vs_ekfac"].values())  # not everything overlaps fully

    def pair(o):
        return f"{o['top-10 overlap']:.2f}/{o['top-100 overlap']:.2f}"
    assert ("attribution, against EK-FAC's ranking: top-10/top-100 overlap "
            + ", ".join(f"{n} {pair(o)}" for n, o in res["vs_ekfac"].items()) + " (chance 0.33/1.00)") in lines
    html_text = prism.write_report(tmp_path, cfg, {"attribution": res}, {}).read_text()
    assert "Each ranking against EK-FAC's" in html_text


@pytest.mark.parametrize("damping", [0.1, 1e-2])
def test_ekfac_damping_other_than_kronfluences_is_noted(damping, monkeypatch):
    """EK-FAC always takes kronfluence's heuristic (0.1 × each module's mean eigenvalue): a run whose
    --attr-damping differs says so, the default run (the same 0.1) does not."""
    cfg = Config(layers=1, d_model=16, heads=2, n_protos=12, topk=3, ctx=8, init="random", kernels="torch",
                 attr_seqs=10, attr_queries=2, ekfac=True, attr_damping=damping)
    calls = []
    monkeypatch.setattr(prism, "ekfac_scores", lambda model, w, xq, yq, log: calls.append(1) or None)
    lines = []
    prism.attribution_experiment(PRISM(cfg, V).eval(), None, StandIn(), cfg, lines.append)
    note = ("note: EK-FAC takes kronfluence's heuristic damping, 0.1 x each module's mean eigenvalue, not "
            "--attr-damping 0.01")
    assert calls == [1] and (note in lines) == (damping != 0.1)
    assert not any(ln.startswith("note: EK-FAC") and ln != note for ln in lines)


def test_ekfac_without_kronfluence_is_skipped(monkeypatch):
    monkeypatch.setitem(sys.modules, "kronfluence", None)  # `import kronfluence...` now raises ImportError
    cfg = Config(layers=1, d_model=16, heads=2, n_protos=12, topk=3, ctx=8, init="random", kernels="torch",
                 attr_seqs=10, attr_queries=2, ekfac=True)
    lines = []
    res = prism.attribution_experiment(PRISM(cfg, V).eval(), None, StandIn(), cfg, lines.append)
    pin = torch.__version__.split("+")[0]
    assert f"EK-FAC: kronfluence is not installed (pip install kronfluence torch=={pin}: the pin keeps this torch); " \
           "skipped" in lines
    assert not any(ln.startswith("note: EK-FAC takes") for ln in lines)  # the default damping is kronfluence's own
    assert not any("EK-FAC" in r["method"] for r in res["table"])


def test_ekfac_with_huge_damping_is_gradient_similarity(assert_close):
    """With damping far above every eigenvalue, EK-FAC's (F + λI)⁻¹ ≈ I/λ: λ·score is the dot product of the
    tracked (Linear) modules' gradients. Runs only where kronfluence is installed."""
    pytest.importorskip("kronfluence")
    model = tiny()
    w = windows_of(6, 8, seed=11)
    xq = windows_of(2, 8, seed=12)
    lam = 1e8
    res = prism.ekfac_scores(model, w, xq[:, :-1], xq[:, -1], print, damping=lam)
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]

    def grad_of(loss):
        return torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, linears)]).double()
    # the query's loss gradient through W z (query_ce), the training windows' as the model trains (the head)
    gq = [grad_of(F.cross_entropy(F.linear(model.hidden(xq[j:j + 1, :-1])[0, -1], model.wte.weight), xq[j, -1]))
          for j in range(2)]
    gm = [grad_of(F.cross_entropy(model(w[m:m + 1, :-1])[0], w[m, 1:], reduction="sum")) for m in range(6)]
    ref = torch.stack([torch.stack([q @ m for m in gm]) for q in gq])
    assert_close("EK-FAC at huge damping", ref, res["scores"] * lam, ratio=1e-3)
    assert res["bytes"] > 0 and res["seconds"] > 0


def manual_sgd(model, windows, left_out, order, lr, batch):
    """The retraining check's continued training written apart from it: per-window gradients of each window's mean
    CE by autograd, summed over the windows a batch keeps and divided by the batch size (a short last batch's too:
    every window weighs lr/batch), one SGD step per batch. -> the trained copy."""
    m = copy.deepcopy(model).eval()
    params = [p for p in m.parameters() if p.requires_grad]
    for epoch in order:
        for b in epoch.split(batch):
            step = [torch.zeros_like(p) for p in params]
            kept = [int(i) for i in b if int(i) not in left_out]
            for i in kept:
                w = windows[i]
                loss = F.cross_entropy(m(w[None, :-1])[0].float(), w[1:])
                for s, g in zip(step, torch.autograd.grad(loss, params, allow_unused=True)):
                    if g is not None:
                        s += g
            with torch.no_grad():
                for p, s in zip(params, step):
                    p -= lr * s / batch
    return m


@pytest.mark.parametrize("resid_grad", ["detach-zhat", "full"])
def test_retraining_leaves_out_exactly_those_windows(resid_grad, assert_close):
    """retrain_query_losses against per-window SGD written out: two epochs in two shuffled orders, batches of 4
    over 10 windows (a short last batch of 2), three windows left out, two of them the first epoch's whole last
    batch (no step there); the query losses after agree, and `work` starts again from `start` on every call."""
    model = tiny(resid_grad)
    w = windows_of(10, 8, seed=21)
    xq = windows_of(3, 8, seed=22)
    order = torch.stack([torch.randperm(10, generator=torch.Generator().manual_seed(s)) for s in (1, 2)])
    start = {k: v.clone() for k, v in model.state_dict().items()}
    work = copy.deepcopy(model)
    last = order[0, 8:].tolist()  # the first epoch's short last batch
    left = {next(i for i in range(10) if i not in last), *last}
    assert len(left) == 3
    for left_out in (left, set()):
        got = prism.retrain_query_losses(work, start, w, left_out, xq[:, :-1], xq[:, -1], order, 0.5, 4)
        ref = manual_sgd(model, w, left_out, order, 0.5, 4)
        with torch.no_grad():
            want = torch.stack([prism.query_ce(ref, xq[j:j + 1, :-1], xq[j, -1]) for j in range(3)])
        assert_close(f"query losses, {sorted(left_out)} left out", want, got, ratio=1e-5)
        before = torch.stack([prism.query_ce(model, xq[j:j + 1, :-1], xq[j, -1]) for j in range(3)]).detach()
        assert (got - before).abs().max() > 1e-3  # the training moved the queries
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in start.items())  # the model itself is untouched


@pytest.mark.parametrize("resid_grad", ["detach-zhat", "detach-r", "full"])
def test_retraining_depends_on_p_only_through_the_training(resid_grad, assert_close):
    """The query's loss is CE of W z: at fixed weights it does not depend on the prototypes P at all, so to first
    order the check sees a window only through its backbone gradient. P enters through the continued training
    (CE alone): under full the backbone's CE gradient is the dense head's and the losses after it do not depend
    on P either (to rounding); under detach-zhat the backbone also gets ẑ's share through the cosines in a, and
    under detach-r only that share, so there other values of P give other losses."""
    model = tiny(resid_grad)
    w = windows_of(10, 8, seed=23)
    xq = windows_of(3, 8, seed=24)
    order = torch.stack([torch.randperm(10, generator=torch.Generator().manual_seed(s)) for s in (3, 4)])
    start = {k: v.clone() for k, v in model.state_dict().items()}
    other = {**start, "P": torch.randn(start["P"].shape, generator=torch.Generator().manual_seed(25))}
    work = copy.deepcopy(model)
    for s in (start, other):  # at fixed weights: the same query losses, whatever P holds
        work.load_state_dict(s)
        with torch.no_grad():
            at_start = prism.query_ce(work, xq[:, :-1], xq[:, -1], reduction="none")
        if s is start:
            first = at_start
        assert torch.equal(at_start, first)
    for left_out in (set(), {1, 4, 7}):
        losses = [prism.retrain_query_losses(work, s, w, left_out, xq[:, :-1], xq[:, -1], order, 0.5, 4)
                  for s in (start, other)]
        if resid_grad == "full":
            assert_close(f"query losses, other P, {sorted(left_out)} left out", losses[0], losses[1], ratio=1e-5)
        else:
            assert (losses[0] - losses[1]).abs().max() > 1e-2, left_out


@pytest.mark.parametrize("resid_grad", ["detach-zhat", "detach-r", "full"])
def test_retraining_effect_is_tracin_to_first_order(resid_grad, assert_close):
    """One small SGD step over the whole set: leaving out R changes the query's loss by (lr/M)·Σ_{m∈R} ∇L_q·∇CE̅_m
    to first order, i.e. lr/(M·T) times the dense TracIn scores (∇ of the summed CE) of the windows left out: the
    check measures what the scores claim, in their units. Under detach-zhat and detach-r only with the query's
    loss gradient of W z (query_ce): the same prediction from autograd through the routed head is off."""
    model = tiny(resid_grad)
    M, T = 12, 8
    w = windows_of(M, T, seed=31)
    xq = windows_of(2, T, seed=32)
    scores = prism.dense_scores(model, w, xq[:, :-1], xq[:, -1])[0].double()
    order = torch.arange(M)[None]
    start = {k: v.clone() for k, v in model.state_dict().items()}
    work = copy.deepcopy(model)
    lr = 3e-3  # second-order terms grow with lr, fp32's rounding of the losses with 1/lr
    base = prism.retrain_query_losses(work, start, w, (), xq[:, :-1], xq[:, -1], order, lr, M).double()
    params = [p for p in model.parameters() if p.requires_grad]
    head_q = torch.stack([prism.flat_param_grad(F.cross_entropy(model(xq[j:j + 1, :-1])[0, -1], xq[j, -1]), params)
                          for j in range(2)]).double()
    g_m = torch.stack([prism.flat_param_grad(F.cross_entropy(model(w[m:m + 1, :-1])[0], w[m, 1:]), params)
                       for m in range(M)]).double()  # each window's mean CE, as the continued training takes it
    for left_out in ([0, 5], [2, 3, 11]):
        got = prism.retrain_query_losses(work, start, w, left_out, xq[:, :-1], xq[:, -1], order, lr, M).double()
        assert_close(f"Δ with {left_out} left out", lr / (M * T) * scores[:, left_out].sum(1), got - base, ratio=2e-2)
        routed = lr / M * (head_q @ g_m[left_out].T).sum(1)
        err = (routed - (got - base)).norm() / (got - base).norm()
        assert (err < 2e-2) == (resid_grad == "full"), err


def test_retraining_check_rows(monkeypatch, tmp_path):
    """The check over the experiment's rankings: the picked queries, one row per ranking and the random windows, Δ
    and its standard error from the per-query values, the above-random counts, equal left-out sets trained once,
    the same figures on a second call, the model left as it was, and the log lines."""
    cfg = Config(layers=1, d_model=16, heads=2, n_protos=12, topk=3, ctx=8, init="random", kernels="torch",
                 attr_seqs=20, attr_queries=5, attr_retrain=3, attr_retrain_k=4, batch_size=6, attr_retrain_epochs=2)
    model = PRISM(cfg, V).eval()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    calls = []
    real = prism.retrain_query_losses
    monkeypatch.setattr(prism, "retrain_query_losses", lambda *a: calls.append((a[3], a[8])) or real(*a))
    lines = []
    res = prism.attribution_experiment(model, None, StandIn(), cfg, lines.append)
    rt = res["retrain"]
    assert rt["queries"] == [0, 2, 4] and rt["k"] == 4 and rt["seqs"] == 20 and rt["epochs"] == 2
    names = ["PRISM cached (block)", "prototype-space exact", "dense TracIn (all parameters)",
             "dense TracIn, CountSketch cache at matched memory", "random windows"]
    assert [r["method"] for r in rt["rows"]] == names
    rand = rt["rows"][-1]["per_query"]
    for r in rt["rows"]:
        d = torch.tensor(r["per_query"], dtype=torch.float64)
        assert len(d) == 3 and r["delta"] == pytest.approx(d.mean().item())
        assert r["se"] == pytest.approx((d.std() / 3 ** 0.5).item())
        if r["method"] != "random windows":
            assert r["above random"] == sum(x > y for x, y in zip(r["per_query"], rand))
    assert rt["rows"][-1]["above random"] is None
    left = [frozenset(c[0]) for c in calls]  # each left-out set trained once, nothing left out twice: the noise
    assert left.count(frozenset()) == 2 and len(set(left)) == len(left) - 1 == rt["runs"] - 1
    assert all(len(c) == 4 for c in left if c) and {c[1] for c in calls} == {6} == {rt["batch"]}  # --batch-size
    assert rt["noise"] == 0  # on the CPU the repeat is bit-identical
    # the shift: the nothing-left-out training's query losses against the model's own
    xq, yq = prism.val_queries(StandIn(), 5, 8, "cpu")
    gen = torch.Generator().manual_seed(cfg.seed)  # the batches: one shuffle per epoch from --seed
    base = real(copy.deepcopy(model), start, prism.train_windows(StandIn(), 20, 8), (), xq[[0, 2, 4]], yq[[0, 2, 4]],
                torch.stack([torch.randperm(20, generator=gen) for _ in range(2)]), 0.1, 6)
    with torch.no_grad():
        before = prism.query_ce(model, xq[[0, 2, 4]], yq[[0, 2, 4]], reduction="none")
    assert rt["shift"] == pytest.approx(float((base - before).mean()), rel=1e-5)
    cached = rt["rows"][0]["per_query"]  # each other method minus the cached one, query by query
    assert "vs first" not in rt["rows"][0] and "vs first" not in rt["rows"][-1] and rt["first"] == names[0]
    for r in rt["rows"][1:-1]:
        diff = torch.tensor([x - c for x, c in zip(r["per_query"], cached)], dtype=torch.float64)
        assert r["vs first"]["delta"] == pytest.approx(diff.mean().item())
        assert r["vs first"]["se"] == pytest.approx((diff.std() / 3 ** 0.5).item())
        assert r["vs first"]["above"] == int((diff > 0).sum())
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in start.items())
    # the first-order prediction: lr·epochs/(B·T) × the left-out windows' dense TracIn scores; for TracIn's own row
    # its top 4, for the random row the windows drawn after the batches' shuffles
    tracin = prism.dense_scores(model, prism.train_windows(StandIn(), 20, 8), xq, yq)[0]
    scale = 0.1 * 2 / (6 * 8)
    assert rt["rows"][2]["predicted_per_query"] == pytest.approx(
        [scale * float(tracin[j].topk(4).values.sum()) for j in (0, 2, 4)], rel=1e-5)
    assert rt["rows"][-1]["predicted_per_query"] == pytest.approx(
        [scale * float(tracin[j, torch.randperm(20, generator=gen)[:4]].sum()) for j in (0, 2, 4)], rel=1e-5)
    assert all(r["predicted"] == pytest.approx(statistics.fmean(r["predicted_per_query"])) for r in rt["rows"])
    xs = np.array([x for r in rt["rows"] for x in r["predicted_per_query"]])
    ys = np.array([y for r in rt["rows"] for y in r["per_query"]])
    fo = rt["first_order"]
    assert fo["pairs"] == 15 and fo["r"] == pytest.approx(np.corrcoef(xs, ys)[0, 1])
    assert fo["slope"] == pytest.approx(xs @ ys / (xs @ xs))
    again = prism.retrain_check(model, prism.train_windows(StandIn(), 20, 8),
                                *prism.val_queries(StandIn(), 5, 8, "cpu"), {}, cfg, lambda s: None)
    assert again["rows"][-1]["per_query"] == rand  # the random windows and the batches: the same draws
    head = [ln for ln in lines if ln.startswith("attribution, retraining check")]
    assert len(head) == 7 and head[0].startswith("attribution, retraining check: 3 queries; for each, a method's top 4 "
                                                 "of the 20 windows left out of 2 epochs of plain SGD (lr 0.1")
    assert f"repeated, it gave the same losses to 0.0e+00 nats, Δ's noise floor); {rt['runs']} runs" in head[0]
    assert rt["runs"] <= 2 + 3 * 5  # nothing left out twice, then 3 queries × (4 rankings + random), fewer if equal
    assert head[1] == (f"attribution, retraining check, first order: the prediction lr·epochs/(B·T) × the left-out "
                       f"windows' dense TracIn scores vs the measured Δ over the 15 (method, query) pairs: correlation "
                       f"{fo['r']:.3f}, measured = {fo['slope']:.3f} × predicted (least squares through 0); near 1 "
                       "and 1, the check is in TracIn's linear regime, where TracIn's own top k is the largest "
                       "predicted Δ by construction")
    for ln, r in zip(head[2:], rt["rows"]):
        assert ln.startswith(f"attribution, retraining check, {r['method']}: Δ {r['delta']:+.4f} ± {r['se']:.4f} "
                             "nats")
        assert f", first-order prediction {r['predicted']:+.4f}" in ln
        if "vs first" in r:
            v = r["vs first"]
            assert ln.endswith(f"; minus PRISM cached (block)'s, query by query: {v['delta']:+.4f} ± {v['se']:.4f}, "
                               f"above it in {v['above']}/3")
    # a batch of its own (--attr-retrain-batch), and the report's table
    other = prism.retrain_check(model, prism.train_windows(StandIn(), 20, 8), xq, yq, {},
                                dataclasses.replace(cfg, attr_retrain=1, attr_retrain_batch=20), lambda s: None)
    assert other["batch"] == 20 and other["queries"] == [0] and calls[-1][1] == 20  # what the training got
    table = {"summary": "s", "table": [{"method": names[0], "sequences scored": 20.0, "sequences scored (min)": 20}]}
    html = prism.write_report(tmp_path, cfg, {"attribution": {**table, "retrain": rt}}, {}).read_text()
    one = prism.write_report(tmp_path, cfg, {"attribution": {**table, "retrain": other}}, {}).read_text()
    assert "Retraining check (3 queries): each method&#x27;s top 4 of the 20 windows left out of 2 epoch(s)" in html \
        or "Retraining check (3 queries): each method's top 4 of the 20 windows left out of 2 epoch(s)" in html
    assert "Retraining check (1 query)" in one
    for r in rt["rows"]:
        cells = f"<td>{r['method']}</td><td>{r['delta']:+.4f} ± {r['se']:.4f}</td>"
        if "vs first" in r:
            v = r["vs first"]
            cells += (f"<td>{r['above random']}/3</td><td>{r['predicted']:+.4f}</td><td>{v['delta']:+.4f} ± "
                      f"{v['se']:.4f}</td><td>{v['above']}/3</td>")
        assert cells in html, cells
    assert f"correlates with it at {rt['first_order']['r']:.3f}, measured = {rt['first_order']['slope']:.3f} × " \
           "predicted" in html
    assert "first-order prediction" not in one and "correlates" not in one  # no TracIn scores given: no column


def test_retraining_check_first_order_fit():
    """At a small lr the check is in TracIn's linear regime: its prediction lr·epochs/(B·T) × the left-out windows'
    dense TracIn scores fits the measured Δ (correlation and least-squares slope near 1) over several batches
    and epochs; a scale off by the epochs (2), B (4) or T (8) would put the slope that far from 1."""
    cfg = Config(layers=1, d_model=16, heads=2, n_protos=12, topk=3, ctx=8, init="random", kernels="torch",
                 attr_retrain=3, attr_retrain_k=3, batch_size=4, attr_retrain_epochs=2, attr_retrain_lr=3e-3)
    model = tiny()
    w = windows_of(12, 8, seed=61)
    xq = windows_of(3, 8, seed=62)
    tracin = prism.dense_scores(model, w, xq[:, :-1], xq[:, -1])[0]
    every_fourth = (torch.arange(12) % 4 == 0).float().expand(3, 12)  # a fixed set, whatever the query
    rankings = {"TracIn": tracin, "TracIn reversed": -tracin, "every fourth": every_fourth}
    rt = prism.retrain_check(model, w, xq[:, :-1], xq[:, -1], rankings, cfg, lambda s: None, tracin=tracin)
    fo = rt["first_order"]
    assert fo["pairs"] == 12 and fo["r"] > 0.99 and fo["slope"] == pytest.approx(1, abs=0.05), fo


def test_retraining_noise_floor_is_the_repeat_gap(monkeypatch):
    """The nothing-left-out training runs twice; the largest gap between the two is the logged noise floor (on
    the CPU 0, so a stand-in that perturbs the repeat shows the plumbing)."""
    cfg = Config(layers=1, d_model=16, heads=2, n_protos=12, topk=3, ctx=8, init="random", kernels="torch",
                 attr_retrain=2, attr_retrain_k=2, batch_size=4)
    model = PRISM(cfg, V).eval()
    real, empties = prism.retrain_query_losses, []

    def perturbed(*a):
        out = real(*a)
        if not a[3]:
            empties.append(1)
            return out + 0.25 * (len(empties) == 2)  # the repeat
        return out
    monkeypatch.setattr(prism, "retrain_query_losses", perturbed)
    lines = []
    xq = windows_of(2, 8, seed=51)
    rt = prism.retrain_check(model, windows_of(8, 8, seed=52), xq[:, :-1], xq[:, -1], {}, cfg, lines.append)
    assert len(empties) == 2 and rt["noise"] == pytest.approx(0.25)
    assert "repeated, it gave the same losses to 2.5e-01 nats, Δ's noise floor)" in lines[0]


def test_retraining_check_needs_a_window_to_train_on():
    cfg = Config(layers=1, d_model=16, heads=2, n_protos=12, topk=3, ctx=8, init="random", kernels="torch",
                 attr_retrain=2, attr_retrain_k=6)
    model = PRISM(cfg, V).eval()
    xq = windows_of(2, 8, seed=41)
    with pytest.raises(prism.RunError, match=r"^--attr-retrain-k 6 leaves no window of the attribution set's 6 to "
                                             r"train on; use at most 5$"):
        prism.retrain_check(model, windows_of(6, 8), xq[:, :-1], xq[:, -1], {}, cfg, print)


def test_retraining_check_batches_at_most_the_set_and_refuses_divergence(monkeypatch):
    """A batch larger than the attribution set trains on the whole set per step (weighting each window by the
    requested batch would shrink every step unseen, so every Δ read 0), said in a note; an lr at which the plain
    SGD diverges is one error line, not a table of NaN deltas."""
    cfg = Config(layers=1, d_model=16, heads=2, n_protos=12, topk=3, ctx=8, init="random", kernels="torch",
                 attr_retrain=2, attr_retrain_k=2, attr_retrain_batch=1000)
    model = PRISM(cfg, V).eval()
    xq, windows = windows_of(2, 8, seed=61), windows_of(8, 8, seed=62)
    batches = []
    real = prism.retrain_query_losses
    monkeypatch.setattr(prism, "retrain_query_losses", lambda *a: batches.append(a[8]) or real(*a))
    lines = []
    rt = prism.retrain_check(model, windows, xq[:, :-1], xq[:, -1], {}, cfg, lines.append)
    assert rt["batch"] == 8 and set(batches) == {8}
    assert lines[0] == ("note: retraining check: batches of 1000 windows, more than the attribution set's 8; using "
                        "8 (one full batch per epoch)")
    same = prism.retrain_check(model, windows, xq[:, :-1], xq[:, -1], {}, dataclasses.replace(cfg, attr_retrain_batch=8),
                               print)  # the same run as batches of 8 asked for
    assert rt["shift"] == same["shift"] != 0 and rt["rows"] == same["rows"]
    monkeypatch.setattr(prism, "retrain_query_losses", lambda *a: torch.full((2,), float("nan")))
    with pytest.raises(prism.RunError, match=r"^the retraining check diverged \(a non-finite query loss after 1 "
                                             r"epoch of SGD at --attr-retrain-lr 0.1\); lower --attr-retrain-lr$"):
        prism.retrain_check(model, windows, xq[:, :-1], xq[:, -1], {}, dataclasses.replace(cfg, attr_retrain_batch=0),
                            print)


def test_more_queries_than_val_windows_allocate_no_more():
    """--attr-queries past the val split's window starts: every start once (what the linspace would collapse to),
    without building a Q-long linspace first (1e9 queries took GBs and the OOM killer)."""
    class Tiny:
        def tokens(self, split):
            return np.arange(20, dtype=np.uint16)
    xq, yq = prism.val_queries(Tiny(), 10 ** 12, 5, "cpu")
    assert xq[:, 0].tolist() == list(range(15)) and yq.tolist() == list(range(5, 20))
    xq, _ = prism.val_queries(Tiny(), 4, 5, "cpu")
    assert xq[:, 0].tolist() == [0, 4, 9, 14]  # as before: evenly spread, floor of linspace(0, 14, 4)


def test_fisher_draws_that_cannot_fit_stop_before_they_are_drawn(monkeypatch):
    """--attr-fisher-samples 1e9 asked for hundreds of GB once training was over, and the out-of-memory line named
    --batch-size: each fisher build checks its floor first (one pass's uniforms, draws and δ̃; the exact
    reference's kept targets beside the larger of that and its float64 Gram) and names the flag."""
    import common

    model = tiny()
    M, T, S = 6, 8, 10 ** 9
    d = model.P.shape[1]
    w = windows_of(M, T, seed=7)
    monkeypatch.setattr(common, "available_memory", lambda device: 2 ** 30)
    per_pass = S * M * T * (12 + 4 * d)
    gib = lambda b: f"{b / 2 ** 30:,.0f} GiB"  # noqa: E731
    with pytest.raises(prism.RunError, match=rf"^this run needs at least {gib(per_pass)} of memory \(one pass's "
                                             r"draws and their δ̃ .*; lower --attr-fisher-samples or --attr-seqs,"):
        prism.build_attr_cache(model, w, "block", 1e-2, "fisher", samples=S, seed=3)
    need = 4 * M * S * T + 8 * (M * S) ** 2  # the Gram outgrows one pass
    with pytest.raises(prism.RunError, match=rf"^this run needs at least {gib(need)} of memory \(the drawn targets "
                                             r".*, the sampled gradients' Gram \(float64\) "):
        prism.build_exact(model, w, 1e-2, "fisher", S, seed=3)
    assert prism.fisher_draws_problem(M, T, d, 2, "cpu", exact=True) is None  # 1 GiB holds the test's own sizes
    assert prism.fisher_draws_problem(M, T, d, 10 ** 9, "cpu", exact=False) is not None
    monkeypatch.setattr(common, "available_memory", lambda device: None)  # unknown: no refusal
    assert prism.fisher_draws_problem(M, T, d, 10 ** 9, "cpu", exact=True) is None
