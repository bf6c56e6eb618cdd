"""The shape of an encoder, independent of where its weights come from."""

from dataclasses import dataclass
from typing import Literal

PositionKind = Literal["learned", "sinusoidal", "rope"]
HeadPooling = Literal["cls", "mean"]
HeadActivation = Literal["tanh", "gelu"]
# RoBERTa's families: their learned positions are numbered from the padding id on.
_POSITIONS_AFTER_PADDING = ("roberta", "xlm-roberta")


@dataclass(frozen=True)
class EncoderShape:
    """What every family has: what export, its checks and the artifact read."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    """the longest sequence the model takes, special tokens included"""
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    model_type: str = "bert"
    """the Hugging Face family the weights come from"""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class EncoderConfig(EncoderShape):
    """BERT and the families built as it is (RoBERTa, XLM-RoBERTa): post-LN blocks."""

    type_vocab_size: int = 2
    positions: PositionKind = "learned"
    positions_after_padding: bool = False
    """RoBERTa's numbering of learned positions: a row's real tokens are numbered
    pad_token_id + 1, pad_token_id + 2, … and every padding token pad_token_id"""
    causal: bool = False
    pooler: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.positions not in ("learned", "sinusoidal", "rope"):
            raise ValueError(f"unknown positions {self.positions!r}")
        if self.positions_after_padding and self.positions != "learned":
            raise ValueError("positions after the padding id are learned positions")

    @property
    def position_table_size(self) -> int:
        """Rows of the learned position table: the numbers after the padding id need
        pad_token_id + 1 rows more than the longest sequence."""
        return self.max_positions + (self.pad_token_id + 1 if self.positions_after_padding else 0)

    @classmethod
    def from_hf(cls, hf: dict, pooler: bool) -> "EncoderConfig":
        """Read a Hugging Face config.json of BERT, RoBERTa or XLM-RoBERTa; `pooler` says
        whether the weights carry BERT's pooler head (config.json does not say)."""
        if hf.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (gelu)")
        if hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                "position_embedding_type "
                f"{hf['position_embedding_type']!r} is not supported (absolute)"
            )
        after_padding = hf["model_type"] in _POSITIONS_AFTER_PADDING
        pad = hf.get("pad_token_id", 1 if after_padding else 0)
        table = hf["max_position_embeddings"]
        longest = table - (pad + 1 if after_padding else 0)
        if longest < 1:
            raise ValueError(f"max_position_embeddings {table} leaves no position after the "
                             f"padding id {pad}")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_positions=longest,
            type_vocab_size=hf.get("type_vocab_size", 2),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
            pad_token_id=pad,
            model_type=hf["model_type"],
            positions_after_padding=after_padding,
            pooler=pooler,
        )


@dataclass(frozen=True)
class ModernBertConfig(EncoderShape):
    """ModernBERT: pre-LN blocks, rotary positions, a GeGLU feed-forward, and attention
    over the whole sequence in its global layers and over a sliding window in the others."""

    layer_types: tuple[str, ...] = ()
    """per layer: "global" (the whole sequence) or "local" (the window)"""
    local_attention: int = 128
    """the window of a local layer: a query sees the keys at most local_attention // 2
    positions away on either side"""
    global_rope_theta: float = 160_000.0
    local_rope_theta: float = 10_000.0
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")
        if set(self.layer_types) - {"global", "local"}:
            raise ValueError(f"layer types {self.layer_types} are not all global or local")

    @property
    def window_radius(self) -> int:
        return self.local_attention // 2

    @classmethod
    def from_hf(cls, hf: dict, pooler: bool) -> "ModernBertConfig":
        """Read a Hugging Face ModernBERT config.json: its layer types as `layer_types`
        names them, or as `global_attn_every_n_layers` places them (layer i global when i
        is a multiple of it); its rotary bases from `rope_parameters` or from
        `global_rope_theta` and `local_rope_theta`."""
        if pooler:
            raise ValueError("ModernBERT has no pooler")
        if hf.get("hidden_activation", "gelu") != "gelu":
            raise ValueError(f"hidden_activation {hf['hidden_activation']!r} is not supported (gelu)")
        layers = hf["num_hidden_layers"]
        every = hf.get("global_attn_every_n_layers", 3)
        named = hf.get("layer_types") or ["sliding_attention" if i % every else "full_attention"
                                          for i in range(layers)]
        kinds = {"full_attention": "global", "sliding_attention": "local"}
        if set(named) - set(kinds):
            raise ValueError(f"layer_types {named} are not all full_attention or sliding_attention")
        rope = hf.get("rope_parameters") or {}
        thetas = {}
        for layer_type, old_name, default in (("full_attention", "global_rope_theta", 160_000.0),
                                              ("sliding_attention", "local_rope_theta", 10_000.0)):
            parameters = rope.get(layer_type) or {}
            if parameters.get("rope_type", "default") != "default":
                raise ValueError(f"rope_parameters.{layer_type}.rope_type "
                                 f"{parameters['rope_type']!r} is not supported (default)")
            thetas[layer_type] = parameters.get("rope_theta", hf.get(old_name, default))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=layers,
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            max_positions=hf["max_position_embeddings"],
            layer_norm_eps=hf.get("norm_eps", 1e-5),
            pad_token_id=hf.get("pad_token_id", 50283),
            model_type=hf["model_type"],
            layer_types=tuple(kinds[name] for name in named),
            local_attention=hf.get("local_attention", 128),
            global_rope_theta=thetas["full_attention"],
            local_rope_theta=thetas["sliding_attention"],
            norm_bias=hf.get("norm_bias", False),
            attention_bias=hf.get("attention_bias", False),
            mlp_bias=hf.get("mlp_bias", False),
        )


@dataclass(frozen=True)
class HeadConfig:
    """A sequence classifier's head over the encoder: the first token's vector (or the
    mean over the real tokens), a dense layer and its activation (then a LayerNorm, in
    ModernBERT's), and one score per label."""

    labels: tuple[str, ...]
    """each label's name, by its id (config.json's id2label)"""
    pooling: HeadPooling = "cls"
    activation: HeadActivation = "tanh"
    dense_bias: bool = True
    norm: bool = False
    norm_bias: bool = False
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if not self.labels:
            raise ValueError("a classifier has at least one label")
        if self.pooling not in ("cls", "mean"):
            raise ValueError(f"classifier pooling {self.pooling!r} is not supported (cls, mean)")
        if self.activation not in ("tanh", "gelu"):
            raise ValueError(f"classifier activation {self.activation!r} is not supported "
                             "(tanh, gelu)")

    @staticmethod
    def labels_of(hf: dict) -> tuple[str, ...]:
        """config.json's id2label, in id order; without one, transformers' default of two
        labels."""
        id2label = {int(i): str(label) for i, label in
                    (hf.get("id2label") or {0: "LABEL_0", 1: "LABEL_1"}).items()}
        if sorted(id2label) != list(range(len(id2label))):
            raise ValueError(f"id2label ids {sorted(id2label)} are not 0..{len(id2label) - 1}")
        return tuple(id2label[i] for i in range(len(id2label)))

    @classmethod
    def bert_from_hf(cls, hf: dict) -> "HeadConfig":
        """BERT's (its pooler, then `classifier`) and RoBERTa's (`classifier.dense`, then
        `classifier.out_proj`): the first token, dense, tanh, the labels."""
        return cls(cls.labels_of(hf))

    @classmethod
    def modernbert_from_hf(cls, hf: dict) -> "HeadConfig":
        return cls(cls.labels_of(hf), pooling=hf.get("classifier_pooling", "cls"),
                   activation=hf.get("classifier_activation", "gelu"),
                   dense_bias=hf.get("classifier_bias", False), norm=True,
                   norm_bias=hf.get("norm_bias", False), norm_eps=hf.get("norm_eps", 1e-5))
