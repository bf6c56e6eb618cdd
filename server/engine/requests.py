"""What the engine takes and gives back: typed, protocol-neutral requests and results.

A door turns its wire format into one of these requests and renders the result in its own protocol. Where the
engine finds a fault in a request, it names the field with the door's own names (`Fields`), so an error
reaches each caller in the terms of the request it sent, with no rewriting."""

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from attnserve.server.errors import InvalidArgument, ResourceExhausted
from attnserve.server.priority import Priority, of_call
from attnserve.server.runtime.backend import HIDDEN_ONLY, Outputs, SequenceResult


@dataclass(frozen=True)
class Fields:
    """A request's field names as its door's callers write them: where the engine finds a
    fault, its error names the field in these terms (`texts[3]`, `input[3][5]`,
    `token_ids[3].ids[5]`, `inputs.sentences[1]`)."""

    sequences: str = "texts"
    """the field holding every text or id sequence (`texts`, `input`, `documents`)"""
    single: bool = False
    """the field holds one sequence (a lone string or id list): it is its own sequence 0"""
    token_at: str = "{sequence}[{position}]"
    """a token's field, from its sequence's (`{sequence}`), the sequence's index
    (`{index}`) and its position (`{position}`)"""
    query: str = "query"
    top_n: str = "top_n"
    chunking: str = "chunking"
    pair_at: str = "{sequence}.text_pair"
    """the field of an input's second text, from its sequence's (`{sequence}`) and index (`{index}`)"""
    top_k: str = "top_k"

    def sequence(self, index: int) -> str:
        return self.sequences if self.single else f"{self.sequences}[{index}]"

    def pair(self, index: int) -> str:
        return self.pair_at.format(sequence=self.sequence(index), index=index)

    def token(self, index: int, position: int) -> str:
        return self.token_at.format(sequence=self.sequence(index), index=index, position=position)


@dataclass(frozen=True)
class ResponseSize:
    """The size of a door's response, in its own encoding, before any work is done for
    it, and the most the door sends."""

    measure: Callable[[np.ndarray], int]
    """bytes of the response for sequences of these lengths, or with chunking for texts of
    these counts of chunks (never under the real size)"""
    limit: int
    advice: str
    """what the caller can change when the response would be too large"""

    def check(self, lengths: np.ndarray, at_least: bool = False) -> int:
        """The response's size for sequences of `lengths` (or at least those, with
        `at_least`); refused, before any work, when the door could not send it."""
        size = self.measure(lengths)
        if size > self.limit:
            raise ResourceExhausted(
                f"response would be {'at least' if at_least else 'about'} {size_text(size)}, "
                f"over the {size_text(self.limit)} message limit: {self.advice}")
        return size


def size_text(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB" if size >= 1 << 20 else f"{size / 1024:.1f} KiB"


class ChunkingMode(enum.Enum):
    LATE = "late"
    """the text runs whole, in overlapping windows; a chunk pools its tokens' contextual
    embeddings from the window where it has the most context on both sides"""
    ISOLATED = "isolated"
    """each chunk runs alone, with its own special tokens, pooled as the model pools a text"""

    def pooling(self, model_pooling: str) -> str:
        return "mean" if self is ChunkingMode.LATE else model_pooling


class TruncationDirection(enum.Enum):
    RIGHT = "right"
    """keep a text's start"""
    LEFT = "left"
    """keep its end"""


@dataclass(frozen=True)
class Chunking:
    """One vector per chunk of each text (server/engine/chunked.py)."""

    max_tokens: int
    """the most tokens in one chunk, special tokens aside"""
    mode: ChunkingMode = ChunkingMode.LATE
    window_overlap: int = 0
    """LATE: tokens shared by consecutive windows; 0: chunking.default_overlap"""


@dataclass(frozen=True)
class EmbedRequest:
    """Texts (tokenized by the engine) or token ids (taken as they are), and the graph
    outputs the response is built from."""

    names: Fields
    size: ResponseSize
    texts: Sequence[str] = ()
    token_ids: Sequence[Sequence[int]] = ()
    truncate: bool = False
    """cut sequences longer than the model's positions instead of refusing them"""
    truncation_direction: TruncationDirection = TruncationDirection.RIGHT
    """texts only: which end `truncate` keeps"""
    prompt_name: str | None = None
    """texts only: the prompt put before each; None: the model's default prompt"""
    outputs: Outputs = frozenset()
    """pooled outputs (artifact.pooled_output) of one pooling, and HIDDEN_OUTPUT, as the response needs"""
    dimensions: int = 0
    """cut each pooled vector to its first this many values (renormalised where it was
    normalised); 0: the hidden size"""
    layers: tuple[int, ...] = ()
    """attention maps to return, each layer once, in order"""
    chunking: Chunking | None = None
    """texts only; chunk vectors (ChunkingMode.pooling), normalised when `normalize`, instead of
    `outputs` and `layers` (which must be empty)"""
    normalize: bool = False
    """with chunking: L2-normalise each chunk's vector"""


@dataclass(frozen=True)
class ChunkedText:
    """One text's chunks, in text order."""

    num_tokens: int
    """the text's tokens, special tokens aside"""
    spans: np.ndarray
    """int64 [chunks, 2]: start, end in code points, end exclusive"""
    token_counts: np.ndarray
    """int64 [chunks]: tokens in each chunk"""
    vectors: np.ndarray
    """float32 [chunks, hidden]"""


@dataclass
class Embedded:
    ids: list[np.ndarray]
    """each sequence's token ids, special tokens included (none with chunking)"""
    lengths: np.ndarray
    """each sequence's length as run (with chunking: each window's or chunk's)"""
    results: list[SequenceResult]
    """in request order (none with chunking)"""
    chunked: list[ChunkedText] = field(default_factory=list)
    """with chunking: each text's chunks, in request order"""
    response_bytes: int = 0
    """the door's response, as its ResponseSize measured it"""

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def chunk_counts(self) -> np.ndarray:
        """each chunked text's count of chunks (none without chunking)"""
        return np.fromiter((len(c.spans) for c in self.chunked), np.int64, len(self.chunked))


@dataclass(frozen=True)
class RerankRequest:
    """A query and texts, each pair scored by a reranker (a cross-encoder)."""

    names: Fields
    size: ResponseSize
    """measures the response for the results of these text indexes"""
    query: str
    texts: Sequence[str]
    top_n: int | None = None
    """the best top_n only (1 or more); None: every text"""
    raw_scores: bool = False
    """the logit instead of its sigmoid"""
    truncate: bool = False
    """cut a pair's text (never its query) where the pair is longer than the model's
    positions, instead of refusing it"""
    max_text_tokens: int | None = None
    """every text cut to at most this many tokens (Cohere's max_tokens_per_doc)"""
    truncation_direction: TruncationDirection = TruncationDirection.RIGHT
    """which end of a text a cut keeps"""


@dataclass
class Reranked:
    order: np.ndarray
    """int64: the indexes of the texts returned, highest score first (equal scores in
    request order), top_n of them"""
    scores: np.ndarray
    """float32, in `order`'s order"""
    total_tokens: int
    """every pair's tokens, special tokens included"""
    response_bytes: int


@dataclass(frozen=True)
class SparseRequest:
    """Texts, each one sparse vector: its non-zero weights by token id."""

    names: Fields
    size: ResponseSize
    """measures the response for texts of these counts of entries"""
    texts: Sequence[str]
    truncate: bool = False
    truncation_direction: TruncationDirection = TruncationDirection.RIGHT
    prompt_name: str | None = None
    top_k: int | None = None
    """the top_k largest weights of each text only (1 or more); None: the model's default
    (its checkpoint's max_active_dims), or every non-zero weight"""


@dataclass
class SparseEmbedded:
    indices: list[np.ndarray]
    """int64: each text's token ids of non-zero weight, ascending"""
    values: list[np.ndarray]
    """float32: their weights, in the same order"""
    total_tokens: int
    response_bytes: int


@dataclass(frozen=True)
class ClassifyRequest:
    """Texts, each alone or with a second text (a pair, laid out as the tokenizer's pair
    template), every label of each scored by a classifier (or a reranker's one label)."""

    names: Fields
    size: ResponseSize
    """measures the response for this many inputs (the array's length)"""
    texts: Sequence[str]
    text_pairs: Sequence[str | None] = ()
    """each text's second text, or None; empty: every text alone"""
    activation: str | None = None
    """softmax, sigmoid or none (the logits: raw_scores); None: the model's"""
    truncate: bool = False
    """cut a text (a pair's second text) longer than the model's positions instead of refusing it"""
    truncation_direction: TruncationDirection = TruncationDirection.RIGHT
    top_k: int | None = None
    """checked here (1 or more); the door cuts each input's labels, best first, to it"""


@dataclass
class Classified:
    scores: np.ndarray
    """float32 [inputs, labels]: each input's score of every label, in label-id order"""
    total_tokens: int
    response_bytes: int

    def ranked(self, index: int, top_k: int | None = None) -> list[tuple[int, float]]:
        """Input `index`'s (label id, score), highest first, equal scores by id, the first
        `top_k` (None: every label)."""
        row = self.scores[index]
        order = np.argsort(-row, kind="stable")[:top_k]
        return list(zip(order.tolist(), row[order].tolist(), strict=True))


class ScoreMode(enum.Enum):
    COSINE = "cosine"
    """the cosine of the query's pooled vector (the model's default pooling) and each text's"""
    MAXSIM = "maxsim"
    """for each of the query's token vectors its best cosine with the text's, summed over the query's tokens
    (ColBERT's late interaction); every token counts, special tokens included"""


@dataclass(frozen=True)
class ScoreRequest:
    """A query and texts, each text scored against the query by an embedding model."""

    names: Fields
    size: ResponseSize
    """measures the response for texts of these lengths"""
    query: str
    texts: Sequence[str]
    mode: ScoreMode
    truncate: bool = False
    truncation_direction: TruncationDirection = TruncationDirection.RIGHT
    prompt_name: str | None = None
    """the prompt put before the query and each text; None: the model's default prompt"""


@dataclass
class Scored:
    scores: np.ndarray
    """float32, one per text, in request order"""
    total_tokens: int
    """the query's tokens and every text's"""
    response_bytes: int


@dataclass(frozen=True)
class TokenizeRequest:
    names: Fields
    texts: Sequence[str]
    truncate: bool = False
    truncation_direction: TruncationDirection = TruncationDirection.RIGHT
    prompt_name: str | None = None
    special_tokens: bool = True
    """close each text with the model's special tokens, as the model runs it"""


@dataclass(frozen=True)
class DecodeRequest:
    """Token ids back to text: each sequence's ids in the model's vocabulary."""

    names: Fields
    token_ids: Sequence[Sequence[int]]
    skip_special_tokens: bool = True


@dataclass(frozen=True)
class InputTensor:
    """One named int64 input tensor of shape [batch, seq], as a caller sent it: its data is
    read only once the request has passed every check its shapes allow."""

    name: str
    shape: tuple[int, int]
    data: bytes | Sequence[int]
    """little-endian int64 bytes, or the values, row-major"""


Shapes = list[tuple[str, tuple[int, ...]]]
"""each output named with its shape, as the engine decides them"""


class TensorAnswer(Protocol):
    """A door's answer to raw tensors, in its own encoding, for outputs of these shapes."""

    def size(self, shapes: Shapes) -> ResponseSize:
        """the answer's size, before any work is done for it"""

    def seconds(self, shapes: Shapes) -> float:
        """to encode the outputs (server/engine/offload.py's costs)"""

    def respond(self, outputs: list[tuple[str, np.ndarray]]) -> Any:
        """the answer, as the door sends it, from the (name, float32 array) outputs"""


@dataclass(frozen=True)
class TensorRequest:
    """Raw tensors in (the model's inputs: input_ids and attention_mask, a BERT reranker's
    token_type_ids), the outputs named, answered as the door encodes them."""

    inputs: Sequence[InputTensor]
    outputs: Sequence[str]
    """output names (`ModelInfo.outputs`); empty means the model's first"""
    answer: TensorAnswer
    names: Fields = Fields("input_ids", token_at="input_ids[{index}, {position}]")


@dataclass(eq=False)
class Submission:
    """One request's sequences, as a scheduler (the request queue, or the engine process's
    with --workers) queues and runs them; compared, as the queue's jobs are, by identity."""

    sequences: list[np.ndarray]
    lengths: np.ndarray | None = None
    """int64, each sequence's length; None: measured here"""
    layers: tuple[int, ...] = ()
    """the attention maps every result carries, by layer"""
    deadline: float | None = None
    """on the monotonic clock"""
    outputs: Outputs = HIDDEN_ONLY
    """the graph outputs the results must carry"""
    alone: float = 0.0
    """the peak of its largest batch run alone (ModelMemory.check), kept free while it waits"""
    spans: list[np.ndarray] | None = None
    """per sequence, int64 [k, 2] token ranges [start, end), ascending, not overlapping,
    none empty, whose mean embeddings each result carries (SequenceResult.span_means)
    beside `outputs` (which need not name the token embeddings the means are taken from)"""
    segments: np.ndarray | None = None
    """per sequence, where its second segment (token type 1) starts, its length for none
    (a reranker's pairs: the text's side)"""
    priority: Priority = field(default_factory=of_call)
    """its call's class: the one its door set for the call (server/priority.py)"""
    attended: np.ndarray | None = None
    """per sequence, how many of its first tokens the encoder attends to; the tokens past them run and return
    outputs but are masked as padding is (a ColBERT query's expansion tokens); None: every token"""

    def __post_init__(self) -> None:
        if self.lengths is None:
            self.lengths = lengths_of(self.sequences)


def check_cut(name: str, value: int | None, unset: str) -> None:
    """A request's top_k or top_n: 1 or more, or unset (`unset` says what it then keeps)."""
    if value is not None and value < 1:
        raise InvalidArgument(name, f"{value}; expected 1 or more (unset: {unset})")


def lengths_of(sequences: Sequence) -> np.ndarray:
    """int64: each sequence's (or text's) length."""
    return np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))


@dataclass(frozen=True)
class TensorInfo:
    name: str
    datatype: str
    shape: tuple[int, ...]
    """-1 for an axis of any size"""


@dataclass(frozen=True)
class ModelInfo:
    model: str
    hidden_size: int
    num_layers: int
    num_heads: int
    max_positions: int
    vocab_size: int
    default_pooling: str
    provider: str
    precision: str
    platform: str
    """the backend's framework and format (onnxruntime_onnx)"""
    family: str
    """the checkpoint's model_type (bert, roberta, xlm-roberta, modernbert)"""
    kind: str
    """embedder or reranker (artifact.KINDS)"""
    labels: list[str]
    """a reranker's labels, by id"""
    artifact_sha256: str
    inputs: list[TensorInfo] = field(default_factory=list)
    outputs: list[TensorInfo] = field(default_factory=list)
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    """the prompt a request that names none gets"""
    matryoshka_dims: list[int] = field(default_factory=list)
    """the sizes a pooled vector may be cut to besides embedding_size, largest first"""
    embedding_size: int = 0
    """the pooled vectors' size (past any Dense layers)"""
    heads: list[str] = field(default_factory=list)
    """an embedder's outputs: dense (pooled vectors), sparse"""
