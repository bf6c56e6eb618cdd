"""`attnserve serve` settings: command-line flags, each with an ATTNSERVE_* environment twin."""

import argparse
import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ServeConfig:
    artifact: Path
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 8000
    device: str = "auto"
    precision: str = "auto"
    max_batch_tokens: int = 16384
    max_batch_size: int = 64
    max_wait_ms: float = 0.0
    max_queue_requests: int = 1024
    max_queue_tokens: int = 262144
    memory_budget_bytes: int = 0
    drain_seconds: float = 20.0
    max_message_bytes: int = 64 * 1024 * 1024
    max_connection_age_seconds: float = 300.0
    intra_op_threads: int = 0
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        for name in ("max_batch_tokens", "max_batch_size", "max_queue_requests",
                     "max_queue_tokens", "max_message_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        for name in ("max_wait_ms", "memory_budget_bytes", "drain_seconds",
                     "max_connection_age_seconds", "intra_op_threads", "metrics_port", "port"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative")


_HELP = {
    "artifact": "artifact directory written by `attnserve export`",
    "host": "address the gRPC port binds to",
    "port": "gRPC port (EncoderService, Open Inference Protocol, health, reflection)",
    "metrics_host": "address the Prometheus /metrics port binds to",
    "metrics_port": "Prometheus /metrics port (0 disables it)",
    "device": "auto: CUDA when a GPU and the CUDA provider are usable, else CPU; "
              "cuda: fail at start when CUDA cannot be used",
    "precision": "auto: fp16 graphs on CUDA when the artifact has them, fp32 elsewhere",
    "max_batch_tokens": "cap on padded tokens (batch × longest sequence) in one batch",
    "max_batch_size": "cap on sequences in one batch",
    "max_wait_ms": "how long an idle scheduler waits to gather a first batch; 0: run at "
                   "once (batches still form from what queues while one runs)",
    "max_queue_requests": "queued requests past which new ones get RESOURCE_EXHAUSTED",
    "max_queue_tokens": "queued tokens past which new requests get RESOURCE_EXHAUSTED",
    "memory_budget_bytes": "peak memory one batch may take; 0: a safe share of the device "
                           "(CUDA) or machine (CPU) memory",
    "drain_seconds": "on SIGTERM, how long accepted work may take to finish",
    "max_message_bytes": "largest gRPC message received or sent",
    "max_connection_age_seconds": "close client connections after this long (they reconnect at "
                                  "once), so clients balancing over a headless Service find new "
                                  "replicas; 0 keeps connections forever",
    "intra_op_threads": "onnxruntime intra-op threads; 0: one per core",
    "tls_cert": "PEM certificate chain: serve TLS",
    "tls_key": "PEM private key for --tls-cert",
    "tls_client_ca": "PEM CA bundle: require client certificates signed by it (mTLS)",
    "log_level": "debug, info, warning or error",
}
_CHOICES = {
    "device": ("auto", "cuda", "cpu"),
    "precision": ("auto", "fp32", "fp16"),
    "log_level": ("debug", "info", "warning", "error"),
}


def env_name(field: str) -> str:
    return "ATTNSERVE_" + field.upper()


def _field_type(name: str) -> type:
    kind = ServeConfig.__dataclass_fields__[name].type
    return kind if isinstance(kind, type) else Path  # `Path | None`


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ServeConfig field; the environment twin, when set, is the default."""
    for name, field in ServeConfig.__dataclass_fields__.items():
        default = None if field.default is dataclasses.MISSING else field.default
        default = os.environ.get(env_name(name), default)
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=_field_type(name),
            default=default,
            required=default is None and name == "artifact",
            choices=_CHOICES.get(name),
            help=f"{_HELP[name]} (env {env_name(name)})",
        )


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    values = {}
    for name in ServeConfig.__dataclass_fields__:
        value = getattr(args, name)
        if value is not None and value != "":
            values[name] = _field_type(name)(value)  # env defaults arrive as strings
    return ServeConfig(**values)
