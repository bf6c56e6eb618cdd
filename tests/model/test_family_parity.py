"""Our encoder against transformers (eager attention) on small random checkpoints of each
family served beside BERT, on padded batches of the family's own tokenization (Qwen3's
padded on the left, as its tokenizer pads) and padded on the other side too: hidden
states, attention maps, the pooler and mean pooling. The texts reach past ModernBERT's
16-token window and Gemma3's 8 tokens on either side, beside one shorter than either, so
local layers see the window and the padding together."""

import pytest
import torch

from attnserve.model import load_checkpoint
from tests.families import ALL_FAMILIES, GEMMA3_WINDOW, MODERNBERT_WINDOW, make_checkpoint
from tests.hugging_face import HuggingFace

TEXTS = [
    "Hello world, don't panic!",
    "Le chat dort sur le canapé pendant que la pluie tombe doucement, et le chien aussi.",
    "服务 A 调用了配置中心 B。",
    "ok",
    "The quick brown fox jumps over the lazy dog. " * 3,
]
HIDDEN_ATOL = 1e-5
MAPS_ATOL = 1e-6


@pytest.fixture(scope="module", params=ALL_FAMILIES)
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hf(checkpoint):
    return HuggingFace(checkpoint)


@pytest.fixture(scope="module")
def batch(hf):
    return hf.tokenizer(TEXTS, padding=True, return_tensors="pt")


@pytest.fixture(scope="module")
def expected(hf, batch):
    with torch.no_grad():
        return hf.model(**batch, output_attentions=True)


@pytest.fixture(scope="module")
def ours(checkpoint, batch):
    encoder = load_checkpoint(checkpoint)
    with torch.no_grad():
        return encoder(batch["input_ids"], batch["attention_mask"], output_attentions=True)


def test_the_batch_is_padded_with_the_checkpoints_pad_id(hf, batch):
    mask = batch["attention_mask"]
    assert (mask == 0).any()
    assert (batch["input_ids"][mask == 0] == hf.model.config.pad_token_id).all()


def test_hidden_states_match_transformers(batch, expected, ours):
    real = batch["attention_mask"].bool()
    assert (ours.last_hidden_state - expected.last_hidden_state)[real].abs().max() <= HIDDEN_ATOL


def test_attention_maps_match_transformers(batch, expected, ours):
    assert len(ours.attentions) == len(expected.attentions)
    for got, want in zip(ours.attentions, expected.attentions, strict=True):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= MAPS_ATOL


def test_the_texts_cross_the_windows(batch):
    lengths = batch["attention_mask"].sum(1)
    for window in (MODERNBERT_WINDOW, GEMMA3_WINDOW):  # window // 2 on either side
        assert lengths.max() > window + 1 and lengths.min() < window // 2


def test_pooler_and_mean_pooling_match_transformers(hf, batch, expected, ours):
    if expected.get("pooler_output") is None:  # ModernBERT, DistilBERT, the decoders
        assert ours.pooler_output is None
    else:
        assert (ours.pooler_output - expected.pooler_output).abs().max() <= HIDDEN_ATOL
    mask = batch["attention_mask"][..., None].float()
    mean = (ours.last_hidden_state * mask).sum(1) / mask.sum(1)
    want = (expected.last_hidden_state * mask).sum(1) / mask.sum(1)
    assert (mean - want).abs().max() <= HIDDEN_ATOL


def test_padding_on_the_other_side_matches_transformers(checkpoint, hf):
    """The same texts padded on the side the tokenizer does not pad on: left for the
    encoders, right for Qwen3 (the server pads on the right)."""
    side = "right" if hf.tokenizer.padding_side == "left" else "left"
    other = hf.tokenizer(TEXTS, padding=True, padding_side=side, return_tensors="pt")
    real = other["attention_mask"].bool()
    assert not real[:, 0 if side == "left" else -1].all()
    with torch.no_grad():
        want = hf.model(**other).last_hidden_state
        got = load_checkpoint(checkpoint)(other["input_ids"], other["attention_mask"]).last_hidden_state
    assert (got - want)[real].abs().max() <= HIDDEN_ATOL


def test_a_padded_row_matches_transformers_on_the_row_alone(checkpoint, hf, batch, ours):
    """Positions count only the real tokens: the shortest text, padded to the longest,
    against transformers given it unpadded."""
    row = int(batch["attention_mask"].sum(1).argmin())
    real = batch["attention_mask"][row].bool()
    hidden, _ = hf.run(batch["input_ids"][row, real].tolist())
    assert (ours.last_hidden_state[row, real] - torch.from_numpy(hidden)).abs().max() <= HIDDEN_ATOL


def test_the_longest_sequence_matches_transformers(checkpoint, hf):
    encoder = load_checkpoint(checkpoint)
    longest = encoder.config.max_positions
    assert longest == 128
    ids = torch.randint(3, encoder.config.vocab_size, (1, longest))
    with torch.no_grad():
        got = encoder(ids).last_hidden_state
        want = hf.model(ids).last_hidden_state
    assert (got - want).abs().max() <= HIDDEN_ATOL
