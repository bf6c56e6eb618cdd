"""One module a benchmark; the runner imports every module here (bench/runner.py)."""
