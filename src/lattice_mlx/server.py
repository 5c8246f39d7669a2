"""An OpenAI-compatible HTTP server: `python -m lattice_mlx.server [--model PATH] [--port 8080]`.

Endpoints: POST /v1/chat/completions and /v1/completions (streamed over server-sent events with "stream": true),
GET /v1/models and /health. Requests are served one at a time in arrival order (one generation worker, a queue);
a client that disconnects from a stream cancels its generation. MTP speculation is on (adaptive) when the
checkpoint has a head, and its statistics come back in `usage.speculation`. A prompt that extends the previous
request's (the next turn of a chat) prefills only its new tokens (`usage.prompt_tokens_details.cached_tokens`). The standard library's HTTP server is
enough for one model and one generation at a time (docs/adr/0005-server.md).
"""

import json
import logging
import queue
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import mlx.core as mx

from .cli import ArgumentParser
from .decode import generate_step
from .generate import chat_ids, stream_generate
from .load import LoadError, load
from .prompt_cache import PromptCache
from .sample import Sampler
from .speculative import SpecOptions, SpecStats, speculate

log = logging.getLogger("lattice_mlx.server")
DEFAULT_MAX_TOKENS = 512


class BadRequest(ValueError):
    """A request the server refuses with HTTP 400 (its message goes back to the client)."""


@dataclass
class Job:
    """One request's generation: what to generate, and the events the worker sends back."""

    ids: list[int]
    max_tokens: int
    sampler: Sampler
    stop: list[str]
    seed: int | None
    events: queue.Queue = field(default_factory=queue.Queue)  # ("text", str) ..., then ("done", dict) or ("error", str)
    cancelled: threading.Event = field(default_factory=threading.Event)


def _number(body: dict, name: str, default, kind=float):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise BadRequest(f"'{name}' must be a number, got {v!r}")
    return kind(v)


def parse_sampling(body: dict, default_max_tokens: int) -> tuple[int, Sampler, list[str], int | None]:
    """max_tokens, sampler, stop strings and seed from an OpenAI request body (BadRequest for bad values)."""
    if body.get("n", 1) != 1:
        raise BadRequest("only n = 1 is supported")
    max_tokens = _number(body, "max_completion_tokens", None, int) or _number(body, "max_tokens", default_max_tokens,
                                                                              int)
    if max_tokens < 1:
        raise BadRequest(f"'max_tokens' must be >= 1, got {max_tokens}")
    try:
        sampler = Sampler(temp=_number(body, "temperature", 0.0), top_p=_number(body, "top_p", 1.0),
                          top_k=_number(body, "top_k", 0, int), min_p=_number(body, "min_p", 0.0))
    except ValueError as e:
        raise BadRequest(str(e).replace(" (--temp)", "").replace("temp ", "temperature ")) from None
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest("'stop' must be a non-empty string or a list of them")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"'seed' must be an integer, got {seed!r}")
    return max_tokens, sampler, stop, seed


def request_ids(tokenizer, messages) -> list[int]:
    """generate.chat_ids, its refusals as 400s."""
    try:
        return chat_ids(tokenizer, messages)
    except ValueError as e:
        raise BadRequest(str(e)) from None


def completion_ids(tokenizer, prompt, vocab_size: int) -> list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise BadRequest(f"'prompt' token ids must be in [0, {vocab_size})")
        return prompt
    raise BadRequest("'prompt' must be a non-empty string or a list of token ids")


class StopScanner:
    """Cuts generated text at the first stop string; holds back a tail that could still become one."""

    def __init__(self, stop: list[str]):
        self.stop, self.text, self.sent = stop, "", 0
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, piece: str) -> tuple[str, bool]:
        """The text that may be sent now, and whether a stop string was found."""
        self.text += piece
        hits = [i for i in (self.text.find(s, max(0, self.sent - self.hold)) for s in self.stop) if i >= 0]
        if hits:
            out, self.sent = self.text[self.sent : min(hits)], min(hits)
            return out, True
        upto = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : upto], upto
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


class Engine:
    """The model and its one generation worker: jobs run in arrival order."""

    def __init__(self, model, tokenizer, model_id: str, speculation: SpecOptions | None, max_tokens: int):
        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.speculation, self.max_tokens = speculation, max_tokens
        self.prompt_cache: PromptCache | None = None  # the state after the last request's prompt (all but its last token)
        self.jobs: queue.Queue = queue.Queue()
        self.stopping = threading.Event()

    def submit(self, job: Job) -> Job:
        self.jobs.put(job)
        return job

    def run(self) -> None:
        """The generation loop, on the thread that loaded the model (MLX is used from that thread only), until
        `stopping` is set; the job in progress finishes first."""
        while not self.stopping.is_set():
            try:
                job = self.jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            if job.cancelled.is_set():
                continue
            try:
                self._generate(job)
            except Exception as e:  # one request's failure is reported to it; the server goes on
                log.exception("generation failed")
                job.events.put(("error", f"generation failed: {e}"))
        while not self.jobs.empty():  # requests still waiting get an answer, not a hang
            self.jobs.get().events.put(("error", "the server is shutting down"))

    def _generate(self, job: Job) -> None:
        if job.seed is not None:
            mx.random.seed(job.seed)
        s = job.sampler
        scan, n, finish, last, cut = StopScanner(job.stop), 0, "length", None, False
        # A prompt that extends the previous one (the next turn of a chat) prefills only its new tokens: the state
        # after all but its last token is built from the previous request's, and kept for the next request.
        cached, pc = 0, None
        if len(job.ids) > 1:
            prev = self.prompt_cache
            if prev is not None and prev.tokens == job.ids[:-1]:
                pc, cached = prev, len(prev.tokens)
            else:
                cached = prev.covers(job.ids[:-1]) if prev is not None else 0
                pc = PromptCache.build(self.model, job.ids[:-1], base=prev)
            self.prompt_cache = pc
        stream = stream_generate(self.model, self.tokenizer, job.ids, max_tokens=job.max_tokens, temp=s.temp,
                                 top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, chat_template=False,
                                 speculation=self.speculation, prompt_cache=pc)
        tic = time.perf_counter()
        try:
            for last in stream:
                n += 1
                if job.cancelled.is_set():
                    log.info("request cancelled by its client after %d tokens", n)
                    return
                text, hit = scan.add(last.text)
                if text:
                    job.events.put(("text", text))
                if hit:
                    finish, cut = "stop", True
                    break
                if last.finish_reason:
                    finish = last.finish_reason
                    break
        finally:
            stream.close()
        tail = "" if cut else scan.flush()  # text after a stop string is dropped; a held-back tail is not
        if tail:
            job.events.put(("text", tail))
        usage = {"prompt_tokens": len(job.ids), "completion_tokens": n, "total_tokens": len(job.ids) + n,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        if last is not None and last.spec_stats is not None:  # (a stop string ends a generation early too)
            usage["speculation"] = last.spec_stats.to_dict()
        log.info("request done: %d prompt tokens (%d from the prompt cache) + %d generated in %.2f s (%s)",
                 len(job.ids), cached, n, time.perf_counter() - tic, finish)
        job.events.put(("done", {"finish_reason": finish, "usage": usage}))


def make_handler(engine: Engine):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            log.debug("%s %s", self.address_string(), fmt % args)

        def _json(self, code: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, code: int, message: str, kind: str = "invalid_request_error") -> None:
            self._json(code, {"error": {"message": message, "type": kind, "code": code}})

        def do_GET(self):
            if self.path in ("/v1/models", "/models"):
                self._json(200, {"object": "list", "data": [
                    {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "lattice_mlx"}]})
            elif self.path == "/health":
                self._json(200, {"status": "ok"})
            else:
                self._error(404, f"no such endpoint: GET {self.path}", "not_found_error")

        def do_POST(self):
            chat = self.path in ("/v1/chat/completions", "/chat/completions")
            if not chat and self.path not in ("/v1/completions", "/completions"):
                self._error(404, f"no such endpoint: POST {self.path}", "not_found_error")
                return
            try:
                size = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(size) or b"null")
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise BadRequest(f"the body is not valid JSON: {e}") from None
                if not isinstance(body, dict):
                    raise BadRequest("the body must be a JSON object")
                ids = request_ids(engine.tokenizer, body.get("messages")) if chat else \
                    completion_ids(engine.tokenizer, body.get("prompt"), engine.model.args.vocab_size)
                max_tokens, sampler, stop, seed = parse_sampling(body, engine.max_tokens)
                stream = body.get("stream", False)
                if not isinstance(stream, bool):
                    raise BadRequest("'stream' must be true or false")
                usage_chunk = bool((body.get("stream_options") or {}).get("include_usage"))
            except BadRequest as e:
                self._error(400, str(e))
                return
            job = engine.submit(Job(ids, max_tokens, sampler, stop, seed))
            ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            if stream:
                self._stream(job, chat, ident, usage_chunk)
            else:
                self._whole(job, chat, ident)

        def _whole(self, job: Job, chat: bool, ident: str) -> None:
            parts = []
            while True:
                kind, value = job.events.get()
                if kind == "text":
                    parts.append(value)
                elif kind == "error":
                    self._error(500, value, "server_error")
                    return
                else:
                    break
            text = "".join(parts)
            choice = {"index": 0, "finish_reason": value["finish_reason"], "logprobs": None}
            choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
            self._json(200, {"id": ident, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": engine.model_id, "choices": [choice],
                             "usage": value["usage"]})

        def _stream(self, job: Job, chat: bool, ident: str, usage_chunk: bool) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            obj, created = ("chat.completion.chunk" if chat else "text_completion"), int(time.time())

            def chunk(delta: str | None, finish: str | None, role: bool = False) -> dict:
                if chat:
                    d = {"role": "assistant", "content": ""} if role else ({"content": delta} if delta else {})
                    choice = {"index": 0, "delta": d, "finish_reason": finish, "logprobs": None}
                else:
                    choice = {"index": 0, "text": delta or "", "finish_reason": finish, "logprobs": None}
                return {"id": ident, "object": obj, "created": created, "model": engine.model_id, "choices": [choice]}

            def send(payload) -> None:
                data = payload if isinstance(payload, str) else json.dumps(payload)
                self.wfile.write(f"data: {data}\n\n".encode())
                self.wfile.flush()

            try:
                if chat:
                    send(chunk(None, None, role=True))
                while True:
                    kind, value = job.events.get()
                    if kind == "text":
                        send(chunk(value, None))
                    elif kind == "error":
                        send({"error": {"message": value, "type": "server_error"}})
                        break
                    else:
                        send(chunk(None, value["finish_reason"]))
                        if usage_chunk:
                            send({"id": ident, "object": obj, "created": created, "model": engine.model_id,
                                  "choices": [], "usage": value["usage"]})
                        break
                send("[DONE]")
            except (BrokenPipeError, ConnectionResetError):
                job.cancelled.set()  # the client left: its generation stops at the next token

    return Handler


def warm_up(model, speculation: SpecOptions | None) -> None:
    """A few tokens plain and with every draft depth 1..K the adaptive loop may pick, greedy and sampled, before the
    first request (a 16-token prompt: other prompt lengths still pay their own first call). A new verify depth's first
    generation compiles kernels for seconds on a GPU (docs/results/code_measurements.md, 'First use'), which would
    otherwise land on whichever request first uses that depth. Plain steps and pipelined rounds are traced once per sampler structure (decode.TracedSteps, rounds.py):
    greedy, and sampled without top-k / top-p / min-p (a request's temperature is an input of that trace)."""
    tic = time.perf_counter()
    ids = [(7 * i + 3) % model.args.vocab_size for i in range(16)]
    depths = range(1, speculation.draft_tokens + 1) if speculation is not None else []
    for sampler in (Sampler(), Sampler(temp=1.0)):
        for k in [None, *depths]:
            if k is None:
                steps = generate_step(model, mx.array(ids), sampler=sampler)
            else:
                options = SpecOptions(draft_tokens=k, adaptive=False)
                steps = speculate(model, mx.array(ids), sampler=sampler, options=options,
                                         stats=SpecStats.of(options))
            for _ in zip(range(2 * (k or 1) + 2), steps):
                pass
            steps.close()
    log.info("warmed up in %.1f s: decode%s, greedy and sampled", time.perf_counter() - tic,
             f" and verify shapes for K = 1..{speculation.draft_tokens}" if speculation else "")


def setup_arg_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m lattice_mlx.server", description="Serve a Qwen3.5 model over an "
                       "OpenAI-compatible HTTP API.")
    p.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: the embedded demo model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's own dtype")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="when a request gives none")
    p.add_argument("--no-mtp", action="store_true", help="plain decoding even when the checkpoint has an MTP head")
    p.add_argument("--draft-tokens", type=int, default=SpecOptions().draft_tokens,
                   help="MTP draft depth K (the largest, adaptive)")
    p.add_argument("--no-warmup", action="store_true", help="serve at once: skip the start-up generations that "
                   "compile the decode and verify shapes (otherwise the first request pays for them)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        if args.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
        model, tokenizer = load(args.model, dtype=args.dtype)
        speculation = SpecOptions(draft_tokens=args.draft_tokens) if model.has_mtp and not args.no_mtp else None
        httpd = ThreadingHTTPServer((args.host, args.port), None)
    except (LoadError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not args.no_warmup:
        try:
            warm_up(model, speculation)
        except KeyboardInterrupt:
            print("error: interrupted while warming up", file=sys.stderr)
            httpd.server_close()
            return 130
        except (RuntimeError, ValueError) as e:  # e.g. out of memory at the first forward
            print(f"error: warming up failed: {e}", file=sys.stderr)
            httpd.server_close()
            return 1
    engine = Engine(model, tokenizer, args.model or "lattice-demo", speculation, args.max_tokens)
    httpd.RequestHandlerClass = make_handler(engine)
    httpd.daemon_threads = True

    def stop(signum, frame):  # graceful: the job in progress finishes, then no more are taken; exit 0
        engine.stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    host, port = httpd.server_address[:2]
    log.info("serving %s on http://%s:%d/v1 (MTP %s)", engine.model_id, host, port,
             f"on, K up to {args.draft_tokens}, adaptive" if speculation else "off")
    # HTTP on a thread of its own; generation on this one, where the model was loaded
    http_thread = threading.Thread(target=httpd.serve_forever, name="http", daemon=True)
    http_thread.start()
    try:
        engine.run()
    finally:
        httpd.shutdown()
        httpd.server_close()
        log.info("shut down")
    return 0


if __name__ == "__main__":
    sys.exit(main())
