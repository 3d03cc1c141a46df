"""Hardware catalog and network links.

``GPUS``: H800 and H20 from PAPER.md Table 1 (BF16 dense TFLOPS, HBM, HBM bandwidth, NVLink,
relative cost of an 8-GPU machine); H200 and A100 from NVIDIA's public datasheets, their machine
costs our assumption (each ``Gpu`` says its ``cost_source``). Networks (PAPER.md §3.5): H800
nodes have 8 x 200 Gbps RoCE (one NIC per GPU); the H20 site has 100 Gbps TCP per node; the two
sites are joined by one 80 Gbps link (``CROSS_DC_LINK``).

A ``Link`` moves ``nbytes`` in ``latency_s + nbytes / bandwidth``; ``pipelined_chain_s``,
``broadcast_in_dc_s`` and ``weight_push_s`` build weight pushes from links. Only ``simulate
hetero`` and ``plan`` print costs, and only H20/H800 costs come from the paper.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
from typing import Sequence

GBPS = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_tflops: float
    hbm_gb: float
    hbm_tb_s: float
    nvlink_gb_s: float
    nic_gbps_per_gpu: float
    """Inter-node bandwidth available to one GPU (Gbit/s)."""
    cost_per_node: float
    """Relative cost of an 8-GPU machine (H20 machine = 1.00)."""
    cost_source: str = "PAPER.md Table 1"

    @property
    def flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gb * 1e9

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tb_s * 1e12

    @property
    def nvlink_bytes_per_s(self) -> float:
        return self.nvlink_gb_s * 1e9


GPUS: dict[str, Gpu] = {
    "H800": Gpu("H800", 989.5, 80, 3.35, 400, 200, 2.85),
    # 100 Gbps TCP per 8-GPU node in the paper's H20 site.
    "H20": Gpu("H20", 148, 96, 4.0, 900, 100 / 8, 1.00),
    # Not in the paper: NVIDIA's public datasheets (H200 SXM: 989 dense BF16 TFLOPS, 141 GB HBM3e,
    # 4.8 TB/s, NVLink 900 GB/s; A100 SXM 80 GB: 312 TFLOPS, 2.039 TB/s, NVLink 600 GB/s). Their
    # machine costs are our assumption: rough ratios of public cloud on-demand prices (2025),
    # normalised to an H20 machine = 1.00.
    "H200": Gpu("H200", 989.5, 141, 4.8, 900, 400, 3.6, "assumption: cloud price ratio"),
    "A100": Gpu("A100", 312, 80, 2.039, 600, 200, 1.3, "assumption: cloud price ratio"),
}
GPUS_PER_NODE = 8


def get_gpu(name: str) -> Gpu:
    for key, gpu in GPUS.items():
        if key.lower() == name.lower():
            return gpu
    raise ValueError(f"unknown GPU type {name!r}; known: {sorted(GPUS)}")


@dataclass(frozen=True)
class Link:
    """A point-to-point path: bandwidth in bytes/s and a fixed per-transfer latency."""

    bandwidth: float
    latency_s: float = 0.0
    name: str = ""

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"Link {self.name!r} bandwidth={self.bandwidth} must be > 0 bytes/s")

    def transfer_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.bandwidth


CROSS_DC_LINK = Link(80 * GBPS, 0.005, "cross-dc 80 Gbps")
"""PAPER.md §3.5: the two sites are joined by one 80 Gbps link (latency: our assumption, 5 ms)."""

RDMA_LATENCY_S = 10e-6
TCP_LATENCY_S = 100e-6


def pipelined_chain_s(nbytes: float, hops: Sequence[Link], chunk_bytes: float = 64e6) -> float:
    """Time to push ``nbytes`` through ``hops`` in ``chunk_bytes`` chunks (pipelined):
    ``sum(latency) + nbytes / min(bandwidth) + (hops - 1) * chunk / min(bandwidth)``
    (store-and-forward of the first chunk at each hop, then the slowest hop paces the stream)."""
    if not hops:
        return 0.0
    slowest = min(h.bandwidth for h in hops)
    chunk = min(chunk_bytes, nbytes)
    return sum(h.latency_s for h in hops) + nbytes / slowest + (len(hops) - 1) * chunk / slowest


def node_link(gpu: Gpu) -> Link:
    """One GPU's inter-node path (RDMA when the NIC is >= 100 Gbps per GPU, else TCP)."""
    rdma = gpu.nic_gbps_per_gpu >= 100
    return Link(gpu.nic_gbps_per_gpu * GBPS, RDMA_LATENCY_S if rdma else TCP_LATENCY_S, f"{gpu.name} NIC")


def broadcast_in_dc_s(weight_bytes: float, receivers: int, gpu: Gpu, trees: int = 1) -> float:
    """Broadcast a full copy of the weights to ``receivers`` GPUs in one site.

    Each 8-GPU node needs one copy over its NICs (all of them together, ``8 x`` the per-GPU
    bandwidth; several trees rooted at different trainer ranks keep every NIC busy), then fans it
    out over NVLink. Nodes form a pipelined binary tree of depth ``log2(nodes + 1)``.
    """
    if receivers <= 0:
        return 0.0
    nodes = math.ceil(receivers / GPUS_PER_NODE)
    nic = node_link(gpu)
    node_bw = Link(nic.bandwidth * min(receivers, GPUS_PER_NODE), nic.latency_s, "node NICs")
    depth = max(1, math.ceil(math.log2(nodes + 1)))
    return pipelined_chain_s(weight_bytes, [node_bw] * depth) + 64e6 / gpu.nvlink_bytes_per_s


def weight_push_s(
    weight_bytes: float, gen_gpu: Gpu, gen_gpus: int, tp: int, cross_dc: Link | None = None,
) -> float:
    """Push a new policy version from the trainer to every generation GPU.

    Each generation GPU needs ``weight_bytes / tp``, each node a full copy. In one site: a tree. Across
    sites: the trainer's root sends **one** full copy over ``cross_dc`` to one remote instance,
    which re-broadcasts locally; the two legs are pipelined in chunks, so the slower paces.
    """
    local = broadcast_in_dc_s(weight_bytes, gen_gpus, gen_gpu, trees=tp)
    if cross_dc is None:
        return local
    remote = pipelined_chain_s(weight_bytes, [cross_dc])
    return max(remote, local) + 64e6 / cross_dc.bandwidth  # first chunk crosses before re-broadcast
