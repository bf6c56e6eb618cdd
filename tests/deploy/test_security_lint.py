"""Security lint of the rendered manifests with checkov (PyPI, Apache-2.0).

Why checkov: it installs from PyPI (no binary download, works offline with
--skip-download), has ~100 Kubernetes checks covering the Pod Security
Standards, resource limits, probes, service-account tokens and image pinning,
and reads accepted findings from `checkov.io/skipN: CHECK_ID=reason` annotations,
so every exception is written, with its reason, in the manifest it excuses.

checkov's dependency tree is large and pins its own versions, so it lives in its
own venv, .venv-lint, never in .venv (whose protobuf<7 and friends it must not
move). The test creates it when it is missing, with the same command as the
Makefile's lint-deps target (see deploy/README.md).
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import yaml

from .helpers import DOCKER, OVERLAYS, REPO, find, kserve_predictor_pod

CHECKOV_VERSION = "3.3.30"
LINT_VENV = REPO / ".venv-lint"
CHECKOV = LINT_VENV / "bin" / "checkov"
# Findings accepted on purpose, each explained where it is skipped.
ACCEPTED = {
    "CKV_K8S_43",  # image by digest: pinned by the release pipeline, not in git
    "CKV_DOCKER_2",  # HEALTHCHECK: Kubernetes ignores it; native gRPC probes instead
    "CKV_DOCKER_7",  # base tag: an ARG default, which checkov cannot resolve
}


@pytest.fixture(scope="session")
def checkov() -> str:
    if not CHECKOV.exists():
        steps = [
            [sys.executable, "-m", "venv", str(LINT_VENV)],
            [str(LINT_VENV / "bin" / "pip"), "install", "--quiet", f"checkov=={CHECKOV_VERSION}"],
        ]
        for step in steps:
            out = subprocess.run(step, check=False, capture_output=True, text=True, timeout=900)
            if out.returncode != 0:
                pytest.fail(
                    f"could not make {LINT_VENV} (make lint-deps): {' '.join(step)}\n{out.stdout}{out.stderr}"
                )
    return str(CHECKOV)


def lint(checkov: str, directory, framework: str = "kubernetes") -> dict:
    out = subprocess.run(
        [
            checkov,
            "--directory",
            str(directory),
            "--framework",
            framework,
            "--skip-download",
            "--output",
            "json",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode in (0, 1), f"checkov crashed ({out.returncode}):\n{out.stderr[-3000:]}"
    report = json.loads(out.stdout)
    assert report["summary"]["parsing_errors"] == 0, report["summary"]
    return report


def write_manifests(directory, rendered, kserve_isvc) -> None:
    for overlay in OVERLAYS:
        (directory / f"{overlay}.yaml").write_text(yaml.safe_dump_all(rendered[overlay]))
    (directory / "kserve-predictor.yaml").write_text(yaml.safe_dump(kserve_predictor_pod(kserve_isvc)))


def assert_clean(report: dict) -> None:
    results = report["results"]
    failed = [f"{c['check_id']} {c['check_name']}: {c['resource']}" for c in results["failed_checks"]]
    assert not failed, "\n".join(failed)
    for skipped in results["skipped_checks"]:
        assert skipped["check_id"] in ACCEPTED, f"unexpected exception {skipped['check_id']}"
        assert skipped["check_result"]["suppress_comment"].strip(), "an exception needs its reason"


def test_rendered_manifests_pass_the_security_lint(checkov, rendered, kserve_isvc, tmp_path):
    write_manifests(tmp_path, rendered, kserve_isvc)
    report = lint(checkov, tmp_path)
    assert_clean(report)
    # Every object of both overlays and the KServe predictor Pod were read
    # (checkov counts containers as resources too).
    assert report["summary"]["resource_count"] >= sum(len(rendered[o]) for o in OVERLAYS) + 1


def test_dockerfiles_pass_the_security_lint(checkov):
    report = lint(checkov, DOCKER, framework="dockerfile")
    assert_clean(report)
    assert report["summary"]["resource_count"] == 2


def test_lint_catches_an_insecure_pod(checkov, rendered, tmp_path):
    deployment = copy.deepcopy(find(rendered["gpu"], "Deployment"))
    c = deployment["spec"]["template"]["spec"]["containers"][0]
    c["securityContext"].update(allowPrivilegeEscalation=True, readOnlyRootFilesystem=False)
    (tmp_path / "insecure.yaml").write_text(yaml.safe_dump(deployment))
    failed = {check["check_id"] for check in lint(checkov, tmp_path)["results"]["failed_checks"]}
    assert {"CKV_K8S_20", "CKV_K8S_22"} <= failed, failed
