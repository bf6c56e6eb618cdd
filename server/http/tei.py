"""Text Embeddings Inference's HTTP API (TEI 1.9, its router/src/http) through the data
plane, in TEI's bodies, answers, error shape and statuses (docs/api.md, "HTTP: TEI"). TEI
serves one model and names none: the embedding routes serve the server's default model,
/rerank, /predict and /similarity the first of the kind they take or, beyond TEI's fields,
the one `model` names. `truncate` left out is TEI's `auto_truncate`, false here."""

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
    ScoreMode,
    ScoreRequest,
    SparseRequest,
    TokenizeRequest,
)
from attnserve.server.engine.tokenize import Encoded
from attnserve.server.errors import InvalidArgument, RequestError
from attnserve.server.http import schemas as s
from attnserve.server.http.calls import JSON_CHAR_BYTES, JSON_FLOAT_BYTES
from attnserve.server.http.door import Door, encode, json_response, packed
from attnserve.server.http.openapi import ROOTS, tei_root
from attnserve.server.memory.ledger import Holds

DTYPES = {"fp32": "float32", "fp16": "float16", "int8": "int8"}
# Answer sizes: the brackets and comma around each vector or list, one token's object but
# its text ({"id":N,"text":"","special":false,"start":N,"stop":N},), a rank's around its
# text ({"index":N,"score":F,"text":""}) and a score's text.
LIST_BYTES, TOKEN_BYTES, RANK_BYTES, SCORE_BYTES = 4, 64, 64, 16
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


def byte_offsets(text: str) -> np.ndarray:
    """Each code point's UTF-8 offset in `text`, and the text's length in bytes last."""
    if text.isascii():
        return np.arange(len(text) + 1)
    points = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    widths = 1 + (points >= 0x80) + (points >= 0x800) + (points >= 0x10000)
    return np.concatenate([[0], np.cumsum(widths)])


def tei_tokens(text: str, encoded: Encoded) -> list[s.TeiToken]:
    """TEI's SimpleTokens: a special token as its own text, the others as the text they
    cover with its UTF-8 offsets."""
    places = byte_offsets(text)
    return [s.TeiToken(token_id, token, True, None, None) if special else
            s.TeiToken(token_id, text[start:end], False, int(places[start]), int(places[end]))
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


async def _arrays(model: ServedModel, seconds: float, arrays: list[np.ndarray]) -> web.Response:
    return await packed(model, seconds, orjson.dumps, arrays, None, orjson.OPT_SERIALIZE_NUMPY)


class TeiDoor(Door):
    def __init__(self, *args, limits: dict[str, int]):
        """`limits`: /info's server limits, by their TEI names."""
        super().__init__(*args)
        self.limits = limits

    def routes(self) -> list[web.RouteDef]:
        default = self.plane.default
        posts = {"/embed": self.embed, "/embed_all": self.embed_all,
                 "/embed_sparse": self.embed_sparse, "/tokenize": self.tokenize, "/decode": self.decode,
                 "/rerank": self.rerank, "/predict": self.predict, "/similarity": self.similarity}
        posts["/"] = posts[ROOTS.get(tei_root(default.kind, default.manifest.heads), "/embed")]
        return [self.route("GET", "/info", self.info), *(self.route("POST", *post) for post in posts.items())]

    @staticmethod
    def refusal(err: RequestError, status: int) -> web.Response:
        status, kind = (400, "Empty") if isinstance(err, Empty) else STATUSES.get(
            status, (status, "Validation"))
        return json_response(s.TeiError(err.message, kind), status)

    async def _embedded(self, body: s.TeiEmbedAll, model: ServedModel, holds: Holds, output: str,
                        per_sequence: int, per_token: int, dimensions: int = 0):
        """The inputs' `output`, each answered in `per_sequence` bytes and `per_token` a token."""
        inputs, names = s.sequences(body.inputs, "inputs", Empty)
        size = self.size(lambda lengths: 2 + len(lengths) * per_sequence + int(lengths.sum())
                         * per_token, ADVICE)
        return await embed.embed(model, EmbedRequest(
            names=names, size=size, truncate=bool(body.truncate),
            truncation_direction=s.direction(body.truncation_direction), prompt_name=body.prompt_name,
            outputs=frozenset({output}), dimensions=dimensions, **inputs), holds, None)

    async def embed(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, s.TeiEmbed)
        model = self.plane.model(None)
        size = body.dimensions or model.manifest.embedding_size
        pooled = pooled_output(model.manifest.default_pooling, body.normalize)
        embedded = await self._embedded(body, model, holds, pooled,
                                        LIST_BYTES + size * JSON_FLOAT_BYTES, 0, body.dimensions or 0)
        return await _arrays(model, len(embedded.results) * (RESULT_S + size * FLOAT_TEXT_S),
                             [r.pooled[pooled] for r in embedded.results])

    async def embed_all(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, s.TeiEmbedAll)
        model = self.plane.model(None)
        hidden = model.manifest.hidden_size
        embedded = await self._embedded(body, model, holds, HIDDEN_OUTPUT, LIST_BYTES,
                                        LIST_BYTES + hidden * JSON_FLOAT_BYTES)
        seconds = len(embedded.results) * RESULT_S + embedded.total_tokens * hidden * FLOAT_TEXT_S
        return await _arrays(model, seconds, [np.ascontiguousarray(r.hidden) for r in embedded.results])

    async def embed_sparse(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, s.TeiEmbedSparse)
        model = self.plane.model(None)
        inputs, names = s.sequences(body.inputs, "inputs", Empty, ids=False)
        size = self.size(lambda counts: 2 + len(counts) * LIST_BYTES + int(counts.sum()) * SPARSE_VALUE_BYTES,
                         "set top_k, or send fewer inputs")
        embedded = await sparse.embed_sparse(model, SparseRequest(
            names, size, inputs["texts"], bool(body.truncate), s.direction(body.truncation_direction),
            body.prompt_name, body.top_k), holds, None)

        def answer() -> bytes:
            return encode([[s.TeiSparseValue(i, v) for i, v in zip(
                indices.tolist(), values.tolist(), strict=True)]
                for indices, values in zip(embedded.indices, embedded.values, strict=True)])

        return await packed(model, embedded.response_bytes * COPY_BYTE_S, answer)

    def _checked(self, model: ServedModel, holds: Holds, value) -> bytes:
        """`value` as JSON, once it is known to fit the response limit, held until sent."""
        payload = encode(value)
        self.size(lambda _: len(payload), ADVICE).check(None)
        model.hold_response(holds, len(payload))
        return payload

    async def tokenize(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, s.TeiTokenize)
        model = self.plane.model(None)
        inputs, names = s.sequences(body.inputs, "inputs", Empty, ids=False)
        texts = inputs["texts"]
        least = len(model.tokenizer.empty.ids) if body.add_special_tokens else 0
        self.size(lambda _: len(texts) * (LIST_BYTES + least * TOKEN_BYTES), ADVICE).check(
            None, at_least=True)
        encoded = await embed.tokenize(model, TokenizeRequest(
            names, texts, bool(body.truncate), prompt_name=body.prompt_name,
            special_tokens=body.add_special_tokens), holds)
        # A prompt's tokens come first, their offsets into the prompt and the text.
        prompt = model.prompt(body.prompt_name)
        lead = prompt.text if prompt else ""

        def answer() -> bytes:
            return self._checked(model, holds, [tei_tokens(lead + text, e)
                                                for text, e in zip(texts, encoded, strict=True)])

        return await packed(model, len(texts) * RESULT_S + sum(len(e.ids) for e in encoded) * TOKEN_S, answer)

    async def decode(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, s.TeiDecode)
        model = self.plane.model(None)
        inputs, names = s.sequences(body.ids, "ids", Empty)
        texts = await embed.decode(model, DecodeRequest(names, inputs["token_ids"],
                                                        body.skip_special_tokens), holds)
        return await packed(model, sum(map(len, texts)) * COPY_BYTE_S, self._checked, model, holds, texts)

    async def rerank(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, s.TeiRerank)
        model = self.plane.model(body.model, kind=RERANKER)
        texts = body.texts

        def measure(indexes) -> int:
            text = sum(len(texts[i]) for i in indexes.tolist()) if body.return_text else 0
            return 64 + len(indexes) * RANK_BYTES + JSON_CHAR_BYTES * text

        reranked = await pairs.rerank(model, RerankRequest(
            RERANK, self.size(measure, "send fewer texts, or leave return_text unset"), body.query, texts,
            raw_scores=body.raw_scores, truncate=bool(body.truncate),
            truncation_direction=s.direction(body.truncation_direction)), holds, None)

        def answer() -> bytes:
            return encode([s.TeiRank(i, score, *((texts[i],) if body.return_text else ())) for i, score
                           in zip(reranked.order.tolist(), reranked.scores.tolist(), strict=True)])

        return await packed(model, len(texts) * RESULT_S, answer)

    async def predict(self, request: web.Request, holds: Holds) -> web.Response:
        """Every label's score of each input, highest first: a list for one input, a list of
        them for a batch (and always, nested as the Inference API's, with `parameters`)."""
        body = await self.calls.json_body(request, holds, s.TeiPredict)
        model = self.plane.model(body.model, kind=CLASSIFIER)
        batch, texts, text_pairs, names = predict_inputs(body.inputs)
        parameters = body.parameters
        activation = "none" if body.raw_scores else parameters and parameters.function_to_apply
        top_k = parameters and parameters.top_k
        labels = model.manifest.labels
        label_bytes = sum(PREDICTION_BYTES + JSON_CHAR_BYTES * len(label) for label in labels)
        classified = await classify.classify(model, ClassifyRequest(
            names, self.size(lambda counts: 2 + len(counts) * (LIST_BYTES + label_bytes), ADVICE), texts,
            text_pairs, activation, bool(body.truncate), s.direction(body.truncation_direction), top_k),
            holds, None)

        def answer() -> bytes:
            predictions = [[s.TeiPrediction(score, labels[label])
                            for label, score in classified.ranked(i, top_k)]
                           for i in range(len(texts))]
            return encode(predictions if batch or parameters is not None else predictions[0])

        return await packed(model, classified.scores.size * RESULT_S, answer)

    async def similarity(self, request: web.Request, holds: Holds) -> web.Response:
        body = await self.calls.json_body(request, holds, s.TeiSimilarity)
        model = self.plane.model(body.model, kind=EMBEDDER)
        parameters = body.parameters or s.SimilarityParameters()
        scored = await pairs.score(model, ScoreRequest(
            SIMILARITY, self.size(lambda lengths: 64 + len(lengths) * SCORE_BYTES, "send fewer sentences"),
            body.inputs.source_sentence, body.inputs.sentences, ScoreMode.COSINE, bool(parameters.truncate),
            s.direction(parameters.truncation_direction), parameters.prompt_name), holds, None)
        return await packed(model, len(scored.scores) * RESULT_S, encode, scored.scores.tolist())

    async def info(self, request: web.Request, holds: Holds) -> web.Response:
        info = self.plane.model(None).model_info()
        if info.kind in (RERANKER, CLASSIFIER):
            labels = s.TeiReranker({str(i): label for i, label in enumerate(info.labels)},
                                   {label: i for i, label in enumerate(info.labels)})
            kind = s.TeiModelType(**{info.kind: labels})
        else:
            splade = self.plane.default.manifest.sparse is not None
            kind = s.TeiModelType(embedding=s.TeiEmbedding("splade" if splade else TEI_POOLINGS.get(
                info.default_pooling, info.default_pooling)))
        return json_response(s.TeiInfo(
            model_id=info.model, model_sha=info.artifact_sha256, served_model_name=info.model,
            model_dtype=DTYPES.get(info.precision, info.precision), model_type=kind, auto_truncate=False,
            max_input_length=info.max_positions, tokenization_workers=1, version=SERVER_VERSION, sha=None,
            docker_label=None, **self.limits))
