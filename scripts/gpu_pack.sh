#!/usr/bin/env bash
# Packs, on this (CPU) machine, what a GPU machine lacks to run scripts/gpu_check.sh, into .gpu/
# (ignored by git; carry it to the GPU machine): wheels of the project's dependencies that such a
# machine does not have (gRPC, protobuf, aiohttp, pydantic, ... at this checkout's versions, for
# its Python: GPU_PYTHON_VERSION, default 3.12) and the default model's tokenizer files (the GPU
# machine builds random-weight checkpoints of other shapes around them); and into .gpu-model-1
# ... .gpu-model-N, the default model's own weights in parts sized to travel one call each.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
PYVER="${GPU_PYTHON_VERSION:-3.12}"
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
for pattern in '/.gpu/' '/.gpu-model-*/'; do
  grep -qxF "$pattern" "$exclude" 2>/dev/null || echo "$pattern" >> "$exclude"
done
rm -rf .gpu && mkdir -p .gpu/wheels .gpu/tokenizer
model=$("$PY" -c "from engine.loader import resolve_model_path; print(resolve_model_path('default'))")
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
  [ -f "$model/$f" ] && cp "$model/$f" .gpu/tokenizer/
done
# The wheels: every distribution the cluster's processes and the GPU stages import, found by
# importing them here, less what the GPU machine's image holds and must keep (torch and what is
# built against it, transformers and its tokenizers, pytest). A dependency added later is packed
# without this list changing (jsonschema, added for structured output, once stopped the router
# there).
pins=$(PYTHONPATH=. "$PY" scripts/gpu_wheel_pins.py)
[ -n "$pins" ] || { echo "found nothing to pack" >&2; exit 1; }
platforms=""
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do platforms="$platforms --platform $p"; done
# shellcheck disable=SC2086 # one argument per pin and platform
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp $platforms -d .gpu/wheels $pins
du -sh .gpu
ls .gpu/wheels .gpu/tokenizer
# The default model's own weights, in parts that each travel in one call (the last beside .gpu):
# gpu_check.sh joins them once a warm machine has seen every part. GPU_PACK_MODEL=0 skips this.
if [ "${GPU_PACK_MODEL:-1}" != 0 ]; then
  PYTHONPATH=. "$PY" scripts/gpu_model_parts.py pack --gpu-dir .gpu
fi
