"""Served, side by side: `vllm serve` and ours on the same model and cores, each loaded with
vLLM's own client (`vllm bench serve`), in one invocation (issue 35, the served part).

    .venv/bin/python -m benchmarks.served_vs_vllm [--systems vllm,ours_colocated,ours_1p1d]
        [--rates 1,2,4] [--num-prompts 60] [--runs 2] [--dtype bfloat16] [--json OUT] [--write]

Systems: `vllm` is `vllm serve MODEL_DIR` with its defaults (.venv-vllm, benchmarks/vllm_env.py's
environment: VLLM_CPU_OMP_THREADS_BIND = every core); `ours_colocated` is `router launch
--colocated 1 --threads 2`, `ours_1p1d` is `router launch --prefill 1 --decode 1 --threads 1`,
`ours_colocated_512` (not a default) adds `--max-num-batched-tokens 512`, its budget before f5b0b0c.
Every server serves the model under the same name (the router's: the checkpoint folder's name),
so the client sends the same body to each. One server at a time; the order of the systems
alternates between runs (A B C, then C B A, ...); each server starts once per run, gets one
warm-up request, then serves every rate. Per rate the client sends `--num-prompts` random prompts
of 256 tokens, 128 output tokens each (EOS ignored, greedy), Poisson arrivals; the seed differs
per rate and per run (the same for every system within a run), so no rate or run is served from
an earlier one's prefix cache. Reported per system and rate: achieved req/s, TTFT and ITL p50 and
p90, output tok/s, medians over runs. `--write` puts the section into BENCHMARKS.md; `--json`
keeps every client result. Needs .venv-vllm (`bash benchmarks/vllm_cpu_setup.sh`).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.common import loadavg_1m, replace_marked, write_json
from benchmarks.offline_throughput import descendants
from benchmarks.served_report import (
    INPUT_LEN,
    OUTPUT_LEN,
    cpu_description,
    rate_text,
    section,
)
from benchmarks.vllm_env import VENV_DIR, vllm_env, vllm_python

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
SYSTEMS = ("vllm", "ours_colocated", "ours_1p1d", "ours_colocated_512")
OURS_TOPOLOGY = {"ours_colocated": ("--colocated", "1", "--threads", "2"),
                 "ours_1p1d": ("--prefill", "1", "--decode", "1", "--threads", "1"),
                 # the colocated worker at the engine's budget (its default is 2048 on CPU)
                 "ours_colocated_512": ("--colocated", "1", "--threads", "2",
                                        "--max-num-batched-tokens", "512")}
# vLLM's first start compiles the model (torch.compile) before it answers at all.
READY_TIMEOUT_S = {"vllm": 900.0, **{system: 300.0 for system in OURS_TOPOLOGY}}
STOP_GRACE_S = 60.0  # SIGTERM, then SIGKILL for the whole tree
WARMUP_TIMEOUT_S = 300.0
# Fields of the client's detailed result that are per request: only summaries are kept.
BULKY = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times",
         "queue_times", "generated_texts", "errors")
TITLE = "## Served: ours vs vLLM CPU (issue 35)"
START, END = "<!-- served-vs-vllm:start -->", "<!-- served-vs-vllm:end -->"


def _csv(value: str, cast: Callable[[str], Any], allowed: Iterable[Any] | None = None
         ) -> list[Any]:
    try:
        items = [cast(v.strip()) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list: {value!r}") from None
    allowed = tuple(allowed) if allowed is not None else None
    bad = [v for v in items if allowed is not None and v not in allowed]
    if bad or not items or len(set(items)) != len(items):
        hint = f" of {', '.join(map(str, allowed))}" if allowed else ""
        raise argparse.ArgumentTypeError(f"expected a comma list{hint} without repeats, got "
                                         f"{value!r}")
    return items


def _positive_rate(value: str) -> float:
    rate = float(value)
    if not rate > 0:
        raise ValueError(value)
    return rate


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", type=lambda v: _csv(v, str, SYSTEMS), default=list(SYSTEMS[:3]),
                   help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--rates", type=lambda v: _csv(v, _positive_rate), default=[1.0, 2.0, 4.0],
                   help="offered request rates (req/s, Poisson arrivals)")
    p.add_argument("--num-prompts", type=int, default=60, help="requests per rate")
    p.add_argument("--runs", type=int, default=2, help="server starts per system (medians)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--seed-base", type=int, default=0,
                   help="the client's --seed is this + run * len(rates) + rate index")
    p.add_argument("--client-timeout", type=float, default=1800.0,
                   help="seconds one `vllm bench serve` may take")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="server logs and client results (default: a new temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="write every client result here")
    p.add_argument("--write", action="store_true", help="put the section into BENCHMARKS.md")
    args = p.parse_args(argv)
    if args.runs < 1 or args.num_prompts < 1:
        p.error("--runs and --num-prompts must be >= 1")
    return args


def seed_for(run: int, rate_index: int, num_rates: int, base: int = 0) -> int:
    """One seed per (run, rate): every rate and every run gets prompts of its own; within a run
    every system gets the same prompts."""
    return base + run * num_rates + rate_index


def run_order(systems: list[str], runs: int) -> list[list[str]]:
    """The systems of each run, alternating (A B C, C B A, A B C, ...): a drift over the
    invocation (heat, a neighbour) hits every system alike."""
    return [list(systems) if run % 2 == 0 else list(reversed(systems)) for run in range(runs)]


def vllm_command(model_dir: Path, name: str, port: int, dtype: str,
                 venv: Path = VENV_DIR) -> list[str]:
    return [str(Path(venv) / "bin" / "vllm"), "serve", str(model_dir), "--dtype", dtype,
            "--served-model-name", name, "--host", HOST, "--port", str(port)]


def ours_command(system: str, grpc_port: int, http_port: int, dtype: str, log_dir: Path,
                 python: str = sys.executable) -> list[str]:
    return [python, "-m", "router", "launch", *OURS_TOPOLOGY[system], "--host", HOST,
            "--port", str(grpc_port), "--http-port", str(http_port), "--dtype", dtype,
            "--log-dir", str(log_dir)]


def client_command(port: int, model_dir: Path, name: str, rate: float, num_prompts: int,
                   seed: int, result_file: Path, venv: Path = VENV_DIR) -> list[str]:
    """`vllm bench serve` against one server; --save-detailed keeps each request's error and
    output length (condense() reduces them to counts)."""
    return [str(Path(venv) / "bin" / "vllm"), "bench", "serve", "--backend", "vllm",
            "--base-url", f"http://{HOST}:{port}", "--endpoint", "/v1/completions",
            "--model", str(model_dir), "--served-model-name", name,
            "--tokenizer", str(model_dir), "--dataset-name", "random",
            "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
            "--num-prompts", str(num_prompts), "--request-rate", rate_text(rate),
            "--ignore-eos", "--seed", str(seed), "--temperature", "0",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--save-result", "--save-detailed", "--result-dir", str(result_file.parent),
            "--result-filename", result_file.name, "--disable-tqdm"]


# ---- processes -------------------------------------------------------------------------------

def _start_time(pid: int) -> str | None:
    """The process's start time (/proc/PID/stat field 22): with the pid, it names one process,
    so a pid reused after an exit is never killed by mistake."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def stop_tree(proc: subprocess.Popen | None, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM (a server then stops its own children: vLLM its engine core, `router launch` its
    router and workers), SIGKILL after `grace_s`; then SIGKILL whatever of its tree is left: the
    processes below it when it was asked to stop (re-parented once it exits), and its process
    group (every child here is started in a session of its own, so it leads that group)."""
    if proc is None:
        return
    below = {pid: _start_time(pid) for pid in descendants(proc.pid)} if proc.poll() is None \
        else {}
    if proc.poll() is None and grace_s > 0:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait(30)
    for pid, started in below.items():
        if started is not None and _start_time(pid) == started:
            _kill(lambda p=pid: os.kill(p, signal.SIGKILL))
    _kill(lambda: os.killpg(proc.pid, signal.SIGKILL))


def _kill(send: Callable[[], None]) -> None:
    try:
        send()
    except (ProcessLookupError, PermissionError):
        pass  # already gone (or a group only it led, also gone)


def log_tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


@dataclass
class Server:
    """One server process with its own log file and session; stopped with its whole tree."""

    system: str
    command: list[str]
    http_port: int
    log_path: Path
    env: dict[str, str] | None = None
    ready_marker: str | None = None  # a log line printed once every worker is up
    proc: subprocess.Popen | None = None

    def start(self) -> Server:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as log:
            # Its own session: Ctrl-C reaches this process only, which stops the server in
            # order; and the whole tree is one process group to kill at the end.
            self.proc = subprocess.Popen(self.command, cwd=ROOT, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        return self

    def stop(self) -> None:
        # A second Ctrl-C while it stops must not leave half of the tree running.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            stop_tree(self.proc)
        finally:
            signal.signal(signal.SIGINT, previous)

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ---- HTTP ------------------------------------------------------------------------------------

def get_json(port: int, path: str, timeout_s: float = 5.0) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        body = reply.read()
        return reply.status, json.loads(body) if reply.status == 200 else body.decode(
            errors="replace")
    finally:
        conn.close()


def served_models(server: Server) -> list[str] | None:
    """The model ids of GET /v1/models once the server is ready; None before."""
    if server.ready_marker and server.ready_marker not in log_tail(server.log_path, 1 << 20):
        return None
    try:
        status, body = get_json(server.http_port, "/v1/models")
    except (OSError, http.client.HTTPException, ValueError):
        return None  # not listening yet
    return [m["id"] for m in body["data"]] if status == 200 else None


def wait_ready(server: Server, name: str, timeout_s: float) -> float:
    """Seconds until the server lists `name` in /v1/models; raises if it exits first, lists
    another name, or is not ready within `timeout_s`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if server.proc is not None and server.proc.poll() is not None:
            raise RuntimeError(f"{server.system} exited with {server.proc.returncode} before it "
                               f"was ready; log {server.log_path}:\n{log_tail(server.log_path)}")
        models = served_models(server)
        if models is not None:
            if name not in models:
                raise RuntimeError(f"{server.system} serves {models}, not {name!r}: the client "
                                   "would send another body to it")
            return time.monotonic() - start
        time.sleep(1.0)
    raise TimeoutError(f"{server.system} was not ready within {timeout_s:.0f}s; log "
                       f"{server.log_path}:\n{log_tail(server.log_path)}")


def warm_up(port: int, name: str, timeout_s: float = WARMUP_TIMEOUT_S) -> None:
    """One streamed completion shaped like the client's (about 256 prompt tokens), not timed."""
    body = {"model": name, "prompt": "The benchmark starts after this warm-up request. " * 25,
            "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"Content-Type": "application/json"})
        reply = conn.getresponse()
        data = reply.read()
    finally:
        conn.close()
    if reply.status != 200 or b"data: [DONE]" not in data:
        raise RuntimeError(f"warm-up request failed: HTTP {reply.status}: {data[-1000:]!r}")


# ---- one client run --------------------------------------------------------------------------

def condense(result: dict[str, Any]) -> dict[str, Any]:
    """The client's result without its per-request lists: their summaries instead (distinct
    errors, output lengths other than OUTPUT_LEN, the range of prompt lengths, and how many
    stream chunks with choices a request got: the client takes each for a token arrival, so
    a chunk without a token adds a gap of its own to ITL)."""
    kept = {k: v for k, v in result.items() if k not in BULKY}
    outputs = result.get("output_lens") or []
    inputs = result.get("input_lens") or []
    chunks = [len(gaps) + 1 for gaps in result.get("itls") or [] if gaps]
    errors = sorted({e for e in result.get("errors") or [] if e})
    kept.update(output_len_mismatches=sum(n != OUTPUT_LEN for n in outputs),
                input_len_range=[min(inputs), max(inputs)] if inputs else None,
                chunks_per_request=statistics.median(chunks) if chunks else None,
                errors=[e[-2000:] for e in errors[:5]], distinct_errors=len(errors))
    return kept


def run_client(command: list[str], env: dict[str, str], result_file: Path,
               timeout_s: float) -> dict[str, Any]:
    log_path = result_file.with_suffix(".log")
    result_file.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        # Its own session too: stop_tree kills its process group, which it must lead.
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"the client ran past {timeout_s:.0f}s; log {log_path}") from None
        finally:
            stop_tree(proc, grace_s=0.0)  # nothing to wait for: it is done or abandoned
    if code != 0 or not result_file.is_file():
        raise RuntimeError(f"the client exited with {code}; log {log_path}:\n"
                           f"{log_tail(log_path)}")
    return condense(json.loads(result_file.read_text()))


@dataclass(frozen=True)
class Setup:
    model_dir: Path
    name: str  # what every server serves the model as, and the client sends
    work_dir: Path
    client_env: dict[str, str]


def load_once(server: Server, run: int, rate_index: int, args: argparse.Namespace,
              setup: Setup) -> dict[str, Any]:
    rate = args.rates[rate_index]
    seed = seed_for(run, rate_index, len(args.rates), args.seed_base)
    record: dict[str, Any] = {"run": run, "system": server.system, "rate": rate, "seed": seed,
                              "loadavg_start": loadavg_1m()}
    result_file = server.log_path.parent / f"rate-{rate_text(rate)}.json"
    command = client_command(server.http_port, setup.model_dir, setup.name, rate,
                             args.num_prompts, seed, result_file)
    start = time.monotonic()
    try:
        record["result"] = run_client(command, setup.client_env, result_file,
                                      args.client_timeout)
    except (RuntimeError, TimeoutError, OSError, ValueError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    record.update(wall_s=time.monotonic() - start, loadavg_end=loadavg_1m())
    _progress(record)
    return record


def _progress(record: dict[str, Any]) -> None:
    res = record.get("result")
    what = record.get("error", "").splitlines()[0] if res is None else (
        f"{res['request_throughput']:.2f} req/s, TTFT p50 {res['median_ttft_ms']:.1f} ms, "
        f"ITL p50 {res['median_itl_ms']:.1f} ms, failed {res['failed']}")
    print(f"[served_vs_vllm] run {record['run'] + 1} {record['system']} "
          f"{rate_text(record['rate'])} req/s (seed {record['seed']}): {what}",
          file=sys.stderr, flush=True)


# ---- the whole measurement -------------------------------------------------------------------

def make_server(system: str, run: int, dtype: str, setup: Setup) -> Server:
    from launch.cluster import free_port

    http_port = free_port(HOST)
    folder = setup.work_dir / f"run{run + 1}-{system}"
    if system == "vllm":
        rpc = folder / "rpc"  # vLLM's ZMQ sockets: here, not left behind in /tmp
        rpc.mkdir(parents=True, exist_ok=True)
        return Server(system, vllm_command(setup.model_dir, setup.name, http_port, dtype),
                      http_port, folder / "server.log", env=vllm_env(rpc_dir=rpc))
    return Server(system, ours_command(system, free_port(HOST), http_port, dtype,
                                       folder / "cluster"),
                  http_port, folder / "server.log", ready_marker="cluster ready:")


def serve_and_load(system: str, run: int, args: argparse.Namespace,
                   setup: Setup) -> list[dict[str, Any]]:
    """Start `system` once, warm it up, load it at every rate; stopped on every path. A server
    that fails to start or warm up gets an error record for each rate it did not run."""
    records: list[dict[str, Any]] = []
    server = make_server(system, run, args.dtype, setup)
    print(f"[served_vs_vllm] run {run + 1}: starting {system}: {shlex.join(server.command)}",
          file=sys.stderr, flush=True)
    try:
        with server:
            ready_s = wait_ready(server, setup.name, READY_TIMEOUT_S[system])
            warm_up(server.http_port, setup.name)
            for i in range(len(args.rates)):
                records.append(load_once(server, run, i, args, setup))
                records[-1]["ready_s"] = ready_s
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"[served_vs_vllm] {system}: {exc}", file=sys.stderr, flush=True)
        done = {r["rate"] for r in records}
        records += [{"run": run, "system": system, "rate": rate,
                     "seed": seed_for(run, i, len(args.rates), args.seed_base),
                     "error": f"{type(exc).__name__}: {exc}"}
                    for i, rate in enumerate(args.rates) if rate not in done]
    return records


def measure(args: argparse.Namespace, setup: Setup, records: list[dict[str, Any]]) -> None:
    """Every run, each system in its turn; `records` fills as it goes (kept on Ctrl-C)."""
    for run, order in enumerate(run_order(args.systems, args.runs)):
        for system in order:
            records.extend(serve_and_load(system, run, args, setup))


def _run_text(command: list[str], env: dict[str, str] | None = None) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env,
                              check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine(setup: Setup) -> dict[str, Any]:
    from importlib import metadata

    peer = _run_text([str(vllm_python()), "-I", "-c", "import importlib.metadata as m; "
                      "print(m.version('vllm-cpu'), m.version('torch'))"], setup.client_env)
    vllm_version, _, vllm_torch = peer.partition(" ")
    env = vllm_env()
    return {"cpu": cpu_description(_run_text(["lscpu"])), "cores": len(os.sched_getaffinity(0)),
            "versions": f"ours: torch {metadata.version('torch')}; vLLM: vllm-cpu "
                        f"{vllm_version or '?'} with torch {vllm_torch or '?'}",
            "model": setup.name, "model_dir": str(setup.model_dir),
            "date": time.strftime("%Y-%m-%d"), "omp_bind": env["VLLM_CPU_OMP_THREADS_BIND"],
            "kv_gib": env["VLLM_CPU_KVCACHE_SPACE"], "work_dir": str(setup.work_dir)}


def prepare(args: argparse.Namespace) -> Setup:
    from engine.loader import resolve_model_path

    vllm_python()  # raises VllmNotInstalled, naming the setup script, before anything starts
    model_dir = resolve_model_path("default")
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="served_vs_vllm-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    # The router serves the model under its folder's name (router.server.Router); vLLM is
    # given the same name, and wait_ready checks that each server lists it.
    return Setup(model_dir, model_dir.name, work_dir, vllm_env())


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt  # SIGTERM: the same orderly stop as Ctrl-C


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = ".venv/bin/python -m benchmarks.served_vs_vllm " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    setup = prepare(args)
    meta = machine(setup)
    print(f"[served_vs_vllm] logs and client results in {setup.work_dir}", file=sys.stderr)
    records: list[dict[str, Any]] = []
    interrupted = False
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        measure(args, setup, records)
    except KeyboardInterrupt:
        interrupted = True
        print("[served_vs_vllm] interrupted (every server stopped): partial results",
              file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if args.json:
            write_json(args.json, {"command": command, "meta": meta, "args": vars(args),
                                   "records": records})
    body = section(records, args, meta, command)
    print("\n".join(body))
    if args.write and not interrupted:
        path = ROOT / "BENCHMARKS.md"
        path.write_text(replace_marked(path.read_text(), body, TITLE, START, END))
    return 130 if interrupted else 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())
