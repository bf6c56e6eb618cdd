"""EmbedRequest -> a validated plan, or an InvalidArgument that names the field."""

from dataclasses import dataclass

import numpy as np

from attnserve.artifact import Manifest
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server.errors import InvalidArgument

POOLING_NAMES = {"mean": pb.POOLING_MEAN, "cls": pb.POOLING_CLS}
DTYPES = {pb.DTYPE_UNSPECIFIED: np.float32, pb.DTYPE_FLOAT32: np.float32,
          pb.DTYPE_FLOAT16: np.float16}


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
    pooling: int
    normalize: bool
    return_token_embeddings: bool
    dtype: type
    attention: AttentionPlan | None


def _indexes(values, count: int, field: str, what: str) -> tuple[int, ...]:
    resolved = []
    for i, value in enumerate(values):
        if not -count <= value < count:
            raise InvalidArgument(
                f"{field}[{i}]", f"{what} {value} does not exist: the model has {count} {what}s "
                f"(0..{count - 1}, or -1..-{count} from the end)")
        index = value % count
        if index in resolved:
            raise InvalidArgument(f"{field}[{i}]", f"{what} {value} is listed twice")
        resolved.append(index)
    return tuple(resolved)


def plan_embed(request: pb.EmbedRequest, manifest: Manifest) -> EmbedPlan:
    """Validate everything but the sequences themselves."""
    if bool(request.texts) == bool(request.token_ids):
        which = "both are set" if request.texts else "both are empty"
        raise InvalidArgument("texts/token_ids", f"{which}; set exactly one of them")
    if request.pooling not in pb.Pooling.values():
        raise InvalidArgument("pooling", f"unknown value {request.pooling}")
    if request.dtype not in DTYPES:
        raise InvalidArgument("dtype", f"unknown value {request.dtype}")
    pooling = request.pooling or POOLING_NAMES.get(manifest.default_pooling, pb.POOLING_MEAN)
    attention = None
    if request.HasField("attention"):
        options = request.attention
        layers = _indexes(options.layers, manifest.num_layers, "attention.layers", "layer")
        heads = _indexes(options.heads, manifest.num_heads, "attention.heads", "head")
        attention = AttentionPlan(layers or tuple(range(manifest.num_layers)), heads or None,
                                  options.average_heads)
    return EmbedPlan(pooling, request.normalize, request.return_token_embeddings,
                     DTYPES[request.dtype], attention)


def token_id_sequences(request: pb.EmbedRequest, manifest: Manifest) -> tuple[list[np.ndarray], np.ndarray]:
    """Caller-supplied ids, taken as they are (the caller adds special tokens), and their
    lengths. Run off the event loop: a Python loop over the sequences, which lets the
    interpreter go between them; a sequence longer than the model takes is refused, or
    only its first max_positions ids are read."""
    limit = manifest.max_positions
    sequences = []
    lengths = np.empty(len(request.token_ids), dtype=np.int64)
    for i, entry in enumerate(request.token_ids):
        count = len(entry.ids)
        if count == 0:
            raise InvalidArgument(f"token_ids[{i}]", "empty sequence")
        if count > limit and not request.truncate:
            raise InvalidArgument(
                f"token_ids[{i}]", f"{count} tokens, longer than the model's {limit} "
                "positions; set truncate=true to cut it")
        ids = np.asarray(entry.ids[:limit] if count > limit else entry.ids, dtype=np.int64)
        bad = np.flatnonzero((ids < 0) | (ids >= manifest.vocab_size))
        if bad.size:
            j = int(bad[0])
            raise InvalidArgument(
                f"token_ids[{i}].ids[{j}]",
                f"id {int(ids[j])} is outside the vocabulary [0, {manifest.vocab_size})")
        sequences.append(ids)
        lengths[i] = ids.size
    return sequences, lengths
