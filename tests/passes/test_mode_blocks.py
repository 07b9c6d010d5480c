"""passes/mode_blocks.py: which nodes a symbolically traced grad-mode or autocast block
leaves that the graph would run in the wrong mode."""

from __future__ import annotations

import doctest

import torch
import torch.fx as fx

import partitioner.passes.mode_blocks
from partitioner.passes.mode_blocks import IN_BLOCK, ModeBlocks, live_in_blocks


def _graph(build) -> fx.Graph:  # type: ignore[no-untyped-def]
    """A graph from ``build(graph, x)``, its nodes made inside a block marked."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(build(graph, x))
    return graph


def _mark(*nodes: fx.Node) -> None:
    for node in nodes:
        node.meta[IN_BLOCK] = True


def test_a_block_the_output_reads_is_live_and_an_unread_one_is_not() -> None:
    def build(graph: fx.Graph, x: fx.Node) -> fx.Node:
        scale = graph.call_method("norm", (x,))
        unused = graph.call_method("div_", (graph.get_attr("w"), 2))
        _mark(scale, unused)
        return graph.call_function(torch.div, (x, scale))
    assert live_in_blocks(_graph(build)) == ["norm"]


def test_an_in_place_write_into_a_tensor_the_output_reads_is_live() -> None:
    def build(graph: fx.Graph, x: fx.Node) -> fx.Node:
        h = graph.call_function(torch.relu, (x,))
        clamp = graph.call_method("clamp_", (h,), {"min": 0.5})
        _mark(clamp)
        return graph.call_function(torch.mul, (h, 2))
    assert live_in_blocks(_graph(build)) == ["clamp_"]


def test_the_blocks_depth_counts_nested_blocks_and_decorators() -> None:
    @torch.no_grad()
    def decorated() -> int:
        return blocks.depth
    with ModeBlocks() as blocks:
        with torch.autocast("cpu", enabled=False), torch.enable_grad():
            assert blocks.depth == 2
        assert decorated() == 1
        assert blocks.depth == 0
    assert torch.autograd.grad_mode.no_grad.__enter__.__name__ == "__enter__"


def test_doctests() -> None:
    assert doctest.testmod(partitioner.passes.mode_blocks).failed == 0


def test_blocks_of_other_threads_and_from_before_do_not_count() -> None:
    import threading

    outer = torch.no_grad()
    outer.__enter__()
    with ModeBlocks() as blocks:
        outer.__exit__(None, None, None)  # entered before the watch: not counted down
        seen = []
        worker = threading.Thread(target=lambda: seen.append(_in_block(blocks)))
        worker.start()
        worker.join()
        assert blocks.depth == 0 and seen == [0]


def _in_block(blocks: ModeBlocks) -> int:
    with torch.no_grad():
        return blocks.depth
