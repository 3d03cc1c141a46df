"""A conversation's tokens grow only by appending: the model's ids as sampled, then the template's
markup and the env's messages, equal to what the chat template renders for the whole exchange."""

from __future__ import annotations

from streamrl.agent.chat import TurnRenderer
from streamrl.agent.tools import schema
from streamrl.models.hf import PromptFormatter


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def test_tokens_between_turns_complete_the_template_render_of_the_whole_conversation(chat_tokenizer):
    tok = chat_tokenizer
    r = TurnRenderer(PromptFormatter(tok, "auto", "be brief"))
    messages, ids = r.start([{"role": "user", "content": "what is 2+3?"}])
    assert messages[0] == {"role": "system", "content": "be brief"}
    turn1 = tok.encode("call add", add_special_tokens=False) + [tok.eos_token_id]  # as sampled, eos included
    env = [{"role": "tool", "content": "5"}]
    between = r.between(messages, env, stopped=True)
    turn2 = tok.encode("answer 5", add_special_tokens=False) + [tok.eos_token_id]
    whole = messages + [{"role": "assistant", "content": "call add"}] + env + [{"role": "assistant", "content": "answer 5"}]
    want = tok.apply_chat_template(whole, tokenize=False)
    got = tok.decode(ids + turn1 + between + turn2)
    assert got == want.rstrip("\n")  # the template's newline after the last <|im_end|> comes with the next turn
    assert tok.decode(between).startswith("\n<|im_start|>tool\n5<|im_end|>") and tok.decode(between).endswith(
        "<|im_start|>assistant\n")


def test_tools_reach_a_template_that_ignores_them_through_a_system_section(chat_tokenizer):
    r = TurnRenderer(PromptFormatter(chat_tokenizer, "auto", None), [schema(add)])
    messages, ids = r.start([{"role": "user", "content": "what is 2+3?"}])
    assert not r.native_tools and messages[0]["role"] == "system" and '"name": "add"' in messages[0]["content"]
    assert "<tool_call>" in chat_tokenizer.decode(ids)


def test_without_a_template_messages_are_appended_as_bare_text(chat_tokenizer):
    r = TurnRenderer(PromptFormatter(chat_tokenizer, "none", None))
    _, ids = r.start([{"role": "user", "content": "what is 2+3?"}])
    assert chat_tokenizer.decode(ids) == "what is 2+3?"
    assert chat_tokenizer.decode(r.between([], [{"role": "user", "content": " then 5"}], True)) == " then 5"
