"""Cost models: decode steps of a generation instance, and training work on the trainer.

``RooflineDecode`` and ``RooflineTrain`` are rooflines (bytes over bandwidth, FLOPs over peak)
times efficiency constants; ``ProfiledDecode`` and ``ProfiledTrain`` read a measured profile
(``streamrl profile``). A roofline decode step of ``B`` sequences holding ``C`` tokens::

    step = T0 + max(bytes / (tp * BW * ETA_MEM), flops / (tp * PEAK * ETA_DECODE)) + t_allreduce
    bytes = weight_bytes + kv_bytes_per_token * C;   flops = 2 * matmul_params * B + attention_flops(C)

Invariant: only PAPER.md's PTL table and scaling facts (and measured CPU profiles) calibrate the
constants; each one's comment says whether it is fitted or assumed, docs/simulator.md
("Constants", "Training") gives sources and sensitivity, and ``tests/lab/test_sim.py`` checks them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from streamrl.scheduling.latency import LatencyModel
from streamrl.lab.sim.hardware import Gpu
from streamrl.lab.sim.models import ModelShape

# Assumed: HBM bandwidth reached by GEMV-like decode kernels on Hopper (PAPER.md's PTL table
# cannot separate it from T0).
ETA_MEM = 0.8
# Fitted (weighted least squares on relative error) to PAPER.md's PTL table (7B, one H800, BS
# 1..512; every point within 4%): the per-step engine overhead, the same on every GPU, and the
# context length behind the table, which the paper does not state.
T0 = 2.83e-3
PTL_CONTEXT = 2465
# Assumed fractions of peak BF16 FLOPs. The H800 table is memory-bound throughout; they matter
# on H20, where large batches become compute-bound.
ETA_DECODE = 0.6
ETA_PREFILL = 0.6
# Assumed: per all-reduce, two per layer under TP, plus a ring transfer of B * hidden * 2 bytes
# over NVLink.
ALLREDUCE_LATENCY = 10e-6
KV_MEM_FRACTION = 0.9  # of HBM, minus the weight shard (vLLM's default; verl's rollout default is 0.5)
# Assumed launch time per layer per step for verl's rollout (enforce_eager: True, no CUDA graphs).
EAGER_S_PER_LAYER = 40e-6
MFU_BASE = 0.45  # assumed (public Megatron-LM reports, 40-50% on Hopper)
# MFU(y) = MFU_BASE / (1 + KAPPA * states_bytes / (y * HBM)). 0: training scales linearly with
# devices once its states fit. 0.55 fits PAPER.md §1's 7B facts best in least squares but with
# the wrong shape, and slows every large model on the device counts the planner weighs with no
# measurement behind it (docs/simulator.md, "Training", has the comparison). A knob.
KAPPA = 0.0
TRAIN_MEM_FRACTION = 0.7  # of HBM that the sharded training states may fill (assumed)
# Actor and critic with mixed-precision Adam (16 bytes each), reference bf16 weights only.
STATE_BYTES_PER_PARAM = 16 + 16 + 2
# One PPO iteration with actor, critic and reference of the same size: old log-probs, reference
# log-probs and values, then forward + backward of actor and critic: 18 * P * T FLOPs plus 9
# attention passes of each sequence. The mean prompt length (workload.PROMPT_MEAN) is fitted
# to §1's length scaling of training time.
TRAIN_FWD_EQUIVALENTS = 9
CPU_OFFLOAD_BYTES_PER_S = 25e9
"""PCIe Gen5 x16 per GPU at about half its 64 GB/s peak (assumption), for state offload/reload."""


@dataclass(frozen=True)
class RooflineDecode:
    """Decode/prefill cost of one generation instance from first principles."""

    gpu: Gpu
    model: ModelShape
    tp: int = 1
    kv_mem_fraction: float = KV_MEM_FRACTION
    eager: bool = False
    max_batch: int = 256
    """Engine batch limit (vLLM's default ``max_num_seqs`` = 256)."""

    @property
    def kv_capacity_tokens(self) -> int:
        free = self.tp * self.gpu.hbm_bytes * self.kv_mem_fraction - self.model.weight_bytes
        return max(0, int(free / self.model.kv_bytes_per_token))

    @property
    def fits(self) -> bool:
        """Weights fit with room for at least 32K tokens of KV cache."""
        return self.kv_capacity_tokens >= 32768

    def step_s(self, batch: int, context_tokens: float) -> float:
        m, g, tp = self.model, self.gpu, self.tp
        nbytes = m.weight_bytes + m.kv_bytes_per_token * context_tokens
        t_mem = nbytes / (tp * g.hbm_bytes_per_s * ETA_MEM)
        flops = 2.0 * m.matmul_params * batch + m.attention_flops_per_token(context_tokens)
        t_cmp = flops / (tp * g.flops * ETA_DECODE)
        t = T0 + max(t_mem, t_cmp)
        if tp > 1:
            ring = 2 * (tp - 1) / tp * batch * m.hidden * 2 / g.nvlink_bytes_per_s
            t += 2 * m.layers * (ALLREDUCE_LATENCY + ring)
        if self.eager:
            t += m.layers * EAGER_S_PER_LAYER
        return t

    def prefill_s(self, tokens: float) -> float:
        return 2.0 * self.model.matmul_params * tokens / (self.tp * self.gpu.flops * ETA_PREFILL)

    def latency_model(self, mean_context: float, batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)) -> LatencyModel:
        """PTL(BS) of this instance at a typical context, for Algorithm 2's predictions."""
        pts = tuple((b, 1000 * self.step_s(b, b * mean_context)) for b in batch_sizes)
        return LatencyModel(pts, "roofline", self.model.name, f"{self.gpu.name}xTP{self.tp}")


@dataclass(frozen=True)
class ProfiledDecode:
    """Decode cost read from a measured PTL profile (e.g. the live CPU engine).

    A step of ``B`` requests holding ``C`` context tokens costs ``PTL(B) + context_s_per_token *
    (C - B * profiled_context)``: PTL was measured with every request at ``profiled_context``
    tokens (mean over the profiling run), the profile's context term (``kv_ms_per_token``) charges
    the difference, linearly (shorter contexts are cheaper). Context-free when it is 0."""

    latency: LatencyModel
    prefill_tokens_per_s: float = math.inf
    kv_capacity_tokens: int = 1 << 40
    max_batch: int = 0
    context_s_per_token: float = 0.0
    profiled_context: float = 0.0

    def __post_init__(self) -> None:
        if not self.max_batch:
            object.__setattr__(self, "max_batch", self.latency.max_batch_size)

    @property
    def fits(self) -> bool:
        return True

    def step_s(self, batch: int, context_tokens: float) -> float:
        extra = context_tokens - batch * self.profiled_context
        return self.latency.seconds_per_token(batch) + self.context_s_per_token * extra

    def prefill_s(self, tokens: float) -> float:
        return tokens / self.prefill_tokens_per_s

    def latency_model(self, mean_context: float) -> LatencyModel:
        return self.latency


@dataclass(frozen=True)
class RooflineTrain:
    """PPO training cost (actor, critic, reference) on ``devices`` GPUs."""

    gpu: Gpu
    model: ModelShape
    devices: int
    mfu_scale: float = 1.0
    """Multiplier on MFU for a less efficient trainer (verl FSDP: see systems.py)."""

    @property
    def states_bytes(self) -> float:
        return STATE_BYTES_PER_PARAM * self.model.params

    @property
    def fits(self) -> bool:
        return self.states_bytes / self.devices <= TRAIN_MEM_FRACTION * self.gpu.hbm_bytes

    @property
    def mfu(self) -> float:
        pressure = self.states_bytes / (self.devices * self.gpu.hbm_bytes)
        return self.mfu_scale * MFU_BASE / (1 + KAPPA * pressure)

    def seq_flops(self, seq_lens: Sequence[float]) -> np.ndarray:
        """Training FLOPs of each sequence (causal attention: mean context is half its length)."""
        m, s = self.model, np.asarray(seq_lens, float)
        attn = m.attention_flops_per_token(1.0) * s * s / 2.0
        return TRAIN_FWD_EQUIVALENTS * (2.0 * m.matmul_params * s + attn)

    def seq_train_s(self, seq_lens: Sequence[float]) -> np.ndarray:
        """Seconds of trainer time each sequence (prompt + response) costs; inf if it cannot fit."""
        if not self.fits:
            return np.full(len(seq_lens), math.inf)
        return self.seq_flops(seq_lens) / (self.devices * self.gpu.flops * self.mfu)

    def train_s(self, seq_lens: Sequence[float]) -> float:
        return float(self.seq_train_s(seq_lens).sum())

    def prepare_s(self, seq_lens: Sequence[float]) -> float:
        """0: the reference and critic forwards are inside ``seq_flops`` (``TRAIN_FWD_EQUIVALENTS``)."""
        return 0.0

    def optimizer_step_s(self) -> float:
        """One Adam step: read and write the sharded fp32 states (memory-bound)."""
        return 2 * 32 * self.model.params / (self.devices * self.gpu.hbm_bytes_per_s * ETA_MEM)

    def offload_s(self) -> float:
        """Move this device's share of the training states to CPU (or back)."""
        return self.states_bytes / self.devices / CPU_OFFLOAD_BYTES_PER_S


@dataclass(frozen=True)
class ProfiledTrain:
    """Training cost from measured rates on ``profile_devices`` workers: ``tokens_per_s`` per
    prompt + response token of the optimizer steps, plus the cost of a *prepare call*
    (``prepare_s``): the live trainer's per-sample work (reference log-probs, critic values,
    GAE) for all sequences handed to it in one call, run as shared forward passes over the
    sequences sorted by length and cut into micro-batches of ``micro_batch_tokens`` padded tokens
    (``trainer.Trainer.prepare_groups``). Each pass costs ``prepare_pass_s`` plus
    ``prepare_token_s`` per padded token (both fitted by ``streamrl profile``), so a call of many
    sequences costs far less per sequence than many calls of one. Both are 0 when the profile only
    has a combined rate (everything charged per token). Scaled linearly by
    ``devices / profile_devices``."""

    tokens_per_s: float
    devices: int = 1
    profile_devices: int = 1
    prepare_pass_s: float = 0.0
    prepare_token_s: float = 0.0
    micro_batch_tokens: int = 4096
    """``trainer.micro_batch_tokens`` (its config default here; the profile records the one it measured at)."""

    @property
    def fits(self) -> bool:
        return True

    def seq_train_s(self, seq_lens: Sequence[float]) -> np.ndarray:
        """Optimizer-step seconds of each sequence (prompt + response tokens)."""
        return np.asarray(seq_lens, float) / self.tokens_per_s * self.profile_devices / self.devices

    def prepare_s(self, seq_lens: Sequence[float]) -> float:
        """Seconds of one prepare call over ``seq_lens`` (see the class docstring)."""
        if not len(seq_lens) or not (self.prepare_pass_s or self.prepare_token_s):
            return 0.0
        passes = micro_batch_shapes(seq_lens, self.micro_batch_tokens)
        padded = sum(rows * longest for rows, longest in passes)
        return (len(passes) * self.prepare_pass_s + padded * self.prepare_token_s) * self.profile_devices / self.devices

    def train_s(self, seq_lens: Sequence[float]) -> float:
        """One call preparing ``seq_lens`` together, then their optimizer steps."""
        return self.prepare_s(seq_lens) + float(self.seq_train_s(seq_lens).sum())

    def optimizer_step_s(self) -> float:
        return 0.0

    def offload_s(self) -> float:
        return 0.0


def micro_batch_shapes(seq_lens: Sequence[float], token_budget: int) -> list[tuple[int, float]]:
    """``(rows, longest)`` of each forward pass the live trainer's prepare runs on these sequences:
    sorted by length, then cut in order so rows x longest stays within ``token_budget`` (a longer
    single sequence forms its own pass), the rule of ``trainer.trainer.micro_batches``."""
    out: list[tuple[int, float]] = []
    rows, longest = 0, 0.0
    for n in sorted(float(x) for x in seq_lens):
        if rows and max(longest, n) * (rows + 1) > token_budget:
            out.append((rows, longest))
            rows, longest = 0, 0.0
        rows, longest = rows + 1, max(longest, n)
    if rows:
        out.append((rows, longest))
    return out
