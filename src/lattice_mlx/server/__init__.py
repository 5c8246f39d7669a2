"""An OpenAI-compatible HTTP server: `python -m lattice_mlx.server [--model PATH] [--port 8080]`.

Endpoints: POST /v1/chat/completions and /v1/completions (streamed over server-sent events with "stream": true),
GET /v1/models and /health. One generation worker serves requests in arrival order from a bounded queue
(engine.py); each request is bounded in tokens, context and wall time, a client that leaves cancels its job, and
SIGTERM or Ctrl-C stops the server within a token (protocol.py, http.py). MTP speculation is on (adaptive) when the
checkpoint has a head, and its statistics come back in `usage.speculation`. A prompt that extends the previous
request's (the next turn of a chat) prefills only its new tokens (`usage.prompt_tokens_details.cached_tokens`).
The standard library's HTTP server is enough for one model and one generation at a time (docs/adr/0005-server.md).
"""

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx

from ..batch import DEFAULT_MAX_BATCH, BatchDecoder
from ..cli import ArgumentParser
from ..decode import generate_step, prefill, tracing_enabled
from ..generate import checkpoint_sampling
from ..load import DEMO_MODEL, LoadError, load, resolve_path
from ..sample import Sampler
from ..speculative import SpecOptions, SpecStats, speculate
from ..speculative.batched import BatchRounds
from ..speculative.options import ADAPTIVE_MAX_K
from ..speculative.pipelined import tracing_enabled as rounds_tracing_enabled
from ..speculative.pipelined import warm_catch_up, warm_rounds
from ..speculative.tuning import PIPELINED_START_K
from ..startup import end_startup, interrupts_to_main
from .engine import BatchEngine, Engine, Job
from .http import Server, Site, is_loopback, make_handler
from .protocol import BadRequest, HTTPError, Limits, StopScanner, parse_request

__all__ = ["BadRequest", "Engine", "HTTPError", "Job", "Limits", "StopScanner", "main", "parse_request", "warm_up"]

log = logging.getLogger("lattice_mlx.server")
DEFAULT_MAX_TOKENS = 512
DEMO_ID = "lattice-demo"


def served_name(model: str | None, given: str | None = None) -> str:
    """The model id clients see: the name given, else the hub id, else the checkpoint folder's name (never a local
    path, which would tell every client where the user keeps files)."""
    if given:
        return given
    if model is None:
        return DEMO_ID
    path = Path(model).expanduser()
    return path.resolve().name if path.exists() else model


# Prompt lengths the warm-up prefills once: one per row tile of MLX's 4-bit matmul on CUDA (16, 32, 64 rows: a tile
# is built, with the elementwise fusions around it, the first time a machine runs a prompt of that many rows, over a
# minute each on a fresh GPU machine, then kept on disk: docs/results/code_measurements.md, 'First use of a prompt
# length'), so that a fresh machine builds them at start-up, announced, and not inside a request; milliseconds where
# they are built. (16 and 40 rows measured so; 24 for the 32-row tile is read from MLX 0.32's source, not measured.)
# Caches as a request's are (not trimmable: a short forward on a trimmable cache takes the recording path).
WARM_PROMPT_ROWS = (24, 40)  # (the 16-row tile: the 16-token prompt of the generations below)


def warm_up(model, speculation: SpecOptions | None, max_batch: int = 1) -> None:
    """A few tokens plain and with every draft depth 1..K the adaptive loop may pick, greedy and sampled, before the
    first request (a 16-token prompt), and a prefill of each of WARM_PROMPT_ROWS. A new verify depth's first
    generation compiles kernels for seconds on a GPU (docs/results/code_measurements.md, 'First use'), which would
    otherwise land on whichever request first uses that depth. Plain steps and pipelined rounds are traced once per
    sampler structure (decode.TracedSteps, speculative/pipelined.py): greedy, and sampled without top-k / top-p /
    min-p (a request's temperature is an input of that trace). With `max_batch` > 1 where steps are traced, also a
    batch of every size 1..max_batch for a few steps, greedy and sampled: a traced batch step is traced once per
    batch size (batch.BatchSteps), which would otherwise land on the requests that first make a batch that big; with
    MTP the batch's rounds instead (speculative/batched.py), at the tuner's first depth (PIPELINED_START_K)."""
    tic = time.perf_counter()
    ids = [(7 * i + 3) % model.args.vocab_size for i in range(16)]
    depths = range(1, speculation.draft_tokens + 1) if speculation is not None else []
    for sampler in (Sampler(), Sampler(temp=1.0)):
        for k in [None, *depths]:
            if k is None:
                steps = generate_step(model, mx.array(ids), sampler=sampler)
            else:
                options = SpecOptions(draft_tokens=k, adaptive=False)
                steps = speculate(model, mx.array(ids), sampler=sampler, options=options, stats=SpecStats.of(options))
            for _ in zip(range(2 * (k or 1) + 2), steps):
                pass
            steps.close()
    for rows in WARM_PROMPT_ROWS:  # (the MTP path's prefill also returns the hiddens the head reads)
        prompt = mx.array([ids[i % len(ids)] for i in range(rows)])
        logits, hidden = prefill(model, prompt, model.make_cache(trimmable=False),
                                 return_hidden=speculation is not None)
        mx.eval(logits, *([hidden] if hidden is not None else []))
    if speculation is not None:
        warm_catch_up(model)
        if speculation.adaptive and mx.default_device().type == mx.DeviceType.gpu and rounds_tracing_enabled():
            # every change between depths and plain steps, which the fixed depths above do not run (on the GPU its
            # builds are the machine's once, and its traces and first loads this process's; on the CPU seconds)
            warm_rounds(model, speculation.draft_tokens)
    # the batch's traces: plain steps (BatchSteps) without MTP; with it the batch runs MTP rounds (BatchRounds),
    # whose steady-state round is traced per depth and batch size: the tuner's first depth is warmed; the other
    # depths, and the engine's own plain steps (its off state), are traced when the tuner first picks them
    traced = rounds_tracing_enabled() if speculation is not None else tracing_enabled()
    batches = max_batch if max_batch > 1 and traced else 0
    if batches:
        K = min(PIPELINED_START_K, speculation.draft_tokens) if speculation is not None else 0
        for sampler in (Sampler(), Sampler(temp=1.0)):
            for B in range(1, batches + 1):
                decoder = BatchRounds(model, k=K, max_batch=B) if K else BatchDecoder(model, max_batch=B)
                for _ in range(B):
                    decoder.add(ids, max_tokens=4 * (K + 1) if K else 4, sampler=sampler)
                while decoder.busy:
                    decoder.step()
    log.info("warmed up in %.1f s: decode%s%s, greedy and sampled", time.perf_counter() - tic,
             f" and verify shapes for K = 1..{speculation.draft_tokens}" if speculation else "",
             (f", batches of 1..{batches}" + (f" (MTP rounds, K = {K})" if K else "")) if batches else "")


class Stopper:
    """The signal handler while serving: the first SIGTERM or SIGINT refuses new work and ends the running job at its
    next token (the server then exits 0); a second exits at once, with 128 + the signal's number."""

    def __init__(self, engine: Engine, exit_now=os._exit):
        self.engine, self.exit_now, self.count = engine, exit_now, 0

    def __call__(self, signum, frame=None) -> None:
        self.count += 1
        if self.count > 1:
            self.exit_now(128 + signum)
            return
        log.info("stopping (%s): no new requests; the running one ends at its next token",
                 signal.Signals(signum).name)
        self.engine.stop()


def setup_arg_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m lattice_mlx.server", description="Serve a Qwen3.5 model over an "
                       "OpenAI-compatible HTTP API, on 127.0.0.1 unless told otherwise.")
    p.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: the embedded demo model)")
    p.add_argument("--served-model-name", help="the model id clients see and must ask for (default: the hub id, "
                   "or the checkpoint folder's name; 'lattice-demo' for the demo)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's own dtype")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="when a request gives none (then at most what the context leaves)")
    p.add_argument("--max-tokens-limit", type=int, default=4096, help="the most tokens a request may ask for")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds of generation per request; then it ends with finish_reason 'time_limit'")
    p.add_argument("--max-queue", type=int, default=16, help="requests waiting behind the running one; "
                   "beyond it a request gets 503 with Retry-After")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger bodies get 413 unread (1 MiB)")
    p.add_argument("--io-timeout", type=float, default=30.0,
                   help="seconds a client may take to send its request or to read each write")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="a web origin allowed to call the server (repeat; '*': any). Default: loopback origins on "
                   "this port only")
    p.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                   help="a Host name the server answers to besides its bound address (repeat; '*': any)")
    p.add_argument("--allow-long-context", action="store_true",
                   help="accept a prompt plus max_tokens past the checkpoint's context length")
    p.add_argument("--generation-config", choices=["auto", "none"], default="auto",
                   help="auto: sampling a request leaves out takes the checkpoint's generation_config.json")
    p.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH, help="requests decoded together (continuous "
                   "batching; MTP rounds over the batch with a head, the depth tuned for the batch; a request alone "
                   f"decodes as a single generation until another arrives); 1: one at a time [{DEFAULT_MAX_BATCH}]")
    p.add_argument("--no-mtp", action="store_true", help="plain decoding even when the checkpoint has an MTP head")
    p.add_argument("--draft-tokens", type=int, help=f"MTP draft depth K, the largest (adaptive) [{ADAPTIVE_MAX_K}]")
    p.add_argument("--no-warmup", action="store_true", help="serve at once: skip the start-up generations that "
                   "compile the decode and verify shapes (otherwise the first request pays for them)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def _check_flags(args) -> None:
    for name in ("max_tokens", "max_tokens_limit", "max_queue", "max_body_bytes", "max_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in ("request_timeout", "io_timeout"):
        if not getattr(args, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.max_tokens > args.max_tokens_limit:
        raise ValueError(f"--max-tokens ({args.max_tokens}) must be <= --max-tokens-limit ({args.max_tokens_limit})")


def _closed(httpd, code: int) -> int:
    if httpd is not None:
        httpd.server_close()
    return code


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)  # (Ctrl-C here: the start-up handler's one line and exit 130)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(message)s", stream=sys.stderr)
    httpd, stage = None, "loading"
    try:
        # from here to the Stopper's installation a Ctrl-C is a KeyboardInterrupt caught below, wherever it lands
        interrupts_to_main()
        # until serving starts, SIGTERM stops the process as Ctrl-C does: one line, no traceback
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        _check_flags(args)
        model, tokenizer = load(args.model, dtype=args.dtype)
        defaults = {}
        if args.generation_config == "auto":
            defaults = checkpoint_sampling(resolve_path(args.model) if args.model else DEMO_MODEL)
        batched = args.max_batch > 1  # continuous batching (batch.py; MTP rounds: speculative/batched.py)
        speculation = SpecOptions(draft_tokens=args.draft_tokens) if model.has_mtp and not args.no_mtp else None
        httpd = Server((args.host, args.port), None)
        if not args.no_warmup:
            stage = "warming up"
            # (a request alone runs the pipelined rounds; a batch's plain steps are traced per batch size)
            warm_up(model, speculation, args.max_batch)
        stage = "starting"
        model_id = served_name(args.model, args.served_model_name)
        engine = (BatchEngine(model, tokenizer, model_id, speculation, args.max_queue, args.allow_long_context,
                              max_batch=args.max_batch) if batched else
                  Engine(model, tokenizer, model_id, speculation, args.max_queue, args.allow_long_context))
        host, port = httpd.server_address[:2]
        limits = Limits(default_max_tokens=args.max_tokens, max_tokens=args.max_tokens_limit,
                        context=model.args.max_position_embeddings, allow_long_context=args.allow_long_context,
                        seconds=args.request_timeout)
        site = Site(str(host), port, set(args.allow_host), set(args.allow_origin))
        httpd.RequestHandlerClass = make_handler(engine, site, limits, defaults, args.max_body_bytes,
                                                 args.io_timeout)
        stop = Stopper(engine)
        signal.signal(signal.SIGTERM, stop)  # (a signal pending here runs the handler it came under: caught below)
        signal.signal(signal.SIGINT, stop)
        end_startup()  # (serving: Ctrl-C straight to the Stopper)
    except KeyboardInterrupt:
        print(f"error: interrupted while {stage}", file=sys.stderr)
        return _closed(httpd, 130)
    except (LoadError, ValueError, OSError, RuntimeError) as e:
        if stage == "loading" and not isinstance(e, RuntimeError):
            print(f"error: {e}", file=sys.stderr)
        else:  # e.g. out of memory at the first forward
            print(f"error: {stage} failed: {e}", file=sys.stderr)
        return _closed(httpd, 1)
    if not is_loopback(str(host).strip("[]").lower()) and not args.allow_host:
        log.warning("bound to %s: clients on other machines must name this server by an --allow-host name", host)
    sampling = ", ".join(f"{k} {v}" for k, v in defaults.items()) or "greedy"
    mtp = f"on, K up to {speculation.draft_tokens}, adaptive" if speculation else "off"
    log.info("serving %s on http://%s:%d/v1 (MTP %s; %s; default sampling: %s; context %d tokens)", engine.model_id,
             host, port, mtp, f"up to {args.max_batch} requests batched" if batched else "one request at a time",
             sampling, limits.context)
    # HTTP on a thread of its own; generation on this one, where the model was loaded
    http_thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="http",
                                   daemon=True)
    http_thread.start()
    try:
        engine.run()
    finally:
        httpd.shutdown()
        httpd.server_close()
        log.info("shut down")
    return 0

