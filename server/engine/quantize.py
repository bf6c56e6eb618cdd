"""Embeddings in fewer bits, as a caller asks for them (Cohere's `embedding_types`), the
same for every door (docs/api.md#output-types): quantized from the float32 vector the
caller would get as `float`, over the ranges of the same pooled output. int8 and uint8 are
sentence-transformers' `quantize_embeddings(..., precision, ranges=...)` operation for
operation in float32, so the two give the same bytes for the same vectors and ranges."""

import enum

import numpy as np

from attnserve.artifact import Manifest
from attnserve.server.errors import InvalidArgument, quote


class EmbeddingType(enum.Enum):
    FLOAT = "float"
    INT8 = "int8"
    UINT8 = "uint8"
    BINARY = "binary"
    UBINARY = "ubinary"

    @property
    def ranged(self) -> bool:
        """Quantized over the export's ranges."""
        return self in (EmbeddingType.INT8, EmbeddingType.UINT8)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype({EmbeddingType.FLOAT: "<f4", EmbeddingType.INT8: "i1",
                         EmbeddingType.UINT8: "u1", EmbeddingType.BINARY: "i1",
                         EmbeddingType.UBINARY: "u1"}[self])

    def dimensions(self, hidden: int) -> int:
        """Values of one vector of `hidden` dimensions."""
        return -(-hidden // 8) if self in (EmbeddingType.BINARY, EmbeddingType.UBINARY) else hidden


def ranges_of(manifest: Manifest, model: str, pooled: str, kind: EmbeddingType,
              field: str, dimensions: int = 0) -> np.ndarray | None:
    """float32 [2, vector size]: the ranges `kind` quantizes the pooled output `pooled` over
    (None for a kind that needs none); refused, naming `field`, for an artifact exported
    without them, and for vectors cut to fewer `dimensions` (0: the model's size), which
    are normalised again and so fall outside ranges fitted on whole vectors."""
    if not kind.ranged:
        return None
    if 0 < dimensions < manifest.embedding_size:
        raise InvalidArgument(field, f"{kind.value} quantizes over ranges fitted on whole "
                              f"{manifest.embedding_size}-dimension vectors, not on vectors cut to "
                              f"{dimensions}: ask for float, binary or ubinary with dimensions, "
                              "or leave dimensions unset")
    fitted = manifest.embedding_ranges
    if fitted is None or pooled not in fitted.ranges:
        raise InvalidArgument(field, f"{kind.value} needs the embedding ranges an export fits, "
                              f"and model {quote(model)} was exported without them (manifest "
                              f"format_version {manifest.format_version}): export it again "
                              "with attnserve export")
    return np.asarray(fitted.ranges[pooled], dtype=np.float32)


def quantize(vectors: np.ndarray, kind: EmbeddingType, ranges: np.ndarray | None) -> np.ndarray:
    """float32 [..., hidden] -> [..., kind.dimensions(hidden)] of kind.dtype."""
    if kind is EmbeddingType.FLOAT:
        return np.asarray(vectors, dtype=np.float32)
    if kind.ranged:
        starts = ranges[0, :]
        steps = (ranges[1, :] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        levels = np.clip(np.floor((vectors - starts) / steps), 0, 255)
        return levels.astype(np.uint8) if kind is EmbeddingType.UINT8 else (levels - 128).astype(np.int8)
    bits = np.packbits(vectors > 0, axis=-1)
    return bits if kind is EmbeddingType.UBINARY else (bits - 128).astype(np.int8)
