"""The main job: a small convnet on scikit-learn's digits, accumulated and large-batch.

Every run sees the same images in the same order, from the same initial weights, with
`optax.chain(ga.adaptive_grad_clip(0.1), optax.adam(cosine schedule))`: accumulated runs
take 4 micro-batches of 32 per optimizer step through `ga.accumulate(that chain, 4)`,
large-batch runs one batch of 128 through the chain itself. It shows two facts:

1. Accumulation is the large batch. On a convnet without batch statistics the two runs'
   parameters agree to float32 round-off after every step, and the script prints the
   largest difference next to the bound it must stay under.
2. With BatchNorm, what accumulation can make exact is exact, and what it cannot is shown.
   `gradaccum_jax.flax.AccumBatchNorm` (committed once per window) records running
   statistics equal to `nn.BatchNorm` on the window's concatenated inputs; each window is
   checked against flax's own layer, and against the averaging of micro-batch statistics
   that the TensorFlow package this project started from uses. Training-time
   normalisation, however, uses the statistics of the 32 images a micro-batch holds, so
   at equal parameters the window's gradient differs from the large batch's (by tens of
   percent late in training, printed), by design; the parameters drift apart while the
   losses and accuracies agree.

The activation is GELU rather than ReLU so that the first comparison stays at round-off
over the whole run: at a kink a round-off difference in a pre-activation that sits at zero
becomes a different gradient, which training then amplifies (with ReLU, one step from the
same state still agrees to 2e-7, but over 330 steps the runs drift apart by 2e-2).

    python examples/digits_convnet.py [--epochs 30] [--plot digits_convnet.png] [--quick]
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from tqdm import tqdm

import gradaccum_jax as ga
from gradaccum_jax.flax import AccumBatchNorm, commit_batch_stats

# Float32 round-off bound for the largest parameter difference between accumulated and
# large-batch training without batch statistics: sums taken in another order differ by a
# few units in the last place (~1e-7 relative) per step, which Adam's normalised steps turn
# into parameter differences far below this. The tests use the same bound.
PARAM_BOUND = 1e-5
# Bound for the running statistics against nn.BatchNorm on the concatenated window: the
# window's sums are pooled in float32, exact up to rounding of sums of ~2,000 entries.
STATS_BOUND = 1e-5
NORM_LAYERS = ("bn0", "bn1")
MOMENTUM = 0.9


class ConvNet(nn.Module):
    """Two conv blocks (optionally batch-normalised), global average pooling, a linear head.

    GELU, not ReLU: smooth, so round-off is not amplified at kinks (see the module docstring).
    """

    norm: type[nn.Module] | None

    @nn.compact
    def __call__(self, x, train: bool):
        for i, (features, stride) in enumerate([(16, 1), (32, 2)]):
            x = nn.Conv(features, (3, 3), strides=stride, name=f"conv{i}")(x)
            if self.norm is not None:
                x = self.norm(use_running_average=not train, momentum=MOMENTUM, name=f"bn{i}")(x)
            x = nn.gelu(x)
        return nn.Dense(10, name="head")(x.mean(axis=(1, 2)))


def load_data(seed: int = 0):
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]  # (N, 8, 8, 1)
    order = np.random.default_rng(seed).permutation(len(images))
    images, labels = images[order], digits.target[order].astype(np.int32)
    split = 1500
    return (images[:split], labels[:split]), (images[split:], labels[split:])


def cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_optimizer(num_steps: int) -> optax.GradientTransformation:
    schedule = optax.cosine_decay_schedule(1e-2, decay_steps=num_steps)
    return optax.chain(ga.adaptive_grad_clip(0.1), optax.adam(schedule))


def loss_and_stats(model: nn.Module, params, batch_stats, x, y):
    """Training-mode loss and the updated `batch_stats` (empty without BatchNorm)."""
    logits, new = model.apply(
        {"params": params, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
    )
    return cross_entropy(logits, y), new.get("batch_stats", {})


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, k: int | None):
    """A jitted step; with `k` and AccumBatchNorm, it commits the window when it closes."""
    commits = k is not None and model.norm is AccumBatchNorm

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, batch_stats, opt_state, x, y):
        grad_fn = jax.value_and_grad(functools.partial(loss_and_stats, model), has_aux=True)
        (loss, new_stats), grads = grad_fn(params, batch_stats, x, y)
        if commits:
            # Read before the update: does this micro-step close the window?
            new_stats = commit_batch_stats(new_stats, ga.closes_window(opt_state))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_stats, opt_state, loss

    return step


def make_gradient_gap(model: nn.Module, k: int):
    """Relative difference between the mean of `k` micro-batch gradients and the large
    batch's gradient, at the same parameters. Without batch statistics it is round-off;
    with BatchNorm it is the effect of normalising each micro-batch with its own statistics.
    """

    @jax.jit
    def gap(params, batch_stats, x, y):
        def grad(xs, ys):
            return jax.grad(lambda p: loss_and_stats(model, p, batch_stats, xs, ys)[0])(params)

        micro = [grad(xs, ys) for xs, ys in zip(jnp.split(x, k), jnp.split(y, k), strict=True)]
        mean = jax.tree.map(lambda *g: sum(g) / k, *micro)
        diff = optax.tree.norm(jax.tree.map(jnp.subtract, mean, grad(x, y)))
        return diff / optax.tree.norm(grad(x, y))

    return gap


def make_window_statistics(model: nn.Module, k: int):
    """Running statistics after one window, computed two ways from what each layer saw.

    Returns `(flax_stats, averaged_stats)`: `nn.BatchNorm` run on the concatenation of the
    inputs every BatchNorm layer normalised in the window's `k` micro-batches (the large
    batch's statistics), and the TensorFlow package's rule, the mean of the `k` micro-batch
    means and variances. Parameters do not change inside a window, so the inputs are
    those the accumulated run's layers saw.
    """

    def flax_batchnorm(stats, h):
        layer = nn.BatchNorm(use_running_average=False, momentum=MOMENTUM, use_scale=False)
        variables = {"params": {"bias": jnp.zeros(h.shape[-1])}, "batch_stats": stats}
        return layer.apply(variables, h, mutable=["batch_stats"])[1]["batch_stats"]

    @jax.jit
    def statistics(params, batch_stats, x):
        inputs = {name: [] for name in NORM_LAYERS}
        for xs in jnp.split(x, k):
            _, state = model.apply(
                {"params": params, "batch_stats": batch_stats},
                xs,
                train=True,
                mutable=["batch_stats", "intermediates"],
                capture_intermediates=lambda mdl, _: mdl.name in ("conv0", "conv1"),
            )
            for i, name in enumerate(NORM_LAYERS):
                inputs[name].append(state["intermediates"][f"conv{i}"]["__call__"][0])
        flax_stats, averaged = {}, {}
        for name in NORM_LAYERS:
            before = {"mean": batch_stats[name]["mean"], "var": batch_stats[name]["var"]}
            flax_stats[name] = flax_batchnorm(before, jnp.concatenate(inputs[name]))
            # EMA is linear: averaging k one-micro-batch EMA steps averages their statistics.
            per_micro = [flax_batchnorm(before, h) for h in inputs[name]]
            averaged[name] = jax.tree.map(lambda *s: sum(s) / k, *per_micro)
        return flax_stats, averaged

    return statistics


def running_stats_difference(stats, reference) -> float:
    return max(
        float(jnp.max(jnp.abs(stats[name][key] - reference[name][key])))
        for name in NORM_LAYERS
        for key in ("mean", "var")
    )


def accuracy(model, params, batch_stats, images, labels) -> float:
    logits = model.apply({"params": params, "batch_stats": batch_stats}, images, train=False)
    return float(jnp.mean(jnp.argmax(logits, -1) == labels))


def max_difference(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def train_pair(
    title: str,
    norm: tuple[type[nn.Module], type[nn.Module]] | None,
    data,
    *,
    epochs: int,
    k: int,
    b: int,
    seed: int,
    progress: bool,
    check_every: int,
) -> dict[str, Any]:
    """Trains the accumulated and the large-batch run side by side; records the gaps."""
    (x_train, y_train), (x_test, y_test) = data
    steps_per_epoch = len(x_train) // (k * b)
    num_steps = epochs * steps_per_epoch
    acc_model, big_model = (ConvNet(norm=n) for n in (norm or (None, None)))
    variables = acc_model.init(jax.random.key(seed), x_train[:1], train=False)
    # Same variable paths: both runs start from identical weights.
    copy = functools.partial(jax.tree.map, jnp.array)
    acc_params, big_params = copy(variables["params"]), copy(variables["params"])
    acc_stats = copy(variables.get("batch_stats", {}))
    big_stats = big_model.init(jax.random.key(seed), x_train[:1], train=False).get(
        "batch_stats", {}
    )

    acc_tx, big_tx = ga.accumulate(make_optimizer(num_steps), k), make_optimizer(num_steps)
    acc_opt, big_opt = acc_tx.init(acc_params), big_tx.init(big_params)
    acc_step = make_train_step(acc_model, acc_tx, k)
    big_step = make_train_step(big_model, big_tx, None)
    gradient_gap = make_gradient_gap(big_model, k)
    window_statistics = make_window_statistics(acc_model, k) if norm else None

    history: dict[str, list[float]] = {
        key: []
        for key in (
            "acc_loss",
            "big_loss",
            "param_diff",
            "checked",
            "grad_gap",
            "stats",
            "averaged",
        )
    }
    rng = np.random.default_rng(seed)
    with tqdm(total=num_steps, desc=title, unit="step", disable=not progress) as bar:
        for _ in range(epochs):
            order = rng.permutation(len(x_train))
            for s in range(steps_per_epoch):
                idx = order[s * k * b : (s + 1) * k * b]
                x, y = jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx])
                # Both checks use the parameters before this step's update.
                check = len(history["acc_loss"]) % check_every == 0
                if check:
                    history["checked"].append(len(history["acc_loss"]))
                    history["grad_gap"].append(float(gradient_gap(big_params, big_stats, x, y)))
                if check and window_statistics is not None:
                    flax_stats, averaged = window_statistics(acc_params, acc_stats, x)
                micro_losses = []
                for i in range(k):
                    sl = slice(i * b, (i + 1) * b)
                    acc_params, acc_stats, acc_opt, loss = acc_step(
                        acc_params, acc_stats, acc_opt, x[sl], y[sl]
                    )
                    micro_losses.append(float(loss))
                if check and window_statistics is not None:
                    history["stats"].append(running_stats_difference(acc_stats, flax_stats))
                    history["averaged"].append(running_stats_difference(averaged, flax_stats))
                big_params, big_stats, big_opt, big_loss = big_step(
                    big_params, big_stats, big_opt, x, y
                )
                history["acc_loss"].append(float(np.mean(micro_losses)))
                history["big_loss"].append(float(big_loss))
                history["param_diff"].append(max_difference(acc_params, big_params))
                bar.set_postfix(acc=f"{history['acc_loss'][-1]:.3f}", big=f"{float(big_loss):.3f}")
                bar.update()
    return {
        "history": history,
        "num_steps": num_steps,
        "optimizer_steps": int(ga.optimizer_step(acc_opt)),
        "acc_accuracy": accuracy(acc_model, acc_params, acc_stats, x_test, y_test),
        "big_accuracy": accuracy(big_model, big_params, big_stats, x_test, y_test),
    }


def plot(path: str, exact: dict[str, Any], bn: dict[str, Any], k: int, b: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    (ax_loss, ax_param), (ax_stats, ax_grad) = axes
    acc_label, big_label = f"accumulate: {k} x {b}", f"large batch: 1 x {k * b}"
    for run, name, style in ((exact, "no BatchNorm", "-"), (bn, "BatchNorm", ":")):
        ax_loss.plot(run["history"]["acc_loss"], ls=style, label=f"{acc_label}, {name}")
        ax_loss.plot(run["history"]["big_loss"], ls=style, label=f"{big_label}, {name}", alpha=0.7)
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", yscale="log")
    ax_loss.set_title("losses agree", fontsize=10)
    ax_loss.legend(fontsize=7)

    ax_param.plot(exact["history"]["param_diff"], label="no BatchNorm: float32 round-off")
    ax_param.plot(bn["history"]["param_diff"], label="BatchNorm: normalisation of 32 vs 128")
    ax_param.axhline(PARAM_BOUND, color="k", ls="--", lw=0.8, label=f"bound {PARAM_BOUND:g}")
    ax_param.set(xlabel="optimizer step", ylabel="max |Δ parameter|", yscale="log")
    ax_param.set_title("parameters: accumulated vs large batch", fontsize=10)
    ax_param.legend(fontsize=7)

    # A difference of exactly zero has no place on a log axis; floor it for display.
    tiny = 1e-12
    checked = bn["history"]["checked"]
    ax_stats.plot(checked, np.maximum(bn["history"]["stats"], tiny), label="AccumBatchNorm")
    ax_stats.plot(
        checked, bn["history"]["averaged"], label="average of micro-batch statistics (TF package)"
    )
    ax_stats.axhline(STATS_BOUND, color="k", ls="--", lw=0.8, label=f"bound {STATS_BOUND:g}")
    ax_stats.set(xlabel="optimizer step", ylabel="max |Δ running mean, var|", yscale="log")
    ax_stats.set_title("running statistics vs nn.BatchNorm on the window", fontsize=10)
    ax_stats.legend(fontsize=7)

    ax_grad.plot(exact["history"]["checked"], exact["history"]["grad_gap"], label="no BatchNorm")
    ax_grad.plot(checked, bn["history"]["grad_gap"], label="BatchNorm (by design)")
    ax_grad.set(xlabel="optimizer step", ylabel="‖ḡ_acc - g_large‖ / ‖g_large‖", yscale="log")
    ax_grad.set_title("gradient at the same parameters", fontsize=10)
    ax_grad.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--k", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--plot", default="digits_convnet.png", help="where to write the PNG")
    parser.add_argument("--quick", action="store_true", help="2 epochs, for a smoke test")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--check-every", type=int, default=5, help="steps between gradient/statistics checks"
    )
    args = parser.parse_args(argv)
    epochs = 2 if args.quick else args.epochs
    k, b = args.k, args.micro_batch
    data = load_data(args.seed)
    common = dict(
        epochs=epochs,
        k=k,
        b=b,
        seed=args.seed,
        progress=not args.no_progress,
        check_every=args.check_every,
    )
    exact = train_pair("no BatchNorm", None, data, **common)
    bn = train_pair("BatchNorm", (AccumBatchNorm, nn.BatchNorm), data, **common)
    plot(args.plot, exact, bn, k, b)

    steps = exact["num_steps"]
    param_diff = max(exact["history"]["param_diff"])
    stats_diff = max(bn["history"]["stats"])
    averaged_diff = max(bn["history"]["averaged"])
    gap_exact = float(np.median(exact["history"]["grad_gap"]))
    gap_bn = float(np.median(bn["history"]["grad_gap"]))
    verdict = {True: "within", False: "OUTSIDE"}
    print(f"{k} micro-batches of {b} (accumulate) against one batch of {k * b}, {steps} steps")
    print("1. Without batch statistics, accumulation is the large batch:")
    print(
        f"   largest parameter difference over all steps: {param_diff:.1e}"
        f" ({verdict[param_diff <= PARAM_BOUND]} the float32 bound {PARAM_BOUND:g})"
    )
    print(f"   gradient difference at equal parameters (median): {gap_exact:.1e} (round-off)")
    print(
        f"   test accuracy: accumulated {exact['acc_accuracy']:.3f}"
        f"  large batch {exact['big_accuracy']:.3f}"
    )
    print("2. With BatchNorm (AccumBatchNorm against nn.BatchNorm):")
    print(
        f"   running statistics after each window vs nn.BatchNorm on the window: {stats_diff:.1e}"
        f" ({verdict[stats_diff <= STATS_BOUND]} the bound {STATS_BOUND:g});"
        f" averaging micro-batch statistics (TF package): {averaged_diff:.1e}"
    )
    print(
        f"   training-time normalisation uses each micro-batch's statistics (by design):"
        f" gradient differs by {gap_bn:.1%} (median), parameters by"
        f" {bn['history']['param_diff'][-1]:.1e} after {steps} steps"
    )
    print(
        f"   test accuracy: accumulated {bn['acc_accuracy']:.3f}"
        f"  large batch {bn['big_accuracy']:.3f}"
    )
    print(f"plot written to {args.plot}")
    return {
        "num_steps": steps,
        "optimizer_steps": min(exact["optimizer_steps"], bn["optimizer_steps"]),
        "param_diff": param_diff,
        "stats_diff": stats_diff,
        "averaged_stats_diff": averaged_diff,
        "grad_gap_exact": gap_exact,
        "grad_gap_batchnorm": gap_bn,
        "batchnorm_param_diff": bn["history"]["param_diff"][-1],
        "first_loss": exact["history"]["acc_loss"][0],
        "accumulated_loss": exact["history"]["acc_loss"][-1],
        "large_batch_loss": exact["history"]["big_loss"][-1],
        "accumulated_accuracy": exact["acc_accuracy"],
        "large_batch_accuracy": exact["big_accuracy"],
        "batchnorm_accumulated_accuracy": bn["acc_accuracy"],
        "batchnorm_large_batch_accuracy": bn["big_accuracy"],
    }


if __name__ == "__main__":
    main()
