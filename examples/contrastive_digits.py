"""Contrastive learning on scikit-learn's digits: a large batch in micro-batches, exactly.

Each step takes N images, makes two augmented views of each (random shifts,
pixel noise, dropped pixels) and trains an MLP encoder with the symmetric
InfoNCE (CLIP) loss between the views: every view's positive is the other view
of its image, its negatives the other N - 1 images. The temperature is a
learned parameter of the loss alone. Three runs from the same weights see the
same views, with Adam:

* ``large batch``: ``jax.value_and_grad`` on all N pairs at once;
* ``coupled``: ``gradaccum_jax.coupled_value_and_grad`` with K micro-batches of
  N/K: embeddings cached, the loss over all N, the encoder re-run per
  micro-batch. Its parameters follow the large batch's to float32 rounding;
* ``naive``: ``gradaccum_jax.microbatch_value_and_grad`` of the same loss with K
  micro-batches: each micro-batch's loss sees N/K - 1 negatives. It is exact
  accumulation of a *different* objective, and its parameters drift away.

It prints the compiled temporary memory of each step, the loss on the N-pair
objective (on held-out digits) along the way, and the accuracy of a linear
probe (logistic regression on the frozen encoder's 8-dimensional embeddings)
on held-out digits. By default N = 512 in K = 32 micro-batches of 16.

    python examples/contrastive_digits.py [--steps 300] [--plot contrastive_digits.png] [--quick]
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.linear_model import LogisticRegression

import gradaccum_jax as ga

HIDDEN, FEATURES, PROJ = 256, 64, 8


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    return x[:1400], y[:1400], x[1400:], y[1400:]


def augment(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One random view of each 8 x 8 image: a shift of up to 1 pixel, noise, dropped pixels."""
    n = len(images)
    padded = np.pad(images, ((0, 0), (1, 1), (1, 1)))
    dy, dx = rng.integers(0, 3, n), rng.integers(0, 3, n)
    rows = dy[:, None] + np.arange(8)[None, :]
    cols = dx[:, None] + np.arange(8)[None, :]
    view = padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None, :]]
    view = view * (rng.random(view.shape) > 0.1) + 0.05 * rng.standard_normal(view.shape)
    return view.reshape(n, 64).astype(np.float32)


def init_params(key: jax.Array) -> dict[str, Any]:
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w1": jax.random.normal(k1, (64, HIDDEN)) / 8.0,
        "b1": jnp.zeros(HIDDEN),
        "w2": jax.random.normal(k2, (HIDDEN, FEATURES)) / HIDDEN**0.5,
        "proj": jax.random.normal(k3, (FEATURES, PROJ)) / FEATURES**0.5,
        "log_scale": jnp.log(jnp.float32(10.0)),  # used by the loss only
    }


def features(params: Any, x: jax.Array) -> jax.Array:
    """The encoder: 64 pixels to a unit vector of PROJ dimensions (what the probe reads)."""
    h = jax.nn.gelu(x @ params["w1"] + params["b1"]) @ params["w2"]
    z = jax.nn.gelu(h) @ params["proj"]
    return z / jnp.linalg.norm(z, axis=-1, keepdims=True)


def embed(params: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    return {"a": features(params, batch["a"]), "b": features(params, batch["b"])}


def contrastive_loss(params: Any, reps: dict[str, jax.Array]) -> jax.Array:
    scale = jnp.exp(params["log_scale"])
    return ga.losses.clip_loss(reps["a"], reps["b"], scale, block_size=128)


def full_loss(params: Any, batch: dict[str, jax.Array]) -> jax.Array:
    return contrastive_loss(params, embed(params, batch))


def make_steps(k: int, lr: float) -> tuple[dict[str, Any], optax.GradientTransformation]:
    opt = optax.adam(lr)
    grad_fns = {
        "large batch": jax.value_and_grad(full_loss),
        "coupled": ga.coupled_value_and_grad(contrastive_loss, embed, k),
        "naive": ga.microbatch_value_and_grad(full_loss, k),
    }

    def step_of(grad_fn: Any) -> Any:
        def step(params: Any, opt_state: Any, batch: Any) -> Any:
            loss, grads = grad_fn(params, batch)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return jax.jit(step)

    return {name: step_of(fn) for name, fn in grad_fns.items()}, opt


def linear_probe(params: Any, x_train, y_train, x_test, y_test) -> float:
    f_train = np.asarray(features(params, jnp.asarray(x_train.reshape(len(x_train), 64))))
    f_test = np.asarray(features(params, jnp.asarray(x_test.reshape(len(x_test), 64))))
    mean, std = f_train.mean(0), f_train.std(0) + 1e-6
    probe = LogisticRegression(max_iter=2000, C=0.1)
    probe.fit((f_train - mean) / std, y_train)
    return float(probe.score((f_test - mean) / std, y_test))


def rel_diff(a: Any, b: Any) -> float:
    num = sum(
        float(jnp.sum((x - y) ** 2))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )
    return (num / sum(float(jnp.sum(y**2)) for y in jax.tree.leaves(b))) ** 0.5


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=512, help="N, pairs per step")
    parser.add_argument("--k", type=int, default=32, help="micro-batches per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default=None, help="write the figure to this path")
    parser.add_argument("--quick", action="store_true", help="a reduced run for the tests")
    args = parser.parse_args(argv)
    steps = 40 if args.quick else args.steps
    n, k = args.batch, args.k

    x_train, y_train, x_test, y_test = load_data(args.seed)
    steps_by_name, opt = make_steps(k, args.lr)
    params0 = init_params(jax.random.key(args.seed))
    state = {name: (params0, opt.init(params0)) for name in steps_by_name}

    # (c) compiled memory of each train step: peak = temp + arguments + outputs - aliased.
    shapes = {v: jax.ShapeDtypeStruct((n, 64), jnp.float32) for v in ("a", "b")}
    peaks, temps = {}, {}
    for name, step in steps_by_name.items():
        stats = step.lower(params0, opt.init(params0), shapes).compile().memory_analysis()
        temps[name] = int(stats.temp_size_in_bytes)
        peaks[name] = int(
            stats.temp_size_in_bytes
            + stats.argument_size_in_bytes
            + stats.output_size_in_bytes
            - stats.alias_size_in_bytes
        )

    rng = np.random.default_rng(args.seed + 1)
    eval_rng = np.random.default_rng(args.seed + 2)
    eval_batches = []
    for _ in range(4):
        idx = eval_rng.choice(len(x_test), size=min(n, len(x_test)), replace=False)
        eval_batches.append({v: jnp.asarray(augment(x_test[idx], eval_rng)) for v in ("a", "b")})
    objective = jax.jit(full_loss)
    history: dict[str, list[float]] = {name: [] for name in steps_by_name}
    param_gap: list[float] = []
    eval_every = max(1, steps // 20)
    eval_steps: list[int] = []
    for t in range(steps):
        idx = rng.choice(len(x_train), size=n, replace=False)
        batch = {v: jnp.asarray(augment(x_train[idx], rng)) for v in ("a", "b")}
        for name, step in steps_by_name.items():
            params, opt_state = state[name]
            params, opt_state, _ = step(params, opt_state, batch)
            state[name] = (params, opt_state)
        param_gap.append(rel_diff(state["coupled"][0], state["large batch"][0]))
        if t % eval_every == 0 or t == steps - 1:
            eval_steps.append(t + 1)
            for name in steps_by_name:
                p = state[name][0]
                history[name].append(float(np.mean([objective(p, b) for b in eval_batches])))

    probe = {
        name: linear_probe(state[name][0], x_train, y_train, x_test, y_test)
        for name in steps_by_name
    }
    init_probe = linear_probe(params0, x_train, y_train, x_test, y_test)

    print(f"N = {n} pairs per step in K = {k} micro-batches of {n // k}; {steps} Adam steps")
    print(
        f"{'run':<13}{'peak MiB':>10}{'temp MiB':>10}{'N-pair loss (held out)':>25}"
        f"{'probe acc':>11}"
    )
    for name in steps_by_name:
        print(
            f"{name:<13}{peaks[name] / 2**20:>10.2f}{temps[name] / 2**20:>10.2f}"
            f"{history[name][-1]:>25.4f}{probe[name]:>11.3f}"
        )
    print(f"linear probe on the initial encoder: {init_probe:.3f}")
    print(
        f"coupled vs large batch: largest relative parameter difference over the run "
        f"{max(param_gap):.1e} (float32 rounding)"
    )
    print(
        f"naive vs large batch: relative parameter difference at the end "
        f"{rel_diff(state['naive'][0], state['large batch'][0]):.2f}"
    )
    if args.plot:
        plot(args.plot, eval_steps, history, param_gap, peaks)
    return {
        "peaks": peaks,
        "temps": temps,
        "history": history,
        "probe": probe,
        "init_probe": init_probe,
        "max_param_gap": max(param_gap),
        "naive_gap": rel_diff(state["naive"][0], state["large batch"][0]),
        "steps": steps,
    }


def plot(path: str, eval_steps, history, param_gap, peaks) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, losses in history.items():
        style = "--" if name == "coupled" else "-"
        axes[0].plot(eval_steps, losses, style, label=name)
    axes[0].set(xlabel="step", ylabel="N-pair InfoNCE loss (held out)", title="objective")
    axes[0].legend()
    axes[1].semilogy(np.arange(1, len(param_gap) + 1), np.maximum(param_gap, 1e-12))
    axes[1].set(xlabel="step", ylabel="relative difference", title="coupled vs large batch")
    names = list(peaks)
    axes[2].bar(names, [peaks[m] / 2**20 for m in names])
    axes[2].set(ylabel="compiled peak (MiB)", title="memory of one train step")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
