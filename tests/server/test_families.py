"""The server on the families beside BERT: its tokenizer on each family's own kind of
tokenizer (special tokens from the post-processor, long texts in pieces, chunk cuts), and
each family's artifact through a real `attnserve serve` against transformers."""

import json
import re

import pytest

from attnserve.embed import token_texts
from attnserve.server.engine import tokenize
from attnserve.server.engine.chunking import cut
from attnserve.server.engine.tokenize import TextTokenizer
from tests.families import FAMILIES, make_checkpoint
from tests.hugging_face import HuggingFace
from tests.server.test_chunking import assert_covers
from tests.server.test_hostile_units import Unlimited

LONG_TEXT = ("Le chat dort.  The quick brown fox jumps over the lazy dog!\nDon't panic:\t3.5%\n\n"
             "服务 A 调用了配置中心 B。Быстрая лиса. ") * 40
SENTENCES = ("The quick brown fox jumps over the lazy dog. Le chat dort sur le canapé! "
             "Der schnelle braune Fuchs springt. Hello world, don't panic? "
             "Self-attention lets every token look at every other token.")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def hf(checkpoint):
    return HuggingFace(checkpoint)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return TextTokenizer(checkpoint / "tokenizer.json", 128)


def past_spaces(text: str, offsets) -> list[int]:
    """Each token's start past the whitespace it begins with (to its end for whitespace
    alone), written plainly."""
    starts = []
    for start, end in offsets:
        while start < end and text[start].isspace():
            start += 1
        starts.append(start)
    return starts


def test_special_tokens_come_from_the_tokenizer(tokenizer, hf):
    """<s> … </s> or [CLS] … [SEP]: the checkpoint's own, never BERT's assumed."""
    assert tokenizer.head_ids.tolist() == [hf.tokenizer.cls_token_id]
    assert tokenizer.tail_ids.tolist() == [hf.tokenizer.sep_token_id]
    (encoded,) = tokenizer.encode([SENTENCES], truncate=False, holds=Unlimited())
    assert encoded.ids.tolist() == hf.ids(SENTENCES)


def test_a_cut_text_keeps_the_closing_special_token(tokenizer, hf):
    (encoded,) = tokenizer.encode([LONG_TEXT], truncate=True, holds=Unlimited())
    full = hf.ids(LONG_TEXT)
    assert len(full) > 128
    assert encoded.ids.tolist() == full[:127] + [hf.tokenizer.sep_token_id]


def test_a_whole_text_tokenized_in_pieces_is_the_text_tokenized_at_once(tokenizer, monkeypatch):
    """Pieces of ~64 characters, so every kind of cut point the pre-tokenizer allows is
    used: the tokens are the whole text's, each start past the space it carries."""
    monkeypatch.setattr(tokenize, "PIECE_CHARS", 64)
    (tokens,) = tokenizer.encode_whole([LONG_TEXT], Unlimited())
    whole = tokenizer.whole.encode(LONG_TEXT, add_special_tokens=False)
    assert tokens.ids.tolist() == whole.ids
    assert tokens.ends.tolist() == [end for _, end in whole.offsets]
    assert tokens.starts.tolist() == past_spaces(LONG_TEXT, whole.offsets)


@pytest.mark.parametrize("pre_tokenizer", [
    {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": False}])
def test_pieces_are_cut_only_where_the_pre_tokenizer_allows(tmp_path, monkeypatch, pre_tokenizer):
    """A byte-level pre-tokenizer that adds a space before a text would add one before a
    piece starting with a newline; a metaspace one that does not split lets a token span
    a space. The tokens stay the whole text's."""
    base = "roberta" if pre_tokenizer["type"] == "ByteLevel" else "xlm-roberta"
    described = json.loads((make_checkpoint(base, tmp_path / base) / "tokenizer.json").read_text())
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(described | {"pre_tokenizer": pre_tokenizer}))
    variant = TextTokenizer(path, 128)
    monkeypatch.setattr(tokenize, "PIECE_CHARS", 64)
    (tokens,) = variant.encode_whole([LONG_TEXT], Unlimited())
    whole = variant.whole.encode(LONG_TEXT, add_special_tokens=False)
    assert tokens.ids.tolist() == whole.ids


def test_chunks_end_on_sentences(tokenizer):
    (tokens,) = tokenizer.encode_whole([SENTENCES], Unlimited())
    sentences = re.findall(r"[^.!?]+[.!?]", SENTENCES)
    longest = max(len(tokenizer.whole.encode(s.strip(), add_special_tokens=False).ids)
                  for s in sentences)
    chunks = cut(SENTENCES, tokens, longest + 2)
    texts = [SENTENCES[start:end] for start, end in chunks.spans.tolist()]
    assert len(texts) > 1 and "".join(texts).replace(" ", "") == SENTENCES.replace(" ", "")
    for text in texts:
        assert text == text.strip() and text[-1] in ".!?", texts


@pytest.mark.parametrize("max_tokens", [6, 9])
def test_chunks_of_spaceless_text_are_cut_between_characters(tokenizer, max_tokens):
    """Characters the tokenizer never saw are byte-level tokens of their UTF-8 bytes (up
    to four), all placed on the whole character; a metaspace word runs to the next space.
    Cuts fall between characters all the same."""
    text = "鬱調用了配置中心。它很快。服务 A 调用了配置中心 B，因为它需要获取最新配置。"
    (tokens,) = tokenizer.encode_whole([text], Unlimited())
    chunks = cut(text, tokens, max_tokens)
    assert_covers(text, tokens, chunks, max_tokens)
    inner = chunks.bounds[1:-1]
    assert (tokens.starts[inner] >= tokens.ends[inner - 1]).all()


def test_heatmap_labels_are_the_text_each_token_covers(tokenizer, hf):
    text = "Hello world, don't panic!"
    encoding = tokenizer.tokenizer.encode(text)
    offsets = [x for pair in encoding.offsets for x in pair]
    labels = token_texts(text, encoding.tokens, offsets)
    assert labels[0] == hf.tokenizer.cls_token and labels[-1] == hf.tokenizer.sep_token
    assert all(label in text or label == "␣" for label in labels[1:-1]), labels
    assert "".join(labels[1:-1]).replace("␣", "") == text.replace(" ", "")
