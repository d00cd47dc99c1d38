"""The schedule tables: every task once, in dependency order, ring places never overwritten
while a value waits in them, and the bubble and stash the docs state."""

import pytest

import gradaccum_jax as ga
from gradaccum_jax._pipeline import schedules

# Tables and source text: no jax computation (the `pure` marker).
pytestmark = pytest.mark.pure

CASES = [
    (name, s, n, v)
    for name, v in [
        ("gpipe", 1),
        ("1f1b", 1),
        ("interleaved", 2),
        ("circular", 2),
        ("interleaved", 3),
    ]
    for s in (1, 2, 3, 4)
    for n in sorted({1, 2, max(s - 1, 1), s, s + 1, 2 * s, 8 * s})
]


def _replay(table):
    """Plays the table as the executor does, with values named (micro-batch, virtual stage):
    returns what each read found, and checks every task ran once after its inputs."""
    s, v, n = table.num_stages, table.num_chunks, table.num_microbatches
    last = s * v - 1
    act = [[None] * (table.act_depth + 1) for _ in range(s)]
    cot = [[None] * (table.cot_depth + 1) for _ in range(s)]
    done = set()
    for t in range(table.num_slots):
        sent_on, sent_back = [None] * s, [None] * s
        for d in range(s):
            kind = table.kind[t, d]
            if kind == schedules.IDLE:
                continue
            m, j = int(table.microbatch[t, d]), int(table.chunk[t, d])
            c = j * s + d
            if c > 0:  # the stage input waits in the ring (stage 0 recomputes the embedding)
                assert act[d][table.act_read[t, d]] == (m, c), (t, d)
            if kind == schedules.FORWARD:
                assert c == 0 or ("F", m, c - 1) in done
                done.add(("F", m, c))
                sent_on[d] = (m, c + 1) if c < last else None
            else:
                assert ("F", m, c) in done
                if c < last:
                    assert ("B", m, c + 1) in done
                    assert cot[d][table.cot_read[t, d]] == (m, c), (t, d)
                done.add(("B", m, c))
                sent_back[d] = (m, c - 1) if c > 0 else None
        for d in range(s):  # what arrives at the end of the slot
            got_on, got_back = sent_on[(d - 1) % s], sent_back[(d + 1) % s]
            if got_on is not None:
                assert table.act_write[t, d] < table.act_depth
            act[d][table.act_write[t, d]] = got_on
            if got_back is not None:
                assert table.cot_write[t, d] < table.cot_depth
            cot[d][table.cot_write[t, d]] = got_back
    assert len(done) == 2 * n * s * v


@pytest.mark.parametrize(("name", "s", "n", "v"), CASES)
def test_the_table_runs_every_task_once_in_order_from_its_ring_places(name, s, n, v):
    _replay(ga.pipeline_schedule(name, s, n, v))


@pytest.mark.parametrize(("name", "s", "n", "v"), [c for c in CASES if c[2] % c[1] == 0])
def test_the_bubble_is_the_formula_for_n_a_multiple_of_s(name, s, n, v):
    table = ga.pipeline_schedule(name, s, n, v)
    assert table.bubble == pytest.approx(table.formula_bubble, abs=1e-12)
    assert table.num_slots == 2 * (v * n + s - 1)


def test_the_replay_catches_a_wrong_ring_place():
    table = ga.pipeline_schedule("1f1b", 4, 8)
    broken = table.act_write.copy()
    broken[broken < table.act_depth] = 0  # every arrival in place 0: waiting values lost
    with pytest.raises(AssertionError):
        _replay(schedules.PipelineSchedule(**{**table.__dict__, "act_write": broken}))


def test_1f1b_keeps_at_most_s_minus_s_plus_one_inputs_flat_in_n():
    for n in (4, 8, 32, 128):
        table = ga.pipeline_schedule("1f1b", 4, n)
        assert table.stash == (0, 4, 3, 2)
        assert table.act_depth == 4
    assert ga.pipeline_schedule("gpipe", 4, 32).stash == (0, 32, 32, 32)
    assert (
        ga.pipeline_schedule("interleaved", 4, 32, 2).act_depth
        == ga.pipeline_schedule("interleaved", 4, 8, 2).act_depth
    )


def test_nesting_accumulation_outside_keeps_the_bubble_of_m():
    assert round(ga.pipeline_schedule("gpipe", 4, 4).bubble, 3) == 0.429
    assert round(ga.pipeline_schedule("1f1b", 4, 32).bubble, 3) == 0.086


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (("zb", 4, 8), "schedule='zb': expected one of"),
        (("1f1b", 0, 8), "num_stages=0: expected an int >= 1"),
        (("1f1b", 4, 8, 2), "num_chunks=2 with schedule='1f1b'"),
        (("interleaved", 4, True, 2), "num_microbatches=True"),
    ],
)
def test_bad_arguments_are_refused(args, match):
    with pytest.raises(ValueError, match=match):
        ga.pipeline_schedule(*args)


def test_sends_mark_the_slots_that_permute():
    table = ga.pipeline_schedule("gpipe", 4, 8)
    on, back = table.sends()
    assert on.sum() == 8 + 4 - 2 and back.sum() == 8 + 4 - 2
    assert not (on & back).any()  # GPipe never sends both ways in one slot
    assert repr(table).startswith("PipelineSchedule('gpipe', stages=4, microbatches=8")
