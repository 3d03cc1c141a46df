"""Tiny policy: tokenizer and model save and reload offline, bit-identical."""

import pytest
import torch

from streamrl.config import PolicyConfig
from streamrl.models.tiny import build_model, build_tokenizer, encode_prompt, load_policy, save_policy
from streamrl.tasks.synthetic import ALPHABET


def test_tokenizer_is_character_level_and_round_trips():
    tok = build_tokenizer([ALPHABET])
    text = "D 57,40: 56 55 =55"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_policy_saves_and_reloads_bit_identical(tmp_path):
    tok = build_tokenizer([ALPHABET])
    model = build_model(PolicyConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64),
                        len(tok), tok)
    save_policy(model, tok, tmp_path / "p")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "p").iterdir()}
    model2, tok2 = load_policy(tmp_path / "p")
    ids = torch.tensor([encode_prompt(tok2, "S 123:")])
    assert encode_prompt(tok2, "S 123:") == encode_prompt(tok, "S 123:")
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, model2(input_ids=ids).logits)
    assert tok2.eos_token_id == tok.eos_token_id and model2.config.eos_token_id == tok.eos_token_id


def test_missing_policy_dir_fails_clearly(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match=r"policy.path=.*nope' does not exist$"):
        load_policy(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="`streamrl make-policy` builds the tiny policy"):
        load_policy(tmp_path / "tiny-policy-x")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="directory without config.json"):
        load_policy(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="not in the local Hugging Face cache"):
        load_policy("no-such-org/no-such-model-xyz")


def test_a_policy_built_for_another_synthetic_task_version_is_stale(tmp_path):
    import json

    from streamrl.models.sft import POLICY_MARKER, policy_is_stale
    from streamrl.tasks.synthetic import TASK_VERSION

    assert not policy_is_stale(tmp_path)  # no marker: a user's checkpoint, used as is
    (tmp_path / POLICY_MARKER).write_text(json.dumps({"synthetic_task_version": TASK_VERSION}))
    assert not policy_is_stale(tmp_path)
    (tmp_path / POLICY_MARKER).write_text(json.dumps({"synthetic_task_version": TASK_VERSION - 1}))
    assert policy_is_stale(tmp_path)


def test_reward_trend_summarises_a_noisy_rising_curve():
    from streamrl.controller.stats import reward_trend

    t = reward_trend([0.2, 0.5, 0.3, 0.4, 0.6, 0.5, 0.7, 0.5, 0.8])
    assert t["first_third_mean"] == pytest.approx(1.0 / 3) and t["last_third_mean"] == pytest.approx(2.0 / 3)
    assert t["slope_per_iter"] > 0
    assert reward_trend([0.5, 0.4]) == {}


def test_model_logprobs_through_the_chunked_head_equal_the_full_logits_path():
    """The trainer's path (last hidden states -> chunked head) scores a padded batch exactly as
    log_softmax over the model's own logits does, gradients included."""
    from streamrl.models.logprobs import model_logprobs, plain_head, token_logprobs

    torch.manual_seed(0)
    model = build_model(PolicyConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64),
                        vocab_size=40).double()
    assert plain_head(model) is not None
    ids = torch.randint(0, 40, (3, 9))
    attn = torch.ones_like(ids)
    attn[1, 6:] = 0  # right padding, as the trainer pads
    logp, ent = model_logprobs(model, ids, attn, temperature=0.8)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    ref = token_logprobs(logits, ids[:, 1:], temperature=0.8)
    torch.testing.assert_close(logp, ref.double(), atol=1e-5, rtol=0)  # token_logprobs works in float32
    lp = torch.log_softmax(logits / 0.8, -1)
    torch.testing.assert_close(ent, -(lp.exp() * lp).sum(-1), atol=1e-9, rtol=0)
    params = [p for p in model.parameters()]
    ours = torch.autograd.grad(logp.sum(), params, allow_unused=True)
    theirs = torch.autograd.grad(token_logprobs(model(input_ids=ids, attention_mask=attn).logits[:, :-1], ids[:, 1:],
                                                temperature=0.8).sum(), params, allow_unused=True)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
