"""Promise: under load every caller gets the answer for its own input, and none is lost.

Many threads call for a bounded time with mixed lengths, mixed requests (EncoderService
with and without attention maps, KServe ModelInfer) and a short gathering window, so
unrelated requests share batches; afterwards every response is checked against the
in-process reference for that request's own input. Two hostile callers send bad requests
all along (ids outside the vocabulary, layers that do not exist, bytes that do not parse,
KServe masks with holes): they are refused, and nobody else's answer is touched."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from attnserve.artifact import load_artifact
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.inference import grpc_service_pb2_grpc as kpb_grpc
from tests.harness import sample
from tests.server.reliability import (
    BIG,
    EXPECTED_REFUSALS,
    Reference,
    embed_ids,
    ids_of,
    infer_request,
    serve,
    stub,
)

CALLERS = 12
HOSTILE = 2
DURATION_S = 6.0
MAX_CALLS_PER_CALLER = 400  # a bound even on a fast machine
KINDS = ("embed", "embed", "attention", "kserve")


def test_concurrent_callers_each_get_their_own_answer(tiny_artifact):
    reference = Reference(tiny_artifact)
    model = load_artifact(tiny_artifact).manifest.model_name
    server = serve(tiny_artifact, "--max-wait-ms", "2")
    answered: list[tuple[str, list[list[int]], object]] = []
    failed: list[tuple[str, grpc.StatusCode, str]] = []
    refused: dict[str, int] = {}
    lock = threading.Lock()
    stop_at = time.monotonic() + DURATION_S

    def caller(seed: int) -> int:
        rng = np.random.default_rng(seed)
        sent = 0
        with grpc.insecure_channel(server.address, options=BIG) as channel:
            encoder, kserve = stub(channel), kpb_grpc.GRPCInferenceServiceStub(channel)
            while time.monotonic() < stop_at and sent < MAX_CALLS_PER_CALLER:
                kind = KINDS[int(rng.integers(len(KINDS)))]
                sequences = [ids_of(rng, int(rng.integers(1, 129)))
                             for _ in range(int(rng.integers(1, 5)))]
                sent += 1
                try:
                    if kind == "kserve":
                        response = kserve.ModelInfer(infer_request(model, sequences), timeout=60)
                    else:
                        layers = [1] if kind == "attention" else None
                        response = encoder.Embed(embed_ids(sequences, layers), timeout=60)
                    with lock:
                        answered.append((kind, sequences, response))
                except grpc.RpcError as err:
                    with lock:
                        failed.append((kind, err.code(), err.details()))
        return sent

    def hostile(seed: int) -> None:
        rng = np.random.default_rng(seed)
        with grpc.insecure_channel(server.address, options=BIG) as channel:
            encoder, kserve = stub(channel), kpb_grpc.GRPCInferenceServiceStub(channel)
            garbage = channel.unary_unary("/attnserve.v1.EncoderService/Embed",
                                          request_serializer=None, response_deserializer=None)
            calls = [
                lambda: encoder.Embed(embed_ids([ids_of(rng, 30) + [40000]]), timeout=60),
                lambda: encoder.Embed(embed_ids([ids_of(rng, 30)], layers=[7]), timeout=60),
                lambda: encoder.Embed(pb.EmbedRequest(texts=["a"], pooling=42), timeout=60),
                lambda: garbage(b"\x0a\x03\xff\xfe\xfd", timeout=60),
                lambda: kserve.ModelInfer(holey, timeout=60),
            ]
            holey = infer_request(model, [ids_of(rng, 12), ids_of(rng, 5)])
            mask = np.frombuffer(holey.raw_input_contents[1], "<i8").copy()
            mask[3] = 0
            holey.raw_input_contents[1] = mask.tobytes()
            n = 0
            while time.monotonic() < stop_at and n < MAX_CALLS_PER_CALLER:
                n += 1
                try:
                    calls[n % len(calls)]()
                    code = grpc.StatusCode.OK
                except grpc.RpcError as err:
                    code = err.code()
                with lock:
                    refused[code.name] = refused.get(code.name, 0) + 1

    try:
        with ThreadPoolExecutor(CALLERS + HOSTILE) as pool:
            attacks = [pool.submit(hostile, 1000 + i) for i in range(HOSTILE)]
            sent = sum(pool.map(caller, range(CALLERS)))
            for attack in attacks:
                attack.result()
        metrics = server.scrape()
    finally:
        assert server.stop() == 0

    assert not failed, failed[:5]
    assert refused and set(refused) <= {c.name for c in EXPECTED_REFUSALS}, refused
    # Every call came back to its caller (each has a 60 s deadline, so a lost one shows as
    # a failure above), and the server answered OK exactly as many as the callers got.
    served_ok = sum(sample(metrics, "attnserve_requests_total", rpc=rpc, code="OK")
                    for rpc in ("Embed", "ModelInfer"))
    assert served_ok == len(answered), (served_ok, len(answered))
    worst = 0.0
    for kind, sequences, response in answered:
        if kind == "kserve":
            worst = max(worst, reference.check_infer(sequences, response))
        else:
            assert len(response.embeddings) == len(sequences)
            layers = (1,) if kind == "attention" else ()
            for ids, embedding in zip(sequences, response.embeddings, strict=True):
                worst = max(worst, reference.check_embedding(ids, embedding, layers))
    batches = sample(metrics, "attnserve_batch_size_count")
    per_batch = sample(metrics, "attnserve_batch_size_sum") / batches
    # Unrelated requests did share batches, so a mix-up would have shown.
    assert per_batch > 1.2, per_batch
    print(f"\nload: {CALLERS} callers x {DURATION_S:.0f}s: sent={sent} answered={len(answered)} "
          f"server_ok={served_ok:.0f} errors={len(failed)} rps={sent / DURATION_S:.0f} "
          f"batches={batches:.0f} sequences/batch={per_batch:.2f} max_abs_err={worst:.2e}; "
          f"hostile calls alongside: {refused}")
