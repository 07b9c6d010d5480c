"""Tests of partitioner/cost/devices.py: specs, presets, links, clusters and devices=."""

from __future__ import annotations

import doctest
from dataclasses import replace

import pytest
import torch
from torch import nn

import partitioner.cost.devices
from partitioner import make_plan, partition
from partitioner.cost.devices import (
    DEVICES,
    LINKS,
    Cluster,
    DeviceSpec,
    LinkSpec,
    parse_devices,
)
from partitioner.cost.machine import as_cluster, local_cluster
from partitioner.errors import DeviceError, PartitionError


def test_presets_carry_datasheet_figures() -> None:
    a100, h100 = DEVICES["A100-80GB"], DEVICES["H100-SXM"]
    assert a100.flops("bf16") == 312e12 and a100.flops("fp32") == 19.5e12
    assert a100.memory_bandwidth == 2.039e12 and a100.memory_bytes == 80 * 2**30
    assert DEVICES["A100-40GB"].memory_bandwidth == 1.555e12
    assert h100.flops("bf16") == 989e12 and h100.memory_bandwidth == 3.35e12
    assert DEVICES["H200"].memory_bytes == 141e9 and DEVICES["H200"].memory_bandwidth == 4.8e12
    assert DEVICES["V100"].flops("fp16") == 125e12
    assert set(DEVICES) == {"V100", "A100-40GB", "A100-80GB", "H100-SXM", "H100-HBM2e-500W",
                            "H200"}


def test_grand_teton_preset_is_torchtitans_published_part() -> None:
    # torchtitan's benchmark files: 96GB HBM2e at 2.4 TB/s, 500 W; the peak is not published,
    # so the SXM datasheet's (an upper bound) and its measured MAMF stay.
    teton, sxm = DEVICES["H100-HBM2e-500W"], DEVICES["H100-SXM"]
    assert (teton.memory_bytes, teton.memory_bandwidth) == (96 * 2**30, 2.4e12)
    assert teton.matmul_rate(1e15, "bf16") == sxm.matmul_rate(1e15, "bf16")
    assert teton.attention_efficiency == sxm.attention_efficiency == 0.35
    assert Cluster.preset("H100-HBM2e-500W", nodes=2).inter_node == LINKS["ib-ndr"]


def test_attention_rate_is_the_product_curve_at_the_attention_efficiency() -> None:
    spec = DeviceSpec("d", {"bf16": 100e12}, 1e9, 1e12, matmul_efficiency=0.8,
                      matmul_half_flops=1e9, attention_efficiency=0.35)
    assert spec.attention_rate(1e15, "bf16") == pytest.approx(0.35 * 100e12, rel=1e-5)
    assert spec.attention_rate(1e9, "bf16") == pytest.approx(0.35 / 2 * 100e12)
    unset = replace(spec, attention_efficiency=0.0)
    assert unset.attention_rate(1e12, "bf16") == unset.matmul_rate(1e12, "bf16")
    with pytest.raises(DeviceError, match="attention_efficiency=-0.1"):
        replace(spec, attention_efficiency=-0.1)


def test_unknown_dtype_falls_back_to_fp32_peak() -> None:
    assert DEVICES["A100-80GB"].flops("int4") == 19.5e12


def test_matmul_rate_follows_the_efficiency_curve() -> None:
    spec = DeviceSpec("d", {"fp32": 100e12}, 1e9, 1e12, matmul_efficiency=0.8,
                      matmul_half_flops=1e9)
    assert spec.matmul_rate(1e9) == pytest.approx(0.4 * 100e12)
    assert spec.matmul_rate(1e15) == pytest.approx(0.8 * 100e12, rel=1e-5)
    assert spec.matmul_rate(1e6) < spec.matmul_rate(1e9) < spec.matmul_rate(1e12)


def test_device_spec_lists_every_problem() -> None:
    with pytest.raises(DeviceError) as info:
        DeviceSpec("bad", {"fp32": -1.0}, 0.0, 1e9, matmul_efficiency=1.5, op_overhead=-1)
    message = str(info.value)
    for part in ("peak_flops['fp32']", "memory_bytes=0.0", "matmul_efficiency=1.5",
                 "op_overhead=-1"):
        assert part in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, PartitionError)


def test_device_spec_accepts_a_mapping_and_is_hashable() -> None:
    spec = DeviceSpec("d", {"bf16": 2.0, "fp32": 1.0}, 1.0, 1.0)
    assert spec.peak_flops == (("bf16", 2.0), ("fp32", 1.0))
    assert hash(spec) == hash(DeviceSpec("d", {"fp32": 1.0, "bf16": 2.0}, 1.0, 1.0))


def test_shared_sizes_are_checked_and_looked_up_by_size() -> None:
    for rows, words in ((((1e6, 1.0, 2.0), (1e3, 1.0, 1.5)), "ascending"),
                        (((1e6, 1.0),), "then 1 speedups"),
                        (((1e6, 2.0, 2.0),), "1.0")):
        with pytest.raises(DeviceError, match=words):
            DeviceSpec("d", {"fp32": 1.0}, 1.0, 1.0, shared_speedup=(1.0, 1.2),
                       shared_sizes=rows)
    with pytest.raises(DeviceError, match="give both or neither"):
        DeviceSpec("d", {"fp32": 1.0}, 1.0, 1.0, shared_sizes=((1e6, 1.0, 2.0),))
    spec = DeviceSpec("d", {"fp32": 1.0}, 1.0, 1.0, shared_speedup=(1.0, 1.2),
                      shared_sizes=((0.0, 1.0, 0.5), (1e6, 1.0, 2.0), (1e8, 1.0, 1.0)))
    assert spec.speedup(2, 1e3) == 2.0 and spec.speedup(2, 1e10) == 1.0  # flat beyond
    assert spec.speedup(2, 1e7) == pytest.approx(1.5)  # linear in log(flops)
    assert spec.speedup(1.5, 0.0) == pytest.approx(0.75)  # memory-bound, 1.5 busy
    assert spec.speedup(2) == 1.2 and spec.max_speedup == 2.0
    products_only = replace(spec, shared_sizes=spec.shared_sizes[1:])
    assert products_only.speedup(2, 0.0) == 1.2  # no element-wise row: the reference


def test_shared_speedup_must_start_at_one() -> None:
    with pytest.raises(DeviceError, match="shared_speedup"):
        DeviceSpec("d", {"fp32": 1.0}, 1.0, 1.0, shared_speedup=(2.0, 3.0))
    spec = DeviceSpec("d", {"fp32": 1.0}, 1.0, 1.0, shared_speedup=(1.0, 1.2))
    assert spec.speedup(1) == 1.0 and spec.speedup(2) == 1.2 and spec.speedup(5) == 1.2
    assert DEVICES["A100-80GB"].speedup(4) == 4.0  # devices with their own compute


def test_link_time_is_alpha_plus_bytes_over_effective_bandwidth() -> None:
    link = LinkSpec("l", bandwidth=100e9, latency=1e-5, efficiency=0.5)
    assert link.time(1e9) == pytest.approx(1e-5 + 1e9 / 50e9)
    assert link.time(0) == 0.0
    with pytest.raises(DeviceError, match="bandwidth=0.*efficiency=2"):
        LinkSpec("bad", 0.0, 1e-6, 2.0)


def test_cluster_preset_topology() -> None:
    cluster = Cluster.preset("A100-80GB", nodes=4)
    assert cluster.size == 32 and cluster.node_of(7) == 0 and cluster.node_of(8) == 1
    assert cluster.intra_node is LINKS["nvlink3"]
    assert cluster.link(0, 7).name == "NVLink 3"
    assert cluster.link(0, 8).name.startswith("InfiniBand")
    assert cluster.link(0, 8).bandwidth == 25e9  # one of 8 NICs per GPU


def test_group_link_shares_a_node_s_nics_by_ranks_per_node() -> None:
    cluster = Cluster.preset("A100-80GB", nodes=4)
    assert cluster.group_link(range(8)) is cluster.intra_node
    assert cluster.group_link(range(32)).bandwidth == 200e9  # 8 ranks per node: all NICs
    assert cluster.group_link([0, 8, 16, 24]).bandwidth == 25e9  # 1 rank per node
    assert cluster.group_link([0, 1, 8, 9]).bandwidth == 50e9


def test_cluster_validation_collects_problems() -> None:
    with pytest.raises(DeviceError, match="nodes=0.*devices_per_node=-1"):
        Cluster(DEVICES["V100"], nodes=0, devices_per_node=-1)
    with pytest.raises(DeviceError, match="inter_node is None"):
        Cluster(DEVICES["V100"], nodes=2, devices_per_node=8)
    with pytest.raises(DeviceError, match="no preset device 'TPU'"):
        Cluster.preset("TPU")


def test_local_cluster_is_this_machine() -> None:
    cluster = local_cluster(["cpu", "cpu", "cpu"])
    assert cluster.is_local and cluster.local == ("cpu", "cpu", "cpu") and cluster.size == 3
    assert parse_devices(cluster) == [torch.device("cpu")] * 3
    assert as_cluster(cluster) is cluster
    assert not Cluster.preset("H100-SXM").is_local


def test_devices_accepts_strings_an_int_or_a_cluster() -> None:
    assert parse_devices("cpu") == [torch.device("cpu")]
    assert [d.type for d in parse_devices(2)] == ["cuda" if torch.cuda.is_available()
                                                  else "cpu"] * 2
    with pytest.raises(DeviceError, match="not this machine's devices; plan for it with "
                                          "make_plan"):
        parse_devices(Cluster.preset("A100-80GB"))


def test_make_plan_and_partition_take_strings_an_int_or_a_cluster() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 2))
    x = torch.randn(4, 8)
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    assert len(make_plan(model, "cpu", example_inputs=(x,)).stages) == 1
    two = ["cpu", torch.device("cpu")]
    assert len(make_plan(model, two, "pipeline", example_inputs=(x,)).stages) == 2
    by_count = make_plan(model, 2, "pipeline", example_inputs=(x,))
    assert [s.device.split(":")[0] for s in by_count.stages] == [kind, kind]
    here = local_cluster(["cpu"] * 3)
    assert make_plan(model, here, "pipeline", example_inputs=(x,)).devices == ("cpu",) * 3
    torch.testing.assert_close(partition(model, here, example_inputs=(x,))(x), model(x))


def test_cpu_devices_each_may_use_the_machine_s_memory() -> None:
    one = local_cluster(["cpu"]).spec(0).memory_bytes
    four = local_cluster(["cpu"] * 4)
    assert all(four.spec(r).memory_bytes == one for r in range(4))
    assert four.device.flops() == local_cluster(["cpu"]).device.flops()


def test_describe_names_devices_and_links() -> None:
    text = Cluster.preset("A100-80GB", nodes=2).describe()
    assert text == ("2 x 8 A100-80GB, NVLink 3 inside, 8 x InfiniBand HDR 200 Gb/s between "
                    "nodes")


def test_doctests() -> None:
    assert doctest.testmod(partitioner.cost.devices).failed == 0
