"""The vllm_cpu benchmark peer, without vLLM (CI never installs it): its command line, its
environment, the error when .venv-vllm is missing, the child's imports, and the timeout's kill of
the child's whole process tree."""

from __future__ import annotations

import ast
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import offline_throughput, vllm_child, vllm_env
from benchmarks.report import markdown_table, table_rows

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_venv(tmp_path, monkeypatch):
    """A .venv-vllm stand-in: bin/python and lib/libiomp5.so exist (neither is run); the
    system's library folders are an empty one, so a tcmalloc installed here is not found."""
    (tmp_path / "system-libs").mkdir()
    monkeypatch.setattr(vllm_env, "SYSTEM_LIB_DIRS", (str(tmp_path / "system-libs"),))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / vllm_env.IOMP).write_text("")
    monkeypatch.setattr(vllm_env, "VENV_DIR", tmp_path)
    return tmp_path


def test_systems_accept_vllm_cpu_when_its_venv_exists(fake_venv):
    args = offline_throughput.parse_args(["--systems", "ours,vllm_cpu", "--runs", "2"])
    assert args.systems == ["ours", "vllm_cpu"]
    assert args.vllm_kv_cache_gib == vllm_env.DEFAULT_KV_CACHE_GIB


def test_vllm_cpu_is_opt_in():
    assert "vllm_cpu" not in offline_throughput.parse_args([]).systems


def test_missing_venv_is_a_clear_error_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vllm_env, "VENV_DIR", tmp_path / "nothing-here")
    with pytest.raises(SystemExit):
        offline_throughput.parse_args(["--systems", "ours,vllm_cpu"])
    assert "bash benchmarks/vllm_cpu_setup.sh" in capsys.readouterr().err
    with pytest.raises(vllm_env.VllmNotInstalled, match="vllm_cpu_setup.sh"):
        vllm_env.vllm_python()


def test_env_has_what_a_vllm_child_needs(fake_venv):
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/somewhere", "LD_PRELOAD": "/x/libother.so"}
    env = vllm_env.vllm_env(base, kv_cache_gib=2, cpus=[0, 1])
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["HF_HUB_OFFLINE"] == env["TRANSFORMERS_OFFLINE"] == "1"
    assert env["LD_PRELOAD"].split(":") == [str(fake_venv / "lib" / vllm_env.IOMP),
                                            "/x/libother.so"]
    assert env["PATH"].split(":")[0] == str(fake_venv / "bin")
    assert env["VLLM_CACHE_ROOT"].startswith(str(fake_venv))
    assert "PYTHONPATH" not in env and "VLLM_RPC_BASE_PATH" not in env
    assert base["LD_PRELOAD"] == "/x/libother.so"  # the caller's mapping is left alone


def test_preload_puts_tcmalloc_first_and_skips_what_is_absent(tmp_path, fake_venv):
    (tmp_path / "sys").mkdir()
    assert vllm_env.preload_libraries(system_dirs=[tmp_path / "sys"]) == [
        fake_venv / "lib" / vllm_env.IOMP]
    (tmp_path / "sys" / vllm_env.TCMALLOC).write_text("")
    libs = vllm_env.preload_libraries(system_dirs=[tmp_path / "sys"])
    assert [p.name for p in libs] == [vllm_env.TCMALLOC, vllm_env.IOMP]
    (fake_venv / "lib" / vllm_env.IOMP).unlink()
    assert "LD_PRELOAD" not in vllm_env.vllm_env({}, cpus=[0])  # nothing found: no preload


def test_cpu_list():
    assert vllm_env.cpu_list([1, 0]) == "0-1"
    assert vllm_env.cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert vllm_env.cpu_list()  # this process's own affinity
    with pytest.raises(ValueError):
        vllm_env.cpu_list([])


def test_vllm_child_command_runs_under_the_vllm_venv(fake_venv, tmp_path, monkeypatch):
    import engine.loader

    monkeypatch.setattr(engine.loader, "resolve_model_path", lambda name: tmp_path / "model")
    args = offline_throughput.parse_args(["--systems", "vllm_cpu", "--runs", "3",
                                          "--vllm-kv-cache-gib", "2"])
    cmd, env = offline_throughput.child_command("vllm_cpu", "bfloat16", args, tmp_path / "r.json")
    assert cmd[:3] == [str(fake_venv / "bin" / "python"), "-I",
                       str(ROOT / "benchmarks" / "vllm_child.py")]
    assert cmd[3:5] == [str(tmp_path / "model"), "bfloat16"]
    assert cmd[cmd.index("--runs") + 1] == "3"
    assert Path(cmd[cmd.index("--workload") + 1]).is_absolute()
    assert env is not None and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert env["VLLM_RPC_BASE_PATH"] == str(tmp_path)  # removed with the parent's workdir
    cmd, env = offline_throughput.child_command("ours", "float32", args, tmp_path / "r.json")
    assert cmd[:3] == [sys.executable, "-m", "benchmarks.child"] and env is None


def _stdlib_or(path: Path, allowed: set[str]) -> set[str]:
    """Top-level modules `path` imports that are neither stdlib nor in `allowed`."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__"} - allowed


def test_vllm_side_imports_nothing_of_the_project_venv():
    """.venv-vllm has vLLM's dependencies, not ours: its child reaches only stdlib modules of
    the repository (benchmarks.common, loadtest.workloads) besides vllm."""
    assert _stdlib_or(ROOT / "benchmarks" / "vllm_child.py", {"vllm", "benchmarks"}) == set()
    assert _stdlib_or(ROOT / "benchmarks" / "common.py", {"loadtest"}) == set()
    assert _stdlib_or(ROOT / "loadtest" / "workloads" / "__init__.py", set()) == set()
    assert _stdlib_or(ROOT / "loadtest" / "__init__.py", set()) == set()
    assert _stdlib_or(ROOT / "benchmarks" / "vllm_env.py", set()) == set()
    # its `ours` child imports the engine inside the function that runs it, under .venv only
    assert _stdlib_or(ROOT / "benchmarks" / "prefill_vs_vllm.py",
                      {"vllm", "benchmarks", "engine"}) == set()


def test_prefill_passes_are_fresh_prompts_of_the_asked_shape():
    from benchmarks.prefill_vs_vllm import serve_passes

    seen: list[list[list[int]]] = []
    replies: list[str] = []
    serve_passes(seen.append, 5, ["1", "3", "3"], replies.append)
    assert [len(batch) for batch in seen] == [2, 1, 3, 3]  # the warm-up, then one per command
    assert replies[0] == "READY" and len(replies) == 4
    assert all(r.startswith("PASS ") and float(r.split()[1]) >= 0 for r in replies[1:])
    assert all(len(prompt) == 5 for batch in seen for prompt in batch)
    prompts = [tuple(prompt) for batch in seen for prompt in batch]
    assert len(set(prompts)) == len(prompts)  # no pass reuses a prompt: no prefix-cache hit
    again: list[list[list[int]]] = []
    serve_passes(again.append, 5, ["1", "3", "3"], lambda _: None)
    assert again == seen  # every system gets the same prompts


def test_prefill_systems_take_turns_and_pair_their_passes():
    from benchmarks.prefill_vs_vllm import paired_ratio, turns

    order = list(turns(["ours", "vllm"], [1, 4], repeats=2))
    assert order == [(0, 1, "ours"), (0, 1, "vllm"), (0, 4, "ours"), (0, 4, "vllm"),
                     (1, 1, "vllm"), (1, 1, "ours"), (1, 4, "vllm"), (1, 4, "ours")]
    # pass by pass: a host twice as slow in the second repeat moves neither ratio
    assert paired_ratio([120.0, 240.0, 300.0], [100.0, 200.0, 100.0]) == 1.2


def test_child_counts_length_mismatches_and_rss():
    rows = [{"prompt_token_ids": [1, 2], "max_tokens": 3},
            {"prompt_token_ids": [4], "max_tokens": 2}]
    out = [SimpleNamespace(prompt_token_ids=[1, 2], outputs=[SimpleNamespace(token_ids=[9] * 3)]),
           SimpleNamespace(prompt_token_ids=[4], outputs=[SimpleNamespace(token_ids=[9])])]
    assert vllm_child.mismatches(rows, out[:1] + out[:1]) == 2
    assert vllm_child.mismatches(rows, out) == 2  # one short request: one missing, one extra
    out[1].outputs[0].token_ids = [9, 9]
    assert vllm_child.mismatches(rows, out) == 0
    rss = vllm_child.rss_fields()
    assert rss["peak_rss_mb"] == rss["peak_rss_self_mb"] + rss["peak_rss_children_mb"]


def test_vllm_row_in_the_report():
    ours = {"system": "ours", "dtype": "float32", "tok_s_median": 30.0,
            "runs": [{"tok_s": 30.0}], "latency": {}}
    peer = {"system": "vllm_cpu", "dtype": "float32", "tok_s_median": 20.0,
            "runs": [{"tok_s": 20.0, "cached_prompt_tokens": 0}], "latency": {},
            "peak_rss_mb": 3000.0, "length_mismatches": 0}
    rows = table_rows([ours, peer], {}, {"output_tokens": 1, "total": 1})
    assert rows[1][:5] == ["vllm_cpu", "float32", "20.00", "20.00", "1.50×"]
    assert "| vllm_cpu | float32 |" in markdown_table(rows)


def test_rounds_take_turns_and_merge_every_run(monkeypatch, tmp_path):
    """With --rounds the systems alternate child by child, and a system's figure is the median
    of its runs over all rounds, with each round's median kept for the notes."""
    order: list[tuple[str, int]] = []
    rates = {("ours", 1): [10.0, 12.0], ("vllm_cpu", 1): [8.0, 8.0],
             ("ours", 2): [14.0, 16.0], ("vllm_cpu", 2): [9.0, 11.0]}

    def fake_child(system, dtype, args, workdir, round_no=0):
        if system == "roofline":
            return {"system": system, "dtype": dtype}
        order.append((system, round_no))
        runs = [{"tok_s": r, "length_mismatches": 0} for r in rates[(system, round_no)]]
        return {"system": system, "dtype": dtype, "runs": runs, "peak_rss_mb": 100.0 * round_no,
                "tok_s_median": sum(rates[(system, round_no)]) / 2, "length_mismatches": 0}

    monkeypatch.setattr(offline_throughput, "run_child", fake_child)
    args = SimpleNamespace(dtypes=["float32"], systems=["ours", "vllm_cpu"], rounds=2)
    results, _ = offline_throughput.run_all(args, tmp_path)
    assert order == [("ours", 1), ("vllm_cpu", 1), ("ours", 2), ("vllm_cpu", 2)]
    ours, peer = results
    assert ours["tok_s_median"] == 13.0 and ours["round_medians"] == [11.0, 15.0]
    assert len(ours["runs"]) == 4 and ours["peak_rss_mb"] == 200.0
    assert peer["tok_s_median"] == 8.5
    assert table_rows(results, {}, {"output_tokens": 1, "total": 1})[1][4] == "1.53×"


def test_a_failed_round_fails_the_systems_result():
    ok = {"system": "ours", "dtype": "float32", "runs": [{"tok_s": 1.0}], "tok_s_median": 1.0}
    failed = {"system": "ours", "dtype": "float32", "error": "timed out after 5s"}
    assert offline_throughput.merge_rounds([ok, failed]) == failed
    assert offline_throughput.merge_rounds([ok]) == ok


def test_rounds_must_be_positive():
    with pytest.raises(SystemExit):
        offline_throughput.parse_args(["--rounds", "0"])


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie no one has reaped yet is dead too


def test_timeout_kills_the_childs_children():
    """vLLM's engine core is a child of the benchmark child: killing only the child would leave
    it computing on the cores the next system is measured on."""
    code = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 20
        while not (below := offline_throughput.descendants(proc.pid)):
            assert time.monotonic() < deadline, "the grandchild never started"
            time.sleep(0.05)
        offline_throughput.kill_tree(proc)
        assert proc.returncode is not None
        deadline = time.monotonic() + 10
        while any(map(_alive, below)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(map(_alive, below))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


def test_setup_script_parses():
    script = ROOT / "benchmarks" / "vllm_cpu_setup.sh"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    assert "/.venv-vllm/" in (ROOT / ".gitignore").read_text().splitlines()


def test_a_prefill_child_that_died_is_reported_with_its_log(tmp_path):
    from benchmarks.prefill_vs_vllm import Child

    script = "import sys; print('READY', flush=True); sys.stderr.write('no model here')"
    child = Child("fake", [sys.executable, "-c", script], {}, tmp_path / "fake.log")
    try:
        assert child.reply(30.0) == "READY"
        with pytest.raises(RuntimeError, match="fake exited .*no model here"):
            child.run_pass(1)
    finally:
        child.close()
    assert child.proc.returncode == 0
