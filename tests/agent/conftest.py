"""One small ChatML tokenizer (byte-level BPE, Qwen's special tokens and chat template) for the
multi-turn tests, built once."""

from __future__ import annotations

import pytest

from tests.helpers import make_qwen2_bpe_checkpoint


@pytest.fixture(scope="session")
def chat_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chatml")
    make_qwen2_bpe_checkpoint(path, ["what is 2+3? call add then answer 5 tool user assistant tool_call name "
                                     "arguments"] * 20)
    return AutoTokenizer.from_pretrained(path)
