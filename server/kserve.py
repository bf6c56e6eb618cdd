"""What both Open Inference Protocol doors (KServe v2 over gRPC and over REST) say the same
way: each model's one version, its metadata and the model repository index (Triton's
extension), from the data plane's models, as Structs both doors answer with; and the
input tensors they take, checked for what the protocol says of them before the engine
runs them as raw tensors (server/engine/tensors.py)."""

from collections.abc import Sequence
from typing import Literal

from msgspec import Struct

from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.plane import DataPlane
from attnserve.server.engine.requests import InputTensor
from attnserve.server.errors import InvalidArgument, NotFound, quote

MODEL_VERSION = "1"


def find_model(plane: DataPlane, name: str, version: str | None, name_field: str,
               version_field: str) -> ServedModel:
    """The model a call names (KServe names one always; unknown: NOT_FOUND naming the
    models served), at its one version (empty: that one)."""
    if not name:
        raise NotFound(f"{name_field}: required; this server serves {plane.served()}", name_field)
    model = plane.model(name, name_field)
    if version not in (None, "", MODEL_VERSION):
        raise NotFound(f"{version_field}: unknown version {quote(version)}; {model.name!r} has "
                       f"version {MODEL_VERSION!r}", version_field)
    return model


class TensorMetadata(Struct):
    name: str
    datatype: str
    shape: list[int]


class ModelMetadata(Struct):
    name: str
    versions: list[str]
    platform: str
    inputs: list[TensorMetadata]
    outputs: list[TensorMetadata]


class RepositoryModel(Struct):
    name: str
    version: str
    state: Literal["READY", "UNAVAILABLE"]
    reason: str


def model_metadata(model: ServedModel) -> ModelMetadata:
    info = model.model_info()
    inputs, outputs = ([TensorMetadata(t.name, t.datatype, list(t.shape)) for t in tensors]
                       for tensors in (info.inputs, info.outputs))
    return ModelMetadata(info.model, [MODEL_VERSION], info.platform, inputs, outputs)


def repository_index(plane: DataPlane, ready_only: bool) -> list[RepositoryModel]:
    """Every model (with `ready_only`, every model serving), with its state."""
    ready = {name: model.serving() for name, model in plane.models.items()}
    return [RepositoryModel(name, MODEL_VERSION, "READY" if up else "UNAVAILABLE",
                            "" if up else "warming up or draining")
            for name, up in ready.items() if up or not ready_only]


def input_tensor(index: int, name: str, datatype: str, shape: Sequence[int],
                 data: bytes | Sequence[int]) -> InputTensor:
    """Input `index`, INT64 [batch ≥ 1, seq ≥ 1], its data (little-endian bytes, or the
    values, row-major) filling its shape exactly: checked without reading the data."""
    field = f"inputs[{index}] ({name})"
    if datatype != "INT64":
        raise InvalidArgument(field, f"datatype {quote(datatype)}, expected INT64")
    if len(shape) != 2 or min(shape) < 1:
        raise InvalidArgument(field, f"shape {list(shape[:8])}, expected [batch ≥ 1, seq ≥ 1]")
    count = shape[0] * shape[1]
    raw = isinstance(data, bytes | bytearray | memoryview)
    given = len(data) // 8 if raw else len(data)
    if given != count or (raw and len(data) % 8):
        what = f"{len(data)} raw bytes" if raw else f"{given} values"
        raise InvalidArgument(field, f"{what}, shape {list(shape)} INT64 needs "
                              f"{count * 8 if raw else count}{' bytes' if raw else ''}")
    return InputTensor(name, (shape[0], shape[1]), data)
