"""The deployment against the real program.

- The container args of each overlay (and of the KServe predictor) parse with
  `attnserve serve --check-config` against a real artifact.
- A real server, started with the cpu overlay's args on free loopback ports and
  serving two models, answers grpc.health.v1 SERVING and GET /health 200 on the
  ports it was told (the ones the probes and Services use), exports every metric
  that the alert rules, the dashboard and the autoscaler's adapter rule read,
  labels with `model` exactly the series that the dashboard filters and the rules
  group by model, and on SIGTERM exits within the pod's grace period.

Needs the `tiny_artifact` fixture (tests/conftest.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from attnserve.cli import main
from attnserve.client import EncoderClient
from tests.harness import ATTNSERVE, ServerProcess, free_port

from .helpers import (
    EXPORTED_METRICS,
    MODEL_LABELLED,
    OVERLAYS,
    REPO,
    SERVE_FLAGS,
    find,
    kserve_predictor_pod,
    only_container,
)

# The second model the live server serves, beside the artifact's own name: the dashboard
# and the rules split by model, so the scrape they are checked against has two.
SECOND_MODEL = "second"
# Per-model counters that move only on their event (a batch held back for memory, a
# sequence dropped, a shape never run): a call to each model may leave them without a
# sample, and so without labels to check.
COUNTED_ON_AN_EVENT = {
    "attnserve_memory_waits_total",
    "attnserve_dropped_sequences_total",
    "attnserve_unseen_shape_runs_total",
}


def clean_env() -> dict[str, str]:
    """The environment without ATTNSERVE_* twins: the container sets none."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")}


def container_args(rendered, kserve_isvc, where: str) -> list[str]:
    if where == "kserve":
        return only_container(kserve_predictor_pod(kserve_isvc)["spec"])["args"]
    return only_container(find(rendered[where], "Deployment")["spec"]["template"]["spec"])["args"]


def check_config(artifact, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*ATTNSERVE, "serve", "--check-config", "--artifact", str(artifact), *args],
        cwd=REPO,
        env=clean_env(),
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("where", [*OVERLAYS, "kserve"])
def test_container_args_pass_check_config(tiny_artifact, rendered, kserve_isvc, where):
    """--check-config runs start-up's own checks, the device included: on a machine without
    CUDA the GPU pods' `--device=cuda` must fail for that reason alone, and everything else
    in their args pass with the device set to the CPU."""
    args = container_args(rendered, kserve_isvc, where)
    out = check_config(tiny_artifact, args)
    if out.returncode != 0 and "--device=cuda" in args:
        assert out.returncode == 2 and "--device cuda" in out.stderr, f"{where}: {out.stderr}"
        out = check_config(tiny_artifact, [*args, "--device=cpu"])
    assert out.returncode == 0, f"{where}: {out.stdout}{out.stderr}"


def test_the_deployment_contract_names_every_serve_flag(capsys):
    """helpers.SERVE_FLAGS (what the manifests may use) is the real command's flag list,
    read from its usage line."""
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    usage = capsys.readouterr().out.split("\n\n", 1)[0]
    assert SERVE_FLAGS == set(re.findall(r"\[?(--[a-z][a-z-]*)", usage)) - {"--help"}


@pytest.mark.parametrize("bad", ["--drain-secondz=20", "--device=gpu", "--port=grpc"])
def test_check_config_rejects_a_bad_flag(tiny_artifact, rendered, kserve_isvc, bad):
    args = [*container_args(rendered, kserve_isvc, "cpu"), bad]
    out = check_config(tiny_artifact, args)
    assert out.returncode == 2 and bad.split("=")[0] in out.stderr, out.stderr


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        # service "" is what the kubelet's grpc probe asks when none is named.
        return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def exported_names(exposition: str) -> set[str]:
    """Metric names in a scrape, histogram suffixes stripped: every family
    (a labelled histogram with no observations yet has only its # TYPE line)."""
    names = set()
    for line in exposition.splitlines():
        m = re.match(r"# TYPE (\S+) (\S+)", line)
        if m:
            name, kind = m.groups()
            names.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
        elif line and not line.startswith("#"):
            names.add(re.sub(r"_(bucket|sum|count)$", "", re.split(r"[{\s]", line, maxsplit=1)[0]))
    return names


@pytest.fixture(scope="module")
def live_server(tiny_artifact, rendered):
    """`attnserve serve` with the cpu overlay's args; host and ports overridden (the last
    flag wins) so that it runs on free loopback ports, and the tiny artifact served a
    second time, as SECOND_MODEL."""
    port, http_port = free_port(), free_port()
    overrides = ["--host", "127.0.0.1", "--port", str(port), "--metrics-host", "127.0.0.1",
                 "--metrics-port", str(free_port()), "--http-port", str(http_port), "--device", "cpu",
                 "--artifact", f"{SECOND_MODEL}={tiny_artifact}"]
    with ServerProcess(tiny_artifact, *container_args(rendered, None, "cpu"), *overrides) as server:
        assert server.port == port, "the server did not bind the port it was told"
        assert server.http_port == http_port, "the server did not bind the HTTP port it was told"
        yield server


def test_server_serves_health_on_the_grpc_port(live_server):
    assert health(live_server.port) == health_pb2.HealthCheckResponse.SERVING


def test_server_serves_the_readiness_path_on_the_http_port(live_server):
    with urllib.request.urlopen(f"{live_server.http_url}/health", timeout=5) as response:
        assert response.status == 200


def test_every_metric_read_by_rules_dashboard_and_adapter_is_exported(live_server, used_metrics):
    exposition = scrape(live_server.metrics_port)
    exported = exported_names(exposition)
    missing = {name: sorted(where) for name, where in used_metrics.items() if name not in exported}
    assert not missing, f"read by the deployment but not in the scrape: {missing}"
    # The health alert and the absent() alert read these two directly.
    assert re.search(r"^attnserve_health_serving 1(\.0)?$", exposition, re.MULTILINE)
    assert re.search(r"^attnserve_info\{", exposition, re.MULTILINE)
    assert not EXPORTED_METRICS - exported, "helpers.EXPORTED_METRICS names metrics the server lacks"


def test_the_series_split_by_model_are_those_the_server_labels(live_server):
    """After a call to each model, every sample of a name in helpers.MODEL_LABELLED (what
    the dashboard filters by $model and the rules group by model) carries the model it was
    counted for, and no sample of another attnserve metric carries a model label: a
    dashboard filter on one of those would show nothing."""
    with EncoderClient(live_server.address) as client:
        models = {m.model for m in client.list_models()}
        assert len(models) == 2 and SECOND_MODEL in models, models
        for model in models:
            client.embed(token_ids=[[101, 7592, 2088, 102]], model=model)
    labels: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(scrape(live_server.metrics_port)):
        for sample in family.samples:
            name = re.sub(r"_(bucket|sum|count)$", "", sample.name)
            if name in EXPORTED_METRICS:
                labels.setdefault(name, []).append(sample.labels)
    labelled = {name for name, samples in labels.items() if any("model" in s for s in samples)}
    assert labelled == MODEL_LABELLED & labels.keys()
    assert not MODEL_LABELLED - labels.keys() - COUNTED_ON_AN_EVENT, "a call moved none of them"
    for name in labelled:
        # "" is a call refused before it named a model (ListModels names none).
        assert {s.get("model") for s in labels[name]} <= models | {""}, name
    assert {s["model"] for s in labels["attnserve_info"]} == models
    assert {s["model"] for s in labels["attnserve_queue_depth"]} == models
    embedded = {s["model"] for s in labels["attnserve_requests_total"] if s["rpc"] == "Embed"}
    assert embedded == models


def test_sigterm_exits_within_the_grace_period(live_server, rendered):
    """Runs last in this module: it stops the server."""
    proc = live_server.proc
    pod = find(rendered["cpu"], "Deployment")["spec"]["template"]["spec"]
    pre_stop = only_container(pod)["lifecycle"]["preStop"]["sleep"]["seconds"]
    budget = pod["terminationGracePeriodSeconds"] - pre_stop
    started = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(budget)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {budget}s after SIGTERM: the kubelet would SIGKILL it")
    assert proc.returncode == 0, live_server.output()
    assert time.monotonic() - started < budget
