"""Which backend runs an artifact, and where: the one place the rest of the server gets a
backend from.

A backend module under server/runtime/ registers itself here under the artifact format it
runs (`Manifest.runtime`; onnxruntime's is "onnx", ort_backend.py). The server asks for a
backend by the artifact and the device flags (`create_backend`), or first only for where it
would run (`place`: cheap, nothing loaded), and never names a framework or a provider:
adding a backend is one module and one `register` call.
"""

from dataclasses import dataclass
from typing import Protocol

from attnserve.artifact import Artifact, ArtifactError, Manifest
from attnserve.server.runtime.backend import DEFAULT_STRATEGY, Backend, Strategy


@dataclass(frozen=True)
class Placement:
    """Where an artifact's graphs would run."""

    provider: str
    """the backend's name for it, e.g. CPUExecutionProvider (keys the memory model)"""
    precision: str
    """fp32, fp16 or int8"""
    device: str
    """cpu or cuda"""
    why: str
    """one phrase: why this provider, for the start-up log"""
    platform: str
    """the framework and format, as KServe's model metadata names it (onnxruntime_onnx)"""


class BackendKind(Protocol):
    def place(self, manifest: Manifest, device: str, precision: str) -> Placement:
        """Where `serve --device DEVICE --precision PRECISION` would run the artifact; raises
        ConfigError or a DeviceError for a choice that cannot be served."""
        ...

    def create(self, artifact: Artifact, device: str, precision: str, intra_op_threads: int,
               strategy: Strategy) -> Backend:
        ...


KINDS: dict[str, BackendKind] = {}


def register(runtime: str, kind: BackendKind) -> None:
    KINDS[runtime] = kind


def kind_of(manifest: Manifest, where: str = "manifest.json") -> BackendKind:
    _load_builtin()
    kind = KINDS.get(manifest.runtime)
    if kind is None:
        raise ArtifactError(f"{where}: runtime {manifest.runtime!r} is not one this server runs "
                            f"({', '.join(sorted(KINDS))})")
    return kind


def place(artifact: Artifact, device: str = "auto", precision: str = "auto") -> Placement:
    return kind_of(artifact.manifest, str(artifact.path("manifest.json"))).place(
        artifact.manifest, device, precision)


def create_backend(artifact: Artifact, device: str = "auto", precision: str = "auto",
                   intra_op_threads: int = 0, strategy: Strategy = DEFAULT_STRATEGY) -> Backend:
    kind = kind_of(artifact.manifest, str(artifact.path("manifest.json")))
    return kind.create(artifact, device, precision, intra_op_threads, strategy)



def _load_builtin() -> None:
    """The backends that ship with the server register themselves on first use, so that
    importing this module loads no framework."""
    if "onnx" not in KINDS:
        from attnserve.server.runtime import ort_backend  # noqa: F401 - registers "onnx"
