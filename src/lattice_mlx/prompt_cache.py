"""Prompt caches for hybrid models: the state after a prompt (KV caches, GDN conv windows and recurrent states, the
MTP head's rows and the last target hidden), reused when a later prompt extends it, and saved to / loaded from a
safetensors file with metadata that names the model it belongs to.

    pc = PromptCache.build(model, ids)        # or PromptCache.load(path, model)
    generate(model, tok, longer_ids, prompt_cache=pc)   # prefills only longer_ids[len(ids):]

A GDN state cannot be trimmed back to an earlier position, so a cache is reused only when it covers a proper prefix
of the new prompt (at least one new token: the next token's logits come from the prefill). Reuse never changes the
cache (the loops work on copies).
"""

import hashlib
import json
import os
import tempfile
from pathlib import Path

import mlx.core as mx

from . import cache as caches
from .decode import prefill
from .speculative.drafters import feed_head


def fingerprint(model) -> str:
    """Shapes and a sample of the embedding's values: a cache of another model (or other weights) is refused."""
    a = model.args
    embed = model.model.embed_tokens
    sample = [embed[name].reshape(-1)[:64].astype(mx.float32).tolist() for name in ("weight", "scales")
              if name in embed]
    desc = json.dumps([a.model_type, a.hidden_size, a.vocab_size, list(a.layer_types), a.head_dim, sample])
    return hashlib.sha256(desc.encode()).hexdigest()[:16]


class PromptCache:
    """The state after `tokens`: target caches, the MTP head's caches (slots of every pair inside `tokens`) and the
    target hidden at the last position (what the head pairs with the next token), or None without a head."""

    def __init__(self, tokens: list[int], cache: list, mtp: list | None, hidden: mx.array | None, model_id: str):
        self.tokens, self.cache, self.mtp, self.hidden, self.model_id = list(tokens), cache, mtp, hidden, model_id

    @classmethod
    def build(cls, model, tokens: list[int], base: "PromptCache | None" = None) -> "PromptCache":
        """The state after `tokens`; from `base` (prefilling only the rest) when it holds a proper prefix of them."""
        if not tokens:
            raise ValueError("a prompt cache needs at least one token")
        n = base.covers(tokens) if base is not None else 0
        if n:
            base.check(model)
            cache, mtp = base.fork()
        else:
            cache, mtp = model.make_cache(trimmable=False), (model.mtp.make_cache() if model.has_mtp else None)
        _, hidden = prefill(model, mx.array(tokens[n:]), cache, return_hidden=model.has_mtp)
        last = None
        if model.has_mtp:  # slots pair tokens t_i (i >= 1) with h_{i-1}
            before = mx.concatenate([base.hidden, hidden[:-1]]) if n else hidden[:-1]
            feed_head(model, tokens[max(n, 1) :], before, mtp)
            last = hidden[-1:]
            mx.eval(last)
        return cls(tokens, cache, mtp, last, base.model_id if n else fingerprint(model))

    def covers(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` this cache holds: all of its tokens when they are a proper prefix of
        `ids`, else 0 (not reusable)."""
        n = len(self.tokens)
        return n if len(ids) > n and ids[:n] == self.tokens else 0

    def fork(self) -> tuple[list, list | None]:
        """Copies of the target and head caches for a generation to write into (this cache stays as it is)."""
        def copy(cs):
            if cs is None:
                return None
            out = [type(c)() for c in cs]
            caches.restore(out, caches.snapshot(cs))
            return out
        return copy(self.cache), copy(self.mtp)

    def check(self, model) -> None:
        if self.model_id != fingerprint(model):
            raise ValueError("this prompt cache was made by another model (its shapes or weights differ)")

    # --- files ---

    def save(self, path: str | Path) -> None:
        """One safetensors file (arrays + metadata); written to a temporary file and renamed, so a failure never
        leaves a half-written cache."""
        arrays, layers = {}, []
        for i, c in enumerate([*self.cache, *(self.mtp or [])]):
            if isinstance(c, caches.GDNCache):
                arrays[f"{i}.conv"], arrays[f"{i}.ssm"] = c.conv, c.ssm
                layers.append(["gdn", c.offset])
            else:
                if c.keys is not None:
                    arrays[f"{i}.keys"] = c.keys[..., : c.offset, :]
                    arrays[f"{i}.values"] = c.values[..., : c.offset, :]
                layers.append(["kv", c.offset])
        if self.hidden is not None:
            arrays["hidden"] = self.hidden
        meta = {"format": "lattice_mlx.prompt_cache/1", "model": self.model_id, "tokens": json.dumps(self.tokens),
                "layers": json.dumps(layers), "target_layers": str(len(self.cache))}
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            mx.save_safetensors(tmp, arrays, metadata=meta)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @classmethod
    def load(cls, path: str | Path, model) -> "PromptCache":
        """A saved cache for `model`; ValueError (one line) for a missing or corrupt file or another model's."""
        try:
            arrays, meta = mx.load(str(path), return_metadata=True)
            if meta.get("format") != "lattice_mlx.prompt_cache/1":
                raise ValueError("not a lattice_mlx prompt cache")
            tokens, layers, n = json.loads(meta["tokens"]), json.loads(meta["layers"]), int(meta["target_layers"])
        except (OSError, RuntimeError, ValueError, KeyError) as e:
            raise ValueError(f"cannot read prompt cache {path}: {e}") from None
        pc = cls(tokens, [], None, arrays.get("hidden"), meta["model"])
        pc.check(model)
        built = []
        for i, (kind, offset) in enumerate(layers):
            if kind == "gdn":
                c = caches.GDNCache()
                c.conv, c.ssm, c.offset = arrays[f"{i}.conv"], arrays[f"{i}.ssm"], offset
            else:
                c = caches.KVCache()
                if f"{i}.keys" in arrays:
                    c.keys, c.values, c.offset = arrays[f"{i}.keys"], arrays[f"{i}.values"], offset
            built.append(c)
        pc.cache, pc.mtp = built[:n], (built[n:] or None) if model.has_mtp else None
        if len(pc.cache) != len(model.layers):
            raise ValueError(f"prompt cache {path} has {len(pc.cache)} layers, the model {len(model.layers)}")
        return pc
