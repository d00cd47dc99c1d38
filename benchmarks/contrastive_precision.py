"""Gradient error of the tiled contrastive losses against float64 truth, beside dense float32.

For float32 unit-norm embeddings, each loss's gradient with respect to both towers and
`scale` (and `bias` for SigLIP) is computed three ways: the truth in numpy float64 (with
each softmax row's `p - onehot` at the positive taken as minus the sum of the other
probabilities, so that the truth is exact where the loss is near 0); the dense float32
loss (`jax.nn.log_softmax` / `jax.nn.log_sigmoid` on the N x N logits, plain autodiff);
and `gradaccum_jax.losses`. The error of a gradient is `|g - truth| / |truth|` (2-norms),
the worst over the arguments. Batches: "random" (unrelated rows), "aligned" (each
positive is its row plus noise of the same size) and "easy" (positives within 1e-3 of
their rows, a loss near 0), at N x D; and issue 40's low-loss batch (`LOW_LOSS`: 32
pairs of 16 features, positives within 1e-3), whose true gradient at scale 100 is about
1e-18, below float64's spacing near 1. SigLIP's bias is `-scale / 2`, halfway between
the positives' and the negatives' logits, where both sides' gradients are small.

Each row also keeps what the docs say of the cells whose error is about 1: the truth's
norm, its largest term (`|d loss / d s_ij|`), whether each loss returned exactly 0, and
for the softmax losses the error of a float64 reference that forms the positive's
`p - 1` by subtraction, as float64 autodiff of the dense loss does.

Target (issue 35): the tiled error within 10x the dense float32 one (floor 1e-6) in
every cell. Used by `benchmarks/run.py` and `tests/test_losses.py`.

    python benchmarks/contrastive_precision.py [--quick]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradaccum_jax import losses

SCALES = (1.0, 10.0, 30.0, 100.0, 1e3, 1e4)
KINDS = {"random": None, "aligned": 1.0, "easy": 1e-3}
NAMES = ("clip_loss", "info_nce", "siglip_loss")
# Issue 40's low-loss batch: (label, kind, N, D, seed). The seed draws rows whose nearest
# negatives are far enough that at scale 100 the true gradient is about 1e-18, the
# regime where a reference that forms p - 1 in float64 loses it.
LOW_LOSS = ("low loss, N = 32, D = 16", "easy", 32, 16, 3)
# The table's N x D and block size.
SIZE = {"default": (512, 256, 128), "quick": (128, 256, 32)}


def batch(name: str, n: int, d: int, kind: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Float32 unit rows `(a, b)`; `info_nce` gets `n // 4` extra keys."""
    rng = np.random.default_rng(seed)
    m = n + n // 4 if name == "info_nce" else n
    a, b = rng.standard_normal((n, d)), rng.standard_normal((m, d))
    if KINDS[kind] is not None:
        b[:n] = a + KINDS[kind] * rng.standard_normal((n, d))
    a /= np.linalg.norm(a, axis=1, keepdims=True)
    b /= np.linalg.norm(b, axis=1, keepdims=True)
    return a.astype(np.float32), b.astype(np.float32)


def _softmax_minus_target(s: np.ndarray, *, subtract: bool = False) -> np.ndarray:
    """Row softmax minus the one-hot of column i, the positive's entry summed from the rest.

    `subtract=True` forms the positive's `p - 1` by subtraction instead, as float64
    autodiff of the dense loss does: 0 where the others' sum is below float64's spacing.
    """
    rows = np.arange(s.shape[0])
    e = np.exp(s - s.max(1, keepdims=True))
    g = e / e.sum(1, keepdims=True)
    if subtract:
        g[rows, rows] -= 1.0
        return g
    g[rows, rows] = 0.0
    g[rows, rows] = -g.sum(1)
    return g


def _logit_grads(name: str, s: np.ndarray, bias: float, subtract: bool) -> np.ndarray:
    """`d loss / d s` for the logits `s`, in float64."""
    n = s.shape[0]
    if name == "clip_loss":
        rows, cols = (_softmax_minus_target(x, subtract=subtract) for x in (s, s.T))
        return (rows + cols.T) / (2 * n)
    if name == "info_nce":
        return _softmax_minus_target(s, subtract=subtract) / n
    z = np.where(np.eye(*s.shape, dtype=bool), 1.0, -1.0)
    # d softplus(-z x) / dx = -z sigmoid(-z x) = -z / (1 + exp(z x))
    with np.errstate(over="ignore"):
        return -z / (1.0 + np.exp(z * (s + bias))) / n


def float64_grads(
    name: str, a: Any, b: Any, scale: float, bias: float, *, subtract: bool = False
) -> list[np.ndarray]:
    """The gradients with respect to `(a, b, scale[, bias])` in float64.

    `subtract=True`: a softmax positive's `p - 1` formed by subtraction (see
    `_softmax_minus_target`), for comparison; the truth is the default.
    """
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    raw = a @ b.T
    ds = _logit_grads(name, scale * raw, bias, subtract)
    grads = [scale * ds @ b, scale * ds.T @ a, np.array((ds * raw).sum())]
    return [*grads, np.array(ds.sum())] if name == "siglip_loss" else grads


def _dense(name: str) -> Callable[..., Any]:
    def loss(a, b, scale, bias):
        s = scale * jnp.dot(a, b.T, precision=jax.lax.Precision.HIGHEST)
        if name == "siglip_loss":
            z = jnp.where(jnp.eye(*s.shape, dtype=bool), 1.0, -1.0)
            return -jax.nn.log_sigmoid(z * (s + bias)).sum() / s.shape[0]
        rows = -jnp.diag(jax.nn.log_softmax(s, axis=1)).mean()
        if name == "info_nce":
            return rows
        return 0.5 * (rows - jnp.diag(jax.nn.log_softmax(s, axis=0)).mean())

    return loss


def _tiled(name: str, block_size: int) -> Callable[..., Any]:
    def loss(a, b, scale, bias):
        if name == "siglip_loss":
            return losses.siglip_loss(a, b, scale, bias, block_size=block_size)
        return getattr(losses, name)(a, b, scale, block_size=block_size)

    return loss


def grad_fns(name: str, block_size: int) -> dict[str, Callable[..., Any]]:
    """Jitted gradients of the dense and the tiled loss: `(a, b, scale, bias) -> grads`."""
    argnums = (0, 1, 2, 3) if name == "siglip_loss" else (0, 1, 2)
    return {
        kind: jax.jit(jax.grad(make(name), argnums))
        for kind, make in (("dense", _dense), ("tiled", lambda n: _tiled(n, block_size)))
    }


def _l2(x: Any) -> float:
    """The 2-norm in float64, scaled first: a plain norm of entries below 1e-154 squares
    them to 0."""
    x = np.asarray(x, np.float64)
    top = float(np.abs(x).max(initial=0.0))
    return top * float(np.linalg.norm(x / top)) if top > 0 else 0.0


def rel_error(got: Any, want: list[np.ndarray]) -> float:
    """The worst over arguments of `|got - want| / |want|`: 0 where both are 0, inf where
    only `want` is."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        err = _l2(np.asarray(g, np.float64) - w)
        if err:
            size = _l2(w)
            worst = max(worst, err / size if size else np.inf)
    return worst


def _norm(grads: Any) -> float:
    """The largest 2-norm over the arguments."""
    return max(_l2(g) for g in grads)


def _cell(name: str, fns: dict[str, Callable[..., Any]], a, b, scale: float) -> dict:
    bias = -scale / 2 if name == "siglip_loss" else 0.0
    truth = float64_grads(name, a, b, scale, bias)
    args = (a, b, jnp.float32(scale), jnp.float32(bias))
    got = {k: f(*args) for k, f in fns.items()}
    err = {k: rel_error(g, truth) for k, g in got.items()}
    raw = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T
    row: dict[str, Any] = {
        "scale": scale,
        "err_dense": float(f"{err['dense']:.2g}"),
        "err_tiled": float(f"{err['tiled']:.2g}"),
        "within_10x_dense": err["tiled"] <= max(10 * err["dense"], 1e-6),
        "truth_norm": float(f"{_norm(truth):.2g}"),
        "max_term": float(f"{np.abs(_logit_grads(name, scale * raw, bias, False)).max():.2g}"),
        "zero_dense": _norm(got["dense"]) == 0.0,
        "zero_tiled": _norm(got["tiled"]) == 0.0,
    }
    if name != "siglip_loss":
        subtracted = float64_grads(name, a, b, scale, bias, subtract=True)
        row["err_float64_p_minus_1"] = float(f"{rel_error(subtracted, truth):.2g}")
    return row


def table(
    n: int,
    d: int,
    block_size: int,
    scales: tuple[float, ...] = SCALES,
    names: tuple[str, ...] = NAMES,
) -> list[dict]:
    """One row per (loss, batch, scale): the dense and tiled errors and whether the tiled
    one is within 10x the dense one (floor 1e-6). The batches: each of `KINDS` at `n` x
    `d`, and `LOW_LOSS` at its own size."""
    batches = [(kind, kind, n, d, 0) for kind in KINDS] + [LOW_LOSS]
    rows = []
    for name in names:
        fns = grad_fns(name, block_size)
        for label, kind, rows_n, features, seed in batches:
            a, b = batch(name, rows_n, features, kind, seed)
            for scale in scales:
                cell = _cell(name, fns, a, b, scale)
                rows.append({"loss": name, "batch": label, "n": rows_n, "d": features, **cell})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    # Here, not at the top: the tests import this module as `benchmarks.contrastive_precision`,
    # where `harness` (a sibling run as a script's neighbour) is not importable by that name.
    import harness

    parser = harness.benchmark_parser(__doc__, quick="smaller N, a smoke test")
    args = parser.parse_args(argv)

    n, d, block = SIZE["quick" if args.quick else "default"]
    rows = table(n, d, block)
    harness.print_rows(
        f"gradient error against float64 truth: dense float32 vs tiled (float32 inputs, "
        f"N = {n}, D = {d}, block {block}; the low-loss batch at its own size)",
        rows,
    )
    return rows


if __name__ == "__main__":
    main()
