"""Tests of partitioner/planning/solver.py against brute force over every composition."""

from __future__ import annotations

import itertools
import math
import pickle
import random

import pytest

from partitioner.planning.solver import (
    InfeasibleError,
    PartitionProblem,
    PartitionSolution,
    evaluate,
    lower_bound,
    solve,
    stage_time,
)

TOL = 1e-12


def near(x: float, y: float) -> bool:
    return abs(x - y) <= 1e-9 * max(1.0, abs(x), abs(y))


def random_problem(rng: random.Random, integer: bool) -> PartitionProblem:
    """Heterogeneous devices; integer times make exact ties, so tie-breaks matter."""
    n_layers = rng.randint(1, 9)
    n_stages = rng.randint(1, min(n_layers, 5))

    def draw(top: float) -> float:
        return float(rng.randint(0, int(top))) if integer else rng.uniform(0, top)

    memory = [rng.randint(1, 5) for _ in range(n_layers)]
    capacity = [
        rng.choice([math.inf, rng.randint(1, sum(memory))]) for _ in range(n_stages)
    ]
    return PartitionProblem(
        compute=tuple(tuple(draw(4) for _ in range(n_layers)) for _ in range(n_stages)),
        transfer=tuple(
            tuple(draw(3) for _ in range(n_layers + 1)) for _ in range(n_stages)
        ),
        memory=tuple(memory),
        capacity=tuple(capacity),
    )


def compositions(n_layers: int, n_stages: int) -> list[tuple[int, ...]]:
    inner = itertools.combinations(range(1, n_layers), n_stages - 1)
    return [(0, *cuts, n_layers) for cuts in inner]


def fits(problem: PartitionProblem, cuts: tuple[int, ...], capacity: float) -> bool:
    return all(
        sum(problem.memory[a:b]) <= capacity for a, b in itertools.pairwise(cuts)
    )


def brute_force(
    problem: PartitionProblem,
) -> tuple[tuple[int, ...], float, float] | None:
    """The best (boundaries, bottleneck, total) by the documented rules, or None."""
    scored = []
    for cuts in compositions(problem.n_layers, problem.n_stages):
        spans = list(itertools.pairwise(cuts))
        if any(
            sum(problem.memory[a:b]) > problem.capacity[j]
            for j, (a, b) in enumerate(spans)
        ):
            continue
        times = [
            sum(problem.compute[j][a:b]) + (problem.transfer[j][a] if j > 0 else 0.0)
            for j, (a, b) in enumerate(spans)
        ]
        scored.append((cuts, max(times), sum(times)))
    if not scored:
        return None
    best = min(m for _, m, _ in scored)
    near_best = [s for s in scored if s[1] <= best + TOL * max(1.0, best)]
    total = min(t for _, _, t in near_best)
    cuts = min(c for c, _, t in near_best if t <= total + TOL * max(1.0, total))
    return cuts, best, total


def brute_min_devices(problem: PartitionProblem) -> int | None:
    largest = max(problem.capacity)
    for n in range(1, problem.n_layers + 1):
        if any(
            fits(problem, cuts, largest) for cuts in compositions(problem.n_layers, n)
        ):
            return n
    return None


@pytest.mark.parametrize("integer", [True, False], ids=["integer_ties", "float"])
def test_solve_matches_brute_force_and_tie_break(integer: bool) -> None:
    rng = random.Random(1234 + integer)
    solved = 0
    for case in range(400):
        problem = random_problem(rng, integer)
        expected = brute_force(problem)
        if expected is None:
            continue
        solved += 1
        solution = solve(problem)
        cuts, best, total = expected
        context = f"case {case}: {problem}"
        assert near(solution.bottleneck, best), context
        assert near(solution.total_time, total), context
        assert solution.boundaries == cuts, context
    assert solved > 200  # the generator must mostly produce solvable instances


def test_solve_raises_infeasible_exactly_when_brute_force_finds_nothing() -> None:
    rng = random.Random(99)
    infeasible = 0
    for case in range(400):
        problem = random_problem(rng, integer=True)
        if brute_force(problem) is not None:
            solve(problem)
            continue
        infeasible += 1
        with pytest.raises(InfeasibleError) as info:
            solve(problem)
        assert info.value.min_devices == brute_min_devices(problem), (
            f"case {case}: {problem}"
        )
    assert infeasible > 30  # the generator must also produce infeasible instances


def test_solve_prefers_smaller_total_over_smaller_boundaries() -> None:
    # Stage 2 must hold the 10-layer alone; (0, 1, 3, 4) and (0, 2, 3, 4) both have
    # bottleneck 10, totals 15 and 13.
    problem = PartitionProblem(
        compute=((1, 1, 1, 10), (1, 3, 1, 10), (10, 10, 10, 10)),
        transfer=((0,) * 5,) * 3,
        memory=(0,) * 4,
        capacity=(math.inf,) * 3,
    )
    solution = solve(problem)
    assert solution.boundaries == (0, 2, 3, 4)
    assert solution.stage_times == (2.0, 1.0, 10.0)


def test_solve_breaks_remaining_ties_by_smallest_boundaries() -> None:
    # Every split of the four 1-layers over stages 0 and 1 has bottleneck 10 and total 14.
    problem = PartitionProblem.uniform([1, 1, 1, 1, 10], n_stages=3)
    assert solve(problem).boundaries == (0, 1, 4, 5)


def test_solve_treats_rounding_differences_as_ties() -> None:
    # (0, 1, 3) has bottleneck 0.3; (0, 2, 3) has 0.1 + 0.2, which rounds to
    # 0.30000000000000004, and the smaller total, so it must win the tie.
    problem = PartitionProblem(
        compute=((0.1, 0.2, 5), (5, 0.3, 0.0)),
        transfer=((0,) * 4,) * 2,
        memory=(0,) * 3,
        capacity=(math.inf,) * 2,
    )
    assert solve(problem).boundaries == (0, 2, 3)


def test_solve_charges_transfer_to_receiving_stage() -> None:
    # Cutting at 2 is the balanced split, but receiving there costs 5 (and at 1, 4).
    problem = PartitionProblem.uniform(
        [1, 1, 1, 1], n_stages=2, transfer=[0, 4, 5, 0, 0]
    )
    solution = solve(problem)
    assert solution.boundaries == (0, 3, 4)
    assert solution.bottleneck == 3.0


def test_solve_respects_heterogeneous_memory() -> None:
    problem = PartitionProblem.uniform(
        [1] * 6, n_stages=2, memory=[1] * 6, capacity=[1, 10]
    )
    assert solve(problem).balance == (1, 5)


def test_infeasible_error_reports_min_devices_and_limit() -> None:
    problem = PartitionProblem.uniform(
        [1] * 12, n_stages=2, memory=[0.3e9] * 12, capacity=1e9
    )
    with pytest.raises(InfeasibleError) as info:
        solve(problem)
    assert info.value.min_devices == 4
    message = str(info.value)
    assert "no partition of 12 layers into 2 stages fits" in message
    assert "stage memory limit 1.0 GB; 4 devices of that size would fit" in message


def test_infeasible_error_min_devices_none_when_one_layer_is_too_big() -> None:
    problem = PartitionProblem.uniform(
        [1] * 3, n_stages=2, memory=[1, 5e9, 1], capacity=2e9
    )
    with pytest.raises(InfeasibleError) as info:
        solve(problem)
    assert info.value.min_devices is None
    assert "layer 1 alone needs 5.0 GB" in str(info.value)


def test_infeasible_error_names_heterogeneous_limits() -> None:
    # One device of 10 B would hold both layers, but stage 0 gets the 1-byte device.
    problem = PartitionProblem.uniform(
        [1, 1], n_stages=2, memory=[5, 5], capacity=[1, 10]
    )
    with pytest.raises(InfeasibleError) as info:
        solve(problem)
    assert info.value.min_devices == 1
    assert "stage memory limits 1 B, 10 B" in str(info.value)


def test_infeasible_error_survives_pickling() -> None:
    error = pickle.loads(pickle.dumps(InfeasibleError("no fit", 4)))
    assert (str(error), error.min_devices) == ("no fit", 4)


def test_more_stages_than_layers_raises_value_error() -> None:
    problem = PartitionProblem.uniform([1, 1], n_stages=3)
    with pytest.raises(
        ValueError, match="cannot split 2 layers into 3 non-empty stages"
    ):
        solve(problem)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"compute": ((1, 2, 3), (1, 2))}, "lengths (3, 2)"),
        ({"compute": ()}, "compute has no rows"),
        ({"compute": ((), ())}, "lengths (0, 0)"),
        ({"compute": ((1, 2, 3), (1, 2, -0.5))}, "compute[1][2] is -0.5"),
        ({"compute": ((1, math.inf, 3), (1, 2, 3))}, "compute[0][1] is inf"),
        ({"compute": ((1, "2", 3), (1, 2, 3))}, "'2'"),
        ({"transfer": ((0, 0, 0), (0, 0, 0))}, "lengths (3, 3)"),
        ({"transfer": ((0,) * 4,) * 3}, "transfer has 3 rows"),
        ({"transfer": ((0,) * 4, (0, 0, -2, 0))}, "transfer[1][2] is -2.0"),
        ({"memory": (1, 1)}, "memory has 2 entries; pass L = 3"),
        ({"memory": (1, math.nan, 1)}, "memory[1] is nan"),
        ({"capacity": (1,)}, "capacity has 1 entries; pass P = 2"),
        ({"capacity": (1, -1)}, "capacity[1] is -1.0"),
        ({"capacity": (1, math.nan)}, "capacity[1] is nan"),
    ],
)
def test_problem_rejects_bad_field(fields: dict[str, object], expected: str) -> None:
    good: dict[str, object] = {
        "compute": ((1, 2, 3), (1, 2, 3)),
        "transfer": ((0,) * 4,) * 2,
        "memory": (1, 1, 1),
        "capacity": (math.inf, math.inf),
    }
    with pytest.raises(ValueError) as info:
        PartitionProblem(**{**good, **fields})  # type: ignore[arg-type]
    assert expected in str(info.value)


def test_problem_reports_every_problem_at_once() -> None:
    with pytest.raises(ValueError) as info:
        PartitionProblem(
            compute=((1, -1),), transfer=((0, 0, 0),), memory=(-3, 1), capacity=(-7,)
        )
    message = str(info.value)
    assert all(
        part in message for part in ("compute[0][1]", "memory[0]", "capacity[0]")
    )


def test_problem_ignores_unused_transfer_entries() -> None:
    # Stage 0 never receives; no stage starts at boundary 0 or L.
    problem = PartitionProblem(
        compute=((1, 1), (1, 1)),
        transfer=((-1, math.nan, -1), (math.inf, 2, -5)),
        memory=(0, 0),
        capacity=(1, 1),
    )
    assert solve(problem).stage_times == (1.0, 3.0)


def test_uniform_replicates_rows_and_defaults() -> None:
    problem = PartitionProblem.uniform([1, 2], n_stages=3, capacity=[1, 2, 3])
    assert problem.compute == ((1.0, 2.0),) * 3
    assert problem.transfer == ((0.0, 0.0, 0.0),) * 3
    assert problem.memory == (0.0, 0.0)
    assert problem.capacity == (1.0, 2.0, 3.0)


def test_uniform_rejects_zero_stages() -> None:
    with pytest.raises(ValueError, match="n_stages is 0"):
        PartitionProblem.uniform([1, 2], n_stages=0)


def test_evaluate_agrees_with_solve_and_no_partition_beats_it() -> None:
    rng = random.Random(7)
    for _ in range(100):
        problem = random_problem(rng, integer=False)
        if brute_force(problem) is None:
            continue
        solution = solve(problem)
        assert evaluate(problem, solution.boundaries) == solution
        for cuts in compositions(problem.n_layers, problem.n_stages):
            other = evaluate(problem, cuts)
            if all(
                m <= c
                for m, c in zip(other.stage_memory, problem.capacity, strict=True)
            ):
                assert other.bottleneck >= solution.bottleneck - 1e-9


def test_evaluate_reports_stage_times_and_memory() -> None:
    problem = PartitionProblem(
        compute=((1, 2, 3), (10, 20, 30)),
        transfer=((0,) * 4, (0, 0, 5, 0)),
        memory=(1, 2, 4),
        capacity=(math.inf, math.inf),
    )
    solution = evaluate(problem, [0, 2, 3])
    assert solution.stage_times == (3.0, 35.0)
    assert solution.stage_memory == (3.0, 4.0)
    assert solution.bottleneck == 35.0
    assert solution.balance == (2, 1)


@pytest.mark.parametrize(
    ("cuts", "expected"),
    [
        ((1, 2, 4), "the first is 1, not 0"),
        ((0, 2, 3), "the last is 3, not L = 4"),
        ((0, 4), "they are 2 positions, not P + 1 = 3"),
        ((0, 2, 2, 4), "they are 4 positions"),
        ((0, 0, 4), "stage 0 is empty or reversed (0 to 0)"),
        ((0, 2.5, 4), "non-integer"),
    ],
)
def test_evaluate_rejects_bad_boundaries(cuts: tuple[int, ...], expected: str) -> None:
    problem = PartitionProblem.uniform([1, 1, 1, 1], n_stages=2)
    with pytest.raises(ValueError) as info:
        evaluate(problem, cuts)
    assert expected in str(info.value)
    assert str(cuts) in str(info.value)


def test_stage_time_adds_transfer_only_after_first_stage() -> None:
    problem = PartitionProblem.uniform([1, 2, 3], n_stages=2, transfer=[9, 5, 7, 9])
    assert stage_time(problem, 0, 1, 3) == 5.0
    assert stage_time(problem, 1, 1, 3) == 10.0
    assert stage_time(problem, 1, 2, 3) == 10.0


@pytest.mark.parametrize(("j", "a", "b"), [(2, 0, 1), (0, 1, 1), (0, 0, 4), (-1, 0, 1)])
def test_stage_time_rejects_out_of_range(j: int, a: int, b: int) -> None:
    problem = PartitionProblem.uniform([1, 2, 3], n_stages=2)
    with pytest.raises(ValueError, match=f"j={j}, a={a}, b={b}"):
        stage_time(problem, j, a, b)


def test_solution_rejects_inconsistent_fields() -> None:
    with pytest.raises(ValueError, match="stage 1 is empty or reversed"):
        PartitionSolution((0, 2, 2, 3), (1.0, 1.0, 1.0), (0.0, 0.0, 0.0), 1.0)
    with pytest.raises(ValueError, match="2 stages but 1 stage_times"):
        PartitionSolution((0, 1, 2), (1.0,), (0.0, 0.0), 1.0)
    with pytest.raises(ValueError, match="bottleneck 1.0 is not max"):
        PartitionSolution((0, 1, 2), (1.0, 2.0), (0.0, 0.0), 1.0)


def test_lower_bound_never_exceeds_optimum() -> None:
    rng = random.Random(3)
    checked = 0
    for _ in range(200):
        problem = random_problem(rng, integer=False)
        if brute_force(problem) is not None:
            checked += 1
            assert lower_bound(problem) <= solve(problem).bottleneck + 1e-9
    assert checked > 100


def test_lower_bound_is_tight_for_even_layers() -> None:
    problem = PartitionProblem.uniform([2] * 8, n_stages=4)
    assert lower_bound(problem) == solve(problem).bottleneck == 4.0


def test_lower_bound_uses_fastest_device_per_layer() -> None:
    problem = PartitionProblem(
        compute=((1, 9, 1), (9, 6, 9)),
        transfer=((0,) * 4,) * 2,
        memory=(0,) * 3,
        capacity=(math.inf,) * 2,
    )
    # Layer 1 takes at least 6; the average of the fastest times is (1 + 6 + 1) / 2 = 4.
    assert lower_bound(problem) == 6.0


def test_solve_handles_sixty_layers_on_sixteen_stages() -> None:
    rng = random.Random(60)
    speeds = [rng.uniform(0.5, 2.0) for _ in range(16)]
    problem = PartitionProblem(
        compute=tuple(
            tuple(s * rng.uniform(0.5, 2.0) for _ in range(60)) for s in speeds
        ),
        transfer=tuple(
            tuple(rng.uniform(0, 0.5) for _ in range(61)) for _ in range(16)
        ),
        memory=tuple(rng.randint(1, 10) * 1e8 for _ in range(60)),
        capacity=tuple(rng.choice([5e9, 1e10]) for _ in range(16)),
    )
    solution = solve(problem)
    assert len(solution.balance) == 16 and sum(solution.balance) == 60
    assert all(
        m <= c for m, c in zip(solution.stage_memory, problem.capacity, strict=True)
    )
    assert solution.bottleneck >= lower_bound(problem)
