"""The Open Inference Protocol (KServe v2) over HTTP/REST, through the data plane: an infer
request's JSON (and binary data, Triton's binary tensor extension, which tritonclient.http
uses by default) becomes the data plane's tensors, and its outputs JSON tensors or binary
data, as asked (docs/api.md, "HTTP: KServe v2 REST")."""

import re
import time

import numpy as np
from aiohttp import web

from attnserve.server.call import SERVER_NAME, SERVER_VERSION
from attnserve.server.engine import tensors
from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.offload import COPY_BYTE_S, FLOAT_TEXT_S
from attnserve.server.engine.requests import InputTensor, ResponseSize, Shapes, TensorRequest
from attnserve.server.errors import InvalidArgument, quote
from attnserve.server.http import schemas as s
from attnserve.server.http.calls import JSON_CHAR_BYTES, JSON_FLOAT_BYTES
from attnserve.server.http.door import Door, encode, json_response, numbers
from attnserve.server.kserve import MODEL_VERSION, find_model, input_tensor, model_metadata, repository_index
from attnserve.server.memory.ledger import Holds

HEADER_LENGTH = "Inference-Header-Content-Length"
# Triton's extensions this door implements: binary tensor data, and the repository index.
EXTENSIONS = ["binary_tensor_data", "model_repository"]
ADVICE = "request fewer attentions.K outputs, binary_data outputs, or a smaller batch"
_DIGITS = re.compile(r"[0-9]{1,12}")


def _readiness(ready: s.Ready) -> web.Response:
    return json_response(ready, status=200 if ready.ready else 400)


def _at(index: int, dims: list[int]) -> str:
    """`[i][j]…`: where the index-th list (row-major) of a level whose lists' dimensions
    are `dims` sits in a tensor's data."""
    return "".join(f"[{i}]" for i in np.unravel_index(index, dims))


def _values(data, shape: list[int], field: str) -> list:
    """A JSON tensor's `data` as a flat list of integers: flat (row-major, KServe's
    choice), or nested exactly as `shape`. Nested data is walked one level at a time, never
    by recursion, so data nested deeper than its shape is refused at the level below the
    shape's last, whatever its depth, and no value is read before the nesting is checked."""
    if any(isinstance(value, list) for value in data):
        level = [data]
        for depth, size in enumerate(shape):
            for i, item in enumerate(level):
                if not isinstance(item, list) or len(item) != size:
                    where = _at(i, shape[:depth])
                    found = f"a list of {len(item)}" if isinstance(item, list) else quote(item)
                    raise InvalidArgument(field, f"{where + ' is ' if where else ''}{found} where "
                                          f"shape {shape} needs a list of {size}")
            level = [value for item in level for value in item]
        data = level
    for i, value in enumerate(data):
        if type(value) is not int:  # bool is an int to Python, not to JSON
            if isinstance(value, list):
                raise InvalidArgument(field, f"nested deeper than shape {shape}: {_at(i, shape)} is a list")
            raise InvalidArgument(field, f"{quote(value)} is not an INT64 value")
    return data


class InferCall:
    """One infer request, read: its tensors, the outputs asked for and which of them
    travel as binary data, its id and deadline; and its answer (a TensorAnswer), sized
    against the door's `limit`."""

    def __init__(self, header: s.Infer, binary: bytes, model: str, limit: int):
        self.inputs = self._inputs(header, binary)
        self.id, self.model, self.limit = header.id, model, limit
        parameters = header.parameters or s.InferParameters()
        self.outputs = [output.name for output in header.outputs]
        every = parameters.binary_data_output
        self.binary = {o.name for o in header.outputs
                       if (every if o.parameters is None or o.parameters.binary_data is None
                           else o.parameters.binary_data)}
        self.every_binary = every and not self.outputs
        self.deadline = None if parameters.timeout is None else time.monotonic() + parameters.timeout / 1e6

    @staticmethod
    def _inputs(header: s.Infer, binary: bytes) -> list[InputTensor]:
        tensors, offset = [], 0
        for i, tensor in enumerate(header.inputs):
            field = f"inputs[{i}]"
            size = tensor.parameters and tensor.parameters.binary_data_size
            if size is None:
                if tensor.data is None:
                    raise InvalidArgument(field, "needs data, or parameters.binary_data_size")
                data = _values(tensor.data, tensor.shape, f"{field}.data")
            else:
                if offset + size > len(binary):
                    raise InvalidArgument(f"{field}.parameters.binary_data_size",
                                          f"{quote(size)}; {len(binary) - offset} binary bytes are left")
                data, offset = binary[offset:offset + size], offset + size
            tensors.append(input_tensor(i, tensor.name, tensor.datatype, tensor.shape, data))
        if offset != len(binary):
            raise InvalidArgument("body", f"{len(binary) - offset} binary bytes after the inputs "
                                  "that binary_data_size accounts for")
        return tensors

    def travels_binary(self, name: str) -> bool:
        return self.every_binary or name in self.binary

    def size(self, shapes: Shapes) -> ResponseSize:
        """Raw bytes for binary outputs, JSON text for the rest."""
        total = 256 + len(self.id or "") * JSON_CHAR_BYTES
        for name, shape in shapes:
            values = int(np.prod(shape, dtype=np.int64))
            total += 128 + values * (4 if self.travels_binary(name) else JSON_FLOAT_BYTES)
        return ResponseSize(lambda _: total, self.limit, ADVICE)

    def seconds(self, shapes: Shapes) -> float:
        return sum(int(np.prod(shape, dtype=np.int64)) * (4 * COPY_BYTE_S if self.travels_binary(name)
                                                          else FLOAT_TEXT_S) for name, shape in shapes)

    def respond(self, outputs: list[tuple[str, np.ndarray]]) -> tuple[bytes, int | None]:
        """(the body, the JSON header's length when binary data follows it)"""
        entries, chunks = [], []
        for name, array in outputs:
            entry = s.OutputTensor(name, "FP32", list(array.shape))
            if self.travels_binary(name):
                entry.parameters = s.OutputTensorParameters(array.nbytes)
                chunks.append(array.tobytes())
            else:
                entry.data = numbers(array.ravel())
            entries.append(entry)
        header = encode(s.Inferred(self.model, MODEL_VERSION, entries,
                                   *(() if self.id is None else (self.id,))))
        if not chunks:
            return header, None
        return b"".join([header, *chunks]), len(header)


class KServeDoor(Door):
    def routes(self) -> list[web.RouteDef]:
        routes = [web.get("/v2/health/live", self.live), web.get("/v2/health/ready", self.ready),
                  web.get("/v2", self.server_metadata),
                  self.route("POST", "/v2/repository/index", self.repository_index)]
        for model in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
            routes += [self.route("GET", model, self.model_metadata, "http:/v2/metadata"),
                       self.route("GET", model + "/ready", self.model_ready, "http:/v2/ready"),
                       self.route("POST", model + "/infer", self.infer, "http:/v2/infer")]
        return routes

    def _model(self, request: web.Request) -> ServedModel:
        return find_model(self.plane, request.match_info["name"],
                          request.match_info.get("version"), "model", "version")

    async def live(self, request: web.Request) -> web.Response:
        return json_response(s.Live(True))

    async def ready(self, request: web.Request) -> web.Response:
        return _readiness(s.Ready(self.plane.serving()))

    async def server_metadata(self, request: web.Request) -> web.Response:
        return json_response(s.ServerMetadata(SERVER_NAME, SERVER_VERSION, EXTENSIONS))

    async def model_metadata(self, request: web.Request, holds: Holds) -> web.Response:
        return json_response(model_metadata(self._model(request)))

    async def model_ready(self, request: web.Request, holds: Holds) -> web.Response:
        model = self._model(request)
        return _readiness(s.Ready(model.serving(), model.name))

    async def repository_index(self, request: web.Request, holds: Holds) -> web.Response:
        """Triton's extension: {"ready": bool} in an optional body, the models as a list."""
        self.calls.check_type(request, ("application/json",), optional=True)
        body = await self.calls.body(request, holds)
        options = await self.calls.json(body, s.RepositoryIndex) if body.strip() else s.RepositoryIndex()
        return json_response(repository_index(self.plane, options.ready))

    async def infer(self, request: web.Request, holds: Holds) -> web.Response:
        self.plane.check_serving()
        model = self._model(request)
        self.calls.check_type(request, ("application/json", "application/octet-stream"), optional=True)
        length = request.headers.get(HEADER_LENGTH)
        if length is not None and not _DIGITS.fullmatch(length):
            raise InvalidArgument(HEADER_LENGTH, f"{quote(length[:32])}; expected the JSON "
                                  "header's length in bytes")
        body = await self.calls.body(request, holds)
        if length is not None and int(length) > len(body):
            raise InvalidArgument(HEADER_LENGTH, f"{length}; the body has {len(body)} bytes")
        split = len(body) if length is None else int(length)
        header, binary = body[:split], body[split:]
        call = await self.calls.json(header, s.Infer, lambda parsed: InferCall(
            parsed, binary, model.name, self.max_response_bytes))
        payload, header_length = await tensors.run(model, TensorRequest(call.inputs, call.outputs, call),
                                                   holds, call.deadline)
        if header_length is None:
            return web.Response(body=payload, content_type="application/json")
        return web.Response(body=payload, content_type="application/octet-stream",
                            headers={HEADER_LENGTH: str(header_length)})
