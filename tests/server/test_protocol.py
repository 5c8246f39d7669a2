"""The server's rules one at a time, in-process: stop strings split across token pieces, every request field checked
to a 400 that names it, the context and token limits, which Host and Origin headers are answered, the model id, the
bounded queue and the two-signal stop."""

import signal

import pytest

from lattice_mlx import load
from lattice_mlx.sample import Sampler
from lattice_mlx.server import Engine, HTTPError, Job, Limits, Stopper, served_name
from lattice_mlx.server.http import Site, split_host
from lattice_mlx.server.protocol import BadRequest, StopScanner, parse_json, parse_request


def scan(stop: list[str], pieces: list[str]) -> tuple[str, bool]:
    s, sent, hit = StopScanner(stop), [], False
    for p in pieces:
        out, hit = s.add(p)
        sent.append(out)
        if hit:
            break
    if not hit:
        sent.append(s.flush())
    return "".join(sent), hit


@pytest.mark.parametrize("pieces", [["xx", "a", "b", "c", "yy"], ["xxa", "bc"], ["x", "x", "ab", "cyy"], ["xxabc"],
                                    list("xxabcyy")])
def test_a_stop_string_split_across_pieces_leaks_nothing(pieces):
    assert scan(["abc"], pieces) == ("xx", True)


def test_stop_scanner_sends_everything_that_cannot_become_a_stop():
    s = StopScanner(["abc"])
    assert s.add("xx") == ("", False) and s.add("a") == ("x", False) and s.add("bd") == ("xa", False)
    assert s.flush() == "bd"
    assert scan(["abc"], ["ab", "x", "ab"]) == ("abxab", False)  # a held tail that never completes is sent at the end
    assert scan(["zz", "b"], ["a", "bzz"]) == ("a", True)  # the earliest of several stop strings
    assert scan(["abc"], ["abc", "x"]) == ("", True)


class Tok:
    chat_template = None

    def encode(self, text):
        return [ord(c) % 100 for c in text]


LIMITS = Limits(default_max_tokens=512, max_tokens=1000, context=2048)


def req(body: dict, chat: bool = False, limits: Limits = LIMITS, defaults: dict | None = None):
    return parse_request(body, chat, Tok(), 100, limits, defaults or {})


@pytest.mark.parametrize("body, message", [
    ({"prompt": "x", "seed": -1}, "'seed' must be an integer in [0, 2**63 - 1]"),
    ({"prompt": "x", "seed": 2**64}, "'seed' must be an integer"),
    ({"prompt": "x", "seed": True}, "'seed' must be an integer"),
    ({"prompt": "x", "stream_options": 5}, "'stream_options' must be an object"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": "yes"}}, "'stream_options.include_usage'"),
    ({"prompt": "x", "stream": "yes"}, "'stream' must be true or false"),
    ({"prompt": "x", "temperature": "hot"}, "'temperature' must be a number"),
    ({"prompt": "x", "temperature": -1}, "'temperature' must be a finite number >= 0"),
    ({"prompt": "x", "top_p": 0}, "'top_p' must be in (0, 1]"),
    ({"prompt": "x", "top_k": 1.5}, "'top_k' must be an integer"),
    ({"prompt": "x", "min_p": 2}, "'min_p' must be in [0, 1]"),
    ({"prompt": "x", "max_tokens": 0}, "'max_tokens' must be >= 1"),
    ({"prompt": "x", "max_tokens": 1e9}, "'max_tokens' must be <= 1000 on this server"),
    ({"prompt": "x", "max_completion_tokens": 5000}, "'max_completion_tokens' must be <= 1000"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "'stop' may hold at most 4"),
    ({"prompt": "x", "stop": 5}, "'stop' must be"),
    ({"prompt": "x", "n": 2}, "only n = 1"),
    ({"prompt": 5}, "'prompt' must be"),
    ({"prompt": [1, 100]}, "token ids must be in [0, 100)"),
    ({"prompt": [1] * 2000, "max_tokens": 100}, "the prompt (2000 tokens) plus 'max_tokens' (100) exceeds the model's "
                                                "context length (2048 tokens)"),
    ({"prompt": [1] * 2048}, "the prompt (2048 tokens) leaves no room in the model's context length (2048 tokens)"),
])
def test_every_completion_field_is_checked_by_name(body, message):
    with pytest.raises(BadRequest) as e:
        req(body)
    assert message in str(e.value) and "--" not in str(e.value), str(e.value)


@pytest.mark.parametrize("messages, message", [
    ([], "'messages' must be a non-empty list"),
    ([{"role": "wizard", "content": "x"}], "'messages[0].role' must be one of"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": 5}]}],
     "'messages[1].content[0].text' must be a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "must be a text part"),
    ([{"role": "user", "content": 7}], "'messages[0].content' must be a string or a list of text parts"),
])
def test_every_chat_field_is_checked_by_name(messages, message):
    with pytest.raises(BadRequest, match=None) as e:
        req({"messages": messages}, chat=True)
    assert message in str(e.value), str(e.value)


def test_bodies_that_are_not_json_objects_and_numbers_json_does_not_allow():
    for data, message in [(b"{not json", "not valid JSON"), (b"[1]", "must be a JSON object"),
                          (b'{"prompt": "x", "temperature": NaN}', "NaN is not a number JSON allows"),
                          (b"\xff\xfe", "not valid JSON"), (b"[" * 100000 + b"]" * 100000, "not valid JSON")]:
        with pytest.raises(BadRequest, match=None) as e:
            parse_json(data)
        assert message in str(e.value), (data[:20], str(e.value))


def test_the_default_max_tokens_is_cut_to_the_context_and_the_checkpoint_sets_the_sampling():
    r = req({"prompt": [1] * 2040})
    assert r.max_tokens == 8  # what the context leaves, not the default 512
    assert req({"prompt": [1] * 3000, "max_tokens": 64}, limits=Limits(context=2048, allow_long_context=True)) \
        .max_tokens == 64
    r = req({"prompt": "x"}, defaults={"temp": 0.7, "top_p": 0.9})
    assert (r.sampler.temp, r.sampler.top_p) == (0.7, 0.9)
    r = req({"prompt": "x", "temperature": 0}, defaults={"temp": 0.7})
    assert r.sampler.temp == 0.0 and r.seed is None and r.stop == [] and not r.stream


def test_hosts_and_origins_the_server_answers_to():
    site = Site("127.0.0.1", 8080)
    for host in ("127.0.0.1:8080", "localhost:8080", "[::1]:8080", "LOCALHOST:8080"):
        assert site.host_ok(host), host
    for host in (None, "evil.com", "evil.com:8080", "127.0.0.1:9090", "127.0.0.1", "[::1", "localhost:80x", ""):
        assert not site.host_ok(host), host
    assert Site("127.0.0.1", 80).host_ok("localhost")
    assert Site("0.0.0.0", 8080).host_ok("127.0.0.1:8080") and not Site("0.0.0.0", 8080).host_ok("box.lan:8080")
    assert Site("0.0.0.0", 8080, hosts={"box.lan"}).host_ok("box.lan:8080")
    assert Site("10.0.0.5", 8080).host_ok("10.0.0.5:8080") and Site("1.2.3.4", 1, hosts={"*"}).host_ok("any")
    for origin in ("http://localhost:8080", "http://127.0.0.1:8080", "http://[::1]:8080"):
        assert site.origin_ok(origin), origin
    for origin in ("http://evil.com", "null", "http://localhost:9999", "file://", "http://localhost.evil.com:8080"):
        assert not site.origin_ok(origin), origin
    assert Site("127.0.0.1", 8080, origins={"https://app.example"}).origin_ok("https://app.example")
    assert split_host("[::1]:8080") == ("::1", 8080) and split_host("a:b") is None


def test_the_model_id_never_shows_a_local_path(tmp_path):
    ckpt = tmp_path / "my-model"
    ckpt.mkdir()
    assert served_name(str(ckpt)) == "my-model" and served_name(str(ckpt) + "/") == "my-model"
    assert served_name("Qwen/Qwen3.5-0.8B") == "Qwen/Qwen3.5-0.8B" and served_name(None) == "lattice-demo"
    assert served_name(str(ckpt), "given") == "given"


def job(n: int = 4) -> Job:
    return Job([1, 2, 3], n, Sampler(), [], None)


def test_the_queue_is_bounded_and_stopping_answers_everyone():
    model, tok = load()
    engine = Engine(model, tok, "m", None, max_queue=2)
    a, b = engine.submit(job()), engine.submit(job())
    with pytest.raises(HTTPError) as e:
        engine.submit(job())
    assert e.value.status == 503 and "Retry-After" in e.value.headers
    engine.stop()
    assert a.events.get_nowait() == ("error", "the server is shutting down") and b.cancelled.is_set()
    with pytest.raises(HTTPError) as e:
        engine.submit(job())
    assert e.value.status == 503 and "shutting down" in str(e.value)


def test_a_time_limit_ends_a_job_with_its_own_finish_reason():
    model, tok = load()
    engine = Engine(model, tok, "m", None)
    slow = job(400)
    slow.seconds = 0.0
    engine._generate(slow)
    events = [slow.events.get_nowait() for _ in range(slow.events.qsize())]
    assert events[-1][0] == "done" and events[-1][1]["finish_reason"] == "time_limit"
    assert events[-1][1]["usage"]["completion_tokens"] < 400


def test_the_second_signal_exits_at_once():
    model, tok = load()
    engine, exits = Engine(model, tok, "m", None), []
    stop = Stopper(engine, exit_now=exits.append)
    stop(signal.SIGTERM)
    assert engine.stopping.is_set() and exits == []
    stop(signal.SIGINT)
    assert exits == [128 + signal.SIGINT]
