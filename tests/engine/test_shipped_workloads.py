"""The shipped workloads are exactly what their generator builds (same CPython documentation
text, tokenizer and seed), so anyone can rebuild and extend them."""

from __future__ import annotations

import sys

import pytest

from loadtest.workloads import NAMES, workload_path


@pytest.mark.skipif(sys.version_info[:3] != (3, 11, 7),
                    reason="the files were built from CPython 3.11.7 documentation text")
def test_the_generator_rebuilds_every_shipped_workload_byte_for_byte(tmp_path,
                                                                     default_model_dir):
    from loadtest.workloads.generate import generate

    built = generate(default_model_dir, tmp_path)
    assert sorted(p.stem for p in built) == sorted(NAMES)
    for path in built:
        assert path.read_bytes() == workload_path(path.stem).read_bytes(), path.name
