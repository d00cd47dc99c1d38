"""Cost of exact norms on ordinary inputs: the clipping family and AGC against plain norms.

The clipping family measures norms that neither overflow nor underflow (a
float32 `[3e19, 4e19]` is clipped, not zeroed). On ordinary gradients the
direct result is kept and the scaled recomputation never runs; this benchmark
checks that the guard costs (almost) nothing. Each candidate is compared with
the plain computation it replaces, on a ~30M-parameter float32 tree, timed
interleaved (median of repetitions, all under `jit`, inputs donated nowhere):

- `clip_norm` (global) against `optax.clip_by_global_norm`;
- `clip_grad_norm(dim=None)` against a per-leaf `x * min(1, c / sqrt(sum(x**2)))`;
- `normalize_grads` against a plain global `x * (t / sqrt(sum(x**2)))`;
- `adaptive_grad_clip` against `optax.adaptive_grad_clip` (same units);
- the global norm alone against `optax.global_norm`.

    python benchmarks/clipping.py [--quick]
"""

from __future__ import annotations

import functools

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax as ga


def make_tree(total: int, seed: int = 0) -> dict:
    """Dense and conv kernels with biases: about `total` float32 parameters."""
    rng = np.random.default_rng(seed)
    width = max(int((total / 12) ** 0.5), 4)
    shapes = {
        "dense_0": {"kernel": (width, 4 * width), "bias": (4 * width,)},
        "dense_1": {"kernel": (4 * width, width), "bias": (width,)},
        "conv": {"kernel": (3, 3, width // 4, width), "bias": (width,)},
        "head": {"kernel": (width, 3 * width), "bias": (3 * width,)},
    }
    return jax.tree.map(
        lambda s: jnp.asarray(rng.normal(size=s) * 1e-2, jnp.float32),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def _plain_per_leaf_clip(tree, c):
    def leaf(x):
        norm = jnp.sqrt(jnp.sum(jnp.square(x)))
        return x * jnp.where(norm > c, c / jnp.where(norm > 0, norm, 1), 1)

    return jax.tree.map(leaf, tree)


def _plain_normalize(tree, t):
    norm = optax.global_norm(tree)
    return jax.tree.map(lambda x: x * (t / norm), tree)


def _stateless(tx):
    return lambda g, p: tx.update(g, tx.init(p), p)[0]


def candidates() -> list[tuple[str, object, object]]:
    """(name, new, plain): functions of (grads, params) returning a tree or a scalar."""
    return [
        (
            "clip_norm (global)",
            _stateless(ga.clip_norm(1.0)),
            _stateless(optax.clip_by_global_norm(1.0)),
        ),
        (
            "clip_grad_norm (per leaf)",
            lambda g, p: ga.clip_grad_norm(g, 1.0, dim=None)[0],
            lambda g, p: _plain_per_leaf_clip(g, 1.0),
        ),
        (
            "normalize_grads (global)",
            lambda g, p: ga.normalize_grads(g, 1.0),
            lambda g, p: _plain_normalize(g, 1.0),
        ),
        (
            "global norm",
            lambda g, p: ga.clip_grad_norm(g, None)[1],
            lambda g, p: optax.global_norm(g),
        ),
        (
            "adaptive_grad_clip",
            _stateless(ga.adaptive_grad_clip(0.01)),
            _stateless(optax.adaptive_grad_clip(0.01)),
        ),
    ]


def time_pair(new, plain, grads, params, reps: int) -> tuple[float, float]:
    fns = {"new": jax.jit(new), "plain": jax.jit(plain)}
    seconds = harness.interleaved_medians(
        {name: functools.partial(fn, grads, params) for name, fn in fns.items()}, reps
    )
    return seconds["new"], seconds["plain"]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__)
    args = parser.parse_args(argv)
    total = 100_000 if args.quick else 30_000_000
    reps = 3 if args.quick else 21
    params = make_tree(total, seed=0)
    grads = make_tree(total, seed=1)
    size = sum(x.size for x in jax.tree.leaves(params))
    print(f"clipping: {size / 1e6:.1f}M float32 parameters, {jax.devices()[0].platform}")
    print(f"{'transform':<28} {'new ms':>9} {'plain ms':>9} {'new / plain':>12}")
    rows = []
    for name, new, plain in candidates():
        t_new, t_plain = time_pair(new, plain, grads, params, reps)
        ratio = t_new / t_plain
        print(f"{name:<28} {1e3 * t_new:9.2f} {1e3 * t_plain:9.2f} {ratio:12.3f}")
        rows.append(
            {
                "benchmark": "clipping",
                "transform": name,
                "params": size,
                "ms_new": 1e3 * t_new,
                "ms_plain": 1e3 * t_plain,
                "new_vs_plain": ratio,
            }
        )
    return rows


if __name__ == "__main__":
    main()
