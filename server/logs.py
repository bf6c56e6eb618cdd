"""The log format every process of the server writes: one line per event, key=value."""

import logging
import sys


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr,
        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s",
    )
