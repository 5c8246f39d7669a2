"""Server overhead per token: the same greedy generation through `generate` in this process and through the
OpenAI-compatible server (another process, non-streaming and streaming), legs interleaved.

    python scripts/bench/bench_server.py --out docs/results/archive/server_cpu.json [--model M] [--tokens 128] [--reps 10]
"""

import argparse
import http.client
import json
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time

from lattice_mlx import generate, load
from lattice_mlx.speculative import SpecOptions

PROMPT = "def fibonacci(n):\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, body: dict) -> tuple[float, dict | None]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    tic = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    dt = time.perf_counter() - tic
    return dt, (json.loads(data) if not body.get("stream") else None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "lattice_mlx.server", "--port", str(port), "--log-level", "WARNING"]
    server = subprocess.Popen(cmd + (["--model", args.model] if args.model else []))
    model, tok = load(args.model)
    spec = SpecOptions() if model.has_mtp else None
    while True:
        try:
            post(port, {"prompt": PROMPT, "max_tokens": 4})
            break
        except OSError:
            time.sleep(0.5)
    body = {"prompt": PROMPT, "max_tokens": args.tokens, "temperature": 0, "stop": None}
    generate(model, tok, PROMPT, max_tokens=args.tokens, speculation=spec)  # warm-up
    post(port, body)
    legs = {"api": [], "server": [], "server_stream": []}
    for _ in range(args.reps):
        tic = time.perf_counter()
        r = generate(model, tok, PROMPT, max_tokens=args.tokens, speculation=spec)
        legs["api"].append(time.perf_counter() - tic)
        dt, obj = post(port, body)
        assert obj["choices"][0]["text"] == r.text, "the server's text differs from generate's"
        legs["server"].append(dt)
        legs["server_stream"].append(post(port, {**body, "stream": True})[0])
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=60)
    n = args.tokens
    out = {"command": " ".join(sys.argv), "machine": platform.machine(), "model": args.model or "demo",
           "tokens": n, "reps": args.reps, "mtp": spec is not None,
           "ms_per_token_median": {k: 1000 * statistics.median(v) / n for k, v in legs.items()},
           "overhead_ms_per_token_median": {k: 1000 * statistics.median([a - b for a, b in zip(v, legs["api"])]) / n
                                            for k, v in legs.items() if k != "api"},
           "runs_s": legs}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: out[k] for k in ("ms_per_token_median", "overhead_ms_per_token_median")}))


if __name__ == "__main__":
    main()
