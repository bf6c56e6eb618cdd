"""Structural checks of the rendered manifests: the pieces that must agree with
each other and with the server (ports, probes, drain time, device, security)."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from .helpers import (
    IMAGE_OF,
    OVERLAYS,
    SERVE_FLAGS,
    find,
    flag_values,
    metric_names,
    only_container,
)

ALL = ["base", *OVERLAYS]


def pod_spec(objs):
    return find(objs, "Deployment")["spec"]["template"]["spec"]


def container(objs):
    return only_container(pod_spec(objs))


def container_ports(objs) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container(objs)["ports"]}


def flags(objs) -> dict[str, list[str]]:
    return flag_values(container(objs)["args"])


def flag(objs, name: str) -> str:
    values = flags(objs).get(name, [])
    assert len(values) == 1, f"{name} given {len(values)} times in {container(objs)['args']}"
    return values[0]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def autoscaler(objs) -> dict:
    """The overlay's one autoscaler: an HPA, or KEDA's ScaledObject (which makes its own)."""
    (scaler,) = [o for o in objs if o["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]
    return scaler


def scale_down(scaler: dict) -> dict:
    """The scale-down behaviour of an HPA, or of the HPA a ScaledObject makes."""
    if scaler["kind"] == "ScaledObject":
        return scaler["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    return scaler["spec"]["behavior"]["scaleDown"]


def cpu_quantity(q: str) -> float:
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def memory_bytes(q: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if q.endswith(suffix):
            return int(float(q[: -len(suffix)]) * factor)
    return int(q)


@pytest.mark.parametrize("name", ALL)
def test_args_are_serve_flags(rendered, name):
    for flag_name, values in flags(rendered[name]).items():
        assert flag_name in SERVE_FLAGS, f"{flag_name} is not an `attnserve serve` flag"
        assert len(values) == 1, f"{flag_name} given twice"
    # --artifact comes from the image's ENTRYPOINT; repeating it would hide a mismatch.
    assert "--artifact" not in flags(rendered[name])


@pytest.mark.parametrize("name", ALL)
def test_ports_are_the_ones_the_server_is_told_to_listen_on(rendered, name):
    ports = container_ports(rendered[name])
    assert ports["grpc"] == int(flag(rendered[name], "--port"))
    assert ports["metrics"] == int(flag(rendered[name], "--metrics-port"))
    assert ports["http"] == int(flag(rendered[name], "--http-port"))


def probed_port(probe: dict, ports: dict[str, int]) -> int:
    """The container port a probe reaches (httpGet may name it)."""
    (kind,) = set(probe) & {"grpc", "httpGet", "tcpSocket", "exec"}
    port = probe[kind]["port"]
    return ports[port] if isinstance(port, str) else port


@pytest.mark.parametrize("name", ALL)
def test_probes_reach_the_grpc_and_http_ports_health(rendered, name):
    c = container(rendered[name])
    ports = container_ports(rendered[name])
    for probe in ("startupProbe", "livenessProbe"):
        assert set(c[probe]) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"grpc"}, probe
        assert probed_port(c[probe], ports) == ports["grpc"], probe
        # An empty service name asks for the server's overall health.
        assert c[probe]["grpc"].get("service", "") == "", probe
    # Readiness on the HTTP port: GET /health answers 503 while draining or loading.
    ready = c["readinessProbe"]
    assert set(ready) & {"grpc", "httpGet", "tcpSocket", "exec"} == {"httpGet"}
    assert ready["httpGet"]["path"] == "/health"
    assert probed_port(ready, ports) == ports["http"]


@pytest.mark.parametrize("name", ALL)
def test_services_and_servicemonitor_name_existing_ports(rendered, name):
    objs = rendered[name]
    pod_labels = find(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    ports = container_ports(objs)

    grpc_svc = find(objs, "Service", "attnserve")
    assert grpc_svc["spec"]["clusterIP"] == "None", "headless, for client-side balancing"
    assert [p["name"] for p in grpc_svc["spec"]["ports"]] == ["grpc"]
    metrics_svc = find(objs, "Service", "attnserve-metrics")
    assert metrics_svc["spec"].get("clusterIP") != "None"
    assert [p["name"] for p in metrics_svc["spec"]["ports"]] == ["metrics"]
    http_svc = find(objs, "Service", "attnserve-http")
    assert http_svc["spec"].get("clusterIP") != "None", "HTTP/1.1 clients balance per connection"
    assert [p["name"] for p in http_svc["spec"]["ports"]] == ["http"]

    for svc in (grpc_svc, metrics_svc, http_svc):
        assert selects(svc["spec"]["selector"], pod_labels), svc["metadata"]["name"]
        for port in svc["spec"]["ports"]:
            target = port["targetPort"]
            assert (ports[target] if isinstance(target, str) else target) == ports[port["name"]]
            assert port["port"] == ports[port["name"]]

    monitor = find(objs, "ServiceMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    matched = [s for s in objs if s["kind"] == "Service" and selects(selector, s["metadata"]["labels"])]
    assert matched == [metrics_svc], "the ServiceMonitor must select the metrics Service only"
    for endpoint in monitor["spec"]["endpoints"]:
        assert endpoint["port"] in {p["name"] for p in metrics_svc["spec"]["ports"]}


@pytest.mark.parametrize("name", ALL)
def test_selectors_match_the_pods(rendered, name):
    objs = rendered[name]
    deployment = find(objs, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    assert selects(find(objs, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"], pod_labels)
    policy = find(objs, "NetworkPolicy")
    assert selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels)
    ports = container_ports(objs)
    allowed = {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]}
    assert allowed == set(ports), "ingress to exactly the grpc, http and metrics ports"
    if name != "base":
        scaler = autoscaler(objs)
        ref = scaler["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) == ("Deployment", deployment["metadata"]["name"])
        least = scaler["spec"].get("minReplicas", scaler["spec"].get("minReplicaCount"))
        assert least >= 2, "one replica left while the PDB allows a drain"
        # The autoscaler owns the replica count; a fixed value would fight it on every apply.
        assert "replicas" not in deployment["spec"]


@pytest.mark.parametrize("name", ALL)
def test_security_context(rendered, name):
    pod = pod_spec(rendered[name])
    c = only_container(pod)
    psc, csc = pod.get("securityContext", {}), c["securityContext"]

    def effective(key):
        return csc.get(key, psc.get(key))

    assert effective("runAsNonRoot") is True
    assert isinstance(effective("runAsUser"), int) and effective("runAsUser") > 0
    assert effective("seccompProfile") == {"type": "RuntimeDefault"}
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["capabilities"]["drop"] == ["ALL"]
    assert "add" not in csc["capabilities"]
    assert pod["automountServiceAccountToken"] is False
    # The read-only root needs one writable path: /tmp on an emptyDir.
    volumes = {v["name"]: v for v in pod["volumes"]}
    tmp = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert len(tmp) == 1 and "emptyDir" in volumes[tmp[0]["name"]]


@pytest.mark.parametrize("name", ALL)
def test_grace_period_outlasts_prestop_and_drain(rendered, name):
    pod = pod_spec(rendered[name])
    drain = float(flag(rendered[name], "--drain-seconds"))
    pre_stop = only_container(pod).get("lifecycle", {}).get("preStop", {}).get("sleep", {})
    assert pod["terminationGracePeriodSeconds"] > pre_stop.get("seconds", 0) + drain


@pytest.mark.parametrize("name", OVERLAYS)
def test_overlay_device_image_and_resources(rendered, name):
    objs = rendered[name]
    pod = pod_spec(objs)
    c = only_container(pod)
    limits = c["resources"]["limits"]
    image = IMAGE_OF[name]
    assert flag(objs, "--device") == {"cpu": "cpu", "gpu": "cuda"}[image]
    assert c["image"].endswith(f"-{image}"), "the overlay runs the image built for its device"
    # onnxruntime's pool, and the front-end processes beside it, sized to the pod's CPU,
    # never to the node's cores.
    threads = int(flag(objs, "--intra-op-threads"))
    workers = int(flag(objs, "--workers")) if "--workers" in flags(objs) else 1
    assert (threads if workers == 1 else workers + threads) == cpu_quantity(limits["cpu"])
    if image == "gpu":
        assert str(limits["nvidia.com/gpu"]) == "1"
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    else:
        assert not any("nvidia.com/gpu" in r for r in c["resources"].values())
        assert "tolerations" not in pod and "nodeSelector" not in pod
        # Admission control must refuse work before the kernel OOM-kills the pod.
        assert int(flag(objs, "--memory-budget-bytes")) < memory_bytes(limits["memory"])


def test_no_device_in_base(rendered):
    assert "--device" not in flags(rendered["base"]), "each overlay chooses the device"


@pytest.mark.parametrize("name", ["cpu", "gpu"])
def test_hpa_scales_on_the_queue_depth_the_adapter_rule_serves(rendered, adapter_rules, name):
    """Both HPAs scale on the requests waiting per pod (every model and class summed by
    the adapter rule, per pod), averaged over the pods: never on utilisation."""
    (metric,) = find(rendered[name], "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["target"]["type"] == "AverageValue"
    name = metric["pods"]["metric"]["name"]
    assert name == "attnserve_queue_depth"
    (rule,) = [r for r in adapter_rules if r["name"]["as"] == name]
    assert rule["seriesQuery"].startswith(name + "{")
    assert rule["resources"]["overrides"] == {
        "namespace": {"resource": "namespace"},
        "pod": {"resource": "pod"},
    }
    assert rule["metricsQuery"].startswith("sum by (<<.GroupBy>>) (")


def test_keda_scales_on_the_queue_depth_per_replica(rendered):
    """KEDA's Prometheus trigger: one sum over every pod's queues (every model and class),
    as an AverageValue target (KEDA's default: the HPA it makes divides it by the
    replicas), in the overlay's namespace, at the cpu HPA's threshold."""
    objs = rendered["keda"]
    scaled = find(objs, "ScaledObject")
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger.get("metricType", "AverageValue") == "AverageValue"
    query = trigger["metadata"]["query"]
    assert metric_names(query) == {"attnserve_queue_depth"}
    assert query.startswith("sum(") and " by " not in query, "one value for the whole Deployment"
    assert f'namespace="{find(objs, "Deployment")["metadata"]["namespace"]}"' in query
    target = find(rendered["cpu"], "HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["target"]
    assert float(trigger["metadata"]["threshold"]) == float(target["averageValue"])


@pytest.mark.parametrize("name", OVERLAYS)
def test_scale_down_waits_for_each_drain(rendered, name):
    """A replica is given back only after minutes of little waiting work, and one at a
    time, no faster than a pod's grace period (which covers its preStop and its drain):
    each pod removed finishes what it accepted while the others take its callers."""
    objs = rendered[name]
    down = scale_down(autoscaler(objs))
    assert down["stabilizationWindowSeconds"] >= 300
    grace = pod_spec(objs)["terminationGracePeriodSeconds"]
    assert down["policies"], "without a policy the HPA may remove every surplus pod at once"
    for policy in down["policies"]:
        assert (policy["type"], policy["value"]) == ("Pods", 1)
        assert policy["periodSeconds"] >= grace


def test_adapter_and_keda_queries_are_valid_promql(adapter_rules, scaled_object, promtool, tmp_path):
    """The adapter's Go template filled in as prometheus-adapter would, and KEDA's query,
    parsed by promtool (as recording rules)."""
    rules = []
    for i, rule in enumerate(adapter_rules):
        series = rule["seriesQuery"].split("{")[0]
        expr = (
            rule["metricsQuery"]
            .replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", 'namespace="attnserve",pod=~"a|b"')
            .replace("<<.GroupBy>>", "pod")
        )
        assert "<<" not in expr, f"template field left in {expr}"
        rules.append({"record": f"adapter:rule{i}", "expr": expr})
    for i, trigger in enumerate(scaled_object["spec"]["triggers"]):
        rules.append({"record": f"keda:trigger{i}", "expr": trigger["metadata"]["query"]})
    path = tmp_path / "adapter.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "adapter", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], check=False, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
