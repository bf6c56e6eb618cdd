"""A scrape of a test server's /metrics."""

import urllib.request

from tests.conftest import ServerProcess


def scrape_text(server: ServerProcess) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        return response.read().decode()
