"""What owns the model, in the process that runs it: the backend's sessions, the memory
budget, the request queue and the batch loop, and their warm-up. Every start-up check
happens in the constructor, with nothing bound yet."""

import asyncio
import logging
import time
from collections.abc import Callable

from attnserve.artifact import MEMORY_MODEL, Artifact, ArtifactError
from attnserve.server.config import ServeConfig
from attnserve.server.engine.batch_loop import BatchLoop
from attnserve.server.engine.offload import create_executors, on_every_thread
from attnserve.server.engine.queue import Limits, RequestQueue
from attnserve.server.host import machine_available_bytes
from attnserve.server.memory.budget import MemoryBudget
from attnserve.server.memory.ledger import Totals
from attnserve.server.memory.model import load_memory_model
from attnserve.server.memory.probe import MemoryProbe
from attnserve.server.metrics import Metrics
from attnserve.server.runtime.backend import Strategy
from attnserve.server.runtime.backends import create_backend

log = logging.getLogger("attnserve.server")

# A batch may take this share of the memory that is free when the server starts.
DEFAULT_BUDGET_SHARE = 0.5


class Core:
    """The backend, the memory budget, the request queue and the batch loop."""

    def __init__(self, config: ServeConfig, artifact: Artifact, metrics: Metrics,
                 totals: Callable[[float], Totals] = Totals, alone: bool = True):
        """`totals(limit)`: the memory ledger's totals, under that limit (shared by a
        server's processes with --workers); `alone`: no other process of the server needs
        the cores (with --workers the front ends do)."""
        self.config, self.artifact, self.metrics = config, artifact, metrics
        manifest = artifact.manifest
        self.backend = create_backend(artifact, config.device, config.precision,
                                      config.intra_op_threads, Strategy(
                                          config.shape_buckets, config.bucket_seq_multiple,
                                          config.max_batch_size, config.sessions,
                                          config.cuda_graphs == "on", spinning=alone))
        self.probe = MemoryProbe(cuda=self.backend.device == "cuda")
        try:
            self.memory_model = load_memory_model(artifact.directory, manifest,
                                                  self.backend.provider, self.backend.precision)
        except (ValueError, TypeError) as err:
            raise ArtifactError(f"{artifact.path(MEMORY_MODEL)}: not a valid memory model "
                                f"({err})") from err
        budget = config.memory_budget_bytes or int(self.probe.available_bytes() * DEFAULT_BUDGET_SHARE)
        self.limits = Limits.of(config, budget)
        # On CUDA the budget is the device's; requests and responses live in host memory,
        # under a limit of their own.
        shared = self.backend.device == "cpu"
        ledger_limit = budget if shared else int(machine_available_bytes() * DEFAULT_BUDGET_SHARE)
        self.memory = MemoryBudget(self.memory_model, budget, manifest.num_heads,
                                   manifest.hidden_size, responses_in_budget=shared,
                                   totals=totals(ledger_limit))
        self.ready = False

    def describe(self) -> None:
        m, memory = self.metrics, self.probe.device_memory()
        live = m.live
        live.info = {"model": self.artifact.manifest.model_name, "provider": self.backend.provider,
                     "precision": self.backend.precision,
                     "artifact_sha256": self.artifact.manifest_sha256}
        live.device, live.device_memory_total = memory.device, memory.total
        live.device_memory_used = lambda: self.probe.device_memory().used

    def start(self, watch: Callable[[int, int], None] | None = None) -> None:
        """The queue (`watch`: told its counts as they change) and the batch loop, on the
        running event loop."""
        self.executors = create_executors(self.backend.concurrency, self.backend.bind_thread)
        self.queue = RequestQueue(self.limits, self.memory, self.metrics, watch)
        self.batch_loop = BatchLoop(self.queue, self.backend, self.executors.inference,
                                    self.metrics, self.probe, self.limits, self.memory,
                                    self.artifact.manifest.pad_token_id)
        self.batch_loop.start()

    async def warm_up(self) -> None:
        """Ready only once both graphs have run, every shape bucket included, on every
        inference thread's sessions: the first caller must not pay for it."""
        shapes = self.backend.warm_up_shapes(self.limits.max_batch_tokens)
        threads, started = self.executors.inference_threads, time.perf_counter()
        log.info("event=warm_up_start shapes=%d threads=%d", len(shapes), threads)
        await asyncio.gather(*map(asyncio.wrap_future, on_every_thread(
            self.executors.inference, threads, lambda: self.backend.warm_up(shapes))))
        log.info("event=warmed_up shapes=%d threads=%d seconds=%.2f", len(shapes), threads,
                 time.perf_counter() - started)
        self.ready = True
