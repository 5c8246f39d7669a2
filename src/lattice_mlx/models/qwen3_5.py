"""Qwen3.5 text model: Gated DeltaNet layers interleaved with gated full attention (mlx-lm model protocol)."""

import re
from dataclasses import dataclass, field, fields
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, RotatingKVCache
from mlx_lm.models.switch_layers import SwitchGLU

from ..cache import GDNCache, KVCache, NullCache
from ..metal.attention import sdpa
from ..metal.gated_delta import gated_delta_conv_update, unpack
from ..metal.gated_delta_tree import gated_delta_tree
from ..metal.q4_matmul import Pre, prologue_ref, swiglu
from ..metal.qk_norm_rope import qk_norm_rope
from ..runtime import Runtime, runtime_of
from .compiled import run_layers
from .layers import Q4Embedding, RMSNormGated, drop_split_k, project, project_out, rms_pre, rope_at
from .parallel import Pipe, SkipLayer, from_rank, run_stages, split_stages
from .tree import Tree

# RMSNorms stored zero-centred in raw HF checkpoints (applied as x * (1 + w)); the GDN gated norm is not one of them.
SHIFTED_NORMS = re.compile(
    r"(input_layernorm|post_attention_layernorm|q_norm|k_norm|pre_fc_norm_embedding|pre_fc_norm_hidden)\.weight$"
    r"|^(model|mtp)\.norm\.weight$"
)


# config.json fields without which ModelArgs would build its defaults' shapes, not the checkpoint's
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size")
POSITIVE = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "vocab_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
            "linear_value_head_dim", "linear_conv_kernel_dim", "full_attention_interval", "max_position_embeddings")


@dataclass
class ModelArgs:
    model_type: str = "qwen3_5_text"
    hidden_size: int = 1024
    intermediate_size: int = 3584
    num_hidden_layers: int = 24
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    vocab_size: int = 248320
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 16
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    full_attention_interval: int = 4
    layer_types: list[str] | None = None
    rope_parameters: dict | None = None
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262144
    eos_token_id: int | list[int] | None = None
    mtp_num_hidden_layers: int = 0
    # qwen3_5_moe: every layer's MLP (the MTP layer's too) is a sparse MoE block; 0 experts = the dense family
    num_experts: int = 0
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    # Derived in __post_init__: rotary dims of the attention head.
    rope_dims: int = field(init=False, default=0)

    @classmethod
    def from_dict(cls, config: dict) -> "ModelArgs":
        """Reads the text fields of a hub (`text_config`), text-only or mlx-community config; unknown keys dropped."""
        text = dict(config.get("text_config") or config)
        for key in ("tie_word_embeddings", "eos_token_id"):
            if key not in text and key in config:
                text[key] = config[key]
        names = {f.name for f in fields(cls) if f.init}
        required = REQUIRED if text.get("num_experts") else (*REQUIRED, "intermediate_size")
        missing = [k for k in required if k not in text]
        if missing:  # the defaults are one checkpoint's shapes: another's weights would fail with a shape mismatch
            raise ValueError(f"{missing[0]} is missing (a Qwen3.5 config sets {', '.join(required)})")
        return cls(**{k: v for k, v in text.items() if k in names})

    def check(self) -> None:
        """ValueError naming the first field with a value no model can have (a sizes' type or range)."""
        sizes = [*POSITIVE, *(["head_dim"] if self.head_dim is not None else []),
                 *(["num_experts_per_tok", "moe_intermediate_size"] if self.num_experts else [])]
        for name in sizes:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for name in ("mtp_num_hidden_layers", "num_experts", "shared_expert_intermediate_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        for name in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"{name} must be a positive number, got {v!r}")
        for name in ("tie_word_embeddings", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.rope_parameters is not None and not isinstance(self.rope_parameters, dict):
            raise ValueError(f"rope_parameters must be an object, got {self.rope_parameters!r}")
        if self.layer_types is not None and (not isinstance(self.layer_types, list) or not set(self.layer_types)
                                             <= {"full_attention", "linear_attention"}):
            raise ValueError(f"layer_types must be a list of full_attention and linear_attention, got "
                             f"{self.layer_types!r}"[:200])
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")

    def __post_init__(self):
        self.check()
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        rope = self.rope_parameters or {}
        self.rope_theta = float(rope.get("rope_theta", self.rope_theta))
        self.partial_rotary_factor = float(rope.get("partial_rotary_factor", self.partial_rotary_factor))
        self.rope_dims = int(self.head_dim * self.partial_rotary_factor)
        if self.layer_types is None:
            interval = self.full_attention_interval
            self.layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} is outside 1..{self.num_experts}")


class GatedDeltaNet(nn.Module):
    sharding_group = None  # Model.shard: this rank's heads, out_proj's partial sums added over the group

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.Hk, self.Hv = args.linear_num_key_heads, args.linear_num_value_heads
        self.Dk, self.Dv = args.linear_key_head_dim, args.linear_value_head_dim
        self.key_dim, self.value_dim = self.Hk * self.Dk, self.Hv * self.Dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.kernel_size = args.linear_conv_kernel_dim
        H = args.hidden_size
        self.in_proj_qkv = nn.Linear(H, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(H, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(H, self.Hv, bias=False)
        self.in_proj_a = nn.Linear(H, self.Hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel_size, groups=self.conv_dim, bias=False)
        self.dt_bias = mx.ones((self.Hv,))
        self.A_log = mx.zeros((self.Hv,))
        self.norm = RMSNormGated(self.Dv, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, H, bias=False)

    def __call__(self, x: mx.array, cache: GDNCache | None = None, tree: Tree | None = None, *,
                 norm: nn.RMSNorm | None = None, residual: mx.array | None = None) -> mx.array:
        """residual + the mixer's output on norm(x) (norm and residual fused into the projections)."""
        B, T, _ = x.shape
        packed = None
        # a left-padded group's prefill (batch.py): its pad positions' projections zeroed, so that they enter no
        # conv window or state (k = v = 0 on a zero state leaves it zero)
        valid = getattr(cache, "valid", None) if T > 1 else None
        if "in_proj" in self:  # fused (models/fuse.py): [qkv | z | b | a]
            proj = project(self.in_proj, x, pre=rms_pre(norm))
            if valid is not None:
                proj = mx.where(valid[..., None], proj, mx.zeros((), proj.dtype))
            # the GDN kernel reads qkv, b and a in place (no slice copies); the slices exist only where needed
            packed = (proj, self.in_proj_points[1], self.in_proj_points[2])
            qkv = a = b = None
            z_src, z_offset = proj, self.in_proj_points[0]
            dtype = proj.dtype
        else:
            x = prologue_ref(rms_pre(norm), x)
            qkv, z_src, b, a = self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
            if valid is not None:
                qkv = mx.where(valid[..., None], qkv, mx.zeros((), qkv.dtype))
            z_offset = 0
            dtype = qkv.dtype

        conv_state = cache.conv if cache is not None else None
        if conv_state is None:
            conv_state = mx.zeros((B, self.kernel_size - 1, self.conv_dim), dtype=dtype)
        if tree is not None:
            if packed is not None:
                qkv, a, b = unpack(packed, self.conv_dim, self.Hv)
            conv_in = mx.concatenate([conv_state.astype(qkv.dtype), qkv], axis=1)  # [B, T+K-1, C]
            windows = conv_in[:, tree.conv_windows(self.kernel_size)]  # [B, T, K, C]
            # fp32 sums rounded before the SiLU, as the chain path's kernel and conv_silu_ref do
            w = self.conv1d.weight[:, :, 0].T.astype(mx.float32)
            conv_out = nn.silu((windows.astype(mx.float32) * w).sum(axis=2).astype(qkv.dtype))
            q, k, v = mx.split(conv_out, [self.key_dim, 2 * self.key_dim], axis=-1)
            q = q.reshape(B, T, self.Hk, self.Dk)
            k = k.reshape(B, T, self.Hk, self.Dk)
            v = v.reshape(B, T, self.Hv, self.Dv)
            state = cache.ssm if cache is not None else None
            y, node_states = gated_delta_tree(q, k, v, a, b, self.A_log, self.dt_bias, state, list(tree.parents))
            if cache is not None:
                cache.record_tree(windows[:, :, 1:], node_states)
        else:
            # conv + SiLU + recurrence in one kernel at decode/verify sizes (metal/gated_delta.py)
            record = cache is not None and cache.records(T)
            y, new_state, conv_in = gated_delta_conv_update(
                qkv, conv_state, self.conv1d.weight.reshape(self.conv_dim, self.kernel_size), a, b, self.A_log,
                self.dt_bias, cache.ssm if cache is not None else None, heads=(self.Hk, self.Dk, self.Hv, self.Dv),
                step_states=record, packed=packed, pick=getattr(cache, "window_pick", None))
            if cache is not None:
                cache.update(conv_in, new_state, window=self.kernel_size - 1, stepwise=record)
        gated = Pre("gated_rms", self.norm.weight, self.norm.eps, src=z_src, offset=z_offset)
        return project_out(self, self.out_proj, y, pre=gated, residual=residual)


class Attention(nn.Module):
    sharding_group = None

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        H, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(H, 2 * self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, H, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.rope_dims, self.rope_theta = args.rope_dims, args.rope_theta

    def project(self, x: mx.array, offset: int | mx.array, tree: Tree | None = None, *,
                norm: nn.RMSNorm | None = None) -> tuple[mx.array, ...]:
        """q, k, v [B, heads, T, D] (normed, RoPE at positions offset.. or the tree's depths) of norm(x), and the
        projection output whose per-head [q | gate] blocks hold the output gate (for `finish`)."""
        B, T, _ = x.shape
        if "qkv_proj" in self:  # fused (models/fuse.py): [q and gate | k | v]
            gate_src = project(self.qkv_proj, x, pre=rms_pre(norm))
            if tree is None:  # q/k norms and RoPE in one kernel on a GPU (metal/qk_norm_rope.py)
                q, k, v = qk_norm_rope(gate_src, self.q_norm, self.k_norm, offset,
                                       heads=(self.n_heads, self.n_kv, self.head_dim), rope_dims=self.rope_dims,
                                       base=self.rope_theta)
                return q, k, v, gate_src
            qg, k, v = mx.split(gate_src, self.qkv_proj_points, axis=-1)
        else:
            x = prologue_ref(rms_pre(norm), x)
            gate_src = qg = self.q_proj(x)
            k, v = self.k_proj(x), self.v_proj(x)
        q = qg.reshape(B, T, self.n_heads, 2 * self.head_dim)[..., : self.head_dim]  # [B, T, Hq, D]
        q = self.q_norm(q).transpose(0, 2, 1, 3)
        k = self.k_norm(k.reshape(B, T, self.n_kv, -1)).transpose(0, 2, 1, 3)
        v = v.reshape(B, T, self.n_kv, -1).transpose(0, 2, 1, 3)
        if tree is not None:
            positions = offset + mx.array(tree.depths)
            q, k = rope_at(q, positions, self.rope_dims, self.rope_theta), rope_at(k, positions, self.rope_dims,
                                                                               self.rope_theta)
        else:
            q = mx.fast.rope(q, self.rope_dims, traditional=False, base=self.rope_theta, scale=1.0, offset=offset)
            k = mx.fast.rope(k, self.rope_dims, traditional=False, base=self.rope_theta, scale=1.0, offset=offset)
        return q, k, v, gate_src

    def finish(self, out: mx.array, gate_src: mx.array, residual: mx.array | None = None) -> mx.array:
        """Attention output [B, heads, T, D] -> gated, projected [B, T, H] (+ residual)."""
        return project_out(self, self.o_proj, out, pre=Pre("gate", src=gate_src), residual=residual)

    def __call__(self, x: mx.array, cache: KVCache | None = None, mask: mx.array | str | None = None,
                 tree: Tree | None = None, *, norm: nn.RMSNorm | None = None,
                 residual: mx.array | None = None) -> mx.array:
        T = x.shape[1]
        offset = cache.offset if cache is not None else 0
        q, k, v, gate_src = self.project(x, offset, tree, norm=norm)
        if tree is not None:
            mask = tree.attention_mask(offset)
        elif mask is None and isinstance(cache, (RotatingKVCache, BatchKVCache)):
            # a sliding window once the cache has rotated (None for one row); a batch's left padding (batch.py)
            mask = cache.make_mask(T)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if mask is None and T > 1:
            mask = "causal"
        # a kernel at decode/verify sizes (metal/attention.py); a fixed-capacity cache says how many keys are valid
        out = sdpa(q, k, v, scale=self.scale, mask=mask, length=getattr(cache, "length", None))
        return self.finish(out, gate_src, residual)


class MLP(nn.Module):
    sharding_group = None

    def __init__(self, dims: int, hidden_dims: int):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden_dims, bias=False)
        self.up_proj = nn.Linear(dims, hidden_dims, bias=False)
        self.down_proj = nn.Linear(hidden_dims, dims, bias=False)

    def __call__(self, x: mx.array, *, norm: nn.RMSNorm | None = None, residual: mx.array | None = None) -> mx.array:
        """residual + down(silu(gate(norm(x))) * up(norm(x))), the norm, SwiGLU and residual fused into the matmuls."""
        if "gate_up_proj" in self:  # fused (models/fuse.py): [gate | up], SwiGLU as the matmul's epilogue
            h = project(self.gate_up_proj, x, pre=rms_pre(norm), glu=True)
            return project_out(self, self.down_proj, h, residual=residual)
        x = prologue_ref(rms_pre(norm), x)
        return project_out(self, self.down_proj, swiglu(self.gate_proj(x), self.up_proj(x)), residual=residual)


class SparseMoeBlock(nn.Module):
    """qwen3_5_moe's MLP: a softmax router (fp32) picks the top-k experts, whose weights are renormalised to sum to 1
    (HF's Qwen3_5MoeTopKRouter math; on exact ties the experts picked may differ from HF's, as mlx-lm's do); the experts run through mlx-lm's SwitchGLU (gather_qmm when quantized);
    plus one shared expert scaled by sigmoid(shared_expert_gate(x))."""

    sharding_group = None  # Model.shard: this rank's slice of every expert's and the shared expert's hidden units

    def __init__(self, args: ModelArgs):
        super().__init__()
        H = args.hidden_size
        self.top_k = args.num_experts_per_tok
        self.gate = nn.Linear(H, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(H, args.moe_intermediate_size, args.num_experts)
        self.shared_expert = MLP(H, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(H, 1, bias=False)

    def __call__(self, x: mx.array, *, norm: nn.RMSNorm | None = None, residual: mx.array | None = None) -> mx.array:
        """residual + the block's output on norm(x)."""
        x = prologue_ref(rms_pre(norm), x)
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)
        inds = mx.argpartition(-probs, kth=self.top_k - 1, axis=-1)[..., : self.top_k]  # [B, T, k]
        scores = mx.take_along_axis(probs, inds, axis=-1)
        scores = (scores / scores.sum(axis=-1, keepdims=True)).astype(x.dtype)
        # unquantized experts may be kept in fp32 (MLX's CPU gather_mm takes fp32 only; load.py does that there)
        experts_dtype = self.switch_mlp.gate_proj.weight.dtype if "scales" not in self.switch_mlp.gate_proj else x.dtype
        y = self.switch_mlp(x.astype(experts_dtype), inds).astype(x.dtype)
        y = (y * scores[..., None]).sum(axis=-2)
        y = y + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if self.sharding_group is not None:  # routed and shared partial sums added over the ranks at once
            y = mx.distributed.all_sum(y, group=self.sharding_group)
        return y if residual is None else residual + y


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_type: str):
        super().__init__()
        self.is_linear = layer_type == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(args)
        else:
            self.self_attn = Attention(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.mlp = SparseMoeBlock(args) if args.num_experts else MLP(args.hidden_size, args.intermediate_size)

    def __call__(self, x: mx.array, cache: Any = None, mask: mx.array | str | None = None,
                 tree: Tree | None = None) -> mx.array:
        norm = self.input_layernorm
        if self.is_linear:
            h = self.linear_attn(x, cache, tree, norm=norm, residual=x)
        else:
            h = self.self_attn(x, cache, mask, tree, norm=norm, residual=x)
        return self.mlp(h, norm=self.post_attention_layernorm, residual=h)


class TextModel(nn.Module):
    pipe: Pipe | None = None  # set by Model.pipeline

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, t) for t in args.layer_types]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, inputs: mx.array, cache: list | None = None, input_embeddings: mx.array | None = None,
                 mask: mx.array | str | None = None, tree: Tree | None = None) -> mx.array:
        """Returns the final hidden states before the last norm, [B, T, H]."""
        h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        p = self.pipe
        if p is None:
            return run_layers(self, self.layers, h, cache, mask, tree, input_embeddings)
        return run_stages(self, p, h, cache, mask, tree, input_embeddings)


class Model(nn.Module):
    """Qwen3.5 causal LM. Parameters are named as in HF's text-only checkpoint (`model.*`, `lm_head`, `mtp.*`)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model_type = args.model_type
        self.runtime = Runtime()  # traces, tuner memory, the draft model's tap (runtime.py)
        self.model = TextModel(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def __call__(self, inputs: mx.array, cache: list | None = None, input_embeddings: mx.array | None = None, *,
                 return_hidden: bool | str = False, mask: mx.array | str | None = None, tree: Tree | None = None):
        """Logits [B, T, V]; with return_hidden, also the hidden the MTP head reads [B, T, H] (`head_input`;
        return_hidden="pre": the hidden before it, whose head_input the caller takes later, for many rows at once).
        With `tree`, the T inputs are the nodes of a token tree (see Tree)."""
        tap = self.runtime.hidden_tap  # lattice_mlx.make_draft_model: the draft model reads every hidden
        first = next((c for c in cache if hasattr(c, "offset")), None) if tap is not None and cache else None
        start = first.offset if first is not None else None
        pre = self.model(inputs, cache, input_embeddings, mask, tree)
        # the final norm fused into the lm_head either way: a verify row's logits are then computed exactly as a
        # decode step's (the unfused form rounds norm(h) to the activation dtype first: other logits in bf16)
        logits = self.lm_logits(pre, norm=self.model.norm)
        hidden = self.head_input(pre) if return_hidden is True or start is not None else None
        if start is not None and tree is None:
            tap.record(start, hidden[0], first)
        if return_hidden == "pre":
            return logits, pre
        return (logits, hidden) if return_hidden else logits

    def update(self, parameters: dict, strict: bool = True) -> "Model":
        """nn.Module.update (load_weights, optimizers), dropping the split-K layouts a batch engine made of the old
        weights (layers.prepare_split_k), and the traces that hold them as constants."""
        super().update(parameters, strict=strict)
        if drop_split_k(self):
            self.runtime.traces.clear()
            for part in (self, self.model, self.get("mtp")):
                if part is not None:
                    runtime_of(part).compiled = None
        return self

    def head_input(self, pre: mx.array) -> mx.array:
        """The final hidden the MTP head reads: after the final norm unless the head says `input_hidden = "pre"`."""
        if self.has_mtp and self.mtp.input_hidden == "pre":
            return pre
        return self.model.norm(pre)

    def lm_logits(self, h: mx.array, *, norm: nn.RMSNorm | None = None) -> mx.array:
        """Logits of h (of norm(h) when given, fused into the matmul)."""
        embed = self.model.embed_tokens
        if not self.args.tie_word_embeddings:
            return project(self.lm_head, h, pre=rms_pre(norm))
        if isinstance(embed, Q4Embedding):
            return embed.as_linear(h, pre=rms_pre(norm))
        return embed.as_linear(prologue_ref(rms_pre(norm), h))

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    @property
    def has_mtp(self) -> bool:
        return "mtp" in self

    def make_cache(self, *, trimmable: bool = True, max_kv_size: int | None = None) -> list:
        """One cache per layer. `trimmable` (the default, what mlx-lm's make_prompt_cache gets): GDN caches record
        short forwards so that mlx-lm's speculative loop can trim them (cache.GDNCache); this package's own loops
        pass False and roll back through begin/rollback instead. `max_kv_size`: the attention layers keep at most
        that many keys (mlx-lm's RotatingKVCache, its first 4 kept; plain decoding only)."""
        def kv():
            return RotatingKVCache(max_size=max_kv_size, keep=4) if max_kv_size else KVCache()
        return [NullCache() if isinstance(layer, SkipLayer) else GDNCache(trimmable=trimmable) if layer.is_linear
                else kv() for layer in self.layers]

    def pipeline(self, group=None, split: list[int] | None = None, transport: str | None = None) -> set[str]:
        """Pipeline parallel over `group`, in place: this process keeps only its stage's decoder layers (layers
        [start, end): rank size-1 the first ones, rank 0 the last, an even split unless `split` gives the layer
        count per rank); the others become weightless SkipLayers. Embedding, final norm, lm_head and the MTP head
        stay on every rank. Returns the parameter names this rank no longer holds (load() skips reading them)."""
        return split_stages(self, group, split, transport)

    sharding_group = None  # set by shard(): the group this model runs tensor-parallel over

    def shard(self, group=None, *, mtp: str = "replicated") -> None:
        """Tensor parallel over `group` (default: mx.distributed.init()), in place, mlx-lm's conventions
        (mlx.nn.layers.distributed.shard_inplace): each rank keeps 1/N of the GDN heads (qkv, z, b, a rows and the
        conv channels per q/k/v segment; A_log, dt_bias), of the attention heads (key/value heads repeated when N
        exceeds them) and of the MLP's hidden units; the output projections take this rank's slice of their input
        and their partial sums are added over the group (one all_sum per block). Embedding, lm_head, norms and the
        MTP head are replicated. MoE: every expert's and the shared expert's hidden units split likewise, the router
        replicated. `mtp="sharded"` splits the MTP head's decoder layer the same way (its fc, norms and the shared
        embedding stay replicated): less memory and compute per rank, two more all_sums per draft step.
        Call it on the checkpoint's layout, before fuse_projections (load() does)."""
        if mtp not in ("replicated", "sharded"):
            raise ValueError(f"mtp={mtp!r}: the MTP head is 'replicated' or 'sharded'")
        group = group or mx.distributed.init()
        N, rank = group.size(), group.rank()
        if N == 1:
            return
        if self.model.pipe is not None:
            raise ValueError("a model is either tensor-parallel (shard) or pipelined, not both")
        from mlx.nn.layers.distributed import shard_inplace

        a = self.args
        problems = []
        sizes = [("linear_num_key_heads", a.linear_num_key_heads), ("linear_num_value_heads",
                 a.linear_num_value_heads), ("num_attention_heads", a.num_attention_heads)]
        sizes += ([("moe_intermediate_size", a.moe_intermediate_size), ("shared_expert_intermediate_size",
                   a.shared_expert_intermediate_size)] if a.num_experts else [("intermediate_size", a.intermediate_size)])
        for name, n in sizes:
            if n % N:
                problems.append(f"{name} = {n} is not divisible by the group size {N}")
        if a.attention_bias:
            problems.append("attention_bias: the output projection's bias would be added once per rank")
        kv = a.num_key_value_heads
        if (kv % N if N <= kv else N % kv):
            problems.append(f"num_key_value_heads = {kv} and the group size {N}: one must divide the other")
        layers = list(self.layers) + (list(self.mtp.layers) if mtp == "sharded" and self.has_mtp else [])
        mlps = [layer.mlp.shared_expert if a.num_experts else layer.mlp for layer in layers]
        if any(name in mod for layer, mlp in zip(layers, mlps)
               for mod in (layer.linear_attn if layer.is_linear else layer.self_attn, mlp)
               for name in ("in_proj", "qkv_proj", "gate_up_proj")):
            problems.append("shard() needs the checkpoint's unfused projections: call it before fuse_projections")

        def downs(mlp):
            return [mlp.switch_mlp.down_proj, mlp.shared_expert.down_proj] if a.num_experts else [mlp.down_proj]

        for m in (lin for layer in layers for lin in (
                [layer.linear_attn.out_proj] if layer.is_linear else [layer.self_attn.o_proj]) + downs(layer.mlp)):
            gs = getattr(m, "group_size", None)
            if gs and (m.weight.shape[-1] * 32 // m.bits // N) % gs:
                problems.append(f"an output projection's input ({m.weight.shape[-1] * 32 // m.bits}) split {N} ways "
                                f"is not a whole number of quantization groups ({gs})")
                break
        if problems:
            raise ValueError(f"cannot shard over {N} ranks: {problems[0]}")

        def repeat_heads(linear: nn.Module, heads: int) -> None:
            if N <= heads:
                return
            linear.update({k: mx.repeat(v.reshape(heads, -1, *v.shape[1:]), N // heads, axis=0).reshape(-1, *v.shape[1:])
                           for k, v in linear.parameters().items()})

        for layer in layers:
            if layer.is_linear:
                g = layer.linear_attn
                kd = g.key_dim
                shard_inplace(g.conv1d, lambda p, w, kd=kd: (0, [kd, 2 * kd]), group=group)
                shard_inplace(g.in_proj_qkv, "all-to-sharded", segments=[kd, 2 * kd], group=group)
                for lin in (g.in_proj_z, g.in_proj_b, g.in_proj_a):
                    shard_inplace(lin, "all-to-sharded", group=group)
                g.dt_bias = mx.contiguous(mx.split(g.dt_bias, N)[rank])
                g.A_log = mx.contiguous(mx.split(g.A_log, N)[rank])
                shard_inplace(g.out_proj, "sharded-to-all", group=group)
                g.Hk, g.Hv = g.Hk // N, g.Hv // N
                g.key_dim, g.value_dim, g.conv_dim = g.key_dim // N, g.value_dim // N, g.conv_dim // N
                g.sharding_group = group
            else:
                t = layer.self_attn
                shard_inplace(t.q_proj, "all-to-sharded", group=group)
                for lin in (t.k_proj, t.v_proj):
                    repeat_heads(lin, t.n_kv)
                    shard_inplace(lin, "all-to-sharded", group=group)
                shard_inplace(t.o_proj, "sharded-to-all", group=group)
                t.n_heads, t.n_kv = t.n_heads // N, max(1, t.n_kv // N)
                t.sharding_group = group
            m = layer.mlp
            # MoE: the router and the shared expert's gate are replicated; the experts and the shared expert are
            # split like an MLP, and the block adds its partial sums once (the shared MLP keeps no group of its own)
            for mlp in ([m.switch_mlp, m.shared_expert] if a.num_experts else [m]):
                shard_inplace(mlp.gate_proj, "all-to-sharded", group=group)
                shard_inplace(mlp.up_proj, "all-to-sharded", group=group)
                shard_inplace(mlp.down_proj, "sharded-to-all", group=group)
            m.sharding_group = group
        self.sharding_group = group

    def agree(self, x: mx.array) -> mx.array:
        """x as rank 0 has it, on every rank of a sharded model (itself otherwise): the tokens every rank feeds
        next and the accept/reject decisions come from one rank, so no rank can go its own way (a rank whose
        sampler or random state differed would otherwise feed other tokens into the collective forward)."""
        g = self.sharding_group
        if g is None or g.size() == 1:
            return x
        return from_rank(x, 0, g)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        return sanitize(weights, tie_word_embeddings=self.args.tie_word_embeddings)


_EXPERT = re.compile(r"^(.*\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.(weight|scales|biases)$")


def _switch_experts(w: dict[str, mx.array]) -> dict[str, mx.array]:
    """MoE experts into SwitchGLU's layout: the trunk's fused `experts.gate_up_proj` [E, 2I, H] split at its middle
    and `experts.down_proj` [E, H, I] renamed; the MTP layer's per-expert `experts.{e}.{gate,up,down}_proj` stacked."""
    out, per_expert = {}, {}
    for k, v in w.items():
        m = _EXPERT.match(k)
        if m:
            per_expert.setdefault((m.group(1), m.group(3), m.group(4)), {})[int(m.group(2))] = v
        elif k.endswith(".mlp.experts.gate_up_proj"):
            prefix, mid = k[: -len(".experts.gate_up_proj")], v.shape[-2] // 2
            out[f"{prefix}.switch_mlp.gate_proj.weight"] = v[..., :mid, :]
            out[f"{prefix}.switch_mlp.up_proj.weight"] = v[..., mid:, :]
        elif k.endswith(".mlp.experts.down_proj"):
            out[k[: -len(".experts.down_proj")] + ".switch_mlp.down_proj.weight"] = v
        else:
            out[k] = v
    counts = {}
    for (prefix, proj, tensor), experts in per_expert.items():
        n = counts.setdefault(prefix, max(max(e) + 1 for (p, _, _), e in per_expert.items() if p == prefix))
        missing = sorted(set(range(n)) - set(experts))
        if missing:
            raise ValueError(f"{prefix}.experts.{missing[0]}.{proj}_proj.{tensor} is missing ({len(experts)} of {n} "
                             "experts)")
        out[f"{prefix}.switch_mlp.{proj}_proj.{tensor}"] = mx.stack([experts[e] for e in range(n)])
    return out


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
    out = _switch_experts(out)
    raw = any(k.endswith("conv1d.weight") and v.shape[-1] != 1 for k, v in out.items())
    if raw:
        for k, v in out.items():
            if k.endswith("conv1d.weight"):
                out[k] = v.moveaxis(2, 1)
            elif SHIFTED_NORMS.search(k) and v.ndim == 1:
                # 1 + w rounded to bf16 would be off by up to 2^-9; the loader casts to the model dtype it chooses.
                out[k] = v.astype(mx.float32) + 1.0
    return out
