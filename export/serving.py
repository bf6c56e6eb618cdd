"""What a checkpoint says about serving it, beside its weights: the pooling and the prompts
a sentence-transformers model was saved with, and the Matryoshka sizes it was trained for.

sentence-transformers writes `config_sentence_transformers.json` (`prompts`,
`default_prompt_name`) and its Pooling module's `1_Pooling/config.json` (`pooling_mode`,
`include_prompt`; older versions one `pooling_mode_*_token` flag a mode). Matryoshka sizes
have no standard place: `matryoshka_dimensions` in `config.json` is what vLLM reads and
what checkpoints such as jina-embeddings-v3 carry; for the others, `attnserve export
--matryoshka-dims` says them."""

import json
from dataclasses import dataclass
from pathlib import Path

ST_CONFIG = "config_sentence_transformers.json"
POOLING_CONFIG = Path("1_Pooling") / "config.json"
MATRYOSHKA_KEY = "matryoshka_dimensions"
SERVED_POOLINGS = ("mean", "cls")


class ServingConfigError(ValueError):
    """The checkpoint's serving configuration cannot be served; the message names the file."""


@dataclass(frozen=True)
class Serving:
    pooling: str
    """mean or cls"""
    include_prompt: bool
    prompts: dict[str, str]
    default_prompt_name: str | None
    matryoshka_dims: list[int]
    """largest first"""


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise ServingConfigError(f"{path}: not JSON ({err})") from err
    if not isinstance(data, dict):
        raise ServingConfigError(f"{path}: expected a JSON object")
    return data


def _pooling(checkpoint: Path) -> tuple[str, bool]:
    path = checkpoint / POOLING_CONFIG
    config = _json(path)
    include = config.get("include_prompt", True)
    if not isinstance(include, bool):
        raise ServingConfigError(f"{path}: include_prompt {include!r}, expected true or false")
    if "pooling_mode" not in config:
        return ("cls" if config.get("pooling_mode_cls_token") else "mean"), include
    mode = config["pooling_mode"]
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if mode not in SERVED_POOLINGS:
        raise ServingConfigError(f"{path}: pooling_mode {mode!r} is not served; attnserve pools "
                                 f"{' or '.join(SERVED_POOLINGS)}")
    return mode, include


def _prompts(checkpoint: Path) -> tuple[dict[str, str], str | None]:
    path = checkpoint / ST_CONFIG
    config = _json(path)
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise ServingConfigError(f"{path}: prompts must map names to texts")
    default = config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise ServingConfigError(f"{path}: default_prompt_name {default!r} is not one of the "
                                 f"prompts {sorted(prompts)}")
    return prompts, default


def matryoshka_dims(dims: list[int], hidden: int, source: str) -> list[int]:
    """`dims` checked against the hidden size, largest first, each once."""
    if not isinstance(dims, list) or not all(type(d) is int and 0 < d <= hidden for d in dims):
        raise ServingConfigError(f"{source}: Matryoshka sizes {dims!r}; expected sizes from 1 "
                                 f"to the hidden size, {hidden}")
    return sorted(set(dims), reverse=True)


def read_serving(checkpoint: Path, hidden: int, dims: list[int] | None = None) -> Serving:
    """The checkpoint's serving configuration; `dims` (export's --matryoshka-dims), when
    given, in place of the sizes config.json declares."""
    pooling, include = _pooling(checkpoint)
    prompts, default = _prompts(checkpoint)
    if dims is not None:
        sizes = matryoshka_dims(dims, hidden, "--matryoshka-dims")
    else:
        declared = _json(checkpoint / "config.json").get(MATRYOSHKA_KEY) or []
        sizes = matryoshka_dims(declared, hidden, f"{checkpoint / 'config.json'}: {MATRYOSHKA_KEY}")
    return Serving(pooling, include, prompts, default, sizes)
