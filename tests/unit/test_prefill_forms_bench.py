"""benchmarks.prefill_attention_forms' table rows, without timing anything: each earlier build
of the kernel (`--against REV`) is compared with the build of this checkout it corresponds to."""

from __future__ import annotations

from benchmarks.prefill_attention_forms import FORM_NAMES, row


def test_a_row_compares_each_earlier_build_with_its_own_build_now():
    befores = ["native kernel at abc123", "native kernel, AVX2 build, at abc123"]
    names = [*FORM_NAMES, *befores]
    ms = {"native kernel": 2.0, "native kernel, AVX2 build": 4.0, "native kernel, no AMX": 7.0,
          "sdpa, K/V expanded": 3.0,
          "sdpa, enable_gqa": 5.0, "query tiles": 6.0, befores[0]: 2.5, befores[1]: 4.4}
    line = row("float32", 144, 560, ms, names, befores)
    assert line == ("| float32 | 144 × 560 | 2.00 | 4.00 | 7.00 | 3.00 | 5.00 | 6.00 | 2.50 | "
                    "4.40 | 1.50x | 1.25x | 1.10x |")


def test_forms_missing_on_this_machine_are_dashes():
    ms = {"sdpa, K/V expanded": 3.0, "sdpa, enable_gqa": 5.0, "query tiles": 6.0}
    line = row("bfloat16", 16, 16, ms, [*FORM_NAMES, "native kernel at r"], ["native kernel at r"])
    assert line == "| bfloat16 | 16 × 16 | - | - | - | 3.00 | 5.00 | 6.00 | - | - | - |"
