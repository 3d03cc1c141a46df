"""Reward-pool scaling: scores/s of `RewardRunner.submit` with 1..N isolated workers, for a reward
that takes 50 ms waiting on I/O (a verifier that calls a sandbox or a service; `--busy` makes it
do 50 ms of CPU work instead, which this 2-core machine bounds at 2x). Prints a table; `--out FILE.json` writes it.

    python scripts/reward_pool.py --workers 1,2,4,8 --calls 96
"""

from __future__ import annotations

import argparse
import json
import time

from streamrl.tasks.rewards import RewardRunner
from streamrl.types import Prompt


def waiting_reward(prompt: Prompt, response: str) -> float:
    time.sleep(0.05)
    return 1.0


def busy_reward(prompt: Prompt, response: str) -> float:
    """A fixed amount of CPU work: the loop count (in the response) that takes 50 ms on one core."""
    x = 0
    for _ in range(int(response)):
        x += 1
    return 1.0


def loops_per_50ms() -> int:
    n, t0 = 2_000_000, time.perf_counter()
    busy_reward(None, str(n))
    return int(n * 0.05 / (time.perf_counter() - t0))


def measure(fn, workers: int, calls: int, response: str) -> float:
    prompt = Prompt("p", "q", "a")
    with RewardRunner(fn, timeout_s=30.0, num_workers=workers) as runner:
        for f in [runner.submit(prompt, response) for _ in range(workers)]:  # every worker started
            f.result()
        t0 = time.perf_counter()
        for f in [runner.submit(prompt, response) for _ in range(calls)]:
            f.result()
        return calls / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--calls", type=int, default=96)
    ap.add_argument("--busy", action="store_true", help="a CPU-bound 50 ms reward instead of a waiting one")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    fn = busy_reward if args.busy else waiting_reward
    response = str(loops_per_50ms()) if args.busy else "0"
    rows, base = [], None
    for n in [int(x) for x in args.workers.split(",")]:
        rate = measure(fn, n, args.calls, response)
        base = base or rate
        rows.append({"workers": n, "scores_per_s": round(rate, 2), "speedup": round(rate / base, 2),
                     "of_ideal": round(rate / base / n, 2)})
    print(f"{'workers':>8} {'scores/s':>9} {'speedup':>8} {'of ideal':>9}   ({'busy' if args.busy else 'waiting'} "
          f"50 ms reward, {args.calls} calls)")
    for r in rows:
        print(f"{r['workers']:>8} {r['scores_per_s']:>9} {r['speedup']:>8} {r['of_ideal']:>9}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"reward": "busy" if args.busy else "waiting", "ms": 50, "calls": args.calls, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
