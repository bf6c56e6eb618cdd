"""The Open Inference Protocol (KServe v2) over HTTP/REST, through the data plane: an infer
request's JSON (and binary data, Triton's binary tensor extension, which
tritonclient.http uses by default) becomes the data plane's tensors, and its outputs become
JSON tensors or binary data, as asked.

Every route is served with and without the model version (`/v2/models/{name}` and
`/v2/models/{name}/versions/1`). Health answers {"live": bool} and {"ready": bool}, with
200 for true and 400 for false; model readiness {"name", "ready"}. Errors are
{"error": "<message>"}."""

import re
import time

import numpy as np
import orjson
from aiohttp import web

from attnserve.server.call import SERVER_NAME, SERVER_VERSION
from attnserve.server.engine import tensors
from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.offload import COPY_BYTE_S, FLOAT_TEXT_S
from attnserve.server.engine.plane import DataPlane
from attnserve.server.engine.requests import InputTensor, ResponseSize, TensorRequest
from attnserve.server.errors import InvalidArgument, RequestError, quote
from attnserve.server.http.calls import JSON_FLOAT_BYTES, HttpCalls
from attnserve.server.kserve import (
    MODEL_VERSION,
    find_model,
    input_tensor,
    model_metadata,
    repository_index,
)
from attnserve.server.memory.ledger import Holds

HEADER_LENGTH = "Inference-Header-Content-Length"
# Triton's extensions this door implements: binary tensor data, and the repository index.
EXTENSIONS = ["binary_tensor_data", "model_repository"]
ADVICE = "request fewer attentions.K outputs, binary_data outputs, or a smaller batch"
_DIGITS = re.compile(r"[0-9]{1,12}")


def _health(field: str, ok: bool, **more) -> web.Response:
    return web.json_response({**more, field: ok}, status=200 if ok else 400)


def _dict(value, field: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidArgument(field, "expected a JSON object")
    return value


def _list(value, field: str) -> list:
    if not isinstance(value, list):
        raise InvalidArgument(field, "expected a JSON list")
    return value


def _shape(value, field: str) -> list[int]:
    if not isinstance(value, list) or not all(type(d) is int and d >= 0 for d in value):
        raise InvalidArgument(field, f"{quote(value)}; expected a list of integers ≥ 0")
    return value


def _at(index: int, dims: list[int]) -> str:
    """`[i][j]…`: where the index-th list (row-major) of a level whose lists' dimensions
    are `dims` sits in a tensor's data."""
    path = []
    for size in reversed(dims):
        index, i = divmod(index, size)
        path.append(f"[{i}]")
    return "".join(reversed(path))


def _values(data, shape: list[int], field: str) -> list:
    """A JSON tensor's `data` as a flat list of integers: flat (row-major, KServe's
    choice), or nested exactly as `shape`. Nested data is walked one level at a time, never
    by recursion, so data nested deeper than its shape is refused at the level below the
    shape's last, whatever its depth, and no value is read before the nesting is checked."""
    values = _list(data, field)
    if any(isinstance(value, list) for value in values):
        level = [values]
        for depth, size in enumerate(shape):
            for i, item in enumerate(level):
                if not isinstance(item, list) or len(item) != size:
                    where = _at(i, shape[:depth])
                    found = f"a list of {len(item)}" if isinstance(item, list) else quote(item)
                    raise InvalidArgument(field, f"{where + ' is ' if where else ''}{found} where "
                                          f"shape {shape} needs a list of {size}")
            level = [value for item in level for value in item]
        values = level
    for i, value in enumerate(values):
        if type(value) is not int:  # bool is an int to Python, not to JSON
            if isinstance(value, list):
                raise InvalidArgument(field, f"nested deeper than shape {shape}: "
                                      f"{_at(i, shape)} is a list")
            raise InvalidArgument(field, f"{quote(value)} is not an INT64 value")
    return values


class InferCall:
    """One infer request, read: its tensors, the outputs asked for and which of them
    travel as binary data, its id and deadline."""

    def __init__(self, header, binary: bytes):
        header = _dict(header, "body")
        self.inputs = self._inputs(_list(header.get("inputs"), "inputs"), binary)
        request_id = header.get("id")
        if request_id is not None and not isinstance(request_id, str):
            raise InvalidArgument("id", f"{quote(request_id)}; expected a string")
        self.id = request_id
        parameters = _dict(header.get("parameters", {}), "parameters")
        every_binary = parameters.get("binary_data_output", False)
        if not isinstance(every_binary, bool):
            raise InvalidArgument("parameters.binary_data_output", f"{quote(every_binary)}; "
                                  "expected true or false")
        self.outputs: list[str] = []
        self.binary: set[str] = set()
        for i, output in enumerate(_list(header.get("outputs", []), "outputs")):
            output = _dict(output, f"outputs[{i}]")
            name = output.get("name")
            if not isinstance(name, str):
                raise InvalidArgument(f"outputs[{i}].name", "required, a string")
            self.outputs.append(name)
            wants = _dict(output.get("parameters", {}), f"outputs[{i}].parameters")
            binary_data = wants.get("binary_data", every_binary)
            if not isinstance(binary_data, bool):
                raise InvalidArgument(f"outputs[{i}].parameters.binary_data",
                                      f"{quote(binary_data)}; expected true or false")
            if binary_data:
                self.binary.add(name)
        self.every_binary = every_binary and not self.outputs
        timeout = parameters.get("timeout")
        if timeout is not None and (type(timeout) is not int or timeout <= 0):
            raise InvalidArgument("parameters.timeout", f"{quote(timeout)}; expected "
                                  "microseconds > 0")
        self.deadline = None if timeout is None else time.monotonic() + timeout / 1e6

    @staticmethod
    def _inputs(inputs: list, binary: bytes) -> list[InputTensor]:
        tensors, offset = [], 0
        for i, tensor in enumerate(inputs):
            tensor = _dict(tensor, f"inputs[{i}]")
            name, datatype = tensor.get("name"), tensor.get("datatype")
            if not isinstance(name, str) or not isinstance(datatype, str):
                raise InvalidArgument(f"inputs[{i}]", "name and datatype are required strings")
            field = f"inputs[{i}]"
            shape = _shape(tensor.get("shape"), f"{field}.shape")
            size = _dict(tensor.get("parameters", {}), f"{field}.parameters").get("binary_data_size")
            if size is None:
                if "data" not in tensor:
                    raise InvalidArgument(field, "needs data, or parameters.binary_data_size")
                data = _values(tensor["data"], shape, f"{field}.data")
            else:
                if type(size) is not int or size < 0 or offset + size > len(binary):
                    raise InvalidArgument(f"{field}.parameters.binary_data_size",
                                          f"{quote(size)}; {len(binary) - offset} binary bytes "
                                          "are left")
                data, offset = binary[offset:offset + size], offset + size
            tensors.append(input_tensor(i, name, datatype, shape, data))
        if offset != len(binary):
            raise InvalidArgument("body", f"{len(binary) - offset} binary bytes after the inputs "
                                  "that binary_data_size accounts for")
        return tensors

    def travels_binary(self, name: str) -> bool:
        return self.every_binary or name in self.binary

    def size(self, limit: int):
        """The response's size for the data plane's (name, shape) outputs: raw bytes for
        binary outputs, JSON text for the rest."""
        def for_outputs(shapes: list[tuple[str, tuple[int, ...]]]) -> ResponseSize:
            total = 256 + len(self.id or "") * 6
            for name, shape in shapes:
                values = int(np.prod(shape, dtype=np.int64))
                total += 128 + values * (4 if self.travels_binary(name) else JSON_FLOAT_BYTES)
            return ResponseSize(lambda _: total, limit, ADVICE)
        return for_outputs

    def respond(self, model: str, outputs: list[tuple[str, np.ndarray]]) -> tuple[bytes, int | None]:
        """(the body, the JSON header's length when binary data follows it)"""
        entries, chunks = [], []
        for name, array in outputs:
            entry = {"name": name, "datatype": "FP32", "shape": list(array.shape)}
            if self.travels_binary(name):
                raw = array.tobytes()
                entry["parameters"] = {"binary_data_size": len(raw)}
                chunks.append(raw)
            else:
                entry["data"] = array.ravel()
            entries.append(entry)
        head = {"model_name": model, "model_version": MODEL_VERSION}
        if self.id is not None:
            head["id"] = self.id
        header = orjson.dumps({**head, "outputs": entries}, option=orjson.OPT_SERIALIZE_NUMPY)
        if not chunks:
            return header, None
        return b"".join([header, *chunks]), len(header)


class KServeHttp:
    def __init__(self, calls: HttpCalls, plane: DataPlane, max_response_bytes: int):
        self.calls = calls
        self.plane = plane
        self.max_response_bytes = max_response_bytes

    def routes(self) -> list[web.RouteDef]:
        routes = [web.get("/v2/health/live", self.live), web.get("/v2/health/ready", self.ready),
                  web.get("/v2", self.server_metadata),
                  web.post("/v2/repository/index", self.repository_index)]
        for model in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
            routes += [web.get(model, self.model_metadata),
                       web.get(model + "/ready", self.model_ready),
                       web.post(model + "/infer", self.infer)]
        return routes

    def _model(self, request: web.Request) -> ServedModel:
        return find_model(self.plane, request.match_info["name"],
                          request.match_info.get("version"), "model", "version")

    async def live(self, request: web.Request) -> web.Response:
        return _health("live", True)

    async def ready(self, request: web.Request) -> web.Response:
        return _health("ready", self.plane.serving())

    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response({"name": SERVER_NAME, "version": SERVER_VERSION,
                                  "extensions": EXTENSIONS})

    async def model_metadata(self, request: web.Request) -> web.StreamResponse:
        async def handle(holds: Holds) -> web.Response:
            return web.json_response(model_metadata(self._model(request)))
        return await self.calls.answer("http:/v2/metadata", request, handle, refusal)

    async def model_ready(self, request: web.Request) -> web.StreamResponse:
        async def handle(holds: Holds) -> web.Response:
            model = self._model(request)
            return _health("ready", model.serving(), name=model.name)
        return await self.calls.answer("http:/v2/ready", request, handle, refusal)

    async def repository_index(self, request: web.Request) -> web.StreamResponse:
        """Triton's extension: {"ready": bool} in an optional body, the models as a list."""
        async def handle(holds: Holds) -> web.Response:
            self.calls.check_type(request, ("application/json",), optional=True)
            body = await self.calls.body(request, holds)
            ready = False
            if body.strip():
                options = await self.calls.json(body, lambda parsed: _dict(parsed, "body"))
                ready = options.get("ready", False)
                if not isinstance(ready, bool):
                    raise InvalidArgument("ready", f"{quote(ready)}; expected true or false")
            return web.json_response(repository_index(self.plane, ready))
        return await self.calls.answer("http:/v2/repository/index", request, handle, refusal)

    async def _infer(self, request: web.Request, holds: Holds) -> web.Response:
        self.plane.check_serving()
        model = self._model(request)
        self.calls.check_type(request, ("application/json", "application/octet-stream"),
                              optional=True)
        length = request.headers.get(HEADER_LENGTH)
        if length is not None and not _DIGITS.fullmatch(length):
            raise InvalidArgument(HEADER_LENGTH, f"{quote(length[:32])}; expected the JSON "
                                  "header's length in bytes")
        body = await self.calls.body(request, holds)
        if length is None:
            header, binary = body, b""
        else:
            if int(length) > len(body):
                raise InvalidArgument(HEADER_LENGTH, f"{length}; the body has {len(body)} bytes")
            header, binary = body[:int(length)], body[int(length):]
        call = await self.calls.json(header, lambda parsed: InferCall(parsed, binary))
        outputs = await tensors.run(model, TensorRequest(
            call.inputs, call.outputs, call.size(self.max_response_bytes)), holds, call.deadline)
        values = sum(array.size for _, array in outputs)
        binary_only = all(call.travels_binary(name) for name, _ in outputs)
        payload, header_length = await model.pack(
            values * (4 * COPY_BYTE_S if binary_only else FLOAT_TEXT_S), call.respond,
            model.name, outputs)
        if header_length is None:
            return web.Response(body=payload, content_type="application/json")
        return web.Response(body=payload, content_type="application/octet-stream",
                            headers={HEADER_LENGTH: str(header_length)})

    async def infer(self, request: web.Request) -> web.StreamResponse:
        return await self.calls.answer("http:/v2/infer", request,
                                       lambda holds: self._infer(request, holds), refusal)


def refusal(err: RequestError, status: int) -> web.Response:
    return web.json_response({"error": err.message}, status=status)
