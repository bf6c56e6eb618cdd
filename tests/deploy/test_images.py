"""Static checks of the Dockerfiles and .dockerignore (no container engine is
needed or assumed): stage layout, pins that must agree with pyproject.toml, and
a GPU base whose CUDA/cuDNN majors match the pinned onnxruntime-gpu wheel."""

from __future__ import annotations

import fnmatch
import json
import re
import tomllib

import pytest

from .helpers import DOCKER, REPO

DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "gpu": DOCKER / "Dockerfile.gpu"}
ENTRYPOINT = ["attnserve", "serve", "--artifact", "/artifact"]


def instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages(path) -> dict[str, list[tuple[str, str]]]:
    """{stage name: its instructions}; ARGs before the first FROM under "__global__"."""
    result: dict[str, list] = {"__global__": []}
    current = "__global__"
    for word, rest in instructions(path):
        if word == "FROM":
            current = rest.split(" AS ")[-1].strip() if " AS " in rest else rest
            result[current] = [(word, rest)]
        else:
            result[current].append((word, rest))
    return result


def arg_default(path, name: str) -> str:
    for word, rest in instructions(path):
        if word == "ARG" and rest.startswith(name + "="):
            return rest.split("=", 1)[1]
    raise AssertionError(f"no ARG {name}= in {path.name}")


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def pin(requirements: list[str], package: str) -> str:
    for req in requirements:
        m = re.match(rf"{re.escape(package)}==([^;\s]+)", req)
        if m:
            return m.group(1)
    raise AssertionError(f"{package} is not pinned with == in pyproject.toml")


@pytest.mark.parametrize("device", list(DOCKERFILES))
def test_build_stage_generates_stubs_bakes_artifact_and_builds_wheel(device):
    build = " ".join(f"{instruction} {rest}" for instruction, rest in stages(DOCKERFILES[device])["build"])
    steps = [
        "python -m venv .venv",
        "download.pytorch.org/whl/cpu",
        # the dependencies, from pyproject.toml alone, before the source: a change to the
        # source leaves their layer cached
        "COPY pyproject.toml",
        "['optional-dependencies']['export']",
        *(["['optional-dependencies']['profile']"] if device == "cpu" else []),
        "-r /tmp/deps/requirements.txt",
        "COPY . .",
        "pip install --no-deps .",
        "make proto",
        # the CPU image measures memory with the allocation hook (the GPU's reads NVML)
        *(["alloc-hook"] if device == "cpu" else []),
        "attnserve export --out /artifact",
        # the CPU image admits on a memory model fitted at build (the GPU's on its device)
        *(["attnserve memory-profile --artifact /artifact"] if device == "cpu" else []),
        "pip wheel --no-deps --wheel-dir /wheels .",
    ]
    positions = [build.find(step) for step in steps]
    assert -1 not in positions, dict(zip(steps, positions, strict=True))
    # The Makefile's proto target needs .venv/bin/attnserve (the install) first;
    # the wheel must come after the stubs and the hook so that it carries them.
    assert positions == sorted(positions), dict(zip(steps, positions, strict=True))


@pytest.mark.parametrize("device", list(DOCKERFILES))
def test_runtime_stage_is_lean_non_root_and_read_only(device):
    all_stages = stages(DOCKERFILES[device])
    runtime = all_stages["runtime"]
    assert list(all_stages)[-1] == "runtime", "the runtime stage is the image"
    text = "\n".join(f"{w} {r}" for w, r in runtime)
    for heavy in (
        "torch",
        "[export]",
        "grpcio-tools",
        "make ",
        "gcc",
        "build-essential",
        "pip install",
    ):
        assert heavy not in text, f"{heavy!r} in the runtime stage"
    copies = [r for w, r in runtime if w == "COPY"]
    assert "--from=build /artifact /artifact" in copies
    assert "--from=venv /opt/venv /opt/venv" in copies
    # The artifact is owned by root (no --chown): the server's user cannot write it.
    assert not any("--chown" in c for c in copies)
    users = [r for w, r in runtime if w == "USER"]
    assert len(users) == 1 and re.fullmatch(r"[1-9]\d*:[1-9]\d*", users[0]), users
    (entrypoint,) = [r for w, r in runtime if w == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ENTRYPOINT
    (cmd,) = [r for w, r in runtime if w == "CMD"]
    assert json.loads(cmd) == ["--device", {"cpu": "cpu", "gpu": "cuda"}[device]]
    venv = "\n".join(f"{w} {r}" for w, r in all_stages["venv"])
    assert "torch" not in venv and "[export]" not in venv


def test_uid_matches_the_manifests(rendered, kserve_isvc):
    (user,) = {r for device in DOCKERFILES for w, r in stages(DOCKERFILES[device])["runtime"] if w == "USER"}
    uid = int(user.split(":")[0])
    for overlay in ("cpu", "gpu"):
        (deployment,) = [o for o in rendered[overlay] if o["kind"] == "Deployment"]
        assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == uid
    assert kserve_isvc["spec"]["predictor"]["securityContext"]["runAsUser"] == uid


@pytest.mark.parametrize("device", list(DOCKERFILES))
def test_torch_pin_matches_pyproject(device):
    expected = pin(pyproject()["project"]["optional-dependencies"]["export"], "torch")
    assert arg_default(DOCKERFILES[device], "TORCH_VERSION") == expected


def test_cpu_image_onnxruntime_matches_the_gpu_pin():
    expected = pin(pyproject()["project"]["dependencies"], "onnxruntime-gpu")
    assert arg_default(DOCKERFILES["cpu"], "ORT_VERSION") == expected


def test_cpu_image_on_slim_python():
    assert arg_default(DOCKERFILES["cpu"], "PYTHON_IMAGE") == "python:3.11-slim"


def test_gpu_base_matches_the_onnxruntime_gpu_wheel():
    """The CUDA major of the base must be the one onnxruntime-gpu was built with
    (its wheel records it), on a *runtime* (not devel) image that ships cuDNN."""
    image = arg_default(DOCKERFILES["gpu"], "CUDA_IMAGE")
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.(\d+)\.(\d+)-cudnn-runtime-ubuntu(\d+\.\d+)", image)
    assert m, f"{image} is not an nvidia/cuda <version>-cudnn-runtime-ubuntu<release> tag"
    build_info = pytest.importorskip(
        "onnxruntime.capi.build_and_package_info", reason="onnxruntime-gpu is not installed"
    )
    from importlib.metadata import version

    pinned = pin(pyproject()["project"]["dependencies"], "onnxruntime-gpu")
    assert version("onnxruntime-gpu") == pinned, "the venv's onnxruntime-gpu is not the pinned one"
    assert m.group(1) == build_info.cuda_version.split(".")[0], (
        f"onnxruntime-gpu {pinned} is built for CUDA {build_info.cuda_version}, the base is {image}"
    )


def test_dockerignore_keeps_what_the_build_needs():
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def ignored(path: str) -> bool:
        return any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(path, p.removeprefix("**/")) for p in patterns)

    for needed in (
        "pyproject.toml",
        "README.md",
        "Makefile",
        "proto",
        "server",
        "model",
        "export",
    ):
        assert not ignored(needed), f".dockerignore drops {needed}, which the build needs"
    for dropped in (".git", ".venv", ".venv-lint", "tests", "bench", "docs", "deploy", "server/_proto",
                    "artifacts"):
        assert ignored(dropped), f".dockerignore sends {dropped} to the build"
