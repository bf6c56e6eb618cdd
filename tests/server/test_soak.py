"""Promise: thousands of small requests leave no trace. A soak of a few thousand tiny
requests (texts, token ids, KServe, Tokenize, and a share of invalid ones so the error
paths run too) from a few callers: every one answered as expected, and the server's
resident memory (VmRSS) and open file descriptors do not grow beyond a stated bound."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from attnserve.artifact import load_artifact
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.inference import grpc_service_pb2_grpc as kpb_grpc
from tests.server.reliability import MIB, embed_ids, ids_of, infer_request, serve, stub

CALLERS = 4
WARM_UP = 400
SOAK = 4000
# What a few thousand requests may add to the resident set once warm: allocator and
# interpreter noise, not a per-request leak (at 4000 requests, 8 MiB is 2 KiB each).
RSS_GROWTH_BOUND = 8 * MIB
FD_GROWTH_BOUND = 8
WORDS = ["alpha", "beta", "gamma", "δέλτα", "服务", "🙂", "token", "attention", "x" * 40]


def run_requests(server, model: str, count: int, seed: int) -> dict[str, int]:
    codes: dict[str, int] = {}
    lock = threading.Lock()

    def caller(index: int) -> None:
        rng = np.random.default_rng(seed * 100 + index)
        with grpc.insecure_channel(server.address) as channel:
            encoder, kserve = stub(channel), kpb_grpc.GRPCInferenceServiceStub(channel)
            for i in range(count // CALLERS):
                kind = i % 10
                try:
                    if kind < 4:
                        text = " ".join(rng.choice(WORDS, size=int(rng.integers(1, 12))))
                        response = encoder.Embed(pb.EmbedRequest(texts=[text]), timeout=30)
                        assert len(response.embeddings) == 1
                    elif kind < 7:
                        ids = ids_of(rng, int(rng.integers(1, 24)))
                        response = encoder.Embed(embed_ids([ids], [0] if kind == 6 else None),
                                                 timeout=30)
                        assert list(response.embeddings[0].token_ids) == ids
                    elif kind == 7:
                        kserve.ModelInfer(infer_request(model, [ids_of(rng, 8)]), timeout=30)
                    elif kind == 8:
                        encoder.Tokenize(pb.TokenizeRequest(texts=["soak"]), timeout=30)
                    else:  # invalid: an id outside the vocabulary
                        encoder.Embed(embed_ids([[101, 10 ** 6, 102]]), timeout=30)
                    code = "OK"
                except grpc.RpcError as err:
                    code = err.code().name
                with lock:
                    codes[code] = codes.get(code, 0) + 1

    with ThreadPoolExecutor(CALLERS) as pool:
        list(pool.map(caller, range(CALLERS)))
    return codes


def test_a_soak_of_small_requests_does_not_grow_the_server(tiny_artifact):
    model = load_artifact(tiny_artifact).manifest.model_name
    server = serve(tiny_artifact)
    try:
        run_requests(server, model, WARM_UP, seed=1)
        time.sleep(0.5)
        warm = server.status()
        started = time.monotonic()
        codes = run_requests(server, model, SOAK, seed=2)
        took = time.monotonic() - started
        time.sleep(0.5)
        after = server.status()
    finally:
        assert server.stop() == 0
    assert sum(codes.values()) == SOAK
    assert codes == {"OK": SOAK * 9 // 10, "INVALID_ARGUMENT": SOAK // 10}, codes
    growth = after["rss"] - warm["rss"]
    print(f"\nsoak: {SOAK} requests in {took:.1f}s ({SOAK / took:.0f}/s) {codes}; RSS "
          f"{warm['rss'] / MIB:.1f} -> {after['rss'] / MIB:.1f} MiB ({growth / MIB:+.2f}, bound "
          f"{RSS_GROWTH_BOUND / MIB:.0f}); open files {warm['open_files']} -> "
          f"{after['open_files']} (bound +{FD_GROWTH_BOUND})")
    assert growth <= RSS_GROWTH_BOUND
    assert after["open_files"] - warm["open_files"] <= FD_GROWTH_BOUND
