"""attnserve.v1.EncoderService, the gRPC door of our own API: texts or token ids in,
embeddings and attention maps out (their responses packed by encoder_pack.py); texts
ranked against a query (Rerank, Score), their requests and responses sized before any
work is done for them; through the data plane."""

import dataclasses
import enum
from collections.abc import Sequence

import numpy as np

from attnserve.artifact import (
    CLASSIFIER,
    EMBEDDER,
    RERANKER,
    SPARSE_OUTPUT,
    TOKEN_WEIGHTS_OUTPUT,
    Manifest,
    pooled_output,
)
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc
from attnserve.server.engine import classify, embed, pairs, sparse
from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.offload import COPY_BYTE_S, RESULT_S, TOKEN_S
from attnserve.server.engine.plane import DataPlane
from attnserve.server.engine.quantize import EmbeddingType, ranges_of
from attnserve.server.engine.requests import (
    Chunking,
    ChunkingMode,
    ClassifyRequest,
    EmbedRequest,
    Fields,
    RerankRequest,
    ResponseSize,
    ScoreMode,
    ScoreRequest,
    SparseRequest,
    TokenizeRequest,
    TruncationDirection,
)
from attnserve.server.engine.tokenize import Encoded
from attnserve.server.errors import InvalidArgument
from attnserve.server.grpc.calls import answer, answered, call_holds, deadline_of
from attnserve.server.grpc.encoder_pack import (
    POOLING_NAMES,
    SPARSE_ENTRY_BYTES,
    AttentionPlan,
    EmbedPlan,
    chunked_response_bytes,
    embed_response,
    embed_response_bytes,
    head_bytes,
    outputs_for,
    pooled_name,
)
from attnserve.server.grpc.wire import field_bytes
from attnserve.server.memory.ledger import Holds
from attnserve.server.metrics import Metrics


def _codes(prefix: str, values: type[enum.Enum], unspecified: enum.Enum) -> dict:
    """The protobuf enum's code `prefix`NAME for each of `values`, and UNSPECIFIED's."""
    codes = {getattr(pb, prefix + value.name): value for value in values}
    return {getattr(pb, f"{prefix}UNSPECIFIED"): unspecified, **codes}


DTYPES = {pb.DTYPE_UNSPECIFIED: np.float32, pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_FLOAT16: np.float16}
EMBEDDING_TYPES = _codes("EMBEDDING_TYPE_", EmbeddingType, EmbeddingType.FLOAT)
EMBED_ADVICE = ("ask for fewer attention layers or heads, set average_heads, use "
                "dtype=DTYPE_FLOAT16, or send fewer texts")
CHUNKED_ADVICE = "raise chunking.max_tokens, use dtype=DTYPE_FLOAT16, or send less text"
TOKENIZE_ADVICE = "send fewer texts per request"
CHUNKING_MODES = _codes("CHUNKING_MODE_", ChunkingMode, ChunkingMode.LATE)
DIRECTIONS = _codes("TRUNCATION_DIRECTION_", TruncationDirection, TruncationDirection.RIGHT)
TEXTS = Fields("texts", token_at="{sequence}")
IDS = Fields("token_ids", token_at="{sequence}.ids[{position}]")
SCORE_MODES = {pb.SCORE_MODE_COSINE: ScoreMode.COSINE, pb.SCORE_MODE_MAXSIM: ScoreMode.MAXSIM}
RERANK_ADVICE = "set top_n, leave return_texts unset, or send fewer texts"
CLASSIFY = Fields("inputs", token_at="{sequence}.text", pair_at="{sequence}.text_pair")
CLASSIFY_ADVICE = "set top_k, or send fewer inputs"
# A SparseVector's entry (its length prefix) and its two packed fields' tags and lengths,
# at the largest.
SPARSE_VECTOR_BYTES = (1 + 5) + 2 * (1 + 5)
# One label's score: its id (a uint32), its score (a float) and its label's length prefix,
# each with its tag, in a Classification's length-prefixed entry.
LABEL_BYTES = field_bytes((1 + 5) + (1 + 4) + (1 + 5))
# One result's index (a uint32) and score (a float), each with its one-byte tag, and the
# text's tag and length prefix (at the largest, 5 bytes).
RESULT_BYTES = (1 + 5) + (1 + 4) + (1 + 5)
# A UTF-8 character takes at most this many bytes.
UTF8_MAX = 4


class IdLists(Sequence):
    """A request's TokenIds entries as lists of ids, each read when the data plane reads it
    (off the event loop for a big request)."""

    def __init__(self, entries):
        self.entries = entries

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, index: int):
        return self.entries[index].ids


def _indexes(values, count: int, field: str, what: str) -> tuple[int, ...]:
    resolved = []
    for i, value in enumerate(values):
        if not -count <= value < count:
            raise InvalidArgument(f"{field}[{i}]", f"{what} {value} does not exist: the model has {count} "
                                  f"{what}s (0..{count - 1}, or -1..-{count} from the end)")
        index = value % count
        if index in resolved:
            raise InvalidArgument(f"{field}[{i}]", f"{what} {value} is listed twice")
        resolved.append(index)
    return tuple(resolved)


def _tokenization(e: Encoded) -> pb.Tokenization:
    return pb.Tokenization(ids=e.ids.tolist(), tokens=e.tokens,
                           offsets=[x for pair in e.offsets for x in pair])


def _known(codes: dict, value: int, field: str):
    if value not in codes:
        raise InvalidArgument(field, f"unknown value {value}")
    return codes[value]


def direction(value: int) -> TruncationDirection:
    return _known(DIRECTIONS, value, "truncation_direction")


def plan_embed(request: pb.EmbedRequest, manifest: Manifest, model: str) -> EmbedPlan:
    """Validate everything but the sequences themselves (the data plane reads those)."""
    if bool(request.texts) == bool(request.token_ids):
        which = "both are set" if request.texts else "both are empty"
        raise InvalidArgument("texts/token_ids", f"{which}; set exactly one of them")
    if request.pooling not in pb.Pooling.values():
        raise InvalidArgument("pooling", f"unknown value {request.pooling}")
    if request.dtype not in DTYPES:
        raise InvalidArgument("dtype", f"{pb.DType.Name(request.dtype)} is what a pooled vector's "
                              "embedding_type is sent as, not a dtype: set embedding_type"
                              if request.dtype in pb.DType.values()
                              else f"unknown value {request.dtype}")
    kind = _known(EMBEDDING_TYPES, request.embedding_type, "embedding_type")
    # A model without dense vectors (SPLADE, ColBERT) pools nothing unless asked: the data
    # plane refuses a pooling, or a request for none of its heads, naming the model.
    pooling = request.pooling or (POOLING_NAMES.get(manifest.default_pooling, pb.POOLING_MEAN)
                                  if manifest.dense else pb.POOLING_NONE)
    if pooling == pb.POOLING_LAST_TOKEN and pooled_output("lasttoken", False) not in manifest.pooled_outputs:
        raise InvalidArgument("pooling", f"POOLING_LAST_TOKEN: model {model!r} was exported without "
                              f"last-token vectors (manifest format_version "
                              f"{manifest.format_version}): export it again")
    attention = None
    if request.HasField("attention"):
        options = request.attention
        layers = _indexes(options.layers, manifest.num_layers, "attention.layers", "layer")
        heads = _indexes(options.heads, manifest.num_heads, "attention.heads", "head")
        attention = AttentionPlan(layers or tuple(range(manifest.num_layers)), heads or None,
                                  options.average_heads)
    plan = EmbedPlan(pooling, request.normalize, request.return_token_embeddings, DTYPES[request.dtype],
                     attention, _chunking(request, manifest), **_heads(request, manifest, model))
    if kind is EmbeddingType.FLOAT:
        return plan
    source = (pooled_output(plan.chunking.mode.pooling(manifest.default_pooling), plan.normalize)
              if plan.chunking else pooled_name(plan))
    if source is None:
        raise InvalidArgument("embedding_type", "sets what the pooled vector is sent as, and "
                              "pooling is POOLING_NONE: ask for a pooling")
    ranges = ranges_of(manifest, model, source, kind, "embedding_type", request.dimensions)
    return dataclasses.replace(plan, embedding_type=kind, ranges=ranges)


def _heads(request: pb.EmbedRequest, manifest: Manifest, model: str) -> dict:
    """EmbedPlan's multi-vector and sparse fields, as the request asks for them of the
    model's heads."""
    heads = ", ".join(manifest.heads)
    plan = {}
    for field, asked, present in (("return_multi_vector", request.return_multi_vector,
                                   manifest.multi_vector),
                                  ("return_sparse", request.return_sparse,
                                   manifest.sparse or manifest.lexical)):
        if asked and present is None:
            raise InvalidArgument(field, f"model {model!r} has no {field[7:].replace('_', '-')} "
                                  f"head (its heads: {heads})")
        if asked and request.HasField("chunking"):
            raise InvalidArgument(field, "not with chunking, which returns one vector per chunk")
    if request.return_multi_vector:
        plan["multi_vector"] = (manifest.multi_vector.dim, manifest.multi_vector.skip_leading)
    if request.return_sparse:
        plan["sparse"] = SPARSE_OUTPUT if manifest.sparse else TOKEN_WEIGHTS_OUTPUT
        plan["dropped_ids"] = tuple(manifest.lexical.dropped_token_ids if manifest.lexical else ())
    return plan


def _chunking(request: pb.EmbedRequest, manifest: Manifest) -> Chunking | None:
    """The request's chunking, its fields checked against the rest of the request (the
    data plane checks their values against the model)."""
    if not request.HasField("chunking"):
        return None
    options = request.chunking
    mode = _known(CHUNKING_MODES, options.mode, "chunking.mode")
    pooling = POOLING_NAMES[mode.pooling(manifest.default_pooling)]
    if request.pooling not in (pb.POOLING_UNSPECIFIED, pooling):
        raise InvalidArgument("pooling", f"{mode.value} chunk vectors are pooled by "
                              f"{pb.Pooling.Name(pooling)} (late: each chunk's mean; isolated: "
                              "the model's pooling): leave pooling unset or set that with chunking")
    if request.return_token_embeddings:
        raise InvalidArgument("return_token_embeddings", "not with chunking, which returns one "
                              "vector per chunk; ask for token embeddings without it")
    if request.HasField("attention"):
        raise InvalidArgument("attention", "not with chunking, which returns one vector per "
                              "chunk; ask for attention maps without it")
    return Chunking(options.max_tokens, mode, options.window_overlap)


class EncoderService(pb_grpc.EncoderServiceServicer):
    def __init__(self, plane: DataPlane, metrics: Metrics, max_message_bytes: int):
        self.plane, self.metrics, self.max_message_bytes = plane, metrics, max_message_bytes
        # Per model, the smallest Tokenization (an empty text's): a request's cheap size bound.
        self.least_tokenization = {name: _tokenization(m.tokenizer.empty).ByteSize()
                                   for name, m in plane.models.items()}

    async def _embed(self, request: pb.EmbedRequest, holds: Holds,
                     deadline: float | None) -> pb.EmbedResponse:
        model = self.plane.model(request.model)
        manifest = model.manifest
        plan = plan_embed(request, manifest, model.name)
        measure, advice = ((chunked_response_bytes, CHUNKED_ADVICE) if plan.chunking
                           else (embed_response_bytes, EMBED_ADVICE))
        size = ResponseSize(lambda counts: measure(plan, counts, manifest, model.name),
                            self.max_message_bytes, advice)
        embedded = await embed.embed(model, EmbedRequest(
            names=TEXTS if request.texts else IDS, size=size, texts=request.texts,
            token_ids=IdLists(request.token_ids), truncate=request.truncate,
            truncation_direction=direction(request.truncation_direction),
            prompt_name=request.prompt_name, outputs=outputs_for(plan), dimensions=request.dimensions,
            layers=plan.attention.graph_layers if plan.attention else (),
            chunking=plan.chunking, normalize=plan.normalize), holds, deadline)
        results = int(embedded.chunk_counts.sum()) if plan.chunking else len(embedded.ids)
        return await model.pack(results * RESULT_S + embedded.response_bytes * COPY_BYTE_S,
                                embed_response, embedded, plan, model.name)

    @answered
    async def Embed(self, request, context):
        return await self._embed(request, call_holds(), deadline_of(context))

    async def EmbedStream(self, request_iterator, context):
        holds = call_holds()
        async for request in request_iterator:
            # Each answer's memory is held until it has been written: the stream takes
            # the next request only then, so a caller that stops reading holds one.
            before = holds.total
            try:
                yield await answer(self.metrics, "EmbedStream", context,
                                   lambda request=request: self._embed(
                                       request, holds, deadline_of(context)), request.priority)
            finally:
                holds.give_back(holds.total - before)

    @answered
    async def Tokenize(self, request, context):
        model = self.plane.model(request.model)
        count, least = len(request.texts), self.least_tokenization[model.name]
        ResponseSize(lambda _: count * field_bytes(least), self.max_message_bytes,
                     TOKENIZE_ADVICE).check(None, at_least=True)
        holds = call_holds()
        encoded = await embed.tokenize(model, TokenizeRequest(
            TEXTS, request.texts, request.truncate, direction(request.truncation_direction),
            request.prompt_name), holds)

        def answer() -> pb.TokenizeResponse:
            response = pb.TokenizeResponse(model=model.name)
            for e in encoded:  # one at a time, as Embed's
                response.tokenizations.append(_tokenization(e))
            size = response.ByteSize()
            ResponseSize(lambda _: size, self.max_message_bytes, TOKENIZE_ADVICE).check(None)
            model.hold_response(holds, size)
            return response

        return await model.pack(count * RESULT_S + sum(len(e.ids) for e in encoded) * TOKEN_S, answer)

    @answered
    async def GetModelInfo(self, request, context):
        return _info(self.plane.model(request.model))

    @answered
    async def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[_info(m) for m in self.plane.models.values()],
                                     default_model=self.plane.default.name)

    @answered
    async def Rerank(self, request, context):
        model = self.plane.model(request.model, kind=RERANKER)
        texts = request.texts

        def measure(indexes: np.ndarray) -> int:
            total = head_bytes(model.name) + len(indexes) * field_bytes(RESULT_BYTES)
            if request.return_texts:
                total += UTF8_MAX * sum(len(texts[i]) for i in indexes.tolist())
            return total

        reranked = await pairs.rerank(model, RerankRequest(
            TEXTS, ResponseSize(measure, self.max_message_bytes, RERANK_ADVICE), request.query, texts,
            request.top_n if request.HasField("top_n") else None, request.raw_scores, request.truncate),
            call_holds(), deadline_of(context))

        def answer() -> pb.RerankResponse:
            response = pb.RerankResponse(model=model.name, total_tokens=reranked.total_tokens)
            for index, score in zip(reranked.order.tolist(), reranked.scores.tolist(), strict=True):
                response.results.append(pb.RerankResult(
                    index=index, score=score, text=texts[index] if request.return_texts else ""))
            return response

        seconds = len(reranked.order) * RESULT_S + reranked.response_bytes * COPY_BYTE_S
        return await model.pack(seconds, answer)

    @answered
    async def Score(self, request, context):
        model = self.plane.model(request.model, kind=EMBEDDER)
        if request.mode not in SCORE_MODES:
            what = (pb.ScoreMode.Name(request.mode) if request.mode in pb.ScoreMode.values()
                    else f"unknown value {request.mode}")
            raise InvalidArgument("mode", f"{what}; name one: SCORE_MODE_COSINE or SCORE_MODE_MAXSIM")
        size = ResponseSize(lambda lengths: head_bytes(model.name) + field_bytes(4 * len(lengths)),
                            self.max_message_bytes, "send fewer texts")
        scored = await pairs.score(model, ScoreRequest(
            TEXTS, size, request.query, request.texts, SCORE_MODES[request.mode], request.truncate),
            call_holds(), deadline_of(context))
        return await model.pack(len(scored.scores) * RESULT_S, lambda: pb.ScoreResponse(
            scores=scored.scores.tolist(), model=model.name, total_tokens=scored.total_tokens))

    @answered
    async def Classify(self, request, context):
        model = self.plane.model(request.model, kind=CLASSIFIER)
        inputs = request.inputs
        top_k = request.top_k if request.HasField("top_k") else None
        # Every label's name at its longest, as each input's answer may carry them all.
        per_input = field_bytes(sum(LABEL_BYTES + UTF8_MAX * len(label) for label in model.manifest.labels))
        head = head_bytes(model.name)
        classified = await classify.classify(model, ClassifyRequest(
            CLASSIFY, ResponseSize(lambda counts: head + len(counts) * per_input, self.max_message_bytes,
                                   CLASSIFY_ADVICE),
            [i.text for i in inputs], [i.text_pair if i.HasField("text_pair") else None for i in inputs],
            "none" if request.raw_scores else None, request.truncate, direction(request.truncation_direction),
            top_k), call_holds(), deadline_of(context))

        def answer() -> pb.ClassifyResponse:
            labels = model.manifest.labels
            response = pb.ClassifyResponse(model=model.name, total_tokens=classified.total_tokens)
            for index in range(len(classified.scores)):
                response.classifications.add(scores=[pb.LabelScore(id=label, label=labels[label], score=score)
                                                     for label, score in classified.ranked(index, top_k)])
            return response

        return await model.pack(classified.scores.size * RESULT_S, answer)

    @answered
    async def EmbedSparse(self, request, context):
        model = self.plane.model(request.model)
        head = head_bytes(model.name)
        size = ResponseSize(lambda counts: head + len(counts) * SPARSE_VECTOR_BYTES + SPARSE_ENTRY_BYTES
                            * int(counts.sum()), self.max_message_bytes, "set top_k, or send fewer texts")
        embedded = await sparse.embed_sparse(model, SparseRequest(
            TEXTS, size, request.texts, request.truncate, direction(request.truncation_direction),
            request.prompt_name, request.top_k if request.HasField("top_k") else None),
            call_holds(), deadline_of(context))
        return await model.pack(embedded.response_bytes * COPY_BYTE_S, lambda: pb.EmbedSparseResponse(
            vectors=[pb.SparseVector(indices=i.tolist(), values=v.tolist())
                     for i, v in zip(embedded.indices, embedded.values, strict=True)],
            model=model.name, total_tokens=embedded.total_tokens))


def _info(model: ServedModel) -> pb.GetModelInfoResponse:
    info = model.model_info()
    # The fields named as the response's, and those it names or encodes otherwise.
    same = {name: getattr(info, name) for name in pb.GetModelInfoResponse.DESCRIPTOR.fields_by_name
            if hasattr(info, name)}
    return pb.GetModelInfoResponse(**same | dict(
        default_pooling=POOLING_NAMES[info.default_pooling], execution_provider=info.provider,
        labels={str(i): label for i, label in enumerate(info.labels)},
        default_prompt_name=info.default_prompt_name or ""))
