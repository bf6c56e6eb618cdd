"""What both Open Inference Protocol doors (KServe v2 over gRPC and over REST) say the same
way: each model's one version, its metadata and the model repository index (Triton's
extension), from the data plane's models."""

from attnserve.server.engine.model import ServedModel
from attnserve.server.engine.plane import DataPlane
from attnserve.server.errors import NotFound, quote

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


def model_metadata(model: ServedModel) -> dict:
    """name, versions, platform, inputs and outputs ({name, datatype, shape})."""
    info = model.model_info()
    return {"name": info.model, "versions": [MODEL_VERSION], "platform": info.platform,
            **{kind: [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
                      for t in getattr(info, kind)] for kind in ("inputs", "outputs")}}


def repository_index(plane: DataPlane, ready_only: bool) -> list[dict]:
    """Every model: name, version, state (READY or UNAVAILABLE) and reason."""
    index = []
    for model in plane.models.values():
        ready = model.ready()
        if ready or not ready_only:
            index.append({"name": model.name, "version": MODEL_VERSION,
                          "state": "READY" if ready else "UNAVAILABLE",
                          "reason": "" if ready else "warming up or draining"})
    return index
