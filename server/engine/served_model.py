"""One served model, protocol-neutral: embed, tokenize, decode, rerank, score, infer on
tensors, model info.

Typed requests in (server/engine/requests.py), typed results or typed errors out.
Everything a request goes through between its door and the model's batch loop happens
here, once, for every door: readiness, the cheap bounds before any work (entry counts,
queue room, the response's size), tokenizing or reading ids, the memory budget and the
call's holds, the deadline, and the choice of what runs inline and what on a pool
(server/engine/offload.py). A chunked request (server/engine/chunked.py) goes through the
same steps, its texts cut into chunks and run as windows or chunks. An embedder embeds and
scores texts against a query from their vectors (cosine, MaxSim); a reranker scores
(query, text) pairs, each pair one sequence batched with every other of its model; each
refuses the other's calls, naming what it is.

It hands sequences to its model's scheduler (the request queue and batch loop in this
process, or the engine process's with `--workers`) and gets back each sequence's share of
a batch's outputs. The doors find a model through the data plane (data_plane.py).
"""

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import numpy as np

from attnserve.artifact import (
    EMBEDDER,
    HIDDEN_OUTPUT,
    LOGITS_OUTPUT,
    RERANKER,
    TOKEN_TYPES,
    Artifact,
    attention_output,
    pooled_output,
)
from attnserve.server.engine import timings
from attnserve.server.engine.chunked import TextPlan, window_overlap
from attnserve.server.engine.chunking import cut
from attnserve.server.engine.offload import (
    CHUNK_S,
    COPY_BYTE_S,
    CUT_CHAR_S,
    DECODE_ID_S,
    ID_SEQUENCE_S,
    MAXSIM_S,
    POOLED_S,
    SPAN_S,
    TEXT_CHAR_S,
    TEXT_S,
    TOKEN_ID_S,
    Offload,
    cost,
)
from attnserve.server.engine.pooling import POOLED, finish, prompt_spans, to_dimensions
from attnserve.server.engine.requests import (
    ChunkedText,
    Chunking,
    ChunkingMode,
    DecodeRequest,
    Embedded,
    EmbedRequest,
    FieldNames,
    Inferred,
    InferRequest,
    InputTensor,
    ModelInfo,
    PairNames,
    Reranked,
    RerankRequest,
    ResponseSize,
    Scored,
    ScoreMode,
    ScoreRequest,
    TensorInfo,
    TokenizeRequest,
    TruncationDirection,
)
from attnserve.server.engine.scores import QueryThenTexts, cosines, maxsim, ranking, sigmoid
from attnserve.server.engine.tokenize import (
    KEPT_BYTES_PER_ID,
    Encoded,
    Prompt,
    TextTokenizer,
    TooLong,
)
from attnserve.server.errors import InvalidArgument, Unavailable, quote
from attnserve.server.memory.budget import ModelMemory
from attnserve.server.memory.ledger import Holds
from attnserve.server.metrics import Metrics
from attnserve.server.priority import DEFAULT, Priority, of_call
from attnserve.server.runtime.backend import HIDDEN_ONLY, Outputs, Placement, SequenceResult

ALL_ATTENTIONS = "attentions"
"""the output holding every layer's attention maps, stacked: [layers, batch, heads, seq, seq]"""
T = TypeVar("T")
# An input tensor's values (not raw bytes) are read this many at a time.
VALUES_SLICE = 1 << 16
NOT_SERVING = ("server is not serving (starting, or draining): send the request to another "
               "replica")
KINDS_SAID = {EMBEDDER: ("an embedding model", "it embeds texts and scores them against a query "
                                               "from their vectors (Embed, Score)"),
              RERANKER: ("a reranker (a cross-encoder)", "it scores (query, text) pairs (Rerank)")}
"""kind -> (what it is, what it does), as a refusal says them"""
# A refusal names at most this many of a model's prompts.
PROMPTS_LISTED = 16


class Scheduler(Protocol):
    """Where sequences go to be run: the request queue (server/engine/queue.py)."""

    def admit(self, tokens: int, at_least: bool = False) -> None:
        """Refuse (ResourceExhausted, Unavailable) a request the queue has no room for."""
        ...

    async def submit(self, sequences: list[np.ndarray], layers: tuple[int, ...] = (),
                     deadline: float | None = None, outputs: Outputs = HIDDEN_ONLY,
                     alone: float = 0.0, lengths: np.ndarray | None = None,
                     spans: list[np.ndarray] | None = None,
                     segments: np.ndarray | None = None,
                     priority: Priority = DEFAULT) -> list[SequenceResult]:
        ...


class ServedModel:
    def __init__(self, name: str, artifact: Artifact, tokenizer: TextTokenizer,
                 scheduler: Scheduler, memory: ModelMemory, placement: Placement,
                 offload: Offload, metrics: Metrics, ready: Callable[[], bool],
                 max_chunking_chars: int, default_prompt: str | None = None):
        """`default_prompt`: the name of the prompt a request that names none gets."""
        self.name = name
        """what callers name it by"""
        self.artifact = artifact
        self.manifest = artifact.manifest
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.memory = memory
        self.offload = offload
        self.metrics = metrics
        self.placement = placement
        self.ready = ready
        """() -> bool: warmed up and the server not draining"""
        self.max_chunking_chars = max_chunking_chars
        """the longest text a chunked request may carry"""
        self.default_prompt = default_prompt
        m = self.manifest
        self.kind = m.kind
        self.dimensions = sorted({m.hidden_size, *m.matryoshka_dims}, reverse=True)
        """the sizes a pooled vector may be cut to"""
        if m.kind == RERANKER:
            self.output_layers = {LOGITS_OUTPUT: ()}
        else:
            self.output_layers = {HIDDEN_OUTPUT: ()} | {ALL_ATTENTIONS: tuple(range(m.num_layers))}
            self.output_layers |= {attention_output(i): (i,) for i in range(m.num_layers)}

    # --- shared by every call -------------------------------------------------------

    def check_ready(self) -> None:
        """New work only while serving: UNAVAILABLE before warm-up ends and while draining."""
        if not self.ready():
            raise Unavailable(NOT_SERVING)

    def require(self, kind: str, call: str) -> None:
        """Refuse a call (`call`, as the door names it) that a model of another kind does
        not serve, naming the model's kind."""
        if self.kind != kind:
            what, does = KINDS_SAID[self.kind]
            raise InvalidArgument("model", f"{self.name!r} is {what}: {does}; {call} takes "
                                  f"{KINDS_SAID[kind][0]} (ListModels and GetModelInfo say "
                                  "each model's kind)")

    def hold_response(self, holds: Holds, size: int, on_top: float = 0.0) -> None:
        """Hold a response of `size` bytes (several times over: see RESPONSE_COPIES) until
        it has been sent."""
        holds.take(self.memory.response_copies * size, "the response", on_top=on_top)

    async def pack(self, seconds: float, build: Callable[..., T], *args) -> T:
        """`build(*args)`: a door's response built from a result, inline when it costs
        less than offload.INLINE_S, else on the responses pool."""
        with self.metrics.stage_duration.labels(self.name, "respond").time(), \
                timings.stage("respond"):
            return await self.offload.response(seconds, build, *args)

    def prompt(self, name: str | None, texts: bool = True) -> Prompt | None:
        """The prompt a request names (`prompt_name`), or the default one when it names
        none; `texts`: the request carries texts (token ids are run as sent)."""
        if not name:
            return self.tokenizer.prompts[self.default_prompt] if texts and self.default_prompt else None
        prompts = self.tokenizer.prompts
        if name not in prompts:
            known = list(prompts)
            listed = ", ".join(map(repr, known[:PROMPTS_LISTED])) + (
                f" and {len(known) - PROMPTS_LISTED} more" if len(known) > PROMPTS_LISTED else "")
            raise InvalidArgument("prompt_name", f"{quote(name)} is not a prompt of "
                                  f"{self.name!r}; " + (f"its prompts: {listed}" if known else
                                                        "it has none"))
        if not texts:
            raise InvalidArgument("prompt_name", "a prompt goes before texts: token ids are "
                                  "run as sent")
        return prompts[name]

    def _left(self, direction: TruncationDirection, texts: bool) -> bool:
        if direction is TruncationDirection.RIGHT:
            return False
        if not texts:
            raise InvalidArgument("truncation_direction", "left truncation keeps a text's "
                                  "special tokens: send texts, or cut token ids yourself")
        return True

    def _dimensions(self, request: EmbedRequest) -> int:
        """The size pooled vectors are cut to, checked; 0: the hidden size (no cut)."""
        dimensions = request.dimensions
        if dimensions in (0, self.manifest.hidden_size):
            return 0
        if not self.manifest.matryoshka_dims:
            raise InvalidArgument("dimensions", f"{quote(dimensions)}; {self.name!r} declares no "
                                  "Matryoshka sizes: omit dimensions or set it to its one size, "
                                  f"{self.manifest.hidden_size}")
        if dimensions not in self.dimensions:
            raise InvalidArgument("dimensions", f"{quote(dimensions)}; {self.name!r} takes "
                                  f"{', '.join(map(str, self.dimensions))}")
        if request.chunking is None and not set(request.outputs) & POOLED.keys():
            raise InvalidArgument("dimensions", "cuts the pooled vector: ask for one")
        return dimensions

    def _prompt_pooling(self, prompt: Prompt | None, outputs) -> str | None:
        """The pooling that must leave the prompt's tokens out of these outputs, if any."""
        if prompt is None or self.manifest.include_prompt:
            return None
        return next((POOLED[name][0] for name in outputs if name in POOLED), None)

    async def _run(self, sequences: list[np.ndarray], lengths: np.ndarray,
                   field_of: Callable[[int], str], layers: tuple[int, ...], outputs: Outputs,
                   response_bytes: int, holds: Holds, deadline: float | None,
                   spans: list[np.ndarray] | None = None, segments: np.ndarray | None = None,
                   kept_bytes: int = 0) -> list[SequenceResult]:
        """Check the request against the memory budget, hold its response (and
        `kept_bytes` of results kept until it is built), and wait for its sequences'
        results; `field_of(i)`: the request's field sequence i comes from."""
        longest = int(lengths.argmax())
        alone = self.memory.check(int(lengths[longest]), field_of(longest), len(layers),
                                  response_bytes)
        on_top = alone if self.memory.shared else 0.0
        self.hold_response(holds, response_bytes, on_top=on_top)
        if kept_bytes:
            holds.take(kept_bytes, "the token vectors kept until scored", on_top=on_top)
        if (times := timings.current()) is not None:
            times.compute_tokens += int(lengths.sum())
        return await self.scheduler.submit(sequences, layers, deadline, outputs, alone, lengths,
                                           spans, segments, priority=of_call())

    # --- embed ------------------------------------------------------------------------

    async def embed(self, request: EmbedRequest, holds: Holds, deadline: float | None) -> Embedded:
        self.check_ready()
        self.require(EMBEDDER, "embedding")
        names = request.names
        count = len(request.texts) or len(request.token_ids)
        if not count:
            raise InvalidArgument(names.sequences, "empty: send at least one sequence")
        texts = bool(request.texts)
        prompt = self.prompt(request.prompt_name, texts)
        left = self._left(request.truncation_direction, texts)
        dimensions = self._dimensions(request)
        if request.chunking is not None:
            return await self._embed_chunked(request, prompt, dimensions, holds, deadline)
        # The cheap bounds first, from the count of sequences alone (each has at least an
        # empty text's tokens, or one id): a request that cannot be served is refused
        # before any text is tokenized or any id read.
        least = len(self.tokenizer.empty.ids) if texts else 1
        self.scheduler.admit(count * least, at_least=True)
        request.size.check(np.full(count, least), at_least=True)
        if texts:
            encoded = await self._tokenize(request.texts, request.truncate, names, holds, False,
                                           prompt, left)
            ids = [e.ids for e in encoded]
            lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        else:
            with timings.stage("tokenize"):
                ids, lengths = await self.offload.request(
                    cost(request.token_ids, ID_SEQUENCE_S, TOKEN_ID_S), self._read_ids,
                    request.token_ids, request.truncate, names)
        size = request.size.check(lengths)
        results = await self._run_pooled(ids, lengths, names.sequence, request.layers,
                                         request.outputs, size, holds, deadline, prompt, dimensions)
        return Embedded(ids, lengths, results, response_bytes=size)

    async def _run_pooled(self, sequences: list[np.ndarray], lengths: np.ndarray,
                          field_of: Callable[[int], str], layers: tuple[int, ...],
                          outputs: Outputs, response_bytes: int, holds: Holds,
                          deadline: float | None, prompt: Prompt | None, dimensions: int,
                          spans: list[np.ndarray] | None = None) -> list[SequenceResult]:
        """`_run`, the pooled vectors among `outputs` as the request asks for them: without
        the prompt's tokens where the model's pooling leaves them out (a span a sequence,
        in place of the graph's pooled output), cut to `dimensions` (0: whole)."""
        pooled = [name for name in outputs if name in POOLED]
        pooling = self._prompt_pooling(prompt, pooled)
        if pooling is not None:
            outputs = outputs - set(pooled)
            spans = await self.offload.request(len(lengths) * SPAN_S, prompt_spans, lengths,
                                               prompt.length, pooling)
        results = await self._run(sequences, lengths, field_of, layers, outputs, response_bytes,
                                  holds, deadline, spans)
        if pooling is not None or dimensions:
            await self.offload.request(len(results) * POOLED_S, finish, results, pooled,
                                       pooling is not None, dimensions)
        return results

    # --- embed, chunked -----------------------------------------------------------------

    async def _embed_chunked(self, request: EmbedRequest, prompt: Prompt | None, dimensions: int,
                             holds: Holds, deadline: float | None) -> Embedded:
        """Each text cut into chunks and run as its windows (LATE) or chunks (ISOLATED),
        under the same bounds as any request, each as soon as it can be known: the queue
        and the response from the count of texts, the response again from the count of
        chunks, the queue from the tokens of every window, the memory budget from the
        longest. A prompt's tokens run in every window or chunk, after its leading special
        tokens."""
        names, texts, chunking = request.names, request.texts, request.chunking
        if request.token_ids:
            raise InvalidArgument(names.chunking, "chunking cuts texts into chunks: send texts, "
                                  "not token ids")
        head = self.tokenizer.head_ids if prompt is None else np.concatenate(
            (self.tokenizer.head_ids, prompt.ids))
        specials = len(head) + len(self.tokenizer.tail_ids)
        width = self.manifest.max_positions - specials  # a window's tokens, specials aside
        overlap = window_overlap(chunking, names, width)
        # A text may have no tokens, and so no chunks.
        self.scheduler.admit(0, at_least=True)
        request.size.check(np.zeros(len(texts), dtype=np.int64), at_least=True)
        with self.metrics.stage_duration.labels(self.name, "tokenize").time(), \
                timings.stage("tokenize"):
            plans = await self.offload.request(
                cost(texts, TEXT_S, TEXT_CHAR_S + CUT_CHAR_S), self._plan_chunks, texts,
                chunking, width, overlap, names, request.size, holds)
        size = request.size.check(np.fromiter((p.chunks.count for p in plans), np.int64, len(plans)))
        per_text = [p.lengths(specials) for p in plans]
        lengths = np.concatenate(per_text)
        late = chunking.mode is ChunkingMode.LATE
        results: list[SequenceResult] = []
        if len(lengths):
            self.scheduler.admit(int(lengths.sum()))
            sequences, spans = await self.offload.request(
                cost(plans, CHUNK_S, CHUNK_S, lambda p: p.chunks.count), self._sequences,
                plans, late, head, holds)
            text_of = np.repeat(np.arange(len(plans)), list(map(len, per_text)))
            # LATE: the chunks' means from their windows' spans; ISOLATED: each chunk's
            # pooled vector. Cut to `dimensions` with the rest of the chunk vectors.
            outputs = frozenset() if late else frozenset({pooled_output("mean", request.normalize)})
            results = await self._run_pooled(
                sequences, lengths, lambda i: names.sequence(int(text_of[i])), (), outputs, size,
                holds, deadline, prompt, 0, spans)
        return Embedded([], lengths, [], await self.offload.request(
            cost(plans, CHUNK_S, CHUNK_S, lambda p: p.chunks.count), self._chunk_vectors, plans,
            list(map(len, per_text)), results, request.normalize, dimensions), size)

    def _plan_chunks(self, texts: Sequence[str], chunking: Chunking, width: int, overlap: int,
                     names: FieldNames, size: ResponseSize, holds: Holds) -> list[TextPlan]:
        """Each text tokenized whole, cut into chunks and (LATE) placed in windows of
        `width` tokens that overlap by `overlap`."""
        max_tokens = chunking.max_tokens
        limit = self.max_chunking_chars
        for i, text in enumerate(texts):
            if len(text) > limit:
                raise InvalidArgument(names.sequence(i), f"{len(text)} characters, more than "
                                      f"the {limit} a text to chunk may have on this server "
                                      "(--max-chunking-chars): split it")
        tokens = self.tokenizer.encode_whole(texts, holds)
        # Before any cutting: each text has at least this many chunks.
        size.check(np.fromiter((-(-len(t.ids) // max_tokens) for t in tokens), np.int64,
                               len(tokens)), at_least=True)
        plans = []
        for text, text_tokens in zip(texts, tokens, strict=True):
            chunks = cut(text, text_tokens, max_tokens)
            plans.append(TextPlan.late(text_tokens, chunks, width, overlap)
                         if chunking.mode is ChunkingMode.LATE
                         else TextPlan.isolated(text_tokens, chunks))
        return plans

    def _sequences(self, plans: list[TextPlan], late: bool, head: np.ndarray,
                   holds: Holds) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """Every plan's sequences, each after the ids `head`, and, for windows (`late`), the
        chunks' token spans in each."""
        tail = self.tokenizer.tail_ids
        sequences: list[np.ndarray] = []
        spans: list[np.ndarray] = []
        for plan in plans:
            sequences += plan.sequences(head, tail)
            if late:
                spans += plan.spans(len(head))
        holds.take(KEPT_BYTES_PER_ID * sum(map(len, sequences)), "token ids")
        return sequences, spans if late else None

    def _chunk_vectors(self, plans: list[TextPlan], counts: list[int],
                       results: list[SequenceResult], normalize: bool,
                       dimensions: int) -> list[ChunkedText]:
        """Each text's chunks and their vectors, cut to `dimensions` (0: whole); `counts`:
        the sequences each plan ran."""
        pooled, hidden = pooled_output("mean", normalize), self.manifest.hidden_size
        out, at = [], 0
        for plan, count in zip(plans, counts, strict=True):
            vectors = to_dimensions(plan.vectors(results[at:at + count], pooled, normalize,
                                                 hidden), dimensions, normalize)
            out.append(ChunkedText(len(plan.tokens.ids), plan.chunks.spans,
                                   plan.chunks.token_counts, vectors))
            at += count
        return out

    def _read_ids(self, token_ids: Sequence[Sequence[int]], truncate: bool,
                  names: FieldNames) -> tuple[list[np.ndarray], np.ndarray]:
        """Caller-supplied ids, taken as they are (the caller adds special tokens), and
        their lengths: a Python loop over the sequences, which lets the interpreter go
        between them. A sequence longer than the model takes is refused, or only its first
        max_positions ids are read."""
        limit = self.manifest.max_positions
        sequences = []
        lengths = np.empty(len(token_ids), dtype=np.int64)
        for i, entry in enumerate(token_ids):
            count = len(entry)
            if count == 0:
                raise InvalidArgument(names.sequence(i), "empty sequence")
            if count > limit and not truncate:
                raise InvalidArgument(
                    names.sequence(i), f"{count} tokens, longer than the model's {limit} "
                    "positions; set truncate=true to cut it")
            ids = self._vocabulary_ids(entry[:limit] if count > limit else entry, i, names)
            sequences.append(ids)
            lengths[i] = ids.size
        return sequences, lengths

    def _vocabulary_ids(self, entry: Sequence[int], index: int, names: FieldNames) -> np.ndarray:
        """Sequence `index`'s ids as int64, refused (naming the first) where one lies outside
        the vocabulary."""
        vocab = self.manifest.vocab_size
        try:
            ids = np.asarray(entry, dtype=np.int64)
        except OverflowError:  # an integer past int64 (JSON's are unbounded)
            ids = np.asarray([min(max(int(x), -1), vocab) for x in entry], np.int64)
        bad = np.flatnonzero((ids < 0) | (ids >= vocab))
        if bad.size:
            j = int(bad[0])
            raise InvalidArgument(names.token(index, j), f"id {quote(entry[j])} is outside the "
                                  f"vocabulary [0, {vocab})")
        return ids

    # --- rerank: (query, text) pairs through a cross-encoder ---------------------------

    async def rerank(self, request: RerankRequest, holds: Holds, deadline: float | None) -> Reranked:
        """Each (query, text) pair one sequence, scored by the classifier's one label
        (its sigmoid, or its logit with raw_scores); the texts ranked by score."""
        self.check_ready()
        self.require(RERANKER, "rerank")
        names, labels = request.names, self.manifest.labels
        if len(labels) != 1:
            raise InvalidArgument("model", f"{self.name!r} has {len(labels)} labels "
                                  f"({', '.join(map(repr, labels[:8]))}): rerank ranks by one "
                                  "score; its logits come from KServe infer")
        self._check_pair_request(request.query, request.texts, names)
        if request.top_n is not None and request.top_n < 1:
            raise InvalidArgument(names.top_n, f"{request.top_n}; expected 1 or more (unset: "
                                  "every text)")
        count = len(request.texts)
        shown = count if request.top_n is None else min(count, request.top_n)
        least = self.tokenizer.pair.specials + 1  # an empty text's pair with a one-token query
        self.scheduler.admit(count * least, at_least=True)
        with self.metrics.stage_duration.labels(self.name, "tokenize").time():
            ids, segments, size = await self.offload.request(
                cost(request.texts, TEXT_S, TEXT_CHAR_S), self._pairs, request, shown, holds)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        results = await self._run(ids, lengths, names.sequence, (), frozenset({LOGITS_OUTPUT}),
                                  size, holds, deadline, segments=segments)
        logits = np.fromiter((r.pooled[LOGITS_OUTPUT][0] for r in results), np.float32, count)
        scores = logits if request.raw_scores else sigmoid(logits)
        order = ranking(scores, request.top_n)
        return Reranked(order, scores[order], int(lengths.sum()), size)

    def _check_pair_request(self, query: str, texts: Sequence[str], names: PairNames) -> None:
        if not query:
            raise InvalidArgument(names.query, "empty: send the query to score the texts against")
        if not texts:
            raise InvalidArgument(names.sequences, "empty: send at least one text")

    def _pairs(self, request: RerankRequest, shown: int,
               holds: Holds) -> tuple[list[np.ndarray], np.ndarray | None, int]:
        """The pairs' ids and segments, and the response's size: measured for the `shown`
        longest texts, which no top_n of them can outgrow."""
        texts = request.texts
        chars = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
        size = request.size.check(np.argsort(-chars, kind="stable")[:shown])
        try:
            ids, segments = self.tokenizer.encode_pairs(request.query, texts, request.truncate,
                                                        holds, request.max_text_tokens)
        except TooLong as err:
            field = request.names.query if err.index < 0 else request.names.sequence(err.index)
            raise InvalidArgument(field, err.reason) from err
        return ids, segments, size

    # --- score: texts against a query from an embedding model's vectors ---------------

    async def score(self, request: ScoreRequest, holds: Holds, deadline: float | None) -> Scored:
        """The query and each text embedded (pooled vectors for COSINE, every token's for
        MAXSIM, which never leave the server), each text scored against the query."""
        self.check_ready()
        self.require(EMBEDDER, "scoring")
        names = request.names
        self._check_pair_request(request.query, request.texts, names)
        count = len(request.texts)
        least = len(self.tokenizer.empty.ids)
        self.scheduler.admit((count + 1) * least, at_least=True)
        request.size.check(np.full(count, least), at_least=True)
        sequences = QueryThenTexts(names)
        # The query and the texts get the default prompt, as Embed would give them.
        prompt = self.prompt(None)
        encoded = await self._tokenize([request.query, *request.texts], request.truncate,
                                       sequences, holds, False, prompt)
        ids = [e.ids for e in encoded]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        size = request.size.check(lengths[1:])
        hidden = self.manifest.hidden_size
        if request.mode is ScoreMode.MAXSIM:
            # Every token's vector (float32) is kept until the texts are scored.
            results = await self._run(ids, lengths, sequences.sequence, (), HIDDEN_ONLY, size,
                                      holds, deadline, kept_bytes=4 * hidden * int(lengths.sum()))
            work = MAXSIM_S * hidden * int(lengths[0]) * int(lengths[1:].sum())
            scores = await self.offload.response(work, maxsim, results[0].hidden,
                                                 [r.hidden for r in results[1:]])
        else:
            name = pooled_output(self.manifest.default_pooling, True)
            results = await self._run_pooled(ids, lengths, sequences.sequence, (),
                                             frozenset({name}), size, holds, deadline, prompt, 0)
            scores = await self.offload.response(count * hidden * COPY_BYTE_S, cosines,
                                                 results[0].pooled[name],
                                                 [r.pooled[name] for r in results[1:]])
        return Scored(scores, int(lengths.sum()), size)

    # --- tokenize ---------------------------------------------------------------------

    async def _tokenize(self, texts: Sequence[str], truncate: bool, names: FieldNames,
                        holds: Holds, details: bool, prompt: Prompt | None = None,
                        left: bool = False, special_tokens: bool = True) -> list[Encoded]:
        try:
            with self.metrics.stage_duration.labels(self.name, "tokenize").time(), \
                    timings.stage("tokenize"):
                return await self.offload.request(
                    cost(texts, TEXT_S, TEXT_CHAR_S), self.tokenizer.encode, texts, truncate,
                    holds, details, prompt, left, special_tokens)
        except TooLong as err:
            raise InvalidArgument(names.sequence(err.index), err.reason) from err

    async def tokenize(self, request: TokenizeRequest, holds: Holds) -> list[Encoded]:
        """Ids, tokens, character offsets and special-token flags of each text; the door
        holds its response."""
        self.check_ready()
        if not request.texts:
            raise InvalidArgument(request.names.sequences, "empty: send at least one text")
        prompt = self.prompt(request.prompt_name)
        left = self._left(request.truncation_direction, True)
        return await self._tokenize(request.texts, request.truncate, request.names, holds, True,
                                    prompt, left, request.special_tokens)

    # --- decode -----------------------------------------------------------------------

    async def decode(self, request: DecodeRequest, holds: Holds) -> list[str]:
        """Each id sequence as text; the door holds its response."""
        self.check_ready()
        if not request.token_ids:
            raise InvalidArgument(request.names.sequences, "empty: send at least one sequence")
        return await self.offload.request(
            cost(request.token_ids, ID_SEQUENCE_S, TOKEN_ID_S + DECODE_ID_S), self._decode,
            request, holds)

    def _decode(self, request: DecodeRequest, holds: Holds) -> list[str]:
        names = request.names
        for i, entry in enumerate(request.token_ids):
            if not entry:
                raise InvalidArgument(names.sequence(i), "empty sequence")
            self._vocabulary_ids(entry, i, names)
        return self.tokenizer.decode(request.token_ids, request.skip_special_tokens, holds)

    # --- infer on tensors -------------------------------------------------------------

    async def infer(self, request: InferRequest, holds: Holds, deadline: float | None) -> Inferred:
        """input_ids and attention_mask (and a reranker's token_type_ids, where its graph
        takes them), INT64 [batch, seq], each row's mask ones then zeros (and its token
        types zeros then ones); the outputs asked for, each row zero past its length, so
        no computed padding reaches the caller."""
        self.check_ready()
        # The cheap checks first, from the declared shapes: no id is read for a request
        # that cannot be served.
        batch, seq = self._input_shape(request.inputs)
        names, layers = self._output_names(request.outputs)
        self.scheduler.admit(batch, at_least=True)
        shapes = [(name, self._output_shape(name, layers, batch, seq)) for name in names]
        response_bytes = request.size(shapes).check(np.zeros(0, np.int64))
        with timings.stage("tokenize"):
            sequences, lengths, segments = await self.offload.request(
                batch * (ID_SEQUENCE_S + seq * len(self.manifest.inputs) * TOKEN_ID_S), self._rows,
                request.inputs, batch, seq)
        outputs = frozenset({LOGITS_OUTPUT if self.kind == RERANKER else HIDDEN_OUTPUT})
        results = await self._run(sequences, lengths, _INFER_NAMES.sequence, layers, outputs,
                                  response_bytes, holds, deadline, segments=segments)
        with timings.stage("respond"):
            dense = await self.offload.response(
                response_bytes * COPY_BYTE_S, self._dense, shapes, layers, results)
        return Inferred(dense)

    def _input_shape(self, inputs: Sequence[InputTensor]) -> tuple[int, int]:
        """(batch, seq), from the inputs' declared shapes and sizes alone."""
        expected = list(self.manifest.inputs)
        names = [t.name for t in inputs[:len(expected) + 1]]
        if sorted(names) != sorted(expected):
            shown = ", ".join(quote(n) for n in names) + (" …" if len(inputs) > len(names) else "")
            raise InvalidArgument("inputs", f"got [{shown}], expected exactly {expected}")
        shapes = []
        for i, t in enumerate(inputs):
            field = f"inputs[{i}] ({t.name})"
            if t.datatype != "INT64":
                raise InvalidArgument(field, f"datatype {quote(t.datatype)}, expected INT64")
            shape = tuple(t.shape[:3])
            if len(shape) != 2 or min(shape) < 1:
                raise InvalidArgument(field, f"shape {list(t.shape[:8])}, expected [batch ≥ 1, "
                                      "seq ≥ 1]")
            count = shape[0] * shape[1]
            raw = isinstance(t.data, bytes | bytearray | memoryview)
            given = len(t.data) // 8 if raw else len(t.data)
            if given != count or (raw and len(t.data) % 8):
                what = f"{len(t.data)} raw bytes" if raw else f"{given} values"
                raise InvalidArgument(field, f"{what}, shape {list(shape)} INT64 needs "
                                      f"{count * 8 if raw else count}{' bytes' if raw else ''}")
            shapes.append(shape)
        ids = names.index("input_ids")
        for i, shape in enumerate(shapes):
            if shape != shapes[ids]:
                raise InvalidArgument(names[i], f"shape {list(shape)} differs from input_ids "
                                      f"{list(shapes[ids])}")
        batch, seq = shapes[0]
        if seq > self.manifest.max_positions:
            raise InvalidArgument("input_ids", f"seq {seq} is longer than the model's "
                                  f"{self.manifest.max_positions} positions")
        return batch, seq

    def _output_names(self, outputs: Sequence[str]) -> tuple[list[str], tuple[int, ...]]:
        known = self.output_layers
        if len(outputs) > len(known):
            raise InvalidArgument("outputs", f"{len(outputs)} named; the model has {len(known)}, "
                                  "each to be named once")
        names = list(outputs) or [next(iter(known))]
        layers: set[int] = set()
        for i, name in enumerate(names):
            if name not in known:
                listed = (LOGITS_OUTPUT if self.kind == RERANKER else
                          f"{HIDDEN_OUTPUT}, {ALL_ATTENTIONS}, attentions.0 … "
                          f"attentions.{self.manifest.num_layers - 1}")
                raise InvalidArgument(f"outputs[{i}]", f"unknown output {quote(name)}; known: "
                                      f"{listed}")
            if name in names[:i]:
                raise InvalidArgument(f"outputs[{i}]", f"{quote(name)} is named twice")
            layers.update(known[name])
        return names, tuple(sorted(layers))

    def _output_shape(self, name: str, layers: tuple[int, ...], batch: int,
                      seq: int) -> tuple[int, ...]:
        m = self.manifest
        if name == LOGITS_OUTPUT:
            return batch, len(m.labels)
        if name == HIDDEN_OUTPUT:
            return batch, seq, m.hidden_size
        if name == ALL_ATTENTIONS:
            return len(layers), batch, m.num_heads, seq, seq
        return batch, m.num_heads, seq, seq

    def _rows(self, inputs: Sequence[InputTensor], batch: int,
              seq: int) -> tuple[list[np.ndarray], np.ndarray, np.ndarray | None]:
        """Each row's ids up to its length, the lengths, and where each row's second
        segment starts (with token types)."""
        arrays = {}
        for t in inputs:
            if isinstance(t.data, bytes | bytearray | memoryview):
                array = np.frombuffer(t.data, dtype="<i8")
            else:
                # A slice at a time, letting the interpreter go between them.
                try:
                    array = np.concatenate([
                        np.asarray(t.data[start:start + VALUES_SLICE], dtype=np.int64)
                        for start in range(0, len(t.data), VALUES_SLICE)])
                except OverflowError as err:
                    raise InvalidArgument(t.name, "a value is outside INT64's range") from err
            arrays[t.name] = array.reshape(batch, seq).astype(np.int64, copy=False)
        ids, mask = arrays["input_ids"], arrays["attention_mask"]
        if not np.isin(mask, (0, 1)).all():
            raise InvalidArgument("attention_mask", "values must be 0 or 1")
        lengths = mask.sum(axis=1)
        ones_then_zeros = (np.arange(seq)[None, :] < lengths[:, None]).astype(mask.dtype)
        bad_rows = (lengths == 0) | (mask != ones_then_zeros).any(axis=1)
        if bad_rows.any():
            raise InvalidArgument(f"attention_mask[{int(np.argmax(bad_rows))}]",
                                  "must be ones then zeros, with at least one one")
        vocab = self.manifest.vocab_size
        bad = np.argwhere((ids < 0) | (ids >= vocab))
        if bad.size:
            r, c = (int(x) for x in bad[0])
            raise InvalidArgument(f"input_ids[{r}, {c}]", f"id {int(ids[r, c])} is outside the "
                                  f"vocabulary [0, {vocab})")
        segments = None if TOKEN_TYPES not in arrays else _segments(arrays[TOKEN_TYPES], lengths)
        return ([ids[row, :length] for row, length in enumerate(lengths.tolist())], lengths,
                segments)

    def _dense(self, shapes: list[tuple[str, tuple[int, ...]]], layers: tuple[int, ...],
               results: list[SequenceResult]) -> list[tuple[str, np.ndarray]]:
        """The outputs asked for, each row zero past its sequence's length."""
        out = []
        for name, shape in shapes:
            array = np.zeros(shape, dtype="<f4")
            if name == LOGITS_OUTPUT:
                for row, r in enumerate(results):
                    array[row] = r.pooled[LOGITS_OUTPUT]
            elif name == HIDDEN_OUTPUT:
                for row, r in enumerate(results):
                    array[row, :len(r.hidden)] = r.hidden
            else:
                wanted = layers if name == ALL_ATTENTIONS else self.output_layers[name]
                stacked = array if name == ALL_ATTENTIONS else array[None]
                for row, r in enumerate(results):
                    n = len(r.hidden)
                    for k, layer in enumerate(wanted):
                        stacked[k, row, :, :n, :n] = r.attentions[layer]
            out.append((name, array))
        return out

    # --- model info -------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        m = self.manifest
        if self.kind == RERANKER:
            outputs = [TensorInfo(LOGITS_OUTPUT, "FP32", (-1, len(m.labels)))]
        else:
            outputs = [TensorInfo(HIDDEN_OUTPUT, "FP32", (-1, -1, m.hidden_size)),
                       TensorInfo(ALL_ATTENTIONS, "FP32", (m.num_layers, -1, m.num_heads, -1, -1))]
            outputs += [TensorInfo(attention_output(i), "FP32", (-1, m.num_heads, -1, -1))
                        for i in range(m.num_layers)]
        return ModelInfo(
            model=self.name, hidden_size=m.hidden_size, num_layers=m.num_layers,
            num_heads=m.num_heads, max_positions=m.max_positions, vocab_size=m.vocab_size,
            default_pooling=m.default_pooling, provider=self.placement.provider,
            precision=self.placement.precision, platform=self.placement.platform,
            family=m.model_type, kind=m.kind, labels=list(m.labels),
            artifact_sha256=self.artifact.manifest_sha256,
            inputs=[TensorInfo(name, "INT64", (-1, -1)) for name in m.inputs],
            outputs=outputs, prompts=dict(m.prompts), default_prompt_name=self.default_prompt,
            matryoshka_dims=list(m.matryoshka_dims))


def _segments(types: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Where each row's token types turn from 0 to 1 (its length for none): within a row's
    length they must be zeros then ones; past it they are padding, not read."""
    batch, seq = types.shape
    real = np.arange(seq)[None, :] < lengths[:, None]
    ones = (types == 1) & real
    starts = np.where(ones.any(axis=1), ones.argmax(axis=1), lengths)
    expected = (np.arange(seq)[None, :] >= starts[:, None]) & real
    bad = (((types != 0) & (types != 1)) & real) | ((types == 1) != expected) & real
    if bad.any():
        row, column = (int(x) for x in np.argwhere(bad)[0])
        raise InvalidArgument(f"token_type_ids[{row}, {column}]",
                              f"{int(types[row, column])}; each row's token types must be 0 "
                              "then 1 (the query's side, then the text's) over its length")
    return starts.astype(np.int64)


class _InferNames:
    """Rows of the input tensors, as both KServe doors name them."""

    sequences = "input_ids"

    def sequence(self, index: int) -> str:
        return f"input_ids[{index}]"

    def token(self, index: int, position: int) -> str:
        return f"input_ids[{index}, {position}]"


_INFER_NAMES = _InferNames()
