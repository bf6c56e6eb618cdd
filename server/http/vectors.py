"""How a JSON door writes its vectors, as the request asks (docs/api.md, "HTTP: OpenAI"):
OpenAI's `encoding_format`, `embedding_dtype`, and Cohere's `embedding_types`
(server/engine/quantize.py), each item's types in its own `embeddings` object and its
`embedding` left empty, so that no vector is sent twice."""

import base64
from dataclasses import dataclass

import numpy as np
from msgspec import UNSET

from attnserve.artifact import Manifest
from attnserve.server.engine.quantize import EmbeddingType, quantize, ranges_of
from attnserve.server.errors import InvalidArgument, quote
from attnserve.server.http.calls import JSON_FLOAT_BYTES
from attnserve.server.http.door import numbers
from attnserve.server.http.schemas import Embeddings

# The most one value takes in the body: a float32 JSON_FLOAT_BYTES, an int8 ("-128,"), a
# uint8 ("255,"); any value's bytes as base64 (4 characters for 3 bytes) at 2 characters a byte.
INT8_TEXT_BYTES, UINT8_TEXT_BYTES, BASE64_BYTES_PER_BYTE = 5, 4, 2
TYPE_KEY_BYTES = 16
"""'"ubinary":' and the brackets or quotes around a type's vector"""


@dataclass(frozen=True)
class VectorFormat:
    types: tuple[EmbeddingType, ...] = ()
    """Cohere's embedding types asked for; () for OpenAI's one float vector"""
    base64: bool = False
    float16: bool = False

    @classmethod
    def of(cls, body: Embeddings) -> "VectorFormat":
        base64, float16 = body.encoding_format == "base64", body.embedding_dtype == "float16"
        if float16 and not base64:
            raise InvalidArgument("embedding_dtype", "float16 travels as base64 only: set "
                                  "encoding_format to 'base64'")
        kinds = tuple(map(EmbeddingType, body.embedding_types or ()))
        for i, kind in enumerate(kinds):
            if kind in kinds[:i]:
                raise InvalidArgument(f"embedding_types[{i}]", f"{quote(kind.value)} is listed twice")
        return cls(kinds, base64, float16)

    def value_bytes(self, kind: EmbeddingType) -> float:
        if self.base64:
            return BASE64_BYTES_PER_BYTE * (2 if self.float16 and kind is EmbeddingType.FLOAT
                                            else kind.dtype.itemsize)
        return {np.dtype("<f4"): JSON_FLOAT_BYTES, np.dtype("i1"): INT8_TEXT_BYTES,
                np.dtype("u1"): UINT8_TEXT_BYTES}[kind.dtype]

    def vector_bytes(self, hidden: int) -> int:
        """The most one item's vectors take in the body."""
        kinds = self.types or (EmbeddingType.FLOAT,)
        return int(sum(TYPE_KEY_BYTES + k.dimensions(hidden) * self.value_bytes(k) for k in kinds))

    def ranges(self, manifest: Manifest, model: str, pooled: str,
               dimensions: int) -> dict[EmbeddingType, np.ndarray]:
        """The ranges the types asked for need, for the pooled output `pooled` cut to
        `dimensions` (0: whole): refused before any work when there are none to use."""
        return {kind: ranges_of(manifest, model, pooled, kind, "embedding_types", dimensions)
                for kind in self.types if kind.ranged}

    def _encoded(self, vector: np.ndarray, kind: EmbeddingType):
        if not self.base64:
            return numbers(vector)
        if kind is EmbeddingType.FLOAT:
            vector = vector.astype("<f2" if self.float16 else "<f4")
        return base64.b64encode(vector.tobytes()).decode()

    def fields(self, vectors: np.ndarray, ranges: dict[EmbeddingType, np.ndarray]) -> list[tuple]:
        """Each float32 vector of `vectors` [n, hidden] as its item's `embedding` and, with
        embedding types, `embeddings` (UNSET without)."""
        if not self.types:
            return [(self._encoded(v, EmbeddingType.FLOAT), UNSET) for v in vectors]
        typed = {kind: quantize(vectors, kind, ranges.get(kind)) for kind in self.types}
        empty = numbers(np.zeros(0, np.float32)) if not self.base64 else ""
        return [(empty, {kind.value: self._encoded(typed[kind][i], kind) for kind in self.types})
                for i in range(len(vectors))]
