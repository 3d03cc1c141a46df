"""Small builders shared by tests (no fixtures here: plain functions)."""

from __future__ import annotations

import torch

from streamrl.types import Completion, Prompt, Sample


def real_samples(model, tokenizer, texts_and_responses, rewards, temperature=1.0, version=0):
    """Samples whose old log-probs are computed by ``model`` (as the engine would report them)."""
    from streamrl.models.tiny import encode_prompt
    from streamrl.models.logprobs import token_logprobs

    out = []
    for i, ((text, response), reward) in enumerate(zip(texts_and_responses, rewards)):
        p_ids = encode_prompt(tokenizer, text)
        o_ids = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids = torch.tensor([p_ids + o_ids])
        with torch.no_grad():
            lp = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:], temperature=temperature)[0]
        lps = lp[len(p_ids) - 1:].tolist()
        prompt = Prompt(prompt_id=f"p{i // 2}", text=text, answer="")
        comp = Completion(request_id=f"0:p{i // 2}/{i % 2}", prompt_id=f"p{i // 2}", sample_idx=i % 2, prompt_ids=tuple(p_ids), output_ids=tuple(o_ids),
                          logprobs=tuple(lps), finish_reason="stop", version_start=version, version_end=version,
                          t_start=0.0, t_end=0.0)
        out.append(Sample(prompt=prompt, sample_idx=i % 2, completion=comp, response_text=response, reward=reward))
    return out


def kill_an_instance_at(ctx, pipe, iteration: int) -> list[int]:
    """SIGKILL the pipeline's first generation instance when the scorer is handed the first
    completion of ``iteration`` (the others of that iteration are still running); returns the list
    the killed pid is appended to."""
    import os
    import signal

    import ray

    submit, killed = ctx.scorer.submit, []

    def submit_then_kill(c, it):
        if it == iteration and not killed:
            killed.append(ray.get(next(iter(pipe.sgs.instances.values())).pid.remote()))
            os.kill(killed[-1], signal.SIGKILL)
        return submit(c, it)

    ctx.scorer.submit = submit_then_kill
    return killed


class AllOnFirst:
    """Dispatch that puts every request on instance 0, so only rebalancing can use the others."""

    def assign(self, predicted_lengths, num_instances):
        return [0] * len(predicted_lengths)


def assert_moved_running_and_joined(sgs, requests, done, new_tokens):
    """After a drain where rebalancing moved running requests off gen-0: each request came back
    exactly once and whole (the prompt as submitted, all ``new_tokens`` tokens with log-probs),
    at least one was moved while running and at least one finished on gen-1."""
    assert sorted(c.request_id for c in done) == sorted(r.request_id for r in requests)  # exactly once
    assert sgs.counters["sgs/rebalanced_running"] >= 1 and sgs.counters["sgs/duplicates"] == 0
    assert any(c.instance == "gen-1" for c in done)
    by_id = {r.request_id: r for r in requests}
    for c in done:
        assert c.prompt_ids == by_id[c.request_id].prompt_ids
        assert len(c.output_ids) == len(c.logprobs) == new_tokens and c.finish_reason == "length"
        assert all(lp <= 0.0 for lp in c.logprobs) and c.t_start <= c.t_end


QWEN_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_qwen2_bpe_checkpoint(path, corpus: list[str], hidden_size: int = 64, vocab_size: int = 400):
    """A small Qwen2.5-style checkpoint built here, no download: a byte-level BPE tokenizer trained
    on ``corpus`` with Qwen's special tokens, **no BOS token**, a chat template, the tokenizer
    class a real Qwen2.5 checkpoint names (so ``AutoTokenizer`` builds ``Qwen2Tokenizer``), and an
    EOS list in ``generation_config.json`` (``<|im_end|>`` and ``<|endoftext|>``). Returns the
    ``(im_end, endoftext)`` ids."""
    import json
    from pathlib import Path

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = QWEN_CHAT_TEMPLATE
    hf.save_pretrained(path)
    tc = path / "tokenizer_config.json"
    tc.write_text(json.dumps({**json.loads(tc.read_text()), "tokenizer_class": "Qwen2Tokenizer"}))
    im_end, eot = hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(hf), hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None,
        eos_token_id=im_end, pad_token_id=eot, tie_word_embeddings=True))
    model.generation_config = GenerationConfig(eos_token_id=[im_end, eot], pad_token_id=eot)
    model.save_pretrained(path)
    return im_end, eot


def generate_stalling_the_busiest(sgs, requests) -> tuple[list[str], str, list[str]]:
    """Generate ``requests``; after the first completion, the engine of the instance with the most
    unfinished requests stops stepping while its actor keeps answering (its polls return empty).
    Returns (request ids as they came back, the stalled instance, the instances alive at the end)."""
    import ray

    seen, stalled = [], []
    for c in sgs.generate(requests):
        seen.append(c.request_id)
        if not stalled:
            left = sgs.ledger.counts(sgs.instances)
            stalled.append(max(left, key=left.get))
            ray.get(sgs.instances[stalled[0]].inject_fault.remote("hang"))
    return seen, stalled[0], list(sgs.instances)


def assert_the_stalled_instance_was_replaced(sgs, requests, seen, stalled, alive) -> None:
    """Every request came back once; exactly one fault, the stalled instance's, found by its
    heartbeat; it was replaced (as many instances alive as before, without it)."""
    assert sorted(seen) == sorted(r.request_id for r in requests)
    assert sgs.counters["sgs/faults"] == 1 and "generated no token" in sgs.faults[0]["reason"], sgs.faults
    assert sgs.faults[0]["instance"] == stalled and stalled not in alive and len(alive) == 2
