"""Paths, contracts and small helpers shared by the deployment tests."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
DATA = Path(__file__).resolve().parent / "data"
KUSTOMIZATIONS = {
    "base": DEPLOY / "k8s" / "base",
    "cpu": DEPLOY / "k8s" / "overlays" / "cpu",
    "gpu": DEPLOY / "k8s" / "overlays" / "gpu",
    "keda": DEPLOY / "k8s" / "overlays" / "keda",
}
OVERLAYS = ["cpu", "gpu", "keda"]
IMAGE_OF = {"cpu": "cpu", "gpu": "gpu", "keda": "cpu"}
"""the image (and device) each overlay runs: keda is the cpu overlay scaled by KEDA"""
RULES_FILE = DEPLOY / "prometheus" / "attnserve-rules.yml"
DASHBOARD = DEPLOY / "grafana" / "attnserve.json"
ADAPTER_VALUES = DEPLOY / "prometheus" / "prometheus-adapter-values.yaml"
SCALED_OBJECT = KUSTOMIZATIONS["keda"] / "scaledobject.yaml"
KSERVE = DEPLOY / "kserve" / "inferenceservice.yaml"
DOCKER = DEPLOY / "docker"

# The flags of `attnserve serve` (the server's contract); test_consistency.py
# checks the manifests against the real CLI as well.
SERVE_FLAGS = {
    "--artifact",
    "--host",
    "--port",
    "--metrics-host",
    "--metrics-port",
    "--http-port",
    "--http-max-body-bytes",
    "--http-header-timeout-seconds",
    "--http-body-timeout-seconds",
    "--device",
    "--max-batch-tokens",
    "--max-batch-size",
    "--max-wait-ms",
    "--max-queue-requests",
    "--max-queue-tokens",
    "--bulk-batch-ms",
    "--priority-aging-ms",
    "--interactive-window-ms",
    "--max-chunking-chars",
    "--default-prompt-name",
    "--memory-budget-bytes",
    "--drain-seconds",
    "--max-message-bytes",
    "--max-connection-age-seconds",
    "--intra-op-threads",
    "--shape-buckets",
    "--bucket-seq-multiple",
    "--sessions",
    "--workers",
    "--cuda-graphs",
    "--tls-cert",
    "--tls-key",
    "--tls-client-ca",
    "--api-key",
    "--api-key-file",
    "--cors-allow-origin",
    "--otlp-endpoint",
    "--log-level",
    "--ready-file",
    "--check-config",
    "--precision",
}

# The metric names the server exports (the observability contract), in two sets:
# test_consistency.py reads the real ones from a live scrape of a server of two models.
# Those counted per model, with a `model` label: the dashboard filters these, and only
# these, by its `model` variable.
MODEL_LABELLED = {
    "attnserve_request_duration_seconds",
    "attnserve_requests_total",
    "attnserve_stage_duration_seconds",
    "attnserve_batch_size",
    "attnserve_batch_tokens",
    "attnserve_sequence_length_tokens",
    "attnserve_inference_duration_seconds",
    "attnserve_batch_peak_memory_bytes",
    "attnserve_batch_predicted_memory_bytes",
    "attnserve_queue_depth",
    "attnserve_queue_wait_seconds",
    "attnserve_inflight_requests",
    "attnserve_info",
    "attnserve_dropped_sequences_total",
    "attnserve_unseen_shape_runs_total",
    "attnserve_memory_waits_total",
}
# ... and the pod's own: device memory, health, worker deaths.
EXPORTED_METRICS = MODEL_LABELLED | {
    "attnserve_device_memory_used_bytes",
    "attnserve_device_memory_total_bytes",
    "attnserve_health_serving",
    "attnserve_worker_deaths_total",
}

_METRIC_RE = re.compile(r"\battnserve_[A-Za-z0-9_]+")
_SUFFIX_RE = re.compile(r"_(bucket|sum|count)$")
_SELECTOR_RE = re.compile(r"\b(attnserve_[A-Za-z0-9_]+)(?:\{([^}]*)\})?")


def selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, its label matchers) for each attnserve_* selector in a PromQL
    expression, the name's histogram suffix stripped: `attnserve_batch_size_sum{pod=~"a"}`
    is ("attnserve_batch_size", 'pod=~"a"')."""
    return [(_SUFFIX_RE.sub("", name), matchers) for name, matchers in _SELECTOR_RE.findall(expr)]


def metric_names(expr: str) -> set[str]:
    """attnserve_* metric names in a PromQL expression, histogram suffixes stripped.

    Recording rules (attnserve:...) and label values such as ".*attnserve.*"
    do not match: a metric name here is `attnserve_` followed by a word.
    """
    return {_SUFFIX_RE.sub("", m) for m in _METRIC_RE.findall(expr)}


def tool(name: str, install_hint: str) -> str:
    """Path of a command-line tool; fails (never skips) the test when it is missing."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not on PATH; the deployment tests need it: {install_hint}")
    return path


def strict(schema):
    """A CRD's schema with additionalProperties: false wherever properties are listed: the
    API server prunes unknown fields of a custom resource silently, and kubectl (>= 1.27,
    --validate=strict by default) rejects them."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def crd_validator(path: Path) -> jsonschema.Draft7Validator:
    """A validator of a CRD's openAPIV3Schema kept in data/, in its strict form."""
    schema = strict(yaml.safe_load(path.read_text()))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def kustomize(kubectl: str, name: str) -> list[dict]:
    out = subprocess.run(
        [kubectl, "kustomize", str(KUSTOMIZATIONS[name])],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"kubectl kustomize {name} failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def find(objs: list[dict], kind: str, name: str | None = None) -> dict:
    hits = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def only_container(pod_spec: dict) -> dict:
    assert len(pod_spec["containers"]) == 1, "one container per attnserve pod"
    return pod_spec["containers"][0]


def flag_values(args: list[str]) -> dict[str, list[str]]:
    """{"--device": ["cuda"], ...} from `--flag=value` / `--flag value` args."""
    values: dict[str, list[str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        assert arg.startswith("--"), f"stray argument {arg!r} in {args}"
        if "=" in arg:
            flag, value = arg.split("=", 1)
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            flag, value = arg, args[i + 1]
            i += 1
        else:
            flag, value = arg, ""
        values.setdefault(flag, []).append(value)
        i += 1
    return values


def dashboard_exprs(dash: dict) -> list[tuple[str, str]]:
    """(panel title, expr) for every query in the dashboard."""
    return [
        (panel["title"], target["expr"]) for panel in dash["panels"] for target in panel.get("targets", [])
    ]


# KServe fields of a predictor that are not PodSpec fields (the ones used here).
KSERVE_PREDICTOR_FIELDS = {"minReplicas", "maxReplicas", "scaleMetric", "scaleTarget"}


def kserve_predictor_pod(isvc: dict) -> dict:
    """The predictor of an InferenceService as the Pod KServe would run."""
    spec = dict(isvc["spec"]["predictor"])
    for field in KSERVE_PREDICTOR_FIELDS:
        spec.pop(field, None)
    # The security lint's accepted findings travel with it (checkov reads them
    # from annotations).
    lint_skips = {
        k: v for k, v in isvc["metadata"].get("annotations", {}).items() if k.startswith("checkov.io/skip")
    }
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": isvc["metadata"]["name"] + "-predictor",
            "namespace": "attnserve",
            "annotations": lint_skips,
        },
        "spec": spec,
    }
