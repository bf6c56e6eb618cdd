"""Promise: memory admission. With --memory-budget-bytes, a request that cannot fit alone
(512 tokens with every layer's attention in float32 on MiniLM) is refused with
RESOURCE_EXHAUSTED and a message that says what would fit; a batch that would not fit is
split; smaller requests pass; and the server's resident memory stays under the budget
plus a stated baseline: its resident set when idle after start-up, plus SLACK (below)."""

import re
import time

import grpc
import numpy as np
import pytest

from attnserve.artifact import load_artifact
from attnserve.server.memory.budget import RESPONSE_COPIES
from tests.harness import sample
from tests.server.reliability import BIG, MIB, Peak, Reference, embed_ids, ids_of, serve, stub

# Also run against a server of several processes (make test: --server-workers 2).
pytestmark = pytest.mark.workers

BUDGET = 256 * MIB
# The stated baseline is the idle resident set after start-up plus this allowance: the
# budget is enforced on predictions (here the analytic bound, no fitted memory model), and
# one run of a shape varies by about ±30 % on a shared 2-core machine. Seen: the highest
# rise over idle 189-207 MiB for this 256 MiB budget; with --workers 2, 256-314 MiB.
SLACK = 48 * MIB
ALL = []  # every layer


@pytest.fixture(scope="module")
def server(minilm_artifact):
    # A message limit far above any response here, so the memory budget decides alone.
    process = serve(minilm_artifact, "--memory-budget-bytes", str(BUDGET),
                    "--max-message-bytes", str(256 * MIB))
    process.baseline = process.status()["rss"]  # idle, warmed up, before any request
    yield process
    assert process.stop() == 0


def call(encoder, sequences, layers):
    try:
        return encoder.Embed(embed_ids(sequences, layers), timeout=120), None
    except grpc.RpcError as err:
        return None, err


def test_oversize_attention_is_refused_with_what_fits(server):
    with grpc.insecure_channel(server.address, options=BIG) as channel:
        started = time.monotonic()
        _, err = call(stub(channel), [ids_of(np.random.default_rng(1), 512)], ALL)
        refused_in = time.monotonic() - started
    assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    message = err.details()
    assert "512 tokens with 6 attention layer(s)" in message
    assert "memory budget of 256 MiB" in message
    fits = re.search(r"what fits: up to (\d+) tokens with 6 layer\(s\), or (\d+) layer\(s\) at 512",
                     message)
    assert fits, message
    fits_len, fits_layers = int(fits.group(1)), int(fits.group(2))
    assert 0 < fits_len < 512 and 0 < fits_layers < 6
    assert refused_in < 5  # at once: refused before any work
    # What the message says fits does.
    rng = np.random.default_rng(3)
    with grpc.insecure_channel(server.address, options=BIG) as channel:
        for sequences, layers in (([ids_of(rng, fits_len)], ALL),
                                  ([ids_of(rng, 512)], list(range(fits_layers)))):
            response, err = call(stub(channel), sequences, layers)
            assert err is None, err.details()
    print(f"\nadmission refusal: {message}")


def test_smaller_requests_pass_batches_split_and_memory_stays_under_the_budget(
        server, minilm_artifact):
    reference = Reference(minilm_artifact)
    rng = np.random.default_rng(2)
    baseline = server.baseline  # measured before the refusal test's requests too
    before = server.scrape()
    peak = Peak(server)
    # (sequences, layers): each fits alone. Four 512s in one batch would need ~300 MiB by
    # the analytic bound: they run as two batches of two.
    passing = [
        ([ids_of(rng, 512)], None),
        ([ids_of(rng, 512) for _ in range(4)], None),
        ([ids_of(rng, 256)], ALL),
        ([ids_of(rng, 128), ids_of(rng, 100)], ALL),
        ([ids_of(rng, 512)], [-1]),
        ([ids_of(rng, 300)], [0, 2]),
    ]
    # The response of two 256s with every layer (37 MiB) does not fit beside its batch.
    too_big = ([ids_of(rng, 256), ids_of(rng, 256)], ALL)
    rows, split = [], None
    try:
        with grpc.insecure_channel(server.address, options=BIG) as channel:
            encoder = stub(channel)
            for sequences, layers in passing:
                ahead = server.scrape()
                response, err = call(encoder, sequences, layers)
                if len(sequences) == 4:
                    behind = server.scrape()
                    split = [sample(behind, f"attnserve_batch_size_{x}")
                             - sample(ahead, f"attnserve_batch_size_{x}") for x in ("count", "sum")]
                assert err is None, err.details()
                resolved = tuple(range(6)) if layers == ALL else tuple(
                    x % 6 for x in layers or ())
                for ids, embedding in zip(sequences, response.embeddings, strict=True):
                    reference.check_embedding(ids, embedding, resolved, atol=1e-4)
                rows.append((len(sequences), len(sequences[0]), layers,
                             (peak.read() - baseline) / MIB))
            _, err = call(encoder, *too_big)
            assert err is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "to build and send" in err.details() and "what fits" in err.details()
    finally:
        highest = peak.close()
    after = server.scrape()
    runs = (sample(after, "attnserve_batch_size_count")
            - sample(before, "attnserve_batch_size_count"))
    assert split == [2, 4], split  # two batches, four sequences
    for count, length, layers, rise in rows:
        print(f"admission: {count} x {length} layers={layers}: peak rise {rise:.0f} MiB")
    print(f"admission: baseline {baseline / MIB:.0f} MiB, budget {BUDGET / MIB:.0f} MiB, "
          f"highest {(highest - baseline) / MIB:.0f} MiB over baseline (sampled "
          f"{(peak.sampled - baseline) / MIB:.0f}), batches run {runs:.0f}")
    # One process packs an answer in memory its batch has just freed. With --workers a
    # front end packs it in its own heap, which keeps those pages until its trim a moment
    # after the answer is sent, while the engine's next batch peaks in its own: up to the
    # packing of the largest answer here on top (and the marks add the two; see Peak).
    heads = load_artifact(minilm_artifact).manifest.num_heads
    answers = [sum(len(ids) ** 2 for ids in sequences) * 4 * heads * (
        6 if layers == ALL else len(layers or ())) for sequences, layers in passing]
    packing = RESPONSE_COPIES * max(answers) if len(server.pids) > 1 else 0
    assert highest <= baseline + BUDGET + SLACK + packing, (highest - baseline) / MIB
