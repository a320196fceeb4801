"""lm-eval's loglikelihood scoring through the cluster against transformers directly (issue 30).

The project's own multiple-choice task (benchmarks/lm_eval_task: 40 questions in a local JSONL,
no hub) is scored twice by lm-evaluation-harness from its own virtualenv: once with its
`local-completions` model against `router launch --prefill 1 --decode 1 --local-prefill off`
(token-id prompts, `echo: true, logprobs: 1, max_tokens: 1`: every prompt's logprobs computed on
the prefill worker and carried to the router with the first token), once with its `hf` model
(transformers on the same checkpoint, float32). Both accuracies and the largest difference of
any choice's loglikelihood are printed.

    bash benchmarks/lm_eval_setup.sh
    .venv/bin/python -m benchmarks.lm_eval_check [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from engine.loader import resolve_model_path
from launch.cluster import ClusterSpec, LocalCluster

ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "benchmarks" / "lm_eval_task"
LM_EVAL = ROOT / ".venv-lmeval" / "bin" / "lm_eval"
TASK = "pdserve_facts"
TIMEOUT_S = 1800


def run_lm_eval(model: str, model_args: str, out: Path) -> dict[str, Any]:
    """One lm-eval run of the task (its dataset read from TASK_DIR, offline); its results and
    the per-sample loglikelihoods."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([str(LM_EVAL), "--model", model, "--model_args", model_args,
                    "--tasks", TASK, "--include_path", str(TASK_DIR), "--batch_size", "1",
                    "--output_path", str(out), "--log_samples"],
                   cwd=TASK_DIR, env=env, check=True, timeout=TIMEOUT_S)
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [json.loads(line) for path in out.rglob(f"samples_{TASK}_*.jsonl")
               for line in path.read_text().splitlines()]
    return {"acc": results["results"][TASK]["acc,none"],
            "loglikelihoods": {s["doc_id"]: [float(r[0][0]) for r in s["resps"]] for s in samples}}


def through_cluster(model_dir: Path, out: Path) -> dict[str, Any]:
    spec = ClusterSpec(prefill=1, decode=1, port=0, dtype="float32",
                       router_args=("--local-prefill", "off"))
    with LocalCluster(spec, log_dir=out / "cluster-logs").start() as cluster:
        status = cluster.status()
        args = (f"model={status.model},base_url=http://{status.http_address}/v1/completions,"
                f"tokenizer={model_dir},tokenizer_backend=huggingface,tokenized_requests=True,"
                "num_concurrent=1,max_retries=1")
        return run_lm_eval("local-completions", args, out / "cluster")


def with_transformers(model_dir: Path, out: Path) -> dict[str, Any]:
    return run_lm_eval("hf", f"pretrained={model_dir},dtype=float32,device=cpu", out / "hf")


def for_transformers_4(model_dir: Path, out: Path) -> Path:
    """The checkpoint as lm-eval's transformers 4 reads it: the same weights (linked); the
    tokenizer's class named as transformers 4 knows it (the checkpoint names transformers 5's
    TokenizersBackend; both load tokenizer.json); the RoPE base where transformers 4 looks for
    it (transformers 5 writes it under rope_parameters; without it transformers 4 silently uses
    10,000 instead of SmolLM2's 100,000 and every logprob moves)."""
    view = out / "checkpoint"
    view.mkdir(parents=True)
    patched = {"tokenizer_config.json", "config.json"}
    for path in model_dir.iterdir():
        if path.name not in patched:
            (view / path.name).symlink_to(path.resolve())
    tokenizer = json.loads((model_dir / "tokenizer_config.json").read_text())
    tokenizer["tokenizer_class"] = "PreTrainedTokenizerFast"
    (view / "tokenizer_config.json").write_text(json.dumps(tokenizer))
    config = json.loads((model_dir / "config.json").read_text())
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        raise SystemExit(f"rope type {rope['rope_type']!r}: not translated for transformers 4")
    if "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    (view / "config.json").write_text(json.dumps(config))
    return view


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--keep", default=None, help="write lm-eval's outputs here and keep them")
    args = parser.parse_args()
    if not LM_EVAL.exists():
        raise SystemExit(f"{LM_EVAL} is missing: run `bash benchmarks/lm_eval_setup.sh` first")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep or tmp)
        model_dir = for_transformers_4(resolve_model_path("default"), out)
        ours = through_cluster(model_dir, out)
        theirs = with_transformers(model_dir, out)
    diffs = [abs(a - b) for doc, lls in ours["loglikelihoods"].items()
             for a, b in zip(lls, theirs["loglikelihoods"][doc])]
    report = {"task": TASK, "docs": len(ours["loglikelihoods"]),
              "acc_cluster": ours["acc"], "acc_transformers": theirs["acc"],
              "max_loglikelihood_diff": max(diffs), "choices_compared": len(diffs)}
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
