"""Promise: overload is refused at once (RESOURCE_EXHAUSTED), not suffered, and the server
keeps serving what it accepted.

Two bursts far past a small queue (4 requests, 512 tokens) arrive while the server gathers
its first batch (a gathering window of a few seconds holds what it accepted, whatever
order the calls arrive in): first big requests, of which one fits and the rest pass the
token bound, then small ones, of which three more fit and the rest pass the request
bound. Every refusal comes back before the first answer (so none waited for the queue: an
order, where a time bound would flake on 2 busy cores), nothing hangs, every accepted
request is answered correctly, and the server is healthy and correct afterwards."""

import time

import grpc
import numpy as np

from tests.harness import sample
from tests.server.reliability import (
    BIG,
    Reference,
    embed_ids,
    health,
    ids_of,
    serve,
    stub,
    wait_for,
)

BIG_REQUESTS, SMALL_REQUESTS = 50, 250
TIMEOUT_S = 60  # a hang would show as DEADLINE_EXCEEDED
# Long enough for both bursts to arrive and be admitted or refused before the first batch
# runs, on a slow machine too.
GATHER_MS = 4000


def test_a_burst_past_the_queue_gets_answers_and_refusals_and_nothing_hangs(tiny_artifact):
    reference = Reference(tiny_artifact)
    server = serve(tiny_artifact, "--max-queue-requests", "4", "--max-queue-tokens", "512",
                   "--max-wait-ms", str(GATHER_MS))
    rng = np.random.default_rng(6)
    # 300 tokens each: one fits the 512-token queue, a second never does.
    bigs = [[ids_of(rng, 100) for _ in range(3)] for _ in range(BIG_REQUESTS)]
    smalls = [[ids_of(rng, 8)] for _ in range(SMALL_REQUESTS)]
    requests = bigs + smalls
    try:
        with grpc.insecure_channel(server.address, options=BIG) as channel:
            encoder = stub(channel)
            started = time.monotonic()
            finished: dict[int, float] = {}
            futures = []

            def send(first: int, batch: list) -> None:
                for i, sequences in enumerate(batch, first):
                    future = encoder.Embed.future(embed_ids(sequences), timeout=TIMEOUT_S)
                    future.add_done_callback(lambda f, i=i: finished.setdefault(i, time.monotonic()))
                    futures.append(future)

            send(0, bigs)
            # The refused big ones are back (the one accepted waits for the window).
            assert wait_for(lambda: len(finished) >= BIG_REQUESTS - 1, TIMEOUT_S)
            send(BIG_REQUESTS, smalls)
            codes = [f.exception().code() if f.exception() else grpc.StatusCode.OK
                     for f in futures]
            burst_s = time.monotonic() - started
            ok = [i for i, c in enumerate(codes) if c == grpc.StatusCode.OK]
            refused = [i for i, c in enumerate(codes) if c == grpc.StatusCode.RESOURCE_EXHAUSTED]
            assert len(ok) + len(refused) == len(requests), {c.name for c in codes}
            reasons = [futures[i].exception().details() for i in refused]
            by_tokens = sum("tokens waiting" in reason for reason in reasons)
            by_requests = sum("requests waiting" in reason for reason in reasons)
            assert (len(ok), by_tokens, by_requests) == (4, BIG_REQUESTS - 1,
                                                        SMALL_REQUESTS - 3), set(reasons)
            for i in ok:
                for ids, embedding in zip(requests[i], futures[i].result().embeddings, strict=True):
                    reference.check_embedding(ids, embedding)
            # At once: the last refusal came back before the first answer, while what was
            # accepted still waited in the queue.
            slowest_refusal = max(finished[i] - started for i in refused)
            first_answer = min(finished[i] - started for i in ok)
            assert slowest_refusal < first_answer, (slowest_refusal, first_answer)

            # Afterwards: healthy, an empty queue, and still correct.
            assert health(server.address) == "SERVING"
            probe = [ids_of(rng, 50), ids_of(rng, 7)]
            response = encoder.Embed(embed_ids(probe), timeout=TIMEOUT_S)
            for ids, embedding in zip(probe, response.embeddings, strict=True):
                reference.check_embedding(ids, embedding)
        metrics = server.scrape()
        assert sample(metrics, "attnserve_queue_depth") == 0
        assert sample(metrics, "attnserve_requests_total", rpc="Embed",
                      code="RESOURCE_EXHAUSTED") == len(refused)
        assert sample(metrics, "attnserve_requests_total", rpc="Embed", code="OK") == len(ok) + 1
    finally:
        assert server.stop() == 0
    print(f"\noverload: {len(requests)} requests: ok={len(ok)} refused={len(refused)} "
          f"(tokens {by_tokens}, requests {by_requests}); last refusal at "
          f"{slowest_refusal:.2f}s, first answer at {first_answer:.2f}s (gathering window "
          f"{GATHER_MS / 1000:.0f}s), all done in {burst_s:.2f}s")
