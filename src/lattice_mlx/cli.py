"""Command-line plumbing shared by the entry modules: one-line flag errors, typed flag parsers, and the speculation
flags (with the one environment switch, LATTICE_MTP=1) turned into SpecOptions."""

import argparse
import os

from .spec import MAX_DRAFT_TOKENS, VERIFIERS, SpecOptions


class ArgumentParser(argparse.ArgumentParser):
    """Flag errors end in one line (no usage block) and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def int_in(lo: int, hi: int | None = None):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"{v} is outside {lo}..{hi if hi is not None else 'inf'}")
        return v

    return parse


def float_in(lo: float, hi: float, *, lo_open: bool = False):
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
        if not (lo < v if lo_open else lo <= v) or v > hi:
            raise argparse.ArgumentTypeError(f"{v} is outside {'(' if lo_open else '['}{lo}, {hi}]")
        return v

    return parse


def env_mtp() -> bool:
    """LATTICE_MTP=1 turns MTP speculation on as --mtp does; 0 or unset leaves it off; anything else is an error."""
    value = os.environ.get("LATTICE_MTP", "0")
    if value not in ("0", "1", ""):
        raise ValueError(f"LATTICE_MTP={value!r}: use 1 (MTP on) or 0 (off)")
    return value == "1"


def add_speculation_args(p: argparse.ArgumentParser) -> None:
    defaults = SpecOptions()
    g = p.add_argument_group("speculative decoding (off unless --mtp, --draft or --tree)")
    g.add_argument("--mtp", action="store_true", help="draft with the checkpoint's MTP head (= --draft mtp; "
                   "also LATTICE_MTP=1)")
    g.add_argument("--draft", help="draft source: mtp, self[:LAYERS], ngram, mtp+ngram")
    g.add_argument("--draft-tokens", type=int_in(1, MAX_DRAFT_TOKENS), default=defaults.draft_tokens,
                   help="draft depth K (the largest, when adaptive)")
    g.add_argument("--verify", choices=VERIFIERS, default=defaults.verify, help="verifier")
    g.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=defaults.adaptive,
                   help="tune K from acceptance and turn speculation off when it cannot pay (--no-adaptive keeps K "
                        "fixed, e.g. for benchmarks)")
    g.add_argument("--tree", help="verify a tree of MTP drafts, widths per depth, e.g. 2-2-1")


def speculation_from_args(args: argparse.Namespace) -> SpecOptions | None:
    """SpecOptions from the flags above (ValueError for a bad combination), or None for plain decoding."""
    if args.mtp and args.draft not in (None, "mtp"):
        raise ValueError(f"--mtp and --draft {args.draft} name two draft sources: pass one")
    draft = args.draft or ("mtp" if args.mtp or args.tree or env_mtp() else None)
    if draft is None:
        return None
    return SpecOptions(draft=draft, draft_tokens=args.draft_tokens, verify=args.verify, adaptive=args.adaptive,
                       tree=args.tree)
