"""The multi-token-prediction head: x = fc([norm_e(embed(t+1)), norm_h(h_t)]) -> one attention layer -> norm.

Its logits come from the target's lm_head; its input hidden is the target's final hidden at the position that
produced t+1 (post-norm by default). The head's KV cache holds one row per target position (RoPE position t).
"""

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache
from ..metal.q4_matmul import dense_matmul, prologue_ref, q4_matmul, quantized_matmul
from ..metal.rms_pair import rms_pair
from .compiled import run_layers
from .layers import project, rms_pre
from .qwen3_5 import DecoderLayer, ModelArgs


class DraftVocab:
    """The token subset the MTP head drafts from: a frequent-token list stored with the checkpoint (`FILE`, written by
    `convert --draft-vocab`). The target's lm_head rows of those ids are gathered once, so a draft step's lm_head
    reads |ids| rows instead of the whole vocabulary (Qwen3.5: 248,320). Exactness is untouched: a token outside the
    subset is simply never proposed, and a sampled draft's distribution q is zero there (the verifier's
    min(1, p/q) and residual max(0, p - q) stay exact for any q)."""

    FILE = "draft_vocab.json"

    def __init__(self, ids):
        ids = sorted({int(i) for i in ids})
        self.ids = mx.array(ids, dtype=mx.int32)
        self.size = len(ids)
        # every array it computes with (the ids, the gathered rows): a traced round's captured input (speculative/pipelined.py), so
        # rows gathered again after the weights changed are what the trace computes with
        self.arrays: dict = {"ids": self.ids}
        self._meta, self._key = None, None
        self.pinned = False  # inside a traced round: the rows in `arrays` as they are, no identity check

    def _lm_rows(self, model) -> dict:
        """The lm_head's rows of the subset (tied: the embedding's), gathered on first use and again if the weights
        were replaced."""
        if not (self.pinned and self._meta is not None):
            lin = model.model.embed_tokens if model.args.tie_word_embeddings else model.lm_head
            key = id(lin["weight"])
            if self._key != key:
                rows = {name: mx.take(lin[name], self.ids, axis=0) for name in ("weight", "scales", "biases")
                        if name in lin and lin[name] is not None}
                mx.eval(rows)
                for name in ("weight", "scales", "biases"):
                    self.arrays.pop(name, None)
                self.arrays.update(rows)  # in place: a trace holding this dict reads the new rows
                self._meta = dict(bits=lin.bits, group_size=lin.group_size, mode=getattr(lin, "mode", "affine")) \
                    if "scales" in rows else {}
                self._key = key
        return {**{k: v for k, v in self.arrays.items() if k != "ids"}, **self._meta}

    def lm_logits(self, model, h: mx.array, *, norm: nn.RMSNorm | None = None) -> mx.array:
        """Logits [.., |ids|] of h (of norm(h) when given, fused into the matmul; in the target lm_head's basis)
        over the subset."""
        r, pre = self._lm_rows(model), rms_pre(norm)
        if "scales" not in r:
            return dense_matmul(h, r["weight"], pre=pre)
        if r["bits"] == 4 and r["mode"] == "affine":
            return q4_matmul(h, r["weight"], r["scales"], r["biases"], group_size=r["group_size"], pre=pre)
        return quantized_matmul(prologue_ref(pre, h), r["weight"], r["scales"], r.get("biases"),
                                group_size=r["group_size"], bits=r["bits"], mode=r["mode"])

    def to_full(self, draft: mx.array, q: mx.array | None, vocab: int) -> tuple[mx.array, mx.array | None]:
        """A draft picked over the subset (an index into it) and its distribution [|ids|] -> the token id and q over
        the whole vocabulary (zero outside the subset)."""
        ids = self.arrays["ids"]
        token = ids[draft]
        if q is None:
            return token, None
        return token, mx.zeros((vocab,), dtype=q.dtype).at[ids].add(q)


class MTPHead(nn.Module):
    """`input_hidden`: the target hidden the head reads, "post" (after the final norm: the default, as vLLM and
    SGLang do) or "pre"; docs/mtp.md measured no difference in acceptance. With `rotated`, the target's residual
    stream is rotated (see rotate.py) and the head carries the rotation Q and the target's final norm weight to move
    between the two bases."""

    input_hidden = "post"
    draft_vocab: DraftVocab | None = None  # set by load() from the checkpoint's draft_vocab.json

    def __init__(self, args: ModelArgs, *, rotated: bool = False):
        super().__init__()
        H, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(H, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(H, eps=eps)
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.layers = [DecoderLayer(args, "full_attention") for _ in range(max(1, args.mtp_num_hidden_layers))]
        self.norm = nn.RMSNorm(H, eps=eps)
        if rotated:
            self.rotation = mx.zeros((H, H))
            self.target_norm = mx.ones((H,))

    def from_target(self, hidden: mx.array) -> mx.array:
        """The target's final hidden [.., H] (`input_hidden`: after the final norm, or before) in the head's basis."""
        if "rotation" not in self:
            return hidden
        h = hidden @ self.rotation
        return h * self.target_norm if self.input_hidden == "post" else h

    def to_target(self, u: mx.array) -> mx.array:
        """The head's post-norm output in the basis of the target's lm_head."""
        if "rotation" not in self:
            return u
        return (u / self.target_norm) @ self.rotation.T

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list | None = None,
                 mask: mx.array | None = None, *, hidden_norm: nn.RMSNorm | None = None) -> mx.array:
        """Shapes: embeds, hidden [B, T, H] -> the head's hidden before `self.norm` [B, T, H]. `mask`: an explicit
        attention mask over the cache's keys and these slots (training the draft recursion: distill_demo_head.py).
        `hidden_norm`: a norm `hidden` goes through first (a draft step passes its output before `self.norm`)."""
        x = rms_pair(embeds, hidden, self.pre_fc_norm_embedding, self.pre_fc_norm_hidden, hidden_norm)  # one kernel
        return run_layers(self, self.layers, project(self.fc, x), cache, mask)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]
