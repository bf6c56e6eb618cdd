"""Promise: --max-connection-age-seconds moves callers to new connections without failing a
call. A call still running when its connection reaches its age finishes, however long it
takes; the next call on the same channel goes out on a new connection."""

import time

import grpc
import numpy as np

from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from tests.server.reliability import BIG, embed_ids, ids_of, sequences_for, serve, stub, tensor

AGE_S = 1.0
CALL_S = 4.0  # several ages long, and longer than --drain-seconds


def pooled(sequences: list[list[int]]) -> pb.EmbedRequest:
    return pb.EmbedRequest(token_ids=[pb.TokenIds(ids=s) for s in sequences],
                           pooling=pb.POOLING_MEAN)


def test_a_call_longer_than_the_connection_age_finishes(minilm_artifact):
    rng = np.random.default_rng(7)
    with serve(minilm_artifact, "--max-connection-age-seconds", str(AGE_S),
               "--drain-seconds", "1") as server, \
            grpc.insecure_channel(server.address, options=BIG) as channel:
        encoder = stub(channel)
        count = sequences_for(encoder, rng, CALL_S, most=256)
        sequences = [ids_of(rng, 512) for _ in range(count)]
        started = time.monotonic()
        answer = encoder.Embed(pooled(sequences), timeout=120)
        took = time.monotonic() - started
        assert len(answer.embeddings) == count
        assert took > 2 * AGE_S, f"the call took {took:.1f} s, too short to outlive its connection"
        again = encoder.Embed(embed_ids([sequences[0]]), timeout=30)
        assert np.allclose(tensor(again.embeddings[0].pooled),
                           tensor(answer.embeddings[0].pooled), atol=1e-5)
