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
  tokens cross it, and three layers: global, local, global.

`make_reranker` makes each family's sequence classifier (BERT's with MiniLM's tokenizer)
the same way: a cross-encoder served as a reranker, its weights drawn wide enough that
its scores spread over pairs.

The model, export and server tests share them."""

from pathlib import Path

FAMILIES = ("roberta", "xlm-roberta", "modernbert")

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
_MODERNBERT_SPECIALS = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
# ModernBERT's window, its tiny positions and its layers: global, local, global.
MODERNBERT_WINDOW = 16
MODERNBERT_POSITIONS = 128
# Weights large enough that attention is far from uniform, so that the window, the layer
# kinds and the rotary convention each change the hidden states by 0.2 to 0.8.
MODERNBERT_INIT = 0.2


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


def _modernbert_tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TRAINING_TEXTS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in _MODERNBERT_SPECIALS])
    cls, sep = (tokenizer.token_to_id(token) for token in ("[CLS]", "[SEP]"))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return tokenizer


def _modernbert(directory: Path, overrides: dict) -> Path:
    import torch
    from transformers import ModernBertConfig, ModernBertModel

    tokenizer = _modernbert_tokenizer()
    ids = {token: tokenizer.token_to_id(token) for token in _MODERNBERT_SPECIALS}
    config = ModernBertConfig(**(SHAPE | dict(
        num_hidden_layers=3, global_attn_every_n_layers=2, local_attention=MODERNBERT_WINDOW,
        max_position_embeddings=MODERNBERT_POSITIONS, intermediate_size=48,
        initializer_range=MODERNBERT_INIT,
        vocab_size=-(-tokenizer.get_vocab_size() // 64) * 64, pad_token_id=ids["[PAD]"],
        cls_token_id=ids["[CLS]"], bos_token_id=ids["[CLS]"], sep_token_id=ids["[SEP]"],
        eos_token_id=ids["[SEP]"]) | overrides))
    torch.manual_seed(0)
    ModernBertModel(config).eval().save_pretrained(directory, safe_serialization=True)
    _save_tokenizer(tokenizer, directory, cls_token="[CLS]", sep_token="[SEP]", pad_token="[PAD]",
                    unk_token="[UNK]", mask_token="[MASK]")
    return directory


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
    if family == "modernbert":
        return _modernbert(directory, overrides)
    raise ValueError(f"no maker for {family!r}")


RERANKER_FAMILIES = ("bert", *FAMILIES)
# Wide enough that a random cross-encoder's scores differ from pair to pair by tenths.
RERANKER_INIT = 0.2
_MINILM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                           "special_tokens_map.json")


def make_reranker(family: str, directory: Path, num_labels: int = 1, **overrides) -> Path:
    """A random `…ForSequenceClassification` of `family` (bert or one of FAMILIES) with
    `num_labels` labels, as transformers saves it, with its tokenizer."""
    import shutil

    import torch
    import transformers

    from tests.harness import minilm_dir

    labels = {i: f"label_{i}" for i in range(num_labels)}
    if family == "bert":
        config = transformers.BertConfig(vocab_size=30522, max_position_embeddings=128, **SHAPE)
        for name in _MINILM_TOKENIZER_FILES:
            directory.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(minilm_dir() / name, directory / name)
    else:
        make_checkpoint(family, directory)
        config = transformers.AutoConfig.from_pretrained(directory)
    for key, value in (dict(initializer_range=RERANKER_INIT, id2label=labels,
                            label2id={v: k for k, v in labels.items()}) | overrides).items():
        setattr(config, key, value)
    model_class = getattr(transformers, {"bert": "Bert", "roberta": "Roberta",
                                         "xlm-roberta": "XLMRoberta",
                                         "modernbert": "ModernBert"}[family]
                          + "ForSequenceClassification")
    torch.manual_seed(0)
    model_class(config).eval().save_pretrained(directory, safe_serialization=True)
    return directory
