"""The GPU proof's tools, smoke-run on CPU: the decode-kernel bandwidth benchmark (tiny shapes,
Triton interpreter; outputs checked against dense SDPA), the random stand-in for the default
model (which refuses to go without a tokenizer) and the real one replacing it once its carried
parts have come, gpu_check.sh refusing a stage it does not know, and the wheels gpu_pack.sh
packs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import decode_kernel
from benchmarks.random_checkpoint import write_checkpoint
from engine.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]


def test_decode_kernel_benchmark_matches_dense_attention(tmp_path):
    out = tmp_path / "kernels.json"
    decode_kernel.main(["--device", "cpu", "--dtype", "float32", "--smoke", "--reps", "2",
                        "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["seqs"], r["ctx"], r["heads"]) for r in rows] == [(2, 64, 4), (1, 128, 9)]
    for row in rows:
        assert row["max_abs_error"] < 1e-4 and row["paged_gbps"] > 0 and row["dense_gbps"] > 0


def random_stand_in(env: dict[str, str], tokenizer: Path) -> subprocess.CompletedProcess:
    """A tiny random checkpoint written as `default` into env's PDSERVE_CACHE_DIR."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.random_checkpoint", "tiny",
                           "--tokenizer", str(tokenizer), "--as-default", "--device", "cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_a_random_checkpoint_stands_in_for_the_default_model(tmp_path, default_model_dir):
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path / "cache")}
    done = random_stand_in(env, default_model_dir)
    path = Path(done.stdout.strip().splitlines()[-1])
    assert path.is_relative_to(tmp_path / "cache") and (path / ".prepared").is_file()
    assert (path / "tokenizer.json").is_file() and ModelConfig.from_dir(path).hidden_size == 64
    resolved = subprocess.run([sys.executable, "-c", "from engine.loader import "
                               "resolve_model_path; print(resolve_model_path('default'))"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert resolved.stdout.strip() == str(path)  # `default` now loads it, nothing converted


def test_a_random_checkpoint_needs_its_tokenizer_and_a_kept_one_gets_it(tmp_path,
                                                                        default_model_dir):
    """On an H200 a tokenizer folder that had not travelled left 8B checkpoints without one, and
    every engine then failed on it: now the writer refuses at once, and a checkpoint kept from
    such a run gets the tokenizer when it is reused."""
    with pytest.raises(FileNotFoundError, match="no tokenizer.json in"):
        write_checkpoint("tiny", tmp_path / "ckpt", tmp_path / "missing", "cpu")
    path = write_checkpoint("tiny", tmp_path / "ckpt", default_model_dir, "cpu")
    (path / "tokenizer.json").unlink()
    assert write_checkpoint("tiny", path, default_model_dir, "cpu") == path
    assert (path / "tokenizer.json").is_file()


def test_the_default_models_own_weights_replace_a_random_stand_in(tmp_path, default_model_dir):
    """On a GPU machine an earlier call may have left a random stand-in as `default`; once the
    GGUF's parts have come together, `gpu_model_parts.py prepare` converts the real model over
    it, and a second call keeps it."""
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    random_stand_in(env, default_model_dir)
    for _ in range(2):
        done = subprocess.run([sys.executable, "scripts/gpu_model_parts.py", "prepare"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        path = Path(done.stdout.strip().splitlines()[-1])
        assert path.is_relative_to(tmp_path / "cache")
        assert ModelConfig.from_dir(path).hidden_size == 576  # SmolLM2-135M's, not tiny's 64
    from engine.prepare import find_gguf

    assert json.loads((path / ".prepared").read_text())["source"] == str(find_gguf())


def test_gpu_check_refuses_an_unknown_stage(tmp_path):
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path),
                           "--stage", "everything"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "unknown stage everything" in done.stderr


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu_pack.sh"])
def test_the_gpu_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(ROOT / "scripts" / script)]).returncode == 0


def test_the_gpu_pack_carries_what_the_cluster_imports_and_not_torch():
    """Found by importing the cluster's entry points: gRPC, the HTTP front door's aiohttp and
    pydantic, and jsonschema (which a hand-kept list once missed, stopping the router on the
    GPU machine); never torch or what the GPU image builds against it."""
    done = subprocess.run([sys.executable, "scripts/gpu_wheel_pins.py"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    names = {pin.split("==")[0].lower().replace("_", "-") for pin in done.stdout.split()}
    assert {"grpcio", "protobuf", "aiohttp", "pydantic", "jsonschema", "gguf"} <= names
    assert not names & {"torch", "triton", "numpy", "transformers", "pdserve"}
