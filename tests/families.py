"""Small random checkpoints of the families served beside BERT, as transformers saves them
(config.json, model.safetensors), each with a tokenizer of its family's kind trained here
by `tokenizers` on a few sentences and saved as transformers saves one (tokenizer.json
and tokenizer_config.json):

- RoBERTa: byte-level BPE, RobertaProcessing (<s> … </s>, offsets trimmed), pad id 1;
- XLM-RoBERTa: Unigram over a metaspace pre-tokenizer (▁word), NFKC, <s> … </s> by
  template, pad id 1;
- ModernBERT: byte-level BPE with [CLS] … [SEP] by template, its special tokens after the
  vocabulary (pad id past every word's) and a vocabulary rounded up past the
  tokenizer's, as ModernBERT's is; a local window of 16 tokens, so texts of a few dozen
  tokens cross it, and global attention every second layer.

The model, export and server tests share them."""

from pathlib import Path

FAMILIES = ("roberta", "xlm-roberta")

TRAINING_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Self-attention lets every token look at every other token in the sequence.",
    "Hello world, don't panic! The meeting moved from 3:30 p.m. to 10:15 a.m.",
    "Le chat dort sur le canapé pendant que la pluie tombe doucement.",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "Быстрая коричневая лиса прыгает через ленивую собаку.",
    "服务 A 调用了配置中心 B，因为它需要获取最新配置。",
    "東京は日本の首都です。",
    "def add(a, b):\n    return a + b\n",
    "Revenue grew 17.5% year over year to $4.2 billion.",
]
SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
# RoBERTa's positions start after the padding id (1): 130 rows serve 128 tokens.
ROBERTA_POSITIONS = 130
_ROBERTA_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def _roberta_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TRAINING_TEXTS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=_ROBERTA_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=True)
    return tokenizer


def _xlm_roberta_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.Unigram())
    tokenizer.normalizer = normalizers.NFKC()
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(TRAINING_TEXTS, trainers.UnigramTrainer(
        vocab_size=400, special_tokens=_ROBERTA_SPECIALS, unk_token="<unk>"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)])
    return tokenizer


def _save_tokenizer(tokenizer, directory: Path, **special_tokens: str) -> None:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special_tokens).save_pretrained(directory)


def _roberta_like(family: str, directory: Path, tokenizer, overrides: dict) -> Path:
    import torch
    import transformers

    config_class, model_class = {
        "roberta": (transformers.RobertaConfig, transformers.RobertaModel),
        "xlm-roberta": (transformers.XLMRobertaConfig, transformers.XLMRobertaModel),
    }[family]
    config = config_class(**(SHAPE | dict(
        vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=ROBERTA_POSITIONS,
        type_vocab_size=1, pad_token_id=1, bos_token_id=0, eos_token_id=2) | overrides))
    torch.manual_seed(0)
    model_class(config).eval().save_pretrained(directory, safe_serialization=True)
    _save_tokenizer(tokenizer, directory, bos_token="<s>", eos_token="</s>", cls_token="<s>",
                    sep_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    return directory


def make_checkpoint(family: str, directory: Path, **overrides) -> Path:
    """A random checkpoint of `family` (one of FAMILIES) in `directory`; `overrides` go to
    its transformers config."""
    if family == "roberta":
        return _roberta_like(family, directory, _roberta_tokenizer(), overrides)
    if family == "xlm-roberta":
        return _roberta_like(family, directory, _xlm_roberta_tokenizer(), overrides)
    raise ValueError(f"no maker for {family!r}")
