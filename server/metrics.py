"""Prometheus metrics (docs/operations.md lists them): prefix attnserve_, base units in the
name, counters end in _total, small label sets (lengths go into buckets); series of work
carry the priority class of the call it came from (priority.py).

With --workers, each front end counts into prometheus-client's multiprocess files (the
PROMETHEUS_MULTIPROC_DIR its supervisor set) and the engine process, which counts in its
own memory (a batch's dozen observations stay cheap), serves its counts and theirs
merged. Values read when a scrape is taken come from `Live`, in the process serving it."""

import contextlib
import itertools
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.samples import Sample

from attnserve.server.priority import CLASSES, Priority, of_call

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
MEMORY_BUCKETS = tuple(float(1 << shift) for shift in range(20, 37, 2))  # 1 MiB .. 64 GiB


def answered_by_code(families: Iterable[Metric]) -> str:
    """Calls answered by status over the counts' life, e.g. OK:12,UNAVAILABLE:3 (every rpc
    summed), from collected metric families: what callers must have received, to compare
    against their count."""
    counts: dict[str, int] = {}
    for sample in itertools.chain.from_iterable(family.samples for family in families):
        if sample.name == "attnserve_requests_total":
            counts[sample.labels["code"]] = counts.get(sample.labels["code"], 0) + int(sample.value)
    return ",".join(f"{code}:{n}" for code, n in sorted(counts.items())) or "none"


# The model a call was routed to, for its request series: set by the data plane once it has
# found the model a call names (an unknown name is never a label: the set stays bounded).
_CALL_MODEL: ContextVar[list[str] | None] = ContextVar("attnserve_call_model", default=None)


def call_model() -> list[str]:
    """A new call's model label, "" until `Metrics.routed_to` names it (in the same task)."""
    cell = [""]
    _CALL_MODEL.set(cell)
    return cell


@dataclass(eq=False)
class Live:
    """Values read when /metrics is scraped, set by whoever owns them."""

    info: dict[str, dict[str, str]] = field(default_factory=dict)
    """model -> its attnserve_info labels"""
    device: str = "cpu"
    device_memory_used: Callable[[], float] = lambda: 0.0
    device_memory_total: float = 0.0
    queue_depth: dict[str, Callable[[], dict[Priority, int]]] = field(default_factory=dict)
    """model -> its queue's depth by class"""
    serving: Callable[[], bool] = lambda: False

    def collect(self):
        info = InfoMetricFamily("attnserve", "The models being served, one series each.",
                                labels=["model", "provider", "precision", "artifact_sha256"])
        for model, labels in self.info.items():
            info.add_metric([model, labels["provider"], labels["precision"],
                             labels["artifact_sha256"]], {})
        yield info
        for name, doc, value in (
                ("attnserve_device_memory_used_bytes", "Device memory in use (NVML on a GPU; the "
                 "resident set of the server's processes on the CPU).", self.device_memory_used()),
                ("attnserve_device_memory_total_bytes", "Device memory in all (NVML on a GPU; on "
                 "the CPU the machine's memory, or the container's limit when lower).",
                 self.device_memory_total)):
            family = GaugeMetricFamily(name, doc, labels=["device"])
            family.add_metric([self.device], value)
            yield family
        depth = GaugeMetricFamily("attnserve_queue_depth", "Requests accepted and waiting for a "
                                  "batch (some of their sequences not yet running), by model and "
                                  "priority class.", labels=["model", "priority"])
        for model, read in self.queue_depth.items():
            depths = read()
            for priority in CLASSES:
                depth.add_metric([model, priority.value], depths[priority])
        yield depth
        yield GaugeMetricFamily("attnserve_health_serving", "1 while grpc.health.v1 answers "
                                "SERVING.", value=1 if self.serving() else 0)


class Merged:
    """This process's metrics and those the front ends count in `directory`, one family
    a name, each sample summed over the processes (one that never counted adds 0)."""

    def __init__(self, own: CollectorRegistry, directory: str):
        self.own, self.directory = own, Path(directory)

    def _files(self) -> list[str]:
        """The front ends' files with counts in them. A process creates its file empty and
        sizes it a moment later (prometheus-client's MmapedDict): one read in between would
        fail the whole scrape, and holds no count yet. A file removed meanwhile (a dead front
        end's live gauges) is passed over too."""
        files = []
        for path in self.directory.glob("*.db"):
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_size:
                    files.append(str(path))
        return files

    def collect(self):
        families: dict[str, Metric] = {}
        front_ends = MultiProcessCollector.merge(self._files(), accumulate=True)
        for metric in itertools.chain(self.own.collect(), front_ends):
            family = families.setdefault(metric.name, Metric(metric.name, metric.documentation,
                                                             metric.type, metric.unit))
            family.samples += metric.samples
        for family in families.values():
            totals: dict[tuple, Sample] = {}
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                seen = totals.get(key)
                totals[key] = sample if seen is None else seen._replace(value=seen.value + sample.value)
            family.samples = list(totals.values())
        return families.values()


class Labelled:
    """A labelled metric whose series are each looked up once: prometheus_client's `labels()`
    checks and converts its values and takes a lock on every call (1.5-3 µs; a call moves
    about 17 series). Anything else is the metric's own."""

    def __init__(self, metric: Counter | Gauge | Histogram):
        self.metric, self.series = metric, {}

    def labels(self, *values: str):
        series = self.series.get(values)
        if series is None:
            series = self.series[values] = self.metric.labels(*values)
        return series

    def __getattr__(self, name: str):
        return getattr(self.metric, name)


class Metrics:
    def __init__(self, max_positions: int, front_ends_dir: str | None = None):
        """`front_ends_dir`: where a server's front ends count (--workers): `registry`
        serves their counts with this process's."""
        counted = CollectorRegistry()
        self.registry = counted if front_ends_dir is None else CollectorRegistry()
        if front_ends_dir is not None:
            self.registry.register(Merged(counted, front_ends_dir))
        def labelled(kind: type[Counter | Gauge | Histogram], *args, **kwargs) -> Labelled:
            return Labelled(kind(*args, registry=counted, **kwargs))

        histogram, counter = partial(labelled, Histogram), partial(labelled, Counter)
        # The length buckets' upper edges: 16, 32, ... up to the model's maximum.
        self.edges = [16 << i for i in range(max_positions.bit_length())
                      if 16 << i < max_positions] + [max_positions]
        self.request_duration = histogram(
            "attnserve_request_duration_seconds", "Time from receiving a request to answering it, "
            "by RPC, status code, model and the call's priority class.",
            ["rpc", "code", "model", "priority"], buckets=LATENCY_BUCKETS)
        self.requests = counter(
            "attnserve_requests", "Requests answered, by RPC, status code, model (empty when "
            "the call named no model the server serves) and the call's priority class.",
            ["rpc", "code", "model", "priority"])
        self.stage_duration = histogram(
            "attnserve_stage_duration_seconds", "Time per stage: queue (waiting for a batch), tokenize, "
            "inference, respond.", ["model", "stage"], buckets=LATENCY_BUCKETS)
        self.batch_size = histogram("attnserve_batch_size", "Sequences per batch run.", ["model"],
                                    buckets=tuple(float(1 << i) for i in range(0, 9)))
        self.batch_tokens = histogram(
            "attnserve_batch_tokens", "Tokens per batch run: real ones, and padded (batch × longest "
            "sequence).", ["model", "kind"], buckets=tuple(float(1 << i) for i in range(4, 18)))
        self.sequence_length = histogram("attnserve_sequence_length_tokens", "Tokens per sequence requested.",
                                         ["model"], buckets=tuple(float(e) for e in self.edges))
        self.inference_duration = histogram(
            "attnserve_inference_duration_seconds", "Backend time per batch, by padded length bucket and "
            "attention maps returned.", ["model", "seq_len_bucket", "attention"], buckets=LATENCY_BUCKETS)
        self.batch_peak_memory = histogram(
            "attnserve_batch_peak_memory_bytes", "Peak memory a batch added over what was in use before "
            "it (see docs/memory.md).", ["model", "seq_len_bucket", "attention"], buckets=MEMORY_BUCKETS)
        self.batch_predicted_memory = histogram(
            "attnserve_batch_predicted_memory_bytes", "The memory model's prediction for the same batches, "
            "to show drift.", ["model", "seq_len_bucket", "attention"], buckets=MEMORY_BUCKETS)
        # A door counts a call in as it starts (model "" until routed_to moves it) and out once
        # answered (call.CallRecord), in the task that serves it. With --workers each front end
        # counts its own and a scrape sums them (livesum).
        self.inflight = labelled(
            Gauge, "attnserve_inflight_requests", "Requests being handled now, by the model each "
            "was routed to (empty before a call names one, and for calls that name none).",
            ["model"], multiprocess_mode="livesum")
        self.queue_wait = histogram(
            "attnserve_queue_wait_seconds", "Time a request waited in its model's queue, by "
            "priority class: from queued until its last sequence started running (or was "
            "dropped).", ["model", "priority"], buckets=LATENCY_BUCKETS)
        self.dropped = counter(
            "attnserve_dropped_sequences", "Sequences dropped unanswered, by reason: deadline (the "
            "caller's deadline passed while it waited) or cancelled (the caller went away), both before "
            "inference; failed (its batch raised in inference, or the batch loop failed); and by the "
            "priority class of their call.", ["model", "reason", "priority"])
        self.unseen_shape_runs = counter(
            "attnserve_unseen_shape_runs", "Batches run at a (batch, seq) shape their graph's session had "
            "never run before (on an H200 such a run costs ~55 ms more); with shape buckets every "
            "embeddings shape ran in warm-up, so graph=\"embeddings\" stays 0 after it.", ["model", "graph"])
        self.memory_waits = counter(
            "attnserve_memory_waits", "Times a model's next batch was held back because it would not fit in "
            "the memory budget beside the batches in flight (its own model's or another's).", ["model"])
        self.worker_deaths = counter("attnserve_worker_deaths", "Front-end processes (--workers) that died "
                                     "without draining; each is started again.")
        self.live = Live()
        self.registry.register(self.live)

    def answered(self, rpc: str, code: str, seconds: float, model: str = "") -> None:
        """One call finished with status `code`: both request metrics move together, under
        the class its door set (priority.of_call)."""
        label = of_call()
        self.requests.labels(rpc, code, model, label).inc()
        self.request_duration.labels(rpc, code, model, label).observe(seconds)

    def routed_to(self, model: str) -> None:
        """The call the running task serves goes to `model`: its request series and its
        place in the in-flight gauge say so from here on (outside a call: nothing)."""
        cell = _CALL_MODEL.get()
        if cell is not None and cell[0] != model:
            self.inflight.labels(cell[0]).dec()
            self.inflight.labels(model).inc()
            cell[0] = model

    def bucket(self, length: int) -> str:
        """"1-16", "17-32", ... "257-512": a bounded label for a raw length."""
        low = 1
        for edge in self.edges:
            if length <= edge:
                return f"{low}-{edge}"
            low = edge + 1
        return f"{low}-"
