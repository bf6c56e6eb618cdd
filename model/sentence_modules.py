"""sentence-transformers' modules, as a checkpoint's modules.json lists them in the order
they run (Transformer -> Pooling -> Dense … -> Normalize): what turns the encoder's token
states into the vector `SentenceTransformer.encode` returns. docs/api.md
("sentence-transformers' modules") says what each exports as; any other module, or these in
another order, is refused: it would serve another vector than the model's. A checkpoint
without modules.json is a plain Hugging Face model: mean pooling, as sentence-transformers
loads it.
"""

import contextlib
import importlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from attnserve.model.checkpoint import CheckpointError

MODULES = "modules.json"
DENSE_CONFIG = "config.json"
# Where a checkpoint without modules.json keeps its Pooling module's config, if anywhere.
DEFAULT_POOLING = "1_Pooling"
# Dense and Normalize act on the pooled vector under this name; on another (the token
# states, as multi-vector models use them) they would change something else.
SENTENCE_EMBEDDING = "sentence_embedding"
TOKEN_EMBEDDINGS = "token_embeddings"
"""the token states, what a multi-vector model's Dense and Normalize act on"""
_KNOWN = ("Transformer", "Pooling", "Dense", "Dropout", "Normalize")


class Dense(nn.Module):
    """activation(linear(x)), plus x (through a projection when the sizes differ) when
    `residual`: sentence-transformers' Dense, its parameters under the same names."""

    def __init__(self, in_features: int, out_features: int, bias: bool, activation: nn.Module,
                 residual: bool = False):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.activation = activation
        self.use_residual = residual
        self.residual = (nn.Linear(in_features, out_features, bias=False)
                         if residual and in_features != out_features else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.activation(self.linear(x))
        if self.use_residual:
            out = out + (x if self.residual is None else self.residual(x))
        return out


@dataclass(frozen=True)
class ModuleList:
    pooling_config: Path | None
    """the Pooling module's config.json (None: mean pooling, sentence-transformers' default)"""
    dense: tuple[Path, ...]
    """each Dense module's folder, in the order they run"""
    normalize: bool
    """the vectors end at unit length"""


def _json(path: Path, where: str) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}: {where} cannot be read ({err})") from err


def _activation(path: Path, name: str) -> nn.Module:
    """sentence-transformers' activation by its class path (torch.nn's only, as it loads
    them without remote code)."""
    module_name, _, class_name = name.rpartition(".")
    found = None
    if name.startswith("torch.nn."):
        with contextlib.suppress(ImportError):
            found = getattr(importlib.import_module(module_name), class_name, None)
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise CheckpointError(f"{path}: activation_function {name!r} is not a torch.nn module")
    try:
        return found()
    except TypeError as err:
        raise CheckpointError(f"{path}: activation_function {name!r} needs arguments ({err})") from err


def _weights(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    for name in ("model.safetensors", "pytorch_model.bin"):
        path = folder / name
        if path.is_file():
            try:
                return path, (load_file(path) if name.endswith(".safetensors")
                              else torch.load(path, map_location="cpu", weights_only=True))
            except Exception as err:  # a damaged file raises whatever its reader does
                raise CheckpointError(f"{path}: cannot be read ({err})") from err
    raise CheckpointError(f"{folder}: a Dense module needs model.safetensors or pytorch_model.bin")


def _dense(folder: Path, in_features: int, on: str) -> Dense:
    path = folder / DENSE_CONFIG
    config = _json(path, "a Dense module's config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    states = "the pooled vector" if on == SENTENCE_EMBEDDING else "the token states"
    for key in ("module_input_name", "module_output_name"):
        if config.get(key) not in (None, on):
            raise CheckpointError(f"{path}: {key} {config[key]!r}; attnserve exports Dense layers "
                                  f"on {states} ({on!r})")
    if config.get("in_features") != in_features or not isinstance(config.get("out_features"), int):
        raise CheckpointError(f"{path}: in_features {config.get('in_features')!r} and out_features "
                           f"{config.get('out_features')!r}; the vector coming in has {in_features}")
    dense = Dense(in_features, config["out_features"], bool(config.get("bias", True)),
                  _activation(path, config.get("activation_function", "torch.nn.modules.activation.Tanh")),
                  bool(config.get("use_residual", False)))
    weights_path, weights = _weights(folder)
    expected = dense.state_dict()
    for name in sorted(set(weights) | set(expected)):
        if name not in expected:
            raise CheckpointError(f"{weights_path}: tensor {name} does not belong to this Dense")
        if name not in weights:
            raise CheckpointError(f"{weights_path}: missing tensor {name}")
        if tuple(weights[name].shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{weights_path}: tensor {name} has shape {tuple(weights[name].shape)}, "
                                  f"the config says {tuple(expected[name].shape)}")
    dense.load_state_dict({name: w.float() for name, w in weights.items()})
    return dense


def module_types(path: Path) -> list[tuple[str, str, str]]:
    """modules.json -> (name, type, path) of each module, in order, whatever its type."""
    entries = _json(path, "sentence-transformers' module list")
    if not isinstance(entries, list) or not all(isinstance(e, dict) and isinstance(e.get("type"), str)
                                                for e in entries):
        raise CheckpointError(f"{path}: expected a list of modules, each with its type")
    return [(str(entry.get("name", "?")), entry["type"], str(entry.get("path", "")))
            for entry in sorted(entries, key=lambda e: e.get("idx", 0))]


def _entries(path: Path) -> list[tuple[str, str, str]]:
    """modules.json -> (name, class name, path) of each module, in order."""
    found = []
    for module, kind, folder in module_types(path):
        name = kind.rpartition(".")[2]
        if not kind.startswith("sentence_transformers.") or name not in _KNOWN:
            raise CheckpointError(f"{path}: module {module} {kind!r} is not one "
                               f"attnserve exports ({', '.join(_KNOWN)}): it would serve "
                               "something else than the model returns")
        found.append((module, name, folder))
    return found


def read_module_list(checkpoint: Path) -> ModuleList:
    """The modules a checkpoint's modules.json lists after its Transformer, checked to be
    ones attnserve runs as sentence-transformers runs them."""
    path = checkpoint / MODULES
    if not path.is_file():
        default = checkpoint / DEFAULT_POOLING / "config.json"
        return ModuleList(default if default.is_file() else None, (), False)
    entries = _entries(path)
    order = [kind for _, kind, _ in entries]
    if order[:2] != ["Transformer", "Pooling"] or order.count("Pooling") > 1:
        raise CheckpointError(f"{path}: modules {order}; attnserve exports a Transformer, then "
                              "one Pooling, then Dense layers and a Normalize")
    if entries[0][2]:
        raise CheckpointError(f"{path}: the Transformer lives in {entries[0][2]!r}; attnserve "
                              "exports one whose config.json and weights are the checkpoint's own")
    dense, normalize = [], False
    for name, kind, folder in entries[2:]:
        if normalize:
            raise CheckpointError(f"{path}: module {name} ({kind}) comes after Normalize; "
                                  "attnserve exports Normalize last")
        if kind == "Normalize":
            config = checkpoint / folder / "config.json"
            input_name = (_json(config, "Normalize's config") or {}).get(
                "module_input_name") if config.is_file() else None
            if input_name not in (None, SENTENCE_EMBEDDING):
                raise CheckpointError(f"{config}: module_input_name {input_name!r}; attnserve "
                                      f"normalizes the pooled vector ({SENTENCE_EMBEDDING!r})")
            normalize = True
        elif kind == "Dense":
            dense.append(checkpoint / folder)
        elif kind != "Dropout":  # Dropout is the identity at inference
            raise CheckpointError(f"{path}: module {name} ({kind}) after the Pooling; attnserve "
                                  "exports Dense layers and a Normalize there")
    return ModuleList(checkpoint / entries[1][2] / "config.json", tuple(dense), normalize)


def dense_layers(modules: ModuleList, in_features: int) -> nn.Sequential:
    """dense_stack on the pooled vector of `in_features`; none: it passes unchanged."""
    return dense_stack(modules.dense, in_features, SENTENCE_EMBEDDING)


def dense_stack(folders: tuple[Path, ...], in_features: int, on: str) -> nn.Sequential:
    """The Dense layers in `folders`, in order, each taking the previous one's vectors (the
    first, vectors of `in_features`), on the pooled vector or the token states (`on`)."""
    layers = []
    for folder in folders:
        layers.append(_dense(folder, in_features, on))
        in_features = layers[-1].linear.out_features
    return nn.Sequential(*layers).eval()


def check_reranker_modules(checkpoint: Path) -> None:
    """A cross-encoder's modules.json (sentence-transformers saves one) may list its
    Transformer alone: any module after it would change the scores."""
    path = checkpoint / MODULES
    if path.is_file():
        extra = [f"{name} ({kind})" for name, kind, _ in _entries(path) if kind != "Transformer"]
        if extra:
            raise CheckpointError(f"{path}: a sequence classifier's modules are its Transformer "
                               f"alone; {', '.join(extra)} would change its scores")
