"""``placement``: where the trainer ranks and generation instances run (``streamrl.placement``
plans it), and the GPU node groups of the cluster it plans on."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from streamrl.config.base import _Section


class NodeGroupConfig(_Section):
    """Identical nodes of a (possibly heterogeneous) GPU cluster, named by a Ray resource label."""

    gpu_type: str = Field(..., min_length=1)
    """Ray resource label of these GPUs, e.g. H800; start Ray on such a node with
    --num-gpus=8 --resources='{"H800": 8}'"""
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    cpus_per_node: int = Field(32, ge=1)


class PlacementConfig(_Section):
    """Where the trainer ranks and generation instances run (``streamrl.placement`` plans it).

    ``device: cpu`` is the embedded default (actors with CPUs only). With ``device: cuda`` the
    trainer is ``trainer_gpus`` FSDP2 ranks in one Ray placement group and every generation
    instance has its own ``gen_gpus_per_instance`` GPUs; ``*_gpu_type`` pins each side to GPUs
    carrying that resource label (a heterogeneous cluster: e.g. trainer on H800, vLLM on H20)."""

    device: Literal["cpu", "cuda"] = "cpu"
    """cpu (actors with CPUs only) | cuda (GPU workers)"""
    nodes: list[NodeGroupConfig] = Field(default_factory=list)
    """the cluster, for the plan and its dry run; empty = the local machine (live runs read Ray's resources)"""
    trainer_gpus: int = Field(1, ge=1)
    """FSDP2 world size (one Ray worker per GPU)"""
    trainer_gpu_type: str | None = None
    """Ray resource label the trainer's GPUs carry; None = any"""
    trainer_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP2 compute dtype (bfloat16: fp32 master weights, fp32 gradient reduce)"""
    gen_gpus_per_instance: int = Field(1, ge=1)
    """tensor-parallel size of each vLLM instance"""
    gen_gpu_type: str | None = None
    """Ray resource label the generation GPUs carry; None = any"""
    cpus_per_gpu: int = Field(4, ge=1)
    """CPUs reserved beside each GPU worker"""
    trainer_node: str | None = None
    """run the trainer on this node of a labelled cluster (its node_<NAME> Ray resource, e.g. A0; `streamrl cluster
    up` labels nodes)"""
    trainer_site: str | None = None
    """run the trainer in this site (its site_<NAME> resource)"""
    gen_nodes: list[str] = Field(default_factory=list)
    """generation instance i runs on node gen_nodes[i % len] (node_<NAME> resources); empty = anywhere (or gen_sites)"""
    gen_sites: list[str] = Field(default_factory=list)
    """generation instance i runs in site gen_sites[i % len] (site_<NAME> resources) when gen_nodes is empty"""

