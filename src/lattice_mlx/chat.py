"""A chat REPL: `python -m lattice_mlx.chat [--model M]`. The conversation's state is kept between turns (a prompt
cache: each turn prefills only what follows the previous turn's prompt, i.e. the reply and the new message) and MTP speculation is on where the checkpoint
has a head. Type a message and Enter; `/reset` starts over; `/quit` or end of input leaves."""

import sys

import mlx.core as mx

from .cli import ArgumentParser
from .generate import DEFAULT_TEMP, DEFAULT_TOP_K, DEFAULT_TOP_P, chat_ids, check_max_tokens, stream_generate
from .load import LoadError, load
from .prompt_cache import PromptCache
from .sample import Sampler
from .speculative import SpecOptions


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m lattice_mlx.chat", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: the embedded demo model)")
    p.add_argument("--system-prompt", help="a system message at the start of the conversation")
    p.add_argument("--max-tokens", type=int, default=256, help="per reply")
    p.add_argument("--temp", type=float, default=DEFAULT_TEMP)
    p.add_argument("--top-p", type=float, default=DEFAULT_TOP_P)
    p.add_argument("--top-k", type=int, default=DEFAULT_TOP_K)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-mtp", action="store_true", help="plain decoding even when the checkpoint has an MTP head")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args(argv)
    try:
        check_max_tokens(args.max_tokens)
        Sampler(temp=args.temp, top_p=args.top_p, top_k=args.top_k)
        model, tokenizer = load(args.model, dtype=args.dtype)
    except (LoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    mx.random.seed(args.seed)
    speculation = SpecOptions() if model.has_mtp and not args.no_mtp else None
    start = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    messages, cache = list(start), None
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            print(">> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line or line.strip() == "/quit":
            return 0
        if line.strip() == "/reset":
            messages, cache = list(start), None
            continue
        if not line.strip():  # an empty line asks for nothing
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = chat_ids(tokenizer, messages)
        cached = 0
        if len(ids) > 1:  # the state after all but the last token, grown from the last turn's
            cached = cache.covers(ids[:-1]) if cache is not None else 0
            cache = PromptCache.build(model, ids[:-1], base=cache)
        reply = []
        for r in stream_generate(model, tokenizer, ids, max_tokens=args.max_tokens, temp=args.temp,
                                 top_p=args.top_p, top_k=args.top_k, chat_template=False, speculation=speculation,
                                 prompt_cache=cache if len(ids) > 1 else None):
            print(r.text, end="", flush=True)
            reply.append(r.text)
        print()
        print(f"[{len(ids)} prompt tokens, {cached} from the last turn's cache, {r.generation_tokens} generated, "
              f"{r.generation_tps:.1f} tok/s]", file=sys.stderr)
        messages.append({"role": "assistant", "content": "".join(reply)})


if __name__ == "__main__":
    sys.exit(main())
