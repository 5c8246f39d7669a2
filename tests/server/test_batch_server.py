"""The server with continuous batching (`--max-batch` > 1): concurrent requests decode together, each gets the text it
would get alone (greedy, fp32), streaming and stop strings work per request, and a client leaving frees its row while
the others go on."""

import threading

import pytest

openai = pytest.importorskip("openai", reason="the test extra installs openai")

from test_server import MODEL, PROMPT, _cancelled_after, _client, _served, _streaming  # noqa: E402

from lattice_mlx import generate, load  # noqa: E402

PROMPTS = [PROMPT, "import os\n", "class Stack:\n    def", "# a comment\nx = "]


@pytest.fixture(scope="module")
def batch_server(tmp_path_factory):
    with _served(tmp_path_factory.mktemp("bserver"), "--max-batch", "3", "--dtype", "float32", "--no-warmup") as s:
        yield s


@pytest.fixture(scope="module")
def bclient(batch_server):
    return _client(batch_server[0])


def test_concurrent_requests_each_get_their_single_generation(bclient, batch_server):
    """Four requests at once into three rows (the fourth joins when one leaves), budgets of their own."""
    model, tok = load(dtype="float32")
    budgets = [20, 7, 14, 10]
    want = [generate(model, tok, p, max_tokens=n, chat_template=False, speculation=None).text
            for p, n in zip(PROMPTS, budgets)]
    got = [None] * len(PROMPTS)

    def ask(i):
        got[i] = bclient.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=budgets[i], temperature=0)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i, r in enumerate(got):
        assert r.choices[0].text == want[i], i
        assert r.usage.completion_tokens == budgets[i] and r.choices[0].finish_reason == "length"
    assert "up to 3 requests batched" in batch_server[1].read_text()


def test_a_request_alone_joins_the_batch_when_another_arrives(bclient, batch_server):
    """A lone request decodes as a single generation (MTP's pipelined rounds here) until a second arrives; then it
    goes on in the batch from the tokens it has: both texts are their single generations (greedy, fp32), the first's
    usage counts its tokens from both parts."""
    model, tok = load(dtype="float32")
    want = [generate(model, tok, p, max_tokens=n, chat_template=False, speculation=None).text
            for p, n in ((PROMPTS[2], 40), (PROMPTS[1], 8))]
    stream = bclient.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=40, temperature=0, stream=True,
                                        stream_options={"include_usage": True})
    chunks = [next(stream)]  # it is decoding, alone
    second = bclient.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    chunks += list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want[0]
    assert chunks[-1].usage.completion_tokens == 40
    assert second.choices[0].text == want[1]
    joined = [line for line in batch_server[1].read_text().splitlines() if "joins the batch after" in line]
    assert joined and 0 < int(joined[-1].split("after ")[1].split()[0]) < 40


def test_streaming_and_stop_strings_per_request(bclient):
    full = bclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = full[8:11]
    chunks = list(bclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, stop=[stop], stream=True,
                                             temperature=0))
    text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    assert text == full[: full.find(stop)] and finish == "stop"


def test_a_client_leaving_frees_its_row_and_the_others_go_on(bclient, batch_server):
    port, log = batch_server
    before = len(log.read_text())
    sock = _streaming(port)
    other = bclient.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=6, temperature=0)
    sock.close()
    assert other.usage.completion_tokens == 6
    assert bclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                      temperature=0).usage.completion_tokens == 4
    assert _cancelled_after(log, before) < 2000


@pytest.fixture(scope="module")
def plain_batch_server(tmp_path_factory):
    """The port of a batching server decoding plainly (--no-mtp)."""
    with _served(tmp_path_factory.mktemp("pserver"), "--max-batch", "3", "--dtype", "float32", "--no-warmup",
                 "--no-mtp") as (port, log):
        _LOGS[port] = log
        yield port


_LOGS: dict = {}


def plain_batch_server_log(port: int) -> str:
    return _LOGS[port].read_text()


def test_a_conversations_next_turn_prefills_only_its_new_tokens(plain_batch_server):
    """Batched plain decoding too keeps the state after the newest prompt: the next turn reports the reused tokens,
    and its text is a fresh generation's. (Batched MTP rounds prefill every prompt whole: the head's rows.)"""
    bclient = _client(plain_batch_server)
    model, tok = load(dtype="float32")
    turn1 = tok.encode("def fib(n):\n    ")
    bclient.completions.create(model=MODEL, prompt=turn1, max_tokens=6, temperature=0)
    turn2 = turn1 + tok.encode("if n < 2:\n        return n\n    ")
    r2 = bclient.completions.create(model=MODEL, prompt=turn2, max_tokens=10, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens == len(turn1) - 1
    assert r2.choices[0].text == generate(model, tok, turn2, max_tokens=10, chat_template=False,
                                          speculation=None).text


def test_a_seeded_request_handed_to_the_batch_keeps_its_lone_text(plain_batch_server, tmp_path):
    """A seeded request that starts alone (the single generation's path, seeding MLX's global generator) and is
    handed to the batch when another arrives goes on with the key its next token would have drawn alone: its text
    equals its text alone (fp32, plain decoding). Keyed by its seed again at the hand-off, the batch redrew its
    first tokens' numbers and the text changed there."""
    bclient = _client(plain_batch_server)
    kw = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=120, temperature=1.0, seed=7)
    alone = bclient.completions.create(**kw).choices[0].text
    chunks, mate = [], None
    for chunk in bclient.completions.create(**kw, stream=True):
        chunks.append(chunk.choices[0].text if chunk.choices else "")
        if mate is None and len(chunks) >= 3:  # it streams alone: now another request arrives
            mate = threading.Thread(target=lambda: bclient.completions.create(
                model=MODEL, prompt=PROMPTS[0], max_tokens=60, temperature=0.9))
            mate.start()
    mate.join(timeout=300)
    assert "".join(chunks) == alone
    log = plain_batch_server_log(plain_batch_server)
    assert "request joins the batch after" in log, log[-2000:]


def test_a_seeded_request_samples_the_same_text_beside_others(plain_batch_server):
    """A request's seed keys its own stream: its sampled text alone equals its text beside sampled batch-mates.
    (Plain decoding: with adaptive MTP the batch's depth, chosen from measured times, decides how draws are used.)
    The batch-mates are streaming before it is sent, so it runs in the batch from its first token (a request that
    starts alone and is handed over has the next test)."""
    bclient = _client(plain_batch_server)
    kw = dict(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=1.3)
    alone = bclient.completions.create(**kw, seed=42).choices[0].text
    started = [threading.Event() for _ in range(2)]

    def mate(i: int) -> None:
        for _ in bclient.completions.create(model=MODEL, prompt=PROMPTS[i], max_tokens=400, temperature=0.9,
                                            stream=True):
            started[i].set()

    threads = [threading.Thread(target=mate, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    assert all(e.wait(timeout=120) for e in started)
    beside = bclient.completions.create(**kw, seed=42).choices[0].text
    for t in threads:
        t.join(timeout=300)
    assert beside == alone
    assert bclient.completions.create(**kw, seed=43).choices[0].text != alone


@pytest.mark.parametrize("mtp", [False, True])
def test_a_hand_off_leaves_the_global_generator_off_the_seeds_stream(mtp):
    """At a seeded request's hand-off the row goes on with a key on its seed's stream (plain: the key its next token
    draws with), and the global generator, which unseeded requests draw from, is keyed afresh: it is on no key of
    that stream, and its next draw is none of the row's."""
    from types import SimpleNamespace

    import mlx.core as mx

    from lattice_mlx import SpecOptions
    from lattice_mlx.sample import Sampler
    from lattice_mlx.server.engine import BatchEngine, Job, unseed

    job = Job([1, 2], 8, Sampler(temp=1.0), [], 11)
    mx.random.seed(11)
    for _ in range(5):  # a lone run's draws
        mx.random.uniform()
    owner = SimpleNamespace(speculation=SpecOptions() if mtp else None)
    key = BatchEngine._stream_on(owner, job, 5)
    chain = [mx.random.key(11)]
    for _ in range(60):
        chain.append(mx.random.split(chain[-1])[0])
    if not mtp:
        assert mx.array_equal(key, chain[5]).item()
    unseed()
    state = mx.random.state[0]
    assert not any(mx.array_equal(state, c).item() for c in chain)
    row = [mx.random.uniform(key=mx.random.split(c)[1]).item() for c in chain[5:20]]
    assert mx.random.uniform().item() not in row
