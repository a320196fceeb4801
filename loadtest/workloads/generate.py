"""Build the shipped workloads from text CPython ships, tokenized for a model's tokenizer.

    python -m loadtest.workloads.generate [--tokenizer default|DIR] [--out DIR] [--seed N]

Each prompt is a chat turn (the model's chat template) whose body is an excerpt of the Python
reference documentation (`pydoc_data.topics`): real English and code, not random ids. The same
Python version (the documentation text changes between versions), tokenizer and seed give the
same files byte for byte; the shipped files were made with the defaults on CPython 3.11.7.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loadtest.workloads import WORKLOAD_DIR

DEFAULT_SEED = 20261121
SYSTEM_PROMPT = "You are a concise technical assistant."
INSTRUCTIONS = (
    "Summarize the following documentation in plain words:",
    "List the key rules described in this text:",
    "Explain this to a new Python programmer:",
    "Write three quiz questions about this passage:",
)
Row = dict[str, Any]


class PromptMaker:
    """Chat prompts whose user turn quotes an n-token excerpt of the corpus."""

    def __init__(self, tokenizer: Any, rng: random.Random):
        import pydoc_data.topics  # the standard library's own documentation text

        topics = pydoc_data.topics.topics
        corpus = "\n\n".join(topics[key] for key in sorted(topics))
        self.tokenizer = tokenizer
        self.rng = rng
        self.corpus_ids: list[int] = tokenizer(corpus, add_special_tokens=False)["input_ids"]

    def excerpt(self, tokens: int) -> str:
        start = self.rng.randrange(0, len(self.corpus_ids) - tokens - 1)
        return self.tokenizer.decode(self.corpus_ids[start:start + tokens])

    def make(self, excerpt_tokens: int, system: str = SYSTEM_PROMPT) -> tuple[str, list[int]]:
        excerpt = self.excerpt(excerpt_tokens)
        messages = [{"role": "system", "content": system},
                    {"role": "user", "content": f"{self.rng.choice(INSTRUCTIONS)}\n\n{excerpt}"}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True)
        return text, self.tokenizer(text, add_special_tokens=False)["input_ids"]


def offline_mixed(maker: PromptMaker, count: int = 32) -> list[Row]:
    """Prompts of 16-480 excerpt tokens, outputs of 16, 64 or 256 tokens."""
    rows = []
    for i in range(count):
        text, ids = maker.make(maker.rng.randint(16, 480))
        rows.append({"id": f"offline-{i}", "prompt": text, "prompt_token_ids": ids,
                     "max_tokens": maker.rng.choice([16, 64, 256]), "ignore_eos": True})
    return rows


def online_mixed(maker: PromptMaker, count: int = 240) -> list[Row]:
    """80% chat turns, 20% long documents: the mix where prefill interferes with decode."""
    rows = []
    for i in range(count):
        if maker.rng.random() < 0.8:
            kind, excerpt, low, high = "chat", maker.rng.randint(48, 360), 32, 256
        else:
            kind, excerpt, low, high = "long", maker.rng.randint(1000, 1800), 16, 64
        text, ids = maker.make(excerpt)
        rows.append({"id": f"online-{i}", "kind": kind, "prompt": text, "prompt_token_ids": ids,
                     "max_tokens": maker.rng.randint(low, high), "ignore_eos": True})
    return rows


def decode_heavy(maker: PromptMaker, count: int = 128) -> list[Row]:
    """Chat turns of 60-260 excerpt tokens with long, spread outputs: 32-768 tokens,
    log-uniform (most short, a tail of long ones), so the batch stays large for many steps."""
    rows = []
    for i in range(count):
        text, ids = maker.make(maker.rng.randint(60, 260))
        rows.append({"id": f"decode-{i}", "prompt": text, "prompt_token_ids": ids,
                     "max_tokens": int(32 * 24 ** maker.rng.random()), "ignore_eos": True})
    return rows


def shared_prefix(maker: PromptMaker, count: int = 32) -> list[Row]:
    """Long prompts sharing one system prompt (~400 tokens of reference text), each with its own
    question of 40-200 excerpt tokens; outputs of 32, 64 or 128 tokens."""
    system = f"{SYSTEM_PROMPT} Answer from this reference:\n\n{maker.excerpt(400)}"
    rows = []
    for i in range(count):
        text, ids = maker.make(maker.rng.randint(40, 200), system=system)
        rows.append({"id": f"shared-{i}", "prompt": text, "prompt_token_ids": ids,
                     "max_tokens": maker.rng.choice([32, 64, 128]), "ignore_eos": True})
    return rows


# In this order, from one random stream: a file's rows depend on every file built before it
# (new workloads go last, so the earlier files stay byte for byte what they were).
BUILDERS: tuple[tuple[str, Callable[[PromptMaker], list[Row]]], ...] = (
    ("offline_mixed", offline_mixed), ("online_mixed", online_mixed),
    ("decode_heavy", decode_heavy), ("shared_prefix", shared_prefix))


def write_jsonl(path: Path, rows: list[Row]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    prompt = sum(len(row["prompt_token_ids"]) for row in rows)
    output = sum(row["max_tokens"] for row in rows)
    return f"{path}: {len(rows)} requests, {prompt} prompt tokens, {output} output tokens"


def generate(tokenizer_dir: Path, out_dir: Path, seed: int = DEFAULT_SEED) -> list[Path]:
    from transformers import AutoTokenizer

    maker = PromptMaker(AutoTokenizer.from_pretrained(str(tokenizer_dir)), random.Random(seed))
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, build in BUILDERS:
        path = out_dir / f"{name}.jsonl"
        print(write_jsonl(path, build(maker)))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.workloads.generate",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", default="default",
                        help="a model directory with a tokenizer (default: the default model)")
    parser.add_argument("--out", type=Path, default=WORKLOAD_DIR)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    args = parser.parse_args(argv)
    from engine.loader import resolve_model_path

    generate(resolve_model_path(args.tokenizer), args.out, args.seed)


if __name__ == "__main__":
    main()
