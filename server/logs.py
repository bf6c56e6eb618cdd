"""The log format every process of the server writes: one line per event, key=value; an
event of a call ends with the call's request_id, so every line of one call can be found."""

import logging
import sys
from collections.abc import Callable
from contextvars import ContextVar

CURRENT_REQUEST_ID: ContextVar[str | None] = ContextVar("attnserve_request_id", default=None)
"""the request id of the call the running task serves (None: no call)"""


class CallIds(logging.Filter):
    """Gives every record its call's ` request_id=...` (empty outside a call)."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = CURRENT_REQUEST_ID.get()
        record.call = "" if request_id is None else f" request_id={request_id}"
        return True


class ClientsDoing(logging.Filter):
    """A library's ERROR with a traceback about what a client did (a request it cannot parse,
    a caller hanging up mid-answer), which any client could repeat at will to flood the log:
    one key=value line at INFO instead. A record whose message starts with `prefix` becomes
    `line` % `values(record, the rest of its message)`."""

    def __init__(self, prefix: str, line: str, values: Callable[[logging.LogRecord, str], tuple]):
        super().__init__()
        self.prefix, self.line, self.values = prefix, line, values

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith(self.prefix):
            record.msg, record.args = self.line, self.values(record, message[len(self.prefix):])
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.exc_info, record.exc_text = None, None
        return True


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s%(call)s")
    for handler in logging.getLogger().handlers:
        handler.addFilter(CallIds())
