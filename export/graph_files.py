"""Writing a graph into the artifact: its weights inside the .onnx file, or, past ONNX's
2 GB protobuf limit (Qwen3-Embedding-0.6B in float32 is 2.4 GB), in one external data
file beside it, `<graph>.onnx.data`, which onnxruntime reads from there and the manifest
lists and hashes like the graph itself."""

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import onnx
from onnx.external_data_helper import load_external_data_for_model

# A protobuf message cannot pass 2 GiB; the nodes and the small constants kept inside
# need room besides the weights.
EXTERNAL_DATA_BYTES = (2 << 30) - (256 << 20)


def data_file(graph: Path) -> Path:
    return graph.with_name(graph.name + ".data")


def external_data(graph: Path) -> str | None:
    """The name of the graph's external data file, None when its weights are inside it."""
    data = data_file(graph)
    return data.name if data.is_file() else None


def save(model: onnx.ModelProto, path: Path) -> None:
    """Write `model` to `path`, its weights in data_file(path) when they pass
    EXTERNAL_DATA_BYTES; `model` holds its weights in memory after, as before."""
    data = data_file(path)
    data.unlink(missing_ok=True)
    if not large(model):
        onnx.save_model(model, str(path))
        return
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=data.name, size_threshold=1024)
    share_mode(path)
    # Saving moved the weights out of `model`; a caller may still run or change it.
    load_external_data_for_model(model, str(path.parent))


def share_mode(graph: Path) -> None:
    """The data file readable by whoever may read the graph (onnx creates it for its owner
    alone): a server in a container, under another user, reads both."""
    data = data_file(graph)
    if data.is_file():
        data.chmod(graph.stat().st_mode & 0o777)


def remove(path: Path) -> None:
    path.unlink(missing_ok=True)
    data_file(path).unlink(missing_ok=True)


def large(model: onnx.ModelProto) -> bool:
    """Whether `model` cannot be serialised in one protobuf message."""
    return sum(tensor.ByteSize() for tensor in model.graph.initializer) > EXTERNAL_DATA_BYTES


@contextmanager
def scratch(near: Path | None = None) -> Iterator[Path]:
    """A directory of its own for a graph written only to be read again (traced by torch,
    written by the quantizer, handed to onnxruntime by path), beside the artifact (`near`)
    so that large files stay on its disk; removed with everything in it on leaving."""
    with tempfile.TemporaryDirectory(prefix=".scratch-", dir=near) as name:
        yield Path(name)
