"""Typed run configuration: YAML presets plus dotted command-line overrides.

``load_config("configs/tiny.yaml", ["trainer.lr=3e-4", "mode=stream-sync"])`` reads the file,
applies each override (the value is parsed as YAML, so ``3e-4``, ``true`` and ``[1, 2]`` work),
and validates the whole tree. Any unknown key or bad value raises ``ConfigError`` naming the
dotted key and the offending value (and the closest key or name for a typo), before any work
starts: a YAML syntax error names the file, line and column; a number field takes no booleans,
infinities or NaN; dispatch policies and rankers are checked against their registries. Relative
paths written in a file resolve against the file's directory, those of overrides and defaults
against the working directory, and come out absolute (``PATH_FIELDS``). Defaults run on a 2-core
laptop. ``streamrl config show`` prints the resolved config (``dump_config_annotated``).
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import textwrap
import types
from pathlib import Path
from typing import Any, Iterable, Literal, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from streamrl.errors import UserError
from streamrl.modes import MODE_NAMES


class ConfigError(UserError, ValueError):
    """A config file or override is wrong; the message names the key and the value."""

    label = "config error"


def _union_arms(annotation: Any) -> tuple[Any, ...]:
    return get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)


def _misplaced_bool(annotation: Any, value: Any) -> bool:
    """True where ``value`` is (or holds, in a list or dict) a bool where ``annotation`` wants a
    number: YAML's ``true`` is not the integer 1 here."""
    arms = _union_arms(annotation)
    if isinstance(value, bool):
        return bool not in arms and any(a in (int, float) for a in arms)
    for arm in arms:
        origin, args = get_origin(arm), get_args(arm)
        if origin in (list, tuple) and args and isinstance(value, (list, tuple)):
            return any(_misplaced_bool(args[0], v) for v in value)
        if origin is dict and len(args) == 2 and isinstance(value, dict):
            return any(_misplaced_bool(args[1], v) for v in value.values())
    return False


def _choice(value: str, names: Iterable[str], what: str) -> str:
    """``value`` if it is one of ``names``, else an error listing them (and the closest)."""
    names = list(names)
    if value in names:
        return value
    msg = f"unknown {what} {value!r}; choose one of {names}"
    close = difflib.get_close_matches(value, names, n=1)
    if close:
        msg += f"; did you mean {close[0]!r}?"
    raise PydanticCustomError("streamrl_value", msg)


class _Section(BaseModel):
    # allow_inf_nan=False: ``trainer.lr=1e400`` or ``nan`` is a mistake, not a learning rate.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        """Pydantic's lax mode reads ``true`` as 1; a number field takes numbers (and numeric
        strings: YAML reads ``3e-4`` as a string), never booleans."""
        field = cls.model_fields.get(info.field_name or "")
        if field is not None and _misplaced_bool(field.annotation, value):
            raise PydanticCustomError("streamrl_bool_number", "a boolean is not a number")
        return value


class RunConfig(_Section):
    seed: int = Field(0, description="seed of data order, sampling and initialisation")
    iterations: int = Field(30, ge=1, description="RL iterations (one optimizer round each)")
    out_dir: str = Field("runs/latest", description="metrics.jsonl, tensorboard, timeline, ckpts")
    trainer_timeout_s: float | None = Field(3600.0, gt=0, description="a call to the trainer (an iteration's "
                                            "training included) that takes longer stops the run: a hung trainer "
                                            "is an error, not a wait (its start gets at least 600 s); None waits forever")
    eval_every: int = Field(0, ge=0, description="evaluate on the held-out set every k iterations; 0 = only before/after")
    checkpoint_every: int = Field(0, ge=0, description="save a checkpoint every k iterations; 0 = only at the end")
    keep_checkpoints: bool = Field(False, description="also keep each periodic checkpoint's policy as "
                                   "out_dir/checkpoints/iter-<k> (the latest is always out_dir/checkpoint)")
    resume: bool = Field(False, description="resume from the latest checkpoint in out_dir (refuses if there is none)")
    overwrite: bool = Field(False, description="a fresh run into an out_dir that holds a run removes that run's "
                                               "files first; without it such a run refuses")
    eval_samples: int = Field(2, ge=1, description="samples per held-out prompt (temperature as in training)")


class ClusterConfig(_Section):
    address: str | None = Field(None, description="existing Ray cluster address; None starts a local one")
    num_cpus: int = Field(2, ge=1, description="CPUs of the local Ray cluster")
    ship_package: bool = Field(True, description="with cluster.address: send this streamrl package to every node "
                               "through Ray's runtime environment (nodes need Python and the dependencies only)")
    ray_task_events: bool = Field(False, description="let Ray record an event per actor call (its dashboard's task "
                                  "list); off by default: the GCS keeps them and grows with the run, and the run's "
                                  "own timeline records the stages")

    def actor_options(self) -> dict:
        """Ray options every actor of a run is created with."""
        return {"enable_task_events": self.ray_task_events}


class PolicyConfig(_Section):
    path: str = Field(".cache/tiny-policy", description="a local Hugging Face causal-LM checkpoint directory, or "
                      "a hub id already in the local Hugging Face cache (resolved offline)")
    make_if_missing: bool = Field(True, description="build the tiny policy when policy.path is a missing "
                                  "directory named tiny-policy* (its cache); any other missing path is an error")
    save_dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="dtype of the final policy "
                                                               "checkpoint; auto = bfloat16 on cuda, float32 on cpu")
    # Tiny-policy architecture (used by `streamrl make-policy`).
    hidden_size: int = Field(128, ge=16, description="tiny policy: hidden size")
    num_layers: int = Field(4, ge=1, description="tiny policy: transformer layers")
    num_heads: int = Field(4, ge=1, description="tiny policy: attention heads (divides hidden_size)")
    num_kv_heads: int = Field(2, ge=1, description="tiny policy: key/value heads (divides num_heads)")
    intermediate_size: int = Field(384, ge=16, description="tiny policy: MLP width")
    max_position_embeddings: int = Field(512, ge=64, description="tiny policy: longest prompt + response")
    # Supervised warm start.
    sft_steps: int = Field(1500, ge=0, description="tiny policy: at most this many supervised warm-start steps")
    sft_batch_size: int = Field(32, ge=1, description="tiny policy: supervised warm-start batch size")
    sft_lr: float = Field(2e-3, gt=0, description="tiny policy: supervised warm-start learning rate")
    sft_target_accuracy: float = Field(0.45, gt=0, le=1, description="stop SFT once sampled accuracy reaches this")

    @model_validator(mode="after")
    def _heads_divide(self) -> "PolicyConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"policy.hidden_size={self.hidden_size} is not divisible by policy.num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"policy.num_heads={self.num_heads} is not divisible by policy.num_kv_heads={self.num_kv_heads}")
        return self


class TaskConfig(_Section):
    """Where prompts come from and how a response is scored.

    ``synthetic`` is generated here; ``file`` reads your data (jsonl, parquet, csv, or a local
    ``datasets`` directory); ``gsm8k`` and ``math500`` are presets of ``file`` (their keys,
    template and extractor filled in, their files looked up in the data directory)."""

    name: Literal["synthetic", "file", "gsm8k", "math500"] = Field(
        "synthetic", description="synthetic | file (your data) | gsm8k | math500 (presets of file)")
    train_path: str | None = Field(None, description="training data: .jsonl, .parquet, .csv or a `datasets` "
                                   "save_to_disk directory; presets default to their file in the data directory")
    eval_path: str | None = Field(None, description="held-out data (same formats); None = num_eval rows cut "
                                  "from train_path by seed")
    train_split: str = Field("train", description="split read from a DatasetDict directory for training")
    eval_split: str = Field("test", description="split read from a DatasetDict directory for evaluation")
    prompt_key: str | None = Field(None, description="column holding the prompt (file: 'prompt'; gsm8k: "
                                   "'question'; math500: 'problem')")
    answer_key: str | None = Field(None, description="column holding the reference answer (default 'answer')")
    prompt_template: str | None = Field(None, description="text around the prompt, with a {prompt} placeholder "
                                        "(other columns as {name}); None = the prompt as is (math presets: "
                                        "a step-by-step instruction)")
    answer_extractor: Literal["gsm8k", "boxed", "raw"] | None = Field(
        None, description="how the reference answer is read from answer_key: gsm8k (after '####'), boxed "
                          "(last \\boxed{}), raw (as is); None = the preset's, raw for file")
    chat_template: str = Field("auto", description="auto (the tokenizer's chat template when it has one) | none "
                               "| a Jinja template file")
    system_prompt: str | None = Field(None, description="system message when a chat template is applied")
    reward: str | list[str] | None = Field(None, description="reward function(s) by path: 'package.module:fn' or "
                                           "'/path/to/file.py:fn'; called as fn(response, answer, prompt, "
                                           "metadata) -> float or dict; None = the task's verifier")
    reward_weights: list[float] | None = Field(None, description="one weight per task.reward function "
                                               "(default 1.0 each); the reward is their weighted sum")
    num_train: int = Field(4096, ge=1, description="at most this many training prompts")
    num_eval: int = Field(256, ge=1, description="held-out prompts")
    reward_timeout_s: float = Field(5.0, gt=0, description="a reward call taking longer scores as an error")
    on_reward_error: Literal["zero", "raise"] = Field("zero", description="zero = score 0.0, count it and flag "
                                                      "the sample; raise = stop the run")
    on_bad_row: Literal["skip", "raise"] = Field("skip", description="skip = count and log the row, never silently")
    max_prompt_tokens: int = Field(256, ge=1, description="longer prompts are rejected with a counted error")
    partial_credit: float = Field(0.0, ge=0, lt=1, description="synthetic task: credit for a correct chain prefix "
                                  "(exact solutions score 1.0, accuracy counts only those)")
    length_ramp: bool = Field(False, description="synthetic task: training prompts in order of solution length, "
                                                 "shortest first, every epoch (no shuffle): response lengths grow "
                                                 "through each epoch (the elastic workload)")

    @field_validator("reward")
    @classmethod
    def _reward_syntax(cls, value: str | list[str] | None) -> str | list[str] | None:
        for spec in [value] if isinstance(value, str) else (value or []):
            target, sep, attr = spec.rpartition(":")
            if not (sep and target.strip() and attr.isidentifier()
                    and (is_reward_file(target) or _MODULE_PATH.match(target))):
                raise PydanticCustomError("streamrl_value", f"{spec!r} is not 'package.module:function' or "
                                          "'path/to/file.py:function'")
        return value

    @model_validator(mode="after")
    def _rewards_fit(self) -> "TaskConfig":
        specs = reward_specs(self)
        if self.reward_weights is not None and len(self.reward_weights) != len(specs):
            raise ValueError(f"task.reward_weights={self.reward_weights} has {len(self.reward_weights)} weights "
                             f"for {len(specs)} task.reward functions")
        if self.name == "file" and self.train_path is None:
            raise ValueError("task.name='file' needs task.train_path (a .jsonl, .parquet, .csv file or a "
                             "`datasets` directory)")
        return self


_MODULE_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def is_reward_file(target: str) -> bool:
    """A ``task.reward`` entry's part before ``:`` names a Python file (else a module to import),
    by the rule ``tasks/user_reward.py`` imports it with."""
    return target.endswith(".py") or "/" in target or "\\" in target


def reward_specs(task: "TaskConfig") -> list[str]:
    """``task.reward`` as a list (empty: the task's own verifier)."""
    if task.reward is None:
        return []
    return [task.reward] if isinstance(task.reward, str) else list(task.reward)


class GenerationConfig(_Section):
    engine: Literal["transformers", "vllm"] = Field("transformers", description="generation backend; vllm needs "
                                                    "the vllm package (`make test-vllm` builds .venv-vllm)")
    vllm: dict[str, Any] = Field(default_factory=dict, description="extra VLLMEngine settings when engine=vllm: "
                                 "dtype, device, multiprocessing, enforce_eager, gpu_memory_utilization, engine_args")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest token set holding this "
                         "probability mass; 1 = off")
    max_new_tokens: int = Field(200, ge=1, description="longest response, in tokens")
    n_samples: int = Field(8, ge=1, description="samples per prompt (GRPO group size)")
    prompts_per_iter: int = Field(16, ge=1, description="prompts per iteration (each sampled n_samples times)")
    num_instances: int = Field(1, ge=1, description="generation instances (one Ray actor each)")
    dispatch: str = Field("round-robin", description="dispatch policy: random | round-robin | least-loaded | skewness-aware | skewness-search")
    order: Literal["fifo", "lpt", "lpt-head"] = Field("fifo", description="admission order inside an instance: "
                                                     "arrival; longest predicted first (needs the ranker); or that "
                                                     "for the order_head fraction predicted longest, then arrival")
    order_head: float = Field(0.1, gt=0, le=1, description="lpt-head: the fraction admitted longest-first")
    latency_profile: str | None = Field(None, description="PTL profile JSON (`streamrl profile`) read by skewness-aware "
                                        "dispatch and rebalancing; None = the paper's H800 table")
    skew_alpha: float = Field(0.2, gt=0, lt=1, description="skewness-aware dispatch: long-tail fraction")
    rebalance: bool = Field(False, description="move requests off an instance whose predicted remaining work "
                            "exceeds the least loaded one's while some instance has free slots (beyond the paper)")
    rebalance_threshold: float = Field(0.25, ge=0, lt=1, description="rebalance when (T_max - T_min) > this x T_max")
    partial_rollout: bool = Field(False, description="stream-async: a new policy version is installed on the "
                                  "instances as soon as the trainer publishes it, between two decode steps of the "
                                  "running requests (each token records the version that sampled it), and the next "
                                  "iteration's prompts are admitted into free batch slots while the staleness bound "
                                  "allows, so the long tail no longer idles the instances")
    rebalance_running: bool = Field(True, description="rebalancing may also move running requests (stopped and "
                                    "resumed elsewhere with their generated prefix) where the engine can preempt")
    rebalance_interval_s: float = Field(0.1, gt=0, description="rebalancing checks progress at most this often")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per instance, e.g. {H20: 1}")
    threads_per_instance: int = Field(1, ge=1, description="CPUs (Ray num_cpus) of each generation instance")
    cpus_per_instance: float | None = Field(None, gt=0, description="Ray CPUs reserved per instance when not "
                                            "threads_per_instance (a fraction oversubscribes on purpose)")
    max_batch_tokens: int = Field(1024, ge=16)
    max_requests_per_batch: int = Field(64, ge=1)
    num_blocks: int = Field(512, ge=8)
    page_size: int = Field(32, ge=1)
    cb_attention: Literal["varlen", "dense"] = Field(
        "varlen", description="transformers engine on CPU: 'varlen' attends each request to its own keys "
                              "(sgs/engines/varlen_attention.py); 'dense' is transformers' packed masked attention")
    elastic: bool = Field(False, description="scale the instance count live: add one when generation lags "
                                             "training by at least what one more instance saves (PAPER.md 3.4), "
                                             "remove one when generation keeps outpacing training")
    min_instances: int = Field(1, ge=1, description="elastic: fewest instances")
    max_instances: int | None = Field(None, ge=1, description="elastic: most instances (default num_instances + 1); "
                                      "the placement reserves CPUs for this many")
    scale_down_patience: int = Field(3, ge=1, description="elastic: iterations in a row that generation must outpace "
                                     "training (with one instance fewer) before one is removed, and the iterations "
                                     "after any change before another removal")
    scale_up_min_gain: float = Field(0.1, ge=0, lt=1, description="elastic: add one only if it is predicted to save "
                                     "at least this fraction of the generation time")
    scale_down_margin: float = Field(0.25, ge=0, lt=1, description="elastic: remove one only if generation with one "
                                     "instance fewer is predicted at most (1 - margin) x the training time")
    restart: bool = Field(True, description="start a replacement (with the current weights) for an instance that "
                                            "died or stopped answering")
    max_restarts: int = Field(8, ge=0, description="replacements started over the whole run, at most")
    heartbeat_timeout_s: float = Field(120.0, gt=0, description="an instance that answers no call (poll, submit, "
                                       "weight update) for this long is taken as hung: killed, its requests re-dispatched")
    replacement_timeout_s: float = Field(300.0, gt=0, description="how long a replacement may take to start "
                                         "(Ray scheduling and model load) before it counts as failed")

    @field_validator("dispatch")
    @classmethod
    def _known_dispatch(cls, value: str) -> str:
        from streamrl.scheduling.dispatch import DISPATCH_POLICIES  # pure Python: no torch, no Ray

        return _choice(value, DISPATCH_POLICIES, "policy")


class RankerConfig(_Section):
    """Output-length ranker used by the SGS when dispatch or order needs predicted lengths."""

    name: str = Field("blend", description="learned | lm (the policy fine-tuned to predict lengths) | history | "
                      "blend (history + a text prior: kwargs.prior learned|lm) | reweighted (earlier responses scored by "
                      "the current policy; kwargs.estimator) | prompt-length | none (equal predictions)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="constructor arguments of the ranker")
    fit_file: str | None = Field(None, description="JSONL of {key, text, length} records to fit on before the "
                                 "first iteration; None = cold start, fitted on the first finished batch")
    refresh: bool = Field(True, description="update from finished generations each iteration, in the background")

    @field_validator("name")
    @classmethod
    def _known_ranker(cls, value: str) -> str:
        from streamrl.ranker.base import RANKERS  # numpy only: no torch, no Ray

        return _choice(value, [*RANKERS, "none"], "ranker")


class TrainerConfig(_Section):
    algo: Literal["grpo", "ppo"] = Field("grpo", description="grpo (group-relative advantages) | ppo (with a critic)")
    lr: float = Field(1e-4, gt=0, description="policy learning rate")
    weight_decay: float = Field(0.0, ge=0)
    clip_eps: float = Field(0.2, gt=0)
    kl_coef: float = Field(0.0, ge=0, description="KL to the frozen reference; 0 disables the reference")
    grad_clip: float = Field(1.0, gt=0)
    micro_batch_tokens: int = Field(4096, ge=16, description="token budget of one micro-batch")
    step_tokens: int = Field(0, ge=0, description="dynamic batch: an optimizer step fires once finished groups "
                             "(in completion order) hold this many tokens; 0 = one step per iteration")
    epochs: int = Field(1, ge=1, description="passes over each batch")
    threads: int = Field(1, ge=1, description="torch threads (and Ray CPUs) of the single trainer")
    backend: Literal["single", "fsdp"] = Field("single", description="single = one trainer process (the trainer "
                                               "actor); fsdp = FSDP2 ranks as Ray actors in one placement group, "
                                               "driven by the trainer actor (disaggregated modes, GRPO without KL; "
                                               "required on placement.device=cuda)")
    fsdp_ranks: int = Field(2, ge=1, description="FSDP2 world size on placement.device=cpu (gloo); on cuda it is "
                            "placement.trainer_gpus")
    fsdp_rank_cpus: float = Field(1.0, gt=0, description="CPUs each FSDP2 rank reserves on placement.device=cpu "
                                  "(a fraction shares a core; torch threads per rank: max(1, int(this)))")
    max_staleness: int | None = Field(None, ge=0, description="versions a trained sample's oldest token may lag "
                                      "the trainer; None = the mode's (0, stream-async 1); above 1 only in "
                                      "stream-async, where generation then runs up to k iterations ahead")
    correction: Literal["none", "decoupled", "tis"] = Field(
        "none", description="off-policy correction of stale samples: none (PPO clip against the behaviour log-probs) | "
        "decoupled (AReaL's decoupled PPO: clip against the trainer's pre-step policy, weight by pre-step / behaviour) "
        "| tis (policy gradient weighted by truncated pi/behaviour per token)")
    is_cap: float = Field(2.0, gt=0, description="truncation of the importance weights (decoupled and tis)")
    # PPO
    critic_lr: float = Field(5e-4, gt=0, description="PPO critic learning rate")
    vf_coef: float = Field(0.5, ge=0)
    vf_clip: float = Field(0.2, gt=0)
    gamma: float = Field(1.0, gt=0, le=1, description="PPO discount")
    lam: float = Field(0.95, ge=0, le=1, description="PPO GAE lambda")


class NodeGroupConfig(_Section):
    """Identical nodes of a (possibly heterogeneous) GPU cluster, named by a Ray resource label."""

    gpu_type: str = Field(..., min_length=1, description="Ray resource label of these GPUs, e.g. H800; start "
                          "Ray on such a node with --num-gpus=8 --resources='{\"H800\": 8}'")
    nodes: int = Field(1, ge=1)
    gpus_per_node: int = Field(8, ge=1)
    cpus_per_node: int = Field(32, ge=1)


class PlacementConfig(_Section):
    """Where the trainer ranks and generation instances run (``streamrl.placement`` plans it).

    ``device: cpu`` is the embedded default (actors with CPUs only). With ``device: cuda`` the
    trainer is ``trainer_gpus`` FSDP2 ranks in one Ray placement group and every generation
    instance has its own ``gen_gpus_per_instance`` GPUs; ``*_gpu_type`` pins each side to GPUs
    carrying that resource label (a heterogeneous cluster: e.g. trainer on H800, vLLM on H20)."""

    device: Literal["cpu", "cuda"] = Field("cpu", description="cpu (actors with CPUs only) | cuda (GPU workers)")
    nodes: list[NodeGroupConfig] = Field(default_factory=list, description="the cluster, for the plan and its "
                                         "dry run; empty = the local machine (live runs read Ray's resources)")
    trainer_gpus: int = Field(1, ge=1, description="FSDP2 world size (one Ray worker per GPU)")
    trainer_gpu_type: str | None = Field(None, description="Ray resource label the trainer's GPUs carry; None = any")
    trainer_dtype: Literal["float32", "bfloat16"] = Field("float32", description="FSDP2 compute dtype "
                                                         "(bfloat16: fp32 master weights, fp32 gradient reduce)")
    gen_gpus_per_instance: int = Field(1, ge=1, description="tensor-parallel size of each vLLM instance")
    gen_gpu_type: str | None = Field(None, description="Ray resource label the generation GPUs carry; None = any")
    cpus_per_gpu: int = Field(4, ge=1, description="CPUs reserved beside each GPU worker")
    trainer_node: str | None = Field(None, description="run the trainer on this node of a labelled cluster "
                                     "(its node_<NAME> Ray resource, e.g. A0; `streamrl cluster up` labels nodes)")
    trainer_site: str | None = Field(None, description="run the trainer in this site (its site_<NAME> resource)")
    gen_nodes: list[str] = Field(default_factory=list, description="generation instance i runs on node "
                                 "gen_nodes[i % len] (node_<NAME> resources); empty = anywhere (or gen_sites)")
    gen_sites: list[str] = Field(default_factory=list, description="generation instance i runs in site "
                                 "gen_sites[i % len] (site_<NAME> resources) when gen_nodes is empty")


class WeightsConfig(_Section):
    """How new weights reach the generation instances (``streamrl.weights.engine``)."""

    method: Literal["naive", "tree"] = Field("tree", description="naive (every instance fetches from the "
                                             "trainer) | tree (one copy per node and per remote site: a relay "
                                             "instance re-publishes to its site, weights.fanout at a time)")
    fanout: int = Field(2, ge=1, description="tree: nodes each relay feeds inside its site")
    wire_dtype: Literal["float32", "bfloat16"] = Field("float32", description="dtype of floating-point weights "
                                                       "on the wire (bfloat16 halves the bytes; instances keep "
                                                       "their own dtype)")
    delta: bool = Field(False, description="send only the 16-bit words that changed since the version an "
                        "instance holds (lossless, CRC-checked); a new or lagging instance gets a full copy")
    bucket_mb: float = Field(16.0, gt=0, description="delta: bytes per bucket, each encoded on its own")


LOGGING_BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


class LoggingConfig(_Section):
    backends: list[Literal[LOGGING_BACKENDS]] = Field(
        ["console", "jsonl", "tensorboard"], description="where metrics go: console | jsonl "
        "(out_dir/metrics.jsonl) | tensorboard (out_dir/tensorboard) | wandb (offline unless WANDB_MODE says "
        "otherwise; pip install wandb) | mlflow (sqlite store out_dir/mlflow.db unless MLFLOW_TRACKING_URI; pip "
        "install mlflow)")
    project: str = Field("streamrl", description="wandb project / mlflow experiment name")
    run_name: str | None = Field(None, description="wandb / mlflow run name; None = out_dir's name")
    samples: bool = Field(False, description="write every trained sample (prompt, response, length, reward, "
                          "versions) to run.out_dir/samples.jsonl: the rollout log, and `rank eval` records")


class Config(_Section):
    mode: Literal[MODE_NAMES] = Field(
        "colocated", description="pipeline: colocated (one worker: generate, then train) | disagg-batch (separate "
        "workers, whole batches) | stream-sync (train on finished samples during generation) | stream-async "
        "(also generate iteration i+1 while training i: staleness 1)")
    run: RunConfig = RunConfig()
    cluster: ClusterConfig = ClusterConfig()
    policy: PolicyConfig = PolicyConfig()
    task: TaskConfig = TaskConfig()
    generation: GenerationConfig = GenerationConfig()
    trainer: TrainerConfig = TrainerConfig()
    ranker: RankerConfig = RankerConfig()
    logging: LoggingConfig = LoggingConfig()
    placement: PlacementConfig = PlacementConfig()
    weights: WeightsConfig = WeightsConfig()

    def staleness_bound(self) -> int:
        """The staleness bound k the run holds: ``trainer.max_staleness``, else the mode's."""
        from streamrl.modes import get_mode

        k = self.trainer.max_staleness
        return get_mode(self.mode).max_staleness if k is None else k

    @model_validator(mode="after")
    def _staleness_fits_the_mode(self) -> "Config":
        from streamrl.modes import get_mode

        k, mode = self.trainer.max_staleness, get_mode(self.mode)
        if k is not None and k != mode.max_staleness and mode.max_staleness == 0:
            raise ValueError(f"trainer.max_staleness={k}: mode={self.mode!r} is synchronous (staleness 0); a bound "
                             "above 0 needs mode=stream-async")
        if k == 0 and mode.max_staleness > 0:
            raise ValueError("trainer.max_staleness=0 in mode='stream-async': a synchronous run is mode=stream-sync")
        if self.generation.partial_rollout and mode.max_staleness == 0:
            raise ValueError(f"generation.partial_rollout=true needs mode=stream-async (mode={self.mode!r} installs "
                             "weights only between iterations, with no request in flight)")
        return self

    @model_validator(mode="after")
    def _trainer_backend_fits(self) -> "Config":
        """The FSDP2 trainer group trains GRPO without a reference or critic, beside separate
        generation instances; a GPU run trains with it and nothing else."""
        t, p = self.trainer, self.placement
        if p.device == "cuda" and self.mode == "colocated":
            raise ValueError("placement.device=cuda runs the disaggregated modes (trainer and generation on separate "
                             "GPUs): mode='colocated' is not supported on GPU")
        if p.device == "cuda" and t.backend != "fsdp":
            raise ValueError(f"placement.device=cuda trains with FSDP2 over placement.trainer_gpus={p.trainer_gpus} "
                             f"ranks: set trainer.backend=fsdp (got trainer.backend={t.backend!r})")
        if t.backend == "fsdp":
            if self.mode == "colocated":
                raise ValueError("trainer.backend='fsdp' needs a disaggregated mode (disagg-batch, stream-sync, "
                                 "stream-async): mode='colocated' time-shares one worker and is not supported")
            if t.algo != "grpo":
                raise ValueError(f"trainer.backend='fsdp' trains GRPO only (no critic): trainer.algo={t.algo!r} "
                                 "is not supported")
            if t.kl_coef > 0:
                raise ValueError(f"trainer.backend='fsdp' has no reference model: trainer.kl_coef={t.kl_coef} is "
                                 "not supported (set it to 0)")
        return self


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key!r}: {part!r} is not a section")
        node = child
    node[parts[-1]] = value


def _string_field(key: str) -> bool | None:
    """True if the dotted key names a plain-string field (``str`` or ``str | None``), whose value
    an override takes verbatim: ``task.prompt_template=Q: {prompt}`` is text, not YAML."""
    model: Any = Config
    parts = key.split(".")
    for i, part in enumerate(parts):
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        ann = field.annotation
        if i < len(parts) - 1:
            model = ann
            continue
        return set(_union_arms(ann)) in ({str}, {str, type(None)})
    return None


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """A PyYAML error as one line: ``line 3, column 5: mapping values are not allowed here``."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    context = getattr(exc, "context", None)
    if context:
        ctx_mark = getattr(exc, "context_mark", None)
        where = f" at line {ctx_mark.line + 1}, column {ctx_mark.column + 1}" if ctx_mark is not None else ""
        problem = f"{problem} ({context}{where})"
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark is not None else problem


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    if _string_field(key) and raw.strip() not in ("null", "~", "None"):
        return key, raw
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {key}: value {raw!r} is not valid YAML ({_yaml_problem(exc)})") from None
    return key, value


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The config section an annotation holds (``NodeGroupConfig`` for ``list[NodeGroupConfig]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        model = _model_in(arg)
        if model is not None:
            return model
    return None


def _keys_beside(loc: tuple[Any, ...]) -> list[str]:
    """The field names of the section holding the key at ``loc`` (list indices skipped)."""
    model: type[BaseModel] | None = Config
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part)) if model is not None else None
        model = _model_in(field.annotation) if field is not None else None
        if model is None:
            return []
    return list(model.model_fields) if model is not None else []


def _format_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        value = err.get("input")
        msg = err["msg"].removeprefix("Value error, ")
        if not loc:  # a check across sections: its message names every key and value involved
            lines.append(msg)
        elif err["type"] == "extra_forbidden":
            line = f"unknown config key {loc!r} (value {value!r})"
            close = difflib.get_close_matches(str(err["loc"][-1]), _keys_beside(err["loc"]), n=1)
            if close:
                line += f"; did you mean {'.'.join([*map(str, err['loc'][:-1]), close[0]])!r}?"
            lines.append(line)
        elif err["type"] == "streamrl_value":  # the message names the value already
            lines.append(f"config key {loc!r}: {msg}")
        else:
            lines.append(f"config key {loc!r}: {msg} (got {value!r})")
    return "; ".join(lines)


def config_from_dict(tree: dict[str, Any]) -> Config:
    """Validate a config tree as is (no path resolution: ``load_config`` does that)."""
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None


# Fields naming files, and how a relative value resolves (``_resolve_path``): against the config
# file's directory for a value written in the file, against the working directory for an override
# or a default. Resolved values are absolute, so a run's out_dir/config.yaml reloads unchanged.
#   path: always; data: only if it exists there (else a name the task looks up in the data
#   directory); policy: unless it looks like a hub id and does not exist there; template: unless
#   auto/none; reward: the file part of 'file.py:fn' / 'dir/file:fn' entries.
PATH_FIELDS: dict[str, str] = {
    "run.out_dir": "path",
    "policy.path": "policy",
    "task.train_path": "data",
    "task.eval_path": "data",
    "task.chat_template": "template",
    "task.reward": "reward",
    "ranker.fit_file": "path",
    "generation.latency_profile": "path",
}

def _looks_like_hub_id(value: str) -> bool:
    """``Qwen/Qwen2.5-0.5B``: org/name, neither part hidden (``.cache/x``), not the tiny policy's cache."""
    from streamrl.models.hf import HUB_ID, is_tiny_policy_path  # light: no transformers at import

    return bool(HUB_ID.match(value)) and not any(part.startswith(".") for part in value.split("/")) \
        and not is_tiny_policy_path(value)


def _resolve_path(kind: str, value: Any, base: Path) -> Any:
    """``value`` of a ``PATH_FIELDS`` field of that ``kind``, a relative path made absolute
    against ``base``; anything that is not a path (or not a string) is returned as is."""
    if kind == "reward":
        if isinstance(value, list):
            return [_resolve_path("reward", v, base) for v in value]
        if not isinstance(value, str):
            return value
        target, sep, attr = value.rpartition(":")
        return f"{_resolve_path('path', target, base)}:{attr}" if sep and is_reward_file(target) else value
    if not isinstance(value, str) or not value.strip() or (kind == "template" and value in ("auto", "none")):
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    joined = os.path.normpath(base / path)
    if kind == "data" and not os.path.exists(joined):
        return value
    if kind == "policy" and not os.path.exists(joined) and _looks_like_hub_id(value):
        return value
    return joined


def _resolve_paths(tree: dict[str, Any], base: Path, defaults: bool = False) -> None:
    """Resolve the ``PATH_FIELDS`` of a raw config tree in place against ``base``; with
    ``defaults``, also the defaults of those the tree does not set."""
    for key, kind in PATH_FIELDS.items():
        section, name = key.split(".")
        if section not in tree and defaults:
            tree[section] = {}
        node = tree.get(section)
        if not isinstance(node, dict):
            continue  # validation names the bad section
        if name in node:
            node[name] = _resolve_path(kind, node[name], base)
        elif defaults:
            default = _model_in(Config.model_fields[section].annotation).model_fields[name].get_default(
                call_default_factory=True)
            resolved = _resolve_path(kind, default, base)
            if resolved != default:
                node[name] = resolved


def _read_config_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist" if not path.exists()
                          else f"config file {str(path)!r} is not a file")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} {_yaml_problem(exc)}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping, got {type(loaded).__name__}")
    return loaded


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The validated config of a YAML file (None: the defaults) with dotted overrides applied.

    Relative paths written in the file resolve against the file's directory; those given as
    overrides, and the defaults, against the working directory (see ``PATH_FIELDS``)."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        tree = _read_config_file(p)
        _resolve_paths(tree, p.absolute().parent)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(tree, key, value)
    _resolve_paths(tree, Path.cwd(), defaults=True)
    return config_from_dict(tree)


def plan_overrides(path: str | Path) -> list[str]:
    """A plan file (``streamrl plan --placement-out``: YAML config sections) as dotted overrides,
    applied before the command line's own."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--plan {str(path)!r}: no such file")
    tree = _read_config_file(p)
    out: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out.append(f"{prefix}{key}=" + yaml.dump(value, default_flow_style=True, width=float("inf")).strip()
                           .removesuffix("\n...").removesuffix("...").strip())
    walk(tree, "")
    return out


def split_cli_config(config: str | None, overrides: list[str] | tuple[str, ...],
                     default: str | None = None) -> tuple[str | None, list[str]]:
    """A command's ``[CONFIG] [overrides...]`` positionals: a first positional that looks like an
    override (``key=value``) is one, and ``default`` is the config file then."""
    overrides = list(overrides)
    if config is not None and "=" in config:
        config, overrides = default, [config] + overrides
    return (config if config is not None else default), overrides


def load_cli_config(config: str | None, overrides: list[str] | tuple[str, ...], default: str | None = None) -> Config:
    """``load_config`` on ``split_cli_config``'s result."""
    return load_config(*split_cli_config(config, overrides, default))


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)


class _OneLineDumper(yaml.SafeDumper):
    """Flow-style YAML on one line: multi-line or unprintable strings double-quoted (escaped)."""


def _represent_str(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = '"' if ("\n" in text or not text.isprintable()) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_OneLineDumper.add_representer(str, _represent_str)


def _yaml_entry(name: str, value: Any) -> str:
    """``name: value`` as one line of YAML (a list or mapping in flow style)."""
    text = yaml.dump({name: value}, Dumper=_OneLineDumper, default_flow_style=True, width=float("inf"),
                     sort_keys=False, allow_unicode=True).strip()
    return text[1:-1]  # drop the braces of the one-entry mapping


def _comment(text: str | None, indent: str = "", width: int = 100) -> list[str]:
    if not text:
        return []
    lines = []
    for para in inspect.cleandoc(text).split("\n\n"):
        if lines:
            lines.append(f"{indent}#")
        lines += textwrap.wrap(" ".join(para.split()), width - len(indent) - 2, initial_indent=f"{indent}# ",
                               subsequent_indent=f"{indent}# ", break_on_hyphens=False)
    return lines


def dump_config_annotated(cfg: Config, header: Iterable[str] = ()) -> str:
    """``cfg`` as YAML with each section's docstring and each key's description as ``#``
    comments (``streamrl config show``); ``load_config`` reads it back to ``cfg``."""
    data = cfg.model_dump()
    lines = [f"# {h}" for h in header] + ([""] if header else [])
    for name, field in Config.model_fields.items():
        section = _model_in(field.annotation)
        if section is None or get_origin(field.annotation) is not None:
            lines += _comment(field.description)
            lines.append(_yaml_entry(name, data[name]))
            continue
        lines.append("")
        lines += _comment(section.__doc__)
        lines.append(f"{name}:")
        for key, sub in section.model_fields.items():
            lines += _comment(sub.description, "  ")
            lines.append("  " + _yaml_entry(key, data[name][key]))
    return "\n".join(lines).replace("\n\n\n", "\n\n").lstrip("\n") + "\n"
