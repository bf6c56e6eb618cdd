"""`attnserve serve` settings: command-line flags, each with an ATTNSERVE_* environment twin.

A value from a flag and one from the environment go through the same conversion and the
same checks (`config_from_args`), and an error names where the bad value came from: a
flag wins over its twin, an empty value counts as unset."""

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from importlib.util import find_spec
from pathlib import Path
from urllib.parse import urlparse, urlsplit


class ConfigError(ValueError):
    """A setting that cannot be used; its message starts with the flag or variable at fault."""

    def __init__(self, field: str, reason: str, source: str | None = None):
        self.field, self.reason = field, reason
        super().__init__(f"{source or flag(field)}: {reason}")


@dataclass(frozen=True)
class ModelSource:
    """One `--artifact [NAME=]DIR`: an artifact directory, and the name it is served by
    (None: its manifest's model_name)."""

    path: Path
    name: str | None = None

    @classmethod
    def parse(cls, text: str, source: str | None = None) -> "ModelSource":
        """DIR, or NAME=DIR; a text naming an existing directory is a DIR, whatever it holds."""
        name, sep, path = text.partition("=")
        if not sep or Path(text).is_dir():
            return cls(Path(text))
        if not name.strip():
            raise ConfigError("artifact", f"{text!r}: an empty NAME; write NAME=DIR, or DIR to "
                                          "serve it under its manifest's model name", source)
        if not path:
            raise ConfigError("artifact", f"{text!r}: no DIR after {name}=", source)
        return cls(Path(path), name)

    def __str__(self) -> str:
        return str(self.path) if self.name is None else f"{self.name}={self.path}"


ANY_ORIGIN = "*"


def cors_origin(text: str, source: str | None = None) -> str:
    """One `--cors-allow-origin`: `*`, or an origin as a browser sends it in `Origin`
    (scheme://host[:port], nothing after it), lower-cased as browsers send it."""
    origin = text.strip()
    if origin == ANY_ORIGIN:
        return origin
    try:
        parts = urlsplit(origin)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as err:
        raise ConfigError("cors_allow_origin", f"{text!r}: not an origin ({err})", source) from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username is not None \
            or parts.path or parts.query or parts.fragment or origin.endswith(("?", "#")):
        raise ConfigError("cors_allow_origin", f"{text!r}: not an origin; write * or "
                                               "scheme://host[:port], e.g. https://app.example.com "
                                               "(no path, no trailing slash)", source)
    return origin.lower()


@dataclass(frozen=True)
class ServeConfig:
    artifact: tuple[ModelSource, ...]
    host: str = "0.0.0.0"
    port: int = 50051
    metrics_host: str = "0.0.0.0"
    metrics_port: int = 8000
    http_port: int = 8080
    http_max_body_bytes: int = 4 * 1024 * 1024
    http_header_timeout_seconds: float = 15.0
    http_body_timeout_seconds: float = 30.0
    device: str = "auto"
    precision: str = "auto"
    max_batch_tokens: int = 16384
    max_batch_size: int = 64
    max_wait_ms: float = 0.0
    max_queue_requests: int = 1024
    max_queue_tokens: int = 262144
    bulk_batch_ms: float = 20.0
    priority_aging_ms: float = 1000.0
    interactive_window_ms: float = 1000.0
    max_chunking_chars: int = 1 << 20
    default_prompt_name: str | None = None
    memory_budget_bytes: int = 0
    drain_seconds: float = 20.0
    max_message_bytes: int = 64 * 1024 * 1024
    max_connection_age_seconds: float = 300.0
    intra_op_threads: int = 0
    shape_buckets: str = "auto"
    bucket_seq_multiple: int = 32
    sessions: int = 0
    workers: str = "auto"
    cuda_graphs: str = "off"
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None
    api_key: str | None = None
    api_key_file: Path | None = None
    cors_allow_origin: tuple[str, ...] = ()
    log_level: str = "info"
    otlp_endpoint: str | None = None
    ready_file: Path | None = None

    def __post_init__(self) -> None:
        if not self.artifact:
            raise ConfigError("artifact", f"required (or set {env_name('artifact')})")
        if len(self.artifact) > MAX_MODELS:
            raise ConfigError("artifact", f"{len(self.artifact)} given; a server serves at most "
                                          f"{MAX_MODELS} models")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ConfigError(name, f"{getattr(self, name)!r} is not one of {', '.join(allowed)}")
        for name in ("max_batch_tokens", "max_batch_size", "max_queue_requests", "max_queue_tokens",
                     "max_chunking_chars", "max_message_bytes", "http_max_body_bytes", "bucket_seq_multiple"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be at least 1")
        for name in ("http_header_timeout_seconds", "http_body_timeout_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, "must be more than 0")
        for name in ("max_wait_ms", "bulk_batch_ms", "priority_aging_ms", "interactive_window_ms",
                     "memory_budget_bytes", "drain_seconds", "max_connection_age_seconds",
                     "intra_op_threads", "metrics_port", "port", "http_port", "sessions"):
            if getattr(self, name) < 0:
                raise ConfigError(name, "must not be negative")
        if self.workers != "auto" and not (self.workers.isascii() and self.workers.isdigit()
                                           and 1 <= int(self.workers) <= MAX_WORKERS):
            raise ConfigError("workers", f"{self.workers!r} is not auto or a number of "
                                         f"processes from 1 to {MAX_WORKERS}")
        if self.otlp_endpoint is not None:
            _check_otlp_endpoint(self.otlp_endpoint)
        if self.cuda_graphs == "on" and self.shape_buckets == "off":
            raise ConfigError("cuda_graphs", "needs shape buckets (one graph per bucket): "
                                             "drop --shape-buckets off")


# What --otlp-endpoint needs installed: pip install 'attnserve[otlp]'.
OTLP_MODULES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter")


def _check_otlp_endpoint(endpoint: str) -> None:
    url = urlparse(endpoint)
    if url.scheme not in ("http", "https") or not url.hostname or url.path not in ("", "/"):
        raise ConfigError("otlp_endpoint", f"{endpoint!r} is not http://HOST:PORT or "
                                           "https://HOST:PORT (an OTLP/gRPC collector)")
    for name in OTLP_MODULES:
        try:
            found = find_spec(name) is not None
        except ImportError:  # a parent package missing
            found = False
        if not found:
            raise ConfigError("otlp_endpoint", f"needs the 'otlp' extra, which is not installed (no "
                                               f"{name}): pip install 'attnserve[otlp]'")


MAX_WORKERS = 64
MAX_MODELS = 32
CHOICES = {
    "device": ("auto", "cuda", "cpu"),
    "precision": ("auto", "fp32", "fp16", "int8"),
    "log_level": ("debug", "info", "warning", "error"),
    "shape_buckets": ("auto", "on", "off"),
    "cuda_graphs": ("on", "off"),
}
_HELP = {
    "artifact": "[NAME=]DIR: an artifact directory written by `attnserve export`, served as NAME (default: "
                "its manifest's model name); repeat it to serve several models, the first the default for "
                "requests that name none (required; in the environment twin, several are separated by "
                "commas)",
    "host": "address the gRPC port binds to",
    "port": "gRPC port (EncoderService, Open Inference Protocol, health, reflection); 0: one the OS picks "
            "(see --ready-file)",
    "metrics_host": "address the Prometheus /metrics port binds to",
    "metrics_port": "Prometheus /metrics port (0 disables it)",
    "http_port": "HTTP port on --host: OpenAI's, Infinity's and TEI's routes, KServe v2 REST (/v2/...), GET "
                 "/health, /openapi.json and its page /docs (0 disables it)",
    "http_max_body_bytes": "largest HTTP request body (413 past it); it bounds the time parsing one JSON "
                           "body holds the interpreter (~7 ms per MiB of texts, ~45 ms per MiB of one-id "
                           "lists)",
    "http_header_timeout_seconds": "an HTTP connection closes when a request's headers are not all in this "
                                   "long after it opened or after its last answer (so an idle keep-alive "
                                   "connection closes after it too)",
    "http_body_timeout_seconds": "an HTTP request whose body is not all in this long after its headers gets "
                                 "408 and its connection closes",
    "device": "auto: CUDA when a GPU and the CUDA provider are usable, else CPU; cuda: fail at start when "
              "CUDA cannot be used",
    "precision": "auto: fp16 graphs on CUDA when the artifact has them, fp32 elsewhere; int8: the CPU's "
                 "quantized graphs (export --int8)",
    "max_batch_tokens": "cap on padded tokens in one batch (rows × length as run: batch × longest sequence, "
                        "or the shape bucket's)",
    "max_batch_size": "cap on sequences in one batch",
    "max_wait_ms": "how long an idle scheduler waits to gather a first batch; 0: run at once (batches still "
                   "form from what queues while one runs)",
    "max_queue_requests": "queued requests past which new ones get RESOURCE_EXHAUSTED (bulk ones past three "
                          "quarters of it: the rest is kept for interactive calls)",
    "max_queue_tokens": "queued tokens past which new requests get RESOURCE_EXHAUSTED (bulk ones past three "
                        "quarters of it)",
    "bulk_batch_ms": "while interactive work is arriving (--interactive-window-ms), a batch of bulk work "
                     "holds only the sequences whose predicted time (the artifact's time model, else the "
                     "batches run so far) stays within this, and at least one: an interactive batch runs "
                     "beside it, and where none can (--cuda-graphs) waits at most about this long behind "
                     "the batch running when it arrives; 0: bulk batches are never cut",
    "priority_aging_ms": "bulk work counts as having arrived this much after the later of its arrival and "
                         "the start of the last bulk batch when the next batch's class is chosen: "
                         "interactive work goes first while bulk batches run, and waiting bulk work yields "
                         "only to interactive work that arrived less than this after the last bulk batch "
                         "started",
    "interactive_window_ms": "interactive work counts as arriving while some waits and for this long after "
                             "an interactive request last arrived or an interactive batch last started "
                             "(bulk batches are cut meanwhile: --bulk-batch-ms)",
    "max_chunking_chars": "longest text (in Unicode code points) a request with chunking may carry; a "
                          "longer one gets INVALID_ARGUMENT naming it. A chunked text is tokenized whole "
                          "and costs what its windows or chunks cost against --max-queue-tokens and the "
                          "memory budget",
    "default_prompt_name": "the prompt (one of a model's prompts, as GetModelInfo lists them) put before "
                           "the texts of every request that names none, for every model that has a prompt "
                           "of this name; a model without one keeps its own default prompt (its "
                           "checkpoint's default_prompt_name), or none, and the start-up log says which",
    "memory_budget_bytes": "peak memory the batches in flight and the requests and answers held may take "
                           "together (on CUDA the batches alone: requests and answers get half the "
                           "machine's free memory); 0: half the device's (CUDA) or machine's (CPU) memory "
                           "free at start",
    "drain_seconds": "on SIGTERM, how long accepted work may take to finish",
    "max_message_bytes": "largest gRPC message received or sent, and largest HTTP response",
    "max_connection_age_seconds": "close client connections after this long (they reconnect at once; calls "
                                  "in flight on them finish), so clients balancing over a headless Service "
                                  "find new replicas; 0 keeps connections forever",
    "intra_op_threads": "onnxruntime intra-op threads; 0: one per core this process may use on the CPU, 1 "
                        "on CUDA",
    "shape_buckets": "pad every batch to a bounded set of shapes (rows to a power of two up to "
                     "--max-batch-size, length to a multiple of --bucket-seq-multiple) and run each once "
                     "before health says SERVING, so no caller meets a shape's first run (~55 ms on an "
                     "H200); auto: on with CUDA, off on the CPU (where a padded token costs as much as a "
                     "real one and a new shape nothing)",
    "bucket_seq_multiple": "with shape buckets, lengths round up to a multiple of this",
    "sessions": "onnxruntime sessions per graph, each running its own batch at the same time on its own "
                "inference thread; 0: 2 with CUDA (the device overlaps one batch's host work with another's "
                "kernels), 1 on the CPU (one batch already uses every core)",
    "workers": "front-end processes (each parsing, tokenizing and packing on its own event loop, all on the "
               "same ports) around one engine process that owns the sessions, the queue, the batch loop and "
               "the memory budget; 1: one process, no hop between them; auto: 1 on the CPU, on a GPU one "
               "for every two cores this process may use (its CPU limit counted), at most 8",
    "cuda_graphs": "on: capture one CUDA graph per shape bucket (needs shape buckets) and replay it, with "
                   "fixed input and output buffers (IO binding); on the CPU only the fixed buffers",
    "tls_cert": "PEM certificate chain: serve TLS",
    "tls_key": "PEM private key for --tls-cert",
    "tls_client_ca": "PEM CA bundle: require client certificates signed by it (mTLS)",
    "api_key": "require this key on every call but health checks, reflection and /openapi.json: gRPC "
               "metadata 'authorization: Bearer KEY', HTTP header 'Authorization: Bearer KEY'",
    "api_key_file": "file of API keys, one a line (a mounted Kubernetes Secret), taken as --api-key is; "
                    "both may be given. A key may be followed by class=bulk (or interactive: every call "
                    "made with it is of that priority class, whatever it names) and max_inflight=N (at most "
                    "N of its calls handled at once across --workers; one more gets RESOURCE_EXHAUSTED / "
                    "429 with Retry-After)",
    "cors_allow_origin": "let web pages of this origin (scheme://host[:port], or * for any) call the HTTP "
                         "port from a browser: preflights answered, answers marked for it; repeat it or "
                         "separate origins by commas. None by default",
    "log_level": "the least severe log lines written",
    "otlp_endpoint": "send one trace span per call (its tokenize, queue, inference and respond steps "
                     "beneath it) to the OpenTelemetry collector at this OTLP/gRPC endpoint, "
                     "http://HOST:PORT (https:// for TLS); a caller's W3C traceparent is continued. Needs "
                     "the otlp extra (pip install 'attnserve[otlp]'); off by default, costing nothing then",
    "ready_file": "once health is SERVING, write {\"port\", \"metrics_port\", \"http_port\", \"pid\"} as "
                  "JSON to this file (whole: written beside it, then renamed), for whoever started the "
                  "server and waits for it",
}
_TYPE_NAMES = {int: "an integer", float: "a number"}
# The flags that may be given more than once: how each value is read, and whether a flag's
# value is split at commas too (an artifact's path may hold one; the twin's is always split).
REPEATED = {"artifact": (ModelSource.parse, False), "cors_allow_origin": (cors_origin, True)}
_METAVARS = {"artifact": "[NAME=]DIR", "cors_allow_origin": "ORIGIN"}


def flag(field: str) -> str:
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    return "ATTNSERVE_" + field.upper()


def _field_type(name: str) -> type:
    kind = ServeConfig.__dataclass_fields__[name].type
    if isinstance(kind, type):
        return kind
    return next(t for t in kind.__args__ if t is not type(None))  # `Path | None`, `str | None`


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ServeConfig field, taken as text: `config_from_args` converts and checks
    flags and environment twins alike."""
    for field in fields(ServeConfig):
        default = "" if field.default in (MISSING, None, ()) else f"; default {field.default}"
        choices = CHOICES.get(field.name)
        parser.add_argument(flag(field.name), default=None,
                            action="append" if field.name in REPEATED else "store",
                            metavar="{" + ",".join(choices) + "}" if choices else _METAVARS.get(field.name),
                            help=f"{_HELP[field.name]}{default} (env {env_name(field.name)})")


def config_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServeConfig:
    """The flags given, else their environment twins, else the defaults (ConfigError: a bad value)."""
    environ = os.environ if environ is None else environ
    values, from_env = {}, set()
    for name in (f.name for f in fields(ServeConfig)):
        raw = getattr(args, name)
        if raw is None or raw == "":
            raw = environ.get(env_name(name), "")
            if raw == "":
                continue
            from_env.add(name)
        if name in REPEATED:
            parse, split_flags = REPEATED[name]
            texts = raw if isinstance(raw, list) and not split_flags else [
                text for value in (raw if isinstance(raw, list) else [raw])
                for text in value.split(",")]
            values[name] = tuple(parse(text, _source(name, from_env)) for text in texts if text)
            continue
        kind = _field_type(name)
        try:
            values[name] = kind(raw)
        except ValueError:
            raise ConfigError(name, f"{raw!r} is not {_TYPE_NAMES.get(kind, kind.__name__)}",
                              _source(name, from_env)) from None
    values.setdefault("artifact", ())
    try:
        return ServeConfig(**values)
    except ConfigError as err:
        if err.field not in from_env:
            raise
        raise ConfigError(err.field, err.reason, _source(err.field, from_env)) from None


def _source(name: str, from_env: set[str]) -> str:
    return f"{env_name(name)} (environment)" if name in from_env else flag(name)


def config_to_json(config: ServeConfig) -> str:
    """The settings, for a process the server starts itself (--workers)."""
    return json.dumps({f.name: getattr(config, f.name) for f in fields(config)},
                      default=lambda v: [str(v.path), v.name] if isinstance(v, ModelSource) else str(v))


def config_from_json(text: str) -> ServeConfig:
    values = json.loads(text)
    values["artifact"] = tuple(ModelSource(Path(path), name) for path, name in values["artifact"])
    values["cors_allow_origin"] = tuple(values["cors_allow_origin"])
    return ServeConfig(**{name: value if value is None or name in REPEATED
                          else _field_type(name)(value) for name, value in values.items()})
