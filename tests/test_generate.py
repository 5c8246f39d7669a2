"""The generate API and CLI: mlx-lm compatibility, JSON output, and one-line errors for everything a user can get wrong."""

import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest

from lattice_mlx import generate, load, stream_generate


def run_cli(*args, stdin: str | None = None, module: str = "lattice_mlx.generate", env: dict | None = None):
    return subprocess.run([sys.executable, "-m", module, *args], input=stdin, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_mlx_lm_stream_generate_runs_the_model_with_the_same_greedy_tokens(checkpoints):
    import mlx_lm

    model, tokenizer = load(checkpoints["untied"])
    prompt = [5, 9, 33, 21, 7, 100]
    ours = generate(model, tokenizer, prompt, max_tokens=24).tokens
    theirs = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=24)]
    assert theirs[: len(ours)] == ours


def test_stream_generate_yields_pieces_that_join_to_the_text(checkpoints):
    model, tokenizer = load(checkpoints["tied"])
    pieces = list(stream_generate(model, tokenizer, "def f(x):", max_tokens=12, chat_template=False))
    result = generate(model, tokenizer, "def f(x):", max_tokens=12, chat_template=False)
    assert [p.token for p in pieces] == result.tokens
    assert "".join(p.text for p in pieces) == result.text
    assert pieces[-1].finish_reason in ("length", "stop")


def test_cli_json_and_stdin_prompt(checkpoints):
    out = run_cli("--model", str(checkpoints["tied"]), "--prompt", "-", "--max-tokens", "8", "--json",
                  stdin="def main():")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for key in ("tokens", "text", "prompt_tokens", "generation_tokens", "prompt_tps", "generation_tps",
                "peak_memory_gb"):
        assert key in result
    assert 1 <= result["generation_tokens"] == len(result["tokens"]) <= 8
    assert "tok/s" in out.stderr


def test_cli_mtp_json_stats_and_exactness(checkpoints):
    base = ["--model", str(checkpoints["tied"]), "--prompt", "hello", "--max-tokens", "16", "--json"]
    plain = json.loads(run_cli(*base).stdout.splitlines()[-1])
    assert "speculation" not in plain
    spec = run_cli(*base, "--mtp", "--draft-tokens", "3", "--no-adaptive")
    assert spec.returncode == 0, spec.stderr
    result = json.loads(spec.stdout.splitlines()[-1])
    assert result["tokens"] == plain["tokens"]
    stats = result["speculation"]
    for key in ("acceptance_rate", "accepted_per_position", "mean_accepted_length", "draft_tokens", "verify",
                "rounds", "proposed_at", "accepted_at", "accepted_hist", "draft_time_s", "verify_time_s"):
        assert key in stats
    assert stats["draft"] == "mtp" and stats["draft_tokens"] == 3 and stats["verify"] == "pipelined"  # auto
    assert sum(stats["accepted_hist"]) == stats["rounds"] and stats["proposed_at"] == [stats["rounds"]] * 3
    by_env = json.loads(run_cli(*base, "--draft-tokens", "3", "--no-adaptive", env={"LATTICE_MTP": "1"})
                        .stdout.splitlines()[-1])
    times = ("draft_time_s", "verify_time_s", "rollback_time_s")
    assert by_env["tokens"] == plain["tokens"]
    assert {k: v for k, v in by_env["speculation"].items() if k not in times} == \
        {k: v for k, v in stats.items() if k not in times}


def _corrupt(src, dst, how):
    shutil.copytree(src, dst)
    if how == "truncated":
        data = (dst / "model.safetensors").read_bytes()
        (dst / "model.safetensors").write_bytes(data[: len(data) // 3])
    elif how in ("wrong_shape", "missing_tensor"):
        from safetensors.numpy import load_file, save_file

        w = load_file(str(dst / "model.safetensors"))
        key = "model.language_model.layers.0.mlp.up_proj.weight"
        if how == "missing_tensor":
            del w[key]
        else:
            w[key] = w[key][:, :-1].copy()
        save_file(w, str(dst / "model.safetensors"))
    elif how == "unknown_type":
        config = json.loads((dst / "config.json").read_text())
        config["model_type"] = config["text_config"]["model_type"] = "llama"
        (dst / "config.json").write_text(json.dumps(config))
    elif how == "gptq":
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128}
        (dst / "config.json").write_text(json.dumps(config))
    elif how == "no_config":
        (dst / "config.json").unlink()
    return dst


@pytest.mark.parametrize("how, message", [
    ("truncated", "corrupt"), ("wrong_shape", "shape"), ("missing_tensor", "missing tensor"),
    ("unknown_type", "unsupported model_type"), ("no_config", "no config.json"), ("gptq", "not supported"),
])
def test_cli_bad_checkpoint_is_one_line(checkpoints, tmp_path, how, message):
    path = _corrupt(checkpoints["tied"], tmp_path / how, how)
    out = run_cli("--model", str(path), "--max-tokens", "2")
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("args, message", [
    (["--model", "/no/such/dir"], "no such directory"),
    (["--model", "nobody-xyz/not-a-real-repo-1234"], "pass a local checkpoint directory"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--temp", "-1"], "--temp"),
    (["--top-p", "0"], "--top-p"),
    (["--draft-tokens", "9"], "--draft-tokens"),
    (["--verify", "tree"], "--verify"),
    (["--mtp", "--draft", "ngram"], "two draft sources"),
    (["--tree", "2-x"], "bad tree shape"),
    (["--draft", "bogus"], "unknown draft source"),
    (["--env", "LATTICE_MTP=yes"], "LATTICE_MTP"),
    (["--env", "LATTICE_KERNELS=bogus"], "LATTICE_KERNELS"),
    (["--env", "LATTICE_COMPILE=2"], "LATTICE_COMPILE"),
    (["--env", "LATTICE_TRACE_ROUNDS=yes"], "LATTICE_TRACE_ROUNDS"),
    (["--env", "LATTICE_KERNEL_CACHE=on"], "LATTICE_KERNEL_CACHE"),
    (["--env", "LATTICE_DEQUANT_ROWS=-1"], "LATTICE_DEQUANT_ROWS"),
])
def test_cli_bad_flags_are_one_line(args, message, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = dict([args[1].split("=")]) if args[0] == "--env" else {}
    out = run_cli(*(["--max-tokens", "2"] if env else args), env=env)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in out.stderr, out.stderr


@pytest.mark.parametrize("flags, named", [(["--mtp"], "--mtp"), (["--tree", "2-1"], "--tree 2-1"),
                                          (["--draft", "mtp+ngram"], "--draft mtp+ngram")])
def test_cli_mtp_without_mtp_weights(no_mtp_checkpoint, flags, named):
    out = run_cli("--model", str(no_mtp_checkpoint), *flags)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines() == [
        f"error: {named} needs MTP weights (mtp.*), and this checkpoint has none: drop {named}"
    ]


def test_convert_cli_bad_input_is_one_line(tmp_path):
    out = run_cli("--hf-path", str(tmp_path / "missing"), "--mlx-path", str(tmp_path / "out"),
                  module="lattice_mlx.convert")
    assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens (--max-tokens)"), (dict(max_tokens=-5), "max_tokens (--max-tokens)"),
    (dict(temp=-1.0), "temp (--temp)"), (dict(temp=float("nan")), "temp (--temp)"),
    (dict(top_p=0.0), "top_p (--top-p)"), (dict(top_p=1.5), "top_p (--top-p)"), (dict(top_k=-1), "top_k (--top-k)"),
])
def test_api_checks_what_the_cli_checks(checkpoints, kwargs, message):
    """The API refuses what the CLI refuses, with the same message (it was: a token for max_tokens 0, gibberish for
    temp -1, an empty token for top_p 0)."""
    model, tok = load(checkpoints["tied"])
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as refused:
        generate(model, tok, [5, 9], **kwargs)
    flag = message.split("(")[1].rstrip(")")
    out = run_cli("--model", str(checkpoints["tied"]), flag, str(next(iter(kwargs.values()))))
    assert out.returncode != 0 and out.stderr.strip().splitlines() == [f"error: {refused.value}"]


@pytest.mark.parametrize("kwargs", [dict(draft_tokens=0), dict(draft_tokens=-1), dict(draft_tokens=100),
                                    dict(verify="bogus")])
def test_api_speculation_options_are_checked(kwargs):
    from lattice_mlx import SpecOptions

    with pytest.raises(ValueError, match="--draft-tokens|--verify"):
        SpecOptions(**kwargs)


# --- mlx-lm's API arguments and CLI flags ---


def test_api_takes_a_text_prompt_as_it_is_like_mlx_lm(checkpoints):
    """mlx-lm's API encodes a text prompt as it is; chat_template=True wraps it as a user message."""
    model, tok = load(checkpoints["tied"])
    raw = generate(model, tok, "def f(x):", max_tokens=4)
    assert raw.prompt_tokens == len(tok.encode("def f(x):"))
    wrapped = generate(model, tok, "def f(x):", max_tokens=4, chat_template=True)
    assert wrapped.prompt_tokens > raw.prompt_tokens  # the test checkpoints carry a Qwen-style template


def test_api_seed_sampler_and_logits_processors(checkpoints):
    import mlx.core as mx

    from lattice_mlx import Sampler
    from lattice_mlx.speculative import SpecOptions

    model, tok = load(checkpoints["untied"])
    prompt = [5, 9, 33, 21, 7, 100]
    a = generate(model, tok, prompt, max_tokens=12, temp=1.0, seed=3).tokens
    assert a == generate(model, tok, prompt, max_tokens=12, sampler=Sampler(temp=1.0), seed=3).tokens
    assert a != generate(model, tok, prompt, max_tokens=12, temp=1.0, seed=4).tokens
    greedy = generate(model, tok, prompt, max_tokens=12).tokens
    seen = []

    def ban_first_choice(tokens, logits):  # mlx-lm's processor signature: (tokens so far, logits [1, V])
        seen.append(tokens.size)
        return logits + mx.where(mx.arange(logits.shape[-1]) == greedy[0], -mx.inf, 0.0)

    banned = generate(model, tok, prompt, max_tokens=12, logits_processors=[ban_first_choice]).tokens
    assert greedy[0] not in banned and seen[:3] == [6, 7, 8]
    with pytest.raises(ValueError, match="logits_processors work with plain decoding only"):
        generate(model, tok, prompt, max_tokens=4, logits_processors=[ban_first_choice], speculation=SpecOptions())
    with pytest.raises(ValueError, match="sampler must be a lattice_mlx.Sampler"):
        generate(model, tok, prompt, max_tokens=4, sampler=lambda logits: mx.argmax(logits))


def test_cli_mlx_lm_flags(checkpoints):
    path = str(checkpoints["tied"])
    plain = run_cli("-m", path, "-p", "def f(x):", "--max-tokens", "6", "--json")
    system = run_cli("-m", path, "-p", "def f(x):", "--max-tokens", "6", "--json", "--system-prompt", "be brief")
    raw = run_cli("-m", path, "-p", "def f(x):", "--max-tokens", "6", "--json", "--ignore-chat-template")
    n = [json.loads(r.stdout.strip().splitlines()[-1])["prompt_tokens"] for r in (plain, system, raw)]
    assert n[1] > n[0] > n[2], n
    quiet = run_cli("-m", path, "-p", "def f(x):", "--max-tokens", "6", "--verbose", "false")
    assert quiet.returncode == 0 and "tok/s" not in quiet.stderr and quiet.stdout.strip()
    tokens = json.loads(plain.stdout.strip().splitlines()[-1])["tokens"]
    model, tok = load(path)
    stop = tok.convert_ids_to_tokens(tokens[2])
    cut = run_cli("-m", path, "-p", "def f(x):", "--max-tokens", "6", "--json", "--extra-eos-token", stop)
    assert json.loads(cut.stdout.strip().splitlines()[-1])["tokens"] == tokens[: tokens.index(tokens[2]) + 1]
    bad = run_cli("-m", path, "--extra-eos-token", "no-such-token-xyz")
    assert bad.returncode == 1 and "is not a token of this tokenizer" in bad.stderr


def test_max_kv_size_bounds_the_attention_caches(checkpoints, monkeypatch):
    """Plain decoding with a rotating KV cache: the same tokens as unbounded decoding while everything fits, then it
    goes on past the window with the attention caches' buffers held to max_kv_size rows, on both decode paths."""
    from mlx_lm.models.cache import RotatingKVCache

    from lattice_mlx.speculative import SpecOptions

    model, tok = load(checkpoints["untied"])
    prompt = list(range(3, 23))  # 20 tokens
    made = []
    real = model.make_cache

    def spy(**kw):
        made.append(real(**kw))
        return made[-1]

    monkeypatch.setattr(model, "make_cache", spy)
    import mlx.core as mx

    no_eos = [lambda tokens, logits: logits + mx.where(mx.arange(logits.shape[-1]) == 0, -mx.inf, 0.0)]
    for compiled in ("1", "0"):
        monkeypatch.setenv("LATTICE_COMPILE", compiled)
        full = generate(model, tok, prompt, max_tokens=60, logits_processors=no_eos).tokens
        bounded = generate(model, tok, prompt, max_tokens=60, max_kv_size=48, logits_processors=no_eos).tokens
        assert bounded[:27] == full[:27] and len(bounded) == 60  # (20 + 27 < 48: nothing rotated out yet)
        rot = [c for c in made[-1] if isinstance(c, RotatingKVCache)]
        assert rot and all(c.keys.shape[2] <= 48 for c in rot)
    with pytest.raises(ValueError, match="works with plain decoding only"):
        generate(model, tok, prompt, max_tokens=4, max_kv_size=48, speculation=SpecOptions())
    with pytest.raises(ValueError, match="must be an integer > 4"):
        generate(model, tok, prompt, max_tokens=4, max_kv_size=3)


def test_cli_takes_sampling_defaults_from_the_checkpoint_generation_config(checkpoints, tmp_path):
    """As vLLM's --generation-config auto: flags left out take generation_config.json's values when it sets
    do_sample (Hugging Face's meaning; without it the file means greedy); given flags win; `none` is mlx-lm's
    greedy default; a corrupt file ends in one line."""
    path = tmp_path / "ckpt"
    shutil.copytree(checkpoints["tied"], path)
    base = ["--model", str(path), "--prompt", "hello", "--max-tokens", "12", "--json"]

    def tokens(*flags):
        out = run_cli(*base, *flags)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[-1])["tokens"], out.stderr

    greedy, _ = tokens()
    (path / "generation_config.json").write_text(json.dumps({"temperature": 1.5, "top_k": 20}))
    assert tokens()[0] == greedy  # no do_sample: greedy
    (path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 1.5, "top_k": 20,
                                                              "top_p": 0.9, "eos_token_id": 0}))
    sampled, err = tokens()
    assert "generation_config.json: temp 1.5, top_p 0.9, top_k 20" in err
    assert sampled == tokens("--temp", "1.5", "--top-k", "20", "--top-p", "0.9", "--generation-config", "none")[0]
    assert sampled != greedy
    assert tokens("--generation-config", "none")[0] == greedy == tokens("--temp", "0")[0]
    (path / "generation_config.json").write_text("{not json")
    out = run_cli(*base)
    assert out.returncode == 1 and out.stderr.strip().count("\n") == 0 and "generation_config.json" in out.stderr


def _short_context(src, dst, n: int):
    """A copy of a checkpoint whose config allows `n` positions."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = n
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_check_context_names_both_numbers_and_the_limit():
    from types import SimpleNamespace

    from lattice_mlx.generate import check_context

    model = SimpleNamespace(args=SimpleNamespace(max_position_embeddings=2048))
    with pytest.raises(ValueError) as e:
        check_context(model, 3000, 64)
    assert str(e.value) == "the prompt (3,000 tokens) plus max_tokens (64) exceeds the model's context length " \
                           "(2,048 tokens)"
    check_context(model, 3000, 64, allow_long=True)
    check_context(model, 1984, 64)  # exactly the context: fits


def test_stream_generate_refuses_a_prompt_past_the_context_unless_allowed(checkpoints, tmp_path):
    model, tok = load(_short_context(checkpoints["tied"], tmp_path / "short", 16))
    prompt = list(range(3, 15))  # 12 tokens
    with pytest.raises(ValueError, match=r"the prompt \(12 tokens\) plus max_tokens \(8\) exceeds the model's "
                                         r"context length \(16 tokens\)"):
        next(stream_generate(model, tok, prompt, max_tokens=8))
    assert len(generate(model, tok, prompt, max_tokens=4).tokens) <= 4
    assert len(generate(model, tok, prompt, max_tokens=8, allow_long_context=True).tokens) <= 8


def test_cli_refuses_a_prompt_past_the_demo_context_in_one_line():
    """The demo model's context is 2,048 tokens; a 3,000-word prompt (after the chat template) is refused before
    it is prefilled, in one line, and --allow-long-context lets it through (checked on a short-context copy)."""
    out = run_cli("--prompt", "-", "--max-tokens", "4", stdin="word " * 3000)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "exceeds the model's context length (2,048 tokens)" in lines[0] and "max_tokens (4)" in lines[0]
    assert "--allow-long-context" in lines[0]


def test_cli_allow_long_context(checkpoints, tmp_path):
    path = _short_context(checkpoints["tied"], tmp_path / "short", 8)
    base = ["--model", str(path), "--prompt", "def main(): return 1", "--max-tokens", "4", "--no-chat-template"]
    out = run_cli(*base)
    assert out.returncode == 1 and "context length (8 tokens)" in out.stderr, out.stderr
    out = run_cli(*base, "--allow-long-context")
    assert out.returncode == 0, out.stderr


def test_prompt_tps_counts_only_the_tokens_prefilled(checkpoints, monkeypatch):
    """With a prompt cache, the rate is over the tokens not in the cache (a clock that ticks 1 s per read: the
    prompt's time is 1 s)."""
    from types import SimpleNamespace

    gen = importlib.import_module("lattice_mlx.generate")  # (the package's `generate` is the function)
    from lattice_mlx.prompt_cache import PromptCache

    model, tok = load(checkpoints["tied"])
    ids = [5, 9, 33, 21, 7, 100, 3, 3, 17, 2, 8, 64]
    cache = PromptCache.build(model, ids[:9])
    ticks = iter(range(10_000))
    monkeypatch.setattr(gen, "time", SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    result = generate(model, tok, ids, max_tokens=4, prompt_cache=cache)
    assert result.prompt_tokens == 12 and result.prompt_cached_tokens == 9 and result.prompt_tps == 3.0
    result = generate(model, tok, ids, max_tokens=4)
    assert result.prompt_cached_tokens == 0 and result.prompt_tps == 12.0
    line = gen.prompt_line(gen.GenerationResult(tokens=[1], text="", prompt_tokens=12, generation_tokens=1,
                                                prompt_tps=3.0, generation_tps=0.0, peak_memory_gb=0.0,
                                                finish_reason="length", prompt_cached_tokens=9))
    assert line == "prompt: 12 tokens (9 from the cache), 3 prefilled at 3.0 tok/s"


def test_help_names_the_command_as_it_was_started(monkeypatch, capsys):
    """The console script (pyproject's lattice-generate) is named as such; `python -m` keeps the module's name."""
    gen = importlib.import_module("lattice_mlx.generate")  # (the package's `generate` is the function)

    for argv0, name in (("/venv/bin/lattice-generate", "lattice-generate"),
                        (gen.__file__, "python -m lattice_mlx.generate")):
        monkeypatch.setattr(sys, "argv", [argv0])
        with pytest.raises(SystemExit):
            gen.main(["--help"])
        assert capsys.readouterr().out.startswith(f"usage: {name} [-h]")


def test_interrupt_while_loading_is_one_line(monkeypatch, capsys):
    gen = importlib.import_module("lattice_mlx.generate")  # (the package's `generate` is the function)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gen, "load", interrupted)
    try:
        assert gen.main(["--max-tokens", "2"]) == 130
    except KeyboardInterrupt:  # (escaping, it would stop the whole pytest session)
        pytest.fail("Ctrl-C escaped generate.main")
    assert capsys.readouterr().err.strip().splitlines() == ["interrupted"]


def _interrupt_at_startup(module: str, *args: str):
    """Starts `python -m module`, sends SIGINT while it is still importing and loading, returns (rc, stderr)."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    time.sleep(0.8)  # (a background shell job starts its children with SIGINT ignored: preexec_fn undoes that)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    return proc.returncode, err


@pytest.mark.parametrize("module", ["lattice_mlx.generate", "lattice_mlx.convert"])
def test_ctrl_c_at_startup_is_one_line_and_exit_130(module, tmp_path):
    from lattice_mlx.load import demo_model

    args = ["--max-tokens", "2"] if module == "lattice_mlx.generate" else \
        ["--hf-path", str(demo_model()), "--mlx-path", str(tmp_path / "out")]
    rc, err = _interrupt_at_startup(module, *args)
    assert rc == 130 and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and err.strip().startswith("interrupted"), err
    assert not (tmp_path / "out").exists()


def test_a_virtual_environment_is_ignored_by_git():
    import pathlib

    root = pathlib.Path(__file__).parents[1]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    assert subprocess.run(["git", "check-ignore", "-q", ".venv/"], cwd=root).returncode == 0


def test_api_builds_the_speculative_kernels_only_when_it_speculates_adaptively(checkpoints, monkeypatch):
    """stream_generate (so the API's generate and the CLI) asks for the once-per-machine builds of the adaptive loop's
    passes (load.keep_round_builds: a no-op off CUDA, and after its first check per model) when a generation
    speculates with adaptive depth; plain decoding and a fixed depth do not."""
    from lattice_mlx import SpecOptions

    gen = importlib.import_module("lattice_mlx.generate")
    asked = []
    monkeypatch.setattr(gen, "keep_round_builds", lambda model: asked.append(model.has_mtp))
    model, tokenizer = load(checkpoints["tied"])
    for speculation, want in ((None, []), (SpecOptions(draft_tokens=2, adaptive=False), []), (SpecOptions(), [True])):
        asked.clear()
        gen.generate(model, tokenizer, "hi", max_tokens=3, speculation=speculation)
        assert asked == want, speculation


def test_cli_builds_the_speculative_kernels_only_when_it_speculates_adaptively(checkpoints, monkeypatch, capsys):
    """The CLI asks for the once-per-machine builds of the adaptive loop's passes (load.keep_round_builds: a no-op
    off CUDA) when it speculates with adaptive depth, with the loaded model; plain decoding and a fixed depth
    do not pay for them."""
    gen = importlib.import_module("lattice_mlx.generate")
    asked = []
    monkeypatch.setattr(gen, "keep_round_builds", lambda model: asked.append(model.has_mtp))
    base = ["--model", str(checkpoints["tied"]), "--prompt", "hi", "--max-tokens", "3"]
    for flags, want in (([], []), (["--mtp", "--no-adaptive"], []), (["--mtp"], [True])):
        asked.clear()
        assert gen.main([*base, *flags]) == 0
        assert asked == want, flags
    capsys.readouterr()
