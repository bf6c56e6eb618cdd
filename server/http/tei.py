"""Text Embeddings Inference's HTTP API (TEI 1.9, its router/src/http) through the data
plane: POST /embed, POST / (TEI routes its root by the model's kind: an embedder's is
/embed, a reranker's /rerank), POST /embed_all, POST /tokenize, POST /decode, GET /info,
POST /rerank and POST /similarity. TEI serves one model and has no field or header that
names one: the embedding routes serve the server's default model; /rerank and /similarity
the first model of the kind they take, or, beyond TEI's fields, the one `model` names.

Bodies and answers are TEI's, and so is its rule for a field it does not know: ignored,
as serde ignores it. `inputs` is a string, a list of token ids (the model's vocabulary,
special tokens included), or a list of either (of one kind in one request here); /embed
answers a list of vectors (the model's pooling, normalised unless `normalize` is false),
/embed_all each input's token vectors ([CLS] and [SEP] included), /tokenize each text's
tokens {id, text, special, start, stop} (start and stop: UTF-8 byte offsets into the
text, none for a special token), /decode a list of texts, /rerank `[{index, score,
text?}]` highest score first, /similarity `[score, ...]` (the cosine of the source
sentence's pooled vector and each sentence's) in the sentences' order.

`prompt_name` names one of the model's prompts, put before each text (none named: the
model's default prompt, if it has one); /tokenize's tokens then include the prompt's, with
offsets into the prompt and the text, as TEI gives them. `truncation_direction` Left cuts
a long text at its start (on /rerank, a pair's text); `dimensions` one of the model's
Matryoshka sizes. `truncate` left out means TEI's `auto_truncate`, false here (/info says
so): a text longer than the model's positions is refused unless the request sets
truncate. /similarity takes truncate, truncation_direction and prompt_name in
`parameters`, as TEI's. /tokenize takes `truncate` too (not a TEI field).

Errors come in TEI's shape {"error", "error_type"} with TEI's statuses: an empty input
400 Empty, any other bad input 422 Validation, 429 Overloaded, 503 Unhealthy, a batch that
failed in the backend 424 Backend; the port's own limits keep their statuses (401, 408,
413, 415) and are typed Validation."""

import numpy as np
import orjson
from aiohttp import web

from attnserve.artifact import CLASSIFIER, EMBEDDER, HIDDEN_OUTPUT, RERANKER, pooled_output
from attnserve.server.call import SERVER_VERSION
from attnserve.server.engine import classify, embed, pairs, sparse
from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.offload import COPY_BYTE_S, FLOAT_TEXT_S, RESULT_S, TOKEN_S
from attnserve.server.engine.requests import (
    ClassifyRequest,
    DecodeRequest,
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
from attnserve.server.errors import InvalidArgument, RequestError
from attnserve.server.http.calls import JSON_CHAR_BYTES, JSON_FLOAT_BYTES
from attnserve.server.http.door import Door, encode, json_response
from attnserve.server.http.schemas import (
    SimilarityParameters,
    TeiDecode,
    TeiEmbed,
    TeiEmbedAll,
    TeiEmbedding,
    TeiEmbedSparse,
    TeiError,
    TeiInfo,
    TeiModelType,
    TeiPredict,
    TeiPrediction,
    TeiRank,
    TeiReranker,
    TeiSimilarity,
    TeiSparseValue,
    TeiToken,
    TeiTokenize,
    sequences,
)
from attnserve.server.http.schemas import TeiRerank as TeiRerankBody
from attnserve.server.memory.ledger import Holds

DTYPES = {"fp32": "float32", "fp16": "float16", "int8": "int8"}
# Answer sizes: the brackets and comma around each vector or list, one token's object but
# its text ({"id":N,"text":"","special":false,"start":N,"stop":N},), a rank's around its
# text ({"index":N,"score":F,"text":""}) and a score's text.
LIST_BYTES = 4
TOKEN_BYTES = 64
RANK_BYTES = 64
SCORE_BYTES = 16
ADVICE = "send fewer inputs per request"
# What the data plane reports -> TEI's status and error_type; Empty is TEI's 400.
STATUSES = {400: (422, "Validation"), 429: (429, "Overloaded"), 500: (424, "Backend"),
            503: (503, "Unhealthy"), 504: (429, "Overloaded")}
RERANK = Fields("texts")
SIMILARITY = Fields("inputs.sentences", query="inputs.source_sentence")
# A prediction's braces, score and label but the label's text ({"score":F,"label":""},).
PREDICTION_BYTES = 40
# A sparse entry at its longest ({"index":250001,"value":-1.1754944e-38},).
SPARSE_VALUE_BYTES = 42

# TEI's name of a pooling where it differs from ours (its /info).
TEI_POOLINGS = {"lasttoken": "last_token"}


class Empty(InvalidArgument):
    """TEI's Empty: an empty input, list or text."""


def side(name: str) -> TruncationDirection:
    return TruncationDirection(name.lower())


def byte_offsets(text: str) -> np.ndarray:
    """Each code point's UTF-8 offset in `text`, and the text's length in bytes last."""
    if text.isascii():
        return np.arange(len(text) + 1)
    points = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    return np.concatenate([[0], np.cumsum(widths)])


def tei_tokens(text: str, encoded: Encoded) -> list[TeiToken]:
    """TEI's SimpleTokens: a special token as its own text, the others as the text they
    cover with its UTF-8 offsets."""
    places = byte_offsets(text)
    return [TeiToken(token_id, token, True, None, None) if special else
            TeiToken(token_id, text[start:end], False, int(places[start]), int(places[end]))
            for token_id, token, (start, end), special in zip(
                encoded.ids.tolist(), encoded.tokens, encoded.offsets, encoded.special, strict=True)]


def predict_inputs(inputs: str | list) -> tuple[bool, list[str], list[str | None], Fields]:
    """TEI's /predict inputs: a text; a list of one or two texts (one input: a text, or a
    pair); a list of such lists (a batch). Whether it is a batch, each input's text and
    second text (or None), and the inputs' field names."""
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], str)):
        batch, entries, names = False, [inputs], Fields("inputs", single=True, pair_at="inputs[1]")
    else:
        batch, entries, names = True, inputs, Fields("inputs", pair_at="{sequence}[1]")
    if not entries:
        raise Empty("inputs", "an empty list; expected one that is not empty")
    texts, text_pairs = [], []
    for i, entry in enumerate(entries):
        parts = [entry] if isinstance(entry, str) else entry
        if not 1 <= len(parts) <= 2:
            raise InvalidArgument(names.sequence(i), f"a list of {len(parts)} texts; expected "
                                  "one text, or two (a pair)")
        for j, part in enumerate(parts):
            if not part:
                raise Empty(names.sequence(i) if isinstance(entry, str) else
                            f"{names.sequence(i)}[{j}]", "an empty string; send text")
        texts.append(parts[0])
        text_pairs.append(parts[1] if len(parts) == 2 else None)
    return batch, texts, text_pairs, names


class TeiDoor(Door):
    def __init__(self, *args, limits: dict[str, int]):
        """`limits`: /info's max_concurrent_requests, max_batch_tokens, max_batch_requests
        and max_client_batch_size."""
        super().__init__(*args)
        self.limits = limits

    def routes(self) -> list[web.RouteDef]:
        default = self.plane.default
        root = {RERANKER: self.rerank, CLASSIFIER: self.predict}.get(default.kind, self.embed)
        if default.manifest.heads == ["sparse"]:
            root = self.embed_sparse
        return [self.route("POST", "/", root), self.route("POST", "/embed", self.embed),
                self.route("POST", "/embed_all", self.embed_all),
                self.route("POST", "/embed_sparse", self.embed_sparse),
                self.route("POST", "/tokenize", self.tokenize),
                self.route("POST", "/decode", self.decode), self.route("GET", "/info", self.info),
                self.route("POST", "/rerank", self.rerank),
                self.route("POST", "/predict", self.predict),
                self.route("POST", "/similarity", self.similarity)]

    @staticmethod
    def refusal(err: RequestError, status: int) -> web.Response:
        status, kind = (400, "Empty") if isinstance(err, Empty) else STATUSES.get(
            status, (status, "Validation"))
        return json_response(TeiError(err.message, kind), status)

    def _size(self, per_sequence: int, per_token: int) -> ResponseSize:
        return ResponseSize(lambda lengths: 2 + len(lengths) * per_sequence + int(lengths.sum())
                            * per_token, self.max_response_bytes, ADVICE)

    async def _arrays(self, model: ServedModel, seconds: float, arrays: list) -> web.Response:
        payload = await model.pack(seconds, orjson.dumps, arrays, None, orjson.OPT_SERIALIZE_NUMPY)
        return web.Response(body=payload, content_type="application/json")

    # --- /embed, / and /embed_all -------------------------------------------------------

    async def embed(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, TeiEmbed)
        model = self.plane.model(None)
        size = body.dimensions or model.manifest.embedding_size
        pooled = pooled_output(model.manifest.default_pooling, body.normalize)
        inputs, names = sequences(body.inputs, "inputs", Empty)
        embedded = await embed.embed(model, EmbedRequest(
            names=names, size=self._size(LIST_BYTES + size * JSON_FLOAT_BYTES, 0),
            truncate=bool(body.truncate), truncation_direction=side(body.truncation_direction),
            prompt_name=body.prompt_name, outputs=frozenset({pooled}),
            dimensions=body.dimensions or 0, **inputs), holds, None)
        return await self._arrays(model, len(embedded.results) * (RESULT_S + size * FLOAT_TEXT_S),
                                  [r.pooled[pooled] for r in embedded.results])

    async def embed_all(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, TeiEmbedAll)
        model = self.plane.model(None)
        hidden = model.manifest.hidden_size
        inputs, names = sequences(body.inputs, "inputs", Empty)
        embedded = await embed.embed(model, EmbedRequest(
            names=names, size=self._size(LIST_BYTES, LIST_BYTES + hidden * JSON_FLOAT_BYTES),
            truncate=bool(body.truncate), truncation_direction=side(body.truncation_direction),
            prompt_name=body.prompt_name, outputs=frozenset({HIDDEN_OUTPUT}), **inputs),
            holds, None)
        seconds = len(embedded.results) * RESULT_S + embedded.total_tokens * hidden * FLOAT_TEXT_S
        return await self._arrays(model, seconds,
                                  [np.ascontiguousarray(r.hidden) for r in embedded.results])

    async def embed_sparse(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, TeiEmbedSparse)
        model = self.plane.model(None)
        inputs, names = sequences(body.inputs, "inputs", Empty, ids=False)
        embedded = await sparse.embed_sparse(model, SparseRequest(
            names, ResponseSize(lambda counts: 2 + len(counts) * LIST_BYTES + int(counts.sum())
                                * SPARSE_VALUE_BYTES, self.max_response_bytes,
                                "set top_k, or send fewer inputs"),
            inputs["texts"], bool(body.truncate), side(body.truncation_direction),
            body.prompt_name, body.top_k), holds, None)

        def answer() -> bytes:
            return encode([[TeiSparseValue(i, v) for i, v in zip(
                indices.tolist(), values.tolist(), strict=True)]
                for indices, values in zip(embedded.indices, embedded.values, strict=True)])

        return web.Response(body=await model.pack(embedded.response_bytes * COPY_BYTE_S, answer),
                            content_type="application/json")

    # --- /tokenize and /decode ----------------------------------------------------------

    def _checked(self, model: ServedModel, holds: Holds, value) -> bytes:
        """`value` as JSON, once it is known to fit the response limit, held until sent."""
        payload = encode(value)
        ResponseSize(lambda _: len(payload), self.max_response_bytes, ADVICE).check(None)
        model.hold_response(holds, len(payload))
        return payload

    def _tokens(self, model: ServedModel, holds: Holds, lead: str, texts: list[str],
                encoded: list[Encoded]) -> bytes:
        """`lead`: the prompt before each text, whose tokens' offsets are into it and the text."""
        return self._checked(model, holds, [tei_tokens(lead + text, e)
                                            for text, e in zip(texts, encoded, strict=True)])

    async def tokenize(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, TeiTokenize)
        model = self.plane.model(None)
        inputs, names = sequences(body.inputs, "inputs", Empty, ids=False)
        texts = inputs["texts"]
        least = len(model.tokenizer.empty.ids) if body.add_special_tokens else 0
        count = len(texts)
        ResponseSize(lambda _: count * (LIST_BYTES + least * TOKEN_BYTES), self.max_response_bytes,
                     ADVICE).check(None, at_least=True)
        encoded = await embed.tokenize(model, TokenizeRequest(
            names, texts, bool(body.truncate), prompt_name=body.prompt_name,
            special_tokens=body.add_special_tokens), holds)
        prompt = model.prompt(body.prompt_name)
        tokens = sum(len(e.ids) for e in encoded)
        payload = await model.pack(count * RESULT_S + tokens * TOKEN_S, self._tokens, model, holds,
                                   prompt.text if prompt else "", texts, encoded)
        return web.Response(body=payload, content_type="application/json")

    async def decode(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, TeiDecode)
        model = self.plane.model(None)
        inputs, names = sequences(body.ids, "ids", Empty)
        texts = await embed.decode(model, DecodeRequest(names, inputs["token_ids"],
                                                        body.skip_special_tokens), holds)
        payload = await model.pack(sum(map(len, texts)) * COPY_BYTE_S, self._checked, model, holds,
                                   texts)
        return web.Response(body=payload, content_type="application/json")

    # --- /rerank and /similarity --------------------------------------------------------

    async def rerank(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, TeiRerankBody)
        model = self.plane.model(body.model, kind=RERANKER)
        texts = body.texts

        def measure(indexes) -> int:
            text = sum(len(texts[i]) for i in indexes.tolist()) if body.return_text else 0
            return 64 + len(indexes) * RANK_BYTES + JSON_CHAR_BYTES * text

        reranked = await pairs.rerank(model, RerankRequest(
            RERANK, ResponseSize(measure, self.max_response_bytes,
                                 "send fewer texts, or leave return_text unset"), body.query, texts,
            raw_scores=body.raw_scores, truncate=bool(body.truncate),
            truncation_direction=side(body.truncation_direction)), holds, None)

        def answer() -> bytes:
            return encode([TeiRank(i, score, *((texts[i],) if body.return_text else ()))
                           for i, score in zip(reranked.order.tolist(), reranked.scores.tolist(),
                                               strict=True)])

        return web.Response(body=await model.pack(len(texts) * RESULT_S, answer),
                            content_type="application/json")

    async def predict(self, request: web.Request, holds: Holds) -> web.Response:
        """Every label's score of each input, highest first: a list for one input, a list of
        them for a batch (and always, nested as the Inference API's, with `parameters`)."""
        body = await self.calls.json_body(request, holds, TeiPredict)
        model = self.plane.model(body.model, kind=CLASSIFIER)
        batch, texts, text_pairs, names = predict_inputs(body.inputs)
        parameters = body.parameters
        activation = "none" if body.raw_scores else parameters and parameters.function_to_apply
        top_k = parameters and parameters.top_k
        label_bytes = sum(PREDICTION_BYTES + JSON_CHAR_BYTES * len(label)
                          for label in model.manifest.labels)
        classified = await classify.classify(model, ClassifyRequest(
            names, ResponseSize(lambda counts: 2 + len(counts) * (LIST_BYTES + label_bytes),
                                self.max_response_bytes, ADVICE),
            texts, text_pairs, activation, bool(body.truncate), side(body.truncation_direction),
            top_k), holds, None)
        labels = model.manifest.labels

        def answer() -> bytes:
            predictions = [[TeiPrediction(score, labels[label])
                            for label, score in classified.ranked(i, top_k)]
                           for i in range(len(texts))]
            return encode(predictions if batch or parameters is not None else predictions[0])

        return web.Response(body=await model.pack(classified.scores.size * RESULT_S, answer),
                            content_type="application/json")

    async def similarity(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, TeiSimilarity)
        model = self.plane.model(body.model, kind=EMBEDDER)
        parameters = body.parameters or SimilarityParameters()
        size = ResponseSize(lambda lengths: 64 + len(lengths) * SCORE_BYTES,
                            self.max_response_bytes, "send fewer sentences")
        scored = await pairs.score(model, ScoreRequest(
            SIMILARITY, size, body.inputs.source_sentence, body.inputs.sentences, ScoreMode.COSINE,
            bool(parameters.truncate), side(parameters.truncation_direction),
            parameters.prompt_name), holds, None)
        payload = await model.pack(len(scored.scores) * RESULT_S, encode, scored.scores.tolist())
        return web.Response(body=payload, content_type="application/json")

    # --- /info ----------------------------------------------------------------------------

    async def info(self, request: web.Request, holds: Holds) -> web.Response:
        info = self.plane.model(None).model_info()
        if info.kind in (RERANKER, CLASSIFIER):
            labels = TeiReranker({str(i): label for i, label in enumerate(info.labels)},
                                 {label: i for i, label in enumerate(info.labels)})
            kind = TeiModelType(**{info.kind: labels})
        else:
            splade = self.plane.default.manifest.sparse is not None
            kind = TeiModelType(embedding=TeiEmbedding("splade" if splade else TEI_POOLINGS.get(
                info.default_pooling, info.default_pooling)))
        return json_response(TeiInfo(
            model_id=info.model, model_sha=info.artifact_sha256,
            model_dtype=DTYPES.get(info.precision, info.precision), served_model_name=info.model,
            model_type=kind, max_input_length=info.max_positions, auto_truncate=False,
            tokenization_workers=1, version=SERVER_VERSION, sha=None, docker_label=None,
            **self.limits))

