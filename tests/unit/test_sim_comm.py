"""The simulator's alpha-beta collective costs pinned against hand-computed values: ring formulas, NVLink rings inside
a node, flat and hierarchical rings across nodes, fat-tree latency, SHARP, NVL72 placement and point-to-point."""

from __future__ import annotations

import pytest

from scaletrain.sim.catalog import load_catalog
from scaletrain.sim.comm import Cluster, ring_all_gather, ring_all_reduce, ring_reduce_scatter

CAT = load_catalog()


@pytest.fixture(autouse=True)
def _no_user_files(monkeypatch):
    """Only the shipped catalog."""
    monkeypatch.delenv("SCALETRAIN_CATALOG", raising=False)
    monkeypatch.delenv("SCALETRAIN_EFFICIENCY", raising=False)


def _cluster(gpus: int, gpu: str = "h100", node: str | None = None, fabric: str | None = None) -> Cluster:
    return Cluster(*CAT.system(gpu, node, fabric), gpus)


def test_ring_formulas_by_hand():
    S = 1e9
    assert ring_all_reduce(8, S, 365.0, 2.0) == pytest.approx(2 * 7 * 2e-6 + 2 * 7 / 8 * S / 365e9, rel=1e-12)
    assert ring_reduce_scatter(8, S, 365.0, 2.0) == pytest.approx(7 * 2e-6 + 7 / 8 * S / 365e9, rel=1e-12)
    assert ring_all_gather(16, 3e6, 47.0, 9.2) == pytest.approx(15 * 9.2e-6 + 15 / 16 * 3e6 / 47e9, rel=1e-12)
    for fn in (ring_all_reduce, ring_reduce_scatter, ring_all_gather):
        assert fn(1, S, 365.0, 2.0) == 0.0
        assert fn(0, S, 365.0, 2.0) == 0.0
    # Bus bandwidth convention: algbw = busbw * n / (2(n-1)) for all-reduce, busbw * n / (n-1) for RS/AG.
    n, bw = 64, 47.0
    assert S / (ring_all_reduce(n, S, bw, 0.0) * 1e9) == pytest.approx(bw * n / (2 * (n - 1)))
    assert S / (ring_reduce_scatter(n, S, bw, 0.0) * 1e9) == pytest.approx(bw * n / (n - 1))


def test_collective_inside_one_node_is_the_nvlink_ring():
    S = 256e6
    cl = _cluster(64)  # hgx-h100: ring 365 GB/s, NVLS 470 GB/s, 2 us per step
    assert cl.collective("all_reduce", 8, S) == pytest.approx(2 * 7 * 2e-6 + 2 * 7 / 8 * S / 470e9, rel=1e-12)
    assert cl.collective("reduce_scatter", 8, S) == pytest.approx(7 * 2e-6 + 7 / 8 * S / 365e9, rel=1e-12)
    assert cl.collective("all_gather", 4, S) == pytest.approx(3 * 2e-6 + 3 / 4 * S / 365e9, rel=1e-12)
    # A 4-rank group at stride 2 still fits one node.
    assert cl.collective("reduce_scatter", 4, S, stride=2) == pytest.approx(3 * 2e-6 + 3 / 4 * S / 365e9)
    # No NVLS on DGX A100: all-reduce uses the ring figure (230 GB/s).
    a100 = _cluster(64, "a100")
    assert a100.collective("all_reduce", 8, S) == pytest.approx(2 * 7 * 2e-6 + 2 * 7 / 8 * S / 230e9, rel=1e-12)
    # GB200 NVL72: the 72-GPU domain is one NVLink domain: ring 680 GB/s, all-reduce with NVLS at 884 GB/s.
    gb = _cluster(1152, "gb200")
    assert gb.collective("all_reduce", 72, S) == pytest.approx(2 * 71 * 2e-6 + 2 * 71 / 72 * S / 884e9)
    assert gb.collective("reduce_scatter", 72, S) == pytest.approx(71 * 2e-6 + 71 / 72 * S / 680e9)
    # Trivial cases.
    assert cl.collective("all_reduce", 1, S) == 0.0
    assert cl.collective("all_reduce", 8, 0.0) == 0.0


def test_cluster_latency_grows_with_fat_tree_tiers():
    # 8 H100 nodes = 64 NICs: one leaf tier, alpha = 8 us; 1024 NICs: 2 tiers, +2 hops x 0.6 us; 10,752: 3 tiers.
    assert _cluster(64).net_alpha_us() == pytest.approx(8.0)
    assert _cluster(1024).net_alpha_us() == pytest.approx(9.2)
    assert _cluster(10752).net_alpha_us() == pytest.approx(10.4)
    assert _cluster(1024).fabric.tiers(2048) == 2 and _cluster(1024).fabric.tiers(10752) == 3


def test_collective_across_nodes_at_stride_8_is_a_flat_fabric_ring():
    S, n = 512e6, 128
    cl = _cluster(1024)  # alpha 9.2 us, NDR busbw 47 GB/s
    assert cl.placement(n, 8) == (1, n)
    assert cl.collective("all_reduce", n, S, stride=8) == pytest.approx(
        2 * (n - 1) * 9.2e-6 + 2 * (n - 1) / n * S / 47e9, rel=1e-12
    )
    assert cl.collective("reduce_scatter", n, S, stride=32) == pytest.approx(
        (n - 1) * 9.2e-6 + (n - 1) / n * S / 47e9, rel=1e-12
    )


def test_collective_at_stride_4_is_hierarchical():
    S, n = 512e6, 64
    cl = _cluster(1024)
    assert cl.placement(n, 4) == (2, 32)  # 2 members per 8-GPU node, 32 nodes
    intra = 1 * 2e-6 + 1 / 2 * S / 365e9  # RS (or AG) over the 2 NVLink members
    inter_ar = 2 * 31 * 9.2e-6 + 2 * 31 / 32 * (S / 2) / 47e9
    inter_rs = 31 * 9.2e-6 + 31 / 32 * (S / 2) / 47e9
    assert cl.collective("all_reduce", n, S, stride=4) == pytest.approx(2 * intra + inter_ar, rel=1e-12)
    assert cl.collective("reduce_scatter", n, S, stride=4) == pytest.approx(intra + inter_rs, rel=1e-12)
    assert cl.collective("all_gather", n, S, stride=4) == pytest.approx(intra + inter_rs, rel=1e-12)
    # Two members per node beat a flat fabric ring of the same group (half the bytes per NIC).
    assert cl.collective("all_reduce", n, S, stride=4) < cl.collective("all_reduce", n, S, stride=8)
    # Stride 1 with 16 members: full nodes, 8 per node, 2 nodes under one leaf switch (one tier: 8 us).
    assert cl.placement(16, 1) == (8, 2)
    assert cl.collective("reduce_scatter", 16, S) == pytest.approx(
        7 * 2e-6 + 7 / 8 * S / 365e9 + 1 * 8e-6 + 1 / 2 * (S / 8) / 47e9, rel=1e-12
    )


def test_sharp_all_reduce_moves_the_bytes_once():
    S, n = 1e12, 64
    plain = _cluster(1024)
    sharp = _cluster(1024, fabric="ib-ndr-sharp")
    assert sharp.fabric.sharp
    assert sharp.collective("all_reduce", n, S, stride=8) == pytest.approx(2 * 9.2e-6 + S / 47e9, rel=1e-12)
    ratio = sharp.collective("all_reduce", n, S, stride=8) / plain.collective("all_reduce", n, S, stride=8)
    assert 0.49 < ratio < 0.52  # n/(2(n-1)) = 0.508 at n=64
    # Hierarchical: the NVLink RS+AG are unchanged, only the inter-node part halves.
    intra = 2 * (1 * 2e-6 + 1 / 2 * S / 365e9)
    assert sharp.collective("all_reduce", n, S, stride=4) == pytest.approx(intra + 2 * 9.2e-6 + (S / 2) / 47e9)
    # SHARP does not change reduce-scatter / all-gather.
    assert sharp.collective("reduce_scatter", n, S, stride=8) == plain.collective("reduce_scatter", n, S, stride=8)


def test_placement_on_nvl72():
    cl = _cluster(1152, "gb200")
    assert cl.node.nvlink_domain == 72 and cl.node.gpus_per_node == 4
    assert cl.placement(18, 4) == (18, 1)  # 18 members at stride 4 fill one 72-GPU domain
    assert cl.placement(64, 4) == (18, 4)  # ceil(64 / 18) domains
    assert cl.placement(8, 1) == (8, 1)
    assert cl.placement(16, 72) == (1, 16)
    # Inside the domain even across trays (nodes of 4): NVLink, not the fabric.
    S = 64e6
    assert cl.collective("reduce_scatter", 18, S, stride=4) == pytest.approx(17 * 2e-6 + 17 / 18 * S / 680e9)


def test_p2p_over_nvlink_or_one_nic():
    cl = _cluster(1024)
    S = 12_582_912  # one GPT-3 activation b*s*h*2 / t at t=4
    assert cl.p2p(S, same_domain=True) == pytest.approx(2e-6 + S / 450e9, rel=1e-12)
    assert cl.p2p(S, same_domain=False) == pytest.approx(9.2e-6 + S / 47e9, rel=1e-12)
    assert cl.p2p(0, same_domain=False) == 0.0
