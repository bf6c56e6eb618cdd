"""`attnserve serve --workers N`: the process that starts the group (the engine process, N
front ends and a standby), keeps it whole and drains it (docs/architecture.md, "Worker
processes"). Its ready file lists every pid but the standby's, written once the standby waits."""

import contextlib
import ctypes
import dataclasses
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from attnserve.server.config import ServeConfig, config_to_json
from attnserve.server.host import gpu_present, usable_cores
from attnserve.server.metrics import answered_by_code
from attnserve.server.startup import PortInUse, write_ready_file
from attnserve.server.workers import signals
from attnserve.server.workers.shared import CONFIG_ENV, DRAINED, FRONT_ENDS_METRICS_ENV, STANDBY, SharedState

log = logging.getLogger("attnserve.workers")

POLL_S = 0.05
MAX_AUTO_WORKERS = 8
# How long the engine may take to load the artifact and open its sessions before the
# front ends start (they need its budget): generous, CUDA sessions take a while.
ENGINE_LOAD_TIMEOUT_S = 600
# A standby that died waiting is started again after this long at the soonest.
STANDBY_RESTART_S = 5.0
# Told to stop, each process gets the drain time and this much more to exit.
EXIT_GRACE_S = 5.0


def reserve_port(host: str, port: int, flag: str) -> socket.socket:
    """A socket bound to the port (not listening: it takes no connections) that holds it
    for this server's front ends, which bind it too with SO_REUSEPORT. A port someone
    else holds fails first, with a message naming the flag; port 0 picks a free one."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    if port:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as err:
                raise PortInUse(flag, f"{host}:{port}") from err
    holder = socket.socket(family, kind, proto)
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    holder.bind(address)
    return holder


class Group:
    def __init__(self, config: ServeConfig, workers: int):
        self.config, self.count = config, workers
        self.shared = SharedState.create(workers)
        self.ports = [reserve_port(config.host, config.port, "--port")]
        if config.http_port:
            self.ports.append(reserve_port(config.host, config.http_port, "--http-port"))
        port = self.ports[0].getsockname()[1]
        http_port = self.ports[1].getsockname()[1] if config.http_port else 0
        self.front_config = dataclasses.replace(config, port=port, http_port=http_port)
        self.metrics_dir = tempfile.mkdtemp(prefix="attnserve-metrics-")
        self.address = f"attnserve-{os.getpid()}-{secrets.token_hex(8)}"
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(b"\0" + self.address.encode())
        self.listener.listen(64)
        self.engine: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen | None] = [None] * workers
        self.standby: tuple[subprocess.Popen, int] | None = None
        """a front end started and loaded, waiting to take a dead one's place, and the
        pipe its index is written to"""
        self.stopping = False

    def _start_engine(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
        env |= {CONFIG_ENV: config_to_json(self.config), FRONT_ENDS_METRICS_ENV: self.metrics_dir}
        self.engine = self._spawn("engine_process", [], (self.listener.fileno(),), env)

    def _front_end(self, index: str, *fds: int) -> subprocess.Popen:
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": self.metrics_dir,
               CONFIG_ENV: config_to_json(self.front_config)}
        return self._spawn("front_end", [index, self.address], fds, env)

    def _spawn(self, module: str, args: list[str], fds: tuple[int, ...], env: dict) -> subprocess.Popen:
        """`python -m` a module of the group: the shared state's fd, `args`, then `fds`."""
        with signals.starting_a_child():
            return subprocess.Popen([sys.executable, "-m", f"attnserve.server.workers.{module}",
                                     str(self.shared.fd), *args, *map(str, fds)],
                                    pass_fds=(self.shared.fd, *fds), env=env)

    def _start_worker(self, index: int) -> None:
        """Front end `index`: the standby, told to take that place, where one is up (a
        replacement that only binds its ports), else a new process."""
        standby, self.standby = self.standby, None
        taking = standby is not None and standby[0].poll() is None
        worker = self.workers[index] = standby[0] if taking else self._front_end(str(index))
        self.shared.fields.worker_pids[index] = worker.pid  # before the standby connects
        if standby is not None:  # its pipe closed, taken or found dead
            if taking:
                with contextlib.suppress(BrokenPipeError):  # died since: the next poll sees it
                    os.write(standby[1], f"{index}\n".encode())
            os.close(standby[1])

    def _standby_waits(self) -> bool:
        """The standby is loaded and waiting (or has died: the group serves without one)."""
        process = self.standby[0] if self.standby is not None else None
        return (process is None or process.poll() is not None
                or self.shared.fields.standby_waiting_pid == process.pid)

    def _standby_wanted(self) -> bool:
        """No standby waits (the last took a dead front end's place, or died): start
        another, but not more often than STANDBY_RESTART_S after one that died waiting."""
        if self.standby is None:
            return True
        process, pipe = self.standby
        if process.poll() is None:
            return False
        if time.monotonic() - self.standby_started < STANDBY_RESTART_S:
            return False
        log.warning("event=standby_died pid=%d code=%d note='started again'", process.pid,
                    process.returncode)
        os.close(pipe)
        self.standby = None
        return True

    def _start_standby(self) -> None:
        read, write = os.pipe()
        try:
            self.standby = (self._front_end(STANDBY, read), write)
            self.standby_started = time.monotonic()
        finally:
            os.close(read)

    def _forget_worker(self, index: int) -> None:
        """A front end is gone: what it held in the ledger and its live gauges with it."""
        worker = self.workers[index]
        with self.shared.locked() as fields:
            fields.held[index] = 0
            ctypes.memset(fields.key_calls[index], 0, ctypes.sizeof(fields.key_calls[index]))
            fields.worker_up[index] = fields.worker_pids[index] = fields.worker_drained[index] = 0
        mark_process_dead(worker.pid, self.metrics_dir)

    def _stop(self, signum, frame) -> None:
        self.stopping = True

    def run(self) -> int:
        for sig in signals.GROUP_SIGNALS:
            signal.signal(sig, self._stop)
        try:
            return self._run()
        finally:
            for holder in self.ports:
                holder.close()
            self.listener.close()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _run(self) -> int:
        fields = self.shared.fields
        self._start_engine()
        started = time.monotonic()
        while not fields.engine_loaded:
            if self.engine.poll() is not None:
                log.error("event=startup_failed process=engine code=%d", self.engine.returncode)
                return 2
            if self.stopping or time.monotonic() - started > ENGINE_LOAD_TIMEOUT_S:
                return self._shut_down(1 if not self.stopping else 0)
            time.sleep(POLL_S)
        for index in range(self.count):
            self._start_worker(index)
        # The standby loads beside the front ends, so that its loading never competes with
        # the calls of a group that serves.
        self._start_standby()
        ready_written, ever_up = False, [False] * self.count
        while not self.stopping:
            if self.engine.poll() is not None:
                log.error("event=engine_died code=%d note='stopping the group: the pod restarts'",
                          self.engine.returncode)
                fields.draining = 1
                return self._shut_down(1)
            for index, worker in enumerate(self.workers):
                ever_up[index] |= bool(fields.worker_up[index])
                if worker.poll() is None:
                    continue
                if not ever_up[index]:
                    log.error("event=startup_failed process=worker worker=%d code=%d", index,
                              worker.returncode)
                    return self._shut_down(2)
                log.warning("event=worker_died worker=%d pid=%d code=%d note='started again'",
                            index, worker.pid, worker.returncode)
                self._forget_worker(index)
                self._start_worker(index)
            if not ready_written and self.shared.whole() and self._standby_waits():
                ready_written = True
                self._ready()
            if ready_written and self._standby_wanted():
                self._start_standby()
            time.sleep(POLL_S)
        return self._shut_down(0)

    def _ready(self) -> None:
        config, fields, pids = self.front_config, self.shared.fields, self.shared.pids()
        log.info("event=serving workers=%d port=%d http_port=%d metrics_port=%d tls=%s mtls=%s "
                 "pids=%s", self.count, config.port, config.http_port, fields.metrics_port,
                 config.tls_cert is not None, config.tls_client_ca is not None,
                 ",".join(map(str, pids)))
        if config.ready_file is not None:
            write_ready_file(config.ready_file, {"port": config.port, "http_port": config.http_port,
                                                 "metrics_port": fields.metrics_port, "pids": pids})

    def _shut_down(self, code: int) -> int:
        """Drain the front ends, then the engine; `code`, or 1 if one of them failed."""
        self.shared.fields.draining = 1
        log.info("event=draining workers=%d seconds=%.0f", self.count, self.config.drain_seconds)
        standby = [self.standby[0]] if self.standby is not None else []
        timeout = self.config.drain_seconds + EXIT_GRACE_S
        failed = _stop_all([w for w in self.workers if w is not None] + standby, timeout)
        failed |= _stop_all([self.engine], timeout)
        fields = self.shared.fields
        finished = bool(fields.engine_drained) and all(fields.worker_drained[i] == DRAINED
                                                       for i in range(self.count))
        # Calls the group answered by status, from every front end's counts.
        answered = CollectorRegistry()
        MultiProcessCollector(answered, self.metrics_dir)
        code = code or int(failed)
        log.info("event=stopped all_finished=%s answered=%s code=%d", finished,
                 answered_by_code(answered.collect()), code)
        return code


def _stop_all(processes: list[subprocess.Popen], timeout: float) -> bool:
    """STOP each (those still running), wait for all; True if one did not exit 0."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signals.STOP)
    deadline, failed = time.monotonic() + timeout, False
    for process in processes:
        try:
            code = process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            code = process.wait()
        failed |= code != 0
    return failed


def workers_for(config: ServeConfig) -> int:
    """--workers as a number, or `auto` resolved for the device and the cores."""
    if config.workers != "auto":
        return int(config.workers)
    cuda = config.device == "cuda" or (config.device == "auto" and gpu_present()[0])
    return auto_workers(cuda, usable_cores())


def auto_workers(cuda: bool, cores: int) -> int:
    """One process on the CPU, where the model takes every core a front end would want
    (a group pays off there only for a model far cheaper than its callers' calls:
    `python -m bench workers`); on a GPU, a front end for every two cores, up to
    MAX_AUTO_WORKERS, the rest left to the engine process."""
    return max(1, min(MAX_AUTO_WORKERS, cores // 2)) if cuda else 1


def supervise(config: ServeConfig, workers: int) -> int:
    return Group(config, workers).run()
