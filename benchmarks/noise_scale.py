"""Cost of measuring the gradient noise scale: `accumulate(track_noise_scale=True)` vs off.

A micro-step (not closing the window) and a closing step of
`accumulate(optax.adam(1e-3), K)` on a ~8M-parameter float32 tree, jitted
with the state donated, timed interleaved (median of repetitions). Tracking
adds one squared norm of the micro-gradient per micro-step and two scalars to
the window's reduction; the targets are a micro-step time ratio <= 1.05 and
no extra parameter-sized temporary (compiled temp bytes, on vs off).

    python benchmarks/noise_scale.py [--quick]
"""

from __future__ import annotations

import time

import harness
import jax
import numpy as np
import optax
from clipping import make_tree

import gradaccum_jax as ga

K = 4


def _step(tx):
    return jax.jit(lambda g, s, p: tx.update(g, s, p)[::-1], donate_argnums=1)


def measure(total: int, reps: int) -> list[dict]:
    params = make_tree(total, seed=0)
    grads = make_tree(total, seed=1)
    size = sum(x.size for x in jax.tree.leaves(params))
    txs = {
        flag: ga.accumulate(optax.adam(1e-3), K, track_noise_scale=flag) for flag in (False, True)
    }
    steps = {flag: _step(tx) for flag, tx in txs.items()}
    temp = {
        flag: steps[flag]
        .lower(grads, txs[flag].init(params), params)
        .compile()
        .memory_analysis()
        .temp_size_in_bytes
        for flag in txs
    }
    states = {flag: tx.init(params) for flag, tx in txs.items()}
    times: dict[tuple[bool, bool], list[float]] = {}
    for rep in range(reps + 1):
        for micro in range(K):
            for flag in (False, True):
                start = time.perf_counter()
                states[flag], _ = jax.block_until_ready(steps[flag](grads, states[flag], params))
                if rep:  # the first window compiles and warms up
                    times.setdefault((flag, micro == K - 1), []).append(time.perf_counter() - start)
    rows = []
    for closing in (False, True):
        off = float(np.median(times[(False, closing)]))
        on = float(np.median(times[(True, closing)]))
        rows.append(
            {
                "benchmark": "noise_scale",
                "step": "window close" if closing else "micro-step",
                "params": size,
                "ms_off": 1e3 * off,
                "ms_on": 1e3 * on,
                "on_vs_off": on / off,
                "temp_bytes_off": temp[False],
                "temp_bytes_on": temp[True],
            }
        )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__)
    args = parser.parse_args(argv)
    total = 100_000 if args.quick else 8_000_000
    reps = 3 if args.quick else 15
    rows = measure(total, reps)
    print(f"noise_scale: {rows[0]['params'] / 1e6:.1f}M float32 parameters, adam, K={K}")
    print(f"{'step':<14} {'off ms':>8} {'on ms':>8} {'on/off':>7} {'temp off':>10} {'temp on':>10}")
    for r in rows:
        print(
            f"{r['step']:<14} {r['ms_off']:8.2f} {r['ms_on']:8.2f} {r['on_vs_off']:7.3f} "
            f"{r['temp_bytes_off']:10d} {r['temp_bytes_on']:10d}"
        )
    return rows


if __name__ == "__main__":
    main()
