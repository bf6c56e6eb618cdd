"""Shape buckets, the outputs a batch brings back, and several lanes of sessions, on the CPU
provider: which shape a batch is padded to, that warm-up runs every shape a batch can be
padded to, that a server with buckets forced on never meets a new shape after warm-up
whatever the mix of lengths (and one without them does), that each request gets the
outputs it asked for when it shares a batch with others, and that fixed IO-bound buffers
(what CUDA graphs run on) with two lanes give every caller what it gets alone."""

import asyncio
import random
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnserve.artifact import HIDDEN_OUTPUT, load_artifact, pooled_output
from attnserve.client import EncoderClient
from attnserve.server.engine.offload import inference_pool, on_every_thread
from attnserve.server.engine.queue import Limits
from attnserve.server.engine.requests import Submission
from attnserve.server.engine.runner import ModelRunner
from attnserve.server.memory.budget import MemoryBudget
from attnserve.server.memory.model import MemoryModel
from attnserve.server.memory.probe import MemoryProbe
from attnserve.server.metrics import Metrics
from attnserve.server.runtime.backend import HIDDEN_ONLY, Strategy
from attnserve.server.runtime.onnx import OrtBackend
from attnserve.server.runtime.shapes import ShapeBuckets
from tests.harness import ATTNSERVE, REPO, ServerProcess, sample

WAIT_S = 60
MEAN = pooled_output("mean", False)
UNSEEN = "attnserve_unseen_shape_runs_total"


# --- which shape ------------------------------------------------------------------------

def test_batches_pad_to_a_power_of_two_rows_and_a_multiple_of_the_length_step():
    buckets = ShapeBuckets(seq_multiple=32, max_batch_size=64, max_positions=512)
    assert buckets.padded(1, 1) == (1, 32)
    assert buckets.padded(1, 17) == (1, 32)
    assert buckets.padded(1, 32) == (1, 32)
    assert buckets.padded(3, 33) == (4, 64)
    assert buckets.padded(33, 500) == (64, 512)
    assert buckets.padded(64, 512) == (64, 512)
    # max_batch_size not a power of two: the last bucket is the cap itself.
    assert ShapeBuckets(32, 48, 512).padded(40, 20) == (48, 32)
    # max_positions not a multiple of the step: the longest bucket is the model's maximum.
    assert ShapeBuckets(32, 64, 100).padded(1, 99) == (1, 100)


@settings(max_examples=300, deadline=None)
@given(batch=st.integers(1, 48), longest=st.integers(1, 512), step=st.sampled_from([1, 8, 32, 64]),
       max_batch=st.sampled_from([48, 64]))
def test_a_padded_shape_holds_the_batch_and_is_its_own_bucket(batch, longest, step, max_batch):
    """(The batch loop never forms more than max_batch_size sequences.)"""
    buckets = ShapeBuckets(step, max_batch, 512)
    rows, seq = buckets.padded(batch, longest)
    assert batch <= rows <= max_batch and longest <= seq <= 512
    assert seq % step == 0 or seq == 512
    assert buckets.padded(rows, seq) == (rows, seq)


@pytest.mark.parametrize("max_positions,max_batch_tokens,count", [(256, 16384, 56), (512, 16384, 104),
                                                                  (512, 4096, 78)])
def test_the_warm_up_set_is_every_shape_a_batch_can_be_padded_to(max_positions, max_batch_tokens, count):
    """Brute force over every (sequences, longest) the batch loop may form: one sequence
    of any length, or several whose padded shape is within the token cap. The 56 buckets up
    to 64 × 256 warm in 3.2 s on an H200 (onnxruntime-gpu 1.31.1)."""
    buckets = ShapeBuckets(32, 64, max_positions)
    formed = {buckets.padded(b, n) for n in range(1, max_positions + 1) for b in range(1, 65)
              if b == 1 or np.prod(buckets.padded(b, n)) <= max_batch_tokens}
    assert set(buckets.reachable(max_batch_tokens)) == formed
    assert len(formed) == count


# --- in process: the batch loop on a bucketed backend ------------------------------------

@pytest.fixture(scope="module")
def bucketed(tiny_artifact):
    return OrtBackend(load_artifact(tiny_artifact), device="cpu", intra_op_threads=1,
                      strategy=Strategy(shape_buckets="on", max_batch_size=64))


def test_a_bucketed_backend_warms_every_bucket_and_then_meets_no_new_shape(bucketed):
    shapes = bucketed.warm_up_shapes(16384)
    assert shapes == bucketed.buckets.reachable(16384)
    assert len(shapes) == 7 * 4  # rows 1..64, lengths 32..128 (the tiny model's positions)
    bucketed.warm_up(shapes)
    rng = np.random.default_rng(0)
    for _ in range(20):
        batch, longest = int(rng.integers(1, 65)), int(rng.integers(1, 129))
        if batch > 1 and np.prod(bucketed.padded_shape(batch, longest)) > 16384:
            continue
        shape = bucketed.padded_shape(batch, longest)
        ids = np.zeros(shape, dtype=np.int64)
        mask = np.zeros(shape, dtype=np.int64)
        mask[:batch, :longest] = 1
        assert not bucketed.run(ids, mask, outputs=frozenset({MEAN})).new_shape, shape


MODEL = "tiny"


def assembled(backend: OrtBackend, max_batch_tokens: int = 16384) -> ModelRunner:
    """The server's own runner of one model on `backend`, its batch loop not started."""
    limits = Limits(max_batch_size=64, max_batch_tokens=max_batch_tokens,
                    max_queue_requests=1024, max_queue_tokens=1 << 20,
                    memory_budget_bytes=1 << 40, max_wait_s=0.0)
    memory = MemoryBudget(1 << 40, responses_in_budget=False).for_model(
        MODEL, MemoryModel(a=1000.0, b=1.0, c=0.0, d=0.0, source="test"), heads=4, hidden=32)
    return ModelRunner(MODEL, backend.artifact, backend, memory, limits, Metrics(128),
                       MemoryProbe(cuda=False))


def counted(core: ModelRunner, name: str, **labels) -> float:
    return core.metrics.registry.get_sample_value(name, {"model": MODEL, **labels}) or 0.0


def sequences(lengths: list[int]) -> list[np.ndarray]:
    return [np.arange(1000, 1000 + n, dtype=np.int64) for n in lengths]


def test_the_batch_loop_caps_padded_tokens_and_runs_only_warmed_shapes(bucketed):
    """Nine sequences of 20 tokens under a cap of 256 padded tokens: eight pad to 8 × 32 =
    256, nine would pad to 16 × 32, so they run as 8 and 1, both warmed shapes."""
    async def scenario():
        core = assembled(bucketed, max_batch_tokens=256)
        core.batch_loop.start()
        ask = Submission(sequences([20]), outputs=frozenset({MEAN}))
        results = await asyncio.wait_for(asyncio.gather(
            *(core.queue.submit(ask) for _ in range(9))), WAIT_S)
        return core, results

    core, results = asyncio.run(scenario())
    assert counted(core, "attnserve_batch_size_count") == 2
    assert counted(core, "attnserve_batch_size_sum") == 9
    assert counted(core, "attnserve_batch_tokens_sum", kind="padded") == 8 * 32 + 1 * 32
    assert counted(core, UNSEEN, graph="embeddings") == 0
    alone = bucketed.run(sequences([20])[0][None], np.ones((1, 20), np.int64), outputs=frozenset({MEAN}))
    for (result,) in results:
        assert result.hidden is None
        np.testing.assert_allclose(result.pooled[MEAN], alone.pooled[MEAN][0], atol=1e-5)


def test_each_request_gets_the_outputs_it_asked_for_from_a_shared_batch(bucketed):
    """Three requests in one batch asking for different outputs: the batch brings back the
    union, and each request's results carry its own (the hidden state trimmed to its
    sequence), whatever the others asked for."""
    normalized = pooled_output("cls", True)
    asks = [frozenset({MEAN}), HIDDEN_ONLY, frozenset({normalized, HIDDEN_OUTPUT})]

    async def scenario():
        core = assembled(bucketed)
        core.batch_loop.start()
        tasks = [core.queue.submit(Submission(sequences([n]), outputs=ask))
                 for n, ask in zip((9, 10, 11), asks, strict=True)]
        return core, await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)

    core, results = asyncio.run(scenario())
    assert counted(core, "attnserve_batch_size_count") == 1
    for n, ask, (result,) in zip((9, 10, 11), asks, results, strict=True):
        ids = sequences([n])[0][None]
        alone = bucketed.run(ids, np.ones_like(ids), outputs=ask)
        assert set(result.pooled) == ask - {HIDDEN_OUTPUT}
        for name in result.pooled:
            np.testing.assert_allclose(result.pooled[name], alone.pooled[name][0], atol=1e-5)
        if HIDDEN_OUTPUT in ask:
            assert result.hidden.shape == (n, 32)
            np.testing.assert_allclose(result.hidden, alone.hidden[0], atol=1e-5)
        else:
            assert result.hidden is None


def test_every_inference_thread_warms_its_own_lane(tiny_artifact):
    """Two lanes, two inference threads: warm-up through `on_every_thread` runs once on
    each thread, so each lane has run every shape and no batch on either meets a new one."""
    backend = OrtBackend(load_artifact(tiny_artifact), device="cpu", intra_op_threads=1,
                         strategy=Strategy(shape_buckets="on", sessions=2, cuda_graphs=True))
    assert backend.concurrency == 2 and backend.max_in_flight == 3
    inference = inference_pool(MODEL, backend.concurrency, backend.bind_thread)
    shapes = backend.warm_up_shapes(16384)
    for future in on_every_thread(inference, 2, lambda: backend.warm_up(shapes)):
        future.result(WAIT_S)
    for lane in backend.lanes:
        assert {(False, shape) for shape in shapes} <= lane.seen
    ids = np.zeros((4, 64), dtype=np.int64)
    runs = [inference.submit(backend.run, ids, np.ones_like(ids), (), frozenset({MEAN}))
            for _ in range(8)]
    assert not any(run.result(WAIT_S).new_shape for run in runs)


# --- a real server ----------------------------------------------------------------------

def mixed_traffic(address: str, seed: int, callers: int = 6, requests: int = 8) -> list[list[int]]:
    """Callers at once, each sending requests of 1-4 sequences of random lengths 1-128
    (pooled vectors, some with token embeddings), so batches form at many shapes."""
    def caller(k: int) -> list[list[int]]:
        rnd = random.Random(seed * 100 + k)
        sent = []
        with EncoderClient(address) as client:
            for _ in range(requests):
                batch = [[rnd.randrange(1000, 30000) for _ in range(rnd.randint(1, 128))]
                         for _ in range(rnd.randint(1, 4))]
                client.embed(token_ids=batch, token_embeddings=rnd.random() < 0.3)
                sent += batch
        return sent

    with ThreadPoolExecutor(callers) as pool:
        return [s for sent in pool.map(caller, range(callers)) for s in sent]


@pytest.fixture(scope="module")
def bucket_server(tiny_artifact):
    with ServerProcess(tiny_artifact, "--shape-buckets", "on", "--intra-op-threads", "1") as server:
        yield server


def test_a_bucketed_server_warms_up_before_serving_and_never_meets_a_new_shape(bucket_server):
    log = bucket_server.output()
    assert "event=warm_up lane=0 shapes=28/28" in log
    assert re.search(r"event=warmed_up model=\S+ shapes=28 threads=1 seconds=", log)
    before = bucket_server.scrape()
    assert sample(before, UNSEEN, graph="embeddings") == 0
    sent = mixed_traffic(bucket_server.address, seed=1)
    after = bucket_server.scrape()
    assert sample(after, "attnserve_batch_size_sum") - sample(before, "attnserve_batch_size_sum") == len(sent)
    assert sample(after, UNSEEN, graph="embeddings") == 0


def test_without_buckets_the_same_traffic_meets_new_shapes(tiny_artifact):
    """The control: the default CPU server (no buckets) counts the new shapes the same
    traffic brings, so the counter above could have moved."""
    with ServerProcess(tiny_artifact, "--intra-op-threads", "1") as server:
        mixed_traffic(server.address, seed=1)
        assert sample(server.scrape(), UNSEEN, graph="embeddings") > 10


def test_fixed_buffers_in_two_lanes_answer_as_the_model_does_alone(tiny_artifact):
    """--cuda-graphs on without CUDA: fixed IO-bound input and output buffers per bucket
    (what a CUDA graph replays), two lanes on two inference threads. Every caller gets what
    the graph gives its sequence alone: pooled (mean and normalised CLS) and token
    embeddings, although the buffers are reused batch after batch."""
    reference = OrtBackend(load_artifact(tiny_artifact), device="cpu", intra_op_threads=1)
    rnd = random.Random(7)
    texts = [[rnd.randrange(1000, 30000) for _ in range(rnd.randint(1, 128))] for _ in range(24)]
    with ServerProcess(tiny_artifact, "--shape-buckets", "on", "--cuda-graphs", "on",
                       "--sessions", "2", "--intra-op-threads", "1") as server:
        assert re.search(r"event=warmed_up model=\S+ shapes=28 threads=2", server.output())

        def call(ids: list[int]):
            with EncoderClient(server.address) as client:
                return (client.embed(token_ids=[ids], token_embeddings=True)[0],
                        client.embed(token_ids=[ids], pooling="cls", normalize=True)[0])

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(call, texts))
        assert sample(server.scrape(), UNSEEN, graph="embeddings") == 0
    cls = pooled_output("cls", True)
    for ids, (plain, normalised) in zip(texts, answers, strict=True):
        array = np.asarray([ids], dtype=np.int64)
        alone = reference.run(array, np.ones_like(array), outputs=frozenset({HIDDEN_OUTPUT, MEAN, cls}))
        np.testing.assert_allclose(plain.token_embeddings, alone.hidden[0], atol=1e-5)
        np.testing.assert_allclose(plain.pooled, alone.pooled[MEAN][0], atol=1e-5)
        np.testing.assert_allclose(normalised.pooled, alone.pooled[cls][0], atol=1e-5)


def test_cuda_graphs_without_shape_buckets_is_refused_at_start(tiny_artifact):
    done = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(tiny_artifact), "--device", "cpu",
                           "--cuda-graphs", "on", "--shape-buckets", "off", "--check-config"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--cuda-graphs: needs shape buckets" in done.stderr
    done = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(tiny_artifact), "--device", "cpu",
                           "--cuda-graphs", "on", "--check-config"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2  # auto buckets are off on the CPU
    assert "--cuda-graphs: needs shape buckets" in done.stderr
