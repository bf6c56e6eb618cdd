"""attnserve.v1 results -> protobuf: each sequence's arrays trimmed to its length and packed
as little-endian bytes, and the size of a response counted before any work is done for
it. Pooled vectors come pooled from the graph."""

import math
from dataclasses import dataclass

import numpy as np

from attnserve.artifact import HIDDEN_OUTPUT, MULTI_VECTOR_OUTPUT, SPARSE_OUTPUT, Manifest, pooled_output
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server.engine.quantize import EmbeddingType, quantize
from attnserve.server.engine.requests import ChunkedText, Chunking, Embedded
from attnserve.server.engine.sparse import entries, lexical_rows
from attnserve.server.grpc.wire import field_bytes, varint_bytes
from attnserve.server.runtime.backend import Outputs, SequenceResult

POOLING_NAMES = {"mean": pb.POOLING_MEAN, "cls": pb.POOLING_CLS, "lasttoken": pb.POOLING_LAST_TOKEN}
POOLINGS = {code: name for name, code in POOLING_NAMES.items()}
_WIRE = {np.float32: (pb.DTYPE_FLOAT32, "<f4"), np.float16: (pb.DTYPE_FLOAT16, "<f2")}
QUANTIZED_DTYPES = {kind: getattr(pb, f"DTYPE_{kind.name}") for kind in EmbeddingType if kind.name != "FLOAT"}


@dataclass(frozen=True)
class AttentionPlan:
    layers: tuple[int, ...]
    """in the caller's order, negative indexes resolved"""
    heads: tuple[int, ...] | None
    """None: all heads"""
    average_heads: bool

    @property
    def graph_layers(self) -> tuple[int, ...]:
        """The graph outputs to ask onnxruntime for: each layer once, in order."""
        return tuple(sorted(set(self.layers)))

    def returned_heads(self, num_heads: int) -> int:
        return 1 if self.average_heads else len(self.heads or range(num_heads))


@dataclass(frozen=True)
class EmbedPlan:
    """What an Embed response carries, validated."""

    pooling: int
    normalize: bool
    return_token_embeddings: bool
    dtype: type
    attention: AttentionPlan | None
    chunking: Chunking | None = None
    embedding_type: EmbeddingType = EmbeddingType.FLOAT
    """what the pooled vectors are sent as"""
    ranges: np.ndarray | None = None
    """int8 and uint8: the ranges they are quantized over (quantized.ranges_of)"""
    multi_vector: tuple[int, int] | None = None
    """with return_multi_vector: the head's (dim, leading positions left out)"""
    sparse: str | None = None
    """with return_sparse: the graph output it comes from (SPARSE_OUTPUT's vocabulary
    row, or TOKEN_WEIGHTS_OUTPUT's weight a token)"""
    dropped_ids: tuple[int, ...] = ()
    """TOKEN_WEIGHTS_OUTPUT: the ids whose weights are left out (the special tokens)"""

    def pooled_tensor(self, vector: np.ndarray) -> pb.Tensor:
        """A pooled (or chunk) vector, as its embedding type."""
        if self.embedding_type is EmbeddingType.FLOAT:
            return tensor(vector, self.dtype)
        values = quantize(vector, self.embedding_type, self.ranges)
        return pb.Tensor(shape=values.shape, dtype=QUANTIZED_DTYPES[self.embedding_type],
                         data=values.tobytes())

    def pooled_bytes(self, hidden: int) -> int:
        """The wire size of one pooled vector's Tensor."""
        kind = self.embedding_type
        value_bytes = np.dtype(self.dtype).itemsize if kind is EmbeddingType.FLOAT else 1
        return tensor_bytes((kind.dimensions(hidden),), value_bytes)


def tensor(array: np.ndarray, dtype: type) -> pb.Tensor:
    code, wire = _WIRE[dtype]
    return pb.Tensor(shape=array.shape, dtype=code, data=np.ascontiguousarray(array, dtype=wire).tobytes())


def pooled_name(plan: EmbedPlan) -> str | None:
    """The graph output an Embed response's pooled vector is, None for POOLING_NONE."""
    return None if plan.pooling == pb.POOLING_NONE else pooled_output(POOLINGS[plan.pooling], plan.normalize)


def outputs_for(plan: EmbedPlan) -> Outputs:
    """The graph outputs an Embed response is built from: only the pooled vector unless
    the caller asked for token embeddings (attention maps are asked for by layer)."""
    return frozenset({pooled_name(plan), plan.sparse, HIDDEN_OUTPUT if plan.return_token_embeddings else None,
                      MULTI_VECTOR_OUTPUT if plan.multi_vector is not None else None} - {None})


def sparse_vector(result: SequenceResult, ids: np.ndarray, plan: EmbedPlan) -> pb.SparseVector:
    row = result.pooled[plan.sparse]
    rows = ([row] if plan.sparse == SPARSE_OUTPUT else lexical_rows([ids], [row], list(plan.dropped_ids)))
    (indices,), (values,) = entries(rows, None)
    return pb.SparseVector(indices=indices.tolist(), values=values.tolist())


def attention_maps(result: SequenceResult, plan: EmbedPlan) -> np.ndarray:
    """(layers, heads or 1, n, n) in the caller's layer and head order."""
    options = plan.attention
    heads = slice(None) if options.heads is None else list(options.heads)
    maps = (result.attentions[layer][heads] for layer in options.layers)
    if options.average_heads:  # a layer at a time: each one's copy of its heads goes once averaged
        maps = (probs.mean(axis=0, keepdims=True, dtype=np.float32) for probs in maps)
    return np.stack([*maps])


def embedding(result: SequenceResult, ids: np.ndarray, plan: EmbedPlan) -> pb.Embedding:
    out = pb.Embedding(token_ids=ids.tolist(), num_tokens=len(ids))
    name = pooled_name(plan)
    if name is not None:
        out.pooled.CopyFrom(plan.pooled_tensor(result.pooled[name]))
    if plan.return_token_embeddings:
        out.token_embeddings.CopyFrom(tensor(result.hidden, plan.dtype))
    if plan.attention is not None:
        out.attentions.CopyFrom(tensor(attention_maps(result, plan), plan.dtype))
    if plan.multi_vector is not None:
        out.multi_vector.CopyFrom(tensor(result.pooled[MULTI_VECTOR_OUTPUT], plan.dtype))
    if plan.sparse is not None:
        out.sparse.CopyFrom(sparse_vector(result, ids, plan))
    return out


def chunked_embedding(text: ChunkedText, plan: EmbedPlan) -> pb.Embedding:
    out = pb.Embedding(num_tokens=text.num_tokens)
    for (start, end), count, vector in zip(text.spans.tolist(), text.token_counts.tolist(),
                                           text.vectors, strict=True):
        out.chunks.append(pb.Chunk(start=start, end=end, num_tokens=count, pooled=plan.pooled_tensor(vector)))
    return out


def embed_response(embedded: Embedded, plan: EmbedPlan, model: str) -> pb.EmbedResponse:
    response = pb.EmbedResponse(model=model, total_tokens=embedded.total_tokens)
    # One at a time: a list handed to the constructor is copied in one call that holds
    # the interpreter for as long as the whole response takes.
    for result, ids in zip(embedded.results, embedded.ids, strict=True):
        response.embeddings.append(embedding(result, ids, plan))
    for text in embedded.chunked:
        response.embeddings.append(chunked_embedding(text, plan))
    return response


# --- sizes -----------------------------------------------------------------------------
# A response is sized before any work is done for it, from the lengths of its sequences,
# counting what the wire carries: the data, the shapes, the echoed ids, every field's tag
# and length prefix. Where a figure depends on values not known yet (the ids), it counts
# the largest, so the size is never under the real one: gRPC refuses to send a message
# over its limit, after all the inference it took.


def tensor_bytes(shape: tuple[int, ...], value_bytes: float) -> int:
    """A pb.Tensor: its packed shape, its dtype, its data."""
    data = math.ceil(math.prod(shape) * value_bytes)
    return field_bytes(sum(varint_bytes(d) for d in shape)) + 2 + field_bytes(data)


def embedding_bytes(length: int, plan: EmbedPlan, manifest: Manifest) -> int:
    """One pb.Embedding of a `length`-token sequence, ids counted at the largest."""
    vocab, value_bytes = manifest.vocab_size, np.dtype(plan.dtype).itemsize
    total = field_bytes(length * varint_bytes(vocab - 1)) + 1 + varint_bytes(length)
    if pooled_name(plan) is not None:
        total += field_bytes(plan.pooled_bytes(manifest.embedding_size))
    if plan.return_token_embeddings:
        total += field_bytes(tensor_bytes((length, manifest.hidden_size), value_bytes))
    if plan.attention is not None:
        maps = (len(plan.attention.layers), plan.attention.returned_heads(manifest.num_heads), length, length)
        total += field_bytes(tensor_bytes(maps, value_bytes))
    if plan.multi_vector is not None:
        dim, skip = plan.multi_vector
        total += field_bytes(tensor_bytes((max(length - skip, 0), dim), value_bytes))
    if plan.sparse is not None:
        most = vocab if plan.sparse == SPARSE_OUTPUT else length
        total += field_bytes(2 * field_bytes(0) + SPARSE_ENTRY_BYTES * min(most, vocab))
    return total


SPARSE_ENTRY_BYTES = 5 + 4
"""a sparse entry: its id a uint32 varint at the largest, its weight a packed float"""
INT64_MAX = (1 << 63) - 1


def head_bytes(model: str, tokens: int = INT64_MAX) -> int:
    """A response's model and total_tokens (at the largest, unless known)."""
    return field_bytes(len(model.encode())) + 1 + varint_bytes(tokens)


def embed_response_bytes(plan: EmbedPlan, lengths: np.ndarray, manifest: Manifest,
                         model: str) -> int:
    counts = np.bincount(np.asarray(lengths, dtype=np.int64))
    return head_bytes(model, int(lengths.sum())) + sum(
        int(counts[length]) * field_bytes(embedding_bytes(length, plan, manifest))
        for length in np.flatnonzero(counts).tolist())


# A chunk's start, end and num_tokens: a one-byte tag and a uint32 varint each, at the
# largest; a chunked text's num_tokens likewise.
CHUNK_FIELDS_BYTES = 3 * (1 + 5)
UINT32_FIELD_BYTES = 1 + 5


def chunked_response_bytes(plan: EmbedPlan, counts: np.ndarray, manifest: Manifest,
                           model: str) -> int:
    vector = field_bytes(plan.pooled_bytes(manifest.embedding_size))
    chunk = field_bytes(CHUNK_FIELDS_BYTES + vector)
    values, repeats = np.unique(np.asarray(counts, dtype=np.int64), return_counts=True)
    embeddings = sum(times * field_bytes(UINT32_FIELD_BYTES + n * chunk)
                     for n, times in zip(values.tolist(), repeats.tolist(), strict=True))
    return head_bytes(model) + embeddings

