"""Pipeline schedules as lockstep tables: which task each stage runs in each slot.

A schedule is first a list of tasks per device, in the order that device runs them
(`_orders`): the forward `F(m, c)` or backward `B(m, c)` of micro-batch `m` through
virtual stage `c`. Virtual stage `c` lives on device `c % S` as its chunk `c // S`, so
an activation always moves one device along the ring. The list is then played in
lockstep (`_simulate`): in each slot every device runs its next task if what it needs
arrived in an earlier slot, else it idles. Last, every value that waits on a device (a
stage input kept for its backward, a cotangent not yet used) gets a place in a ring
buffer (`_places`), chosen so that the buffers are as shallow as the table allows.

The result, `PipelineSchedule`, is plain numpy: the executor scans over its rows.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

SCHEDULES = ("gpipe", "1f1b", "interleaved", "circular")
ScheduleName = Literal["gpipe", "1f1b", "interleaved", "circular"]

IDLE, FORWARD, BACKWARD = 0, 1, 2

Task = tuple[int, int, int]  # (kind, micro-batch, chunk)


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineSchedule:
    """One optimizer step's pipeline schedule, as a table of slots x stages.

    Every array is `int32` of shape `(num_slots, num_stages)`; row `t`, column `s`
    says what stage (device) `s` does in slot `t`.

    Attributes:
      name: The schedule's name (`"gpipe"`, `"1f1b"`, `"interleaved"`, `"circular"`).
      num_stages: `S`, the devices along the stage axis.
      num_microbatches: `N`, the micro-batches of the step, all in this one schedule.
      num_chunks: `v`, the model chunks each device holds (1 but for the interleaved
        and circular schedules).
      kind: 0 idle, 1 forward, 2 backward.
      microbatch: The micro-batch of the task (0 where idle).
      chunk: The chunk of the task, `0 <= chunk < v` (0 where idle).
      act_read: Where the task's stage input waits in the activation ring.
      cot_read: Where a backward's incoming cotangent waits in the cotangent ring.
      act_write: Where the activation arriving at the end of the slot goes
        (`act_depth`, a spare place, when nothing useful arrives).
      cot_write: The same for the arriving cotangent (`cot_depth` when none).
      act_depth: Places of the activation ring: stage inputs kept for their backward
        plus those arrived and not yet run, at the deepest stage.
      cot_depth: Places of the cotangent ring.
      stash: Per stage, the most stage inputs it holds at once.
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_chunks: int
    kind: np.ndarray
    microbatch: np.ndarray
    chunk: np.ndarray
    act_read: np.ndarray
    cot_read: np.ndarray
    act_write: np.ndarray
    cot_write: np.ndarray
    act_depth: int
    cot_depth: int
    stash: tuple[int, ...]

    @property
    def num_slots(self) -> int:
        """Slots (lockstep ticks) of the step; each runs one chunk's forward or backward."""
        return int(self.kind.shape[0])

    @property
    def bubble(self) -> float:
        """The idle share of the stage x slot cells of the table."""
        return float(np.mean(self.kind == IDLE))

    @property
    def formula_bubble(self) -> float:
        """`(S - 1) / (v N + S - 1)`: the bubble of one schedule of `N` micro-batches."""
        s, n, v = self.num_stages, self.num_microbatches, self.num_chunks
        return (s - 1) / (v * n + s - 1)

    def sends(self) -> tuple[np.ndarray, np.ndarray]:
        """Per slot, whether some stage sends an activation on, and a cotangent back."""
        last = self.num_stages * self.num_chunks - 1
        virtual = self.chunk * self.num_stages + np.arange(self.num_stages)
        forward = ((self.kind == FORWARD) & (virtual < last)).any(axis=1)
        backward = ((self.kind == BACKWARD) & (virtual > 0)).any(axis=1)
        return forward, backward

    def __repr__(self) -> str:
        return (
            f"PipelineSchedule({self.name!r}, stages={self.num_stages}, "
            f"microbatches={self.num_microbatches}, chunks={self.num_chunks}, "
            f"slots={self.num_slots}, bubble={self.bubble:.3f}, stash={list(self.stash)})"
        )


def _groups(n: int, s: int) -> list[range]:
    """Micro-batches in groups of `s`, the unit the interleaved orders cycle through chunks by."""
    return [range(g, min(g + s, n)) for g in range(0, n, s)]


def _orders(name: str, s: int, n: int, v: int) -> list[list[Task]]:
    """Each device's tasks in the order it runs them."""
    orders = []
    for d in range(s):
        if name == "gpipe":
            forwards = [(FORWARD, m, 0) for m in range(n)]
            backwards = [(BACKWARD, m, 0) for m in range(n)]
            warmup = n
        elif name == "1f1b":
            forwards = [(FORWARD, m, 0) for m in range(n)]
            backwards = [(BACKWARD, m, 0) for m in range(n)]
            warmup = min(s - d - 1, n)
        else:
            groups = _groups(n, s)
            forwards = [(FORWARD, m, j) for g in groups for j in range(v) for m in g]
            backwards = [(BACKWARD, m, v - 1 - j) for g in groups for j in range(v) for m in g]
            # Megatron's warm-up count for interleaved 1F1B: the forwards a device runs
            # before its first backward can have arrived.
            warmup = n * v if name == "circular" else min(2 * (s - d - 1) + (v - 1) * s, n * v)
        order = forwards[:warmup]
        for i, forward in enumerate(forwards[warmup:]):
            order += [forward, backwards[i]]
        order += backwards[len(forwards) - warmup :]
        orders.append(order)
    return orders


def _simulate(orders: list[list[Task]], s: int, v: int) -> list[list[Task | None]]:
    """Plays the orders in lockstep; a task runs once its inputs arrived in an earlier slot.

    A device whose next task is not ready runs the first task of the other kind
    (backward for forward, or the reverse) if that one is ready: each kind keeps its
    order, and a device never idles while it has work it could do. Without this, a
    Megatron order over a last group smaller than `S` can wait in a circle.
    """
    last = s * v - 1
    done: dict[Task, int] = {}
    pending = [list(order) for order in orders]
    rows: list[list[Task | None]] = []
    total = sum(len(o) for o in orders)

    def ready(task: Task, d: int, t: int) -> bool:
        kind, m, j = task
        c = j * s + d
        needs = []
        if kind == FORWARD and c > 0:
            needs.append((FORWARD, m, c - 1))
        if kind == BACKWARD:
            needs.append((FORWARD, m, c))
            if c < last:
                needs.append((BACKWARD, m, c + 1))
        return all(done.get(need, t) < t for need in needs)

    while any(pending):
        t = len(rows)
        row: list[Task | None] = []
        for d in range(s):
            queue = pending[d]
            chosen = None
            if queue:
                other = None
                if queue[0][0] == FORWARD:
                    other = next((task for task in queue if task[0] == BACKWARD), None)
                for task in (queue[0], other):
                    if task is not None and ready(task, d, t):
                        chosen = task
                        queue.remove(task)
                        break
            row.append(chosen)
        for d, task in enumerate(row):
            if task is not None:
                kind, m, j = task
                done[(kind, m, j * s + d)] = t
        rows.append(row)
        if t > 4 * total + 4 * s:  # every order here is deadlock-free; this guards edits
            raise RuntimeError("pipeline schedule deadlocked: a task waits on one never run")
    return rows


def _places(intervals: dict[tuple, tuple[int, int]]) -> tuple[dict[tuple, int], int]:
    """Ring places for values alive over slots `[written, read]`: greedy, fewest places.

    A value written at the end of slot `a` and last read in slot `b` frees its place
    for a value written at the end of slot `b` or later (reads come before writes).
    """
    free_at: list[int] = []
    place = {}
    for key, (a, b) in sorted(intervals.items(), key=lambda item: item[1]):
        for i, until in enumerate(free_at):
            if until <= a:
                free_at[i] = b
                place[key] = i
                break
        else:
            place[key] = len(free_at)
            free_at.append(b)
    return place, len(free_at)


def pipeline_schedule(
    schedule: ScheduleName | str, num_stages: int, num_microbatches: int, num_chunks: int = 1
) -> PipelineSchedule:
    """Returns the lockstep table of one pipeline schedule of `num_microbatches`.

    The executor of `pipeline_value_and_grad` scans over these rows; the table alone
    answers the planning questions (slots per step, the bubble, the inputs each stage
    keeps) without tracing a model.

    * `"gpipe"`: every forward, then every backward; stage `s` keeps all `N` inputs.
    * `"1f1b"`: after `S - s - 1` warm-up forwards each stage alternates a forward and
      a backward, so it keeps at most `min(S - s, N)` inputs, whatever `N`.
    * `"interleaved"`: 1F1B over `v = num_chunks` chunks per device (virtual stage
      `c` on device `c % S`), micro-batches taken in groups of `S` as Megatron-LM
      orders them; bubble about `(S - 1) / (v N + S - 1)`.
    * `"circular"`: every forward through all `v` chunks, then every backward
      (MaxText's circular pipeline); bubble `(S - 1) / (v N + S - 1)`.

    Args:
      schedule: One of `"gpipe"`, `"1f1b"`, `"interleaved"`, `"circular"`.
      num_stages: `S >= 1`, the size of the stage axis.
      num_microbatches: `N >= 1` micro-batches in the one schedule.
      num_chunks: `v >= 1` chunks per device: 1 for `"gpipe"` and `"1f1b"`.

    Returns:
      A `PipelineSchedule`.

    Examples:
      >>> import gradaccum_jax as ga
      >>> table = ga.pipeline_schedule("1f1b", num_stages=4, num_microbatches=32)
      >>> table.num_slots, round(table.bubble, 3), table.stash
      (70, 0.086, (0, 4, 3, 2))
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"{schedule=}: expected one of {', '.join(map(repr, SCHEDULES))}.")
    for arg, value in (
        ("num_stages", num_stages),
        ("num_microbatches", num_microbatches),
        ("num_chunks", num_chunks),
    ):
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
            raise ValueError(f"{arg}={value!r}: expected an int >= 1.")
    s, n, v = int(num_stages), int(num_microbatches), int(num_chunks)
    if schedule in ("gpipe", "1f1b") and v != 1:
        raise ValueError(
            f"num_chunks={v} with schedule={schedule!r}: chunks need schedule='interleaved' "
            "or 'circular'; gpipe and 1f1b hold one chunk per stage (num_chunks=1)."
        )
    rows = _simulate(_orders(schedule, s, n, v), s, v)
    return _table(schedule, rows, s, n, v)


def _table(name: str, rows: list[list[Task | None]], s: int, n: int, v: int) -> PipelineSchedule:
    last = s * v - 1
    when = {}
    for t, row in enumerate(rows):
        for d, task in enumerate(row):
            if task is not None:
                what, m, j = task
                when[(what, m, j * s + d)] = t
    # Stage inputs (virtual stage c > 0): arrive after F(m, c-1), last read by B(m, c).
    acts = {
        (m, c): (when[(FORWARD, m, c - 1)], when[(BACKWARD, m, c)])
        for m in range(n)
        for c in range(1, last + 1)
    }
    # Cotangents (c < last): arrive after B(m, c+1), read by B(m, c).
    cots = {
        (m, c): (when[(BACKWARD, m, c + 1)], when[(BACKWARD, m, c)])
        for m in range(n)
        for c in range(last)
    }
    act_place, cot_place, stash = {}, {}, []
    act_depth = cot_depth = 0
    for d in range(s):
        here, depth = _places({k: i for k, i in acts.items() if k[1] % s == d})
        act_place.update(here)
        act_depth = max(act_depth, depth)
        stash.append(depth)
        here, depth = _places({k: i for k, i in cots.items() if k[1] % s == d})
        cot_place.update(here)
        cot_depth = max(cot_depth, depth)
    shape = (len(rows), s)
    kind, micro, chunk, act_read, cot_read = (np.zeros(shape, np.int32) for _ in range(5))
    act_write = np.full(shape, act_depth, np.int32)
    cot_write = np.full(shape, cot_depth, np.int32)
    for t, row in enumerate(rows):
        for d, task in enumerate(row):
            if task is None:
                continue
            k, m, j = task
            c = j * s + d
            kind[t, d], micro[t, d], chunk[t, d] = k, m, j
            act_read[t, d] = act_place.get((m, c), 0)
            if k == BACKWARD:
                cot_read[t, d] = cot_place.get((m, c), 0)
            if k == FORWARD and c < last:
                act_write[t, (d + 1) % s] = act_place[(m, c + 1)]
            if k == BACKWARD and c > 0:
                cot_write[t, (d - 1) % s] = cot_place[(m, c - 1)]
    return PipelineSchedule(
        name=name,
        num_stages=s,
        num_microbatches=n,
        num_chunks=v,
        kind=kind,
        microbatch=micro,
        chunk=chunk,
        act_read=act_read,
        cot_read=cot_read,
        act_write=act_write,
        cot_write=cot_write,
        act_depth=act_depth,
        cot_depth=cot_depth,
        stash=tuple(stash),
    )
