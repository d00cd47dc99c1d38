"""Pipeline schedules on a (stage=4, data=2) host mesh: exactness, temp, bubble, collectives.

`ga.pipeline_value_and_grad` under global-view `jax.jit` (`jax.set_mesh`) on 8 host
devices, the toy model of docs/design pipeline.md section 3: an input projection
32 -> 128 on the first stage, residual tanh-MLP blocks (H = 128, two per virtual stage,
so the v = 2 schedules run a model twice as deep), a softmax cross-entropy head over 10
classes on the last stage, float32. Each data shard holds N micro-batches of 32 rows, so
the global batch is 64 N. Candidates, at N in {S-1, S, 2S, 8S} (`--quick`: S only):

* ``gpipe``, ``1f1b``, ``interleaved`` (v = 2), ``circular`` (v = 2): one schedule of N;
* ``nested``: gradient accumulation outside the pipeline, an outer `jax.lax.scan` over
  K = N / 4 calls of a gpipe `grad_fn` of M = 4 micro-batches, the gradients summed
  (MaxText's and torchtitan's arrangement: K fills and drains per step).

Per row:

* ``max_rel_err``: the largest over the loss and gradient leaves of max |g - g_ref| /
  max |g_ref|, against `jax.value_and_grad(grad_fn.sequential)` on the whole batch;
* ``temp_bytes``: `compiled.memory_analysis().temp_size_in_bytes` (per device);
* ``bubble`` from `ga.pipeline_schedule`'s table beside ``formula`` (S-1)/(vN+S-1); for
  nested, the table of one gpipe schedule of M and (S-1)/(M+S-1);
* ``permutes_run`` and ``all_reduces_run``: collective-permutes and all-reduces one step
  runs, read from the compiled HLO with `harness.Hlo.runs` (each op times the known trip
  counts of its enclosing loops; an op in a conditional's branch at most once per run of
  the conditional), beside ``permutes_needed``: what the table needs, the slots up to its
  last forward send plus those from its first backward send (a permute each). Where the
  forward sends end before the backward ones start (gpipe, circular), the executor's
  forward loop runs up to the first backward send, one or two permutes more;
* ``all_reduces_in_loops``: all-reduce ops inside any while loop (0 for every schedule: the
  gradient is reduced once, after the schedule; nested reduces once per call, inside its
  outer scan);
* ``compile_s``: a fresh `jax.jit(step).lower(...).compile()` after `jax.clear_caches()`.

A summary table gives compile times at N = 2S and 8S and the two memory targets: 1F1B temp
at N = 8S over N = 2S (target at most 1.05x: its stash does not grow with N) and 1F1B over
GPipe at N >= 4S (target below 1). With `--time` a last table times the schedules at
N = 2S in one interleaved run: the 8 host devices share this machine's cores, so it is
shared-core host time, not a pipeline's speed.

    python benchmarks/pipeline.py [--quick] [--time] [--reps 5]
"""

from __future__ import annotations

import os
import time

# XLA reads the device count once, when the CPU backend starts: set it before jax.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8"]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import harness
import jax
import jax.numpy as jnp
import numpy as np

import gradaccum_jax as ga

S, D = 4, 2  # stages, data shards
IN, H, CLASSES = 32, 128, 10
ROWS = 32  # rows per micro-batch and data shard
BLOCKS_PER_STAGE = 2  # per virtual stage
NESTED_M = 4
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("circular", 2))
P = jax.P


def stage_fn(blocks, x):
    def block(x, w):
        return x + jnp.tanh(x @ w["w"] + w["b"]), None

    return jax.lax.scan(block, x, blocks)[0]


def embed_fn(outer, batch):
    return batch["x"] @ outer["w_in"]


def loss_fn(outer, y, batch):
    logits = y @ outer["w_out"]
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], 1))


def init_params(v: int) -> dict:
    rng = np.random.default_rng(0)
    layers = S * v * BLOCKS_PER_STAGE
    blocks = {
        "w": (rng.normal(size=(layers, H, H)) / np.sqrt(H) / 2).astype(np.float32),
        "b": np.zeros((layers, H), np.float32),
    }
    # stack_stages takes (L, ...) layers to (S, [v,] L / (S v), ...): two per virtual stage.
    return {
        "stages": ga.stack_stages(blocks, S, v),
        "w_in": (rng.normal(size=(IN, H)) / np.sqrt(IN)).astype(np.float32),
        "w_out": (rng.normal(size=(H, CLASSES)) / np.sqrt(H)).astype(np.float32),
    }


def make_batch(n: int) -> dict:
    rng = np.random.default_rng(n)
    rows = n * ROWS * D
    return {
        "x": rng.normal(size=(rows, IN)).astype(np.float32),
        "y": rng.integers(0, CLASSES, size=rows).astype(np.int32),
    }


def place(mesh, params, batch, batch_spec):
    stages = jax.NamedSharding(mesh, P("stage"))
    replicated = jax.NamedSharding(mesh, P())
    params = {
        k: jax.device_put(p, stages if k == "stages" else replicated) for k, p in params.items()
    }
    return params, jax.device_put(batch, jax.NamedSharding(mesh, batch_spec))


def pipelined(schedule: str, v: int, n: int):
    return ga.pipeline_value_and_grad(
        stage_fn,
        loss_fn,
        embed_fn=embed_fn,
        num_microbatches=n,
        schedule=schedule,
        num_chunks=v,
    )


def nested(n: int):
    """K = n / M gpipe calls of M micro-batches in an outer scan; the batch comes as (K, ...)."""
    inner = pipelined("gpipe", 1, NESTED_M)
    k = n // NESTED_M

    def grad_fn(params, batches):
        def call(acc, batch):
            loss, grads = inner(params, batch)
            return jax.tree.map(jnp.add, acc, (loss, grads)), None

        zeros = jax.tree.map(jnp.zeros_like, (jnp.float32(0.0), params))
        total = jax.lax.scan(call, zeros, batches)[0]
        # Each call is its part's mean over equal-sized parts: the step's mean is their mean.
        return jax.tree.map(lambda x: x / k, total)

    return grad_fn, inner


def permutes_from_table(table) -> int:
    """Permutes the table implies: one per slot from the first slot to the last forward send,
    and one per slot from the first backward send to the end."""
    on, back = table.sends()
    t = table.num_slots
    forward = t - int(np.argmax(on[::-1])) if on.any() else 0
    backward = t - int(np.argmax(back)) if back.any() else 0
    return forward + backward


def compile_fresh(fn, *args):
    jax.clear_caches()
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, time.perf_counter() - start


def measure(mesh, candidate: str, v: int, n: int, references: dict) -> tuple[dict, object]:
    params_host, batch_host = init_params(v), make_batch(n)
    if candidate == "nested":
        grad_fn, inner = nested(n)
        k = n // NESTED_M
        # Part i holds every K-th row, so each part splits over "data" like the whole batch.
        parts = jax.tree.map(
            lambda x: np.swapaxes(x.reshape(-1, k, *x.shape[1:]), 0, 1), batch_host
        )
        params, batch = place(mesh, params_host, parts, P(None, "data"))
        table = ga.pipeline_schedule("gpipe", S, NESTED_M)
        formula = (S - 1) / (NESTED_M + S - 1)
        reference_fn = inner.sequential
        expected_permutes = k * permutes_from_table(table)
    else:
        grad_fn = pipelined(candidate, v, n)
        params, batch = place(mesh, params_host, batch_host, P("data"))
        table = ga.pipeline_schedule(candidate, S, n, v)
        formula = table.formula_bubble
        reference_fn = grad_fn.sequential
        expected_permutes = permutes_from_table(table)
    compiled, seconds = compile_fresh(grad_fn, params, batch)
    out = compiled(params, batch)
    # The unstaged model is the same for every candidate of one (v, N): computed once.
    if (v, n) not in references:
        references[(v, n)] = jax.jit(jax.value_and_grad(reference_fn))(params_host, batch_host)
    reference = references[(v, n)]
    hlo = harness.Hlo(compiled)
    row = {
        "schedule": candidate,
        "v": v,
        "N": n,
        "max_rel_err": f"{harness.max_relative_error(out, reference):.1e}",
        "temp_bytes": harness.compiled_memory(compiled).temp_bytes,
        "bubble": round(table.bubble, 3),
        "formula": round(formula, 3),
        "permutes_run": hlo.runs("collective-permute"),
        "permutes_needed": expected_permutes,
        "all_reduces_run": hlo.runs("all-reduce"),
        "all_reduces_in_loops": len(hlo.ops("all-reduce", hlo.in_loops())),
        "compile_s": round(seconds, 2),
    }
    return row, (compiled, params, batch)


def summary(rows: list[dict], sizes: tuple[int, ...]) -> list[dict]:
    temp = {(r["schedule"], r["N"]): r["temp_bytes"] for r in rows}
    secs = {(r["schedule"], r["N"]): r["compile_s"] for r in rows}
    out = []
    for n in (2 * S, 8 * S):
        if n in sizes:
            out.append(
                {"figure": f"compile s, N={n}"}
                | {
                    name: secs.get((name, n), "")
                    for name in dict.fromkeys(r["schedule"] for r in rows)
                }
            )
    if 2 * S in sizes and 8 * S in sizes:
        ratio = temp[("1f1b", 8 * S)] / temp[("1f1b", 2 * S)]
        out.append(
            {
                "figure": f"1f1b temp N={8 * S} / N={2 * S}",
                "value": round(ratio, 3),
                "target": "<= 1.05",
            }
        )
    for n in sizes:
        if n >= 4 * S:
            ratio = temp[("1f1b", n)] / temp[("gpipe", n)]
            out.append(
                {"figure": f"1f1b / gpipe temp, N={n}", "value": round(ratio, 3), "target": "< 1"}
            )
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    reps = "timed rounds with --time (default 5)"
    parser = harness.benchmark_parser(__doc__, quick="N = S only", reps=reps)
    parser.add_argument("--time", action="store_true", help="time the schedules at N = 2S")
    args = parser.parse_args(argv)
    sizes = (S,) if args.quick else (S - 1, S, 2 * S, 8 * S)
    mesh = jax.make_mesh(
        (S, D), ("stage", "data"), axis_types=(jax.sharding.AxisType.Explicit,) * 2
    )
    print(
        f"{mesh.devices.size} host devices, mesh (stage={S}, data={D}), global-view jit; "
        f"{BLOCKS_PER_STAGE} tanh-MLP blocks (H={H}) per virtual stage, {ROWS} rows per "
        f"micro-batch and data shard, float32; nested = {NESTED_M}-micro-batch gpipe calls "
        "in an outer scan"
    )
    rows, programs, references = [], {}, {}
    with jax.set_mesh(mesh):
        for n in sizes:
            for name, v in (*SCHEDULES, ("nested", 1)):
                if name == "nested" and n % NESTED_M:
                    continue  # K = N / M calls need M to divide N
                row, program = measure(mesh, name, v, n, references)
                rows.append(row)
                programs[(name, n)] = program
        harness.print_rows("pipeline schedules per step (S = 4 stages, D = 2 data shards)", rows)
        targets = summary(rows, sizes)
        harness.print_rows("compile time and memory targets", targets)
        timed = []
        if args.time:
            n = 2 * S
            fns = {
                name: (lambda c=c, p=p, b=b: c(p, b))
                for (name, m), (c, p, b) in programs.items()
                if m == n
            }
            medians = harness.interleaved_medians(fns, args.reps or 5)
            timed = [
                {"schedule": name, "N": n, "host_ms": round(1e3 * t, 1)}
                for name, t in medians.items()
            ]
            harness.print_rows(
                f"shared-core host time per step at N = {n} (8 host devices on this machine's "
                "cores: not a pipeline's speed)",
                timed,
            )
    return rows + targets + timed


if __name__ == "__main__":
    main()
