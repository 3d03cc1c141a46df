"""The trainer as a Ray actor: it consumes groups as they stream in and steps when it can.

``IterationTrainer`` (the logic, testable without Ray; ``TrainerActor`` is its Ray actor) takes
each iteration's groups through ``add_groups``: staleness check, per-sample preparation on
arrival, an optimizer step whenever ``trainer.step_tokens`` tokens are buffered, and at the end
of the iteration version + 1 and the weights published to the object store.

Invariants: a sample older than ``max_staleness`` versions is never trained on
(``StalenessError``); the same cut rule on the same order gives the same steps, however the groups
are split into calls (batch-sync: one call; stream-sync: one per group), hence the same
parameters. Backends (``trainer.backend``): ``single`` (``trainer.py``), ``fsdp`` (``fsdp.py``).
"""

from __future__ import annotations

import time

import ray

from streamrl.config import Config
from streamrl.memory import release_free_memory
from streamrl.types import Event, Group, TrainResult


class StalenessError(RuntimeError):
    """A sample older than the staleness bound reached the trainer."""


class IterationTrainer:
    """The actor's logic as a plain class (tests drive it without Ray).

    Batch-sync (disagg-batch) sends all groups in one call, stream-sync one call per finished
    group: the same cut rule on the same order gives the same steps, hence the same parameters.
    The weight publish is a ``ray.put`` of one flat buffer; the instances fetch it while this
    actor already works on the next iteration's groups (stream-async overlaps the push with
    training).

    Two trainer backends behind the same logic (``trainer.backend``):

    - ``single``: the ``Trainer`` in this process (``trainer.threads`` CPUs); it flattens its
      own state dict for the publish.
    - ``fsdp`` (always on GPU): an ``FSDPTrainerGroup`` (``trainer/fsdp.py``). The steps of
      ``add_groups`` are still decided here (staleness, preparing, the batch cut, epochs,
      versions); preparing needs no model (GRPO, no reference, no critic), so this actor loads
      none and reserves no CPU. The optimizer steps, the publish (rank 0 gathers, flattens and
      puts the buffer: the weights still travel by the object store, not by NCCL) and
      checkpoints run on the FSDP2 ranks, a placement group of their own that ``shutdown`` frees."""

    def __init__(self, cfg: Config, threads: int, max_staleness: int, policy=None) -> None:
        """``policy``: a ``controller.shipping.PolicyPackage`` when the driver ships the policy
        (a run on a multi-node cluster), else None (``policy.path`` is read here)."""
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from streamrl.memory import watch_private_memory
        from streamrl.models.shipping import materialize_policy

        watch_private_memory()
        from streamrl.trainer.trainer import Trainer

        cfg = cfg.model_copy(deep=True)  # this process's own copy: the thread count is set here
        cfg.trainer.threads = threads
        self.cfg = cfg
        if cfg.trainer.backend == "fsdp":
            from streamrl.trainer.fsdp import FSDPTrainerGroup

            self.trainer = FSDPTrainerGroup(cfg, policy_path=policy)  # each rank materializes it on its node
        else:
            self.trainer = Trainer(cfg, materialize_policy(policy) if policy is not None else None)
        self.max_staleness = max_staleness
        self.iteration = -1
        self._reset(-1, 0)
        self.events: list[Event] = []
        self.lineage: list[str] = []  # every request id the current weights were trained on: checkpointed
        self._drained = 0  # lineage entries already returned by drain_trained_ids

    def _reset(self, iteration: int, expected: int) -> None:
        self.iteration, self.expected, self.received = iteration, expected, 0
        self.buffer: list[list] = []
        self.batches: list[list[list]] = []
        self.metrics: dict[str, float] = {}
        self.train_s = 0.0
        self.prepare_s = 0.0
        self.tokens = 0

    def publish(self) -> object:
        """Flatten the current policy and put it in the object store; returns the handle (with
        ``fsdp``, rank 0 gathers, flattens and puts it: no state dict passes through here)."""
        t0 = time.time()
        handle = self.trainer.publish()
        meta = {"bytes": handle.nbytes, "delta_bytes": handle.delta_nbytes} if handle is not None else {}
        self.events.append(Event("trainer", "weight_push", self.iteration, self.trainer.version, t0, time.time(), meta))
        return handle

    def version(self) -> int:
        return self.trainer.version

    def location(self):
        """Where this actor runs (``weights.tree.Location``: node label and site)."""
        from streamrl.weights.engine import here

        return here()

    def add_groups(self, iteration: int, groups: list[Group], expected: int) -> TrainResult | None:
        """Take groups of iteration ``iteration`` (calls are processed in order, from the mailbox)::

            1. staleness check: every sample's version_start >= trainer.version - max_staleness,
               else StalenessError (the sample is never trained on)
            2. per-sample work on arrival: reference log-probs, old values, GAE / group advantages
            3. buffer; whenever the buffered groups hold ``trainer.step_tokens`` tokens, one
               optimizer step on them (a dynamic batch), in arrival order
            4. when ``expected`` groups of ``iteration`` have arrived: the last step on the
               remainder, extra epochs if configured, version += 1, flatten and publish the
               weights to the object store; return a ``TrainResult`` (metrics, weight handle,
               version). Before that, None."""
        from streamrl.trainer.trainer import dynamic_batches, group_tokens

        if iteration != self.iteration:
            if self.received != self.expected:
                raise RuntimeError(f"iteration {iteration} started while {self.iteration} has "
                                   f"{self.received}/{self.expected} groups")
            self.trainer.begin_iteration()
            self._reset(iteration, expected)
        t0 = time.time()
        for g in groups:
            for s in g.samples:
                lag = self.trainer.version - s.completion.version_start
                if lag > self.max_staleness:
                    raise StalenessError(f"sample {s.completion.request_id} generated by version "
                                         f"{s.completion.version_start} reached trainer version "
                                         f"{self.trainer.version}: staleness {lag} > bound {self.max_staleness}")
        prepared = self.trainer.prepare_groups([list(g.samples) for g in groups])
        if self.cfg.trainer.algo == "grpo":
            self.trainer.set_group_advantages(prepared)
        t1 = time.time()
        self.prepare_s += t1 - t0
        self.events.append(Event("trainer", "prepare", iteration, self.trainer.version, t0, t1))
        self.buffer.extend(prepared)
        self.received += len(groups)
        step_tokens = self.cfg.trainer.step_tokens
        while step_tokens > 0 and sum(group_tokens(g) for g in self.buffer) >= step_tokens:
            batch = dynamic_batches(self.buffer, step_tokens)[0]
            self.buffer = self.buffer[len(batch):]
            self._step(batch)
        if self.received < self.expected:
            return None
        if self.buffer:
            self._step(self.buffer)
            self.buffer = []
        for _ in range(self.cfg.trainer.epochs - 1):
            for batch in self.batches:
                self._step(batch, record=False)
        self.trainer.finish_iteration()
        release_free_memory()  # this iteration's tensors are gone: give their pages back (streamrl.memory)
        handle = self.publish()
        self.metrics.update({"time/train_s": self.train_s, "time/prepare_s": self.prepare_s,
                             "train/tokens_per_s": self.tokens / max(self.train_s, 1e-9),
                             "train/steps_in_iter": len(self.batches) * self.cfg.trainer.epochs,
                             "policy/version": self.trainer.version, "weights/bytes": float(handle.nbytes)})
        if handle.delta is not None:
            self.metrics["weights/delta_fraction"] = handle.delta_nbytes / handle.nbytes
        return TrainResult(iteration=iteration, version=self.trainer.version, handle=handle, metrics=dict(self.metrics))

    def _step(self, batch: list[list], record: bool = True) -> None:
        t0 = time.time()
        items = [p for g in batch for p in g]
        self.metrics = self.trainer.train_step(items)
        t1 = time.time()
        self.train_s += t1 - t0
        self.tokens += sum(p.num_tokens for p in items)
        if record:
            self.batches.append(batch)
            self.lineage.extend(p.meta["request_id"] for p in items)
        self.events.append(Event("trainer", "train", self.iteration, self.trainer.version, t0, t1))

    def partial_steps(self) -> int:
        """Optimizer steps already taken on the iteration still being received (dynamic batches):
        a checkpoint now would hold part of an iteration that a resume replays whole."""
        return len(self.batches) if self.received < self.expected else 0

    def drain_events(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    def drain_trained_ids(self) -> list[str]:
        """Request ids trained since the last call (the tail of the lineage)."""
        out, self._drained = self.lineage[self._drained:], len(self.lineage)
        return out

    def parameters_vector(self):
        return self.trainer.parameters_vector()

    def save(self, path: str, extra: dict, keep_as: str | None = None, ship: bool = False):
        """Write the checkpoint (with the lineage); ``keep_as``: also copy its policy there. Called
        as an actor method it runs between two ``add_groups`` calls, i.e. exactly after the last
        iteration whose groups came before it, while generation goes on elsewhere. ``ship``: the
        driver is on another node; write to a local temporary and return the files
        (``{"checkpoint": files, "keep": files | None}``) for the driver to write."""
        import shutil
        import tempfile

        t0 = time.time()
        local = tempfile.mkdtemp(prefix="streamrl-ckpt-") if ship else None
        target = f"{local}/checkpoint" if ship else path
        out = None
        try:
            self.trainer.save_checkpoint(target, {**extra, "lineage": list(self.lineage)})
            if ship:
                from streamrl.models.shipping import pack_dir

                out = {"checkpoint": pack_dir(target), "keep": pack_dir(f"{target}/policy") if keep_as else None}
            elif keep_as:
                shutil.copytree(f"{path}/policy", keep_as, dirs_exist_ok=True)
        finally:
            if local:
                shutil.rmtree(local, ignore_errors=True)
        self.events.append(Event("trainer", "checkpoint", self.iteration, self.trainer.version, t0, time.time()))
        return out

    def load(self, path) -> dict:
        """Restore a checkpoint: a directory here, or its files shipped by the driver."""
        import shutil
        import tempfile

        local = None
        if isinstance(path, dict):
            from streamrl.models.shipping import unpack_dir

            local = tempfile.mkdtemp(prefix="streamrl-ckpt-")
            path = str(unpack_dir(path, f"{local}/checkpoint"))
        try:
            extra = self.trainer.load_checkpoint(path)
        finally:
            if local:
                shutil.rmtree(local, ignore_errors=True)
        self.lineage = list(extra.pop("lineage", []))
        self._drained = len(self.lineage)
        return extra

    def peak_memory_mb(self) -> dict[str, float]:
        """Peak resident and private memory of this process (FSDP2 ranks are their own processes, not counted)."""
        from streamrl.memory import peaks_mb

        return peaks_mb()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def get_lineage(self) -> list[str]:
        return list(self.lineage)

    def shutdown(self) -> None:
        """Stop the FSDP2 ranks and free their placement group: a placement group lives as long as
        the job, not as the actor that made it, so killing this actor alone would keep it reserved."""
        self.trainer.shutdown()


TrainerActor = ray.remote(IterationTrainer)
