"""The resource planner: Algorithm 1 over an estimator (simulated or measured).

``plan_single_dc`` splits ``n`` devices of one type between generation and training;
``plan_cross_dc`` keeps generation in one site and training in another and shrinks the faster side.
Both return a plain dict: the split, the parallel configuration, and the predicted stage times.
The trainer's configuration is ZeRO-3 data parallel over its devices (the only one our cost model
has); the generation side reports its tensor-parallel degree and instance count.
"""

from __future__ import annotations

from typing import Any

from streamrl.policies.balance import Balance, balance_cross_dc, balance_single_dc


def _row(b: Balance, est: Any, **extra: Any) -> dict[str, Any]:
    cfg = est.gen_config(b.gen_devices)
    return {
        **extra,
        "gen_gpus": b.gen_devices, "gen_tp": cfg["tp"], "gen_instances": cfg["instances"],
        "train_gpus": b.train_devices, "train_parallel": f"zero3-dp{b.train_devices}",
        "t_gen_s": b.t_gen, "t_train_s": b.t_train, "t_iter_s": b.t_iter,
        "bottleneck": "generation" if b.t_gen >= b.t_train else "training",
    }


def plan_single_dc(est: Any, n: int, train_unit: int = 1, **extra: Any) -> dict[str, Any]:
    b = balance_single_dc(n, est.p_gen, est.p_train, gen_unit=est.gen_unit, train_unit=train_unit)
    return _row(b, est, total_gpus=n, **extra)


def plan_cross_dc(est: Any, gen_gpus: int, train_gpus: int, train_unit: int = 1, **extra: Any) -> dict[str, Any]:
    b = balance_cross_dc(gen_gpus, train_gpus, est.p_gen, est.p_train, gen_unit=est.gen_unit, train_unit=train_unit)
    return _row(b, est, gen_gpus_available=gen_gpus, train_gpus_available=train_gpus, **extra)
