"""Promise: overload is refused at once (RESOURCE_EXHAUSTED), not suffered, and the server
keeps serving what it accepted.

A burst far past a small queue (a few requests, a few hundred tokens, batches of one)
comes back as a mix of answers and refusals, both the request bound and the token bound
refuse, nothing hangs, every accepted request is answered correctly, and the server is
healthy and correct afterwards."""

import time

import grpc
import numpy as np

from tests.server.reliability import (
    BIG,
    Reference,
    embed_ids,
    health,
    ids_of,
    sample,
    scrape,
    serve,
    stub,
)

BURST = 300
TIMEOUT_S = 60  # a hang would show as DEADLINE_EXCEEDED


def test_a_burst_past_the_queue_gets_answers_and_refusals_and_nothing_hangs(tiny_artifact):
    reference = Reference(tiny_artifact)
    server = serve(tiny_artifact, "--max-queue-requests", "4", "--max-queue-tokens", "512",
                   "--max-batch-size", "1")
    rng = np.random.default_rng(6)
    # Small requests fill the request bound; big ones (3 x 120 tokens) the token bound.
    requests = [[ids_of(rng, 120) for _ in range(3)] if i % 3 == 0 else [ids_of(rng, 8)]
                for i in range(BURST)]
    try:
        with grpc.insecure_channel(server.address, options=BIG) as channel:
            encoder = stub(channel)
            started = time.monotonic()
            finished: dict[int, float] = {}
            futures = []
            for i, sequences in enumerate(requests):
                future = encoder.Embed.future(embed_ids(sequences), timeout=TIMEOUT_S)
                future.add_done_callback(lambda f, i=i: finished.setdefault(i, time.monotonic()))
                futures.append(future)
            codes = [f.exception().code() if f.exception() else grpc.StatusCode.OK
                     for f in futures]
            burst_s = time.monotonic() - started
            ok = [i for i, c in enumerate(codes) if c == grpc.StatusCode.OK]
            refused = [i for i, c in enumerate(codes) if c == grpc.StatusCode.RESOURCE_EXHAUSTED]
            assert len(ok) + len(refused) == BURST, {c.name for c in codes}
            assert ok and refused
            messages = {futures[i].exception().details() for i in refused}
            assert any("requests waiting" in m for m in messages), messages
            assert any("tokens waiting" in m for m in messages), messages
            for i in ok:
                for ids, embedding in zip(requests[i], futures[i].result().embeddings, strict=True):
                    reference.check_embedding(ids, embedding)
            slowest_refusal = max(finished[i] - started for i in refused)

            # Afterwards: healthy, an empty queue, and still correct.
            assert health(server.address) == "SERVING"
            probe = [ids_of(rng, 50), ids_of(rng, 7)]
            response = encoder.Embed(embed_ids(probe), timeout=TIMEOUT_S)
            for ids, embedding in zip(probe, response.embeddings, strict=True):
                reference.check_embedding(ids, embedding)
        metrics = scrape(server)
        assert sample(metrics, "attnserve_queue_depth") == 0
        assert sample(metrics, "attnserve_requests_total", rpc="Embed",
                      code="RESOURCE_EXHAUSTED") == len(refused)
        assert sample(metrics, "attnserve_requests_total", rpc="Embed", code="OK") == len(ok) + 1
    finally:
        assert server.terminate() == 0
    print(f"\noverload: burst={BURST} ok={len(ok)} refused={len(refused)} lost=0 "
          f"burst_done_in={burst_s:.2f}s slowest_refusal={slowest_refusal:.2f}s")
