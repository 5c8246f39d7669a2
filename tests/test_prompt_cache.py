"""Prompt caches for hybrid models (prompt_cache.py): a generation from a cached prefix is the generation from
scratch (fp32: the same tokens, and with MTP the same accepted drafts), extending a cache equals building it, saved
files reload exactly, and a cache of another model or a broken file is refused in one line."""

import json

import mlx.core as mx
import pytest

from lattice_mlx import generate, load
from lattice_mlx.prompt_cache import PromptCache
from lattice_mlx.speculative import SpecOptions

IDS = [5, 9, 33, 21, 7, 100, 3, 3, 17, 2, 8, 64, 128, 12, 13, 40, 41]


def _run(model, tok, ids, **kw):
    r = generate(model, tok, ids, max_tokens=30, chat_template=False, **kw)
    return r.tokens, (r.speculation or {}).get("accepted_at")


@pytest.mark.parametrize("spec", [None, SpecOptions(draft_tokens=2, verify="batched", adaptive=False),
                                  SpecOptions(draft="mtp+ngram", draft_tokens=3, adaptive=False),
                                  SpecOptions(draft_tokens=3, verify="pipelined", adaptive=False)],
                         ids=["plain", "mtp", "mtp+ngram", "mtp-pipelined"])
def test_generation_from_a_cached_prefix_is_the_generation_from_scratch(checkpoints, spec):
    for name, path in checkpoints.items():
        model, tok = load(path)
        want = _run(model, tok, IDS, speculation=spec)
        for cut in (1, 6, len(IDS) - 1):
            pc = PromptCache.build(model, IDS[:cut])
            assert _run(model, tok, IDS, speculation=spec, prompt_cache=pc) == want, (name, cut)
        other = PromptCache.build(model, [7, 7, 7])  # not a prefix: ignored, the prompt prefilled whole
        assert _run(model, tok, IDS, speculation=spec, prompt_cache=other) == want


def test_demo_mtp_accepts_the_same_drafts_from_a_cached_prefix():
    model, tok = load(dtype="float32")
    ids = tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n    return")
    spec = SpecOptions(draft_tokens=2, verify="batched", adaptive=False)
    want = _run(model, tok, ids, speculation=spec)
    got = _run(model, tok, ids, speculation=spec, prompt_cache=PromptCache.build(model, ids[:-4]))
    assert got == want and sum(want[1]) > 5
    pipelined = SpecOptions(draft_tokens=2, verify="pipelined", adaptive=False)
    want = _run(model, tok, ids, speculation=pipelined)
    assert _run(model, tok, ids, speculation=pipelined, prompt_cache=PromptCache.build(model, ids[:-4])) == want
    assert sum(want[1]) > 5


def test_extending_a_cache_equals_building_it(checkpoints):
    model, _ = load(checkpoints["tied"])
    whole = PromptCache.build(model, IDS[:-2])
    grown = PromptCache.build(model, IDS[:-2], base=PromptCache.build(model, IDS[:5]))
    for a, b in zip(whole.cache + whole.mtp, grown.cache + grown.mtp):
        assert a.offset == b.offset
        for x, y in zip(a.state, b.state):
            assert x == y if isinstance(x, int) else mx.allclose(x, y, atol=1e-5).item()
    assert mx.allclose(whole.hidden, grown.hidden, atol=1e-5).item()


def test_a_cache_is_not_changed_by_generations_from_it(checkpoints):
    model, tok = load(checkpoints["untied"])
    pc = PromptCache.build(model, IDS[:8])
    first = _run(model, tok, IDS, prompt_cache=pc)
    _run(model, tok, IDS[:8] + [99, 98, 97], prompt_cache=pc)  # another continuation from the same cache
    assert _run(model, tok, IDS, prompt_cache=pc) == first


def test_save_and_load_continue_exactly(checkpoints, tmp_path):
    model, tok = load(checkpoints["untied"])
    spec = SpecOptions(draft_tokens=2, adaptive=False)
    pc = PromptCache.build(model, IDS[:10])
    pc.save(tmp_path / "p.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.safetensors"]
    want = _run(model, tok, IDS, speculation=spec)
    assert _run(model, tok, IDS, speculation=spec, prompt_cache=str(tmp_path / "p.safetensors")) == want
    loaded = PromptCache.load(tmp_path / "p.safetensors", model)
    assert loaded.tokens == IDS[:10] and _run(model, tok, IDS, prompt_cache=loaded) == _run(model, tok, IDS)


def test_another_models_or_a_broken_cache_is_refused_in_one_line(checkpoints, tmp_path):
    model, _ = load(checkpoints["untied"])
    other, _ = load(checkpoints["tied"])
    PromptCache.build(other, IDS[:6]).save(tmp_path / "other.safetensors")
    with pytest.raises(ValueError, match="made by another model"):
        PromptCache.load(tmp_path / "other.safetensors", model)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    for path in (tmp_path / "junk.safetensors", tmp_path / "missing.safetensors"):
        with pytest.raises(ValueError, match="cannot read prompt cache") as e:
            PromptCache.load(path, model)
        assert "\n" not in str(e.value)


def test_a_failed_save_leaves_no_file(checkpoints, tmp_path, monkeypatch):
    model, _ = load(checkpoints["untied"])
    pc = PromptCache.build(model, IDS[:6])

    def broken(path, arrays, metadata=None):
        open(path, "wb").write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", broken)
    with pytest.raises(OSError, match="disk full"):
        pc.save(tmp_path / "p.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_loops_without_prompt_cache_support_say_so(checkpoints):
    model, tok = load(checkpoints["untied"])
    with pytest.raises(ValueError, match="--tree does not take a prompt cache"):
        _run(model, tok, IDS, speculation=SpecOptions(tree="2-1"), prompt_cache=PromptCache.build(model, IDS[:4]))


def test_cli_cache_prompt_then_generate_continues_it(tmp_path):
    import json
    import subprocess
    import sys

    path = tmp_path / "fib.safetensors"
    r = subprocess.run([sys.executable, "-m", "lattice_mlx.cache_prompt", "--prompt", "def fibonacci(n):\n",
                        "--prompt-cache-file", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-m", "lattice_mlx.generate", "--prompt-cache-file", str(path), "--prompt",
                        "    if n < 2:\n", "--max-tokens", "16", "--mtp", "--json", "--temp", "0"],  # the demo samples
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    model, tok = load()
    ids = tok.encode("def fibonacci(n):\n") + tok.encode("    if n < 2:\n")
    assert got["tokens"] == generate(model, tok, ids, max_tokens=16, chat_template=False).tokens
    r = subprocess.run([sys.executable, "-m", "lattice_mlx.generate", "--prompt-cache-file", str(tmp_path / "no")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("error: cannot read prompt cache") and "Traceback" not in r.stderr


def test_cli_reports_the_prompt_rate_over_the_tokens_prefilled(tmp_path):
    """A generation from a prompt cache prefills only the new tokens: the line says how many came from the cache
    and gives the rate over the others."""
    import subprocess
    import sys

    path = tmp_path / "fib.safetensors"
    r = subprocess.run([sys.executable, "-m", "lattice_mlx.cache_prompt", "--prompt", "def fibonacci(n):\n",
                        "--prompt-cache-file", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    cached = int(r.stderr.split("after ")[1].split()[0])
    r = subprocess.run([sys.executable, "-m", "lattice_mlx.generate", "--prompt-cache-file", str(path), "--prompt",
                        "    if n < 2:\n", "--max-tokens", "4", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    new = got["prompt_tokens"] - cached
    assert got["prompt_cached_tokens"] == cached and new > 0
    assert f"prompt: {got['prompt_tokens']} tokens ({cached} from the cache), {new} prefilled at " in r.stderr


def test_cache_prompt_refuses_a_prompt_past_the_context_in_one_line(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "long.safetensors"
    cmd = [sys.executable, "-m", "lattice_mlx.cache_prompt", "--prompt", "-", "--prompt-cache-file", str(path)]
    r = subprocess.run(cmd, input="word " * 3000, capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert "exceeds the model's context length (2,048 tokens)" in lines[0] and "--allow-long-context" in lines[0]
    assert not path.exists()


def test_cache_prompt_help_is_whole_sentences(capsys):
    from lattice_mlx import cache_prompt

    with pytest.raises(SystemExit):
        cache_prompt.main(["--help"])
    out = capsys.readouterr().out
    description = out.split("\n\n")[1]
    assert description.endswith(".") and description.count("`") % 2 == 0, description
    assert "prefills only" in out  # the next step, in the epilog
