"""Which artifacts a server serves, and under which names: each `--artifact [NAME=]DIR`
loaded and checked, named by NAME or its manifest's model_name, every name once; and the
prompt each gives a request that names none."""

import logging
from dataclasses import dataclass

from attnserve.artifact import Artifact, ArtifactError, load_artifact
from attnserve.server.config import ConfigError, ModelSource, ServeConfig
from attnserve.server.engine.tokenize import TextTokenizer, load_tokenizer

log = logging.getLogger("attnserve.server")


@dataclass(frozen=True)
class NamedArtifact:
    name: str
    """what callers name the model by"""
    artifact: Artifact
    source: ModelSource
    """the --artifact it came from"""
    default_prompt: str | None = None
    """the prompt a request that names none gets: --default-prompt-name's where the model has a prompt of that
    name, else the checkpoint's default_prompt_name (or none), so that one flag serves models whose prompts
    differ"""


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
        flag, manifest = config.default_prompt_name, artifact.manifest
        models[name] = NamedArtifact(name, artifact, source, flag if flag in manifest.prompts
                                     else manifest.default_prompt_name)
    return list(models.values())


def log_default_prompts(config: ServeConfig, models: list[NamedArtifact]) -> None:
    """One line a model: the prompt a request that names none gets; a warning for a model
    that has no prompt of --default-prompt-name's name."""
    flag = config.default_prompt_name
    for m in models:
        prompts = ",".join(m.artifact.manifest.prompts) or "none"
        if flag is not None and flag != m.default_prompt:
            log.warning("event=default_prompt_missing model=%s default_prompt_name=%s prompts=%s "
                        "served_with=%s", m.name, flag, prompts, m.default_prompt or "none")
        else:
            log.info("event=default_prompt model=%s prompt_name=%s prompts=%s", m.name,
                     m.default_prompt or "none", prompts)


def load_tokenizers(models: list[NamedArtifact]) -> list[TextTokenizer]:
    """Each model's tokenizer; one that does not load is refused naming the flag too."""
    tokenizers = []
    for named in models:
        try:
            tokenizers.append(load_tokenizer(named.artifact))
        except ArtifactError as err:
            raise ArtifactError(f"--artifact {named.source}: {err}") from err
    return tokenizers
