"""inference.GRPCInferenceService: the Open Inference Protocol (KServe v2) over the same
request queue, so tritonclient and KServe tooling work unchanged.

Inputs: input_ids and attention_mask, INT64 [batch, seq]; each row's mask must be ones
then zeros. Outputs: last_hidden_state (FP32 [batch, seq, hidden]), and on request
`attentions` (every layer stacked, [layers, batch, heads, seq, seq]) or `attentions.K`
([batch, heads, seq, seq]). Positions past a row's length are zeros: no computed padding
reaches the caller.
"""

import asyncio

import numpy as np

from attnserve.artifact import HIDDEN_OUTPUT, INPUT_NAMES, Artifact, attention_output
from attnserve.server._proto.inference import grpc_service_pb2 as pb
from attnserve.server._proto.inference import grpc_service_pb2_grpc as pb_grpc
from attnserve.server.backend import SequenceResult
from attnserve.server.calls import answer, call_holds, deadline_of
from attnserve.server.errors import InvalidArgument, NotFound
from attnserve.server.executors import Executors
from attnserve.server.holds import Holds
from attnserve.server.metrics import Metrics
from attnserve.server.request_queue import RequestQueue
from attnserve.server.respond import build_response, check_response_size, field_bytes

ALL_ATTENTIONS = "attentions"
SERVER_NAME = "attnserve"
SERVER_VERSION = "0.1.0"
# int64_contents are read this many at a time off the event loop.
CONTENTS_SLICE = 1 << 16


class KServeService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, artifact: Artifact, queue: RequestQueue, executors: Executors,
                 metrics: Metrics, max_message_bytes: int, ready):
        self.manifest = artifact.manifest
        self.queue = queue
        self.executors = executors
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self.ready = ready  # () -> bool: loaded, warmed up and not draining

    def check_model(self, name: str) -> None:
        if name != self.manifest.model_name:
            raise NotFound(f"model_name: unknown model {name!r}; this server serves "
                           f"{self.manifest.model_name!r}")

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.ready())

    async def ModelReady(self, request, context):
        async def handle():
            self.check_model(request.name)
            return pb.ModelReadyResponse(ready=self.ready())
        return await answer(self.metrics, "ModelReady", context, handle)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION)

    def metadata(self, name: str) -> pb.ModelMetadataResponse:
        self.check_model(name)
        m = self.manifest
        meta = pb.ModelMetadataResponse.TensorMetadata
        return pb.ModelMetadataResponse(
            name=m.model_name, versions=["1"], platform="onnxruntime_onnx",
            inputs=[meta(name=n, datatype="INT64", shape=[-1, -1]) for n in INPUT_NAMES],
            outputs=[meta(name=HIDDEN_OUTPUT, datatype="FP32", shape=[-1, -1, m.hidden_size]),
                     meta(name=ALL_ATTENTIONS, datatype="FP32",
                          shape=[m.num_layers, -1, m.num_heads, -1, -1])]
            + [meta(name=attention_output(i), datatype="FP32", shape=[-1, m.num_heads, -1, -1])
               for i in range(m.num_layers)],
        )

    async def ModelMetadata(self, request, context):
        async def handle():
            return self.metadata(request.name)
        return await answer(self.metrics, "ModelMetadata", context, handle)

    def _shape(self, request: pb.ModelInferRequest) -> tuple[int, int]:
        """(batch, seq), from the inputs' declared shapes alone: checked before any id is
        read."""
        names = [t.name for t in request.inputs[:len(INPUT_NAMES) + 1]]
        if sorted(names) != sorted(INPUT_NAMES):
            raise InvalidArgument("inputs", f"got {names}{' …' if len(request.inputs) > len(names) else ''}"
                                  f", expected exactly {list(INPUT_NAMES)}")
        if request.raw_input_contents and len(request.raw_input_contents) != len(request.inputs):
            raise InvalidArgument("raw_input_contents", f"{len(request.raw_input_contents)} "
                                  f"entries for {len(request.inputs)} inputs")
        shapes = []
        for i, t in enumerate(request.inputs):
            field = f"inputs[{i}] ({t.name})"
            if t.datatype != "INT64":
                raise InvalidArgument(field, f"datatype {t.datatype!r}, expected INT64")
            shape = tuple(t.shape[:3])
            if len(shape) != 2 or min(shape) < 1:
                raise InvalidArgument(field, f"shape {list(t.shape[:8])}, expected [batch ≥ 1, seq ≥ 1]")
            count = shape[0] * shape[1]
            given = (len(request.raw_input_contents[i]) // 8 if request.raw_input_contents
                     else len(t.contents.int64_contents))
            if given != count or (request.raw_input_contents
                                  and len(request.raw_input_contents[i]) % 8):
                what = (f"{len(request.raw_input_contents[i])} raw bytes" if request.raw_input_contents
                        else f"{given} int64_contents")
                raise InvalidArgument(field, f"{what}, shape {list(shape)} INT64 needs "
                                      f"{count * 8 if request.raw_input_contents else count}")
            shapes.append(shape)
        if shapes[0] != shapes[1]:
            mask = names.index("attention_mask")
            raise InvalidArgument("attention_mask", f"shape {list(shapes[mask])} differs from "
                                  f"input_ids {list(shapes[1 - mask])}")
        batch, seq = shapes[0]
        if seq > self.manifest.max_positions:
            raise InvalidArgument("input_ids", f"seq {seq} is longer than the model's "
                                  f"{self.manifest.max_positions} positions")
        return batch, seq

    def _inputs(self, request: pb.ModelInferRequest, batch: int, seq: int) -> dict[str, np.ndarray]:
        """The inputs as arrays, their shapes already checked. Run off the event loop:
        int64_contents are read a slice at a time, letting the interpreter go between."""
        arrays = {}
        for i, t in enumerate(request.inputs):
            if request.raw_input_contents:
                array = np.frombuffer(request.raw_input_contents[i], dtype="<i8")
            else:
                values = t.contents.int64_contents
                array = np.concatenate([np.asarray(values[start:start + CONTENTS_SLICE], dtype=np.int64)
                                        for start in range(0, len(values), CONTENTS_SLICE)])
            arrays[t.name] = array.reshape(batch, seq).astype(np.int64, copy=False)
        return arrays

    def _sequences(self, request: pb.ModelInferRequest, batch: int,
                   seq: int) -> tuple[list[np.ndarray], np.ndarray]:
        """Each row's ids up to its length, and the lengths. Run off the event loop."""
        m = self.manifest
        arrays = self._inputs(request, batch, seq)
        ids, mask = arrays["input_ids"], arrays["attention_mask"]
        if not np.isin(mask, (0, 1)).all():
            raise InvalidArgument("attention_mask", "values must be 0 or 1")
        lengths = mask.sum(axis=1)
        ones_then_zeros = (np.arange(seq)[None, :] < lengths[:, None]).astype(mask.dtype)
        bad_rows = (lengths == 0) | (mask != ones_then_zeros).any(axis=1)
        if bad_rows.any():
            raise InvalidArgument(f"attention_mask[{int(np.argmax(bad_rows))}]",
                                  "must be ones then zeros, with at least one one")
        bad = np.argwhere((ids < 0) | (ids >= m.vocab_size))
        if bad.size:
            r, c = (int(x) for x in bad[0])
            raise InvalidArgument(f"input_ids[{r}, {c}]", f"id {int(ids[r, c])} is outside the "
                                  f"vocabulary [0, {m.vocab_size})")
        return [ids[row, :length] for row, length in enumerate(lengths.tolist())], lengths

    def _outputs(self, request: pb.ModelInferRequest) -> tuple[list[str], tuple[int, ...]]:
        m = self.manifest
        known = {HIDDEN_OUTPUT: ()} | {ALL_ATTENTIONS: tuple(range(m.num_layers))}
        known |= {attention_output(i): (i,) for i in range(m.num_layers)}
        if len(request.outputs) > len(known):
            raise InvalidArgument("outputs", f"{len(request.outputs)} named; the model has "
                                  f"{len(known)}, each to be named once")
        names = [o.name for o in request.outputs] or [HIDDEN_OUTPUT]
        layers: set[int] = set()
        for i, name in enumerate(names):
            if name not in known:
                raise InvalidArgument(f"outputs[{i}]", f"unknown output {name!r}; known: "
                                      f"{HIDDEN_OUTPUT}, {ALL_ATTENTIONS}, attentions.0 … "
                                      f"attentions.{m.num_layers - 1}")
            if name in names[:i]:
                raise InvalidArgument(f"outputs[{i}]", f"{name!r} is named twice")
            layers.update(known[name])
        return names, tuple(sorted(layers))

    def _output_shape(self, name: str, layers: tuple[int, ...], batch: int,
                      seq: int) -> tuple[int, ...]:
        m = self.manifest
        if name == HIDDEN_OUTPUT:
            return batch, seq, m.hidden_size
        if name == ALL_ATTENTIONS:
            return len(layers), batch, m.num_heads, seq, seq
        return batch, m.num_heads, seq, seq

    def _check_size(self, request: pb.ModelInferRequest, names: list[str],
                    layers: tuple[int, ...], batch: int, seq: int,
                    float_bytes: float | None) -> int:
        """The response's size, exactly (or over, for JSON): its fields but the output
        data, sized by protobuf itself, and the data's length-prefixed bytes."""
        skeleton = pb.ModelInferResponse(model_name=self.manifest.model_name, model_version="1",
                                         id=request.id)
        data = 0
        for name in names:
            shape = self._output_shape(name, layers, batch, seq)
            skeleton.outputs.add(name=name, datatype="FP32", shape=shape)
            data += field_bytes(int(np.ceil(np.prod(shape, dtype=np.float64)
                                            * max(4, float_bytes or 0))))
        return check_response_size(skeleton.ByteSize() + data, self.max_message_bytes,
                                   "request fewer attentions.K outputs or a smaller batch")

    async def infer(self, request: pb.ModelInferRequest, deadline: float | None,
                    holds: Holds | None = None,
                    float_bytes: float | None = None) -> pb.ModelInferResponse:
        """One ModelInfer call, whichever protocol it came in by. `holds`: the call's
        memory, released by the caller once the response has been sent (by default, held
        until this returns); `float_bytes`: what a value takes where the response is
        re-encoded (JSON), for the size limit."""
        if holds is None:
            holds = self.queue.memory.ledger.holds()
            try:
                return await self.infer(request, deadline, holds, float_bytes)
            finally:
                holds.release()
        self.check_model(request.model_name)
        # The cheap checks first, from the declared shapes: no id is read for a request
        # that cannot be served.
        batch, seq = self._shape(request)
        names, layers = self._outputs(request)
        self.queue.admit(batch, at_least=True)
        size = self._check_size(request, names, layers, batch, seq, float_bytes)
        sequences, lengths = await asyncio.get_running_loop().run_in_executor(
            self.executors.tokenize, self._sequences, request, batch, seq)
        results = await self.queue.submit(sequences, layers, deadline, size, holds=holds,
                                          lengths=lengths)
        return await build_response(
            self.executors.respond, self.metrics,
            lambda: self._response(request.id, names, layers, results, batch, seq),
            len(sequences), size)

    def _response(self, request_id: str, names: list[str], layers: tuple[int, ...],
                  results: list[SequenceResult], batch: int, seq: int) -> pb.ModelInferResponse:
        """The outputs asked for, each row zero past its sequence's length."""
        m = self.manifest
        response = pb.ModelInferResponse(model_name=m.model_name, model_version="1", id=request_id)
        for name in names:
            if name == HIDDEN_OUTPUT:
                out = np.zeros((batch, seq, m.hidden_size), dtype="<f4")
                for row, r in enumerate(results):
                    out[row, :len(r.hidden)] = r.hidden
            else:
                wanted = layers if name == ALL_ATTENTIONS else (int(name.rsplit(".", 1)[1]),)
                out = np.zeros((len(wanted), batch, m.num_heads, seq, seq), dtype="<f4")
                for row, r in enumerate(results):
                    n = len(r.hidden)
                    for k, layer in enumerate(wanted):
                        out[k, row, :, :n, :n] = r.attentions[layer]
                if name != ALL_ATTENTIONS:
                    out = out[0]
            response.outputs.add(name=name, datatype="FP32", shape=out.shape)
            response.raw_output_contents.append(out.tobytes())
        return response

    async def ModelInfer(self, request, context):
        return await answer(self.metrics, "ModelInfer", context,
                            lambda: self.infer(request, deadline_of(context), call_holds()))
