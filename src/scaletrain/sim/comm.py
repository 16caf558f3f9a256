"""Collective costs: alpha-beta ring formulas per tier, composed hierarchically across NVLink domains and NICs.

Sizes are bytes of the whole buffer S (what nccl-tests calls the message size); bandwidths are nccl-tests bus
bandwidths in GB/s, so the bandwidth term of a ring all-reduce is 2(n-1)/n * S / busbw and of a reduce-scatter
or all-gather (n-1)/n * S / busbw (docs/perf-model.md, Communication).
"""

from __future__ import annotations

from dataclasses import dataclass

from scaletrain.sim.catalog import GPU, Fabric, Node

GB = 1e9


def ring_all_reduce(n: int, size: float, busbw_gbps: float, alpha_us: float) -> float:
    """Seconds for a ring all-reduce of `size` bytes over n ranks: 2(n-1)a + 2((n-1)/n) S b."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * alpha_us * 1e-6 + 2 * (n - 1) / n * size / (busbw_gbps * GB)


def ring_reduce_scatter(n: int, size: float, busbw_gbps: float, alpha_us: float) -> float:
    """Seconds for a ring reduce-scatter (or all-gather) of a `size`-byte buffer: (n-1)a + ((n-1)/n) S b."""
    if n <= 1:
        return 0.0
    return (n - 1) * alpha_us * 1e-6 + (n - 1) / n * size / (busbw_gbps * GB)


ring_all_gather = ring_reduce_scatter


@dataclass(frozen=True)
class Cluster:
    """GPUs of one kind in nodes of one kind on one fabric, ranks numbered node by node."""

    gpu: GPU
    node: Node
    fabric: Fabric
    gpus: int
    bw_eff: float = 1.0
    """Fraction of the modelled NVLink and fabric bandwidths the collectives reach (`Efficiency.comm_eff`)."""

    @property
    def nodes(self) -> int:
        """Nodes used (the last one may be partly filled)."""
        return -(-self.gpus // self.node.gpus_per_node)

    def net_alpha_us(self, nodes: int | None = None) -> float:
        """Ring-step latency across the fabric between `nodes` nodes (default all): NIC latency plus two hops per
        switch tier above the leaf, the tiers being those a fat tree needs to reach that many NICs."""
        tiers = self.fabric.tiers(min(nodes or self.nodes, self.nodes) * self.node.nics)
        return self.fabric.alpha_us + 2 * self.fabric.hop_us * (tiers - 1)

    def placement(self, n: int, stride: int) -> tuple[int, int]:
        """(members per NVLink domain g, domains k) of an n-rank group whose members are `stride` ranks apart.

        Megatron orders ranks tp fastest, then cp, dp, pp; a group's stride is the product of the faster degrees.
        """
        domain = self.node.nvlink_domain
        if stride >= domain:
            return 1, n
        g = max(1, min(n, domain // stride))
        return g, -(-n // g)

    def nvlink_share(self, g: int) -> float:
        """Fraction of the domain's bus bandwidth a g-member group inside it gets: all of it behind a switch; on a
        mesh (one direct link per peer) only the g-1 links to the group's own members carry its traffic."""
        domain = self.node.nvlink_domain
        if self.node.topology != "mesh" or domain <= 1:
            return self.bw_eff
        return min(1.0, (g - 1) / (domain - 1)) * self.bw_eff

    @property
    def nic_share(self) -> float:
        """Fraction of one NIC's bandwidth each GPU gets on the fabric (1 with a NIC per GPU, as in every shipped
        node; less where GPUs share NICs)."""
        return min(1.0, self.node.nics / self.node.gpus_per_node) * self.bw_eff

    def collective(self, op: str, n: int, size: float, stride: int = 1) -> float:
        """Seconds for `op` ("all_reduce", "reduce_scatter", "all_gather") of a `size`-byte buffer over n ranks.

        Inside one NVLink domain (8 GPUs of an HGX board, or all 72 of an NVL72 rack, across its trays): a ring over
        NVLink (NVLS for all-reduce where the node has it), at the share of the bandwidth the group's members reach
        (`nvlink_share`). Across domains: reduce-scatter inside each domain, the inter-domain step on S/g per GPU
        with every GPU on its own NIC (rail), then all-gather inside the domain; IB SHARP makes the inter-domain
        all-reduce move ~1x the bytes.
        """
        if n <= 1 or size <= 0:
            return 0.0
        if op == "all_to_all":
            return self.all_to_all(n, size, stride)
        g, k = self.placement(n, stride)
        nv = self.node
        share = self.nvlink_share(g)
        ring_bw = nv.nvlink_busbw_gbps * share
        nvl_bw = nv.nvls_busbw_gbps * share if (op == "all_reduce" and nv.nvls_busbw_gbps > 0) else ring_bw
        if k == 1:
            if op == "all_reduce":
                return ring_all_reduce(g, size, nvl_bw, nv.nvlink_alpha_us)
            return ring_reduce_scatter(g, size, ring_bw, nv.nvlink_alpha_us)
        intra = ring_reduce_scatter(g, size, ring_bw, nv.nvlink_alpha_us)
        nodes_spanned = k * max(1, self.node.nvlink_domain // self.node.gpus_per_node) if g > 1 else k
        shard, bw, alpha = size / g, self.fabric.busbw_gbps * self.nic_share, self.net_alpha_us(nodes_spanned)
        if op == "all_reduce":
            if self.fabric.sharp:
                inter = 2 * alpha * 1e-6 + shard / (bw * GB)
            else:
                inter = ring_all_reduce(k, shard, bw, alpha)
            return 2 * intra + inter
        return intra + ring_reduce_scatter(k, shard, bw, alpha)

    def all_to_all(self, n: int, size: float, stride: int = 1) -> float:
        """Seconds for an all-to-all in which each of n ranks sends `size` bytes in all, 1/n to each member (MoE
        token dispatch or combine with even routing).

        Each rank's (g-1)/n share to members of its own NVLink domain goes over NVLink and its (n-g)/n share to
        the other domains over its own NIC (rail-aligned, NCCL's PXN moves it to the right rail over NVLink first);
        both run at once, so the slower sets the time, plus a latency per peer (nccl-tests' all-to-all bus bandwidth
        is the per-rank bytes x (n-1)/n over the time, the form used here).
        """
        if n <= 1 or size <= 0:
            return 0.0
        g, k = self.placement(n, stride)
        nv = self.node
        intra = (g - 1) * nv.nvlink_alpha_us * 1e-6 + (g - 1) / n * size / (
            nv.nvlink_busbw_gbps * self.nvlink_share(g) * GB
        )
        if k == 1:
            return intra
        # The fabric's latency grows with the switch tiers between the nodes the group spans: k domains of
        # nvlink_domain / gpus_per_node nodes each (18 trays of an NVL72 rack, one HGX board), as in `collective`.
        nodes_spanned = k * max(1, self.node.nvlink_domain // self.node.gpus_per_node) if g > 1 else k
        inter = (k - 1) * self.net_alpha_us(nodes_spanned) * 1e-6 + (n - g) / n * size / (
            self.fabric.busbw_gbps * self.nic_share * GB
        )
        return max(intra, inter)

    def p2p(self, size: float, same_domain: bool) -> float:
        """Seconds to send `size` bytes to a pipeline neighbour (over NVLink, or one NIC across the fabric)."""
        if size <= 0:
            return 0.0
        if same_domain:
            # On a mesh a neighbour is one direct link away: 1/(domain-1) of the GPU's fabric bandwidth.
            return self.node.nvlink_alpha_us * 1e-6 + size / (self.gpu.nvlink_gbps * self.nvlink_share(2) * GB)
        return self.net_alpha_us() * 1e-6 + size / (self.fabric.busbw_gbps * self.nic_share * GB)
