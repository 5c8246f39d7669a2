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


def _packaged_copy(tmp_path, monkeypatch):
    """A copy of the packaged demo folder that demo_model() reads instead, and an empty cache for it."""
    import importlib
    import shutil

    load_module = importlib.import_module("lattice_mlx.load")  # (the package's `load` is the function)
    copy = tmp_path / "package"
    shutil.copytree(DEMO_MODEL, copy)
    monkeypatch.setattr(load_module, "DEMO_MODEL", copy)
    monkeypatch.setenv("LATTICE_CACHE", str(tmp_path / "cache"))
    return copy


def test_a_folder_lacking_a_file_is_replaced_and_any_packaged_file_changed_is_a_new_folder(tmp_path, monkeypatch):
    copy = _packaged_copy(tmp_path, monkeypatch)
    path = demo_model()
    (path / "tokenizer.json").unlink()  # (a cleaner took a file)
    assert demo_model() == path and (path / "tokenizer.json").read_bytes() == (copy / "tokenizer.json").read_bytes()
    config = (copy / "config.json").read_text()
    (copy / "config.json").write_text(config.replace("{", '{"_edited": 1, ', 1))
    edited = demo_model()
    assert edited != path and (edited / "config.json").read_text() == (copy / "config.json").read_text()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([path.name, edited.name])


@pytest.mark.parametrize("damage", ["stream", "checksum", "truncated"])
def test_a_damaged_archive_is_one_line_and_leaves_nothing_behind(tmp_path, monkeypatch, damage):
    copy = _packaged_copy(tmp_path, monkeypatch)
    data = bytearray((copy / "model.safetensors.gz").read_bytes())
    if damage == "truncated":
        data = data[: len(data) // 2]
    else:  # (a byte of the deflate stream's start: zlib's error; one further on: the gzip checksum's)
        data[20 if damage == "stream" else len(data) // 2] ^= 0xFF
    (copy / "model.safetensors.gz").write_bytes(bytes(data))
    with pytest.raises(LoadError, match="damaged") as e:
        demo_model()
    assert "\n" not in str(e.value)
    assert list((tmp_path / "cache").iterdir()) == []


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
