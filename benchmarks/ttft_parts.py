"""Where a served request's TTFT goes, from the server's own account: Poisson arrivals of random
token-id prompts through a running cluster's OpenAI API (streamed `/v1/completions`), and per
request the client's TTFT beside the `timings` of its last chunk — router queue, prefill queue
(the engine's waiting queue), prefill compute (first scheduled step to first token) and KV
transfer (disaggregated only), and the rest of the router's TTFT: on a colocated worker mostly
the wait for the step in flight, since a request joins the engine between steps. Decode admission
(disaggregated only) is shown beside them but lies after the TTFT: the router streams the prefill
worker's first token before it calls Decode, so admission delays the second token.

    .venv/bin/python -m benchmarks.ttft_parts --address 127.0.0.1:8000 [--rate 4] [--requests 60]
        [--prompt-tokens 256] [--max-tokens 128] [--seed 7] [--json OUT]

Start the cluster first (`router launch ... --http-port 8000`). Prints p50 / mean / max of each
part in ms. Not a timed test: a diagnosis.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import statistics
import threading
import time
from pathlib import Path

IN_TTFT = ("router_queue", "prefill_queue", "prefill_compute", "kv_transfer")
PHASES = (*IN_TTFT, "decode_admission")  # admission: after the first token (module docstring)
PARTS = ("client_ttft", "router_ttft", *PHASES, "rest")


def stream_one(address: str, model: str, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: the client's TTFT and the last chunk's timings, in ms."""
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "ignore_eos": True, "temperature": 0, "stream": True})
    start = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    first, timings = None, {}
    for raw in conn.getresponse():
        line = raw.strip()
        if not line.startswith(b"data:") or line == b"data: [DONE]":
            continue
        event = json.loads(line[5:])
        if "error" in event:
            return {"error": event["error"].get("message", "")}
        if first is None and any(c.get("text") for c in event.get("choices", [])):
            first = time.perf_counter() - start
        timings = event.get("timings", timings)
    conn.close()
    t = {k: v * 1e3 for k, v in timings.items() if isinstance(v, float)}
    parts = {phase: t.get(f"{phase}_s", 0.0) for phase in PHASES}
    ttft = t.get("ttft_s", 0.0)
    return {"client_ttft": (first or 0.0) * 1e3, "router_ttft": ttft, **parts,
            "rest": ttft - sum(parts[phase] for phase in IN_TTFT)}


def model_name(address: str) -> str:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("GET", "/v1/models")
        return json.loads(conn.getresponse().read())["data"][0]["id"]
    finally:
        conn.close()


def run(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    model = model_name(args.address)
    results: list[dict] = []
    threads = []
    for _ in range(args.requests):
        prompt = [rng.randrange(1000, 40000) for _ in range(args.prompt_tokens)]
        thread = threading.Thread(target=lambda p=prompt: results.append(
            stream_one(args.address, model, p, args.max_tokens)))
        thread.start()
        threads.append(thread)
        time.sleep(rng.expovariate(args.rate))
    for thread in threads:
        thread.join(timeout=900)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", required=True, help="HOST:PORT of the OpenAI API")
    parser.add_argument("--rate", type=float, default=4.0, help="offered requests per second")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = run(args)
    failed = [r["error"] for r in results if "error" in r]
    done = [r for r in results if "error" not in r]
    print(f"{len(done)} requests served, {len(failed)} failed" + (f": {failed[0]}" if failed
                                                                    else ""))
    for part in PARTS if done else ():
        values = [r[part] for r in done]
        print(f"{part:20} p50 {statistics.median(values):8.1f}  mean "
              f"{statistics.mean(values):8.1f}  max {max(values):8.1f} ms")
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
