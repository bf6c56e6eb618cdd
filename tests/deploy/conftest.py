"""Fixtures for the deployment tests (deploy/).

The manifests are rendered with the real `kubectl kustomize` and the rules are
checked with the real `promtool`. A missing tool fails the test, never skips
it: a green run must mean the deployment was checked.
"""

from __future__ import annotations

import json

import pytest
import yaml

from .helpers import (
    ADAPTER_VALUES,
    DASHBOARD,
    KSERVE,
    KUSTOMIZATIONS,
    RULES_FILE,
    SCALED_OBJECT,
    dashboard_exprs,
    kustomize,
    metric_names,
    tool,
)


@pytest.fixture(scope="session")
def kubectl() -> str:
    return tool(
        "kubectl",
        "install kubectl >= 1.27 (it carries kustomize); Debian's kubernetes-client package is too old",
    )


@pytest.fixture(scope="session")
def promtool() -> str:
    return tool("promtool", "apt-get install prometheus  (Debian's package ships promtool)")


@pytest.fixture(scope="session")
def rendered(kubectl) -> dict[str, list[dict]]:
    """Every kustomization rendered: {"base": [...], "cpu": [...], "gpu": [...], "keda": [...]}."""
    return {name: kustomize(kubectl, name) for name in KUSTOMIZATIONS}


@pytest.fixture(scope="session")
def rule_groups() -> list[dict]:
    return yaml.safe_load(RULES_FILE.read_text())["groups"]


@pytest.fixture(scope="session")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="session")
def adapter_rules() -> list[dict]:
    return yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]


@pytest.fixture(scope="session")
def scaled_object() -> dict:
    return yaml.safe_load(SCALED_OBJECT.read_text())


@pytest.fixture(scope="session")
def kserve_isvc() -> dict:
    return yaml.safe_load(KSERVE.read_text())


@pytest.fixture(scope="session")
def used_metrics(rule_groups, dashboard, adapter_rules, scaled_object) -> dict[str, set[str]]:
    """Every attnserve_* metric the deployment reads: {name: {where it is read}}."""
    used: dict[str, set[str]] = {}

    def add(expr: str, where: str) -> None:
        for name in metric_names(expr):
            used.setdefault(name, set()).add(where)

    for group in rule_groups:
        for rule in group["rules"]:
            add(rule["expr"], f"{RULES_FILE.name}: {rule.get('alert') or rule.get('record')}")
    for title, expr in dashboard_exprs(dashboard):
        add(expr, f"{DASHBOARD.name}: {title}")
    for rule in adapter_rules:
        add(rule["seriesQuery"], ADAPTER_VALUES.name)
    for trigger in scaled_object["spec"]["triggers"]:
        add(trigger["metadata"]["query"], SCALED_OBJECT.name)
    return used
