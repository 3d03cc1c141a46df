"""Generation engine on transformers' continuous batching (``model.init_continuous_batching``).

Dataflow (three threads; ``_lock`` guards every structure below):

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

* Admission order (LPT). CB's own scheduler is FIFO and has no priority. So this wrapper holds
  requests in its own heap (``-priority``, arrival sequence) and hands CB at most
  ``max_inflight`` (default ``max_requests_per_batch``) at a time; the largest priority goes
  first whenever a slot frees. CB's FIFO keeps our order among those it cannot start yet.
* Log-probs. CB with ``return_logprobs=True`` returns ``log(softmax(processed_scores))[token]``
  for each sampled token, where ``processed_scores`` are the fp32 logits after the generation
  config's warpers (temperature, then top-p); the token is drawn with ``torch.multinomial`` from
  that same softmax. So they are exactly the log-probs under the distribution sampled from
  (top-p renormalised over the nucleus). With ``temperature=0`` (greedy) they are the
  temperature-1 log-probs of the argmax token. The EOS token, when sampled, is part of
  ``output_ids`` and has a log-prob like any other token.
* Versions. ``version_start`` is the version installed when this wrapper handed the request to
  CB (``t_start``); ``version_end`` the version installed when CB sampled its last token (CB's
  own finish stamp, taken on the loop thread, looked up in a log of install times). Weight copies
  only happen while the loop is parked between steps, so no step straddles an update.
  ``version_start`` can be one lower than strictly necessary for a request handed over in the
  instant before an update but not yet scheduled: this overstates staleness, never understates.
* Prefix sharing is disabled: CB's prefix cache keeps KV blocks computed under old weights and
  would reuse them for new requests after an update, breaking log-prob parity.

Caveats found in transformers 5.23 CB:
* ``cancel_request`` delivers no output; a request finishing in the same step can still be
  delivered, so cancelled ids are remembered and their late results dropped.
* Starting the loop calls ``torch.manual_seed`` (process-wide) with ``seed`` or a random draw;
  sampling uses the global torch RNG, shared with any other thread in the process.
* The manager switches the model's attention implementation (eager -> ``paged|eager``) and
  restores it on ``stop``; while the engine runs it owns the model object (eval mode).
* A bad token id raises inside the loop thread and kills it for every request; ids are
  validated here against the vocabulary before submission.
* Cost on CPU: without flash attention, CB packs all running requests into one sequence and
  runs sdpa with a dense block-diagonal mask of shape [new tokens, all cached tokens], so one
  decode step costs ~ (running requests)^2 x length in attention (64 requests of context 230:
  411 ms per step on the ~1M-param policy, 1 thread). ``attention="varlen"`` (the default)
  routes this engine's CB attention through ``varlen_attention.py``, which attends each request
  to its own keys only: 36 ms for the same step, equal at short contexts, same tokens and
  log-probs within ~1e-5. ``attention="dense"`` keeps transformers' own path.
* ``pause()`` parks the loop only between steps (``pause_and_wait`` at the top of the next
  scheduling round), so ``update_weights`` waits for at most one step; requests added
  meanwhile queue and are scheduled after the resume.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import threading
import time
from collections import deque
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from streamrl.sgs.engines.base import EngineError, GenerationEngine, QueueBookkeeping
from streamrl.types import Completion, GenRequest, Partial

_DRAIN_POLL_S = 0.05  # how often the drain thread re-checks the stop flag when idle


class TransformersCBEngine(QueueBookkeeping, GenerationEngine):
    """Continuous-batching engine around an already loaded transformers causal LM."""

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
    ) -> None:
        _check(attention in ("varlen", "dense"), "attention", attention, "'varlen' or 'dense'")
        _check(temperature >= 0, "temperature", temperature, ">= 0 (0 = greedy)")
        _check(0 < top_p <= 1, "top_p", top_p, "in (0, 1]")
        for name, value in [("max_batch_tokens", max_batch_tokens), ("max_requests_per_batch", max_requests_per_batch),
                            ("num_blocks", num_blocks), ("num_threads", num_threads)]:
            _check(isinstance(value, int) and value >= 1, name, value, "an int >= 1")
        _check(isinstance(page_size, int) and page_size >= 4, "page_size", page_size, "an int >= 4 (CB minimum)")
        max_inflight = max_requests_per_batch if max_inflight is None else max_inflight
        _check(isinstance(max_inflight, int) and max_inflight >= 1, "max_inflight", max_inflight, "an int >= 1")

        torch.set_num_threads(num_threads)  # process-wide: the CB loop thread uses the same pool
        if attention == "varlen":
            from streamrl.sgs.engines.varlen_attention import install

            install(model)
        self.model = model
        self.instance = instance
        self._vocab_size = int(model.config.get_text_config().vocab_size)
        eos_list = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        for e in eos_list:
            _check(0 <= e < self._vocab_size, "eos_token_id", eos_token_id, f"within the vocabulary [0, {self._vocab_size})")
        self._eos_ids = frozenset(eos_list)
        self._max_seq_tokens = num_blocks * page_size  # whole-cache capacity: a longer request can never run
        self._max_inflight = max_inflight
        self.settings = dict(temperature=temperature, top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                             max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_requests_per_batch,
                             num_blocks=num_blocks, page_size=page_size, num_threads=num_threads,
                             max_inflight=max_inflight, seed=seed, attention=attention)

        greedy = temperature == 0
        gen_cfg = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else temperature, top_p=None if greedy else top_p,
            top_k=0, eos_token_id=eos_list if eos_list else -1, pad_token_id=pad_token_id,
        )
        cb_cfg = ContinuousBatchingConfig(
            return_logprobs=True, page_size=page_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_requests_per_batch, allow_block_sharing=False, seed=seed,
        )
        self._manager = model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)

        self._lock = threading.Lock()
        self._done_cv = threading.Condition(self._lock)
        self._seq = itertools.count()
        self._waiting: list[tuple[float, int, float, GenRequest]] = []  # (-priority, seq, t_added, req) heap
        self._waiting_ids: dict[str, int] = {}  # request_id -> seq of its live heap entry
        self._inflight: dict[str, tuple[GenRequest, float, int, float]] = {}  # cb_id -> (req, t_wall, version, t_perf)
        self._cb_id_of: dict[str, str] = {}  # request_id -> cb_id, while in flight
        self._cancelled_cb_ids: set[str] = set()  # cancelled in flight: drop a late result
        self._done: deque[Completion] = deque()
        self._error: EngineError | None = None
        self._closed = False
        # Versions: (perf_counter at install, version), appended inside the pause.
        self._version = initial_version
        self._version_log: list[tuple[float, int]] = [(float("-inf"), initial_version)]
        self._wall_minus_perf = time.time() - time.perf_counter()
        self._stats = dict.fromkeys(
            ["gen/tokens", "gen/requests_finished", "gen/requests_cancelled", "gen/busy_s", "gen/queue_wait_s",
             "gen/weight_updates", "gen/weight_update_s", "gen/pause_wait_s"], 0.0)
        self._busy_since: float | None = None

        self._manager.start()
        self._drain_thread = threading.Thread(target=self._drain_loop, name=f"cb-drain-{instance}", daemon=True)
        self._drain_thread.start()

    # ------------------------------------------------------------------ requests

    def add_request(self, req: GenRequest) -> None:
        prompt = req.prompt_ids
        if not prompt:
            raise ValueError(f"request {req.request_id!r}: empty prompt_ids")
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < self._vocab_size)]
        if bad:
            raise ValueError(f"request {req.request_id!r}: token ids {bad[:5]} outside the vocabulary [0, {self._vocab_size})")
        if not (isinstance(req.max_new_tokens, int) and req.max_new_tokens >= 1):
            raise ValueError(f"request {req.request_id!r}: max_new_tokens={req.max_new_tokens!r} must be an int >= 1")
        if len(prompt) + req.max_new_tokens > self._max_seq_tokens:
            raise ValueError(f"request {req.request_id!r}: prompt ({len(prompt)}) + max_new_tokens ({req.max_new_tokens})"
                             f" exceeds the KV cache (num_blocks*page_size = {self._max_seq_tokens} tokens)")
        with self._lock:
            self._raise_if_unusable()
            if req.request_id in self._waiting_ids or req.request_id in self._cb_id_of:
                raise ValueError(f"request_id {req.request_id!r} is already pending in this engine")
            seq = next(self._seq)
            heapq.heappush(self._waiting, (-float(req.priority), seq, time.perf_counter(), req))
            self._waiting_ids[req.request_id] = seq
            self._admit_locked()

    def _admit_locked(self) -> None:
        """Hand CB the highest-priority waiting requests while it has free slots."""
        while self._waiting and len(self._inflight) < self._max_inflight:
            _, seq, t_added, req = heapq.heappop(self._waiting)
            if self._waiting_ids.get(req.request_id) != seq:
                continue  # cancelled while waiting (stale heap entry)
            del self._waiting_ids[req.request_id]
            cb_id = f"{req.request_id}#{seq}"  # unique even if a cancelled request_id is reused
            now_perf = time.perf_counter()
            self._stats["gen/queue_wait_s"] += now_perf - t_added
            if not self._inflight:
                self._busy_since = now_perf
            self._inflight[cb_id] = (req, time.time(), self._version, now_perf)
            self._cb_id_of[req.request_id] = cb_id
            if self._manager.add_request(list(req.prompt_ids), request_id=cb_id, max_new_tokens=req.max_new_tokens) is None:
                raise EngineError(f"CB manager refused request {req.request_id!r}: "
                                  f"{self._manager.background_thread_status.can_accept_new_requests()}")

    def _remove_inflight_locked(self, cb_id: str) -> tuple[GenRequest, float, int, float]:
        entry = self._inflight.pop(cb_id)
        del self._cb_id_of[entry[0].request_id]
        if not self._inflight and self._busy_since is not None:
            self._stats["gen/busy_s"] += time.perf_counter() - self._busy_since
            self._busy_since = None
        return entry

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            if request_id in self._waiting_ids:
                del self._waiting_ids[request_id]
                self._stats["gen/requests_cancelled"] += 1
                return True
            cb_id = self._cb_id_of.get(request_id)
            if cb_id is None:
                return False
            self._remove_inflight_locked(cb_id)
            self._cancelled_cb_ids.add(cb_id)
            self._manager.cancel_request(cb_id)
            self._stats["gen/requests_cancelled"] += 1
            self._admit_locked()
            return True

    # ------------------------------------------------------------------ progress and preemption
    supports_preempt = True

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
            ids = dict(self._cb_id_of)
        out = {}
        for rid, cb_id in ids.items():
            state = active.get(cb_id)
            out[rid] = len(state.generated_tokens) if state is not None else 0
        return out

    def waiting_ids(self) -> list[str]:
        with self._lock:
            return list(self._waiting_ids)

    def preempt(self, request_id: str, running: bool = True) -> Partial | None:
        """Stop ``request_id`` and return its generated prefix (see ``GenerationEngine.preempt``).

        A running request is read and cancelled while CB's loop is parked between two steps
        (``manager.pause``), so its tokens and log-probs are consistent and it generates nothing
        more; a result CB still delivers for it (finished in the same step) is dropped like a
        cancelled one. A request CB has already finished (its state gone from the scheduler,
        its result not yet drained) is left alone: None, and it is returned as usual."""
        with self._lock:
            self._raise_if_unusable()
            if request_id in self._waiting_ids:
                seq = self._waiting_ids.pop(request_id)
                req = next(r for _, s, _, r in self._waiting if s == seq)
                return Partial(req)
            if not running or request_id not in self._cb_id_of:
                return None
        with self._manager.pause():
            with self._lock:
                cb_id = self._cb_id_of.get(request_id)
                if cb_id is None:
                    return None  # finished (and drained) while we waited for the pause
                req, t_start, v_start, _ = self._inflight[cb_id]
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
                self._remove_inflight_locked(cb_id)
                self._cancelled_cb_ids.add(cb_id)
                self._manager.cancel_request(cb_id)
                self._stats["gen/requests_preempted"] = self._stats.get("gen/requests_preempted", 0.0) + 1
                self._admit_locked()
        if not tokens:
            return Partial(req)
        return Partial(req, tokens, logprobs, v_start, t_start)

    def _pending_states(self) -> list:
        """CB's request states that are queued for it but not running (input queue, waiting)."""
        waiting = list((getattr(self._scheduler(), "waiting_requests", None) or {}).values())
        return waiting + list(self._manager.input_queue.queue)

    # ------------------------------------------------------------------ results

    def get_completions(self, timeout: float | None = None, max_items: int | None = None) -> list[Completion]:
        if max_items is not None and max_items < 1:
            raise ValueError(f"max_items={max_items!r} must be >= 1 or None")
        with self._done_cv:
            self._done_cv.wait_for(
                lambda: self._done or self._error is not None or self._closed
                or not (self._waiting_ids or self._inflight), timeout=timeout)
            if self._error is not None and not self._done:
                raise self._error
            n = len(self._done) if max_items is None else min(max_items, len(self._done))
            return [self._done.popleft() for _ in range(n)]

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
                req, t_start, v_start, _ = self._remove_inflight_locked(out.request_id)
                if out.error is not None:
                    self._error = EngineError(f"request {req.request_id!r} failed in the CB loop: {out.error}")
                    self._done_cv.notify_all()
                    return
                try:
                    self._done.append(self._to_completion(req, out, t_start, v_start))
                except EngineError as exc:  # a malformed result: surface it, never drop it silently
                    self._error = exc
                    self._done_cv.notify_all()
                    return
                self._admit_locked()
                self._done_cv.notify_all()

    def _to_completion(self, req: GenRequest, out: Any, t_start: float, v_start: int) -> Completion:
        tokens = tuple(int(t) for t in out.generated_tokens)
        logprobs = tuple(float(x) for x in out.logprobs)
        if len(tokens) != len(logprobs) or not tokens:
            raise EngineError(f"request {req.request_id!r}: {len(tokens)} tokens but {len(logprobs)} logprobs")
        t_end_perf = out.lifespan[1]
        finish = "stop" if tokens[-1] in self._eos_ids else "length"
        if finish == "length" and len(tokens) != req.max_new_tokens:
            raise EngineError(f"request {req.request_id!r}: stopped at {len(tokens)} tokens without EOS "
                              f"(max_new_tokens={req.max_new_tokens})")
        self._stats["gen/tokens"] += len(tokens)
        self._stats["gen/requests_finished"] += 1
        return Completion(
            request_id=req.request_id, prompt_ids=tuple(req.prompt_ids), output_ids=tokens, logprobs=logprobs,
            finish_reason=finish, version_start=v_start, version_end=self._version_at(t_end_perf),
            t_start=t_start, t_end=t_end_perf + self._wall_minus_perf, instance=self.instance,
        )

    def _version_at(self, t_perf: float) -> int:
        i = bisect.bisect_right(self._version_log, (t_perf, float("inf"))) - 1
        return self._version_log[i][1]

    def _fail(self, error: EngineError) -> None:
        with self._done_cv:
            self._error = error
            self._done_cv.notify_all()

    def _raise_if_unusable(self) -> None:
        if self._closed:
            raise EngineError(f"engine {self.instance!r} is shut down")
        if self._error is not None:
            raise self._error

    # ------------------------------------------------------------------ weights

    def update_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        if version < self._version:
            raise ValueError(f"update_weights: version {version} is older than the installed {self._version}")
        targets = _match_state_dict(self.model, state_dict)
        with self._lock:
            self._raise_if_unusable()
        t0 = time.perf_counter()
        with self._manager.pause():  # returns once the loop is parked between two steps
            t1 = time.perf_counter()
            # Under _lock: a request admitted during the copy is stamped with the new version.
            with self._lock, torch.no_grad():
                for name, dst in targets.items():
                    dst.copy_(state_dict[name])
                self._version = version
                self._version_log.append((time.perf_counter(), version))
        t2 = time.perf_counter()
        with self._lock:
            self._stats["gen/weight_updates"] += 1
            self._stats["gen/pause_wait_s"] += t1 - t0
            self._stats["gen/weight_update_s"] += t2 - t0

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        with self._done_cv:
            if self._closed:
                return
            self._closed = True
            self._waiting.clear()
            self._waiting_ids.clear()
            self._done_cv.notify_all()
        self._drain_thread.join()
        if self._manager.is_running():
            self._manager.stop(block=True, timeout=30, hard_stop=True)  # hard: fail (drop) running requests now


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: expected {expected}")


def _match_state_dict(model: Any, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map each incoming tensor to the model tensor it overwrites, checking names and shapes.

    Every model tensor must be covered, either by name or by sharing storage with a covered
    one (tied embeddings: ``lm_head.weight`` may be omitted when ``embed_tokens`` is sent)."""
    own = model.state_dict()
    unknown = sorted(set(state_dict) - set(own))
    if unknown:
        raise KeyError(f"update_weights: {len(unknown)} unknown tensor names, e.g. {unknown[:5]}")
    bad = [(k, tuple(v.shape), tuple(own[k].shape)) for k, v in state_dict.items() if v.shape != own[k].shape]
    if bad:
        raise ValueError(f"update_weights: shape mismatch (name, got, expected): {bad[:5]}")
    covered = {own[k].data_ptr() for k in state_dict}
    missing = sorted(k for k, t in own.items() if k not in state_dict and t.data_ptr() not in covered)
    if missing:
        raise KeyError(f"update_weights: {len(missing)} model tensors not provided, e.g. {missing[:5]}")
    return {k: own[k] for k in state_dict}
