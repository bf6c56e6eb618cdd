"""The state a server's processes share (--workers): one page of memory (a memfd the
supervisor makes and every process inherits), read and written in place: what every
process must see at once, without a message. The ledger's totals and the keys' counts
change under a lock that spans the processes (a POSIX record lock on the memfd, with a
thread lock for the threads of one process), so the budget and the caps hold for the
group exactly; every other field has one writer."""

import contextlib
import ctypes
import fcntl
import mmap
import os
import threading
from collections.abc import Callable

from attnserve.server.config import MAX_MODELS, MAX_WORKERS
from attnserve.server.keys import MAX_CAPPED_KEYS
from attnserve.server.memory.ledger import Totals

ENGINE_SLOT = MAX_WORKERS
"""the ledger slot of the engine process (a front end's is its index)"""
DRAINED, DRAIN_TIMED_OUT = 1, 2
STANDBY = "standby"
"""a front end's index on its command line while it waits to replace one that died"""
CONFIG_ENV = "ATTNSERVE_INTERNAL_CONFIG"
"""the environment variable a process of the group finds its settings in, as JSON"""
FRONT_ENDS_METRICS_ENV = "ATTNSERVE_INTERNAL_METRICS_DIR"
"""where the engine process finds the front ends' metric files (they find it in
prometheus-client's own PROMETHEUS_MULTIPROC_DIR)"""


class _Fields(ctypes.Structure):
    _fields_ = [
        ("supervisor_pid", ctypes.c_int64),
        ("engine_pid", ctypes.c_int64),
        # The engine's budget and ledger limit are set: front ends may start.
        ("engine_loaded", ctypes.c_int64),
        ("engine_warm", ctypes.c_int64),
        ("draining", ctypes.c_int64),
        ("metrics_port", ctypes.c_int64),
        ("workers", ctypes.c_int64),
        ("budget", ctypes.c_double),
        ("ledger_limit", ctypes.c_double),
        ("ledger_reserve", ctypes.c_double),
        ("ledger_batches", ctypes.c_double),
        # Each model's queue (in --artifact's order).
        ("queue_requests", ctypes.c_int64 * MAX_MODELS),
        ("queue_tokens", ctypes.c_int64 * MAX_MODELS),
        ("held", ctypes.c_int64 * (MAX_WORKERS + 1)),
        ("worker_pids", ctypes.c_int64 * MAX_WORKERS),
        ("worker_up", ctypes.c_int64 * MAX_WORKERS),
        # Set once a front end has drained: DRAINED, or DRAIN_TIMED_OUT.
        ("worker_drained", ctypes.c_int64 * MAX_WORKERS),
        ("engine_drained", ctypes.c_int64),
        # The pid of the standby front end once it is loaded and waiting.
        ("standby_waiting_pid", ctypes.c_int64),
        # Each front end's calls in flight per capped API key (ApiKey.slot).
        ("key_calls", (ctypes.c_int64 * MAX_CAPPED_KEYS) * MAX_WORKERS),
    ]


class SharedState:
    """The shared page, mapped: made by `create` (the supervisor), or from the inherited fd."""

    def __init__(self, fd: int):
        self.fd = fd
        self.map = mmap.mmap(fd, ctypes.sizeof(_Fields))
        self.fields = _Fields.from_buffer(self.map)
        self._threads = threading.Lock()

    @classmethod
    def create(cls, workers: int) -> "SharedState":
        fd = os.memfd_create("attnserve-shared", 0)  # no MFD_CLOEXEC: children inherit it
        os.ftruncate(fd, ctypes.sizeof(_Fields))
        state = cls(fd)
        state.fields.workers = workers
        state.fields.supervisor_pid = os.getpid()
        return state

    @contextlib.contextmanager
    def locked(self):
        """Exclusive across the group's processes and this process's threads."""
        with self._threads:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
            try:
                yield self.fields
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def held(self) -> int:
        """Bytes held in the ledger by every process of the group."""
        f = self.fields
        return sum(f.held[:f.workers]) + f.held[ENGINE_SLOT]

    def serving(self) -> bool:
        """What health says for the group: the engine warm, no drain, a front end up. Only
        its own calls fail with a front end that dies: the others go on serving."""
        f = self.fields
        return (bool(f.engine_warm) and not f.draining
                and any(f.worker_up[i] for i in range(f.workers)))

    def whole(self) -> bool:
        """Serving, with every front end up: the group has started."""
        f = self.fields
        return self.serving() and all(f.worker_up[i] for i in range(f.workers))

    def pids(self) -> list[int]:
        f = self.fields
        return [p for p in (f.engine_pid, *f.worker_pids[:f.workers]) if p]


def _shared_field(name: str) -> property:
    return property(lambda self: getattr(self.state.fields, name),
                    lambda self, value: setattr(self.state.fields, name, value))


class SharedTotals(Totals):
    """The memory ledger's totals for one process of the group (its `slot`), counted with
    every other process's: what the group holds is the sum of the slots."""

    def __init__(self, state: SharedState, slot: int):
        self.state, self.slot = state, slot

    limit = property(lambda self: self.state.fields.ledger_limit)
    held = property(lambda self: self.state.held())
    reserve = _shared_field("ledger_reserve")
    batches = _shared_field("ledger_batches")

    def add(self, nbytes: int) -> None:
        # Only this process writes its slot, and the ledger's lock orders its threads.
        self.state.fields.held[self.slot] += nbytes

    def exclusive(self):
        return self.state.locked()


class SharedKeyCounts:
    """A front end's count of capped API keys' calls in flight (keys.InFlightCounts),
    checked against the group's: its own row of the shared page, the rows summed under the
    group's lock. A front end that dies takes its row with it (the supervisor zeroes it).
    `index()`: the front end's index (a standby learns its own once it takes a place)."""

    def __init__(self, state: SharedState, index: Callable[[], int]):
        self.state, self.index = state, index

    def take(self, slot: int, cap: int) -> bool:
        with self.state.locked() as f:
            if sum(f.key_calls[i][slot] for i in range(f.workers)) >= cap:
                return False
            f.key_calls[self.index()][slot] += 1
            return True

    def give(self, slot: int) -> None:
        with self.state.locked() as f:
            f.key_calls[self.index()][slot] -= 1
