"""Small builders shared by tests (no fixtures here: plain functions)."""

from __future__ import annotations

import torch

from streamrl.types import Completion, Prompt, Sample


def real_samples(model, tokenizer, texts_and_responses, rewards, temperature=1.0, version=0):
    """Samples whose old log-probs are computed by ``model`` (as the engine would report them)."""
    from streamrl.models.tiny import encode_prompt
    from streamrl.trainer.losses import token_logprobs

    out = []
    for i, ((text, response), reward) in enumerate(zip(texts_and_responses, rewards)):
        p_ids = encode_prompt(tokenizer, text)
        o_ids = tokenizer.encode(response, add_special_tokens=False) + [tokenizer.eos_token_id]
        ids = torch.tensor([p_ids + o_ids])
        with torch.no_grad():
            lp = token_logprobs(model(input_ids=ids).logits[:, :-1], ids[:, 1:], temperature=temperature)[0]
        lps = lp[len(p_ids) - 1:].tolist()
        prompt = Prompt(prompt_id=f"p{i // 2}", text=text, answer="")
        comp = Completion(request_id=f"0:p{i // 2}/{i % 2}", prompt_ids=tuple(p_ids), output_ids=tuple(o_ids),
                          logprobs=tuple(lps), finish_reason="stop", version_start=version, version_end=version,
                          t_start=0.0, t_end=0.0)
        out.append(Sample(prompt=prompt, sample_idx=i % 2, completion=comp, response_text=response, reward=reward))
    return out
