# The two commands a newcomer needs: `make serve` and `make test`.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
ARTIFACT ?= artifacts/all-MiniLM-L6-v2
PROTO_OUT := server/_proto
PROTOS := proto/attnserve/v1/encoder.proto proto/inference/grpc_service.proto

# Flags `make serve` adds to `attnserve serve`, e.g. SERVE_ARGS="--port 50052 --log-level debug".
SERVE_ARGS ?=

.PHONY: serve test proto alloc-hook export memory-model docs lint tools lint-deps bench
.PHONY: image image-deps image-test

# Steps that do not depend on each other run side by side: `make test` sets up the
# project's environment and checkov's at once (a minute less on 2 cores).
MAKEFLAGS += -j2

# The environment: torch pinned to 2.13.0 (pip's configured wheel directory may hold its
# CPU wheel; from PyPI on Linux it is the multi-GB CUDA build), every extra the tests and
# export need. uv installs it, minutes faster than pip on 2 cores; it reads no pip.conf, so
# pip's own settings on the machine (a local wheel folder, extra indexes, constraints) are
# handed to it as flags, and like pip it weighs every index alike. Like pip it byte-compiles
# what it installs: where PYTHONDONTWRITEBYTECODE is set, every process would otherwise
# compile its imports again: torch with transformers 21 s against 9 s, a server 3.4 s against
# 1.2 s, on 2 cores.
UV_INSTALL = $(BIN)/uv pip install --quiet --compile-bytecode --index-strategy unsafe-best-match \
	$$($(BIN)/pip config list | \
	sed -nE "s/^[^=]*\.(find-links|index-url|extra-index-url|constraint)='(.*)'$$/\1 \2/p" | \
	while read -r key values; do for v in $$values; do printf -- '--%s %s ' "$$key" "$$v"; done; done)
$(BIN)/uv:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet uv
$(BIN)/attnserve: pyproject.toml | $(BIN)/uv
	$(UV_INSTALL) --python $(BIN)/python -e '.[export,plot,dev]'
	touch $@

# Generated gRPC stubs (never edited by hand), importable as
# attnserve.server._proto.<package>: generated under that import path, then moved into
# server/, the folder the attnserve.server package installs from.
$(PROTO_OUT)/.stamp: $(PROTOS) $(BIN)/attnserve
	rm -rf $(PROTO_OUT) .proto-build && mkdir -p .proto-build
	$(BIN)/python -m grpc_tools.protoc -Iattnserve/server/_proto=proto \
		--python_out=.proto-build --pyi_out=.proto-build --grpc_python_out=.proto-build $(PROTOS)
	mv .proto-build/attnserve/server/_proto $(PROTO_OUT) && rm -rf .proto-build
	touch $@

proto: $(PROTO_OUT)/.stamp

# The allocation hook `attnserve serve` preloads on the CPU to measure each batch's memory
# exactly (server/memory/alloc_peak.c; glibc only: -z defs refuses a build against another libc).
# Without it the server samples instead.
ALLOC_HOOK := server/memory/_alloc_peak.so
$(ALLOC_HOOK): server/memory/alloc_peak.c
	cc -O2 -Wall -shared -fPIC -Wl,-z,defs -o $@ $< || \
		echo "no allocation hook (no C compiler, or not glibc): the server samples memory instead"

alloc-hook: $(ALLOC_HOOK)

# The default model's artifact, exported when it is missing or was written by an exporter
# this one does not match (an older format, graphs without an output the server asks
# for): `--unless-current` says which in one line, or keeps it. An outdated artifact of
# another model at ARTIFACT is refused, not replaced with the default one.
export: | $(PROTO_OUT)/.stamp
	$(BIN)/attnserve export --out $(ARTIFACT) --unless-current

# Its memory and time models, fitted on this machine's provider unless memory_model.json has
# that fit (the run prints how long it took): without a memory model the server admits on
# an analytic bound far above what batches take, without a time model it sizes bulk
# batches by the batches it has run. An export removes the fit of the graphs it replaces.
# PROFILE_ARGS: more memory-profile flags, e.g. "--seq-lens 64,128,256" to measure only
# the lengths a deployment serves (the default measures 36 shapes, about a minute on 2 cores).
PROFILE_ARGS ?=
memory-model: export
	$(BIN)/attnserve memory-profile --artifact $(ARTIFACT) --attention --unless-fitted $(PROFILE_ARGS)

serve: memory-model $(ALLOC_HOOK)
	$(BIN)/attnserve serve --artifact $(ARTIFACT) $(SERVE_ARGS)

# docs/configuration.md from `attnserve serve --help` (tests/test_docs.py fails when they differ).
docs: $(BIN)/attnserve
	$(BIN)/python docs/generate.py

# promtool and prometheus (Debian's `prometheus` package) for the metrics and rules tests;
# headless Chromium and its driver (`chromium`, `chromium-driver`) for the /docs page test;
# kubectl (with kustomize) comes with the machine image.
TOOLS := promtool:prometheus chromium:chromium chromedriver:chromium-driver
tools:
	missing=; for tool in $(TOOLS); do command -v $${tool%%:*} >/dev/null || \
		missing="$$missing $${tool#*:}"; done; \
	[ -z "$$missing" ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install \
		-y -qq --no-install-recommends $$missing; }

# checkov, the security linter the deploy tests run on the rendered manifests, in its own
# environment: its pins clash with the project's (protobuf among them).
lint-deps: .venv-lint/bin/checkov
.venv-lint/bin/checkov: | $(BIN)/uv
	$(PYTHON) -m venv .venv-lint
	$(UV_INSTALL) --python .venv-lint/bin/python 'checkov==3.3.30'

# The suite includes the image test (tests/deploy/test_image_run.py), hence image-deps;
# then the promises marked `workers` again, against servers of two front-end processes.
test: $(PROTO_OUT)/.stamp $(ALLOC_HOOK) tools lint-deps image-deps
	$(BIN)/python -m pytest -q
	$(BIN)/python -m pytest -q -m workers --server-workers 2

# The engines benchmark (bench/, a repository tool, not part of the installed package), from
# the checkout: BENCH_ARGS="--quick", "--docs docs/benchmarks.md", ... (python -m bench
# engines --help; python -m bench --help lists the others).
BENCH_ARGS ?=
bench: memory-model $(ALLOC_HOOK)
	$(BIN)/python -m bench engines --artifact $(ARTIFACT) $(BENCH_ARGS)

lint: $(BIN)/attnserve
	$(BIN)/ruff check .

# Container images (deploy/docker/, deploy/README.md). `make image` builds the CPU image
# (IMAGE_DEVICE=gpu: the GPU one) with podman, or docker where it has a working daemon: with
# the Dockerfile's defaults (a registry, PyTorch's index), or, with IMAGE_FLAGS=--local, on a
# base made here from Debian's packages and with torch from pip's local wheel directory.
IMAGE_DEVICE ?= cpu
IMAGE_FLAGS ?=
image:
	deploy/docker/build.sh $(IMAGE_DEVICE) $(IMAGE_FLAGS)

# podman, runc (crun fails on hybrid cgroups), catatonit (the pause process of `podman kube
# play`'s pods) and debootstrap (the local base) from Debian's packages, for the image test.
IMAGE_DEPS := podman runc catatonit debootstrap
# After `tools`: the two apt-get runs share dpkg's lock.
image-deps: | tools
	missing=; for tool in $(IMAGE_DEPS); do command -v $$tool >/dev/null || missing=1; done; \
	[ -z "$$missing" ] || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install \
		-y -qq --no-install-recommends $(IMAGE_DEPS); }

# The CPU image built on a local base and run as the cpu overlay runs its pod.
image-test: $(PROTO_OUT)/.stamp image-deps
	$(BIN)/python -m pytest -q tests/deploy/test_image_run.py
