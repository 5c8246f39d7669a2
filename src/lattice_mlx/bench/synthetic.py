"""What tests and benchmarks use in place of real weights and a trained head: random-weight checkpoints in the exact
Hugging Face hub layout of Qwen3.5 (`mtp.*` included), random in-memory models of real shapes, and SYNTHETIC oracle
drafters that force a chosen acceptance."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..load import keep_kernel_builds, quantize
from ..models.fuse import fuse_projections
from ..models.mtp import MTPHead
from ..models.qwen3_5 import Model, ModelArgs

QWEN3_5_0_8B = dict(
    hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=True,
)
QWEN3_5_4B = dict(
    hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=True,
)
QWEN3_5_2B = dict(
    hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128,
    linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=True,
)
QWEN3_5_9B = dict(
    hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=False,
)
# Qwen3.5-27B's text shape (64 layers, 48 GDN : 16 attention; untied): ~15 GB at Q4, for multi-GPU benchmarks.
QWEN3_5_27B = dict(
    hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=False,
)

# Qwen3.5-35B-A3B's text shape (HF's Qwen3_5MoeTextConfig defaults): ~18 GB at Q4, for GPU benchmarks.
QWEN3_5_35B_A3B = dict(
    hidden_size=2048, intermediate_size=512, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=False, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512,
)
# The larger MoE shapes (every layer MoE; the dense intermediate size is unused), for the Metal source check.
QWEN3_5_122B_A10B = dict(
    hidden_size=3072, intermediate_size=1024, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
    linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=False, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
)
QWEN3_5_397B_A17B = dict(
    hidden_size=4096, intermediate_size=1024, num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=64, linear_key_head_dim=128,
    linear_value_head_dim=128, vocab_size=248320, tie_word_embeddings=False, num_experts=512, num_experts_per_tok=10,
    moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
)


def hub_config(*, mtp: bool = True, **text) -> dict:
    """A hub-layout config.json (Qwen3_5ForConditionalGeneration with a nested text_config); tiny by default."""
    base = dict(
        model_type="qwen3_5_text", hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, vocab_size=320,
        rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=True, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10]},
        mtp_num_hidden_layers=1 if mtp else 0, eos_token_id=0, attention_bias=False,
    )
    base.update(text)
    moe = bool(base.get("num_experts"))
    if moe:
        base["model_type"] = "qwen3_5_moe_text"
        for key, value in (("num_experts_per_tok", 2), ("moe_intermediate_size", 32),
                           ("shared_expert_intermediate_size", 48)):
            base.setdefault(key, value)
    if "layer_types" not in text:
        base["layer_types"] = [
            "full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(base["num_hidden_layers"])
        ]
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5_moe" if moe else "qwen3_5",
        "tie_word_embeddings": base["tie_word_embeddings"],
        "text_config": base,
    }


def _attention(rng, c: dict, prefix: str, w) -> dict:
    H, D = c["hidden_size"], c["head_dim"]
    nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    return {
        f"{prefix}.q_proj.weight": w(2 * nq * D, H),
        f"{prefix}.k_proj.weight": w(nkv * D, H),
        f"{prefix}.v_proj.weight": w(nkv * D, H),
        f"{prefix}.o_proj.weight": w(H, nq * D),
        f"{prefix}.q_norm.weight": rng.normal(0, 0.1, D),
        f"{prefix}.k_norm.weight": rng.normal(0, 0.1, D),
    }


def _gdn(rng, c: dict, prefix: str, w) -> dict:
    H, K = c["hidden_size"], c["linear_conv_kernel_dim"]
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    Hv = c["linear_num_value_heads"]
    value_dim = Hv * c["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    return {
        f"{prefix}.in_proj_qkv.weight": w(conv_dim, H),
        f"{prefix}.in_proj_z.weight": w(value_dim, H),
        f"{prefix}.in_proj_b.weight": w(Hv, H),
        f"{prefix}.in_proj_a.weight": w(Hv, H),
        f"{prefix}.conv1d.weight": rng.normal(0, 0.5, (conv_dim, 1, K)),  # HF layout [C, 1, K]
        f"{prefix}.dt_bias": rng.uniform(0.5, 1.5, Hv),
        f"{prefix}.A_log": np.log(rng.uniform(1, 16, Hv)),
        f"{prefix}.norm.weight": rng.uniform(0.5, 1.5, c["linear_value_head_dim"]),
        f"{prefix}.out_proj.weight": w(H, value_dim),
    }


def _moe(rng, c: dict, prefix: str, w, *, per_expert: bool) -> dict:
    """An MoE block as the hub stores it: the trunk's experts fused ([E, 2I, H] and [E, H, I]), the MTP layer's one
    tensor per expert."""
    H, E, I, S = c["hidden_size"], c["num_experts"], c["moe_intermediate_size"], c["shared_expert_intermediate_size"]
    out = {f"{prefix}.gate.weight": w(E, H), f"{prefix}.shared_expert_gate.weight": w(1, H),
           f"{prefix}.shared_expert.gate_proj.weight": w(S, H), f"{prefix}.shared_expert.up_proj.weight": w(S, H),
           f"{prefix}.shared_expert.down_proj.weight": w(H, S)}
    if per_expert:
        for e in range(E):
            out.update({f"{prefix}.experts.{e}.gate_proj.weight": w(I, H), f"{prefix}.experts.{e}.up_proj.weight":
                        w(I, H), f"{prefix}.experts.{e}.down_proj.weight": w(H, I)})
    else:
        out[f"{prefix}.experts.gate_up_proj"] = np.stack([w(2 * I, H) for _ in range(E)])
        out[f"{prefix}.experts.down_proj"] = np.stack([w(H, I) for _ in range(E)])
    return out


def _layer(rng, c: dict, prefix: str, kind: str, w, *, mtp: bool = False) -> dict:
    H, I = c["hidden_size"], c["intermediate_size"]
    out = _gdn(rng, c, f"{prefix}.linear_attn", w) if kind == "linear_attention" else \
        _attention(rng, c, f"{prefix}.self_attn", w)
    out.update({
        f"{prefix}.input_layernorm.weight": rng.normal(0, 0.1, H),
        f"{prefix}.post_attention_layernorm.weight": rng.normal(0, 0.1, H),
    })
    if c.get("num_experts"):
        out.update(_moe(rng, c, f"{prefix}.mlp", w, per_expert=mtp))
    else:
        out.update({f"{prefix}.mlp.gate_proj.weight": w(I, H), f"{prefix}.mlp.up_proj.weight": w(I, H),
                    f"{prefix}.mlp.down_proj.weight": w(H, I)})
    return out


def hub_weights(config: dict, *, seed: int = 0, mtp: bool = True, dtype=np.float32, gain: float = 2.0
                ) -> dict[str, np.ndarray]:
    """Random tensors named and shaped as in the hub checkpoint; norms zero-centred like HF stores them.
    `gain` > 1 makes the layers outweigh the tied embedding, so greedy output does not just repeat its input."""
    c = config["text_config"]
    rng = np.random.default_rng(seed)
    H, V = c["hidden_size"], c["vocab_size"]

    def w(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0, gain * cols**-0.5, (rows, cols))

    out = {"model.language_model.embed_tokens.weight": rng.normal(0, 0.5, (V, H)),
           "model.language_model.norm.weight": rng.normal(0, 0.1, H)}
    for i, kind in enumerate(c["layer_types"]):
        out.update(_layer(rng, c, f"model.language_model.layers.{i}", kind, w))
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = w(V, H)
    if mtp:
        out.update({
            "mtp.fc.weight": w(H, 2 * H),
            "mtp.pre_fc_norm_embedding.weight": rng.normal(0, 0.1, H),
            "mtp.pre_fc_norm_hidden.weight": rng.normal(0, 0.1, H),
            "mtp.norm.weight": rng.normal(0, 0.1, H),
        })
        out.update(_layer(rng, c, "mtp.layers.0", "full_attention", w, mtp=True))
    return {k: np.ascontiguousarray(v, dtype=dtype) for k, v in out.items()}


def write_tokenizer(path: Path, vocab_size: int = 320) -> None:
    """A small byte-level BPE tokenizer (eos `<|endoftext|>` = id 0) with a Qwen-style chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    text = ["def main():\n    return 0\n", "The quick brown fox jumps over the lazy dog.", '{"key": [1, 2, 3]}'] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
        "chat_template": template, "model_max_length": 4096,
    }))


def write_checkpoint(path: str | Path, config: dict, weights: dict[str, np.ndarray], *, tokenizer: bool = True) -> Path:
    """Writes config.json, model.safetensors (and a tokenizer) into `path`, as a hub snapshot would hold them."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(path / "model.safetensors"))
    if tokenizer:
        write_tokenizer(path, min(config["text_config"]["vocab_size"], 320))
    return path


def random_checkpoint(path: str | Path, *, seed: int = 0, mtp: bool = True, gain: float = 2.0, **text) -> Path:
    config = hub_config(mtp=mtp, **text)
    return write_checkpoint(path, config, hub_weights(config, seed=seed, mtp=mtp, gain=gain))


def random_model(*, mtp: bool = True, bits: int | None = None, group_size: int = 64, dtype=None, fuse: bool = True,
                 place=None, **text):
    """A randomly initialised Model (MTP head attached) built in memory at any size, e.g. random_model(
    **QWEN3_5_0_8B, bits=4): for timing only, since random weights make acceptance meaningless. `place(model)`, if
    given, runs on the lazy (not yet evaluated) model before any weight is materialised, e.g. Model.shard or
    Model.pipeline: a process then only ever holds its own part (plus one layer's temporaries)."""
    args = ModelArgs.from_dict(hub_config(mtp=mtp, **text))
    model = Model(args)
    if mtp:
        model.mtp = MTPHead(args)
    if dtype is not None:
        model.set_dtype(dtype)
    if bits:
        quantize(model, bits=bits, group_size=group_size, quantize_mtp=False)
    if place is not None:
        place(model)
    model.eval()
    # one layer at a time: the whole lazy graph at once would hold every fp32 init at the 35B-A3B shape (~140 GB)
    for part in (*model.layers, model.model.embed_tokens, model):
        mx.eval(part.parameters())
    if fuse:
        fuse_projections(model)
    if place is None:
        keep_kernel_builds({"text_config": hub_config(mtp=mtp, **text)["text_config"],
                            "quantization": {"bits": bits, "group_size": group_size} if bits else None},
                           dtype or mx.float32)
    return model


# The family's text configs (hub layout, one MTP layer as the checkpoints have) that the Metal source check covers
# (tests/metal/test_metal_sources.py).
# Shapes from public configs (Qwen3.5 model cards and training scripts that carry their config.json values).
FAMILY = {name: hub_config(**shape)["text_config"] for name, shape in (
    ("0.8b", QWEN3_5_0_8B), ("2b", QWEN3_5_2B), ("4b", QWEN3_5_4B), ("9b", QWEN3_5_9B), ("27b", QWEN3_5_27B),
    ("35b-a3b", QWEN3_5_35B_A3B), ("122b-a10b", QWEN3_5_122B_A10B), ("397b-a17b", QWEN3_5_397B_A17B))}
