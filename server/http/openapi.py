"""The OpenAPI 3.0 description of the HTTP port, served at /openapi.json (and shown at
/docs): the route table below (each route's peer of origin, summary, bodies and the
statuses its protocol answers with) and the bodies' schemas, generated from their Structs
(server/http/schemas.py), each once, in the document's components. The test suite checks
that every route the port serves is in it, and the running server against it
(schemathesis)."""

from dataclasses import dataclass, replace

import msgspec
import orjson

from attnserve.artifact import CLASSIFIER, RERANKER
from attnserve.server.call import SERVER_VERSION
from attnserve.server.engine.requests import ModelInfo
from attnserve.server.http import schemas as s
from attnserve.server.http.docs_page import FILES
from attnserve.server.kserve import ModelMetadata, RepositoryModel
from attnserve.server.priority import CLASSES, DEFAULT, HEADER

REASONS = {200: "the answer", 400: "the request names a field that is wrong, and why",
           401: "no valid API key (when the server has keys)", 404: "no such model, version or route",
           408: "the body did not arrive within --http-body-timeout-seconds",
           413: "the body, or what it asks for, is larger than the server takes",
           415: "a content type or encoding the route does not take",
           422: "the request names a field that is wrong, and why (TEI's Validation)",
           424: "the batch failed in the backend (TEI's Backend)",
           429: "the queue or the memory budget is full: retry with backoff",
           503: "the server is starting or draining: send the request elsewhere",
           504: "the request's deadline passed while it waited"}
# The statuses of a route that reads a body and runs the model, per protocol.
RUNS = (400, 401, 404, 408, 413, 415, 429, 503, 504)
TEI_RUNS = (400, 401, 408, 413, 415, 422, 424, 429, 503)
TEI_TEXT = (400, 401, 408, 413, 415, 422, 429, 503)
"""TEI's routes that only tokenize or decode"""


@dataclass(frozen=True)
class Protocol:
    tag: str
    """the peer of origin the page groups its routes under"""
    error: type
    statuses: tuple[int, ...]
    """those of its routes that run the model"""


OPENAI = Protocol("OpenAI", s.OpenAIError, RUNS)
INFINITY = Protocol("Infinity", s.OpenAIError, RUNS)
TEI = Protocol("Text Embeddings Inference", s.TeiError, TEI_RUNS)
VLLM = Protocol("vLLM", s.OpenAIError, RUNS)
COHERE = Protocol("Cohere and Jina", s.CohereError, (400, 401, 404, 408, 413, 415, 429, 503))
KSERVE = Protocol("KServe v2 (Open Inference Protocol)", s.KServeError, RUNS)
ATTNSERVE = Protocol("attnserve", s.KServeError, ())


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    protocol: Protocol
    summary: str
    answer: object = None
    """the 200 answer's schema type; None: a body that is not JSON (`content`)"""
    body: type | None = None
    """the request body's schema type"""
    statuses: tuple[int, ...] | None = None
    """its refusals; None: its protocol's for a route that runs the model"""
    content: tuple[str, ...] = ("application/json",)
    """the 200 answer's content types"""
    refused: bool = False
    """its answer is refused as 400 (KServe's health and readiness: false)"""
    error: type | None = None
    """its refusals' schema type; None: its protocol's"""


MODEL = "/v2/models/{name}"
VERSION = "/v2/models/{name}/versions/{version}"
ROUTES = [
    Route("GET", "/health", ATTNSERVE, "Readiness for load balancers", s.Health, statuses=(503,),
          error=s.Health),
    Route("GET", "/", TEI, "Readiness (TEI's root health route), as /health", s.Health,
          statuses=(503,), error=s.Health),
    Route("GET", "/openapi.json", ATTNSERVE, "This document", dict, statuses=()),
    Route("GET", "/docs", ATTNSERVE, "This document as a page (Swagger UI)", content=("text/html",),
          statuses=()),
    Route("GET", "/docs/start.js", ATTNSERVE, "The page's script", content=("text/javascript",), statuses=()),
    Route("GET", "/docs/{file}", ATTNSERVE, "Swagger UI's files, from the swagger-ui-bundle package",
          content=tuple(dict.fromkeys(FILES.values())), statuses=(404,)),
    Route("POST", "/v1/embeddings", OPENAI, "Embeddings (the model's pooling, normalised), one "
          "per input or, with chunking, one per chunk", s.EmbeddingList, s.Embeddings),
    Route("GET", "/v1/models", OPENAI, "The models served, as OpenAI lists them", s.ModelList,
          statuses=(401,)),
    Route("GET", "/v1/models/{model}", OPENAI, "One model, as OpenAI describes it", s.Model,
          statuses=(401, 404)),
    Route("POST", "/embeddings", INFINITY, "Infinity's embeddings: OpenAI's, with Infinity's "
          "fields", s.EmbeddingList, s.InfinityEmbeddings),
    Route("POST", "/classify", VLLM, "A classifier's score of every label of each text, by "
          "label id", s.Classification, s.Classify),
    Route("GET", "/models", INFINITY, "The models served, as Infinity lists them", s.ModelList,
          statuses=(401,)),
    Route("POST", "/", TEI, "TEI's root: an embedder's is /embed", s.TeiVectors, s.TeiEmbed),
    Route("POST", "/embed", TEI, "One vector per input, the model's pooling", s.TeiVectors, s.TeiEmbed),
    Route("POST", "/embed_all", TEI, "Every token's vector of each input, special tokens included",
          s.TeiTokenVectors, s.TeiEmbedAll),
    Route("POST", "/tokenize", TEI, "Each text's tokens", list[list[s.TeiToken]], s.TeiTokenize, TEI_TEXT),
    Route("POST", "/decode", TEI, "Token ids back to text", s.TeiTexts, s.TeiDecode, TEI_TEXT),
    Route("GET", "/info", TEI, "The model served and the server's limits", s.TeiInfo, statuses=(401,)),
    Route("POST", "/rerank", TEI, "A reranker's score of each (query, text) pair, highest first",
          list[s.TeiRank], s.TeiRerank, (*TEI_RUNS, 404)),
    Route("POST", "/embed_sparse", TEI, "A SPLADE model's sparse vector of each input: its "
          "non-zero weights by token id, ascending", s.TeiSparseVectors, s.TeiEmbedSparse),
    Route("POST", "/predict", TEI, "A classifier's score of every label of each text or pair, "
          "highest first", s.TeiPredictions, s.TeiPredict, (*TEI_RUNS, 404)),
    Route("POST", "/similarity", TEI, "The cosine of the source sentence's pooled vector and "
          "each sentence's, in order", s.TeiScores, s.TeiSimilarity, (*TEI_RUNS, 404)),
    *(Route("POST", path, COHERE, "A reranker's relevance_score (sigmoid) of each (query, document) pair",
            s.CohereRanking, s.CohereRerank) for path in ("/v1/rerank", "/v2/rerank")),
    Route("GET", "/v2/health/live", KSERVE, "Live", s.Live, statuses=(), refused=True),
    Route("GET", "/v2/health/ready", KSERVE, "Ready", s.Ready, statuses=(), refused=True),
    Route("GET", "/v2", KSERVE, "Server metadata", s.ServerMetadata, statuses=(401,)),
    Route("POST", "/v2/repository/index", KSERVE, "The model repository (Triton's extension)",
          list[RepositoryModel], s.RepositoryIndex, (400, 401, 408, 413, 415)),
    *(route for base in (MODEL, VERSION) for route in (
        Route("GET", base, KSERVE, "Model metadata", ModelMetadata, statuses=(401, 404)),
        Route("GET", base + "/ready", KSERVE, "Model readiness", s.Ready, statuses=(401, 404), refused=True),
        Route("POST", base + "/infer", KSERVE, "Inference on tensors: input_ids and "
              "attention_mask, INT64 [batch, seq]", s.Inferred, s.Infer,
              content=("application/json", "application/octet-stream")))),
]
ROOTS = {RERANKER: "/rerank", CLASSIFIER: "/predict", "sparse": "/embed_sparse"}
"""a default model's kind (sparse: a SPLADE model's) -> the route TEI's root is (a dense
embedder's: /embed)"""
EXAMPLES = {"/v1/embeddings", "/embeddings"}
"""routes whose body example names the default model, so that "Try it out" answers"""
BINARY = {"type": "string", "format": "binary"}


def _nullable(schema):
    """JSON Schema 2020-12 (msgspec's) as OpenAPI 3.0 writes it: `X | None` is a nullable X."""
    if isinstance(schema, list):
        return [_nullable(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _nullable(value) for key, value in schema.items()}
    members = schema.get("anyOf", [])
    if {"type": "null"} in members:
        rest = [m for m in members if m != {"type": "null"}]
        del schema["anyOf"]
        one = rest[0] if len(rest) == 1 else {"anyOf": rest}
        schema |= {"allOf": [one]} if "$ref" in one else one
        schema["nullable"] = True
    return schema


PRIORITY_HEADER = {"name": HEADER, "in": "header", "required": False,
                   "schema": {"type": "string", "enum": [p.value for p in CLASSES], "default": DEFAULT.value},
                   "description": "the call's priority class: interactive work is batched ahead of bulk "
                                  "work; an API key that carries a class overrides it"}


def _operation(route: Route, schema: dict[object, dict], example: dict) -> dict:
    operation = {"summary": route.summary, "tags": [route.protocol.tag]}
    names = [part[1:-1] for part in route.path.split("/") if part.startswith("{")]
    parameters = [{"name": name, "in": "path", "required": True, "schema": {
        "type": "string", **({"enum": list(FILES)} if name == "file" else {})}} for name in names]
    if route.body is not None:
        content = {"application/json": {"schema": schema[route.body]}}
        if route.path in EXAMPLES:
            content["application/json"]["example"] = example
        if route.path.endswith("/infer"):
            content["application/octet-stream"] = {"schema": BINARY}
            parameters.append({"name": "Inference-Header-Content-Length", "in": "header", "required": False,
                               "schema": {"type": "integer", "minimum": 0},
                               "description": "with binary tensor data: the JSON header's length in bytes"})
        operation["requestBody"] = {"required": route.path != "/v2/repository/index", "content": content}
        parameters.append({"$ref": "#/components/parameters/priority"})
    if parameters:
        operation["parameters"] = parameters
    answer = {kind: {"schema": schema[route.answer] if kind == "application/json" else BINARY}
              for kind in route.content}
    responses = {"200": {"description": REASONS[200], "content": answer}}
    if route.refused:
        responses["400"] = {"description": "false", "content": answer}
    error = {"application/json": {"schema": schema[route.error or route.protocol.error]}}
    for status in route.protocol.statuses if route.statuses is None else route.statuses:
        responses[str(status)] = {"description": REASONS[status], "content": error}
    return operation | {"responses": responses}


def tei_root(kind: str, heads: list[str]) -> str:
    """The key in ROOTS of a default model of this kind and these heads."""
    return "sparse" if heads == ["sparse"] else kind


def openapi_document(infos: list[ModelInfo]) -> bytes:
    """The HTTP API of a server of these models (the first the default)."""
    routes = ROUTES
    kind = tei_root(infos[0].kind, infos[0].heads)
    if kind in ROOTS:  # TEI routes its root by the model's kind
        path = ROOTS[kind]
        served = next(r for r in ROUTES if r.path == path)
        root = replace(served, path="/", summary=f"TEI's root: a {kind} model's is {path}")
        routes = [root if (r.method, r.path) == ("POST", "/") else r for r in ROUTES]
    types = list(dict.fromkeys(t for route in routes for t in (
        route.answer, route.body, route.error or route.protocol.error) if t not in (None, dict)))
    generated, components = msgspec.json.schema_components(types, ref_template="#/components/schemas/{name}")
    schema = dict(zip(types, _nullable(generated), strict=True)) | {dict: {"type": "object"},
                                                                    None: {"type": "string"}}
    example = {"input": ["attention is all you need"], "model": infos[0].model}
    paths: dict[str, dict] = {}
    for route in routes:
        paths.setdefault(route.path, {})[route.method.lower()] = _operation(route, schema, example)
    served = ", ".join(f"{i.model} ({i.hidden_size} dimensions, {i.max_positions} positions)" for i in infos)
    return orjson.dumps({
        "openapi": "3.0.3", "info": {"title": "attnserve HTTP API", "version": SERVER_VERSION,
                                     "description": f"Serving {served}; the default is {infos[0].model}."},
        "components": {"schemas": _nullable(components), "parameters": {"priority": PRIORITY_HEADER},
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": paths})
