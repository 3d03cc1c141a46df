"""`streamrl profile [CONFIG] [overrides]`: measure decode latency vs batch size and trainer tokens/s."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser(
        "profile", help="measure PTL(batch size) of the engine and the trainer's tokens/s; write a profile JSON",
        description="Measures, on the configured policy (never built here), the engine's per-token decode latency "
                    "at each batch size (generation.threads_per_instance threads) and the trainer's tokens/s "
                    "(trainer.threads threads) on one generated iteration of the workload, prints a table and "
                    "writes the profile that `streamrl simulate modes`, `streamrl plan --profile` and dispatch read.")
    p.add_argument("config", nargs="?", default="configs/bench.yaml")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="comma list (default 1,2,4,8,16,32,64)")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps per latency run (default 32)")
    p.add_argument("--train-steps", type=int, default=3, help="timed trainer steps after one warm-up (default 3)")
    p.add_argument("--colocated-threads", type=int, default=None,
                   help="also measure at this many threads for colocated mode (default cluster.num_cpus; 0 = skip)")
    p.add_argument("--out", metavar="FILE.json", default=None, help="profile path (default profiles/cpu-<model>.json)")
    p.set_defaults(handler="streamrl.planner.profile_live:run_profile")
