"""benchmarks.served_vs_vllm without vLLM and without processes: its arguments, the command lines
it builds, the alternation and seeds, a client result's condensing, and the tables from fake
results."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from benchmarks import served_report
from benchmarks import served_vs_vllm as svv

MODEL = Path("/models/SmolLM2-135M-Instruct")
NAME = "SmolLM2-135M-Instruct"


def test_defaults_are_the_issues_method():
    args = svv.parse_args([])
    assert args.systems == ["vllm", "ours_colocated", "ours_1p1d"]
    assert args.rates == [1.0, 2.0, 4.0]
    assert (args.num_prompts, args.runs, args.dtype) == (60, 2, "bfloat16")
    assert args.json is None and not args.write


def test_arguments_parse():
    args = svv.parse_args(["--systems", "ours_1p1d,vllm", "--rates", "0.5,4", "--num-prompts",
                           "4", "--runs", "1", "--json", "out.json", "--write"])
    assert args.systems == ["ours_1p1d", "vllm"]
    assert args.rates == [0.5, 4.0]
    assert (args.num_prompts, args.runs, args.json, args.write) == (4, 1, Path("out.json"), True)


@pytest.mark.parametrize("argv", [["--systems", "sglang"], ["--systems", "vllm,vllm"],
                                  ["--rates", "0"], ["--rates", "fast"], ["--runs", "0"],
                                  ["--num-prompts", "0"], ["--dtype", "float16"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        svv.parse_args(argv)


def test_order_alternates_between_runs():
    assert svv.run_order(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"],
                                                 ["a", "b", "c"]]


def test_every_run_and_rate_has_its_own_seed():
    seeds = {svv.seed_for(run, i, 3, base=7) for run in range(4) for i in range(3)}
    assert len(seeds) == 12 and min(seeds) == 7


def test_vllm_serve_command(tmp_path):
    cmd = svv.vllm_command(MODEL, NAME, 8123, "bfloat16", venv=tmp_path)
    assert cmd == [str(tmp_path / "bin" / "vllm"), "serve", str(MODEL), "--dtype", "bfloat16",
                   "--served-model-name", NAME, "--host", "127.0.0.1", "--port", "8123"]


@pytest.mark.parametrize("system,topology", [
    ("ours_colocated", ["--colocated", "1", "--threads", "2"]),
    ("ours_1p1d", ["--prefill", "1", "--decode", "1", "--threads", "1"]),
    ("ours_colocated_512", ["--colocated", "1", "--threads", "2",
                            "--max-num-batched-tokens", "512"])])
def test_router_launch_command(system, topology):
    cmd = svv.ours_command(system, 50100, 8124, "bfloat16", Path("/logs"), python="py")
    assert cmd == ["py", "-m", "router", "launch", *topology, "--host", "127.0.0.1",
                   "--port", "50100", "--http-port", "8124", "--dtype", "bfloat16",
                   "--log-dir", "/logs"]


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_client_command(tmp_path):
    cmd = svv.client_command(8125, MODEL, NAME, 2.0, 60, 5, tmp_path / "r" / "rate-2.json",
                             venv=tmp_path)
    assert cmd[:3] == [str(tmp_path / "bin" / "vllm"), "bench", "serve"]
    expected = {"--backend": "vllm", "--base-url": "http://127.0.0.1:8125",
                "--endpoint": "/v1/completions", "--model": str(MODEL),
                "--served-model-name": NAME, "--tokenizer": str(MODEL),
                "--dataset-name": "random", "--random-input-len": "256",
                "--random-output-len": "128", "--num-prompts": "60", "--request-rate": "2",
                "--seed": "5", "--temperature": "0", "--metric-percentiles": "50,90,99",
                "--result-dir": str(tmp_path / "r"), "--result-filename": "rate-2.json"}
    assert {k: _flag(cmd, k) for k in expected} == expected
    for flag in ("--ignore-eos", "--save-result", "--disable-tqdm"):
        assert flag in cmd


def _result(req_s: float, ttft: float, itl: float, failed: int = 0, chunks: int = 128) -> dict:
    return {"request_throughput": req_s, "output_throughput": req_s * 128,
            "median_ttft_ms": ttft, "p90_ttft_ms": ttft * 2, "median_itl_ms": itl,
            "p90_itl_ms": itl * 1.5, "median_tpot_ms": itl, "completed": 60 - failed,
            "failed": failed, "output_len_mismatches": 0, "errors": [],
            "chunks_per_request": chunks}


def test_condense_keeps_summaries_not_lists():
    raw = {**_result(1.0, 50, 10), "input_lens": [256, 256, 257], "output_lens": [128, 128, 7],
           "itls": [[0.01] * 128, [0.01] * 128, []], "ttfts": [0.05] * 3,
           "generated_texts": ["x"] * 3, "errors": ["", "boom", "boom"]}
    kept = svv.condense(raw)
    assert not set(svv.BULKY) - {"errors"} & set(kept)
    assert kept["output_len_mismatches"] == 1
    assert kept["input_len_range"] == [256, 257]
    assert kept["chunks_per_request"] == 129  # a failed request (no gaps) is not counted
    assert (kept["errors"], kept["distinct_errors"]) == (["boom"], 1)


def _records() -> list[dict]:
    figures = {("vllm", 0): (1.0, 100.0, 20.0), ("vllm", 1): (0.9, 120.0, 22.0),
               ("ours_colocated", 0): (1.0, 50.0, 10.0), ("ours_colocated", 1): (1.0, 40.0, 12.0)}
    records = [{"run": run, "system": s, "rate": 1.0, "seed": run,
                "result": _result(*f, chunks=128 if s == "vllm" else 129)}
               for (s, run), f in figures.items()]
    return records + [{"run": run, "system": "ours_1p1d", "rate": 1.0, "seed": run,
                       "error": "RuntimeError: ours_1p1d exited"} for run in (0, 1)]


def test_summary_is_the_median_over_runs():
    summary = served_report.summarize(_records())
    vllm = summary[("vllm", 1.0)]
    assert vllm["request_throughput"] == pytest.approx(0.95)
    assert vllm["median_ttft_ms"] == pytest.approx(110.0)
    assert (vllm["runs"], vllm["failed_runs"]) == (2, 0)
    assert summary[("ours_1p1d", 1.0)]["failed_runs"] == 2


def test_section_tables_and_ratios():
    args = argparse.Namespace(systems=["vllm", "ours_colocated", "ours_1p1d"], rates=[1.0],
                              num_prompts=60, runs=2, dtype="bfloat16")
    meta = {"cpu": "AMD EPYC (AVX-512: avx512f; AMX: none)", "cores": 2,
            "versions": "ours: torch 2.13.0", "model": NAME, "date": "2026-01-01",
            "omp_bind": "0-1", "kv_gib": "1"}
    text = "\n".join(svv.section(_records(), args, meta, "CMD"))
    assert ("| offered req/s | vLLM: req/s, TTFT p50, ITL p50 | ours colocated | ours 1P+1D |"
            in text)
    assert "| 1 | 0.95, 110.0, 21.0 | 1.00, 45.0, 11.0 | failed |" in text
    assert "| 1 | 220.0, 31.5, 121.6 | 90.0, 16.5, 128.0 | failed |" in text
    # ours ÷ vLLM req/s; vLLM ÷ ours TTFT and ITL
    assert "| 1 | 1.05×, 2.44×, 1.91× | — |" in text
    assert "AMD EPYC" in text and "CMD" in text
    assert "⚠ ours 1P+1D at 1 req/s: 2 failed runs" in text
    assert "`RuntimeError: ours_1p1d exited`" in text
    assert "- ours colocated: 129 stream chunks with `choices`" in text
    assert "- vLLM:" not in text


def test_cpu_description_names_the_vector_flags():
    lscpu = ("Architecture: x86_64\nModel name:   Intel Xeon\n"
             "Flags: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert svv.cpu_description(lscpu) == ("Intel Xeon (AVX-512: avx512f avx512_bf16; "
                                          "AMX: amx_bf16 amx_tile)")
    assert svv.cpu_description("") == "unknown CPU (AVX-512: none; AMX: none)"


def test_write_replaces_its_own_section():
    body = svv.section([], argparse.Namespace(systems=["vllm"], rates=[1.0], num_prompts=4,
                                              runs=1, dtype="bfloat16"),
                       {"cpu": "c", "cores": 2, "versions": "v", "model": NAME, "date": "d",
                        "omp_bind": "0-1", "kv_gib": "1"}, "CMD")
    once = svv.replace_marked("# Benchmarks\n", body, svv.TITLE, svv.START, svv.END)
    assert once.count(svv.TITLE) == 1
    assert svv.replace_marked(once, body, svv.TITLE, svv.START, svv.END) == once
