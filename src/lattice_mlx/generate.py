"""Plain and speculative decode loops, and `python -m lattice_mlx.generate`."""

import argparse
import json
import os
import sys
import time
from collections.abc import Generator, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx

from .batch import DEFAULT_MAX_BATCH, BatchDecoder, Sequence
from .cli import ArgumentParser, add_speculation_args, command_name, resolve_speculation, speculation_from_args
from .decode import generate_step
from .load import DEMO_MODEL, LoadError, keep_round_builds, load, resolve_path
from .sample import Sampler
from .speculative import SpecOptions, SpecStats, auto_applies, speculate
from .speculative.batched import BatchRounds
from .startup import end_startup, interrupts_to_main

DEFAULT_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
DEFAULT_MAX_TOKENS = 128
DEFAULT_TEMP = 0.0
DEFAULT_TOP_P = 1.0
DEFAULT_TOP_K = 0
DEFAULT_SEED = 0
# CLI sampling flag -> (generation_config.json key, the default when neither the flag nor the checkpoint sets it)
SAMPLING_FLAGS = {"temp": ("temperature", DEFAULT_TEMP), "top_p": ("top_p", DEFAULT_TOP_P),
                  "top_k": ("top_k", DEFAULT_TOP_K), "min_p": ("min_p", 0.0)}


@dataclass
class GenerationResponse:
    text: str
    token: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory_gb: float
    finish_reason: str | None = None
    speculation: dict | None = None  # SpecStats.to_dict() on the last response of a speculative generation
    # the live statistics of a speculative generation on every response (for a caller that stops early)
    spec_stats: SpecStats | None = field(default=None, repr=False, compare=False)
    prompt_cached_tokens: int = 0  # leading prompt tokens a prompt cache held (prompt_tps counts only the others)


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float
    finish_reason: str
    speculation: dict | None = field(default=None)
    prompt_cached_tokens: int = 0  # leading prompt tokens a prompt cache held (prompt_tps counts only the others)

    def to_json(self) -> dict:
        out = asdict(self)
        if self.speculation is None:
            out.pop("speculation")
        return out


def chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template applied to text messages ({"role", "content": str}; "developer" is read as "system"). The
    server checks a request's messages before they come here (server/protocol.py)."""
    out = [{"role": "system" if m["role"] == "developer" else m["role"], "content": m["content"]} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template(out, add_generation_prompt=True, tokenize=True))
    return list(tokenizer.encode("\n".join(m["content"] for m in out)))


def check_max_tokens(max_tokens: int) -> None:
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens (--max-tokens) must be an integer >= 1, got {max_tokens!r}")


def check_context(model, prompt_tokens: int, max_tokens: int, *, allow_long: bool = False) -> None:
    """ValueError (one line, both numbers and the limit) when the prompt plus max_tokens would run past the model's
    context length (config.json's max_position_embeddings), unless `allow_long`; a model without one is not checked."""
    limit = getattr(getattr(model, "args", None), "max_position_embeddings", None)
    if allow_long or not isinstance(limit, int) or prompt_tokens + max_tokens <= limit:
        return
    asked = f"the prompt ({prompt_tokens:,} tokens)" + (f" plus max_tokens ({max_tokens:,})" if max_tokens else "")
    raise ValueError(f"{asked} exceeds the model's context length ({limit:,} tokens)")


def encode_prompt(tokenizer, prompt: str | list[int], *, chat_template: bool = True,
                  system_prompt: str | None = None) -> list[int]:
    if not isinstance(prompt, str):
        return list(prompt)
    if chat_template and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return list(tokenizer.encode(prompt))


def token_stream(model, ids: mx.array, sampler: Sampler, options: SpecOptions | None,
                 prompt_cache=None, logits_processors=None, max_kv_size=None,
                 max_tokens: int | None = None) -> tuple[Iterator[int], SpecStats | None]:
    """The token iterator for the chosen decoding (plain, chain speculation, or tree) and the stats it fills."""
    if options is None:
        return generate_step(model, ids, sampler=sampler, prompt_cache=prompt_cache,
                             logits_processors=logits_processors, max_kv_size=max_kv_size), None
    stats = SpecStats.of(options)
    return speculate(model, ids, sampler=sampler, options=options, stats=stats, prompt_cache=prompt_cache,
                     max_tokens=max_tokens), stats


def stream_generate(
    model, tokenizer, prompt: str | list[int], *, max_tokens: int = DEFAULT_MAX_TOKENS, temp: float = DEFAULT_TEMP,
    top_p: float = DEFAULT_TOP_P, top_k: int = DEFAULT_TOP_K, min_p: float = 0.0, chat_template: bool = False,
    speculation: SpecOptions | str | None = "auto", prompt_cache=None, seed: int | None = None,
    sampler: Sampler | None = None, logits_processors: list | None = None, max_kv_size: int | None = None,
    allow_long_context: bool = False,
) -> Generator[GenerationResponse, None, None]:
    """Yields one response per generated token (text piece and id); the last one carries finish_reason and, when
    the generation speculated, the speculation statistics.

    `speculation`: "auto" (the default) speculates with the checkpoint's MTP head, adaptive depth, where
    `speculative.auto_applies` (a head, and LATTICE_MTP=1: off by default for now) and nothing asked for
    here rules it out (logits_processors, max_kv_size), and decodes plainly otherwise; a SpecOptions asks for exactly
    that speculation (an error where it cannot run); None decodes plainly.

    As in mlx-lm's API, a text prompt is encoded as it is; `chat_template=True` wraps it as one user message.
    `prompt_cache` (prompt_cache.PromptCache, or its saved file's path): the state after a prefix of the prompt,
    which is then not prefilled again (`prompt_tokens` still counts the whole prompt). `seed` seeds MLX's random
    state first. `sampler` (a sample.Sampler) replaces temp/top_p/top_k/min_p. `logits_processors`: mlx-lm's
    callables (tokens so far, logits [1, V]) -> logits, applied before sampling; plain decoding only (speculation
    would have to apply them to every verify row with its own history, which is not done). `max_kv_size`: the
    attention layers keep at most that many keys (the first 4 and a sliding window; plain decoding only). A prompt
    (after the chat template) plus max_tokens longer than the model's context is a ValueError (`check_context`) unless
    `allow_long_context`."""
    check_max_tokens(max_tokens)
    if sampler is None:
        sampler = Sampler(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    elif not isinstance(sampler, Sampler):
        raise ValueError("sampler must be a lattice_mlx.Sampler (speculation needs its probabilities), got "
                         f"{type(sampler).__name__}")
    if isinstance(speculation, str):
        if speculation != "auto":
            raise ValueError(f"speculation={speculation!r}: use 'auto', a SpecOptions or None")
        speculation = SpecOptions() if auto_applies(model) and not logits_processors and max_kv_size is None \
            else None
    elif speculation is not None and not isinstance(speculation, SpecOptions):
        raise ValueError(f"speculation must be 'auto', a SpecOptions or None, got {type(speculation).__name__}")
    if logits_processors and speculation is not None:
        raise ValueError("logits_processors work with plain decoding only: drop them or the speculation")
    if max_kv_size is not None:
        if isinstance(max_kv_size, bool) or not isinstance(max_kv_size, int) or max_kv_size <= 4:
            raise ValueError(f"max_kv_size (--max-kv-size) must be an integer > 4, got {max_kv_size!r}")
        if speculation is not None:
            raise ValueError("max_kv_size (--max-kv-size) works with plain decoding only: drop it or the speculation")
    if speculation is not None and speculation.adaptive and getattr(model, "sharding_group", None) is None:
        keep_round_builds(model)  # (on MLX's CUDA backend: once per machine, announced; the first call per model
        # in a process checks its marker)
    if seed is not None:
        mx.random.seed(seed)
    ids = encode_prompt(tokenizer, prompt, chat_template=chat_template)
    if not ids:
        raise ValueError("the prompt encodes to no tokens")
    check_context(model, len(ids), max_tokens, allow_long=allow_long_context)
    if isinstance(prompt_cache, (str, os.PathLike)):
        from .prompt_cache import PromptCache

        prompt_cache = PromptCache.load(prompt_cache, model)
    cached = prompt_cache.covers(ids) if prompt_cache is not None else 0  # what decode.resume will not prefill
    tokens, stats = token_stream(model, mx.array(ids), sampler, speculation, prompt_cache, logits_processors,
                                 max_kv_size, max_tokens)
    detok = tokenizer.detokenizer
    detok.reset()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    prompt_tps = 0.0
    for n, token in enumerate(tokens, start=1):
        if n == 1:
            prompt_time = time.perf_counter() - tic
            prompt_tps = (len(ids) - cached) / prompt_time
            tic = time.perf_counter()
        finish = "stop" if token in tokenizer.eos_token_ids else ("length" if n >= max_tokens else None)
        if token not in tokenizer.eos_token_ids:
            detok.add_token(token)
        if finish:
            detok.finalize()
        elapsed = time.perf_counter() - tic
        yield GenerationResponse(
            text=detok.last_segment, token=token, prompt_tokens=len(ids), prompt_tps=prompt_tps,
            prompt_cached_tokens=cached,
            generation_tokens=n, generation_tps=(n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0,
            peak_memory_gb=mx.get_peak_memory() / 1e9, finish_reason=finish,
            speculation=stats.to_dict() if (finish and stats is not None) else None, spec_stats=stats,
        )
        if finish:
            break


def generate(model, tokenizer, prompt: str | list[int], *, on_text=None, **kwargs) -> GenerationResult:
    """Runs `stream_generate` to the end (same keyword options); `on_text(piece)` sees the text as it streams."""
    tokens, pieces, last = [], [], None
    for last in stream_generate(model, tokenizer, prompt, **kwargs):
        tokens.append(last.token)
        pieces.append(last.text)
        if on_text is not None:
            on_text(last.text)
    return GenerationResult(
        tokens=tokens, text="".join(pieces), prompt_tokens=last.prompt_tokens, generation_tokens=len(tokens),
        prompt_tps=last.prompt_tps, generation_tps=last.generation_tps, peak_memory_gb=last.peak_memory_gb,
        finish_reason=last.finish_reason, speculation=last.speculation, prompt_cached_tokens=last.prompt_cached_tokens,
    )


def checkpoint_sampling(path) -> dict:
    """The checkpoint's recommended sampling, from its generation_config.json (what vLLM's `--generation-config
    auto` reads), keyed as Sampler's and stream_generate's arguments: a subset of {"temp": float, "top_p": float,
    "top_k": int, "min_p": float}, the values as the file gives them (int or float), only the keys it sets. {} without
    the file or with `do_sample` unset or false (Hugging Face's meaning: greedy). LoadError (one line) when the file
    is not a JSON object."""
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return {}
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise LoadError(f"cannot read {f} ({e}); fix it, or pass --generation-config none") from None
    if not isinstance(cfg, dict):
        raise LoadError(f"{f} is not a JSON object; fix it, or pass --generation-config none")
    if cfg.get("do_sample") is not True:
        return {}
    return {arg: cfg[key] for arg, (key, _) in SAMPLING_FLAGS.items()
            if isinstance(cfg.get(key), (int, float)) and not isinstance(cfg.get(key), bool)}


def sampling_flags(args: argparse.Namespace, checkpoint: dict) -> tuple[dict, dict]:
    """The sampling flags to run with: each one the user gave, else the checkpoint's value, else the built-in
    default; and the checkpoint's values among them."""
    values, used = {}, {}
    for arg, (_, default) in SAMPLING_FLAGS.items():
        values[arg] = getattr(args, arg)
        if values[arg] is None:
            if arg in checkpoint:
                used[arg] = checkpoint[arg]
            values[arg] = checkpoint.get(arg, default)
    return values, used


def _bool(v: str) -> bool:
    if v.lower() in ("true", "t", "1", "yes"):
        return True
    if v.lower() in ("false", "f", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


@dataclass
class BatchResult:
    """One prompt's generation in `batch_generate`."""

    text: str | None
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str


def batch_generate(model, tokenizer, prompts: list, *, max_tokens: int | list[int] = 256,
                   temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                   max_batch: int = DEFAULT_MAX_BATCH, speculation: SpecOptions | None = None,
                   seed: int | None = None) -> list[BatchResult]:
    """Generates for every prompt (text, or a list of token ids) with continuous batching (lattice_mlx.batch): up to
    `max_batch` sequences decode together, a new one joining as soon as another leaves. `max_tokens`: one budget
    for all, or one per prompt. Results in the prompts' order; greedy (temp 0) gives each prompt its single
    generation's tokens (fp32; batch.py's docstring for bf16). `speculation`: None, plain decoding; an MTP
    `SpecOptions` (chains; `adaptive`: the depth, or plain steps, picked for the batch as a whole), MTP rounds over
    the batch (speculative/batched.py). `seed`: prompt i samples from a random stream of its own keyed by seed + i,
    so sampled results repeat whatever `max_batch` is (fp32; and with MTP, at a fixed depth); None: streams keyed
    from MLX's global generator."""
    if speculation is not None and (not isinstance(speculation, SpecOptions) or speculation.draft != "mtp"
                                    or speculation.tree):
        raise ValueError("batch_generate speculates with MTP chains: SpecOptions(draft_tokens=K[, adaptive=...]), "
                         "or None")
    budgets = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(prompts)
    if len(budgets) != len(prompts):
        raise ValueError(f"max_tokens has {len(budgets)} entries for {len(prompts)} prompts")
    sampler = Sampler(temp=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    ids = [list(tokenizer.encode(p)) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    eos = frozenset(getattr(tokenizer, "eos_token_ids", ()) or ()) if tokenizer is not None else frozenset()
    engine = BatchDecoder(model, max_batch=max_batch) if speculation is None else \
        BatchRounds(model, k=speculation.draft_tokens, adaptive=speculation.adaptive, max_batch=max_batch)
    seqs: list[Sequence | None] = [None] * len(prompts)
    pending = iter(range(len(prompts)))
    while True:
        # fill the free rows (a prompt whose first token ends it never takes one)
        while not engine.full and (i := next(pending, None)) is not None:
            seqs[i] = engine.add(ids[i], max_tokens=budgets[i], sampler=sampler, stop_ids=eos,
                                 seed=None if seed is None else seed + i)
        if not engine.busy:
            break
        engine.step()
    return [BatchResult(tokenizer.decode(s.tokens) if tokenizer is not None else None, s.tokens, len(s.prompt),
                        s.finish_reason) for s in seqs]


def setup_arg_parser() -> ArgumentParser:
    p = ArgumentParser(prog=command_name("lattice_mlx.generate"), description="Generate text with a Qwen3.5 model.")
    p.add_argument("--model", "-m", help="checkpoint directory or Hugging Face repo id (default: the embedded demo "
                   "model)")
    p.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, help="prompt text; '-' reads standard input")
    p.add_argument("--system-prompt", help="a system message before the prompt (with the chat template)")
    # ranges are checked once, by the API (check_max_tokens, Sampler, SpecOptions), for both
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--allow-long-context", action="store_true", help="run even when the prompt plus --max-tokens "
                   "is longer than the model's context length (max_position_embeddings; quality past it is unknown)")
    p.add_argument("--temp", type=float, help=f"sampling temperature (default: the checkpoint's, else {DEFAULT_TEMP}: "
                   "greedy)")
    p.add_argument("--top-p", type=float, help=f"default: the checkpoint's, else {DEFAULT_TOP_P}")
    p.add_argument("--top-k", type=int, help=f"default: the checkpoint's, else {DEFAULT_TOP_K} (off)")
    p.add_argument("--min-p", type=float, help="keep tokens with p >= min_p x the top token's (default: the "
                   "checkpoint's, else 0: off)")
    p.add_argument("--generation-config", choices=["auto", "none"], default="auto",
                   help="auto: sampling flags left out take the checkpoint's generation_config.json (when it sets "
                   "do_sample, as vLLM does); none: mlx-lm's defaults (greedy)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: the checkpoint's own dtype")
    p.add_argument("--no-chat-template", "--ignore-chat-template", action="store_true",
                   help="feed the prompt as raw text (the CLI applies the chat template by default, as mlx-lm's does)")
    p.add_argument("--max-kv-size", type=int, help="attention layers keep at most this many keys (the first 4 "
                   "and a sliding window; plain decoding only)")
    p.add_argument("--extra-eos-token", nargs="+", default=[], metavar="TOKEN",
                   help="more tokens (as text) that end the generation")
    p.add_argument("--verbose", type=_bool, default=True, metavar="{true,false}",
                   help="false: print only the generated text (no statistics)")
    p.add_argument("--json", action="store_true", help="print one JSON object with tokens and stats as the last line")
    p.add_argument("--prompt-cache-file", help="a prompt cache saved by `python -m lattice_mlx.cache_prompt`: "
                   "--prompt continues its prompt (raw text) and only the new tokens are prefilled")
    p.add_argument("--pipeline", action="store_true",
                   help="under mlx.launch: split the layers into stages, one per process (default: tensor parallel); "
                   "for one stream the faster split on two GPUs (docs/adr/0007-tensor-vs-pipeline.md)")
    add_speculation_args(p)
    return p


def speculation_line(s: dict) -> str:
    if s["tree"]:
        return f"tree {s['tree']}: {s['mean_accepted_length']:.2f} drafts accepted per round, {s['rounds']} rounds"
    return (f"{s['draft']} drafts: acceptance {s['acceptance_rate']:.2f} per position "
            f"{[round(a, 2) for a in s['accepted_per_position']]}, {s['rounds']} rounds"
            + "".join(f"; {d}" for d in s["decisions"]))


def prompt_line(result: GenerationResult) -> str:
    """The prompt's statistics; with a prompt cache the rate is over the tokens actually prefilled."""
    cached, new = result.prompt_cached_tokens, result.prompt_tokens - result.prompt_cached_tokens
    if not cached:
        return f"prompt: {result.prompt_tokens} tokens, {result.prompt_tps:.1f} tok/s"
    if not new:
        return f"prompt: {result.prompt_tokens} tokens, prompt from cache"
    return (f"prompt: {result.prompt_tokens} tokens ({cached} from the cache), {new} prefilled at "
            f"{result.prompt_tps:.1f} tok/s")


def run(args: argparse.Namespace) -> GenerationResult:
    options, when = speculation_from_args(args)
    check_max_tokens(args.max_tokens)  # the API checks these too; here they fail before the model loads
    Sampler(**sampling_flags(args, {})[0])  # the flags given, before a checkpoint is fetched
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    mx.random.seed(args.seed)
    group = distributed_group()
    if args.pipeline and group is None:
        raise ValueError("--pipeline splits the model over several processes: launch with mlx.launch -n N")
    path = resolve_path(args.model) if args.model else None  # (once: a hub id is fetched here, not again in load)
    model, tokenizer = load(path, dtype=args.dtype, group=group, pipeline=args.pipeline)
    for token in args.extra_eos_token:
        tid = tokenizer.convert_tokens_to_ids(token)
        if tid is None or tokenizer.convert_ids_to_tokens(tid) != token:  # (an unknown token maps to <unk>)
            raise ValueError(f"--extra-eos-token {token!r} is not a token of this tokenizer")
        tokenizer.add_eos_token(token)
    checkpoint = checkpoint_sampling(path or DEMO_MODEL) if args.generation_config == "auto" else {}
    sampling, from_checkpoint = sampling_flags(args, checkpoint)
    Sampler(**sampling)  # the checkpoint's values too
    prompt_cache, chat_template = None, not args.no_chat_template
    if args.prompt_cache_file:  # the prompt continues the cached one (raw text, no chat template)
        from .prompt_cache import PromptCache

        prompt_cache = PromptCache.load(args.prompt_cache_file, model)
        prompt, chat_template = prompt_cache.tokens + list(tokenizer.encode(prompt)), False
    else:
        prompt = encode_prompt(tokenizer, prompt, chat_template=chat_template, system_prompt=args.system_prompt)
    try:  # the count after the chat template and the cached prefix; before anything is prefilled
        check_context(model, len(prompt), args.max_tokens, allow_long=args.allow_long_context)
    except ValueError as e:
        raise ValueError(f"{e}: shorten the prompt or --max-tokens, or pass --allow-long-context") from None
    speculation = resolve_speculation(model, options, when) if args.max_kv_size is None or when == "on" else None
    result = generate(
        model, tokenizer, prompt, max_tokens=args.max_tokens, **sampling, chat_template=chat_template,
        speculation=speculation,
        prompt_cache=prompt_cache, max_kv_size=args.max_kv_size,
        allow_long_context=args.allow_long_context, on_text=lambda t: print(t, end="", flush=True),
    )
    print()
    if not args.verbose:
        return result
    print(f"{prompt_line(result)} | generation: {result.generation_tokens} tokens, {result.generation_tps:.1f} tok/s"
          f" | peak memory: {result.peak_memory_gb:.3f} GB", file=sys.stderr)
    if result.speculation:
        print(speculation_line(result.speculation), file=sys.stderr)
    if from_checkpoint:
        print("sampling from the checkpoint's generation_config.json: "
              + ", ".join(f"{k} {v}" for k, v in from_checkpoint.items()) + " (--generation-config none: greedy)",
              file=sys.stderr)
    return result


def distributed_group():
    """The group when launched by mlx.launch on more than one process (the model then runs tensor-parallel over
    it; only rank 0 prints), else None."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def main(argv: list[str] | None = None) -> int:
    args = setup_arg_parser().parse_args(argv)
    group = distributed_group()
    if group is not None and group.rank() != 0:  # every rank computes; rank 0 speaks for them all
        sys.stdout = sys.stderr = open(os.devnull, "w")
    try:
        interrupts_to_main()  # (inside the try: a Ctrl-C after it is caught below)
        if args.prompt == "-":
            end_startup()  # (reading stdin: a blocking read that Ctrl-C interrupts)
        result = run(args)
    except (LoadError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(result.to_json()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
