"""`streamrl bench agent`: multi-turn rollout throughput, streamed per trajectory against a
turn-synchronous loop, on the same instances and environment workers.

- **turn-synchronous** (what naive batch loops do): every live trajectory generates its next turn
  as one batch, then every environment step runs (in parallel on the env workers), and the next
  round starts when the slowest of both is done.
- **streamrl**: each trajectory advances on its own (``agent.loop`` in the SGS): a finished turn
  goes to its environment while the others keep generating, and its next turn goes back to its
  instance as soon as the environment answers.

Decoding is greedy, so both systems generate the same trajectories (``same_trajectories`` reports
the fraction whose tokens match); the workload is ``agent.scripted.SlowChainEnv`` (1-4 turns per
trajectory, an environment step of 0.02-0.5 s like a remote tool). Each system runs ``repeats``
times, alternating; the table keeps each system's median.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from streamrl.config import Config

ENV = "streamrl.agent.scripted:SlowChainEnv"


def _turn_synchronous(sgs, loop, requests) -> list:
    """Every live trajectory's turn as one batch, then every env step; returns the completions."""
    from streamrl.sgs.ledger import Ledger

    ledger, done = Ledger(remember_batches=1), []
    for r in requests:
        ledger.add(r, 1.0)
    live = {r.request_id: r for r in requests}
    rounds = 0
    while live:
        rounds += 1
        turn = list(sgs.generate([_fresh(r, rounds) for r in live.values()]))  # the batch barrier
        for c in turn:
            rid = c.request_id.split("#", 1)[0]
            c = replace(c, request_id=rid)
            loop.on_turn(c, ledger.turn_done(c))
        while loop.pending():  # every env step of the round (the second barrier)
            loop.wait(1.0)
            for rid, ids, episode in loop.collect():
                if ids is None:
                    done.append(ledger.finish(rid, episode))
                    del live[rid]
                else:
                    live[rid] = ledger.next_turn(rid, ids)
    return done


def _fresh(request, rounds: int):
    """The round's request under an id the SGS has not seen (it refuses a resubmitted one)."""
    return replace(request, request_id=f"{request.request_id}#{rounds}")


def _streamed(sgs, requests) -> list:
    return list(sgs.generate(requests))


def bench_agent(cfg: Config, trajectories: int = 32, repeats: int = 3, echo=print) -> dict:
    from streamrl.controller.setup import agent_loop, ensure_policy, init_ray
    from streamrl.controller.common import RequestBuilder
    from streamrl.models.tiny import load_tokenizer
    from streamrl.sgs.service import StreamGenerationService
    from streamrl.tasks.factory import make_task

    ensure_policy(cfg, echo)
    init_ray(cfg)
    tok = load_tokenizer(cfg.policy.path)
    prompts = make_task(cfg).train_prompts()[:trajectories]
    builder = RequestBuilder(tok, cfg)
    builder.n = 1
    sgs = StreamGenerationService(cfg, ranker=None, engine_overrides={"temperature": 0.0})
    runs: dict[str, list[dict]] = {"turn-synchronous": [], "streamrl": []}
    outputs: dict[str, list] = {}
    try:
        sgs.add_instances(cfg.generation.num_instances)
        for rep in range(repeats):
            for system in (("turn-synchronous", "streamrl") if rep % 2 == 0 else ("streamrl", "turn-synchronous")):
                loop = agent_loop(cfg, tok, builder)
                builder.agent = loop
                try:
                    requests = builder.build(prompts, rep, tag=f"{system}-")
                    t0 = time.perf_counter()
                    if system == "streamrl":
                        sgs.agent = loop
                        done = _streamed(sgs, requests)
                    else:
                        sgs.agent = None
                        done = _turn_synchronous(sgs, loop, requests)
                    wall = time.perf_counter() - t0
                finally:
                    sgs.agent = None
                    loop.close()
                runs[system].append(_row(system, wall, done))
                outputs.setdefault(system, sorted((c.prompt_id, c.output_ids) for c in done))
                echo(f"agent: {system} run {rep + 1}/{repeats}: {wall:.1f}s")
    finally:
        sgs.shutdown()
    same = sum(a == b for a, b in zip(outputs["streamrl"], outputs["turn-synchronous"])) / max(len(prompts), 1)
    rows = [min(rs, key=lambda r: abs(r["wall_s"] - statistics.median(x["wall_s"] for x in rs))) for rs in runs.values()]
    base = rows[0]["wall_s"]
    for r in rows:
        r["speedup"] = base / r["wall_s"]
    return {"rows": rows, "runs": runs, "trajectories": len(prompts), "repeats": repeats, "env": cfg.task.env,
            "same_trajectories": same, "instances": cfg.generation.num_instances,
            "env_workers": cfg.task.env_workers}


def _row(system: str, wall: float, done: list) -> dict:
    turns = sum(c.episode["turns"] for c in done)
    sampled = sum(c.generated for c in done)
    return {"system": system, "wall_s": wall, "trajectories": len(done), "turns": turns, "sampled_tokens": sampled,
            "trajectories_per_s": len(done) / wall, "sampled_tokens_per_s": sampled / wall}
