"""Promise: no request, however it is shaped, stalls the server or takes memory
past its budget, and no answer is promised that the transport will not carry.

- A long text, a million tiny sequences, the most sequences a request may carry: health
  checks with a 250 ms deadline all succeed while each is parsed, tokenized or run (the
  event loop never waits on work proportional to a request's size).
- Cheap limits first: a request with more entries than the queue holds tokens is refused
  by its count, before any of it is parsed or converted, and no batch runs for it.
- Tokenizing is inside the memory budget: a text too costly to tokenize is refused, and
  the memory a big text took is given back.
- The response-size check counts what the wire carries (echoed ids, tokens, offsets, the
  request id, tags and length prefixes): the largest response it passes is sent, one more
  sequence is refused before inference with the server's own message, never counted OK.
- One more round: two million empty Tokenize texts, a million attention heads, a nested
  list of 3 MiB, a flood of metadata.
"""

import time

import grpc
import numpy as np
import pytest
from tokenizers import Tokenizer

from attnserve.artifact import TOKENIZER, load_artifact
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.inference import grpc_service_pb2_grpc as kpb_grpc
from attnserve.server.grpc.encoder import plan_embed
from attnserve.server.grpc.encoder_pack import embed_response_bytes
from tests.harness import delta
from tests.server.reliability import (
    BIG,
    MIB,
    HealthProbe,
    Peak,
    Reference,
    embed_ids,
    health,
    ids_of,
    infer_request,
    serve,
    stub,
    wait_for,
)

# Also run against a server of several processes (make test: --server-workers 2).
pytestmark = pytest.mark.workers

FOUR_MIB_TEXT = "word " * 838_861
SIXTEEN_MIB_TEXT = "word " * 3_355_443
MAX_QUEUE_TOKENS = 262144  # the server's default


def rpc_error(call, request, timeout: float = 120) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call(request, timeout=timeout)
    return refused.value


@pytest.fixture(scope="module")
def server(tiny_artifact):
    process = serve(tiny_artifact)
    yield process
    assert "Traceback" not in process.output(), process.output()[-3000:]
    assert process.stop() == 0


@pytest.fixture(scope="module")
def channel(server):
    with grpc.insecure_channel(server.address, options=BIG) as channel:
        yield channel


def test_long_texts_never_stall_the_event_loop(server, channel, tiny_artifact):
    """A 4 MiB text (which, tokenized whole with `encode`, would hold the interpreter for
    seconds), a 16 MiB text, and a 1 MiB word with nowhere to cut it."""
    encoder = stub(channel)
    reference = Tokenizer.from_file(str(tiny_artifact / TOKENIZER))
    reference.no_padding()
    reference.enable_truncation(128)
    took = {}
    with HealthProbe(server.address) as probe:
        started = time.monotonic()
        cut = encoder.Embed(pb.EmbedRequest(texts=[FOUR_MIB_TEXT], truncate=True), timeout=120)
        took["4 MiB text, truncate"] = time.monotonic() - started
        started = time.monotonic()
        refused = rpc_error(encoder.Tokenize, pb.TokenizeRequest(texts=[SIXTEEN_MIB_TEXT]))
        took["16 MiB text, no truncate"] = time.monotonic() - started
        started = time.monotonic()
        word = encoder.Tokenize(pb.TokenizeRequest(texts=["a" * MIB]), timeout=120)
        took["1 MiB word"] = time.monotonic() - started
    assert list(cut.embeddings[0].token_ids) == reference.encode(FOUR_MIB_TEXT[:4096]).ids
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "longer than the model's 128 positions" in refused.details()
    assert word.tokenizations[0].tokens == ["[CLS]", "[UNK]", "[SEP]"]
    assert word.tokenizations[0].offsets == [0, 0, 0, MIB, 0, 0]
    assert probe.failed == [] and probe.ok >= 3, str(probe)
    print(f"\nlong texts: {', '.join(f'{k} {v:.2f}s' for k, v in took.items())}; {probe}")


def test_a_million_tiny_sequences_are_refused_by_their_count(server, channel):
    """1,000,000 sequences of 3 ids (8 MB): refused after 5.0 s with health blocked 4.9 s
    (every sequence converted on the event loop before the limits refused it)."""
    request = pb.EmbedRequest(token_ids=[pb.TokenIds(ids=[101, 2000, 102])] * 1_000_000)
    before = server.scrape()
    with HealthProbe(server.address) as probe:
        started = time.monotonic()
        refused = rpc_error(stub(channel).Embed, request)
        took = time.monotonic() - started
    after = server.scrape()
    assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"token_ids: more than {MAX_QUEUE_TOKENS} entries" in refused.details()
    assert delta(before, after, "attnserve_batch_size_count") == 0
    assert delta(before, after, "attnserve_requests_total", rpc="Embed",
                 code="RESOURCE_EXHAUSTED") == 1
    assert probe.failed == [], str(probe)
    print(f"\na million sequences: refused in {took * 1000:.0f} ms; {probe}")


def test_the_most_sequences_a_request_may_carry_are_served_without_a_stall(server, channel):
    """87,381 sequences of 3 ids: just under the queue's 262,144 tokens, each queued,
    batched and answered while health checks keep their deadline."""
    count = MAX_QUEUE_TOKENS // 3
    rng = np.random.default_rng(14)
    middles = rng.integers(1000, 30000, size=count)
    request = pb.EmbedRequest(token_ids=[pb.TokenIds(ids=[101, int(m), 102]) for m in middles],
                              pooling=pb.POOLING_NONE)
    with HealthProbe(server.address) as probe:
        started = time.monotonic()
        response = stub(channel).Embed(request, timeout=600)
        took = time.monotonic() - started
    assert len(response.embeddings) == count and response.total_tokens == 3 * count
    assert [e.token_ids[1] for e in response.embeddings[:5]] == middles[:5].tolist()
    assert probe.failed == [] and probe.ok >= 3, str(probe)
    print(f"\n{count} sequences: answered in {took:.1f}s; {probe}")


def test_tokenizing_is_inside_the_memory_budget_and_given_back(tiny_artifact):
    """--memory-budget-bytes 256 MiB: a 16 MiB text (peak 2,783 MiB, 1,885 MiB still held
    afterwards, with a 1 GiB budget) is refused in full within the budget, a text too
    costly to tokenize (4 MiB with nowhere to cut) is refused before it is tokenized,
    and afterwards the process is back within 64 MiB of where it started."""
    budget = 256 * MIB
    process = serve(tiny_artifact, "--memory-budget-bytes", str(budget))
    try:
        baseline = process.status()["rss"]
        peak = Peak(process)
        with grpc.insecure_channel(process.address, options=BIG) as channel:
            encoder = stub(channel)
            long = rpc_error(encoder.Tokenize, pb.TokenizeRequest(texts=[SIXTEEN_MIB_TEXT]))
            costly = rpc_error(encoder.Tokenize, pb.TokenizeRequest(texts=["a" * (4 * MIB)]))
            # Still serving texts in between.
            ok = encoder.Tokenize(pb.TokenizeRequest(texts=["word " * 2000] * 64, truncate=True),
                                  timeout=60)
        highest = peak.close()
        settled = wait_for(lambda: process.status()["rss"] - baseline <= 64 * MIB, timeout=10)
        after = process.status()["rss"]
    finally:
        assert process.stop() == 0
    assert long.code() == grpc.StatusCode.INVALID_ARGUMENT and "longer than" in long.details()
    assert costly.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "tokenizing" in costly.details() and "memory budget of 256 MiB" in costly.details()
    assert len(ok.tokenizations) == 64 and len(ok.tokenizations[0].ids) == 128
    assert highest - baseline <= budget, (highest - baseline) / MIB
    assert settled, (after - baseline) / MIB
    print(f"\ntokenizing: peak {(highest - baseline) / MIB:.0f} MiB over the idle "
          f"{baseline / MIB:.0f} MiB (budget 256 MiB), {(after - baseline) / MIB:.0f} MiB "
          "over it afterwards")


@pytest.fixture(scope="module")
def small_messages(minilm_artifact):
    process = serve(minilm_artifact, "--max-message-bytes", str(MIB))
    yield process
    log = process.output()
    assert "Traceback" not in log and "larger than max" not in log, log[-3000:]
    assert process.stop() == 0


def largest_that_fits(manifest, plan, length: int, limit: int) -> int:
    count = 1
    while embed_response_bytes(plan, np.full(count + 1, length), manifest,
                               manifest.model_name) <= limit:
        count += 1
    return count


def test_the_response_size_check_counts_what_the_wire_carries(small_messages, minilm_artifact):
    """--max-message-bytes 1 MiB: a check counting only the floats would pass more texts
    of "word" than gRPC can send, run their batches, and count OK an answer gRPC refuses.
    The largest count the check passes is sent (and fills the limit to within a few per
    cent), one more is refused before any batch runs, with the server's own message."""
    manifest = load_artifact(minilm_artifact).manifest
    plan = plan_embed(pb.EmbedRequest(texts=["word"]), manifest, manifest.model_name)
    fits = largest_that_fits(manifest, plan, 3, MIB)
    before = small_messages.scrape()
    with grpc.insecure_channel(small_messages.address, options=BIG) as channel:
        encoder = stub(channel)
        sent = encoder.Embed(pb.EmbedRequest(texts=["word"] * fits), timeout=120)
        middle = small_messages.scrape()
        refused = [rpc_error(encoder.Embed, pb.EmbedRequest(texts=["word"] * n))
                   for n in (fits + 1, 682)]
    after = small_messages.scrape()
    assert 0.97 * MIB <= sent.ByteSize() <= MIB, sent.ByteSize()
    for err in refused:
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "over the 1.0 MiB message limit" in err.details(), err.details()
    assert delta(middle, after, "attnserve_batch_size_count") == 0
    assert delta(before, after, "attnserve_requests_total", rpc="Embed", code="OK") == 1
    assert delta(before, after, "attnserve_requests_total", rpc="Embed",
                 code="RESOURCE_EXHAUSTED") == 2
    print(f"\nresponse size: {fits} texts sent ({sent.ByteSize()} bytes of {MIB}), "
          f"{fits + 1} refused before inference")


def test_tokenize_and_model_infer_responses_are_sized_too(small_messages, minilm_artifact):
    """Tokenize had no size check at all; ModelInfer's left out the id it echoes."""
    model = load_artifact(minilm_artifact).manifest.model_name
    with grpc.insecure_channel(small_messages.address, options=BIG) as channel:
        encoder = stub(channel)
        kserve = kpb_grpc.GRPCInferenceServiceStub(channel)
        # Refused by the count alone (each text at least [CLS] [SEP]), before tokenizing.
        many = rpc_error(encoder.Tokenize, pb.TokenizeRequest(texts=[""] * 50_000))
        # Past the count's bound, refused once tokenized: its real size.
        wordy = rpc_error(encoder.Tokenize, pb.TokenizeRequest(texts=["hello world " * 20] * 2200))
        under = encoder.Tokenize(pb.TokenizeRequest(texts=["hello world " * 20] * 500), timeout=60)
        # 40 x 16 tokens of hidden state: 983,040 bytes of floats, under the limit alone.
        sequences = [ids_of(np.random.default_rng(1), 16)] * 40
        request = infer_request(model, sequences)
        plain = kserve.ModelInfer(request, timeout=60)
        request.id = "x" * (80 << 10)
        echoed = rpc_error(kserve.ModelInfer, request)
    assert many.code() == wordy.code() == echoed.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for err in (many, wordy, echoed):
        assert "over the 1.0 MiB message limit" in err.details(), err.details()
    assert "at least" in many.details() and "about" in wordy.details()
    assert under.ByteSize() <= MIB and plain.ByteSize() <= MIB
    assert plain.ByteSize() + len(request.id) > MIB


def test_more_hostile_shapes_are_refused_at_once(server, channel, tiny_artifact):
    """Two million empty texts, a million attention heads, a 3 MiB list of heads and
    100 KiB of metadata: each refused, none stalls health checks or harms the next call."""
    encoder = stub(channel)
    reference = Reference(tiny_artifact)
    good = ids_of(np.random.default_rng(3), 30)
    outcomes = {}
    with HealthProbe(server.address) as probe:
        err = rpc_error(encoder.Tokenize, pb.TokenizeRequest(texts=[""] * 2_000_000))
        outcomes["2M empty texts"] = err
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "texts: more than" in err.details()
        heads = pb.EmbedRequest(texts=["a"], attention=pb.AttentionOptions(heads=[0] * 1_000_000))
        err = rpc_error(encoder.Embed, heads)
        outcomes["1M heads"] = err
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "listed twice" in err.details()
        heads.attention.heads.extend([1] * 2_000_000)
        err = rpc_error(encoder.Embed, heads)
        outcomes["3 MiB of heads"] = err
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "attention: one entry of" in err.details()
        flood = [(f"x-flood-{i}", "v" * 100) for i in range(1000)]
        with pytest.raises(grpc.RpcError) as err:
            encoder.Embed(embed_ids([good]), metadata=flood, timeout=30)
        outcomes["100 KiB of metadata"] = err.value
        response = encoder.Embed(embed_ids([good]), timeout=30)
        reference.check_embedding(good, response.embeddings[0])
    assert probe.failed == [], str(probe)
    assert health(server.address) == "SERVING"
    for name, err in outcomes.items():
        print(f"\n{name}: {err.code().name} ({err.details()[:100]})", end="")
    print(f"\n{probe}")
