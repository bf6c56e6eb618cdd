"""`attnserve export --unless-current` (what `make serve` runs): an artifact this exporter
would write is kept as it is; one from an older exporter, here with graphs that lack the
pooled outputs the server asks for, is named in one line and exported again, after which
the server takes it."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from attnserve.artifact import MANIFEST, MEMORY_MODEL, load_artifact, outdated, sha256_file
from tests.harness import ATTNSERVE, REPO


def export_unless_current(out: Path, checkpoint: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([*ATTNSERVE, "export", "--out", str(out), "--from", str(checkpoint),
                           "--unless-current"],
                          cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def check_config(artifact: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*ATTNSERVE, "serve", "--check-config", "--artifact", str(artifact),
                           "--device", "cpu"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, check=False)


def without_pooled_outputs(artifact: Path) -> None:
    """What an exporter from before the pooled outputs wrote: graphs that end at the hidden
    state (and the maps), and a manifest that lists and hashes them as they are."""
    import onnx

    data = json.loads((artifact / MANIFEST).read_text())
    for graph in data["graphs"]:
        path = artifact / graph["file"]
        model = onnx.load(str(path))
        kept = [o for o in model.graph.output if not o.name.startswith("pooled_")]
        del model.graph.output[:]
        model.graph.output.extend(kept)
        onnx.save(model, str(path))
        graph["outputs"] = [o.name for o in kept]
        data["files"][graph["file"]] = sha256_file(path)
    (artifact / MANIFEST).write_text(json.dumps(data))


@pytest.fixture()
def older(tiny_artifact, tmp_path) -> Path:
    artifact = tmp_path / "artifact"
    shutil.copytree(tiny_artifact, artifact)
    without_pooled_outputs(artifact)
    # A fit of the graphs the export will replace: it must not outlive them.
    (artifact / MEMORY_MODEL).write_text(json.dumps({"a": 1, "b": 1, "c": 1, "d": 1,
                                                     "source": "fitted on the old graphs"}))
    return artifact


def test_a_current_artifact_is_kept(tiny_artifact, tiny_checkpoint, tmp_path):
    artifact = tmp_path / "artifact"
    shutil.copytree(tiny_artifact, artifact)
    before = {p.name: p.stat().st_mtime_ns for p in artifact.iterdir()}
    done = export_unless_current(artifact, tiny_checkpoint)
    assert done.stdout.strip() == f"{artifact}: current, kept"
    assert {p.name: p.stat().st_mtime_ns for p in artifact.iterdir()} == before


def test_an_artifact_from_an_older_exporter_is_exported_again(older, tiny_checkpoint):
    refused = check_config(older)
    assert refused.returncode == 2 and "lacks outputs" in refused.stderr, refused.stderr
    reason = outdated(older)
    assert reason is not None and "lacks the outputs ['pooled_mean'" in reason

    done = export_unless_current(older, tiny_checkpoint)
    first = done.stdout.splitlines()[0]
    assert first == f"{reason}: exporting again"
    assert outdated(older) is None
    assert not (older / MEMORY_MODEL).exists()
    for graph in load_artifact(older).manifest.graphs:
        assert "pooled_mean_normalized" in graph.outputs, graph.file
    served = check_config(older)
    assert served.returncode == 0, served.stderr


def test_another_models_outdated_artifact_is_refused_not_replaced(older):
    """`make serve ARTIFACT=dir` exports the default checkpoint: over an outdated artifact of
    another model it refuses and leaves the directory as it was."""
    before = {p.name: p.read_bytes() for p in older.iterdir()}
    held = load_artifact(older, verify=()).manifest.model_name
    done = subprocess.run([*ATTNSERVE, "export", "--out", str(older), "--unless-current"],
                          cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (f"attnserve export: {outdated(older)}; it holds {held}, not all-MiniLM-L6-v2: "
                           "export it again --from its checkpoint, or name another --out\n")
    assert {p.name: p.read_bytes() for p in older.iterdir()} == before


@pytest.mark.parametrize(("edit", "reason"), [
    # (an exporter of format 1 fitted no embedding ranges)
    (lambda data: data.update(format_version=1, embedding_ranges=None),
     "format_version 1, from an older exporter"),
    (lambda data: data.update(format_version=99), "format_version 99, this server reads"),
])
def test_outdated_names_a_manifest_of_another_format(tiny_artifact, tmp_path, edit, reason):
    artifact = tmp_path / "artifact"
    shutil.copytree(tiny_artifact, artifact)
    data = json.loads((artifact / MANIFEST).read_text())
    edit(data)
    (artifact / MANIFEST).write_text(json.dumps(data))
    assert reason in outdated(artifact)


def test_outdated_names_a_missing_or_damaged_artifact(tiny_artifact, tmp_path):
    assert outdated(tmp_path / "nothing") == f"{tmp_path / 'nothing'}: no artifact yet"
    artifact = tmp_path / "artifact"
    shutil.copytree(tiny_artifact, artifact)
    with (artifact / "encoder.onnx").open("ab") as graph:
        graph.write(b"\0")
    assert "does not match the manifest" in outdated(artifact)
