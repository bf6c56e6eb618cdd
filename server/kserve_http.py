"""The Open Inference Protocol (KServe v2) over HTTP/REST, on the same path as its gRPC
twin: an infer request's JSON becomes a ModelInferRequest, so every check is the gRPC
service's, and the ModelInferResponse's outputs become JSON tensors, or binary data where
asked (Triton's binary tensor extension, which tritonclient.http uses by default).

Health follows the protocol: 200 for true, 400 for false, empty bodies. Errors are
{"error": "<message>"}."""

import json
import time

import numpy as np
from aiohttp import web

from attnserve.server._proto.inference import grpc_service_pb2 as pb
from attnserve.server.errors import InvalidArgument, RequestError
from attnserve.server.holds import Holds
from attnserve.server.http_calls import HttpCalls, float32_json
from attnserve.server.kserve_service import SERVER_NAME, SERVER_VERSION, KServeService
from attnserve.server.respond import JSON_FLOAT_BYTES

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY_EXTENSION = "binary_tensor_data"
# Binary outputs up to this size are packed on the event loop (a copy); larger ones, and
# any JSON output (~0.7 µs a float to format), on a thread.
INLINE_RESPONSE_BYTES = 64 << 10


def _health(ok: bool) -> web.Response:
    return web.Response(status=200 if ok else 400)


def _dict(value, field: str) -> dict:
    if not isinstance(value, dict):
        raise InvalidArgument(field, "expected a JSON object")
    return value


def _list(value, field: str) -> list:
    if not isinstance(value, list):
        raise InvalidArgument(field, "expected a JSON list")
    return value


def _json_data(data, datatype: str, field: str) -> bytes:
    """A JSON tensor's `data` (flat or nested, row-major) as little-endian INT64 bytes."""
    if datatype != "INT64":
        return b""  # the shared checks refuse the datatype, naming it
    try:
        array = np.asarray(data)
    except ValueError as err:  # ragged nesting
        raise InvalidArgument(f"{field}.data", f"not a rectangular list ({err})") from err
    if array.size and array.dtype.kind not in "iu":
        raise InvalidArgument(f"{field}.data", "INT64 data must be integers")
    return array.astype("<i8").tobytes()


class InferCall:
    """One infer request, read: the ModelInferRequest, which outputs travel as binary data,
    and the caller's deadline."""

    def __init__(self, model: str, header, binary: bytes):
        header = _dict(header, "body")
        parameters = _dict(header.get("parameters", {}), "parameters")
        self.request = pb.ModelInferRequest(model_name=model, id=str(header.get("id", "")))
        self._inputs(_list(header.get("inputs"), "inputs"), binary)
        every_binary = parameters.get("binary_data_output", False) is True
        self.binary: set[str] = set()
        for i, output in enumerate(_list(header.get("outputs", []), "outputs")):
            output = _dict(output, f"outputs[{i}]")
            name = output.get("name")
            if not isinstance(name, str):
                raise InvalidArgument(f"outputs[{i}].name", "required, a string")
            self.request.outputs.add(name=name)
            wants = _dict(output.get("parameters", {}), f"outputs[{i}].parameters")
            if wants.get("binary_data", every_binary) is True:
                self.binary.add(name)
        self.every_binary = every_binary and not self.request.outputs
        self.all_binary = (all(o.name in self.binary for o in self.request.outputs)
                           if self.request.outputs else every_binary)
        """no output travels as JSON, so the size limit counts raw bytes"""
        timeout = parameters.get("timeout")
        if timeout is not None and (type(timeout) is not int or timeout <= 0):
            raise InvalidArgument("parameters.timeout", f"{timeout!r}; expected microseconds > 0")
        self.deadline = None if timeout is None else time.monotonic() + timeout / 1e6

    def _inputs(self, inputs: list, binary: bytes) -> None:
        offset = 0
        for i, tensor in enumerate(inputs):
            tensor = _dict(tensor, f"inputs[{i}]")
            name, datatype = tensor.get("name"), tensor.get("datatype")
            if not isinstance(name, str) or not isinstance(datatype, str):
                raise InvalidArgument(f"inputs[{i}]", "name and datatype are required strings")
            field = f"inputs[{i}] ({name})"
            try:
                self.request.inputs.add(name=name, datatype=datatype, shape=tensor.get("shape"))
            except (TypeError, ValueError) as err:
                raise InvalidArgument(f"{field}.shape", f"expected a list of integers ({err})") from err
            size = _dict(tensor.get("parameters", {}), f"{field}.parameters").get("binary_data_size")
            if size is None:
                if "data" not in tensor:
                    raise InvalidArgument(field, "needs data, or parameters.binary_data_size")
                raw = _json_data(tensor["data"], datatype, field)
            else:
                if type(size) is not int or size < 0 or offset + size > len(binary):
                    raise InvalidArgument(f"{field}.parameters.binary_data_size",
                                          f"{size!r}; {len(binary) - offset} binary bytes are left")
                raw, offset = binary[offset:offset + size], offset + size
            self.request.raw_input_contents.append(raw)
        if offset != len(binary):
            raise InvalidArgument("body", f"{len(binary) - offset} binary bytes after the inputs "
                                  "that binary_data_size accounts for")

    def travels_binary(self, name: str) -> bool:
        return self.every_binary or name in self.binary

    def cheap(self, response: pb.ModelInferResponse) -> bool:
        """Packing it only copies a few bytes."""
        return (all(self.travels_binary(o.name) for o in response.outputs)
                and sum(len(raw) for raw in response.raw_output_contents) <= INLINE_RESPONSE_BYTES)

    def respond(self, response: pb.ModelInferResponse) -> tuple[bytes, int | None]:
        """(the body, the JSON header's length when binary data follows it)"""
        entries, chunks = [], []
        for meta, raw in zip(response.outputs, response.raw_output_contents, strict=True):
            entry = {"name": meta.name, "datatype": meta.datatype, "shape": list(meta.shape)}
            if self.travels_binary(meta.name):
                entry["parameters"] = {"binary_data_size": len(raw)}
                chunks.append(raw)
                entries.append(json.dumps(entry))
            else:
                entries.append(json.dumps(entry)[:-1] + ', "data": ' + float32_json(raw) + "}")
        head = json.dumps({"model_name": response.model_name,
                           "model_version": response.model_version, "id": response.id})
        header = (head[:-1] + ', "outputs": [' + ", ".join(entries) + "]}").encode()
        if not chunks:
            return header, None
        return b"".join([header, *chunks]), len(header)


class KServeHttp:
    def __init__(self, calls: HttpCalls, service: KServeService):
        self.calls = calls
        self.service = service

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v2/health/live", self.live),
            web.get("/v2/health/ready", self.ready),
            web.get("/v2", self.server_metadata),
            web.get("/v2/models/{name}", self.model_metadata),
            web.get("/v2/models/{name}/ready", self.model_ready),
            web.post("/v2/models/{name}/infer", self.infer),
        ]

    async def live(self, request: web.Request) -> web.Response:
        return _health(True)

    async def ready(self, request: web.Request) -> web.Response:
        return _health(self.calls.ready())

    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response({"name": SERVER_NAME, "version": SERVER_VERSION,
                                  "extensions": [BINARY_EXTENSION]})

    async def model_metadata(self, request: web.Request) -> web.StreamResponse:
        async def handle(holds: Holds) -> web.Response:
            meta = self.service.metadata(request.match_info["name"])
            tensors = {kind: [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                              for t in getattr(meta, kind)] for kind in ("inputs", "outputs")}
            return web.json_response({"name": meta.name, "versions": list(meta.versions),
                                      "platform": meta.platform, **tensors})
        return await self.calls.answer("http:/v2/metadata", request, handle, refusal)

    async def model_ready(self, request: web.Request) -> web.StreamResponse:
        async def handle(holds: Holds) -> web.Response:
            self.service.check_model(request.match_info["name"])
            return _health(self.calls.ready())
        return await self.calls.answer("http:/v2/ready", request, handle, refusal)

    async def _infer(self, request: web.Request, holds: Holds) -> web.Response:
        self.calls.refuse_unless_ready()
        model = request.match_info["name"]
        self.service.check_model(model)
        body = await self.calls.body(request, holds)
        length = request.headers.get(HEADER_LENGTH)
        if length is None:
            header, binary = body, b""
        else:
            if not length.isdigit() or int(length) > len(body):
                raise InvalidArgument(HEADER_LENGTH, f"{length!r}; the body has {len(body)} bytes")
            header, binary = body[:int(length)], body[int(length):]
        call = await self.calls.decode(header, lambda parsed: InferCall(model, parsed, binary))
        # The size limit counts the floats as this body carries them (JSON unless binary).
        response = await self.service.infer(call.request, call.deadline, holds,
                                            None if call.all_binary else JSON_FLOAT_BYTES)
        if call.cheap(response):
            payload, header_length = call.respond(response)
        else:
            payload, header_length = await self.calls.off_loop(call.respond, response)
        if header_length is None:
            return web.Response(body=payload, content_type="application/json")
        return web.Response(body=payload, content_type="application/octet-stream",
                            headers={HEADER_LENGTH: str(header_length)})

    async def infer(self, request: web.Request) -> web.StreamResponse:
        return await self.calls.answer("http:/v2/infer", request,
                                       lambda holds: self._infer(request, holds), refusal)


def refusal(err: RequestError, status: int) -> web.Response:
    return web.json_response({"error": err.message}, status=status)
