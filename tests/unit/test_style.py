"""The tree stays ruff-clean (ruff is a dev dependency installed by scripts/setup.sh)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is not installed")
    result = subprocess.run([ruff, "check", str(ROOT)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_nothing_reads_outside_the_repository():
    """A clone with nothing beside it must work: no code, test, script or default names the
    workplace's shared folder beside the checkout (the workloads ship in loadtest/workloads/)."""
    files = subprocess.run(["git", "ls-files", "*.py", "*.sh", "*.toml", "*.yaml", ".ci/*"],
                           cwd=ROOT, capture_output=True, text=True, timeout=60).stdout.split()
    if not files:
        pytest.skip("not a git checkout")
    pattern = re.compile(r"""\.\./shared|["']shared["']\s*/\s*["']bench|/work/shared""")
    offenders = [name for name in files
                 if name != "tests/unit/test_style.py" and (ROOT / name).is_file()
                 and pattern.search((ROOT / name).read_text())]
    assert offenders == []


def test_no_source_file_is_hidden_from_git():
    """An ignore rule must not swallow source (a `dist/` rule once hid kv_transfer/dist/'s
    connector: the checkout it was written in passed, every clean clone's workers died)."""
    listed = subprocess.run(["git", "ls-files", "--others", "--ignored", "--exclude-standard",
                             "--", "*.py", "*.sh", "*.proto", "*.cpp", "*.md"],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    environments = (".venv/", ".venv-vllm/", ".venv-lmeval/", ".gpu/", "build/", "dist/", ".gl/",
                    ".whl/", ".pytest_cache/", ".ruff_cache/", "logs/")
    hidden = [name for name in listed.stdout.splitlines()  # names may hold spaces
              if not name.startswith(environments) and "/__pycache__/" not in name
              and ".egg-info/" not in name]
    assert hidden == []


def test_every_native_kernel_source_ships_in_the_package():
    """A kernel's C++ source or header not named in package-data would be missing from an
    installed pdserve, which would then fall back to the torch path without saying why."""
    import fnmatch

    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]
    sources = [path.relative_to(ROOT) for pattern in ("*/**/csrc/*.cpp", "*/**/csrc/*.h")
               for path in ROOT.glob(pattern)
               if not path.relative_to(ROOT).parts[0].startswith(".")]  # virtualenvs, .git
    assert sources
    unshipped = [str(path) for path in sources
                 if not any(fnmatch.fnmatch(str(path.relative_to(path.parts[0])), pattern)
                            for pattern in globs.get(path.parts[0], []))]
    assert unshipped == []
