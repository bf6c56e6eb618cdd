"""The alert rules: promtool accepts them, they fire when they should, and the
PrometheusRule in the base carries exactly the plain rule file."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from attnserve.server.config import ServeConfig

from .helpers import DATA, EXPORTED_METRICS, MODEL_LABELLED, OVERLAYS, RULES_FILE, find, metric_names

UNIT_TESTS = DATA / "attnserve-rules.test.yml"
BOUND_RECORD = "attnserve:request_duration_seconds:p99_bound"
WAIT_BOUND_RECORD = "attnserve:queue_wait_seconds:interactive_p99_bound"


def promtool_run(promtool: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], check=False, capture_output=True, text=True, timeout=120)


def prometheusrule_groups(rendered) -> list[dict]:
    return find(rendered["base"], "PrometheusRule")["spec"]["groups"]


def rule_sets(rendered) -> dict[str, dict]:
    return {
        "plain file": yaml.safe_load(RULES_FILE.read_text()),
        "PrometheusRule": {"groups": prometheusrule_groups(rendered)},
    }


def test_prometheusrule_is_the_plain_rule_file(rendered):
    assert prometheusrule_groups(rendered) == yaml.safe_load(RULES_FILE.read_text())["groups"], (
        "deploy/k8s/base/prometheusrule.yaml has drifted from"
        " deploy/prometheus/attnserve-rules.yml; regenerate it with the command in its header"
    )


def test_overlays_carry_the_same_prometheusrule(rendered):
    for overlay in OVERLAYS:
        assert find(rendered[overlay], "PrometheusRule")["spec"]["groups"] == prometheusrule_groups(rendered)


def test_promtool_checks_the_plain_rule_file(promtool):
    out = promtool_run(promtool, "check", "rules", str(RULES_FILE))
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_checks_the_prometheusrule(promtool, rendered, tmp_path):
    path = tmp_path / "prometheusrule-groups.yml"
    path.write_text(yaml.safe_dump({"groups": prometheusrule_groups(rendered)}))
    out = promtool_run(promtool, "check", "rules", str(path))
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_rejects_a_broken_rule(promtool, tmp_path):
    rules = yaml.safe_load(RULES_FILE.read_text())
    rules["groups"][1]["rules"][0]["expr"] = "sum by (pod (attnserve_queue_depth)"
    path = tmp_path / "broken.yml"
    path.write_text(yaml.safe_dump(rules))
    assert promtool_run(promtool, "check", "rules", str(path)).returncode != 0


@pytest.mark.parametrize("which", ["plain file", "PrometheusRule"])
def test_alerts_fire_on_the_unit_test_series(promtool, rendered, tmp_path, which):
    """`promtool test rules`: each alert fires on series that should page and
    stays quiet on series that should not (tests/deploy/data/attnserve-rules.test.yml)."""
    rules = rule_sets(rendered)[which]
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)  # the cases pin expressions and labels, not wording
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    cases = yaml.safe_load(UNIT_TESTS.read_text())
    cases["rule_files"] = ["rules.yml"]
    (tmp_path / "cases.yml").write_text(yaml.safe_dump(cases))

    out = promtool_run(promtool, "test", "rules", str(tmp_path / "cases.yml"))
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_alert_has_severity_summary_and_runbook(rule_groups):
    alerts = [r for g in rule_groups for r in g["rules"] if "alert" in r]
    assert {a["alert"] for a in alerts} >= {
        "AttnserveDeviceMemoryHigh",
        "AttnserveP99LatencyHigh",
        "AttnserveInteractiveWaitHigh",
        "AttnserveErrorRatioHigh",
        "AttnserveMemoryUnderpredicted",
        "AttnserveTargetDown",
        "AttnserveNotServing",
        "AttnserveAbsent",
    }
    for alert in alerts:
        assert alert["labels"]["severity"] in {"warning", "critical"}, alert["alert"]
        assert {"summary", "description", "runbook"} <= set(alert["annotations"]), alert["alert"]


def test_latency_bound_is_one_named_constant(rule_groups):
    rules = {r.get("record") or r.get("alert"): r for g in rule_groups for r in g["rules"]}
    assert rules[BOUND_RECORD]["expr"].startswith("vector(")
    assert BOUND_RECORD in rules["AttnserveP99LatencyHigh"]["expr"]


def test_the_interactive_wait_bound_is_one_named_constant_above_the_bulk_cut(rule_groups):
    """The alert reads interactive requests' queue wait against one named bound, which is
    above the default --bulk-batch-ms: at the default cut the alert stays quiet."""
    rules = {r.get("record") or r.get("alert"): r for g in rule_groups for r in g["rules"]}
    bound = rules[WAIT_BOUND_RECORD]["expr"]
    assert bound.startswith("vector(")
    assert float(bound[len("vector("):-1]) > ServeConfig.bulk_batch_ms / 1000
    expr = rules["AttnserveInteractiveWaitHigh"]["expr"]
    assert WAIT_BOUND_RECORD in expr and 'priority="interactive"' in expr


@pytest.mark.parametrize(
    "alert", ["AttnserveP99LatencyHigh", "AttnserveInteractiveWaitHigh", "AttnserveErrorRatioHigh",
              "AttnserveMemoryUnderpredicted"]
)
def test_model_alerts_read_only_series_counted_per_model(rule_groups, alert):
    """An alert that groups by model reads series the server labels with it
    (helpers.MODEL_LABELLED, checked against a live scrape in test_consistency.py): on
    one of the pod's own series `by (model)` would page with no model named. The unit
    test cases show each firing for one model while another is quiet."""
    (expr,) = [r["expr"] for g in rule_groups for r in g["rules"] if r.get("alert") == alert]
    assert "model" in expr
    assert metric_names(expr) <= MODEL_LABELLED, metric_names(expr) - MODEL_LABELLED


def test_health_alerts_cover_down_not_serving_and_absent(rule_groups):
    exprs = {r["alert"]: r["expr"] for g in rule_groups for r in g["rules"] if "alert" in r}
    assert 'up{job=~".*attnserve.*"} == 0' in exprs["AttnserveTargetDown"]
    assert "attnserve_health_serving == 0" in exprs["AttnserveNotServing"]
    assert exprs["AttnserveAbsent"].startswith("absent(")


def test_rules_dashboard_and_adapter_read_only_exported_metrics(used_metrics):
    unknown = {name: sorted(where) for name, where in used_metrics.items() if name not in EXPORTED_METRICS}
    assert not unknown, f"not exported by the server: {unknown}"
