"""The GPU clock sampler the GPU benchmarks record beside their figures, against a stand-in
`nvidia-smi` (a script printing what the real one prints)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from benchmarks.gpu_clocks import GpuClockSampler, parse_line, query, summarise


def fake_smi(tmp_path: Path, lines: list[str], code: int = 0) -> str:
    """An executable printing `lines` one per call (the last one again once they run out)."""
    (tmp_path / "lines").write_text("\n".join(lines) + "\n")
    (tmp_path / "calls").write_text("0")
    script = tmp_path / "nvidia-smi"
    script.write_text(f"""#!/bin/sh
n=$(cat {tmp_path}/calls); echo $((n + 1)) > {tmp_path}/calls
total=$(wc -l < {tmp_path}/lines)
[ "$n" -ge "$total" ] && n=$((total - 1))
sed -n "$((n + 1))p" {tmp_path}/lines
echo "the query" >&2
exit {code}
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def test_one_line_parses_with_the_reasons_in_hex():
    sample = parse_line("1980, 1980, 652.31, 71, 0x0000000000000008")
    assert sample == {"clocks.sm": 1980.0, "clocks.max.sm": 1980.0, "power.draw": 652.31,
                      "temperature.gpu": 71.0, "clocks_event_reasons.active": 8.0}
    assert isinstance(parse_line("1980, 1980, [N/A], 71, 0x0"), str)
    assert isinstance(parse_line("1980, 1980"), str)


def test_the_sampler_keeps_the_lowest_clock_and_every_slowdown_reason(tmp_path):
    binary = fake_smi(tmp_path, ["1980, 1980, 300.0, 50, 0x0",
                                 "1200, 1980, 699.5, 84, 0x0000000000000008",
                                 "1410, 1980, 690.0, 86, 0x0000000000000024"])
    with GpuClockSampler(interval_s=0.01, binary=binary) as clocks:
        while len(clocks.samples) < 3:
            pass
    summary = clocks.summary()
    assert summary["samples"] >= 4  # the one at exit too
    assert summary["sm_mhz_min"] == 1200 and summary["sm_mhz_max_allowed"] == 1980
    assert summary["power_w_max"] == 699.5 and summary["temperature_c_max"] == 86
    assert summary["reasons_mask"] == "0x2c"
    assert summary["slowdown_reasons"] == ["sw_power_cap", "hw_slowdown", "sw_thermal_slowdown"]


def test_no_nvidia_smi_or_a_failing_one_is_recorded_not_raised(tmp_path):
    assert query(binary=str(tmp_path / "absent")).endswith("not found")
    with GpuClockSampler(interval_s=0.01, binary=str(tmp_path / "absent")) as clocks:
        pass
    assert clocks.summary()["samples"] == 0 and "not found" in clocks.summary()["error"]
    failing = fake_smi(tmp_path, ["No devices were found"], code=6)
    assert query(binary=failing) == f"{failing} exited 6: the query"


def test_summary_without_samples_and_a_bad_interval():
    assert summarise([], []) == {"samples": 0, "error": "no sample taken"}
    with pytest.raises(ValueError, match="interval_s"):
        GpuClockSampler(interval_s=0)
