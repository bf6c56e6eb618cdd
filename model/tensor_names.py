"""Hugging Face tensor names -> this package's parameter names, per family.

A name maps to a tuple of ours: one, or several when the checkpoint stores them fused
(ModernBERT's Q, K and V in one matrix), concatenated in that order along the first axis.
None: the tensor belongs to no parameter of ours.

Each family names its modules in two tables: the modules outside the layers, and the
parts of a layer (under the prefix its layers share, `layers.{i}.` in ours).
"""

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class TensorNames:
    modules: dict[str, tuple[str, ...]]
    """a module outside the layers -> ours"""
    layer: re.Pattern
    """matches a layer's module name: (layer index, part)"""
    parts: dict[str, tuple[str, ...]]
    """a part of layer i -> ours, under layers.{i}."""

    def __call__(self, name: str) -> tuple[str, ...] | None:
        module, _, kind = name.rpartition(".")
        if kind not in ("weight", "bias"):
            return None
        if module in self.modules:
            return tuple(f"{ours}.{kind}" for ours in self.modules[module])
        match = self.layer.match(module)
        if match and match.group(2) in self.parts:
            index, part = match.groups()
            return tuple(f"layers.{index}.{ours}.{kind}" for ours in self.parts[part])
        return None


def _attention(q: str, k: str, v: str, o: str) -> dict[str, tuple[str, ...]]:
    """A family's names of attention's four projections -> ours."""
    return {q: ("attention.w_q",), k: ("attention.w_k",), v: ("attention.w_v",), o: ("attention.w_o",)}


_EMBEDDINGS = {
    "embeddings.word_embeddings": ("embeddings.word",),
    "embeddings.position_embeddings": ("embeddings.position",),
    "embeddings.LayerNorm": ("embeddings.norm",),
}
_POOLER = {"pooler.dense": ("pooler.dense",)}
_BERT_FEED_FORWARD = {
    "intermediate.dense": ("feed_forward.up",),
    "output.dense": ("feed_forward.down",),
    "output.LayerNorm": ("output_norm",),
}
_ENCODER_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)$")
_LAYERS = re.compile(r"^layers\.(\d+)\.(.+)$")

# BertModel (and RoBERTa's, XLM-RoBERTa's).
bert_names = TensorNames(
    _EMBEDDINGS | _POOLER | {"embeddings.token_type_embeddings": ("embeddings.token_type",)}, _ENCODER_LAYER,
    _attention("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense")
    | {"attention.output.LayerNorm": ("attention_norm",)} | _BERT_FEED_FORWARD,
)

# MPNetModel: BERT's, but no segments, attention under attn.{q,k,v,o}, and one table of
# relative-position biases for all the layers.
mpnet_names = TensorNames(
    _EMBEDDINGS | _POOLER | {"encoder.relative_attention_bias": ("relative.bias",)}, _ENCODER_LAYER,
    _attention("attention.attn.q", "attention.attn.k", "attention.attn.v", "attention.attn.o")
    | {"attention.LayerNorm": ("attention_norm",)} | _BERT_FEED_FORWARD,
)

# DistilBertModel: no segments, no pooler.
distilbert_names = TensorNames(
    _EMBEDDINGS, re.compile(r"^transformer\.layer\.(\d+)\.(.+)$"),
    _attention("attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin")
    | {"sa_layer_norm": ("attention_norm",), "ffn.lin1": ("feed_forward.up",),
       "ffn.lin2": ("feed_forward.down",), "output_layer_norm": ("output_norm",)},
)

# ModernBertModel: Q, K and V are one matrix (Wqkv), and so are the GeGLU's two input
# projections (Wi: the GELU branch, then the linear one).
modernbert_names = TensorNames(
    {"embeddings.tok_embeddings": ("embeddings.word",),
     "embeddings.norm": ("embeddings.norm",),
     "final_norm": ("final_norm",)},
    _LAYERS,
    {"attn_norm": ("attention_norm",),
     "attn.Wqkv": ("attention.w_q", "attention.w_k", "attention.w_v"),
     "attn.Wo": ("attention.w_o",),
     "mlp_norm": ("feed_forward_norm",),
     "mlp.Wi": ("feed_forward.gate", "feed_forward.up"),
     "mlp.Wo": ("feed_forward.down",)},
)

_DECODER = {"embed_tokens": ("word",), "norm": ("final_norm",)}
_DECODER_PARTS = {
    **_attention("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
    "input_layernorm": ("attention_norm",),
    "self_attn.q_norm": ("attention.query_norm",),
    "self_attn.k_norm": ("attention.key_norm",),
    "mlp.gate_proj": ("feed_forward.gate",),
    "mlp.up_proj": ("feed_forward.up",),
    "mlp.down_proj": ("feed_forward.down",),
}

# Qwen3Model: its post_attention_layernorm is the norm before the feed-forward.
qwen3_names = TensorNames(_DECODER, _LAYERS,
                          _DECODER_PARTS | {"post_attention_layernorm": ("feed_forward_norm",)})

# Gemma3TextModel: a norm on attention's output, and one before and after the feed-forward.
gemma3_names = TensorNames(_DECODER, _LAYERS, _DECODER_PARTS | {
    "post_attention_layernorm": ("post_attention_norm",),
    "pre_feedforward_layernorm": ("feed_forward_norm",),
    "post_feedforward_layernorm": ("post_feed_forward_norm",),
})
