"""Save the state after a prompt for later generations: `python -m lattice_mlx.cache_prompt --prompt TEXT
--prompt-cache-file PATH [--model M]`; then `python -m lattice_mlx.generate --prompt-cache-file PATH --prompt MORE`
prefills only MORE (prompt_cache.PromptCache)."""

import sys

from .cli import ArgumentParser, command_name
from .generate import check_context
from .load import LoadError, load
from .prompt_cache import PromptCache
from .startup import end_startup, interrupts_to_main

EPILOG = ("Then `python -m lattice_mlx.generate --prompt-cache-file PATH --prompt MORE` continues the cached prompt "
          "with MORE and prefills only MORE's tokens.")


def setup_arg_parser() -> ArgumentParser:
    p = ArgumentParser(prog=command_name("lattice_mlx.cache_prompt"), epilog=EPILOG,
                       description="Save the state after a prompt (a prompt cache) for later generations.")
    p.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: the embedded demo model)")
    p.add_argument("--prompt", required=True, help="the prompt (raw text, no chat template); '-' reads stdin")
    p.add_argument("--prompt-cache-file", required=True, help="the .safetensors file to write")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's own dtype")
    p.add_argument("--allow-long-context", action="store_true",
                   help="cache a prompt longer than the model's context length (max_position_embeddings)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    try:
        interrupts_to_main()  # (inside the try: a Ctrl-C after it is caught below)
        model, tokenizer = load(args.model, dtype=args.dtype)
        if args.prompt == "-":
            end_startup()  # (reading stdin: a blocking read that Ctrl-C interrupts)
        text = sys.stdin.read() if args.prompt == "-" else args.prompt
        ids = list(tokenizer.encode(text))
        try:
            check_context(model, len(ids), 0, allow_long=args.allow_long_context)
        except ValueError as e:
            raise ValueError(f"{e}: shorten the prompt, or pass --allow-long-context") from None
        PromptCache.build(model, ids).save(args.prompt_cache_file)
    except (LoadError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return 130
    print(f"saved the state after {len(ids)} prompt tokens to {args.prompt_cache_file}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
