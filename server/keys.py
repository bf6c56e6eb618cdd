"""API keys: who may call, and what a key says of its calls (docs/configuration.md,
"Security", gives the key file's format: `<key> [class=interactive|bulk] [max_inflight=N]`).
Keys are compared in constant time; with no key configured every call is let through, of
the class it names."""

import hmac
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from attnserve.server.errors import InvalidArgument, RetryLater, Unauthenticated
from attnserve.server.priority import DEFAULT, Priority, for_call, parse

CLASS, MAX_INFLIGHT = "class", "max_inflight"
MAX_CAPPED_KEYS = 64
"""keys with a max_inflight (their counts live in the --workers group's shared page)"""
RETRY_AFTER_S = 1
"""a capped key's refusal says to retry after this many seconds: a call's usual length"""


@dataclass(frozen=True)
class ApiKey:
    secret: bytes
    priority: Priority | None = None
    """the class of every call made with it; None: the class each call names"""
    max_inflight: int = 0
    """0: no cap"""
    slot: int = -1
    """a capped key's place among the in-flight counts"""


class InFlightCounts(Protocol):
    """Calls in flight per capped key (by its slot)."""

    def take(self, slot: int, cap: int) -> bool:
        """Count one more call unless `cap` are in flight already; whether it was counted."""

    def give(self, slot: int) -> None:
        ...


class LocalCounts:
    """One process's counts: every call is taken and given on its event loop."""

    def __init__(self):
        self.counts: Counter[int] = Counter()

    def take(self, slot: int, cap: int) -> bool:
        if self.counts[slot] >= cap:
            return False
        self.counts[slot] += 1
        return True

    def give(self, slot: int) -> None:
        self.counts[slot] -= 1


def read_key_file(path: Path) -> list[ApiKey]:
    """The keys of a key file (docs/configuration.md's format), refused naming the line at fault."""
    keys, capped = [], 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        secret, *settings = line.split()
        where = f"--api-key-file {path}, line {number}"
        values: dict[str, str] = {}
        for setting in settings:
            name, equals, value = setting.partition("=")
            if not equals or name not in (CLASS, MAX_INFLIGHT) or name in values:
                raise ValueError(f"{where}: {setting[:32]!r} is not a setting; a key takes "
                                 f"{CLASS}=<{'|'.join(p.value for p in Priority)}> and "
                                 f"{MAX_INFLIGHT}=<calls>, once each")
            values[name] = value
        try:
            priority = parse(values[CLASS], f"{where}: {CLASS}") if CLASS in values else None
        except InvalidArgument as err:
            raise ValueError(err.message) from None
        cap = values.get(MAX_INFLIGHT, "0")
        if not cap.isdigit() or (MAX_INFLIGHT in values and int(cap) < 1):
            raise ValueError(f"{where}: {MAX_INFLIGHT}={cap[:16]!r}: a count of calls, at least 1")
        slot = -1
        if int(cap):
            slot, capped = capped, capped + 1
            if capped > MAX_CAPPED_KEYS:
                raise ValueError(f"{where}: at most {MAX_CAPPED_KEYS} keys may carry {MAX_INFLIGHT}")
        keys.append(ApiKey(secret.encode("utf-8", "surrogateescape"), priority, int(cap), slot))
    if not keys:
        raise ValueError(f"--api-key-file {path}: holds no key")
    return keys


class ApiKeys:
    """The keys a caller may present, from --api-key and --api-key-file; `counts`: where
    capped keys' calls are counted (LocalCounts in one process, the shared page's with
    --workers)."""

    def __init__(self, key: str | None, key_file: Path | None, counts: InFlightCounts | None = None):
        self.keys = [ApiKey(key.encode("utf-8", "surrogateescape"))] if key else []
        if key_file is not None:
            self.keys += read_key_file(key_file)
        self.counts = counts or LocalCounts()

    def __bool__(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | None) -> ApiKey | None:
        """The key `authorization` carries (else Unauthenticated); None with no key configured."""
        if not self.keys:
            return None
        if authorization is None:
            raise Unauthenticated("authorization: missing; send 'Authorization: Bearer <api key>'")
        scheme, _, presented = authorization.strip().partition(" ")
        given = presented.strip().encode("utf-8", "surrogateescape")
        # Every key compared, whether or not an earlier one matched: the time taken says
        # nothing about which key, or how much of one, was right.
        matched = [key for key in self.keys if hmac.compare_digest(key.secret, given)]
        if scheme.lower() != "bearer" or not matched:
            raise Unauthenticated("authorization: not a valid API key")
        return matched[0]

    def admit(self, key: ApiKey | None, named: str | None, field: str) -> Callable[[], None]:
        """Set the running call's class (what the caller named in `field`, if anything, or
        its key's) and count it under its key's cap; returns what ends the count, called
        once the call has been answered. RetryLater when the key's calls are at its cap."""
        for_call(parse(named, field) if named else DEFAULT)
        if key is not None and key.priority is not None:
            for_call(key.priority, keyed=True)
        if key is None or not key.max_inflight:
            return lambda: None
        if not self.counts.take(key.slot, key.max_inflight):
            raise RetryLater(f"authorization: this API key's calls are at its cap of {key.max_inflight} in "
                             f"flight ({MAX_INFLIGHT}); retry after {RETRY_AFTER_S} s", RETRY_AFTER_S)
        return lambda: self.counts.give(key.slot)
