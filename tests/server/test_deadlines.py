"""Promise: deadlines and cancellation. While a long request occupies the server, a
request whose deadline passes in the queue is answered DEADLINE_EXCEEDED and never run
(the scheduler's counters show it dropped and no batch for it), and a cancelled call or
stream frees its place in the queue at once: while the long batch still runs (an order,
where a time bound would flake on 2 busy cores)."""

import threading
import time

import grpc
import numpy as np
import pytest

from tests.harness import sample
from tests.server.reliability import (
    BIG,
    Reference,
    embed_ids,
    ids_of,
    sequences_for,
    serve,
    stub,
    wait_for,
)

# Also run against a server of several processes (make test: --server-workers 2).
pytestmark = pytest.mark.workers

# The long request: as many 512-token sequences (one batch) as keep MiniLM busy this long.
BUSY_S = 4.0
# Five of them must expire behind the long request, which lasts at least ~1.4 s (24 x 512
# tokens on a fast 2-core machine).
SHORT_DEADLINE_S = 0.15


@pytest.fixture(scope="module")
def server(minilm_artifact):
    # One queued request at most, so a place freed (or not) shows at once.
    process = serve(minilm_artifact, "--max-queue-requests", "1")
    yield process
    assert process.stop() == 0


@pytest.fixture(scope="module")
def reference(minilm_artifact):
    return Reference(minilm_artifact)


def start_long(encoder, server, rng):
    ids, count = ids_of(rng, 512), sequences_for(encoder, rng, BUSY_S)
    future = encoder.Embed.future(embed_ids([ids] * count), timeout=300)
    # Running: it has left the queue and is being answered.
    assert wait_for(lambda: sample(server.scrape(), "attnserve_inflight_requests") >= 1
                    and sample(server.scrape(), "attnserve_queue_depth") == 0, 30)
    future.count = count
    return ids, future


def counters(server) -> dict[str, float]:
    m = server.scrape()
    return {"deadline": sample(m, "attnserve_dropped_sequences_total", reason="deadline"),
            "cancelled": sample(m, "attnserve_dropped_sequences_total", reason="cancelled"),
            "batches": sample(m, "attnserve_batch_size_count"),
            "batched_sequences": sample(m, "attnserve_batch_size_sum"),
            "exceeded": sample(m, "attnserve_requests_total", rpc="Embed",
                               code="DEADLINE_EXCEEDED")}


def test_requests_whose_deadline_passes_in_the_queue_are_dropped_unrun(server, reference):
    rng = np.random.default_rng(4)
    with grpc.insecure_channel(server.address, options=BIG) as channel:
        encoder = stub(channel)
        before = counters(server)
        long_ids, long_call = start_long(encoder, server, rng)
        before["batches"] += 1  # the timing request
        before["batched_sequences"] += 1
        codes, waited = [], []
        for _ in range(5):
            started = time.monotonic()
            try:
                encoder.Embed(embed_ids([ids_of(rng, 20), ids_of(rng, 9)]),
                              timeout=SHORT_DEADLINE_S)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as err:
                codes.append(err.code())
            waited.append(time.monotonic() - started)
        # The premise: all of them waited behind the long request.
        assert not long_call.done(), "the long request finished too soon to queue behind"
        assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * 5, codes
        response = long_call.result()
        reference.check_embedding(long_ids, response.embeddings[0], atol=1e-4)
        probe = ids_of(rng, 30)
        answer = encoder.Embed(embed_ids([probe]), timeout=60)
        reference.check_embedding(probe, answer.embeddings[0], atol=1e-4)
    after = counters(server)
    delta = {k: after[k] - before[k] for k in after}
    # 5 requests x 2 sequences dropped for their deadline; only the long batch and the
    # probe ran.
    assert delta["deadline"] == 10, delta
    assert delta["exceeded"] == 5, delta
    assert delta["batches"] == 2 and delta["batched_sequences"] == long_call.count + 1, delta
    print(f"\ndeadlines: 5 requests with {SHORT_DEADLINE_S}s deadlines behind a "
          f"{long_call.count}x512 batch: "
          f"DEADLINE_EXCEEDED after {min(waited):.2f}-{max(waited):.2f}s, dropped sequences "
          f"{delta['deadline']:.0f}, batches run {delta['batches']:.0f} (long + probe)")


def test_a_cancelled_call_or_stream_frees_its_place_at_once(server, reference):
    rng = np.random.default_rng(5)
    before = counters(server)

    def depth() -> float:
        return sample(server.scrape(), "attnserve_queue_depth")

    with grpc.insecure_channel(server.address, options=BIG) as channel:
        encoder = stub(channel)
        _, long_call = start_long(encoder, server, rng)
        freed = []

        # A unary call takes the one place; a second is refused; cancelling the first
        # frees the place.
        queued = encoder.Embed.future(embed_ids([ids_of(rng, 12)]), timeout=120)
        assert wait_for(lambda: depth() == 1, 10)
        with pytest.raises(grpc.RpcError) as refused:
            encoder.Embed(embed_ids([ids_of(rng, 12)]), timeout=30)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        started = time.monotonic()
        queued.cancel()
        assert wait_for(lambda: depth() == 0 or long_call.done(), 60)
        freed.append(time.monotonic() - started)
        assert not long_call.done(), "the place was freed only when the long batch ended"

        # The same with a stream that stays open.
        hold = threading.Event()

        def one_then_wait():
            yield embed_ids([ids_of(rng, 12)])
            hold.wait(60)

        stream = encoder.EmbedStream(one_then_wait(), timeout=120)
        try:
            assert wait_for(lambda: depth() == 1, 10)
            started = time.monotonic()
            stream.cancel()
            assert wait_for(lambda: depth() == 0 or long_call.done(), 60)
            freed.append(time.monotonic() - started)
            assert not long_call.done(), "the place was freed only when the long batch ended"
        finally:
            hold.set()

        # The freed place takes new work, answered once the long batch is done.
        later = ids_of(rng, 12)
        accepted = encoder.Embed.future(embed_ids([later]), timeout=120)
        assert not long_call.done(), "the long request finished too soon"
        long_call.result()
        reference.check_embedding(later, accepted.result().embeddings[0], atol=1e-4)
    after = counters(server)
    assert after["cancelled"] - before["cancelled"] == 2
    print(f"\ncancellation: unary and stream places freed in {freed[0]:.3f}s and "
          f"{freed[1]:.3f}s (metrics polled), dropped cancelled "
          f"{after['cancelled'] - before['cancelled']:.0f}")
