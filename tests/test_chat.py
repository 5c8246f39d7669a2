"""The chat REPL as a new user meets it (on the embedded demo model, driven through a fake stdin): the banner, the
checkpoint's sampling defaults, Ctrl-C at the prompt and during a reply, and line editing."""

import importlib.util
import io

import pytest

from lattice_mlx import chat


class Stdin(io.StringIO):
    """Lines for input(); Ctrl-C (KeyboardInterrupt) where a line is "^C"."""

    def readline(self, *args):
        line = super().readline(*args)
        if line == "^C\n":
            raise KeyboardInterrupt
        return line


def run_chat(monkeypatch, capsys, text: str, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", Stdin(text))
    try:
        rc = chat.main(["--max-tokens", "4", *args])
    except KeyboardInterrupt:  # (escaping, it would stop the whole pytest session)
        pytest.fail("Ctrl-C escaped chat.main")
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def calls(monkeypatch):
    """Records each reply's stream_generate keywords and the messages its prompt was built from."""
    seen = {"kwargs": [], "messages": []}
    real_ids, real_stream = chat.chat_ids, chat.stream_generate

    def chat_ids(tokenizer, messages):
        seen["messages"].append([dict(m) for m in messages])
        return real_ids(tokenizer, messages)

    def stream_generate(*args, **kwargs):
        seen["kwargs"].append(kwargs)
        yield from real_stream(*args, **kwargs)

    monkeypatch.setattr(chat, "chat_ids", chat_ids)
    monkeypatch.setattr(chat, "stream_generate", stream_generate)
    return seen


def test_banner_names_the_commands(monkeypatch, capsys):
    rc, _, err = run_chat(monkeypatch, capsys, "/quit\n")
    assert rc == 0
    assert "/reset" in err and "/quit" in err and "Ctrl-C" in err


def test_sampling_defaults_come_from_the_checkpoint(monkeypatch, capsys, calls):
    """The demo's generation_config.json asks for temperature 0.7 (it was greedy in chat, sampled in generate)."""
    rc, _, err = run_chat(monkeypatch, capsys, "def add(a, b):\n/quit\n")
    assert rc == 0 and calls["kwargs"][-1]["temp"] == 0.7
    assert "temp 0.7 (the checkpoint's generation_config.json" in err
    rc, _, err = run_chat(monkeypatch, capsys, "def add(a, b):\n/quit\n", "--temp", "0")
    assert rc == 0 and calls["kwargs"][-1]["temp"] == 0 and "sampling: greedy" in err
    rc, _, err = run_chat(monkeypatch, capsys, "def add(a, b):\n/quit\n", "--generation-config", "none")
    assert rc == 0 and calls["kwargs"][-1]["temp"] == 0


def test_ctrl_c_at_the_prompt_leaves_in_one_line(monkeypatch, capsys):
    rc, _, err = run_chat(monkeypatch, capsys, "def add(a, b):\n^C\n")
    assert rc == 130 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "interrupted: bye"


def test_ctrl_c_during_a_reply_stops_it_and_keeps_the_conversation(monkeypatch, capsys, calls):
    """The part of the reply shown is kept as the assistant's turn; the next turn sees both earlier messages."""
    real = chat.stream_generate

    def stopped_after_two(*args, **kwargs):
        for n, r in enumerate(real(*args, **kwargs)):
            if n == 2 and len(calls["kwargs"]) == 1:
                raise KeyboardInterrupt
            yield r

    monkeypatch.setattr(chat, "stream_generate", stopped_after_two)
    rc, out, err = run_chat(monkeypatch, capsys, "def add(a, b):\nclass Stack:\n/quit\n", "--temp", "0")
    assert rc == 0 and "Traceback" not in err and "[stopped]" in out
    first, second = calls["messages"]
    assert [m["role"] for m in second] == ["user", "assistant", "user"]
    assert second[0] == first[0] and second[2]["content"] == "class Stack:"
    partial = second[1]["content"]
    assert partial and partial in out
    assert len([line for line in err.splitlines() if line.startswith("[")]) == 2  # both turns reported


def test_a_turn_past_the_context_is_refused_and_the_chat_goes_on(monkeypatch, capsys, calls):
    rc, _, err = run_chat(monkeypatch, capsys, "word " * 3000 + "\ndef add(a, b):\n/quit\n")
    assert rc == 0 and "Traceback" not in err
    assert "exceeds the model's context length (2,048 tokens)" in err
    assert len(calls["kwargs"]) == 1 and calls["messages"][-1] == [{"role": "user", "content": "def add(a, b):"}]


def test_ctrl_c_while_loading_is_one_line(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(chat, "load", interrupted)
    rc, _, err = run_chat(monkeypatch, capsys, "")
    assert rc == 130 and err.strip().splitlines() == ["interrupted: bye"]


@pytest.mark.skipif(importlib.util.find_spec("readline") is None, reason="no readline on this platform")
def test_messages_are_read_by_input_with_readline(monkeypatch, capsys):
    """input() after `import readline` gives line editing and history at a terminal."""
    asked = []
    monkeypatch.setattr("builtins.input", lambda prompt="": asked.append(prompt) or "/quit")
    rc, _, _ = run_chat(monkeypatch, capsys, "def add(a, b):\n")
    assert rc == 0 and asked == [""]  # (the ">> " prompt only at a terminal)
    assert chat.readline.__name__ == "readline"


def test_chat_builds_the_speculative_kernels_only_when_it_speculates(monkeypatch, capsys):
    """Chat speculates with adaptive depth on a checkpoint with a head: it asks for the once-per-machine builds of
    the adaptive loop's passes (load.keep_round_builds: a no-op off CUDA) with the loaded model; --no-mtp does not."""
    asked = []
    monkeypatch.setattr(chat, "keep_round_builds", lambda model: asked.append(model.has_mtp))
    assert run_chat(monkeypatch, capsys, "/quit\n")[0] == 0 and len(asked) == 1
    assert run_chat(monkeypatch, capsys, "/quit\n", "--no-mtp")[0] == 0 and len(asked) == 1
