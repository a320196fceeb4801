#!/usr/bin/env bash
# lm-evaluation-harness (lm-eval on PyPI) in its own virtualenv .venv-lmeval/ beside .venv: it
# pins datasets, evaluate, accelerate, ... that the project does not use, so it never enters
# .venv. Used by benchmarks/lm_eval_check.py (loglikelihood through `router launch` against the
# same task computed with transformers directly).
#
#   bash benchmarks/lm_eval_setup.sh
#   .venv/bin/python -m benchmarks.lm_eval_check
#
# Idempotent. Writes nothing outside the repository except pip's cache.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-lmeval
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
# torch first, the way scripts/setup.sh installs it (this machine's pip configuration resolves
# it to the CPU build), so lm-eval's requirement on torch pulls no CUDA build. lm-eval 0.4.9
# imports a class transformers 5 removed (AutoModelForVision2Seq): transformers 4 here.
"$VENV/bin/python" -c 'import torch' 2>/dev/null || pip install "torch==2.13.0"
"$VENV/bin/python" -c "import lm_eval.evaluator, tenacity" 2>/dev/null || \
    pip install "lm-eval[api]==0.4.9" "torch==2.13.0" "transformers>=4.45,<5"
"$VENV/bin/python" -c 'import lm_eval, torch; print("lm-eval", lm_eval.__version__, "torch", torch.__version__)'
