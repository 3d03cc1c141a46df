"""Generation engine behaviour on a random tiny Qwen2 (token ids only, no tokenizer).

EOS is unreachable unless a test sets it, so ``max_new_tokens`` alone makes a request short or
long. Each test asserts something that breaks if the engine's contract breaks: finish-order
streaming, LPT admission, log-prob parity with a plain forward pass, weight updates (also mid-
flight, visible in the versions), cancellation.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from streamrl.sgs.engines.base import EngineError, GenerationEngine, make_engine
from streamrl.types import Completion, GenRequest

transformers = pytest.importorskip("transformers")

VOCAB = 64
LONG = 300  # tokens: ~1 s on the tiny model, far longer than a short request
SHORT = 4


def tiny_qwen2(seed: int = 0, hidden: int = 64, layers: int = 2, vocab: int = VOCAB):
    """A random tiny Qwen2 causal LM (fp32, sdpa attention), deterministic in ``seed``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=4096)
    return Qwen2ForCausalLM(cfg).eval()


def clone_with(model, state_dict):
    """A separate copy of ``model``'s architecture holding ``state_dict``, for reference forwards."""
    ref = type(model)(model.config).eval()
    ref.load_state_dict(state_dict)
    ref.set_attn_implementation("sdpa")
    return ref


def perturbed(state_dict, scale: float = 0.5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in state_dict.items()}


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


def collect(engine: GenerationEngine, n: int, timeout: float = 30.0) -> list[Completion]:
    out: list[Completion] = []
    while len(out) < n:
        got = engine.get_completions(timeout=timeout)
        assert got, f"no completion within {timeout}s; have {[c.request_id for c in out]}"
        out += got
    return out


@pytest.fixture
def model():
    return tiny_qwen2()


@pytest.fixture
def engine_factory(model):
    engines = []

    def build(**kw):
        kw.setdefault("num_blocks", 64)
        kw.setdefault("page_size", 32)
        kw.setdefault("max_batch_tokens", 256)
        kw.setdefault("max_requests_per_batch", 16)
        kw.setdefault("seed", 0)
        e = make_engine("transformers", model, **kw)
        engines.append(e)
        return e

    yield build
    for e in engines:
        e.shutdown()


def test_short_requests_finish_before_long_ones_added_with_them_or_before(engine_factory):
    e = engine_factory()
    e.add_request(req("long", LONG))
    e.add_request(req("short-a", SHORT))
    e.add_request(req("short-b", SHORT))
    first_two = collect(e, 2)
    assert {c.request_id for c in first_two} == {"short-a", "short-b"}
    # A short request added while the long one is still running also overtakes it.
    assert e.get_completions(timeout=0.05) == []
    e.add_request(req("short-late", SHORT))
    rest = collect(e, 2)
    assert [c.request_id for c in rest] == ["short-late", "long"]
    late, long_ = rest
    assert late.t_start > long_.t_start and late.t_end < long_.t_end
    assert len(long_.output_ids) == LONG and long_.finish_reason == "length"
    assert all(len(c.logprobs) == len(c.output_ids) for c in first_two + rest)
    assert e.num_pending() == 0 and e.stats()["gen/tokens"] == LONG + 3 * SHORT


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_a_plain_forward_of_prompt_plus_output(model, engine_factory, temperature):
    ref = clone_with(model, model.state_dict())
    e = engine_factory(temperature=temperature)
    prompts = [(5,), (1, 2, 3, 4, 5, 6, 7), tuple(range(10, 50))]  # varied lengths, batched together
    for i, p in enumerate(prompts):
        e.add_request(req(f"r{i}", 24 + 8 * i, prompt=p))
    for c in collect(e, len(prompts)):
        got = torch.tensor(c.logprobs)
        torch.testing.assert_close(got, ref_logprobs(ref, c, temperature), atol=1e-4, rtol=0)


def test_eos_stops_a_request_with_finish_reason_stop(engine_factory):
    e = engine_factory(eos_token_id=list(range(VOCAB)))  # every token is EOS: stop after one
    e.add_request(req("r", 50))
    (c,) = collect(e, 1)
    assert c.finish_reason == "stop" and len(c.output_ids) == 1 and len(c.logprobs) == 1


def test_weight_update_changes_what_the_engine_generates(model, engine_factory):
    old_sd = {k: v.clone() for k, v in model.state_dict().items()}
    new_sd = perturbed(old_sd)
    old_ref, new_ref = clone_with(model, old_sd), clone_with(model, new_sd)
    e = engine_factory()
    e.add_request(req("before", 32))
    (before,) = collect(e, 1)
    e.update_weights(new_sd, version=1)
    assert e.version == 1
    e.add_request(req("after", 32))
    (after,) = collect(e, 1)
    assert (before.version_start, before.version_end) == (0, 0)
    assert (after.version_start, after.version_end) == (1, 1)
    torch.testing.assert_close(torch.tensor(after.logprobs), ref_logprobs(new_ref, after), atol=1e-4, rtol=0)
    # Under the old weights the same tokens would have had clearly different log-probs.
    assert (torch.tensor(after.logprobs) - ref_logprobs(old_ref, after)).abs().max() > 0.1


def test_update_mid_flight_is_recorded_in_versions(model, engine_factory):
    old_ref = clone_with(model, model.state_dict())
    new_sd = perturbed(model.state_dict())
    e = engine_factory()
    e.add_request(req("spanning", 2 * LONG))
    assert e.get_completions(timeout=0.3) == []  # it is generating (prefill is one step, ~5 ms)
    e.update_weights(new_sd, version=7)
    e.add_request(req("fresh", SHORT))
    done = {c.request_id: c for c in collect(e, 2)}
    spanning, fresh = done["spanning"], done["fresh"]
    assert (spanning.version_start, spanning.version_end) == (0, 7)
    assert (fresh.version_start, fresh.version_end) == (7, 7)
    # The first tokens came from the old weights, later ones did not.
    old = ref_logprobs(old_ref, spanning)
    got = torch.tensor(spanning.logprobs)
    torch.testing.assert_close(got[:1], old[:1], atol=1e-4, rtol=0)
    assert (got[-20:] - old[-20:]).abs().max() > 0.05
    assert e.stats()["gen/weight_updates"] == 1


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
    assert e.stats()["gen/requests_cancelled"] == 2
    # The cancellation reached the CB loop: it is not still generating the 3000 tokens unseen.
    scheduler = e._manager.batch_processor.scheduler
    assert not scheduler.active_requests and not scheduler.waiting_requests


def test_admission_follows_priority_when_more_requests_than_slots(engine_factory):
    e = engine_factory(max_inflight=1)
    e.add_request(req("first", 40))  # takes the only slot at once
    for rid, prio in [("p1", 1.0), ("p5", 5.0), ("p3", 3.0), ("p3-later", 3.0), ("p0", 0.0)]:
        e.add_request(req(rid, SHORT, priority=prio))
    order = [c.request_id for c in collect(e, 6)]
    assert order == ["first", "p5", "p3", "p3-later", "p1", "p0"]  # larger first, ties FIFO


def test_update_weights_rejects_wrong_names_and_shapes(model, engine_factory):
    e = engine_factory()
    sd = model.state_dict()
    with pytest.raises(KeyError, match="unknown"):
        e.update_weights({**sd, "not.a.weight": torch.zeros(1)}, version=1)
    with pytest.raises(ValueError, match="shape mismatch"):
        e.update_weights({**sd, "model.norm.weight": torch.zeros(3)}, version=1)
    with pytest.raises(KeyError, match="not provided"):
        e.update_weights({k: v for k, v in sd.items() if "layers.0.mlp" not in k}, version=1)
    # Tied embeddings: lm_head may be omitted when the embedding is sent.
    e.update_weights({k: v for k, v in sd.items() if k != "lm_head.weight"}, version=2)
    assert e.version == 2
    with pytest.raises(ValueError, match="older"):
        e.update_weights(sd, version=1)


def test_bad_requests_and_settings_fail_loudly(model, engine_factory):
    with pytest.raises(ValueError, match="unknown engine 'vllm-typo'"):
        make_engine("vllm-typo", model)
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
    assert e.get_completions(timeout=None) == []  # never hangs on a closed engine
