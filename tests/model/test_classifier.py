"""Our cross-encoder against transformers' sequence classifiers (eager attention) on small
random checkpoints of every family, on padded batches of (query, text) pairs as each
family's tokenizer makes them (BERT's with token types; Qwen3's padded on the left, its
pairs ending in the pad token, which its classifier skips): logits within 1e-5, and one
label's sigmoid within 1e-5 of sentence-transformers' CrossEncoder.predict at its own
defaults. The head's configuration is read from config.json; what is still refused is
refused by name."""

import pytest
import torch

from attnserve.model import CheckpointError, CrossEncoder, load_checkpoint
from tests.families import CLASSIFIER_FAMILIES, RERANKER_FAMILIES, make_reranker
from tests.model.test_checkpoint_families import edit_config

QUERY = "where does the cat sleep?"
TEXTS = ["Le chat dort sur le canapé pendant que la pluie tombe doucement.",
         "The quick brown fox jumps over the lazy dog. " * 3, "ok", "服务 A 调用了配置中心 B。"]
ATOL = 1e-5


def hf_classifier(directory):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(
        str(directory), attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.parametrize("family", RERANKER_FAMILIES + CLASSIFIER_FAMILIES)
@pytest.mark.parametrize("labels", [1, 3])
def test_logits_match_transformers_on_padded_pairs(tmp_path, family, labels):
    directory = make_reranker(family, tmp_path / family, num_labels=labels)
    ours = load_checkpoint(directory)
    assert isinstance(ours, CrossEncoder)
    assert ours.head.config.labels == tuple(f"label_{i}" for i in range(labels))
    assert ours.uses_token_types == (family == "bert")
    hf, tokenizer = hf_classifier(directory)
    batch = tokenizer([QUERY] * len(TEXTS), TEXTS, padding=True, return_tensors="pt")
    assert batch["attention_mask"].sum(1).min() < batch["attention_mask"].shape[1]  # padded
    with torch.no_grad():
        expected = hf(**batch).logits
        got = ours(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
    assert got.shape == (len(TEXTS), labels)
    assert (got - expected).abs().max() <= ATOL
    assert expected.std(0).min() > 1e-2  # the pairs score apart: the check can fail


def test_modernbert_mean_pooling_head(tmp_path):
    directory = make_reranker("modernbert", tmp_path / "mean", classifier_pooling="mean")
    ours = load_checkpoint(directory)
    assert ours.head.config.pooling == "mean" and ours.head.config.norm
    hf, tokenizer = hf_classifier(directory)
    batch = tokenizer([QUERY] * len(TEXTS), TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        diff = ours(batch["input_ids"], batch["attention_mask"]) - hf(**batch).logits
    assert diff.abs().max() <= ATOL


@pytest.mark.parametrize("family", ["bert", "xlm-roberta"])
def test_one_label_sigmoid_matches_sentence_transformers(tmp_path, family):
    from sentence_transformers import CrossEncoder as STCrossEncoder

    directory = make_reranker(family, tmp_path / family)
    reference = STCrossEncoder(str(directory), device="cpu")
    expected = torch.from_numpy(reference.predict([(QUERY, text) for text in TEXTS]))
    ours = load_checkpoint(directory)
    batch = reference.tokenizer([QUERY] * len(TEXTS), TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = ours(batch["input_ids"], batch["attention_mask"], batch.get("token_type_ids"))
    assert (torch.sigmoid(logits[:, 0]) - expected).abs().max() <= ATOL


def test_other_heads_are_still_refused(tmp_path):
    from transformers import BertConfig, BertForTokenClassification

    from tests.model.test_checkpoint_families import saved

    config = BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64)
    directory = saved(BertForTokenClassification(config), tmp_path / "tagger")
    with pytest.raises(CheckpointError, match=r"'BertForTokenClassification' is not served; for "
                                              r"model_type 'bert' attnserve exports BertModel, "
                                              r"BertForMaskedLM .* and BertForSequenceClassification "
                                              r"\(a reranker\)"):
        load_checkpoint(directory)
    reranker = make_reranker("bert", tmp_path / "both")
    edit_config(reranker, architectures=["BertForSequenceClassification", "BertForMaskedLM"])
    with pytest.raises(CheckpointError, match=r"name a classifier beside another head"):
        load_checkpoint(reranker)


def test_a_classifier_missing_its_head_is_refused_naming_the_tensor(tmp_path):
    """A base model's weights under a classifier's config.json: no head to load."""
    from tests.harness import make_tiny_checkpoint

    directory = make_tiny_checkpoint(tmp_path / "headless")
    edit_config(directory, architectures=["BertForSequenceClassification"])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor .* does not belong "
                                              r"to this model|missing tensor for head\."):
        load_checkpoint(directory)
