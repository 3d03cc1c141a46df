"""Stage balancing, Algorithm 1 (PAPER.md §3.3): how many devices generation and training get.

``P_gen(x)`` and ``P_train(y)`` are callables giving one iteration's stage time (seconds) on ``x``
(or ``y``) devices, each with its best parallel configuration; they return ``math.inf`` for a
count that cannot run (e.g. the model does not fit). Device counts move in units (``gen_unit``:
one generation instance's tensor-parallel size; ``train_unit``: e.g. one 8-GPU node), because a
generation instance or a trainer node is the smallest thing one can add.

``balance_single_dc`` splits ``n`` devices; ``balance_cross_dc`` shrinks the faster of two sites.
The ``sweep_*`` functions list the candidates each one chooses among. Pure functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

StageTime = Callable[[int], float]


@dataclass(frozen=True)
class Balance:
    """A device split and the stage times predicted for it."""

    gen_devices: int
    train_devices: int
    t_gen: float
    t_train: float

    @property
    def t_iter(self) -> float:
        """Iteration time of a perfect overlap: the slower stage."""
        return max(self.t_gen, self.t_train)


def _counts(limit: int, unit: int, minimum: int) -> range:
    if unit < 1:
        raise ValueError(f"device unit={unit} must be >= 1")
    start = max(unit, math.ceil(minimum / unit) * unit)
    return range(start, limit + 1, unit)


def balance_single_dc(
    n: int, p_gen: StageTime, p_train: StageTime, gen_unit: int = 1, train_unit: int = 1,
    min_gen: int = 1, min_train: int = 1,
) -> Balance:
    """Algorithm 1, single datacenter: the best ``(x, y)`` with ``x + y <= n``.

    Tries every pair and keeps the smallest ``max(P_gen(x), P_train(y))``; ties (the slower side
    is unchanged) go to the pair whose faster side is faster (spare devices speed up the side
    that is not the bottleneck, which shortens the pipeline's fill and drain), then to fewer
    devices in total."""
    gen_time = {x: p_gen(x) for x in _counts(n, gen_unit, min_gen)}
    train_time = {y: p_train(y) for y in _counts(n, train_unit, min_train)}
    best: tuple | None = None
    for x, tg in gen_time.items():
        for y, tt in train_time.items():
            if x + y > n:
                continue
            key = (max(tg, tt), min(tg, tt), x + y, -x)
            if best is None or key < best[0]:
                best = (key, Balance(x, y, tg, tt))
    if best is None or math.isinf(best[1].t_iter):
        raise ValueError(
            f"no feasible split of n={n} devices (gen_unit={gen_unit}, train_unit={train_unit}, "
            f"min_gen={min_gen}, min_train={min_train}): every candidate is infeasible"
        )
    return best[1]


def balance_cross_dc(
    m: int, n: int, p_gen: StageTime, p_train: StageTime, gen_unit: int = 1, train_unit: int = 1,
) -> Balance:
    """Algorithm 1, cross datacenter: shrink the faster side until the two stage times match.

    ``m`` generation devices in one site, ``n`` training devices in the other. If generation is
    the faster side, shrink it to ``k = argmin_k |P_gen(k) - P_train(n)|``, otherwise shrink
    training to ``k = argmin_k |P_train(k) - P_gen(m)|``; the freed devices go back to other
    jobs. Ties go to the smaller ``k``."""
    tg, tt = p_gen(m), p_train(n)
    if math.isinf(tg) or math.isinf(tt):
        raise ValueError(f"infeasible cross-DC setup: P_gen({m})={tg}, P_train({n})={tt}")
    if tg < tt:
        cands = [(abs(p_gen(k) - tt), k) for k in _counts(m, gen_unit, 1)]
        k = min(c for c in cands if not math.isinf(c[0]))[1]
        return Balance(k, n, p_gen(k), tt)
    cands = [(abs(p_train(k) - tg), k) for k in _counts(n, train_unit, 1)]
    k = min(c for c in cands if not math.isinf(c[0]))[1]
    return Balance(m, k, tg, p_train(k))


def sweep_single_dc(n: int, p_gen: StageTime, p_train: StageTime, gen_unit: int = 1,
                    train_unit: int = 1) -> list[Balance]:
    """Every generation size ``x`` (in units) with the most training devices that fit beside it:
    the frontier Algorithm 1's best split lies on (fewer devices never make a stage faster)."""
    out = []
    for x in _counts(n, gen_unit, 1):
        y = (n - x) // train_unit * train_unit
        if y >= max(train_unit, 1):
            out.append(Balance(x, y, p_gen(x), p_train(y)))
    return out


def sweep_cross_dc(m: int, n: int, p_gen: StageTime, p_train: StageTime, gen_unit: int = 1,
                   train_unit: int = 1) -> list[Balance]:
    """The sizes of the faster side Algorithm 1 chooses among (the other side keeps all its devices)."""
    tg, tt = p_gen(m), p_train(n)
    if tg < tt:
        return [Balance(k, n, p_gen(k), tt) for k in _counts(m, gen_unit, 1)]
    return [Balance(m, k, tg, p_train(k)) for k in _counts(n, train_unit, 1)]


def flatness(candidates: list[Balance], tolerance: float = 0.05) -> dict[str, float]:
    """How flat the optimum is: the candidates whose iteration time is within ``tolerance`` of the
    best, as the range of generation (and training) device counts they span."""
    finite = [c for c in candidates if math.isfinite(c.t_iter)]
    if not finite:
        return {}
    best = min(c.t_iter for c in finite)
    near = [c for c in finite if c.t_iter <= best * (1 + tolerance)]
    return {"tolerance": tolerance, "best_t_iter_s": best, "near_count": len(near),
            "near_gen_min": min(c.gen_devices for c in near), "near_gen_max": max(c.gen_devices for c in near),
            "near_train_min": min(c.train_devices for c in near), "near_train_max": max(c.train_devices for c in near)}
