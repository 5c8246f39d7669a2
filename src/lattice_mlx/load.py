"""Local directory or hub id -> config -> Model (+ MTP head) -> weights -> tokenizer. Every failure is a LoadError."""

import glob
import json
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .models.fuse import fuse_projections
from .models.mtp import MTPHead
from .models.qwen3_5 import Model, ModelArgs, route_quantized

DEMO_MODEL = Path(__file__).parent / "assets" / "demo"
MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
# RMSNorms stored zero-centred in raw HF checkpoints (applied as x * (1 + w)); the GDN gated norm is not one of them.
SHIFTED_NORMS = re.compile(
    r"(input_layernorm|post_attention_layernorm|q_norm|k_norm|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight$"
    r"|^(model|mtp)\.norm\.weight$"
)
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


class LoadError(Exception):
    """A checkpoint problem the user can fix; the message says how."""


def resolve_path(path_or_repo: str | Path) -> Path:
    path = Path(path_or_repo).expanduser()
    if path.exists():
        if not path.is_dir():
            raise LoadError(f"{path} is a file: pass the checkpoint's directory")
        return path
    if str(path_or_repo).startswith((".", "/", "~")) or str(path_or_repo).count("/") != 1:
        raise LoadError(f"no such directory: {path_or_repo}")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.txt", "*.model"]
        return Path(snapshot_download(str(path_or_repo), allow_patterns=patterns))
    except Exception as e:  # offline, unknown repo, gated repo: all end the same way for the user
        raise LoadError(
            f"could not fetch '{path_or_repo}' from the Hugging Face hub ({type(e).__name__}); "
            "pass a local checkpoint directory instead"
        ) from None


def read_config(path: Path) -> dict:
    file = path / "config.json"
    if not file.exists():
        raise LoadError(f"{path} has no config.json: is it a model checkpoint directory?")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoadError(f"{file} is not valid JSON ({e})") from None
    types = {config.get("model_type"), (config.get("text_config") or {}).get("model_type")}
    if not types & set(MODEL_TYPES):
        raise LoadError(f"unsupported model_type {config.get('model_type')!r}: lattice_mlx runs {', '.join(MODEL_TYPES)}")
    return config


def read_weights(path: Path) -> dict[str, mx.array]:
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise LoadError(f"{path} has no *.safetensors weight files")
    weights = {}
    for f in files:
        try:
            weights.update(mx.load(f))
        except Exception as e:
            raise LoadError(f"cannot read {Path(f).name}: truncated or corrupt safetensors ({e})") from None
    return weights


def sanitize(weights: dict[str, mx.array], *, tie_word_embeddings: bool) -> dict[str, mx.array]:
    """Checkpoint names -> this package's names; raw HF tensors -> MLX layout (+1 norm shift, conv axes). Idempotent:
    a raw HF checkpoint is recognised by its conv1d weights in HF's [C, 1, K] layout, which this moves to [C, K, 1]."""
    out = {}
    for k, v in weights.items():
        if k.startswith(("model.visual.", "visual.", "vision_tower.", "model.vision_tower.")):
            continue
        if k.startswith("model.language_model."):
            k = "model." + k[len("model.language_model.") :]
        elif k.startswith("language_model.model."):
            k = "model." + k[len("language_model.model.") :]
        elif k.startswith("language_model."):
            k = k[len("language_model.") :]
        out[k] = v
    if tie_word_embeddings:
        out = {k: v for k, v in out.items() if not k.startswith("lm_head.")}
    raw = any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in out.items())
    if raw:
        for k, v in out.items():
            if k.endswith("conv1d.weight"):
                out[k] = v.moveaxis(2, 1)
            elif SHIFTED_NORMS.search(k) and v.ndim == 1:
                # 1 + w rounded to bf16 would be off by up to 2^-9; the loader casts to the model dtype it chooses.
                out[k] = v.astype(mx.float32) + 1.0
    return out


def checkpoint_dtype(weights: dict[str, mx.array]) -> mx.Dtype:
    """The dtype the checkpoint's activations run in: that of the embedding (its scales when quantized)."""
    w = weights.get("model.embed_tokens.scales", weights.get("model.embed_tokens.weight"))
    return w.dtype if w is not None else mx.float32


def build_model(config: dict, weights: dict[str, mx.array]) -> Model:
    """A model whose parameter tree matches `weights` (MTP head attached only when the checkpoint carries it)."""
    try:
        args = ModelArgs.from_dict(config)
    except (TypeError, ValueError) as e:
        raise LoadError(f"config.json does not describe a valid Qwen3.5 model: {e}") from None
    model = Model(args)
    if any(k.startswith("mtp.") for k in weights):
        model.mtp = MTPHead(args, rotated="rotation" in config)
    quant = config.get("quantization") or config.get("quantization_config")
    if quant and quant.get("quant_method", "mlx") != "mlx":
        raise LoadError(f"{quant['quant_method']!r} quantized checkpoints are not supported: convert the unquantized "
                        "checkpoint with `python -m lattice_mlx.convert -q` instead")
    if quant and "bits" in quant:
        nn.quantize(
            model,
            group_size=quant["group_size"],
            bits=quant["bits"],
            class_predicate=lambda p, m: f"{p}.scales" in weights,
        )
        route_quantized(model)
    return model


def check_weights(model: Model, weights: dict[str, mx.array]) -> None:
    expected = dict(tree_flatten(model.parameters()))
    for k, v in expected.items():
        if k not in weights:
            raise LoadError(f"checkpoint is missing tensor {k!r}")
        if weights[k].shape != v.shape:
            raise LoadError(f"tensor {k!r} has shape {tuple(weights[k].shape)}, expected {tuple(v.shape)}")
    extra = sorted(set(weights) - set(expected))
    if extra:
        raise LoadError(f"checkpoint has {len(extra)} tensors this model does not use, e.g. {extra[0]!r}")


def cast_floats(weights: dict[str, mx.array], dtype: mx.Dtype) -> dict[str, mx.array]:
    """Floating tensors to `dtype`, except A_log (the GDN decay is computed in fp32 from it)."""
    return {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) and not k.endswith("A_log") else v
            for k, v in weights.items()}


def load_model(path: Path, *, dtype: str | None = None, fuse: bool = True) -> tuple[Model, dict]:
    """Model and config from a checkpoint directory; `fuse` stacks projections that share an input (exact, fewer
    matmuls: models/fuse.py); hf_parameters() gives a fused model's tensors under the checkpoint's names."""
    config = read_config(path)
    text = config.get("text_config") or config
    weights = sanitize(read_weights(path), tie_word_embeddings=text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    model = build_model(config, weights)
    check_weights(model, weights)
    weights = cast_floats(weights, DTYPES[dtype] if dtype else checkpoint_dtype(weights))
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    if fuse:
        fuse_projections(model)
    mx.eval(model.parameters())
    return model, config


def load_tokenizer(path: Path, config: dict):
    from mlx_lm.tokenizer_utils import load as load_mlx_lm_tokenizer

    eos = (config.get("text_config") or {}).get("eos_token_id", config.get("eos_token_id"))
    eos = [eos] if isinstance(eos, int) else eos
    try:
        return load_mlx_lm_tokenizer(path, eos_token_ids=eos)
    except Exception as e:
        raise LoadError(f"cannot load the tokenizer from {path} ({type(e).__name__}: {e})") from None


def load(path_or_repo: str | Path | None = None, *, dtype: str | None = None):
    """(model, tokenizer) from a local directory or a hub id; the embedded demo model when none is given."""
    if path_or_repo is None:
        if not (DEMO_MODEL / "config.json").exists():
            raise LoadError("no embedded demo model in this build: pass --model PATH")
        path_or_repo = DEMO_MODEL
    path = resolve_path(path_or_repo)
    model, config = load_model(path, dtype=dtype)
    return model, load_tokenizer(path, config)
