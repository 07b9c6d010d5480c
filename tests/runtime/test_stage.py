"""StageRunner: dropout generators of a tensor-parallel rank's stage, and their replay."""

from __future__ import annotations

import torch
from torch import fx, nn

from partitioner.runtime import rng
from partitioner.runtime.stage import StageRunner
from partitioner.runtime.tensor_parallel import ops as tpops


class _TwoDropouts(nn.Module):
    """Dropout on a replicated value, then on a split one (what a split MLP's graph has)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rng.dropout(x, 0.5, True), tpops.sharded_dropout(x * 1.0, 0.5, True)


def _runner(shard: int | None) -> StageRunner:
    module: fx.GraphModule = _TwoDropouts()  # type: ignore[assignment]
    runner = StageRunner(0, module, torch.device("cpu"), shard=shard)
    runner.reset(1234)
    return runner


def test_ranks_share_replicated_masks_and_draw_their_own_for_split_values() -> None:
    x = torch.ones(256)
    outs = [_runner(shard).forward(0, [x], grad=False, checkpoint=False) for shard in (0, 1)]
    torch.testing.assert_close(outs[0][0], outs[1][0])  # replicated: same mask everywhere
    assert not torch.equal(outs[0][1], outs[1][1])  # split: each rank its own mask
    plain = _runner(None).forward(0, [x], grad=False, checkpoint=False)
    torch.testing.assert_close(plain[0], outs[0][0])  # the stage's generator as before


def test_checkpointed_replay_redraws_both_masks() -> None:
    for checkpoint in (False, True):
        runner = _runner(shard=1)
        x = torch.ones(256, requires_grad=True)
        replicated, split = runner.forward(0, [x], grad=True, checkpoint=checkpoint)
        (x_grad,) = runner.backward(0, [torch.ones(256), torch.ones(256)])
        # d(sum of both outputs)/dx is the sum of the masks the forward drew (scaled by 2)
        torch.testing.assert_close(x_grad, (replicated + split).detach())
