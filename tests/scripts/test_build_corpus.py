"""scripts/demo/build_corpus.py (the [demo-head] corpus): split by package, deduplicated, prompts from held-out code."""

import json

from conftest import load_script

bc = load_script("demo/build_corpus.py")

CODE = '''import os


def area(width, height):
    total = width * height
    if total < 0:
        raise ValueError("negative")
    scaled = total * 2
    return scaled // 2
'''


def test_split_is_by_package_files_are_kept_once_and_prompts_come_from_heldout_code(tmp_path):
    stdlib, site = tmp_path / "lib", tmp_path / "site"
    (stdlib / "json").mkdir(parents=True)
    (stdlib / "json" / "__init__.py").write_text(CODE.replace("area", "json_area"))
    (stdlib / "heapq.py").write_text(CODE.replace("area", "heap_area"))
    (stdlib / "ast.py").write_text(CODE.replace("area", "ast_area"))  # held out by the first demo's path rule
    for pkg in ("alpha", "beta"):
        (site / pkg / "tests").mkdir(parents=True)
        (site / pkg / "core.py").write_text(CODE.replace("area", f"{pkg}_area"))
        (site / pkg / "tests" / "test_core.py").write_text(CODE.replace("area", f"test_{pkg}"))
        (site / pkg / "vendored.py").write_text("x = 1\n")  # the same file in both packages: kept once
    (site / "beta-1.0.dist-info").mkdir()
    (site / "beta-1.0.dist-info" / "x.py").write_text("ignored = True\n")
    out, prompts = tmp_path / "out", tmp_path / "prompts.json"
    totals = bc.build(stdlib, site, out, percent=0, named={"beta", "stdlib.heapq"}, prompts_path=prompts,
                      n_prompts=10, seed=0)
    summary = json.loads((out / "summary.json").read_text())["packages"]
    assert {k: v["split"] for k, v in summary.items()} == {
        "alpha": "train", "beta": "heldout", "stdlib.ast": "train", "stdlib.heapq": "heldout", "stdlib.json": "train"}
    assert bc.legacy_heldout("ast.py") and not bc.legacy_heldout("heapq.py") and summary["stdlib.ast"]["files"] == 0
    assert summary["beta"]["duplicates"] == 1 and totals["train"]["files"] == 4 and totals["heldout"]["files"] == 3
    train, heldout = (out / "train.txt").read_text(), (out / "heldout.txt").read_text()
    assert "beta_area" not in train and "heap_area" not in train and "ast_area" not in train + heldout
    assert "alpha_area" in train and "ast_area" in (out / "legacy_heldout.txt").read_text()
    assert totals["legacy_heldout"]["files"] == 1
    assert train.count(bc.SEPARATOR) == 4 and "ignored" not in train + heldout
    got = json.loads(prompts.read_text())["prompts"]
    assert sorted(p["package"] for p in got) == ["beta", "stdlib.heapq"]  # tests/ files give no prompts
    assert all(p["prompt"].startswith("def ") and p["prompt"].count("\n") == 6 for p in got)


def test_documents_read_back_and_sample_by_bytes(tmp_path):
    """The split files' reader and the seeded sample train_demo.py and distill_demo_head.py take their text with."""
    docs = [f"doc {i}\n" * (i + 1) for i in range(20)]
    (tmp_path / "train.txt").write_text("".join(d + bc.SEPARATOR for d in docs))
    assert bc.read_documents(tmp_path / "train.txt") == docs
    assert bc.sample_documents(docs, 0, seed=3) == docs
    a = bc.sample_documents(docs, 100, seed=3)
    assert a == bc.sample_documents(docs, 100, seed=3) != bc.sample_documents(docs, 100, seed=4)
    assert sum(len(d) for d in a[:-1]) < 100 <= sum(len(d) for d in a) and set(a) <= set(docs)
    pairs = [(str(i), d) for i, d in enumerate(docs)]
    assert [d for _, d in bc.sample_documents(pairs, 100, seed=3, text=lambda p: p[1])] == a
