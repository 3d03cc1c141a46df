"""What a run sets up before its loop: Ray, the policy on disk, the user's reward, the request
builder and scorer (``RunContext``) and the mode's pipeline."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from streamrl.config import Config
from streamrl.controller.common import RequestBuilder, Scorer
from streamrl.modes import get_mode
from streamrl.placement import PlacementPlan, plan_placement

if TYPE_CHECKING:
    from streamrl.controller.pipeline import Pipeline

log = logging.getLogger(__name__)

def init_ray(cfg: Config) -> None:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if ray.is_initialized():
        return
    # THP_MEM_ALLOC_ENABLE: torch's CPU allocator asks for transparent huge pages for large blocks;
    # the trainer then spends less time in page faults (docs/results.md: +18-21% tokens/s, smaller peak)
    env = {"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "1")}}
    if cfg.cluster.address:
        if cfg.cluster.ship_package:  # other nodes import this copy of the package (controller.shipping)
            env["py_modules"] = [str(Path(__file__).resolve().parents[1])]  # the streamrl package folder
        ray.init(address=cfg.cluster.address, log_to_driver=True, runtime_env=env)
    else:
        ray.init(num_cpus=cfg.cluster.num_cpus, include_dashboard=False, log_to_driver=True, runtime_env=env)


def ray_resources() -> dict[str, float]:
    import ray

    return ray.cluster_resources()


def ensure_policy(cfg: Config, echo=print) -> None:
    """Build the tiny policy (tokenizer, model, SFT warm start) or a model recipe's checkpoint
    (``models.recipes``) at its cache path if it is not on disk yet, or the tiny policy again if
    the one there was built for an older synthetic task (its ``streamrl_policy.json`` says so).
    Any other path must hold a checkpoint (or be a cached hub id): a mistyped path fails here,
    naming it, instead of training a tiny model there."""
    from streamrl.models.hf import is_tiny_policy_path, resolve_policy_path
    from streamrl.models.sft import POLICY_MARKER, policy_is_stale

    from streamrl.models import recipes

    path = Path(cfg.policy.path)
    recipe = recipes.recipe_for(path)
    if (path / "config.json").is_file():
        if not policy_is_stale(path):
            return
        echo(f"the policy at {path} was built for an older synthetic task ({POLICY_MARKER}); rebuilding it")
    elif cfg.policy.make_if_missing and recipe is not None:
        recipes.build(recipe, path, seed=cfg.run.seed, echo=echo)
        return
    elif not (cfg.policy.make_if_missing and is_tiny_policy_path(path)):
        resolve_policy_path(path)  # a hub id in the local cache passes; anything else raises naming the path
        return
    from streamrl.models.sft import make_policy

    echo(f"building the tiny policy at {cfg.policy.path} (tokenizer, model, supervised warm start)")
    from streamrl.metrics import progress

    with progress.bar("building the tiny policy (SFT steps)", total=cfg.policy.sft_steps):
        res = make_policy(cfg.policy, cfg.policy.path, seed=cfg.run.seed, progress=lambda s, n, m: echo(m))
    echo(f"policy ready: {res.steps} SFT steps in {res.seconds:.0f}s, sampled accuracy {res.sampled_accuracy:.3f}")


def make_pipeline(cfg: Config, ctx: "RunContext", plan: PlacementPlan | None = None) -> "Pipeline":
    """The configured mode's pipeline; ``plan`` is the run's placement plan (computed here if not given)."""
    plan = plan if plan is not None else plan_placement(cfg)
    if get_mode(cfg.mode).colocated:
        from streamrl.controller.colocated import ColocatedPipeline

        return ColocatedPipeline(cfg, ctx, plan)
    from streamrl.controller.disagg import DisaggPipeline

    return DisaggPipeline(cfg, ctx, plan)


class RunContext:
    """What every pipeline needs from the driver: request building and scoring."""

    def __init__(self, cfg: Config, task, tokenizer, reward_fn=None) -> None:
        from streamrl.tasks.rewards import RewardRunner

        self.cfg = cfg
        self.task = task
        self.tokenizer = tokenizer
        self.builder = RequestBuilder(tokenizer, cfg)
        self.reward_runner = RewardRunner.for_task(task, cfg.task, reward_fn=reward_fn)
        self.scorer = Scorer(task, tokenizer, self.reward_runner)
        self.fault_log: str | None = None  # where the SGS appends generation faults (the driver sets it)
        self.agent = agent_loop(cfg, tokenizer, self.builder) if cfg.task.multi_turn else None
        self.builder.agent = self.agent

    def close(self) -> None:
        self.reward_runner.close()
        if self.agent is not None:
            self.agent.close()


def agent_schemas(cfg: Config) -> list[dict]:
    """Import ``task.env`` and ``task.tools`` (``RewardSpecError`` naming a bad entry, before any
    work, not in every trajectory's reset) and return the tools' schemas."""
    from streamrl.agent.env import load_env_class, load_tools
    from streamrl.agent.tools import schema

    if cfg.task.env:
        load_env_class(cfg.task.env)
    return [schema(fn) for fn in load_tools(cfg.task.tools).values()]


def agent_loop(cfg: Config, tokenizer, builder: RequestBuilder):
    """The run's multi-turn loop: env and tools in their worker processes, the chat renderer."""
    from streamrl.agent.chat import TurnRenderer
    from streamrl.agent.env import EnvHost
    from streamrl.agent.loop import AgentLoop
    from streamrl.agent.runner import EnvRunner

    t = cfg.task
    schemas = agent_schemas(cfg)
    runner = EnvRunner(EnvHost(t.env, t.tools), workers=t.env_workers, timeout_s=t.env_timeout_s)
    return AgentLoop(cfg, TurnRenderer(builder.formatter, schemas), runner, tokenizer, has_env=bool(t.env))


def user_reward(cfg: Config, reward_fn=None):
    """The run's ``UserReward`` (``task.reward`` specs, then ``reward_fn`` callables), imported
    and signature-checked here so a typo fails before Ray starts; None = the task's verifier."""
    from streamrl.config import reward_specs
    from streamrl.tasks.user_reward import UserReward

    specs = reward_specs(cfg.task)
    fns = [] if reward_fn is None else (list(reward_fn) if isinstance(reward_fn, (list, tuple)) else [reward_fn])
    if not specs and not fns:
        return None
    weights = cfg.task.reward_weights
    if weights is not None and fns:
        weights = list(weights) + [1.0] * len(fns)
    return UserReward(specs, weights, fns).check()
