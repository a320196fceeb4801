"""What an engine start costs in imports: a CPU engine never imports torch._dynamo (~1.5 s of
every worker's and offline engine's start, for a mask only CUDA attention builds)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_a_cpu_engine_serves_without_importing_dynamo(tiny_llama_dir: Path) -> None:
    # A prompt served twice: the second's chunk after a cached prefix takes the masked path.
    code = ("import sys; from engine.llm import LLM; from engine.request import SamplingParams; "
            f"llm = LLM({str(tiny_llama_dir)!r}, dtype='float32'); "
            "params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True); "
            "[llm.generate([list(range(1, 60))], params) for _ in range(2)]; "
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo'))[:3])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
