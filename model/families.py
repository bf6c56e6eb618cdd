"""Which Hugging Face checkpoints this package implements, told apart by config.json.

Tensor names cannot tell the families apart: a RoBERTa or XLM-RoBERTa checkpoint names
its tensors exactly as BERT does, and loaded as BERT it serves vectors that are off
without a word (its positions start after the padding id). So a checkpoint is refused
unless its `model_type` is a family written here and every one of its `architectures`
holds that family's encoder as it is: the base model, the base model under its
masked-language-model head, which is dropped at load (it predicts tokens, and nothing
served reads it), or the base model under its sequence-classification head, which is
kept: a cross-encoder (model/classifier.py), served as a reranker.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from attnserve.model.config import EncoderConfig, EncoderShape, HeadConfig, ModernBertConfig
from attnserve.model.encoder import Encoder
from attnserve.model.modernbert import ModernBertEncoder
from attnserve.model.tensor_names import bert_names, modernbert_names

AnyEncoder = Encoder | ModernBertEncoder
"""the encoder of a checkpoint's family, as load_checkpoint builds it"""
Architecture = Literal["encoder", "masked_lm", "classifier"]


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
    head_config: Callable[[dict], HeadConfig]
    """config.json -> its sequence-classification head's config"""
    head_modules: dict[str, str]
    """the sequence-classification head's modules, by their full names in the checkpoint
    -> ours in model/classifier.py's ClassificationHead (BERT's dense layer is its pooler)"""

    @property
    def masked_lm(self) -> str:
        return self.base.removesuffix("Model") + "ForMaskedLM"

    @property
    def classifier(self) -> str:
        return self.base.removesuffix("Model") + "ForSequenceClassification"

    def head_names(self, hf_name: str) -> tuple[str, ...] | None:
        """A classifier head tensor's name in the checkpoint -> ours, None for any other."""
        module, _, kind = hf_name.rpartition(".")
        ours = self.head_modules.get(module)
        return None if ours is None else (f"{ours}.{kind}",)


_BERT_HEAD = {"bert.pooler.dense": "dense", "classifier": "out"}
_ROBERTA_HEAD = {"classifier.dense": "dense", "classifier.out_proj": "out"}
_MODERNBERT_HEAD = {"head.dense": "dense", "head.norm": "norm", "classifier": "out"}

FAMILIES = {family.model_type: family for family in (
    Family("bert", "BertModel", "bert.", ("cls.predictions.",), EncoderConfig.from_hf, Encoder,
           bert_names, HeadConfig.bert_from_hf, _BERT_HEAD),
    Family("roberta", "RobertaModel", "roberta.", ("lm_head.",), EncoderConfig.from_hf, Encoder,
           bert_names, HeadConfig.bert_from_hf, _ROBERTA_HEAD),
    Family("xlm-roberta", "XLMRobertaModel", "roberta.", ("lm_head.",), EncoderConfig.from_hf,
           Encoder, bert_names, HeadConfig.bert_from_hf, _ROBERTA_HEAD),
    Family("modernbert", "ModernBertModel", "model.", ("head.", "decoder."),
           ModernBertConfig.from_hf, ModernBertEncoder, modernbert_names,
           HeadConfig.modernbert_from_hf, _MODERNBERT_HEAD),
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
    architecture_of(hf, family)
    return family


def architecture_of(hf: dict, family: Family) -> Architecture:
    """What config.json's `architectures` hold of `family`: its encoder alone, under its
    masked-LM head, or under its sequence-classification head; ValueError for any other
    (a config without `architectures` is the base model)."""
    kinds = {family.base: "encoder", family.masked_lm: "masked_lm", family.classifier: "classifier"}
    found = []
    for architecture in hf.get("architectures") or [family.base]:
        if architecture not in kinds:
            raise ValueError(
                f"architectures: {architecture!r} is not served; for model_type "
                f"{hf['model_type']!r} attnserve exports {family.base}, {family.masked_lm} (its "
                f"masked-LM head dropped: the encoder is the base model's) and "
                f"{family.classifier} (a reranker)")
        found.append(kinds[architecture])
    if "classifier" in found and len(set(found)) > 1:
        raise ValueError(f"architectures: {hf['architectures']} name a classifier beside another "
                         "head; export a checkpoint of one")
    return found[0]
