"""The keda overlay's ScaledObject against KEDA's own CRD schema (v2.20.2's, kept in
data/ as the ServiceMonitor's is), in the strict form kubectl applies; and its trigger
against what KEDA's Prometheus scaler reads."""

from __future__ import annotations

import copy

import pytest

from .helpers import DATA, crd_validator, find

SCHEMA_FILE = DATA / "keda-scaledobject-v1alpha1-openapiv3schema.yaml"
# The trigger metadata KEDA's Prometheus scaler reads (pkg/scalers/prometheus_scaler.go,
# v2.20.2): anything else in `metadata` is ignored without a word.
PROMETHEUS_METADATA = {"serverAddress", "query", "queryParameters", "threshold",
                       "activationThreshold", "namespace", "customHeaders", "ignoreNullValues",
                       "unsafeSsl", "awsRegion", "timeout", "identityOwner"}
PROMETHEUS_REQUIRED = {"serverAddress", "query", "threshold"}


@pytest.fixture(scope="module")
def validator():
    return crd_validator(SCHEMA_FILE)


def test_scaledobject_matches_the_crd_schema(rendered, validator):
    scaled = find(rendered["keda"], "ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(scaled)]
    assert not errors, errors


def test_the_trigger_is_what_the_prometheus_scaler_reads(rendered):
    (trigger,) = find(rendered["keda"], "ScaledObject")["spec"]["triggers"]
    metadata = trigger["metadata"]
    assert PROMETHEUS_REQUIRED <= set(metadata) <= PROMETHEUS_METADATA, set(metadata)
    assert metadata["serverAddress"].startswith(("http://", "https://"))
    assert float(metadata["threshold"]) > 0


@pytest.mark.parametrize(
    "mutate, why",
    [
        (lambda s: s["spec"].update(minReplicas=2), "the HPA's name, not KEDA's"),
        (lambda s: s["spec"].update(maxReplicaCount="ten"), "not an integer"),
        (lambda s: s["spec"].update(triggers=[]), "no trigger"),
        (lambda s: s["spec"]["triggers"][0]["metadata"].update(threshold=4), "metadata values are strings"),
        (lambda s: s["spec"].pop("scaleTargetRef"), "no target"),
        (lambda s: s["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
         .update(stabilisationWindowSeconds=300), "misspelt behaviour field"),
    ],
)
def test_schema_rejects_a_broken_scaledobject(rendered, validator, mutate, why):
    scaled = copy.deepcopy(find(rendered["keda"], "ScaledObject"))
    mutate(scaled)
    assert list(validator.iter_errors(scaled)), why
