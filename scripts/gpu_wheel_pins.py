"""The wheels scripts/gpu_pack.sh packs for a GPU machine, as NAME==VERSION pins on one line:
every distribution the cluster's processes and the GPU stages import, found by importing them
here, less what the GPU machine's image holds and must keep (torch and what is built against it,
transformers and its tokenizers, pytest). A dependency added later is packed without a list to
update: jsonschema, added for structured output and missing from a hand-kept list, once stopped
the router there."""

from __future__ import annotations

import importlib
import sys
from importlib.metadata import packages_distributions, version

ENTRY_MODULES = ("router.server", "cli.cluster", "serving.worker_main", "prefill_worker.__main__",
                 "decode_worker.__main__", "kv_transfer.dist.connector", "engine.engine",
                 "tests.cluster.cluster_helpers", "tests.gpu.test_cluster_on_cuda",
                 "tests.cluster.test_shared_faults", "benchmarks.gpu_engine",
                 "benchmarks.kv_transfer", "benchmarks.decode_kernel", "benchmarks.moe_layer",
                 # transformers imports gguf only inside the call that reads the default model's
                 # GGUF (scripts/gpu_model_parts.py prepare), so no entry point pulls it in
                 "gguf")
GPU_IMAGE_KEEPS = {"pdserve", "torch", "triton", "numpy", "safetensors", "tokenizers",
                   "transformers", "huggingface-hub", "jinja2", "markupsafe", "pygments",
                   "pytest", "pluggy", "iniconfig", "setuptools", "tqdm", "filelock", "fsspec",
                   "sympy", "mpmath", "networkx", "packaging", "pyyaml", "regex", "requests"}


def pins() -> list[str]:
    for name in ENTRY_MODULES:
        importlib.import_module(name)
    distributions = packages_distributions()
    tops = {module.split(".")[0] for module in sys.modules}
    found = {d for top in tops for d in distributions.get(top, [])}
    carried = {d for d in found if d.lower().replace("_", "-") not in GPU_IMAGE_KEEPS
               and not d.lower().startswith("nvidia")}
    return [f"{d}=={version(d)}" for d in sorted(carried)]


if __name__ == "__main__":
    print(" ".join(pins()))
