"""Markdown table/section and bar plot for the offline throughput benchmark."""

from __future__ import annotations

import datetime
import os
from importlib import metadata
from pathlib import Path
from typing import Any

Result = dict[str, Any]
LAT_KEYS = ("ttft", "itl")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def roofline_tok_s(flops: dict[str, int], peak: Result | None) -> float | None:
    if not peak or "peak_flops" not in peak:
        return None
    return flops["output_tokens"] / (flops["total"] / peak["peak_flops"])


def _fmt(value: float | None, digits: int = 1) -> str:
    if value is None or value != value:  # None or NaN
        return "—"
    return f"{value:,.{digits}f}"


def _lat(result: Result, kind: str) -> str:
    lat = result.get("latency") or {}
    if not lat:
        return "—"
    return " / ".join(_fmt(lat.get(f"{kind}_p{q}"), 0) for q in (50, 90, 99))


def table_rows(results: list[Result], peaks: dict[str, Result], flops: dict[str, int]
               ) -> list[list[str]]:
    ours = {r["dtype"]: r.get("tok_s_median") for r in results if r["system"] == "ours"}
    rows = []
    for r in results:
        if "error" in r:
            rows.append([r["system"], r["dtype"], f"failed: {r['error'][:80]}"] + ["—"] * 8)
            continue
        med = r["tok_s_median"]
        runs = ", ".join(_fmt(run["tok_s"], 2) for run in r["runs"])
        ratio = "—"
        if r["system"] != "ours" and ours.get(r["dtype"]):
            ratio = f"{ours[r['dtype']] / med:.2f}×"
        roof = roofline_tok_s(flops, peaks.get(r["dtype"]))
        share = f"{100 * med / roof:.1f}%" if roof else "—"
        rows.append([r["system"], r["dtype"], _fmt(med, 2), runs, ratio, _fmt(roof), share,
                     _lat(r, "ttft"), _lat(r, "itl"), _fmt(r.get("peak_rss_mb"), 0),
                     str(r.get("length_mismatches", "—"))])
    return rows


HEADER = ["system", "dtype", "tok/s (median)", "tok/s (all runs)", "ours / this",
          "roofline tok/s", "share of roofline", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms",
          "peak RSS MB", "length mismatches"]


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row + ["—"] * (len(HEADER) - len(row))) + " |" for row in rows]
    return "\n".join(lines)


def _peak_lines(peaks: dict[str, Result]) -> list[str]:
    lines = []
    for dtype, peak in peaks.items():
        if "error" in peak:
            lines.append(f"- {dtype}: peak measurement failed: {peak['error']}")
            continue
        shapes = "; ".join(f"{s['shape']} [M,{s['k']}]x[{s['k']},{s['n']}] {s['gflops']:.0f} "
                           f"({s['best']})" for s in peak["shapes"])
        lines.append(f"- {dtype}: peak **{peak['peak_flops'] / 1e9:.1f} GFLOP/s** "
                     f"({peak['threads']} threads; best GFLOP/s per shape over M in "
                     f"{peak['ms']} and F.linear / oneDNN prepacked, median of "
                     f"{peak['repeats']}: {shapes})")
    return lines


def _notes(results: list[Result]) -> list[str]:
    notes = []
    for r in results:
        bits = [f"load avg {r.get('loadavg_start', 0):.2f}→{r.get('loadavg_end', 0):.2f}",
                f"child wall {r.get('child_wall_s', 0):.0f}s"]
        for key in ("attn_implementation", "cb_num_blocks", "engine_dtype", "load_s",
                    "peer_versions", "kv_cache_gib", "peak_rss_self_mb", "peak_rss_children_mb"):
            if key in r:
                bits.append(f"{key}={r[key]:.1f}" if isinstance(r[key], float)
                            else f"{key}={r[key]}")
        if r.get("round_medians"):
            bits.append("tok/s median per round (systems taking turns)="
                        + ", ".join(f"{m:.2f}" for m in r["round_medians"]))
        if r.get("runs") and "cached_prompt_tokens" in r["runs"][0]:
            bits.append("prefix-cache hit tokens per run="
                        + ",".join(str(run["cached_prompt_tokens"]) for run in r["runs"]))
        busy = max(r.get("loadavg_start", 0.0), r.get("loadavg_end", 0.0))
        if busy > (os.cpu_count() or 1) + 0.5:
            bits.append("**CPU contended** (load average above the core count: another process "
                        "competed for the cores, so this row is pessimistic)")
        notes.append(f"- {r['system']} {r['dtype']}: " + ", ".join(bits))
    return notes


def section(results: list[Result], peaks: dict[str, Result], flops: dict[str, int],
            workload: str, num_rows: int, prompt_tokens: int, command: str) -> str:
    table = markdown_table(table_rows(results, peaks, flops))
    flop_parts = ", ".join(f"{k} {v / 1e12:.3f}" for k, v in flops.items() if k != "output_tokens")
    lines = [
        "## Offline throughput",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} cores; torch {_version('torch')}, "
        f"transformers {_version('transformers')}; {datetime.date.today().isoformat()}.",
        f"Workload: `{workload}` ({num_rows} requests, {prompt_tokens:,} prompt + "
        f"{flops['output_tokens']:,} output tokens, greedy, EOS ignored).",
        "",
        "```bash", command, "```", "",
        table, "",
        "tok/s = useful output tokens (each request's own max_tokens) / wall time of the whole "
        "workload; median over runs. TTFT is from submitting the workload to a request's first "
        "token; ITL is the gap between consecutive tokens of a request (latencies of the median "
        "run; vllm_cpu's `llm.generate` gives no per-token times). Peak RSS is each system's own "
        "child process (ru_maxrss; vllm_cpu: its front end plus its largest child, the engine "
        "core holding weights and KV cache).",
        "",
        f"Workload FLOPs (TFLOP): {flop_parts}. Roofline tok/s = output tokens / (FLOPs / peak):",
        *_peak_lines(peaks), "",
        "Run conditions:", *_notes(results), "",
    ]
    return "\n".join(lines)


def plot(results: list[Result], path: str | Path) -> bool:
    """Grouped bars of median tok/s per system and dtype; False when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    ok = [r for r in results if "error" not in r]
    systems = list(dict.fromkeys(r["system"] for r in ok))
    dtypes = list(dict.fromkeys(r["dtype"] for r in ok))
    width = 0.8 / max(len(dtypes), 1)
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, dtype in enumerate(dtypes):
        by_system = {r["system"]: r["tok_s_median"] for r in ok if r["dtype"] == dtype}
        xs = [j + i * width for j, s in enumerate(systems) if s in by_system]
        ys = [by_system[s] for s in systems if s in by_system]
        bars = ax.bar(xs, ys, width, label=dtype)
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xticks([j + width * (len(dtypes) - 1) / 2 for j in range(len(systems))], systems)
    ax.set_ylabel("useful output tokens/s (median)")
    ax.set_title(f"Offline throughput — {cpu_model()}, {os.cpu_count()} cores")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
