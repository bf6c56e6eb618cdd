"""inference.GRPCInferenceService: the Open Inference Protocol (KServe v2) over the same
scheduler, so tritonclient and KServe tooling work unchanged.

Inputs: input_ids and attention_mask, INT64 [batch, seq]; each row's mask must be ones
then zeros. Outputs: last_hidden_state (FP32 [batch, seq, hidden]), and on request
`attentions` (every layer stacked, [layers, batch, heads, seq, seq]) or `attentions.K`
([batch, heads, seq, seq]). Positions past a row's length are zeros: no computed padding
reaches the caller.
"""

import numpy as np

from attnserve.artifact import HIDDEN_OUTPUT, INPUT_NAMES, Artifact, attention_output
from attnserve.server._proto.inference import grpc_service_pb2 as pb
from attnserve.server._proto.inference import grpc_service_pb2_grpc as pb_grpc
from attnserve.server.calls import answer, deadline_of
from attnserve.server.errors import InvalidArgument, NotFound, ResourceExhausted
from attnserve.server.metrics import Metrics
from attnserve.server.schedule import Scheduler

ALL_ATTENTIONS = "attentions"
SERVER_NAME = "attnserve"
SERVER_VERSION = "0.1.0"


class KServeService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, artifact: Artifact, scheduler: Scheduler, metrics: Metrics,
                 max_message_bytes: int, ready):
        self.manifest = artifact.manifest
        self.scheduler = scheduler
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self.ready = ready  # () -> bool: loaded, warmed up and not draining

    def _check_model(self, name: str) -> None:
        if name != self.manifest.model_name:
            raise NotFound(f"model_name: unknown model {name!r}; this server serves "
                           f"{self.manifest.model_name!r}")

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.ready())

    async def ModelReady(self, request, context):
        async def handle():
            self._check_model(request.name)
            return pb.ModelReadyResponse(ready=self.ready())
        return await answer(self.metrics, "ModelReady", context, handle)

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION)

    async def ModelMetadata(self, request, context):
        async def handle():
            self._check_model(request.name)
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
        return await answer(self.metrics, "ModelMetadata", context, handle)

    def _inputs(self, request: pb.ModelInferRequest) -> dict[str, np.ndarray]:
        names = [t.name for t in request.inputs]
        if sorted(names) != sorted(INPUT_NAMES):
            raise InvalidArgument("inputs", f"got {names}, expected exactly {list(INPUT_NAMES)}")
        if request.raw_input_contents and len(request.raw_input_contents) != len(request.inputs):
            raise InvalidArgument("raw_input_contents", f"{len(request.raw_input_contents)} "
                                  f"entries for {len(request.inputs)} inputs")
        arrays = {}
        for i, t in enumerate(request.inputs):
            field = f"inputs[{i}] ({t.name})"
            if t.datatype != "INT64":
                raise InvalidArgument(field, f"datatype {t.datatype!r}, expected INT64")
            shape = tuple(t.shape)
            if len(shape) != 2 or min(shape) < 1:
                raise InvalidArgument(field, f"shape {list(shape)}, expected [batch ≥ 1, seq ≥ 1]")
            count = shape[0] * shape[1]
            if request.raw_input_contents:
                raw = request.raw_input_contents[i]
                if len(raw) != count * 8:
                    raise InvalidArgument(field, f"{len(raw)} raw bytes, shape {list(shape)} "
                                          f"INT64 needs {count * 8}")
                array = np.frombuffer(raw, dtype="<i8")
            else:
                array = np.asarray(t.contents.int64_contents, dtype=np.int64)
                if array.size != count:
                    raise InvalidArgument(field, f"{array.size} int64_contents, shape "
                                          f"{list(shape)} needs {count}")
            arrays[t.name] = array.reshape(shape).astype(np.int64, copy=False)
        if arrays["input_ids"].shape != arrays["attention_mask"].shape:
            raise InvalidArgument("attention_mask", f"shape {list(arrays['attention_mask'].shape)}"
                                  f" differs from input_ids {list(arrays['input_ids'].shape)}")
        return arrays

    def _sequences(self, ids: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
        m = self.manifest
        if ids.shape[1] > m.max_positions:
            raise InvalidArgument("input_ids", f"seq {ids.shape[1]} is longer than the model's "
                                  f"{m.max_positions} positions")
        if not np.isin(mask, (0, 1)).all():
            raise InvalidArgument("attention_mask", "values must be 0 or 1")
        lengths = mask.sum(axis=1)
        for row, length in enumerate(lengths):
            if length == 0 or not mask[row, :length].all():
                raise InvalidArgument(f"attention_mask[{row}]", "must be ones then zeros, "
                                      "with at least one one")
        bad = np.argwhere((ids < 0) | (ids >= m.vocab_size))
        if bad.size:
            r, c = (int(x) for x in bad[0])
            raise InvalidArgument(f"input_ids[{r}, {c}]", f"id {int(ids[r, c])} is outside the "
                                  f"vocabulary [0, {m.vocab_size})")
        return [ids[row, :length] for row, length in enumerate(lengths)]

    def _outputs(self, request: pb.ModelInferRequest) -> tuple[list[str], tuple[int, ...]]:
        m = self.manifest
        known = {HIDDEN_OUTPUT: ()} | {ALL_ATTENTIONS: tuple(range(m.num_layers))}
        known |= {attention_output(i): (i,) for i in range(m.num_layers)}
        names = [o.name for o in request.outputs] or [HIDDEN_OUTPUT]
        layers: set[int] = set()
        for i, name in enumerate(names):
            if name not in known:
                raise InvalidArgument(f"outputs[{i}]", f"unknown output {name!r}; known: "
                                      f"{HIDDEN_OUTPUT}, {ALL_ATTENTIONS}, attentions.0 … "
                                      f"attentions.{m.num_layers - 1}")
            layers.update(known[name])
        return names, tuple(sorted(layers))

    def _check_size(self, names: list[str], batch: int, seq: int) -> int:
        m = self.manifest
        per_layer = batch * m.num_heads * seq * seq * 4
        total = sum(batch * seq * m.hidden_size * 4 if n == HIDDEN_OUTPUT
                    else per_layer * (m.num_layers if n == ALL_ATTENTIONS else 1) for n in names)
        if total > self.max_message_bytes:
            raise ResourceExhausted(
                f"response would be about {total / (1 << 20):.1f} MiB, over the "
                f"{self.max_message_bytes / (1 << 20):.1f} MiB message limit: request fewer "
                "attentions.K outputs or a smaller batch")
        return total

    async def _infer(self, request: pb.ModelInferRequest, context) -> pb.ModelInferResponse:
        self._check_model(request.model_name)
        arrays = self._inputs(request)
        ids, mask = arrays["input_ids"], arrays["attention_mask"]
        sequences = self._sequences(ids, mask)
        names, layers = self._outputs(request)
        batch, seq = ids.shape
        size = self._check_size(names, batch, seq)
        results = await self.scheduler.submit(sequences, layers, deadline_of(context), size)

        m = self.manifest
        response = pb.ModelInferResponse(model_name=m.model_name, model_version="1", id=request.id)
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
                            lambda: self._infer(request, context))
