"""The CPU image, built here and run the way the cpu overlay's Deployment runs its pod.

`deploy/docker/build.sh cpu --local` builds it on a locally made Debian base (no registry
is needed), with podman. The container is then started from the rendered manifest, field
by field (`pod_run_flags`: a field this test does not know how to run fails it, so that a
manifest change cannot slip past): its args and env, the pod's and container's
securityContext (user, read-only root filesystem, every capability dropped, no privilege
escalation, the runtime's default seccomp profile), its only writable mount (`/tmp`, an
emptyDir: a fresh host directory), its CPU and memory limits, and its ports, published on
127.0.0.1 only. The probes are run as the kubelet runs them, from outside, with the
manifest's periods and thresholds. Then, from outside too:

- gRPC health SERVING, GET /health 200 (the probes);
- Embed (raw generated stubs) returns the vectors a host onnxruntime session computes on
  the image's own artifact (copied out, hashes verified), for texts and for token ids;
- OpenAI's `openai` client gets the same normalised vectors from /v1/embeddings;
- /metrics answers with attnserve_ series that counted those calls;
- SIGTERM ends it with exit code 0 within terminationGracePeriodSeconds less the preStop
  sleep (the kubelet's budget for the process once the hook is done).

The image itself: at most SIZE_BOUND bytes, no torch, onnxruntime's CPU build (not the GPU
one), and the user, entrypoint and command the manifests rely on.

Last, the rendered cpu overlay itself is played with `podman kube play` (see that test).

Run alone with `make image-test`. Needs root, podman, runc (where cgroups are not v2 only),
catatonit and debootstrap: `make image-deps` installs them.
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .helpers import DOCKER, REPO, find, only_container, tool

ENGINE = DOCKER / "engine.sh"
BUILD = DOCKER / "build.sh"
IMAGE = "localhost/attnserve:image-test-cpu"
BUILD_TIMEOUT_S = 2400
# The memory model baked on a few short shapes: the fit itself is tested in
# tests/server/test_memory_profile.py, here that the image runs as its pod does.
PROFILE_ARGS = "--seq-lens 8,16,32 --batch-sizes 1,2"
# The image is the local base (129 MB: Debian minbase + Python 3.11, about the size of
# python:3.11-slim), the runtime venv (250 MB, onnxruntime's CPU build 68 MB of it) and the
# baked MiniLM artifact (271 MB: three fp32 graphs of 87 MB). 650 MB measured; the bound
# leaves ~150 MB for growth and still fails an image that carries torch (its CPU build
# alone is 754 MB installed) or onnxruntime's GPU build instead of the CPU one (340 MB
# installed, +272 MB).
SIZE_BOUND = 800_000_000
TEXTS = [
    "Attention is all you need.",
    "The server pads a batch to its longest sequence and trims every answer back.",
    "short",
]
# Host and container run the same onnxruntime release (the GPU build's CPU provider on the
# host, the CPU build in the image) on the same CPU: measured identical here. The bound
# leaves room for float32 rounding (the server pads a batch to its longest sequence).
ATOL = 1e-4

pytestmark = pytest.mark.timeout(BUILD_TIMEOUT_S + 900)


def say(request, line: str) -> None:
    """A line on the terminal, past pytest's capture: the size and timings are the report."""
    capture = request.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n[image-test] {line}", flush=True)


def engine(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([str(ENGINE), *args], env={**_env(), "ENGINE": "podman"},
                         capture_output=True, text=True, timeout=timeout, check=False)
    if check and out.returncode != 0:
        pytest.fail(f"podman {' '.join(args)}: exit {out.returncode}\n{out.stdout}{out.stderr}")
    return out


def _env() -> dict[str, str]:
    """The caller's environment without ATTNSERVE_* twins (the manifest sets none)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")}


# ---------------------------------------------------------------------------------------
# The manifest -> podman run


def quantity_bytes(value: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    m = re.fullmatch(r"(\d+)([A-Za-z]*)", str(value))
    assert m and (m.group(2) in units or not m.group(2)), f"quantity {value!r}"
    return int(m.group(1)) * units.get(m.group(2), 1)


def cpu_quantity(value: str) -> str:
    value = str(value)
    return str(int(value[:-1]) / 1000) if value.endswith("m") else value


POD_FIELDS_RUN = {"containers", "securityContext", "volumes", "terminationGracePeriodSeconds"}
# Scheduling and API fields: the node and the API server act on them, not the container.
POD_FIELDS_NOT_CONTAINER = {"serviceAccountName", "automountServiceAccountToken",
                            "topologySpreadConstraints", "nodeSelector", "tolerations"}
CONTAINER_FIELDS_RUN = {"name", "image", "imagePullPolicy", "args", "env", "ports", "resources",
                        "securityContext", "volumeMounts", "startupProbe", "readinessProbe",
                        "livenessProbe", "lifecycle"}


def pod_run_flags(pod: dict, container: dict, scratch: Path) -> list[str]:
    """`podman run` flags for the pod's one container, from its spec."""
    unknown = set(pod) - POD_FIELDS_RUN - POD_FIELDS_NOT_CONTAINER
    assert not unknown, f"pod fields the image test does not run: {sorted(unknown)}"
    unknown = set(container) - CONTAINER_FIELDS_RUN
    assert not unknown, f"container fields the image test does not run: {sorted(unknown)}"
    flags: list[str] = []

    security = {**pod.get("securityContext", {}), **container.get("securityContext", {})}
    handled = {"runAsNonRoot", "runAsUser", "runAsGroup", "seccompProfile",
               "allowPrivilegeEscalation", "readOnlyRootFilesystem", "capabilities"}
    assert set(security) <= handled, f"securityContext fields not run: {set(security) - handled}"
    if "runAsUser" in security:
        flags += ["--user", f"{security['runAsUser']}:{security.get('runAsGroup', 0)}"]
    if security.get("readOnlyRootFilesystem"):
        # podman would otherwise add writable tmpfs on /tmp, /run and /var/tmp: only the
        # manifest's own mounts may be writable.
        flags += ["--read-only", "--read-only-tmpfs=false"]
    if security.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    caps = security.get("capabilities", {})
    assert set(caps) <= {"drop", "add"}, caps
    flags += [f"--cap-drop={c}" for c in caps.get("drop", [])]
    flags += [f"--cap-add={c}" for c in caps.get("add", [])]
    # RuntimeDefault is the runtime's default profile: podman applies its own unless told
    # otherwise (checked in the running container: Seccomp 2, filter mode).
    assert security.get("seccompProfile", {"type": "RuntimeDefault"}) == {"type": "RuntimeDefault"}

    for item in container.get("env", []):
        assert set(item) == {"name", "value"}, f"env {item}: only literal values are run"
        flags += ["--env", f"{item['name']}={item['value']}"]

    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        assert set(volume) <= {"name", "emptyDir"}, f"volume {volume}: only emptyDir is run"
        assert set(mount) <= {"name", "mountPath", "readOnly"}, mount
        # An emptyDir is a fresh directory on the node's disk, mode 0777, for the pod's life.
        directory = scratch / mount["name"]
        directory.mkdir()
        directory.chmod(0o777)
        mode = "ro" if mount.get("readOnly") else "rw"
        flags += ["--volume", f"{directory}:{mount['mountPath']}:{mode}"]

    limits = container.get("resources", {}).get("limits", {})
    assert set(limits) <= {"cpu", "memory"}, limits
    if "cpu" in limits:
        flags += ["--cpus", cpu_quantity(limits["cpu"])]
    if "memory" in limits:
        flags += ["--memory", str(quantity_bytes(limits["memory"]))]

    for port in container.get("ports", []):
        assert port.get("protocol", "TCP") == "TCP", port
        flags += ["--publish", f"127.0.0.1::{port['containerPort']}"]
    return flags


# ---------------------------------------------------------------------------------------
# Fixtures


@pytest.fixture(scope="module")
def podman() -> str:
    tool("runc", "make image-deps (apt-get install runc): crun fails on hybrid cgroups")
    tool("debootstrap", "make image-deps (apt-get install debootstrap)")
    tool("catatonit", "make image-deps (apt-get install catatonit): kube play's pause process")
    return tool("podman", "make image-deps (apt-get install podman runc debootstrap)")


@pytest.fixture(scope="module")
def image(request, podman) -> str:
    started = time.monotonic()
    out = subprocess.run([str(BUILD), "cpu", "--local", "--tag", IMAGE, "--",
                          "--build-arg", f"PROFILE_ARGS={PROFILE_ARGS}"], cwd=REPO,
                         env={**_env(), "ENGINE": "podman"}, capture_output=True, text=True,
                         timeout=BUILD_TIMEOUT_S, check=False)
    assert out.returncode == 0, f"build failed:\n{out.stdout[-8000:]}\n{out.stderr[-8000:]}"
    say(request, f"build: {time.monotonic() - started:.0f} s (podman's layer cache: "
                 f"cold on a first build, warm after)")
    return IMAGE


@pytest.fixture(scope="module")
def cpu_pod(rendered) -> tuple[dict, dict]:
    pod = find(rendered["cpu"], "Deployment")["spec"]["template"]["spec"]
    return pod, only_container(pod)


class Pod:
    """The container running, and its ports on the host's loopback."""

    def __init__(self, name: str, ports: dict[int, int], container: dict):
        self.name, self.ports, self.container = name, ports, container

    def port(self, ref) -> int:
        """The host port for a probe's `port` (a number or a port's name)."""
        if isinstance(ref, str):
            (ref,) = [p["containerPort"] for p in self.container["ports"] if p.get("name") == ref]
        return self.ports[ref]

    def logs(self) -> str:
        out = engine("logs", self.name, check=False)
        return out.stdout + out.stderr


def flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    return value


@pytest.fixture(scope="module")
def pod(request, image, cpu_pod, tmp_path_factory):
    spec, container = cpu_pod
    name = f"attnserve-image-test-{int(time.time())}"
    flags = pod_run_flags(spec, container, tmp_path_factory.mktemp("pod-volumes"))
    run = engine("run", "--detach", "--name", name, *flags, image, *container.get("args", []))
    try:
        ports = {}
        for p in container["ports"]:
            published = engine("port", name, f"{p['containerPort']}/tcp").stdout.strip()
            host, _, port = published.rpartition(":")
            assert host == "127.0.0.1", f"{p} published on {published}: loopback only"
            ports[p["containerPort"]] = int(port)
        say(request, f"podman run {' '.join(flags)} {image} {' '.join(container.get('args', []))}"
                     f" -> {run.stdout.strip()[:12]}, ports {ports}")
        yield Pod(name, ports, container)
    finally:
        engine("rm", "--force", "--time", "0", name, check=False)


# ---------------------------------------------------------------------------------------
# Probes, as the kubelet runs them


def probe_once(pod: Pod, probe: dict) -> bool:
    timeout = probe.get("timeoutSeconds", 1)
    try:
        if "grpc" in probe:
            with grpc.insecure_channel(f"127.0.0.1:{pod.port(probe['grpc']['port'])}") as channel:
                response = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")),
                    timeout=timeout)
            return response.status == health_pb2.HealthCheckResponse.SERVING
        if "httpGet" in probe:
            get = probe["httpGet"]
            url = f"http://127.0.0.1:{pod.port(get['port'])}{get.get('path', '/')}"
            with urllib.request.urlopen(url, timeout=timeout) as response:
                return 200 <= response.status < 400
    except (grpc.RpcError, OSError):
        return False
    raise AssertionError(f"probe kind not run by the test: {probe}")


def wait_probe(pod: Pod, probe: dict) -> float:
    """Seconds until the probe first succeeds; fails once the kubelet would have given up
    (initialDelaySeconds + periodSeconds x failureThreshold)."""
    started = time.monotonic()
    deadline = started + probe.get("initialDelaySeconds", 0) + \
        probe.get("periodSeconds", 10) * probe.get("failureThreshold", 3)
    while True:
        if probe_once(pod, probe):
            return time.monotonic() - started
        state = engine("inspect", "--format", "{{.State.Status}}", pod.name).stdout.strip()
        assert state == "running", f"container {state}:\n{pod.logs()}"
        if time.monotonic() > deadline:
            pytest.fail(f"probe {probe} never succeeded: the kubelet would restart the pod\n"
                        f"{pod.logs()}")
        time.sleep(1)


@pytest.fixture(scope="module")
def started(request, pod):
    startup = pod.container["startupProbe"]
    seconds = wait_probe(pod, startup)
    say(request, f"startup probe (grpc.health.v1 on {startup['grpc']['port']}) passed after "
                 f"{seconds:.1f} s")
    return pod


# ---------------------------------------------------------------------------------------
# The host's reference: onnxruntime on the image's own artifact


@pytest.fixture(scope="module")
def artifact_copy(started, tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("image-artifact")
    engine("cp", f"{started.name}:/artifact/.", str(directory), timeout=300)
    return directory


def tensor(message) -> np.ndarray:
    assert message.dtype in (0, 1), f"dtype {message.dtype}"  # float32
    return np.frombuffer(message.data, dtype="<f4").reshape(tuple(message.shape))


class Reference:
    """The graph the server chose, run by a host onnxruntime session, one sequence at a
    time (no padding)."""

    def __init__(self, directory: Path, precision: str):
        import onnxruntime as ort
        from tokenizers import Tokenizer

        from attnserve.artifact import cpu_session_config, load_artifact

        self.artifact = load_artifact(directory)  # every file's sha256 against the manifest
        graph = self.artifact.manifest.graph(attention=False, precision=precision)
        options = ort.SessionOptions()
        for key, value in cpu_session_config(precision).items():
            options.add_session_config_entry(key, value)
        self.graph = graph.file
        self.session = ort.InferenceSession(str(directory / graph.file), options,
                                            providers=["CPUExecutionProvider"])
        self.tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def run(self, ids: list[int]) -> dict[str, np.ndarray]:
        feed = {"input_ids": np.array([ids], dtype=np.int64),
                "attention_mask": np.ones((1, len(ids)), dtype=np.int64)}
        names = [o.name for o in self.session.get_outputs()]
        return {n: v[0] for n, v in zip(names, self.session.run(names, feed), strict=True)}


@pytest.fixture(scope="module")
def stubs():
    from attnserve.server._proto.attnserve.v1 import encoder_pb2, encoder_pb2_grpc

    return encoder_pb2, encoder_pb2_grpc


@pytest.fixture(scope="module")
def channel(started):
    """To the server's --port, the one the gRPC probes use."""
    port = int(flag(started.container["args"], "--port"))
    assert port == started.container["startupProbe"]["grpc"]["port"]
    with grpc.insecure_channel(f"127.0.0.1:{started.port(port)}") as channel:
        yield channel


# ---------------------------------------------------------------------------------------
# The image itself


def test_image_size_is_bounded(request, image):
    size = int(engine("image", "inspect", "--format", "{{.Size}}", image).stdout)
    say(request, f"image size: {size} bytes ({size / 1e6:.0f} MB; bound {SIZE_BOUND / 1e6:.0f} MB)")
    assert size <= SIZE_BOUND, f"{image} is {size / 1e6:.0f} MB, over {SIZE_BOUND / 1e6:.0f} MB"


def test_image_carries_no_torch_and_the_cpu_onnxruntime(image):
    script = (
        "import importlib.metadata as m, importlib.util as u, json, shutil;"
        "print(json.dumps({'torch': u.find_spec('torch') is not None,"
        " 'dists': sorted(d.metadata['Name'].lower() for d in m.distributions()),"
        " 'gcc': shutil.which('gcc') or shutil.which('cc')}))"
    )
    out = engine("run", "--rm", "--entrypoint", "python", image, "-c", script)
    found = json.loads(out.stdout)
    assert not found["torch"], "torch is importable in the serving image"
    # nvidia-ml-py (NVML's bindings, 0.5 MB) is a dependency of the server; NVIDIA's CUDA
    # library wheels (nvidia-cublas, nvidia-cudnn-cu13, ...) are not.
    heavy = [d for d in found["dists"] if d in ("torch", "onnxruntime-gpu")
             or (d.startswith("nvidia-") and d != "nvidia-ml-py")]
    assert not heavy, f"in the serving image: {heavy}"
    assert "onnxruntime" in found["dists"]
    assert found["gcc"] is None, "a C compiler in the serving image"


def test_image_config_is_what_the_manifests_expect(image, cpu_pod):
    config = json.loads(engine("image", "inspect", image).stdout)[0]["Config"]
    pod, container = cpu_pod
    security = {**pod["securityContext"], **container["securityContext"]}
    # runAsNonRoot: the kubelet refuses an image whose USER is not a numeric non-zero uid.
    assert config["User"] == f"{security['runAsUser']}:{security['runAsGroup']}"
    assert config["Entrypoint"] == ["attnserve", "serve", "--artifact", "/artifact"]
    # The overlay's --device=cpu comes after the image's command, which k8s args replace.
    assert config["Cmd"] == ["--device", "cpu"]
    exposed = {int(p.split("/")[0]) for p in config.get("ExposedPorts", {})}
    assert exposed == {p["containerPort"] for p in container["ports"]}


# ---------------------------------------------------------------------------------------
# The running pod


def test_startup_readiness_and_liveness_probes_pass(started):
    for kind in ("readinessProbe", "livenessProbe"):
        wait_probe(started, started.container[kind])


def test_the_container_runs_confined_as_the_manifest_says(started, cpu_pod):
    pod, container = cpu_pod
    status = engine("exec", started.name, "cat", "/proc/1/status").stdout
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    uid = str(pod["securityContext"]["runAsUser"])
    assert fields["Uid"].split()[0] == uid and fields["Gid"].split()[0] == str(
        pod["securityContext"]["runAsGroup"])
    assert "attnserve" in engine("exec", started.name, "cat", "/proc/1/cmdline").stdout
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapPrm"], 16) == 0
    assert int(fields["CapBnd"], 16) == 0, "capabilities left in the bounding set"
    assert fields["NoNewPrivs"].strip() == "1"
    assert fields["Seccomp"].strip() == "2", "no seccomp filter (RuntimeDefault)"
    # Read-only everywhere but the emptyDir.
    probe = ("import sys\nfor p in sys.argv[1:]:\n"
             "    try:\n        open(p, 'w').close(); print(p, 'writable')\n"
             "    except OSError as e:\n        print(p, e.errno)\n")
    paths = ["/probe", "/artifact/probe", "/opt/venv/probe", "/run/probe", "/var/tmp/probe",
             "/tmp/probe"]
    out = engine("exec", started.name, "python", "-c", probe, *paths).stdout.split("\n")
    result = dict(line.split(" ", 1) for line in out if line)
    writable = {m["mountPath"] + "/probe" for m in container["volumeMounts"]}
    for path in paths:
        expected = "writable" if path in writable else str(errno.EROFS)
        assert result[path] == expected, (path, result[path])
    limit = engine("exec", started.name, "cat", "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                   check=False)
    if limit.returncode == 0:  # cgroup v1; v2 has memory.max
        assert int(limit.stdout) == quantity_bytes(container["resources"]["limits"]["memory"])


def test_embed_returns_the_hosts_vectors(request, started, artifact_copy, channel, stubs):
    pb, pb_grpc = stubs
    stub = pb_grpc.EncoderServiceStub(channel)
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    ref = Reference(artifact_copy, info.precision)
    assert info.artifact_sha256 == ref.artifact.manifest_sha256, "serving another artifact"
    assert info.execution_provider == "CPUExecutionProvider"

    by_text = stub.Embed(pb.EmbedRequest(texts=TEXTS, pooling=pb.POOLING_MEAN,
                                         return_token_embeddings=True), timeout=30)
    ids = [ref.ids(t) for t in TEXTS]
    by_ids = stub.Embed(pb.EmbedRequest(token_ids=[pb.TokenIds(ids=i) for i in ids],
                                        pooling=pb.POOLING_MEAN, return_token_embeddings=True),
                        timeout=30)
    worst = 0.0
    for response in (by_text, by_ids):
        assert len(response.embeddings) == len(TEXTS)
        for embedding, token_ids in zip(response.embeddings, ids, strict=True):
            assert list(embedding.token_ids) == token_ids, "the container tokenizes differently"
            expected = ref.run(token_ids)
            tokens, pooled = tensor(embedding.token_embeddings), tensor(embedding.pooled)
            assert tokens.shape == expected["last_hidden_state"].shape
            np.testing.assert_allclose(tokens, expected["last_hidden_state"], rtol=0, atol=ATOL)
            np.testing.assert_allclose(pooled, expected["pooled_mean"], rtol=0, atol=ATOL)
            worst = max(worst, float(np.abs(tokens - expected["last_hidden_state"]).max()),
                        float(np.abs(pooled - expected["pooled_mean"]).max()))
    say(request, f"Embed vs host onnxruntime ({ref.graph}, {info.precision}): "
                 f"max |difference| {worst:.2e} (bound {ATOL})")


def test_openai_embeddings(request, started, artifact_copy, channel, stubs):
    import openai

    pb, pb_grpc = stubs
    info = pb_grpc.EncoderServiceStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    ref = Reference(artifact_copy, info.precision)
    http = started.port(started.container["readinessProbe"]["httpGet"]["port"])
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="unused",
                           timeout=30, max_retries=0)
    response = client.embeddings.create(model=info.model, input=TEXTS)
    assert response.model == info.model and len(response.data) == len(TEXTS)
    worst = 0.0
    for item, text in zip(response.data, TEXTS, strict=True):
        expected = ref.run(ref.ids(text))["pooled_mean_normalized"]
        got = np.array(item.embedding, dtype=np.float32)
        np.testing.assert_allclose(got, expected, rtol=0, atol=ATOL)
        worst = max(worst, float(np.abs(got - expected).max()))
    assert response.usage.prompt_tokens == sum(len(ref.ids(t)) for t in TEXTS)
    say(request, f"/v1/embeddings (openai {openai.__version__}) vs host: max |difference| "
                 f"{worst:.2e}")


def test_metrics_answer_with_the_servers_series(started, channel, stubs):
    from prometheus_client.parser import text_string_to_metric_families

    pb, pb_grpc = stubs
    pb_grpc.EncoderServiceStub(channel).Embed(pb.EmbedRequest(texts=TEXTS), timeout=30)
    port = started.port(int(flag(started.container["args"], "--metrics-port")))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    names = {s.name for s in samples}
    assert {"attnserve_info", "attnserve_health_serving", "attnserve_requests_total"} <= names
    assert [s.value for s in samples if s.name == "attnserve_health_serving"] == [1.0]
    embeds = sum(s.value for s in samples if s.name == "attnserve_requests_total"
                 and s.labels.get("rpc", "").rsplit("/", 1)[-1] == "Embed")
    assert embeds >= 1, "the Embed calls were not counted"
    assert any(s.name == "attnserve_batch_size_count" and s.value >= 1 for s in samples)


def test_sigterm_exits_0_within_the_grace_period(request, started, cpu_pod):
    """Runs last: it stops the container. The kubelet runs the preStop sleep, then sends
    SIGTERM, and kills the container terminationGracePeriodSeconds after the start of it
    all: the server has the grace period less the sleep."""
    pod, container = cpu_pod
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    budget = pod["terminationGracePeriodSeconds"] - pre_stop
    began = time.monotonic()
    engine("kill", "--signal", "TERM", started.name)
    # `podman wait` has no time limit of its own: the subprocess timeout is the bound.
    try:
        out = engine("wait", started.name, timeout=budget)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {budget} s after SIGTERM: the kubelet would SIGKILL it\n"
                    f"{started.logs()}")
    took = time.monotonic() - began
    code = int(out.stdout.strip().splitlines()[-1])
    logs = started.logs()
    assert code == 0, f"exit code {code} after SIGTERM\n{logs}"
    # One structured line per event (key=value from ts=, or JSON), nothing else: no
    # traceback, no library writing to the terminal (onnxruntime's telemetry warned here
    # until the image turned it off).
    unstructured = [line for line in logs.splitlines() if line and not line.startswith(("ts=", "{"))]
    assert not unstructured, "\n".join(unstructured)
    say(request, f"SIGTERM -> exit 0 in {took:.1f} s (budget {budget} s: grace "
                 f"{pod['terminationGracePeriodSeconds']} s - preStop {pre_stop} s)")


# ---------------------------------------------------------------------------------------
# The rendered overlay itself, with `podman kube play`


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_rendered_cpu_overlay_under_podman_kube_play(request, image, rendered, tmp_path):
    """`kubectl kustomize deploy/k8s/overlays/cpu`, every object of it, played by podman,
    which runs the Deployment's pod and passes over the kinds it does not play (Services,
    NetworkPolicy, HPA, ...). Three edits, none to what the container runs: the image is
    the one built here, imagePullPolicy IfNotPresent (Always pulls: there is no registry),
    and each containerPort gets hostIP 127.0.0.1 and a free hostPort (podman 4.3 otherwise
    publishes it on 0.0.0.0 at the same number; a cluster reaches it on the pod's IP).

    Checked: what podman made of the args, securityContext, limits and the /tmp volume, in
    the running process; the startup, readiness and liveness probes, run from outside as the
    kubelet runs them; `podman pod stop` with the grace period gives exit code 0. Reported:
    what podman did not apply."""
    import copy

    import yaml

    docs = copy.deepcopy(rendered["cpu"])
    spec = find(docs, "Deployment")["spec"]["template"]["spec"]
    container = only_container(spec)
    container["image"] = image
    container["imagePullPolicy"] = "IfNotPresent"
    for port in container["ports"]:
        port["hostIP"], port["hostPort"] = "127.0.0.1", free_port()
    kube = tmp_path / "cpu-overlay.yaml"
    kube.write_text(yaml.safe_dump_all(docs))

    # --replace: a pod of the same name left by an interrupted run is removed first.
    played = engine("kube", "play", "--replace", str(kube), timeout=300).stdout.split()
    try:
        pod_id = played[played.index("Pod:") + 1]
        container_id = played[played.index("Container:") + 1]
        pod = Pod(container_id, {p["containerPort"]: p["hostPort"] for p in container["ports"]},
                  container)
        startup = wait_probe(pod, container["startupProbe"])
        for kind in ("readinessProbe", "livenessProbe"):
            wait_probe(pod, container[kind])

        info = json.loads(engine("inspect", container_id).stdout)[0]
        config, host = info["Config"], info["HostConfig"]
        assert info["Args"][-len(container["args"]):] == container["args"]
        security = {**spec["securityContext"], **container["securityContext"]}
        assert config["User"] == f"{security['runAsUser']}:{security['runAsGroup']}"
        assert host["ReadonlyRootfs"] is True
        assert "no-new-privileges" in host["SecurityOpt"]
        assert host["Memory"] == quantity_bytes(container["resources"]["limits"]["memory"])
        assert host["NanoCpus"] == int(float(cpu_quantity(container["resources"]["limits"]["cpu"])) * 1e9)
        status = engine("exec", container_id, "cat", "/proc/1/status").stdout
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        assert fields["Uid"].split()[0] == str(security["runAsUser"])
        assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0
        assert fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2"
        mounts = {m["Destination"]: m for m in info["Mounts"]}
        for mount in container["volumeMounts"]:
            assert mounts[mount["mountPath"]]["RW"], f"{mount['mountPath']} is not writable"
        write = engine("exec", container_id, "python", "-c",
                       "open('/tmp/probe', 'w').close(); open('/probe', 'w')", check=False)
        assert "Read-only file system" in write.stderr and "/probe" in write.stderr, write.stderr

        grace = spec["terminationGracePeriodSeconds"]
        began = time.monotonic()
        engine("pod", "stop", "--time", str(grace), pod_id, timeout=grace + 30)
        took = time.monotonic() - began
        state = json.loads(engine("inspect", container_id).stdout)[0]["State"]
        assert state["ExitCode"] == 0, f"exit code {state['ExitCode']}\n{pod.logs()}"

        volume = mounts[container["volumeMounts"][0]["mountPath"]]
        not_applied = [
            "probes: none made a podman healthcheck (startup and liveness are grpc:, "
            "readiness httpGet:)" if not config.get("Healthcheck")
            else f"probes: healthcheck {config['Healthcheck']}",
            f"terminationGracePeriodSeconds {grace}: container StopTimeout {config.get('StopTimeout')}",
            "lifecycle.preStop: not run by podman",
            f"emptyDir {container['volumeMounts'][0]['name']}: a {volume['Type']} "
            f"{volume.get('Name', '')!r}, sizeLimit not applied",
            "Services, NetworkPolicy, PodDisruptionBudget, HPA, ServiceMonitor, PrometheusRule,"
            " Namespace, ServiceAccount: not played",
        ]
        say(request, f"kube play: pod up, startup probe passed after {startup:.1f} s, readiness and "
                     f"liveness too; args, user, read-only root, capabilities, no-new-privileges, "
                     f"seccomp, limits and /tmp as the manifest says; pod stop -> exit 0 in "
                     f"{took:.1f} s. Not applied by podman {podman_version()}: "
                     + "; ".join(not_applied))
    finally:
        engine("kube", "down", str(kube), check=False, timeout=120)


def podman_version() -> str:
    return engine("version", "--format", "{{.Client.Version}}").stdout.strip()
