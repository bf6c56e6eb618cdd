"""Batch results -> the caller's response: trimmed, packed as little-endian bytes, off the
event loop unless the response is small. Pooled vectors come pooled from the graph."""

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

import numpy as np

from attnserve.artifact import HIDDEN_OUTPUT, Manifest, pooled_output
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server.backend import Outputs, SequenceResult
from attnserve.server.errors import ResourceExhausted
from attnserve.server.metrics import Metrics
from attnserve.server.parse import POOLING_NAMES, EmbedPlan

POOLINGS = {code: name for name, code in POOLING_NAMES.items()}
_WIRE = {np.float32: (pb.DTYPE_FLOAT32, "<f4"), np.float16: (pb.DTYPE_FLOAT16, "<f2")}
# A response this small is built on the event loop: handing it to the respond pool and
# back costs more than building it and holds the loop about as long. Measured (median, 2
# busy cores): the hop alone 46-54 µs; 4 pooled embeddings 65 µs inline, 130-150 µs via
# the pool; a 96 KiB hidden state 18 µs inline, 70-110 µs via the pool. Anything larger
# goes to the pool: 64 pooled embeddings held the loop 2.2 ms, thousands of them seconds,
# stalling every other call (health checks included).
INLINE_RESPONSE_SEQUENCES = 4
INLINE_RESPONSE_BYTES = 64 << 10

Response = TypeVar("Response")


async def build_response(pool: Executor, metrics: Metrics, build: Callable[[], Response],
                         sequences: int, response_bytes: int) -> Response:
    """`build()` on the respond pool, or inline when the response is small."""
    started = time.perf_counter()
    if sequences <= INLINE_RESPONSE_SEQUENCES and response_bytes <= INLINE_RESPONSE_BYTES:
        response = build()
    else:
        response = await asyncio.get_running_loop().run_in_executor(pool, build)
    metrics.stage_duration.labels("respond").observe(time.perf_counter() - started)
    return response


def tensor(array: np.ndarray, dtype: type) -> pb.Tensor:
    code, wire = _WIRE[dtype]
    data = np.ascontiguousarray(array, dtype=wire).tobytes()
    return pb.Tensor(shape=array.shape, dtype=code, data=data)


def pooled_name(plan: EmbedPlan) -> str | None:
    """The graph output an Embed response's pooled vector is, None for POOLING_NONE."""
    if plan.pooling == pb.POOLING_NONE:
        return None
    return pooled_output(POOLINGS[plan.pooling], plan.normalize)


def outputs_for(plan: EmbedPlan) -> Outputs:
    """The graph outputs an Embed response is built from: only the pooled vector unless
    the caller asked for token embeddings (attention maps are asked for by layer)."""
    names = {pooled_name(plan)} - {None}
    if plan.return_token_embeddings:
        names.add(HIDDEN_OUTPUT)
    return frozenset(names)


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
    name = pooled_name(plan)
    if name is not None:
        out.pooled.CopyFrom(tensor(result.pooled[name], plan.dtype))
    if plan.return_token_embeddings:
        out.token_embeddings.CopyFrom(tensor(result.hidden, plan.dtype))
    if plan.attention is not None:
        out.attentions.CopyFrom(tensor(attention_maps(result, plan), plan.dtype))
    return out


# --- sizes -----------------------------------------------------------------------------
# A response is sized before any work is done for it, from the lengths of its sequences,
# counting what the wire carries: the data, the shapes, the echoed ids, every field's tag
# and length prefix. Where a figure depends on values not known yet (the ids), it counts
# the largest, so the size is never under the real one (gRPC refused to send a response
# the old check had passed, after all its inference, and it was counted OK).

JSON_FLOAT_BYTES = 26
"""a float32 as JSON: up to 24 characters of repr (-1.1754943508222875e-38) and ", \""""
BASE64_FLOAT_BYTES = 6
"""a float32 as base64: 4 bytes are 5⅓ characters"""


def varint_bytes(value: int) -> int:
    return max(1, (int(value).bit_length() + 6) // 7)


def field_bytes(payload: int) -> int:
    """A length-delimited field of `payload` bytes with a one-byte tag (fields 1-15)."""
    return 1 + varint_bytes(payload) + payload


def tensor_bytes(shape: tuple[int, ...], value_bytes: float) -> int:
    """A pb.Tensor: its packed shape, its dtype, its data."""
    data = math.ceil(math.prod(shape) * value_bytes)
    return field_bytes(sum(varint_bytes(d) for d in shape)) + 2 + field_bytes(data)


def embedding_bytes(length: int, plan: EmbedPlan, hidden: int, heads: int, vocab: int,
                    value_bytes: float) -> int:
    """One pb.Embedding of a `length`-token sequence, ids counted at the largest."""
    total = field_bytes(length * varint_bytes(vocab - 1)) + 1 + varint_bytes(length)
    if pooled_name(plan) is not None:
        total += field_bytes(tensor_bytes((hidden,), value_bytes))
    if plan.return_token_embeddings:
        total += field_bytes(tensor_bytes((length, hidden), value_bytes))
    if plan.attention is not None:
        maps = (len(plan.attention.layers), plan.attention.returned_heads(heads), length, length)
        total += field_bytes(tensor_bytes(maps, value_bytes))
    return total


def embed_response_bytes(plan: EmbedPlan, lengths: np.ndarray, manifest: Manifest,
                         float_bytes: float | None = None) -> int:
    """The EmbedResponse for sequences of `lengths` tokens, in bytes; `float_bytes`: what
    each value takes where the response is re-encoded (JSON), if more than its dtype."""
    value_bytes = max(np.dtype(plan.dtype).itemsize, float_bytes or 0)
    counts = np.bincount(np.asarray(lengths, dtype=np.int64))
    total = field_bytes(len(manifest.model_name.encode())) + 1 + varint_bytes(int(lengths.sum()))
    for length in np.flatnonzero(counts).tolist():
        count = int(counts[length])
        one = embedding_bytes(length, plan, manifest.hidden_size, manifest.num_heads,
                              manifest.vocab_size, value_bytes)
        total += count * field_bytes(one)
    return total


def check_response_size(size: int, limit: int, advice: str, at_least: bool = False) -> int:
    """Refuse, before any work, a response the transport would refuse after all of it;
    returns `size`."""
    if size > limit:
        raise ResourceExhausted(
            f"response would be {'at least' if at_least else 'about'} "
            f"{size / (1 << 20):.1f} MiB, over the {limit / (1 << 20):.1f} MiB message "
            f"limit: {advice}")
    return size


EMBED_ADVICE = ("ask for fewer attention layers or heads, set average_heads, use "
                "dtype=DTYPE_FLOAT16, or send fewer texts")
