"""Build the demo model's code corpus: the Python source of the standard library and of the installed packages,
deduplicated, split into train and held-out BY PACKAGE (a held-out package is never seen in training), and a fixed
set of held-out prompts of ordinary code (a function's first lines, not boilerplate) from held-out packages.

    python scripts/demo/build_corpus.py --out .demo-build/corpus \\
        --prompts src/lattice_mlx/assets/prompts/demo_heldout_packages.json

Writes OUT/train.txt and OUT/heldout.txt (documents separated by <|endoftext|>), OUT/manifest.json (every file: its
package, split, bytes and sha256) and OUT/summary.json (per package: split, files, bytes). A package is a
top-level import name in site-packages, or `stdlib.<module>` for a top-level module of the standard library.
Held out: packages whose sha256(name) % 100 < --heldout-percent, plus any named with --heldout. The standard
library files the first demo model held out (scripts/demo/train_demo.py's path rule, `sha256(relative path) % 100 < 3`)
are kept out of training whatever their package: OUT/legacy_heldout.txt holds them, so the new model's held-out
loss can be compared with the first one's on the same files.
"""

import argparse
import hashlib
import json
import random
import re
import sys
import sysconfig
from pathlib import Path

SEPARATOR = "<|endoftext|>"
MAX_FILE_BYTES = 400_000
SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", "idlelib", "lib2to3", "ensurepip", "turtledemo"}


def package_files(stdlib: Path, purelib: Path) -> dict[str, list[Path]]:
    """{package: [*.py files]}: each top-level entry of the standard library and of site-packages."""
    out: dict[str, list[Path]] = {}
    for root, prefix in ((stdlib, "stdlib."), (purelib, "")):
        if not root.is_dir():
            continue
        for entry in sorted(root.iterdir()):
            name = entry.name[:-3] if entry.suffix == ".py" else entry.name
            if entry.name in SKIP_DIRS or entry.name.startswith((".", "_")) and entry.name != "__future__.py" \
                    or "-" in entry.name or entry.name.endswith((".dist-info", ".egg-info", ".libs")):
                continue
            files = [entry] if entry.suffix == ".py" else sorted(
                p for p in entry.rglob("*.py") if not SKIP_DIRS.intersection(p.relative_to(root).parts))
            if files:
                out.setdefault(prefix + name, []).extend(files)
    return out


def is_heldout(package: str, percent: int, named: set[str]) -> bool:
    return package in named or int(hashlib.sha256(package.encode()).hexdigest()[:8], 16) % 100 < percent


def legacy_heldout(rel_path: str, percent: int = 3) -> bool:
    """The first demo model's split of the standard library, by path (scripts/demo/train_demo.py, distill_demo_head.py):
    a file keeps its side across machines and Python versions."""
    return int(hashlib.sha256(rel_path.encode()).hexdigest()[:8], 16) % 100 < percent


def read_documents(path: Path) -> list[str]:
    """The documents of a split file this script wrote."""
    return [d for d in path.read_text(encoding="utf-8").split(SEPARATOR) if d.strip()]


def sample_documents(docs: list, max_bytes: int, seed: int, text=lambda d: d) -> list:
    """A seeded random subset of `docs` holding about `max_bytes` of text (`text(doc)`; 0: all of them, in order)."""
    if not max_bytes:
        return docs
    order = list(docs)
    random.Random(seed).shuffle(order)
    out, total = [], 0
    for d in order:
        if total >= max_bytes:
            break
        out.append(d)
        total += len(text(d).encode())
    return out


def read_source(path: Path) -> str | None:
    """The file's text when it is ordinary source: UTF-8, under MAX_FILE_BYTES, not generated tables."""
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            return None
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    if not text.strip() or "\0" in text or SEPARATOR in text:
        return None
    return text


DEF = re.compile(r"^([ \t]*)(async[ \t]+)?def \w+\(.*", re.M)


def function_prompts(text: str, lines: int = 6) -> list[str]:
    """Each function's first `lines` lines (its def line and body start) where they are ordinary code: at least 4
    distinct non-blank lines, no line repeated, not only docstring, comments or `pass`."""
    out, src = [], text.splitlines()
    for m in DEF.finditer(text):
        start = text.count("\n", 0, m.start())
        block = src[start : start + lines]
        body = [b.strip() for b in block[1:] if b.strip()]
        if len(block) < lines or len(set(body)) < 3 or len(body) != len(set(body)):
            continue
        if any(b.startswith(('"""', "'''", "#", "@")) for b in body[:1]) or "pass" in body or "..." in body:
            continue
        out.append("\n".join(block) + "\n")
    return out


def build(stdlib: Path, purelib: Path, out: Path, *, percent: int, named: set[str], prompts_path: Path | None,
          n_prompts: int, seed: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    seen, manifest, summary = set(), [], {}
    docs = {"train": [], "heldout": [], "legacy_heldout": []}
    for package, files in sorted(package_files(stdlib, purelib).items()):
        split = "heldout" if is_heldout(package, percent, named) else "train"
        row = summary.setdefault(package, {"split": split, "files": 0, "bytes": 0, "duplicates": 0,
                                           "legacy_heldout": 0})
        for path in files:
            text = read_source(path)
            if text is None:
                continue
            digest = hashlib.sha256(text.encode()).hexdigest()
            if digest in seen:  # the same file under two packages (vendored copies): kept once, where first seen
                row["duplicates"] += 1
                continue
            seen.add(digest)
            file_split = split
            if split == "train" and package.startswith("stdlib.") and legacy_heldout(path.relative_to(stdlib).as_posix()):
                file_split = "legacy_heldout"  # never trained on: the first demo's held-out files
                row["legacy_heldout"] += 1
            docs[file_split].append((package, path, text))
            manifest.append({"package": package, "split": file_split, "path": str(path), "bytes": len(text.encode()),
                             "sha256": digest})
            if file_split != split:
                continue
            row["files"] += 1
            row["bytes"] += len(text.encode())
    for split, items in docs.items():
        with open(out / f"{split}.txt", "w", encoding="utf-8") as f:
            for _, _, text in items:
                f.write(text + ("\n" if not text.endswith("\n") else "") + SEPARATOR)
    (out / "manifest.json").write_text(json.dumps(manifest))
    totals = {s: {"packages": sum(1 for r in summary.values() if r["split"] == s and r["files"]),
                  "files": sum(r["files"] for r in summary.values() if r["split"] == s),
                  "bytes": sum(r["bytes"] for r in summary.values() if r["split"] == s)} for s in ("train", "heldout")}
    totals["legacy_heldout"] = {"files": len(docs["legacy_heldout"]),
                                "bytes": sum(len(t.encode()) for _, _, t in docs["legacy_heldout"])}
    (out / "summary.json").write_text(json.dumps({"totals": totals, "packages": summary}, indent=1))
    if prompts_path is not None:
        rng = random.Random(seed)
        candidates = [(package, str(path), p) for package, path, text in docs["heldout"]
                      if not re.search(r"(^|/)(tests?|testing)/|/test_[^/]*$", str(path))  # code, not its tests
                      for p in function_prompts(text)]
        rng.shuffle(candidates)
        picked, per_package = [], {}
        for package, path, prompt in candidates:  # spread over packages: at most 4 prompts from one
            if per_package.get(package, 0) < 4 and len(picked) < n_prompts:
                per_package[package] = per_package.get(package, 0) + 1
                picked.append({"package": package, "prompt": prompt})
        prompts_path.parent.mkdir(parents=True, exist_ok=True)
        prompts_path.write_text(json.dumps({"source": "held-out packages of scripts/demo/build_corpus.py",
                                            "heldout_percent": percent, "prompts": picked}, indent=1) + "\n")
    return totals


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for train.txt, heldout.txt, manifest.json, summary.json")
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    p.add_argument("--site-packages", default=sysconfig.get_paths()["purelib"])
    p.add_argument("--heldout-percent", type=int, default=10)
    p.add_argument("--heldout", default="", help="comma-separated packages held out in addition")
    p.add_argument("--prompts", help="write the held-out prompt set (JSON) here")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    totals = build(Path(args.stdlib), Path(args.site_packages), Path(args.out), percent=args.heldout_percent,
                   named={s for s in args.heldout.split(",") if s}, n_prompts=args.num_prompts, seed=args.seed,
                   prompts_path=Path(args.prompts) if args.prompts else None)
    json.dump(totals, sys.stdout)
    print()


if __name__ == "__main__":
    main()
