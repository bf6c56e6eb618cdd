"""Batch results -> the caller's response: trimmed, pooled, packed as little-endian bytes."""

import numpy as np

from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server.parse import EmbedPlan
from attnserve.server.schedule import SequenceResult

_WIRE = {np.float32: (pb.DTYPE_FLOAT32, "<f4"), np.float16: (pb.DTYPE_FLOAT16, "<f2")}


def tensor(array: np.ndarray, dtype: type) -> pb.Tensor:
    code, wire = _WIRE[dtype]
    data = np.ascontiguousarray(array, dtype=wire).tobytes()
    return pb.Tensor(shape=array.shape, dtype=code, data=data)


def pool(hidden: np.ndarray, pooling: int, normalize: bool) -> np.ndarray | None:
    """hidden is one sequence's (num_tokens, hidden), padding already trimmed."""
    if pooling == pb.POOLING_NONE:
        return None
    vector = hidden[0] if pooling == pb.POOLING_CLS else hidden.mean(axis=0, dtype=np.float32)
    if normalize:
        vector = vector / max(float(np.linalg.norm(vector)), 1e-12)
    return vector


def attention_maps(result: SequenceResult, plan: EmbedPlan) -> np.ndarray:
    """(layers, heads or 1, n, n) in the caller's layer and head order."""
    options = plan.attention
    maps = []
    for layer in options.layers:
        probs = result.attentions[layer]
        if options.heads is not None:
            probs = probs[list(options.heads)]
        if options.average_heads:
            probs = probs.mean(axis=0, keepdims=True, dtype=np.float32)
        maps.append(probs)
    return np.stack(maps)


def embedding(result: SequenceResult, ids: np.ndarray, plan: EmbedPlan) -> pb.Embedding:
    out = pb.Embedding(token_ids=ids.tolist(), num_tokens=len(ids))
    pooled = pool(result.hidden, plan.pooling, plan.normalize)
    if pooled is not None:
        out.pooled.CopyFrom(tensor(pooled, plan.dtype))
    if plan.return_token_embeddings:
        out.token_embeddings.CopyFrom(tensor(result.hidden, plan.dtype))
    if plan.attention is not None:
        out.attentions.CopyFrom(tensor(attention_maps(result, plan), plan.dtype))
    return out
