"""Measuring tools shared by the benchmarks and the tests.

One place answers the questions both ask of a compiled step:

* `interleaved_times` / `interleaved_medians`: how long each of several callables takes, called in
  turn (the order reversed every other round) so machine drift hits them alike;
* `compiled_memory`: temp, argument, output and alias bytes of a compiled
  program, and the peak they imply;
* `Hlo`: the compiled program's text parsed into computations and
  instructions, to count parameter-sized copies (`Hlo.copies`) and collectives
  (`Hlo.ops`), split into what runs on every step (`Hlo.every_step`) and what
  runs only inside a conditional's branches, once per window; `Hlo.runs`: how many ops of a
  kind one call runs, with the loops' trip counts (`Hlo.in_loops`: what runs inside loops;
  `Hlo.computation_runs`: how often each computation runs);
  `Hlo.collectives`: each collective with its mesh axes, its place (every step or in a
  branch, in a loop or not) and whether it runs asynchronously; `Hlo.fusions`: the kernels;
* `benchmark_parser`: the command line every benchmark takes (`--quick`, `--reps`).

`Hlo` reads the programs of XLA:CPU and of the TPU compiler (a program compiled for a TPU
topology without a TPU, docs/tpu.md): the TPU's layouts name a memory space
(`f32[8,128]{1,0:T(8,128)S(1)}`: `S(1)` is the on-chip VMEM), its copies between memory
spaces are prefetches and evictions, not copies (`Hlo.memory_moves`), its asynchronous ops
come as `-start`/`-done` pairs (the op's result is its `-done`'s), a collective may run
inside an `async-start`'s wrapped computation or be split into the steps of one chain
(`chain_id`, "async collective fusion": one op here), and its loops carry no
`known_trip_count` (`Hlo.trip_count` reads the counter instead).

Tests import it as `benchmarks.harness` (the repository root is on `sys.path`
under pytest); the benchmark scripts, run from `benchmarks/`, as `harness`.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import re
import statistics
import time
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

COLLECTIVES = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")


def interleaved_times(
    fns: Mapping[Hashable, Callable[[], Any]], repeats: int, *, warmup: int = 1
) -> dict[Hashable, list[float]]:
    """Wall-clock seconds of each callable in every round, measured side by side.

    Every round calls each callable once and waits for its result
    (`jax.block_until_ready`); odd rounds go in reverse order, so neither the
    first nor the last position favours one candidate. `warmup` untimed rounds
    come first (compilation, first-touch page faults). Round `i` of two
    candidates ran back to back, so their ratio per round shows the spread.
    """
    for _ in range(warmup):
        for fn in fns.values():
            jax.block_until_ready(fn())
    times: dict[Hashable, list[float]] = {name: [] for name in fns}
    for round_ in range(repeats):
        order = list(fns) if round_ % 2 == 0 else list(reversed(list(fns)))
        for name in order:
            start = time.perf_counter()
            jax.block_until_ready(fns[name]())
            times[name].append(time.perf_counter() - start)
    return times


def interleaved_medians(
    fns: Mapping[Hashable, Callable[[], Any]], repeats: int, *, warmup: int = 1
) -> dict[Hashable, float]:
    """Median wall-clock seconds per call of each callable (`interleaved_times`)."""
    times = interleaved_times(fns, repeats, warmup=warmup)
    return {name: statistics.median(t) for name, t in times.items()}


def ratio_quartiles(numerator: list[float], denominator: list[float]) -> tuple[float, float, float]:
    """Median and quartiles of the per-round ratios of two `interleaved_times` lists."""
    ratios = [a / b for a, b in zip(numerator, denominator, strict=True)]
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return median, q1, q3


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """Bytes of a compiled program, from `compiled.memory_analysis()`."""

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Live bytes at the worst moment: outputs that alias a donated argument count once."""
        return self.temp_bytes + self.argument_bytes + self.output_bytes - self.alias_bytes


def compiled_memory(compiled: Any) -> CompiledMemory:
    stats = compiled.memory_analysis()
    return CompiledMemory(
        temp_bytes=int(stats.temp_size_in_bytes),
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
    )


# --- compiled HLO ------------------------------------------------------------------------

# A computation header starts at column 0: `%name (params) -> type {` or `ENTRY %name ...`.
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{$")
# `%name = TYPE opcode(`: TYPE may be a tuple with spaces and `/*index=5*/` comments,
# so it is the shortest text before the first ` opcode(`.
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
# An array type and its layout: `f32[8,128]{1,0:T(8,128)S(1)}` (TPU: tiles, memory space 1).
_ARRAY_TYPE = re.compile(r"\b([a-z][a-z0-9]*)\[([\d,]*)\](?:\{([^}]*)\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_CHAIN = re.compile(r'\bchain_id="([^"]+)"')
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition)=\{?([^,}\s]+(?:, *%[\w.\-]+)*)\}?")
_CALLS = re.compile(r"\bcalls=\{?([^,}\s]+(?:, *%[\w.\-]+)*)\}?")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_LOOP_PART = re.compile(r"\b(body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(
    r"\b(?:branch_computations=\{([^}]*)\}|true_computation=(%?[\w.\-]+)"
    r"|false_computation=(%?[\w.\-]+))"
)


def _names(text: str) -> list[str]:
    return [name.strip().lstrip("%") for name in text.split(",") if name.strip()]


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: `name = types opcode(operands), attributes`."""

    computation: str
    name: str
    opcode: str
    # (dtype, dims) of every array in the result; for an asynchronous `-start`, those of its
    # `-done`: what the op produces (the start's own tuple also holds operands and contexts).
    types: tuple[tuple[str, tuple[int, ...]], ...]
    operands: tuple[str, ...]
    attributes: str
    line: str
    # The memory space of each array of `types` (the layout's `S(n)`; 0, the default memory,
    # where the layout names none: every array on CPU, HBM on TPU).
    memory_spaces: tuple[int, ...] = ()

    @property
    def chain(self) -> str | None:
        """The `chain_id` of a collective split into steps (TPU async collective fusion)."""
        found = _CHAIN.search(self.attributes)
        return found.group(1) if found else None

    @property
    def elements(self) -> int:
        return sum(math.prod(dims) for _, dims in self.types)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(dims) * _itemsize(dtype) for dtype, dims in self.types)

    def nbytes_in(self, space: int) -> int:
        """Bytes of the result's arrays in memory space `space` (0: HBM on a TPU, and every
        array on XLA:CPU; 1: the TPU's VMEM)."""
        spaces = self.memory_spaces or (0,) * len(self.types)
        return sum(
            math.prod(dims) * _itemsize(dtype)
            for (dtype, dims), found in zip(self.types, spaces, strict=True)
            if found == space
        )


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program (`Hlo.collectives`)."""

    op: str  # one of COLLECTIVES
    axes: tuple[Hashable, ...]  # the mesh axes its groups span
    place: str  # "every step" (outside conditional branches) or "once" (inside a branch)
    in_loop: bool  # inside a `while` loop's body or condition
    asynchronous: bool  # a `-start`/`-done` pair, a chain's step or an async-wrapped op
    nbytes: int  # bytes of its result
    instruction: Instruction


def _tuple_index(inst: Instruction | None) -> int | None:
    """The index of a `get-tuple-element`, or None for any other instruction."""
    if inst is None or inst.opcode != "get-tuple-element":
        return None
    found = re.search(r"\bindex=(\d+)", inst.attributes)
    return int(found.group(1)) if found else None


def _constant(inst: Instruction | None) -> int | None:
    """The value of an integer scalar `constant` (`s32[] constant(8)`), or None."""
    if inst is None or inst.opcode != "constant":
        return None
    found = re.search(r"constant\((-?\d+)\)", inst.line)
    return int(found.group(1)) if found else None


def _permute_pairs(attributes: str) -> list[tuple[int, ...]]:
    """The (source, target) pairs of a `collective-permute`."""
    found = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", attributes)
    pairs = re.findall(r"\{(\d+),(\d+)\}", found.group(1)) if found else []
    return [(int(a), int(b)) for a, b in pairs] or [()]


def _itemsize(hlo_dtype: str) -> int:
    if hlo_dtype == "pred":
        return 1
    bits = re.search(r"\d+", hlo_dtype)
    return max(1, int(bits.group()) // 8) if bits else 0


def _split_call(rest: str) -> tuple[str, str]:
    """Splits `operands), attributes` at the parenthesis that closes the operand list."""
    depth = 1
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            return rest[:i], rest[i + 1 :]
    return rest, ""


def _give_starts_their_results(insts: list[Instruction]) -> None:
    """Gives each asynchronous `-start` of a computation the result of its `-done`."""
    position = {inst.name: i for i, inst in enumerate(insts)}
    for done in insts:
        if not done.opcode.endswith("-done") or not done.operands:
            continue
        i = position.get(done.operands[0])
        if i is not None and insts[i].opcode.endswith("-start"):
            insts[i] = dataclasses.replace(
                insts[i], types=done.types, memory_spaces=done.memory_spaces
            )


class Hlo:
    """A compiled program's HLO text, parsed into computations of instructions."""

    def __init__(self, compiled_or_text: Any):
        text = compiled_or_text if isinstance(compiled_or_text, str) else compiled_or_text.as_text()
        self.text = text
        self.computations: dict[str, list[Instruction]] = {}
        self.entry = ""
        current: list[Instruction] | None = None
        name = ""
        for line in text.splitlines():
            header = None if line.startswith(" ") else _HEADER.match(line)
            if header:
                name = header.group(2)
                current = self.computations[name] = []
                if header.group(1):
                    self.entry = name
                continue
            match = _INSTRUCTION.match(line) if current is not None else None
            if match:
                operands, attributes = _split_call(match.group(4))
                arrays = _ARRAY_TYPE.findall(match.group(2))
                current.append(
                    Instruction(
                        computation=name,
                        name=match.group(1),
                        opcode=match.group(3),
                        types=tuple(
                            (dtype, tuple(int(d) for d in dims.split(",") if d))
                            for dtype, dims, _ in arrays
                        ),
                        operands=tuple(re.findall(r"%([\w.\-]+)", operands)),
                        attributes=attributes,
                        line=line.strip(),
                        memory_spaces=tuple(
                            int(space.group(1)) if (space := _MEMORY_SPACE.search(layout)) else 0
                            for _, _, layout in arrays
                        ),
                    )
                )
        if not self.entry:
            raise ValueError("no ENTRY computation in the HLO text")
        for insts in self.computations.values():
            _give_starts_their_results(insts)
        self._by_name = {
            (inst.computation, inst.name): inst
            for insts in self.computations.values()
            for inst in insts
        }
        # Who calls each computation (the first caller: XLA gives every fused, wrapped or
        # branch computation its own copy), and which computations run inside one kernel.
        self._caller: dict[str, Instruction] = {}
        for inst in self.instructions():
            for callee in self.callees(inst) + self.branches(inst):
                self._caller.setdefault(callee, inst)
        self._fused = self.reachable(
            callee
            for inst in self.instructions()
            if inst.opcode == "fusion"
            for callee in self.callees(inst)
        )
        # A collective split into the steps of one chain counts once, as its first step.
        self._steps: set[tuple[str, str]] = set()
        seen: set[tuple[str, str, str]] = set()
        for inst in self.instructions():
            if inst.chain is not None:
                key = (inst.opcode, inst.chain, self.place(inst))
                if key in seen:
                    self._steps.add((inst.computation, inst.name))
                seen.add(key)

    # -- structure --

    @staticmethod
    def callees(inst: Instruction) -> list[str]:
        return [n for m in _CALLEE.finditer(inst.attributes) for n in _names(m.group(1))]

    @staticmethod
    def loop_parts(inst: Instruction) -> dict[str, str]:
        """A `while` instruction's computations: {"body": name, "condition": name}."""
        return {m.group(1): m.group(2) for m in _LOOP_PART.finditer(inst.attributes)}

    @staticmethod
    def branches(inst: Instruction) -> list[str]:
        """The branch computations of a `conditional` (empty for other instructions)."""
        return [
            n
            for m in _BRANCHES.finditer(inst.attributes)
            for n in _names(next(g for g in m.groups() if g))
        ]

    def reachable(self, roots: Iterable[str], *, into_branches: bool = True) -> set[str]:
        """Computations called from `roots` (included), transitively."""
        seen: set[str] = set()
        todo = list(roots)
        while todo:
            name = todo.pop()
            if name in seen or name not in self.computations:
                continue
            seen.add(name)
            for inst in self.computations[name]:
                todo += self.callees(inst)
                if into_branches:
                    todo += self.branches(inst)
        return seen

    def place(self, inst: Instruction) -> str:
        """The computation that runs `inst` as one of its steps: its own, or for an op inside
        a fusion or an asynchronous wrapper, the computation of the kernel that holds it."""
        name = inst.computation
        while name in self._caller and (
            name in self._fused or self._caller[name].opcode.startswith("async-")
        ):
            name = self._caller[name].computation
        return name

    def is_async(self, inst: Instruction) -> bool:
        """Whether `inst` runs asynchronously: a `-start` (done later by its `-done`), a step
        of a chain, or an op inside an `async-start`'s wrapped computation."""
        if inst.opcode.endswith("-start") or inst.chain is not None:
            return True
        caller = self._caller.get(inst.computation)
        return caller is not None and caller.opcode.startswith("async-")

    def fusions(self, within: Iterable[str] | None = None) -> list[Instruction]:
        """The kernels (`fusion` instructions) of `within` (default: every computation), not
        counting the fusions nested inside another fusion's computation."""
        names = self.computations if within is None else within
        return [
            inst
            for inst in self.instructions([n for n in names if n not in self._fused])
            if inst.opcode == "fusion"
        ]

    def every_step(self) -> set[str]:
        """Computations that run whenever the program runs: all but conditional branches."""
        return self.reachable([self.entry], into_branches=False)

    def conditionals(self, within: Iterable[str] | None = None) -> list[list[str]]:
        """The branch computations of each conditional in `within` (default: every step)."""
        within = self.every_step() if within is None else set(within)
        return [
            self.branches(inst)
            for name in within
            for inst in self.computations[name]
            if inst.opcode == "conditional"
        ]

    def instructions(self, within: Iterable[str] | None = None) -> list[Instruction]:
        names = self.computations if within is None else within
        return [inst for name in names for inst in self.computations[name]]

    def source(self, inst: Instruction, operand: int = 0) -> str:
        """What an operand computes: its opcode, or a fusion's root opcode."""
        producer = self._by_name.get((inst.computation, inst.operands[operand]))
        if producer is None:
            return "unknown"
        if producer.opcode == "fusion":
            called = self.callees(producer)
            if called and self.computations.get(called[0]):
                return self.computations[called[0]][-1].opcode  # ROOT is printed last
        return producer.opcode

    def reducer(self, inst: Instruction) -> str:
        """What a reduction (`all-reduce`, `reduce`) combines with: its `to_apply`'s root opcode."""
        called = self.callees(inst)
        computation = self.computations.get(called[0]) if called else None
        return computation[-1].opcode if computation else "unknown"  # ROOT is printed last

    # -- questions --

    def ops(self, opcode: str, within: Iterable[str] | None = None) -> list[Instruction]:
        """Instructions of `opcode` or its `-start` form in `within` (default: everywhere).

        A collective split into the steps of one chain is one op, its first step."""
        return [
            inst
            for inst in self.instructions(within)
            if inst.opcode in (opcode, f"{opcode}-start")
            and (inst.computation, inst.name) not in self._steps
        ]

    def copies(self, min_elements: int, within: Iterable[str] | None = None) -> list[Instruction]:
        """`copy` instructions of at least `min_elements` elements (parameter-sized copies).

        Read `source(copy)` to tell a copy of a state buffer from one of fresh
        zeros (`"broadcast"`): XLA merges identical zero broadcasts of
        equal-shaped leaves into one buffer and copies it into each output.
        A copy into another memory space is not one (`memory_moves`).
        """
        return [
            inst
            for inst in self.ops("copy", within)
            if inst.elements >= min_elements and not self._moves(inst)
        ]

    def memory_moves(
        self, min_elements: int, within: Iterable[str] | None = None
    ) -> list[Instruction]:
        """Copies of at least `min_elements` elements from one memory space into another.

        On TPU the compiler prefetches buffers from HBM into the on-chip VMEM and evicts
        them back (`copy-start`/`copy-done` whose layouts name different spaces): bytes
        moved, but no second buffer in HBM. XLA:CPU has one memory space: none.
        """
        return [
            inst
            for inst in self.ops("copy", within)
            if inst.elements >= min_elements and self._moves(inst)
        ]

    def _moves(self, copy: Instruction) -> bool:
        producer = self._by_name.get((copy.computation, copy.operands[0]))
        if producer is None or not producer.memory_spaces or not copy.memory_spaces:
            return False
        return producer.memory_spaces[0] != copy.memory_spaces[0]

    def collective_counts(self, within: Iterable[str] | None = None) -> dict[str, int]:
        return {op: len(self.ops(op, within)) for op in COLLECTIVES}

    def collectives(self, mesh_shape: Mapping[Hashable, int]) -> list[Collective]:
        """Every collective of the program with its mesh axes, place and mode (`Collective`).

        `axes` are the mesh axes along which the members of a replica group differ, read
        from `replica_groups` (`replica_groups` lists the spellings), with device ids the
        positions in the mesh (`mesh_shape`, as `dict(mesh.shape)`, in order); a
        `collective-permute` has pairs, not groups: the axes its pairs cross.
        """
        every, loops = self.every_step(), self.in_loops()
        names, dims = tuple(mesh_shape), tuple(mesh_shape.values())
        found = []
        for op in COLLECTIVES:
            for inst in self.ops(op):
                if op == "collective-permute":
                    groups = _permute_pairs(inst.attributes)
                else:
                    groups = replica_groups(inst.attributes, math.prod(dims))
                axes = tuple(
                    name
                    for i, name in enumerate(names)
                    if any(len({np.unravel_index(d, dims)[i] for d in g}) > 1 for g in groups)
                )
                found.append(
                    Collective(
                        op=op,
                        axes=axes,
                        place="every step" if inst.computation in every else "once",
                        in_loop=inst.computation in loops,
                        asynchronous=self.is_async(inst),
                        nbytes=inst.nbytes,
                        instruction=inst,
                    )
                )
        return found

    def collectives_by_axis(
        self, mesh_shape: Mapping[Hashable, int]
    ) -> dict[tuple[str, str, tuple[Hashable, ...]], tuple[int, int]]:
        """Collectives per place, opcode and mesh axes: `{(place, op, axes): (count, bytes)}`.

        `place` is `"every step"` (outside conditional branches) or `"once"` (inside
        a branch: once per window in `accumulate`); `axes` as in `collectives`.
        An empty group list means every device: all axes.
        """
        out: dict[tuple[str, str, tuple[Hashable, ...]], tuple[int, int]] = {}
        for found in self.collectives(mesh_shape):
            key = (found.place, found.op, found.axes)
            count, nbytes = out.get(key, (0, 0))
            out[key] = (count + 1, nbytes + found.nbytes)
        return out

    def per_window(self, opcode: str, k: int) -> tuple[int, int]:
        """(ops, bytes) that one window of `k` calls runs: ops outside branches run `k` times.

        An op inside a conditional's branch runs at most once per window (the
        boundary branch of `accumulate`, or the update branch of MultiSteps).
        """
        every = self.every_step()
        count = nbytes = 0
        for inst in self.ops(opcode):
            runs = k if inst.computation in every else 1
            count += runs
            nbytes += runs * inst.nbytes
        return count, nbytes

    def trip_count(self, inst: Instruction) -> int:
        """The `known_trip_count` XLA proved for a `while` instruction.

        The TPU compiler prints none; there the count is read from the loop itself when it
        is a counted loop (`counted_trips`: a scan's or a `fori_loop`'s). Raises
        `ValueError` when the loop is neither (a `while_loop` whose bound is data): a
        count of what such a loop runs would be a guess.
        """
        found = _TRIP_COUNT.search(inst.attributes)
        if found is not None:
            return int(found.group(1))
        counted = self.counted_trips(inst)
        if counted is None:
            raise ValueError(f"while loop {inst.name!r} has no known_trip_count: {inst.line[:200]}")
        return counted

    def counted_trips(self, inst: Instruction) -> int | None:
        """The trips of a counted `while` loop, read from its condition, body and start.

        A counted loop's condition is `i < N` on a counter `i` of the loop's tuple and a
        constant `N`, its body adds the constant 1 to `i`, and `i` starts from a constant
        `s`: `N - s` trips. Copies and bitcasts between them (the TPU moves scalars into
        its scalar memory) are looked through. None for any other loop.
        """
        parts = self.loop_parts(inst)
        condition = self.computations.get(parts.get("condition", ""))
        body = self.computations.get(parts.get("body", ""))
        start = self._producer(inst, 0)
        if not condition or not body or start is None or start.opcode != "tuple":
            return None
        compare = condition[-1]  # ROOT is printed last
        if compare.opcode != "compare" or "direction=LT" not in compare.attributes:
            return None
        i = _tuple_index(self._producer(compare, 0))
        bound = _constant(self._producer(compare, 1))
        if i is None or bound is None or body[-1].opcode != "tuple":
            return None
        first = _constant(self._producer(start, i))
        step = self._producer(body[-1], i)
        if first is None or step is None or step.opcode != "add":
            return None
        # The step adds the constant 1 to the counter, in either order.
        terms = {
            (_constant(t), _tuple_index(t))
            for t in (self._producer(step, 0), self._producer(step, 1))
        }
        if terms != {(1, None), (None, i)}:
            return None
        return max(0, bound - first)

    def operand(self, inst: Instruction, operand: int) -> Instruction | None:
        """The instruction that computes an operand of `inst` (in its computation), or None."""
        if operand >= len(inst.operands):
            return None
        return self._by_name.get((inst.computation, inst.operands[operand]))

    def _producer(self, inst: Instruction, operand: int) -> Instruction | None:
        """What computes an operand of `inst`, looking through copies and bitcasts."""
        if operand >= len(inst.operands):
            return None
        found = self._by_name.get((inst.computation, inst.operands[operand]))
        while found is not None and found.opcode in ("copy", "bitcast", "copy-done", "copy-start"):
            found = self._by_name.get((found.computation, found.operands[0]))
        return found

    def runs(self, opcode: str) -> int:
        """Ops of `opcode` (or its `-start` form) run by one call of the program.

        Each op counts once per run of its computation: an op in a `while` body
        counts its loop's `known_trip_count` times, nested loops multiply, and a
        loop's condition runs once more than its body. A `conditional` runs one
        branch, so it counts the branch with the most such ops, at most once per
        run of the conditional: an upper bound where branches differ, exact where
        the op sits outside every branch. A `call` or fusion counts its callee
        once; a reduction's `to_apply` is not a run of anything.
        """
        memo: dict[str, int] = {}

        def count(name: str) -> int:
            if name in memo:
                return memo[name]
            memo[name] = 0  # HLO has no recursion; this only guards malformed text
            total = 0
            for inst in self.computations.get(name, []):
                if (inst.computation, inst.name) in self._steps:
                    continue
                if inst.opcode in (opcode, f"{opcode}-start"):
                    total += 1
                if inst.opcode == "while":
                    trips = self.trip_count(inst)
                    parts = self.loop_parts(inst)
                    total += trips * count(parts["body"]) + (trips + 1) * count(parts["condition"])
                elif inst.opcode == "conditional":
                    total += max((count(b) for b in self.branches(inst)), default=0)
                else:
                    total += sum(count(c) for c in self.runs_once(inst))
            memo[name] = total
            return total

        return count(self.entry)

    def computation_runs(self) -> dict[str, int]:
        """How many times each computation runs in one call of the program, every
        conditional's branches each taken once (as in a window whose closing step is one of
        its calls): a `while` body runs its loop's trip count times per run of the loop
        (nested loops multiply), its condition once more; a branch once per run of its
        conditional; a `call`'s, fusion's or `async-start`'s callee once. An instruction
        runs as often as its computation."""
        runs: dict[str, int] = {}

        def visit(name: str, times: int) -> None:
            runs[name] = runs.get(name, 0) + times
            for inst in self.computations.get(name, []):
                if inst.opcode == "while":
                    trips = self.trip_count(inst)
                    parts = self.loop_parts(inst)
                    visit(parts["body"], times * trips)
                    visit(parts["condition"], times * (trips + 1))
                    continue
                for callee in self.branches(inst) + self.runs_once(inst):
                    visit(callee, times)

        visit(self.entry, 1)
        return runs

    @staticmethod
    def runs_once(inst: Instruction) -> list[str]:
        """What an instruction runs once per run of its own: a `call`'s callee, a fusion's
        or an `async-start`'s `calls=`; not the `to_apply` of a reduction, sort or scatter,
        which is applied per element, nor the wrapped computation that an `async-done` or
        `async-update` names again."""
        if inst.opcode == "call":
            return Hlo.callees(inst)
        if inst.opcode in ("async-done", "async-update"):
            return []
        found = _CALLS.search(inst.attributes)
        return _names(found.group(1)) if found else []

    def in_loops(self) -> set[str]:
        """Computations run inside some `while` loop: its bodies, conditions and their callees."""
        roots = [
            m.group(2)
            for inst in self.instructions()
            if inst.opcode == "while"
            for m in _LOOP_PART.finditer(inst.attributes)
        ]
        return self.reachable(roots)

    def bytes_moved(self, branch: int | None = None) -> int:
        """Bytes a run of the program reads and writes, estimated from its top-level ops.

        Every instruction of the entry computation that computes something (a
        fusion, a reduce, a copy, ...; not parameters, tuples, bitcasts,
        constants) counts its result once (written) and each operand once
        (read). A `conditional` counts the computation of `branch` instead
        (`jax.lax.cond`: 0 is the false branch, 1 the true one; `None`: the
        conditional's own operands and result, as if it were one fusion), and
        a `call` its callee. Fused operations count at the fusion's boundary,
        which is what crosses memory. It overestimates ops that update a
        slice in place and ignores re-reads inside one fusion.

        A conditional whose result is one boolean is a test with a fallback (the
        exact finiteness pass behind a quick one, `trees.all_finite_by_squares`):
        it counts its cheaper branch, the one an ordinary step takes, whatever
        `branch` says.
        """
        free = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}

        def walk(name: str) -> int:
            insts = self.computations[name]
            by_name = {inst.name: inst for inst in insts}
            total = 0
            for inst in insts:
                if inst.opcode in free:
                    continue
                if inst.opcode == "conditional" and branch is not None:
                    if inst.types == (("pred", ()),):
                        total += min(walk(b) for b in self.branches(inst))
                    else:
                        total += walk(self.branches(inst)[branch])
                    continue
                if inst.opcode == "call":
                    total += sum(walk(callee) for callee in self.callees(inst))
                    continue
                reads = sum(by_name[o].nbytes for o in set(inst.operands) if o in by_name)
                total += inst.nbytes + reads
            return total

        return walk(self.entry)


def replica_groups(attributes: str, devices: int) -> list[tuple[int, ...]]:
    """The device groups of a collective, sorted, from any of XLA's spellings.

    `{{0,1},{2,3}}`; iota `[G,S]<=[dims]T(perm)`; or a mesh,
    `mesh['a'=4,'b'=2], device_ids=([2,4]T(1,0)) {'a'}` (groups along the named
    axes; without `device_ids`, as the TPU compiler prints it, the devices in order).
    No groups (`{}`) means one group of all `devices`.
    """
    listed = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", attributes)
    if listed:
        groups = re.findall(r"\{([\d,]*)\}", listed.group(1))
        found = sorted(tuple(int(d) for d in g.split(",") if d) for g in groups)
        return found if found and found[0] else [tuple(range(devices))]

    def iota(dims: list[int], perm: str | None) -> np.ndarray:
        ids = np.arange(math.prod(dims)).reshape(dims)
        return ids.transpose([int(p) for p in perm.split(",")]) if perm else ids

    found = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attributes)
    if found:
        shape = (int(found.group(1)), int(found.group(2)))
        ids = iota([int(d) for d in found.group(3).split(",")], found.group(4))
        return sorted(tuple(int(d) for d in row) for row in ids.reshape(shape))
    found = re.search(
        r"replica_groups=mesh\[([^\]]*)\]"
        r"(?:, device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))? \{([^}]*)\}",
        attributes,
    )
    if not found:
        return [tuple(range(devices))]
    axes = re.findall(r"'([^']+)'=(\d+)", found.group(1))
    names, sizes = [a for a, _ in axes], [int(n) for _, n in axes]
    if found.group(2):
        ids = iota([int(d) for d in found.group(2).split(",")], found.group(3)).reshape(sizes)
    else:  # no device ids: the mesh's devices in order
        ids = np.arange(math.prod(sizes)).reshape(sizes)
    along = [names.index(a) for a in re.findall(r"'([^']+)'", found.group(4))]
    ids = np.moveaxis(ids, along, list(range(len(sizes) - len(along), len(sizes))))
    size = math.prod(sizes[i] for i in along)
    return sorted(tuple(int(d) for d in row) for row in ids.reshape(-1, size))


def benchmark_parser(
    doc: str | None, *, quick: str = "tiny sizes, a smoke test", reps: str | None = None
) -> argparse.ArgumentParser:
    """The command line every benchmark shares; each adds its own options to it.

    Args:
      doc: the benchmark module's docstring, whose first line describes the command.
      quick: what `--quick` does, for `--help`: `benchmarks/run.py --quick` passes it on to
        every benchmark (the smoke run of tests/test_benchmarks.py).
      reps: the help of an integer `--reps` (default None: the benchmark's own count, which
        depends on `--quick`), or None for a benchmark that takes none.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--quick", action="store_true", help=quick)
    if reps is not None:
        parser.add_argument("--reps", type=int, default=None, help=reps)
    return parser


def print_rows(title: str, rows: list[dict]) -> None:
    """Prints `rows` (dicts) as a markdown table under a `## title` heading."""
    print(f"\n## {title}")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")


def shard_map_accumulate(tx: Any, params: Any, axes: Any, loss: Callable) -> tuple[Any, Any]:
    """Jitted `(init, step)` of a data-parallel `jax.shard_map` step with `accumulate` over `axes`.

    Params replicated, the batch split over `axes`, the gradient taken with respect to
    the params cast to varying (no reduction in the backward pass); `step` donates
    params and state. Under the context mesh.
    """
    import optax

    import gradaccum_jax as ga

    specs = ga.replica_state_specs(jax.eval_shape(tx.init, params), axes)

    def body(params, state, batch):
        local = jax.lax.pcast(params, axes, to="varying")
        grads = jax.grad(loss)(local, batch)
        updates, state = tx.update(grads, ga.remove_replica_axis(state), params)
        return optax.apply_updates(params, updates), ga.add_replica_axis(state)

    P = jax.sharding.PartitionSpec
    init = jax.shard_map(lambda p: ga.add_replica_axis(tx.init(p)), in_specs=P(), out_specs=specs)
    step = jax.shard_map(body, in_specs=(P(), specs, P(axes)), out_specs=(P(), specs))
    return jax.jit(init), jax.jit(step, donate_argnums=(0, 1))


def max_relative_error(a: Any, b: Any) -> float:
    """Largest over the leaves of `max |a - b| / max |b|`: how far tree `a` is from `b`."""
    return max(
        float(jnp.max(jnp.abs(x - y)) / (jnp.max(jnp.abs(y)) + 1e-30))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


def mlp_host_params(sizes: list[int]) -> list[dict[str, np.ndarray]]:
    """A ReLU MLP's params as host arrays: each candidate puts fresh device arrays of them,
    since the steps donate theirs."""
    rng = np.random.default_rng(0)
    return [
        {
            "w": (rng.normal(size=(m, n)) / np.sqrt(m)).astype(np.float32),
            "b": np.zeros(n, np.float32),
        }
        for m, n in itertools.pairwise(sizes)
    ]


def mlp_batch_loss(params: Any, batch: Mapping[str, Any]) -> Any:
    """Mean squared error of the ReLU MLP of `mlp_host_params` on `{"x", "y"}`."""
    x = batch["x"]
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return jax.numpy.mean((x @ params[-1]["w"] + params[-1]["b"] - batch["y"]) ** 2)


def smallest_leaf(tree: Any) -> int:
    """Elements of the smallest non-scalar leaf: the `min_elements` of parameter-sized copies."""
    return min(int(np.size(leaf)) for leaf in jax.tree.leaves(tree) if np.size(leaf) > 1)


def transformer_params(layers: int = 12, d: int = 512, vocab: int = 8192) -> dict:
    """A transformer-shaped tree: per layer q, k, v, o, MLP up/down with biases, two LayerNorms."""
    keys = iter(jax.random.split(jax.random.key(0), 7 * layers + 1))

    def w(shape):
        return jax.random.normal(next(keys), shape, jnp.float32) / np.sqrt(shape[0])

    def ln():
        return {"scale": jnp.ones((d,), jnp.float32), "bias": jnp.zeros((d,), jnp.float32)}

    tree: dict = {"embed": w((vocab, d)), "ln_f": ln()}
    for i in range(layers):
        tree[f"layer_{i:03d}"] = {
            "q": w((d, d)),
            "k": w((d, d)),
            "v": w((d, d)),
            "o": w((d, d)),
            "up": {"w": w((d, 4 * d)), "b": jnp.zeros((4 * d,), jnp.float32)},
            "down": {"w": w((4 * d, d)), "b": jnp.zeros((d,), jnp.float32)},
            "ln1": ln(),
            "ln2": ln(),
        }
    return tree
