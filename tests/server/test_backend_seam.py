"""The backend seam, and the data plane built in this process on top of it.

A second backend is one module and one registration: the test's own backend below (an
embedding table looked up in numpy, of an artifact whose manifest says runtime "lookup")
registers with server/runtime/backend.py and is then built, placed, warmed and run by the
server's own runners, queues, batch loops and data plane, exactly as onnxruntime's is.
Two such models share one memory budget: a batch of one waits for the other's batch in
flight when both would not fit, and runs as soon as that one ends."""

import asyncio
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from attnserve.artifact import (
    HIDDEN_OUTPUT,
    MEMORY_MODEL,
    POOLED_OUTPUTS,
    TOKENIZER,
    Graph,
    Manifest,
    attention_output,
    pooled_output,
    write_manifest,
)
from attnserve.server.call import CallRecord
from attnserve.server.config import ModelSource, ServeConfig
from attnserve.server.engine.embed import embed
from attnserve.server.engine.plane import DataPlane
from attnserve.server.engine.requests import EmbedRequest, Fields, ResponseSize
from attnserve.server.engine.runner import Runners
from attnserve.server.errors import NotFound
from attnserve.server.memory.model import EMBEDDINGS, model_key, save_entries
from attnserve.server.priority import Priority, for_call
from attnserve.server.runtime.backend import BatchOutput, Placement, Strategy, register
from tests.harness import minilm_dir
from tests.server.reliability import assembled

HIDDEN, HEADS, LAYERS, VOCAB = 8, 2, 1, 30522
TABLE = "table.npy"
PROVIDER = "LookupProvider"
WAIT_S = 30


class LookupBackend:
    """A "model" whose hidden state is its ids' rows of an embedding table: enough to tell
    what ran, and nothing of onnxruntime. `gate`: when set, a batch waits for it."""

    provider, device, platform, precision = PROVIDER, "cpu", "numpy_lookup", "fp32"
    concurrency, max_in_flight, beside = 1, 2, False

    def __init__(self, directory: Path):
        self.table = np.load(directory / TABLE)
        self.placement = Placement(PROVIDER, "fp32", "cpu", "the test's lookup", self.platform)
        self.gate: threading.Event | None = None
        self.running, self.ran = threading.Event(), []

    def padded_shape(self, batch: int, longest: int):
        return batch, longest

    def run(self, input_ids, attention_mask, layers=(), outputs=frozenset(), token_type_ids=None):
        self.running.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT_S), "the test never opened the gate"
        self.ran.append(input_ids.shape)
        hidden = self.table[input_ids] * attention_mask[..., None]
        mean = hidden.sum(axis=1) / attention_mask.sum(axis=1, keepdims=True)
        pooled = {pooled_output("mean", False): mean,
                  pooled_output("mean", True): mean / np.linalg.norm(mean, axis=1, keepdims=True)}
        batch, seq = input_ids.shape
        maps = np.full((batch, HEADS, seq, seq), 1.0 / seq, dtype=np.float32)
        return BatchOutput(hidden.astype(np.float32) if HIDDEN_OUTPUT in outputs else None,
                           {layer: maps for layer in layers},
                           {name: v.astype(np.float32) for name, v in pooled.items()
                            if name in outputs})

    def release_memory(self):
        pass

    def bind_thread(self):
        pass

    def warm_up_shapes(self, max_batch_tokens: int):
        return [(1, 8)]

    def warm_up(self, shapes):
        for shape in shapes:
            self.run(np.zeros(shape, dtype=np.int64), np.ones(shape, dtype=np.int64))


class LookupKind:
    """The registration: where a "lookup" artifact runs, and its backend."""

    def place(self, manifest, device, precision):
        return Placement(PROVIDER, "fp32", "cpu", "the test's lookup", LookupBackend.platform)

    def create(self, artifact, device, precision, intra_op_threads, strategy: Strategy):
        return LookupBackend(artifact.directory)


register("lookup", LookupKind())


def lookup_artifact(directory: Path, name: str, seed: int) -> Path:
    """An artifact of the "lookup" runtime: a random table, MiniLM's tokenizer, and a
    memory model of one byte per padded token (so the budget below is in tokens)."""
    directory.mkdir(parents=True)
    np.save(directory / TABLE, np.random.default_rng(seed).standard_normal((VOCAB, HIDDEN))
            .astype(np.float32))
    shutil.copyfile(minilm_dir() / TOKENIZER, directory / TOKENIZER)
    outputs = [HIDDEN_OUTPUT, *POOLED_OUTPUTS]
    graphs = [Graph(TABLE, "fp32", False, False, outputs, 0.0),
              Graph(TABLE, "fp32", True, False, outputs + [attention_output(0)], 0.0)]
    write_manifest(directory, Manifest(name, HIDDEN, LAYERS, HEADS, VOCAB, 512, 0, "mean", 0,
                                       graphs, runtime="lookup"))
    one_byte = {"a": 0.0, "b": 1.0, "c": 0.0, "d": 0.0, "source": "one byte a token"}
    save_entries(directory, {model_key(PROVIDER, "fp32", kind): one_byte
                             for kind in (EMBEDDINGS, "attention")})
    assert (directory / MEMORY_MODEL).is_file()
    return directory


def request(ids: list[list[int]]) -> EmbedRequest:
    return EmbedRequest(names=Fields("token_ids"), size=ResponseSize(lambda _: 0, 1 << 30, ""), token_ids=ids,
                        outputs=frozenset({HIDDEN_OUTPUT, pooled_output("mean", False)}))


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("lookup")
    return [lookup_artifact(root / "a", "lookup-a", 1), lookup_artifact(root / "b", "lookup-b", 2)]


def assemble(artifacts: list[Path], budget: int) -> tuple[DataPlane, Runners]:
    """What server/app.py assembles, in this process, on the lookup backend."""
    return assembled(ServeConfig(artifact=tuple(ModelSource(path) for path in artifacts),
                                 device="cpu", memory_budget_bytes=budget))


def test_a_second_backend_serves_through_the_seam_alone(artifacts):
    async def scenario():
        plane, runners = assemble(artifacts, 1 << 30)
        runners.start()
        await runners.warm_up()
        assert [r.backend.platform for r in runners.models] == ["numpy_lookup"] * 2
        ids = [[101, 2000, 3000, 102], [101, 7, 102]]
        for name in ("lookup-a", "lookup-b", None):
            model = plane.model(name)
            embedded = await embed(model, request(ids), plane.holds(), None)
            table = runners.models[0 if name in ("lookup-a", None) else 1].backend.table
            for sequence, result in zip(ids, embedded.results, strict=True):
                np.testing.assert_array_equal(result.hidden, table[sequence])
                np.testing.assert_allclose(result.pooled[pooled_output("mean", False)],
                                           table[sequence].mean(axis=0), rtol=1e-6)
        info = plane.model("lookup-b").model_info()
        assert (info.model, info.platform, info.provider, info.hidden_size) == (
            "lookup-b", "numpy_lookup", PROVIDER, HIDDEN)
        with pytest.raises(NotFound) as missing:
            plane.model("x" * 5000)
        assert "'lookup-a', 'lookup-b'" in missing.value.message
        assert len(missing.value.message) < 300 and missing.value.field == "model"
    asyncio.run(scenario())


def test_models_share_one_budget(artifacts):
    """A budget of 1,000 bytes, a byte a token: model a's batch of 600 tokens runs held at
    its gate; model b's 600 tokens would not fit beside it, so b waits (its batch never
    reaches its backend) until a's ends, then runs."""
    async def scenario():
        plane, runners = assemble(artifacts, 1000)
        runners.start()
        await runners.warm_up()
        a, b = (r.backend for r in runners.models)
        a.gate, a.running = threading.Event(), threading.Event()
        first = asyncio.create_task(embed(plane.model("lookup-a"), request(
            [[1000] * 300, [1001] * 300]), plane.holds(), None))
        for _ in range(WAIT_S * 100):
            if a.running.is_set():
                break
            await asyncio.sleep(0.01)
        assert a.running.is_set()
        assert runners.budget.in_flight_bytes() == 600
        runs_of_b = len(b.ran)
        second = asyncio.create_task(embed(plane.model("lookup-b"), request(
            [[1002] * 300, [1003] * 300]), plane.holds(), None))
        # b's batch loop has formed its batch and held it back for memory.
        def waits() -> float:
            return plane.metrics.registry.get_sample_value("attnserve_memory_waits_total",
                                                           {"model": "lookup-b"}) or 0.0
        for _ in range(WAIT_S * 100):
            if waits():
                break
            await asyncio.sleep(0.01)
        assert waits() >= 1
        assert len(b.ran) == runs_of_b and not second.done()
        assert not runners.models[1].batch_loop.in_flight
        a.gate.set()
        await asyncio.wait_for(asyncio.gather(first, second), WAIT_S)
        assert len(b.ran) == runs_of_b + 1 and b.ran[-1] == (2, 300)
        assert runners.budget.in_flight_bytes() == 0
    asyncio.run(scenario())


def test_a_calls_class_reaches_its_models_queue_and_its_series(artifacts):
    """A call whose door set it bulk (priority.for_call), recorded as a door records it:
    its sequences wait in the bulk lane, it counts in flight under its model once routed,
    and its wait and its latency are series of the bulk class."""
    async def scenario():
        plane, runners = assemble(artifacts, 1 << 30)
        runners.start()
        await runners.warm_up()
        a = runners.models[0].backend
        a.gate, a.running = threading.Event(), threading.Event()
        registry = plane.metrics.registry

        def value(name: str, **labels) -> float:
            return registry.get_sample_value(name, labels) or 0.0

        async def call(priority: Priority | None):
            record = CallRecord(plane.metrics, "Embed")
            if priority is not None:
                for_call(priority)
            try:
                return await embed(plane.model("lookup-a"), request([[1000] * 3, [1001] * 3]),
                                   plane.holds(), None)
            finally:
                record.end()

        async def until(condition) -> None:
            for _ in range(WAIT_S * 100):
                if condition():
                    return
                await asyncio.sleep(0.01)
            raise AssertionError("never happened")

        queue = runners.models[0].queue
        # A call of the default class runs first, held at the gate; the bulk call waits.
        held = asyncio.create_task(call(None))
        await until(a.running.is_set)
        task = asyncio.create_task(call(Priority.BULK))
        await until(lambda: queue.depths()[Priority.BULK] == 1)
        assert queue.depths()[Priority.INTERACTIVE] == 0
        assert value("attnserve_inflight_requests", model="lookup-a") == 2
        assert value("attnserve_inflight_requests", model="") == 0
        a.gate.set()
        await asyncio.wait_for(held, WAIT_S)
        embedded = await asyncio.wait_for(task, WAIT_S)
        assert [len(r.hidden) for r in embedded.results] == [3, 3]
        assert value("attnserve_inflight_requests", model="lookup-a") == 0
        assert value("attnserve_queue_wait_seconds_count", model="lookup-a", priority="bulk") == 1
        assert value("attnserve_queue_wait_seconds_count", model="lookup-a",
                     priority="interactive") == 1
        assert value("attnserve_requests_total", rpc="Embed", code="OK", model="lookup-a",
                     priority="bulk") == 1
        # A call of its own, whose door named no class: the default one.
        record = CallRecord(plane.metrics, "ModelInfo")
        plane.model("lookup-b")
        record.end()
        assert value("attnserve_requests_total", rpc="ModelInfo", code="OK", model="lookup-b",
                     priority="interactive") == 1
    asyncio.run(scenario())
