"""inference.GRPCInferenceService: the Open Inference Protocol (KServe v2) over gRPC, so
tritonclient and KServe tooling work unchanged; the tensors go to the engine's `tensors.run`
(inputs and outputs: docs/api.md, "gRPC: the Open Inference Protocol")."""

import msgspec
import numpy as np

from attnserve.server._proto.inference import grpc_service_pb2 as pb
from attnserve.server._proto.inference import grpc_service_pb2_grpc as pb_grpc
from attnserve.server.call import SERVER_NAME, SERVER_VERSION
from attnserve.server.engine import tensors
from attnserve.server.engine.offload import COPY_BYTE_S
from attnserve.server.engine.plane import DataPlane
from attnserve.server.engine.requests import InputTensor, ResponseSize, Shapes, TensorRequest
from attnserve.server.errors import InvalidArgument
from attnserve.server.grpc.calls import answered, call_holds, deadline_of
from attnserve.server.grpc.wire import field_bytes
from attnserve.server.kserve import MODEL_VERSION, find_model, input_tensor, model_metadata, repository_index
from attnserve.server.metrics import Metrics

INFER_ADVICE = "request fewer attentions.K outputs or a smaller batch"


class KServeService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, plane: DataPlane, metrics: Metrics, max_message_bytes: int):
        self.plane, self.metrics, self.max_message_bytes = plane, metrics, max_message_bytes

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.plane.serving())

    @answered
    async def ModelReady(self, request, context):
        model = find_model(self.plane, request.name, request.version, "name", "version")
        return pb.ModelReadyResponse(ready=model.serving())

    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION)

    @answered
    async def ModelMetadata(self, request, context):
        meta = model_metadata(find_model(self.plane, request.name, request.version, "name", "version"))
        return pb.ModelMetadataResponse(**msgspec.to_builtins(meta))

    @answered
    async def RepositoryIndex(self, request, context):
        entry = pb.RepositoryIndexResponse.ModelIndex
        return pb.RepositoryIndexResponse(models=[
            entry(**msgspec.structs.asdict(e)) for e in repository_index(self.plane, request.ready)])

    def _inputs(self, request: pb.ModelInferRequest) -> list[InputTensor]:
        raw = request.raw_input_contents
        if raw and len(raw) != len(request.inputs):
            raise InvalidArgument("raw_input_contents", f"{len(raw)} entries for "
                                  f"{len(request.inputs)} inputs")
        return [input_tensor(i, t.name, t.datatype, t.shape, raw[i] if raw else t.contents.int64_contents)
                for i, t in enumerate(request.inputs)]

    @answered
    async def ModelInfer(self, request, context):
        model = find_model(self.plane, request.model_name, request.model_version, "model_name",
                           "model_version")
        answer = InferAnswer(model.name, request.id, self.max_message_bytes)
        tensor_request = TensorRequest(self._inputs(request), [o.name for o in request.outputs], answer)
        return await tensors.run(model, tensor_request, call_holds(), deadline_of(context))


class InferAnswer:
    """A ModelInferResponse: the outputs as raw bytes."""

    def __init__(self, model: str, request_id: str, limit: int):
        self.model, self.id, self.limit = model, request_id, limit

    def size(self, shapes: Shapes) -> ResponseSize:
        """Exactly: its fields but the output data, sized by protobuf itself, and the data's
        length-prefixed bytes."""
        def measure(_) -> int:
            skeleton = pb.ModelInferResponse(model_name=self.model, model_version=MODEL_VERSION, id=self.id)
            data = 0
            for name, shape in shapes:
                skeleton.outputs.add(name=name, datatype="FP32", shape=shape)
                data += field_bytes(int(np.prod(shape, dtype=np.int64)) * 4)
            return skeleton.ByteSize() + data
        return ResponseSize(measure, self.limit, INFER_ADVICE)

    def seconds(self, shapes: Shapes) -> float:
        return sum(4 * int(np.prod(shape, dtype=np.int64)) for _, shape in shapes) * COPY_BYTE_S

    def respond(self, outputs: list[tuple[str, np.ndarray]]) -> pb.ModelInferResponse:
        response = pb.ModelInferResponse(model_name=self.model, model_version=MODEL_VERSION, id=self.id)
        for name, array in outputs:
            response.outputs.add(name=name, datatype="FP32", shape=array.shape)
            response.raw_output_contents.append(array.tobytes())
        return response
