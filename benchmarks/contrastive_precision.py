"""Gradient error of the tiled contrastive losses against float64 truth, beside dense float32.

For float32 unit-norm embeddings, each loss's gradient with respect to both towers and
`scale` (and `bias` for SigLIP) is computed three ways: the truth in numpy float64 (with
each softmax row's `p - onehot` at the positive taken as minus the sum of the other
probabilities, so that the truth is exact where the loss is near 0); the dense float32
loss (`jax.nn.log_softmax` / `jax.nn.log_sigmoid` on the N x N logits, plain autodiff);
and `gradaccum_jax.losses`. The error of a gradient is `|g - truth| / |truth|` (2-norms),
the worst over the arguments. Batches: "random" (unrelated rows), "aligned" (each
positive is its row plus noise of the same size) and "easy" (positives within 1e-3 of
their rows, a loss near 0). SigLIP's bias is `-scale / 2`, halfway between the
positives' and the negatives' logits, where both sides' gradients are small.

Used by `benchmarks/contrastive_losses.py` (the table) and `tests/test_losses.py`.
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


def _softmax_minus_target(s: np.ndarray) -> np.ndarray:
    """Row softmax minus the one-hot of column i, the positive's entry summed from the rest."""
    rows = np.arange(s.shape[0])
    e = np.exp(s - s.max(1, keepdims=True))
    g = e / e.sum(1, keepdims=True)
    g[rows, rows] = 0.0
    g[rows, rows] = -g.sum(1)
    return g


def float64_grads(name: str, a: Any, b: Any, scale: float, bias: float) -> list[np.ndarray]:
    """The gradients with respect to `(a, b, scale[, bias])` in float64."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    n = a.shape[0]
    raw = a @ b.T
    s = scale * raw
    if name == "clip_loss":
        ds = (_softmax_minus_target(s) + _softmax_minus_target(s.T).T) / (2 * n)
    elif name == "info_nce":
        ds = _softmax_minus_target(s) / n
    else:
        z = np.where(np.eye(*s.shape, dtype=bool), 1.0, -1.0)
        # d softplus(-z x) / dx = -z sigmoid(-z x) = -z / (1 + exp(z x))
        with np.errstate(over="ignore"):
            ds = -z / (1.0 + np.exp(z * (s + bias))) / n
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


def rel_error(got: Any, want: list[np.ndarray]) -> float:
    """The worst over arguments of `|got - want| / |want|` (0 where both are 0)."""
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        err = float(np.linalg.norm(np.asarray(g, np.float64) - w))
        if err:
            worst = max(worst, err / max(float(np.linalg.norm(w)), 1e-300))
    return worst


def table(
    n: int,
    d: int,
    block_size: int,
    scales: tuple[float, ...] = SCALES,
    names: tuple[str, ...] = NAMES,
) -> list[dict]:
    """One row per (loss, batch, scale): the dense and tiled errors and whether the tiled
    one is within 10x the dense one (floor 1e-6)."""
    rows = []
    for name in names:
        fns = grad_fns(name, block_size)
        for kind in KINDS:
            a, b = batch(name, n, d, kind)
            for scale in scales:
                bias = -scale / 2 if name == "siglip_loss" else 0.0
                truth = float64_grads(name, a, b, scale, bias)
                args = (a, b, jnp.float32(scale), jnp.float32(bias))
                err = {k: rel_error(f(*args), truth) for k, f in fns.items()}
                rows.append(
                    {
                        "loss": name,
                        "batch": kind,
                        "scale": scale,
                        "err_dense": float(f"{err['dense']:.2g}"),
                        "err_tiled": float(f"{err['tiled']:.2g}"),
                        "within_10x_dense": err["tiled"] <= max(10 * err["dense"], 1e-6),
                    }
                )
    return rows
