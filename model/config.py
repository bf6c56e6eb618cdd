"""The shape of an encoder, independent of where its weights come from."""

from dataclasses import dataclass
from typing import Literal

PositionKind = Literal["learned", "sinusoidal", "rope"]


@dataclass(frozen=True)
class EncoderConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    positions: PositionKind = "learned"
    causal: bool = False
    pad_token_id: int = 0
    pooler: bool = False

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.positions not in ("learned", "sinusoidal", "rope"):
            raise ValueError(f"unknown positions {self.positions!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf(cls, hf: dict, pooler: bool) -> "EncoderConfig":
        """Read a Hugging Face BERT-family config.json; `pooler` says whether the
        weights carry BERT's pooler head (config.json does not say)."""
        if hf.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (gelu)")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                "position_embedding_type "
                f"{hf['position_embedding_type']!r} is not supported (absolute)"
            )
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_positions=hf["max_position_embeddings"],
            type_vocab_size=hf.get("type_vocab_size", 2),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
            pad_token_id=hf.get("pad_token_id", 0),
            pooler=pooler,
        )
