from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from loadtest.workloads import OFFLINE_MIXED
from tests.model_families import FAMILIES, MAX_TOKENS, family_prompts

if not torch.cuda.is_available():
    # The Triton kernels run under Triton's interpreter on CPU. Triton reads this when it is
    # first imported (transformers may import it long before the kernel tests run), so it is set
    # here, before any test module loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _share_the_cores_between_xdist_workers() -> None:
    """Each pytest-xdist worker runs its models on its share of the cores. torch's default team
    is every core, so two workers on two cores keep two teams spinning on each core: measured
    on 2 cores, four model-heavy engine modules ran 138 s that way and 71 s with a team of one
    each. Cluster tests' worker processes set their own thread counts (`--threads`)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else os.cpu_count() or 1  # the cores this process may use (Linux), else all
        torch.set_num_threads(max(1, cores // workers))


_share_the_cores_between_xdist_workers()


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """torch's thread count set to `count` inside: a native kernel's split of its work across
    an OpenMP team, which the suite's one thread per xdist worker never takes."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from engine.loader import resolve_model_path

    return resolve_model_path("default")


CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}  # where the name does not say


def save_tiny_model(path: Path, arch: str, tokenizer_from: Path, seed: int = 0,
                    **overrides: object) -> Path:
    """A small random checkpoint of `arch` with the default model's vocabulary and tokenizer."""
    import torch
    import transformers

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.3)
    common.update(overrides)
    config_name = CONFIG_CLASSES.get(arch, arch.replace("ForCausalLM", "Config"))
    config_cls = getattr(transformers, config_name)
    model_cls = getattr(transformers, arch)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**common)).float().eval()
    max_shard = common.pop("max_shard_size", None)
    kwargs = {"max_shard_size": max_shard} if max_shard else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, default_model_dir) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "LlamaForCausalLM",
                           default_model_dir)


@pytest.fixture(scope="session")
def workload_prompts() -> list[list[int]]:
    """Token ids of real text from the project's offline workload."""
    rows = [json.loads(line) for line in OFFLINE_MIXED.open()]
    return [r["prompt_token_ids"] for r in rows]


def mixed_prompts(workload: list[list[int]], n: int = 20) -> list[list[int]]:
    """n prompts of mixed lengths (3 .. ~400 tokens), cut from different workload prompts."""
    lengths = [3, 7, 12, 16, 17, 25, 31, 33, 48, 64,
               80, 100, 128, 150, 200, 256, 300, 333, 380, 400]
    return [workload[i % len(workload)][: lengths[i % len(lengths)]] for i in range(n)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request, tmp_path_factory, default_model_dir) -> Path:
    """A tiny checkpoint of each family of tests/model_families.py, one module's tests at a time."""
    arch, overrides = FAMILIES[request.param]
    return save_tiny_model(tmp_path_factory.mktemp(f"tiny-{request.param}"), arch,
                           default_model_dir, seed=5, **overrides)


@pytest.fixture(scope="module")
def family_prompt_ids(workload_prompts) -> list[list[int]]:
    return family_prompts(workload_prompts)


@pytest.fixture(scope="module")
def family_expected(family_dir, family_prompt_ids) -> list[list[int]]:
    """transformers' greedy tokens (eager attention: its SDPA path drops Gemma 2's capping)."""
    from tests.engine.hf_reference import hf_greedy

    return hf_greedy(family_dir, family_prompt_ids, MAX_TOKENS, attn_implementation="eager")


@pytest.fixture(autouse=True)
def _hand_back_gpu_memory():
    """After each test on a CUDA machine: engines a test made (some caught in reference cycles)
    are collected and their cached memory returned, so the next engine sizes its KV cache from
    what is really free. Nothing happens without CUDA."""
    yield
    if torch.cuda.is_available():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a CUDA machine, the tests of modules that run on CUDA where it is present
    (`RUNS_ON_CUDA = True`: the Triton kernels, graphs, fused kernels, async scheduling) join
    `pytest -m gpu`; without CUDA they run on the CPU and `-m gpu` leaves them out."""
    if not torch.cuda.is_available():
        return
    for item in items:
        module = getattr(item, "module", None)
        if getattr(module, "RUNS_ON_CUDA", False):
            item.add_marker(pytest.mark.gpu)


_PREBUILDS: list[subprocess.Popen] = []
_NEEDS_NATIVE = ("tests/engine/", "tests/cluster/", "tests/gpu/")


def _start_prebuilds() -> None:
    """The native kernels start building in the background (tests/native_builds.py: two
    processes, so both compilers run at once, niced under the tests); a test that needs one
    before it is ready waits on the build's lock."""
    root = Path(__file__).resolve().parent.parent
    for which in ("decode", "elementwise"):
        _PREBUILDS.append(subprocess.Popen(
            [sys.executable, "-m", "tests.native_builds", which], cwd=root,
            preexec_fn=lambda: os.nice(10)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """The prebuilds start where the selected tests run models on the CPU (on a CUDA machine
    the GPU stages keep their device time to themselves)."""
    if torch.cuda.is_available():
        return
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return  # under pytest-xdist every worker collects the same tests: one of them builds
    root = Path(__file__).resolve().parent.parent
    paths = [Path(item.path).resolve() for item in session.items]
    if any(str(p.relative_to(root)).startswith(_NEEDS_NATIVE) for p in paths
           if p.is_relative_to(root)):
        _start_prebuilds()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A prebuild still running when the tests end (a short selection) is stopped; on SIGTERM it
    unwinds and releases its build lock, so no later build waits on a stale one."""
    for process in _PREBUILDS:
        if process.poll() is None:
            process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
