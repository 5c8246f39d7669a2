"""QuaRot-style rotation of the residual stream, folded into the weights: x' = Q x with Q = H_blocks · diag(s).

RMSNorm commutes with an orthogonal Q once its weight is folded into the linears that read it, so every reader
W becomes W diag(w) Q^T, every writer W becomes Q W, the embedding E becomes E Q^T, and the final norm's weight goes
into an (untied) lm_head: W_lm diag(w_f) Q^T. The MTP head keeps its own stream unrotated and gets counter-rotations:
its embedding half is folded like any reader; the target hidden it receives is un-rotated by the stored `Q` (and the
final norm weight re-applied for the post-norm hidden), and its output u is rotated into the target's basis so the
shared lm_head gives the original logits: z = Q diag(1 / w_f) u.
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .models.fuse import FUSIONS


def hadamard(n: int) -> np.ndarray:
    """Normalised Walsh-Hadamard matrix (Sylvester), n a power of two."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def rotation(dims: int, seed: int) -> np.ndarray:
    """Q [dims, dims]: block-diagonal Hadamard (largest power-of-two block dividing dims) times random signs."""
    block = dims & -dims
    hb = hadamard(block)
    q = np.kron(np.eye(dims // block), hb)
    signs = np.random.default_rng(seed).choice([-1.0, 1.0], size=dims)
    return q * signs[None, :]


def _fold_readers(linears: list[nn.Linear], norm: nn.RMSNorm, qt: mx.array) -> None:
    for lin in linears:
        lin.weight = (lin.weight * norm.weight[None, :]) @ qt
    norm.weight = mx.ones_like(norm.weight)


def _readers(module: nn.Module, fused_name: str) -> list[nn.Linear]:
    """The linears reading one input, fused (models/fuse.py) or not."""
    return [module[fused_name]] if fused_name in module else [module[n] for n in FUSIONS[fused_name]]


def _rotate_layer(layer, q: mx.array, qt: mx.array) -> None:
    mixer = layer.linear_attn if layer.is_linear else layer.self_attn
    _fold_readers(_readers(mixer, "in_proj" if layer.is_linear else "qkv_proj"), layer.input_layernorm, qt)
    writer = mixer.out_proj if layer.is_linear else mixer.o_proj
    writer.weight = q @ writer.weight
    _fold_readers(_readers(layer.mlp, "gate_up_proj"), layer.post_attention_layernorm, qt)
    layer.mlp.down_proj.weight = q @ layer.mlp.down_proj.weight


def rotate_model(model, *, seed: int = 0, skip_mtp_counter_rotation: bool = False) -> dict:
    """Rotates a dense fp32 model in place; returns the config entry that records it. `skip_mtp_counter_rotation`
    exists for a test that shows the head breaks without it."""
    args = model.args
    if args.num_experts:
        raise ValueError("cannot rotate an MoE checkpoint yet: rotate a dense one, or convert without --rotate")
    H = args.hidden_size
    q = mx.array(rotation(H, seed), dtype=model.model.embed_tokens.weight.dtype)
    qt = q.T
    embed = model.model.embed_tokens.weight
    lm = embed if args.tie_word_embeddings else model.lm_head.weight
    w_f = model.model.norm.weight
    if model.has_mtp and mx.abs(w_f).min().item() < 1e-3:
        raise ValueError("cannot rotate: the final norm weight has entries near zero (the MTP output needs 1/w)")
    if args.tie_word_embeddings:
        model.lm_head = nn.Linear(H, args.vocab_size, bias=False)
        args.tie_word_embeddings = False
    model.lm_head.weight = (lm * w_f[None, :]) @ qt
    model.model.embed_tokens.weight = embed @ qt
    model.model.norm.weight = mx.ones_like(w_f)
    for layer in model.layers:
        _rotate_layer(layer, q, qt)
    if model.has_mtp and not skip_mtp_counter_rotation:
        head = model.mtp
        w_e = head.pre_fc_norm_embedding.weight
        fc_e, fc_h = head.fc.weight[:, :H], head.fc.weight[:, H:]
        head.fc.weight = mx.concatenate([(fc_e * w_e[None, :]) @ qt, fc_h], axis=1)
        head.pre_fc_norm_embedding.weight = mx.ones_like(w_e)
        head.rotation = q
        head.target_norm = w_f
    mx.eval(model.parameters())
    return {"kind": "hadamard", "seed": seed, "block": H & -H}
