"""Plain and speculative decode loops, and `python -m lattice_mlx.generate`."""

import argparse
import json
import os
import sys
import time
from collections.abc import Generator, Iterator
from dataclasses import asdict, dataclass, field

import mlx.core as mx

from .sample import Sampler

DEFAULT_PROMPT = "def fibonacci(n):"
DEFAULT_MAX_TOKENS = 128
DEFAULT_TEMP = 0.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
DEFAULT_SEED = 0
DEFAULT_DRAFT_TOKENS = 2
PREFILL_STEP = 512


def prefill(model, ids: mx.array, cache: list, *, step: int = PREFILL_STEP, hidden: str | None = None):
    """Runs the prompt [T] through the model in chunks; returns the last position's logits [V] and, when asked, the
    final hidden of every prompt position [T, H] ("post" = after the final norm, "pre" = before it)."""
    hs = []
    for start in range(0, ids.size, step):
        h = model.model(ids[None, start : start + step], cache)
        mx.eval([c.state for c in cache])
        if hidden is not None:
            hs.append(model.model.norm(h) if hidden == "post" else h)
    logits = model.lm_logits(model.model.norm(h[:, -1:]))[0, -1]
    return logits, (mx.concatenate(hs, axis=1)[0] if hidden is not None else None)


def generate_step(model, ids: mx.array, *, sampler: Sampler, cache: list | None = None) -> Iterator[int]:
    """Plain decoding: one target forward per token; the next step is queued before the current token is yielded."""
    cache = cache if cache is not None else model.make_cache()
    logits, _ = prefill(model, ids, cache)
    y = sampler(logits)
    mx.async_eval(y)
    while True:
        next_y = sampler(model(y.reshape(1, 1), cache)[0, -1])
        mx.async_eval(next_y)
        yield y.item()
        y = next_y


@dataclass
class GenerationResponse:
    text: str
    token: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory_gb: float
    finish_reason: str | None = None
    mtp: dict | None = None


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float
    finish_reason: str
    mtp: dict | None = field(default=None)

    def to_json(self) -> dict:
        out = asdict(self)
        if self.mtp is None:
            out.pop("mtp")
        else:
            out.update(out.pop("mtp"))
        return out


def encode_prompt(tokenizer, prompt: str | list[int], *, chat_template: bool = True) -> list[int]:
    if not isinstance(prompt, str):
        return list(prompt)
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return list(tokenizer.encode(prompt))


def token_stream(model, ids: mx.array, sampler: Sampler, *, draft: str | None, tree: str | None, draft_tokens: int,
                 verify: str, mtp_hidden: str, adaptive: bool) -> tuple[Iterator[int], object | None]:
    """The token iterator for the chosen decoding (plain, chain speculation, or tree) and the stats it fills."""
    if tree:
        from .tree import TreeStats, parse_shape, tree_step

        stats = TreeStats(parse_shape(tree))
        return tree_step(model, ids, sampler=sampler, shape=stats.shape, stats=stats, mtp_hidden=mtp_hidden), stats
    if draft:
        from .speculative import SpecStats, speculative_step

        stats = SpecStats(draft_tokens=draft_tokens, verify=verify, source=draft)
        return speculative_step(model, ids, sampler=sampler, stats=stats, draft_tokens=draft_tokens, verify=verify,
                                mtp_hidden=mtp_hidden, adaptive=adaptive, draft=draft), stats
    return generate_step(model, ids, sampler=sampler), None


def stream_generate(
    model, tokenizer, prompt: str | list[int], *, max_tokens: int = DEFAULT_MAX_TOKENS, temp: float = DEFAULT_TEMP,
    top_p: float = DEFAULT_TOP_P, top_k: int = DEFAULT_TOP_K, chat_template: bool = True, mtp: bool = False,
    draft_tokens: int = DEFAULT_DRAFT_TOKENS, verify: str = "batched", mtp_hidden: str = "post",
    adaptive: bool = False, draft: str | None = None, tree: str | None = None,
) -> Generator[GenerationResponse, None, None]:
    """Yields one response per generated token (text piece and id); the last one carries finish_reason and stats.
    Speculative decoding: mtp=True (the MTP head) or draft='mtp' | 'self[:LAYERS]' | 'ngram' | 'mtp+ngram';
    tree='2-2-1' verifies a tree of MTP drafts (top-k per depth) instead of a chain."""
    ids = encode_prompt(tokenizer, prompt, chat_template=chat_template)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    sampler = Sampler(temp=temp, top_p=top_p, top_k=top_k)
    tokens, stats = token_stream(model, mx.array(ids), sampler, draft=draft or ("mtp" if mtp else None), tree=tree,
                                 draft_tokens=draft_tokens, verify=verify, mtp_hidden=mtp_hidden, adaptive=adaptive)
    detok = tokenizer.detokenizer
    detok.reset()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    prompt_tps = 0.0
    for n, token in enumerate(tokens, start=1):
        if n == 1:
            prompt_time = time.perf_counter() - tic
            prompt_tps = len(ids) / prompt_time
            tic = time.perf_counter()
        finish = "stop" if token in tokenizer.eos_token_ids else ("length" if n >= max_tokens else None)
        if token not in tokenizer.eos_token_ids:
            detok.add_token(token)
        if finish:
            detok.finalize()
        elapsed = time.perf_counter() - tic
        yield GenerationResponse(
            text=detok.last_segment, token=token, prompt_tokens=len(ids), prompt_tps=prompt_tps,
            generation_tokens=n, generation_tps=(n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0,
            peak_memory_gb=mx.get_peak_memory() / 1e9, finish_reason=finish,
            mtp=stats.to_dict() if (finish and stats is not None) else None,
        )
        if finish:
            break


def generate(model, tokenizer, prompt: str | list[int], *, on_text=None, **kwargs) -> GenerationResult:
    """Runs `stream_generate` to the end (same keyword options); `on_text(piece)` sees the text as it streams."""
    tokens, pieces, last = [], [], None
    for last in stream_generate(model, tokenizer, prompt, **kwargs):
        tokens.append(last.token)
        pieces.append(last.text)
        if on_text is not None:
            on_text(last.text)
    return GenerationResult(
        tokens=tokens, text="".join(pieces), prompt_tokens=last.prompt_tokens, generation_tokens=len(tokens),
        prompt_tps=last.prompt_tps, generation_tps=last.generation_tps, peak_memory_gb=last.peak_memory_gb,
        finish_reason=last.finish_reason, mtp=last.mtp,
    )


class ArgumentParser(argparse.ArgumentParser):
    """Flag errors end in one line (no usage block) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _positive_int(lo: int, hi: int | None = None):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is outside {lo}..{hi if hi is not None else 'inf'}")
        return v

    return parse


def _float_in(lo: float, hi: float, *, lo_open: bool = False):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
        if not (lo < v if lo_open else lo <= v) or v > hi:
            raise argparse.ArgumentTypeError(f"{v} is outside {'(' if lo_open else '['}{lo}, {hi}]")
        return v

    return parse


def setup_arg_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m lattice_mlx.generate", description="Generate text with a Qwen3.5 model.")
    p.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: the embedded demo model)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="prompt text; '-' reads standard input")
    p.add_argument("--max-tokens", type=_positive_int(1), default=DEFAULT_MAX_TOKENS)
    p.add_argument("--temp", type=_float_in(0.0, 100.0), default=DEFAULT_TEMP)
    p.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=DEFAULT_TOP_P)
    p.add_argument("--top-k", type=_positive_int(0), default=DEFAULT_TOP_K)
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's own dtype")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--json", action="store_true", help="print one JSON object with tokens and stats as the last line")
    p.add_argument("--mtp", action="store_true", help="MTP speculative decoding (also LATTICE_MTP=1)")
    p.add_argument("--draft", help="draft source: mtp, self[:LAYERS] (LATTICE_SELF_SPEC=1), ngram, mtp+ngram")
    p.add_argument("--draft-tokens", type=_positive_int(1, 8), default=DEFAULT_DRAFT_TOKENS, help="draft depth K")
    p.add_argument("--verify", choices=["batched", "sequential"], help="verifier (LATTICE_MTP_BATCH=0: sequential)")
    p.add_argument("--mtp-hidden", choices=["post", "pre"], default="post", help="target hidden fed to the MTP head")
    p.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True,
                   help="tune K from acceptance and turn speculation off when it cannot pay (default on; "
                        "--no-adaptive keeps K fixed, e.g. for benchmarks)")
    p.add_argument("--tree", help="verify a tree of MTP drafts, widths per depth, e.g. 2-2-1")
    return p


def run(args: argparse.Namespace) -> GenerationResult:
    from .load import load

    draft = args.draft or ("mtp" if args.mtp or os.environ.get("LATTICE_MTP", "0") == "1" else None)
    if draft is None and os.environ.get("LATTICE_SELF_SPEC", "0") == "1":
        draft = "self"
    verify = args.verify or ("sequential" if os.environ.get("LATTICE_MTP_BATCH", "1") == "0" else "batched")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    mx.random.seed(args.seed)
    model, tokenizer = load(args.model, dtype=args.dtype)
    if (draft == "mtp" or args.tree) and not model.has_mtp:
        raise ValueError("--mtp needs MTP weights (mtp.*), and this checkpoint has none: drop --mtp")
    result = generate(
        model, tokenizer, prompt, max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, top_k=args.top_k,
        chat_template=not args.no_chat_template, draft=draft, draft_tokens=args.draft_tokens, verify=verify,
        mtp_hidden=args.mtp_hidden, adaptive=args.adaptive, tree=args.tree,
        on_text=lambda t: print(t, end="", flush=True),
    )
    print()
    print(
        f"prompt: {result.prompt_tokens} tokens, {result.prompt_tps:.1f} tok/s | generation: "
        f"{result.generation_tokens} tokens, {result.generation_tps:.1f} tok/s | peak memory: "
        f"{result.peak_memory_gb:.3f} GB", file=sys.stderr,
    )
    if result.mtp and "tree" in result.mtp:
        m = result.mtp
        print(f"tree {m['tree']}: {m['mean_accepted_length']:.2f} drafts accepted per round, {m['rounds']} rounds",
              file=sys.stderr)
    elif result.mtp:
        m = result.mtp
        print(f"{m['draft_source']} drafts: acceptance {m['acceptance_rate']:.2f} per position "
              f"{[round(a, 2) for a in m['accepted_per_position']]}, {m['rounds']} rounds"
              + "".join(f"; {d}" for d in m.get("decisions", [])), file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    from .load import LoadError

    args = setup_arg_parser().parse_args(argv)
    try:
        result = run(args)
    except (LoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(result.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
