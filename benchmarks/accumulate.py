"""Micro-step, boundary-step and train-step cost of `accumulate` versus the alternatives.

Everything is measured side by side in one run: the candidates of a table are
called in turn, repetition after repetition, and the medians are compared, so
that the machine's drift affects them alike. Ratios are what to read; the
absolute times only say which machine this was.

    python benchmarks/accumulate.py            # 33.6M-parameter MLP and a 200-leaf model
    python benchmarks/accumulate.py --quick    # small sizes, a smoke test

Tables:
  (a) micro-step: accumulate(adam) against the floor (a jitted, donated tree_map
      add of the gradients into an accumulator), against the floor plus writing
      one zero tree (the least any transform that returns explicit zero updates
      can do), and against optax.MultiSteps(adam) and optax.apply_every after
      adam (which runs adam on every micro-step and is exact only for SGD);
  (b) boundary step: accumulate(adam) against adam alone plus the floor;
  (c) compiled memory: temp, argument and output bytes, and parameter-sized
      copies in the compiled program, of every candidate;
  (d) a full train step at equal effective batch (4 micro-batches of 64 against
      one batch of 256): accumulate and MultiSteps called once per micro-batch,
      the same two looped by a scan inside one jitted call, a hand-written scan
      loop that accumulates inside one jitted step, and the large batch.
"""

from __future__ import annotations

import platform
import statistics
from collections.abc import Callable

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax as ga

NEVER = 1 << 30  # a window length that is never reached: every call is a micro-step


def mlp_params(sizes: list[int], seed: int = 0) -> list[dict[str, jax.Array]]:
    keys = jax.random.split(jax.random.key(seed), len(sizes) - 1)
    return [
        {
            "w": jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a),
            "b": jnp.zeros((b,), jnp.float32),
        }
        for k, a, b in zip(keys, sizes[:-1], sizes[1:], strict=True)
    ]


def mlp_loss(params, x, y):
    h = x
    for layer in params[:-1]:
        h = jax.nn.relu(h @ layer["w"] + layer["b"])
    out = h @ params[-1]["w"] + params[-1]["b"]
    return jnp.mean((out - y) ** 2)


def num_params(tree) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def fresh(tree):
    return jax.tree.map(jnp.copy, tree)


class Candidate:
    """A jitted function with donated state, called repeatedly on its own outputs."""

    def __init__(self, name: str, fn: Callable, state, args, donate=(0,)):
        self.name = name
        self.jitted = jax.jit(fn, donate_argnums=donate)
        self.compiled = self.jitted.lower(state, *args).compile()
        self.state, self.args = state, args

    def __call__(self):
        out = self.compiled(self.state, *self.args)
        self.state = out[0]
        return out

    def memory(self, min_elements: int) -> dict[str, float]:
        mem = harness.compiled_memory(self.compiled)
        hlo = harness.Hlo(self.compiled)
        sources = [hlo.source(c) for c in hlo.copies(min_elements)]
        return {
            "temp_MB": mem.temp_bytes / 1e6,
            "argument_MB": mem.argument_bytes / 1e6,
            "output_MB": mem.output_bytes / 1e6,
            # Copies of state or other computed buffers, and of broadcast zeros:
            # XLA merges identical zero broadcasts of equal-shaped leaves into
            # one buffer and copies it into each output, memory the outputs
            # need anyway.
            "state_copies": sum(source != "broadcast" for source in sources),
            "zero_copies": sum(source == "broadcast" for source in sources),
        }


def medians_ms(candidates, repeats: int) -> dict[str, float]:
    seconds = harness.interleaved_medians({c.name: c for c in candidates}, repeats)
    return {name: 1e3 * s for name, s in seconds.items()}


ZEROS = "floor + zero updates"
# Ratios to the zero-updates line, with the quartiles of their per-round values.
AGAINST_ZEROS = {
    "ratio: micro-step / (floor + zero updates)": "accumulate(adam) micro-step",
    "ratio: micro-step without the check / (floor + zero updates)": (
        "accumulate(adam, skip_nonfinite=False) micro-step"
    ),
}


def transform_step(tx, params):
    def step(state, grads):
        updates, state = tx.update(grads, state, params)
        return state, updates  # state first: each donated buffer aliases its successor

    return step


def floor_step(acc, grads):
    return (jax.tree.map(jnp.add, acc, grads),)


def floor_and_zeros_step(acc, grads):
    return jax.tree.map(jnp.add, acc, grads), jax.tree.map(jnp.zeros_like, grads)


def optimizer_tables(label: str, params, repeats: int) -> list[dict]:
    """Tables (a), (b) and (c) for one parameter tree."""
    grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    big_leaf = max(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    adam = optax.adam(1e-3)
    tx_micro = ga.accumulate(adam, NEVER)
    tx_boundary = ga.accumulate(adam, 1)
    multisteps = optax.MultiSteps(adam, NEVER)
    apply_every = optax.chain(adam, optax.apply_every(NEVER))
    candidates = [
        Candidate("floor (donated add)", floor_step, fresh(zeros), (grads,)),
        Candidate("floor + zero updates", floor_and_zeros_step, fresh(zeros), (grads,)),
        Candidate(
            "accumulate(adam) micro-step",
            transform_step(tx_micro, params),
            tx_micro.init(params),
            (grads,),
        ),
        Candidate(
            "accumulate(adam, skip_nonfinite=False) micro-step",
            transform_step(ga.accumulate(adam, NEVER, skip_nonfinite=False), params),
            tx_micro.init(params),
            (grads,),
        ),
        Candidate(
            "optax.MultiSteps(adam) micro-step",
            transform_step(multisteps, params),
            multisteps.init(params),
            (grads,),
        ),
        Candidate(
            "optax.chain(adam, apply_every) micro-step",
            transform_step(apply_every, params),
            apply_every.init(params),
            (grads,),
        ),
        Candidate("adam alone", transform_step(adam, params), adam.init(params), (grads,)),
        Candidate(
            "accumulate(adam) boundary step",
            transform_step(tx_boundary, params),
            tx_boundary.init(params),
            (grads,),
        ),
    ]
    per_round = harness.interleaved_times({c.name: c for c in candidates}, repeats)
    t = {name: 1e3 * statistics.median(seconds) for name, seconds in per_round.items()}
    floor = t["floor (donated add)"]
    rows = []
    for c in candidates:
        row = {"model": label, "candidate": c.name, "ms": round(t[c.name], 3)}
        row["x_floor"] = round(t[c.name] / floor, 2)
        row.update({k: round(v, 3) for k, v in c.memory(big_leaf).items()})
        rows.append(row)
    boundary_ref = t["adam alone"] + floor
    rows.append(
        {
            "model": label,
            "candidate": "ratio: boundary step / (adam alone + floor)",
            "ms": round(boundary_ref, 3),
            "x_floor": round(t["accumulate(adam) boundary step"] / boundary_ref, 2),
        }
    )
    for name, candidate in AGAINST_ZEROS.items():
        median, q1, q3 = harness.ratio_quartiles(per_round[candidate], per_round[ZEROS])
        rows.append(
            {
                "model": label,
                "candidate": name,
                "ms": round(t[ZEROS], 3),
                "x_floor": round(median, 3),
                "x_floor_q1": round(q1, 3),
                "x_floor_q3": round(q3, 3),
            }
        )
    return rows


def train_step_table(label: str, sizes: list[int], repeats: int, k: int, micro: int) -> list[dict]:
    """Table (d): a whole train step at equal effective batch."""
    params = mlp_params(sizes)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(k * micro, sizes[0])), jnp.float32)
    y = jnp.asarray(rng.normal(size=(k * micro, sizes[-1])), jnp.float32)
    xs, ys = x.reshape(k, micro, -1), y.reshape(k, micro, -1)
    adam = optax.adam(1e-3)

    def one_update(tx):
        def step(carry, xb, yb):
            p, s = carry
            g = jax.grad(mlp_loss)(p, xb, yb)
            u, s = tx.update(g, s, p)
            return (optax.apply_updates(p, u), s), None

        return step

    def k_micro_steps(tx):
        step = one_update(tx)

        class Looped:
            def __init__(self):
                self.c = Candidate(
                    f"{k} x {micro}: {name_of(tx)}",
                    step,
                    (fresh(params), tx.init(params)),
                    (xs[0], ys[0]),
                )
                self.name = self.c.name

            def __call__(self):
                for i in range(k):
                    out = self.c.compiled(self.c.state, xs[i], ys[i])
                    self.c.state = out[0]
                return self.c.state

        return Looped()

    def name_of(tx):
        return "accumulate(adam)" if tx is acc_tx else "optax.MultiSteps(adam)"

    def scan_step(carry, xs, ys):
        p, s = carry

        def body(total, batch):
            g = jax.grad(mlp_loss)(p, *batch)
            return jax.tree.map(jnp.add, total, g), None

        total, _ = jax.lax.scan(body, jax.tree.map(jnp.zeros_like, p), (xs, ys))
        u, s = adam.update(jax.tree.map(lambda t: t / k, total), s, p)
        return (optax.apply_updates(p, u), s), None

    def tx_in_scan(tx):
        # The same K micro-steps through the transformation, looped by a scan
        # inside one jitted call: what the transformation itself costs, apart
        # from the per-call allocation and dispatch of separate calls.
        step = one_update(tx)

        def run(carry, xs, ys):
            carry, _ = jax.lax.scan(lambda c, b: step(c, *b), carry, (xs, ys))
            return carry, None

        return run

    acc_tx = ga.accumulate(adam, k)
    multi = optax.MultiSteps(adam, k)
    candidates = [
        k_micro_steps(acc_tx),
        k_micro_steps(multi),
        Candidate(
            f"{k} x {micro} in one call (scan): accumulate(adam)",
            tx_in_scan(acc_tx),
            (fresh(params), acc_tx.init(params)),
            (xs, ys),
        ),
        Candidate(
            f"{k} x {micro} in one call (scan): optax.MultiSteps(adam)",
            tx_in_scan(multi),
            (fresh(params), multi.init(params)),
            (xs, ys),
        ),
        Candidate(
            f"scan over {k} x {micro} in one step",
            scan_step,
            (fresh(params), adam.init(params)),
            (xs, ys),
        ),
        Candidate(
            f"1 x {k * micro} large batch",
            one_update(adam),
            (fresh(params), adam.init(params)),
            (x, y),
        ),
    ]
    t = medians_ms(candidates, repeats)
    scan = t[f"scan over {k} x {micro} in one step"]
    return [
        {"model": label, "candidate": name, "ms": round(ms, 2), "x_scan": round(ms / scan, 3)}
        for name, ms in t.items()
    ]


print_rows = harness.print_rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__, quick="small sizes, a smoke test")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args(argv)
    repeats = args.repeats or (3 if args.quick else 15)
    width = 512 if args.quick else 4096
    print(
        f"# accumulate benchmark: jax {jax.__version__}, optax {optax.__version__}, "
        f"{jax.devices()[0].platform} ({platform.processor() or platform.machine()}), "
        f"{len(jax.devices())} device(s), repeats={repeats}"
    )
    rows: list[dict] = []

    big = mlp_params([width, width, width])
    label = f"MLP {num_params(big) / 1e6:.1f}M params, {len(jax.tree.leaves(big))} leaves"
    table = optimizer_tables(label, big, repeats)
    print_rows("(a-c) micro-step, boundary step and compiled memory: " + label, table)
    rows += table
    del big

    many = mlp_params([64] * (11 if args.quick else 101))
    label = f"MLP {num_params(many) / 1e6:.2f}M params, {len(jax.tree.leaves(many))} leaves"
    table = optimizer_tables(label, many, repeats)
    print_rows("(a-c) micro-step, boundary step and compiled memory: " + label, table)
    rows += table

    train_repeats = max(3, repeats // 3)
    for sizes in ([width, width, width], [64] * (11 if args.quick else 101)):
        label = f"MLP {num_params(mlp_params(sizes)) / 1e6:.2f}M params"
        table = train_step_table(label, sizes, train_repeats, k=4, micro=64)
        print_rows(f"(d) train step at effective batch 256: {label}", table)
        rows += table
    return rows


if __name__ == "__main__":
    main()
