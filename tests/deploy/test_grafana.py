"""The Grafana dashboard: importable (datasource variable, unique ids, no
overlapping panels), every query is valid PromQL, reads only exported metrics,
filters every per-model series by the `model` variable and splits its panels by
model, and the panels an operator needs (traffic, batching, priority classes, memory
against sequence length, memory waits, device memory) are there."""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from .helpers import EXPORTED_METRICS, MODEL_LABELLED, dashboard_exprs, metric_names, selectors

# Grafana's variables, replaced by values of the same PromQL type for promtool.
GRAFANA_VARS = {
    "$__rate_interval": "1m",
    "$__range": "1h",
    "$namespace": ".*",
    "$pod": ".*",
    "$model": ".*",
}
MODEL_FILTER = 'model=~"$model"'
# An aggregation and its `by (...)` labels, if any: `sum by (model, le) (`, `sum(`.
AGGREGATION_RE = re.compile(r"\b(sum|avg|min|max|count|topk|bottomk|quantile)\s*(?:by\s*\(([^)]*)\))?\s*\(")


def panels(dash):
    return [p for p in dash["panels"] if p["type"] != "row"]


def test_datasource_is_a_variable(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in panels(dashboard):
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    for name in ("namespace", "pod", "model"):
        assert variables[name]["datasource"]["uid"] == "${datasource}"
    # No hard-wired data source anywhere: the dashboard imports into any Grafana.
    assert "__inputs" not in dashboard


def test_model_variable_lists_the_models_of_the_pods_chosen(dashboard):
    names = [v["name"] for v in dashboard["templating"]["list"]]
    model = dashboard["templating"]["list"][names.index("model")]
    # After pod, so that it lists only the models the chosen pods serve.
    assert names.index("model") > names.index("pod")
    query = 'label_values(attnserve_info{namespace=~"$namespace", pod=~"$pod"}, model)'
    assert model["query"]["query"] == query and model["definition"] == query
    assert model["type"] == "query" and model["multi"] and model["includeAll"]
    # All as `.*`, which also matches the series of calls that named no model (model="").
    assert model["allValue"] == ".*"


def test_per_model_series_are_filtered_by_model_and_the_others_are_not(dashboard):
    """A selector of a series the server counts per model (helpers.MODEL_LABELLED, checked
    against a live scrape in test_consistency.py) carries model=~"$model"; one of the
    pod's own series (device memory, in flight) carries no model matcher, which would
    match nothing."""
    for title, expr in dashboard_exprs(dashboard):
        for name, matchers in selectors(expr):
            if name in MODEL_LABELLED:
                assert MODEL_FILTER in matchers, f"{title}: {name}{{{matchers}}} is not filtered by model"
            else:
                assert "model" not in matchers, f"{title}: {name} has no model label"


def test_per_model_panels_are_split_by_model(dashboard):
    """Every aggregation over per-model series keeps `model`, and each series' legend names
    it: two models' batches never add up into one line."""
    for panel in panels(dashboard):
        for target in panel["targets"]:
            expr = target["expr"]
            if not metric_names(expr) & MODEL_LABELLED:
                continue
            for _, by in AGGREGATION_RE.findall(expr):
                assert "model" in [label.strip() for label in by.split(",")], f"{panel['title']}: {expr}"
            if target.get("format") != "table":
                assert "{{model}}" in target["legendFormat"], panel["title"]


def test_ids_unique_and_panels_do_not_overlap(dashboard):
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells = {}
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_queries_read_only_exported_metrics(dashboard):
    for title, expr in dashboard_exprs(dashboard):
        unknown = metric_names(expr) - EXPORTED_METRICS
        assert not unknown, f"{title}: {unknown} are not exported by the server"


def test_queries_are_valid_promql(dashboard, promtool, tmp_path):
    rules = []
    for i, (title, expr) in enumerate(dashboard_exprs(dashboard)):
        for var, value in GRAFANA_VARS.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"{title}: unknown Grafana variable in {expr}"
        rules.append({"record": f"dashboard:query{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize(
    "metric, selector",
    [
        ("attnserve_requests_total", "by (model, rpc)"),
        ("attnserve_request_duration_seconds", "histogram_quantile(0.99"),
        ("attnserve_request_duration_seconds", "histogram_quantile(0.5"),
        ("attnserve_request_duration_seconds", "histogram_quantile(0.9,"),
        ("attnserve_requests_total", 'code!="OK"'),
        ("attnserve_batch_tokens", 'kind="real"'),
        ("attnserve_batch_tokens", 'kind="padded"'),
        ("attnserve_queue_depth", "by (pod, model, priority)"),
        ("attnserve_inflight_requests", "by (pod, model)"),
        ("attnserve_queue_wait_seconds", "by (model, priority, le)"),
        ("attnserve_request_duration_seconds", "by (model, priority, le)"),
        ("attnserve_dropped_sequences_total", "by (model, priority, reason)"),
        ("attnserve_batch_size", ""),
        ("attnserve_batch_peak_memory_bytes", "by (model, seq_len_bucket, attention)"),
        ("attnserve_batch_predicted_memory_bytes", "by (model, seq_len_bucket, attention)"),
        ("attnserve_inference_duration_seconds", "by (model, seq_len_bucket, attention, le)"),
        ("attnserve_memory_waits_total", "by (model)"),
        ("attnserve_info", MODEL_FILTER),
        ("attnserve_device_memory_used_bytes", ""),
        ("attnserve_device_memory_total_bytes", ""),
    ],
)
def test_asked_for_panels_are_there(dashboard, metric, selector):
    assert any(metric in metric_names(expr) and selector in expr for _, expr in dashboard_exprs(dashboard)), (
        f"no query reads {metric} {selector}"
    )


def test_padding_ratio_is_padded_over_real(dashboard):
    (panel,) = [p for p in panels(dashboard) if p["title"] == "Padding ratio"]
    numerator, denominator = panel["targets"][0]["expr"].split(" / ")
    assert 'kind="padded"' in numerator and 'kind="real"' in denominator


def test_measured_and_predicted_memory_side_by_side(dashboard):
    by_title = {p["title"]: p for p in panels(dashboard)}
    measured = by_title["Peak memory per batch by seq_len bucket (measured)"]
    predicted = by_title["Peak memory per batch by seq_len bucket (predicted)"]
    assert measured["gridPos"]["y"] == predicted["gridPos"]["y"]
    assert measured["fieldConfig"]["defaults"]["unit"] == "bytes"
    assert predicted["fieldConfig"]["defaults"]["unit"] == "bytes"


def test_measured_over_predicted_memory_per_bucket(dashboard):
    """Both histograms observe the same batches, so the sum of measured peaks over the sum
    of predicted ones, per model and bucket, is the ratio an operator judges the memory
    model by: green between 0.8 and 1.1."""
    (panel,) = [p for p in panels(dashboard) if p["title"].startswith("Measured / predicted peak memory")]
    (target,) = panel["targets"]
    numerator, denominator = target["expr"].split(" / ")
    by = "sum by (model, seq_len_bucket, attention)"
    assert numerator.startswith(by) and "attnserve_batch_peak_memory_bytes_sum" in numerator
    assert denominator.startswith(by) and "attnserve_batch_predicted_memory_bytes_sum" in denominator
    assert "_count" not in target["expr"]
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["unit"] == "none"
    steps = defaults["thresholds"]["steps"]
    assert [(s["color"], s["value"]) for s in steps] == [("red", None), ("green", 0.8), ("red", 1.1)]
