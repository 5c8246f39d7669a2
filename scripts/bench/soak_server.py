"""Soak the server on loopback: many clients at once, mixing valid streaming and whole requests with abandoned
streams, garbage bodies, oversized bodies and bad headers, for a bounded time.

Passes when every valid request gets the same greedy text a quiet server gave it, every bad one gets the status it
should, the server's RSS stays within a bound, and the server ends healthy (a last request served, SIGTERM exits 0,
no traceback in its log). Writes a summary JSON; exit 1 on any failure.

Usage: python scripts/bench/soak_server.py --seconds 60 --clients 32 --out docs/results/archive/soak/soak_60s.json
       (CI runs it for a few seconds: tests/scripts/test_soak_server.py)
"""

import argparse
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:\n    def __init__(self):\n", "for i in range(10):\n",
           "def fibonacci(n):\n", "# read a file\nwith open("]
MAX_TOKENS = 12
MODEL = "lattice-demo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class Client:
    def __init__(self, port: int, timeout: float):
        self.port, self.timeout = port, timeout

    def request(self, body: dict, stream: bool = False, headers: dict | None = None) -> tuple[int, str, dict]:
        """(status, text or error message, response headers) of one completion request; retries 503s for up to
        five minutes."""
        give_up = time.monotonic() + 300
        while time.monotonic() < give_up:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            conn.request("POST", "/v1/completions", body=json.dumps({**body, "stream": stream}).encode(),
                         headers={"Content-Type": "application/json", **(headers or {})})
            r = conn.getresponse()
            if r.status == 503:
                r.read()
                conn.close()
                time.sleep(min(1.0, float(r.getheader("Retry-After") or 1)))
                continue
            if r.status != 200 or not stream:
                obj = json.loads(r.read() or b"{}")
                conn.close()
                if r.status != 200:
                    return r.status, obj.get("error", {}).get("message", ""), dict(r.getheaders())
                return 200, obj["choices"][0]["text"], dict(r.getheaders())
            parts = []
            for line in r:
                line = line.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    conn.close()
                    return 500, obj["error"]["message"], {}
                parts.append(obj["choices"][0]["text"])
            conn.close()
            return 200, "".join(parts), dict(r.getheaders())
        return 503, "still busy after five minutes", {}

    def raw(self, head: str, body: bytes = b"") -> int:
        """Sends these header lines and body as they are; the response's status (0 if the connection dropped)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout) as s:
            s.sendall(head.encode() + b"\r\n\r\n" + body)
            r = http.client.HTTPResponse(s)
            try:
                r.begin()
                r.read()
            except (OSError, http.client.HTTPException):
                return 0
            return r.status

    def abandon(self, stream: bool, after: float) -> None:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=self.timeout)
        body = json.dumps({"model": MODEL, "prompt": random.choice(PROMPTS), "max_tokens": 400, "stream": stream,
                           "temperature": 0}).encode()
        s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                  f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(after)
        s.close()


def bad_requests(port: int) -> list[tuple[str, str, bytes, set[int]]]:
    """(kind, header lines, body, statuses that are right) for each bad request the soak sends."""
    host = f"Host: 127.0.0.1:{port}"
    post = f"POST /v1/completions HTTP/1.1\r\n{host}\r\n"
    ok = b'{"prompt": "x", "max_tokens": 1}'
    return [
        ("garbage_body", post + "Content-Type: application/json\r\nContent-Length: 64", None, {400}),
        ("oversized_body", post + "Content-Type: application/json\r\nContent-Length: 2000000", b"", {413}),
        ("negative_length", post + "Content-Type: application/json\r\nContent-Length: -1", ok, {400}),
        ("text_length", post + "Content-Type: application/json\r\nContent-Length: many", ok, {400}),
        ("missing_length", post + "Content-Type: application/json", b"", {411}),
        ("text_plain", post + f"Content-Type: text/plain\r\nContent-Length: {len(ok)}", ok, {415}),
        ("cross_site", post + f"Origin: http://evil.example\r\nContent-Type: application/json\r\n"
                              f"Content-Length: {len(ok)}", ok, {403}),
        ("rebound_host", "POST /v1/completions HTTP/1.1\r\nHost: evil.example\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(ok)}", ok, {403}),
        ("bad_field", post + "Content-Type: application/json\r\nContent-Length: 28", b'{"prompt": "x", "seed": -1} ', {400}),
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--model", help="checkpoint (default: the embedded demo)")
    p.add_argument("--rss-growth-mb", type=float, default=400, help="the bound on RSS growth over the quiet phase")
    p.add_argument("--out", help="summary JSON")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="",
                   help="more flags for the server, one string (e.g. --server-args=--no-warmup)")
    args = p.parse_args()
    random.seed(args.seed)
    port = free_port()
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    # a queue as deep as the clients: every valid request waits its turn (503 past the queue is a test of its own)
    cmd = [sys.executable, "-m", "lattice_mlx.server", "--port", str(port), "--max-queue", str(max(16, args.clients)),
           "--request-timeout", "30", "--io-timeout", "5"] + (["--model", args.model] if args.model else []) + \
        args.server_args.split()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    summary: dict = {"command": " ".join(["python", "scripts/bench/soak_server.py", *sys.argv[1:]]),
                     "server": " ".join(cmd[1:]), "seconds": args.seconds, "clients": args.clients}
    failures: list[str] = []
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                print(f"the server did not start: {log.read_text()[-2000:]}", file=sys.stderr)
                return 1
            time.sleep(0.3)
        client = Client(port, timeout=60)
        quiet = {}
        for prompt in PROMPTS:  # the quiet server's greedy texts, the soak's reference
            status, text, _ = client.request({"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                              "temperature": 0})
            if status != 200:
                print(f"quiet request failed: {status} {text}", file=sys.stderr)
                return 1
            quiet[prompt] = text
        baseline = rss_mb(proc.pid)
        rss = [baseline]
        stop = threading.Event()

        def sample_rss():
            while not stop.wait(0.5):
                rss.append(rss_mb(proc.pid))

        counts: dict[str, int] = {}
        latencies: list[float] = []
        lock = threading.Lock()
        bad = bad_requests(port)
        end = time.monotonic() + args.seconds

        def note(kind: str, ok: bool, detail: str = "") -> None:
            with lock:
                counts[kind] = counts.get(kind, 0) + 1
                if not ok:
                    failures.append(f"{kind}: {detail}"[:300])

        def worker(i: int) -> None:
            rng = random.Random(args.seed * 1000 + i)
            c = Client(port, timeout=60)
            while time.monotonic() < end:
                r, action = rng.random(), "valid"
                try:
                    if r < 0.55:  # valid, whole or streamed
                        prompt, stream = rng.choice(PROMPTS), rng.random() < 0.5
                        tic = time.monotonic()
                        status, text, _ = c.request({"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                     "temperature": 0}, stream=stream)
                        with lock:
                            latencies.append(time.monotonic() - tic)
                        note("valid_stream" if stream else "valid_whole", status == 200 and text == quiet[prompt],
                             f"{status} {text!r} != {quiet[prompt]!r}")
                    elif r < 0.70:
                        stream, action = rng.random() < 0.6, "abandon"
                        c.abandon(stream, after=rng.uniform(0.05, 0.5))
                        note("abandoned_stream" if stream else "abandoned_whole", True)
                    else:
                        kind, head, body, want = rng.choice(bad)
                        action = kind
                        if body is None:
                            body = bytes(rng.randrange(256) for _ in range(64))
                        status = c.raw(head, body)
                        note(kind, status in want or (kind == "oversized_body" and status == 0),
                             f"status {status}, want {sorted(want)}")
                except (OSError, http.client.HTTPException) as e:
                    note("connection_error", False, f"{action}: {e!r}")

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(args.clients)]
        tic = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=args.seconds + 300)
        summary["wall_s"] = round(time.monotonic() - tic, 1)
        stop.set()
        status, text, _ = client.request({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                          "temperature": 0})
        healthy = status == 200 and text == quiet[PROMPTS[0]]
        if not healthy:
            failures.append(f"after the soak: {status} {text!r}")
        rss.append(rss_mb(proc.pid))
        grown = max(rss) - baseline
        if grown > args.rss_growth_mb:
            failures.append(f"RSS grew {grown:.0f} MB (bound {args.rss_growth_mb:.0f})")
        summary.update(counts=dict(sorted(counts.items())), requests=sum(counts.values()),
                       valid_latency_s={"p50": round(statistics.median(latencies), 3) if latencies else None,
                                        "p99": round(sorted(latencies)[int(0.99 * (len(latencies) - 1))], 3)
                                        if latencies else None},
                       rss_mb={"baseline": round(baseline), "max": round(max(rss)), "end": round(rss[-1]),
                               "bound_growth": args.rss_growth_mb})
    finally:
        if proc.poll() is None:
            tic = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = "killed"
            summary["sigterm"] = {"rc": rc, "seconds": round(time.monotonic() - tic, 2)}
            if rc != 0:
                failures.append(f"SIGTERM: exit {rc}")
        text = log.read_text()
        if "Traceback" in text:
            failures.append("a traceback in the server's log")
    from lattice_mlx.bench.report import provenance

    summary.update(failures=failures[:20], failure_count=len(failures), passed=not failures, **provenance())
    line = json.dumps(summary, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(line + "\n")
    print(line)
    return 0 if not failures else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
