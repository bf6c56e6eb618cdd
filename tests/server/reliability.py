"""Helpers for the reliability and security tests (issue 6): servers with a reachable
/metrics port, the in-process reference, health, scrapes and the server's memory."""

import re
import socket
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from attnserve.artifact import load_artifact
from attnserve.server._proto.attnserve.v1 import encoder_pb2 as pb
from attnserve.server._proto.attnserve.v1 import encoder_pb2_grpc as pb_grpc
from attnserve.server._proto.inference import grpc_service_pb2 as kpb
from attnserve.server.runtime import Runtime
from tests.conftest import ServerProcess

CLS, SEP = 101, 102
MIB = 1 << 20
BIG = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
# What a hostile or overloaded call may get back; anything else is a broken promise.
EXPECTED_REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                     grpc.StatusCode.NOT_FOUND}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(artifact: Path, *flags: str, env: dict | None = None) -> ServerProcess:
    """A server of our own, sure to have /metrics on a port of its own (`--metrics-port 0`
    means "no metrics"); later flags win over the fixture's."""
    return ServerProcess(artifact, "--metrics-port", str(free_port()), *flags, env=env)


def ids_of(rng: np.random.Generator, length: int) -> list[int]:
    """[CLS] w… [SEP], `length` ids in all (1 means a lone [CLS])."""
    body = rng.integers(1000, 30000, size=max(0, length - 2)).tolist()
    return ([CLS] + body + [SEP])[:length]


def health(address: str, service: str = "", timeout: float = 5,
           credentials: grpc.ChannelCredentials | None = None) -> str:
    channel = (grpc.secure_channel(address, credentials) if credentials
               else grpc.insecure_channel(address))
    with channel:
        response = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def scrape(server: ServerProcess) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def status_bytes(pid: int, field: str) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024


def rss(pid: int) -> int:
    return status_bytes(pid, "VmRSS")


def stub(channel: grpc.Channel) -> pb_grpc.EncoderServiceStub:
    return pb_grpc.EncoderServiceStub(channel)


def embed_ids(sequences: list[list[int]], layers: list[int] | None = None) -> pb.EmbedRequest:
    """Token ids in; token embeddings and the mean-pooled vector out."""
    request = pb.EmbedRequest(token_ids=[pb.TokenIds(ids=s) for s in sequences],
                              pooling=pb.POOLING_MEAN, return_token_embeddings=True)
    if layers is not None:
        request.attention.CopyFrom(pb.AttentionOptions(layers=layers))
    return request


def tensor(t: pb.Tensor) -> np.ndarray:
    assert t.dtype in (pb.DTYPE_UNSPECIFIED, pb.DTYPE_FLOAT32)
    return np.frombuffer(t.data, dtype="<f4").reshape(tuple(t.shape))


def infer_request(model: str, sequences: list[list[int]]) -> kpb.ModelInferRequest:
    """KServe v2: the sequences padded into one [batch, seq] INT64 tensor pair."""
    seq = max(map(len, sequences))
    ids = np.zeros((len(sequences), seq), dtype="<i8")
    mask = np.zeros_like(ids)
    for row, s in enumerate(sequences):
        ids[row, :len(s)] = s
        mask[row, :len(s)] = 1
    request = kpb.ModelInferRequest(model_name=model)
    for name, array in (("input_ids", ids), ("attention_mask", mask)):
        request.inputs.add(name=name, datatype="INT64", shape=array.shape)
        request.raw_input_contents.append(array.tobytes())
    return request


class Reference:
    """The artifact's graphs in this process, one sequence at a time: what a caller must
    get for its own input whatever else shared its batch."""

    def __init__(self, artifact: Path):
        self.runtime = Runtime(load_artifact(artifact), device="cpu", intra_op_threads=1)

    def run(self, ids: list[int], layers: tuple[int, ...] = ()):
        array = np.asarray([ids], dtype=np.int64)
        out = self.runtime.run(array, np.ones_like(array), layers)
        return out.hidden[0], {k: v[0] for k, v in out.attentions.items()}

    def check_embedding(self, ids: list[int], embedding: pb.Embedding,
                        layers: tuple[int, ...] = (), atol: float = 1e-5) -> float:
        """The worst difference from the reference; asserts it is within atol."""
        hidden, maps = self.run(ids, layers)
        assert list(embedding.token_ids) == list(ids)
        worst = float(np.abs(tensor(embedding.token_embeddings) - hidden).max())
        worst = max(worst, float(np.abs(tensor(embedding.pooled) - hidden.mean(axis=0)).max()))
        if layers:
            got = tensor(embedding.attentions)
            assert got.shape == (len(layers), *maps[layers[0]].shape)
            worst = max(worst, max(float(np.abs(got[k] - maps[layer]).max())
                                   for k, layer in enumerate(layers)))
        assert worst <= atol, f"{worst} off the reference for ids {ids[:8]}…"
        return worst

    def check_infer(self, sequences: list[list[int]], response: kpb.ModelInferResponse,
                    atol: float = 1e-5) -> float:
        out = response.outputs[0]
        assert out.name == "last_hidden_state"
        hidden = np.frombuffer(response.raw_output_contents[0], dtype="<f4").reshape(
            tuple(out.shape))
        worst = 0.0
        for row, s in enumerate(sequences):
            expected, _ = self.run(s)
            worst = max(worst, float(np.abs(hidden[row, :len(s)] - expected).max()))
            assert not hidden[row, len(s):].any(), "padding reached the caller"
        assert worst <= atol, f"{worst} off the reference"
        return worst


def wait_for(predicate, timeout: float, step: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def sequences_for(encoder, rng: np.random.Generator, seconds: float, length: int = 512,
                  most: int = 24) -> int:
    """How many `length`-token sequences keep the server busy for about `seconds`: one is
    timed (which also warms the path up) and the count scaled, so a faster machine gets a
    longer request instead of a test that races it."""
    started = time.monotonic()
    encoder.Embed(embed_ids([ids_of(rng, length)]), timeout=120)
    one = time.monotonic() - started
    return max(4, min(most, int(np.ceil(seconds / max(one, 1e-3)))))
