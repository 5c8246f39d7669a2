"""The multi-token-prediction head: x = fc([norm_e(embed(t+1)), norm_h(h_t)]) -> one attention layer -> norm.

Its logits come from the target's lm_head; its input hidden is the target's final hidden at the position that
produced t+1 (post-norm by default). The head's KV cache holds one row per target position (RoPE position t).
"""

import mlx.core as mx
import mlx.nn as nn

from ..cache import KVCache
from .compiled import run_layers
from .qwen3_5 import DecoderLayer, ModelArgs


class MTPHead(nn.Module):
    """`input_hidden`: the target hidden the head reads, "post" (after the final norm: the default, as vLLM and
    SGLang do) or "pre"; docs/mtp.md measured no difference in acceptance. With `rotated`, the target's residual
    stream is rotated (see rotate.py) and the head carries the rotation Q and the target's final norm weight to move
    between the two bases."""

    input_hidden = "post"

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

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list | None = None) -> mx.array:
        """Shapes: embeds, hidden [B, T, H] -> the head's hidden before `self.norm` [B, T, H]."""
        x = mx.concatenate([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1)
        return run_layers(self, self.layers, self.fc(x), cache)

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]
