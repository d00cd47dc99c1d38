"""What a step of `accumulate` moves, against the memory-traffic floor, fused and through optax.

A micro-step must read the gradient and the accumulator and write the
accumulator: the bytes of the floor `p + g` (donated). Every candidate is a
jitted step that donates its state and is called on its own outputs; all of a
table are measured side by side (`harness.interleaved_medians`), so the ratios
are what to read.

    python benchmarks/fused.py            # transformer-shaped tree (42M params) and an MLP
    python benchmarks/fused.py --quick    # small sizes, a smoke test

Rows (per tree):
  floor `p + g`, `acc + g`, and `acc + g` in a step that carries the params and
  Adam's state as the fused step does (the same bytes; what more it costs is the
  dispatch of every donated buffer: 743 on the transformer against 294), and the
  same with a conditional that passes the params and Adam's state through (the
  fused micro-step's structure, without its accounting); the
  micro-step of `accumulate(adam)` through `apply_gradients` (fused) with and
  without the finite check, behind `clip_norm(1.0)`, and through the optax
  path (`update` + `apply_updates`, and `update` alone with the state
  donated); `optax.MultiSteps(adam)` and `chain(adam, apply_every)`; the
  window-closing step (fused) against adam + `apply_updates` alone plus
  `acc + g`; `K = 1` (static) against adam alone.
  `temp_MB` is `memory_analysis()`'s temp; `moved_MB` the bytes the branch that
  runs reads and writes, summed over the compiled program's top-level ops
  (`harness.Hlo.bytes_moved`); `x_floor` the median time over `acc + g`'s.

A last table is a whole train step at effective batch 256 through the fused
path: 4 micro-batches of 64 (separate calls, and one scan) against one batch.
"""

from __future__ import annotations

import platform
from collections.abc import Callable

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax as ga

NEVER = 1 << 30  # a window length never reached: every call is a micro-step


def mlp_params(sizes: list[int]) -> list[dict]:
    keys = jax.random.split(jax.random.key(1), len(sizes) - 1)
    return [
        {"w": jax.random.normal(k, (a, b)) / np.sqrt(a), "b": jnp.zeros((b,))}
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def num_params(tree) -> int:
    return sum(int(np.size(x)) for x in jax.tree.leaves(tree))


def fresh(tree):
    return jax.tree.map(jnp.copy, tree)


class Candidate:
    """A jitted step with donated carry, called repeatedly on its own outputs."""

    def __init__(self, name: str, fn: Callable, carry: tuple, args: tuple, branch: int | None):
        self.name = name
        donate = tuple(range(len(carry)))
        jitted = jax.jit(fn, donate_argnums=donate)
        self.compiled = jitted.lower(*carry, *args).compile()
        self.carry, self.args, self.branch = carry, args, branch

    def __call__(self):
        out = self.compiled(*self.carry, *self.args)
        self.carry = tuple(out[: len(self.carry)])
        return out

    def facts(self) -> dict:
        mem = harness.compiled_memory(self.compiled)
        hlo = harness.Hlo(self.compiled)
        return {
            "temp_MB": round(mem.temp_bytes / 1e6, 3),
            "moved_MB": round(hlo.bytes_moved(self.branch) / 1e6, 1),
            "alias_MB": round(mem.alias_bytes / 1e6, 1),
        }


def fused_step(tx):
    def step(params, state, grads):
        return ga.apply_gradients(tx, grads, state, params)

    return step


def optax_step(tx):
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def update_only_step(tx, params):
    def step(state, grads):
        updates, state = tx.update(grads, state, params)
        return state, updates  # state first: each donated buffer aliases its successor

    return step


def add_step(acc, grads):
    return (jax.tree.map(jnp.add, acc, grads),)


def carried_add_step(params, state, grads):
    """`acc + g` inside a step that carries what the fused step carries (params, Adam's
    moments): the same bytes as the floor, plus the dispatch of every donated buffer."""
    return params, state._replace(acc_grads=jax.tree.map(jnp.add, state.acc_grads, grads))


def carried_cond_step(params, state, grads):
    """`carried_add_step` plus a conditional that passes the params and Adam's state
    through (its other branch, never taken, changes them): the structure of the fused
    micro-step without its accounting."""
    acc = jax.tree.map(jnp.add, state.acc_grads, grads)

    def change(params, inner):
        return jax.tree.map(lambda x: 2 * x, params), inner

    params, inner = jax.lax.cond(
        state.micro_step >= NEVER, change, lambda *x: x, params, state.inner_state
    )
    return params, state._replace(acc_grads=acc, inner_state=inner)


def step_table(label: str, params, repeats: int) -> list[dict]:
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    adam = optax.adam(1e-3)
    micro = ga.accumulate(adam, NEVER)
    # A traced window length of 1: every call closes a window, with the accumulator.
    closing = ga.accumulate(adam, lambda step: jnp.int32(1))
    k1 = ga.accumulate(adam, 1)
    k1_unchecked = ga.accumulate(adam, 1, skip_nonfinite=False)
    unchecked = ga.accumulate(adam, NEVER, skip_nonfinite=False)
    clipped = optax.chain(ga.clip_norm(1.0), ga.accumulate(adam, NEVER))
    multisteps = optax.MultiSteps(adam, NEVER)
    apply_every = optax.chain(adam, optax.apply_every(NEVER))

    def c(name, fn, tx, branch=0):
        return Candidate(name, fn(tx), (fresh(params), tx.init(params)), (grads,), branch)

    candidates = [
        Candidate("floor p + g", add_step, (fresh(params),), (grads,), None),
        Candidate("acc + g", add_step, (fresh(params),), (grads,), None),
        Candidate(
            "acc + g, carrying params and Adam's state",
            carried_add_step,
            (fresh(params), micro.init(params)),
            (grads,),
            None,
        ),
        Candidate(
            "acc + g, carrying params and Adam's state through a conditional",
            carried_cond_step,
            (fresh(params), micro.init(params)),
            (grads,),
            0,
        ),
        c("fused micro-step", fused_step, micro),
        c("fused micro-step, skip_nonfinite=False", fused_step, unchecked),
        c("fused micro-step, chain(clip_norm, accumulate)", fused_step, clipped),
        c("optax path micro-step (update + apply_updates)", optax_step, micro),
        Candidate(
            "optax path micro-step, update only",
            update_only_step(micro, params),
            (micro.init(params),),
            (grads,),
            0,
        ),
        c("optax.MultiSteps(adam) micro-step", optax_step, multisteps),
        c("chain(adam, apply_every) micro-step", optax_step, apply_every, None),
        c("fused closing step", fused_step, closing, 1),
        c("adam + apply_updates", optax_step, adam, None),
        c("fused K=1", fused_step, k1, 1),
        c("optax path K=1, skip_nonfinite=False", optax_step, k1_unchecked, 1),
    ]
    t = harness.interleaved_medians({x.name: x for x in candidates}, repeats)
    base = t["acc + g"]
    rows = []
    for x in candidates:
        row = {"model": label, "candidate": x.name, "ms": round(1e3 * t[x.name], 2)}
        row["x_floor"] = round(t[x.name] / base, 2)
        row.update(x.facts())
        rows.append(row)
    adam_t = t["adam + apply_updates"]
    ratios = {
        "fused closing step / (adam + apply_updates + acc + g)": t["fused closing step"]
        / (adam_t + base),
        "fused K=1 / (adam + apply_updates)": t["fused K=1"] / adam_t,
        "fused micro-step, skip_nonfinite=False / acc + g carrying the same state": t[
            "fused micro-step, skip_nonfinite=False"
        ]
        / t["acc + g, carrying params and Adam's state"],
        "fused micro-step, skip_nonfinite=False / acc + g carrying the same state through "
        "a conditional": t["fused micro-step, skip_nonfinite=False"]
        / t["acc + g, carrying params and Adam's state through a conditional"],
        "optax path K=1 unchecked / (adam + apply_updates)": t[
            "optax path K=1, skip_nonfinite=False"
        ]
        / adam_t,
    }
    for name, ratio in ratios.items():
        rows.append({"model": label, "candidate": f"ratio: {name}", "x_floor": round(ratio, 2)})
    temp = {x.name: x.facts()["temp_MB"] for x in candidates}
    size_mb = 4 * num_params(params) / 1e6
    for name in ("fused micro-step", "fused micro-step, chain(clip_norm, accumulate)"):
        rows.append(
            {
                "model": label,
                "candidate": f"ratio: temp of {name} / P",
                "x_floor": round(temp[name] / size_mb, 4),
            }
        )
    return rows


def mlp_loss(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    return jnp.mean((h @ params[-1]["w"] + params[-1]["b"] - y) ** 2)


def train_table(label: str, sizes: list[int], repeats: int, k: int = 4, micro: int = 64):
    """A train step at effective batch k * micro through the fused path."""
    params = mlp_params(sizes)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(k * micro, sizes[0])), jnp.float32)
    y = jnp.asarray(rng.normal(size=(k * micro, sizes[-1])), jnp.float32)
    xs, ys = x.reshape(k, micro, -1), y.reshape(k, micro, -1)
    adam = optax.adam(1e-3)
    tx = ga.accumulate(adam, k)

    def fused(params, state, xb, yb):
        return ga.apply_gradients(tx, jax.grad(mlp_loss)(params, xb, yb), state, params)

    def optax_path(params, state, xb, yb):
        updates, state = tx.update(jax.grad(mlp_loss)(params, xb, yb), state, params)
        return optax.apply_updates(params, updates), state

    def large(params, state, xb, yb):
        return ga.apply_gradients(adam, jax.grad(mlp_loss)(params, xb, yb), state, params)

    def scanned(params, state, xs, ys):
        def body(carry, batch):
            return fused(*carry, *batch), None

        return jax.lax.scan(body, (params, state), (xs, ys))[0]

    class Looped:
        def __init__(self, name, fn):
            self.name = name
            self.c = Candidate(name, fn, (fresh(params), tx.init(params)), (xs[0], ys[0]), None)

        def __call__(self):
            for i in range(k):
                self.c.carry = self.c.compiled(*self.c.carry, xs[i], ys[i])
            return self.c.carry

    candidates = [
        Looped(f"{k} x {micro}: apply_gradients(accumulate)", fused),
        Looped(f"{k} x {micro}: update + apply_updates", optax_path),
        Candidate(
            f"{k} x {micro} in one call (scan): apply_gradients(accumulate)",
            scanned,
            (fresh(params), tx.init(params)),
            (xs, ys),
            None,
        ),
        Candidate(
            f"1 x {k * micro}: adam", large, (fresh(params), adam.init(params)), (x, y), None
        ),
    ]
    t = harness.interleaved_medians({c.name: c for c in candidates}, repeats)
    ref = t[f"1 x {k * micro}: adam"]
    return [
        {
            "model": label,
            "candidate": n,
            "ms": round(1e3 * v, 2),
            "x_large_batch": round(v / ref, 3),
        }
        for n, v in t.items()
    ]


print_rows = harness.print_rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__, quick="small sizes, a smoke test")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--skip-train", action="store_true", help="only the step tables")
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 21)
    device = jax.devices()[0]
    print(
        f"# fused-path benchmark: jax {jax.__version__}, optax {optax.__version__}, "
        f"{device.platform} ({device.device_kind}; {platform.machine()}), repeats={repeats}"
    )
    rows: list[dict] = []
    trees = (
        [("transformer", harness.transformer_params(2, 64, 256)), ("MLP", mlp_params([256] * 3))]
        if args.quick
        else [("transformer", harness.transformer_params()), ("MLP", mlp_params([4096] * 3))]
    )
    for name, params in trees:
        label = (
            f"{name} {num_params(params) / 1e6:.1f}M params, {len(jax.tree.leaves(params))} leaves"
        )
        table = step_table(label, params, repeats)
        print_rows(f"micro-step, closing step and K=1: {label}", table)
        rows += table
    if not args.skip_train:
        sizes = [256] * 3 if args.quick else [4096] * 3
        label = f"MLP {num_params(mlp_params(sizes)) / 1e6:.1f}M params"
        table = train_table(label, sizes, max(3, repeats // 3))
        print_rows(f"train step at effective batch 256 (fused path): {label}", table)
        rows += table
    return rows


if __name__ == "__main__":
    main()
