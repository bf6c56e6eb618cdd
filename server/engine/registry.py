"""Which artifacts a server serves, and under which names: each `--artifact [NAME=]DIR`
loaded and checked, named by NAME or its manifest's model_name, every name once."""

from dataclasses import dataclass

from attnserve.artifact import Artifact, ArtifactError, load_artifact
from attnserve.server.config import ConfigError, ModelSource, ServeConfig
from attnserve.server.engine.tokenize import TextTokenizer, load_tokenizer


@dataclass(frozen=True)
class NamedArtifact:
    name: str
    """what callers name the model by"""
    artifact: Artifact
    source: ModelSource
    """the --artifact it came from"""


def load_models(config: ServeConfig, verify: tuple[str, ...] | None = None) -> list[NamedArtifact]:
    """Every --artifact, in order (the first is the default model); an artifact that does
    not load, or a name given twice, is refused naming the flag and the file. `verify`: the
    files to check against their hashes (all of them by default)."""
    models: dict[str, NamedArtifact] = {}
    for source in config.artifact:
        try:
            artifact = load_artifact(source.path, verify=verify)
        except ArtifactError as err:
            raise ArtifactError(f"--artifact {source}: {err}") from err
        name = source.name or artifact.manifest.model_name
        if name in models:
            raise ConfigError("artifact", f"{models[name].source} and {source} are both named "
                                          f"{name!r}; name one of them: --artifact NAME=DIR")
        models[name] = NamedArtifact(name, artifact, source)
    return list(models.values())


def load_tokenizers(models: list[NamedArtifact]) -> list[TextTokenizer]:
    """Each model's tokenizer; one that does not load is refused naming the flag too."""
    tokenizers = []
    for named in models:
        try:
            tokenizers.append(load_tokenizer(named.artifact))
        except ArtifactError as err:
            raise ArtifactError(f"--artifact {named.source}: {err}") from err
    return tokenizers
