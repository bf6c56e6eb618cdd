"""`attnserve serve` settings: flags and their ATTNSERVE_* twins go through one validation,
whose errors name where the bad value came from (never a traceback); `--check-config`
reaches the same verdict as starting the server, without binding a port; the ready file
names the ports that serve."""

import json
import os
import subprocess

import pytest

from attnserve.cli import main
from tests.harness import ATTNSERVE, REPO, ServerProcess
from tests.server.reliability import health

# The tests marked `workers` also run against a server of several processes (make test:
# --server-workers 2): those whose answers or accounting cross from the engine to the
# front ends. What a front end refuses on its own is the same code in every process.

# (field, bad value, what the error says about it)
BAD_VALUES = [
    ("device", "gpu", "'gpu' is not one of auto, cuda, cpu"),
    ("precision", "fp8", "'fp8' is not one of auto, fp32, fp16"),
    ("log_level", "loud", "'loud' is not one of debug, info, warning, error"),
    ("port", "grpc", "'grpc' is not an integer"),
    ("drain_seconds", "soon", "'soon' is not a number"),
    ("max_batch_size", "0", "must be at least 1"),
    ("max_wait_ms", "-1", "must not be negative"),
    ("cors_allow_origin", "https://app.example.com/", "'https://app.example.com/': not an origin"),
    ("cors_allow_origin", "http://ok.example,app.example.com", "'app.example.com': not an origin"),
]


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return "ATTNSERVE_" + field.upper()


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")}
    return {**env, **extra}


def check_config(capsys, *args: str) -> tuple[int, str]:
    code = main(["serve", "--check-config", *args])
    return code, capsys.readouterr().err


@pytest.fixture
def no_twins(monkeypatch):
    for name in [k for k in os.environ if k.startswith("ATTNSERVE_")]:
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize("field, value, reason", BAD_VALUES)
def test_a_bad_flag_is_refused_naming_the_flag(tiny_artifact, no_twins, capsys, field, value,
                                                reason):
    code, err = check_config(capsys, "--artifact", str(tiny_artifact), f"{flag(field)}={value}")
    assert code == 2 and f"attnserve serve: {flag(field)}: {reason}" in err, err


@pytest.mark.parametrize("field, value, reason", BAD_VALUES)
def test_a_bad_environment_value_is_refused_naming_the_variable(tiny_artifact, no_twins, capsys,
                                                                 field, value, reason):
    no_twins.setenv(env_name(field), value)
    code, err = check_config(capsys, "--artifact", str(tiny_artifact))
    assert code == 2 and f"attnserve serve: {env_name(field)} (environment): {reason}" in err, err


def test_a_flag_wins_over_its_twin_and_an_empty_twin_is_unset(tiny_artifact, no_twins, capsys):
    no_twins.setenv("ATTNSERVE_DEVICE", "gpu")
    assert check_config(capsys, "--artifact", str(tiny_artifact), "--device", "cpu")[0] == 0
    no_twins.setenv("ATTNSERVE_DEVICE", "")
    no_twins.setenv("ATTNSERVE_ARTIFACT", str(tiny_artifact))
    assert check_config(capsys)[0] == 0
    no_twins.delenv("ATTNSERVE_ARTIFACT")
    code, err = check_config(capsys)
    assert code == 2 and "--artifact: required (or set ATTNSERVE_ARTIFACT)" in err, err


@pytest.mark.workers
def test_a_bad_twin_fails_cleanly_in_a_real_process(tiny_artifact):
    """The whole command, as a container runs it: exit 2, one line, no traceback."""
    out = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(tiny_artifact)], cwd=REPO,
                         env=clean_env(ATTNSERVE_LOG_LEVEL="loud"), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "ATTNSERVE_LOG_LEVEL (environment): 'loud' is not one of" in out.stderr
    assert "Traceback" not in out.stderr


def verdict(command: list[str], env: dict[str, str]) -> tuple[int, str]:
    """Exit code and the `attnserve serve: ...` line of a command expected to fail; one
    that serves instead runs into the timeout, which fails the test."""
    out = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = [line for line in out.stderr.splitlines() if line.startswith("attnserve serve: ")]
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, lines[-1] if lines else out.stderr[-2000:]


def start_up_failures(tmp_path, tiny_artifact) -> dict[str, list[str]]:
    pem = tmp_path / "cert.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n")
    damaged = tmp_path / "artifact"
    damaged.mkdir()
    for path in tiny_artifact.iterdir():
        (damaged / path.name).write_bytes(path.read_bytes())
    (damaged / "memory_model.json").write_text('{"a": "lots"}')
    return {
        "a certificate without its key": ["--tls-cert", str(pem)],
        "a key file that does not exist": ["--tls-cert", str(pem), "--tls-key",
                                           str(tmp_path / "missing.key")],
        "a client CA without a certificate": ["--tls-client-ca", str(pem)],
        "a memory model that does not parse": ["--artifact", str(damaged)],
    }


@pytest.mark.parametrize("case", ["a certificate without its key", "a key file that does not exist",
                                  "a client CA without a certificate",
                                  "a memory model that does not parse"])
def test_check_config_refuses_what_start_up_refuses(tmp_path, tiny_artifact, case):
    flags = ["--artifact", str(tiny_artifact), "--port", "0", "--metrics-port", "0",
             "--http-port", "0", "--device", "cpu", *start_up_failures(tmp_path, tiny_artifact)[case]]
    checked = verdict([*ATTNSERVE, "serve", "--check-config", *flags], clean_env())
    started = verdict([*ATTNSERVE, "serve", *flags], clean_env())
    assert checked[0] == 2, checked
    assert checked == started


@pytest.mark.workers
def test_check_config_and_start_up_agree_on_cuda(tiny_artifact):
    """`--device cuda` never falls back to the CPU: where CUDA cannot run, both refuse it
    for that reason; where it can, both accept it."""
    flags = ["--artifact", str(tiny_artifact), "--device", "cuda"]
    checked = verdict([*ATTNSERVE, "serve", "--check-config", *flags], clean_env())
    if checked[0] == 0:
        assert ServerProcess(tiny_artifact, "--device", "cuda").stop() == 0
        return
    assert checked[0] == 2 and "--device cuda" in checked[1], checked
    assert verdict([*ATTNSERVE, "serve", *flags, "--port", "0", "--metrics-port", "0",
                    "--http-port", "0"], clean_env()) == checked


@pytest.mark.workers
def test_the_ready_file_names_the_ports_that_serve(tiny_server):
    ready = json.loads(tiny_server.ready_path.read_text())
    # With --workers, also every process of the group (its engine and front ends).
    group = {"pids": ready["pids"]} if "pids" in ready else {}
    assert ready == {"port": tiny_server.port, "metrics_port": tiny_server.metrics_port,
                     "http_port": tiny_server.http_port, "pid": tiny_server.proc.pid, **group}
    assert health(tiny_server.address) == "SERVING"
    assert "attnserve_health_serving 1.0" in tiny_server.scrape_text()
    # Written whole: the partial file it was written to has been renamed away.
    assert [p.name for p in tiny_server.ready_path.parent.iterdir()
            if p.name.startswith(".")] == []
