"""The server on the families beside BERT: its tokenizer on each family's own kind of
tokenizer (special tokens from the post-processor, long texts in pieces, chunk cuts), and
each family's artifact through a real `attnserve serve` against transformers."""

import json
import re
import subprocess

import numpy as np
import pytest

from attnserve.client import EncoderClient
from attnserve.embed import token_texts
from attnserve.server.engine import tokenize
from attnserve.server.engine.chunk_cuts import cut
from attnserve.server.engine.tokenize import TextTokenizer
from tests.conftest import FAMILY_EXPORT_FLAGS, export
from tests.families import FAMILIES, make_checkpoint
from tests.harness import ATTNSERVE, REPO, ServerProcess
from tests.hugging_face import HuggingFace
from tests.server.test_chunking import assert_covers
from tests.server.test_hostile_units import Unlimited

LONG_TEXT = ("Le chat dort.  The quick brown fox jumps over the lazy dog!\nDon't panic:\t3.5%\n\n"
             "服务 A 调用了配置中心 B。Быстрая лиса. ") * 40
SENTENCES = ("The quick brown fox jumps over the lazy dog. Le chat dort sur le canapé! "
             "Der schnelle braune Fuchs springt. Hello world, don't panic? "
             "Self-attention lets every token look at every other token.")


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, family_checkpoint):
    return family_checkpoint(request.param)


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


# --- served ------------------------------------------------------------------------------

SERVED_ATOL = 1e-4
TEXTS = ["Hello world, don't panic!", "ok",
         "Le chat dort sur le canapé pendant que la pluie tombe doucement, et le chien aussi.",
         "服务 A 调用了配置中心 B。", "The quick brown fox jumps over the lazy dog. " * 3]
WIDTH = 126  # the tiny models' 128 positions less their two special tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory, checkpoint):
    artifact = export(tmp_path_factory.mktemp("artifact"), checkpoint, *FAMILY_EXPORT_FLAGS)
    with ServerProcess(artifact) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    with EncoderClient(server.address) as c:
        yield c


def mean_of(hf: HuggingFace, ids: list[int]) -> np.ndarray:
    return hf.run(ids)[0].mean(axis=0)


def test_texts_are_served_as_transformers_embeds_them(client, hf):
    """One request of mixed lengths (padded together, ModernBERT's longest past its window
    beside its shortest): token embeddings, maps and mean-pooled vectors of each text."""
    results = client.embed(TEXTS, pooling="mean", token_embeddings=True, attention_layers=[])
    for text, result in zip(TEXTS, results, strict=True):
        ids = hf.ids(text)
        assert result.token_ids == ids
        hidden, maps = hf.run(ids)
        assert np.abs(result.token_embeddings - hidden).max() <= SERVED_ATOL
        assert np.abs(result.attentions - maps).max() <= SERVED_ATOL
        assert np.abs(result.pooled - hidden.mean(axis=0)).max() <= SERVED_ATOL


def test_the_server_says_which_family_it_serves(client, checkpoint):
    family = json.loads((checkpoint / "config.json").read_text())["model_type"]
    assert client.model_info().family == family


def test_token_ids_are_served_as_transformers_embeds_them(client, hf):
    """Ids as a caller sends them (special tokens included), random ones beside the
    tokenizer's; the first token's vector is what `cls` pooling returns."""
    rng = np.random.default_rng(0)
    sequences = [hf.ids(TEXTS[0]), rng.integers(0, len(hf.tokenizer), 90).tolist(), hf.ids("ok")]
    results = client.embed(token_ids=sequences, token_embeddings=True, pooling="mean")
    cls = client.embed(token_ids=sequences, pooling="cls")
    for ids, result, first in zip(sequences, results, cls, strict=True):
        hidden, _ = hf.run(ids)
        assert np.abs(result.token_embeddings - hidden).max() <= SERVED_ATOL
        assert np.abs(result.pooled - hidden.mean(axis=0)).max() <= SERVED_ATOL
        assert np.abs(first.pooled - hidden[0]).max() <= SERVED_ATOL


def test_tokenize_and_truncation_use_the_checkpoints_special_tokens(client, hf):
    (tokenized,) = client.tokenize([TEXTS[0]])
    assert list(tokenized.ids) == hf.ids(TEXTS[0])
    assert tokenized.tokens[0] == hf.tokenizer.cls_token and tokenized.tokens[-1] == hf.tokenizer.sep_token
    (cut_short,) = client.embed([LONG_TEXT], truncate=True, token_embeddings=True)
    assert cut_short.token_ids == hf.ids(LONG_TEXT)[:127] + [hf.tokenizer.sep_token_id]


def late_reference(hf: HuggingFace, ids: list[int], counts: list[int], overlap: int) -> np.ndarray:
    """Each chunk's mean token embedding from transformers, run on the windows the API
    documents (WIDTH tokens between the checkpoint's special tokens, each starting
    WIDTH - overlap after the one before, the last ending with the text), a chunk pooled
    from the window holding it with the most context on its poorer side, then in all,
    then the earliest. Chunks are consecutive: their token counts place them."""
    starts = [0]
    while starts[-1] + WIDTH < len(ids):
        starts.append(starts[-1] + WIDTH - overlap)
    windows = [(start, min(start + WIDTH, len(ids))) for start in starts]
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    head, tail = hf.tokenizer.cls_token_id, hf.tokenizer.sep_token_id
    vectors = []
    for first, last in zip(bounds[:-1], bounds[1:], strict=True):
        holding = [k for k, (a, b) in enumerate(windows) if a <= first and last <= b]
        k = max(holding, key=lambda k: (min(first - windows[k][0], windows[k][1] - last),
                                        windows[k][1] - windows[k][0] - (last - first), -k))
        a, b = windows[k]
        hidden, _ = hf.run([head, *ids[a:b], tail])
        vectors.append(hidden[1 + first - a:1 + last - a].mean(axis=0))
    return np.stack(vectors)


def test_late_chunks_are_transformers_means_over_each_chunk(client, hf):
    text = " ".join([SENTENCES] * 3)
    ids = hf.tokenizer(text, add_special_tokens=False)["input_ids"]
    max_tokens = 20
    (result,) = client.embed([text], chunk_tokens=max_tokens, window_overlap=max_tokens - 1)
    assert result.num_tokens == len(ids) > 2 * WIDTH
    counts = [c.num_tokens for c in result.chunks]
    assert sum(counts) == len(ids) and max(counts) <= max_tokens
    for chunk in result.chunks:
        assert text[chunk.start:chunk.end] == text[chunk.start:chunk.end].strip()
    expected = late_reference(hf, ids, counts, max_tokens - 1)
    got = np.stack([c.pooled for c in result.chunks])
    assert np.abs(got - expected).max() <= SERVED_ATOL


def test_the_embed_command_draws_a_heatmap_labelled_with_the_text(server, tmp_path):
    png = tmp_path / "map.png"
    drawn = subprocess.run([*ATTNSERVE, "embed", "Hello world, don't panic!", "--address",
                            server.address, "--heatmap", str(png)],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 0, drawn.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
