"""A real Prometheus server (Debian's `prometheus` package) on loopback scrapes a running
attnserve every second; a query through its HTTP API returns the request count this test
produced."""

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import grpc
import pytest

from attnserve.client import EncoderClient
from tests.harness import ServerProcess, free_port

PROMETHEUS_START_S = 30
SCRAPED_WITHIN_S = 30


def query(port: int, expression: str) -> list[dict]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.load(response)
    assert body["status"] == "success", body
    return body["data"]["result"]


class Prometheus:
    def __init__(self, target: str, directory):
        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("prometheus not found: install Debian's `prometheus` package "
                        "(apt-get install -y prometheus)")
        config = directory / "prometheus.yml"
        config.write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: attnserve\n    static_configs:\n"
            f"      - targets: ['{target}']\n")
        self.port = free_port()
        self.log = (directory / "prometheus.log").open("w+")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={config}", f"--storage.tsdb.path={directory / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.log_path = directory / "prometheus.log"
        deadline = time.monotonic() + PROMETHEUS_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2):
                    return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"prometheus not ready in {PROMETHEUS_START_S}s:\n{self.output()}")

    def output(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


def test_prometheus_scrapes_the_request_count(tiny_artifact, tmp_path):
    server = ServerProcess(tiny_artifact)
    prometheus = None
    try:
        prometheus = Prometheus(f"127.0.0.1:{server.metrics_port}", tmp_path)
        made = 0
        with EncoderClient(server.address) as client:
            for n in (3, 9, 27, 81):
                client.embed(token_ids=[[1000 + i for i in range(n)]])
                made += 1
            client.embed(token_ids=[[1000, 1001]], attention_layers=[])
            made += 1
            with pytest.raises(grpc.RpcError):
                client.embed(token_ids=[[-1]])
            made += 1
            client.model_info()
            made += 1
        seen, up = None, None
        deadline = time.monotonic() + SCRAPED_WITHIN_S
        while time.monotonic() < deadline:
            result = query(prometheus.port, "sum(attnserve_requests_total)")
            seen = float(result[0]["value"][1]) if result else None
            if seen == made:
                break
            time.sleep(0.5)
        up = query(prometheus.port, 'up{job="attnserve"}')
        assert seen == made, (f"Prometheus saw {seen} requests, the test made {made} "
                              f"(up={up}):\n{prometheus.output()}")
        assert [float(r["value"][1]) for r in up] == [1.0]
        errors = query(prometheus.port,
                       'sum by (code) (attnserve_requests_total{code!="OK"})')
        assert {r["metric"]["code"]: float(r["value"][1]) for r in errors} == {
            "INVALID_ARGUMENT": 1.0}
    finally:
        if prometheus is not None:
            prometheus.stop()
        server.stop()
