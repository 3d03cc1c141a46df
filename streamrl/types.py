"""Messages every part of streamrl shares.

These records cross process boundaries (Ray pickles them), so they hold only plain Python data
(ints, floats, strings, lists): no tensors. Every generated sample carries the policy version(s)
that produced it; the trainer's staleness accounting reads nothing else.

Lifecycle of one prompt (owner of each transition in brackets):

    queued [controller] -> dispatched [SGS] -> generating [instance] -> finished [instance]
           -> scored [reward worker] -> trained [trainer]
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Prompt:
    """One task item, before generation."""

    prompt_id: str
    """Stable id, unique within the dataset (e.g. ``"train-000123"``)."""
    text: str
    """The text the policy is conditioned on (already formatted with any template)."""
    answer: str
    """The reference answer the verifier compares against."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Task-specific extras (sub-task name, difficulty, ...); never read by the trainer."""


@dataclass(frozen=True)
class GenRequest:
    """One response to generate: a prompt, tokenised, and which member of its group it is."""

    request_id: str
    """``f"{prompt_id}/{sample_idx}"``: unique per iteration."""
    prompt_id: str
    sample_idx: int
    """Index of this sample within its prompt's group (GRPO group of ``n`` samples)."""
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    priority: float = 0.0
    """Larger is admitted first (the ranker's predicted length under LPT); 0 = FIFO."""


@dataclass(frozen=True)
class Completion:
    """What an engine returns for one finished request."""

    request_id: str
    prompt_id: str
    """The prompt it answers (``GenRequest.prompt_id``): nothing parses ``request_id``."""
    sample_idx: int
    """Its index within the prompt's group (``GenRequest.sample_idx``)."""
    prompt_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    """Log-probability of each sampled output token under the generating weights (temperature
    applied), one per entry of ``output_ids``."""
    finish_reason: str
    """``"stop"`` (end-of-sequence sampled) or ``"length"`` (hit ``max_new_tokens``)."""
    version_start: int
    """Policy version installed when the request started generating."""
    version_end: int
    """Policy version installed when it finished (differs only if an update happened mid-flight)."""
    t_start: float
    """Wall-clock (``time.time()``) when the request was admitted by the engine."""
    t_end: float
    """Wall-clock when its last token was sampled."""
    instance: str = ""
    """Name of the generation instance that produced it."""
    token_versions: tuple[int, ...] = ()
    """Policy version that sampled each output token (partial rollout: a weight update between two
    decode steps changes it mid-response); empty = every token at ``version_start``."""
    loss_mask: tuple[int, ...] = ()
    """1 for each output token the policy sampled, 0 for one it did not (a multi-turn trajectory's
    environment and tool messages, chat markup); empty = all sampled."""
    episode: dict[str, Any] = field(default_factory=dict)
    """A multi-turn trajectory's account (``agent.loop``): turns, env_tokens, tool_calls, its
    environment reward and errors; empty for a single-turn response."""

    def versions(self) -> tuple[int, ...]:
        """The version of each output token (``token_versions``, else ``version_start`` for all)."""
        return self.token_versions or (self.version_start,) * len(self.output_ids)

    def mask(self) -> tuple[int, ...]:
        """``loss_mask``, or all ones."""
        return self.loss_mask or (1,) * len(self.output_ids)

    @property
    def generated(self) -> int:
        """Output tokens the policy sampled (all of them but a trajectory's environment tokens)."""
        return sum(self.loss_mask) if self.loss_mask else len(self.output_ids)


@dataclass(frozen=True)
class Partial:
    """A request stopped mid-generation (``GenerationEngine.preempt``) and what it had generated.

    Runtime rebalancing resumes it on another instance: the continuation's prompt is
    ``request.prompt_ids + output_ids`` and the two halves are joined into one ``Completion``
    (``StreamGenerationService``). A request preempted before it started has empty outputs."""

    request: GenRequest
    output_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    version_start: int | None = None
    """Version installed when the stopped part started (None: it had not started)."""
    t_start: float | None = None
    token_versions: tuple[int, ...] = ()
    """Version that sampled each of ``output_ids`` (as ``Completion.token_versions``)."""
    loss_mask: tuple[int, ...] = ()
    """As ``Completion.loss_mask`` (empty = all sampled)."""

    def versions(self) -> tuple[int, ...]:
        return self.token_versions or (self.version_start,) * len(self.output_ids)

    def mask(self) -> tuple[int, ...]:
        return self.loss_mask or (1,) * len(self.output_ids)


@dataclass(frozen=True)
class Progress:
    """Where an instance's unfinished requests stand (``GenerationInstance.progress``): what runtime
    rebalancing reads to decide what to move."""

    held: tuple[str, ...] = ()
    """Requests in the instance actor's own queue (not handed to the engine: not started)."""
    waiting: tuple[str, ...] = ()
    """Requests queued in the engine that have not started."""
    running: dict[str, int] = field(default_factory=dict)
    """Started, unfinished requests: ``request_id`` -> tokens generated so far."""
    preempt: bool = False
    """Whether running requests can be stopped and resumed elsewhere (the engine's capability)."""


@dataclass(frozen=True)
class Event:
    """One stage interval of one worker: what the timeline (``metrics.timeline``) records, and
    what every actor hands back to the driver."""

    who: str
    """The row it belongs to: ``"trainer"``, ``"gen-0"``, ``"driver"``."""
    what: str
    """The kind of work: ``generate``, ``train``, ``prepare``, ``weight_push``, ``weight_load``, ``checkpoint``,
    ``eval``, ``idle`` (see ``metrics.timeline.STANDARD_KINDS``)."""
    iteration: int
    """RL iteration the work belongs to (-1 when none, e.g. a warm-up)."""
    version: int
    """Policy version in use (generating with, training from, or pushing)."""
    start: float
    """Wall-clock seconds (``time.time()``)."""
    end: float
    meta: dict[str, Any] = field(default_factory=dict)
    """JSON-able extras: ``{"samples": 8, "tokens": 912, "bytes": 4e6}``."""

    def __post_init__(self) -> None:
        if not self.end >= self.start:
            raise ValueError(f"event {self.who}/{self.what} ends before it starts: start={self.start} end={self.end}")

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class TrainResult:
    """What the trainer returns once an iteration's last group is trained (``TrainerActor.add_groups``)."""

    iteration: int
    """The RL iteration it trained."""
    version: int
    """The policy version it produced (``iteration + 1`` in a run from scratch)."""
    handle: Any
    """The published weights (a ``weights.transfer.WeightHandle``) of ``version``."""
    metrics: dict[str, float] = field(default_factory=dict)
    """``train/...`` and ``time/...`` metrics of the iteration's steps."""


@dataclass(frozen=True)
class Sample:
    """A scored completion: the unit streamed to the trainer (or grouped, for GRPO)."""

    prompt: Prompt
    sample_idx: int
    completion: Completion
    response_text: str
    reward: float
    reward_info: dict[str, Any] = field(default_factory=dict)
    """Why the reward is what it is (``{"error": "..."}`` for a counted zero reward)."""
    iteration: int = 0
    """RL iteration this sample was requested for."""

    @property
    def num_response_tokens(self) -> int:
        """Tokens the policy sampled (a trajectory's environment tokens are not counted)."""
        return self.completion.generated

    @property
    def version(self) -> int:
        """Oldest policy version that contributed tokens to this sample."""
        return self.completion.version_start

    def with_reward(self, reward: float, info: dict[str, Any]) -> "Sample":
        return replace(self, reward=reward, reward_info=info)


@dataclass(frozen=True)
class Group:
    """All ``n`` samples of one prompt: the stream unit for GRPO (advantages need the group)."""

    prompt: Prompt
    samples: tuple[Sample, ...]

    @classmethod
    def of(cls, samples) -> "Group":
        """The group of ``samples`` (all of one prompt, in sample order)."""
        return cls(samples[0].prompt, tuple(samples))

    @property
    def version(self) -> int:
        return min(s.version for s in self.samples)
