"""Tables, verdicts and plots of `benchmarks.poisson` (kept apart from the runner)."""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Outcome:
    """One request of a Poisson run, as the runner (benchmarks.poisson) saw it."""

    arrival: float  # seconds after the run's start
    kind: str = ""  # the workload row's kind: chat or long
    prompt_tokens: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    end: float | None = None
    tokens: int = 0
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return sum(self.gaps) / len(self.gaps) if self.gaps else None

    def met(self, ttft_slo: float, tpot_slo: float, max_gap: float | None = None) -> bool:
        """Both SLOs met (TTFT, and TPOT = the mean gap); with `max_gap`, also no single gap
        (a stall the user sees) longer than that."""
        return self.error is None and self.ttft is not None and self.ttft <= ttft_slo and \
            (self.tpot is None or self.tpot <= tpot_slo) and \
            (max_gap is None or not self.gaps or max(self.gaps) <= max_gap)


ROOT = Path(__file__).resolve().parents[1]
START, END = "<!-- poisson:start -->", "<!-- poisson:end -->"
ATTAINMENT = 0.9  # a topology "meets the SLO" at a rate when 90% of its requests meet both


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(outcomes: list[Outcome], ttft_slo: float, tpot_slo: float,
            max_gap: float | None = None) -> dict:
    done = [o for o in outcomes if o.error is None and o.end is not None]
    span = max((o.end for o in done), default=0.0) or 1.0
    ttft = [o.ttft for o in done if o.ttft is not None]
    gaps = [g for o in done for g in o.gaps]
    met = sum(o.met(ttft_slo, tpot_slo, max_gap) for o in outcomes)
    return {"ttft": [pct(ttft, q) for q in (0.5, 0.9, 0.99)],
            "itl": [pct(gaps, q) for q in (0.5, 0.9, 0.99)],
            "tok_s": sum(o.tokens for o in done) / span, "goodput": met / span,
            "attainment": met / len(outcomes), "errors": len(outcomes) - len(done),
            "ttft_all": ttft}


def combined(runs: list[list[Outcome]], ttft_slo: float, tpot_slo: float,
             max_gap: float | None = None) -> dict:
    """Medians over repeated runs of each run's summary (errors summed, TTFTs pooled)."""
    parts = [summary(run, ttft_slo, tpot_slo, max_gap) for run in runs]

    def med(values: list[float | None]) -> float | None:
        present = [v for v in values if v is not None]
        return statistics.median(present) if present else None

    return {"ttft": [med([p["ttft"][i] for p in parts]) for i in range(3)],
            "itl": [med([p["itl"][i] for p in parts]) for i in range(3)],
            **{key: med([p[key] for p in parts])
               for key in ("tok_s", "goodput", "attainment")},
            "errors": sum(p["errors"] for p in parts),
            "ttft_all": [t for p in parts for t in p["ttft_all"]]}


def _ms(values: list[float | None]) -> str:
    return " / ".join("–" if v is None else f"{v * 1000:,.0f}" for v in values)


def _ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "–"
    if b == 0:
        return "∞" if a > 0 else "–"
    return f"{a / b:.2f}×"


def tables(stats: dict[str, dict[float, dict]], args: argparse.Namespace) -> list[str]:
    lines = ["| topology | rate req/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | out tok/s "
             "| goodput req/s | SLO met | errors |", "|---|---|---|---|---|---|---|---|"]
    for name, by_rate in stats.items():
        for rate, s in by_rate.items():
            lines.append(f"| {name} | {rate:g} | {_ms(s['ttft'])} | {_ms(s['itl'])} | "
                         f"{s['tok_s']:.1f} | {s['goodput']:.3f} | {s['attainment']:.0%} | "
                         f"{s['errors']} |")
    names = list(stats)
    if len(names) >= 2:
        disagg, coloc = names[0], names[1]
        lines += ["", f"| rate req/s | goodput {disagg} / {coloc} | ITL p99 {coloc} / {disagg} |",
                  "|---|---|---|"]
        for rate in stats[disagg]:
            a, b = stats[disagg][rate], stats[coloc][rate]
            lines.append(f"| {rate:g} | {_ratio(a['goodput'], b['goodput'])} | "
                         f"{_ratio(b['itl'][2], a['itl'][2])} |")
    lines.append("")
    for name, by_rate in stats.items():
        ok = [r for r, s in by_rate.items() if s["attainment"] >= ATTAINMENT]
        last = f"up to {max(ok):g} req/s" if ok else "at none of the rates measured"
        lines.append(f"- {name} meets the SLO (≥{ATTAINMENT:.0%} of requests with TTFT ≤ "
                     f"{args.ttft_slo_s:g} s and TPOT ≤ {args.tpot_slo_s * 1000:.0f} ms"
                     f"{_gap_clause(args)}) {last}.")
    return lines


def by_kind(results: dict[str, dict[float, list[list[Outcome]]]]) -> list[str]:
    """TTFT p50 / p90 per request kind, pooled over the repeats: where the queueing lands."""
    kinds = sorted({o.kind for by_rate in results.values() for runs in by_rate.values()
                    for run in runs for o in run if o.kind})
    if not kinds:
        return []
    lines = ["", "| topology | rate req/s | " + " | ".join(
        f"{kind} TTFT p50 / p90 ms (n)" for kind in kinds) + " |",
        "|---|---|" + "---|" * len(kinds)]
    for name, by_rate in results.items():
        for rate, runs in by_rate.items():
            cells = []
            for kind in kinds:
                ttft = [o.ttft for run in runs for o in run if o.kind == kind and o.ttft]
                cells.append(f"{_ms([pct(ttft, 0.5), pct(ttft, 0.9)])} ({len(ttft)})")
            lines.append(f"| {name} | {rate:g} | " + " | ".join(cells) + " |")
    return lines


def _gap_clause(args: argparse.Namespace) -> str:
    gap = getattr(args, "max_gap_slo_s", None)
    return "" if gap is None else f" and no gap > {gap * 1000:.0f} ms"


def plot(stats: dict[str, dict[float, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for name, by_rate in stats.items():
        rates = list(by_rate)
        axes[0].plot(rates, [by_rate[r]["ttft"][2] for r in rates], "o-", label=name)
        axes[1].plot(rates, [by_rate[r]["itl"][2] for r in rates], "o-", label=name)
        axes[2].plot(rates, [by_rate[r]["goodput"] for r in rates], "o-", label=name)
        top = by_rate[rates[-1]]["ttft_all"]
        axes[3].plot(sorted(top), [(i + 1) / len(top) for i in range(len(top))], label=name)
    titles = ["TTFT p99 (s) vs rate", "ITL p99 (s) vs rate", "goodput (req/s) vs rate",
              "TTFT CDF at the highest rate (s)"]
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
    for ax in axes[:3]:
        ax.set_xlabel("arrival rate (req/s)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def report(results: dict[str, dict[float, list[list[Outcome]]]], args: argparse.Namespace,
           write: bool) -> None:
    stats = {name: {rate: combined(runs, args.ttft_slo_s, args.tpot_slo_s, args.max_gap_slo_s)
                    for rate, runs in by_rate.items()} for name, by_rate in results.items()}
    header = [f"`python -m benchmarks.poisson --rates {args.rates} --requests {args.requests} "
              f"--repeats {args.repeats} "
              f"--max-tokens-cap {args.max_tokens_cap} --ttft-slo-s {args.ttft_slo_s:g} "
              f"--tpot-slo-s {args.tpot_slo_s:g}"
              + (f" --max-gap-slo-s {args.max_gap_slo_s:g}" if args.max_gap_slo_s else "")
              + "`: open-loop Poisson arrivals over "
              "online_mixed.jsonl (greedy, fp32, 1 torch thread per worker, 2 cores); "
              f"medians of {args.repeats} run(s) per rate, each on its own requests.", ""]
    body = header + tables(stats, args) + by_kind(results)
    print("\n".join(body))
    if not write:
        return
    plot(stats, ROOT / "benchmarks" / "poisson.png")
    section = "\n".join([START, *body, "", "![latency and goodput vs rate]"
                         "(benchmarks/poisson.png)", END])
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text()
    if START in text:
        text = text[:text.index(START)] + section + text[text.index(END) + len(END):]
    else:
        text += "\n## Disaggregated vs colocated: Poisson arrivals\n\n" + section + "\n"
    path.write_text(text)
