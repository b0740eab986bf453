"""Brute-force references for the per-layer problem (scipy, float64)."""

from __future__ import annotations

import numpy as np
from scipy.optimize import minimize


def objective_parts(A, B):
    m, n = A.shape

    def f(x):
        a, b = x[:m], x[m:]
        s = a[:, None] + b[None, :]
        P, Q = A * np.exp(s), B * np.exp(-s)
        val = 0.5 * (P.sum() + Q.sum())
        D = 0.5 * (P - Q)
        grad = np.concatenate([D.sum(axis=1), D.sum(axis=0)])
        M = 0.5 * (P + Q)
        hess = np.block([[np.diag(M.sum(axis=1)), M], [M.T, np.diag(M.sum(axis=0))]])
        return val, grad, hess

    return f


def brute_force_ns(A, B) -> float:
    """Minimize the per-layer objective with scipy's trust-region Newton method.

    Only for problems whose minimum is attained (no degenerate rows/columns). The
    gauge direction (a + c, b - c) is fixed by a tiny quadratic penalty on
    ``mean(a) - mean(b)``, which does not change the minimum value.
    """
    A, B = np.asarray(A, float), np.asarray(B, float)
    m, n = A.shape
    f = objective_parts(A, B)
    scale = np.sqrt(A.sum() * B.sum())
    g = np.concatenate([np.ones(m) / m, -np.ones(n) / n])

    def fun(x):
        val, grad, hess = f(x)
        pen = g @ x
        return val / scale + pen**2, grad / scale + 2 * pen * g, hess / scale + 2 * np.outer(g, g)

    x0 = np.zeros(m + n)
    x0[:m] = 0.5 * np.log(B.sum(axis=1) / A.sum(axis=1))
    res = minimize(lambda x: fun(x)[0], x0, jac=lambda x: fun(x)[1], hess=lambda x: fun(x)[2],
                   method="trust-exact", options={"gtol": 1e-13, "maxiter": 2000})
    x = res.x
    for _ in range(20):  # Newton polish: scipy's own stopping rule is looser than 1e-9
        _, grad_p, hess_p = fun(x)
        if np.max(np.abs(grad_p)) < 1e-14:
            break
        x = x - np.linalg.solve(hess_p, grad_p)
    val, grad, _ = f(x)
    assert np.max(np.abs(grad)) / scale < 1e-9, res
    return float(val)


def kernel_sums(W, H):
    W, H = np.asarray(W, float), np.asarray(H, float)
    out, inp = W.shape[:2]
    A = np.maximum(H.reshape(out, inp, -1).sum(axis=2), 0.0)
    B = (W**2).reshape(out, inp, -1).sum(axis=2)
    return A, B


def recession_reference(A, B):
    """Infimum of a possibly unattained problem by an independent route.

    A linear program (scipy HiGHS) finds a direction ``d = (da, db)`` that sends the
    largest set of terms to 0 (``da_i + db_j <= -y`` for curvature terms,
    ``>= y`` for weight terms, ``0 <= y <= 1``, maximize ``Σ y``). The remaining
    terms have an attained minimum, found by BFGS. Returns ``(value, x, d)`` such
    that ``F(x + λ d) → value`` as ``λ → ∞`` (``d`` scaled so every vanishing
    term decays at least like ``e^{-λ}``).
    """
    from scipy.optimize import linprog

    A, B = np.asarray(A, float), np.asarray(B, float)
    m, n = A.shape
    terms = [(i, j, +1) for i, j in zip(*np.nonzero(A > 0))] + [(i, j, -1) for i, j in zip(*np.nonzero(B > 0))]
    T = len(terms)
    # variables: da (m), db (n), y (T); constraint sign*(da_i + db_j) + y_t <= 0
    rows = np.zeros((T, m + n + T))
    for t, (i, j, sign) in enumerate(terms):
        rows[t, i] = sign
        rows[t, m + j] = sign
        rows[t, m + n + t] = 1.0
    bounds = [(-1e3, 1e3)] * (m + n) + [(0.0, 1.0)] * T
    c = np.concatenate([np.zeros(m + n), -np.ones(T)])
    lp = linprog(c, A_ub=rows, b_ub=np.zeros(T), bounds=bounds, method="highs")
    assert lp.status == 0
    d = lp.x[: m + n]
    killed = lp.x[m + n :] > 1e-7
    A_rem, B_rem = A.copy(), B.copy()
    for t, (i, j, sign) in enumerate(terms):
        if killed[t]:
            (A_rem if sign > 0 else B_rem)[i, j] = 0.0

    def f(x):
        s = x[:m, None] + x[None, m:]
        P, Q = A_rem * np.exp(s), B_rem * np.exp(-s)
        D = 0.5 * (P - Q)
        return 0.5 * (P.sum() + Q.sum()), np.concatenate([D.sum(axis=1), D.sum(axis=0)])

    res = minimize(f, np.zeros(m + n), jac=True, method="BFGS", options={"gtol": 1e-12, "maxiter": 10_000})
    margin = lp.x[m + n :][killed].min() if killed.any() else 1.0
    return float(res.fun), res.x, d / margin


def full_objective(A, B, x):
    m = A.shape[0]
    s = x[:m, None] + x[None, m:]
    with np.errstate(over="ignore"):  # exp of zero-weight entries may overflow; they are masked
        P = np.where(A > 0, A * np.exp(np.where(A > 0, s, 0.0)), 0.0)
        Q = np.where(B > 0, B * np.exp(np.where(B > 0, -s, 0.0)), 0.0)
    return float(0.5 * (P.sum() + Q.sum()))


def log_domain_ns(log_A, log_B) -> float:
    """``log NS(A, B)`` from the logarithms of the entries (``-inf`` for zeros).

    An independent reference for entries of any magnitude, including ones no
    float64 holds (``log B = 2 log|W|`` of weights beyond 1e154): after
    eliminating the row variables the objective is ``F(b) = Σ_i sqrt((A e^b)_i
    (B e^{-b})_i)``, and ``log F`` is convex (a sum of log-convex terms), so scipy's
    BFGS minimizes it with every sum formed by ``logsumexp``. Only for problems
    whose minimum is attained (no degenerate rows or columns).
    """
    from scipy.special import logsumexp

    LA, LB = np.asarray(log_A, float), np.asarray(log_B, float)

    def f(y):
        ra = logsumexp(LA + y[None, :], axis=1)
        rb = logsumexp(LB - y[None, :], axis=1)
        r = 0.5 * (ra + rb)
        value = logsumexp(r)
        weight = np.exp(r - value)[:, None]
        pa, pb = np.exp(LA + y[None, :] - ra[:, None]), np.exp(LB - y[None, :] - rb[:, None])
        return value, 0.5 * (weight * (pa - pb)).sum(axis=0)

    # Start from the column-wise balance of the largest terms, so BFGS starts in range.
    y0 = 0.5 * (LB.max(axis=0) - LA.max(axis=0))
    res = minimize(f, y0, jac=True, method="BFGS", options={"gtol": 1e-13, "maxiter": 20_000})
    value, grad = f(res.x)
    assert np.max(np.abs(grad)) < 1e-9, res
    return float(value)
