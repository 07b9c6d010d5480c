"""Device-name matching and link presets, each defined once (``partitioner.cost.device_names``,
``partitioner.cost.devices.LINKS``)."""

from __future__ import annotations

from unittest import mock

import torch

import partitioner.cost.machine as machine
import partitioner.planning.world as world
from partitioner.cost.device_names import ASSUMED_GPU, gpu_spec, preset_for, preset_key
from partitioner.cost.devices import DEVICES, LINKS


def test_gpu_names_match_their_presets() -> None:
    assert preset_for("NVIDIA H200", 141e9) == "H200"
    assert preset_for("NVIDIA H100 80GB HBM3", 80 * 2**30) == "H100-SXM"
    assert preset_for("NVIDIA A100-SXM4-40GB", 40 * 2**30) == "A100-40GB"
    assert preset_for("NVIDIA A100-SXM4-80GB", 80 * 2**30) == "A100-80GB"
    assert preset_for("Tesla V100-SXM2-32GB", 32 * 2**30) == "V100"
    assert preset_for("NVIDIA L4", 24e9) is None


def test_typed_preset_names_match_case_insensitively() -> None:
    assert preset_key("a100-80gb") == "A100-80GB"
    assert preset_key("H100-sxm") == "H100-SXM"
    assert preset_key("a100") is None


def test_a_known_gpu_keeps_its_preset_with_its_own_memory() -> None:
    spec = gpu_spec("NVIDIA H100 80GB HBM3", 79e9)
    assert spec.peak_flops == DEVICES["H100-SXM"].peak_flops and spec.memory_bytes == 79e9


def test_local_and_world_planning_treat_an_unknown_gpu_alike() -> None:
    # machine.spec_for (partition on local GPUs) and world_cluster (partition_distributed)
    # used to disagree: one assumed a mid-range GPU, the other refused.
    with mock.patch("partitioner.runtime.device.properties", return_value=("NVIDIA L4", 24e9)):
        local = machine.spec_for(torch.device("cuda", 0))
    remote = world.world_cluster(["a"], "cuda", gpu_name="NVIDIA L4", gpu_memory=24e9).device
    assert local.peak_flops == remote.peak_flops == ASSUMED_GPU.peak_flops
    assert local.memory_bytes == remote.memory_bytes == 24e9
    assert "assumed" in local.name and "assumed" in remote.name


def test_world_links_are_the_link_presets() -> None:
    assert world.LOOPBACK is LINKS["loopback"] and world.ETHERNET is LINKS["ethernet-10g"]
