"""Priority classes: which waiting work each model's batch loop serves first.

Two classes, highest first:

- `interactive`: a caller waiting on each answer (a search query, a RAG lookup). The
  class of every call that names none, so a server whose callers say nothing batches
  as one queue, and an indexer marks itself (or its API key marks it) `bulk`.
- `bulk`: work whose throughput counts, not each call's latency (indexing a corpus).

How the batch loop orders them, and how it bounds an interactive call's wait behind
bulk work, is server/engine/queue.py's `RequestQueue.first` and the batch loop's cut
(server/engine/batch_loop.py); docs/operations.md states the rule.

A call's class is the call's, not any one request's: its door sets it once (`for_call`),
from what the caller sent and its API key, in the task that serves the call; the data
plane hands it to the queue with the call's sequences and the metrics label the call's
latency with it (`of_call`), as they find the call's timings (server/engine/timings.py)
without a record handed through every signature."""

import enum
from contextvars import ContextVar

from attnserve.server.errors import InvalidArgument, quote


class Priority(enum.Enum):
    INTERACTIVE = "interactive"
    BULK = "bulk"


CLASSES = tuple(Priority)
"""highest first"""
DEFAULT = Priority.INTERACTIVE
NAMES = ", ".join(p.value for p in CLASSES)


def parse(text: str, field: str) -> Priority:
    """A class named by a caller (`field`: where it came from, as the door names it, e.g.
    the `x-priority` header); INVALID_ARGUMENT naming the classes for any other."""
    try:
        return Priority(text.strip().lower())
    except ValueError:
        raise InvalidArgument(field, f"{quote(text)} is not a priority class; the classes "
                                     f"are {NAMES}") from None


_CALL: ContextVar[Priority] = ContextVar("attnserve_call_priority", default=DEFAULT)


def for_call(priority: Priority) -> None:
    """The class of the call the running task serves."""
    _CALL.set(priority)


def of_call() -> Priority:
    """The class of the call the running task serves: DEFAULT unless its door set one."""
    return _CALL.get()
