"""The kustomizations render, and every object validates against Kubernetes' schemas.

kubernetes-validate bundles the OpenAPI schemas of each Kubernetes release and
works offline. --strict (strict=True) rejects unknown fields: without it a
misspelt `readinesProbe` passes, which the last test shows.
"""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from .helpers import KUSTOMIZATIONS, find

# The oldest release the manifests support (native preStop `sleep` is 1.30) and
# the newest kubernetes-validate knows.
K8S_VERSIONS = ["1.30", kubernetes_validate.latest_version()]
# Kinds kubernetes-validate has no schema for; checked elsewhere (promtool, the
# ServiceMonitor's and KEDA's ScaledObject's CRD schemas in data/).
CRD_KINDS = {"ServiceMonitor", "PrometheusRule", "ScaledObject"}

EXPECTED_KINDS = {
    "base": {
        "Namespace",
        "ServiceAccount",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
        "ServiceMonitor",
        "PrometheusRule",
    },
}
EXPECTED_KINDS["cpu"] = EXPECTED_KINDS["base"] | {"HorizontalPodAutoscaler"}
EXPECTED_KINDS["gpu"] = EXPECTED_KINDS["cpu"]
# KEDA makes the HorizontalPodAutoscaler from the ScaledObject.
EXPECTED_KINDS["keda"] = EXPECTED_KINDS["base"] | {"ScaledObject"}


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_renders_expected_objects(rendered, name):
    kinds = {o["kind"] for o in rendered[name]}
    assert kinds == EXPECTED_KINDS[name]
    for obj in rendered[name]:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == "attnserve", obj["metadata"]["name"]
        assert obj["metadata"]["labels"]["app.kubernetes.io/name"] == "attnserve"


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_every_object_validates_strictly(rendered, name, version):
    without_schema = set()
    for obj in rendered[name]:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            without_schema.add(obj["kind"])
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {path}: {e.message}")
    # Only the CRDs may go unvalidated here: a typo in a built-in apiVersion or
    # kind would also land in this set, and must not pass silently.
    assert without_schema <= CRD_KINDS


@pytest.mark.parametrize(
    "container_field, misspelt",
    [("readinessProbe", "readinesProbe"), ("securityContext", "securityContex")],
)
def test_strict_validation_rejects_a_misspelt_field(rendered, container_field, misspelt):
    deployment = copy.deepcopy(find(rendered["gpu"], "Deployment"))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container[misspelt] = container.pop(container_field)

    with pytest.raises(kubernetes_validate.ValidationError, match=misspelt):
        kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=True)
    # ...which is why --strict is used: the lax schemas let it through.
    kubernetes_validate.validate(deployment, K8S_VERSIONS[-1], strict=False)
