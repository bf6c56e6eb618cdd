"""Which backend runs an artifact, and where: the one place the rest of the server gets a
backend from.

A backend module under server/runtime/ offers a `KIND` (a BackendKind) for the artifact
format it runs (`Manifest.runtime`), named in BUILTIN below: onnxruntime's is "onnx",
ort_backend.py, imported only when an artifact of its format is served. The server asks
for a backend by the artifact and the device flags (`create_backend`), or first only for
where it would run (`place`: cheap, nothing loaded), and never names a framework or a
provider: adding a backend is one module and one line in BUILTIN (or, from outside the
server, one `register` call).
"""

import importlib
from typing import Protocol

from attnserve.artifact import Artifact, ArtifactError, Manifest
from attnserve.server.runtime.backend import DEFAULT_STRATEGY, Backend, Placement, Strategy


class BackendKind(Protocol):
    def place(self, manifest: Manifest, device: str, precision: str) -> Placement:
        """Where `serve --device DEVICE --precision PRECISION` would run the artifact; raises
        ConfigError or a DeviceError for a choice that cannot be served."""
        ...

    def create(self, artifact: Artifact, device: str, precision: str, intra_op_threads: int,
               strategy: Strategy) -> Backend:
        ...


BUILTIN = {"onnx": "attnserve.server.runtime.ort_backend"}
"""runtime -> the module whose KIND runs it"""
KINDS: dict[str, BackendKind] = {}


def register(runtime: str, kind: BackendKind) -> None:
    KINDS[runtime] = kind


def kind_of(manifest: Manifest, where: str = "manifest.json") -> BackendKind:
    if manifest.runtime not in KINDS and manifest.runtime in BUILTIN:
        register(manifest.runtime, importlib.import_module(BUILTIN[manifest.runtime]).KIND)
    kind = KINDS.get(manifest.runtime)
    if kind is None:
        raise ArtifactError(f"{where}: runtime {manifest.runtime!r} is not one this server runs "
                            f"({', '.join(sorted(KINDS.keys() | BUILTIN.keys()))})")
    return kind


def place(artifact: Artifact, device: str = "auto", precision: str = "auto") -> Placement:
    return kind_of(artifact.manifest, str(artifact.path("manifest.json"))).place(
        artifact.manifest, device, precision)


def create_backend(artifact: Artifact, device: str = "auto", precision: str = "auto",
                   intra_op_threads: int = 0, strategy: Strategy = DEFAULT_STRATEGY) -> Backend:
    kind = kind_of(artifact.manifest, str(artifact.path("manifest.json")))
    return kind.create(artifact, device, precision, intra_op_threads, strategy)
