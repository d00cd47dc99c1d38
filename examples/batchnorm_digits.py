"""A batch-normalised convnet trained with gradient accumulation on scikit-learn's digits.

Every run takes Adam steps on batches of 32 images. The large-batch run uses
``nn.BatchNorm`` on whole batches. The accumulated runs are data-parallel in
spirit: each batch is split into K micro-batches of 8·b images, as 8 replicas
with b = 1 or 2 images each would see them (K = 4 or 2), and the layers are
``gradaccum_jax.flax.AccumBatchNorm``, whose statistics with ``axis_name`` are
pooled over replicas. The replicas are simulated on one device: the pooled
statistics of 8 replicas are those of their concatenated micro-batch (tested
with ``shard_map`` on 8 devices in tests/test_batchnorm.py).

Two sets of running statistics are kept for the same accumulated run, so the
parameters are identical and only inference differs:

* ``AccumBatchNorm``: count, sum and sum of squares pooled over replicas and
  micro-batches, then one EMA step per optimizer step. The script checks that
  the statistics of a window equal ``nn.BatchNorm``'s on its concatenation.
* the seed's averaging (the TensorFlow ``AccumBatchNormalization`` this project
  started from), written out here for comparison only: each replica averages
  the means and variances of its own b images over the K micro-steps, and the
  replicas' running statistics are averaged. The variance of the micro-batch
  means is lost: at b = 1 the variance of the dense layers is 0, at b = 2 about
  half, and inference blows up.

    python examples/batchnorm_digits.py [--epochs 20] [--seed 0] [--quick]
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import gradaccum_jax as ga

BATCH = 32
REPLICAS = 8
MOMENTUM = 0.9
# The layer whose output each norm layer normalises.
NORM_INPUTS = {"conv0": "norm0", "conv1": "norm1", "dense0": "norm2", "dense1": "norm3"}


class ConvNet(nn.Module):
    norm: Callable[..., nn.Module]

    @nn.compact
    def __call__(self, x, train: bool):
        def norm(x, name):
            return self.norm(use_running_average=not train, momentum=MOMENTUM, name=name)(x)

        for i, (features, stride) in enumerate(((16, 1), (32, 2))):
            x = nn.Conv(features, (3, 3), strides=stride, use_bias=False, name=f"conv{i}")(x)
            x = nn.relu(norm(x, f"norm{i}"))
        x = x.mean(axis=(1, 2))
        for i in range(2):
            x = nn.Dense(64, use_bias=False, name=f"dense{i}")(x)
            x = nn.relu(norm(x, f"norm{i + 2}"))
        return nn.Dense(10, name="head")(x)


def load_data(seed: int = 0):
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def seed_average(seed_stats, layer_inputs, per_replica: int, k: int, closes):
    """The seed's pooling, per replica: mean over micro-steps of micro-batch moments."""
    new = {}
    for layer, norm in NORM_INPUTS.items():
        h = layer_inputs[layer]["__call__"][0]
        h = h.reshape(REPLICAS, per_replica, -1, h.shape[-1])  # replica, image, position, feature
        # Each replica's moments over its own images; replicas are then averaged.
        mean, var = h.mean((1, 2)).mean(0), h.var((1, 2)).mean(0)
        s = seed_stats[norm]
        acc_mean, acc_var = s["acc_mean"] + mean / k, s["acc_var"] + var / k
        new[norm] = {
            "mean": jnp.where(closes, MOMENTUM * s["mean"] + (1 - MOMENTUM) * acc_mean, s["mean"]),
            "var": jnp.where(closes, MOMENTUM * s["var"] + (1 - MOMENTUM) * acc_var, s["var"]),
            "acc_mean": jnp.where(closes, 0.0, acc_mean),
            "acc_var": jnp.where(closes, 0.0, acc_var),
        }
    return new


def train(per_replica: int | None, train_set, epochs: int, seed: int = 0):
    """Trains one model; ``per_replica=None`` is the large-batch run."""
    accumulated = per_replica is not None
    micro_batch = REPLICAS * per_replica if accumulated else BATCH
    k = BATCH // micro_batch
    model = ConvNet(ga.flax.AccumBatchNorm if accumulated else nn.BatchNorm)
    x_train, y_train = train_set
    # Under jit: one program instead of one per layer's initialiser, run eagerly.
    init = jax.jit(functools.partial(model.init, train=True))
    variables = init(jax.random.key(seed), x_train[:micro_batch])
    tx = ga.accumulate(optax.adam(3e-3), k) if accumulated else optax.adam(3e-3)

    def loss_fn(params, stats, x, y):
        logits, new = model.apply(
            {"params": params, "batch_stats": stats},
            x,
            train=True,
            mutable=["batch_stats", "intermediates"],
            capture_intermediates=lambda module, _: module.name in NORM_INPUTS,
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), new

    @jax.jit
    def window_step(params, stats, seed_stats, opt_state, xs, ys):
        def micro_step(carry, batch):
            params, stats, seed_stats, opt_state = carry
            grads, new = jax.grad(loss_fn, has_aux=True)(params, stats, *batch)
            stats = new["batch_stats"]
            if accumulated:
                closes = ga.closes_window(opt_state)
                stats = ga.flax.commit_batch_stats(stats, closes)
                inputs = jax.lax.stop_gradient(new["intermediates"])
                seed_stats = seed_average(seed_stats, inputs, per_replica, k, closes)
            updates, opt_state = tx.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), stats, seed_stats, opt_state), None

        carry, _ = jax.lax.scan(micro_step, (params, stats, seed_stats, opt_state), (xs, ys))
        return carry

    params, stats = variables["params"], variables["batch_stats"]
    zeros = {n: jnp.zeros_like(s["mean"]) for n, s in stats.items()}
    seed_stats = {
        n: {"mean": z, "var": jnp.ones_like(z), "acc_mean": z, "acc_var": z}
        for n, z in zeros.items()
    }
    opt_state = tx.init(params)
    rng = np.random.default_rng(seed)
    windows = len(x_train) // BATCH
    for _ in range(epochs):
        order = rng.permutation(len(x_train))[: windows * BATCH]
        xs = x_train[order].reshape(windows, k, micro_batch, *x_train.shape[1:])
        ys = y_train[order].reshape(windows, k, micro_batch)
        for w in range(windows):
            params, stats, seed_stats, opt_state = window_step(
                params, stats, seed_stats, opt_state, xs[w], ys[w]
            )
    return model, params, stats, seed_stats, (xs[-1], ys[-1])


def evaluate(model, variables, test_set) -> tuple[float, float]:
    """Test accuracy and cross-entropy with the running statistics (inference)."""
    x, y = test_set
    logits = jax.jit(lambda v, x: model.apply(v, x, train=False))(variables, x)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
    return float(np.mean(np.argmax(logits, -1) == y)), float(loss)


def window_check(model, params, stats, window) -> float:
    """Largest relative difference between AccumBatchNorm's statistics after one more
    window and nn.BatchNorm's on the concatenation of the inputs each layer saw.

    Means are compared relative to the standard deviation, variances relative to
    themselves.
    """
    xs, _ = window

    @jax.jit  # one program: the window's micro-steps, the commit and the reference
    def worst_error(stats, xs):
        new_stats, inputs = stats, {layer: [] for layer in NORM_INPUTS}
        for x in xs:
            _, new = model.apply(
                {"params": params, "batch_stats": new_stats},
                x,
                train=True,
                mutable=["batch_stats", "intermediates"],
                capture_intermediates=lambda module, _: module.name in NORM_INPUTS,
            )
            new_stats = new["batch_stats"]
            for layer in NORM_INPUTS:
                inputs[layer].append(new["intermediates"][layer]["__call__"][0])
        new_stats = ga.flax.commit_batch_stats(new_stats)
        errors = []
        for layer, norm in NORM_INPUTS.items():
            start = {"mean": stats[norm]["mean"], "var": stats[norm]["var"]}
            _, ref = nn.BatchNorm(momentum=MOMENTUM).apply(
                {"params": params[norm], "batch_stats": start},
                jnp.concatenate(inputs[layer]),
                use_running_average=False,
                mutable=["batch_stats"],
            )
            got, want = new_stats[norm], ref["batch_stats"]
            # Means relative to the standard deviation (they can be near zero).
            errors.append(jnp.max(jnp.abs(got["mean"] - want["mean"]) / jnp.sqrt(want["var"])))
            errors.append(jnp.max(jnp.abs(got["var"] - want["var"]) / want["var"]))
        return jnp.max(jnp.stack(errors))

    return float(worst_error(stats, xs))


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="initialisation and data order")
    parser.add_argument("--quick", action="store_true", help="1 epoch, a smoke test")
    args = parser.parse_args(argv)
    epochs = 1 if args.quick else args.epochs
    train_set, test_set = load_data()

    model, params, stats, _, _ = train(None, train_set, epochs, args.seed)
    accuracy, loss = evaluate(model, {"params": params, "batch_stats": stats}, test_set)
    rows = [
        {"run": "large batch, nn.BatchNorm", "per_replica": None, "k": 1}
        | {"accuracy": accuracy, "test_loss": loss}
    ]
    for per_replica in (1, 2):
        model, params, stats, seed_stats, window = train(per_replica, train_set, epochs, args.seed)
        exact_error = window_check(model, params, stats, window)
        seed_vars = {
            norm: {**stats[norm], "mean": seed_stats[norm]["mean"], "var": seed_stats[norm]["var"]}
            for norm in stats
        }
        # Median over features of the seed's running variance / the exact one.
        ratios = {
            norm: float(np.median(seed_stats[norm]["var"] / stats[norm]["var"])) for norm in stats
        }
        for run, batch_stats in (("AccumBatchNorm", stats), ("seed's averaging", seed_vars)):
            accuracy, loss = evaluate(
                model, {"params": params, "batch_stats": batch_stats}, test_set
            )
            rows.append(
                {"run": run, "per_replica": per_replica, "k": BATCH // (REPLICAS * per_replica)}
                | {"accuracy": accuracy, "test_loss": loss}
                | {"window_error": exact_error, "seed_var_ratio": ratios}
            )

    print(f"digits, {epochs} epochs, Adam on batches of {BATCH}; inference on 397 test images")
    print(f"{'run':<26} {'per replica':>11} {'K':>3} {'accuracy':>9} {'test loss':>10}")
    for row in rows:
        per = "-" if row["per_replica"] is None else str(row["per_replica"])
        print(
            f"{row['run']:<26} {per:>11} {row['k']:>3} {row['accuracy']:>9.3f} "
            f"{row['test_loss']:>10.3g}"
        )
    for row in rows[1::2]:
        ratios = ", ".join(f"{n} {r:.2f}" for n, r in row["seed_var_ratio"].items())
        print(
            f"b={row['per_replica']}: AccumBatchNorm window vs nn.BatchNorm on the concatenation, "
            f"max relative difference {row['window_error']:.1e}; seed's variance / exact "
            f"(median): {ratios}"
        )
    return rows


if __name__ == "__main__":
    main()
