"""GPU placement without a GPU: `router launch --device cuda` flags, spreading workers over GPUs
(launch.gpus), LocalCluster's worker command lines, GPU discovery, and CUDA KV cache sizing
(torch.cuda's memory queries faked)."""

from __future__ import annotations

import re
import signal
import subprocess

import pytest
import torch

import engine.kv_sizing as kv_sizing
from cli.cluster import _parser, launch_spec, main
from engine.config import CacheConfig, ModelConfig, RopeConfig, SchedulerConfig, kv_bytes_per_block
from launch.cluster import ClusterSpec, LocalCluster
from launch.gpus import GpuError, GpuSlot, assign_gpus, place_worker, share_of, visible_gpus
from serving.options import WorkerOptions, parse_worker_args

GIB = 2**30


# --- launch flags ------------------------------------------------------------------------------

def spec_of(*argv: str) -> ClusterSpec:
    return launch_spec(_parser().parse_args(["launch", *argv]))


def test_launch_flags_reach_the_spec():
    spec = spec_of()  # today's CPU cluster
    assert (spec.device, spec.gpus, spec.gpu_memory_fraction, spec.kv_transport) == (
        "cpu", None, None, "auto")
    spec = spec_of("--device", "cuda", "--gpus", "2", "--gpu-memory-fraction", "0.3",
                   "--kv-transport", "shared", "--prefill", "2", "--decode", "1")
    assert (spec.device, spec.gpus, spec.gpu_memory_fraction, spec.kv_transport) == (
        "cuda", 2, 0.3, "shared")


def test_launch_cuda_counts_the_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    assert spec_of("--device", "cuda").gpus == 3


@pytest.mark.parametrize(("argv", "message"), [
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--kv-transport", "nccl"], "argument --kv-transport: invalid choice: 'nccl'"),
    (["--device", "cuda", "--gpus", "0"], "--gpus must be >= 1, got 0"),
    (["--device", "cuda", "--gpus", "1", "--gpu-memory-fraction", "0.99"],
     "--gpu-memory-fraction must be in \\(0, 0.95\\], got 0.99"),
    (["--device", "cuda", "--gpus", "1", "--gpu-memory-fraction", "0"],
     "--gpu-memory-fraction must be in \\(0, 0.95\\], got 0.0"),
    (["--gpus", "2"], "--gpus and --gpu-memory-fraction need --device cuda"),
    (["--device", "cuda", "--gpus", "1", "--prefill", "2", "--decode", "2",
      "--gpu-memory-fraction", "0.3"], "--gpu-memory-fraction 0.3 x 4 workers on one GPU = 1.20"),
    (["--device", "cuda", "--gpus", "1", "--kv-transport", "dist"],
     "--kv-transport dist needs one GPU per worker .*NCCL cannot put two ranks on one GPU"),
    (["--device", "cuda", "--gpus", "a"], "argument --gpus: invalid int value: 'a'"),
    (["--max-num-batched-tokens", "0"], "--max-num-batched-tokens must be >= the workers' "
     "max_num_seqs \\(64 on cpu\\) so every running request can decode each step, got 0"),
    (["--max-num-batched-tokens", "16"], "--max-num-batched-tokens must be >= .*got 16"),
    (["--kv-cache-gb", "-1"], "--kv-cache-gb must be > 0, got -1.0"),
    (["--kv-cache-gb", "0"], "--kv-cache-gb must be > 0, got 0.0"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--device", "cuda", "--gpus", "2", "--decode-tp", "2"],
     "tensor parallelism .* runs on CPU ranks so far"),
    (["--port", "8000", "--http-port", "8000"], "--http-port and --port must differ, both 8000"),
])
def test_bad_launch_flags_are_refused_with_a_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["launch", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err  # the message names the flag and its limit
    assert re.search(message, err), err


def test_launch_cuda_without_a_gpu_says_so(monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(SystemExit):
        main(["launch", "--device", "cuda"])
    assert "no GPU found: CUDA_VISIBLE_DEVICES is ''" in capsys.readouterr().err
    # colocated workers move no KV: dist is fine however many share a GPU
    assert ClusterSpec(prefill=0, decode=0, colocated=3, device="cuda", gpus=1,
                       kv_transport="dist").num_workers == 3


# --- assigning workers to GPUs ----------------------------------------------------------------

def test_one_gpu_per_worker_else_round_robin():
    assert assign_gpus(4, 4) == [GpuSlot(i, 0.9) for i in range(4)]
    assert assign_gpus(2, 8) == [GpuSlot(0, 0.9), GpuSlot(1, 0.9)]
    assert assign_gpus(4, 1) == [GpuSlot(0, 0.22)] * 4  # 0.9 / 4 = 0.225, rounded down
    assert assign_gpus(3, 2) == [GpuSlot(0, 0.45), GpuSlot(1, 0.9), GpuSlot(0, 0.45)]


def test_an_explicit_fraction_and_rounding():
    assert assign_gpus(3, 1, 0.3) == [GpuSlot(0, 0.3)] * 3
    assert [share_of(n) for n in (1, 2, 3, 4, 7, 9)] == [0.9, 0.45, 0.3, 0.22, 0.12, 0.1]
    assert GpuSlot(1, 0.45).worker_args == ["--device", "cuda:1", "--gpu-memory-fraction",
                                            "0.45"]


def test_a_later_worker_takes_a_dead_workers_place_or_is_refused():
    slots = assign_gpus(3, 2)
    assert place_worker([slots[0], slots[2]], 3, 2) == GpuSlot(1, 0.9)  # cuda:1's died
    assert place_worker([slots[1], slots[2]], 3, 2) == GpuSlot(0, 0.45)  # one on cuda:0 died
    with pytest.raises(ValueError, match="GPU cuda:0 has no room for another worker"):
        place_worker(assign_gpus(2, 2), 2, 2)
    assert place_worker(assign_gpus(2, 2, 0.4), 2, 2, 0.4) == GpuSlot(0, 0.4)  # room left


# --- the worker command lines LocalCluster builds ----------------------------------------------

class FakeProcess:
    returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.returncode = -sig


def fake_cluster(spec: ClusterSpec) -> tuple[LocalCluster, dict[str, list[str]]]:
    """A LocalCluster whose processes are recorded, not started."""
    cluster = LocalCluster(spec)
    cluster.address = "127.0.0.1:50051"
    commands: dict[str, list[str]] = {}

    def spawn(name: str, args: list[str]) -> None:
        commands[name] = args
        cluster.processes[name] = FakeProcess()  # type: ignore[assignment]

    cluster._spawn = spawn  # type: ignore[method-assign]
    return cluster, commands


def gpu_of(args: list[str]) -> tuple[str, str]:
    return args[args.index("--device") + 1], args[args.index("--gpu-memory-fraction") + 1]


def test_cpu_worker_command_is_unchanged_but_for_the_transport():
    cluster, commands = fake_cluster(ClusterSpec(dtype="float32", kv_cache_gb=0.5))
    assert cluster.spawn_worker("decode") == "decode-0"
    assert commands["decode-0"] == [
        "decode_worker", "--router", "127.0.0.1:50051", "--host", "127.0.0.1", "--threads", "1",
        "--model", "default", "--worker-id", "decode-0", "--dtype", "float32", "--kv-cache-gb",
        "0.5", "--kv-transport", "auto", "--log-level", "info", "--log-format", "text"]
    assert cluster.gpu_slots == {}


def test_graphs_reach_every_worker_and_async_scheduling_decode_and_colocated_only():
    cluster, commands = fake_cluster(ClusterSpec(device="cuda", gpus=1, cuda_graphs=True,
                                                 async_scheduling=True))
    for role in ("prefill", "decode"):
        cluster.spawn_worker(role)
    assert all("--cuda-graphs" in args for args in commands.values())
    assert "--async-scheduling" in commands["decode-0"]
    assert "--async-scheduling" not in commands["prefill-0"]
    cluster, commands = fake_cluster(ClusterSpec(prefill=0, decode=0, colocated=1,
                                                 async_scheduling=True))
    cluster.spawn_worker("colocated")
    assert "--async-scheduling" in commands["colocated-0"]
    assert "--cuda-graphs" not in commands["colocated-0"]


def test_speed_paths_left_unset_leave_the_workers_their_default_and_off_says_so():
    cluster, commands = fake_cluster(ClusterSpec(device="cuda", gpus=1))
    for role in ("prefill", "decode"):
        cluster.spawn_worker(role)
    flags = {"--cuda-graphs", "--no-cuda-graphs", "--async-scheduling", "--no-async-scheduling",
             "--fused-kernels", "--no-fused-kernels"}
    assert not any(flags & set(args) for args in commands.values())
    cluster, commands = fake_cluster(ClusterSpec(device="cuda", gpus=1, cuda_graphs=False,
                                                 async_scheduling=False, fused_kernels=False))
    for role in ("prefill", "decode"):
        cluster.spawn_worker(role)
    assert flags & set(commands["prefill-0"]) == {"--no-cuda-graphs", "--no-fused-kernels"}
    assert flags & set(commands["decode-0"]) == {"--no-cuda-graphs", "--no-async-scheduling",
                                                 "--no-fused-kernels"}


def test_the_step_budget_reaches_every_worker():
    """`launch --max-num-batched-tokens N` (vllm serve's flag): every role's step budget."""
    cluster, commands = fake_cluster(spec_of("--max-num-batched-tokens", "2048"))
    for role in ("prefill", "decode"):
        cluster.spawn_worker(role)
    for args in commands.values():
        i = args.index("--max-num-batched-tokens")
        assert args[i + 1] == "2048"
    cluster, commands = fake_cluster(spec_of())
    cluster.spawn_worker("decode")
    assert "--max-num-batched-tokens" not in commands["decode-0"]  # the engine's own default


def test_cuda_workers_spread_over_the_gpus_and_a_replacement_takes_the_free_place():
    cluster, commands = fake_cluster(ClusterSpec(prefill=2, decode=2, device="cuda", gpus=2,
                                                 kv_transport="shared"))
    for role in ("prefill", "prefill", "decode", "decode"):
        cluster.spawn_worker(role)
    assert {name: gpu_of(args) for name, args in commands.items()} == {
        "prefill-0": ("cuda:0", "0.45"), "prefill-1": ("cuda:1", "0.45"),
        "decode-0": ("cuda:0", "0.45"), "decode-1": ("cuda:1", "0.45")}
    assert all(args[args.index("--kv-transport") + 1] == "shared" for args in commands.values())
    cluster.signal("decode-1", signal.SIGKILL)
    assert cluster.spawn_worker("decode") == "decode-2"
    assert gpu_of(commands["decode-2"]) == ("cuda:1", "0.45")
    with pytest.raises(ValueError, match="no room for another worker"):
        cluster.spawn_worker("decode")  # every GPU already holds 0.9


def test_cuda_cluster_uses_every_visible_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a,GPU-b,GPU-c,GPU-d")
    cluster, commands = fake_cluster(ClusterSpec(prefill=2, decode=2, device="cuda"))
    for role in ("prefill", "prefill", "decode", "decode"):
        cluster.spawn_worker(role)
    assert [gpu_of(args) for args in commands.values()] == [
        ("cuda:0", "0.9"), ("cuda:1", "0.9"), ("cuda:2", "0.9"), ("cuda:3", "0.9")]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")  # none: fails before starting anything
    cluster = LocalCluster(ClusterSpec(device="cuda"))
    with pytest.raises(GpuError, match="no GPU found"):
        cluster.start()
    assert cluster.processes == {}


@pytest.mark.parametrize(("fields", "message"), [
    ({"device": "tpu"}, "--device must be cpu or cuda"),
    ({"kv_transport": "nccl"}, "--kv-transport must be auto, shared or dist"),
    ({"device": "cuda", "gpus": 0}, "--gpus must be >= 1"),
    ({"gpu_memory_fraction": 0.5}, "need --device cuda"),
    ({"device": "cuda", "gpu_memory_fraction": 0.96}, "--gpu-memory-fraction must be in"),
    ({"cuda_graphs": True}, "--cuda-graphs needs --device cuda"),
])
def test_cluster_spec_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        ClusterSpec(**fields)


# --- GPU discovery (no torch in the router process) -------------------------------------------

@pytest.mark.parametrize(("visible", "count"), [
    ("0", 1), ("0,1", 2), ("GPU-1a2b,GPU-3c4d,GPU-5e6f", 3), ("0,-1,2", 1), (" 1 , 3 ", 2),
    ("", 0), ("-1", 0), (",", 0)])
def test_cuda_visible_devices_is_counted(visible, count):
    if count:
        assert visible_gpus({"CUDA_VISIBLE_DEVICES": visible}) == count
    else:
        with pytest.raises(GpuError, match="no GPU found: CUDA_VISIBLE_DEVICES is"):
            visible_gpus({"CUDA_VISIBLE_DEVICES": visible})


def smi(stdout: str, returncode: int = 0, stderr: str = ""):
    def run(argv, **kwargs):
        assert argv == ["nvidia-smi", "-L"]
        return subprocess.CompletedProcess(argv, returncode, stdout, stderr)
    return run


def test_nvidia_smi_lists_the_gpus(tmp_path, monkeypatch):
    listing = ("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1)\n"
               "  MIG 3g.40gb     Device  0: (UUID: MIG-1)\n"
               "GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-2)\n")
    assert visible_gpus({}, smi(listing)) == 2
    with pytest.raises(GpuError, match="no GPU found: .*NVIDIA-SMI has failed"):
        visible_gpus({}, smi("", 9, "NVIDIA-SMI has failed because it couldn't communicate"))
    with pytest.raises(GpuError, match="no GPU found: `nvidia-smi -L` lists none"):
        visible_gpus({}, smi("No devices found.\n"))
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi at all
    with pytest.raises(GpuError, match="no GPU found: CUDA_VISIBLE_DEVICES is not set and"):
        visible_gpus({})
    script = tmp_path / "nvidia-smi"  # a fake one on the PATH, run for real
    script.write_text("#!/bin/sh\necho 'GPU 0: Fake (UUID: GPU-0)'\necho 'GPU 1: Fake'\n")
    script.chmod(0o755)
    assert visible_gpus({}) == 2


# --- sizing the KV cache on CUDA ---------------------------------------------------------------

MODEL = ModelConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64,
                    intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                    rms_norm_eps=1e-6, rope=RopeConfig(theta=10000.0), max_position_embeddings=128,
                    tie_word_embeddings=True, attention_bias=False)


def test_cuda_budget_arithmetic():
    budget = kv_sizing.cuda_kv_budget_bytes
    # 0.9 x 80 GiB = 72 GiB, minus 1 GiB of weights and a 2 GiB reserve
    assert budget(80 * GIB, 1 * GIB, 78 * GIB, 2 * GIB, 0.9) == int(0.9 * 80 * GIB) - 3 * GIB
    # other workers on the GPU hold most of it: only the free memory (less the reserve) is used
    assert budget(80 * GIB, 1 * GIB, 10 * GIB, 2 * GIB, 0.9) == 8 * GIB
    assert budget(80 * GIB, 20 * GIB, 60 * GIB, 2 * GIB, 0.22) == 0  # never negative


def test_activation_reserve_follows_tokens_and_model_shape():
    reserve = kv_sizing.activation_reserve_bytes
    # widest: MLP 4 x 128 = 512 vs attention (4 + 4) x 16 + 4 x 64 = 384; per token
    # 2 x (3 x 64 + 512) + 8 x 64 = 1920 bytes, doubled; logits: min(512, 64) rows x 1000 x 66
    assert reserve(MODEL, 512, 64, 2) == 2 * 512 * 1920 + 64 * 1000 * 66
    assert reserve(MODEL, 1024, 64, 2) > reserve(MODEL, 512, 64, 2)
    assert reserve(MODEL, 16, 64, 4) == 2 * 16 * (4 * 704 + 512) + 16 * 1000 * 68


def fake_gpu(monkeypatch, free: int, total: int, reserved: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)


def test_num_kv_blocks_on_a_faked_gpu(monkeypatch):
    fake_gpu(monkeypatch, free=70 * GIB, total=80 * GIB, reserved=1 * GIB)
    cache = CacheConfig(gpu_memory_fraction=0.45)
    scheduler = SchedulerConfig(max_num_batched_tokens=2048)
    reserve = (kv_sizing.CUDA_OVERHEAD_BYTES
               + kv_sizing.activation_reserve_bytes(MODEL, 2048, 64, 2))
    per_block = kv_bytes_per_block(MODEL, 16, 2)
    blocks = kv_sizing.num_kv_blocks(cache, MODEL, torch.bfloat16, torch.device("cuda:1"),
                                     scheduler)
    assert blocks == (int(0.45 * 80 * GIB) - 1 * GIB - reserve) // per_block
    graphs_pool = kv_sizing.activation_reserve_bytes(MODEL, 64, 64, 2)  # the largest bucket
    assert kv_sizing.num_kv_blocks(cache, MODEL, torch.bfloat16, torch.device("cuda:1"),
                                   scheduler, graphs=True) == \
        (int(0.45 * 80 * GIB) - 1 * GIB - reserve - graphs_pool) // per_block
    # kv_cache_gb and num_blocks still win on CUDA
    assert kv_sizing.num_kv_blocks(CacheConfig(kv_cache_gb=1.0), MODEL, torch.bfloat16,
                                   torch.device("cuda:0")) == GIB // per_block
    assert kv_sizing.num_kv_blocks(CacheConfig(num_blocks=7), MODEL, torch.bfloat16,
                                   torch.device("cuda:0")) == 7
    fake_gpu(monkeypatch, free=3 * GIB, total=4 * GIB, reserved=1 * GIB)
    with pytest.raises(ValueError, match="holds no block: gpu_memory_fraction 0.1 of 4.00 GiB"):
        kv_sizing.num_kv_blocks(CacheConfig(gpu_memory_fraction=0.1), MODEL, torch.bfloat16,
                                torch.device("cuda:0"))


def test_cpu_keeps_the_fixed_default():
    per_block = kv_bytes_per_block(MODEL, 16, 4)
    for cache in (CacheConfig(), CacheConfig(gpu_memory_fraction=0.1)):
        assert kv_sizing.num_kv_blocks(cache, MODEL, torch.float32,
                                       torch.device("cpu")) == GIB // per_block


@pytest.mark.parametrize("fraction", [0.0, 0.96, -0.5])
def test_gpu_memory_fraction_is_validated(fraction):
    with pytest.raises(ValueError, match="gpu_memory_fraction must be in \\(0, 0.95\\]"):
        CacheConfig(gpu_memory_fraction=fraction)
    with pytest.raises(ValueError, match="--gpu-memory-fraction must be in \\(0, 0.95\\]"):
        WorkerOptions(role="decode", router="h:1", gpu_memory_fraction=fraction)


@pytest.mark.parametrize(("fields", "message"), [
    ({"kv_cache_gb": 0.0}, "--kv-cache-gb must be > 0, got 0.0"),
    ({"kv_cache_gb": -1.0}, "--kv-cache-gb must be > 0, got -1.0"),
    ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens must be >= 1, got 0"),
])
def test_a_workers_sizes_are_validated_before_its_engine_builds(fields, message):
    with pytest.raises(ValueError, match=message):
        WorkerOptions(role="decode", router="h:1", **fields)


def test_worker_flag_reaches_the_engines_cache_config(monkeypatch):
    import serving.worker_main as worker_main

    options = parse_worker_args("decode", ["--router", "127.0.0.1:1", "--device", "cuda:1",
                                           "--gpu-memory-fraction", "0.45"])
    assert (options.device, options.gpu_memory_fraction) == ("cuda:1", 0.45)
    assert parse_worker_args("prefill", ["--router", "h:1"]).gpu_memory_fraction == 0.9
    monkeypatch.setattr(worker_main, "LLMEngine", lambda config, launcher=None: config)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    config = worker_main.build_engine(options)
    assert (config.device, config.cache.gpu_memory_fraction) == ("cuda:1", 0.45)


def test_graph_and_async_flags_reach_the_engine_config(monkeypatch):
    import serving.worker_main as worker_main

    options = parse_worker_args("decode", ["--router", "h:1", "--device", "cuda:0",
                                           "--cuda-graphs", "--async-scheduling"])
    monkeypatch.setattr(worker_main, "LLMEngine", lambda config, launcher=None: config)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    config = worker_main.build_engine(options)
    assert (config.cuda_graphs, config.async_scheduling) == (True, True)
    with pytest.raises(ValueError, match="--cuda-graphs needs --device cuda"):
        WorkerOptions(role="decode", router="h:1", cuda_graphs=True)
    with pytest.raises(ValueError, match="--fused-kernels needs --device cuda"):
        WorkerOptions(role="decode", router="h:1", fused_kernels=True)
    with pytest.raises(ValueError, match="--async-scheduling is for decode and colocated"):
        WorkerOptions(role="prefill", router="h:1", async_scheduling=True)


@pytest.mark.parametrize(("role", "device", "graphs", "async_scheduling"), [
    ("decode", "cuda:0", True, True), ("colocated", "cuda", True, True),
    ("prefill", "cuda:0", True, False), ("decode", "cpu", False, False),
    ("prefill", "cpu", False, False)])
def test_the_speed_paths_default_on_for_cuda_only(role, device, graphs, async_scheduling):
    """Each proven in a cluster on a GPU (H200 runs, 2026-11-27): graphs and async scheduling,
    then the fused kernels; each --no-x turns one off."""
    options = parse_worker_args(role, ["--router", "h:1", "--device", device])
    assert (options.cuda_graphs, options.async_scheduling, options.fused_kernels) == (
        graphs, async_scheduling, graphs)
    off = parse_worker_args(role, ["--router", "h:1", "--device", device, "--no-cuda-graphs",
                                   "--no-async-scheduling", "--no-fused-kernels"])
    assert (off.cuda_graphs, off.async_scheduling, off.fused_kernels) == (False, False, False)
