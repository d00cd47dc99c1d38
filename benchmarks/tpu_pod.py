"""Llama-shaped decoders compiled for TPU pods, without a TPU: per-chip HBM, collectives, compile s.

Needs libtpu (`.venv-tpu`, `bash dev.sh test-tpu` builds it): every program is compiled
ahead of time for a named TPU topology on this machine (docs/tpu.md), from abstract inputs
(`jax.ShapeDtypeStruct`s sharded over the topology's devices), and nothing runs. No model
is ever materialised.

The model: a decoder written in plain JAX, params a dict of per-layer arrays stacked along
a leading layer axis, `jax.lax.scan` over the layers with `jax.checkpoint` on the layer
body (only each layer's input is kept for the backward pass), RMSNorm, grouped-query
attention with rotary embeddings (`jax.nn.dot_product_attention`, XLA's own attention: no
flash kernel, so one layer's recomputation holds its heads' s x s scores), a SwiGLU MLP and
next-token cross entropy over the whole vocabulary. Params, the accumulator and AdamW's
moments are float32; every matmul runs in bfloat16 (each weight is cast before it is
gathered, so the gathers move bfloat16). Shapes (`MODELS`): "1b" is Llama-3.2-1B's (16
layers, d 2048, 32 query / 8 key-value heads, MLP 8192, vocabulary 128,256, tied
embeddings: 1.24B params), "8b" Llama-3-8B's (32 layers, d 4096, 32 / 8 heads of 128, MLP
14,336, untied: 8.03B), "tiny" a 2-layer one for `--quick`.

The mesh is `("data", "fsdp")` with Explicit axes: every weight is sharded over "fsdp"
along its first non-layer dimension (the embedding along the vocabulary, the norms'
scales replicated) and replicated over "data"; the batch (sequences of `--seq` tokens) is
split over both axes. Three train steps (`ROUTES`), each `jax.jit`-compiled with params and
optimizer state donated:

* accumulate: `ga.apply_gradients(ga.accumulate(optax.adamw(...), K), jax.grad(loss), ...)`,
  one call per micro-batch, the loss gathering each layer's weights where it uses them
  (`jax.reshard(w, P())` inside the scanned body): plain FSDP, whose gradient reduction
  XLA places in the backward pass of every micro-step. The window's micro-step and its
  closing step are one program with a conditional inside.
* accumulate_unreduced: the same optimizer with `ga.unreduced_value_and_grad(loss, "data")`
  (docs/distributed.md, HSDP): the gradients are reduced over "fsdp" on every micro-step
  and left unreduced over "data" until the window closes.
* microbatch: `ga.microbatch_value_and_grad(loss, K)` inside one step over the whole
  batch, then `ga.apply_gradients(optax.adamw(...), ...)`: one call per window.

Per program it reads the per-chip bytes of `compiled.memory_analysis()` (arguments: the
params, optimizer state and batch; temporaries), their sum against the chip's HBM (v5e
16 GiB, v5p 95 GiB), and every collective of the compiled HLO (`harness.Hlo`) by kind,
mesh axes and place: on every call or only inside the window's closing branch, inside
the layer loops (per layer) or not (hoisted), with how often it runs per call (loop trip
counts multiplied) and the bytes of its results. The compile time is the wall-clock
seconds of `lower` and of `compile` on this machine.

    .venv-tpu/bin/python benchmarks/tpu_pod.py --quick              # tiny, v5e:2x2
    .venv-tpu/bin/python benchmarks/tpu_pod.py --config 1b-v5e      # one configuration
    .venv-tpu/bin/python benchmarks/tpu_pod.py --json rows.json     # all, rows to a file
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple

# libtpu takes a lock file that lets one process per machine load it; a deviceless compile
# uses no chip, so a second process (a test of the tpu tier, another benchmark) may too.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
import optax

import gradaccum_jax as ga

try:
    import harness
except ModuleNotFoundError:  # imported as benchmarks.tpu_pod (tests/test_tpu_pod.py)
    from benchmarks import harness

P = jax.P
BF16, F32 = jnp.bfloat16, jnp.float32
GIB = 2**30
DATA, FSDP = "data", "fsdp"
BATCH = P((DATA, FSDP), None)
ROUTES = ("accumulate", "accumulate_unreduced", "microbatch")
# The TPU compiler's refusal: "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory
# required for HLO temporaries (48.61G) exceeds available HBM (15.75G)."
OUT_OF_MEMORY = re.compile(r"temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")


class Weight(NamedTuple):
    """A param's global shape and its `PartitionSpec` over the `("data", "fsdp")` mesh."""

    shape: tuple[int, ...]
    spec: jax.sharding.PartitionSpec


def _weights(tree: dict) -> list[Weight]:
    return jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Weight))


@dataclasses.dataclass(frozen=True)
class Decoder:
    """The shapes of a Llama-style decoder."""

    label: str
    vocab: int
    d: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    tied: bool

    def weights(self) -> dict:
        """Every param as a `Weight`: "fsdp" splits the first dimension after the layer axis
        (the embedding's and the head's vocabulary), the norms' scales are replicated."""
        layer, q, kv = self.layers, self.heads * self.head_dim, self.kv_heads * self.head_dim
        split = P(None, FSDP, None)
        tree = {
            "embed": Weight((self.vocab, self.d), P(FSDP, None)),
            "layers": {
                "attn_norm": Weight((layer, self.d), P()),
                "wq": Weight((layer, self.d, q), split),
                "wk": Weight((layer, self.d, kv), split),
                "wv": Weight((layer, self.d, kv), split),
                "wo": Weight((layer, q, self.d), split),
                "mlp_norm": Weight((layer, self.d), P()),
                "w_gate": Weight((layer, self.d, self.ffn), split),
                "w_up": Weight((layer, self.d, self.ffn), split),
                "w_down": Weight((layer, self.ffn, self.d), split),
            },
            "final_norm": Weight((self.d,), P()),
        }
        if not self.tied:
            tree["lm_head"] = Weight((self.d, self.vocab), P(FSDP, None))
        return tree

    def count(self, *, sharded: bool | None = None) -> int:
        """Params: all of them, or those split over "fsdp" (`sharded=True`) or not."""
        return sum(
            math.prod(w.shape)
            for w in _weights(self.weights())
            if sharded is None or (FSDP in w.spec) == sharded
        )


MODELS = {
    "tiny": Decoder("tiny", 1024, 256, 2, 4, 2, 64, 512, tied=False),
    "1b": Decoder("Llama-3.2-1B-shaped", 128256, 2048, 16, 32, 8, 64, 8192, tied=True),
    "8b": Decoder("Llama-3-8B-shaped", 128256, 4096, 32, 32, 8, 128, 14336, tied=False),
}


@dataclasses.dataclass(frozen=True)
class Config:
    """A model on a TPU topology, as a data x fsdp mesh, with the chip's HBM."""

    name: str
    model: str
    topology: str
    mesh: tuple[int, int]  # (data, fsdp)
    hbm_bytes: int
    per_chip: tuple[int, ...]  # sequences per chip and micro-batch to compile


CONFIGS = {
    c.name: c
    for c in (
        Config("tiny-v5e", "tiny", "v5e:2x2", (2, 2), 16 * GIB, (2,)),
        Config("1b-v5e", "1b", "v5e:16x16", (16, 16), 16 * GIB, (4, 16)),
        Config("8b-v5e", "8b", "v5e:16x16", (16, 16), 16 * GIB, (1, 4)),
        Config("8b-v5p", "8b", "v5p:4x4x8", (8, 16), 95 * GIB, (4, 16)),
    )
}


def pod_mesh(config: Config) -> jax.sharding.Mesh:
    """The topology's chips as an Explicit `("data", "fsdp")` mesh."""
    from jax.experimental import topologies

    devices = topologies.get_topology_desc(topology_name=config.topology, platform="tpu").devices
    return jax.sharding.Mesh(
        np.array(devices).reshape(config.mesh),
        (DATA, FSDP),
        axis_types=(jax.sharding.AxisType.Explicit,) * 2,
    )


def abstract_params(model: Decoder, mesh: jax.sharding.Mesh) -> dict:
    return jax.tree.map(
        lambda w: jax.ShapeDtypeStruct(w.shape, F32, sharding=jax.NamedSharding(mesh, w.spec)),
        model.weights(),
        is_leaf=lambda x: isinstance(x, Weight),
    )


def abstract_batch(sequences: int, seq: int, mesh: jax.sharding.Mesh) -> dict:
    """Token ids and their next tokens, `(sequences, seq)` int32, split over both axes."""
    tokens = jax.ShapeDtypeStruct(
        (sequences, seq), jnp.int32, sharding=jax.NamedSharding(mesh, BATCH)
    )
    return {"inputs": tokens, "targets": tokens}


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(F32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
    return (normed * scale.astype(F32)).astype(BF16)


def _rope(x: jax.Array, positions: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    freq = 500000.0 ** (-jnp.arange(half, dtype=F32) / half)
    angle = positions[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., :half].astype(F32), x[..., half:].astype(F32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(BF16)


def decoder_loss(model: Decoder, gather: bool) -> Callable[[dict, dict], jax.Array]:
    """Mean next-token cross entropy of `model`; with `gather`, each weight is cast to
    bfloat16 and all-gathered (`jax.reshard(w, P())`) where it is used: FSDP under explicit
    sharding, whose transpose sums each gradient over the devices of the batch back into the
    weight's shard (libtpu compiles it as an all-reduce over every chip and a slice).
    Without, the weights are used as they come (inside `unreduced_value_and_grad`'s
    `shard_map`, which gathered them)."""

    def weight(w: jax.Array) -> jax.Array:
        w = w.astype(BF16)
        return jax.reshard(w, P()) if gather else w

    def loss(params: dict, batch: dict) -> jax.Array:
        tokens = batch["inputs"]
        b, s = tokens.shape
        embed = weight(params["embed"])
        spec = jax.typeof(tokens).sharding.spec
        x = embed.at[tokens].get(out_sharding=P(*spec, None))
        positions = jnp.arange(s, dtype=F32)

        def layer(x: jax.Array, p: dict) -> tuple[jax.Array, None]:
            h = _rms_norm(x, weight(p["attn_norm"]))
            q = _rope((h @ weight(p["wq"])).reshape(b, s, model.heads, model.head_dim), positions)
            k = _rope(
                (h @ weight(p["wk"])).reshape(b, s, model.kv_heads, model.head_dim), positions
            )
            v = (h @ weight(p["wv"])).reshape(b, s, model.kv_heads, model.head_dim)
            attention = jax.nn.dot_product_attention(q, k, v, is_causal=True)
            x = x + attention.reshape(b, s, -1) @ weight(p["wo"])
            h = _rms_norm(x, weight(p["mlp_norm"]))
            mlp = jax.nn.silu(h @ weight(p["w_gate"])) * (h @ weight(p["w_up"]))
            return x + mlp @ weight(p["w_down"]), None

        x, _ = jax.lax.scan(jax.checkpoint(layer), x, params["layers"])
        head = embed.T if model.tied else weight(params["lm_head"])
        logits = (_rms_norm(x, weight(params["final_norm"])) @ head).astype(F32)
        gold = jnp.take_along_axis(logits, batch["targets"][..., None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - gold)

    return loss


def adamw() -> optax.GradientTransformation:
    return optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1)


def train_step(route: str, model: Decoder, k: int) -> tuple[Any, Callable]:
    """`(tx, step)`: the optimizer and `step(params, state, batch) -> (params, state)`."""
    if route == "microbatch":
        tx = adamw()
        grad_fn = ga.microbatch_value_and_grad(decoder_loss(model, gather=True), k)
    else:
        tx = ga.accumulate(adamw(), k)
        if route == "accumulate":
            grad_fn = jax.value_and_grad(decoder_loss(model, gather=True))
        else:
            grad_fn = ga.unreduced_value_and_grad(
                decoder_loss(model, gather=False), DATA, reduce_value=False
            )

    def step(params, state, batch):
        _, grads = grad_fn(params, batch)
        return ga.apply_gradients(tx, grads, state, params)

    return tx, step


def _on(mesh: jax.sharding.Mesh, tree: Any) -> Any:
    """`jax.eval_shape`'s structs (typed on the abstract mesh, or untyped scalars) placed on
    the chips of `mesh`."""

    def place(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        spec = P() if x.sharding is None else x.sharding.spec
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.NamedSharding(mesh, spec))

    return jax.tree.map(place, tree)


def compile_step(config: Config, route: str, per_chip: int, seq: int, k: int) -> dict:
    """Compiles one route's train step for `config`; returns its row."""
    model, mesh = MODELS[config.model], pod_mesh(config)
    chips = mesh.devices.size
    micro = per_chip * chips  # sequences per micro-batch
    tx, step = train_step(route, model, k)
    with jax.set_mesh(mesh):
        params = abstract_params(model, mesh)
        batch = abstract_batch(micro * (k if route == "microbatch" else 1), seq, mesh)
        state = _on(mesh, jax.eval_shape(tx.init, params))
        if route == "accumulate_unreduced":
            # The first update retypes the accumulator as unreduced over "data"; compile the
            # program every later micro-step runs.
            state = _on(mesh, jax.eval_shape(step, params, state, batch)[1])
        jitted = jax.jit(step, donate_argnums=(0, 1))
        start = time.perf_counter()
        lowered = jitted.lower(params, state, batch)
        lowered_s = time.perf_counter() - start
        compiled, error = None, ""
        try:
            compiled = lowered.compile()
        except jax.errors.JaxRuntimeError as err:
            # The TPU compiler refuses a program whose temporaries exceed the HBM it allows.
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            error = str(err)
        compile_s = time.perf_counter() - start - lowered_s
    row = {
        "config": config.name,
        "model": model.label,
        "params": model.count(),
        "topology": config.topology,
        "chips": chips,
        "mesh": f"data {config.mesh[0]} x fsdp {config.mesh[1]}",
        "route": route,
        "k": k,
        "seq": seq,
        "per_chip": per_chip,
        "tokens_per_window": micro * k * seq,
        "hbm_bytes": config.hbm_bytes,
        "lower_s": round(lowered_s, 1),
        "compile_s": round(compile_s, 1),
    }
    if compiled is None:
        used = OUT_OF_MEMORY.search(error)
        return {
            **row,
            "fits": False,
            "compiler_temp_bytes": int(float(used.group(1)) * GIB) if used else None,
            "compiler_hbm_bytes": int(float(used.group(2)) * GIB) if used else None,
            "error": " ".join(error.split())[:400],
        }
    memory = harness.compiled_memory(compiled)
    hlo = harness.Hlo(compiled)
    used = memory.argument_bytes + memory.temp_bytes
    return {
        **row,
        "argument_bytes": memory.argument_bytes,
        "temp_bytes": memory.temp_bytes,
        "output_bytes": memory.output_bytes,
        "alias_bytes": memory.alias_bytes,
        "hbm_fraction": round(used / config.hbm_bytes, 3),
        "fits": used <= config.hbm_bytes,
        "collectives": collectives(hlo, dict(mesh.shape)),
        "per_window": per_window(hlo, dict(mesh.shape), 1 if route == "microbatch" else k),
    }


def _label(op: str, axes: tuple) -> str:
    short = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG"}.get(op, op)
    return f"{short}@{'+'.join(axes) or 'none'}"


def collectives(hlo: harness.Hlo, mesh_shape: dict) -> list[dict]:
    """Every collective kind of the program: place ("every call" or "once", in the window's
    closing branch), whether it sits in a loop (the layer scans, the micro-batch loop), how
    many instructions, how many runs per call and the bytes of their results per call."""
    runs = hlo.computation_runs()
    found: dict[tuple, list[int]] = {}
    for c in hlo.collectives(mesh_shape):
        place = "every call" if c.place == "every step" else "once"
        key = (place, _label(c.op, c.axes), "loop" if c.in_loop else "hoisted")
        n = runs.get(c.instruction.computation, 1)
        entry = found.setdefault(key, [0, 0, 0])
        entry[0] += 1
        entry[1] += n
        entry[2] += n * c.nbytes
    return [
        {"place": p, "op": op, "where": where, "instructions": i, "runs": r, "bytes": b}
        for (p, op, where), (i, r, b) in sorted(found.items())
    ]


def per_window(hlo: harness.Hlo, mesh_shape: dict, calls: int) -> dict:
    """Runs and bytes of results per window of `calls` calls, by the axes the groups span:
    what runs on every call counts `calls` times, what runs in the closing branch once."""
    out: dict[str, list[int]] = {}
    for row in collectives(hlo, mesh_shape):
        times = calls if row["place"] == "every call" else 1
        axes = row["op"].split("@")[1]
        entry = out.setdefault(axes, [0, 0])
        entry[0] += times * row["runs"]
        entry[1] += times * row["bytes"]
    return {axes: {"runs": r, "bytes": b} for axes, (r, b) in sorted(out.items())}


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def _summary(row: dict) -> str:
    if "error" in row:
        temp, hbm = _gib(row["compiler_temp_bytes"]), _gib(row["compiler_hbm_bytes"])
        return f"refused: temp {temp} GiB, the compiler's HBM {hbm} GiB"
    return f"args {_gib(row['argument_bytes'])} GiB, temp {_gib(row['temp_bytes'])} GiB"


def print_tables(rows: list[dict]) -> None:
    harness.print_rows(
        "per-chip HBM (GiB) and compile time (s)",
        [
            {
                "config": r["config"],
                "route": r["route"],
                "K": r["k"],
                "seqs/chip x seq": f"{r['per_chip']} x {r['seq']}",
                "args": _gib(r.get("argument_bytes")),
                "temp": _gib(r.get("temp_bytes", r.get("compiler_temp_bytes"))),
                "(args+temp)/HBM": r.get("hbm_fraction", "-"),
                "fits": "yes" if r["fits"] else "refused" if "error" in r else "NO",
                "lower": r["lower_s"],
                "compile": r["compile_s"],
            }
            for r in rows
        ],
    )
    compiled = [r for r in rows if "collectives" in r]
    harness.print_rows(
        "collectives per call: runs (instructions), MB of results",
        [
            {
                "config": r["config"],
                "route": r["route"],
                "seqs/chip": r["per_chip"],
                "place": c["place"],
                "op@axes": c["op"],
                "where": c["where"],
                "runs (instr)": f"{c['runs']} ({c['instructions']})",
                "MB": f"{c['bytes'] / 1e6:.1f}",
            }
            for r in compiled
            for c in r["collectives"]
        ],
    )
    harness.print_rows(
        "collectives per window of K micro-batches, by axes: runs, MB of results",
        [
            {
                "config": r["config"],
                "route": r["route"],
                "seqs/chip": r["per_chip"],
                **{
                    axes: f"{v['runs']}, {v['bytes'] / 1e6:.0f}"
                    for axes, v in r["per_window"].items()
                },
            }
            for r in compiled
        ],
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = harness.benchmark_parser(__doc__, quick="the tiny decoder on v5e:2x2 only")
    parser.add_argument(
        "--config",
        action="append",
        choices=sorted(CONFIGS),
        help="a configuration to compile (repeatable; default: all but tiny-v5e)",
    )
    parser.add_argument(
        "--route", action="append", choices=ROUTES, help="a step to compile (repeatable)"
    )
    parser.add_argument(
        "--per-chip", type=int, action="append", help="sequences per chip (repeatable)"
    )
    parser.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    parser.add_argument("--k", type=int, default=8, help="micro-batches per window")
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    names = ["tiny-v5e"] if args.quick else args.config or [n for n in CONFIGS if n != "tiny-v5e"]
    seq = args.seq or (128 if args.quick else 2048)
    rows = []
    for name in names:
        config = CONFIGS[name]
        for route in args.route or ROUTES:
            # The micro-batch sizes of the sweep on the first route; the others at the first.
            sizes = args.per_chip or (
                config.per_chip if route == ROUTES[0] else config.per_chip[:1]
            )
            for per_chip in sizes:
                row = compile_step(config, route, per_chip, seq, args.k)
                summary = f"{_summary(row)}, compile {row['compile_s']} s"
                print(f"{name} {route} {per_chip}/chip: {summary}", flush=True)
                rows.append(row)
    print_tables(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
