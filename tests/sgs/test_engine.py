"""Transformers-backend specifics. The engine contract itself (streaming order, LPT admission,
log-prob parity, weight updates, versions, cancellation, bad input) is checked for every backend
by ``tests/sgs/test_engine_conformance.py``; this file keeps what only this backend has: its
continuous-batching loop's internal state, and the engine factory.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from streamrl.sgs.engines.base import ENGINES, GenerationEngine, make_engine
from streamrl.types import Completion, GenRequest

transformers = pytest.importorskip("transformers")

VOCAB = 64
SHORT = 4


def tiny_qwen2(seed: int = 0, hidden: int = 64, layers: int = 2, vocab: int = VOCAB):
    """A random tiny Qwen2 causal LM (fp32, sdpa attention), deterministic in ``seed``."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                      max_position_embeddings=4096)
    return Qwen2ForCausalLM(cfg).eval()


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


@pytest.mark.slow
def test_cancel_reaches_the_continuous_batching_loop():
    e = make_engine("transformers", tiny_qwen2(), num_blocks=128, page_size=32, max_batch_tokens=256,
                    max_requests_per_batch=16, max_inflight=1, seed=0)
    try:
        e.add_request(req("running", 3000))
        e.add_request(req("waiting", SHORT))
        assert e.cancel("waiting") and e.cancel("running")
        e.add_request(req("short", SHORT))
        assert [c.request_id for c in collect(e, 1)] == ["short"]
        # The CB loop is not still generating the 3000 cancelled tokens unseen.
        scheduler = e._manager.batch_processor.scheduler
        assert not scheduler.active_requests and not scheduler.waiting_requests
    finally:
        e.shutdown()


def test_make_engine_rejects_unknown_names_and_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown engine 'vllm-typo'.*'transformers', 'vllm'"):
        make_engine("vllm-typo", tiny_qwen2())
    assert set(ENGINES) == {"transformers", "vllm"}


@pytest.mark.slow
def test_varlen_attention_generates_what_dense_attention_generates(monkeypatch):
    """The varlen CB attention (each request attends to its own keys) must give the dense path's
    greedy tokens and log-probs, through chunked prefill mixed with decoding and with grouped KV
    heads; and it must really run (a broken routing would silently fall back to dense)."""
    import streamrl.sgs.engines.varlen_attention as va

    calls = {"n": 0, "buckets": 0}
    real, real_plan = va.varlen_paged_attention, va._plan

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    def plan(*args):
        p = real_plan(*args)
        calls["buckets"] = max(calls["buckets"], len(p.decode))
        return p

    monkeypatch.setattr(va, "varlen_paged_attention", counted)
    monkeypatch.setattr(va, "_plan", plan)
    monkeypatch.setattr(va, "SPLIT_MIN_KEYS", 16)  # contexts 3 to ~95: several decode buckets per step
    prompts = [tuple((7 * i + j) % (VOCAB - 1) + 1 for j in range(3 + 11 * i)) for i in range(6)]
    results = {}
    for mode in ("dense", "varlen"):
        e = make_engine("transformers", tiny_qwen2(), temperature=0.0, num_blocks=128, page_size=32,
                        max_batch_tokens=24, max_requests_per_batch=6, attention=mode)
        try:
            for i, p in enumerate(prompts):
                e.add_request(req(f"{mode}-{i}", 12 + 5 * i, prompt=p))
            results[mode] = {c.request_id.split("-")[1]: c for c in collect(e, len(prompts))}
        finally:
            e.shutdown()
        if mode == "dense":
            assert calls["n"] == 0
    assert calls["n"] > 0 and calls["buckets"] >= 2
    for i, d in results["dense"].items():
        v = results["varlen"][i]
        assert v.output_ids == d.output_ids
        assert torch.allclose(torch.tensor(v.logprobs), torch.tensor(d.logprobs), atol=1e-4)


def test_unknown_attention_mode_is_rejected():
    with pytest.raises(ValueError, match="attention"):
        make_engine("transformers", tiny_qwen2(), attention="flash")


@pytest.mark.slow
def test_prefix_cache_reuses_a_finished_turn_and_no_key_written_before_an_update(monkeypatch):
    """``prefix_cache``: a continuation of a finished request (a trajectory's next turn) reuses its
    full KV blocks and gets the log-probs of a plain forward; after a weight update nothing written
    before it is matched."""
    import copy

    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    matched: list[int] = []  # tokens matched for each request admitted, in order (the CB ids are the engine's)
    real = PagedAttentionCache.search_prefix_match

    def spy(self, request_id, prompt_ids):
        matched.append(real(self, request_id, prompt_ids))
        return matched[-1]

    monkeypatch.setattr(PagedAttentionCache, "search_prefix_match", spy)
    model = tiny_qwen2()
    plain = copy.deepcopy(model)
    e = make_engine("transformers", model, temperature=0.0, num_blocks=64, page_size=8, max_batch_tokens=64,
                    max_requests_per_batch=4, prefix_cache=True, seed=0)
    try:
        prompt = tuple((5 * j) % (VOCAB - 1) + 1 for j in range(20))
        e.add_request(req("turn1", 12, prompt=prompt))
        (t1,) = collect(e, 1)
        nxt = prompt + t1.output_ids + (7, 8, 9)  # the next turn's context: prompt, turn 1, env tokens
        e.add_request(req("turn2", 6, prompt=nxt))
        (t2,) = collect(e, 1)
        e.update_weights({k: v.clone() for k, v in plain.state_dict().items()}, 1)
        e.add_request(req("after", 6, prompt=nxt))
        (after,) = collect(e, 1)
    finally:
        e.shutdown()
    # turn 2 reuses every full block of prompt + turn 1; after the update nothing written before it
    assert matched == [0, 8 * ((len(prompt) + 12 - 1) // 8), 0]
    with torch.no_grad():
        ids = torch.tensor([nxt + t2.output_ids])
        lp = torch.log_softmax(plain(input_ids=ids).logits[0, :-1].float(), -1)
    want = [lp[len(nxt) - 1 + i, t].item() for i, t in enumerate(t2.output_ids)]
    assert torch.allclose(torch.tensor(t2.logprobs), torch.tensor(want), atol=1e-4)
    assert after.output_ids == t2.output_ids  # same weights: same tokens, with the prefix recomputed


@pytest.mark.slow  # builds a checkpoint
def test_the_placement_plans_tensor_parallel_degree_reaches_vllms_engine_arguments(tmp_path, monkeypatch):
    """``placement.gen_gpus_per_instance`` (the TP degree the plan prints) becomes vLLM's
    ``tensor_parallel_size``; built here up to the call that would start vLLM."""
    from streamrl.config import load_config
    from streamrl.sgs.engines.build import engine_kwargs
    from streamrl.sgs.engines.vllm_engine import VLLMEngine
    from tests.helpers import make_qwen2_bpe_checkpoint

    make_qwen2_bpe_checkpoint(tmp_path / "ckpt", ["a tiny corpus for a tiny tokenizer"] * 10)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "ckpt")
    cuda = load_config(None, ["placement.device=cuda", "trainer.backend=fsdp", "generation.engine=vllm",
                              "generation.vllm.device=cuda", "mode=stream-async", "placement.gen_gpus_per_instance=2"])
    kw = engine_kwargs(cuda, tok, 1, "gen-0", 0)
    assert kw["tensor_parallel_size"] == 2
    cpu = load_config(None, ["generation.engine=vllm", "mode=stream-async"])
    assert engine_kwargs(cpu, tok, 1, "gen-0", 0)["tensor_parallel_size"] == 1
    started = {}
    monkeypatch.setattr(VLLMEngine, "_start_llm", lambda self, threads, args: started.update(args))
    monkeypatch.setattr(VLLMEngine, "_warm_up", lambda self: None)
    monkeypatch.setattr(VLLMEngine, "_start_loop", lambda self, version: None)
    monkeypatch.setattr(VLLMEngine, "_sampling_params", lambda self, *a: None)  # vLLM's own classes
    VLLMEngine(str(tmp_path / "ckpt"), device="cuda", shm_root=str(tmp_path),
               **{k: v for k, v in kw.items() if k in ("tensor_parallel_size", "num_blocks", "page_size")})
    assert started["tensor_parallel_size"] == 2
