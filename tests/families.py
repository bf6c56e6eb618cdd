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
  tokens cross it, and three layers: global, local, global;
- MPNet: WordPiece (lower-cased), <s> … </s> by template, pad id 1;
- DistilBERT: WordPiece, [CLS] … [SEP], no token types;
- Qwen3: byte-level BPE with <|endoftext|> appended to every text by template and used as
  the pad token, padding on the left (Qwen3-Embedding's tokenizer); 4 query heads over 2
  key/value heads of 16 values each (wider together than the hidden size), causal;
- Gemma3 (its text decoder run both ways, as EmbeddingGemma): a metaspace BPE with <bos>
  … <eos>; 4 query heads over 2 key/value heads; layers local, global, local with a
  window of 16 tokens (8 on either side), so texts of a few dozen tokens cross it.

The decoders' weights are drawn wide (DECODER_INIT) and every vector parameter (norm
scales, biases) random, so that the masks, the windows and each norm's place change the
hidden states measurably.

`make_sentence_transformer` saves a family's checkpoint as sentence-transformers does,
with its modules (SENTENCE_MODULES: the pooling, Dense layers, Normalize, prompts of the
embedders each family stands for).

`make_reranker` makes each family's sequence classifier (BERT's with MiniLM's tokenizer)
the same way: a cross-encoder served as a reranker, its weights drawn wide enough that
its scores spread over pairs.

The model, export and server tests share them."""

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FAMILIES = ("roberta", "xlm-roberta", "modernbert")
# The families with a sentence-transformers checkpoint of their own (SENTENCE_MODULES).
SENTENCE_FAMILIES = ("mpnet", "distilbert", "qwen3", "gemma3_text")
ALL_FAMILIES = FAMILIES + SENTENCE_FAMILIES

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
DECODER_INIT = 0.2
DECODER_POSITIONS = 128
# Gemma3's window: `sliding_window` 16 is 8 positions on either side.
GEMMA3_WINDOW = 16
_WORDPIECE_SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
_QWEN3_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_GEMMA3_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
_DECODER_SHAPE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=48,
                      max_position_embeddings=DECODER_POSITIONS, initializer_range=DECODER_INIT)


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


def _byte_level_bpe(specials: list[str]):
    """Byte-level BPE, its special tokens after the vocabulary (ModernBERT's, Qwen3's)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TRAINING_TEXTS, trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    return tokenizer


def _modernbert_tokenizer():
    from tokenizers import processors

    tokenizer = _byte_level_bpe(_MODERNBERT_SPECIALS)
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


def _save_tokenizer(tokenizer, directory: Path, **settings) -> None:
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **settings).save_pretrained(directory)


def _wordpiece_tokenizer(specials: list[str], unk: str):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.WordPiece(unk_token=unk))
    tokenizer.normalizer = normalizers.BertNormalizer(lowercase=True)
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.train_from_iterator(TRAINING_TEXTS, trainers.WordPieceTrainer(
        vocab_size=400, special_tokens=specials))
    return tokenizer


def _save_random(model_class, config, directory: Path) -> None:
    """A seeded random `model_class` of `config`, every vector parameter (norm scales,
    biases) drawn at random around its value too, so that a norm or a bias loaded in the
    wrong place shows; saved as transformers saves it."""
    import torch

    torch.manual_seed(0)
    model = model_class(config).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)


def _mpnet(directory: Path, overrides: dict) -> Path:
    from tokenizers import processors
    from transformers import MPNetConfig, MPNetModel

    tokenizer = _wordpiece_tokenizer(_ROBERTA_SPECIALS, "<unk>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", 0), ("</s>", 2)])
    config = MPNetConfig(**(SHAPE | dict(
        vocab_size=tokenizer.get_vocab_size(), max_position_embeddings=ROBERTA_POSITIONS,
        pad_token_id=1, bos_token_id=0, eos_token_id=2) | overrides))
    _save_random(MPNetModel, config, directory)
    _save_tokenizer(tokenizer, directory, bos_token="<s>", eos_token="</s>", cls_token="<s>",
                    sep_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>",
                    model_input_names=["input_ids", "attention_mask"])
    return directory


def _distilbert(directory: Path, overrides: dict) -> Path:
    from tokenizers import processors
    from transformers import DistilBertConfig, DistilBertModel

    tokenizer = _wordpiece_tokenizer(_WORDPIECE_SPECIALS, "[UNK]")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    config = DistilBertConfig(**(dict(
        vocab_size=tokenizer.get_vocab_size(), dim=32, n_layers=2, n_heads=4, hidden_dim=64,
        max_position_embeddings=128, pad_token_id=0) | overrides))
    _save_random(DistilBertModel, config, directory)
    _save_tokenizer(tokenizer, directory, cls_token="[CLS]", sep_token="[SEP]",
                    pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]",
                    model_input_names=["input_ids", "attention_mask"])
    return directory


def _qwen3_tokenizer():
    from tokenizers import processors

    tokenizer = _byte_level_bpe(_QWEN3_SPECIALS)
    end = tokenizer.token_to_id("<|endoftext|>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="$A <|endoftext|>", pair="$A <|endoftext|> $B:1 <|endoftext|>:1",
        special_tokens=[("<|endoftext|>", end)])
    return tokenizer


def _qwen3(directory: Path, overrides: dict) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _qwen3_tokenizer()
    end = tokenizer.token_to_id("<|endoftext|>")
    config = Qwen3Config(**(_DECODER_SHAPE | dict(
        vocab_size=tokenizer.get_vocab_size(), rope_parameters={"rope_type": "default",
                                                                 "rope_theta": 1_000_000.0},
        tie_word_embeddings=True, pad_token_id=end, bos_token_id=end, eos_token_id=end)
        | overrides))
    _save_random(Qwen3ForCausalLM, config, directory)
    _save_tokenizer(tokenizer, directory, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                    padding_side="left", model_input_names=["input_ids", "attention_mask"])
    return directory


def _gemma3(directory: Path, overrides: dict) -> Path:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import Gemma3TextConfig, Gemma3TextModel

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    tokenizer.train_from_iterator(TRAINING_TEXTS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=[AddedToken(t, special=True) for t in _GEMMA3_SPECIALS]))
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", pair="<bos> $A <eos> $B <eos>",
        special_tokens=[("<bos>", 2), ("<eos>", 1)])
    config = Gemma3TextConfig(**(_DECODER_SHAPE | dict(
        num_hidden_layers=3, vocab_size=tokenizer.get_vocab_size(), query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=GEMMA3_WINDOW, use_bidirectional_attention=True,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        pad_token_id=0, eos_token_id=1, bos_token_id=2) | overrides))
    _save_random(Gemma3TextModel, config, directory)
    _save_tokenizer(tokenizer, directory, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                    unk_token="<unk>", model_input_names=["input_ids", "attention_mask"])
    return directory


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


def _bert(directory: Path, overrides: dict) -> Path:
    import shutil

    import torch
    import transformers

    from tests.harness import minilm_dir

    directory.mkdir(parents=True, exist_ok=True)
    for name in _MINILM_TOKENIZER_FILES:
        shutil.copyfile(minilm_dir() / name, directory / name)
    config = transformers.BertConfig(**(SHAPE | dict(vocab_size=30522, max_position_embeddings=128)
                                        | overrides))
    torch.manual_seed(0)
    transformers.BertModel(config).eval().save_pretrained(directory, safe_serialization=True)
    return directory


def make_checkpoint(family: str, directory: Path, **overrides) -> Path:
    """A random checkpoint of `family` (bert, with MiniLM's tokenizer, or one of
    ALL_FAMILIES) in `directory`; `overrides` go to its transformers config."""
    if family == "roberta":
        return _roberta_like(family, directory, _roberta_tokenizer(), overrides)
    if family == "xlm-roberta":
        return _roberta_like(family, directory, _xlm_roberta_tokenizer(), overrides)
    makers = {"bert": _bert, "modernbert": _modernbert, "mpnet": _mpnet,
              "distilbert": _distilbert, "qwen3": _qwen3, "gemma3_text": _gemma3}
    if family not in makers:
        raise ValueError(f"no maker for {family!r}")
    return makers[family](directory, overrides)


def make_bge_m3(directory: Path, colbert_dim: int = 24) -> Path:
    """A random XLM-RoBERTa checkpoint with bge-m3's two heads beside it, as FlagEmbedding
    saves them: sparse_linear.pt (hidden -> 1) and colbert_linear.pt (hidden -> colbert_dim)."""
    import torch

    checkpoint = make_checkpoint("xlm-roberta", directory)
    hidden = json.loads((checkpoint / "config.json").read_text())["hidden_size"]
    torch.manual_seed(1)
    torch.save(torch.nn.Linear(hidden, 1).state_dict(), checkpoint / "sparse_linear.pt")
    torch.save(torch.nn.Linear(hidden, colbert_dim).state_dict(), checkpoint / "colbert_linear.pt")
    return checkpoint


@dataclass(frozen=True)
class BgeM3Output:
    """One text's outputs as FlagEmbedding's BGEM3 computes them."""

    ids: list[int]
    dense: np.ndarray
    """the [CLS] state, normalised"""
    lexical: dict[int, float]
    """ReLU(sparse_linear(h)) a token: a token id's largest positive weight, specials left out"""
    colbert: np.ndarray
    """colbert_linear(h) of every token after [CLS], normalised"""
    dropped: frozenset[int]
    """the ids left out of `lexical`: the tokenizer's cls, eos, pad and unk tokens"""


def bge_m3_outputs(checkpoint: Path, texts: list[str]) -> list[BgeM3Output]:
    """Each text's bge-m3 outputs, computed from the checkpoint's own tensors on
    transformers' hidden states, as FlagEmbedding computes them."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint))
    model = AutoModel.from_pretrained(str(checkpoint)).eval()
    sparse = torch.load(checkpoint / "sparse_linear.pt", weights_only=True)
    colbert = torch.load(checkpoint / "colbert_linear.pt", weights_only=True)
    dropped = frozenset({tokenizer.cls_token_id, tokenizer.eos_token_id,
                         tokenizer.pad_token_id, tokenizer.unk_token_id})
    found = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        with torch.no_grad():
            h = model(torch.tensor([ids])).last_hidden_state[0]
        weights = torch.relu(h @ sparse["weight"].T + sparse["bias"]).squeeze(-1).tolist()
        found.append(BgeM3Output(
            ids, F.normalize(h[0], dim=-1).numpy(), lexical_weights(ids, weights, dropped),
            F.normalize(h[1:] @ colbert["weight"].T + colbert["bias"], dim=-1).numpy(), dropped))
    return found


def lexical_weights(ids, weights, dropped) -> dict[int, float]:
    """FlagEmbedding's lexical weights: per token id its largest positive weight."""
    found: dict[int, float] = {}
    for token, weight in zip(ids, weights, strict=True):
        if token not in dropped and weight > 0:
            found[token] = max(found.get(token, 0.0), float(weight))
    return found


RERANKER_FAMILIES = ("bert", *FAMILIES)
# The sentence families with a sequence classifier in transformers (Gemma3's text model is
# served as an embedder only).
CLASSIFIER_FAMILIES = ("mpnet", "distilbert", "qwen3")
# Wide enough that a random cross-encoder's scores differ from pair to pair by tenths.
RERANKER_INIT = 0.2
_MINILM_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt",
                           "special_tokens_map.json")


def make_reranker(family: str, directory: Path, num_labels: int = 1, **overrides) -> Path:
    """A random `…ForSequenceClassification` of `family` (bert, one of FAMILIES or of
    CLASSIFIER_FAMILIES) with `num_labels` labels, as transformers saves it, with its
    tokenizer."""
    import torch
    import transformers

    labels = {i: f"label_{i}" for i in range(num_labels)}
    make_checkpoint(family, directory)
    config = transformers.AutoConfig.from_pretrained(directory)
    for key, value in (dict(initializer_range=RERANKER_INIT, id2label=labels,
                            label2id={v: k for k, v in labels.items()}) | overrides).items():
        setattr(config, key, value)
    model_class = getattr(transformers, {"bert": "Bert", "roberta": "Roberta",
                                         "xlm-roberta": "XLMRoberta", "modernbert": "ModernBert",
                                         "mpnet": "MPNet", "distilbert": "DistilBert",
                                         "qwen3": "Qwen3"}[family]
                          + "ForSequenceClassification")
    torch.manual_seed(0)
    model_class(config).eval().save_pretrained(directory, safe_serialization=True)
    return directory


@dataclass(frozen=True)
class SentenceModules:
    """The sentence-transformers modules of the embedder a family's checkpoint stands for."""

    pooling: str
    dense: tuple[tuple[int, str, bool], ...] = ()
    """each Dense layer's (out_features, activation, bias)"""
    normalize: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    dense_as_bin: bool = False
    """the Dense weights in pytorch_model.bin, as older sentence-transformers saved them"""


QWEN3_QUERY = ("Instruct: Given a web search query, retrieve relevant passages that answer "
               "the query\nQuery:")
SENTENCE_MODULES = {
    # all-MiniLM-L6-v2's
    "bert": SentenceModules("mean"),
    # all-mpnet-base-v2
    "mpnet": SentenceModules("mean"),
    # a classifier-style embedder with a Tanh projection, saved by an older version
    "distilbert": SentenceModules("cls", dense=((24, "Tanh", True),), normalize=False,
                                  dense_as_bin=True),
    # Qwen3-Embedding: the last token, a query instruction as a prompt
    "qwen3": SentenceModules("lasttoken", prompts={"query": QWEN3_QUERY, "document": ""}),
    # EmbeddingGemma: mean, two Dense projections without bias or activation, its prompts
    "gemma3_text": SentenceModules("mean", dense=((64, "Identity", False), (32, "Identity", False)),
                                   prompts={"query": "task: search result | query: ",
                                            "document": "title: none | text: "}),
}


def make_sentence_transformer(family: str, directory: Path, **overrides) -> Path:
    """`family`'s random checkpoint (`overrides` to its transformers config) saved by
    sentence-transformers with the modules of SENTENCE_MODULES[family] (Dense weights
    random, seeded)."""
    import shutil

    import torch
    from safetensors.torch import load_file
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    spec = SENTENCE_MODULES[family]
    hf = make_checkpoint(family, directory.with_name(directory.name + "-hf"), **overrides)
    transformer = Transformer(str(hf))
    size = transformer.get_embedding_dimension()
    modules = [transformer, Pooling(size, pooling_mode=spec.pooling)]
    torch.manual_seed(0)
    for out, activation, bias in spec.dense:
        modules.append(Dense(size, out, bias=bias, activation_function=getattr(torch.nn, activation)()))
        size = out
    if spec.normalize:
        modules.append(Normalize())
    SentenceTransformer(modules=modules, prompts=spec.prompts, device="cpu").save(str(directory))
    shutil.rmtree(hf)
    if spec.dense_as_bin:
        for weights in directory.glob("*_Dense/model.safetensors"):
            torch.save(load_file(weights), weights.with_name("pytorch_model.bin"))
            weights.unlink()
    return directory


def make_sparse_encoder(directory: Path, family: str = "distilbert", pooling: str = "max",
                        activation: str = "relu", legacy: bool = True,
                        max_active_dims: int | None = None) -> Path:
    """A SPLADE model as sentence-transformers' SparseEncoder saves one: `family`'s
    masked-LM (random, seeded), then SpladePooling of `pooling` and `activation`; `legacy`:
    the masked-LM as the deprecated MLMTransformer module, else as a Transformer of task
    fill-mask; `max_active_dims`: the weights each text keeps."""
    import torch
    import transformers
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling

    base = make_checkpoint(family, directory.with_name(directory.name + "-mlm"))
    torch.manual_seed(0)
    transformers.AutoModelForMaskedLM.from_config(
        transformers.AutoConfig.from_pretrained(base)).save_pretrained(base)
    transformer = (MLMTransformer(str(base)) if legacy
                   else Transformer(str(base), transformer_task="fill-mask"))
    SparseEncoder(modules=[transformer, SpladePooling(pooling, activation)], device="cpu",
                  max_active_dims=max_active_dims).save(str(directory))
    return directory


def make_multi_vector(directory: Path, layout: str, dim: int = 16, query_length: int = 12,
                      document_length: int = 40) -> Path:
    """A random multi-vector (ColBERT) BERT checkpoint with MiniLM's tokenizer, saved as
    `layout` saves one: "pylate" (PyLate's files, written here as it writes them: its
    Dense module, its keys in config_sentence_transformers.json, "[Q] " and "[D] " added to
    the vocabulary) or "native" (sentence-transformers' MultiVectorEncoder, its markers as
    text prompts, query expansion to `query_length`, punctuation skipped in documents)."""
    import json
    import string

    import torch
    import transformers
    from safetensors.torch import save_file

    pylate = layout == "pylate"
    base = directory if pylate else directory.with_name(directory.name + "-base")
    _bert(base, {})
    tokenizer = transformers.AutoTokenizer.from_pretrained(base)
    if pylate:
        tokenizer.add_tokens(["[Q] ", "[D] "])
        model = transformers.BertModel.from_pretrained(base)
        model.resize_token_embeddings(len(tokenizer))
        model.eval().save_pretrained(base)
        tokenizer.save_pretrained(base)
    torch.manual_seed(1)
    hidden = SHAPE["hidden_size"]
    if not pylate:
        from sentence_transformers import MultiVectorEncoder
        from sentence_transformers.base.modules import Dense, Normalize, Transformer
        from sentence_transformers.multi_vector_encoder.modules import MultiVectorMask

        transformer = Transformer(str(base), document_length=document_length, query_expansion={
            "strategy": "fixed", "attend": False, "length": query_length})
        dense = Dense(hidden, dim, bias=False, activation_function=torch.nn.Identity(),
                      module_input_name="token_embeddings")
        MultiVectorEncoder(modules=[transformer, dense,
                                    MultiVectorMask(skiplist_words=list(string.punctuation)),
                                    Normalize(module_input_name="token_embeddings")],
                           prompts={"query": "[unused0] ", "document": "[unused1] "},
                           device="cpu").save(str(directory))
        return directory
    (directory / "1_Dense").mkdir()
    save_file({"linear.weight": torch.randn(dim, hidden) * 0.2}, directory / "1_Dense/model.safetensors")
    (directory / "1_Dense/config.json").write_text(json.dumps({
        "in_features": hidden, "out_features": dim, "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity"}))
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"}]))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128,
                                                                     "do_lower_case": False}))
    (directory / "config_sentence_transformers.json").write_text(json.dumps({
        "prompts": {}, "default_prompt_name": None, "similarity_fn_name": "MaxSim",
        "query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": query_length,
        "document_length": document_length, "attend_to_expansion_tokens": False,
        "skiplist_words": list(string.punctuation), "do_query_expansion": True}))
    return directory
