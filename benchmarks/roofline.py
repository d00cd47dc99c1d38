"""An estimate, not a measurement: a step's time on a TPU chip from its compiled program.

Nothing here runs a program. `estimate(hlo, chip, branch)` walks a compiled program's HLO
(`harness.Hlo`, from XLA:CPU or from libtpu without a TPU) the way one call runs it and
adds up two costs:

* the matrix products' floating-point operations: every `dot` and `convolution`, inside
  fusions too, counted as 2 x (result elements) x (contracted elements); element-wise
  arithmetic is not counted (on a TPU it rides along the memory traffic);
* the bytes to and from HBM: every top-level op (a fusion at its boundary, a copy, a
  collective, ...) reads each operand once and writes its result once, as
  `harness.Hlo.bytes_moved` counts them, less the arrays the TPU compiler placed in on-chip
  memory (a weight prefetched into VMEM is read from HBM once, by its prefetch), a slice
  reading only what it takes and an update of a slice in place writing only the update; an
  asynchronous op counts at its start, and an op in a `while` body counts its loop's trip
  count times.

A `conditional` counts one branch (`branch`: 0 is `jax.lax.cond`'s false branch, 1 its true
one; `None` counts both, as XLA's static `cost_analysis()` does); one whose result is a
single boolean (a finite check with a fallback) counts its cheaper branch. The estimate is
the larger of the two times on the chip's public peaks (`CHIPS`): flops over the chip's
bf16 matrix throughput, bytes over its HBM bandwidth. It ignores everything that makes a
real step slower (launch and synchronisation overheads, collectives' link time, float32
matmuls at a fraction of the bf16 peak, imperfect overlap of compute and memory) and is a
lower bound on the step's time, to compare candidates side by side on the same chip.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from harness import Hlo, Instruction

_CONTRACTING = re.compile(r"\blhs_contracting_dims=\{([\d,]*)\}")
_DIM_LABELS = re.compile(r"\bdim_labels=\w+_(\w+)->\w+")
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant"}


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU chip's public peak figures."""

    name: str
    flops_per_s: float  # dense bf16 matrix throughput
    hbm_bytes_per_s: float
    hbm_bytes: int


# The vendor's published per-chip peaks.
CHIPS = {
    "v5e": Chip("TPU v5e", 197e12, 819e9, 16 * 2**30),
    "v5p": Chip("TPU v5p", 459e12, 2765e9, 95 * 2**30),
}


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A roofline estimate of one call of a program on one chip (see the module's docstring)."""

    chip: str
    flops: float
    bytes: float
    seconds: float
    bound: str  # "memory" or "compute": the larger of the two times

    @property
    def microseconds(self) -> float:
        return 1e6 * self.seconds


def _operand_dims(hlo: Hlo, inst: Instruction, operand: int) -> tuple[int, ...] | None:
    found = hlo.operand(inst, operand)
    if found is None or len(found.types) != 1:
        return None
    return found.types[0][1]


_SLICES = {"slice", "slice-start", "dynamic-slice"}


def _hbm(inst: Instruction) -> int:
    """An instruction's bytes in HBM: an array the TPU compiler placed in its on-chip
    memory (`S(1)`, VMEM) or its scalar memory costs no HBM traffic."""
    return inst.nbytes_in(0)


def _op_bytes(inst: Instruction, operands: list[Instruction]) -> int:
    """HBM bytes one op reads and writes: its operands and its result, except that a slice
    reads only what it takes and an update of a slice in place writes only the update."""
    if inst.opcode in _SLICES and operands:
        return _hbm(inst) + min(_hbm(operands[0]), inst.nbytes)
    if inst.opcode == "dynamic-update-slice" and len(operands) > 1:
        update = _hbm(operands[1])
        return 2 * update + sum(_hbm(o) for o in operands[2:])
    return _hbm(inst) + sum(_hbm(o) for o in operands)


def op_flops(hlo: Hlo, inst: Instruction) -> float:
    """The floating-point operations of one `dot` or `convolution` (0 for any other op)."""
    if inst.opcode not in ("dot", "convolution") or len(inst.types) != 1:
        return 0.0
    out = math.prod(inst.types[0][1])
    if inst.opcode == "dot":
        lhs = _operand_dims(hlo, inst, 0)
        found = _CONTRACTING.search(inst.attributes)
        if lhs is None or found is None:
            raise ValueError(f"a dot whose contraction cannot be read: {inst.line[:200]}")
        dims = [int(d) for d in found.group(1).split(",") if d]
        return 2.0 * out * math.prod(lhs[d] for d in dims)
    # A convolution: each result element sums (kernel elements / output features) products.
    rhs = _operand_dims(hlo, inst, 1)
    labels = _DIM_LABELS.search(inst.attributes)
    if rhs is None or labels is None or "o" not in labels.group(1):
        raise ValueError(f"a convolution whose kernel cannot be read: {inst.line[:200]}")
    features = rhs[labels.group(1).index("o")]
    return 2.0 * out * math.prod(rhs) / features


def costs(hlo: Hlo, branch: int | None = None) -> tuple[float, float]:
    """`(flops, bytes)` of one call of the program (see the module's docstring)."""

    def flops_inside(name: str) -> float:
        total = 0.0
        for inst in hlo.computations.get(name, []):
            total += op_flops(hlo, inst)
            total += sum(flops_inside(c) for c in hlo.runs_once(inst))
        return total

    def walk(name: str) -> tuple[float, float]:
        insts = hlo.computations[name]
        by_name = {inst.name: inst for inst in insts}
        flops = moved = 0.0
        for inst in insts:
            if inst.opcode in _FREE or inst.opcode.endswith(("-done", "-update")):
                continue  # an asynchronous op's bytes count once, at its start
            if inst.opcode == "while":
                trips = hlo.trip_count(inst)
                parts = hlo.loop_parts(inst)
                f, b = walk(parts["body"])
                flops, moved = flops + trips * f, moved + trips * b
                continue
            if inst.opcode == "conditional":
                taken = [walk(b) for b in hlo.branches(inst)]
                if inst.types == (("pred", ()),):
                    taken = [min(taken, key=lambda fb: fb[1])]
                elif branch is not None:
                    taken = [taken[branch]]
                flops += sum(f for f, _ in taken)
                moved += sum(b for _, b in taken)
                continue
            if inst.opcode == "call":
                for callee in hlo.callees(inst):
                    f, b = walk(callee)
                    flops, moved = flops + f, moved + b
                continue
            flops += op_flops(hlo, inst) + sum(flops_inside(c) for c in hlo.runs_once(inst))
            moved += _op_bytes(inst, [by_name[o] for o in set(inst.operands) if o in by_name])
        return flops, moved

    return walk(hlo.entry)


def estimate(hlo: Hlo, chip: str | Chip, branch: int | None = None) -> Estimate:
    """The roofline estimate of one call of `hlo` on `chip` (a name of `CHIPS` or a `Chip`)."""
    peaks = CHIPS[chip] if isinstance(chip, str) else chip
    flops, moved = costs(hlo, branch)
    compute, memory = flops / peaks.flops_per_s, moved / peaks.hbm_bytes_per_s
    return Estimate(
        chip=peaks.name,
        flops=flops,
        bytes=moved,
        seconds=max(compute, memory),
        bound="compute" if compute > memory else "memory",
    )
