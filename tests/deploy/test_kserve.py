"""The KServe InferenceService: its predictor is a valid Pod, runs the GPU image
the way the gpu overlay does, exposes the v2 gRPC port KServe expects and probes the HTTP
port."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from .helpers import SERVE_FLAGS, find, flag_values, kserve_predictor_pod, only_container


def test_is_a_v1beta1_inferenceservice_in_raw_mode(kserve_isvc):
    assert kserve_isvc["apiVersion"] == "serving.kserve.io/v1beta1"
    assert kserve_isvc["kind"] == "InferenceService"
    annotations = kserve_isvc["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] == "RawDeployment"


@pytest.mark.parametrize("version", ["1.30", kubernetes_validate.latest_version()])
def test_predictor_is_a_valid_pod(kserve_isvc, version):
    kubernetes_validate.validate(kserve_predictor_pod(kserve_isvc), version, strict=True)


def test_predictor_validation_is_strict(kserve_isvc):
    isvc = copy.deepcopy(kserve_isvc)
    c = isvc["spec"]["predictor"]["containers"][0]
    c["livenesProbe"] = c.pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        kubernetes_validate.validate(kserve_predictor_pod(isvc), "1.30", strict=True)


def test_v2_ports_probes_and_metrics(kserve_isvc):
    pod = kserve_predictor_pod(kserve_isvc)["spec"]
    c = only_container(pod)
    assert c["name"] == "kserve-container"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert c["ports"][0]["name"] == "h2c", "KServe exposes the first port; h2c marks it gRPC"
    flags = flag_values(c["args"])
    assert set(flags) <= SERVE_FLAGS
    assert ports["h2c"] == int(flags["--port"][0])
    assert ports["metrics"] == int(flags["--metrics-port"][0])
    assert ports["http"] == int(flags["--http-port"][0])
    annotations = kserve_isvc["metadata"]["annotations"]
    assert int(annotations["prometheus.kserve.io/port"]) == ports["metrics"]
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == ports["h2c"], probe
    ready = c["readinessProbe"]["httpGet"]
    assert ready["path"] == "/health" and ports[ready["port"]] == ports["http"]


def test_runs_like_the_gpu_overlay(kserve_isvc, rendered):
    pod = kserve_predictor_pod(kserve_isvc)["spec"]
    c = only_container(pod)
    overlay_pod = find(rendered["gpu"], "Deployment")["spec"]["template"]["spec"]
    overlay = only_container(overlay_pod)
    assert c["image"] == overlay["image"]
    assert flag_values(c["args"]) == flag_values(overlay["args"])
    assert c["resources"] == overlay["resources"]
    assert c["securityContext"] == overlay["securityContext"]
    assert c["lifecycle"] == overlay["lifecycle"]
    assert c["volumeMounts"] == overlay["volumeMounts"] and pod["volumes"] == overlay_pod["volumes"]
    assert pod["securityContext"] == overlay_pod["securityContext"]
    assert pod["tolerations"] == overlay_pod["tolerations"]
    assert pod["nodeSelector"] == overlay_pod["nodeSelector"]
    assert pod["terminationGracePeriodSeconds"] == overlay_pod["terminationGracePeriodSeconds"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe] == overlay[probe], probe
