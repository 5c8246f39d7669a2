"""Local directory or hub id -> config -> Model (+ MTP head) -> weights -> tokenizer. Every failure is a LoadError."""

import glob
import gzip
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import settings
from .models.fuse import fuse_projections
from .models.layers import route_quantized
from .models.mtp import DraftVocab, MTPHead
from .models.qwen3_5 import Model, ModelArgs, sanitize

DEMO_MODEL = Path(__file__).parent / "assets" / "demo"  # its weights ship gzipped: demo_model() is the checkpoint
MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


class LoadError(Exception):
    """A checkpoint problem the user can fix; the message says how."""


_DEMO_DIGESTS: dict[tuple, str] = {}


def _demo_digest(files: list[Path]) -> str:
    """A digest of the packaged demo folder's files, names and bytes: any of them changed is another cache folder.
    Kept per process, keyed by the files' sizes and times (hashing ~9 MB costs tens of milliseconds a load)."""
    key = tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _DEMO_DIGESTS:
        h = hashlib.sha256()
        for f in files:
            h.update(f.name.encode() + b"\0" + f.read_bytes())
        _DEMO_DIGESTS[key] = h.hexdigest()[:16]
    return _DEMO_DIGESTS[key]


def demo_model() -> Path:
    """The embedded demo checkpoint as a directory any loader reads (mlx-lm's, transformers', this one's). The
    package ships its weights as model.safetensors.gz (18% smaller); the first call unpacks them, with the folder's
    other files, into a cache keyed by all of their digest ($LATTICE_CACHE, else $XDG_CACHE_HOME/lattice_mlx or
    ~/.cache/lattice_mlx, else the temporary folder's), atomically: a process finds the whole folder or none of it.
    A folder there that lacks a file is replaced; a folder it cannot write is passed over for the next one."""
    packed = DEMO_MODEL / "model.safetensors.gz"
    if (DEMO_MODEL / "model.safetensors").exists() or not packed.exists():
        return DEMO_MODEL  # unpacked in place (a build that did so), or absent: load() says so
    files = sorted(f for f in DEMO_MODEL.iterdir() if f.is_file())
    names = ["model.safetensors" if f == packed else f.name for f in files]
    digest = _demo_digest(files)
    roots = [Path(settings.raw("cache"))] if settings.raw("cache") else []
    try:
        roots.append(Path(settings.raw("cache_home") or Path.home() / ".cache") / "lattice_mlx")
    except RuntimeError:  # no home folder to be found
        pass
    roots.append(Path(tempfile.gettempdir()) / "lattice_mlx")
    tried = []
    for root in roots:
        target = root / f"demo-{digest}"
        try:
            if all((target / n).is_file() for n in names):
                return target
            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=root))
        except OSError as e:
            tried.append(f"{root} ({e.strerror or type(e).__name__})")
            continue  # not writable: the next root
        try:
            for f in files:
                if f == packed:
                    with gzip.open(packed, "rb") as src, open(tmp / "model.safetensors", "wb") as dst:
                        shutil.copyfileobj(src, dst, 1 << 20)
                else:
                    shutil.copyfile(f, tmp / f.name)
            os.chmod(tmp, 0o755)  # (mkdtemp's folder is its owner's alone; a shared cache is read by others)
            if target.exists() and not all((target / n).is_file() for n in names):  # lacks a file: moved aside
                # whole, then removed (a whole one there is another process's, made meanwhile: kept)
                try:
                    os.replace(target, tmp.with_name(tmp.name.replace(".demo-", ".stale-")))
                except OSError:  # (another process moved it first)
                    pass
                shutil.rmtree(tmp.with_name(tmp.name.replace(".demo-", ".stale-")), ignore_errors=True)
            try:
                os.replace(tmp, target)
            except OSError:  # another process got there first: its copy is the same
                pass
        except (EOFError, gzip.BadGzipFile, zlib.error) as e:
            raise LoadError(f"the embedded demo model's weights are damaged ({type(e).__name__}): reinstall "
                            "lattice_mlx") from None
        except OSError as e:  # a full disk, say: the next root
            tried.append(f"{root} ({e.strerror or type(e).__name__})")
            continue
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        try:
            if all((target / n).is_file() for n in names):
                return target
        except OSError:
            pass
        tried.append(f"{root} (incomplete after unpacking)")
    raise LoadError(f"cannot unpack the embedded demo model into {', '.join(tried)}: set LATTICE_CACHE to a writable "
                    "folder")


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


def checkpoint_dtype(weights: dict[str, mx.array]) -> mx.Dtype:
    """The dtype the checkpoint's activations run in: that of the embedding (its scales when quantized)."""
    w = weights.get("model.embed_tokens.scales", weights.get("model.embed_tokens.weight"))
    return w.dtype if w is not None else mx.float32


def model_args(config: dict, source: Path | str = "config.json") -> ModelArgs:
    """ModelArgs from a config; LoadError naming `source` (the config file) and the field when it is not one."""
    try:
        return ModelArgs.from_dict(config)
    except (TypeError, ValueError) as e:
        raise LoadError(f"{source} does not describe a valid Qwen3.5 model: {e}") from None


def build_model(config: dict, weights: dict[str, mx.array], args: ModelArgs | None = None) -> Model:
    """A model whose parameter tree matches `weights` (MTP head attached only when the checkpoint carries it)."""
    args = args or model_args(config)
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
            class_predicate=lambda p, m: f"{p}.scales" in weights and layer_quantization(quant, p),
        )
        route_quantized(model)
    return model


def layer_quantization(quant: dict, path: str) -> dict | bool:
    """A layer's own bits and group size where the checkpoint records them (mlx-lm writes them under its names,
    `language_model.<path>`; e.g. MoE routers at 8 bits), else True: the checkpoint-wide setting."""
    own = quant.get(path, quant.get(f"language_model.{path}"))
    return {"group_size": own["group_size"], "bits": own["bits"]} if isinstance(own, dict) else True


ROUTER_BITS = {"group_size": 64, "bits": 8}  # MoE routers and shared-expert gates, as mlx-lm keeps them


def quantize(model: Model, *, bits: int, group_size: int, quantize_mtp: bool) -> dict:
    """Affine-quantizes every Linear/Embedding whose input width divides into groups (the MTP head only if asked),
    MoE routers at 8 bits; returns the per-layer settings that differ from (bits, group_size), for config.json."""
    own = {}

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized") or (path.startswith("mtp.") and not quantize_mtp):
            return False
        if path.endswith((".mlp.gate", ".mlp.shared_expert_gate")) and module.weight.shape[-1] % 64 == 0:
            own[path] = ROUTER_BITS
            return ROUTER_BITS
        return module.weight.shape[-1] % group_size == 0

    nn.quantize(model, group_size=group_size, bits=bits, class_predicate=predicate)
    route_quantized(model)
    return own


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


def load_model(path: Path, *, dtype: str | None = None, fuse: bool = True, group=None,
               pipeline: bool = False, draft_vocab: bool = True, mtp: str = "replicated") -> tuple[Model, dict]:
    """Model and config from a checkpoint directory, the one load sequence (`convert` uses it too, with fuse=False:
    the checkpoint's own layout). `fuse` sets the runtime layout: projections that share an input stacked (exact,
    fewer matmuls: models/fuse.py), and on the CPU unquantized MoE experts in fp32 (MLX's CPU gather_mm needs it)."""
    config = read_config(path)
    args = model_args(config, path / "config.json")  # before the weights are read: a bad value is named first
    try:
        weights = sanitize(read_weights(path), tie_word_embeddings=args.tie_word_embeddings)
    except ValueError as e:
        raise LoadError(f"bad MoE experts in the checkpoint: {e}") from None
    model = build_model(config, weights, args)
    check_weights(model, weights)
    if group is not None and group.size() > 1 and pipeline:  # this stage's layers only: the rest is never read
        try:
            dropped = model.pipeline(group)
        except ValueError as e:
            raise LoadError(str(e)) from None
        weights = {k: v for k, v in weights.items() if k not in dropped}
    act_dtype = DTYPES[dtype] if dtype else checkpoint_dtype(weights)
    weights = cast_floats(weights, act_dtype)
    if fuse and mx.default_device() == mx.cpu:  # CPU gather_mm is fp32-only: unquantized MoE experts stay fp32 there
        weights = {k: v.astype(mx.float32) if ".switch_mlp." in k and k.endswith(".weight") and
                   f"{k[: -len('weight')]}scales" not in weights else v for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    del weights  # the model holds the (lazy) tensors now; a tensor-parallel rank's full tensors are freed once sliced
    model.eval()
    if group is not None and group.size() > 1 and not pipeline:  # tensor parallel: this rank's slices, then fused
        try:
            model.shard(group, mtp=mtp)
        except ValueError as e:
            raise LoadError(str(e)) from None
    if fuse:
        fuse_projections(model)
    for part in (*model.layers, model):  # a layer at a time: the peak stays near one layer's full tensors
        mx.eval(part.parameters())
    if model.has_mtp and draft_vocab:
        model.mtp.draft_vocab = read_draft_vocab(path, model.args.vocab_size)
    if group is None or group.size() == 1:
        keep_kernel_builds(config, act_dtype)
    return model, config


def keep_kernel_builds(config: dict, dtype: mx.Dtype) -> None:
    """On MLX's CUDA backend (LATTICE_KERNEL_CACHE on, the default), the model's kernel variants built into MLX's
    PTX cache now, in parallel, where a previous process has not (metal/cuda_cache.py); else nothing. A failure
    leaves the builds to MLX, as without it."""
    from .metal import _dialect, cuda_cache, use_kernels

    if not (cuda_cache.enabled() and use_kernels() and _dialect.backend() == "cuda"):
        return
    from .variants import prebuild

    text = dict(config.get("text_config") or config)
    quant = config.get("quantization") or config.get("quantization_config") or {}
    try:
        prebuild(text, dtype=dtype, bits=quant.get("bits"), group_size=quant.get("group_size", 64))
    except Exception as e:  # noqa: BLE001 (NVRTC missing or failing: MLX builds each kernel as it first runs)
        print(f"lattice_mlx: kernels not prebuilt ({type(e).__name__}: {str(e).strip()[:200]})", file=sys.stderr)


def on_cuda() -> bool:
    """Whether MLX computes on its CUDA backend here (the default device a GPU, and not Metal's)."""
    return mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()


def keep_round_builds(model: Model) -> None:
    """On MLX's CUDA backend, for a model with an MTP head about to speculate adaptively (`stream_generate` and so
    the generate CLI and the API, chat, the benchmarks; the first call per model in a process): every kind of pass
    adaptive speculation runs, each depth and each change between them (speculative/pipelined.warm_rounds), run
    once per machine, announced in one line. MLX keeps the kernels it builds
    for them in its PTX cache, and a marker there records that this model (its parameters' names, shapes and dtypes:
    its shape, quantization and activation dtype) was warmed with this package's source; a later process only loads
    them. Without this a kind of pass not seen before on the machine compiled for seconds in the middle of a
    generation (docs/adr/0008, 'Runs N and O'); with it a fresh GPU machine spent 142 s on it once for the demo (then
    2.4 s for a model of another shape: the kernels are mostly shared), too long for every load (plain decoding never
    pays it). Elsewhere nothing: MLX's CPU backend builds the traced steps
    where they are first run, and on Metal the builds are not kept on disk. A failure leaves the builds to the
    generations, as without it."""
    from .metal import cuda_cache
    from .runtime import runtime_of, source_digest
    from .speculative import pipelined
    from .speculative.options import ADAPTIVE_MAX_K

    if not (model.has_mtp and on_cuda() and pipelined.tracing_enabled()):
        return
    runtime = runtime_of(model)
    if runtime.round_builds:  # (checked in this process: the API asks before every adaptive generation)
        return
    runtime.round_builds = True
    params = [(name, tuple(a.shape), str(a.dtype)) for name, a in tree_flatten(model.parameters())]
    key = hashlib.sha256(f"{mx.__version__}|{source_digest()}|{params}".encode()).hexdigest()[:24]
    marker = cuda_cache.cache_dir() / f"lattice_rounds_{key}.done"
    if marker.exists():
        return
    print("lattice_mlx: compiling the speculative decoding kernels for this machine, once ...", file=sys.stderr,
          flush=True)
    tic = time.perf_counter()
    try:
        pipelined.warm_rounds(model, ADAPTIVE_MAX_K)
        marker.parent.mkdir(parents=True, exist_ok=True)
        part = marker.with_suffix(f".{os.getpid()}.part")
        part.write_text(f"{time.perf_counter() - tic:.1f} s\n")
        part.replace(marker)
    except Exception as e:  # noqa: BLE001 (the generations build what they need, as without it)
        print(f"lattice_mlx: speculative kernels not prebuilt ({type(e).__name__}: {' '.join(str(e).split())[:200]})",
              file=sys.stderr, flush=True)
        return
    print(f"lattice_mlx: done in {time.perf_counter() - tic:.1f} s (kept in {marker.parent})", file=sys.stderr,
          flush=True)


def read_draft_vocab(path: Path, vocab_size: int) -> DraftVocab | None:
    """The MTP head's draft vocabulary (`convert --draft-vocab`) if the checkpoint has one."""
    f = Path(path) / DraftVocab.FILE
    if not f.exists():
        return None
    try:
        ids = json.loads(f.read_text())["ids"]
        ok = isinstance(ids, list) and ids and all(isinstance(i, int) and 0 <= i < vocab_size for i in ids)
    except (ValueError, KeyError, TypeError, OSError):
        ok = False
    if not ok:
        raise LoadError(f"{f} is not a draft vocabulary: it needs \"ids\", a non-empty list of token ids below "
                        f"{vocab_size} (rewrite it with convert --draft-vocab, or delete it to draft from the whole "
                        f"vocabulary)")
    return DraftVocab(ids)


# Any one of these makes a tokenizer (fast, sentencepiece, or byte-level BPE); without them transformers silently
# builds an empty one and every prompt encodes to nothing.
TOKENIZER_SOURCES = (("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"))


def check_tokenizer_files(path: Path) -> None:
    if not any(all((path / f).exists() for f in files) for files in TOKENIZER_SOURCES):
        raise LoadError(f"{path} has no tokenizer: it needs tokenizer.json (or tokenizer.model, or vocab.json with "
                        "merges.txt); copy them from the original checkpoint")


def load_tokenizer(path: Path, config: dict):
    from mlx_lm.tokenizer_utils import load as load_mlx_lm_tokenizer

    check_tokenizer_files(path)
    eos = (config.get("text_config") or {}).get("eos_token_id", config.get("eos_token_id"))
    eos = [eos] if isinstance(eos, int) else eos
    try:
        tokenizer = load_mlx_lm_tokenizer(path, eos_token_ids=eos)
    except Exception as e:
        raise LoadError(f"cannot load the tokenizer from {path} ({type(e).__name__}: {e})") from None
    # the context length is checked against the model's config (generate.check_context), in one line; transformers'
    # own warning at encode time, from tokenizer_config.json's limit, would be a second, different line
    tokenizer._tokenizer.model_max_length = int(1e30)
    return tokenizer


def load(path_or_repo: str | Path | None = None, *, dtype: str | None = None, group=None, pipeline: bool = False,
         mtp: str = "replicated"):
    """(model, tokenizer) from a local directory or a hub id; the embedded demo model when none is given. With a
    distributed `group` of several processes the model runs tensor-parallel over it (Model.shard; `mtp="sharded"`
    splits the MTP head's layer too), or with `pipeline` as a pipeline of layer ranges (Model.pipeline: each process
    reads and holds only its layers)."""
    if path_or_repo is None:
        if not (DEMO_MODEL / "config.json").exists():
            raise LoadError("no embedded demo model in this build: pass --model PATH")
        path_or_repo = demo_model()
    path = resolve_path(path_or_repo)
    model, config = load_model(path, dtype=dtype, group=group, pipeline=pipeline, mtp=mtp)
    return model, load_tokenizer(path, config)
