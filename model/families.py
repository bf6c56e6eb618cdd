"""Which Hugging Face checkpoints this package implements, told apart by config.json.

Tensor names cannot tell the families apart: a RoBERTa or XLM-RoBERTa checkpoint names
its tensors exactly as BERT does, and loaded as BERT it serves vectors that are off
without a word (its positions start after the padding id). So a checkpoint is refused
unless its `model_type` is a family written here and every one of its `architectures`
holds that family's encoder as it is: the base model, or the base model under its
masked-language-model head, which is dropped at load (it predicts tokens, and nothing
served reads it).
"""

from collections.abc import Callable
from dataclasses import dataclass

from attnserve.model.config import EncoderConfig, EncoderShape, ModernBertConfig
from attnserve.model.encoder import Encoder
from attnserve.model.modernbert import ModernBertEncoder
from attnserve.model.tensor_names import bert_names, modernbert_names

AnyEncoder = Encoder | ModernBertEncoder
"""the encoder of a checkpoint's family, as load_checkpoint builds it"""


@dataclass(frozen=True)
class Family:
    model_type: str
    base: str
    """the architecture whose tensors are the encoder alone (BertModel)"""
    prefix: str
    """what the encoder's tensor names start with inside a model with a head ("bert.")"""
    masked_lm_head: tuple[str, ...]
    """the name prefixes of the masked-LM head's tensors, dropped at load"""
    config: Callable[[dict, bool], EncoderShape]
    """config.json, and whether the weights carry BERT's pooler -> the encoder's config"""
    encoder: Callable[..., AnyEncoder]
    tensor_names: Callable[[str], tuple[str, ...] | None]
    """a tensor's name, its prefix removed -> ours (model/tensor_names.py)"""

    @property
    def masked_lm(self) -> str:
        return self.base.removesuffix("Model") + "ForMaskedLM"


FAMILIES = {family.model_type: family for family in (
    Family("bert", "BertModel", "bert.", ("cls.predictions.",), EncoderConfig.from_hf, Encoder,
           bert_names),
    Family("roberta", "RobertaModel", "roberta.", ("lm_head.",), EncoderConfig.from_hf, Encoder,
           bert_names),
    Family("xlm-roberta", "XLMRobertaModel", "roberta.", ("lm_head.",), EncoderConfig.from_hf,
           Encoder, bert_names),
    Family("modernbert", "ModernBertModel", "model.", ("head.", "decoder."),
           ModernBertConfig.from_hf, ModernBertEncoder, modernbert_names),
)}


def served() -> str:
    return ", ".join(FAMILIES)


def family_of(hf: dict) -> Family:
    """The family config.json (`hf`) describes; ValueError, naming what it read and what
    is served, for any other. A config without `architectures` is read as the base model."""
    model_type = hf.get("model_type")
    if model_type is None:
        raise ValueError(f"no model_type; attnserve exports {served()}")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not served; attnserve exports {served()}")
    for architecture in hf.get("architectures") or [family.base]:
        if architecture in (family.base, family.masked_lm):
            continue
        if architecture.endswith("ForSequenceClassification"):
            raise ValueError(
                f"architectures: {architecture!r} is not served: attnserve does not serve "
                "sequence-classification heads (it serves the encoder's embeddings, and would "
                "drop the classifier the checkpoint was trained for)")
        raise ValueError(
            f"architectures: {architecture!r} is not served; for model_type {model_type!r} "
            f"attnserve exports {family.base} and {family.masked_lm} (its masked-LM head "
            "dropped: the encoder is the base model's)")
    return family


def drops_head(hf: dict, family: Family) -> bool:
    """Whether the checkpoint carries the masked-LM head, which loading leaves out."""
    return family.masked_lm in (hf.get("architectures") or [])
