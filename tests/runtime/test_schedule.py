"""Tests of runtime/schedule.py, runtime/schedule_generators.py and runtime/schedule_registry.py:
schedules are checked as data, without running a model."""

from __future__ import annotations

import doctest
from fractions import Fraction

import pytest

import partitioner.runtime.schedule
import partitioner.runtime.schedule_generators
import partitioner.runtime.schedule_registry
from partitioner.errors import PartitionError, ScheduleError
from partitioner.runtime.schedule import (
    Action,
    Phase,
    Schedule,
    bubble_fraction,
    clock_ticks,
    in_flight,
    render,
    validate,
)
from partitioner.runtime.schedule_generators import gpipe, interleaved, one_f_one_b
from partitioner.runtime.schedule_registry import (
    CAPABILITIES,
    GPIPE,
    INTERLEAVED,
    ONE_F_ONE_B,
    SCHEDULES,
    V_SHAPE,
    ZERO_BUBBLE,
    Runtime,
    ScheduleKind,
    check_runtime,
    make_schedule,
    runtime_problem,
    schedule_kind,
    schedule_names,
)

SIZES = [(p, m) for p in range(1, 7) for m in range(1, 11)]
VIRTUAL = [1, 2, 3, 4]


def grid(kind: ScheduleKind) -> list[tuple[int, int, int]]:
    """Every (P, m, v) up to 6 stages, 12 micro-batches and 4 virtual stages that ``kind``
    can be built for."""
    sizes = [(p, m, v) for p in range(1, 7) for m in range(1, 13) for v in VIRTUAL]
    return [size for size in sizes if not kind.problems(*size)]


def registered(test: object) -> object:
    """Parametrizes ``test`` over every registered schedule and each size of its grid."""
    cases = [pytest.param(kind, *size, id=f"{name}-{size}")
             for name, kind in SCHEDULES.items() for size in grid(kind)]
    return pytest.mark.parametrize(("kind", "n_stages", "n_microbatches", "virtual"),
                                   cases)(test)  # type: ignore[arg-type]


def schedule_of(*stages: str) -> Schedule:
    """Builds a schedule from one space-separated string of actions per stage."""
    return tuple(tuple(Action.parse(t) for t in stage.split()) for stage in stages)


def text_of(schedule: Schedule) -> list[str]:
    return [" ".join(str(a) for a in actions) for actions in schedule]


def problems_of(schedule: Schedule, n_stages: int, n_microbatches: int) -> str:
    with pytest.raises(ScheduleError) as caught:
        validate(schedule, n_stages, n_microbatches)
    return str(caught.value)


def problems_of_virtual(schedule: Schedule, n_stages: int, n_microbatches: int,
                        virtual: int) -> str:
    with pytest.raises(ScheduleError) as caught:
        validate(schedule, n_stages, n_microbatches, virtual)
    return str(caught.value)


# Actions


def test_action_prints_stage_phase_microbatch() -> None:
    assert str(Action(1, Phase.FORWARD, 0)) == "1F0"
    assert str(Action(12, Phase.BACKWARD, 7)) == "12B7"


def test_action_parse_round_trips_every_action() -> None:
    for schedule in (gpipe(6, 12), one_f_one_b(6, 12)):
        for actions in schedule:
            for a in actions:
                assert Action.parse(str(a)) == a


def test_action_parse_reads_fields() -> None:
    assert Action.parse(" 2B13 ") == Action(2, Phase.BACKWARD, 13)


@pytest.mark.parametrize("text", ["", "1X0", "F0", "1F", "-1F0", "1F0x", "1 F 0", "1f0"])
def test_action_parse_rejects_bad_text(text: str) -> None:
    with pytest.raises(ScheduleError, match="like '1F0'") as caught:
        Action.parse(text)
    assert repr(text) in str(caught.value)


def test_action_rejects_bad_fields_all_at_once() -> None:
    with pytest.raises(ScheduleError) as caught:
        Action(-1, "F", True)  # type: ignore[arg-type]
    message = str(caught.value)
    assert "stage must be an int >= 0, got -1" in message
    assert "microbatch must be an int >= 0, got True" in message
    assert "phase must be a Phase, got 'F'" in message


def test_action_is_frozen() -> None:
    a = Action(0, Phase.FORWARD, 0)
    with pytest.raises(AttributeError):
        a.stage = 1  # type: ignore[misc]


# Schedule builders


def test_gpipe_runs_forwards_then_backwards_in_reverse() -> None:
    assert text_of(gpipe(2, 3)) == [
        "0F0 0F1 0F2 0B2 0B1 0B0",
        "1F0 1F1 1F2 1B2 1B1 1B0",
    ]


def test_one_f_one_b_warms_up_then_alternates() -> None:
    assert text_of(one_f_one_b(3, 4)) == [
        "0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3",
        "1F0 1F1 1B0 1F2 1B1 1F3 1B2 1B3",
        "2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3",
    ]


def test_one_f_one_b_with_fewer_microbatches_than_stages() -> None:
    assert text_of(one_f_one_b(3, 1)) == ["0F0 0B0", "1F0 1B0", "2F0 2B0"]


@pytest.mark.parametrize(("n_stages", "n_microbatches"), SIZES)
def test_gpipe_validates(n_stages: int, n_microbatches: int) -> None:
    validate(gpipe(n_stages, n_microbatches), n_stages, n_microbatches)


@pytest.mark.parametrize(("n_stages", "n_microbatches"), SIZES)
def test_one_f_one_b_validates(n_stages: int, n_microbatches: int) -> None:
    validate(one_f_one_b(n_stages, n_microbatches), n_stages, n_microbatches)


@pytest.mark.parametrize("build", [gpipe, one_f_one_b])
@pytest.mark.parametrize(
    ("n_stages", "n_microbatches", "expected"),
    [
        (0, 4, "n_stages must be an int >= 1, got 0"),
        (2, 0, "n_microbatches must be an int >= 1, got 0"),
        (2.0, 4, "n_stages must be an int >= 1, got 2.0 (float)"),
        (2, True, "n_microbatches must be an int >= 1, got True (bool)"),
    ],
)
def test_builders_reject_bad_counts(
    build: object, n_stages: object, n_microbatches: object, expected: str
) -> None:
    assert callable(build)
    with pytest.raises(ScheduleError, match="pass the number of") as caught:
        build(n_stages, n_microbatches)
    assert expected in str(caught.value)


def test_builders_report_both_bad_counts() -> None:
    with pytest.raises(ScheduleError) as caught:
        gpipe(-1, -2)
    assert "got -1" in str(caught.value)
    assert "got -2" in str(caught.value)


def test_make_schedule_builds_by_name() -> None:
    assert make_schedule("gpipe", 3, 5) == gpipe(3, 5)
    assert make_schedule("1f1b", 3, 5) == one_f_one_b(3, 5)
    assert make_schedule("interleaved", 3, 6, 2) == interleaved(3, 6, 2)
    assert tuple(SCHEDULES) == (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE, V_SHAPE)
    assert all(name == kind.name for name, kind in SCHEDULES.items())


@pytest.mark.parametrize("name", ["zb", "GPipe", "", None, 3])
def test_unknown_schedule_names_the_value_and_the_registered_names(name: object) -> None:
    for lookup in (lambda: schedule_kind(name), lambda: make_schedule(name, 2, 2),  # type: ignore[arg-type]
                   lambda: check_runtime(name, Runtime.ONE_PROCESS)):
        with pytest.raises(ScheduleError) as caught:
            lookup()
        assert isinstance(caught.value, PartitionError) and isinstance(caught.value, ValueError)
        message = str(caught.value)
        assert f"schedule={name!r} is not a registered schedule" in message
        assert "use one of 'gpipe', '1f1b', 'interleaved'" in message


# The registry


@registered
def test_every_registered_schedule_validates(
    kind: ScheduleKind, n_stages: int, n_microbatches: int, virtual: int
) -> None:
    schedule = kind.build(n_stages, n_microbatches, virtual)
    validate(schedule, n_stages, n_microbatches, virtual, kind.place(n_stages, virtual))
    assert make_schedule(kind.name, n_stages, n_microbatches, virtual) == schedule
    clock_ticks(schedule)  # its own P, m and v are read back from the actions


@registered
def test_every_registered_peak_matches_its_schedule(
    kind: ScheduleKind, n_stages: int, n_microbatches: int, virtual: int
) -> None:
    peaks = in_flight(kind.build(n_stages, n_microbatches, virtual))
    assert tuple(kind.in_flight(n_stages, n_microbatches, j, virtual)
                 for j in range(n_stages)) == peaks


@registered
def test_every_registered_schedule_s_held_moments_reach_its_peak(
    kind: ScheduleKind, n_stages: int, n_microbatches: int, virtual: int
) -> None:
    # Weighing every virtual stage alike, the heaviest moment is the plain peak; no moment
    # kept is exceeded by another in every entry.
    for j in range(n_stages):
        moments = kind.held_by_stage(n_stages, n_microbatches, j, virtual)
        assert max(map(sum, moments)) == kind.in_flight(n_stages, n_microbatches, j, virtual)
        assert {len(c) for c in moments} == {virtual}
        assert not any(a != b and all(x >= y for x, y in zip(a, b))
                       for a in moments for b in moments)


def test_held_moments_see_an_interleaved_device_s_chunks_apart() -> None:
    # Device 1 of 2, 4 micro-batches, 2 chunks: three of chunk 0 with none of chunk 1 (the
    # fill) or two and one; the plain count (3) would hold three of the larger chunk.
    assert SCHEDULES["interleaved"].held_by_stage(2, 4, 1, 2) == ((2, 1), (3, 0))


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_every_registered_rule_is_the_generator_s(name: str) -> None:
    # The entry states which counts its generator accepts (the search enumerates from
    # them without building): the generator must refuse exactly the others.
    kind = SCHEDULES[name]
    for p, m, v in [(p, m, v) for p in range(1, 6) for m in range(1, 11) for v in VIRTUAL]:
        problems = kind.problems(p, m, v)
        args = (p, m, v) if kind.virtual else (p, m)
        if problems:
            if kind.virtual or v == 1:  # a generator without virtual stages cannot see v
                with pytest.raises(ScheduleError):
                    kind.generate(*args)
            with pytest.raises(ScheduleError) as caught:
                kind.build(p, m, v)
            assert str(caught.value) == "; ".join(problems)
        else:
            assert kind.generate(*args) == kind.build(p, m, v)


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_last_backward_first_is_what_the_schedule_does(name: str) -> None:
    kind = SCHEDULES[name]
    for p, m, v in grid(kind)[:60]:
        if m < 2:
            continue
        firsts = [next(a for a in actions if a.phase.gives_input_grad)
                  for actions in kind.build(p, m, v)]
        assert all(a.microbatch == m - 1 for a in firsts) == kind.last_backward_first


def test_virtual_stages_are_asked_of_interleaved_only() -> None:
    with pytest.raises(ScheduleError, match="'interleaved' needs virtual >= 2.*got virtual=1"):
        make_schedule("interleaved", 2, 4)
    with pytest.raises(ScheduleError, match="'1f1b' runs one virtual stage per stage, got "
                                            "virtual=2; pass virtual=1, or use one of "
                                            "'interleaved'"):
        make_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ScheduleError, match="groups of the 4 stages, got 6 micro-batches"):
        make_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="virtual must be an int >= 1, got 0"):
        make_schedule("gpipe", 4, 6, 0)


def test_runtimes_execute_what_the_registry_says() -> None:
    every = (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE)
    assert schedule_names([Runtime.ONE_PROCESS]) == (*every, V_SHAPE)
    assert schedule_names([Runtime.MULTI_PROCESS]) == (*every, V_SHAPE)
    assert schedule_names(virtual=True) == (INTERLEAVED, V_SHAPE)
    assert schedule_names(searched=True) == (*every, V_SHAPE)
    assert check_runtime(GPIPE, Runtime.ONE_PROCESS) is SCHEDULES[GPIPE]
    assert runtime_problem(ZERO_BUBBLE, Runtime.MULTI_PROCESS) is None
    with pytest.raises(ScheduleError, match="schedule='zb' is not a registered schedule"):
        check_runtime("zb", Runtime.ONE_PROCESS)


def test_the_registry_cannot_be_changed_by_accident() -> None:
    with pytest.raises(TypeError):
        SCHEDULES["mine"] = SCHEDULES[GPIPE]  # type: ignore[index]


# Interleaved


def test_interleaved_runs_every_virtual_stage_s_actions_once_per_stage() -> None:
    p, m, v = 3, 6, 2
    for j, actions in enumerate(interleaved(p, m, v)):
        expected = {Action(c * p + j, phase, i) for c in range(v)
                    for phase in (Phase.FORWARD, Phase.BACKWARD) for i in range(m)}
        assert set(actions) == expected and len(actions) == len(expected)


def test_interleaved_walks_chunks_in_groups_of_p_microbatches() -> None:
    assert text_of(interleaved(2, 2, 2)) == [
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1",
        "1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1",
    ]


@pytest.mark.parametrize(("n_stages", "n_microbatches", "virtual", "expected"), [
    (4, 6, 2, "n_microbatches=6 is not a multiple of n_stages=4"),
    (2, 4, 1, "virtual=1; interleaving needs 2 or more"),
    (2, 4, 0, "virtual must be an int >= 1, got 0"),
])
def test_interleaved_refuses_counts_it_cannot_run(
    n_stages: int, n_microbatches: int, virtual: int, expected: str
) -> None:
    with pytest.raises(ScheduleError, match=expected):
        interleaved(n_stages, n_microbatches, virtual)


def test_interleaved_divides_the_bubble_by_the_virtual_stages() -> None:
    # Each action is one chunk, 1/v of a stage: with forward and backward of one tick the
    # fill and drain are (P - 1) chunk ticks each, so the bubble is (P-1) / (v m + P - 1).
    for p, m, v in [(2, 4, 2), (4, 8, 2), (3, 6, 3)]:
        bubble = bubble_fraction(interleaved(p, m, v), 1.0, 1.0)
        assert Fraction(bubble).limit_denominator(1000) == Fraction(p - 1, v * m + p - 1)


def test_render_draws_interleaved_one_row_per_stage() -> None:
    assert render(interleaved(2, 2, 2), 1.0, 1.0) == (
        "0F0 0F1 2F0 2F1   . 2B0   . 2B1 0B0 0B1\n"
        "  . 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1   ."
    )


# Memory and bubble


@pytest.mark.parametrize(("n_stages", "n_microbatches"), SIZES)
def test_gpipe_keeps_every_microbatch_in_flight(n_stages: int, n_microbatches: int) -> None:
    assert in_flight(gpipe(n_stages, n_microbatches)) == (n_microbatches,) * n_stages


@pytest.mark.parametrize(("n_stages", "n_microbatches"), SIZES)
def test_one_f_one_b_in_flight_is_min_of_stages_left_and_microbatches(
    n_stages: int, n_microbatches: int
) -> None:
    expected = tuple(min(n_stages - j, n_microbatches) for j in range(n_stages))
    assert in_flight(one_f_one_b(n_stages, n_microbatches)) == expected


@pytest.mark.parametrize(("n_stages", "n_microbatches"), SIZES)
def test_gpipe_bubble_is_p_minus_1_over_m_plus_p_minus_1(
    n_stages: int, n_microbatches: int
) -> None:
    bubble = bubble_fraction(gpipe(n_stages, n_microbatches), 1.0, 1.0)
    assert bubble == (n_stages - 1) / (n_microbatches + n_stages - 1)


@pytest.mark.parametrize(("n_stages", "n_microbatches"), SIZES)
def test_gpipe_bubble_is_unchanged_by_a_longer_backward(
    n_stages: int, n_microbatches: int
) -> None:
    # Fill and drain each cost P-1 forward+backward slots, as does the work per stage:
    # the fraction stays (P-1)/(m+P-1) with backward_time = 2 * forward_time.
    bubble = bubble_fraction(gpipe(n_stages, n_microbatches), 1.0, 2.0)
    assert bubble == (n_stages - 1) / (n_microbatches + n_stages - 1)


@pytest.mark.parametrize("backward_time", [1.0, 2.0, 3.0])
@pytest.mark.parametrize(("n_stages", "n_microbatches"), SIZES)
def test_one_f_one_b_bubble_equals_gpipe(
    n_stages: int, n_microbatches: int, backward_time: float
) -> None:
    ours = bubble_fraction(one_f_one_b(n_stages, n_microbatches), 1.0, backward_time)
    theirs = bubble_fraction(gpipe(n_stages, n_microbatches), 1.0, backward_time)
    assert ours == theirs


def test_bubble_fraction_counts_idle_stage_ticks() -> None:
    # gpipe(2, 3) with backward 2: 12 ticks, 9 busy on each stage.
    assert Fraction(bubble_fraction(gpipe(2, 3))) == Fraction(6, 24)


# Clock ticks and rendering


def test_clock_ticks_backward_occupies_ratio_ticks() -> None:
    grid = clock_ticks(gpipe(1, 1), forward_time=0.5, backward_time=1.5)
    assert [[str(a) for a in tick] for tick in grid] == [["0F0"], ["0B0"], ["0B0"], ["0B0"]]


def test_clock_ticks_marks_bubbles_none() -> None:
    grid = clock_ticks(gpipe(2, 1), 1.0, 1.0)
    assert grid == [
        [Action(0, Phase.FORWARD, 0), None],
        [None, Action(1, Phase.FORWARD, 0)],
        [None, Action(1, Phase.BACKWARD, 0)],
        [Action(0, Phase.BACKWARD, 0), None],
    ]


@pytest.mark.parametrize(("forward_time", "backward_time"), [(2.0, 3.0), (2.0, 1.0), (0.0, 1.0)])
def test_clock_ticks_rejects_non_whole_ratio(forward_time: float, backward_time: float) -> None:
    with pytest.raises(ScheduleError, match="forward_time"):
        clock_ticks(gpipe(2, 2), forward_time, backward_time)


def test_clock_ticks_rejects_invalid_schedule() -> None:
    with pytest.raises(ScheduleError, match="never runs 0B0"):
        clock_ticks(schedule_of("0F0"))


def test_render_gpipe_two_stages_three_microbatches() -> None:
    assert render(gpipe(2, 3)) == (
        "0F0 0F1 0F2   .   .   . 0B2 0B2 0B1 0B1 0B0 0B0\n"
        "  . 1F0 1F1 1F2 1B2 1B2 1B1 1B1 1B0 1B0   .   ."
    )


def test_render_one_f_one_b_two_stages_three_microbatches() -> None:
    assert render(one_f_one_b(2, 3)) == (
        "0F0 0F1   .   . 0B0 0B0 0F2 0B1 0B1   . 0B2 0B2\n"
        "  . 1F0 1B0 1B0 1F1 1B1 1B1 1F2 1B2 1B2   .   ."
    )


def test_render_widens_columns_for_long_labels() -> None:
    row = render(gpipe(1, 11), 1.0, 1.0)
    assert row.startswith(" 0F0  0F1  0F2")
    assert row.endswith("0F10 0B10  0B9  0B8  0B7  0B6  0B5  0B4  0B3  0B2  0B1  0B0")


# Validation of broken schedules


def test_validate_reports_missing_backward() -> None:
    message = problems_of(schedule_of("0F0 0F1 0B1 0B0", "1F0 1F1 1B1"), 2, 2)
    assert "stage 1 never runs 1B0" in message
    assert "1 problem:" in message


def test_validate_reports_duplicate_forward() -> None:
    message = problems_of(schedule_of("0F0 0F0 0B0"), 1, 1)
    assert "stage 0 runs 0F0 2 times; run it once" in message


def test_validate_reports_backward_before_forward() -> None:
    message = problems_of(schedule_of("0B0 0F0"), 1, 1)
    assert "stage 0 runs 0B0 before 0F0" in message
    # Reported once: the deadlock check would only restate it as a stuck stage.
    assert "1 problem:" in message


def test_validate_reports_forwards_out_of_order() -> None:
    message = problems_of(schedule_of("0F1 0F0 0B1 0B0"), 1, 2)
    assert "stage 0 runs forwards in micro-batch order [1, 0]; run them as [0, 1]" in message


def test_validate_reports_microbatch_out_of_range() -> None:
    message = problems_of(schedule_of("0F0 0B0 0F1 0B1"), 1, 1)
    assert "0F1 names micro-batch 1 but n_microbatches=1; use micro-batches 0..0" in message


def test_validate_reports_action_on_wrong_stage_list() -> None:
    message = problems_of(schedule_of("0F0 1F0 0B0", "1B0"), 2, 1)
    assert "stage 0 list holds 1F0; move it to stage 1's list" in message


def test_validate_reports_action_of_missing_stage() -> None:
    message = problems_of(schedule_of("0F0 0B0 4F0"), 1, 1)
    assert "stage 0 list holds 4F0, but n_stages=1; use stages 0..0" in message


def test_validate_reports_wrong_number_of_stage_lists() -> None:
    message = problems_of(gpipe(2, 2), 3, 2)
    assert "schedule has 2 stage lists but n_stages=3" in message


def test_validate_reports_entries_that_are_not_actions() -> None:
    broken = ((Action(0, Phase.FORWARD, 0), "0B0"),)
    message = problems_of(broken, 1, 1)  # type: ignore[arg-type]
    assert "stage 0 list holds '0B0', not an Action" in message


def test_validate_reports_deadlock_with_each_stuck_stage() -> None:
    # Stage 0 starts 0B0 before sending 0F1, but stage 1 needs 0F1 before it runs 1B0.
    message = problems_of(schedule_of("0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"), 2, 2)
    assert (
        "deadlock: stage 0 waits on 0B0 which needs 1B0; "
        "stage 1 waits on 1F1 which needs 0F1"
    ) in message


def test_validate_reports_every_problem_at_once() -> None:
    broken = schedule_of("0F1 0F0 0F0 1F0 0B0 0F9", "1B1 1F0 1F1 1B0", "")
    message = problems_of(broken, 2, 2)
    expected = [
        "schedule has 3 stage lists but n_stages=2",
        "stage 0 list holds 1F0; move it to stage 1's list",
        "0F9 names micro-batch 9 but n_microbatches=2",
        "stage 0 never runs 0B1",
        "stage 0 runs 0F0 2 times",
        "stage 0 runs forwards in micro-batch order [1, 0, 0]",
        "stage 1 runs 1B1 before 1F1",
    ]
    for problem in expected:
        assert problem in message
    assert "has 7 problems:" in message


def test_validate_accepts_a_hand_written_valid_schedule() -> None:
    validate(schedule_of("0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"), 2, 2)


def test_validate_with_virtual_stages_reads_stage_k_on_list_k_mod_p() -> None:
    validate(schedule_of("0F0 2F0 2B0 0B0", "1F0 3F0 3B0 1B0"), 2, 1, virtual=2)
    message = problems_of_virtual(schedule_of("0F0 3F0 2B0 0B0", "1F0 2F0 3B0 1B0"), 2, 1, 2)
    assert "stage 0 list holds 3F0; move it to stage 1's list" in message
    assert "stage 1 list holds 2F0; move it to stage 0's list" in message
    assert "schedule for 2 stages of 2 virtual stages each and 1 micro-batch" in message


def test_validate_with_virtual_stages_reports_missing_chunks_and_high_stages() -> None:
    message = problems_of_virtual(schedule_of("0F0 0B0 4F0", "1F0 3F0 3B0 1B0"), 2, 1, 2)
    assert "stage 0 list holds 4F0, but n_stages=2 and virtual=2; use stages 0..3" in message
    assert ("stage 0 never runs 2F0, 2B0; every stage runs each micro-batch's F and B once "
            "per virtual stage") in message


def test_validate_with_virtual_stages_checks_each_chunk_s_order_and_dependencies() -> None:
    message = problems_of_virtual(
        schedule_of("0F0 0F1 2F1 2F0 2B0 2B1 0B0 0B1", "1F0 1F1 3F0 3F1 3B0 3B1 1B0 1B1"),
        2, 2, 2)
    assert "stage 0 runs forwards of virtual stage 2 in micro-batch order [1, 0]" in message
    # Virtual stage 0's backward needs 1B0, which needs 2B0, queued behind 0B0 on stage 0.
    stuck = problems_of_virtual(
        schedule_of("0F0 2F0 0B0 2B0", "1F0 3F0 3B0 1B0"), 2, 1, 2)
    assert ("deadlock: stage 0 waits on 0B0 which needs 1B0; "
            "stage 1 waits on 1B0 which needs 2B0") in stuck


@pytest.mark.parametrize("module", [partitioner.runtime.schedule,
                                    partitioner.runtime.schedule_generators,
                                    partitioner.runtime.schedule_registry])
def test_docstring_examples_run(module: object) -> None:
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)  # type: ignore[arg-type]
    assert result.attempted > 0
    assert result.failed == 0


def test_each_schedule_times_its_own_fill_and_drain() -> None:
    # The predictor and the search call these hooks instead of branching on a name.
    forward, backward = [1.0, 1.0, 1.0], [2.0, 2.0, 2.0]
    assert SCHEDULES[ONE_F_ONE_B].hidden(backward, 0.5) == 0.0
    # Split backward: the weight halves of stages 1 and 2 wait in the bubbles (2 x 1); the
    # last one, stage 0's, ends the step.
    assert SCHEDULES[ZERO_BUBBLE].hidden(backward, 0.5) == 2.0
    assert SCHEDULES[ONE_F_ONE_B].bound(3, 4, 1, forward, backward, 0.5) == (4 + 2) * 9 / 3
    # The chain of forwards and input halves (3 x (1 + 1)), then 3 more micro-batches at
    # an even share of the work (9 / 3): the predictor's fill and drain, less stage 0's W.
    assert SCHEDULES[ZERO_BUBBLE].bound(3, 4, 1, forward, backward, 0.5) == 6 + 3 * 9 / 3
    assert SCHEDULES[V_SHAPE].bound(3, 1, 2, forward, backward, 0.5) == 9.0


def test_each_runtime_publishes_what_it_runs_besides_schedules() -> None:
    assert CAPABILITIES[Runtime.MULTI_PROCESS].optimizer_sharding
    assert not CAPABILITIES[Runtime.ONE_PROCESS].optimizer_sharding
    assert not any(c.virtual_with_tp for c in CAPABILITIES.values())


def test_the_registry_says_which_schedules_split_their_backwards() -> None:
    from partitioner.runtime.schedule_registry import SCHEDULES
    split = {name for name, kind in SCHEDULES.items() if kind.splits_backward}
    assert split == {"zero_bubble"}
