"""A conversation's tokens: its first prompt, and the tokens between two assistant turns.

With a chat template the conversation is kept as token ids that only ever grow: the model's own
tokens stay as it sampled them, and what follows a turn (the template's end of the assistant
message, the env or tool messages, the next assistant header) is the difference of two renders
with a sentinel assistant message, so the ids equal what the template renders without
re-tokenising the model's text. Without a template (the tiny policy) messages are appended as
their bare text. A template that ignores ``tools`` gets them in a Hermes system section.
"""

from __future__ import annotations

from streamrl.agent import tools as tooling

SENTINEL = "\u2063streamrl-turn\u2063"


class TurnRenderer:
    def __init__(self, formatter, schemas: list[dict] | None = None) -> None:
        self.f = formatter
        self.tok = formatter.tokenizer
        self.schemas = schemas or None
        self.native_tools = bool(self.schemas) and "tools" in (formatter.template or "")
        eos = self.tok.eos_token_id
        self.eos_text = self.tok.decode([eos]) if eos is not None else None

    def start(self, messages: list[dict]) -> tuple[list[dict], list[int]]:
        """The opening messages as the model sees them (system prompt and tools added) and their ids."""
        msgs = list(messages)
        if not self.f.uses_chat:
            ids = self.f.encode("".join(m["content"] for m in msgs))
            return msgs, ids
        system = self.f.system_prompt
        if self.schemas and not self.native_tools:
            system = (system + "\n\n" if system else "") + tooling.tools_prompt(self.schemas)
        if system and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": system})
        ids = list(self.tok.encode(self._render(msgs, True), add_special_tokens=False))
        bos = self.tok.bos_token_id
        if bos is not None and not (ids and ids[0] == bos):
            ids.insert(0, bos)
        return msgs, ids

    def between(self, messages: list[dict], new: list[dict], stopped: bool) -> list[int]:
        """The ids after an assistant turn (``stopped``: it ended with the eos token, which is
        already among its ids) up to the next assistant header."""
        if not self.f.uses_chat:
            return list(self.tok.encode("".join(m["content"] for m in new), add_special_tokens=False))
        turn = messages + [{"role": "assistant", "content": SENTINEL}]
        before = self._render(turn, False)
        after = self._render(turn + new, True)
        if not after.startswith(before):
            raise ValueError("the chat template renders a conversation differently once it grows; "
                             "multi-turn rollouts need a template that appends messages")
        close = before[before.rindex(SENTINEL) + len(SENTINEL):]
        if stopped and self.eos_text and close.startswith(self.eos_text):
            close = close[len(self.eos_text):]
        return list(self.tok.encode(close + after[len(before):], add_special_tokens=False))

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        kw = {"tools": self.schemas} if self.native_tools else {}
        return self.tok.apply_chat_template(messages, chat_template=self.f.template, tokenize=False,
                                            add_generation_prompt=generation_prompt, **kw)
