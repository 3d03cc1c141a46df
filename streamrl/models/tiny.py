"""The tiny policy: a character-level tokenizer and a small Qwen2, both built here, no hub.

The tokenizer (``build_tokenizer``) maps one character to one token; the model is a standard
``Qwen2ForCausalLM``. Both are saved with ``save_pretrained`` into one directory that
``transformers`` reloads (and vLLM could serve): ``config.json``, ``model.safetensors``,
``tokenizer.json``, ...

Sequence layout used everywhere (SFT, generation, training)::

    <bos> prompt-chars response-chars <eos>

The prompt ends with ``":"``; generation stops at ``<eos>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # heavy imports stay out of module import time
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    from streamrl.config import PolicyConfig

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
PRINTABLE = "".join(chr(c) for c in range(32, 127))


def build_tokenizer(corpus: list[str], alphabet: str = PRINTABLE) -> "PreTrainedTokenizerFast":
    """Train a character-level BPE tokenizer on ``corpus`` locally with Hugging Face ``tokenizers``
    and wrap it as a ``PreTrainedTokenizerFast``. The vocabulary is capped at the alphabet plus
    the special tokens, so BPE never merges: one character, one token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(alphabet) | set("".join(corpus)))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIAL_TOKENS) + len(chars),
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=chars,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def build_model(cfg: "PolicyConfig", vocab_size: int, tokenizer=None, seed: int = 0) -> "Qwen2ForCausalLM":
    """A randomly initialised Qwen2 of the configured shape."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id if tokenizer is not None else None,
        eos_token_id=tokenizer.eos_token_id if tokenizer is not None else None,
        pad_token_id=tokenizer.pad_token_id if tokenizer is not None else None,
    )
    return Qwen2ForCausalLM(config)


def save_policy(model, tokenizer, path: str | Path) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def load_policy(path: str | Path, dtype=None):
    """Load ``(model, tokenizer)`` from a checkpoint directory (or a cached hub id), offline."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(_resolved(path), dtype=dtype or torch.float32)
    return model, tokenizer


def _resolved(path: str | Path) -> Path:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from streamrl.models.hf import resolve_policy_path

    return resolve_policy_path(path)


def load_tokenizer(path: str | Path):
    """The checkpoint's tokenizer alone (a process that never runs the model skips loading it)."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = _resolved(path)
    if _generic_tokenizer(path):
        # A tokenizer saved as the generic class (the tiny policy's, or one trained with `tokenizers`):
        # its tokenizer.json is the whole truth. AutoTokenizer would build the model type's own class
        # (Qwen2Tokenizer for a qwen2 config), whose pre-tokenizer drops a character split's spaces.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:  # many causal LMs ship without one; padding never reaches the loss
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _generic_tokenizer(path: Path) -> bool:
    import json

    try:
        cls = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return False
    return cls in ("TokenizersBackend", "PreTrainedTokenizerFast")


def encode_prompt(tokenizer, text: str) -> list[int]:
    """Raw prompt ids: BOS (only where the tokenizer has one) + the text, no chat template."""
    ids = list(tokenizer.encode(text, add_special_tokens=False))
    return ([tokenizer.bos_token_id] + ids) if tokenizer.bos_token_id is not None else ids
