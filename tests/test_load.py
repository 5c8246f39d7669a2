"""Loading and conversion: names, the +1 norm shift applied exactly once, mtp.* kept, atomic output."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

from lattice_mlx.convert import convert
from lattice_mlx.load import LoadError, load, quantize, read_weights
from lattice_mlx.models.qwen3_5 import sanitize

IDS = mx.array([[3, 17, 250, 9, 64, 128, 5, 77]])


def test_sanitize_is_idempotent_and_shifts_norms_once(checkpoints):
    raw = read_weights(checkpoints["tied"])
    once = sanitize(raw, tie_word_embeddings=True)
    twice = sanitize(once, tie_word_embeddings=True)
    assert once.keys() == twice.keys()
    for k in once:
        assert mx.array_equal(once[k], twice[k]), k
    shifted = ["model.norm.weight", "model.layers.0.input_layernorm.weight", "model.layers.3.self_attn.q_norm.weight",
               "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
               "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight",
               "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.self_attn.k_norm.weight"]
    for k in shifted:
        hub = k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k
        assert mx.allclose(once[k], raw[hub] + 1.0).item(), k
    gated = "model.layers.0.linear_attn.norm.weight"
    assert mx.array_equal(once[gated], raw[gated.replace("model.", "model.language_model.", 1)])
    assert once["model.layers.0.linear_attn.conv1d.weight"].shape[-1] == 1


def test_top_level_tie_with_a_shipped_lm_head_loads_and_converts(checkpoints, tmp_path):
    """tie_word_embeddings only at the top level of a hub config, lm_head.weight still in the file: the tied model
    ignores it, in load() and in convert() alike (they share one load path)."""
    from safetensors.numpy import load_file, save_file

    src = shutil.copytree(checkpoints["tied"], tmp_path / "toplevel")
    config = json.loads((src / "config.json").read_text())
    assert config["tie_word_embeddings"] is True
    del config["text_config"]["tie_word_embeddings"]
    (src / "config.json").write_text(json.dumps(config))
    w = load_file(str(src / "model.safetensors"))
    w["lm_head.weight"] = w["model.language_model.embed_tokens.weight"] * 3.0  # would change the logits if used
    save_file(w, str(src / "model.safetensors"))
    ref, _ = load(checkpoints["tied"])
    model, _ = load(src)
    converted, _ = load(convert(str(src), str(tmp_path / "out"), mtp_dtype=None))
    assert model.args.tie_word_embeddings and converted.args.tie_word_embeddings
    assert mx.array_equal(model(IDS), ref(IDS)) and mx.array_equal(converted(IDS), ref(IDS))


def test_mtp_weights_survive_load_and_convert(checkpoints, tmp_path):
    model, _ = load(checkpoints["tied"])
    assert model.has_mtp
    dst = convert(str(checkpoints["tied"]), str(tmp_path / "out"), mtp_dtype=None)
    again, _ = load(dst)
    assert again.has_mtp
    a = dict(__import__("mlx.utils").utils.tree_flatten(model.mtp.parameters()))
    b = dict(__import__("mlx.utils").utils.tree_flatten(again.mtp.parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]) for k in a)
    assert mx.array_equal(model(IDS), again(IDS))


def test_convert_keeps_the_mtp_head_in_bf16_by_default(checkpoints, tmp_path):
    dst = convert(str(checkpoints["untied"]), str(tmp_path / "q"), quantize_bits=4)
    on_disk = mx.load(str(dst / "model.safetensors"))
    assert on_disk["mtp.fc.weight"].dtype == mx.bfloat16 and "mtp.fc.scales" not in on_disk
    assert on_disk["model.embed_tokens.scales"].dtype == mx.float32
    q = convert(str(checkpoints["untied"]), str(tmp_path / "qm"), quantize_bits=4, quantize_mtp=True)
    assert "mtp.fc.scales" in mx.load(str(q / "model.safetensors"))


@pytest.mark.parametrize("group_size", [32, 64])
def test_quantized_convert_reloads_to_same_logits(checkpoints, tmp_path, group_size):
    src = checkpoints["untied"]
    dst = convert(str(src), str(tmp_path / "q"), quantize_bits=4, group_size=group_size)
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization"] == {"group_size": group_size, "bits": 4}
    model, _ = load(dst)
    assert model.has_mtp and "scales" not in model.mtp.fc  # MTP head kept unquantized by default
    in_memory, _ = load(src)
    quantize(in_memory, bits=4, group_size=group_size, quantize_mtp=False)
    logits = model(IDS)
    assert mx.array_equal(logits, in_memory(IDS))
    converted_again = convert(str(dst), str(tmp_path / "copy"))
    assert mx.array_equal(load(converted_again)[0](IDS), logits)


def test_convert_refuses_existing_output_and_leaves_no_temp_dir(checkpoints, tmp_path):
    dst = tmp_path / "exists"
    dst.mkdir()
    with pytest.raises(LoadError, match="already exists"):
        convert(str(checkpoints["tied"]), str(dst))
    broken = tmp_path / "broken"
    shutil.copytree(checkpoints["tied"], broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(LoadError, match="corrupt"):
        convert(str(broken), str(tmp_path / "never"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "exists"]


def test_dtype_override(checkpoints):
    model, _ = load(checkpoints["tied"], dtype="bfloat16")
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16
    assert model.layers[0].linear_attn.A_log.dtype == mx.float32
    assert np.isfinite(np.array(model(IDS).astype(mx.float32))).all()


def test_text_only_layout_loads_to_the_same_model(checkpoints, tmp_path):
    """`qwen3_5_text` checkpoints (Qwen3_5ForCausalLM: flat config, `model.*` names, an explicit lm_head)."""
    src = checkpoints["untied"]
    config = json.loads((src / "config.json").read_text())["text_config"]
    weights = {k.replace("model.language_model.", "model."): v for k, v in mx.load(str(src / "model.safetensors")).items()
               if not k.startswith("mtp.")}
    dst = tmp_path / "text_only"
    shutil.copytree(src, dst)
    (dst / "config.json").write_text(json.dumps(dict(config, architectures=["Qwen3_5ForCausalLM"])))
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    text_only, _ = load(dst)
    hub, _ = load(src)
    assert not text_only.has_mtp and text_only.args.model_type == "qwen3_5_text"
    assert mx.array_equal(text_only(IDS), hub(IDS))


def run_module(module: str, *args, **kw):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120, **kw)


def test_checkpoint_without_tokenizer_is_named_at_load_and_convert(checkpoints, tmp_path):
    """It was "the prompt encodes to no tokens" at load (transformers builds an empty tokenizer) and exit 0 at
    convert."""
    src = shutil.copytree(checkpoints["tied"], tmp_path / "notok")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (src / f).unlink()
    with pytest.raises(LoadError, match="has no tokenizer: it needs tokenizer.json"):
        load(src)
    for module, args in (("lattice_mlx.generate", ["--model", str(src)]),
                         ("lattice_mlx.convert", ["--hf-path", str(src), "--mlx-path", str(tmp_path / "out")])):
        out = run_module(module, *args)
        assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        assert "has no tokenizer" in out.stderr
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.*"))


def test_convert_quantization_flags_need_q(checkpoints, tmp_path):
    out = run_module("lattice_mlx.convert", "--hf-path", str(checkpoints["tied"]), "--mlx-path", str(tmp_path / "o"),
                     "--q-bits", "8")
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "add -q" in out.stderr
    assert not (tmp_path / "o").exists()


# A shell runs a background command (`cmd &`, as CI wrappers and nohup jobs do) with SIGINT ignored, and a child
# inherits that: the slow writer takes Ctrl-C as an interactive convert does, whatever started the suite (with SIGINT
# ignored it slept on and the test waited out its own 60 s timeout).
SLOW_CONVERT = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from lattice_mlx import convert
real = convert.save_weights
def slow(dst, weights):
    real(dst, weights)
    print("writing", flush=True)
    for _ in range(600):
        time.sleep(0.1)
convert.save_weights = slow
sys.exit(convert.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_interrupted_convert_says_one_line_and_leaves_nothing(checkpoints, tmp_path, sig):
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", SLOW_CONVERT, "--hf-path", str(checkpoints["tied"]), "--mlx-path",
                             str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"  # the temp folder exists and holds the weights now
    assert len(list(tmp_path.glob(".out.converting-*"))) == 1
    proc.send_signal(getattr(signal, sig))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err  # above it: the progress bar of the writing
    assert err.strip().splitlines()[-1] == "interrupted: nothing was written (the partial output was removed)"
    assert list(tmp_path.iterdir()) == []


def test_convert_removes_temp_folders_of_killed_runs(checkpoints, tmp_path):
    import socket

    stale = tmp_path / f".out.converting-{socket.gethostname()}-999999999-abc"  # no such process on this host
    elsewhere = tmp_path / ".out.converting-another-host-1-abc"  # another machine's: not ours to judge
    elsewhere.mkdir()
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    out = run_module("lattice_mlx.convert", "--hf-path", str(checkpoints["tied"]), "--mlx-path", str(tmp_path / "out"))
    assert out.returncode == 0, out.stderr
    assert f"removed {stale}, left by an interrupted conversion" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [elsewhere.name, "out"]


def test_interrupted_force_convert_keeps_the_previous_output(checkpoints, tmp_path, monkeypatch):
    """--force over an existing output: interrupted before the new one is in place, the old one stays."""
    from lattice_mlx import convert as convert_module

    dst = convert(str(checkpoints["tied"]), str(tmp_path / "out"))
    before = sorted(p.name for p in dst.iterdir())
    real_rename = type(dst).rename

    def rename(self, target):
        if self.name.startswith(".out.converting-") and not self.name.endswith("-replaced"):
            raise KeyboardInterrupt  # the new output is about to move into place
        return real_rename(self, target)

    monkeypatch.setattr(type(dst), "rename", rename)
    with pytest.raises(KeyboardInterrupt):
        convert_module.convert(str(checkpoints["tied"]), str(tmp_path / "out"), force=True)
    assert sorted(p.name for p in dst.iterdir()) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("value", [-1, 0, "1024", None], ids=["negative", "zero", "string", "missing"])
def test_a_bad_config_value_names_the_file_and_the_field(checkpoints, tmp_path, value):
    """It was "math domain error" (a negative width), a ZeroDivisionError or TypeError traceback, or a tensor shape
    mismatch (a missing width took the default's)."""
    src = shutil.copytree(checkpoints["tied"], tmp_path / "bad")
    config = json.loads((src / "config.json").read_text())
    if value is None:
        del config["text_config"]["hidden_size"]
    else:
        config["text_config"]["hidden_size"] = value
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError) as e:
        load(src)
    message = str(e.value)
    assert str(src / "config.json") in message and "hidden_size" in message and "\n" not in message
    assert ("is missing" if value is None else f"must be a positive integer, got {value!r}") in message


@pytest.mark.parametrize("field, value", [("num_hidden_layers", 1.5), ("rms_norm_eps", -1e-6),
                                          ("tie_word_embeddings", "yes"), ("num_key_value_heads", 3),
                                          ("layer_types", ["full_attention", "mamba", "full_attention",
                                                           "full_attention"])])
def test_other_bad_config_values_are_named(checkpoints, tmp_path, field, value):
    src = shutil.copytree(checkpoints["tied"], tmp_path / "bad")
    config = json.loads((src / "config.json").read_text())
    config["text_config"][field] = value
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError, match=field):
        load(src)


def test_a_bad_config_value_is_one_line_from_the_cli(checkpoints, tmp_path):
    src = shutil.copytree(checkpoints["tied"], tmp_path / "bad")
    config = json.loads((src / "config.json").read_text())
    config["text_config"]["hidden_size"] = -1
    (src / "config.json").write_text(json.dumps(config))
    out = run_module("lattice_mlx.generate", "--model", str(src), "--max-tokens", "2")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0] == f"error: {src / 'config.json'} does not describe a valid Qwen3.5 model: hidden_size must be " \
                       "a positive integer, got -1"


def test_round_builds_run_once_per_machine_on_cuda_and_say_so(checkpoints, no_mtp_checkpoint, tmp_path,
                                                              monkeypatch, capsys):
    """keep_round_builds: on MLX's CUDA backend, for a model with an MTP head, warm_rounds once (announced in one
    line), then a marker in the PTX cache makes later calls skip it (another dtype or quantization: its own); a
    failure is one line and leaves no marker; on another backend, with rounds untraced or without a head, nothing
    runs. Loading a model runs none of it (plain decoding never pays for it)."""
    import sys

    from lattice_mlx import runtime
    from lattice_mlx.metal import cuda_cache
    from lattice_mlx.speculative import pipelined

    loader = sys.modules["lattice_mlx.load"]  # (the module: the package's `load` is the function)
    model, _ = load(checkpoints["pattern"])
    runs = []
    monkeypatch.setattr(cuda_cache, "cache_dir", lambda: tmp_path / "ptx")
    monkeypatch.setattr(pipelined, "warm_rounds", lambda m, k: runs.append((m, k)) or 0)
    loader.keep_round_builds(model)  # (this machine's backend: the CPU)
    assert runs == []
    monkeypatch.setattr(loader, "on_cuda", lambda: True)
    with pipelined.tracing(True):
        load(checkpoints["pattern"])
    assert runs == []
    with pipelined.tracing(False):
        loader.keep_round_builds(model)
    assert runs == []
    capsys.readouterr()
    with pipelined.tracing(True):
        loader.keep_round_builds(model)
        err = capsys.readouterr().err
        assert runs == [(model, 4)] and "once" in err and len(err.strip().splitlines()) == 2
        assert [f.name for f in (tmp_path / "ptx").iterdir()][0].startswith("lattice_rounds_")
        loader.keep_round_builds(model)
        assert len(runs) == 1 and capsys.readouterr().err == ""
        digests = []
        monkeypatch.setattr(runtime, "source_digest", lambda: digests.append(1) or "sha256:x")
        fresh, _ = load(checkpoints["pattern"])
        for _ in range(3):  # (the API asks before every adaptive generation: one check per model and process)
            loader.keep_round_builds(fresh)
        assert len(digests) == 1 and len(runs) == 2
        monkeypatch.undo()
        monkeypatch.setattr(cuda_cache, "cache_dir", lambda: tmp_path / "ptx")
        monkeypatch.setattr(pipelined, "warm_rounds", lambda m, k: runs.append((m, k)) or 0)
        monkeypatch.setattr(loader, "on_cuda", lambda: True)
        del runs[1:]
        bf16, _ = load(checkpoints["pattern"], dtype="bfloat16")
        loader.keep_round_builds(bf16)  # another dtype: its own builds
        assert len(runs) == 2
        quantized, _ = load(checkpoints["pattern"])
        quantize(quantized, bits=4, group_size=32, quantize_mtp=False)
        loader.keep_round_builds(quantized)  # the same shape and dtype at 4 bits: its own builds too
        assert len(runs) == 3
        plain_model, _ = load(no_mtp_checkpoint)
        loader.keep_round_builds(plain_model)
        assert len(runs) == 3

        def boom(m, k):
            raise RuntimeError("nvrtc\nfailed")

        monkeypatch.setattr(pipelined, "warm_rounds", boom)
        capsys.readouterr()
        loader.keep_round_builds(load(checkpoints["pattern"], dtype="float16")[0])
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 2 and "not prebuilt" in err[1] and "RuntimeError" in err[1]
        # (a marker each for the model, the one checked three times, bf16 and 4 bits; none for the failed one, no part
        # file left)
        assert len(list((tmp_path / "ptx").iterdir())) == 4
