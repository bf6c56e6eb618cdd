"""`attnserve memory-profile` on an artifact of each family beside BERT (tests/families.py:
byte-level, metaspace and ModernBERT's tokenizers, vocabularies of a few hundred entries,
RoBERTa's positions after the padding id, ModernBERT's local attention) and of the
decoders (conftest's sentence_artifact: Qwen3's grouped key/value heads wider than its
hidden size, its graphs' weights in external data files; Gemma3's sliding windows and
Dense layers): every shape measured, a fit that follows the peaks, and a real server that
loads each family's fit."""

import json
import re
import shutil

import pytest

from attnserve.artifact import load_artifact
from attnserve.server.memory.model import ATTENTION, EMBEDDINGS, load_memory_model
from tests.conftest import FAMILY_EXPORT_FLAGS, export
from tests.families import FAMILIES
from tests.harness import ServerProcess
from tests.server.test_memory_profile import BATCHES, CPU, SEQ_LENS, profile

MIB = 1 << 20
DECODERS = ("qwen3", "gemma3_text")
PROFILED = FAMILIES + DECODERS


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, sentence_artifact, family_checkpoint) -> dict:
    """family -> (artifact directory, memory_profile.json)"""
    out = {}
    for family in PROFILED:
        if family in DECODERS:
            # A copy: memory_model.json must not change what other tests' servers predict.
            artifact = tmp_path_factory.mktemp(family)
            shutil.copytree(sentence_artifact(family)[1].directory, artifact, dirs_exist_ok=True)
        else:
            artifact = export(tmp_path_factory.mktemp(family), family_checkpoint(family),
                              *FAMILY_EXPORT_FLAGS)
        report_dir = tmp_path_factory.mktemp(f"{family}-profile")
        profile(artifact, report_dir)
        out[family] = artifact, json.loads((report_dir / "memory_profile.json").read_text())
    return out


@pytest.mark.parametrize("family", PROFILED)
def test_every_shape_is_measured_and_the_fit_follows_it(profiled, family):
    artifact, report = profiled[family]
    assert report["left_out"] == []
    rows = report["rows"]
    assert {(r["graph"], r["batch"], r["seq"]) for r in rows} == {
        (graph, b, s) for graph in (EMBEDDINGS, ATTENTION) for b in BATCHES for s in SEQ_LENS}
    manifest = load_artifact(artifact).manifest
    models = load_memory_model(artifact, manifest, CPU, "fp32")
    large = [r for r in rows if r["peak_bytes"] >= MIB]
    assert len(large) >= 4
    for r in large:
        predicted = models.predict(r["batch"], r["seq"], manifest.num_heads, r["returned_layers"])
        assert abs(predicted - r["peak_bytes"]) <= 0.15 * r["peak_bytes"], (r, predicted)


def test_the_server_loads_each_familys_fit(profiled):
    first, *others = PROFILED
    flags = [arg for family in others for arg in ("--artifact", f"{family}={profiled[family][0]}")]
    with ServerProcess(profiled[first][0], *flags) as server:
        line = next(line for line in server.output().splitlines() if "event=serving" in line)
    fitted = "; ".join(f"{family}: embeddings: fitted on {CPU} fp32 (encoder_opt.onnx); "
                       f"attention: fitted on {CPU} fp32 (encoder_attn.onnx)" for family in PROFILED)
    # The memory model and the time model of each graph, fitted by the same run.
    assert re.search(r"memory_model='([^']*)'", line)[1] == fitted, line
    assert re.search(r"time_model='([^']*)'", line)[1] == fitted, line
