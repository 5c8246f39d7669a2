"""Save the state after a prompt for later generations: `python -m lattice_mlx.cache_prompt --prompt TEXT
--prompt-cache-file PATH [--model M]`; then `python -m lattice_mlx.generate --prompt-cache-file PATH --prompt MORE`
prefills only MORE (prompt_cache.PromptCache)."""

import sys

from .cli import ArgumentParser
from .load import LoadError, load
from .prompt_cache import PromptCache


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m lattice_mlx.cache_prompt", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory or Hugging Face repo id (default: the embedded demo model)")
    p.add_argument("--prompt", required=True, help="the prompt (raw text, no chat template); '-' reads stdin")
    p.add_argument("--prompt-cache-file", required=True, help="the .safetensors file to write")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's own dtype")
    args = p.parse_args(argv)
    try:
        model, tokenizer = load(args.model, dtype=args.dtype)
        text = sys.stdin.read() if args.prompt == "-" else args.prompt
        ids = list(tokenizer.encode(text))
        PromptCache.build(model, ids).save(args.prompt_cache_file)
    except (LoadError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"saved the state after {len(ids)} prompt tokens to {args.prompt_cache_file}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
