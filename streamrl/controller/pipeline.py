"""What the run asks of a mode: the ``Pipeline`` interface, and the helpers both kinds share.

``step(iteration, prompts) -> (samples, metrics)`` generates the iteration's samples, scores
them, trains on them and leaves the new weights installed where the mode requires. Two kinds
implement it: ``ColocatedPipeline`` (``colocated.py``) and ``DisaggPipeline`` (``disagg.py``).
What the mode decides comes from its ``modes.ModeSpec``; the placement plan is computed once.
"""

from __future__ import annotations

import logging

import ray

from streamrl.config import Config
from streamrl.errors import TrainerFailed
from streamrl.metrics.timeline import Timeline
from streamrl.types import Completion, GenRequest

log = logging.getLogger(__name__)


def trainer_get(ref, what: str, timeout_s: float | None = None):
    """``ray.get`` of a call to the trainer (or the colocated worker): its death, or no answer
    within ``timeout_s`` (``run.trainer_timeout_s``), is a ``TrainerFailed`` naming the call,
    not a Ray traceback that blames whoever waited, and never a hang."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TrainerFailed(f"the trainer answered no {what} within run.trainer_timeout_s={timeout_s:g}s "
                            "(hung, or a step slower than the limit allows)") from None
    except ray.exceptions.RayActorError as exc:
        raise TrainerFailed(f"the trainer actor died during {what} ({type(exc).__name__}); "
                            "the last checkpoint was left as it was") from None


TRAINER_START_TIMEOUT_S = 600.0
"""The least time the trainer actor gets to start and answer its first call (see ``DisaggPipeline``)."""


def shipped_policy(cfg: Config):
    """On an existing (possibly multi-node) cluster: the policy checkpoint put in the object store
    once, for actors to write on their own node (``controller.shipping``); on the local cluster
    the driver starts: None (every actor reads ``policy.path``)."""
    if not cfg.cluster.address:
        return None
    from streamrl.models.shipping import package_policy
    from streamrl.models.hf import resolve_policy_path

    return ray.put(package_policy(resolve_policy_path(cfg.policy.path)))


def staleness_metrics(iteration: int, completions: list[Completion]) -> dict[str, float]:
    """How far behind the trainer (which trains iteration ``it`` at version ``it``) the samples
    are: per sample by its oldest token (what the bound limits), and per token."""
    if not completions:
        return {"staleness/max": 0}
    per_sample = [iteration - c.version_start for c in completions]
    per_token = [iteration - v for c in completions for v in c.versions()]
    return {"staleness/max": max(per_sample), "staleness/mean": sum(per_sample) / len(per_sample),
            "staleness/token_mean": sum(per_token) / max(len(per_token), 1),
            "staleness/mixed_samples": float(sum(len(set(c.versions())) > 1 for c in completions))}


class Pipeline:
    """What the driver calls; each mode's pipeline implements it."""

    timeline: Timeline
    cfg: Config
    lookahead: int = 1
    """How many later iterations' prompts ``step`` wants in ``upcoming``."""

    def _tget(self, ref, what: str):
        return trainer_get(ref, what, self.cfg.run.trainer_timeout_s)

    def generate(self, requests: list[GenRequest]) -> list[Completion]:
        """Generate ``requests`` with the current weights (evaluation), outside any iteration."""
        raise NotImplementedError

    def step(self, iteration: int, prompts, upcoming=None):
        """One RL iteration: ``(samples, metrics)``."""
        raise NotImplementedError

    def finish(self) -> None:
        """Wait for every pending training step and install the newest weights."""

    def unreported_train_metrics(self) -> list[tuple[int, dict]]:
        """``(iteration, metrics)`` of finished training steps no ``step`` has returned yet."""
        return []

    def save(self, path: str, extra: dict, keep_as: str | None = None) -> None:
        """Checkpoint now, after every pending training step (blocking)."""
        raise NotImplementedError

    def checkpoint(self, path: str, extra: dict, keep_as: str | None = None) -> None:
        """Checkpoint the state after the last iteration whose ``step`` returned, without waiting
        for it where the mode allows (``save`` by default)."""
        self.save(path, extra, keep_as)

    def peak_memory(self) -> dict[str, dict[str, float]]:
        """``memory.peaks_mb()`` (MB) of each process the pipeline runs, by role."""
        raise NotImplementedError

    def lineage(self) -> list[str]:
        """Every request id the current weights were trained on (restored across resumes)."""
        raise NotImplementedError

    def ranker_state(self) -> dict | None:
        return None

    def locations(self) -> dict[str, dict[str, str]]:
        """Where each worker runs now: ``{"trainer": {"node": "A0", "site": "A"}, "gen-0": ...}``."""
        return {}

    def restore_ranker(self, state: dict | None) -> None:
        """Give a resumed run's ranker the stopped run's history."""

    def can_checkpoint_at(self, iteration: int) -> bool:
        """After an interruption: whether the trainer's state is exactly "trained through
        ``iteration``" (no step on a later, unfinished iteration), so a checkpoint there is exact."""
        raise NotImplementedError

    def load(self, path: str) -> dict:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError
