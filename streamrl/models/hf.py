"""Any local Hugging Face causal LM as the policy: where it is, how prompts become ids, when to stop.

- ``resolve_policy_path``: a directory as given, or a hub id found in the local Hugging Face cache
  (offline: nothing is downloaded); anything else fails naming the path.
- ``PromptFormatter``: prompt text -> token ids. The tokenizer's chat template is applied when it
  has one (``task.chat_template: auto``), or a template file's, or none; BOS is prepended only
  when the tokenizer has a BOS token and the rendered text does not already start with it.
- ``stop_token_ids``: the tokenizer's EOS plus every id in ``generation_config.json``'s
  ``eos_token_id`` (instruct models end turns on tokens other than the tokenizer's EOS).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from streamrl.errors import UserError

HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
"""A Hugging Face hub id, ``org/name`` (``policy.path`` is looked up in the local cache as one)."""


def is_tiny_policy_path(path: str | Path) -> bool:
    """The tiny policy's cache: a directory named ``tiny-policy*`` (``make_if_missing`` builds only there)."""
    return Path(path).name.startswith("tiny-policy")


class PolicyNotFound(UserError, FileNotFoundError):
    """``policy.path`` names no checkpoint this machine holds."""


def resolve_policy_path(path: str | Path) -> Path:
    """The checkpoint directory for ``path``: a local directory with ``config.json``, or a hub id
    resolved from the local Hugging Face cache without network."""
    p = Path(path)
    if (p / "config.json").is_file():
        return p
    text = str(path)
    if not p.exists() and HUB_ID.match(text):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from huggingface_hub import snapshot_download

        try:
            return Path(snapshot_download(text, local_files_only=True))
        except Exception as exc:
            raise PolicyNotFound(f"policy.path={text!r} is not a local directory and the hub id is not in the "
                                 f"local Hugging Face cache (offline; nothing is downloaded): "
                                 f"{type(exc).__name__}") from None
    if p.is_dir():
        raise PolicyNotFound(f"policy.path={text!r} is a directory without config.json (not a Hugging Face "
                             "checkpoint)")
    hint = (" (`streamrl make-policy` builds the tiny policy at a path named tiny-policy*, and a model recipe "
            "at a path named after it, e.g. smollm2-135m-instruct)") if is_tiny_policy_path(p) else ""
    raise PolicyNotFound(f"policy.path={text!r} does not exist{hint}")


def stop_token_ids(tokenizer, path: str | Path | None) -> list[int]:
    """EOS ids generation stops on: the tokenizer's, then ``generation_config.json``'s (int or list)."""
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    if path is not None:
        gen = Path(path) / "generation_config.json"
        if gen.is_file():
            value = json.loads(gen.read_text()).get("eos_token_id")
            for e in [value] if isinstance(value, int) else (value or []):
                if int(e) not in ids:
                    ids.append(int(e))
    return ids


def _read_template(spec: str) -> str | None:
    """``auto`` -> None (the tokenizer's own), ``none`` -> "" (no template), else a file's text."""
    if spec == "auto":
        return None
    if spec == "none":
        return ""
    p = Path(spec)
    if not p.is_file():
        raise FileNotFoundError(f"task.chat_template={spec!r}: no such template file")
    return p.read_text()


class PromptFormatter:
    """Renders a task prompt the way the policy expects it and tokenises it."""

    def __init__(self, tokenizer, chat_template: str = "auto", system_prompt: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.system_prompt = system_prompt
        template = _read_template(chat_template)
        if template is None:
            template = getattr(tokenizer, "chat_template", None) or ""
        self.template = template
        self.uses_chat = bool(template)

    def render(self, text: str) -> str:
        """The prompt as the policy sees it (chat template applied when there is one)."""
        if not self.uses_chat:
            return text
        messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
        messages.append({"role": "user", "content": text})
        return self.tokenizer.apply_chat_template(messages, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        rendered = self.render(text)
        ids = list(self.tokenizer.encode(rendered, add_special_tokens=False))
        bos = self.tokenizer.bos_token_id
        if bos is not None and not (ids and ids[0] == bos):
            ids.insert(0, bos)
        return ids
