"""Medians of the paired ratios in runs.jsonl: time with the setting off / time of the leg (above 1: faster)."""

import json
import statistics

runs = [json.loads(line) for line in open("runs.jsonl")]
by = {}
for r in runs:
    by.setdefault(r["rep"], {})[r["leg"]] = r
reps = [v for v in by.values() if len(v) == 3]
out = {"reps": len(reps)}
for leg in ("on", "off-aa"):
    ratios = [v["off"]["seconds"] / v[leg]["seconds"] for v in reps]
    out[leg] = {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                "max": round(max(ratios), 3)}
out["seconds_median"] = {leg: round(statistics.median(v[leg]["seconds"] for v in reps), 3)
                         for leg in ("off", "on", "off-aa")}
out["tokens_identical"] = all(v["on"]["tokens"] == v["off"]["tokens"] == v["off-aa"]["tokens"] for v in reps)
print(json.dumps(out, indent=1))
json.dump(out, open("summary.json", "w"), indent=1)
