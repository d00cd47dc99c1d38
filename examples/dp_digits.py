"""DP-SGD on scikit-learn's digits: Poisson logical batches accumulated from micro-batches.

Differentially private training clips every example's gradient and adds noise
to the sum of a logical batch. A logical batch of `B` examples is computed in
micro-batches of `m`, one micro-step each. `privacy.clipped_grad` finds each
example's gradient norm from every layer's inputs and output gradients (its fast
path, the default), at about the cost of the non-private gradient; with
`--method per_example` it computes every example's whole gradient with `vmap`,
whose memory grows with the examples per call (which is what micro-batches bound).

The private run:

* samples each logical batch by Poisson sampling (every training example joins
  with probability `q = B / N`, so the batch size varies, and may be 0), pads
  it to whole micro-batches and marks the padding;
* on each micro-step, `privacy.clipped_grad` returns the sum of the
  micro-batch's per-example gradients clipped to `C` (padding adds zero);
* `privacy.dp_accumulate` sums those over the micro-steps and, at the last
  micro-step of the logical batch (`close=True`), adds Gaussian noise of
  standard deviation `sigma * C` once, divides by the public `B` and takes
  the Adam step;
* `privacy.epsilon` reports the privacy spent, counting logical batches, not
  micro-steps.

The non-private run takes as many Adam steps at batch `B` (one
`jax.value_and_grad` per step). Both runs' test accuracy is printed per epoch
and, with `--plot`, drawn.

    python examples/dp_digits.py [--epochs 30] [--method fast] [--plot dp_digits.png] [--quick]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import gradaccum_jax as ga
from gradaccum_jax import privacy

DELTA = 1e-5


def load_data(seed: int = 0):
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:1400], y[:1400]), (x[1400:], y[1400:])


def init_params(key: jax.Array, widths=(64, 128, 10)) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(key, len(widths) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros(b)}
        for k, a, b in zip(keys, widths[:-1], widths[1:], strict=True)
    ]


def logits_of(params, x):
    for layer in params[:-1]:
        x = jnp.tanh(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, batch):
    x, y = batch
    return optax.softmax_cross_entropy_with_integer_labels(logits_of(params, x), y).mean()


@jax.jit
def accuracy(params, x, y):
    return jnp.mean(jnp.argmax(logits_of(params, x), -1) == y)


def make_dp_step(
    clip_norm: float, sigma: float, batch: int, micro: int, lr: float, key, method: str = "fast"
):
    """The private transformation and its micro-step: clipped sum in, window closed on `close`."""
    clipped = privacy.clipped_grad(loss_fn, clip_norm, method=method)
    # No every_k_schedule: a Poisson logical batch ends where `close=` says.
    tx = privacy.dp_accumulate(
        optax.adam(lr),
        None,
        l2_clip_norm=clipped.l2_clip_norm,
        noise_multiplier=sigma,
        expected_batch_size=batch,
        key=key,
    )

    @jax.jit
    def micro_step(params, opt_state, x, y, padding, close):
        _, grad_sum = clipped(params, (x, y), is_padding_example=padding)
        return ga.apply_gradients(tx, grad_sum, opt_state, params, close=close)

    return tx, clipped, micro_step


def poisson_micro_batches(rng, x, y, q: float, micro: int):
    """One Poisson logical batch as padded micro-batches: [(x, y, padding, close)]."""
    index = np.flatnonzero(rng.random(len(x)) < q)
    # An empty logical batch still closes a window: its noise is part of the mechanism.
    steps = max(1, -(-len(index) // micro))
    padded = np.zeros(steps * micro, np.int64)
    padded[: len(index)] = index
    padding = np.arange(steps * micro) >= len(index)
    return [
        (x[part], y[part], padding[s * micro : (s + 1) * micro], s == steps - 1)
        for s, part in enumerate(padded.reshape(steps, micro))
    ], len(index)


def train_private(args, train_set, test_set) -> dict[str, Any]:
    (x, y), (x_test, y_test) = train_set, test_set
    q = args.batch / len(x)
    key_init, key_noise = jax.random.split(jax.random.key(args.seed))
    params = init_params(key_init)
    tx, clipped, micro_step = make_dp_step(
        args.clip_norm, args.sigma, args.batch, args.micro, args.lr, key_noise, args.method
    )
    opt_state = tx.init(params)
    rng = np.random.default_rng(args.seed + 1)
    windows_per_epoch = round(1 / q)
    history, sizes, windows, seconds = [], [], 0, 0.0
    for _ in range(args.epochs):
        start = time.perf_counter()
        for _ in range(windows_per_epoch):
            micro_batches, size = poisson_micro_batches(rng, x, y, q, args.micro)
            sizes.append(size)
            for xb, yb, padding, close in micro_batches:
                params, opt_state = micro_step(params, opt_state, xb, yb, padding, close)
            windows += 1
        history.append(float(accuracy(params, x_test, y_test)))
        if len(history) > 1:  # the first epoch compiles
            seconds += time.perf_counter() - start
    eps = privacy.epsilon(args.sigma, q, windows, DELTA, sampling="poisson", accountant="pld")
    # Memory of one call: m examples against the whole logical batch, on both paths.
    temp = {
        (method, n): clipped_temp_bytes(clipped, params, n, method)
        for method in ("fast", "per_example")
        for n in (args.micro, args.batch)
    }
    return {
        "history": history,
        "epsilon": eps,
        "windows": windows,
        "q": q,
        "sizes": sizes,
        "temp_bytes": temp,
        "seconds_per_epoch": seconds / max(1, len(history) - 1),
    }


def clipped_temp_bytes(clipped, params, n: int, method: str) -> int:
    """Compiled temporary bytes of a clipped sum over `n` examples in one call."""
    one_call = jax.jit(privacy.clipped_grad(clipped.loss_fn, clipped.l2_clip_norm, method=method))
    shapes = (jax.ShapeDtypeStruct((n, 64), jnp.float32), jax.ShapeDtypeStruct((n,), jnp.int32))
    return int(one_call.lower(params, shapes).compile().memory_analysis().temp_size_in_bytes)


def train_plain(args, train_set, test_set) -> list[float]:
    (x, y), (x_test, y_test) = train_set, test_set
    params = init_params(jax.random.split(jax.random.key(args.seed))[0])
    tx = optax.adam(args.lr)
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state, xb, yb):
        grads = jax.grad(loss_fn)(params, (xb, yb))
        return ga.apply_gradients(tx, grads, opt_state, params)

    rng = np.random.default_rng(args.seed + 1)
    history = []
    for _ in range(args.epochs):
        for _ in range(round(len(x) / args.batch)):
            index = rng.choice(len(x), size=args.batch, replace=False)
            params, opt_state = step(params, opt_state, x[index], y[index])
        history.append(float(accuracy(params, x_test, y_test)))
    return history


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch", type=int, default=256, help="B, the expected logical batch")
    parser.add_argument("--micro", type=int, default=32, help="m, examples per micro-step")
    parser.add_argument(
        "--method", default="fast", choices=["fast", "per_example"], help="clipped_grad's path"
    )
    parser.add_argument("--clip-norm", type=float, default=1.0, help="C")
    parser.add_argument("--sigma", type=float, default=2.5, help="noise multiplier")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="write the figure to this path")
    parser.add_argument("--quick", action="store_true", help="a reduced run for the tests")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs = 6
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    train_set, test_set = load_data(args.seed)
    private = train_private(args, train_set, test_set)
    plain = train_plain(args, train_set, test_set)
    print(
        f"digits, {len(train_set[0])} training examples; logical batch B = {args.batch} "
        f"(Poisson, q = {private['q']:.3f}, sizes {min(private['sizes'])} to "
        f"{max(private['sizes'])}) in micro-batches of m = {args.micro}"
    )
    temp = private["temp_bytes"]
    for method in ("fast", "per_example"):
        print(
            f"clipped sums in one call, {method} path: {temp[method, args.micro] / 2**20:.2f} MiB "
            f"for m examples, {temp[method, args.batch] / 2**20:.2f} MiB for B examples "
            "(compiled temporaries)"
        )
    print(
        f"private training ({args.method} path): {private['seconds_per_epoch']:.2f} s per epoch "
        "after the first"
    )
    print(f"{'epoch':>5} {'DP-SGD acc':>11} {'non-private acc':>16}")
    for epoch, (a, b) in enumerate(zip(private["history"], plain, strict=True), 1):
        print(f"{epoch:>5} {a:>11.3f} {b:>16.3f}")
    print(
        f"privacy spent: epsilon = {private['epsilon']:.2f} at delta = {DELTA:g} "
        f"(PLD accountant, {private['windows']} logical batches, sigma = {args.sigma}, "
        f"C = {args.clip_norm}, Poisson sampling)"
    )
    if args.plot:
        plot(args.plot, private, plain)
    return {**private, "plain_history": plain}


def plot(path: str, private: dict[str, Any], plain: list[float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = np.arange(1, len(plain) + 1)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(epochs, plain, label="non-private")
    ax.plot(epochs, private["history"], label=f"DP-SGD, epsilon = {private['epsilon']:.2f}")
    ax.set(xlabel="epoch", ylabel="test accuracy", title="digits: DP-SGD vs non-private")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
