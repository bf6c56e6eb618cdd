"""The pieces the hostile-input promises stand on, checked against the real libraries, no
server:

- a request parsed a slice at a time is the request parsed whole, and one with too many
  entries or too large a nested message is refused before it is parsed;
- a text tokenized a prefix at a time gets exactly the tokens, ids and offsets of the
  whole text tokenized (and cut at the model's positions keeping [SEP]), and is refused
  exactly when the whole text is too long;
- the response sizes counted before inference are never under protobuf's own;
- the memory ledger refuses past its limit, past a connection's share, and after a call
  has ended, and gives everything back.
"""

import itertools

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.inference import grpc_service_pb2 as kpb
from attnserve.server.engine.tokenize import TextTokenizer, TooLong
from attnserve.server.errors import ResourceExhausted
from attnserve.server.grpc.encoder_pack import AttentionPlan, EmbedPlan, embed_response_bytes, tensor
from attnserve.server.grpc.wire import MAX_NESTED_BYTES, NestedTooLarge, TooManyEntries, decode_in_slices
from attnserve.server.memory.ledger import PER_CONNECTION_SHARE, Ledger
from tests.harness import minilm_dir

MIB = 1 << 20
BOUNDED = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Unlimited:
    """Holds that never refuse, and remember their peak."""

    def __init__(self):
        self.held = self.peak = 0

    def take(self, nbytes: float, what: str) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def give_back(self, nbytes: float) -> None:
        self.held -= nbytes


texts = st.lists(st.text(max_size=40_000), max_size=8)


@BOUNDED
@given(texts=texts, ids=st.lists(st.lists(st.integers(0, 2 ** 31 - 1), max_size=3000), max_size=30),
       heads=st.lists(st.integers(-5, 5), max_size=50))
def test_a_request_parsed_in_slices_is_the_request(texts, ids, heads):
    request = pb.EmbedRequest(texts=texts, token_ids=[pb.TokenIds(ids=i) for i in ids],
                              truncate=True, attention=pb.AttentionOptions(heads=heads))
    assert decode_in_slices(pb.EmbedRequest, request.SerializeToString(), 10 ** 6) == request


def test_a_model_infer_request_parsed_in_slices_is_the_request():
    request = kpb.ModelInferRequest(model_name="m", id="x" * 300_000)
    request.inputs.add(name="input_ids", datatype="INT64", shape=[2, 3],
                       contents=kpb.InferTensorContents(int64_contents=range(100_000)))
    request.raw_input_contents.append(b"\1" * 500_000)
    assert decode_in_slices(kpb.ModelInferRequest, request.SerializeToString(), 10) == request


def test_too_many_entries_or_too_large_a_nested_message_is_refused_unparsed():
    many = pb.EmbedRequest(texts=[""] * 100_001).SerializeToString()
    with pytest.raises(TooManyEntries, match="texts: more than 100000 entries"):
        decode_in_slices(pb.EmbedRequest, many, 100_000)
    large = pb.EmbedRequest(attention=pb.AttentionOptions(heads=[1] * (MAX_NESTED_BYTES + 1)))
    with pytest.raises(NestedTooLarge, match="attention: one entry of"):
        decode_in_slices(pb.EmbedRequest, large.SerializeToString(), 10)
    # A long string is not nested: it parses in one piece, fast.
    long_text = pb.EmbedRequest(texts=["a" * (3 * MIB)])
    assert decode_in_slices(pb.EmbedRequest, long_text.SerializeToString(), 10) == long_text
    with pytest.raises(DecodeError):
        decode_in_slices(pb.EmbedRequest, many[:-1] + b"\x0a\x05ab", 10 ** 6)


WORDS = ["hello", "world", "服务", "调用", "!!", "...", "a", "é", "naïve", "  ", "\n", "\t", "x" * 150,
         "don't", "[SEP]", "🧪", "\u3000", "a\u0300", "Straße", "ＡＢＣ", "\u200b", "3.14", "e-mail"]


def adversarial_texts(rng: np.random.Generator, positions: int) -> list[str]:
    def text(words: int) -> str:
        return "".join(WORDS[rng.integers(len(WORDS))] + ["", " ", ",", "  "][rng.integers(4)]
                       for _ in range(words))
    sizes = [0, 1, 3, 10, positions // 2, positions - 3, positions, positions * 2, positions * 20]
    return [text(int(rng.choice(sizes))) for _ in range(120)] + [
        "", " " * 10_000, "a" * 100_000, "!" * 50_000, "服" * 20_000, "word " * 5_000,
        "a" + " " * 6_000 + "b " * 2_000, "a " * (positions - 2), "a " * (positions - 1)]


@pytest.mark.parametrize("positions", [16, 128, 512])
def test_prefix_tokenizing_matches_tokenizing_the_whole_text(positions):
    path = minilm_dir() / "tokenizer.json"
    whole = Tokenizer.from_file(str(path))
    whole.no_padding()
    whole.no_truncation()
    cut = Tokenizer.from_file(str(path))
    cut.no_padding()
    cut.enable_truncation(positions)
    tokenizer = TextTokenizer(path, positions)
    batch = adversarial_texts(np.random.default_rng(positions), positions)
    holds = Unlimited()
    got = tokenizer.encode(batch, True, holds, details=True)
    for text, encoded in zip(batch, got, strict=True):
        full = whole.encode(text)
        too_long = len(full.ids) > positions
        want = cut.encode(text) if too_long else full
        assert (encoded.ids.tolist(), encoded.tokens, encoded.offsets) == (
            want.ids, want.tokens, want.offsets), (text[:60], len(text))
        if too_long:
            with pytest.raises(TooLong):
                tokenizer.encode([text], False, Unlimited())
        else:
            tokenizer.encode([text], False, Unlimited())
    assert holds.held > 0 and holds.peak >= holds.held  # what it keeps stays held


def test_response_sizes_are_never_under_protobufs_own():
    class Manifest:
        model_name, hidden_size, num_heads, vocab_size = "all-MiniLM-L6-v2", 384, 12, 30522
        embedding_size = hidden_size

    rng = np.random.default_rng(0)
    worst = 0.0
    for pooling, tokens, attention, dtype in itertools.product(
            [pb.POOLING_MEAN, pb.POOLING_NONE], [False, True],
            [None, AttentionPlan((0, 5), (1, 3), False), AttentionPlan((2,), None, True)],
            [np.float32, np.float16]):
        plan = EmbedPlan(pooling, True, tokens, dtype, attention)
        lengths = rng.integers(1, 200, size=7)
        response = pb.EmbedResponse(model=Manifest.model_name, total_tokens=int(lengths.sum()))
        for n in lengths.tolist():
            e = response.embeddings.add(token_ids=rng.integers(0, 30522, size=n).tolist(),
                                        num_tokens=n)
            if pooling != pb.POOLING_NONE:
                e.pooled.CopyFrom(tensor(np.ones(384), dtype))
            if tokens:
                e.token_embeddings.CopyFrom(tensor(np.ones((n, 384)), dtype))
            if attention:
                heads = attention.returned_heads(12)
                e.attentions.CopyFrom(tensor(np.ones((len(attention.layers), heads, n, n)), dtype))
        counted, real = embed_response_bytes(plan, lengths, Manifest, response.model), response.ByteSize()
        assert counted >= real, (plan, counted, real)
        worst = max(worst, (counted - real) / real)
    assert worst < 0.25  # ids counted at the largest; tensors exact


def test_the_ledger_keeps_its_limit_a_connections_share_and_gives_everything_back():
    ledger = Ledger(100 * MIB)
    share = PER_CONNECTION_SHARE * 100 * MIB
    first, second, other = ledger.holds("a"), ledger.holds("a"), ledger.holds("b")
    first.take(60 * MIB, "one call")  # one call may pass the share alone
    with pytest.raises(ResourceExhausted, match="other calls already hold 60.0 MiB"):
        second.take(1 * MIB, "another call")
    other.take(share, "another connection")
    with pytest.raises(ResourceExhausted, match="whole memory budget of 100 MiB"):
        ledger.holds("c").take(101 * MIB, "too much")
    with pytest.raises(ResourceExhausted, match="retry with backoff"):
        ledger.holds("c").take(20 * MIB, "busy")
    ledger.totals.batches = 10 * MIB  # a batch in flight is kept free
    with pytest.raises(ResourceExhausted, match="10 MiB is kept for batches"):
        ledger.holds("c").take(14 * MIB, "beside a batch")
    first.release()
    first.release()
    with pytest.raises(ResourceExhausted, match="the call has ended"):
        first.take(1, "after the end")
    second.take(1 * MIB, "now there is room")
    second.release()
    other.give_back(MIB)
    other.release()
    assert ledger.held == 0 and ledger.by_connection == {}
