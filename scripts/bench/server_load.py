"""Time to first token and throughput under load: Poisson arrivals of streaming requests at a given rate against the
OpenAI-compatible server, one server process per setting of --max-batch (1: one request at a time; N: continuous
batching), the same arrival times and prompts for each.

Usage: python scripts/bench/server_load.py --rate 4 --seconds 30 --max-batch 1,16 [--model M] [--tokens 64]
         [--server-args "--dtype bfloat16"] --out FILE.json
Per setting: TTFT (request sent -> first streamed text) p50 / p90 / p99, whole-request latency p50 / p99, completed
requests and aggregate generated tokens per second over the run.
"""

import argparse
import http.client
import json
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def __init__(self):\n", "for i in range(10):\n",
           "def fibonacci(n):\n", "# read a file\nwith open("]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, max_batch: int) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "lattice_mlx.server", "--port", str(port), "--max-batch", str(max_batch),
           "--max-queue", "1024", *([] if args.model is None else ["--model", args.model]),
           *shlex.split(args.server_args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + args.start_timeout
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port
        except OSError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError("the server did not start")


def one_request(port: int, prompt: str, tokens: int, sent: float, out: list) -> None:
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}})
    first, n = None, 0
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        for line in r:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and event.get("choices") and event["choices"][0].get("text"):
                first = time.perf_counter()
            if event.get("usage"):
                n = event["usage"]["completion_tokens"]
        out.append({"ttft": (first or time.perf_counter()) - sent, "latency": time.perf_counter() - sent,
                    "tokens": n, "status": r.status})
    except OSError as e:
        out.append({"error": str(e)})


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def drive(port: int, arrivals: list[float], prompts: list[str], tokens: int) -> dict:
    out, threads, t0 = [], [], time.perf_counter()
    for at, prompt in zip(arrivals, prompts):
        time.sleep(max(0.0, t0 + at - time.perf_counter()))
        t = threading.Thread(target=one_request, args=(port, prompt, tokens, time.perf_counter(), out))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in out if "error" not in r and r["status"] == 200]
    ttft, lat = [r["ttft"] for r in ok], [r["latency"] for r in ok]
    return {"requests": len(arrivals), "completed": len(ok), "errors": len(out) - len(ok), "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_s": {"p50": quantile(ttft, 0.5), "p90": quantile(ttft, 0.9), "p99": quantile(ttft, 0.99),
                       "mean": statistics.fmean(ttft) if ttft else float("nan")},
            "latency_s": {"p50": quantile(lat, 0.5), "p99": quantile(lat, 0.99)}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model")
    p.add_argument("--rate", type=float, default=4.0, help="requests per second (Poisson)")
    p.add_argument("--seconds", type=float, default=30.0, help="arrivals over this long")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--max-batch", default="1,16")
    p.add_argument("--server-args", default="")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rng = random.Random(args.seed)
    arrivals, t = [], rng.expovariate(args.rate)
    while t < args.seconds:
        arrivals.append(t)
        t += rng.expovariate(args.rate)
    prompts = [rng.choice(PROMPTS) for _ in arrivals]
    result = {"argv": sys.argv, "rate": args.rate, "seconds": args.seconds, "tokens": args.tokens, "settings": {}}
    for mb in map(int, args.max_batch.split(",")):
        proc, port = start(args, mb)
        try:
            drive(port, [0.0], prompts[:1], 4)  # one request first: what a first request compiles stays out
            result["settings"][mb] = r = drive(port, arrivals, prompts, args.tokens)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
        print(f"--max-batch {mb}: {r['completed']}/{r['requests']} requests, TTFT p50 {r['ttft_s']['p50']:.3f} s "
              f"p99 {r['ttft_s']['p99']:.3f} s, latency p50 {r['latency_s']['p50']:.2f} s, "
              f"{r['tokens_per_s']:.0f} tok/s", flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
