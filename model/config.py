"""The shape of an encoder, independent of where its weights come from, read from a
Hugging Face config.json by each family's `from_hf`."""

from dataclasses import dataclass
from typing import Literal, get_args

PositionKind = Literal["learned", "sinusoidal", "rope"]
HeadPooling = Literal["cls", "mean", "last"]
HeadActivation = Literal["tanh", "gelu", "relu"]
# RoBERTa's families: their learned positions are numbered from the padding id on.
_POSITIONS_AFTER_PADDING = ("roberta", "xlm-roberta")
# MPNet numbers its positions after id 1 whatever its pad_token_id says, and buckets
# relative positions into 32 whatever its relative_attention_num_buckets says
# (transformers' MPNetEmbeddings and MPNetEncoder); a config that disagrees is refused.
_MPNET_PAD_ID = 1
_MPNET_BUCKETS = 32


def _shape(hf: dict, eps_key: str, eps: float) -> dict:
    """The shape config.json gives under transformers' common names (the norms' epsilon
    under `eps_key`, `eps` when it says none)."""
    return dict(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                num_layers=hf["num_hidden_layers"], num_heads=hf["num_attention_heads"],
                intermediate_size=hf["intermediate_size"], layer_norm_eps=hf.get(eps_key, eps),
                model_type=hf["model_type"])


def _choice(hf: dict, key: str, default: str, allowed: tuple[str, ...]) -> str:
    name = hf.get(key, default)
    if name not in allowed:
        raise ValueError(f"{key} {name!r} is not supported ({', '.join(allowed)})")
    return name


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
    head_dim: int = 0
    """each head's width; 0: hidden_size // num_heads (Qwen3 and Gemma3 name another)"""
    num_kv_heads: int = 0
    """heads of keys and values, each shared by num_heads // num_kv_heads query heads
    (grouped-query attention); 0: num_heads"""

    def __post_init__(self) -> None:
        if not self.head_dim:
            if self.hidden_size % self.num_heads:
                raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads "
                                 f"{self.num_heads}")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if not self.num_kv_heads:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")


@dataclass(frozen=True)
class EncoderConfig(EncoderShape):
    """BERT and the families built as it is, post-LN (RoBERTa, XLM-RoBERTa, MPNet, DistilBERT)."""

    type_vocab_size: int = 2
    """segments with an embedding of their own; 0: none (MPNet, DistilBERT)"""
    positions: PositionKind = "learned"
    positions_after_padding: bool = False
    """RoBERTa's numbering of learned positions: a row's real tokens are numbered
    pad_token_id + 1, pad_token_id + 2, … and every padding token pad_token_id"""
    relative_attention_buckets: int = 0
    """MPNet's relative positions: a learned bias on the scores per bucket of distances
    (model/positions.py's RelativePositionBias); 0: none"""
    activation: str = "gelu"
    """the feed-forward's (DistilBERT's may be relu)"""
    causal: bool = False
    pooler: bool = False

    @property
    def position_table_size(self) -> int:
        """Rows of the learned position table: the numbers after the padding id need
        pad_token_id + 1 rows more than the longest sequence."""
        return self.max_positions + (self.pad_token_id + 1 if self.positions_after_padding else 0)

    @classmethod
    def from_hf(cls, hf: dict, pooler: bool) -> "EncoderConfig":
        """Read a Hugging Face config.json of BERT, RoBERTa or XLM-RoBERTa; `pooler` says
        whether the weights carry BERT's pooler head (config.json does not say)."""
        _choice(hf, "hidden_act", "gelu", ("gelu",))
        _choice(hf, "position_embedding_type", "absolute", ("absolute",))
        after_padding = hf["model_type"] in _POSITIONS_AFTER_PADDING
        pad = hf.get("pad_token_id", 1 if after_padding else 0)
        table = hf["max_position_embeddings"]
        longest = table - (pad + 1 if after_padding else 0)
        if longest < 1:
            raise ValueError(f"max_position_embeddings {table} leaves no position after the padding id {pad}")
        return cls(**_shape(hf, "layer_norm_eps", 1e-12), max_positions=longest,
                   type_vocab_size=hf.get("type_vocab_size", 2), pad_token_id=pad,
                   positions_after_padding=after_padding, pooler=pooler)

    @classmethod
    def mpnet_from_hf(cls, hf: dict, pooler: bool) -> "EncoderConfig":
        """MPNet: BERT's blocks, RoBERTa's positions (after id 1), no segments, and
        relative position buckets added to every layer's scores."""
        activation = _choice(hf, "hidden_act", "gelu", ("gelu",))
        pad = hf.get("pad_token_id", _MPNET_PAD_ID)
        if pad != _MPNET_PAD_ID:
            raise ValueError(f"pad_token_id {pad}: MPNet numbers its positions after id "
                             f"{_MPNET_PAD_ID}, its padding id")
        buckets = hf.get("relative_attention_num_buckets", _MPNET_BUCKETS)
        if buckets != _MPNET_BUCKETS:
            raise ValueError(f"relative_attention_num_buckets {buckets} is not supported "
                             f"({_MPNET_BUCKETS}, the buckets MPNet computes)")
        return cls(**_shape(hf, "layer_norm_eps", 1e-12),
                   max_positions=hf["max_position_embeddings"] - pad - 1, type_vocab_size=0,
                   pad_token_id=pad, positions_after_padding=True,
                   relative_attention_buckets=buckets, activation=activation, pooler=pooler)

    @classmethod
    def distilbert_from_hf(cls, hf: dict, pooler: bool) -> "EncoderConfig":
        """DistilBERT: BERT's blocks without segments or pooler, under its own names."""
        return cls(vocab_size=hf["vocab_size"], hidden_size=hf["dim"], num_layers=hf["n_layers"],
                   num_heads=hf["n_heads"], intermediate_size=hf["hidden_dim"],
                   max_positions=hf["max_position_embeddings"], type_vocab_size=0,
                   pad_token_id=hf.get("pad_token_id", 0), model_type=hf["model_type"],
                   activation=_choice(hf, "activation", "gelu", ("gelu", "relu")))


def _rope_theta(parameters: dict, where: str, fallback: float) -> float:
    """A RoPE base from Hugging Face's rope parameters; any scaled kind is refused."""
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    if kind != "default":
        raise ValueError(f"{where}.rope_type {kind!r} is not supported (default)")
    return float(parameters.get("rope_theta", fallback))


def _layer_kinds(hf: dict, named: list[str], legacy: dict[str, tuple[str, float]]) -> dict:
    """Hugging Face's layer_types -> ours, global (the whole sequence) or local (a window), and
    each kind's RoPE base, from `rope_parameters` by layer type or from the older top-level
    names (`legacy`: layer type -> (name, default))."""
    kinds = {"full_attention": "global", "sliding_attention": "local"}
    if set(named) - set(kinds):
        raise ValueError(f"layer_types {named} are not all full_attention or sliding_attention")
    rope = hf.get("rope_parameters") or {}
    thetas = {f"{kinds[layer_type]}_rope_theta": _rope_theta(
        rope.get(layer_type) or {}, f"rope_parameters.{layer_type}", hf.get(name, default))
        for layer_type, (name, default) in legacy.items()}
    return dict(layer_types=tuple(kinds[name] for name in named), **thetas)


@dataclass(frozen=True)
class LayerKindsConfig(EncoderShape):
    """A stack of global and local layers (model/layer_kinds.py), each kind with its RoPE base."""

    layer_types: tuple[str, ...] = ()
    """per layer: "global" (the whole sequence) or "local" (the window)"""
    window_radius: int = 0
    """a local layer's query sees the keys at most this many positions away, on either side"""
    global_rope_theta: float = 10_000.0
    local_rope_theta: float = 10_000.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"{len(self.layer_types)} layer types for {self.num_layers} layers")


@dataclass(frozen=True)
class ModernBertConfig(LayerKindsConfig):
    """ModernBERT: pre-LN blocks, rotary positions, a GeGLU feed-forward, and attention
    over the whole sequence in its global layers and over a sliding window
    (config.json's local_attention // 2 positions on either side) in the others."""

    global_rope_theta: float = 160_000.0
    norm_bias: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_hf(cls, hf: dict, pooler: bool) -> "ModernBertConfig":
        """Read a Hugging Face ModernBERT config.json: its layer types as `layer_types`
        names them, or as `global_attn_every_n_layers` places them (layer i global when i
        is a multiple of it); its rotary bases from `rope_parameters` or from
        `global_rope_theta` and `local_rope_theta`."""
        _choice(hf, "hidden_activation", "gelu", ("gelu",))
        layers = hf["num_hidden_layers"]
        every = hf.get("global_attn_every_n_layers", 3)
        named = hf.get("layer_types") or ["sliding_attention" if i % every else "full_attention"
                                          for i in range(layers)]
        return cls(**_shape(hf, "norm_eps", 1e-5), max_positions=hf["max_position_embeddings"],
                   pad_token_id=hf.get("pad_token_id", 50283),
                   **_layer_kinds(hf, named, {"full_attention": ("global_rope_theta", 160_000.0),
                                              "sliding_attention": ("local_rope_theta", 10_000.0)}),
                   norm_bias=hf.get("norm_bias", False), attention_bias=hf.get("attention_bias", False),
                   mlp_bias=hf.get("mlp_bias", False), window_radius=hf.get("local_attention", 128) // 2)


@dataclass(frozen=True)
class DecoderConfig(LayerKindsConfig):
    """A decoder's blocks (Qwen3, Gemma3): pre-norm RMSNorm blocks of rotary attention with
    grouped key/value heads and a norm on each head's query and key, then a gated
    feed-forward. Qwen3 attends causally; Gemma3 as EmbeddingGemma runs it both ways, its
    local layers within a window. `layer_norm_eps` is the RMSNorms' epsilon."""

    causal: bool = False
    activation: str = "silu"
    """the gated feed-forward's (Hugging Face's name: silu, gelu_pytorch_tanh)"""
    attention_bias: bool = False
    norm_offset: float = 0.0
    """an RMSNorm scales by (norm_offset + weight): Gemma stores its scales as offsets from 1"""
    embedding_scale: bool = False
    """token embeddings multiplied by √hidden_size (Gemma)"""
    sandwich_norms: bool = False
    """Gemma3's extra RMSNorms: on attention's output and on the feed-forward's, before each
    joins the residual stream"""
    query_scale: float | None = None
    """what Q Kᵀ is multiplied by; None: 1/√head_dim (Gemma3: query_pre_attn_scalar^-½)"""

    def __post_init__(self) -> None:
        super().__post_init__()
        if "local" in self.layer_types and self.causal:
            raise ValueError("a causal decoder with sliding-window layers is not supported")

    @staticmethod
    def _shape(hf: dict, head_dim: int, max_positions: int) -> dict:
        """A decoder config.json's shape; `head_dim`, `max_positions`: its family's defaults."""
        return _shape(hf, "rms_norm_eps", 1e-6) | dict(
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim", head_dim),
            max_positions=hf.get("max_position_embeddings", max_positions),
        )

    @classmethod
    def qwen3_from_hf(cls, hf: dict, pooler: bool) -> "DecoderConfig":
        """Qwen3: causal, SwiGLU, one RoPE base, every layer global."""
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window true is not supported (false: every layer "
                             "attends to the whole sequence, as Qwen3's embedders do)")
        layers = hf["num_hidden_layers"]
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        theta = _rope_theta(rope, "rope_parameters", hf.get("rope_theta", 10_000.0))
        pad, eos = hf.get("pad_token_id"), hf.get("eos_token_id")
        return cls(
            **cls._shape(hf, head_dim=128, max_positions=32768),
            # The server fills padding with it; any id does under the mask.
            pad_token_id=pad if pad is not None else (eos[0] if isinstance(eos, list) else eos) or 0,
            **_layer_kinds(hf, hf.get("layer_types") or ["full_attention"] * layers, {}),
            global_rope_theta=theta, causal=True, activation=_choice(hf, "hidden_act", "silu", ("silu",)),
            attention_bias=hf.get("attention_bias", False))

    @classmethod
    def gemma3_from_hf(cls, hf: dict, pooler: bool) -> "DecoderConfig":
        """Gemma3's text decoder run both ways (EmbeddingGemma): local layers within
        `sliding_window` // 2 positions on either side (transformers' bidirectional window),
        global ones over the whole sequence, each kind with its own RoPE base; GeGLU (tanh),
        RMSNorm scaled by 1 + weight, embeddings scaled by √hidden_size."""
        if not hf.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention false: attnserve exports Gemma3 run "
                             "bidirectionally, as EmbeddingGemma")
        for key in ("attn_logit_softcapping", "rope_scaling"):
            if hf.get(key) is not None:
                raise ValueError(f"{key} {hf[key]!r} is not supported (null)")
        layers = hf["num_hidden_layers"]
        every = hf.get("sliding_window_pattern", 6)
        named = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0
                                          else "sliding_attention" for i in range(layers)]
        return cls(**cls._shape(hf, head_dim=256, max_positions=131_072),
                   pad_token_id=hf.get("pad_token_id", 0), window_radius=hf.get("sliding_window", 4096) // 2,
                   **_layer_kinds(hf, named, {"full_attention": ("rope_theta", 1_000_000.0),
                                              "sliding_attention": ("rope_local_base_freq", 10_000.0)}),
                   activation=_choice(hf, "hidden_activation", "gelu_pytorch_tanh", ("gelu_pytorch_tanh",)),
                   attention_bias=hf.get("attention_bias", False), norm_offset=1.0, embedding_scale=True,
                   sandwich_norms=True, query_scale=hf.get("query_pre_attn_scalar", 256) ** -0.5)


@dataclass(frozen=True)
class HeadConfig:
    """A sequence classifier's head over the encoder: the first token's vector (or the
    mean over the real tokens, or the last one's), a dense layer and its activation (then
    a LayerNorm, in ModernBERT's), and one score per label."""

    labels: tuple[str, ...]
    """each label's name, by its id (config.json's id2label)"""
    pooling: HeadPooling = "cls"
    dense: bool = True
    """a dense layer and its activation before the scores (Qwen3's head has none)"""
    activation: HeadActivation = "tanh"
    dense_bias: bool = True
    norm: bool = False
    norm_bias: bool = False
    norm_eps: float = 1e-5
    out_bias: bool = True
    pad_token_id: int | None = None
    """`last` pooling takes the last real token that is not this id, as transformers'
    decoder classifiers do (a trailing token equal to the pad id counts as padding)"""

    @staticmethod
    def labels_of(hf: dict) -> tuple[str, ...]:
        """config.json's id2label, in id order; without one, transformers' default of two labels."""
        id2label = {int(i): str(label) for i, label in
                    (hf.get("id2label") or {0: "LABEL_0", 1: "LABEL_1"}).items()}
        if sorted(id2label) != list(range(len(id2label))):
            raise ValueError(f"id2label ids {sorted(id2label)} are not 0..{len(id2label) - 1}")
        return tuple(id2label[i] for i in range(len(id2label)))

    @classmethod
    def bert_from_hf(cls, hf: dict) -> "HeadConfig":
        """BERT's (its pooler, then `classifier`), RoBERTa's and MPNet's (`classifier.dense`,
        then `classifier.out_proj`): the first token, dense, tanh, the labels."""
        return cls(cls.labels_of(hf))

    @classmethod
    def distilbert_from_hf(cls, hf: dict) -> "HeadConfig":
        """`pre_classifier`, then `classifier`: the first token, dense, ReLU, the labels."""
        return cls(cls.labels_of(hf), activation="relu")

    @classmethod
    def qwen3_from_hf(cls, hf: dict) -> "HeadConfig":
        """`score`: the last token straight to the labels, no bias."""
        return cls(cls.labels_of(hf), pooling="last", dense=False, out_bias=False,
                   pad_token_id=hf.get("pad_token_id"))

    @classmethod
    def modernbert_from_hf(cls, hf: dict) -> "HeadConfig":
        return cls(cls.labels_of(hf), pooling=_choice(hf, "classifier_pooling", "cls", get_args(HeadPooling)),
                   activation=_choice(hf, "classifier_activation", "gelu", get_args(HeadActivation)),
                   dense_bias=hf.get("classifier_bias", False), norm=True,
                   norm_bias=hf.get("norm_bias", False), norm_eps=hf.get("norm_eps", 1e-5))


@dataclass(frozen=True)
class VocabularyHeadConfig:
    """A masked language model's head over each token: a dense layer, its activation and a
    LayerNorm, then one score per vocabulary entry (the decoder)."""

    activation: str = "gelu"
    norm_eps: float = 1e-12
    dense_bias: bool = True
    norm_bias: bool = True
    decoder_bias: bool = True
    tied: bool = True
    """the decoder's weight is the word embeddings' (tie_word_embeddings): a checkpoint that
    ties them may save it once, as the embeddings"""

    @classmethod
    def bert_from_hf(cls, hf: dict) -> "VocabularyHeadConfig":
        """BERT's (its hidden_act), RoBERTa's, XLM-RoBERTa's and MPNet's (GELU)."""
        activation = hf.get("hidden_act", "gelu") if hf["model_type"] == "bert" else "gelu"
        return cls(activation=activation, norm_eps=hf.get("layer_norm_eps", 1e-12),
                   tied=hf.get("tie_word_embeddings", True))

    @classmethod
    def distilbert_from_hf(cls, hf: dict) -> "VocabularyHeadConfig":
        """DistilBERT's: its feed-forward's activation, a LayerNorm of epsilon 1e-12 whatever
        config.json says."""
        return cls(activation=hf.get("activation", "gelu"), norm_eps=1e-12,
                   tied=hf.get("tie_word_embeddings", True))

    @classmethod
    def modernbert_from_hf(cls, hf: dict) -> "VocabularyHeadConfig":
        return cls(activation=hf.get("classifier_activation", "gelu"),
                   norm_eps=hf.get("norm_eps", 1e-5), dense_bias=hf.get("classifier_bias", False),
                   norm_bias=hf.get("norm_bias", False), decoder_bias=hf.get("decoder_bias", True),
                   tied=hf.get("tie_word_embeddings", True))
