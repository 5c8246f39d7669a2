"""The embedded demo model: it loads with no arguments, generates deterministically, and MTP is exact on it."""

import gzip

import mlx.core as mx
import pytest

from lattice_mlx import SpecOptions, generate, load
from lattice_mlx.load import DEMO_MODEL, LoadError, demo_model

MAX_BYTES = 10_000_000


def test_asset_fits_the_size_budget():
    size = sum(f.stat().st_size for f in DEMO_MODEL.iterdir())
    assert 1_000_000 < size <= MAX_BYTES, size


def test_the_packed_weights_unpack_once_into_a_whole_checkpoint_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("LATTICE_CACHE", str(tmp_path / "cache"))
    path = demo_model()
    assert path.parent == tmp_path / "cache" and path.name.startswith("demo-")
    assert sorted(f.name for f in path.iterdir()) == sorted(
        ["model.safetensors" if f.name == "model.safetensors.gz" else f.name for f in DEMO_MODEL.iterdir()])
    with gzip.open(DEMO_MODEL / "model.safetensors.gz", "rb") as f:
        assert (path / "model.safetensors").read_bytes() == f.read()
    assert any(k.startswith("mtp.") for k in mx.load(str(path / "model.safetensors")))
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert demo_model() == path and (path / "model.safetensors").stat().st_mtime_ns == stamp  # found, not redone
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [path.name]  # no half-written folder left


def test_an_unwritable_cache_falls_back_and_then_says_so_in_one_line(tmp_path, monkeypatch):
    import tempfile

    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("LATTICE_CACHE", str(blocked / "cache"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    assert demo_model().parent == tmp_path / "tmp" / "lattice_mlx"
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(blocked))
    with pytest.raises(LoadError, match="set LATTICE_CACHE"):
        demo_model()


@pytest.fixture(scope="module")
def demo():
    return load()


def test_loads_with_its_mtp_head_and_qwen3_5_structure(demo):
    model, tokenizer = demo
    args = model.args
    assert model.has_mtp and args.tie_word_embeddings
    assert [layer.is_linear for layer in model.layers] == [True, True, True, False] * 2
    assert args.linear_num_value_heads > args.linear_num_key_heads and args.rope_dims < args.head_dim
    assert "scales" in model.model.embed_tokens  # 4-bit trunk
    assert tokenizer.chat_template


def test_greedy_generation_is_deterministic_code(demo):
    model, tokenizer = demo
    a = generate(model, tokenizer, "import os\n\ndef ", max_tokens=40)
    b = generate(model, tokenizer, "import os\n\ndef ", max_tokens=40)
    assert a.tokens == b.tokens and len(set(a.tokens)) > 10
    assert any(s in a.text for s in ("(", ":", "=", "return", "self"))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_equals_plain_greedy(demo, k):
    model, tokenizer = demo
    prompt = "class Queue:\n    def __init__(self):\n"
    plain = generate(model, tokenizer, prompt, max_tokens=60)
    spec = generate(model, tokenizer, prompt, max_tokens=60, speculation=SpecOptions(draft_tokens=k, adaptive=False))
    assert spec.tokens == plain.tokens
    # A trained head, unlike a random one, gets drafts accepted.
    assert spec.speculation["acceptance_rate"] > 0.1
