"""Hugging Face tensor names -> this package's parameter names, per family.

A name maps to a tuple of ours: one, or several when the checkpoint stores them fused
(ModernBERT's Q, K and V in one matrix), concatenated in that order along the first axis.
None: the tensor belongs to no parameter of ours.
"""

import re

# BertModel (and RoBERTa's, XLM-RoBERTa's) name -> ours; {i} is the layer index.
_BERT_NAMES = {
    "embeddings.word_embeddings.weight": "embeddings.word.weight",
    "embeddings.position_embeddings.weight": "embeddings.position.weight",
    "embeddings.token_type_embeddings.weight": "embeddings.token_type.weight",
    "embeddings.LayerNorm.weight": "embeddings.norm.weight",
    "embeddings.LayerNorm.bias": "embeddings.norm.bias",
    "pooler.dense.weight": "pooler.dense.weight",
    "pooler.dense.bias": "pooler.dense.bias",
}
_BERT_LAYER_PARTS = {
    "attention.self.query": "attention.w_q",
    "attention.self.key": "attention.w_k",
    "attention.self.value": "attention.w_v",
    "attention.output.dense": "attention.w_o",
    "attention.output.LayerNorm": "attention_norm",
    "intermediate.dense": "feed_forward.up",
    "output.dense": "feed_forward.down",
    "output.LayerNorm": "output_norm",
}
_BERT_LAYER = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")


def bert_names(name: str) -> tuple[str, ...] | None:
    if name in _BERT_NAMES:
        return (_BERT_NAMES[name],)
    match = _BERT_LAYER.match(name)
    if match and match.group(2) in _BERT_LAYER_PARTS:
        index, part, kind = match.groups()
        return (f"layers.{index}.{_BERT_LAYER_PARTS[part]}.{kind}",)
    return None


# ModernBertModel name -> ours; Q, K and V are one matrix (Wqkv), and so are the GeGLU's
# two input projections (Wi: the GELU branch, then the linear one).
_MODERNBERT_NAMES = {
    "embeddings.tok_embeddings": ("embeddings.word",),
    "embeddings.norm": ("embeddings.norm",),
    "final_norm": ("final_norm",),
}
_MODERNBERT_LAYER_PARTS = {
    "attn_norm": ("attention_norm",),
    "attn.Wqkv": ("attention.w_q", "attention.w_k", "attention.w_v"),
    "attn.Wo": ("attention.w_o",),
    "mlp_norm": ("feed_forward_norm",),
    "mlp.Wi": ("feed_forward.w", "feed_forward.v"),
    "mlp.Wo": ("feed_forward.down",),
}
_MODERNBERT_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def modernbert_names(name: str) -> tuple[str, ...] | None:
    module, _, kind = name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if module in _MODERNBERT_NAMES:
        return tuple(f"{ours}.{kind}" for ours in _MODERNBERT_NAMES[module])
    match = _MODERNBERT_LAYER.match(module)
    if match and match.group(2) in _MODERNBERT_LAYER_PARTS:
        index, part = match.groups()
        return tuple(f"layers.{index}.{ours}.{kind}" for ours in _MODERNBERT_LAYER_PARTS[part])
    return None
