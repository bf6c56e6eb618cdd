"""The ServiceMonitor against the prometheus-operator CRD's own schema.

kubernetes-validate has no schema for CRDs; the ServiceMonitor's openAPIV3Schema
is kept in data/. The API server prunes unknown fields of a CRD silently, and
kubectl (>= 1.27, --validate=strict by default) rejects them, so the schema is
checked here in that strict form: every object schema that lists its
properties allows no others.
"""

from __future__ import annotations

import copy

import pytest

from .helpers import DATA, OVERLAYS, crd_validator, find

SCHEMA_FILE = DATA / "servicemonitor-v1-openapiv3schema.yaml"


@pytest.fixture(scope="module")
def validator():
    return crd_validator(SCHEMA_FILE)


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_servicemonitor_matches_the_crd_schema(rendered, validator, name):
    monitor = find(rendered[name], "ServiceMonitor")
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(monitor)]
    assert not errors, errors


@pytest.mark.parametrize(
    "mutate, why",
    [
        (lambda m: m["spec"]["endpoints"][0].update(prot="metrics"), "unknown field"),
        (lambda m: m["spec"]["endpoints"][0].update(interval="15 seconds"), "bad duration"),
        (lambda m: m["spec"].pop("selector"), "missing selector"),
        (lambda m: m["spec"]["endpoints"][0].update(scheme="grpc"), "bad enum"),
    ],
)
def test_schema_rejects_a_broken_servicemonitor(rendered, validator, mutate, why):
    monitor = copy.deepcopy(find(rendered["base"], "ServiceMonitor"))
    mutate(monitor)
    assert list(validator.iter_errors(monitor)), why
