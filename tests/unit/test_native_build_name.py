"""A native build's name: one per source, flags and place, so two checkouts of one source on a
machine keep a build folder each instead of rebuilding one folder in turn."""

from __future__ import annotations

from pathlib import Path

from engine.native_build import extension_name


def _source(folder: Path, text: str = "int f() { return 1; }\n") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "kernel.cpp").write_text(text)
    return folder / "kernel.cpp"


def test_the_same_source_in_two_checkouts_builds_under_two_names(tmp_path: Path) -> None:
    here, there = _source(tmp_path / "a"), _source(tmp_path / "b")
    name = extension_name("k", here, ("-O3",))
    assert name == extension_name("k", here, ("-O3",))  # found again: no rebuild
    assert name.startswith("k_")
    assert name != extension_name("k", there, ("-O3",))
    assert name != extension_name("k", here, ("-O2",))
    assert name != extension_name("k", _source(tmp_path / "a", "int f() { return 2; }\n"),
                                  ("-O3",))


def test_a_header_beside_the_source_is_part_of_the_name(tmp_path: Path) -> None:
    source = _source(tmp_path)
    before = extension_name("k", source, ())
    (tmp_path / "helper.h").write_text("#define X 1\n")
    assert extension_name("k", source, ()) != before
