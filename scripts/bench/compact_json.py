"""Rewrites benchmark result JSON files in place, compactly: floats to 6 significant digits, no indentation, GPU
kernel names (CUPTI's) without their namespace and argument list. The tracked tree travels to the GPU machine on every call and must stay well under 15 MB; run this on results before
committing them under docs/results/archive/.

    python scripts/bench/compact_json.py docs/results/archive/h200/run10/**/*.json
"""

import json
import sys
from pathlib import Path

from lattice_mlx.bench.report import kernel_name as short


def rounded(o):
    if isinstance(o, float):
        return float(f"{o:.6g}")
    if isinstance(o, str):
        return short(o)
    if isinstance(o, dict):
        out = {}
        for k, v in o.items():
            k, v = short(k), rounded(v)
            # two names that differed only in their arguments: one entry (counts and times add)
            out[k] = out[k] + v if k in out and isinstance(v, (int, float)) else v
        return out
    if isinstance(o, list):
        return [rounded(v) for v in o]
    return o


def main(paths: list[str]) -> int:
    saved = 0
    for p in map(Path, paths):
        try:
            text = p.read_text()
            data = json.loads(text)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            print(f"{p}: skipped ({e.__class__.__name__})", file=sys.stderr)
            continue
        new = json.dumps(rounded(data), separators=(",", ":"), allow_nan=True) + "\n"
        if len(new) < len(text):
            tmp = p.with_suffix(p.suffix + ".tmp")
            tmp.write_text(new)
            tmp.replace(p)
            saved += len(text) - len(new)
    print(f"{len(paths)} files, {saved / 1e3:.0f} kB saved")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
