"""/metrics after a known set of requests shows exactly the counts, buckets and token
totals those requests imply; and `promtool check metrics` accepts the exposition.

The server runs on a copy of the tiny artifact with a hand-written memory_model.json
(a = 1000 bytes, b = 1 byte per padded token, c = d = 0), so the predicted-memory
histogram's sums are known exactly too and prove the server loaded the file."""

import hashlib
import shutil
import subprocess

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from attnserve.artifact import MANIFEST
from attnserve.client import EncoderClient
from attnserve.server.memory import alloc_hook
from attnserve.server.memory.model import MemoryModel
from tests.harness import ServerProcess

# Also run against a server of several processes (make test: --server-workers 2).
pytestmark = pytest.mark.workers

# One request each, sent one after another (so each request is a batch of its own):
# the lengths of its sequences (token ids, so lengths are exact) and the attention
# layers asked for (None: no maps; []: every layer).
REQUESTS = [
    ([5], None),
    ([16], None),
    ([17], None),
    ([20, 22, 24], None),  # one batch of 3, padded to 24
    ([128], None),
    ([128] * 32, []),  # every layer's maps: 16 MiB alive at the end of the batch
    ([100], []),
    ([40], [1]),
]
LENGTHS = [n for lengths, _ in REQUESTS for n in lengths]
PADDED = [len(lengths) * max(lengths) for lengths, _ in REQUESTS]
# (seq_len_bucket, attention) -> the padded tokens of each batch that falls there
BATCHES = {
    ("1-16", "false"): [5, 16],
    ("17-32", "false"): [17, 72],
    ("65-128", "false"): [128],
    ("65-128", "true"): [32 * 128, 100],
    ("33-64", "true"): [40],
}
MODEL_A, MODEL_B = 1000.0, 1.0
# The 32 × 128 batch's maps: the tiny model's 2 layers × 4 heads, float32.
BIG_BATCH_MAPS_BYTES = 2 * 32 * 4 * 128 * 128 * 4


def ids(n: int) -> list[int]:
    return [1000 + i for i in range(n)]


class Scrape:
    """The exposition's samples, by name and labels. A server of one model labels every
    model series with it (and a call refused before it named a model with ""): the label
    is checked here, then left out, so the tests below read the counts as one model's."""

    def __init__(self, text: str, model: str):
        self.text = text
        self.samples: dict[tuple[str, frozenset], float] = {}
        self.types: dict[str, str] = {}
        self.models: dict[str, set[str]] = {}
        """sample name -> the model labels it carried"""
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for sample in family.samples:
                labels = dict(sample.labels)
                if "model" in labels and sample.name != "attnserve_info":
                    self.models.setdefault(sample.name, set()).add(labels.pop("model"))
                key = (sample.name, frozenset(labels.items()))
                self.samples[key] = self.samples.get(key, 0.0) + sample.value
        for name, models in self.models.items():
            assert models <= {model, ""}, (name, models)

    def value(self, name: str, **labels) -> float:
        key = (name, frozenset(labels.items()))
        assert key in self.samples, f"no sample {name}{labels} in /metrics"
        return self.samples[key]

    def label_sets(self, name: str) -> set[frozenset]:
        return {labels for sample, labels in self.samples if sample == name}

    def buckets(self, name: str, **labels) -> dict[str, float]:
        """le -> cumulative count"""
        out = {}
        for (sample, sample_labels), value in self.samples.items():
            if sample == name + "_bucket":
                rest = dict(sample_labels)
                le = rest.pop("le")
                if rest == labels:
                    out[le] = value
        return out


@pytest.fixture(scope="module")
def scrape(tiny_artifact, tiny_checkpoint, tmp_path_factory):
    artifact = tmp_path_factory.mktemp("metrics-artifact")
    shutil.copytree(tiny_artifact, artifact, dirs_exist_ok=True)
    MemoryModel(a=MODEL_A, b=MODEL_B, c=0.0, d=0.0, source="written by test_metrics").save(artifact)
    server = ServerProcess(artifact)
    try:
        with EncoderClient(server.address) as client:
            for lengths, layers in REQUESTS:
                results = client.embed(token_ids=[ids(n) for n in lengths],
                                       attention_layers=layers)
                assert len(results) == len(lengths)
            with pytest.raises(grpc.RpcError) as bad:
                client.embed(token_ids=[ids(3) + [10**6]])
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            client.tokenize(["hello world"])
            client.model_info()
        text = server.scrape_text()
        log = server.output()
    finally:
        server.stop()
    sha = hashlib.sha256((artifact / MANIFEST).read_bytes()).hexdigest()
    # `export --from DIR` names the model after the directory.
    return Scrape(text, tiny_checkpoint.name), log, {"model": tiny_checkpoint.name, "sha": sha}


def test_requests_counted_by_rpc_and_code(scrape):
    s, _, _ = scrape
    expected = {("Embed", "OK"): len(REQUESTS), ("Embed", "INVALID_ARGUMENT"): 1,
                ("Tokenize", "OK"): 1, ("GetModelInfo", "OK"): 1}
    assert s.types["attnserve_requests"] == "counter"
    counted = {(dict(labels)["rpc"], dict(labels)["code"]): s.samples[("attnserve_requests_total",
                                                                       labels)]
               for labels in s.label_sets("attnserve_requests_total")}
    assert counted == expected
    for (rpc, code), count in expected.items():
        # No door names a class yet: every call is of the default one.
        assert s.value("attnserve_request_duration_seconds_count", rpc=rpc, code=code,
                       priority="interactive") == count


def test_every_model_series_names_the_model(scrape):
    s, _, expected = scrape
    for name in ("attnserve_requests_total", "attnserve_request_duration_seconds_count",
                 "attnserve_stage_duration_seconds_count", "attnserve_batch_size_count",
                 "attnserve_batch_tokens_count", "attnserve_sequence_length_tokens_count",
                 "attnserve_inference_duration_seconds_count",
                 "attnserve_batch_peak_memory_bytes_count",
                 "attnserve_batch_predicted_memory_bytes_count", "attnserve_queue_depth"):
        assert expected["model"] in s.models[name], name
    # Refused before it named a model: in the interceptor, or for a field before the model.
    assert s.models["attnserve_requests_total"] == {expected["model"]}


def test_sequence_lengths_bucketed_exactly(scrape):
    s, _, _ = scrape
    assert s.value("attnserve_sequence_length_tokens_count") == len(LENGTHS)
    assert s.value("attnserve_sequence_length_tokens_sum") == sum(LENGTHS)
    edges = {"16.0": 16, "32.0": 32, "64.0": 64, "128.0": 128}
    expected = {le: sum(n <= edge for n in LENGTHS) for le, edge in edges.items()}
    expected["+Inf"] = len(LENGTHS)
    assert s.buckets("attnserve_sequence_length_tokens") == expected


def test_batch_tokens_real_and_padded(scrape):
    s, _, _ = scrape
    assert s.value("attnserve_batch_tokens_sum", kind="real") == sum(LENGTHS) == 4468
    assert s.value("attnserve_batch_tokens_sum", kind="padded") == sum(PADDED) == 4474
    assert s.value("attnserve_batch_tokens_count", kind="real") == len(REQUESTS)
    assert s.value("attnserve_batch_tokens_count", kind="padded") == len(REQUESTS)
    assert s.value("attnserve_batch_size_count") == len(REQUESTS)
    assert s.value("attnserve_batch_size_sum") == len(LENGTHS)


def test_stage_counts(scrape):
    s, _, _ = scrape
    # Every Embed read its token ids (the refused one too, up to its bad id) and every one
    # answered built a response; the Tokenize call did both.
    for stage, count in {"queue": len(REQUESTS), "inference": len(REQUESTS),
                         "respond": len(REQUESTS) + 1, "tokenize": len(REQUESTS) + 2}.items():
        assert s.value("attnserve_stage_duration_seconds_count", stage=stage) == count, stage


def test_inference_and_memory_by_bucket_and_attention(scrape):
    s, _, _ = scrape
    expected = {frozenset({"seq_len_bucket": b, "attention": a}.items()): len(padded)
                for (b, a), padded in BATCHES.items()}
    # With the allocation hook (built by `make`, preloaded by the server) every batch's memory
    # is measured; without it every big batch but only the first small one of each bucket
    # here (then one in 16): the test's model predicts every batch small.
    measured = expected if alloc_hook.LIBRARY.is_file() else {labels: 1 for labels in expected}
    for name, counts_expected in (("attnserve_inference_duration_seconds", expected),
                                  ("attnserve_batch_peak_memory_bytes", measured),
                                  ("attnserve_batch_predicted_memory_bytes", measured)):
        counts = {labels: s.samples[(name + "_count", labels)]
                  for labels in s.label_sets(name + "_count")}
        assert counts == counts_expected, name
    for (bucket, attention), padded in BATCHES.items():
        # The test's memory model: a + b·batch·seq, with batch·seq the padded tokens.
        tokens = padded if measured == expected else padded[:1]
        assert s.value("attnserve_batch_predicted_memory_bytes_sum", seq_len_bucket=bucket,
                       attention=attention) == sum(MODEL_A + MODEL_B * t for t in tokens)
    # The probe reads a batch's peak with its outputs alive: the big batch's maps are in it.
    assert s.value("attnserve_batch_peak_memory_bytes_sum", seq_len_bucket="65-128",
                   attention="true") >= BIG_BATCH_MAPS_BYTES


def test_memory_model_loaded_from_artifact(scrape):
    _, log, expected = scrape
    assert f"memory_model='{expected['model']}: written by test_metrics'" in log
    # A format-1 file holds no time model: bulk batches are sized by measured batch times.
    assert (f"time_model='{expected['model']}: measured batch times (memory_model.json has no "
            "time model for CPUExecutionProvider/fp32)'") in log


def test_queue_series_by_priority_class(scrape):
    """Every class's depth is a series (0 here), each request's wait is counted under its
    call's class (the default one: no door names a class yet), and nothing was dropped."""
    s, _, _ = scrape
    for priority in ("interactive", "bulk"):
        assert s.value("attnserve_queue_depth", priority=priority) == 0
    assert s.types["attnserve_queue_wait_seconds"] == "histogram"
    waits = {dict(labels)["priority"]: s.samples[("attnserve_queue_wait_seconds_count", labels)]
             for labels in s.label_sets("attnserve_queue_wait_seconds_count")}
    assert waits == {"interactive": len(REQUESTS)}
    assert s.models["attnserve_queue_wait_seconds_count"] == {scrape[2]["model"]}


def test_gauges_and_info(scrape):
    s, _, expected = scrape
    used = s.value("attnserve_device_memory_used_bytes", device="cpu")
    total = s.value("attnserve_device_memory_total_bytes", device="cpu")
    assert 0 < used < total
    assert s.value("attnserve_inflight_requests") == 0
    # Each call was counted under "" until routed, then under its model.
    assert s.models["attnserve_inflight_requests"] == {expected["model"], ""}
    assert s.value("attnserve_health_serving") == 1
    infos = s.label_sets("attnserve_info")
    assert len(infos) == 1
    info = dict(next(iter(infos)))
    assert info == {"model": expected["model"], "provider": "CPUExecutionProvider",
                    "precision": "fp32", "artifact_sha256": expected["sha"]}
    dropped = {labels: v for (name, labels), v in s.samples.items()
               if name == "attnserve_dropped_sequences_total"}
    assert all(v == 0 for v in dropped.values())


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found: install Debian's `prometheus` package "
                    "(apt-get install -y prometheus) to lint the /metrics exposition")
    return path


def test_promtool_accepts_exposition(scrape):
    s, _, _ = scrape
    done = subprocess.run([promtool(), "check", "metrics"], input=s.text, capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode == 0, f"promtool check metrics:\n{done.stdout}{done.stderr}"


def test_promtool_catches_a_bad_exposition():
    """The lint above can fail: a counter without _total is flagged."""
    bad = "# HELP attnserve_bad A counter.\n# TYPE attnserve_bad counter\nattnserve_bad 1\n"
    done = subprocess.run([promtool(), "check", "metrics"], input=bad, capture_output=True,
                          text=True, timeout=30, check=False)
    assert done.returncode != 0


def test_a_scrape_passes_over_a_front_ends_file_being_created(tmp_path):
    """With --workers the engine serves the front ends' counts from their files. A front
    end creates its file empty and sizes it a moment later: a scrape in between still
    answers, with every count it can read (it answered 500 before)."""
    from prometheus_client import generate_latest

    from attnserve.server.metrics import Metrics

    (tmp_path / "counter_4242.db").touch()
    (tmp_path / "histogram_4242.db").touch()
    metrics = Metrics(128, str(tmp_path))
    metrics.requests.labels("Embed", "OK", "m", "bulk").inc()
    exposition = generate_latest(metrics.registry).decode()
    assert ('attnserve_requests_total{code="OK",model="m",priority="bulk",rpc="Embed"} 1.0'
            in exposition)
