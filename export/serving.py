"""What a checkpoint says about serving it, beside its weights: the pooling and the prompts
a sentence-transformers model was saved with, and the Matryoshka sizes it was trained for
(docs/api.md, "Prompts" and `dimensions`, names the files and keys)."""

import json
from dataclasses import dataclass
from pathlib import Path

from attnserve.artifact import POOLINGS, check_prompts, sizes_up_to
from attnserve.model.sentence_modules import read_module_list

ST_CONFIG = "config_sentence_transformers.json"
TRANSFORMER_CONFIG = "sentence_bert_config.json"
MATRYOSHKA_KEY = "matryoshka_dimensions"
# sentence-transformers' older Pooling configs: one flag a mode.
_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


class ServingConfigError(ValueError):
    """The checkpoint's serving configuration cannot be served; the message names the file."""


@dataclass(frozen=True)
class Serving:
    pooling: str
    """mean, cls or lasttoken"""
    include_prompt: bool
    prompts: dict[str, str]
    default_prompt_name: str | None
    matryoshka_dims: list[int]
    """largest first"""


def read_json(path: Path, error: type[Exception] = ServingConfigError) -> dict:
    """The JSON object `path` holds, {} when there is no such file: every file it reads is
    optional. `error`: the caller's failure class, so a damaged file is refused as the rest
    of what the caller reads is (export/heads.py refuses with CheckpointError)."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise error(f"{path}: cannot be read as JSON ({err})") from err
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object")
    return data


def _pooling(path: Path | None) -> tuple[str, bool]:
    """The Pooling module's mode and include_prompt (none: mean, with the prompt)."""
    config = read_json(path) if path else {}
    include = config.get("include_prompt", True)
    if not isinstance(include, bool):
        raise ServingConfigError(f"{path}: include_prompt {include!r}, expected true or false")
    mode = config.get("pooling_mode") or [
        mode for flag, mode in _POOLING_FLAGS.items() if config.get(flag)] or "mean"
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if isinstance(mode, list):
        raise ServingConfigError(f"{path}: pooling modes {mode} are concatenated into one "
                                 "vector; attnserve pools one mode")
    if mode not in POOLINGS:
        raise ServingConfigError(f"{path}: pooling_mode {mode!r} is not served; attnserve pools "
                                 f"{', '.join(POOLINGS[:-1])} or {POOLINGS[-1]}")
    return mode, include


def _prompts(checkpoint: Path) -> tuple[dict[str, str], str | None]:
    """The prompts and the default prompt's name, for texts fed to the tokenizer as they come:
    a Transformer that sentence-transformers lower-cases every text for is refused."""
    path = checkpoint / TRANSFORMER_CONFIG
    if read_json(path).get("do_lower_case"):
        raise ServingConfigError(f"{path}: do_lower_case true (texts lower-cased before the "
                                 "tokenizer) is not served; attnserve tokenizes texts as they come")
    path = checkpoint / ST_CONFIG
    config = read_json(path)
    prompts = config.get("prompts") or {}
    default = config.get("default_prompt_name")
    check_prompts(path, prompts, default, ServingConfigError)
    return prompts, default


def matryoshka_dims(dims: list[int], hidden: int, source: str) -> list[int]:
    """`dims` checked against the vectors' size, largest first, each once."""
    if not sizes_up_to(dims, hidden):
        raise ServingConfigError(f"{source}: Matryoshka sizes {dims!r}; expected sizes from 1 "
                                 f"to the vectors' size, {hidden}")
    return sorted(set(dims), reverse=True)


def read_serving(checkpoint: Path, hidden: int, dims: list[int] | None = None) -> Serving:
    """The checkpoint's serving configuration; `hidden`: the vectors' size; `dims`
    (export's --matryoshka-dims), when given, in place of the sizes config.json declares."""
    pooling, include = _pooling(read_module_list(checkpoint).pooling_config)
    prompts, default = _prompts(checkpoint)
    if dims is not None:
        sizes = matryoshka_dims(dims, hidden, "--matryoshka-dims")
    else:
        declared = read_json(checkpoint / "config.json").get(MATRYOSHKA_KEY) or []
        sizes = matryoshka_dims(declared, hidden, f"{checkpoint / 'config.json'}: {MATRYOSHKA_KEY}")
    return Serving(pooling, include, prompts, default, sizes)


def read_prompts(checkpoint: Path, pooling: str) -> Serving:
    """The serving configuration of a model whose vectors no Pooling module makes (SPLADE's,
    bge-m3's [CLS]): `pooling`, the checkpoint's prompts, no Matryoshka sizes."""
    return Serving(pooling, True, *_prompts(checkpoint), [])
