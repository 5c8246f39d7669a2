"""Command-line plumbing shared by the entry modules: one-line flag errors and the speculation flags (with the one
environment switch, LATTICE_MTP) turned into SpecOptions. Value ranges are checked by the API's own objects."""

import argparse
import sys
from pathlib import Path

from . import settings
from .speculative import MAX_DRAFT_TOKENS, VERIFIERS, SpecOptions
from .speculative.options import ADAPTIVE_MAX_K, FIXED_K


class ArgumentParser(argparse.ArgumentParser):
    """Flag errors end in one line (no usage block) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def command_name(module: str) -> str:
    """The name a command's help and errors use: the console script it was started as (`lattice-generate`), else
    `python -m <module>` (run with -m, or main() called from another program, e.g. pytest)."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return name if name.startswith("lattice") and not name.endswith(".py") else f"python -m {module}"


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    defaults = SpecOptions()
    g = p.add_argument_group("speculative decoding (off unless --mtp, --draft, --tree or LATTICE_MTP=1)")
    on = g.add_mutually_exclusive_group()
    on.add_argument("--mtp", action="store_true", help="draft with the checkpoint's MTP head (= --draft mtp; an "
                    "error on a checkpoint without one)")
    on.add_argument("--no-mtp", action="store_true", help="plain decoding, whatever LATTICE_MTP says")
    g.add_argument("--draft", help="draft source: mtp, self[:LAYERS], ngram, mtp+ngram")
    g.add_argument("--draft-tokens", type=int,
                   help=f"draft depth K, 1..{MAX_DRAFT_TOKENS} (the largest, when adaptive); default "
                        f"{ADAPTIVE_MAX_K} adaptive, {FIXED_K} with --no-adaptive")
    g.add_argument("--verify", default=defaults.verify,
                   help=f"verifier: auto (pipelined for MTP chains, batched otherwise) or {' or '.join(VERIFIERS)}")
    g.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=defaults.adaptive,
                   help="tune K from acceptance and cost and turn speculation off when it cannot pay (--no-adaptive "
                        "keeps K fixed, e.g. for benchmarks)")
    g.add_argument("--tree", help="verify a tree of MTP drafts, widths per depth, e.g. 2-2-1")


def speculation_from_args(args: argparse.Namespace) -> tuple[SpecOptions, str]:
    """(SpecOptions from the flags above, when they apply: 'on' (asked for: --mtp, --draft, --tree), 'off' (--no-mtp)
    or 'auto' (neither: `speculation`)). A bad combination is a ValueError, checked before any model loads."""
    from . import decode
    from .metal import dequant_rows
    from .speculative import pipelined as rounds

    # LATTICE_TRACE_ROUNDS, LATTICE_TRACE_STEPS, LATTICE_MTP, LATTICE_KERNEL_CACHE and LATTICE_DEQUANT_ROWS checked
    # up front
    rounds.tracing_enabled()
    decode.tracing_enabled()
    settings.on("mtp")
    settings.on("kernel_cache")
    dequant_rows()
    if args.mtp and args.draft not in (None, "mtp"):
        raise ValueError(f"--mtp and --draft {args.draft} name two draft sources: pass one")
    asked = args.mtp or args.draft is not None or args.tree is not None
    if args.no_mtp and asked:
        raise ValueError("--no-mtp and " + ("--draft" if args.draft else "--tree") + " contradict each other: "
                         "pass one")
    options = SpecOptions(draft=args.draft or "mtp", draft_tokens=args.draft_tokens, verify=args.verify,
                          adaptive=args.adaptive, tree=args.tree)  # checked even when speculation stays off
    return options, "on" if asked else ("off" if args.no_mtp else "auto")


def resolve_speculation(model, options: SpecOptions, when: str) -> SpecOptions | None:
    """The options `speculation_from_args` gave, for this model: 'auto' speculates where `auto_applies`
    (LATTICE_MTP=1 and a head), silently decoding plainly elsewhere."""
    from .speculative import auto_applies

    return options if when == "on" or when == "auto" and auto_applies(model) else None
