"""Texts through a model with a multi-vector (ColBERT) head: each text's vectors, one a token it keeps, as the
checkpoint's library makes them.

A ColBERT checkpoint (PyLate's, sentence-transformers' MultiVectorEncoder) tokenizes a query and a document
each its own way (artifact.MultiVectorInput): a marker before the text, a length it is cut to (the closing
special token kept), and for a query, expansion to a fixed length with the mask token, whose positions return
vectors too, attended to or masked as padding is. A document's punctuation (its skiplist) returns none. bge-m3
tokenizes every text alike and leaves out its [CLS]'s vector. The vectors come back from the graph at every
position; which ones a caller gets is decided here."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from attnserve.artifact import MULTI_VECTOR_OUTPUT, MultiVectorInput
from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.pooling import unit
from attnserve.server.engine.requests import lengths_of
from attnserve.server.errors import InvalidArgument, quote
from attnserve.server.memory.ledger import Holds
from attnserve.server.runtime.backend import SequenceResult

SIDES = ("query", "document")


@dataclass
class Tokens:
    """Texts tokenized for one side of a multi-vector head."""

    ids: list[np.ndarray]
    lengths: np.ndarray
    attended: np.ndarray
    """per sequence, the tokens the encoder attends to"""


def side_of(model: ServedModel, name: str | None, field: str) -> MultiVectorInput | None:
    """The tokenization `name` (a request's prompt_name: query or document) asks of a model
    whose multi-vector head tokenizes the two apart; None for one that tokenizes every
    text alike (bge-m3's), which takes the model's prompts as any text does."""
    head = model.manifest.multi_vector
    if head is None or (head.query is None and head.document is None):
        return None
    if name not in SIDES:
        raise InvalidArgument(field, f"{quote(name or '')}; {model.name!r} tokenizes queries "
                              "and documents apart (its markers, lengths, query expansion): "
                              "name one, query or document")
    return getattr(head, name)


async def tokenize(model: ServedModel, texts: Sequence[str], name: str, side: MultiVectorInput,
                   field_of: Callable[[int], str], holds: Holds) -> Tokens:
    """Each text as side `name` tokenizes it: its marker (export keeps it as the
    checkpoint's prompt of that name), cut to its length, a query expanded."""
    prompt = model.tokenizer.prompts[name] if side.prompt else None
    encoded = await model.tokenize(texts, True, field_of, holds, prompt=prompt)
    ids, attended = [], []
    for e in encoded:
        sequence = e.ids
        if side.max_length is not None and sequence.size > side.max_length:
            sequence = np.concatenate([sequence[:side.max_length - 1], sequence[-1:]])
        real = sequence.size
        if side.expand_to is not None and real < side.expand_to:
            sequence = np.concatenate([sequence, np.full(side.expand_to - real,
                                                         side.expansion_token_id, np.int64)])
        ids.append(sequence)
        attended.append(sequence.size if side.expansion_attended else real)
    return Tokens(ids, lengths_of(ids), np.asarray(attended, np.int64))


def keep(model: ServedModel, results: list[SequenceResult], ids: list[np.ndarray],
         side: MultiVectorInput | None) -> None:
    """Each result's multi-vector rows cut to the tokens that return one: past the head's
    leading positions, none of the side's skiplist."""
    head = model.manifest.multi_vector
    skipped = side.skiplist_ids if side is not None else []
    for result, sequence in zip(results, ids, strict=True):
        kept = np.arange(sequence.size) >= head.skip_leading
        if skipped:  # most models skip none: no set lookup per sequence
            kept &= ~np.isin(sequence, skipped)
        result.pooled[MULTI_VECTOR_OUTPUT] = result.pooled[MULTI_VECTOR_OUTPUT][kept]


def maxsim(query: np.ndarray, texts: list[np.ndarray], mean: bool, normalize: bool) -> np.ndarray:
    """float32 [texts]: ColBERT's late interaction: each query vector's best dot product among a
    text's vectors, summed over the query's vectors, or their mean with `mean`. A cosine where
    the vectors are unit vectors: a head's are; `normalize` makes them so (hidden states), one
    text at a time rather than a copy of every text's at once."""
    if normalize:
        query = unit(query.astype(np.float32))
    scores = np.fromiter(((query @ (unit(t.astype(np.float32)) if normalize else t).T).max(axis=1).sum()
                          if len(t) else 0.0 for t in texts), dtype=np.float32, count=len(texts))
    return scores / len(query) if mean else scores
