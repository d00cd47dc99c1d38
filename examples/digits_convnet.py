"""The main job: a small convnet on scikit-learn's digits, accumulated and large-batch.

Two runs see the same images in the same order:

* accumulated: 4 micro-batches of 32 per optimizer step, through
  ``ga.accumulate(optax.chain(ga.adaptive_grad_clip(...), optax.adam(...)), 4)``,
  with ``gradaccum_jax.flax.AccumBatchNorm`` whose running statistics are
  committed once per window;
* large batch: one batch of 128 per step, the same optimizer without
  accumulation, and flax's own ``nn.BatchNorm``.

The optimizer, AGC and the BatchNorm running statistics see exactly the
large-batch quantities. The one difference left is BatchNorm's normalisation
during training, which uses the statistics of the batch it is given (32 images
instead of 128): no accumulation scheme can change that, so the parameters of
the two runs drift apart slowly while their losses and accuracies agree. The
script draws both loss curves and that drift, and prints the test accuracies.

    python examples/digits_convnet.py [--epochs 30] [--plot digits_convnet.png] [--quick]
"""

from __future__ import annotations

import argparse
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from tqdm import tqdm

import gradaccum_jax as ga
from gradaccum_jax.flax import AccumBatchNorm, commit_batch_stats


class ConvNet(nn.Module):
    """Two conv blocks with batch normalisation, global average pooling, a linear head."""

    norm: type[nn.Module]

    @nn.compact
    def __call__(self, x, train: bool):
        for i, (features, stride) in enumerate([(16, 1), (32, 2)]):
            x = nn.Conv(features, (3, 3), strides=stride, name=f"conv{i}")(x)
            x = self.norm(use_running_average=not train, momentum=0.9, name=f"bn{i}")(x)
            x = nn.relu(x)
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


def make_train_step(model: nn.Module, tx: optax.GradientTransformation, k: int | None):
    """A jitted step; with `k`, it also commits AccumBatchNorm's window when it closes."""

    @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
    def step(params, batch_stats, opt_state, x, y):
        def loss_fn(p):
            logits, new = model.apply(
                {"params": p, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
            )
            return cross_entropy(logits, y), new["batch_stats"]

        (loss, new_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        if k is not None:
            # Read before the update: does this micro-step close the window?
            new_stats = commit_batch_stats(new_stats, ga.closes_window(opt_state))
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), new_stats, opt_state, loss

    return step


def accuracy(model, params, batch_stats, images, labels) -> float:
    logits = model.apply({"params": params, "batch_stats": batch_stats}, images, train=False)
    return float(jnp.mean(jnp.argmax(logits, -1) == labels))


def max_difference(a, b) -> float:
    return max(
        float(jnp.max(jnp.abs(x - y)))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def plot(path: str, history: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(10, 3.8))
    ax_loss.plot(history["accumulated"], label="accumulate: 4 x 32, AccumBatchNorm")
    ax_loss.plot(history["large_batch"], label="large batch: 1 x 128, nn.BatchNorm", ls="--")
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", yscale="log")
    ax_loss.legend()
    ax_diff.plot(history["param_diff"])
    ax_diff.set(xlabel="optimizer step", ylabel="max |Δ parameter|", yscale="log")
    ax_diff.set_title("parameter difference between the runs", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--k", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--plot", default="digits_convnet.png", help="where to write the PNG")
    parser.add_argument("--quick", action="store_true", help="2 epochs, for a smoke test")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    epochs = 2 if args.quick else args.epochs
    k, b = args.k, args.micro_batch

    (x_train, y_train), (x_test, y_test) = load_data(args.seed)
    steps_per_epoch = len(x_train) // (k * b)
    num_steps = epochs * steps_per_epoch

    acc_model, big_model = ConvNet(norm=AccumBatchNorm), ConvNet(norm=nn.BatchNorm)
    variables = acc_model.init(jax.random.key(args.seed), x_train[:1], train=False)
    # Same variable paths: the large-batch run starts from identical weights.
    copy = functools.partial(jax.tree.map, jnp.array)
    acc_params, big_params = copy(variables["params"]), copy(variables["params"])
    acc_stats = copy(variables["batch_stats"])
    big_stats = big_model.init(jax.random.key(args.seed), x_train[:1], train=False)["batch_stats"]

    acc_tx = ga.accumulate(make_optimizer(num_steps), k)
    big_tx = make_optimizer(num_steps)
    acc_opt, big_opt = acc_tx.init(acc_params), big_tx.init(big_params)
    acc_step = make_train_step(acc_model, acc_tx, k)
    big_step = make_train_step(big_model, big_tx, None)

    history: dict[str, list[float]] = {"accumulated": [], "large_batch": [], "param_diff": []}
    rng = np.random.default_rng(args.seed)
    with tqdm(total=num_steps, desc="training", unit="step") as bar:
        for _ in range(epochs):
            order = rng.permutation(len(x_train))
            for s in range(steps_per_epoch):
                idx = order[s * k * b : (s + 1) * k * b]
                x, y = x_train[idx], y_train[idx]
                micro_losses = []
                for i in range(k):
                    sl = slice(i * b, (i + 1) * b)
                    acc_params, acc_stats, acc_opt, loss = acc_step(
                        acc_params, acc_stats, acc_opt, x[sl], y[sl]
                    )
                    micro_losses.append(float(loss))
                big_params, big_stats, big_opt, big_loss = big_step(
                    big_params, big_stats, big_opt, x, y
                )
                history["accumulated"].append(float(np.mean(micro_losses)))
                history["large_batch"].append(float(big_loss))
                history["param_diff"].append(max_difference(acc_params, big_params))
                bar.set_postfix(
                    acc=f"{history['accumulated'][-1]:.3f}", big=f"{float(big_loss):.3f}"
                )
                bar.update()

    acc_accuracy = accuracy(acc_model, acc_params, acc_stats, x_test, y_test)
    big_accuracy = accuracy(big_model, big_params, big_stats, x_test, y_test)
    plot(args.plot, history)
    acc_loss, big_loss = history["accumulated"][-1], history["large_batch"][-1]
    steps_taken = int(ga.optimizer_step(acc_opt))
    print(f"optimizer steps: {steps_taken} (accumulated), {num_steps} (large batch)")
    print(f"final training loss: accumulated {acc_loss:.4f}  large-batch {big_loss:.4f}")
    print(f"test accuracy: accumulated {acc_accuracy:.3f}  large-batch {big_accuracy:.3f}")
    print(f"largest parameter difference after training: {history['param_diff'][-1]:.3e}")
    print(f"plot written to {args.plot}")
    return {
        "accumulated_accuracy": acc_accuracy,
        "large_batch_accuracy": big_accuracy,
        "accumulated_loss": history["accumulated"][-1],
        "large_batch_loss": history["large_batch"][-1],
        "first_loss": history["accumulated"][0],
        "param_diff": history["param_diff"][-1],
        "optimizer_steps": int(ga.optimizer_step(acc_opt)),
        "num_steps": num_steps,
    }


if __name__ == "__main__":
    main()
