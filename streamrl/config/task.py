"""``task``: where prompts come from and how a response is scored.

``is_reward_file`` and ``reward_specs`` read ``task.reward`` by the same rules as
``tasks/user_reward.py``, which imports the functions it names.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from streamrl.config.base import _Section


class TaskConfig(_Section):
    """Where prompts come from and how a response is scored.

    ``synthetic`` and ``arithmetic`` are generated here; ``file`` reads your data (jsonl, parquet, csv, or a local
    ``datasets`` directory); ``gsm8k`` and ``math500`` are presets of ``file`` (their keys,
    template and extractor filled in, their files looked up in the data directory)."""

    name: Literal["synthetic", "arithmetic", "file", "gsm8k", "math500"] = "synthetic"
    """synthetic | arithmetic (generated integer expressions, for chat models) | file (your data) | gsm8k | math500
    (presets of file)"""
    train_path: str | None = None
    """training data: .jsonl, .parquet, .csv or a `datasets` save_to_disk directory; presets default to their file in
    the data directory"""
    eval_path: str | None = None
    """held-out data (same formats); None = num_eval rows cut from train_path by seed"""
    train_split: str = "train"
    """split read from a DatasetDict directory for training"""
    eval_split: str = "test"
    """split read from a DatasetDict directory for evaluation"""
    prompt_key: str | None = None
    """column holding the prompt (file: 'prompt'; gsm8k: 'question'; math500: 'problem')"""
    answer_key: str | None = None
    """column holding the reference answer (default 'answer')"""
    prompt_template: str | None = None
    """text around the prompt, with a {prompt} placeholder (other columns as {name}); None = the prompt as is (math
    presets: a step-by-step instruction)"""
    answer_extractor: Literal["gsm8k", "boxed", "raw"] | None = None
    """how the reference answer is read from answer_key: gsm8k (after '####'), boxed (last \\boxed{}), raw (as is);
    None = the preset's, raw for file"""
    chat_template: str = "auto"
    """auto (the tokenizer's chat template when it has one) | none | a Jinja template file"""
    system_prompt: str | None = None
    """system message when a chat template is applied"""
    reward: str | list[str] | None = None
    """reward function(s) by path: 'package.module:fn' or '/path/to/file.py:fn'; called as fn(response, answer,
    prompt, metadata) -> float or dict; None = the task's verifier"""
    reward_weights: list[float] | None = None
    """one weight per task.reward function (default 1.0 each); the reward is their weighted sum"""
    num_train: int = Field(4096, ge=1)
    """at most this many training prompts"""
    num_eval: int = Field(256, ge=1)
    """held-out prompts"""
    reward_workers: int = Field(2, ge=1)
    """isolated reward worker processes scoring in parallel as completions stream in"""
    reward_timeout_s: float = Field(5.0, gt=0)
    """a reward call taking longer scores as an error"""
    on_reward_error: Literal["zero", "raise"] = "zero"
    """zero = score 0.0, count it and flag the sample; raise = stop the run"""
    on_bad_row: Literal["skip", "raise"] = "skip"
    """skip = count and log the row, never silently"""
    max_prompt_tokens: int = Field(256, ge=1)
    """longer prompts are rejected with a counted error"""
    partial_credit: float = Field(0.0, ge=0, lt=1)
    """synthetic task: credit for a correct chain prefix (exact solutions score 1.0, accuracy counts only those)"""
    max_operand: int = Field(50, ge=2)
    """arithmetic task: operands are drawn from 1..max_operand (a product's right factor from 2..9)"""
    max_terms: int = Field(2, ge=2, le=6)
    """arithmetic task: each expression has 2..max_terms operands"""
    env: str | None = None
    """multi-turn environment class: 'file.py:ClassName' or 'package.module:ClassName', built per trajectory as
    ClassName(row) with reset() -> message and step(assistant_text) -> (message | None, reward, done)"""
    tools: list[str] = Field(default_factory=list)
    """tool functions offered to the model ('file.py:fn'), schema from signature and docstring, called in the
    Hermes format <tool_call>{"name": ..., "arguments": {...}}</tool_call>"""
    max_turns: int = Field(8, ge=1)
    """multi-turn: assistant turns per trajectory at most (a trajectory cut here is counted)"""
    env_timeout_s: float = Field(30.0, gt=0)
    """multi-turn: one env step or tool round taking longer scores its trajectory 0 (counted)"""
    env_workers: int = Field(4, ge=1)
    """multi-turn: worker processes running environments and tools"""
    length_ramp: bool = False
    """synthetic task: training prompts in order of solution length, shortest first, every epoch (no shuffle):
    response lengths grow through each epoch (the elastic workload)"""

    @property
    def multi_turn(self) -> bool:
        """Whether rollouts are multi-turn trajectories (an env or tools)."""
        return bool(self.env or self.tools)

    @field_validator("reward", "env", "tools")
    @classmethod
    def _reward_syntax(cls, value: str | list[str] | None) -> str | list[str] | None:
        for spec in [value] if isinstance(value, str) else (value or []):
            target, sep, attr = spec.rpartition(":")
            if not (sep and target.strip() and attr.isidentifier()
                    and (is_reward_file(target) or _MODULE_PATH.match(target))):
                raise PydanticCustomError("streamrl_value", f"{spec!r} is not 'package.module:function' or "
                                          "'path/to/file.py:function'")
        return value

    @model_validator(mode="after")
    def _rewards_fit(self) -> "TaskConfig":
        specs = reward_specs(self)
        if self.reward_weights is not None and len(self.reward_weights) != len(specs):
            raise ValueError(f"task.reward_weights={self.reward_weights} has {len(self.reward_weights)} weights "
                             f"for {len(specs)} task.reward functions")
        if self.name == "file" and self.train_path is None:
            raise ValueError("task.name='file' needs task.train_path (a .jsonl, .parquet, .csv file or a "
                             "`datasets` directory)")
        return self


_MODULE_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def is_reward_file(target: str) -> bool:
    """A ``task.reward`` entry's part before ``:`` names a Python file (else a module to import),
    by the rule ``tasks/user_reward.py`` imports it with."""
    return target.endswith(".py") or "/" in target or "\\" in target


def reward_specs(task: "TaskConfig") -> list[str]:
    """``task.reward`` as a list (empty: the task's own verifier)."""
    if task.reward is None:
        return []
    return [task.reward] if isinstance(task.reward, str) else list(task.reward)

