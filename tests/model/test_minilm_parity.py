"""Our encoder on all-MiniLM-L6-v2 against Hugging Face's BertModel and sentence-transformers."""

import os

import pytest
import torch

from attnserve.model import load_checkpoint
from attnserve.model.checkpoint import default_checkpoint_dir

SENTENCES = [
    "服务 A 调用了配置中心 B，因为它需要获取最新配置。",
    "Self-attention lets every token decide how much every other token matters.",
    "hi",
    "The quick brown fox jumps over the lazy dog, then runs back across the field "
    "to see whether the dog has noticed anything at all.",
]


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoTokenizer, BertModel

    directory = str(default_checkpoint_dir())
    tokenizer = AutoTokenizer.from_pretrained(directory)
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    hf = BertModel.from_pretrained(directory, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = hf(**batch, output_attentions=True)
    return batch, expected


@pytest.fixture(scope="module")
def ours(reference):
    batch, _ = reference
    encoder = load_checkpoint()
    with torch.no_grad():
        return encoder(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"],
                       output_attentions=True)


def test_last_hidden_state_matches_hugging_face(reference, ours):
    batch, expected = reference
    real = batch["attention_mask"].bool()
    assert (ours.last_hidden_state - expected.last_hidden_state)[real].abs().max() <= 1e-5


def test_attentions_match_hugging_face(reference, ours):
    _, expected = reference
    assert len(ours.attentions) == 6
    for got, want in zip(ours.attentions, expected.attentions, strict=True):
        assert got.shape == want.shape == (4, 12, got.shape[-1], got.shape[-1])
        assert (got - want).abs().max() <= 1e-6


def test_pooled_embeddings_match_sentence_transformers(reference, ours):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from sentence_transformers import SentenceTransformer

    batch, _ = reference
    assert batch["input_ids"].shape[1] < 256  # sentence-transformers cuts this model at 256
    st = SentenceTransformer(str(default_checkpoint_dir()), device="cpu")
    expected = torch.from_numpy(st.encode(SENTENCES, normalize_embeddings=True))
    mask = batch["attention_mask"][..., None].float()
    mean = (ours.last_hidden_state * mask).sum(1) / mask.sum(1)
    pooled = torch.nn.functional.normalize(mean, dim=-1)
    cosine = (pooled * expected).sum(-1)
    assert cosine.min() >= 0.99999
