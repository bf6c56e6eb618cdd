"""Priority classes: which waiting work each model's batch loop serves first
(docs/operations.md, "Priority classes"): `interactive`, a caller waiting on each answer,
the class of every call that names none; `bulk`, work whose throughput counts. The batch
loop's order is server/engine/queue.py's `RequestQueue.first` and its cut batch_loop.py's.

A call's class is the call's, not any one request's: its door sets it in the task that
serves the call (keys.py's `ApiKeys.admit`), and the Submission made for the call's
sequences takes it (`of_call`), as the metrics do, without a record handed through every
signature."""

import enum
from collections.abc import Callable
from contextvars import ContextVar

from attnserve.server.errors import InvalidArgument, quote


class Priority(enum.StrEnum):
    """A str equal to its value: hashed in C where the queue's lanes and the metrics' series
    are looked up on every call, and a label or a log field as it is."""

    INTERACTIVE = "interactive"
    BULK = "bulk"


CLASSES = tuple(Priority)  # highest first
DEFAULT = Priority.INTERACTIVE
NAMES = ", ".join(p.value for p in CLASSES)
HEADER = "x-priority"
"""the HTTP header, and gRPC metadata key, a caller names its call's class in"""


def parse(text: str, field: str) -> Priority:
    """A class named by a caller (`field`: where it came from, as the door names it, e.g.
    the `x-priority` header); INVALID_ARGUMENT naming the classes for any other."""
    try:
        return Priority(text.strip().lower())
    except ValueError:
        raise InvalidArgument(field, f"{quote(text)} is not a priority class; the classes "
                                     f"are {NAMES}") from None


_CALL: ContextVar[Priority] = ContextVar("attnserve_call_priority", default=DEFAULT)
_KEYED: ContextVar[bool] = ContextVar("attnserve_call_priority_keyed", default=False)


def for_call(priority: Priority, keyed: bool = False) -> None:
    """The class of the call the running task serves; `keyed`: its API key's, which what
    the caller names (`asked`) does not change."""
    _CALL.set(priority)
    _KEYED.set(keyed)


def asked(text: str, field: str) -> Callable[[], None]:
    """A request names its class in `field` (where one call carries several requests, as
    a stream does): refused (INVALID_ARGUMENT naming the classes) when it is none, the
    call's unless its API key fixed the class. Returns what gives the call back the class
    it had."""
    priority = parse(text, field)
    if _KEYED.get():
        return lambda: None
    token = _CALL.set(priority)
    return lambda: _CALL.reset(token)


def of_call() -> Priority:
    """The class of the call the running task serves: DEFAULT unless its door set one."""
    return _CALL.get()
