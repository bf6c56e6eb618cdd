"""`make serve` in a checkout holding an artifact an older exporter wrote: it names the
reason in one line, exports the default model again, fits its memory model on this
machine's provider, and serves it."""

import json
import os
import shutil
import signal
import subprocess
import time

from attnserve.artifact import FORMAT_VERSION, MANIFEST, MEMORY_MODEL, load_artifact
from attnserve.client import EncoderClient
from attnserve.server.memory.model import ATTENTION, EMBEDDINGS
from tests.harness import REPO

START_TIMEOUT_S = 600
# The fit on a few short shapes: the fit itself is tested in tests/server/test_memory_profile.py,
# here that `make serve` makes one.
PROFILE_ARGS = "--seq-lens 8,16,32 --batch-sizes 1,2"


def test_make_serve_exports_an_older_artifact_again_and_serves_it(minilm_artifact, tmp_path):
    artifact = tmp_path / "all-MiniLM-L6-v2"
    shutil.copytree(minilm_artifact, artifact)
    manifest = json.loads((artifact / MANIFEST).read_text())
    # As the older exporter wrote it: without the pooled outputs it did not make.
    ranges = manifest["embedding_ranges"]["ranges"]
    manifest["embedding_ranges"]["ranges"] = {k: v for k, v in ranges.items() if "lasttoken" not in k}
    (artifact / MANIFEST).write_text(json.dumps(manifest | {"format_version": FORMAT_VERSION - 1}))
    ready = tmp_path / "ready.json"
    serve_args = (f"--host 127.0.0.1 --port 0 --http-port 0 --metrics-port 0 "
                  f"--ready-file {ready}")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")}
    log = tmp_path / "make.log"
    with log.open("w") as out:
        make = subprocess.Popen(["make", "--no-print-directory", "serve", f"ARTIFACT={artifact}",
                                 f"SERVE_ARGS={serve_args}", f"PROFILE_ARGS={PROFILE_ARGS}"],
                                cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready.exists():
            assert make.poll() is None, f"make serve exited {make.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"not serving in {START_TIMEOUT_S} s:\n{log.read_text()}"
            time.sleep(0.5)
        port = json.loads(ready.read_text())["port"]
        with EncoderClient(f"127.0.0.1:{port}") as client:
            (result,) = client.embed(["hello world"], normalize=True)
        assert result.pooled.shape == (384,)
    finally:
        os.killpg(make.pid, signal.SIGTERM)
        make.wait(60)

    said = [line for line in log.read_text().splitlines() if "exporting again" in line]
    assert said == [f"{artifact / MANIFEST}: format_version {FORMAT_VERSION - 1}, from an older "
                    f"exporter (this one writes {FORMAT_VERSION}): exporting again"], log.read_text()
    assert load_artifact(artifact).manifest.format_version == FORMAT_VERSION
    fitted = json.loads((artifact / MEMORY_MODEL).read_text())["models"]
    kinds = {key.rsplit("/", 1)[1] for key in fitted}
    assert kinds == {EMBEDDINGS, ATTENTION}, fitted
