"""The model's one generation worker and its bounded queue. Jobs run one at a time in arrival order; a job ends at its
max_tokens, a stop string, its wall-time limit, its client leaving, or shutdown, and the worker checks the last
three between tokens, so no request can hold the worker past its limit or keep the server from stopping."""

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import mlx.core as mx

from ..batch import BatchDecoder
from ..generate import stream_generate
from ..prompt_cache import PromptCache
from ..sample import Sampler
from ..speculative import SpecOptions
from ..speculative.batched import BatchRounds
from .protocol import HTTPError, StopScanner

log = logging.getLogger("lattice_mlx.server")


@dataclass
class Job:
    """One request's generation: what to generate, and the events the worker sends back."""

    ids: list[int]
    max_tokens: int
    sampler: Sampler
    stop: list[str]
    seed: int | None
    seconds: float = float("inf")  # wall-time limit once generation starts
    events: queue.Queue = field(default_factory=queue.Queue)  # ("text", str) ..., then ("done", dict) or ("error", str)
    cancelled: threading.Event = field(default_factory=threading.Event)
    why: str = ""  # why it was cancelled: "client" or "shutdown"

    def cancel(self, why: str) -> None:
        if not self.cancelled.is_set():
            self.why = why
            self.cancelled.set()


def unseed() -> None:
    """MLX's global generator keyed afresh from the OS's entropy, after a seeded request used it: the requests after
    it (unseeded ones draw from the generator) never draw the numbers its seed's stream drew or would draw next."""
    mx.random.seed(int.from_bytes(os.urandom(8), "little") >> 1)


class Engine:
    """The model and its one generation worker. `submit` refuses (503) beyond `max_queue` waiting jobs and after
    `stop`; `run` is the worker, on the thread that loaded the model (MLX is used from that thread only)."""

    def __init__(self, model, tokenizer, model_id: str, speculation: SpecOptions | None, max_queue: int = 16,
                 allow_long_context: bool = False):
        self.model, self.tokenizer, self.model_id = model, tokenizer, model_id
        self.speculation, self.max_queue, self.allow_long_context = speculation, max_queue, allow_long_context
        self.prompt_cache: PromptCache | None = None  # the state after the last request's prompt (all but its last token)
        self.jobs: queue.Queue = queue.Queue()
        self.stopping = threading.Event()
        self.current: Job | None = None
        self._lock = threading.Lock()

    def submit(self, job: Job) -> Job:
        with self._lock:
            if self.stopping.is_set():
                raise HTTPError("the server is shutting down", 503, "server_error", {"Retry-After": "5"})
            if self.jobs.qsize() >= self.max_queue:
                raise HTTPError(f"the server is busy: {self.jobs.qsize()} requests are waiting; retry later", 503,
                                "server_error", {"Retry-After": "2"})
            self.jobs.put(job)
        return job

    def stop(self) -> None:
        """Refuse new work, end the running job at its next token, and answer every waiting one."""
        with self._lock:
            self.stopping.set()
            if self.current is not None:
                self.current.cancel("shutdown")
            self._drain()

    def _refused(self, job: Job) -> bool:
        """Whether a job taken from the queue is not to run: cancelled (its client left), or taken just as `stop`
        drained the queue (it is answered as the drained ones are). Called under the lock."""
        if self.stopping.is_set() and not job.cancelled.is_set():
            job.cancel("shutdown")
            job.events.put(("error", "the server is shutting down"))
        return job.cancelled.is_set()

    def _drain(self) -> None:
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            job.cancel("shutdown")
            job.events.put(("error", "the server is shutting down"))

    def run(self) -> None:
        """The generation loop, until `stop`."""
        while not self.stopping.is_set():
            try:
                job = self.jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            with self._lock:
                if self._refused(job):
                    continue
                self.current = job
            try:
                self._generate(job)
            except Exception as e:  # one request's failure is reported to it; the server goes on
                log.exception("generation failed")
                job.events.put(("error", f"generation failed: {e}"))
            finally:
                if job.seed is not None:
                    unseed()
                with self._lock:
                    self.current = None
        with self._lock:
            self._drain()

    def _prompt_cache(self, ids: list[int]) -> tuple[PromptCache | None, int]:
        """A prompt that extends the previous one (the next turn of a chat) prefills only its new tokens: the state
        after all but its last token is built from the previous request's, and kept for the next request."""
        if len(ids) < 2:
            return None, 0
        prev = self.prompt_cache
        if prev is not None and prev.tokens == ids[:-1]:
            return prev, len(prev.tokens)
        cached = prev.covers(ids[:-1]) if prev is not None else 0
        self.prompt_cache = PromptCache.build(self.model, ids[:-1], base=prev)
        return self.prompt_cache, cached

    def _generate(self, job: Job, yield_to=None) -> "_Handoff | None":
        """Generates the job to its end, streaming its text, and reports it done. `yield_to()` (BatchEngine), asked
        after every token: True stops the generation there and returns what the batch needs to go on with it."""
        if job.seed is not None:
            mx.random.seed(job.seed)
        s = job.sampler
        scan, n, finish, last, cut, tokens = StopScanner(job.stop), 0, "length", None, False, []
        pc, cached = self._prompt_cache(job.ids)
        stream = stream_generate(self.model, self.tokenizer, job.ids, max_tokens=job.max_tokens, temp=s.temp,
                                 top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, chat_template=False,
                                 speculation=self.speculation, prompt_cache=pc,
                                 allow_long_context=self.allow_long_context)
        tic = time.perf_counter()
        deadline = time.monotonic() + job.seconds
        try:
            for last in stream:
                n += 1
                tokens.append(last.token)
                if job.cancelled.is_set():
                    log.info("request cancelled %s after %d tokens",
                             "by its client" if job.why == "client" else "at shutdown", n)
                    job.events.put(("error", "the server is shutting down" if job.why == "shutdown" else
                                    "cancelled"))
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
                if time.monotonic() > deadline:
                    finish = "time_limit"
                    break
                if yield_to is not None and yield_to():
                    return _Handoff(tokens, scan, cached, tic, deadline)
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


@dataclass(eq=False)
class _Handoff:
    """A lone job's generation stopped between tokens (Engine._generate's yield_to) for the batch to go on with."""

    tokens: list[int]  # generated and streamed so far
    scan: StopScanner
    cached: int  # prompt tokens the prompt cache held
    tic: float
    deadline: float


@dataclass(eq=False)
class _Live:
    """A job decoding in the batch: its sequence, the text streaming out and its limits."""

    job: Job
    seq: object  # batch.Sequence
    scan: StopScanner
    detok: object
    deadline: float
    tic: float
    sent: int = 0  # tokens of seq.tokens already streamed
    before: int = 0  # tokens it generated alone before it joined the batch (their ids end seq.prompt)
    cached: int | None = None  # prompt tokens a prompt cache held, when it started alone (else seq.cached)


class BatchEngine(Engine):
    """Continuous batching (`--max-batch` > 1): up to `max_batch` jobs decode together, one forward per step
    (batch.BatchDecoder; with a head and MTP on, speculative/batched.BatchRounds, its depth or plain steps tuned for
    the batch), each joining as soon as a row is free and leaving at its own max_tokens, stop string, end-of-sequence
    token, time limit, client leaving or shutdown, checked every step. A job arriving to an idle engine with nothing
    behind it runs alone, as `Engine` runs it (a single generation's traced steps and pipelined MTP rounds), until
    another job arrives: then it joins the batch, its prompt and the tokens it has generated prefilled as the
    batch's prompt (from the kept prompt state where one covers it), and goes on there with what is left of its
    budget (greedy, fp32: the tokens it would have got alone). A request's seed keys a PRNG stream of its own
    (BatchDecoder.add): its sampled text does not depend on its batch-mates' draws (in bf16 on a GPU their presence
    may still move its logits: batch.py); with adaptive MTP the batch's depth choice decides how its draws are used.
    The state after the newest prompt is kept, as `Engine` keeps it: a request extending it (a conversation's next
    turn) prefills only its new tokens (not with MTP rounds, which prefill the head's rows too)."""

    def __init__(self, *args, max_batch: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_batch = max_batch
        self.live: list[_Live] = []
        self.eos = frozenset(self.tokenizer.eos_token_ids)

    def stop(self) -> None:
        with self._lock:
            self.stopping.set()
            for live in self.live:
                live.job.cancel("shutdown")
            if self.current is not None:
                self.current.cancel("shutdown")
            self._drain()

    def run(self) -> None:
        spec = self.speculation
        decoder = BatchDecoder(self.model, max_batch=self.max_batch) if spec is None else \
            BatchRounds(self.model, k=spec.draft_tokens, adaptive=spec.adaptive, max_batch=self.max_batch)
        while not self.stopping.is_set() or self.live:
            if not self.live and not decoder.busy and self._alone(decoder):
                continue
            self._admit(decoder)
            for live in list(self.live):
                if live.job.cancelled.is_set():
                    decoder.cancel(live.seq)
                    self._end(live, None)
            if not self.live:
                continue
            try:
                decoder.step()
            except Exception as e:  # noqa: BLE001 (the batch's failure is reported to each of its jobs)
                log.exception("batched step failed")
                for live in list(self.live):
                    decoder.cancel(live.seq)
                    self._end(live, f"generation failed: {e}")
                continue
            for live in list(self.live):
                self._emit(decoder, live)
        with self._lock:
            self._drain()

    def _alone(self, decoder) -> bool:
        """With nothing decoding, a job with nothing behind it runs alone until another job arrives (then it joins
        the batch); False when jobs wait (they are admitted together) or none came."""
        try:
            job = self.jobs.get(timeout=0.1)
        except queue.Empty:
            return True
        if not self.jobs.empty():
            with self.jobs.mutex:  # (first in line still: _admit takes them in order)
                self.jobs.queue.appendleft(job)
            return False
        with self._lock:
            if self._refused(job):
                return True
            self.current = job
        handoff = None
        try:
            handoff = self._generate(job, yield_to=lambda: not self.jobs.empty() and not self.stopping.is_set())
        except Exception as e:  # one request's failure is reported to it; the server goes on
            log.exception("generation failed")
            job.events.put(("error", f"generation failed: {e}"))
            return True
        finally:
            key = self._stream_on(job, len(handoff.tokens)) if handoff is not None else None
            if job.seed is not None:
                unseed()
            with self._lock:
                self.current = None
        if handoff is not None:
            self._join(decoder, job, handoff, key)
        return True

    def _stream_on(self, job: Job, drawn: int) -> mx.array | None:
        """The PRNG key a seeded job handed to the batch goes on with (None: unseeded, a fresh stream). Its lone run
        seeded MLX's global generator, and a plain run drew one key per token, split off the generator's key as the
        batch splits a row's: `drawn` splits of key(seed) are the key its next token draws with, so its text is its
        lone run's (the generator itself may be a draw further: a plain step is queued one ahead). MTP rounds draw
        per round, not per token: the generator's own key, past every key the lone run drew (keyed by its seed
        again, the batch would draw its first tokens' numbers once more). Either key lies on the generator's own
        chain: the caller reseeds the generator afterwards (`unseed`), else later requests would draw its numbers."""
        if job.seed is None:
            return None
        if self.speculation is not None:
            return mx.array(mx.random.state[0])
        key = mx.random.key(job.seed)
        for _ in range(drawn):
            key = mx.random.split(key)[0]
        return key

    def _join(self, decoder, job: Job, handoff: _Handoff, key: mx.array | None = None) -> None:
        """A job that ran alone goes on in the batch: its prompt and generated tokens prefilled (the kept prompt
        state covers its prompt), what is left of its budget to go, its text streaming on where it stopped."""
        ids = job.ids + handoff.tokens
        pc = self.prompt_cache
        try:
            seq = decoder.add(ids, max_tokens=job.max_tokens - len(handoff.tokens), sampler=job.sampler,
                              stop_ids=self.eos, prefix=pc if pc is not None and pc.covers(ids) else None,
                              key=key)
        except Exception as e:  # noqa: BLE001 (one request's failure is reported to it)
            log.exception("joining the batch failed")
            job.events.put(("error", f"generation failed: {e}"))
            return
        detok = self.tokenizer.detokenizer
        for token in handoff.tokens:  # (their text is out: the detokenizer goes on from there)
            detok.add_token(token)
        detok.last_segment  # noqa: B018
        live = _Live(job, seq, handoff.scan, detok, handoff.deadline, handoff.tic, before=len(handoff.tokens),
                     cached=handoff.cached)
        log.info("request joins the batch after %d tokens alone", live.before)
        self._enter(live)

    def _admit(self, decoder) -> None:
        """Takes waiting jobs into free rows: each is prefilled (its first token sampled) before the next step."""
        while not decoder.full and not self.stopping.is_set():
            try:
                job = self.jobs.get(timeout=0 if self.live else 0.1)
            except queue.Empty:
                return
            with self._lock:
                if self._refused(job):
                    continue
            pc = self.prompt_cache
            try:  # (a prompt extending the kept one prefills only its new tokens; MTP rounds prefill it all)
                seq = decoder.add(job.ids, max_tokens=job.max_tokens, sampler=job.sampler, stop_ids=self.eos,
                                  prefix=pc if pc is not None and pc.covers(job.ids) else None, keep_prefix=True,
                                  seed=job.seed)
            except Exception as e:  # noqa: BLE001 (one request's failure is reported to it)
                log.exception("prefill failed")
                job.events.put(("error", f"generation failed: {e}"))
                continue
            live = _Live(job, seq, StopScanner(job.stop), self.tokenizer.detokenizer,
                         time.monotonic() + job.seconds, time.perf_counter())
            self._enter(live)
            self._emit(decoder, live)

    def _enter(self, live: _Live) -> None:
        """The job joins the live ones; one `stop` has missed (it ran since the job left the queue) is cancelled."""
        with self._lock:
            self.live.append(live)
            if self.stopping.is_set():
                live.job.cancel("shutdown")

    def _emit(self, decoder, live: _Live) -> None:
        """Streams the sequence's new tokens as text; ends the job where it ended or a limit says so. The state
        after the newest prompt (all but its last token) is kept for the next request."""
        seq, finish, cut = live.seq, None, False
        if seq.prefix is not None:
            self.prompt_cache, seq.prefix = seq.prefix, None
        for token in seq.tokens[live.sent:]:
            live.sent += 1
            if token not in self.eos:
                live.detok.add_token(token)
            if live.sent == len(seq.tokens) and seq.done:
                live.detok.finalize()
            text, hit = live.scan.add(live.detok.last_segment)
            if text:
                live.job.events.put(("text", text))
            if hit:
                finish, cut = "stop", True
                break
        if finish is None and seq.done:
            finish = seq.finish_reason
        if finish is None and time.monotonic() > live.deadline:
            finish = "time_limit"
        if finish is None:
            return
        if not seq.done:
            decoder.cancel(seq)
        tail = "" if cut else live.scan.flush()
        if tail:
            live.job.events.put(("text", tail))
        n, cached = live.before + live.sent, seq.cached if live.cached is None else live.cached
        usage = {"prompt_tokens": len(live.job.ids), "completion_tokens": n, "total_tokens": len(live.job.ids) + n,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        log.info("request done: %d prompt tokens (%d from the prompt cache) + %d generated in %.2f s (%s; batched)",
                 len(live.job.ids), cached, n, time.perf_counter() - live.tic, finish)
        self._end(live, ("done", {"finish_reason": finish, "usage": usage}))

    def _end(self, live: _Live, event) -> None:
        """The job leaves: its last event (None: the cancellation's error) and its row."""
        if event is None:
            job = live.job
            log.info("request cancelled %s after %d tokens", "by its client" if job.why == "client" else
                     "at shutdown", live.sent)
            event = ("error", "the server is shutting down" if job.why == "shutdown" else "cancelled")
        elif isinstance(event, str):
            event = ("error", event)
        live.job.events.put(event)
        with self._lock:
            self.live.remove(live)

