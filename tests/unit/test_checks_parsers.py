"""Parsers on real captured outputs (tests/fixtures/{gpu,ib}/SOURCES.md says where from)."""

from __future__ import annotations

from pathlib import Path

import pytest

from clusterkit.checks.gpu_topology import (
    TopoParseError,
    parse_p2p,
    parse_query_gpu,
    parse_topo_matrix,
)
from clusterkit.checks.infiniband import (
    IBPort,
    parse_ibstat,
    parse_ibv_devinfo,
    parse_nccl_ib_hca,
    ports_from_sysfs,
    unmatched_hca_entries,
)
from tests.paths import TESTS

GPU = TESTS / "fixtures" / "gpu"
IB = TESTS / "fixtures" / "ib"


def _read(p: Path) -> str:
    return p.read_text(encoding="utf-8")


def test_every_fixture_is_listed_in_sources() -> None:
    for d in (GPU, IB):
        sources = _read(d / "SOURCES.md")
        for f in d.glob("*.txt"):
            assert f"`{f.name}`" in sources, f.name


def test_h100_sxm_nv18_with_nic_legend() -> None:
    m = parse_topo_matrix(_read(GPU / "topo_h100_sxm_8nic.txt"))
    assert m.gpus == tuple(f"GPU{i}" for i in range(8))
    assert m.nics == tuple(f"mlx5_{i}" for i in range(8))  # NIC0.. resolved via NIC Legend
    assert m.has_nvlink and {link for _a, _b, link in m.gpu_pairs()} == {"NV18"}
    assert m.link("GPU0", "NIC0") == "PIX" and m.link("GPU0", "NIC4") == "SYS"
    assert m.cpu_affinity["GPU0"] == "0-47,96-143" and m.cpu_affinity["GPU7"] == "48-95,144-191"
    assert m.numa_affinity["GPU4"] == "1" and m.numa_nodes() == {"0", "1"}


def test_pcie_only_box_has_sys_pairs_and_no_nvlink() -> None:
    m = parse_topo_matrix(_read(GPU / "topo_pcie_8gpu_pix_phb_sys.txt"))
    assert not m.has_nvlink and m.nics == ()
    assert ("GPU0", "GPU1") in m.pairs_with("PIX")
    assert len(m.pairs_with("SYS")) == 16  # 4x4 GPUs across the two sockets
    assert m.numa_affinity["GPU7"] == "1"


def test_tab_separated_with_empty_cells_and_nic_rows() -> None:
    m = parse_topo_matrix(_read(GPU / "topo_rtx4090_8gpu_2nic_tabs.txt"))
    assert m.nics == ("NIC0", "NIC1")  # no NIC Legend in this paste
    assert m.link("GPU6", "NIC0") == "PHB" and m.link("NIC0", "NIC1") == "PIX"
    assert m.cpu_affinity["GPU4"] == "56-111,168-223" and m.numa_affinity["GPU4"] == "1"
    assert not m.has_nvlink


def test_old_style_mlx5_header_and_mixed_nvlink() -> None:
    m = parse_topo_matrix(_read(GPU / "topo_2gpu_nv12_mlx5_columns_tabs.txt"))
    assert m.nics[:2] == ("mlx5_0", "mlx5_1") and m.link("GPU0", "GPU1") == "NV12"
    v = parse_topo_matrix(_read(GPU / "topo_v100_azure_nv1_nv2_mlx5.txt"))
    links = {link for _a, _b, link in v.gpu_pairs()}
    assert links == {"NV1", "NV2", "NODE"} and v.has_nvlink
    assert v.cpu_affinity["GPU0"] == "0-19" and v.nics == ("mlx5_0",)


def test_topo_garbage_is_a_parse_error() -> None:
    with pytest.raises(TopoParseError):
        parse_topo_matrix("NVIDIA-SMI has failed because it couldn't communicate with the driver")
    bad = _read(GPU / "topo_pcie_8gpu_pix_phb_sys.txt").replace("PIX     PHB", "PIXPHB", 1)
    with pytest.raises(TopoParseError):
        parse_topo_matrix(bad)


def test_p2p_matrix() -> None:
    p = parse_p2p(_read(GPU / "p2p_rw_2gpu_gns.txt"))
    assert p.gpus == ("GPU0", "GPU1") and p.not_ok() == [("GPU0", "GPU1", "GNS")]


def test_query_gpu_csv() -> None:
    # Not a captured output (none found, see SOURCES.md): the documented csv,noheader shape.
    gpus = parse_query_gpu("0, NVIDIA H100 80GB HBM3, 535.104.05, 81559 MiB\n"
                           "1, NVIDIA H100 80GB HBM3, 535.104.05, 81559 MiB\n")
    assert [g.index for g in gpus] == [0, 1] and gpus[0].memory_mib == 81559
    assert gpus[1].driver_version == "535.104.05" and gpus[1].name == "NVIDIA H100 80GB HBM3"
    with pytest.raises(TopoParseError):
        parse_query_gpu("No devices were found")


def test_ibstat_active_and_down() -> None:
    ports = parse_ibstat(_read(IB / "ibstat_ib_active_and_down.txt"))
    assert ports == [IBPort("mlx5_0", 1, "ACTIVE", "LinkUp", "InfiniBand", 200.0),
                     IBPort("mlx5_1", 1, "DOWN", "Disabled", "InfiniBand", 10.0)]


def test_ibstat_roce_and_single_ca_and_partial() -> None:
    roce = parse_ibstat(_read(IB / "ibstat_roce_active.txt"))
    assert [p.name for p in roce] == ["mlx5_0:1", "mlx5_1:1"]
    assert all(p.active and p.is_roce and p.rate_gbps == 100.0 for p in roce)
    (down,) = parse_ibstat(_read(IB / "ibstat_ib_down_linkup_single.txt"))
    assert (down.state, down.phys_state, down.active) == ("DOWN", "LinkUp", False)
    (partial,) = parse_ibstat(_read(IB / "ibstat_partial_ibpanic_tabs.txt"))
    assert partial.device == "mlx5_7" and partial.active and partial.link_layer == "InfiniBand"


def test_ibv_devinfo_variants() -> None:
    (ib,) = parse_ibv_devinfo(_read(IB / "ibv_devinfo_ib_active_failed_open.txt"))
    assert (ib.device, ib.port, ib.state, ib.link_layer) == ("mlx4_2", 1, "ACTIVE", "InfiniBand")
    both = parse_ibv_devinfo(_read(IB / "ibv_devinfo_ib_and_roce_azure.txt"))
    assert [(p.device, p.active, p.is_roce) for p in both] == [
        ("mlx5_0", True, False), ("rdmaP36305p0s2", True, True)]
    (down,) = parse_ibv_devinfo(_read(IB / "ibv_devinfo_roce_port_down.txt"))
    assert down.state == "DOWN" and down.is_roce


def test_sysfs_rows() -> None:
    ports = ports_from_sysfs([{"device": "mlx5_0", "port": "1", "state": "4: ACTIVE",
                               "phys_state": "5: LinkUp", "link_layer": "InfiniBand",
                               "rate": "200 Gb/sec (4X HDR)"}])
    assert ports == [IBPort("mlx5_0", 1, "ACTIVE", "LinkUp", "InfiniBand", 200.0)]


def test_nccl_ib_hca_matching() -> None:
    ports = parse_ibstat(_read(IB / "ibstat_ib_active_and_down.txt"))
    assert unmatched_hca_entries(parse_nccl_ib_hca("mlx5"), ports) == []  # prefix
    assert unmatched_hca_entries(parse_nccl_ib_hca("=mlx5"), ports) == ["mlx5"]  # exact
    assert unmatched_hca_entries(parse_nccl_ib_hca("mlx5_0:1,mlx5_9:1"), ports) == ["mlx5_9:1"]
    assert unmatched_hca_entries(parse_nccl_ib_hca("mlx5_0:2"), ports) == ["mlx5_0:2"]
    spec = parse_nccl_ib_hca("^=mlx5_1")
    assert spec.exclude and spec.exact and spec.entries == (("mlx5_1", None),)
