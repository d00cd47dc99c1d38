"""Cost of differential privacy: per-example clipped sums against jax_privacy and a plain step.

On an MLP (digits-sized input, float32), one batch of `B` examples cut into
chunks of `m`, all under `jit`, timed interleaved (median of repetitions):

- `privacy.clipped_grad(loss, C, microbatch_size=m)` against
  `jax_privacy.clipping.clipped_grad(loss, l2_clip_norm=C, microbatch_size=m)`:
  the same sum of per-example clipped gradients (target: at most 1.1x);
- the same two with the last half of the batch marked as padding (a Poisson
  batch padded to a fixed shape): contiguous chunks let whole chunks be skipped;
- a DP training step (the clipped sum, Gaussian noise once, divided by `B`, the
  optimizer) against a non-private step (`jax.value_and_grad` of the mean loss
  and the optimizer) on the same batch. The DP step goes through
  `privacy.dp_accumulate` with one micro-step per window where this checkout has
  it, else through the same pieces written out (the row says which).

The machine is shared and noisy: read the ratios, measured side by side.

    python benchmarks/privacy.py [--quick]
"""

from __future__ import annotations

import itertools

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradaccum_jax import privacy

C, SIGMA = 1.0, 1.1


def make_params(widths: tuple[int, ...], seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            "w": jnp.asarray(rng.normal(size=(a, b)) / np.sqrt(a), jnp.float32),
            "b": jnp.zeros(b, jnp.float32),
        }
        for a, b in itertools.pairwise(widths)
    ]


def loss(params: list[dict], batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    logits = x @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _dp_step_fn(tx_inner, batch_size: int, microbatch_size: int):
    """The DP step: dp_accumulate (K = 1) where it exists, else its pieces written out."""
    clipped = privacy.clipped_grad(loss, C, microbatch_size=microbatch_size)
    dp_accumulate = getattr(privacy, "dp_accumulate", None)
    if dp_accumulate is not None:
        tx = dp_accumulate(
            tx_inner,
            1,
            l2_clip_norm=C,
            noise_multiplier=SIGMA,
            expected_batch_size=batch_size,
            key=jax.random.key(0),
        )

        def step(params, state, batch, key):
            del key  # the window's key lives in its state
            _, grad_sum = clipped(params, batch)
            updates, state = tx.update(grad_sum, state, params)
            return optax.apply_updates(params, updates), state

        return "privacy.dp_accumulate(K=1)", tx, step

    def step(params, state, batch, key):
        _, grad_sum = clipped(params, batch)
        leaves, treedef = jax.tree.flatten(grad_sum)
        keys = jax.random.split(key, len(leaves))
        noisy = [
            (g + SIGMA * C * jax.random.normal(k, g.shape, g.dtype)) / batch_size
            for g, k in zip(leaves, keys, strict=True)
        ]
        updates, state = tx_inner.update(jax.tree.unflatten(treedef, noisy), state, params)
        return optax.apply_updates(params, updates), state

    return "clipped_grad + noise + /B (written out)", tx_inner, step


def measure(widths: tuple[int, ...], batch: int, micro: int, reps: int) -> list[dict]:
    from jax_privacy import clipping

    params = make_params(widths)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(batch, widths[0])), jnp.float32)
    y = jnp.asarray(rng.integers(0, widths[-1], size=batch), jnp.int32)
    data = (x, y)
    half = np.arange(batch) >= batch // 2
    ours = jax.jit(privacy.clipped_grad(loss, C, microbatch_size=micro))
    theirs = jax.jit(clipping.clipped_grad(loss, l2_clip_norm=C, microbatch_size=micro))
    tx_inner = optax.sgd(0.1)
    dp_name, tx, dp_step = _dp_step_fn(tx_inner, batch, micro)
    dp_step = jax.jit(dp_step)

    @jax.jit
    def plain_step(params, state, batch):
        _, grads = jax.value_and_grad(loss)(params, batch)
        updates, state = tx_inner.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    dp_state, plain_state = tx.init(params), tx_inner.init(params)
    key = jax.random.key(2)
    fns = {
        "ours": lambda: ours(params, data),
        "jax_privacy": lambda: theirs(params, data),
        "ours, half padding": lambda: ours(params, data, is_padding_example=half),
        "jax_privacy, half padding": lambda: theirs(params, data, is_padding_example=half),
        "dp step": lambda: dp_step(params, dp_state, data, key),
        "plain step": lambda: plain_step(params, plain_state, data),
    }
    times = harness.interleaved_medians(fns, reps, warmup=2)
    size = sum(leaf.size for leaf in jax.tree.leaves(params))
    common = {"benchmark": "privacy", "params": size, "batch": batch, "microbatch_size": micro}
    return [
        {
            **common,
            "measure": "clipped_sum",
            "candidate": "clipped sum: gradaccum_jax / jax_privacy",
            "ms": 1e3 * times["ours"],
            "ms_reference": 1e3 * times["jax_privacy"],
            "ratio": times["ours"] / times["jax_privacy"],
        },
        {
            **common,
            "measure": "clipped_sum_half_padding",
            "candidate": "clipped sum, half padding: gradaccum_jax / jax_privacy",
            "ms": 1e3 * times["ours, half padding"],
            "ms_reference": 1e3 * times["jax_privacy, half padding"],
            "ratio": times["ours, half padding"] / times["jax_privacy, half padding"],
        },
        {
            **common,
            "measure": "dp_step",
            "candidate": f"DP step ({dp_name}) / non-private step",
            "ms": 1e3 * times["dp step"],
            "ms_reference": 1e3 * times["plain step"],
            "ratio": times["dp step"] / times["plain step"],
        },
    ]


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__)
    args = parser.parse_args(argv)
    if args.quick:
        widths, batch, micro, reps = (64, 32, 10), 32, 8, 3
    else:
        widths, batch, micro, reps = (64, 256, 256, 10), 256, 32, 21
    rows = measure(widths, batch, micro, reps)
    print(
        f"privacy: MLP {widths} ({rows[0]['params'] / 1e3:.0f}k float32 parameters), "
        f"batch {batch}, chunks of {micro}, C={C}, sigma={SIGMA}, jax {jax.__version__}"
    )
    print("(shared, noisy machine: the ratios are measured side by side, interleaved)")
    print(f"{'candidate':<62} {'ms':>8} {'ref ms':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['candidate']:<62} {r['ms']:8.2f} {r['ms_reference']:8.2f} {r['ratio']:6.2f}")
    return rows


if __name__ == "__main__":
    main()
