"""Scores from a model's outputs, protocol-neutral: a reranker's from its logits, an
embedding model's from its vectors (cosine of pooled vectors, MaxSim of token vectors),
and the ranking every rerank route returns."""

import numpy as np

from attnserve.server.engine.requests import PairNames

# A vector's norm is clamped here before dividing by it, as torch.nn.functional.normalize does.
NORM_EPS = 1e-12


def sigmoid(logits: np.ndarray) -> np.ndarray:
    """1 / (1 + e^-x), without overflow for large negative x."""
    x = logits.astype(np.float64)
    out = np.empty_like(x)
    positive = x >= 0
    out[positive] = 1 / (1 + np.exp(-x[positive]))
    e = np.exp(x[~positive])
    out[~positive] = e / (1 + e)
    return out.astype(np.float32)


def ranking(scores: np.ndarray, top_n: int | None) -> np.ndarray:
    """The indexes of `scores`, highest first and equal ones in their order, the first
    `top_n` of them (all with None)."""
    order = np.argsort(-scores, kind="stable")
    return order if top_n is None else order[:top_n]


def _normalized(vectors: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(vectors, axis=-1, keepdims=True)
    return vectors / np.maximum(norms, NORM_EPS)


def cosines(query: np.ndarray, texts: list[np.ndarray]) -> np.ndarray:
    """float32 [texts]: the cosine of the query's vector (hidden,) and each text's."""
    if not texts:
        return np.zeros(0, dtype=np.float32)
    return (_normalized(np.stack(texts)) @ _normalized(query)).astype(np.float32)


def maxsim(query: np.ndarray, texts: list[np.ndarray]) -> np.ndarray:
    """float32 [texts]: ColBERT's late interaction of the query's token vectors (q, hidden)
    with each text's (t, hidden): for each query token its best cosine among the text's
    tokens, summed over the query's tokens."""
    q = _normalized(query.astype(np.float32))
    return np.fromiter(((q @ _normalized(t.astype(np.float32)).T).max(axis=1).sum()
                        for t in texts), dtype=np.float32, count=len(texts))


class QueryThenTexts:
    """A score request's sequences as the engine runs them (the query first, then each
    text), named as the door names them: FieldNames over PairNames."""

    chunking = "chunking"

    def __init__(self, names: PairNames):
        self.names = names
        self.sequences = names.sequences

    def sequence(self, index: int) -> str:
        return self.names.query if index == 0 else self.names.sequence(index - 1)

    def token(self, index: int, position: int) -> str:
        return self.sequence(index)
