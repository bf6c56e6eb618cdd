"""The OpenAPI 3.0 description of the HTTP port, served at /openapi.json: the OpenAI-
compatible /v1/embeddings (after OpenAI's own definition of the embeddings API), the
Open Inference Protocol's REST routes (after its specification, with Triton's binary
tensor extension), and /health. Every status a route answers and every body shape is
in it; the test suite checks the running server against it (schemathesis)."""

import orjson

from attnserve.server.engine.requests import ModelInfo

_ERROR = {"type": "object", "required": ["error"],
          "properties": {"error": {"type": "string"}}}
_OPENAI_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": {"type": "string", "nullable": True},
                       "code": {"type": "string", "nullable": True}}}}}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _refusals(schema: dict, statuses: tuple[int, ...]) -> dict:
    reasons = {400: "the request names a field that is wrong, and why",
               401: "no valid API key (when the server has keys)",
               404: "no such model, version or route",
               408: "the body did not arrive within --http-body-timeout-seconds",
               413: "the body, or what it asks for, is larger than the server takes",
               415: "a content type or encoding the route does not take",
               429: "the queue or the memory budget is full: retry with backoff",
               503: "the server is starting or draining: send the request elsewhere",
               504: "the request's deadline passed while it waited"}
    return {str(status): _json(schema, reasons[status]) for status in statuses}


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
        "type": "object", "required": ["input"],
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
            "encoding_format": {"type": "string", "enum": ["float", "base64"], "default": "float"},
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
    paths: dict = {
        "/health": {"get": {"summary": "Readiness for load balancers", "responses": {
            "200": _json({"type": "object", "properties": {"status": {"type": "string"}}}, "serving"),
            "503": _json({"type": "object", "properties": {"status": {"type": "string"}}},
                         "starting or draining")}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {
            "200": _json({"type": "object"}, "the OpenAPI document")}}},
        "/v1/embeddings": {"post": {
            "summary": "OpenAI-compatible embeddings (mean-pooled, normalised), one per input or, "
                       "with chunking, one per chunk",
            "requestBody": {"required": True, "content": {
                "application/json": {"schema": embeddings_request}}},
            "responses": {"200": _json(embeddings_response, "one vector per input, in order"),
                          **_refusals(_OPENAI_ERROR, (400, 401, 404, 408, 413, 415, 429, 503,
                                                      504))}}},
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
    document = {
        "openapi": "3.0.3",
        "info": {"title": "attnserve HTTP API", "version": "0.1.0",
                 "description": "Serving " + ", ".join(
                     f"{info.model} ({info.hidden_size} dimensions, {info.max_positions} "
                     "positions)" for info in infos) + f"; the default is {infos[0].model}."},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "paths": paths,
    }
    return orjson.dumps(document)
