"""Command-line plumbing shared by the entry modules: one-line flag errors and the speculation flags (with the one
environment switch, LATTICE_MTP=1) turned into SpecOptions. Value ranges are checked by the API's own objects."""

import argparse
import sys
from pathlib import Path

from . import settings
from .speculative import MAX_DRAFT_TOKENS, VERIFIERS, SpecOptions


class ArgumentParser(argparse.ArgumentParser):
    """Flag errors end in one line (no usage block) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def command_name(module: str) -> str:
    """The name a command's help and errors use: the console script it was started as (`lattice-generate`), else
    `python -m <module>` (run with -m, or main() called from another program, e.g. pytest)."""
    name = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return name if name.startswith("lattice") and not name.endswith(".py") else f"python -m {module}"


def env_mtp() -> bool:
    """LATTICE_MTP=1 turns MTP speculation on as --mtp does; 0 or unset leaves it off; anything else is an error."""
    return settings.on("mtp")


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    defaults = SpecOptions()
    g = p.add_argument_group("speculative decoding (off unless --mtp, --draft or --tree)")
    g.add_argument("--mtp", action="store_true", help="draft with the checkpoint's MTP head (= --draft mtp; "
                   "also LATTICE_MTP=1)")
    g.add_argument("--draft", help="draft source: mtp, self[:LAYERS], ngram, mtp+ngram")
    g.add_argument("--draft-tokens", type=int, default=defaults.draft_tokens,
                   help=f"draft depth K, 1..{MAX_DRAFT_TOKENS} (the largest, when adaptive)")
    g.add_argument("--verify", default=defaults.verify,
                   help=f"verifier: auto (pipelined for MTP chains, batched otherwise) or {' or '.join(VERIFIERS)}")
    g.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=defaults.adaptive,
                   help="tune K from acceptance and turn speculation off when it cannot pay (--no-adaptive keeps K "
                        "fixed, e.g. for benchmarks)")
    g.add_argument("--tree", help="verify a tree of MTP drafts, widths per depth, e.g. 2-2-1")


def speculation_from_args(args: argparse.Namespace) -> SpecOptions | None:
    """SpecOptions from the flags above (ValueError for a bad combination), or None for plain decoding."""
    from . import decode
    from .speculative import pipelined as rounds

    rounds.tracing_enabled()  # LATTICE_TRACE_ROUNDS and LATTICE_TRACE_STEPS checked up front, speculation on or
    decode.tracing_enabled()  # not, as LATTICE_MTP is
    if args.mtp and args.draft not in (None, "mtp"):
        raise ValueError(f"--mtp and --draft {args.draft} name two draft sources: pass one")
    draft = args.draft or ("mtp" if args.mtp or args.tree or env_mtp() else None)
    options = SpecOptions(draft=draft or "mtp", draft_tokens=args.draft_tokens, verify=args.verify,
                          adaptive=args.adaptive, tree=args.tree)  # checked even when speculation stays off
    return options if draft is not None else None
