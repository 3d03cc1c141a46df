"""Generation engine on transformers' continuous batching (``model.init_continuous_batching``).

The default backend (``generation.engine: transformers``): ``TransformersCBEngine`` keeps the
``GenerationEngine`` contract (``engines/base.py``) around an already loaded causal LM, with
three threads (callers, our drain thread, CB's loop); ``_lock`` guards our structures.

Invariants: admission order is ours (our priority heap hands CB at most ``max_inflight``
requests); weights are copied only while CB's loop is parked between two steps, so no step
straddles an update and every token carries the version that sampled it; prefix sharing is off
unless ``prefix_cache`` (then no request reuses keys written before the last update).
The class docstring has the dataflow; caveats found in transformers 5.23 CB sit beside the lines
they explain. docs/design.md, "Generation", says why.
"""

from __future__ import annotations

import bisect
import secrets
import threading
import time
from dataclasses import replace
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from streamrl.sgs.engines.base import (EngineError, GenerationEngine, QueueBookkeeping, check_arg, check_engine_args,
                                       check_update_shapes, eos_ids)
from streamrl.types import Completion, GenRequest, Partial

_DRAIN_POLL_S = 0.05  # how often the drain thread re-checks the stop flag when idle


class TransformersCBEngine(QueueBookkeeping, GenerationEngine):
    """Continuous-batching engine around an already loaded transformers causal LM.

    Dataflow (three threads; ``_lock`` guards every structure below)::

        caller thread                      drain thread (ours)              CB loop thread (transformers)
        -------------                      -------------------              -----------------------------
        add_request ─► _waiting (heap by priority)
                       │ _admit(): while len(_inflight) < max_inflight
                       └──► manager.add_request ───────────────────────────► input_queue → scheduler
                                                                             step: forward + sample one
                                                                             token per running request
                            manager.get_result(0.05) ◄── output_queue ◄──── finished request
                            → Completion → _done; _admit() refills
        get_completions ◄── _done (Condition; blocks up to timeout)
        update_weights ─► manager.pause(): waits for the CB loop to park between steps,
                          copies tensors in place, logs (time, version), resumes

    * Admission order (LPT). CB's own scheduler is FIFO, so this wrapper holds requests in its
      own heap (``-priority``, arrival) and hands CB at most ``max_inflight`` (default
      ``max_requests_per_batch``) at a time; the largest priority goes first whenever a slot frees.
    * Log-probs are CB's ``log(softmax(processed_scores))[token]``: the fp32 logits after
      temperature and top-p, the same softmax the token is drawn from. Greedy requests get the
      temperature-1 log-prob of the argmax. A sampled EOS is part of ``output_ids`` with its log-prob.
    * Versions. ``version_start``: installed when this wrapper handed the request to CB;
      ``version_end``: installed when CB sampled its last token (CB's finish stamp, looked up in a
      log of install times). Weights are copied only while the loop is parked between steps, so
      no step straddles an update, and the copy records how many tokens each running request
      had: ``token_versions`` gives every token the version that sampled it (partial rollout),
      and ``version_start`` becomes the first token's.
    * Attention. ``attention="varlen"`` (the default) routes CB's CPU attention through
      ``varlen_attention.py`` (each request attends to its own keys); ``"dense"`` keeps
      transformers' packed masked path, whose cost grows with (running requests)^2 x context."""

    _seq_limit = "the KV cache (num_blocks x page_size)"
    supports_preempt = True

    def __init__(
        self,
        model: Any,
        *,
        temperature: float = 1.0,
        top_p: float = 1.0,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        max_batch_tokens: int = 1024,
        max_requests_per_batch: int = 64,
        num_blocks: int = 512,
        page_size: int = 32,
        num_threads: int = 1,
        max_inflight: int | None = None,
        seed: int | None = None,
        instance: str = "",
        initial_version: int = 0,
        attention: str = "varlen",
        prefix_cache: bool = False,
    ) -> None:
        check_arg(attention in ("varlen", "dense"), "attention", attention, "'varlen' or 'dense'")
        max_inflight = check_engine_args(temperature, top_p, max_requests_per_batch, max_inflight,
                                         max_batch_tokens=max_batch_tokens, num_blocks=num_blocks,
                                         num_threads=num_threads)
        check_arg(isinstance(page_size, int) and page_size >= 4, "page_size", page_size, "an int >= 4 (CB minimum)")

        torch.set_num_threads(num_threads)  # process-wide: the CB loop thread uses the same pool
        # The CB manager switches the model's attention implementation and owns the model while it runs.
        if attention == "varlen":
            from streamrl.sgs.engines.varlen_attention import install

            install(model)
        self.model = model
        self.instance = instance
        # A bad token id kills CB's loop thread for every request, so ids are validated against
        # this before submission.
        self._vocab_size = int(model.config.get_text_config().vocab_size)
        eos_list = eos_ids(eos_token_id, self._vocab_size)
        self._eos_ids = frozenset(eos_list)
        self._max_seq_tokens = num_blocks * page_size  # whole-cache capacity: a longer request can never run
        self._max_inflight = max_inflight

        greedy = temperature == 0
        gen_cfg = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else temperature, top_p=None if greedy else top_p,
            top_k=0, eos_token_id=eos_list if eos_list else -1, pad_token_id=pad_token_id,
        )
        # CB's prefix cache (block sharing) would reuse KV blocks computed under old weights: it is on
        # only with prefix_cache, and every weight update makes the blocks before it unmatchable.
        self._prefix_cache = bool(prefix_cache)
        cb_cfg = ContinuousBatchingConfig(
            return_logprobs=True, page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_requests_per_batch, allow_block_sharing=self._prefix_cache, seed=seed,
        )
        self._manager = model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)

        self._init_queues(initial_version)  # _inflight: cb_id -> (req, t_start wall, version at hand-over)
        # CB's cancel_request delivers no output, and a request finishing in the same step can still
        # be delivered: cancelled ids are remembered and their late results dropped.
        self._cancelled_cb_ids: set[str] = set()
        self._boundaries: dict[str, list[tuple[int, int]]] = {}  # cb_id -> (tokens before an update, its version)
        # Versions: (perf_counter at install, version), appended inside the pause.
        self._version_log: list[tuple[float, int]] = [(float("-inf"), initial_version)]
        self._wall_minus_perf = time.time() - time.perf_counter()
        self._merger = None  # models.lora.AdapterMerger, made at the first adapter update

        self._manager.start()  # calls torch.manual_seed (process-wide); sampling uses the global torch RNG
        self._drain_thread = threading.Thread(target=self._drain_loop, name=f"cb-drain-{instance}", daemon=True)
        self._drain_thread.start()

    # ------------------------------------------------------------------ requests

    def _start_locked(self, cb_id: str, req: GenRequest) -> None:
        self._inflight[cb_id] = (req, time.time(), self._version)
        if self._manager.add_request(list(req.prompt_ids), request_id=cb_id, max_new_tokens=req.max_new_tokens) is None:
            raise EngineError(f"CB manager refused request {req.request_id!r}: "
                              f"{self._manager.background_thread_status.can_accept_new_requests()}")

    def _abort_locked(self, cb_id: str) -> None:
        self._boundaries.pop(cb_id, None)
        self._cancelled_cb_ids.add(cb_id)
        self._manager.cancel_request(cb_id)

    # ------------------------------------------------------------------ progress and preemption

    def _scheduler(self):
        """CB's scheduler (None before the loop has built its batch processor)."""
        return getattr(self._manager.batch_processor, "scheduler", None)

    def _active_states(self) -> dict:
        """CB's running request states by CB id."""
        return getattr(self._scheduler(), "active_requests", None) or {}

    def progress(self) -> dict[str, int]:
        """Tokens generated so far by each request CB is running (read without stopping the loop:
        a count may lag by the step in progress). Requests handed to CB but not yet scheduled
        count 0."""
        active = self._active_states()
        with self._lock:
            ids = dict(self._engine_id_of)
        out = {}
        for rid, cb_id in ids.items():
            state = active.get(cb_id)
            out[rid] = len(state.generated_tokens) if state is not None else 0
        return out

    def preempt(self, request_id: str, running: bool = True) -> Partial | None:
        """Stop ``request_id`` and return its generated prefix (see ``GenerationEngine.preempt``).

        A running request is read and cancelled while CB's loop is parked between two steps
        (``manager.pause``), so its tokens and log-probs are consistent and it generates nothing
        more; a result CB still delivers for it (finished in the same step) is dropped like a
        cancelled one. A request CB has already finished (its state gone from the scheduler,
        its result not yet drained) is left alone: None, and it is returned as usual."""
        with self._lock:
            self._raise_if_unusable()
            queued = self._pop_waiting_locked(request_id)
            if queued is not None:
                return Partial(queued)
            if not running or request_id not in self._engine_id_of:
                return None
        with self._manager.pause():
            with self._lock:
                cb_id = self._engine_id_of.get(request_id)
                if cb_id is None:
                    return None  # finished (and drained) while we waited for the pause
                req, t_start, v_start = self._inflight[cb_id]
                state = self._active_states().get(cb_id)
                if state is None:
                    if any(st.request_id == cb_id for st in self._pending_states()):
                        tokens, logprobs = (), ()  # handed to CB, not scheduled yet
                    else:
                        return None  # finished: its result is on the way
                else:
                    tokens, logprobs = tuple(state.generated_tokens), tuple(state.logprobs)
                    done = (tokens and tokens[-1] in self._eos_ids) or len(tokens) >= req.max_new_tokens
                    if done or len(logprobs) != len(tokens):
                        return None
                versions = self._token_versions(cb_id, v_start, len(tokens))
                self._stop_inflight_locked(cb_id, "gen/requests_preempted")
        if not tokens:
            return Partial(req)
        return Partial(req, tokens, logprobs, versions[0] if versions else v_start, t_start, versions)

    def _pending_states(self) -> list:
        """CB's request states that are queued for it but not running (input queue, waiting)."""
        waiting = list((getattr(self._scheduler(), "waiting_requests", None) or {}).values())
        return waiting + list(self._manager.input_queue.queue)

    # ------------------------------------------------------------------ results

    def _drain_loop(self) -> None:
        """Move finished CB outputs into ``_done`` and refill free slots; exits on shutdown or loop death."""
        while not self._closed:
            out = self._manager.get_result(timeout=_DRAIN_POLL_S)
            if out is None:
                if not self._manager.is_running() and not self._closed:
                    fatal = self._manager.background_thread_status.fatal_error
                    self._fail(EngineError(f"continuous batching loop stopped unexpectedly (fatal error: {fatal!r})"))
                    return
                continue
            if not out.is_finished():
                continue  # streaming partials are not requested; ignore defensively
            with self._done_cv:
                if out.request_id in self._cancelled_cb_ids:
                    self._cancelled_cb_ids.discard(out.request_id)
                    continue
                if out.request_id not in self._inflight:
                    self._error = EngineError(f"engine returned unknown request {out.request_id!r}")
                    self._done_cv.notify_all()
                    return
                req, t_start, v_start = self._remove_inflight_locked(out.request_id)
                if out.error is not None:
                    self._error = EngineError(f"request {req.request_id!r} failed in the CB loop: {out.error}")
                    self._done_cv.notify_all()
                    return
                try:
                    self._done.append(self._to_completion(req, out, t_start, v_start,
                                                          self._token_versions(out.request_id, v_start, None)))
                except EngineError as exc:  # a malformed result: surface it, never drop it silently
                    self._error = exc
                    self._done_cv.notify_all()
                    return
                self._admit_locked()
                self._done_cv.notify_all()

    def _to_completion(self, req: GenRequest, out: Any, t_start: float, v_start: int,
                       boundaries: list[tuple[int, int]] | tuple = ()) -> Completion:
        tokens = tuple(int(t) for t in out.generated_tokens)
        logprobs = tuple(float(x) for x in out.logprobs)
        t_end_perf = out.lifespan[1]
        finish = "stop" if tokens and tokens[-1] in self._eos_ids else "length"
        c = self._completion(req, tokens, logprobs, finish, v_start, self._version_at(t_end_perf),
                             t_start, t_end_perf + self._wall_minus_perf)
        if boundaries:
            versions = _spread(v_start, boundaries, len(tokens))
            c = replace(c, token_versions=versions, version_start=versions[0] if versions else v_start)
        return c

    def _token_versions(self, cb_id: str, v_start: int, n: int | None):
        """Forget ``cb_id``'s update boundaries; with ``n``: its first ``n`` tokens' versions, else
        the boundaries themselves (the caller spreads them over the final token count)."""
        bounds = self._boundaries.pop(cb_id, [])
        if n is None:
            return bounds
        return _spread(v_start, bounds, n) if bounds else ()

    def _version_at(self, t_perf: float) -> int:
        i = bisect.bisect_right(self._version_log, (t_perf, float("inf"))) - 1
        return self._version_log[i][1]

    # ------------------------------------------------------------------ weights

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        self._check_version(version)
        targets = _match_state_dict(self.model, state_dict)

        def write():
            for name, dst in targets.items():
                dst.copy_(state_dict[name])

        self._install(version, write)

    def update_adapter(self, adapter: dict[str, torch.Tensor], scaling: float, version: int) -> None:
        from streamrl.models.lora import AdapterMerger

        self._check_version(version)
        if self._merger is None:
            self._merger = AdapterMerger(self.model, scaling)
        targets = self._merger.check(adapter)
        self._install(version, lambda: self._merger.merge(adapter, targets))

    def _install(self, version: int, write) -> None:
        """Run ``write`` (it changes the weights in place) with the loop parked between two steps,
        and record ``version`` for every request in flight."""
        with self._lock:
            self._raise_if_unusable()
        t0 = time.perf_counter()
        with self._manager.pause():  # returns once the loop is parked between two steps: waits at most one step
            t1 = time.perf_counter()
            # Under _lock: a request admitted during the copy is stamped with the new version.
            with self._lock, torch.no_grad():
                write()
                if self._prefix_cache:
                    self._forget_prefixes()
                active = self._active_states()
                for cb_id in self._inflight:  # tokens sampled so far keep their version, the rest get this one
                    state = active.get(cb_id)
                    self._boundaries.setdefault(cb_id, []).append(
                        (len(state.generated_tokens) if state is not None else 0, version))
                self._version = version
                self._version_log.append((time.perf_counter(), version))
        t2 = time.perf_counter()
        with self._lock:
            self._stats["gen/weight_updates"] += 1
            self._stats["gen/pause_wait_s"] += t1 - t0
            self._stats["gen/weight_update_s"] += t2 - t0

    def _forget_prefixes(self) -> None:
        """Make every KV block written so far unmatchable by later requests (the loop is parked).

        Unreferenced cached blocks go back to the pool; a block a running request still holds gets
        a fresh random hash: its request keeps it (partial rollout keeps a running request's keys),
        and the blocks it completes later chain from that hash, so no request admitted after this
        update reuses keys computed under the weights before it."""
        processor = self._manager.batch_processor
        if processor is None:
            return
        processor.cache.evict_cached_blocks()
        for allocator in processor.cache.cache_allocators.values():
            ledger = allocator.ledger
            for block, old in list(ledger.block_to_hash.items()):
                del ledger.hash_to_block[old]
                new = secrets.randbits(64)
                ledger.hash_to_block[new], ledger.block_to_hash[block] = block, new

    def stall(self) -> None:
        """Park the CB loop between two steps and never resume it (fault injection)."""
        self._stall = self._manager.pause()
        self._stall.__enter__()

    def slow_down(self, seconds: float) -> None:
        """Park the CB loop between two steps for ``seconds`` (fault injection: a straggler)."""
        def park():
            with self._manager.pause():
                time.sleep(seconds)

        threading.Thread(target=park, name=f"cb-slow-{self.instance}", daemon=True).start()

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        if not self._close():
            return
        stalled = getattr(self, "_stall", None)
        if stalled is not None:  # fault injection held the loop parked: let it go so it can stop
            self._stall = None
            stalled.__exit__(None, None, None)
        self._drain_thread.join()
        if self._manager.is_running():
            self._manager.stop(block=True, timeout=30, hard_stop=True)  # hard: fail (drop) running requests now


def _spread(v_start: int, boundaries: list[tuple[int, int]], n: int) -> tuple[int, ...]:
    """Per-token versions of ``n`` tokens started under ``v_start``: each ``(k, v)`` boundary gives
    tokens ``k`` and later version ``v``."""
    versions = [v_start] * n
    for k, v in boundaries:
        versions[k:] = [v] * (n - k) if k < n else []
    return tuple(versions)


def _match_state_dict(model: Any, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map each incoming tensor to the model tensor it overwrites, checking names and shapes.

    Every model tensor must be covered, either by name or by sharing storage with a covered
    one (tied embeddings: ``lm_head.weight`` may be omitted when ``embed_tokens`` is sent)."""
    own = model.state_dict()
    check_update_shapes(state_dict, {k: tuple(t.shape) for k, t in own.items()})
    covered = {own[k].data_ptr() for k in state_dict}
    missing = sorted(k for k, t in own.items() if k not in state_dict and t.data_ptr() not in covered)
    if missing:
        raise KeyError(f"update_weights: {len(missing)} model tensors not provided, e.g. {missing[:5]}")
    return {k: own[k] for k in state_dict}
