"""`pdserve`, the one command: every subcommand reaches its program (its --help answers), an
unknown one is refused, and the `python -m` forms still work."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cli.main import commands, main

ROOT = Path(__file__).resolve().parents[2]


def test_every_command_of_the_issue_is_there():
    assert set(commands()) >= {"launch", "serve", "prefill", "decode", "client", "plan", "certs",
                               "deploy", "loadtest", "bench", "generate"}


@pytest.mark.parametrize("argv, prog", [
    (["launch"], "launch"), (["serve"], "serve"), (["client"], "client"), (["plan"], "plan"),
    (["certs"], "certs"), (["prefill"], "prefill_worker"), (["decode"], "decode_worker"),
    (["deploy"], "deploy"), (["loadtest", "run"], "loadtest run"), (["generate"], "generate"),
    (["bench", "tokenize_stall"], "tokenize_stall"),
])
def test_each_command_reaches_its_program(argv, prog):
    done = subprocess.run([sys.executable, "-m", "cli.main", *argv, "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert prog in done.stdout.splitlines()[0] or prog in done.stdout[:400]


def test_unknown_commands_are_refused(capsys):
    assert main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
    assert main([]) == 2


def test_the_python_m_forms_keep_working():
    for module in ("router", "prefill_worker", "engine", "loadtest", "deploy"):
        done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (module, done.stderr[-1000:])
