"""The GPU benchmark's CPU dry run (bench/gpu_bench.sh --device cpu --quick, which runs
`python -m bench gpu`), end to end: what it runs on a GPU runs here first. Every onnxruntime
phase: the backend's parity and tokens/s, the raw sessions, three server configurations (one
process, two front ends, CUDA graphs) and peak memory per shape; tiny model, small workloads."""

import json
import os
import subprocess

from tests.harness import REPO


def test_the_gpu_benchmark_runs_on_the_cpu_and_prints_its_table(tmp_path, tiny_artifact):
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATTNSERVE_")}
    env.update(OUT=str(tmp_path), TMPDIR=str(tmp_path), GPU_BENCH_TIMEOUT_S="500")
    done = subprocess.run([str(REPO / "bench" / "gpu_bench.sh"), "--device", "cpu", "--quick",
                           "--artifact", str(tiny_artifact), "--configs", "default,2 workers,CUDA graphs",
                           "--budget-s", "450"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "| 32x128, one caller, p50 |" in done.stdout
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["phases"] == ["backend", "raw", "servers", "memory"]
    servers = result["servers"]
    assert set(servers) == {"default", "2 workers", "CUDA graphs"}
    for name, server in servers.items():
        assert "error" not in server, (name, server)
        assert server["mixed"]["requests"] == result["mixed_distribution"]["count"]
        assert server["concurrent"]["requests"] == result["plan"]["concurrent_requests"]
        assert server["min_cosine_vs_raw"] > 0.9999, name
    # Fixed buffers per bucket, warmed: no batch met a new shape (the CPU default has no buckets).
    assert servers["CUDA graphs"]["unseen_shape_runs"] == 0
    assert servers["CUDA graphs"]["warm_up_shapes"] > 1
    # The backend's --cuda-graphs strategy on the CPU (fixed buffers alone) gives what it
    # gives without them, to the bit.
    assert result["raw"]["bound"]["fixed_buffers_cpu"]["1x16"]["max_abs_diff_vs_plain"] == 0
    assert set(result["raw"]["sessions"]) == {"1", "2"}
    # On the CPU the backend is its own reference; fp16 needs `export --fp16`.
    assert result["backend"]["parity"]["fp32"]["max_abs_error"] == 0
    assert set(result["backend"]["throughput"]["fp32"]) == {"1x16", "32x128"}
    assert result["backend"]["parity"]["fp16"].startswith("no fp16 graphs")
    rows = result["memory"]["fp32"]["rows"]
    assert {(r["graph"], r["batch"], r["seq"]) for r in rows} >= {("embeddings", 4, 64), ("attention", 4, 64)}
    assert all(r["peak_bytes"] > 0 for r in rows)
    assert "Peak memory per shape, fp32" in done.stdout
