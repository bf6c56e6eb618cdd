"""Which Hugging Face checkpoints this package implements, told apart by config.json's
`model_type` and `architectures` (docs/api.md lists them): tensor names cannot tell the
families apart (RoBERTa's are BERT's, and loaded as BERT it serves vectors that are off
without a word: its positions start after the padding id).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from attnserve.model.config import (
    DecoderConfig,
    EncoderConfig,
    EncoderShape,
    HeadConfig,
    ModernBertConfig,
    VocabularyHeadConfig,
)
from attnserve.model.decoder import Decoder
from attnserve.model.encoder import Encoder
from attnserve.model.modernbert import ModernBertEncoder
from attnserve.model.tensor_names import (
    bert_names,
    distilbert_names,
    gemma3_names,
    modernbert_names,
    mpnet_names,
    qwen3_names,
)

AnyEncoder = Encoder | ModernBertEncoder | Decoder
"""the encoder of a checkpoint's family, as load_checkpoint builds it"""
Architecture = Literal["encoder", "language_model", "classifier"]


@dataclass(frozen=True)
class Family:
    model_type: str
    base: str
    """the architecture whose tensors are the encoder alone (BertModel)"""
    prefix: str
    """what the encoder's tensor names start with inside a model with a head ("bert.")"""
    language_model: str
    """the architecture of the encoder under its language-model head (BertForMaskedLM)"""
    language_model_head: tuple[str, ...]
    """the name prefixes of the language-model head's tensors, dropped at load unless kept"""
    config: Callable[[dict, bool], EncoderShape]
    """config.json, and whether the weights carry BERT's pooler -> the encoder's config"""
    encoder: Callable[..., AnyEncoder]
    tensor_names: Callable[[str], tuple[str, ...] | None]
    """a tensor's name, its prefix removed -> ours (model/tensor_names.py)"""
    head_config: Callable[[dict], HeadConfig] | None = None
    """config.json -> its sequence-classification head's config (None: no classifier here)"""
    head_modules: dict[str, str] | None = None
    """the sequence-classification head's modules, by their full names in the checkpoint
    -> ours in model/classifier.py's ClassificationHead (BERT's dense layer is its pooler)"""
    vocabulary_config: Callable[[dict], VocabularyHeadConfig] | None = None
    """config.json -> its masked-LM head's config (None: the family's is not implemented)"""
    vocabulary_modules: dict[str, str] | None = None
    """the masked-LM head's modules by their full names in the checkpoint -> ours in
    model/masked_lm.py's VocabularyHead (the module holding the decoder's bias, where a
    family keeps it apart from the decoder, is the decoder too)"""

    @property
    def classifier(self) -> str | None:
        if self.head_config is None:
            return None
        return self.base.removesuffix("Model") + "ForSequenceClassification"


_ROBERTA_HEAD = {"classifier.dense": "dense", "classifier.out_proj": "out"}
_ROBERTA_LM_HEAD = {"lm_head.dense": "dense", "lm_head.layer_norm": "norm",
                    "lm_head.decoder": "decoder", "lm_head": "decoder"}


def _encoder_family(model_type: str, base: str, prefix: str, config: Callable, names: Callable,
                    lm_head: tuple[str, ...] = ("lm_head.",), head_config: Callable = HeadConfig.bert_from_hf,
                    head_modules: dict[str, str] = _ROBERTA_HEAD,
                    vocabulary_config: Callable = VocabularyHeadConfig.bert_from_hf,
                    vocabulary_modules: dict[str, str] = _ROBERTA_LM_HEAD,
                    encoder: Callable = Encoder) -> Family:
    """An encoder family, its heads RoBERTa's unless it names others."""
    return Family(model_type, base, prefix, base.removesuffix("Model") + "ForMaskedLM", lm_head,
                  config, encoder, names, head_config, head_modules, vocabulary_config, vocabulary_modules)


FAMILIES = {family.model_type: family for family in (
    _encoder_family("bert", "BertModel", "bert.", EncoderConfig.from_hf, bert_names,
                    ("cls.predictions.",), head_modules={"bert.pooler.dense": "dense", "classifier": "out"},
                    vocabulary_modules={"cls.predictions.transform.dense": "dense",
                                        "cls.predictions.transform.LayerNorm": "norm",
                                        "cls.predictions.decoder": "decoder", "cls.predictions": "decoder"}),
    _encoder_family("roberta", "RobertaModel", "roberta.", EncoderConfig.from_hf, bert_names),
    _encoder_family("xlm-roberta", "XLMRobertaModel", "roberta.", EncoderConfig.from_hf, bert_names),
    _encoder_family("modernbert", "ModernBertModel", "model.", ModernBertConfig.from_hf, modernbert_names,
                    ("head.", "decoder."), HeadConfig.modernbert_from_hf,
                    {"head.dense": "dense", "head.norm": "norm", "classifier": "out"},
                    VocabularyHeadConfig.modernbert_from_hf,
                    {"head.dense": "dense", "head.norm": "norm", "decoder": "decoder"}, ModernBertEncoder),
    _encoder_family("mpnet", "MPNetModel", "mpnet.", EncoderConfig.mpnet_from_hf, mpnet_names),
    _encoder_family("distilbert", "DistilBertModel", "distilbert.", EncoderConfig.distilbert_from_hf,
                    distilbert_names, ("vocab_transform.", "vocab_layer_norm.", "vocab_projector."),
                    HeadConfig.distilbert_from_hf, {"pre_classifier": "dense", "classifier": "out"},
                    VocabularyHeadConfig.distilbert_from_hf,
                    {"vocab_transform": "dense", "vocab_layer_norm": "norm", "vocab_projector": "decoder"}),
    Family("qwen3", "Qwen3Model", "model.", "Qwen3ForCausalLM", ("lm_head.",),
           DecoderConfig.qwen3_from_hf, Decoder, qwen3_names, HeadConfig.qwen3_from_hf, {"score": "out"}),
    Family("gemma3_text", "Gemma3TextModel", "model.", "Gemma3ForCausalLM", ("lm_head.",),
           DecoderConfig.gemma3_from_hf, Decoder, gemma3_names),
)}


def family_of(hf: dict) -> Family:
    """The family config.json (`hf`) describes; for any other, ValueError naming those served."""
    model_type = hf.get("model_type")
    if model_type is None:
        raise ValueError(f"no model_type; attnserve exports {', '.join(FAMILIES)}")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"model_type {model_type!r} is not served; attnserve exports {', '.join(FAMILIES)}")
    return family


def architecture_of(hf: dict, family: Family) -> Architecture:
    """What config.json's `architectures` hold of `family`: its encoder alone, under its
    language-model head, or under its sequence-classification head; ValueError for any
    other (a config without `architectures` is the base model)."""
    kinds = {family.base: "encoder", family.language_model: "language_model"}
    if family.classifier is not None:
        kinds[family.classifier] = "classifier"
    found = []
    for architecture in hf.get("architectures") or [family.base]:
        if architecture not in kinds:
            reranker = (f" and {family.classifier} (a reranker)" if family.classifier else "")
            raise ValueError(
                f"architectures: {architecture!r} is not served; for model_type "
                f"{hf['model_type']!r} attnserve exports {family.base}, {family.language_model} "
                f"(its language-model head dropped: the encoder is the base model's){reranker}")
        found.append(kinds[architecture])
    if "classifier" in found and len(set(found)) > 1:
        raise ValueError(f"architectures: {hf['architectures']} name a classifier beside another "
                         "head; export a checkpoint of one")
    return found[0]
