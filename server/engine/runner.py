"""What runs the models, in the process that runs them: each model's backend sessions, its
memory model against the budget every model shares, its request queue and batch loop, and
their warm-up. Every start-up check happens while they are built, with nothing bound yet.

Each model has its own inference thread(s): a batch of one model runs beside a batch of
another, so a flood of calls to one model delays another's by sharing the device, never by
queueing behind it (`python -m bench fairness` measures it)."""

import asyncio
import functools
import logging
import time
from collections.abc import Callable

from attnserve.artifact import MEMORY_MODEL, Artifact, ArtifactError
from attnserve.server.config import ServeConfig
from attnserve.server.engine.batch_loop import BatchLoop
from attnserve.server.engine.offload import inference_pool, on_every_thread
from attnserve.server.engine.queue import Limits, RequestQueue
from attnserve.server.engine.registry import NamedArtifact
from attnserve.server.host import machine_available_bytes
from attnserve.server.memory.batch_time import BatchTimes, load_time_model
from attnserve.server.memory.budget import MemoryBudget, ModelMemory
from attnserve.server.memory.ledger import Totals
from attnserve.server.memory.model import load_memory_model
from attnserve.server.memory.probe import MemoryProbe
from attnserve.server.metrics import Metrics
from attnserve.server.runtime.backend import Backend, Strategy, create_backend

log = logging.getLogger("attnserve.server")

# A batch may take this share of the memory that is free when the server starts.
DEFAULT_BUDGET_SHARE = 0.5


class ModelRunner:
    """One model's backend, memory, request queue and batch loop (started by `Runners.start`)."""

    def __init__(self, name: str, artifact: Artifact, backend: Backend, memory: ModelMemory,
                 limits: Limits, metrics: Metrics, probe: MemoryProbe, times: BatchTimes):
        self.name, self.artifact, self.backend = name, artifact, backend
        self.memory, self.limits, self.metrics, self.times = memory, limits, metrics, times
        self.inference = inference_pool(name, backend.concurrency, backend.bind_thread)
        bind_beside = functools.partial(backend.bind_thread, beside=True)
        self.beside = inference_pool(f"{name}-beside", 1, bind_beside) if backend.beside else None
        self.queue = RequestQueue(name, limits, memory, metrics)
        self.batch_loop = BatchLoop(name, self.queue, backend, self.inference, self.beside, metrics,
                                    probe, limits, memory, times, artifact.manifest.pad_token_id)
        self.warm = False
        """both graphs have run on every inference thread"""

    async def warm_up(self) -> None:
        """Warm only once both graphs have run, every shape bucket included, on every
        inference thread's sessions: the first caller must not pay for it."""
        shapes = self.backend.warm_up_shapes(self.limits.max_batch_tokens)
        threads, started = self.backend.concurrency, time.perf_counter()
        log.info("event=warm_up_start model=%s shapes=%d threads=%d", self.name, len(shapes), threads)
        await asyncio.gather(*map(asyncio.wrap_future, on_every_thread(
            self.inference, threads, lambda: self.backend.warm_up(shapes))))
        if self.beside is not None:  # its thread started and bound, on sessions just warmed
            await asyncio.wrap_future(self.beside.submit(lambda: None))
        log.info("event=warmed_up model=%s shapes=%d threads=%d seconds=%.2f", self.name,
                 len(shapes), threads, time.perf_counter() - started)
        self.warm = True


class Runners:
    """Every model the process runs, in the order named (the first is the default), under
    one memory budget on one device."""

    def __init__(self, config: ServeConfig, models: list[NamedArtifact], metrics: Metrics,
                 totals: Callable[[float], Totals] = Totals, alone: bool = True):
        """`totals(limit)`: the memory ledger's totals, under that limit (shared by a
        server's processes with --workers); `alone`: no other process of the server needs
        the cores (with --workers the front ends do)."""
        self.config, self.metrics = config, metrics
        # A backend's threads spin between operations only where nothing else needs the
        # cores: one model, one process.
        strategy = Strategy(config.shape_buckets, config.bucket_seq_multiple, config.max_batch_size,
                            config.sessions, config.cuda_graphs == "on",
                            spinning=alone and len(models) == 1)
        backends = []
        for m in models:
            try:
                backends.append(create_backend(m.artifact, config.device, config.precision,
                                               config.intra_op_threads, strategy))
            except ArtifactError as err:
                raise ArtifactError(f"--artifact {m.source}: {err}") from err
        devices = {b.device for b in backends}
        if len(devices) > 1:
            where = ", ".join(f"{m.name} on {b.device}" for m, b in zip(models, backends, strict=True))
            raise ArtifactError(f"--artifact: every model must run on one device ({where}); set --device")
        self.device = devices.pop()
        self.probe = MemoryProbe(cuda=self.device == "cuda")
        budget = config.memory_budget_bytes or int(self.probe.available_bytes() * DEFAULT_BUDGET_SHARE)
        self.limits = Limits.of(config, budget)
        # On CUDA the budget is the device's; requests and responses live in host memory,
        # under a limit of their own.
        shared = self.device == "cpu"
        ledger_limit = budget if shared else int(machine_available_bytes() * DEFAULT_BUDGET_SHARE)
        self.budget = MemoryBudget(budget, responses_in_budget=shared, totals=totals(ledger_limit))
        self.models: list[ModelRunner] = []
        for named, backend in zip(models, backends, strict=True):
            manifest = named.artifact.manifest
            try:
                memory_model = _fitted(named.artifact, backend, load_memory_model, "memory")
                # Measured batch times where memory_model.json has no time model for them.
                times = BatchTimes(_fitted(named.artifact, backend, load_time_model, "time"),
                                   manifest.num_heads, f"{MEMORY_MODEL} has no time model for "
                                   f"{backend.provider}/{backend.precision}")
            except ArtifactError as err:
                raise ArtifactError(f"--artifact {named.source}: {err}") from err
            memory = self.budget.for_model(named.name, memory_model, manifest.num_heads, manifest.hidden_size)
            self.models.append(ModelRunner(named.name, named.artifact, backend, memory,
                                           self.limits, metrics, self.probe, times))

    @property
    def warm(self) -> bool:
        return all(m.warm for m in self.models)

    def describe(self) -> None:
        """What /metrics says of the models and the device."""
        live, memory = self.metrics.live, self.probe.device_memory()
        live.info = {m.name: {"provider": m.backend.provider, "precision": m.backend.precision,
                              "artifact_sha256": m.artifact.manifest_sha256} for m in self.models}
        live.device, live.device_memory_total = memory.device, memory.total
        live.device_memory_used = lambda: self.probe.device_memory().used

    def start(self, watch: Callable[[str, int, int], None] | None = None) -> None:
        """Every model's queue and batch loop; `watch(model, requests, tokens)`: told each
        queue's counts as they change."""
        for m in self.models:
            m.queue.watch = None if watch is None else (
                lambda requests, tokens, name=m.name: watch(name, requests, tokens))
            m.batch_loop.start()
            self.metrics.live.queue_depth[m.name] = m.queue.depths

    async def warm_up(self) -> None:
        await asyncio.gather(*(m.warm_up() for m in self.models))

    async def drain(self, seconds: float) -> bool:
        """Finish what every model accepted, within `seconds` in all."""
        return all(await asyncio.gather(*(m.queue.drain(seconds) for m in self.models)))

    def memory_source(self) -> str:
        return "; ".join(f"{m.name}: {m.memory.model.source}" for m in self.models)

    def time_source(self) -> str:
        return "; ".join(f"{m.name}: {m.times.source}" for m in self.models)


def _fitted(artifact: Artifact, backend: Backend, load: Callable, what: str):
    """The artifact's fitted `what` model (memory, time) for the backend's provider and
    precision, as `load` reads it from memory_model.json."""
    try:
        return load(artifact.directory, artifact.manifest, backend.provider, backend.precision)
    except (ValueError, TypeError) as err:
        raise ArtifactError(f"{artifact.path(MEMORY_MODEL)}: not a valid {what} model ({err})") from err
