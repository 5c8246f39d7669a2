import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{") and '"run": {' in l]
by = {}
for r in rows:
    by.setdefault(r["rep"], {})[r["leg"]] = r["run"]
reps = [v for v in by.values() if {"old", "new", "aa"} <= set(v)]
out = {"reps": len(reps)}
for key in ("mtp_k3", "plain"):
    new_old = [v["old"][key] / v["new"][key] for v in reps]  # speed of new over old (time old / time new)
    aa = [v["new"][key] / v["aa"][key] for v in reps]
    out[key] = {"new_over_old_median": round(statistics.median(new_old), 3), "range": [round(min(new_old), 3), round(max(new_old), 3)],
                "aa_median": round(statistics.median(aa), 3), "aa_range": [round(min(aa), 3), round(max(aa), 3)],
                "seconds_old_median": round(statistics.median(v["old"][key] for v in reps), 2),
                "seconds_new_median": round(statistics.median(v["new"][key] for v in reps), 2)}
same = all(v["old"]["mtp_k3_tokens"] == v["new"]["mtp_k3_tokens"] == v["new"]["plain_tokens"] for v in reps)
out["greedy_tokens_identical_old_new_plain"] = same
print(json.dumps(out, indent=1))
