"""Model catalog: Qwen2.5 dense decoder shapes (PAPER.md §4 and the public HF configs).

PAPER.md lists layers / query heads / KV heads / hidden as 28/28/8/3584 (7B), 64/40/8/5120 (32B),
80/64/8/8192 (72B). The published Hugging Face configs (Qwen/Qwen2.5-*-Instruct, config.json)
agree except for 7B, which has **4** KV heads; we use the published 4 because the KV-cache size
drives decode cost and batch capacity. Intermediate (MLP) sizes and vocabulary also come from
those configs (18944 / 27648 / 29568; vocab 152064). Head dim is 128 for all three.
"""

from __future__ import annotations

from dataclasses import dataclass

BYTES_BF16 = 2


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    q_heads: int
    kv_heads: int
    hidden: int
    intermediate: int
    vocab: int = 152064
    head_dim: int = 128
    tied_embeddings: bool = False

    @property
    def params_per_layer(self) -> int:
        h, qd, kvd = self.hidden, self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * qd + 2 * h * kvd + qd * h + qd + 2 * kvd  # q, k, v (with biases), o
        mlp = 3 * h * self.intermediate  # gate, up, down
        return attn + mlp + 2 * h  # two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def params(self) -> int:
        """Total parameter count (embeddings and LM head included)."""
        return self.layers * self.params_per_layer + self.embedding_params + self.hidden

    @property
    def matmul_params(self) -> int:
        """Parameters touched by a matmul per token (all but the input embedding lookup)."""
        return self.layers * self.params_per_layer + self.vocab * self.hidden

    @property
    def weight_bytes(self) -> int:
        return self.params * BYTES_BF16

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers, bf16."""
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES_BF16

    def attention_flops_per_token(self, context: float) -> float:
        """Forward FLOPs of QK^T and AV for one new token attending to ``context`` tokens."""
        return 4.0 * self.layers * self.q_heads * self.head_dim * context


MODELS: dict[str, ModelShape] = {
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 28, 28, 4, 3584, 18944),
    "qwen2.5-32b": ModelShape("qwen2.5-32b", 64, 40, 8, 5120, 27648),
    "qwen2.5-72b": ModelShape("qwen2.5-72b", 80, 64, 8, 8192, 29568),
}


def get_model(name: str) -> ModelShape:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {sorted(MODELS)}") from None
