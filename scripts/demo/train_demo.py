"""Train the lattice_mlx demo model: a small Qwen3.5 GDN hybrid with a jointly trained MTP head on CPython's Lib/.

Writes a Hugging Face hub-layout checkpoint (Qwen3_5ForConditionalGeneration naming, `mtp.*` at top level,
bf16 shards), a byte-level BPE tokenizer, and train_log.json with held-out metrics.

    python scripts/demo/train_demo.py --out-dir .demo-build/run
    python scripts/demo/train_demo.py --write-prompts src/lattice_mlx/assets/prompts/demo_heldout.json
"""

import argparse
import copy
import json
import math
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import tokenizers
import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling build_corpus.py
from build_corpus import legacy_heldout as is_heldout  # noqa: E402  (the standard library's split, by path)
from build_corpus import read_documents, sample_documents  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5ForCausalLM,
    Qwen3_5RMSNorm,
)

DEFAULT_OUT_DIR = ".demo-build/run"
DEFAULT_SEED = 1234
DEFAULT_VOCAB_SIZE = 8192
DEFAULT_HIDDEN_SIZE = 320
DEFAULT_INTERMEDIATE_SIZE = 768
DEFAULT_NUM_LAYERS = 8
DEFAULT_SEQ_LEN = 512
DEFAULT_BATCH_SIZE = 64
DEFAULT_LR = 2e-3
DEFAULT_MIN_LR_RATIO = 0.1
DEFAULT_WEIGHT_DECAY = 0.1
DEFAULT_WARMUP_STEPS = 150
DEFAULT_MTP_LOSS_WEIGHT = 0.5
DEFAULT_TRAIN_SECONDS = 360.0
DEFAULT_DEADLINE_SECONDS = 540.0
DEFAULT_RESERVE_SECONDS = 60.0
DEFAULT_MAX_STEPS = 0
DEFAULT_LOG_EVERY = 25
DEFAULT_HELDOUT_PERCENT = 3
DEFAULT_MAX_FILE_BYTES = 400_000
DEFAULT_MAX_FILES = 0
DEFAULT_EVAL_TOKENS = 1_000_000
DEFAULT_SHARD_BYTES = 14_000_000
DEFAULT_NUM_PROMPTS = 32
DEFAULT_PROMPT_LINES = 6

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"""
    r"""| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
HF_NOISE_KEYS = (
    "architectures",
    "_name_or_path",
    "transformers_version",
    "pad_token_id",
    "bos_token_id",
    "output_hidden_states",
    "output_attentions",
    "return_dict",
    "chunk_size_feed_forward",
    "is_encoder_decoder",
    "id2label",
    "label2id",
    "problem_type",
)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass
class Corpus:
    root: str
    train: list[tuple[str, str]] = field(default_factory=list)
    heldout: list[tuple[str, str]] = field(default_factory=list)


def list_stdlib_files(root: Path, max_bytes: int) -> list[str]:
    rels = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "dist-packages/")) or "__pycache__" in rel:
            continue
        # The largest files are generated tables (pydoc_data/topics.py).
        if path.is_file() and path.stat().st_size <= max_bytes:
            rels.append(rel)
    return sorted(rels)


def load_corpus(root: Path, *, percent: int, max_bytes: int, max_files: int) -> Corpus:
    corpus = Corpus(root=str(root))
    rels = list_stdlib_files(root, max_bytes)
    if max_files:
        rels = rels[:max_files]
    for rel in rels:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        (corpus.heldout if is_heldout(rel, percent) else corpus.train).append((rel, text))
    if not corpus.train or not corpus.heldout:
        sys.exit(f"error: too few .py files under {root}; pass --corpus-dir with a CPython Lib/ folder")
    return corpus


def load_built_corpus(root: Path, *, max_files: int) -> Corpus:
    """train.txt / heldout.txt of scripts/demo/build_corpus.py (documents separated by <|endoftext|>)."""
    corpus = Corpus(root=str(root))
    for split in ("train", "heldout"):
        try:
            docs = read_documents(root / f"{split}.txt")
        except OSError as e:
            sys.exit(f"error: cannot read {root / split}.txt ({e}); run scripts/demo/build_corpus.py --out {root}")
        docs = docs[:max_files] if max_files else docs
        getattr(corpus, split).extend((f"{split}/{i}", d) for i, d in enumerate(docs))
    if not corpus.train or not corpus.heldout:
        sys.exit(f"error: {root} holds no train or no held-out documents")
    return corpus


def train_tokenizer(texts: list[str], vocab_size: int) -> tokenizers.Tokenizer:
    """Qwen2/3.5's own pipeline (NFC, split regex, byte level): transformers 5 rebuilds it from model_type anyway."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.normalizer = tokenizers.normalizers.NFC()
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Sequence(
        [
            tokenizers.pre_tokenizers.Split(tokenizers.Regex(QWEN_SPLIT_REGEX), behavior="isolated", invert=False),
            tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_stream(tok: tokenizers.Tokenizer, texts: list[str]) -> torch.Tensor:
    """Documents concatenated, each followed by <|endoftext|>."""
    eos = tok.token_to_id(SPECIAL_TOKENS[0])
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)


def build_text_config(args: argparse.Namespace, eos_id: int) -> Qwen3_5TextConfig:
    n = args.num_layers
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]
    return Qwen3_5TextConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=n,
        layer_types=layer_types,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        # 16 rotary dims = 8 frequencies; the section splits them like Qwen3.5's [11, 11, 10] splits 32.
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": 0.25,
            "mrope_section": [3, 3, 2],
            "mrope_interleaved": True,
        },
        eos_token_id=eos_id,
    )


class MTPHead(nn.Module):
    """vLLM-convention MTP: fc([norm_e(embed(t+1)), norm_h(h_t)]) -> one attention layer -> norm -> tied lm_head."""

    def __init__(self, trunk_config: Qwen3_5TextConfig):
        super().__init__()
        cfg = copy.deepcopy(trunk_config)
        cfg.num_hidden_layers = 1
        cfg.layer_types = ["full_attention"]
        cfg._attn_implementation = "sdpa"
        hidden = cfg.hidden_size
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(hidden, eps=cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(hidden, eps=cfg.rms_norm_eps)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(cfg, layer_idx=0)])
        self.norm = Qwen3_5RMSNorm(hidden, eps=cfg.rms_norm_eps)
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=cfg.initializer_range)

    def forward(self, emb_next: torch.Tensor, hidden: torch.Tensor, rotary: nn.Module) -> torch.Tensor:
        """Shapes: emb_next, hidden [B, T, H] -> [B, T, H]; slot t sits at RoPE position t."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb_next), self.pre_fc_norm_hidden(hidden)], dim=-1))
        T = x.shape[1]
        positions = torch.arange(T, device=x.device).view(1, 1, T).expand(3, 1, T)  # [3, 1, T]
        rope = rotary(x, positions)
        # Explicit boolean causal mask: correct whatever attention backend the installed transformers picks.
        mask = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()[None, None]
        x = self.layers[0](x, position_embeddings=rope, attention_mask=mask)
        return self.norm(x)


class DemoModel(nn.Module):
    def __init__(self, config: Qwen3_5TextConfig):
        super().__init__()
        self.trunk = Qwen3_5ForCausalLM(config)
        self.mtp = MTPHead(self.trunk.config)

    def forward(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Shapes: window [B, T+1] -> main logits [B, T, V] (predict t+1), MTP logits [B, T-1, V] (predict t+2)."""
        inputs = window[:, :-1]
        hidden = self.trunk.model(input_ids=inputs).last_hidden_state  # [B, T, H], post final norm
        embed = self.trunk.model.embed_tokens
        main = self.trunk.lm_head(hidden)
        mtp_hidden = self.mtp(embed(inputs[:, 1:]), hidden[:, :-1], self.trunk.model.rotary_emb)
        return main, F.linear(mtp_hidden, embed.weight)


def losses(model: DemoModel, window: torch.Tensor, mtp_target: str = "labels"
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Main CE and the MTP head's loss: CE to the corpus labels (t+2), or self-distillation (KL from the trunk's
    own distribution over t+2, i.e. its logits one position later, detached), or their mean ("both")."""
    main, mtp = model(window)
    main_loss = F.cross_entropy(main.flatten(0, 1).float(), window[:, 1:].flatten())
    mtp_loss = F.cross_entropy(mtp.flatten(0, 1).float(), window[:, 2:].flatten())
    if mtp_target != "labels":
        teacher = F.log_softmax(main[:, 1:].detach().float(), dim=-1)
        kl = F.kl_div(F.log_softmax(mtp.float(), dim=-1), teacher, log_target=True, reduction="none").sum(-1).mean()
        mtp_loss = kl if mtp_target == "distill" else 0.5 * (kl + mtp_loss)
    return main_loss, mtp_loss, main, mtp


@torch.no_grad()
def check_causality(model: DemoModel, vocab: int, device: torch.device) -> None:
    """A changed token j may not move main logits before j or MTP logits before slot j-1 (fp32, no TF32)."""
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    window = torch.randint(0, vocab, (2, 130), generator=torch.Generator().manual_seed(0)).to(device)
    main_a, mtp_a = model(window)
    j = 70
    window[:, j] = (window[:, j] + 1) % vocab
    main_b, mtp_b = model(window)
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    for name, a, b, first in (("trunk", main_a, main_b, j), ("MTP head", mtp_a, mtp_b, j - 1)):
        leak = (a[:, :first] - b[:, :first]).abs().max().item()
        signal = (a[:, first] - b[:, first]).abs().max().item()
        # A real leak through attention is ~1/T of the signal; kernel noise is far below 1e-3 of it.
        assert signal > 0 and leak <= 1e-3 * signal, f"{name} is not causal: leak {leak:.3g}, signal {signal:.3g}"


def lr_at(step: int, progress: float, args: argparse.Namespace) -> float:
    """Linear warmup by steps, then cosine over the fraction of the time budget used."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    cosine = 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * cosine)


def make_optimizer(model: nn.Module, args: argparse.Namespace, device: torch.device) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def train(model: DemoModel, data: torch.Tensor, args: argparse.Namespace, device: torch.device, stop_at: float) -> dict:
    opt = make_optimizer(model, args, device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    offsets = torch.arange(args.seq_len + 1, device=device)
    curve, step, t0 = [], 0, time.time()
    budget_end = min(t0 + args.train_seconds, stop_at)
    while time.time() < budget_end and (not args.max_steps or step < args.max_steps):
        lr = lr_at(step, (time.time() - t0) / (budget_end - t0), args)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, len(data) - args.seq_len - 1, (args.batch_size,), device=device, generator=gen)
        window = data[starts[:, None] + offsets]  # [B, T+1]
        with torch.autocast(device.type, dtype=torch.bfloat16):
            main_loss, mtp_loss, _, _ = losses(model, window, args.mtp_target)
        loss = main_loss + args.mtp_loss_weight * mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % args.log_every == 0 or step == 1:
            point = {
                "step": step,
                "tokens": step * args.batch_size * args.seq_len,
                "elapsed_s": time.time() - t0,
                "lr": lr,
                "loss": main_loss.item(),
                "mtp_loss": mtp_loss.item(),
                "grad_norm": grad_norm.item(),
            }
            curve.append(point)
            print(json.dumps(point), flush=True)
            if not math.isfinite(point["loss"]):
                sys.exit("error: loss is not finite; lower --lr")
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.time() - t0
    tokens = step * args.batch_size * args.seq_len
    return {
        "steps": step,
        "tokens_seen": tokens,
        "train_seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "loss_curve": curve,
    }


@torch.no_grad()
def evaluate(model: DemoModel, data: torch.Tensor, args: argparse.Namespace, device: torch.device) -> dict:
    """Teacher-forced held-out metrics over non-overlapping windows."""
    span = args.seq_len + 1
    n_windows = min(len(data), args.eval_tokens) // span
    windows = data[: n_windows * span].view(n_windows, span)
    sums = {"main_nll": 0.0, "mtp_nll": 0.0, "main_hits": 0, "mtp_hits": 0, "mtp_agree": 0, "main_n": 0, "mtp_n": 0}
    for batch in windows.split(args.batch_size):
        with torch.autocast(device.type, dtype=torch.bfloat16):
            main_loss, mtp_loss, main, mtp = losses(model, batch)
        n_main, n_mtp = batch[:, 1:].numel(), batch[:, 2:].numel()
        sums["main_nll"] += main_loss.item() * n_main
        sums["mtp_nll"] += mtp_loss.item() * n_mtp
        sums["main_hits"] += (main.argmax(-1) == batch[:, 1:]).sum().item()
        sums["mtp_hits"] += (mtp.argmax(-1) == batch[:, 2:]).sum().item()
        # the head's pick equals the trunk's own greedy pick one position later: a first draft's greedy acceptance
        sums["mtp_agree"] += (mtp.argmax(-1) == main[:, 1:].argmax(-1)).sum().item()
        sums["main_n"] += n_main
        sums["mtp_n"] += n_mtp
    main_loss = sums["main_nll"] / sums["main_n"]
    return {
        "heldout_tokens": sums["main_n"],
        "main_loss": main_loss,
        "main_ppl": math.exp(main_loss),
        "trunk_top1": sums["main_hits"] / sums["main_n"],
        "mtp_loss": sums["mtp_nll"] / sums["mtp_n"],
        "mtp_top1_teacher_forced": sums["mtp_hits"] / sums["mtp_n"],
        "mtp_agrees_with_trunk": sums["mtp_agree"] / sums["mtp_n"],
    }


def checkpoint_tensors(model: DemoModel) -> dict[str, torch.Tensor]:
    """Hub naming: model.X -> model.language_model.X, tied lm_head dropped, mtp.* at top level; bf16."""
    out = {}
    for name, tensor in model.trunk.state_dict().items():
        if name == "lm_head.weight":
            continue
        assert name.startswith("model."), name
        out["model.language_model." + name[len("model.") :]] = tensor
    for name, tensor in model.mtp.state_dict().items():
        out["mtp." + name] = tensor
    return {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in out.items()}


def save_shards(tensors: dict[str, torch.Tensor], out_dir: Path, shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors.torch.save_file(shard, str(out_dir / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def hub_config(text_config: Qwen3_5TextConfig) -> dict:
    text = text_config.to_dict()
    for key in HF_NOISE_KEYS:
        text.pop(key, None)
    rope = text["rope_parameters"]
    # Top-level rope fields and attn_output_gate as in Qwen3.5's own configs, for readers that predate rope_parameters.
    text.update(
        model_type="qwen3_5_text",
        mtp_num_hidden_layers=1,
        mtp_use_dedicated_embeddings=False,
        full_attention_interval=4,
        attn_output_gate=True,
        rope_theta=rope["rope_theta"],
        partial_rotary_factor=rope["partial_rotary_factor"],
        dtype="bfloat16",
        torch_dtype="bfloat16",
        tie_word_embeddings=True,
    )
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "text_config": text,
        "transformers_version": transformers.__version__,
    }


def save_tokenizer(tok: tokenizers.Tokenizer, out_dir: Path) -> None:
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "eos_token": SPECIAL_TOKENS[0],
        "pad_token": SPECIAL_TOKENS[0],
        "bos_token": None,
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_checkpoint(model: DemoModel, tok: tokenizers.Tokenizer, out_dir: Path, shard_bytes: int) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_shards(checkpoint_tensors(model), out_dir, shard_bytes)
    (out_dir / "config.json").write_text(json.dumps(hub_config(model.trunk.config), indent=2) + "\n")
    save_tokenizer(tok, out_dir)


def plot_curve(curve: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    tokens = [p["tokens"] / 1e6 for p in curve]
    ax.plot(tokens, [p["loss"] for p in curve], label="main (next token)")
    ax.plot(tokens, [p["mtp_loss"] for p in curve], label="MTP (token t+2)")
    ax.set(xlabel="training tokens (M)", ylabel="cross-entropy (nats)", title="lattice_mlx demo model")
    ax.set_ylim(0, min(10, max(p["mtp_loss"] for p in curve)))
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def write_prompts(path: Path, args: argparse.Namespace) -> None:
    """First lines of held-out files, non-test files first (those exist in every CPython build)."""
    root = Path(args.corpus_dir or sysconfig.get_paths()["stdlib"])
    rels = [r for r in list_stdlib_files(root, args.max_file_bytes) if is_heldout(r, args.heldout_percent)]
    rels.sort(key=lambda r: (r.startswith("test/") or "/test" in r, r))
    prompts = []
    for rel in rels:
        lines = (root / rel).read_text(encoding="utf-8", errors="replace").splitlines()
        # Skip the shebang/coding/licence comment block so prompts start at code or a docstring.
        start = next((i for i, line in enumerate(lines) if line.strip() and not line.startswith("#")), len(lines))
        text = "\n".join(lines[start : start + args.prompt_lines]).rstrip() + "\n"
        if len(text) >= 40 and len(prompts) < args.num_prompts:
            prompts.append({"path": rel, "prompt": text})
    doc = {
        "source": f"CPython {platform.python_version()} Lib/ (PSF License 2.0)",
        "rule": f"sha256(relative path)[:8] as int % 100 < {args.heldout_percent}; first {args.prompt_lines} "
        "lines after the leading comment block; non-test files first",
        "prompts": prompts,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {len(prompts)} prompts to {path}")


def count_params(model: DemoModel) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters())
    return {"total": total, "trunk": total - mtp, "mtp": mtp}


def run_log(
    args: argparse.Namespace,
    *,
    corpus: Corpus,
    train_ids: torch.Tensor,
    heldout_ids: torch.Tensor,
    model: DemoModel,
    device: torch.device,
) -> dict:
    return {
        "command": " ".join([sys.executable, *sys.argv]),
        "args": vars(args),
        "seed": args.seed,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
        },
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
        "corpus": {
            "root": corpus.root,
            "train_files": len(corpus.train),
            "heldout_files": len(corpus.heldout),
            "train_tokens": len(train_ids),
            "heldout_tokens": len(heldout_ids),
            # the standard library's held-out files by path; a built corpus's split is in its manifest.json
            **({} if args.corpus_out else {"heldout_paths": [r for r, _ in corpus.heldout]}),
        },
        "params": count_params(model),
    }


def run(args: argparse.Namespace) -> None:
    t_start = time.time()
    stop_at = t_start + args.deadline_seconds - args.reserve_seconds
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.corpus_out:  # scripts/demo/build_corpus.py's output: split by package
        root = Path(args.corpus_out)
        corpus = load_built_corpus(root, max_files=args.max_files)
    else:
        root = Path(args.corpus_dir or sysconfig.get_paths()["stdlib"])
        corpus = load_corpus(root, percent=args.heldout_percent, max_bytes=args.max_file_bytes,
                             max_files=args.max_files)
    corpus.train = sample_documents(corpus.train, args.max_train_bytes, args.seed, text=lambda d: d[1])
    tok = train_tokenizer([t for _, t in sample_documents(corpus.train, args.tokenizer_bytes, args.seed + 1,
                                                          text=lambda d: d[1])], args.vocab_size)
    train_ids = encode_stream(tok, [t for _, t in corpus.train]).to(device)
    heldout_ids = encode_stream(tok, [t for _, t in corpus.heldout]).to(device)
    t_data = time.time() - t_start
    print(
        f"corpus {root}: {len(corpus.train)} train files / {len(train_ids)} tokens, "
        f"{len(corpus.heldout)} held-out files / {len(heldout_ids)} tokens, prep {t_data:.1f}s",
        flush=True,
    )
    config = build_text_config(args, eos_id=tok.token_to_id(SPECIAL_TOKENS[0]))
    model = DemoModel(config).to(device)
    assert model.trunk.lm_head.weight is model.trunk.model.embed_tokens.weight, "lm_head is not tied"
    check_causality(model, args.vocab_size, device)
    torch.backends.cuda.matmul.allow_tf32 = True
    print(f"params: {count_params(model)}", flush=True)
    stats = train(model, train_ids, args, device, stop_at)
    # Evaluate the weights as shipped (bf16), not the fp32 masters.
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16).to(p.dtype)
    metrics = evaluate(model, heldout_ids, args, device)
    print(json.dumps(metrics), flush=True)
    save_checkpoint(model, tok, out_dir / "hf", args.shard_bytes)
    log = run_log(args, corpus=corpus, train_ids=train_ids, heldout_ids=heldout_ids, model=model, device=device)
    log.update(prep_seconds=t_data, **stats, heldout=metrics, wall_seconds=time.time() - t_start)
    log["loss_png"] = plot_curve(stats["loss_curve"], out_dir / "loss_curve.png")
    (out_dir / "train_log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(f"done in {log['wall_seconds']:.1f}s -> {out_dir}", flush=True)


def setup_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default=DEFAULT_OUT_DIR)
    p.add_argument("--corpus-dir", default=None, help="CPython Lib/ folder (default: this interpreter's stdlib)")
    p.add_argument("--write-prompts", default=None, metavar="PATH", help="only write held-out prompts and exit")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--hidden-size", type=int, default=DEFAULT_HIDDEN_SIZE)
    p.add_argument("--intermediate-size", type=int, default=DEFAULT_INTERMEDIATE_SIZE)
    p.add_argument("--num-layers", type=int, default=DEFAULT_NUM_LAYERS)
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN)
    p.add_argument("--batch-size", type=int, default=DEFAULT_BATCH_SIZE)
    p.add_argument("--lr", type=float, default=DEFAULT_LR)
    p.add_argument("--min-lr-ratio", type=float, default=DEFAULT_MIN_LR_RATIO)
    p.add_argument("--weight-decay", type=float, default=DEFAULT_WEIGHT_DECAY)
    p.add_argument("--warmup-steps", type=int, default=DEFAULT_WARMUP_STEPS)
    p.add_argument("--mtp-loss-weight", type=float, default=DEFAULT_MTP_LOSS_WEIGHT)
    p.add_argument("--mtp-target", choices=["labels", "distill", "both"], default="labels",
                   help="the head's loss: CE to the corpus (t+2), KL to the trunk's own distribution over t+2 "
                        "(self-distillation), or their mean")
    p.add_argument("--corpus-out", help="train on scripts/demo/build_corpus.py's output folder (split by package) "
                   "instead of the standard library alone")
    p.add_argument("--max-train-bytes", type=int, default=0,
                   help="train on a seeded random subset of the training documents of about this much text (0: all)")
    p.add_argument("--tokenizer-bytes", type=int, default=0,
                   help="train the tokenizer on a seeded random subset of about this much text (0: all training text)")
    p.add_argument("--train-seconds", type=float, default=DEFAULT_TRAIN_SECONDS)
    p.add_argument(
        "--deadline-seconds",
        type=float,
        default=DEFAULT_DEADLINE_SECONDS,
        help="whole-script budget; training stops early to leave --reserve-seconds for eval and save",
    )
    p.add_argument("--reserve-seconds", type=float, default=DEFAULT_RESERVE_SECONDS)
    p.add_argument("--max-steps", type=int, default=DEFAULT_MAX_STEPS, help="0: limited by time only")
    p.add_argument("--log-every", type=int, default=DEFAULT_LOG_EVERY)
    p.add_argument("--heldout-percent", type=int, default=DEFAULT_HELDOUT_PERCENT)
    p.add_argument("--max-file-bytes", type=int, default=DEFAULT_MAX_FILE_BYTES)
    p.add_argument("--max-files", type=int, default=DEFAULT_MAX_FILES, help="0: all (small values for dry runs)")
    p.add_argument("--eval-tokens", type=int, default=DEFAULT_EVAL_TOKENS)
    p.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES)
    p.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS)
    p.add_argument("--prompt-lines", type=int, default=DEFAULT_PROMPT_LINES)
    return p


def main() -> None:
    args = setup_arg_parser().parse_args()
    if args.write_prompts:
        write_prompts(Path(args.write_prompts), args)
    else:
        run(args)


if __name__ == "__main__":
    main()
