"""HTTP for the server, strict the way a process strangers' clients talk to must be: a Host and an Origin this server
answers to (a web page the user opens cannot drive it, and DNS rebinding fails), a JSON body of declared, bounded
length, every refusal a 4xx with one line, socket reads and writes with a timeout, and a client that leaves (streaming
or not) cancels its job."""

import ipaddress
import json
import logging
import queue
import select
import socket
import sys
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from .engine import Engine, Job
from .protocol import BadRequest, HTTPError, Limits, parse_json, parse_request

log = logging.getLogger("lattice_mlx.server")
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})


def split_host(value: str) -> tuple[str, int | None] | None:
    """'name', 'name:port', '[v6]' or '[v6]:port' -> (lower-case name, port or None); None if malformed."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[1:end], value[end + 1 :]
        if rest and not rest.startswith(":"):
            return None
        port = rest[1:] if rest else None
    else:
        name, _, port = value.partition(":")
        port = port if ":" in value else None
    if not name or (port is not None and not (port.isascii() and port.isdigit())):
        return None
    return name.lower(), int(port) if port is not None else None


def is_loopback(name: str) -> bool:
    if name in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


@dataclass
class Site:
    """Which Host and Origin headers the server answers to.

    Host: the bound address (the loopback names 127.0.0.1, localhost and [::1] count as one), with the bound port,
    or a name in `hosts` ("*": any). A server bound to every interface knows no name of its own: loopback, or `hosts`.
    Origin: absent (not a browser), a loopback origin on the bound port, or one in `origins` ("*": any)."""

    address: str
    port: int
    hosts: set[str] = field(default_factory=set)
    origins: set[str] = field(default_factory=set)

    def host_ok(self, value: str | None) -> bool:
        if "*" in self.hosts:
            return True
        if value is None:
            return False
        parsed = split_host(value)
        if parsed is None:
            return False
        name, port = parsed
        if name in {h.lower() for h in self.hosts}:
            return True
        if (port if port is not None else 80) != self.port:
            return False
        bound = self.address.lower().strip("[]")
        return (is_loopback(name) and (is_loopback(bound) or bound in ("0.0.0.0", "::", ""))) or name == bound

    def origin_ok(self, value: str) -> bool:
        if "*" in self.origins or value in self.origins:
            return True
        try:
            url = urlsplit(value)
            port = url.port or {"http": 80, "https": 443}.get(url.scheme)
        except ValueError:
            return False
        return url.scheme in ("http", "https") and is_loopback((url.hostname or "").lower()) and port == self.port


class Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128  # connections waiting to be accepted (socketserver's 5 reset clients arriving together)

    def handle_error(self, request, client_address):
        """A client that leaves or stalls is routine: one debug line, not a traceback on the server's log."""
        err = sys.exc_info()[1]
        if isinstance(err, (ConnectionError, TimeoutError, OSError)):
            log.debug("%s: connection ended: %s", client_address[0], err)
        else:
            log.exception("request from %s failed", client_address[0])


def make_handler(engine: Engine, site: Site, limits: Limits, sampling_defaults: dict, max_body: int,
                 io_timeout: float):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = io_timeout  # every socket read and write (a client that never reads cannot hold its thread)
        server_version = "lattice_mlx"
        _looked = 0.0  # when _next last looked whether the client is still there
        _body_read = False  # whether this request's body has been read (a refusal before it closes the connection)

        def log_message(self, fmt, *args):
            log.debug("%s %s", self.address_string(), fmt % args)

        # --- answers ------------------------------------------------------------------------------------------

        def _cors(self) -> None:
            origin = self.headers.get("Origin") if self.headers else None
            if origin is not None and site.origin_ok(origin):
                self.send_header("Access-Control-Allow-Origin", origin)
                self.send_header("Vary", "Origin")

        def _json(self, code: int, obj: dict, headers: dict[str, str] | None = None, close: bool = False) -> None:
            data = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self._cors()
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            self.wfile.write(data)

        def _error(self, e: HTTPError, close: bool = False) -> None:
            close = close or self.close_connection or e.status in (411, 413)
            self._json(e.status, {"error": {"message": str(e), "type": e.kind, "code": e.status}}, e.headers,
                       close=close)
            if close:
                self._linger()

        def _linger(self) -> None:
            """Before closing on a body left unread: the answer sent, the write side shut, what the client still
            sends read and dropped for at most a second (closing with unread bytes resets the connection, and a
            client would lose the answer to the reset)."""
            try:
                self.wfile.flush()
                self.connection.shutdown(socket.SHUT_WR)
                self.connection.settimeout(0.2)
                deadline, total = time.monotonic() + 1.0, 0
                while time.monotonic() < deadline and total < max_body:
                    data = self.connection.recv(65536)
                    if not data:
                        break
                    total += len(data)
            except OSError:
                pass

        def _site(self) -> None:
            if not site.host_ok(self.headers.get("Host")):
                raise HTTPError(f"this server does not answer to Host {self.headers.get('Host')!r}"[:200], 403,
                                "permission_error")
            origin = self.headers.get("Origin")
            if origin is not None and not site.origin_ok(origin):
                raise HTTPError(f"cross-site requests from {origin!r} are refused"[:200], 403, "permission_error")

        def _guarded(self, handle) -> None:
            self._body_read = False
            try:
                self._site()
                handle()
            except HTTPError as e:  # refused before its body was read: the body would be read as the next request
                self._error(e, close=self.command == "POST" and not self._body_read)
            except (ConnectionError, TimeoutError):
                self.close_connection = True

        # --- methods ------------------------------------------------------------------------------------------

        def do_GET(self):
            def handle():
                if self.path in ("/v1/models", "/models"):
                    self._json(200, {"object": "list", "data": [
                        {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "lattice_mlx"}]})
                elif self.path == "/health":
                    self._json(200, {"status": "stopping" if engine.stopping.is_set() else "ok"})
                else:
                    raise HTTPError(f"no such endpoint: GET {self.path}"[:200], 404, "not_found_error")

            self._guarded(handle)

        def do_OPTIONS(self):  # a browser's preflight: answered for allowed origins only
            def handle():
                if self.headers.get("Origin") is None:
                    raise HTTPError("OPTIONS is answered to cross-origin preflights only", 405)
                self.send_response(204)
                self._cors()
                self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
                self.send_header("Access-Control-Allow-Headers", "Authorization, Content-Type")
                self.send_header("Content-Length", "0")
                self.end_headers()

            self._guarded(handle)

        def do_POST(self):
            self._guarded(self._post)

        def _body(self) -> dict:
            if self.headers.get("Transfer-Encoding"):
                raise HTTPError("a Content-Length body is required (chunked bodies are not accepted)", 411)
            length = self.headers.get("Content-Length")
            if length is None:
                raise HTTPError("a Content-Length header is required", 411)
            if not (length.isascii() and length.strip().isdigit()):
                self.close_connection = True
                raise BadRequest(f"Content-Length must be a non-negative integer, got {length!r}"[:200])
            size = int(length)
            if size > max_body:
                raise HTTPError(f"the body ({size} bytes) is over this server's limit of {max_body} bytes", 413)
            data = self.rfile.read(size)  # (read before a 415: the connection stays usable)
            if len(data) < size:
                self.close_connection = True
                raise ConnectionError("the body ended early")
            self._body_read = True
            kind = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
            if kind != "application/json":
                raise HTTPError(f"Content-Type must be application/json, got {kind or 'none'!r}", 415)
            return parse_json(data)

        def _post(self):
            chat = self.path in ("/v1/chat/completions", "/chat/completions")
            if not chat and self.path not in ("/v1/completions", "/completions"):
                self.close_connection = True
                raise HTTPError(f"no such endpoint: POST {self.path}"[:200], 404, "not_found_error")
            body = self._body()
            model = body.get("model")
            if model is not None and model != engine.model_id:
                raise HTTPError(f"model {str(model)!r} is not served here; this server serves {engine.model_id!r}"
                                [:300], 404, "not_found_error")
            req = parse_request(body, chat, engine.tokenizer, engine.model.args.vocab_size, limits,
                                sampling_defaults)
            job = engine.submit(Job(req.ids, req.max_tokens, req.sampler, req.stop, req.seed, limits.seconds))
            ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            try:
                if req.stream:
                    self._stream(job, chat, ident, req.include_usage)
                else:
                    self._whole(job, chat, ident)
            except (ConnectionError, TimeoutError, OSError):
                job.cancel("client")  # the client left or stopped reading: its generation stops at the next token
                self.close_connection = True

        # --- waiting for the worker ---------------------------------------------------------------------------

        def _client_gone(self) -> bool:
            """Whether the client closed its end (readable with nothing to read), without consuming its bytes."""
            try:
                ready, _, _ = select.select([self.connection], [], [], 0)
                return bool(ready) and self.connection.recv(1, socket.MSG_PEEK) == b""
            except (OSError, ValueError):
                return True

        def _next(self, job: Job) -> tuple[str, object]:
            """The job's next event; a client that leaves meanwhile (looked at every 0.1 s, events or not) cancels
            the job."""
            while True:
                now = time.monotonic()
                if now - self._looked > 0.1:
                    self._looked = now
                    if self._client_gone():
                        job.cancel("client")
                        raise ConnectionError("the client left")
                try:
                    return job.events.get(timeout=0.1)
                except queue.Empty:
                    pass

        def _whole(self, job: Job, chat: bool, ident: str) -> None:
            parts = []
            while True:
                kind, value = self._next(job)
                if kind == "text":
                    parts.append(value)
                elif kind == "error":
                    self._error(HTTPError(value, 503 if "shutting down" in value else 500, "server_error"),
                                close=True)
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
            self._cors()
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

            if chat:
                send(chunk(None, None, role=True))
            while True:
                kind, value = self._next(job)
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

    return Handler

