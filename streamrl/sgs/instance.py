"""A generation instance: one Ray actor around one engine (one model replica).

The Stream Generation Service (``sgs/service.py``) submits requests to it, polls it for finished
completions (the stream) and installs new weights through it (``weights.engine``).

Invariants: the actor is threaded (``max_concurrency``), so ``submit`` and ``update`` run while a
``poll`` blocks, and the engine is thread-safe; a weight update pauses the engine only for the
copy, and in-flight requests keep their KV cache and continue with the new weights; with
``hold_back``, a request is either taken back by the SGS or handed to the engine, never both.
``GenerationInstance`` has the call flow and the hold-back queue.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time

import ray

from streamrl.config import Config
from streamrl.memory import release_free_memory
from streamrl.types import Event, Partial, Progress


@ray.remote(max_concurrency=4)
class GenerationInstance:
    """One engine behind a threaded Ray actor::

        service --submit(requests)--> instance.engine admission queue
        service --poll(timeout)-----> blocks in the actor until >= 1 completion (or timeout), returns
                                      a batch of finished Completions: this is the stream
        service --update(handle)----> fetch the flat weight buffer (zero-copy from the object store;
                                      a delta when this instance holds the base version), pause the
                                      engine, copy in place, resume: in-flight requests keep their KV
                                      cache and continue with the new weights; a relay re-publishes
                                      its copy for the instances it feeds (``weights.engine``)

    Hold-back queue (``hold_back=True``, used when the SGS rebalances): the instance keeps
    submitted requests in its own priority heap (the engine's order: larger ``priority`` first,
    ties FIFO) and hands the engine only enough to fill its batch plus ``slack`` waiting ones,
    topping up before and after every ``poll``. Requests still in this heap have certainly not
    started, so ``take`` can give them back to the SGS to move elsewhere (``preempt``): they are
    removed here under the lock, atomically with respect to the top-up, so a request is either
    taken or handed to the engine, never both."""

    def __init__(self, name: str, cfg: Config, policy_path: str, threads: int, seed: int,
                 hold_back: bool = False, engine_overrides: dict | None = None) -> None:
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from streamrl.memory import watch_private_memory
        from streamrl.sgs.engines.build import engine_kwargs

        watch_private_memory()
        from streamrl.models.tiny import load_policy
        from streamrl.sgs.engines.base import make_engine

        from streamrl.models.shipping import materialize_policy

        self.name = name
        self.cfg_lora = cfg.trainer.lora
        policy_path = materialize_policy(policy_path)  # a package the driver shipped: written on this node
        if cfg.generation.engine == "vllm":  # vLLM loads the checkpoint directory itself
            from transformers import PreTrainedTokenizerFast

            model, tokenizer = policy_path, PreTrainedTokenizerFast.from_pretrained(policy_path)
            # per-step outputs only where they are used: progress and preemption (the SGS may move
            # requests), per-token versions (partial rollout runs requests across weight updates)
            track = hold_back or cfg.generation.partial_rollout
            engine_overrides = {"track_progress": track, **cfg.generation.vllm, **(engine_overrides or {})}
        else:
            model, tokenizer = load_policy(policy_path)
            model = model.eval()
        kwargs = {**engine_kwargs(cfg, tokenizer, threads, name, seed), **(engine_overrides or {})}
        self.engine = make_engine(cfg.generation.engine, model, **kwargs)
        from streamrl.weights.engine import WeightReceiver

        self.receiver = WeightReceiver(name, keep=cfg.weights.delta, bucket_mb=cfg.weights.bucket_mb)
        self.events: list[Event] = []
        self.hold_back = hold_back
        batch = int(self.engine.max_inflight or cfg.generation.max_requests_per_batch)
        self._engine_target = batch + max(2, batch // 2)  # running + waiting requests the engine may hold
        self._lock = threading.Lock()
        self._held: list[tuple[float, int, str]] = []  # (-priority, seq, request_id) heap
        self._held_reqs: dict = {}  # request_id -> GenRequest, while held here
        self._seq = itertools.count()
        self._tokens_out = 0  # tokens of every completion handed out: with progress(), the liveness counter

    def ready(self) -> str:
        return self.name

    def pid(self) -> int:
        """This actor's process id (fault benchmarks and tests kill or stop it from outside)."""
        import os

        return os.getpid()

    def submit(self, requests) -> int:
        if not self.hold_back:
            for r in requests:
                self.engine.add_request(r)
            return len(requests)
        with self._lock:
            for r in requests:
                if r.request_id in self._held_reqs:
                    raise ValueError(f"request_id {r.request_id!r} is already held by instance {self.name!r}")
                self._held_reqs[r.request_id] = r
                heapq.heappush(self._held, (-float(r.priority), next(self._seq), r.request_id))
        self._top_up()
        return len(requests)

    def _top_up(self) -> None:
        """Hand the engine the highest-priority held requests until it holds ``_engine_target``."""
        if not self.hold_back:
            return
        with self._lock:
            room = self._engine_target - self.engine.num_pending()
            while room > 0 and self._held:
                _, _, rid = heapq.heappop(self._held)
                req = self._held_reqs.pop(rid, None)
                if req is None:
                    continue  # taken or cancelled while held (stale heap entry)
                self.engine.add_request(req)
                room -= 1

    def held_ids(self) -> list[str]:
        """Requests held here, not yet handed to the engine (so not started): the movable ones."""
        with self._lock:
            return list(self._held_reqs)

    def progress(self) -> Progress:
        """Where each unfinished request stands, for runtime rebalancing (see ``Progress``)."""
        with self._lock:
            held = tuple(self._held_reqs)
        return Progress(held=held, waiting=tuple(self.engine.waiting_ids()), running=self.engine.progress(),
                        preempt=self.engine.supports_preempt)

    def preempt(self, request_ids, running: bool = True) -> list:
        """Stop these requests wherever they are here and return a ``Partial`` for each one that
        was stopped (held or queued: empty outputs; running, if ``running``: its prefix). One
        that already finished, or is finishing, or runs while ``running`` is False, is left to
        complete here and is not in the list."""
        out = []
        for rid in request_ids:
            with self._lock:
                req = self._held_reqs.pop(rid, None)
            if req is not None:
                out.append(Partial(req))
                continue
            if self.engine.supports_preempt:
                part = self.engine.preempt(rid, running)
                if part is not None:
                    out.append(part)
        self._top_up()
        return out

    def poll(self, timeout: float = 0.5, max_items: int | None = None):
        self._top_up()
        out = self.engine.get_completions(timeout=timeout, max_items=max_items)
        self._tokens_out += sum(len(c.output_ids) for c in out)
        self._top_up()
        return out

    def liveness(self) -> int:
        """Tokens of finished requests plus the engine's heartbeat (running tokens, or steps): it
        changes while the engine steps, whatever the engine tracks. A process that answers calls
        while this stands still with work queued is hung."""
        return self._tokens_out + self.engine.heartbeat()

    def inject_fault(self, kind: str) -> None:
        """Fault injection (tests, ``bench faults``): ``hang`` stops the engine stepping while
        the actor keeps answering; ``slow:S`` stops it for S seconds (a straggler)."""
        if kind == "hang":
            self.engine.stall()
        elif kind.startswith("slow:"):
            self.engine.slow_down(float(kind.split(":", 1)[1]))
        else:
            raise ValueError(f"inject_fault: unknown kind {kind!r}; known: 'hang', 'slow:SECONDS'")

    def poll_with_progress(self, timeout: float = 0.5) -> tuple[list, Progress]:
        """``poll`` and then ``progress`` in one call: a rebalancing SGS reads where requests
        stand from its polls instead of sending a call of its own (each Ray call costs the
        engine's process CPU time)."""
        out = self.poll(timeout)
        return out, self.progress()

    def update(self, handle, version: int, relay: bool = False) -> dict:
        """Install the weights behind ``handle`` (a ``WeightHandle``, or a relay's result that
        Ray resolved: ``weights.engine``) as ``version``. The fetch runs while the engine keeps
        generating; only the copy into the parameters pauses it. With ``relay``, the result
        carries a handle of this instance's own copy for the instances it feeds."""
        from streamrl.weights.engine import resolve
        from streamrl.models.lora import install
        from streamrl.weights.flat import unflatten

        handle = resolve(handle)
        t0 = time.time()
        fw, rec = self.receiver.receive(handle)
        t1 = time.time()
        install(self.engine, unflatten(fw), version, self.cfg_lora)  # with LoRA: merged into the base weights
        t2 = time.time()
        release_free_memory()  # once per version, the engine running again (streamrl.memory)
        self.events.append(Event(self.name, "weight_fetch", -1, version, rec.start,
                                 rec.start + rec.seconds + rec.apply_s, rec.as_meta()))
        self.events.append(Event(self.name, "weight_load", -1, version, t1, t2))
        out = {"fetch_s": t1 - t0, "load_s": t2 - t1, "bytes": rec.bytes, "kind": rec.kind, "link": rec.link,
               "src": rec.src, "start": t0, "end": t2}
        if relay:
            out["handle"] = self.receiver.relay(handle, fw)
        return out

    def location(self):
        """Where this instance runs (``weights.tree.Location``: node label and site)."""
        return self.receiver.location

    def num_pending(self) -> int:
        with self._lock:
            return self.engine.num_pending() + len(self._held_reqs)

    def version(self) -> int:
        return self.engine.version

    def peak_memory_mb(self) -> dict[str, float]:
        from streamrl.memory import peaks_mb

        return peaks_mb()

    def cpu_seconds(self) -> float:
        """CPU time this process has used (all threads): busy time that other processes cannot inflate."""
        return time.process_time()

    def stats(self) -> dict:
        return self.engine.stats()

    def drain_events(self) -> list[Event]:
        out, self.events = self.events, []
        return out

    def shutdown(self) -> None:
        self.engine.shutdown()

