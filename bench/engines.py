"""The two kinds of onnxruntime engine a benchmark row stands for.

A row for attnserve's runtime runs the server's own backend
(`attnserve.server.runtime.backend.create_backend`, with a `Strategy` where the row
isolates one setting, or on `unfused(artifact)`), so it measures what `attnserve serve`
runs. A row for what a user would pick instead runs `default_session`, onnxruntime's
`InferenceSession(path)` with its default options: the one session bench/ opens itself.
"""

from dataclasses import replace
from pathlib import Path

from attnserve.artifact import Artifact


def default_session(path: Path, device: str):
    """`InferenceSession(path)` with nothing set, as a user calling onnxruntime writes it:
    on `device` cuda with the CUDA provider first (and the CUDA libraries loaded, as
    onnxruntime's install notes say), refused when onnxruntime places the graph elsewhere,
    so the reference never runs on the CPU unnoticed."""
    import onnxruntime as ort

    from attnserve.server.runtime.onnx import CPU, CUDA, preload_cuda_libraries

    if device != "cuda":
        return ort.InferenceSession(str(path), providers=[CPU])
    preload_cuda_libraries()
    session = ort.InferenceSession(str(path), providers=[CUDA, CPU])
    if CUDA not in session.get_providers():
        raise RuntimeError(f"{path.name}: onnxruntime did not place it on {CUDA}")
    return session


def unfused(artifact: Artifact) -> Artifact:
    """`artifact` as if export had kept no optimised graph: the backend built on it serves
    the plain `encoder.onnx`, everything else as the server has it."""
    graphs = [g for g in artifact.manifest.graphs if not g.optimized]
    return replace(artifact, manifest=replace(artifact.manifest, graphs=graphs))
