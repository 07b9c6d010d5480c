"""The V-shaped schedule (``v_shape``): a placement other than ``k % P`` read everywhere.

Adding it touched two files, ``runtime/schedule_generators.py`` (its generator and ``zigzag``
placement) and ``runtime/schedule_registry.py`` (its entry); these tests check the
schedule as data, train a model with it in one process, and simulate it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from models import mlp
from torch import nn

from partitioner import partition
from partitioner.errors import ScheduleError
from partitioner.runtime.local import fill_drain
from partitioner.runtime.placement import looped, placement_of
from partitioner.runtime.schedule import bubble_fraction, in_flight, validate
from partitioner.runtime.schedule_generators import one_f_one_b, v_shape, zigzag
from partitioner.runtime.schedule_registry import (
    V_SHAPE,
    Runtime,
    check_runtime,
    make_schedule,
    schedule_kind,
)


def test_the_v_goes_down_the_devices_and_back() -> None:
    assert zigzag(4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert schedule_kind(V_SHAPE).place(4, 2) == zigzag(4, 2)
    assert schedule_kind("interleaved").place(4, 2) == looped(4, 2)


@pytest.mark.parametrize(("p", "m", "v"), [(1, 1, 2), (2, 2, 2), (3, 5, 2), (4, 8, 2),
                                           (4, 3, 3), (5, 7, 4)])
def test_every_v_schedule_is_valid_under_its_placement(p: int, m: int, v: int) -> None:
    schedule = make_schedule(V_SHAPE, p, m, v)
    validate(schedule, p, m, v, zigzag(p, v))
    assert placement_of(schedule) == zigzag(p, v)
    assert max(in_flight(schedule)) <= min(2 * p, m) * v


def test_the_looped_placement_refuses_a_v() -> None:
    with pytest.raises(ScheduleError, match="stage 0 list holds 3F0; move it to stage 1's"):
        validate(v_shape(2, 2, 2), 2, 2, 2)


def test_its_bubble_is_below_1f1b_at_equal_work() -> None:
    assert bubble_fraction(v_shape(4, 16, 2)) < bubble_fraction(one_f_one_b(4, 16))


def test_both_runtimes_run_it() -> None:
    # Across processes (tests/runtime/distributed/test_v_shape_ranks.py) the turn, stages
    # P - 1 and P on the last rank, is handed over in memory, and rank 0 computes the loss.
    for runtime in Runtime:
        assert check_runtime(V_SHAPE, runtime) is schedule_kind(V_SHAPE)


def test_a_turn_within_one_rank_is_handed_over_without_a_message() -> None:
    from partitioner.runtime.distributed.p2p import Boundary, PipeLinks

    links = PipeLinks(None, None, None, torch.device("cpu"), stage_ranks=zigzag(2, 2), rank=1)
    boundary = Boundary.of((torch.zeros(2, 3), 4))
    out = torch.randn(2, 3)
    pending = links.recv_activations(1, 0, boundary)   # posted ahead, like a prefetch
    with pytest.raises(ScheduleError, match="the sender has not run yet"):
        links.recv_grads(1, 5, boundary).wait()
    links.send_activations(1, 0, boundary, [out])
    assert pending.wait()[0] is not out and torch.equal(pending.wait()[0], out)


def test_fill_drain_follows_the_placement() -> None:
    text = [" ".join(map(str, a)) for a in fill_drain(2, 1, 2, zigzag(2, 2))]
    assert text == ["0F0 3F0 3B0 0B0", "1F0 2F0 2B0 1B0"]


@pytest.mark.parametrize("step", [True, False])
def test_a_v_pipeline_trains_like_the_model(step: bool) -> None:
    torch.manual_seed(0)
    model = mlp((12, 32, 32, 32, 32, 16, 6))
    reference = copy.deepcopy(model)
    x, y = torch.randn(16, 12), torch.randn(16, 6)
    pm = partition(model, ["cpu"] * 2, "pipeline", example_inputs=(x,), chunks=4,
                   schedule=V_SHAPE, virtual_stages=2)
    try:
        assert pm.plan.schedule == V_SHAPE and len(pm.plan.stages) == 4
        assert [s.device for s in pm.plan.stages] == ["cpu"] * 4
        nn.functional.mse_loss(reference(x), y).backward()
        if step:
            loss = pm.step(x, y, nn.functional.mse_loss)
        else:
            loss = nn.functional.mse_loss(pm(x), y)
            loss.backward()
        torch.testing.assert_close(torch.as_tensor(float(torch.as_tensor(loss).detach())),
                                   nn.functional.mse_loss(reference(x), y).detach())
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)
    finally:
        pm.close()


def test_timelines_put_each_stage_on_its_placed_device() -> None:
    from types import SimpleNamespace

    from partitioner.runtime.action import Action
    from partitioner.viz.timeline import simulated_timeline

    done = SimpleNamespace(peak_memory=[0.0, 0.0], updates=[],
                           timeline=[(Action.parse("3F0"), 0.0, 1.0),
                                     (Action.parse("2F0"), 1.0, 2.0)])
    rows = [b.stage for b in simulated_timeline(done, placement=zigzag(2, 2)).bars]  # its row
    assert rows == [0, 1]  # looped would put 3F0 on device 1 and 2F0 on device 0
