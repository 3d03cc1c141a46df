"""Stage-time estimators ``P_gen(x)`` and ``P_train(y)`` for Algorithm 1 (PAPER.md §3.3).

``SimEstimator`` profiles with the simulator: ``P_gen(x)`` runs one simulated generation call of a
fixed workload sample (with partial rollout: the steady-state period of overlapping iterations,
``systems.stream_period``) on ``x`` devices for every tensor-parallel degree that fits and divides
``x`` (the best one wins, and is remembered as the parallel configuration); ``P_train(y)`` is the
trainer cost model on ``y`` devices (ZeRO-3 data parallel; ``inf`` when the states do not fit).

``ProfileEstimator`` reads measured numbers instead (the live system's ``streamrl profile`` file:
a PTL table for one instance, plus ``train_tokens_per_s`` for one training device), so the same
planner works from a real cluster's measurements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamrl.scheduling.latency import LatencyModel
from streamrl.lab.sim import cost as C
from streamrl.lab.sim.hardware import Gpu
from streamrl.lab.sim.models import ModelShape
from streamrl.lab.sim.systems import Deployment, SystemSpec, generate, get_system, stream_period
from streamrl.lab.sim.workload import Batch, Workload

TP_CHOICES = (1, 2, 4, 8)
TP_POLICIES = ("min-fit", "search")
TP_POLICY = "min-fit"
"""How generation instances pick their tensor-parallel degree when ``TP_FIXED`` does not name
the model: ``min-fit``, the smallest degree of ``TP_CHOICES`` that fits the weights with room for
32K tokens of KV cache (the most data-parallel instances: how throughput-oriented rollouts are
deployed), or ``search``, the degree with the shortest simulated generation per device count
(Algorithm 1's "best parallel configuration" under the roofline). ``min-fit`` is the default:
``search`` picks TP 8 even for 7B, whose tail it shortens in the roofline, and then disagrees
with PAPER.md §1's generation scaling (docs/simulator.md, "Tensor parallelism")."""
TP_FIXED: dict[str, int] = {}
"""Model name -> the one degree its instances use (``--tp 7b=2,...``), over ``TP_POLICY``."""


def parse_tp(text: str | None) -> tuple[str, dict[str, int]]:
    """``--tp``: a policy (``min-fit`` | ``search``), model degrees (``7b=1,32b=4,72b=8``, sizes
    or full model names), or both (``search,72b=4``) -> ``(policy, {model name: tp})``."""
    from streamrl.lab.sim.models import MODELS

    out: dict[str, int] = {}
    policy = "min-fit"
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        if part in TP_POLICIES:
            policy = part
            continue
        name, _, value = part.partition("=")
        full = [m for m in MODELS if m == name.lower() or m.endswith("-" + name.lower())]
        if len(full) != 1 or not value.isdigit() or int(value) not in TP_CHOICES:
            raise ValueError(f"--tp entry {part!r}: expected {' or '.join(TP_POLICIES)}, or MODEL=TP with MODEL one "
                             f"of {sorted(MODELS)} (or its size, e.g. 7b) and TP one of {TP_CHOICES}")
        out[full[0]] = int(value)
    return policy, out


def set_tp(text: str | None) -> None:
    """Apply ``--tp`` (``parse_tp``) to this process's simulator."""
    global TP_POLICY
    TP_POLICY, fixed = parse_tp(text)
    TP_FIXED.clear()
    TP_FIXED.update(fixed)


@dataclass
class SimEstimator:
    model: ModelShape
    gen_gpu: Gpu
    train_gpu: Gpu
    workload: Workload
    system: SystemSpec = field(default_factory=lambda: get_system("stream-sync"))
    seed: int = 0
    best_tp: dict[int, int] = field(default_factory=dict)
    _cache: dict[tuple[int, int], float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.batch: Batch = self.workload.sample(rng)
        self.history = self.workload.sample(np.random.default_rng(self.seed + 1)).out_lens

    @property
    def tp_choices(self) -> list[int]:
        fixed = TP_FIXED.get(self.model.name)
        ok = [tp for tp in ((fixed,) if fixed else TP_CHOICES) if C.RooflineDecode(self.gen_gpu, self.model, tp).fits]
        if not ok:
            raise ValueError(f"{self.model.name} does not fit on {fixed or max(TP_CHOICES)} x {self.gen_gpu.name}")
        return ok if TP_POLICY == "search" else ok[:1]

    @property
    def gen_unit(self) -> int:
        return self.tp_choices[0]

    def p_gen_tp(self, x: int, tp: int) -> float:
        if x % tp or x < tp:
            return math.inf
        key = (x, tp)
        if key not in self._cache:
            dep = Deployment(self.model, self.gen_gpu, x, tp, self.train_gpu, 1)
            if self.system.partial:  # iterations overlap: the steady-state period, not one call's makespan
                self._cache[key] = stream_period(self.batch, self.system, dep, self.history, self.seed)
            else:
                self._cache[key] = generate(self.batch, self.system, dep, self.history, self.seed).makespan_s
        return self._cache[key]

    def p_gen(self, x: int) -> float:
        times = {tp: self.p_gen_tp(x, tp) for tp in self.tp_choices}
        tp = min(times, key=lambda k: (times[k], k))
        self.best_tp[x] = tp
        return times[tp]

    def p_train(self, y: int) -> float:
        return C.RooflineTrain(self.train_gpu, self.model, y).train_s(self.batch.seq_lens)

    def gen_config(self, x: int) -> dict[str, Any]:
        self.p_gen(x)
        tp = self.best_tp[x]
        return {"tp": tp, "instances": x // tp}


@dataclass
class ProfileEstimator:
    """Estimators from measured profiles: one instance's PTL table and one device's train tokens/s."""

    latency: LatencyModel
    train_tokens_per_s: float
    workload: Workload
    instance_devices: int = 1
    system: SystemSpec = field(default_factory=lambda: get_system("stream-sync"))
    seed: int = 0
    _cache: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.batch = self.workload.sample(np.random.default_rng(self.seed))
        self.history = self.workload.sample(np.random.default_rng(self.seed + 1)).out_lens

    @property
    def gen_unit(self) -> int:
        return self.instance_devices

    def deployment(self, gen_devices: int, train_devices: int, model: ModelShape, gpu: Gpu) -> Deployment:
        return Deployment(
            model, gpu, gen_devices, self.instance_devices, gpu, train_devices,
            decode_override=C.ProfiledDecode(self.latency),
            train_override=C.ProfiledTrain(self.train_tokens_per_s, train_devices, 1),
        )

    def p_gen(self, x: int) -> float:
        if x < self.instance_devices:
            return math.inf
        if x not in self._cache:
            from streamrl.lab.sim.models import MODELS
            from streamrl.lab.sim.hardware import GPUS

            dep = self.deployment(x - x % self.instance_devices, 1, MODELS["qwen2.5-7b"], GPUS["H800"])
            self._cache[x] = generate(self.batch, self.system, dep, self.history, self.seed).makespan_s
        return self._cache[x]

    def p_train(self, y: int) -> float:
        return C.ProfiledTrain(self.train_tokens_per_s, y, 1).train_s(self.batch.seq_lens)

    def gen_config(self, x: int) -> dict[str, Any]:
        return {"tp": self.instance_devices, "instances": x // self.instance_devices}
