"""Data-parallel training of the policy with FSDP2 (``torch.distributed.fsdp.fully_shard``).

One process per rank (one GPU each on a GPU node, NCCL; or CPU processes over gloo, which is how
the tests run it). Every rank holds 1/W of each parameter; a forward all-gathers a layer's
parameters, the backward reduce-scatters its gradients (averaged over ranks). ``FSDPRank`` is one
rank, ``FSDPTrainerGroup`` drives all of them for the trainer actor (``trainer.backend=fsdp``).

Invariants: every rank runs the same number of micro-steps and takes the same deterministic share
of the same item list, and one step's gradient equals the single-process token-mean gradient
(``FSDPRank.train_step``); each rank checkpoints its own shards (``sharded_ckpt``), which resume
at any world size and in the single-process trainer; the weights reach the instances through the
Ray object store, not NCCL. Each rank builds the model on the meta device and reads only its shards
(``trainer.meta_init``); with ``trainer.lora`` it loads the whole model first (the adapters are
seeded as the single trainer's) and they are sharded with their layers. Limits: GRPO without a
reference model (``trainer.kl_coef == 0``) or critic.
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from streamrl.config import Config
from streamrl.models import lora
from streamrl.models.logprobs import token_logprobs
from streamrl.trainer import losses, meta_init
from streamrl.trainer.schedule import lr_for_step, set_lr
from streamrl.trainer.trainer import (Prepared, _pad, micro_batches, policy_objective, prepare_samples,
                                      set_group_advantages, skipped_step, step_denominators)
from streamrl.types import Sample

PARAM_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, backend: str | None = None) -> str:
    """Join the process group (``nccl`` when CUDA is available, else ``gloo``); returns the backend."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    return backend


def shard_policy(model: torch.nn.Module, param_dtype: str = "float32") -> torch.nn.Module:
    """Apply FSDP2 to a Hugging Face causal LM: one shard group per decoder layer, then the root
    (embeddings, final norm and the, possibly tied, head). In place; returns ``model``.

    With ``param_dtype="bfloat16"`` master weights and optimizer state stay fp32, forward and
    backward run in bf16 and gradients are reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if param_dtype not in PARAM_DTYPES:
        raise ValueError(f"param_dtype={param_dtype!r}: expected one of {sorted(PARAM_DTYPES)}")
    mp = MixedPrecisionPolicy(param_dtype=PARAM_DTYPES[param_dtype], reduce_dtype=torch.float32)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no .model.layers: not a decoder-only HF causal LM")
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def shard_items(items: list[Prepared], world_size: int) -> list[list[Prepared]]:
    """Split ``items`` over ranks, longest first onto the least-loaded rank (by tokens); each
    rank keeps the original order of its items. Deterministic: every rank computes the same split."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    loads = [0] * world_size
    owner = [0] * len(items)
    for i in sorted(range(len(items)), key=lambda i: (-items[i].num_tokens, i)):
        r = min(range(world_size), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += items[i].num_tokens
    return [[p for p, o in zip(items, owner) if o == r] for r in range(world_size)]


class FSDPRank:
    """One FSDP2 rank: the policy sharded with ``fully_shard``, AdamW on its shards, and this
    rank's share of each optimizer step. ``FSDPTrainerGroup`` runs one per rank as a Ray actor;
    every method after ``setup`` is a collective (call it on every rank, in lockstep)."""

    def __init__(self, rank: int, world_size: int, cfg: Config, policy_path: str | None, param_dtype: str,
                 threads: int) -> None:
        torch.set_num_threads(threads)
        self.rank, self.world_size = rank, world_size
        self.cfg, self.policy_path, self.param_dtype = cfg, policy_path, param_dtype
        self._publisher = None  # rank 0's weights.engine.WeightPublisher, made at the first publish

    def endpoint(self) -> tuple[str, int]:
        """This node's address and a free port on it: rank 0's is the rendezvous point."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, master_addr: str, master_port: int, backend: str | None) -> str:
        """Join the process group, load the policy (as ``Trainer`` does: same seed, same weights)
        and shard it; returns the backend."""
        from streamrl.models.tiny import load_policy

        backend = init_distributed(self.rank, self.world_size, master_addr, master_port, backend)
        cfg = self.cfg
        self.tcfg, self.temperature = cfg.trainer, cfg.generation.temperature
        torch.manual_seed(cfg.run.seed)
        from streamrl.models.hf import resolve_policy_path
        from streamrl.models.shipping import materialize_policy
        from streamrl.models.tiny import load_tokenizer

        policy_dir = resolve_policy_path(materialize_policy(self.policy_path or cfg.policy.path))
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.lora = self.tcfg.lora.rank > 0
        self.tokenizer = load_tokenizer(policy_dir)
        self.pad_id = self.tokenizer.pad_token_id
        if meta_init.supported(policy_dir, self.lora):  # no rank holds the whole model
            self.model, self.load_info = meta_init.build_sharded_policy(
                policy_dir, lambda m: shard_policy(m, self.param_dtype), device, self.tcfg.activation_checkpointing)
        else:  # whole model, then shards: LoRA's adapters are seeded as the single trainer's are
            self.model = load_policy(policy_dir)[0].to(device)
            model_bytes = sum(p.numel() * 4 for p in self.model.parameters())
            self.load_info = meta_init.LoadInfo(False, largest_full_tensor_bytes=model_bytes, model_bytes=model_bytes)
            if self.tcfg.activation_checkpointing:
                meta_init.enable_activation_checkpointing(self.model)
            if self.lora:  # adapters on every rank (seeded alike), sharded with the layer they belong to
                self.model = lora.wrap(self.model, self.tcfg.lora)
            shard_policy(self.model.get_base_model() if self.lora else self.model, self.param_dtype)
        self.model.train()
        # fully_shard swaps in DTensor parameters: the optimizer must be built on those.
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=self.tcfg.lr,
                                     weight_decay=self.tcfg.weight_decay)
        self._device = next(self.model.parameters()).device
        return backend

    def loaded(self) -> dict:
        """How this rank got its weights (``meta_init.LoadInfo``) and whether blocks recompute
        their activations in backward."""
        return {**vars(self.load_info), "activation_checkpointing": any(getattr(m, "gradient_checkpointing", False) for m in self.model.modules())}

    def train_step(self, items: list[Prepared], step: int = 0) -> dict[str, float]:
        """This rank's share of one optimizer step over all of ``items``; every rank calls it
        with the same list::

            the same item list on every rank --shard_items--> rank r's items (token-balanced, deterministic)
            per rank: micro-batches by the token budget, padded to the SAME count on every rank with
                      zero-loss micro-steps (each forward/backward is a collective: unequal counts hang)
            loss denominator = all-rank response tokens / W  (so the rank-average of gradients equals
                      the single-process token-mean gradient over all items)
            clip by the global grad norm (DTensor) -> AdamW on the local shards

        The metrics other than the grad norm and the counts are this rank's share of the batch
        (the group reports rank 0's)."""
        mine = shard_items(items, self.world_size)
        per_rank_mbs = [micro_batches(share, self.tcfg.micro_batch_tokens) if share else [] for share in mine]
        n_micro = max(len(m) for m in per_rank_mbs)
        tokens, seqs = step_denominators(items)
        denom, seq_denom = tokens / self.world_size, seqs / self.world_size
        self.opt.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        local = per_rank_mbs[self.rank]
        local_tokens = max(float(sum(p.trained_tokens for p in mine[self.rank])), 1.0)
        for i in range(n_micro):
            if i < len(local):
                for key, value in self._micro_step(local[i], denom, seq_denom).items():
                    weight = sum(p.trained_tokens for p in local[i]) / local_tokens
                    sums[key] = sums.get(key, 0.0) + value * weight
            else:
                self._empty_micro_step()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        set_lr(self.opt, lr_for_step(self.cfg, step))  # step: the group's count
        self.opt.step()
        sums.update({"train/lr": float(self.opt.param_groups[0]["lr"]), "train/grad_norm": float(grad_norm), "train/tokens": sum(p.num_tokens for p in items),
                     "train/samples": len(items), "train/rank_samples": len(mine[self.rank])})
        return sums

    def _empty_micro_step(self) -> None:
        """Join the collectives of a micro-step with no data of ours: zero loss, zero gradient."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self._device)
        logits = self.model(input_ids=ids).logits
        (logits.float().sum() * 0.0).backward()

    def _micro_step(self, mb: list[Prepared], total_tokens: float, total_seqs: float) -> dict[str, float]:
        """The GRPO policy-gradient micro-step of ``Trainer._micro_step``, on this rank's device."""
        ids, attn, mask = (t.to(self._device) for t in _pad(mb, self.pad_id))
        logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        logp = token_logprobs(logits, ids[:, 1:], temperature=self.temperature)
        loss, m = policy_objective(self.tcfg, mb, logp, mask, total_tokens, total_seqs)
        loss.backward()
        metrics = {f"train/{k}": v for k, v in m.items()}
        metrics["train/entropy"] = losses.masked_entropy(logits, mask, self.temperature)
        metrics["train/pg_loss"] = float(loss.detach()) * total_tokens / max(float(mask.sum()), 1.0)
        return metrics

    def policy_state(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) state dict on CPU: on rank 0; other ranks get ``{}``. A collective:
        call it on every rank."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.lora:  # the adapter alone, as the single trainer publishes it (one all-gather per tensor)
            out = {}
            for name, p in self.model.named_parameters():
                key = lora.adapter_key(name)
                if key is not None:
                    out[key] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            return out if self.rank == 0 else {}
        return get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def publish(self, version: int):
        """Gather the full state dict; rank 0 flattens it into one buffer and puts it in the
        object store (it owns the object) and returns the handle; others return None."""
        state = self.policy_state()
        if self.rank != 0:
            return None
        if self._publisher is None:
            from streamrl.weights.engine import WeightPublisher

            w = self.cfg.weights
            self._publisher = WeightPublisher(self.cfg.wire_dtype(), w.delta, w.bucket_mb)
        return self._publisher.publish(state, version)

    def parameters_vector(self) -> np.ndarray:
        """Every parameter, unsharded, flattened and concatenated in ``parameters()`` order (as
        the single-process trainer's); on every rank (one all-gather each)."""
        return torch.cat([p.full_tensor().detach().flatten().cpu() for p in self.model.parameters()]).numpy()

    def save_checkpoint(self, path: str, extra: dict, version: int, steps: int) -> None:
        """Full fine-tuning: every rank writes its shards of the parameters and AdamW moments
        (``sharded_ckpt``; nothing gathered), and rank 0 writes ``trainer.pt`` naming that
        directory, after every shard is on disk, then removes the directory it replaces. LoRA: the
        adapters (small) gathered on rank 0, in the single-process trainer's format. Either way
        rank 0 exports ``policy/`` (the weights alone, gathered) for the run's final export.
        Every rank must see ``path`` (one node, or shared storage)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

        path = Path(path)
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        state = {"critic": None, "critic_opt": None, "version": version, "steps": steps, "extra": extra, "rng": rng}
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        if self.lora:
            model_sd, opt_sd = get_state_dict(self.model, self.opt, options=full)  # {} on ranks > 0
            if self.rank == 0:
                model_sd = {k: v for k, v in model_sd.items() if lora.adapter_key(k) is not None}
                names = [n for n, p in self.model.named_parameters() if p.requires_grad]
                index = {n: i for i, n in enumerate(names)}
                state["opt"] = {"state": {index[n]: v for n, v in opt_sd["state"].items()},
                                "param_groups": [{**g, "params": [index[n] for n in g["params"]]}
                                                 for g in opt_sd["param_groups"]]}
                state["model"] = model_sd
        else:
            shards = f"sharded-v{version}-s{steps}"
            from streamrl.trainer.sharded_ckpt import save_sharded

            save_sharded(self.model, self.opt, path / shards)  # returns when every rank's shards are written
            state.update(model=None, opt=None, sharded=shards)
            model_sd = get_model_state_dict(self.model, options=full)
        if self.rank == 0:
            path.mkdir(parents=True, exist_ok=True)
            tmp = path / "trainer.pt.tmp"
            torch.save(state, tmp)
            tmp.replace(path / "trainer.pt")
            for old in path.glob("sharded-*"):  # directories trainer.pt no longer names
                if old.name != state.get("sharded"):
                    shutil.rmtree(old, ignore_errors=True)
            self.model.save_pretrained(path / "policy", state_dict=model_sd)
            self.tokenizer.save_pretrained(path / "policy")
        dist.barrier()

    def load_checkpoint(self, path: str) -> tuple[dict, int, int]:
        """Resume from ``save_checkpoint``'s files (any world size) or a single-process trainer's
        (every rank reads the full state dicts and keeps its shards); the RNG state is rank 0's
        at the save. Returns ``(extra, version, steps)``."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        state = torch.load(Path(path) / "trainer.pt", weights_only=False)
        if state.get("critic") is not None:
            raise ValueError(f"{path}: a PPO checkpoint (it has a critic); the FSDP2 trainer trains GRPO only")
        if state.get("sharded"):
            from streamrl.trainer.sharded_ckpt import load_sharded

            load_sharded(self.model, self.opt, Path(path) / state["sharded"])
        else:
            names = [n for n, p in self.model.named_parameters() if p.requires_grad]
            opt_sd = {"state": {names[i]: v for i, v in state["opt"]["state"].items()},
                      "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["opt"]["param_groups"]]}
            # strict=False with LoRA: the checkpoint holds the adapters, the base weights are loaded already
            set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=opt_sd,
                           options=StateDictOptions(full_state_dict=True, strict=not self.lora))
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        return state["extra"], state["version"], state["steps"]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class FSDPTrainerGroup:
    """The trainer for ``trainer.backend=fsdp``: ``world_size`` ``FSDPRank`` actors inside ONE
    placement group (co-scheduled or not at all), driven in lockstep, behind the surface the
    trainer actor (``trainer.actor.IterationTrainer``) uses of ``Trainer``::

        IterationTrainer --begin_iteration / prepare_groups / set_group_advantages--> here
                         --train_step(items)------------------------------------> every rank
                         --finish_iteration / publish / save / load-------------> every rank;
                                                                                  rank 0 answers

    ``publish``: every rank gathers the full state dict; rank 0 flattens it and ``ray.put``s ONE
    buffer (``streamrl.weights``) and returns the handle. ``save`` / ``load``: each rank writes and
    reads its own shards (``FSDPRank.save_checkpoint``; checkpoints cross backends and world
    sizes). The item
    list goes to the ranks once per step (one ``ray.put``).

    It holds no model: GRPO without a reference or critic prepares a sample without a forward
    pass (tokens, log-probs and the reward are copied) and the group advantage is the reward
    normalised in its group, so no full copy of the policy sits beside the ranks' shards and the
    trainer actor needs no CPU of its own. Versions and step counts are kept here.

    ``bundles`` default to the trainer bundles of ``placement.plan_placement(cfg)`` (a GPU and
    its type label per rank on ``device=cuda``, ``trainer.fsdp_ranks`` CPU bundles on
    ``device=cpu``); pass ``[{"CPU": 1}] * 2`` for CPU ranks over gloo. Rank 0's node address and
    a free port on it become the rendezvous point."""

    def __init__(self, cfg: Config, policy_path: str | None = None, bundles: list[dict[str, float]] | None = None,
                 strategy: str | None = None, backend: str | None = None, ready_timeout_s: float = 120.0) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if cfg.trainer.kl_coef > 0 or cfg.trainer.algo != "grpo":
            raise ValueError(f"FSDPTrainerGroup supports GRPO without a reference model; got trainer.algo="
                             f"{cfg.trainer.algo!r}, trainer.kl_coef={cfg.trainer.kl_coef}")
        self.cfg, self.tcfg = cfg, cfg.trainer
        self.version = self.steps = 0
        if bundles is None:
            from streamrl.placement import plan_placement

            plan = plan_placement(cfg)
            bundles, strategy = [dict(b.resources) for b in plan.trainer], strategy or plan.trainer_strategy
        if not bundles:
            raise ValueError("FSDPTrainerGroup needs at least one bundle (one per rank)")
        self.world_size = len(bundles)
        self.pg = placement_group(bundles, strategy=strategy or "PACK")
        try:
            ray.get(self.pg.ready(), timeout=ready_timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self.pg)
            raise RuntimeError(f"placement group for {self.world_size} trainer ranks {bundles} ({strategy}) not "
                               f"ready after {ready_timeout_s:.0f}s: the cluster lacks the resources "
                               f"(available: {ray.available_resources()})") from None
        rank_actor = ray.remote(FSDPRank)
        dtype = cfg.placement.trainer_dtype
        self.workers = []
        for rank, b in enumerate(bundles):
            labels = {k: v for k, v in b.items() if k not in ("CPU", "GPU")}
            self.workers.append(rank_actor.options(
                num_cpus=b.get("CPU", 1), num_gpus=b.get("GPU", 0), resources=labels, **cfg.cluster.actor_options(),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=rank),
            ).remote(rank, self.world_size, cfg, policy_path, dtype, max(1, int(b.get("CPU", 1)))))
        addr, port = ray.get(self.workers[0].endpoint.remote())
        self.backend = ray.get([w.setup.remote(addr, port, backend) for w in self.workers])[0]

    def _all(self, method: str, *args) -> list:
        """Call ``method`` on every rank at once (a collective) and wait for all of them."""
        import ray

        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    # ------------------------------------------------------------------ per-sample work (no model)
    def begin_iteration(self) -> None:
        """Nothing to snapshot: no critic."""

    def prepare_groups(self, groups: list[list[Sample]]) -> list[list[Prepared]]:
        """``Trainer.prepare_groups`` without a reference or critic: no forward pass."""
        return prepare_samples(self.cfg, groups)

    set_group_advantages = staticmethod(set_group_advantages)

    # ------------------------------------------------------------------ on the ranks
    def train_step(self, items: list[Prepared]) -> dict[str, float]:
        """One optimizer step over ``items`` split across the ranks; rank 0's metrics, plus the
        per-rank sample counts."""
        import ray

        if not items:
            raise ValueError("train_step needs at least one sample")
        skipped = skipped_step(items)
        if skipped is not None:
            return skipped
        t0 = time.time()
        results = self._all("train_step", ray.put(items), self.steps)  # serialised once, read by every rank
        metrics = dict(results[0])
        metrics["train/rank_samples"] = [r["train/rank_samples"] for r in results]
        metrics["train/step_s"] = time.time() - t0
        self.steps += 1
        return metrics

    def finish_iteration(self) -> int:
        """Close the iteration: the policy becomes version + 1."""
        self.version += 1
        return self.version

    def policy_state(self) -> dict[str, torch.Tensor]:
        """The full state dict (gathered by every rank, returned by rank 0)."""
        return self._all("policy_state")[0]

    def publish(self):
        """The current policy as one flat buffer in the object store, put by rank 0; returns its
        ``WeightHandle`` (the state dict itself never passes through the caller)."""
        return self._all("publish", self.version)[0]

    def parameters_vector(self) -> np.ndarray:
        """All parameters, unsharded, as one numpy vector in ``parameters()`` order."""
        return self._all("parameters_vector")[0]

    def save_checkpoint(self, path: str | Path, extra: dict | None = None) -> None:
        self._all("save_checkpoint", str(path), extra or {}, self.version, self.steps)

    def load_checkpoint(self, path: str | Path) -> dict:
        """Load on every rank; returns ``extra`` (version and step count come from the file)."""
        extra, self.version, self.steps = self._all("load_checkpoint", str(path))[0]
        return extra

    def shutdown(self) -> None:
        """Stop the ranks and free their placement group (it outlives the actor that made it)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        self._all("close")
        for w in self.workers:
            ray.kill(w)
        remove_placement_group(self.pg)
