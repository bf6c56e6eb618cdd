"""Chunk boundaries, windows and span pooling (server/engine/chunk_cuts.py, chunked.py), on
the real tokenizer, no server: chunks cover the text in order with only whitespace
between them, end where the text's sentences and words end, and each lies whole in the
window that gives it the most context; a whole text tokenized in pieces is the text
tokenized at once."""

import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server.engine.batch_loop import span_means
from attnserve.server.engine.chunk_cuts import best_windows, cut, default_overlap, windows
from attnserve.server.engine.chunked import TextPlan
from attnserve.server.engine.requests import Chunking
from attnserve.server.engine.tokenize import TextTokenizer
from attnserve.server.grpc.encoder_pack import EmbedPlan, chunked_response_bytes, tensor
from tests.harness import minilm_dir
from tests.server.test_hostile_units import Unlimited

BOUNDED = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
WIDTH = 510


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return TextTokenizer(minilm_dir() / "tokenizer.json", 512)


def chunked(tokenizer: TextTokenizer, text: str, max_tokens: int):
    (tokens,) = tokenizer.encode_whole([text], Unlimited())
    return tokens, cut(text, tokens, max_tokens)


def chunk_texts(text: str, spans: np.ndarray) -> list[str]:
    return [text[start:end] for start, end in spans.tolist()]


def assert_covers(text: str, tokens, chunks, max_tokens: int) -> None:
    """In order, whitespace between, nothing else left out, each chunk's tokens inside it;
    a text without tokens (nothing but whitespace and what the tokenizer drops) has no
    chunks."""
    spans = chunks.spans
    if not len(tokens.ids):
        assert chunks.count == 0 and spans.shape == (0, 2)
        return
    assert chunks.count == len(spans) and int(chunks.token_counts.sum()) == len(tokens.ids)
    assert chunks.token_counts.min(initial=1) >= 1 and chunks.token_counts.max(initial=0) <= max_tokens
    edges = [0, *spans.reshape(-1).tolist(), len(text)]
    for gap_start, gap_end in zip(edges[::2], edges[1::2], strict=True):
        assert gap_start <= gap_end and not text[gap_start:gap_end].strip()
    for piece in chunk_texts(text, spans):
        assert piece and piece == piece.strip()
    for i, (start, end) in enumerate(spans.tolist()):
        first, last = chunks.bounds[i], chunks.bounds[i + 1]
        assert start <= tokens.starts[first] and tokens.ends[last - 1] <= end


def test_chunks_end_on_sentences_where_they_fit_else_on_words(tokenizer):
    text = ("Berlin is the capital of Germany. It has 3.8 million people, e.g. many students. "
            "The city is also a state! A rather long sentence follows here, one with far too "
            "many words to fit into a single chunk of this size.\n\nA new paragraph")
    tokens, chunks = chunked(tokenizer, text, 16)
    assert_covers(text, tokens, chunks, 16)
    assert chunk_texts(text, chunks.spans) == [
        "Berlin is the capital of Germany.",  # the next sentence would not fit beside it
        "It has 3.8 million people, e.g. many students.",  # not cut after "e.g."
        "The city is also a state!",
        "A rather long sentence follows here, one with far too many words to fit into",
        "a single chunk of this size.\n\nA new paragraph"]  # the rest fits in one
    _, longer = chunked(tokenizer, text, 40)
    assert chunk_texts(text, longer.spans) == [
        "Berlin is the capital of Germany. It has 3.8 million people, e.g. many students. "
        "The city is also a state!", text[text.index("A rather"):]]


def test_chinese_and_mixed_text_is_cut_between_characters_and_at_its_full_stops(tokenizer):
    text = "服务 A 调用了配置中心 B，因为它需要获取最新配置。它很快。Mixed English 和中文。"
    tokens, chunks = chunked(tokenizer, text, 14)
    assert_covers(text, tokens, chunks, 14)
    assert chunk_texts(text, chunks.spans) == [
        "服务 A 调用了配置中心 B，因为", "它需要获取最新配置。它很快。", "Mixed English 和中文。"]


def test_a_word_longer_than_a_chunk_is_cut_between_its_pieces(tokenizer):
    text = "short words then " + "pneumonoultramicroscopicsilicovolcanoconiosis" * 2 + " end"
    tokens, chunks = chunked(tokenizer, text, 6)
    assert_covers(text, tokens, chunks, 6)
    assert not tokens.word_starts[chunks.bounds[1:-1]].all()


ALPHABET = st.sampled_from(list("ab Zé.!?,'\"")
                           + ["\n", "\n\n", "\t", "\x00", "\u200b", "。", "，", "服", "务", "😀",
                              "e.g. ", "don't", "Word", "pneumonoultramicroscopic"])


@BOUNDED
@given(parts=st.lists(ALPHABET, max_size=400), max_tokens=st.integers(1, 20))
def test_chunks_cover_any_text_in_order_with_only_whitespace_between(tokenizer, parts, max_tokens):
    text = "".join(parts)
    tokens, chunks = chunked(tokenizer, text, max_tokens)
    whole = tokenizer.whole.encode(text, add_special_tokens=False)
    assert tokens.ids.tolist() == whole.ids
    assert np.column_stack((tokens.starts, tokens.ends)).tolist() == [list(o) for o in whole.offsets]
    assert_covers(text, tokens, chunks, max_tokens)


def test_a_whole_text_tokenized_in_pieces_is_the_text_tokenized_at_once(tokenizer):
    text = ("Ein Satz, with äccents and 中文字符 mixed in; a URL https://example.com/a_b?c=d "
            "and numbers 3.14159. ") * 3000
    (tokens,) = tokenizer.encode_whole([text], Unlimited())
    whole = tokenizer.whole.encode(text, add_special_tokens=False)
    assert len(text) > 4 * 16384 and tokens.ids.tolist() == whole.ids
    assert tokens.starts.tolist() == [start for start, _ in whole.offsets]
    assert tokens.ends.tolist() == [end for _, end in whole.offsets]


@pytest.mark.parametrize("text", ["." * (1 << 19), "!? " * 175_000, "\n" + " " * (1 << 19) + "\n",
                                  "a" * (1 << 19), ". A" * 175_000])
def test_cutting_hostile_text_stays_linear(tokenizer, text):
    (tokens,) = tokenizer.encode_whole([text], Unlimited())
    started = time.perf_counter()
    chunks = cut(text, tokens, 128)
    assert time.perf_counter() - started < 1.0
    assert int(chunks.token_counts.sum()) == len(tokens.ids)


@pytest.mark.parametrize("n, max_tokens, overlap", [(3000, 48, 0), (1200, 1, 0), (5000, 255, 0),
                                                    (2000, 100, 99), (2000, 5, 400), (300, 20, 0),
                                                    (1021, 510, 509)])
def test_every_chunk_is_pooled_from_the_window_giving_it_the_most_context(n, max_tokens, overlap):
    overlap = overlap or default_overlap(max_tokens, WIDTH)
    starts, ends = windows(n, WIDTH, overlap)
    assert starts[0] == 0 and ends[-1] == n and (ends - starts).max() <= WIDTH
    assert (starts[1:] - starts[:-1] == WIDTH - overlap).all()
    rng = np.random.default_rng(n)
    bounds = np.unique(np.concatenate(([0, n], np.arange(0, n, max_tokens),
                                       rng.integers(0, n, n // (2 * max_tokens) + 1))))
    best = best_windows(bounds, starts, ends)
    for i, k in enumerate(best.tolist()):
        first, last = int(bounds[i]), int(bounds[i + 1])
        holding = [j for j in range(len(starts)) if starts[j] <= first and last <= ends[j]]
        # The most context on the poorer side, then in all, then the earliest window.
        context = {j: (min(first - starts[j], ends[j] - last), ends[j] - starts[j] - (last - first), -j)
                   for j in holding}
        assert k == max(holding, key=context.__getitem__)


def test_the_default_overlap_gives_context_and_never_costs_more_than_twice_the_text():
    assert default_overlap(64, WIDTH) == 191 and default_overlap(128, WIDTH) == 255
    assert default_overlap(8, WIDTH) == 135 and default_overlap(400, WIDTH) == 399
    starts, ends = windows(20_000, WIDTH, default_overlap(128, WIDTH))
    assert (ends - starts).sum() <= 2 * 20_000 + WIDTH
    bounds = np.arange(0, 20_001, 100)
    best = best_windows(bounds, starts, ends)
    inner = (bounds[:-1] >= 64) & (bounds[1:] <= 20_000 - 64)
    left, right = bounds[:-1] - starts[best], ends[best] - bounds[1:]
    assert np.minimum(left, right)[inner].min() >= 64


def test_late_plan_spans_pool_each_chunk_once_in_text_order(tokenizer):
    text = "Alpha beta gamma delta. " * 400
    tokens, chunks = chunked(tokenizer, text, 30)
    plan = TextPlan.late(tokens, chunks, WIDTH, default_overlap(30, WIDTH))
    sequences = plan.sequences(tokenizer.head_ids, tokenizer.tail_ids)
    assert [len(s) for s in sequences] == plan.lengths(2).tolist() and max(map(len, sequences)) <= 512
    rng = np.random.default_rng(0)
    hidden = [rng.standard_normal((len(s), 4)).astype(np.float32) for s in sequences]
    results = [type("R", (), {"span_means": span_means(h, spans)})
               for h, spans in zip(hidden, plan.spans(1), strict=True)]
    vectors = plan.vectors(results, "", normalize=False, hidden=4)
    for i in range(chunks.count):
        k = next(j for j, group in enumerate(plan.pooled_from) if i in group)
        first = chunks.bounds[i] - plan.windows[k, 0] + 1
        count = chunks.token_counts[i]
        assert (sequences[k][first:first + count] == tokens.ids[chunks.bounds[i]:chunks.bounds[i + 1]]).all()
        np.testing.assert_allclose(vectors[i], hidden[k][first:first + count].mean(0), atol=1e-6)


def test_chunked_response_sizes_are_never_under_protobufs_own():
    for dtype in (np.float32, np.float16):
        plan = EmbedPlan(pb.POOLING_MEAN, True, False, dtype, None, Chunking(8))
        counts = np.asarray([0, 1, 7, 300])
        response = pb.EmbedResponse(model="all-MiniLM-L6-v2", total_tokens=2 ** 40)
        for n in counts.tolist():
            e = response.embeddings.add(num_tokens=2 ** 31 - 1)
            for _ in range(n):
                e.chunks.add(start=2 ** 32 - 1, end=2 ** 32 - 1, num_tokens=2 ** 32 - 1,
                             pooled=tensor(np.ones(384), dtype))
        counted = chunked_response_bytes(plan, counts, type("M", (), {"hidden_size": 384}),
                                         response.model)
        assert response.ByteSize() <= counted <= 1.05 * response.ByteSize()
