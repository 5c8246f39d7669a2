"""The OpenAI-compatible server (server.py), started as a real process and spoken to with the official `openai`
client and raw HTTP: greedy output equals `generate`'s, streaming equals the whole response, stop sequences,
sampling with a seed, usage with speculation statistics, bad requests, a cancelled stream, graceful shutdown."""

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the test extra installs openai")

from lattice_mlx import generate, load  # noqa: E402

PROMPT = "def add(a, b):"
MODEL = "lattice-demo"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tmp: Path, *extra: str) -> tuple[subprocess.Popen, int, Path]:
    port, log = _free_port(), tmp / f"server-{time.monotonic_ns()}.log"
    proc = subprocess.Popen([sys.executable, "-m", "lattice_mlx.server", "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"), env={**os.environ})
    # Generous: the suite's other workers share the CPU, and the default warm-up traces a batch step per size
    # (LATTICE_TRACE_STEPS=1 here, conftest.py); a server that dies is caught at once below.
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, port, log
        except OSError:
            time.sleep(0.3)
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()}")
    proc.kill()
    raise RuntimeError("server did not start")


@contextlib.contextmanager
def _served(tmp: Path, *extra: str):
    """(port, log) of a server started with `extra` flags, stopped (SIGTERM) when the block ends."""
    proc, port, log = _start(tmp, *extra)
    try:
        yield port, log
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def _client(port: int):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # --max-batch 2: the warm-up traces batches of 1..2, not the default's 1..16 (a minute of this CPU's time;
    # batching has its own tests, test_batch_server.py)
    with _served(tmp_path_factory.mktemp("server"), "--max-batch", "2") as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return _client(server[0])


def _raw(port: int, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    return r.status, json.loads(r.read())


def test_shapes_are_compiled_before_serving(client, server):
    """The start-up warm-up (plain, then every K up to the default 4, fixed, and the head's catch-up row counts;
    then the batch's MTP rounds at each batch size) runs before the first request is taken: logged before the
    'serving' line (the first MoE generation at each K took 9-17 s on the H200)."""
    text = server[1].read_text()
    warm, serving = text.find("warmed up in"), text.find("serving lattice-demo")
    assert 0 <= warm < serving and "verify shapes for K = 1..4" in text and "MTP on, K up to 4" in text, text
    assert "batches of 1..2 (MTP rounds, K = 3)" in text, text


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["lattice-demo"]


def test_greedy_completion_equals_generate(client):
    """MTP speculation on (the demo has a head): the text is plain greedy decoding's, usage counts its tokens."""
    model, tok = load()
    want = generate(model, tok, PROMPT, max_tokens=24, chat_template=False)
    got = client.completions.create(model="lattice-demo", prompt=PROMPT, max_tokens=24, temperature=0)
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.prompt_tokens == want.prompt_tokens and got.usage.completion_tokens == 24
    spec = got.usage.model_extra["speculation"]
    assert spec["draft"] == "mtp" and spec["rounds"] > 0


def test_chat_stream_equals_the_whole_response(client):
    messages = [{"role": "user", "content": "import os\n"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    parts, finish = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, stream=True,
                                                temperature=0):
        parts.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content and finish == whole.choices[0].finish_reason
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 20


def test_stop_sequence_cuts_the_text(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full[8:11]
    assert stop and full.find(stop) >= 0
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=[stop],
                                                    stream=True, temperature=0))
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=stop, temperature=0)
            text, finish = r.choices[0].text, r.choices[0].finish_reason
            assert r.usage.model_extra["speculation"]["draft"] == "mtp"  # reported when a stop string cut it too
        assert text == full[: full.find(stop)] and finish == "stop", stream


def test_seeded_sampling_repeats(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    a, b = (client.completions.create(**kw).choices[0].text for _ in range(2))
    c = client.completions.create(**{**kw, "seed": 8}).choices[0].text
    assert a == b and a != c


def test_bad_requests_are_http_400_with_a_message(client, server):
    port = server[0]
    with pytest.raises(openai.BadRequestError, match="'temperature' must be a finite number >= 0"):
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="only n = 1"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], n=2)
    for path, body, message in [
        ("/v1/completions", b"{not json", "not valid JSON"),
        ("/v1/chat/completions", b'{"messages": []}', "'messages' must be a non-empty list"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": 0}', "'max_tokens' must be >= 1"),
        ("/v1/completions", b'{"prompt": 5}', "'prompt' must be"),
        ("/v1/completions", b'{"prompt": [1, 99999999]}', "token ids must be in [0, "),
        ("/v1/completions", b'{"prompt": "x", "stop": [""]}', "'stop' must be"),
    ]:
        status, obj = _raw(port, "POST", path, body)
        assert status == 400 and message in obj["error"]["message"], (body, obj)
    status, obj = _raw(port, "GET", "/v1/nothing")
    assert status == 404 and "no such endpoint" in obj["error"]["message"]


def _streaming(port: int, max_tokens: int = 2000) -> socket.socket:
    """A raw streaming request, read until its third event: the socket (close it to leave). Greedy: sampled at the
    demo's default temperature (MLX seeds its generator from the clock), 1 text in 40 ends with an end-of-sequence
    token within 60 tokens, and may end before the server sees its client leave; greedy, it runs past 400."""
    sock = socket.create_connection(("127.0.0.1", port))
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "stream": True, "temperature": 0}).encode()
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n".encode()
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    got = b""
    while got.count(b"data: ") < 3:
        got += sock.recv(4096)
    return sock


def _cancelled_after(log, before: int, seconds: float = 60.0) -> int:
    """The tokens a client-cancelled request had when the server logged its cancellation, waiting for a log line
    past the log's first `before` characters. The server batches (--max-batch): a request sent after the client
    left can end beside the stream before the stream's next failed write cancels it, so the line is waited for, not
    assumed written (a suite run failed on that); a stream never cancelled runs its 2,000 tokens, logs no such line,
    and fails here."""
    deadline = time.monotonic() + seconds
    while True:
        lines = [line for line in log.read_text()[before:].splitlines() if "cancelled by its client" in line]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert lines, log.read_text()[before:]
    return int(lines[-1].split("after ")[1].split()[0])


def test_a_client_leaving_a_stream_cancels_its_generation(client, server):
    port, log = server
    before = len(log.read_text())
    _streaming(port).close()
    # the server goes on serving
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                     temperature=0).usage.completion_tokens == 4
    assert _cancelled_after(log, before) < 2000


def test_sigterm_shuts_down_gracefully(tmp_path):
    proc, port, log = _start(tmp_path, "--no-mtp", "--no-warmup")
    status, obj = _raw(port, "POST", "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 3}).encode())
    assert status == 200 and "speculation" not in obj["usage"] and "(MTP off;" in log.read_text()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0 and "shut down" in log.read_text()


def test_bad_flags_and_checkpoints_end_in_one_line(tmp_path):
    for args, message in [(["--max-tokens", "0"], "--max-tokens must be >= 1"),
                          (["--model", str(tmp_path / "missing")], "error:")]:
        r = subprocess.run([sys.executable, "-m", "lattice_mlx.server", "--port", str(_free_port()), *args],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_prompt_extending_the_last_one_prefills_only_its_new_tokens(client):
    """The next turn of a conversation: the server keeps the state after the previous prompt (all but its last
    token) and prefills only the rest; the text is what a fresh generation gives."""
    model, tok = load()
    turn1 = tok.encode("class Stack:\n    def __init__(self):\n")
    client.completions.create(model=MODEL, prompt=turn1, max_tokens=8, temperature=0)
    turn2 = turn1 + tok.encode("        self.items = []\n\n    def push(self, item):\n")
    r2 = client.completions.create(model=MODEL, prompt=turn2, max_tokens=12, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens == len(turn1) - 1
    assert r2.choices[0].text == generate(model, tok, turn2, max_tokens=12, chat_template=False).text
    again = client.completions.create(model=MODEL, prompt=turn2, max_tokens=12, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == len(turn2) - 1 and again.choices[0].text == \
        r2.choices[0].text


def test_chat_repl_reuses_the_conversation_state():
    r = subprocess.run([sys.executable, "-m", "lattice_mlx.chat", "--max-tokens", "8"], input="def add(a, b):\n"
                       "class Stack:\n/reset\nimport os\n/quit\n", capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    turns = [line for line in r.stderr.splitlines() if line.startswith("[")]
    cached = [int(t.split(", ")[1].split()[0]) for t in turns]
    assert len(turns) == 3 and cached[0] == 0 and cached[1] > 0 and cached[2] == 0, turns  # /reset forgets


def test_chat_repl_skips_empty_lines():
    r = subprocess.run([sys.executable, "-m", "lattice_mlx.chat", "--max-tokens", "4"], input="\n   \nimport os\n/quit\n",
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert len([line for line in r.stderr.splitlines() if line.startswith("[")]) == 1


def test_a_failing_warm_up_is_one_line(monkeypatch, capsys):
    """An error while warming up (e.g. out of memory at the first forward) ends in one line and exit 1, the port
    released, no traceback."""
    from lattice_mlx import server as srv

    def boom(model, speculation, max_batch):
        raise RuntimeError("[malloc] out of memory")

    monkeypatch.setattr(srv, "warm_up", boom)
    assert srv.main(["--port", "0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: warming up failed: [malloc] out of memory"], err


def test_warm_up_traces_greedy_and_sampled_steps_and_rounds(checkpoints):
    """Warm-up leaves a traced plain step and a traced round per depth for greedy and for sampled requests (the
    temperature an input), so a request's first tokens do not pay for tracing; a request at another temperature
    adds no trace."""
    import mlx.core as mx

    from lattice_mlx import server as srv
    from lattice_mlx.decode import generate_step
    from lattice_mlx.sample import Sampler
    from lattice_mlx.speculative import SpecOptions

    model, _ = load(checkpoints["pattern"])
    srv.warm_up(model, SpecOptions(draft_tokens=2))
    steps, rounds = model.runtime.traces["steps"], model.runtime.traces["rounds"]
    assert {key[0][0] for key in steps} == {True, False}  # greedy, sampled
    assert {(key[0], key[1][0]) for key in rounds} == {(1, True), (2, True), (1, False), (2, False)}
    before = set(steps)
    for _ in zip(range(6), generate_step(model, mx.array([1, 2, 3]), sampler=Sampler(temp=0.6))):
        pass
    assert set(steps) == before


def test_warm_up_prefills_a_prompt_of_each_row_tile(checkpoints, monkeypatch):
    """Warm-up prefills a prompt of each of WARM_PROMPT_ROWS besides its 16-token generations (one per row tile of
    MLX's 4-bit matmul on CUDA, built once per machine: 74-78 s each on a fresh H100), on a request's (untrimmable)
    caches, with the hiddens where MTP is on."""
    from lattice_mlx import server as srv
    from lattice_mlx.speculative import SpecOptions

    seen = []
    real = srv.prefill

    def spy(model, ids, cache, **kw):
        assert not any(getattr(c, "trimmable", False) for c in cache)
        seen.append((ids.size, kw.get("return_hidden", False)))
        return real(model, ids, cache, **kw)

    monkeypatch.setattr(srv, "prefill", spy)
    model, _ = load(checkpoints["pattern"])
    srv.warm_up(model, None)
    assert seen == [(rows, False) for rows in srv.WARM_PROMPT_ROWS] and {24, 40} <= set(srv.WARM_PROMPT_ROWS)
    seen.clear()
    srv.warm_up(model, SpecOptions(draft_tokens=1))
    assert seen == [(rows, True) for rows in srv.WARM_PROMPT_ROWS]


def test_batched_warm_up_traces_every_batch_size(checkpoints, monkeypatch):
    """With --max-batch N, warm-up runs a traced batch step at every size 1..N, greedy and sampled; a batch at
    another temperature then adds no trace."""
    from lattice_mlx import server as srv
    from lattice_mlx.batch import BatchDecoder, BatchSteps
    from lattice_mlx.sample import Sampler

    sizes = set()
    step = BatchSteps.step

    def spy(self, cache, y, samplers, keys):
        sizes.add((samplers[0].greedy, y.shape[0]))
        return step(self, cache, y, samplers, keys)

    monkeypatch.setattr(BatchSteps, "step", spy)
    model, _ = load(checkpoints["pattern"])
    srv.warm_up(model, None, max_batch=3)
    assert sizes == {(g, b) for g in (True, False) for b in (1, 2, 3)}
    before = set(model.runtime.traces["batch_steps"])
    engine = BatchDecoder(model)
    for temp in (0.6, 1.3):
        engine.add([1, 2, 3], max_tokens=3, sampler=Sampler(temp=temp))
    while engine.busy:
        engine.step()
    assert set(model.runtime.traces["batch_steps"]) == before


def test_sampling_left_out_takes_the_checkpoints_generation_config(client, server):
    """The demo's generation_config.json asks for temperature 0.7: a request that gives none samples (at 0.7, as
    `generate` does; tests/server/test_protocol.py checks the values reach the sampler), not greedily. (Sampled MTP
    with an adaptive depth is not seed-for-seed repeatable: the depth follows measured times.)"""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=16)
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    assert any(client.completions.create(**kw, seed=s).choices[0].text != greedy for s in range(4))
    assert "default sampling: temp 0.7" in server[1].read_text()
