"""`attnserve memory-profile` as `make serve` runs it: the grid leaves out shapes over
--max-tokens (the large-batch, long-length corner), and --unless-fitted keeps a fit that
memory_model.json already holds for the provider, the memory model and the time model both."""

import json
import shutil
import subprocess

from attnserve.artifact import MEMORY_MODEL
from attnserve.memory_profile import Shape, shapes_for
from attnserve.server.memory.batch_time import TIME
from attnserve.server.memory.model import ATTENTION, EMBEDDINGS, model_key, save_entries
from tests.harness import ATTNSERVE, REPO

CPU = "CPUExecutionProvider"


def test_the_grid_leaves_out_shapes_over_max_tokens():
    shapes = shapes_for(True, [64, 128, 512], [1, 8, 32], layers=6, max_tokens=4096)
    assert {(s.batch, s.seq) for s in shapes if s.graph == EMBEDDINGS} == {
        (1, 64), (1, 128), (1, 512), (8, 64), (8, 128), (8, 512), (32, 64), (32, 128)}
    # The maps returned still alternate along the diagonals of the whole grid.
    attention = {(s.batch, s.seq): s.returned_layers for s in shapes if s.graph == ATTENTION}
    assert attention == {(1, 64): 6, (1, 128): 1, (1, 512): 6, (8, 64): 1, (8, 128): 6,
                         (8, 512): 1, (32, 64): 6, (32, 128): 1}
    assert len(shapes_for(False, [64, 128, 512], [1, 8, 32], layers=6)) == 9
    assert Shape(EMBEDDINGS, 32, 512, 0) not in shapes


def profile(artifact, out, *extra) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [*ATTNSERVE, "memory-profile", "--artifact", str(artifact), "--out", str(out),
         "--seq-lens", "16,32,64,128", "--batch-sizes", "1,8", "--attention", "--device", "cpu",
         *extra],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def test_unless_fitted_measures_once_then_keeps_the_fit(tiny_artifact, tmp_path):
    artifact = tmp_path / "artifact"
    shutil.copytree(tiny_artifact, artifact)
    first = profile(artifact, tmp_path / "out", "--unless-fitted")
    assert "memory and time models saved to" in first.stdout
    saved = (artifact / MEMORY_MODEL).read_text()
    assert set(json.loads(saved)["models"]) == {model_key(CPU, "fp32", k) for k in (EMBEDDINGS, ATTENTION)}

    again = profile(artifact, tmp_path / "out", "--unless-fitted")
    assert again.stdout.strip() == (f"memory-profile: {artifact / MEMORY_MODEL} already holds a fit "
                                    f"for {CPU}; kept (run without --unless-fitted to measure again)")
    assert (artifact / MEMORY_MODEL).read_text() == saved

    # A fit from before the time model (memory alone) is measured again, to add it.
    entries = json.loads(saved)["models"]
    for entry in entries.values():
        del entry[TIME]
    save_entries(artifact, entries)
    third = profile(artifact, tmp_path / "out", "--unless-fitted")
    assert "memory and time models saved to" in third.stdout
    assert all(TIME in e for e in json.loads((artifact / MEMORY_MODEL).read_text())["models"].values())
