"""Health, reflection, start-up checks and the `attnserve embed` command line."""

import socket
import subprocess

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests import harness
from tests.harness import ATTNSERVE, REPO


def test_health_serves_every_service(tiny_server):
    with grpc.insecure_channel(tiny_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "attnserve.v1.EncoderService", "inference.GRPCInferenceService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(tiny_server):
    with grpc.insecure_channel(tiny_server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        (response,) = list(stub.ServerReflectionInfo(iter([request])))
        names = {s.name for s in response.list_services_response.service}
    assert {"attnserve.v1.EncoderService", "inference.GRPCInferenceService",
            "grpc.health.v1.Health"} <= names


def test_device_cuda_without_a_gpu_exits_with_a_clear_message(tiny_artifact):
    result = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(tiny_artifact), "--port", "0",
                             "--metrics-port", "0", "--device", "cuda"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--device cuda: no usable GPU" in result.stderr
    assert "Traceback" not in result.stderr


def test_check_config_validates_without_serving(tiny_artifact, tmp_path):
    ok = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(tiny_artifact), "--check-config"],
                        cwd=REPO, capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "config ok" in ok.stdout
    missing = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(tmp_path), "--check-config"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "manifest.json: missing" in missing.stderr


def test_embed_command_prints_writes_npy_and_draws_a_heatmap(tiny_server, tmp_path):
    printed = subprocess.run([*ATTNSERVE, "embed", "hello world", "--address", tiny_server.address],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0 and "'hello world': dim=32" in printed.stdout
    texts = tmp_path / "texts.txt"
    texts.write_text("one\ntwo two\nthree three three\n")
    out, png = tmp_path / "out.npy", tmp_path / "map.png"
    written = subprocess.run([*ATTNSERVE, "embed", "--file", str(texts), "--out", str(out),
                              "--address", tiny_server.address, "--batch-size", "2",
                              "--heatmap", str(png), "--layers", "-1", "--heads", "1"],
                             cwd=REPO, capture_output=True, text=True, timeout=60)
    assert written.returncode == 0, written.stderr
    assert np.load(out).shape == (3, 32) and "3/3 texts" in written.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_nonsensical_flag_is_refused_at_start(tiny_artifact):
    result = subprocess.run([*ATTNSERVE, "serve", "--artifact", str(tiny_artifact),
                             "--max-batch-size", "0", "--check-config"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--max-batch-size: must be at least 1" in result.stderr and "Traceback" not in result.stderr


def test_a_port_taken_before_the_server_binds_it_is_tried_again(tiny_artifact, monkeypatch):
    """The harness picks /metrics and HTTP ports that are free when picked; another
    process can take one before the server binds it (it happened in CI). The server then
    exits on "address already in use" and the harness starts it again on other ports."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        picks = iter([port])
        real = harness.free_port
        monkeypatch.setattr(harness, "free_port", lambda: next(picks, None) or real())
        with harness.ServerProcess(tiny_artifact) as server, \
                grpc.insecure_channel(server.address) as channel:
            assert port not in (server.metrics_port, server.http_port)
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
