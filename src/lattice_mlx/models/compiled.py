"""Compiled decode/verify forward (on by default; `LATTICE_COMPILE=0` runs layer by layer): each layer replayed
from an `mx.compile` trace.

Why: on a fast GPU decoding is host-bound (docs/adr/0001-e1-batched-verifier.md): building a step's graph in Python
costs time a verify round cannot hide and plain decoding hides only in part. Under `mx.compile` a layer is traced
once per input shape (T = 1 for decode, K+1 for verify) and later calls replay the trace without running the layer's
Python (docs/results/code_measurements.md, 'Host-bound decoding, and traces', for what that bought).

What is compiled: a GDN decoder layer whole (its cache passes in and out as arrays: conv window, state, and the
per-step states when recording); a full-attention layer in two pieces around the KV-cache write and attention
(norm + projections + q/k norm + RoPE at an array offset; output gate + o_proj + residual + MLP), because the KV
cache is written in place and grows every step. Embedding, final norm and lm_head stay as they are. Any cached
forward of T <= MAX_T tokens is compiled (decode, verify, and prompts or prefill chunks that short); longer prefill
chunks, tree verifies, explicit masks and uncached calls take the layer path.

Exactness (tests/models/test_compiled.py): the same logits and caches as the layer path to 1e-5 and the same greedy and
seeded-sampled MTP tokens, on the CPU, and on a GPU with TF32 matmuls off (the tests switch it off; with it on a
recorded verify's fp32 logits differed in rows 1-3: the same page, ADR 0001). The layers'
arrays are trace inputs read on every call, so weights changed after tracing are used; a replaced layer object or a
changed LATTICE_KERNELS gets its own traces. Not detected: a submodule swapped for one of another class that keeps
the very same arrays (retrace by deleting the owner's `_compiled`).
"""

from functools import partial

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, RotatingKVCache

from .. import settings
from ..metal import kernel_policy
from ..metal.attention import sdpa
from ..runtime import runtime_of

MAX_T = 16  # decode and verify sizes; prefill chunks take the uncompiled path




def enabled() -> bool:
    """On unless LATTICE_COMPILE=0 (the layer-by-layer reference path) or `forced(False)`."""
    return settings.on("compile")


def forced(on: bool | None):
    """The compiled path on / off inside a block (A/B legs; None: as the environment says)."""
    return settings.override(compile=on)


class _GDNState:
    """Stands in for a GDNCache inside a trace: the layer reads conv/ssm/window_pick/recording and hands back its
    update."""

    def __init__(self, conv, ssm, recording: bool, window_pick=None):
        self.conv, self.ssm, self.recording, self.window_pick = conv, ssm, recording, window_pick
        self.out = None

    def records(self, T: int) -> bool:
        return self.recording

    def update(self, conv_in: mx.array, new_state: mx.array, *, window: int, stepwise: bool) -> None:
        self.out = (conv_in, new_state)


# Each compiled function also takes `kernels` (kernel_policy() at the call), constants that MLX keys its trace cache
# on: the kernel dispatch inside a layer is decided while tracing, so LATTICE_KERNELS (or LATTICE_DEQUANT_ROWS)
# changed later picks (or traces) the matching trace instead of replaying another.
def _gdn_layer(layer, x: mx.array, conv, ssm, window_pick, recording: bool, kernels: tuple):
    state = _GDNState(conv, ssm, recording, window_pick)
    y = layer(x, state)
    return (y, *state.out)


def _attn_in(layer, x: mx.array, offset: mx.array, kernels: tuple):
    return layer.self_attn.project(x, offset, norm=layer.input_layernorm)


def _attn_out(layer, x: mx.array, out: mx.array, gate_src: mx.array, kernels: tuple) -> mx.array:
    h = layer.self_attn.finish(out, gate_src, residual=x)
    return layer.mlp(h, norm=layer.post_attention_layernorm, residual=h)


class CompiledLayers:
    """The compiled per-layer functions of one list of decoder layers (the target's or the MTP head's)."""

    def __init__(self, layers: list):
        self.layers = list(layers)
        self.key = layer_key(layers)
        # inputs=layer.state: the layer's arrays are read on every call (not frozen into the trace), so weights
        # changed after tracing (an update, a swapped or quantized submodule) are what the next call computes with
        self.fns = [mx.compile(partial(_gdn_layer, layer), inputs=layer.state) if layer.is_linear else
                    (mx.compile(partial(_attn_in, layer), inputs=layer.state),
                     mx.compile(partial(_attn_out, layer), inputs=layer.state))
                    for layer in layers]

    def __call__(self, h: mx.array, cache: list) -> mx.array:
        T = h.shape[1]
        kernels = kernel_policy()
        mask, masked = None, False
        for layer, c, fn in zip(self.layers, cache, self.fns):
            if layer.is_linear:
                record = c.records(T)
                h, conv_in, new_state = fn(h, c.conv, c.ssm, getattr(c, "window_pick", None), record, kernels)
                c.update(conv_in, new_state, window=layer.linear_attn.kernel_size - 1, stepwise=record)
            else:
                attn_in, attn_out = fn
                offset = c.offset if isinstance(c.offset, mx.array) else mx.array(c.offset, dtype=mx.int32)
                q, k, v, gate_src = attn_in(h, offset, kernels)
                # a rotating cache (max_kv_size) masks a sliding window once it has rotated; a batch's cache its
                # sequences' left padding. Built once a forward: every attention layer's cache holds the same columns
                if not masked:
                    mask = c.make_mask(T) if isinstance(c, (RotatingKVCache, BatchKVCache)) else None
                    if mask is None and T > 1:
                        mask = "causal"
                    masked = True
                k, v = c.update_and_fetch(k, v)
                out = sdpa(q, k, v, scale=layer.self_attn.scale, mask=mask, length=getattr(c, "length", None))
                h = attn_out(h, out, gate_src, kernels)
        return h


def layer_key(layers: list) -> tuple[int, ...]:
    """Which layer objects a CompiledLayers was built for (a replaced layer needs new traces)."""
    return tuple(map(id, layers))


def usable(h: mx.array, cache, mask, tree, input_embeddings) -> bool:
    """The compiled path covers cached decode/verify steps: no tree, no explicit mask, T <= MAX_T."""
    return (enabled() and cache is not None and cache[0] is not None and tree is None and mask is None
            and input_embeddings is None and h.shape[1] <= MAX_T)


def run_layers(owner, layers: list, h: mx.array, cache, mask=None, tree=None, input_embeddings=None) -> mx.array:
    """Runs `layers` over h: compiled when enabled and usable, else layer by layer (the reference path).
    The compiled functions are built on first use and kept in `owner.runtime` (a TextModel or the MTP head)."""
    if usable(h, cache, mask, tree, input_embeddings):
        rt = runtime_of(owner)
        compiled = rt.compiled
        if compiled is None or compiled.key != layer_key(layers):
            compiled = rt.compiled = CompiledLayers(layers)
        return compiled(h, cache)
    cache = cache if cache is not None else [None] * len(layers)
    if mask is None and tree is None:  # one mask for every attention layer (their caches hold the same columns)
        first = next((c for layer, c in zip(layers, cache) if not getattr(layer, "is_linear", False)), None)
        if isinstance(first, (RotatingKVCache, BatchKVCache)):
            mask = first.make_mask(h.shape[1])
    for layer, c in zip(layers, cache):
        h = layer(h, c, mask, tree)
    return h
