"""The ranges int8 and uint8 embeddings are quantized over: each pooled output's
per-dimension range over the calibration texts, fitted once at export (docs/api.md,
"Output types"). Fitted per request, a dimension's levels would change with whatever else
the request carried, and a request of one text would have no range at all."""

from pathlib import Path

import numpy as np

from attnserve.artifact import POOLED_OUTPUTS, EmbeddingRanges
from attnserve.export.int8_texts import CALIBRATION_TEXTS
from attnserve.export.quantize import encode_texts
from attnserve.export.verify import session


def calibration_embeddings(graph: Path, tokenizer: Path, max_positions: int) -> dict[str, np.ndarray]:
    """Pooled output name -> float32 [texts, hidden]: each calibration text's vectors, the
    text run alone (no padding), as the server returns them for it."""
    runner, outputs = session(graph), list(POOLED_OUTPUTS)
    runs = [runner.run(outputs, {"input_ids": ids[None], "attention_mask": np.ones_like(ids)[None]})
            for ids, _ in encode_texts(tokenizer, CALIBRATION_TEXTS, max_positions)]
    return {name: np.stack([run[i][0] for run in runs]).astype(np.float32)
            for i, name in enumerate(POOLED_OUTPUTS)}


def fit_ranges(graph: Path, tokenizer: Path, max_positions: int) -> EmbeddingRanges:
    """Each pooled output's per-dimension least and greatest value over the calibration
    texts: sentence-transformers' ranges for those calibration embeddings."""
    embeddings = calibration_embeddings(graph, tokenizer, max_positions)
    return EmbeddingRanges(len(CALIBRATION_TEXTS), {
        name: [rows.min(axis=0).tolist(), rows.max(axis=0).tolist()]
        for name, rows in embeddings.items()})
