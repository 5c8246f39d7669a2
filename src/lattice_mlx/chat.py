"""A chat REPL: `python -m lattice_mlx.chat [--model M]`. The conversation's state is kept between turns (a prompt
cache: each turn prefills only what follows the previous turn's prompt, i.e. the reply and the new message) and MTP
speculation is on where the checkpoint has a head. Sampling flags left out take the checkpoint's generation_config.json,
as `generate` does. Type a message and Enter; `/reset` starts over; `/quit`, end of input or Ctrl-C at the prompt
leaves; Ctrl-C during a reply stops it and keeps the part shown."""

import argparse
import sys

try:  # line editing and history for input(); absent on some platforms, where input() still works
    import readline  # noqa: F401
except ImportError:
    pass

import mlx.core as mx

from .cli import ArgumentParser, command_name
from .generate import (
    DEFAULT_TEMP,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    SAMPLING_FLAGS,
    chat_ids,
    check_context,
    check_max_tokens,
    checkpoint_sampling,
    sampling_flags,
    stream_generate,
)
from .load import DEMO_MODEL, LoadError, keep_round_builds, load, resolve_path
from .prompt_cache import PromptCache
from .sample import Sampler
from .speculative import SpecOptions
from .startup import end_startup, interrupts_to_main

HELP = ("/reset starts a new conversation, /quit (or Ctrl-D, or Ctrl-C here) leaves; Ctrl-C during a reply stops it "
        "and keeps the part shown")


def setup_arg_parser() -> ArgumentParser:
    p = ArgumentParser(prog=command_name("lattice_mlx.chat"),
                       description="Chat with a Qwen3.5 model; the conversation's state is kept between turns.",
                       epilog=f"In the chat: {HELP}.")
    p.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: the embedded demo model)")
    p.add_argument("--system-prompt", help="a system message at the start of the conversation")
    p.add_argument("--max-tokens", type=int, default=256, help="per reply")
    p.add_argument("--temp", type=float, help=f"default: the checkpoint's, else {DEFAULT_TEMP} (greedy)")
    p.add_argument("--top-p", type=float, help=f"default: the checkpoint's, else {DEFAULT_TOP_P}")
    p.add_argument("--top-k", type=int, help=f"default: the checkpoint's, else {DEFAULT_TOP_K} (off)")
    p.add_argument("--min-p", type=float, help="default: the checkpoint's, else 0 (off)")
    p.add_argument("--generation-config", choices=["auto", "none"], default="auto",
                   help="auto: sampling flags left out take the checkpoint's generation_config.json (when it sets "
                   "do_sample); none: greedy unless flags say otherwise")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-mtp", action="store_true", help="plain decoding even when the checkpoint has an MTP head")
    p.add_argument("--allow-long-context", action="store_true",
                   help="go on past the model's context length (max_position_embeddings)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    return p


def start(args: argparse.Namespace):
    """(model, tokenizer, sampling flags, the checkpoint's among them); LoadError or ValueError for the user."""
    check_max_tokens(args.max_tokens)
    Sampler(**sampling_flags(args, {})[0])  # the flags given, before a checkpoint is fetched
    path = resolve_path(args.model) if args.model else None
    model, tokenizer = load(path, dtype=args.dtype)
    if model.has_mtp and not args.no_mtp:  # (chat speculates with adaptive depth: on CUDA its kernels, once)
        keep_round_builds(model)
    checkpoint = checkpoint_sampling(path or DEMO_MODEL) if args.generation_config == "auto" else {}
    sampling, from_checkpoint = sampling_flags(args, checkpoint)
    Sampler(**sampling)
    return model, tokenizer, sampling, from_checkpoint


def banner(sampling: dict, from_checkpoint: dict, speculation: SpecOptions | None) -> str:
    how = "greedy" if sampling["temp"] == 0 else ", ".join(
        f"{k} {v}" for k, v in sampling.items() if k == "temp" or v != SAMPLING_FLAGS[k][1])
    origin = " (the checkpoint's generation_config.json; --temp 0: greedy)" if from_checkpoint else ""
    return f"chat: {HELP}.\nsampling: {how}{origin}; MTP speculation {'on' if speculation else 'off'}"


def read_line(interactive: bool) -> str | None:
    """The next message, or None at end of input (Ctrl-D)."""
    try:
        return input(">> " if interactive else "")
    except EOFError:
        return None


def reply(model, tokenizer, ids: list[int], cache, args, sampling: dict, speculation) -> tuple[str, object]:
    """Streams one reply; returns its text (what was shown, when Ctrl-C stopped it) and the last response."""
    pieces, last = [], None
    try:
        for last in stream_generate(model, tokenizer, ids, max_tokens=args.max_tokens, **sampling,
                                    chat_template=False, speculation=speculation,
                                    prompt_cache=cache if len(ids) > 1 else None,
                                    allow_long_context=args.allow_long_context):
            print(last.text, end="", flush=True)
            pieces.append(last.text)
    except KeyboardInterrupt:
        print(" [stopped]", end="")
    print(flush=True)
    return "".join(pieces), last


def converse(model, tokenizer, args: argparse.Namespace, sampling: dict, speculation: SpecOptions | None) -> int:
    """The REPL's turns until /quit or end of input (Ctrl-C outside a reply reaches main())."""
    start_messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages, cache = list(start_messages), None
    interactive = sys.stdin.isatty()
    while True:
        line = read_line(interactive)
        if line is None or line.strip() == "/quit":
            return 0
        if line.strip() in ("/reset", "/help"):
            if line.strip() == "/reset":
                messages, cache = list(start_messages), None
            else:
                print(HELP, file=sys.stderr)
            continue
        if not line.strip():  # an empty line asks for nothing
            continue
        ids = chat_ids(tokenizer, [*messages, {"role": "user", "content": line}])
        try:
            check_context(model, len(ids), args.max_tokens, allow_long=args.allow_long_context)
        except ValueError as e:
            print(f"error: {e}: /reset starts over (or pass --allow-long-context)", file=sys.stderr)
            continue
        cached = 0
        if len(ids) > 1:  # the state after all but the last token, grown from the last turn's
            cached = cache.covers(ids[:-1]) if cache is not None else 0
            try:
                cache = PromptCache.build(model, ids[:-1], base=cache)
            except KeyboardInterrupt:  # stopped before the reply began: the message is dropped
                print("[stopped before the reply]", file=sys.stderr)
                cache = None
                continue
        messages.append({"role": "user", "content": line})
        text, last = reply(model, tokenizer, ids, cache, args, sampling, speculation)
        messages.append({"role": "assistant", "content": text})
        if last is not None:
            print(f"[{len(ids)} prompt tokens, {cached} from the last turn's cache, {last.generation_tokens} "
                  f"generated, {last.generation_tps:.1f} tok/s]", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """0 after /quit or end of input; 130 after Ctrl-C at the prompt (or while loading); 1 for a load error."""
    args = setup_arg_parser().parse_args(argv)
    try:
        interrupts_to_main()  # (inside the try: a Ctrl-C after it is caught below)
        model, tokenizer, sampling, from_checkpoint = start(args)
        end_startup()  # (the prompt's input() is a blocking read that Ctrl-C interrupts)
        mx.random.seed(args.seed)
        speculation = SpecOptions() if model.has_mtp and not args.no_mtp else None
        print(banner(sampling, from_checkpoint, speculation), file=sys.stderr)
        return converse(model, tokenizer, args, sampling, speculation)
    except (LoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted: bye", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
