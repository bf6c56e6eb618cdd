"""The OpenAPI 3.0 description of the HTTP port, served at /openapi.json (and shown at
/docs): the OpenAI-compatible /v1/embeddings (after OpenAI's own definition of the
embeddings API) and Infinity's /embeddings and /models, the Open Inference Protocol's
REST routes (after its specification, with Triton's binary tensor extension), TEI's
routes (after TEI 1.9's own document), Cohere's and Jina's /v1/rerank (after theirs),
/health and the /docs page. Every status a route answers and every body shape is in it;
the test suite checks the running server against it (schemathesis)."""

import orjson

from attnserve.artifact import RERANKER
from attnserve.server.call import SERVER_VERSION
from attnserve.server.engine.requests import ModelInfo
from attnserve.server.http.docs_page import FILES
from attnserve.server.http.openai import INFINITY_DEFAULT_MODEL

_ERROR = {"type": "object", "required": ["error"],
          "properties": {"error": {"type": "string"}}}
_COHERE_ERROR = {"type": "object", "required": ["message"],
                 "properties": {"message": {"type": "string"}}}
_COHERE_STATUSES = (400, 401, 404, 408, 413, 415, 429, 503)
_OPENAI_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": "string", "nullable": True},
                       "code": {"type": "string", "nullable": True}}}}}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _refusals(schema: dict, statuses: tuple[int, ...], **why: str) -> dict:
    """`why`: a status's reason for these routes, as s400="..."."""
    reasons = {400: "the request names a field that is wrong, and why",
               401: "no valid API key (when the server has keys)",
               404: "no such model, version or route",
               408: "the body did not arrive within --http-body-timeout-seconds",
               413: "the body, or what it asks for, is larger than the server takes",
               415: "a content type or encoding the route does not take",
               429: "the queue or the memory budget is full: retry with backoff",
               422: "the request names a field that is wrong, and why (TEI's Validation)",
               424: "the batch failed in the backend (TEI's Backend)",
               503: "the server is starting or draining: send the request elsewhere",
               504: "the request's deadline passed while it waited"}
    reasons |= {int(status[1:]): reason for status, reason in why.items()}
    return {str(status): _json(schema, reasons[status]) for status in statuses}


_STATUS = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}
_HEALTH = {"200": _json(_STATUS, "serving"), "503": _json(
    {**_STATUS, "required": ["status", "error", "error_type"],
     "properties": {**_STATUS["properties"], "error": {"type": "string"},
                    "error_type": {"type": "string", "enum": ["Unhealthy"]}}},
    "starting or draining (with TEI's error and error_type)")}
_TEI_ERROR = {"type": "object", "required": ["error", "error_type"],
              "properties": {"error": {"type": "string"}, "error_type": {
                  "type": "string",
                  "enum": ["Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"]}}}
# TEI's statuses of its POST routes that run the model, and of those that only tokenize.
_TEI_RUNS = (400, 401, 408, 413, 415, 422, 424, 429, 503)
_TEI_TOKENIZES = (400, 401, 408, 413, 415, 422, 429, 503)
# TEI's scoring routes name a model, so they may answer 404 as well.
_TEI_SCORES = (400, 401, 404, 408, 413, 415, 422, 424, 429, 503)
_TEI_EMPTY = "an input, list or text is empty (TEI's Empty)"


def _tei_paths(infos: list[ModelInfo], ids: dict) -> dict:
    """TEI's routes, serving the default model, infos[0]."""
    default = infos[0]
    prompts = ", ".join(sorted(default.prompts)) or "it has none"
    sizes = ", ".join(map(str, sorted({default.hidden_size, *default.matryoshka_dims},
                                      reverse=True)))
    texts = {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}}
    inputs = {"oneOf": [{"type": "string", "minLength": 1}, ids, texts,
                        {"type": "array", "minItems": 1, "items": ids}],
              "description": "a text, the model's token ids (special tokens included), or a "
                             "list of texts or of id lists",
              "example": "attention is all you need"}
    common = {
        "inputs": inputs,
        "truncate": {"type": "boolean", "nullable": True, "default": False,
                     "description": "cut inputs longer than the model's positions instead of "
                                    "refusing them (auto_truncate is false)"},
        "truncation_direction": {"type": "string", "enum": ["Right", "right", "Left", "left"],
                                 "default": "Right", "nullable": True,
                                 "description": "with truncate: Right keeps a text's start, "
                                                "Left its end (texts only)"},
        "prompt_name": {"type": "string", "nullable": True,
                        "description": f"one of the model's prompts ({prompts}), put before "
                                       "each text; null: its default prompt "
                                       f"({default.default_prompt_name or 'none'})"}}

    def request(properties: dict, required: tuple[str, ...] = ("inputs",)) -> dict:
        return {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": list(required), "additionalProperties": False,
            "properties": properties}}}}

    def answer(schema: dict, description: str, statuses: tuple[int, ...]) -> dict:
        return {"200": _json(schema, description),
                **_refusals(_TEI_ERROR, statuses, s400=_TEI_EMPTY)}

    number = {"type": "number"}
    vectors = {"type": "array", "items": {"type": "array", "items": number}}
    embed = {"post": {
        "summary": f"TEI: one vector per input, {default.default_pooling}-pooled",
        "requestBody": request({**common, "normalize": {"type": "boolean", "default": True},
                                "dimensions": {"type": "integer", "nullable": True, "minimum": 1,
                                               "description": "the vectors' size: " + sizes}}),
        "responses": answer(vectors, "the vectors, in order", _TEI_RUNS)}}
    token = {"type": "object", "required": ["id", "text", "special", "start", "stop"],
             "properties": {"id": {"type": "integer"}, "text": {"type": "string"},
                            "special": {"type": "boolean"},
                            "start": {"type": "integer", "nullable": True,
                                      "description": "the token's first byte (UTF-8) in its "
                                                     "text; null for a special token"},
                            "stop": {"type": "integer", "nullable": True}}}
    info = {"type": "object", "required": [
        "model_id", "model_dtype", "served_model_name", "model_type", "max_concurrent_requests",
        "max_input_length", "max_batch_tokens", "max_client_batch_size", "auto_truncate",
        "tokenization_workers", "version"], "properties": {
        **{name: {"type": "string"} for name in ("model_id", "model_dtype", "served_model_name",
                                                  "version")},
        **{name: {"type": "string", "nullable": True} for name in ("model_sha", "sha",
                                                                    "docker_label")},
        **{name: {"type": "integer"} for name in (
            "max_concurrent_requests", "max_input_length", "max_batch_tokens",
            "max_batch_requests", "max_client_batch_size", "tokenization_workers")},
        "auto_truncate": {"type": "boolean"},
        "model_type": {"oneOf": [
            {"type": "object", "required": ["embedding"], "properties": {
                "embedding": {"type": "object", "required": ["pooling"],
                              "properties": {"pooling": {"type": "string"}}}}},
            {"type": "object", "required": ["reranker"], "properties": {
                "reranker": {"type": "object", "required": ["id2label", "label2id"], "properties": {
                    "id2label": {"type": "object", "additionalProperties": {"type": "string"}},
                    "label2id": {"type": "object",
                                 "additionalProperties": {"type": "integer"}}}}}}]}}}
    return {
        "/": {"get": {"summary": "Readiness (TEI's root health route), as /health",
                      "responses": _HEALTH},
              "post": {**embed["post"], "summary": "TEI's root: an embedder's is /embed"}},
        "/embed": embed,
        "/embed_all": {"post": {
            "summary": "TEI: every token's vector of each input, special tokens included",
            "requestBody": request(common),
            "responses": answer({"type": "array", "items": vectors}, "each input's token vectors",
                                _TEI_RUNS)}},
        "/tokenize": {"post": {
            "summary": "TEI: each text's tokens",
            "requestBody": request({
                "inputs": {"oneOf": [{"type": "string", "minLength": 1}, texts],
                           "example": "attention is all you need"},
                "add_special_tokens": {"type": "boolean", "default": True},
                "prompt_name": common["prompt_name"],
                "truncate": {**common["truncate"], "description": "an extension: cut texts "
                             "longer than the model's positions instead of refusing them"}}),
            "responses": answer({"type": "array", "items": {"type": "array", "items": token}},
                                "each text's tokens", _TEI_TOKENIZES)}},
        "/decode": {"post": {
            "summary": "TEI: token ids back to text",
            "requestBody": request({
                "ids": {"oneOf": [ids, {"type": "array", "minItems": 1, "items": ids}],
                        "example": [101, 3086, 2003, 2035, 2017, 2342, 102]},
                "skip_special_tokens": {"type": "boolean", "default": True}}, ("ids",)),
            "responses": answer({"type": "array", "items": {"type": "string"}}, "the texts",
                                _TEI_TOKENIZES)}},
        "/info": {"get": {"summary": "TEI: the model served and the server's limits",
                          "responses": {"200": _json(info, "TEI's Info"),
                                        **_refusals(_TEI_ERROR, (401,))}}},
    }



# Each route's peer of origin, which the page groups routes by.
_TEI = ("/", "/embed", "/embed_all", "/tokenize", "/decode", "/info")
_INFINITY = ("/embeddings", "/models")


def _peer(path: str) -> str:
    if path.startswith("/v1/"):
        return "OpenAI"
    if path.startswith("/v2"):
        return "KServe v2 (Open Inference Protocol)"
    if path in _TEI:
        return "Text Embeddings Inference"
    return "Infinity" if path in _INFINITY else "attnserve"


def openapi_document(infos: list[ModelInfo]) -> bytes:
    """The HTTP API of a server of these models (the first the default)."""
    def union(kind: str) -> list[str]:
        return list(dict.fromkeys(t.name for info in infos for t in getattr(info, kind)))
    tensor_meta = {"type": "object", "required": ["name", "datatype", "shape"],
                   "properties": {"name": {"type": "string"}, "datatype": {"type": "string"},
                                  "shape": {"type": "array", "items": {"type": "integer"}}}}
    parameters = {"type": "object", "additionalProperties": True}
    input_tensor = {
        "type": "object", "required": ["name", "shape", "datatype"],
        "properties": {
            "name": {"type": "string", "enum": union("inputs")},
            "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
            "datatype": {"type": "string", "enum": ["INT64"]},
            "parameters": {"type": "object", "properties": {
                "binary_data_size": {"type": "integer", "minimum": 0}}},
            "data": {"type": "array", "items": {}}}}
    output_request = {
        "type": "object", "required": ["name"],
        "properties": {"name": {"type": "string", "enum": union("outputs")},
                       "parameters": {"type": "object", "properties": {
                           "binary_data": {"type": "boolean"}}}}}
    infer_request = {
        "type": "object", "required": ["inputs"],
        "properties": {
            "id": {"type": "string"},
            "parameters": {"type": "object", "properties": {
                "binary_data_output": {"type": "boolean"},
                "timeout": {"type": "integer", "minimum": 1,
                            "description": "deadline in microseconds"}}},
            "inputs": {"type": "array", "items": input_tensor},
            "outputs": {"type": "array", "items": output_request}}}
    infer_response = {
        "type": "object", "required": ["model_name", "outputs"],
        "properties": {
            "model_name": {"type": "string"}, "model_version": {"type": "string"},
            "id": {"type": "string"},
            "outputs": {"type": "array", "items": {
                "type": "object", "required": ["name", "shape", "datatype"],
                "properties": {"name": {"type": "string"}, "datatype": {"type": "string"},
                               "shape": {"type": "array", "items": {"type": "integer"}},
                               "parameters": parameters,
                               "data": {"type": "array", "items": {"type": "number"}}}}}}}
    ids = {"type": "array", "minItems": 1,
           "items": {"type": "integer", "minimum": 0,
                     "maximum": max(info.vocab_size for info in infos) - 1}}
    embeddings_request = {
        "type": "object", "required": ["input"], "additionalProperties": False,
        "properties": {
            "input": {"oneOf": [
                {"type": "string", "minLength": 1},
                {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                ids,
                {"type": "array", "minItems": 1, "items": ids}],
                "description": "texts, or the model's own token ids (special tokens included)"},
            "model": {"type": "string", "enum": [info.model for info in infos],
                      "description": "one of GET /v1/models; omitted: the server's default, "
                                     f"{infos[0].model}"},
            "encoding_format": {"type": "string", "enum": ["float", "base64"], "default": "float",
                                "description": "base64: every vector as the base64 of its "
                                               "little-endian bytes"},
            "embedding_dtype": {"type": "string", "enum": ["float32", "float16"],
                                "default": "float32",
                                "description": "an extension: float16 halves a base64 float "
                                               "vector (with encoding_format base64 only)"},
            "embedding_types": {
                "type": "array", "minItems": 1, "uniqueItems": True,
                "items": {"type": "string", "enum": ["float", "int8", "uint8", "binary", "ubinary"]},
                "description": "an extension, Cohere's: each item carries `embeddings`, one "
                               "vector per type asked for (int8 and uint8 over the ranges the "
                               "export fitted; binary and ubinary the sign bits, 8 to a byte), "
                               "and an empty `embedding`"},
            "dimensions": {"type": "integer",
                           "enum": sorted({d for info in infos
                                           for d in (info.hidden_size, *info.matryoshka_dims)}),
                           "description": "the model's size, or one of its Matryoshka sizes "
                                          "(GetModelInfo's matryoshka_dims): the vectors' first "
                                          "values, normalised again"},
            "user": {"type": "string"},
            "truncate": {"type": "boolean", "default": False,
                         "description": "cut texts longer than the model's positions instead of "
                                        "refusing them (an extension)"},
            "truncation_direction": {"type": "string", "enum": ["right", "left", "Right", "Left"],
                                     "default": "right",
                                     "description": "with truncate: keep a text's start (right) "
                                                    "or its end (left), as TEI (an extension)"},
            "prompt_name": {"type": "string", "nullable": True,
                            "description": "one of the model's prompts (GetModelInfo's prompts), "
                                           "put before every text; omitted: the server's "
                                           "default prompt for the model (an extension)"},
            "chunking": {
                "type": "object", "nullable": True, "required": ["max_tokens"],
                "additionalProperties": False,
                "description": "an extension: one vector per chunk of each text (texts only), "
                               "each text whole, never truncated; data then holds one item per "
                               "chunk, in order",
                "properties": {
                    "max_tokens": {"type": "integer", "minimum": 1,
                                   "description": "the most tokens in one chunk, at most the "
                                                  "model's positions less its special tokens; "
                                                  "chunks end on word and, where they can, "
                                                  "sentence boundaries"},
                    "mode": {"type": "string", "enum": ["late", "isolated"], "default": "late",
                             "description": "late: the text runs whole in overlapping windows "
                                            "and each chunk pools its tokens' contextual "
                                            "embeddings; isolated: each chunk runs alone"},
                    "window_overlap": {"type": "integer", "minimum": 0, "default": 0,
                                       "description": "late only: tokens shared by "
                                                      "consecutive windows, at least "
                                                      "max_tokens - 1; 0 picks one"}}}}}
    embeddings_response = {
        "type": "object", "required": ["object", "data", "model", "usage"],
        "properties": {
            "object": {"type": "string", "enum": ["list"]},
            "model": {"type": "string"},
            "data": {"type": "array", "items": {
                "type": "object", "required": ["object", "index", "embedding"],
                "properties": {
                    "object": {"type": "string", "enum": ["embedding"]},
                    "index": {"type": "integer"},
                    "embedding": {"oneOf": [
                        {"type": "array", "items": {"type": "number"}},
                        {"type": "string", "description": "base64 of little-endian float32"}]},
                    "embeddings": {
                        "type": "object", "description": "with embedding_types: each type's "
                                                         "vector (numbers, or base64)",
                        "additionalProperties": {"oneOf": [
                            {"type": "array", "items": {"type": "number"}}, {"type": "string"}]}},
                    "input_index": {"type": "integer",
                                    "description": "with chunking: the input this is a chunk of"},
                    "start": {"type": "integer", "description": "with chunking: the chunk's "
                                                                "first code point in its input"},
                    "end": {"type": "integer", "description": "with chunking: its end, exclusive"},
                    "num_tokens": {"type": "integer",
                                   "description": "with chunking: the chunk's tokens"}}}},
            "usage": {"type": "object", "required": ["prompt_tokens", "total_tokens"],
                      "properties": {"prompt_tokens": {"type": "integer"},
                                     "total_tokens": {"type": "integer"}}}}}

    def health(field: str, more: dict | None = None) -> dict:
        schema = {"type": "object", "required": [field, *(more or {})],
                  "properties": {field: {"type": "boolean"}, **(more or {})}}
        return {"200": _json(schema, f"{field}: true"), "400": _json(schema, f"{field}: false")}

    model_object = {"type": "object", "required": ["id", "object", "created", "owned_by"],
                    "properties": {"id": {"type": "string"},
                                   "object": {"type": "string", "enum": ["model"]},
                                   "created": {"type": "integer"}, "owned_by": {"type": "string"}}}
    model = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    version = {"name": "version", "in": "path", "required": True, "schema": {"type": "string"}}
    embeddings_example = {"input": ["attention is all you need"], "model": infos[0].model}
    infinity_request = {**embeddings_request, "properties": {
        **embeddings_request["properties"],
        "model": {**embeddings_request["properties"]["model"],
                  "enum": [INFINITY_DEFAULT_MODEL, *embeddings_request["properties"]["model"]["enum"]],
                  "description": f"{INFINITY_DEFAULT_MODEL} or omitted: the server's default"},
        "dimensions": {"type": "integer", "enum": [0, *sorted({i.hidden_size for i in infos})],
                       "description": "0 or the model's one size"},
        "modality": {"type": "string", "enum": ["text"], "default": "text"}}}
    infinity_response = {**embeddings_response,
                         "required": [*embeddings_response["required"], "id", "created"],
                         "properties": {**embeddings_response["properties"],
                                        "id": {"type": "string"}, "created": {"type": "integer"}}}
    embeddings_refusals = _refusals(_OPENAI_ERROR, (400, 401, 404, 408, 413, 415, 429, 503, 504))
    paths: dict = {
        "/health": {"get": {"summary": "Readiness for load balancers", "responses": _HEALTH}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {
            "200": _json({"type": "object"}, "the OpenAPI document")}}},
        "/docs": {"get": {"summary": "This document as a page (Swagger UI)", "responses": {
            "200": {"description": "the page", "content": {"text/html": {"schema": {
                "type": "string"}}}}}}},
        "/docs/start.js": {"get": {"summary": "The page's script", "responses": {
            "200": {"description": "the script", "content": {"text/javascript": {"schema": {
                "type": "string"}}}}}}},
        "/docs/{file}": {"get": {
            "summary": "Swagger UI's files, from the swagger-ui-bundle package",
            "parameters": [{"name": "file", "in": "path", "required": True,
                            "schema": {"type": "string", "enum": list(FILES)}}],
            "responses": {"200": {"description": "the file", "content": {
                kind: {"schema": {"type": "string"}} for kind in dict.fromkeys(FILES.values())}},
                **_refusals(_ERROR, (404,))}}},
        "/v1/embeddings": {"post": {
            "summary": "OpenAI-compatible embeddings (mean-pooled, normalised), one per input or, "
                       "with chunking, one per chunk",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": embeddings_request, "example": embeddings_example}}},
            "responses": {"200": _json(embeddings_response, "one vector per input, in order"),
                          **embeddings_refusals}}},
        "/embeddings": {"post": {
            "summary": "Infinity's embeddings: OpenAI's, with Infinity's fields",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": infinity_request, "example": embeddings_example}}},
            "responses": {"200": _json(infinity_response, "one vector per input, in order"),
                          **embeddings_refusals}}},
        "/models": {"get": {"summary": "The models served, as Infinity lists them", "responses": {
            "200": _json({"type": "object", "required": ["object", "data"], "properties": {
                "object": {"type": "string", "enum": ["list"]},
                "data": {"type": "array", "items": {**model_object, "required": [
                    *model_object["required"], "backend", "capabilities", "stats"],
                    "properties": {**model_object["properties"],
                                   "owned_by": {"type": "string", "enum": ["infinity"]},
                                   "backend": {"type": "string"},
                                   "capabilities": {"type": "array", "items": {"type": "string"}},
                                   "stats": {"type": "object"}}}}}},
                "every model, the default first"), **_refusals(_OPENAI_ERROR, (401,))}}},
        "/v1/models": {"get": {"summary": "The models served, as OpenAI lists them", "responses": {
            "200": _json({"type": "object", "required": ["object", "data"], "properties": {
                "object": {"type": "string", "enum": ["list"]},
                "data": {"type": "array", "items": model_object}}}, "every model, the default first"),
            **_refusals(_OPENAI_ERROR, (401,))}}},
        "/v1/models/{model}": {"get": {
            "summary": "One model, as OpenAI describes it",
            "parameters": [{"name": "model", "in": "path", "required": True,
                            "schema": {"type": "string"}}],
            "responses": {"200": _json(model_object, "the model"),
                          **_refusals(_OPENAI_ERROR, (401, 404))}}},
        "/v2/repository/index": {"post": {
            "summary": "The model repository (Triton's extension)",
            "requestBody": {"required": False, "content": {"application/json": {"schema": {
                "type": "object", "properties": {"ready": {"type": "boolean"}}}}}},
            "responses": {"200": _json({"type": "array", "items": {
                "type": "object", "required": ["name", "version", "state", "reason"],
                "properties": {key: {"type": "string"}
                               for key in ("name", "version", "state", "reason")}}},
                "every model, with its state"), **_refusals(_ERROR, (400, 401, 408, 413, 415))}}},
        "/v2/health/live": {"get": {"summary": "Open Inference Protocol: live",
                                    "responses": health("live")}},
        "/v2/health/ready": {"get": {"summary": "Open Inference Protocol: ready",
                                     "responses": health("ready")}},
        "/v2": {"get": {"summary": "Server metadata", "responses": {"200": _json(
            {"type": "object", "required": ["name", "version", "extensions"],
             "properties": {"name": {"type": "string"}, "version": {"type": "string"},
                            "extensions": {"type": "array", "items": {"type": "string"}}}},
            "the server's name, version and extensions"), **_refusals(_ERROR, (401,))}}},
    }
    for base, params in (("/v2/models/{name}", [model]),
                         ("/v2/models/{name}/versions/{version}", [model, version])):
        paths[base] = {"get": {"summary": "Model metadata", "parameters": params, "responses": {
            "200": _json({"type": "object", "required": ["name", "versions", "platform",
                                                         "inputs", "outputs"],
                          "properties": {"name": {"type": "string"},
                                         "versions": {"type": "array", "items": {"type": "string"}},
                                         "platform": {"type": "string"},
                                         "inputs": {"type": "array", "items": tensor_meta},
                                         "outputs": {"type": "array", "items": tensor_meta}}},
                         "the model's tensors"), **_refusals(_ERROR, (401, 404))}}}
        paths[base + "/ready"] = {"get": {"summary": "Model readiness", "parameters": params,
                                          "responses": {**health("ready", {"name": {"type": "string"}}),
                                                        **_refusals(_ERROR, (401, 404))}}}
        paths[base + "/infer"] = {"post": {
            "summary": "Inference on tensors: input_ids and attention_mask, INT64 [batch, seq]",
            "parameters": [*params, {
                "name": "Inference-Header-Content-Length", "in": "header", "required": False,
                "schema": {"type": "integer", "minimum": 0},
                "description": "with binary tensor data: the JSON header's length in bytes"}],
            "requestBody": {"required": True, "content": {
                "application/json": {"schema": infer_request},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
            "responses": {"200": {"description": "the outputs asked for, zero past each row's "
                                                 "length", "content": {
                "application/json": {"schema": infer_response},
                "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}},
                **_refusals(_ERROR, (400, 401, 404, 408, 413, 415, 429, 503, 504))}}}
    paths |= _tei_paths(infos, ids)
    paths |= _scoring_paths(infos)
    if infos[0].kind == RERANKER:  # TEI routes its root by the model's kind
        paths["/"]["post"] = {**paths["/rerank"]["post"],
                              "summary": "TEI's root: a reranker's is /rerank"}
    for path, operations in paths.items():
        for operation in operations.values():
            operation["tags"] = [_peer(path)]
    document = {
        "openapi": "3.0.3",
        "info": {"title": "attnserve HTTP API", "version": SERVER_VERSION,
                 "description": "Serving " + ", ".join(
                     f"{info.model} ({info.hidden_size} dimensions, {info.max_positions} "
                     "positions)" for info in infos) + f"; the default is {infos[0].model}."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": paths,
    }
    return orjson.dumps(document)


def _scoring_paths(infos: list[ModelInfo]) -> dict:
    """TEI's /rerank and /similarity, Cohere's and Jina's /v1/rerank and Cohere's /v2/rerank."""
    def models(kind: str) -> dict:
        names = ", ".join(info.model for info in infos if info.kind == kind) or "none served"
        return {"type": "string",
                "description": f"a model of kind {kind} ({names}); omitted: the first"}

    texts = {"type": "array", "items": {"type": "string"}}
    flag = {"type": "boolean", "default": False}
    rerank = {"type": "object", "required": ["query", "texts"], "properties": {
        "query": {"type": "string"}, "texts": texts, "truncate": flag, "raw_scores": flag,
        "return_text": flag, "model": models("reranker")}}
    ranks = {"type": "array", "items": {
        "type": "object", "required": ["index", "score"],
        "properties": {"index": {"type": "integer"}, "score": {"type": "number"},
                       "text": {"type": "string"}}}}
    similarity = {"type": "object", "required": ["inputs"], "properties": {
        "inputs": {"type": "object", "required": ["source_sentence", "sentences"], "properties": {
            "source_sentence": {"type": "string"}, "sentences": texts}},
        "truncate": flag, "model": models("embedder")}}
    documents = {"type": "array", "items": {"oneOf": [
        {"type": "string"},
        {"type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}]}}
    cohere = {"type": "object", "required": ["query", "documents"], "properties": {
        "query": {"type": "string"}, "documents": documents, "model": models("reranker"),
        "top_n": {"type": "integer", "minimum": 1}, "return_documents": flag,
        "max_tokens_per_doc": {"type": "integer", "minimum": 1},
        "truncate": {**flag, "description": "an extension: cut a long pair's document, never "
                                            "its query, instead of refusing it"}}}
    cohere_response = {"type": "object", "required": ["id", "model", "results", "usage"],
                       "properties": {
                           "id": {"type": "string"}, "model": {"type": "string"},
                           "results": {"type": "array", "items": {
                               "type": "object", "required": ["index", "relevance_score"],
                               "properties": {"index": {"type": "integer"},
                                              "relevance_score": {"type": "number"},
                                              "document": {"type": "object", "properties": {
                                                  "text": {"type": "string"}}}}}},
                           "usage": {"type": "object", "required": ["total_tokens"],
                                     "properties": {"total_tokens": {"type": "integer"}}}}}

    def post(summary: str, body: dict, answer: dict, described: str, error: dict,
             statuses: tuple[int, ...]) -> dict:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {
            "application/json": {"schema": body}}},
            "responses": {"200": _json(answer, described), **_refusals(error, statuses)}}}

    cohere_route = post("Cohere's and Jina's rerank: a reranker's relevance_score (sigmoid) of "
                        "each (query, document) pair", cohere, cohere_response,
                        "highest score first", _COHERE_ERROR, _COHERE_STATUSES)
    return {
        "/rerank": post("TEI's rerank: a reranker's score of each (query, text) pair", rerank,
                        ranks, "highest score first", _TEI_ERROR, _TEI_SCORES),
        "/similarity": post("TEI's similarity: the cosine of the source sentence's pooled vector "
                            "and each sentence's", similarity,
                            {"type": "array", "items": {"type": "number"}},
                            "one score a sentence, in order", _TEI_ERROR, _TEI_SCORES),
        "/v1/rerank": cohere_route, "/v2/rerank": cohere_route}
