"""What a request may say, checked field by field: OpenAI's completions and chat completions bodies to a `Request`,
or an `HTTPError` whose one-line message names the field. Messages name request fields, never command-line flags."""

import json
import math
import re
from dataclasses import dataclass

from ..generate import chat_ids
from ..sample import Sampler

MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_SEED = 2**63 - 1
ROLES = ("system", "user", "assistant", "developer", "tool")


class HTTPError(Exception):
    """A request the server refuses: an HTTP status, a one-line message for the client, an OpenAI error type."""

    status, kind = 400, "invalid_request_error"

    def __init__(self, message: str, status: int | None = None, kind: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status or self.status
        self.kind = kind or self.kind
        self.headers = headers or {}


class BadRequest(HTTPError):
    """HTTP 400: the body or one of its fields is wrong."""


@dataclass
class Limits:
    """What one request may ask of the server."""

    default_max_tokens: int = 512  # when a request gives none (then at most what the context leaves)
    max_tokens: int = 4096  # the most a request may ask for
    context: int = 2048  # prompt + max_tokens (the checkpoint's max_position_embeddings)
    allow_long_context: bool = False
    seconds: float = 600.0  # wall time per request, queue wait excluded; then finish_reason "time_limit"


@dataclass
class Request:
    ids: list[int]
    max_tokens: int
    sampler: Sampler
    stop: list[str]
    seed: int | None
    stream: bool
    include_usage: bool


def _reject_constant(name: str):
    raise BadRequest(f"the body is not valid JSON: {name} is not a number JSON allows")


def parse_json(data: bytes) -> dict:
    try:
        body = json.loads(data, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not valid JSON: {e}") from None
    except RecursionError:
        raise BadRequest("the body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _number(body: dict, name: str, default, *, integer: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise BadRequest(f"'{name}' must be a{'n integer' if integer else ' number'}, got {v!r}"[:200])
    if integer:
        if not float(v).is_integer():
            raise BadRequest(f"'{name}' must be an integer, got {v!r}")
        return int(v)
    return float(v)


def sampler_from(body: dict, defaults: dict) -> Sampler:
    """temperature, top_p, top_k and min_p: the request's, else the checkpoint's recommendation, else off."""
    temp = _number(body, "temperature", defaults.get("temp", 0.0))
    top_p = _number(body, "top_p", defaults.get("top_p", 1.0))
    top_k = _number(body, "top_k", defaults.get("top_k", 0), integer=True)
    min_p = _number(body, "min_p", defaults.get("min_p", 0.0))
    if temp < 0:
        raise BadRequest(f"'temperature' must be a finite number >= 0, got {temp!r}")
    if not 0 < top_p <= 1:
        raise BadRequest(f"'top_p' must be in (0, 1], got {top_p!r}")
    if top_k < 0:
        raise BadRequest(f"'top_k' must be an integer >= 0 (0: off), got {top_k!r}")
    if not 0 <= min_p <= 1:
        raise BadRequest(f"'min_p' must be in [0, 1] (0: off), got {min_p!r}")
    try:
        return Sampler(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    except ValueError as e:  # a rule the checks above do not know: its text without the command line's flag names
        raise BadRequest(re.sub(r" \(--[a-z-]+\)", "", str(e))) from None


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or not stop:
        raise BadRequest("'stop' must be a non-empty string or a list of them")
    if len(stop) > MAX_STOP:
        raise BadRequest(f"'stop' may hold at most {MAX_STOP} strings, got {len(stop)}")
    return stop


def _messages(body: dict) -> list[dict]:
    """OpenAI chat messages to {role, content} with text content (a list of text parts is joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"'messages[{i}].role' must be one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type", "text") != "text":
                    raise BadRequest(f"'messages[{i}].content[{j}]' must be a text part ({{\"type\": \"text\", "
                                     "\"text\": ...}); this server reads text only")
                if not isinstance(part.get("text"), str):
                    raise BadRequest(f"'messages[{i}].content[{j}].text' must be a string")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise BadRequest(f"'messages[{i}].content' must be a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    return out


def prompt_ids(body: dict, chat: bool, tokenizer, vocab_size: int) -> list[int]:
    if chat:
        try:
            return chat_ids(tokenizer, _messages(body))
        except BadRequest:
            raise
        except Exception as e:  # the checkpoint's chat template refused the conversation
            raise BadRequest(f"the chat template could not format 'messages': {e}"[:300]) from None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < vocab_size for t in prompt):
            raise BadRequest(f"'prompt' token ids must be in [0, {vocab_size})")
        return prompt
    raise BadRequest("'prompt' must be a non-empty string or a list of token ids")


def max_tokens_for(body: dict, n_prompt: int, limits: Limits) -> int:
    """The request's max_tokens (or max_completion_tokens) within the server's cap and the context; without one,
    the server's default, cut to what the context leaves."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    asked = _number(body, name, None, integer=True)
    if asked is not None and asked < 1:
        raise BadRequest(f"'{name}' must be >= 1, got {asked}")
    if asked is not None and asked > limits.max_tokens:
        raise BadRequest(f"'{name}' must be <= {limits.max_tokens} on this server, got {asked}")
    room = limits.context - n_prompt
    if limits.allow_long_context:
        return asked or limits.default_max_tokens
    if asked is None:
        if room < 1:
            raise BadRequest(f"the prompt ({n_prompt} tokens) leaves no room in the model's context length "
                             f"({limits.context} tokens)")
        return min(limits.default_max_tokens, room)
    if n_prompt + asked > limits.context:
        raise BadRequest(f"the prompt ({n_prompt} tokens) plus '{name}' ({asked}) exceeds the model's context "
                         f"length ({limits.context} tokens)")
    return asked


def parse_request(body: dict, chat: bool, tokenizer, vocab_size: int, limits: Limits,
                  sampling_defaults: dict) -> Request:
    """Every field this server reads, checked; fields it does not read are ignored, as OpenAI-compatible servers
    do (clients send user, presence_penalty, ... by default)."""
    if body.get("n", 1) != 1:
        raise BadRequest("only n = 1 is supported")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object")
    include_usage = (options or {}).get("include_usage", False)
    if include_usage is None:
        include_usage = False
    if not isinstance(include_usage, bool):
        raise BadRequest("'stream_options.include_usage' must be true or false")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED):
        raise BadRequest(f"'seed' must be an integer in [0, 2**63 - 1], got {seed!r}"[:200])
    sampler = sampler_from(body, sampling_defaults)
    stop = _stop(body)
    ids = prompt_ids(body, chat, tokenizer, vocab_size)
    max_tokens = max_tokens_for(body, len(ids), limits)
    return Request(ids, max_tokens, sampler, stop, seed, stream, include_usage)


class StopScanner:
    """Cuts generated text at the first stop string, wherever the token pieces split it; holds back a tail that
    could still become one, so no part of a stop string is ever sent."""

    def __init__(self, stop: list[str]):
        self.stop, self.text, self.sent = stop, "", 0
        self.hold = max((len(s) for s in stop), default=1) - 1

    def add(self, piece: str) -> tuple[str, bool]:
        """The text that may be sent now, and whether a stop string was found."""
        self.text += piece
        start = max(0, self.sent - self.hold)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            cut = min(hits)
            out, self.sent = self.text[self.sent : cut], max(self.sent, cut)
            return out, True
        upto = max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent : upto], upto
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out
