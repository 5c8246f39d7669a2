"""qwen3_5_moe: logits against HF transformers (float64) and mlx-lm's qwen3_5_moe, the MoE MTP head through the
speculative loop, and bad MoE checkpoints."""

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import hf_reference_logits, logit_bound, mlx_lm_logit_error

from lattice_mlx import generate, load
from lattice_mlx.bench.synthetic import random_checkpoint
from lattice_mlx.speculative import SpecOptions

IDS = [3, 17, 250, 9, 64, 128, 5, 77, 300, 12, 41, 199, 2, 8, 150, 33, 90]
MOE = {
    "e6k2": dict(seed=20, num_experts=6, num_experts_per_tok=2),
    "e7k3-untied": dict(seed=21, num_experts=7, num_experts_per_tok=3, tie_word_embeddings=False),  # odd counts
    "e5k1-hv4": dict(seed=22, num_experts=5, num_experts_per_tok=1, linear_num_key_heads=1, linear_num_value_heads=4),
}


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: random_checkpoint(root / name, **kw) for name, kw in MOE.items()}


@pytest.mark.parametrize("name", list(MOE))
def test_moe_logits_match_transformers(moe_checkpoints, name):
    path = moe_checkpoints[name]
    ref, _ = hf_reference_logits(path, IDS)
    model, _ = load(path)
    err = np.abs(np.array(model(mx.array([IDS]))) - ref).max()
    assert err <= 1e-4 * max(1.0, np.abs(ref).max()), f"max |lattice - transformers| = {err:.2e}"


@pytest.mark.parametrize("name", ["e6k2", "e7k3-untied"])  # mlx-lm reads full_attention_interval, not layer_types
def test_moe_logits_match_mlx_lm(moe_checkpoints, name):
    err, bound = mlx_lm_logit_error(moe_checkpoints[name], IDS, gpu_rel=1e-4)  # routed expert sums: looser on a GPU
    assert err <= bound, f"max |lattice - mlx-lm| = {err:.2e} > {bound:.2e}"


@pytest.mark.parametrize("verify", ["batched", "sequential"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_moe_greedy_mtp_equals_plain(moe_checkpoints, k, verify):
    model, tok = load(moe_checkpoints["e7k3-untied"])
    assert type(model.mtp.layers[0].mlp).__name__ == "SparseMoeBlock"  # the MoE MTP head, experts stacked
    for prompt in ([5, 9, 33, 21, 7, 100], [250]):
        plain = generate(model, tok, prompt, max_tokens=30).tokens
        spec = generate(model, tok, prompt, max_tokens=30,
                        speculation=SpecOptions(draft_tokens=k, verify=verify, adaptive=False))
        assert spec.tokens == plain


def test_moe_mtp_experts_are_stacked_in_expert_order(tmp_path):
    from safetensors.numpy import load_file

    path = random_checkpoint(tmp_path / "e12", seed=23, num_experts=12, num_experts_per_tok=2)  # 10 after 9, not 1
    raw = load_file(str(path / "model.safetensors"))
    model, _ = load(path)
    stacked = np.array(model.mtp.layers[0].mlp.switch_mlp.down_proj.weight)
    for e in range(12):
        np.testing.assert_array_equal(stacked[e], raw[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"])
    trunk = np.array(model.layers[0].mlp.switch_mlp.up_proj.weight)
    fused = raw["model.language_model.layers.0.mlp.experts.gate_up_proj"]
    assert stacked.shape[0] == 12
    np.testing.assert_array_equal(trunk, fused[:, fused.shape[1] // 2 :])


def test_moe_oracle_drafts_exercise_acceptance_and_rollback(moe_checkpoints):
    """A random MoE head accepts ~nothing: oracle drafts at 0.7 make the MoE verify accept and roll back."""
    from lattice_mlx.bench.oracles import OracleDrafter
    from lattice_mlx.decode import generate_step
    from lattice_mlx.sample import Sampler
    from lattice_mlx.speculative import SpecStats, speculate

    model, _ = load(moe_checkpoints["e7k3-untied"])
    prompt = mx.array([5, 9, 33, 21, 7, 100])
    steps = generate_step(model, prompt, sampler=Sampler())
    plain = [next(steps) for _ in range(90)]
    for verify in ("batched", "sequential"):
        options = SpecOptions(draft_tokens=3, verify=verify, adaptive=False)
        stats = SpecStats.of(options)
        gen = speculate(model, prompt, sampler=Sampler(), options=options, stats=stats,
                               drafter=OracleDrafter(model, Sampler(), plain, 0.7, seed=4))
        assert [next(gen) for _ in range(80)] == plain[:80]
        assert 0.3 < stats.to_dict()["acceptance_rate"] < 0.95


def test_bf16_moe_runs_on_the_cpu(moe_checkpoints, on_cpu):
    """MLX's CPU gather_mm is fp32-only: unquantized experts are kept in fp32 there, the rest runs in bf16."""
    model, tok = load(moe_checkpoints["e6k2"], dtype="bfloat16")
    assert model.model.embed_tokens.weight.dtype == mx.bfloat16
    assert model.layers[0].mlp.switch_mlp.gate_proj.weight.dtype == mx.float32
    out = generate(model, tok, [5, 9, 33], max_tokens=12, speculation=SpecOptions(draft_tokens=2, adaptive=False))
    assert out.generation_tokens == 12


@pytest.mark.parametrize("how, message", [("missing_expert", "experts.3.up_proj.weight is missing"),
                                          ("last_expert", "experts.5.up_proj.weight is missing"),
                                          ("expert_count", "shape"), ("top_k", "num_experts_per_tok")])
def test_bad_moe_checkpoint_is_one_line(moe_checkpoints, tmp_path, how, message):
    import shutil
    import subprocess
    import sys

    from safetensors.numpy import load_file, save_file

    dst = shutil.copytree(moe_checkpoints["e6k2"], tmp_path / how)
    if how == "top_k":
        config = json.loads((dst / "config.json").read_text())
        config["text_config"]["num_experts_per_tok"] = 9
        (dst / "config.json").write_text(json.dumps(config))
    else:
        w = load_file(str(dst / "model.safetensors"))
        if how == "missing_expert":
            del w["mtp.layers.0.mlp.experts.3.up_proj.weight"]
        elif how == "last_expert":
            del w["mtp.layers.0.mlp.experts.5.up_proj.weight"]
        else:
            key = "model.language_model.layers.1.mlp.experts.down_proj"
            w[key] = w[key][:-1].copy()  # one expert fewer than num_experts
        save_file(w, str(dst / "model.safetensors"))
    out = subprocess.run([sys.executable, "-m", "lattice_mlx.generate", "--model", str(dst), "--max-tokens", "2"],
                         capture_output=True, text=True, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode != 0 and len(lines) == 1 and message in lines[0] and "Traceback" not in out.stderr, lines


def test_mlx_community_4bit_moe_checkpoint_matches_mlx_lm(moe_checkpoints, tmp_path):
    """mlx-lm's own conversion (4-bit experts, routers and shared-expert gates at 8 bits, recorded per layer)."""
    import mlx_lm
    from mlx_lm.convert import convert

    dst = tmp_path / "q4"
    convert(str(moe_checkpoints["e6k2"]), str(dst), quantize=True, q_group_size=32, q_bits=4)
    ref_model, _ = mlx_lm.load(str(dst))
    model, _ = load(dst)
    assert model.layers[0].mlp.gate.bits == 8 and model.layers[0].mlp.switch_mlp.up_proj.bits == 4
    ids = mx.array([IDS])
    ref = ref_model(ids)
    err, bound = mx.abs(model(ids) - ref).max().item(), logit_bound(ref, gpu_rel=1e-4)
    assert err <= bound, f"max |lattice - mlx-lm| on a 4-bit MoE checkpoint = {err:.2e} > {bound:.2e}"


def test_convert_quantizes_moe_with_8_bit_routers_and_keeps_the_moe_head(moe_checkpoints, tmp_path):
    from lattice_mlx.convert import convert

    dst = convert(str(moe_checkpoints["e7k3-untied"]), str(tmp_path / "q"), quantize_bits=4, group_size=32)
    quant = json.loads((dst / "config.json").read_text())["quantization"]
    assert quant["bits"] == 4 and quant["model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
    model, tok = load(dst)
    assert model.layers[1].mlp.gate.bits == 8 and model.layers[1].mlp.switch_mlp.down_proj.bits == 4
    on_disk = mx.load(str(dst / "model.safetensors"))  # the head stays unquantized, in bf16
    assert on_disk["mtp.layers.0.mlp.switch_mlp.gate_proj.weight"].dtype == mx.bfloat16
    assert "mtp.layers.0.mlp.switch_mlp.gate_proj.scales" not in on_disk
    plain = generate(model, tok, [5, 9, 33], max_tokens=20).tokens
    assert generate(model, tok, [5, 9, 33], max_tokens=20,
                    speculation=SpecOptions(draft_tokens=2, adaptive=False)).tokens == plain


def test_bench_stock_leg_for_moe_shares_the_4_bit_weights():
    """The bench's mlx-lm leg for an MoE shape: mlx-lm's qwen3_5_moe on our arrays, each layer quantized as ours is
    (routers at 8 bits)."""
    from lattice_mlx.bench import run as bench

    # On a GPU, group 32: MLX's CUDA quantized matmul is wrong at K = 64 with group 64 (the tiny shape's hidden size),
    # and mlx-lm's model calls it directly (docs/kernels.md, "Small-K quantized matmul on CUDA").
    group = 64 if mx.default_device() == mx.cpu else 32
    target = bench.load_target("tiny-moe", bits=4, group_size=group, dtype="float32", seed=0, stock=True)
    assert type(target.stock).__module__ == "mlx_lm.models.qwen3_5_moe", target.stock_note
    assert target.stock_max_logit_diff < 1e-3


def test_text_only_moe_layout_loads_to_the_same_model(moe_checkpoints, tmp_path):
    """`qwen3_5_moe_text` (Qwen3_5MoeForCausalLM: flat config, `model.*` names, fused experts, mtp.* kept)."""
    import shutil

    src = moe_checkpoints["e7k3-untied"]
    config = json.loads((src / "config.json").read_text())["text_config"]
    weights = {k.replace("model.language_model.", "model."): v for k, v in mx.load(str(src / "model.safetensors")).items()}
    dst = shutil.copytree(src, tmp_path / "text_only")
    (dst / "config.json").write_text(json.dumps(dict(config, architectures=["Qwen3_5MoeForCausalLM"])))
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    text_only, _ = load(dst)
    hub, _ = load(src)
    ids = mx.array([IDS])
    assert text_only.args.model_type == "qwen3_5_moe_text" and text_only.has_mtp
    assert mx.array_equal(text_only(ids), hub(ids))


def test_per_expert_quantized_mtp_tensors_are_stacked_with_their_scales(moe_checkpoints, tmp_path):
    """A quantized checkpoint that stores the MTP layer's experts one by one (weight, scales, biases each)."""
    from lattice_mlx.convert import convert

    dst = convert(str(moe_checkpoints["e6k2"]), str(tmp_path / "q"), quantize_bits=4, group_size=32,
                  quantize_mtp=True)
    w = mx.load(str(dst / "model.safetensors"))
    split = {}
    for k, v in w.items():
        if k.startswith("mtp.layers.0.mlp.switch_mlp."):
            proj, tensor = k.split(".")[-2:]
            split.update({f"mtp.layers.0.mlp.experts.{e}.{proj}.{tensor}": v[e] for e in range(v.shape[0])})
        else:
            split[k] = v
    assert "mtp.layers.0.mlp.experts.5.down_proj.scales" in split
    mx.save_safetensors(str(dst / "model.safetensors"), split)
    again, _ = load(dst)
    model, _ = load(convert(str(moe_checkpoints["e6k2"]), str(tmp_path / "q2"), quantize_bits=4, group_size=32,
                            quantize_mtp=True))
    h = mx.random.normal((1, 3, model.args.hidden_size))
    assert mx.array_equal(again.mtp.layers[0].mlp(h), model.mtp.layers[0].mlp(h))
