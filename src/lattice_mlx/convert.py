"""HF checkpoint -> MLX checkpoint (optionally 4/8-bit), keeping `mtp.*`; `python -m lattice_mlx.convert`."""

import glob
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

from .cli import ArgumentParser, command_name
from .load import (
    DTYPES,
    LoadError,
    check_tokenizer_files,
    load_model,
    load_tokenizer,
    quantize,
    read_draft_vocab,
    resolve_path,
)
from .models.mtp import DraftVocab
from .rotate import rotate_model
from .startup import interrupts_to_main

DEFAULT_Q_BITS = 4
DEFAULT_Q_GROUP_SIZE = 64
DEFAULT_MTP_DTYPE = "bfloat16"
SHARD_BYTES = 2 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


def rotate_into(model, config: dict, *, seed: int) -> None:
    """Folds a Hadamard rotation into the (dense) model in fp32 and records it in `config` (lm_head becomes untied)."""
    if config.get("rotation"):
        raise LoadError("this checkpoint is already rotated")
    if config.get("quantization"):
        raise LoadError("rotate a dense checkpoint: this one is already quantized")
    dtypes = {k: v.dtype for k, v in tree_flatten(model.parameters())}
    model.set_dtype(mx.float32)
    try:
        config["rotation"] = rotate_model(model, seed=seed)
    except ValueError as e:
        raise LoadError(str(e)) from None
    default = dtypes["model.embed_tokens.weight"]
    model.update(tree_unflatten([(k, v.astype(dtypes.get(k, default))) for k, v in tree_flatten(model.parameters())]))
    for c in (config, config.get("text_config") or {}):
        c["tie_word_embeddings"] = False


def save_weights(dst: Path, weights: dict[str, mx.array]) -> None:
    shards, current, size = [], {}, 0
    for k, v in weights.items():
        if current and size + v.nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = {}, 0
        current[k], size = v, size + v.nbytes
    shards.append(current)
    index = {}
    for i, shard in enumerate(tqdm(shards, desc="writing", unit="shard")):
        name = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(dst / name), shard, metadata={"format": "mlx"})
        index.update({k: name for k in shard})
    if len(shards) > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}, indent=2))


def _corpus_files(corpus: Path) -> list[Path]:
    if corpus.is_file():
        return [corpus]
    if corpus.is_dir():
        return sorted(p for p in corpus.rglob("*") if p.is_file())
    raise LoadError(f"--draft-corpus {corpus}: no such file or directory")


def draft_vocab_ids(src: Path, config: dict, size: int, vocab: int, corpus: str | None) -> dict:
    """The `size` most frequent token ids of `corpus` (text files, counted with the checkpoint's tokenizer; ties by
    id), or without a corpus the lowest ids (byte-level BPE vocabularies list merges in the order they were learned,
    most frequent first: a proxy); the end-of-sequence ids always included. Returns draft_vocab.json's content."""
    tok = load_tokenizer(src, config)
    eos = sorted(i for i in getattr(tok, "eos_token_ids", []) if 0 <= i < vocab)
    if corpus is None:
        ids = sorted(set(range(size)) | set(eos))
        return {"ids": ids, "source": "token-id order (no --draft-corpus)", "coverage": None}
    counts, total = np.zeros(vocab, dtype=np.int64), 0
    for f in tqdm(_corpus_files(Path(corpus)), desc="counting tokens", unit="file"):
        text = f.read_text(encoding="utf-8", errors="ignore")
        ids = np.asarray(tok.encode(text, add_special_tokens=False) if text else [], dtype=np.int64)
        ids = ids[(ids >= 0) & (ids < vocab)]
        counts += np.bincount(ids, minlength=vocab)
        total += ids.size
    if total == 0:
        raise LoadError(f"--draft-corpus {corpus}: no text in it")
    top = np.lexsort((np.arange(vocab), -counts))[:size]
    ids = sorted(set(top.tolist()) | set(eos))
    return {"ids": ids, "source": f"--draft-corpus {Path(corpus).name}: {total} tokens",
            "coverage": round(float(counts[ids].sum()) / total, 6)}


def convert(hf_path: str, mlx_path: str, *, quantize_bits: int | None = None, group_size: int = DEFAULT_Q_GROUP_SIZE,
            quantize_mtp: bool = False, dtype: str | None = None, force: bool = False,
            rotate_seed: int | None = None, mtp_dtype: str | None = DEFAULT_MTP_DTYPE, draft_vocab: int | None = None,
            draft_corpus: str | None = None) -> Path:
    """`draft_vocab`: the MTP head drafts from this many frequent ids (models/mtp.py DraftVocab; 0: the whole
    vocabulary; None: as the source has it). Off unless asked for: its acceptance cost on a real Qwen3.5 checkpoint
    has not been measured yet (docs/mtp.md has the demo's)."""
    dst = Path(mlx_path)
    if dst.exists() and not force:
        raise LoadError(f"{dst} already exists: choose another --mlx-path or pass --force")
    src = resolve_path(hf_path)
    check_tokenizer_files(src)
    model, config = load_model(src, dtype=dtype, fuse=False, draft_vocab=False)  # the draft vocabulary: below
    vocab = model.args.vocab_size
    if draft_vocab and not model.has_mtp:
        raise LoadError("--draft-vocab: this checkpoint has no MTP head to draft with")
    if draft_vocab is not None and draft_vocab >= vocab:
        raise LoadError(f"--draft-vocab {draft_vocab}: must be below the vocabulary size ({vocab}); 0 turns it off")
    keep_source = draft_vocab is None and (src / DraftVocab.FILE).exists()
    if keep_source:
        read_draft_vocab(src, vocab)  # a corrupt one is named here (replace it with --draft-vocab N, or 0)
    if draft_corpus is not None and not draft_vocab:
        raise LoadError("--draft-corpus chooses the ids of a draft vocabulary: give its size with --draft-vocab N")
    draft = draft_vocab_ids(src, config, draft_vocab, vocab, draft_corpus) if draft_vocab else None
    if rotate_seed is not None:
        rotate_into(model, config, seed=rotate_seed)
    if quantize_bits:
        if config.get("quantization"):
            raise LoadError(f"{src} is already quantized")
        own = quantize(model, bits=quantize_bits, group_size=group_size, quantize_mtp=quantize_mtp)
        config["quantization"] = {"group_size": group_size, "bits": quantize_bits, **own}
    out = dict(tree_flatten(model.parameters()))
    if mtp_dtype is not None:  # the head stays in this dtype unless it was quantized
        out = {k: v.astype(DTYPES[mtp_dtype]) if k.startswith("mtp.") and mx.issubdtype(v.dtype, mx.floating)
               and not (quantize_mtp and quantize_bits) else v for k, v in out.items()}
    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(dst)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_temp_prefix(dst)}{os.getpid()}-", dir=dst.parent))
    old = tmp.with_name(tmp.name + "-replaced")  # --force: the previous output, until the new one is in place
    try:
        save_weights(tmp, out)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for name in TOKENIZER_FILES + ((DraftVocab.FILE,) if keep_source else ()):
            if (src / name).exists():
                shutil.copy(src / name, tmp / name)
        if draft is not None:
            (tmp / DraftVocab.FILE).write_text(json.dumps(draft))
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp made it private; the result is an ordinary directory
        if dst.exists():
            dst.rename(old)
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old.exists() and not dst.exists():
            old.rename(dst)
        raise
    shutil.rmtree(old, ignore_errors=True)
    return dst


def _temp_prefix(dst: Path) -> str:
    return f".{dst.name}.converting-{socket.gethostname()}-"


def remove_stale_temp_dirs(dst: Path) -> None:
    """Temp folders an interrupted earlier run on this host left beside `dst` (killed: no cleanup ran) go, with one
    line each; host and process id are in the name, so a conversion still running (here or on another machine
    sharing the folder) keeps its folder."""
    prefix = _temp_prefix(dst)
    for old in dst.parent.glob(glob.escape(prefix) + "*"):
        pid = old.name[len(prefix) :].split("-")[0]
        if pid.isdigit() and _alive(int(pid)):
            continue
        shutil.rmtree(old, ignore_errors=True)
        print(f"removed {old}, left by an interrupted conversion", file=sys.stderr)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _terminate(signum, frame):
    raise KeyboardInterrupt  # SIGTERM takes the same cleanup path as Ctrl-C


def setup_arg_parser() -> ArgumentParser:
    p = ArgumentParser(prog=command_name("lattice_mlx.convert"), description="Convert a Qwen3.5 checkpoint for MLX.")
    p.add_argument("--hf-path", required=True, help="local HF checkpoint directory or hub repo id")
    p.add_argument("--mlx-path", required=True, help="output directory (written atomically)")
    p.add_argument("-q", "--quantize", action="store_true", help="affine-quantize the linears and embeddings")
    p.add_argument("--q-bits", type=int, choices=[4, 8], help=f"with -q (default {DEFAULT_Q_BITS})")
    p.add_argument("--q-group-size", type=int, choices=[32, 64, 128], help=f"with -q (default {DEFAULT_Q_GROUP_SIZE})")
    p.add_argument("--quantize-mtp", action="store_true", help="quantize the MTP head too (default: keep it as is)")
    p.add_argument("--dtype", choices=list(DTYPES), help="cast floating weights (default: keep the stored dtype)")
    p.add_argument("--force", action="store_true", help="replace --mlx-path if it exists")
    p.add_argument("--mtp-dtype", choices=[*DTYPES, "keep"], default=DEFAULT_MTP_DTYPE,
                   help="dtype of an unquantized MTP head (default bfloat16)")
    p.add_argument("--rotate", action="store_true", help="fold a Hadamard rotation into the residual stream first")
    p.add_argument("--rotation-seed", type=int, default=0, help="seed of the rotation's random signs")
    p.add_argument("--draft-vocab", type=int, metavar="N",
                   help="the MTP head drafts from the N most frequent token ids, e.g. 32768 (its lm_head then reads "
                        "N rows; 0: the whole vocabulary; default: as the source checkpoint has it)")
    p.add_argument("--draft-corpus", metavar="PATH",
                   help="text file or folder whose token counts rank the draft ids (default: token-id order)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    if not args.quantize and (args.q_bits or args.q_group_size or args.quantize_mtp):
        parser.error("--q-bits, --q-group-size and --quantize-mtp take effect with -q (--quantize): add -q")
    if args.draft_vocab is not None and args.draft_vocab < 0:
        parser.error(f"--draft-vocab {args.draft_vocab}: give a number of token ids >= 0 (0 turns it off)")
    in_main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminate) if in_main_thread else None
    try:
        interrupts_to_main()  # (inside the try: a Ctrl-C after it is caught below)
        dst = convert(args.hf_path, args.mlx_path, quantize_bits=(args.q_bits or DEFAULT_Q_BITS) if args.quantize
                      else None, group_size=args.q_group_size or DEFAULT_Q_GROUP_SIZE, quantize_mtp=args.quantize_mtp,
                      dtype=args.dtype, force=args.force, rotate_seed=args.rotation_seed if args.rotate else None,
                      mtp_dtype=None if args.mtp_dtype == "keep" else args.mtp_dtype, draft_vocab=args.draft_vocab,
                      draft_corpus=args.draft_corpus)
    except (LoadError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: nothing was written (the partial output was removed)", file=sys.stderr)
        return 130
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, before)
    print(f"wrote {dst}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
