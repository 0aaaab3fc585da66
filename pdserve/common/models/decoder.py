"""One decoder-only transformer covering Qwen3 (q/k norm), Qwen2 (qkv bias) and Llama
(GQA, optional attention bias), reading HuggingFace weight names."""
from __future__ import annotations

import operator
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve import kernels
from pdserve.common.models.attention import AttentionMetadata, attend
from pdserve.common.config import ModelConfig
from pdserve.common.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding
from pdserve.common.models.rope import rope_frequencies
from pdserve.common.rope_config import RopeConfig
from pdserve.kernels import cpu_native
from pdserve.kernels.cpu_decode import DecodeInputs, DecodeStack, LayerTensors, ModelTensors, StackDims

# what `_stack_fingerprint` reads of each item, as C-level callables for `map`
_DATA_PTR = torch.Tensor.data_ptr
_VERSION = operator.attrgetter("_version")

# HF weight name fragment -> (our fused parameter fragment, shard index)
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def mark_shards(linear: nn.Linear, sizes: tuple[int, ...]) -> None:
    """Tag a fused projection's parameters with their row shards (q/k/v or gate/up)."""
    for p in linear.parameters():
        p.shard_sizes = sizes  # type: ignore[attr-defined]


class SelfAttention(nn.Module):
    """Owns the fused q/k/v projection, the output projection and (Qwen3) q/k norms."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        mark_shards(self.qkv_proj, (self.q_size, self.kv_size, self.kv_size))
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self._qk_weight: torch.Tensor | None = None
        self._qk_weight_of: tuple[int, ...] | None = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """x [N, hidden]; `rope` is the step's (cos, signed sin) tables (`RotaryEmbedding.tables`)."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)
        v = qkv[:, self.q_size + self.kv_size:].view(n, self.num_kv_heads, self.head_dim)
        has_norm = self.q_norm is not None
        if kernels.qk_norm_rope_(qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                                 self.q_norm.weight if has_norm else None, self.k_norm.weight if has_norm else None,
                                 self.q_norm.eps if has_norm else 0.0, rope[0].squeeze(1), rope[1].squeeze(1)):
            q = qkv[:, :self.q_size].view(n, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size:self.q_size + self.kv_size].view(n, self.num_kv_heads, self.head_dim)
        else:
            # q and k sit side by side in the fused output: norm and rotate them as one [N, Hq + Hkv, D]
            qk = qkv[:, :self.q_size + self.kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim)
            if has_norm:
                qk = self.qk_norm(qk)
            qk = RotaryEmbedding.apply(qk, rope)
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
        o = attend(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        return self.o_proj(o.reshape(n, self.q_size))

    def qk_norm(self, qk: torch.Tensor) -> torch.Tensor:
        """Qwen3's per-head q and k norms on the joint [N, Hq + Hkv, D] view: one
        normalization, then each head row scaled by its own norm's weight (the same
        products as norming q and k apart)."""
        if qk.dtype != torch.float32:
            q, k = qk[:, :self.num_heads], qk[:, self.num_heads:]
            return torch.cat((self.q_norm(q), self.k_norm(k)), dim=1)
        qw, kw = self.q_norm.weight, self.k_norm.weight
        key = (qw.data_ptr(), qw._version, kw.data_ptr(), kw._version)
        if self._qk_weight_of != key:
            self._qk_weight = torch.cat((qw.expand(self.num_heads, -1), kw.expand(self.num_kv_heads, -1)))
            self._qk_weight_of = key
        return F.rms_norm(qk, (self.head_dim,), None, self.q_norm.eps) * self._qk_weight


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block, in the residual-stream form: it takes the previous
    layer's output `h` and the residual stream so far, and returns both; each norm adds
    its input to the stream and normalizes the sum in one step (the same additions, in
    the same order, as x = x + attn(norm(x)); x = x + mlp(norm(x)))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = SelfAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        mark_shards(self.mlp.gate_up_proj, (cfg.intermediate_size, cfg.intermediate_size))

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """residual None (the first layer): h is the embeddings, the stream starts there.
        `keep`: only these rows' outputs are wanted (the last layer, whose other rows no
        one reads): attention still runs on every row, which stores every row's K/V, and
        the MLP only on `keep`."""
        x, residual = self.input_layernorm(h, residual) if residual is not None else (self.input_layernorm(h), h)
        h = self.self_attn(x, rope, kv_cache, meta)
        if keep is not None:
            h, residual = h.index_select(0, keep), residual.index_select(0, keep)
            if not len(keep):
                return h, residual
        x, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        # The weight comes from the checkpoint (build_model): given here, nn.Embedding skips
        # its random init, whose normal_ under the meta device imports torch._dynamo (see
        # build_model).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rope = rope


def rotary_embedding(cfg: ModelConfig, max_positions: int) -> RotaryEmbedding:
    """The model's cos/sin tables for positions [0, max_positions), float32."""
    inv_freq, scaling = rope_frequencies(cfg.head_dim, cfg.max_position_embeddings,
                                         cfg.rope or RopeConfig(theta=cfg.rope_theta))
    return RotaryEmbedding(inv_freq, max_positions, scaling)


class DecoderForCausalLM(nn.Module):
    """The whole model. `kv_caches[i]` is layer i's (k_cache, v_cache) pair, each
    [num_blocks, block_size, Hkv, D]; the runner binds them before the first forward."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg, rope)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._stack: DecodeStack | None = None
        self._stack_of: tuple[object, tuple[list, ...]] | None = None  # (caches, _stack_fingerprint())
        self._stack_linears: list[tuple[Linear, ...]] | None = None  # each layer's four, for decode_stack
        # [a module's _parameters or _buffers, ...], [name, ...]: what the stack reads (_stack_watch)
        self._stack_params: list[list] = []
        self._stack_flat: list[Linear] = []  # every linear the stack multiplies by, the lm_head last
        self._stack_versioned = 0  # how many of `_stack_params`, the first, are the float linears'

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                layer_hook: Callable[[int], None] | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [N] -> hidden states [N, hidden] (final norm applied), or
        only rows `keep` of them [len(keep), hidden]: then the last layer's MLP runs on those
        rows alone (a prompt's hidden states are read only at its last token; llama.cpp does
        the same), which spares 1/num_layers of a long prefill's MLP work.
        `layer_hook(i)` runs once layer i's K/V are in the cache (layer-wise KV push).
        A pure decode batch on CPU runs every layer in one native call
        (`kernels.cpu_decode`) where that applies and the batch is below the crossover of
        its linears (`DecodeStack.takes_rows`); the layers below otherwise."""
        if layer_hook is None and meta.num_decode == input_ids.shape[0] and DecodeStack.takes(input_ids):
            stack = self.decode_stack()
            if stack is not None and stack.takes_rows(input_ids.shape[0]):
                out = stack(input_ids, positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens)
                return out if keep is None else out.index_select(0, keep)
        x = self.model.embed_tokens(input_ids).to(self.activation_dtype)  # bf16 table, float32 stream (precision)
        rope = self.model.rope.tables(positions, x.dtype)  # once per step, for every layer
        residual = None
        last = len(self.model.layers) - 1
        for i, (layer, kv) in enumerate(zip(self.model.layers, self.kv_caches)):
            x, residual = layer(x, residual, rope, kv, meta, keep if i == last else None)
            if layer_hook is not None:
                layer_hook(i)
        if not len(x):
            return x
        return self.model.norm(x, residual)[0]

    def decode_logits(self, rows: DecodeInputs) -> tuple[torch.Tensor, list[int]] | None:
        """A pure decode batch from its token ids to (logits [N, V] float32, each row's
        argmax) in the native stack's one call, lm_head included (`DecodeStack.logits`:
        the logits are its buffer, valid until the next decode step); None where that does
        not apply, or the batch reaches the crossover of a linear (`DecodeStack.takes_rows`):
        the caller runs `forward` and `compute_logits` then."""
        if not cpu_native.enabled():
            return None
        stack = self.decode_stack()
        if stack is None or not stack.has_head or not stack.takes_rows(len(rows.ids), head=True):
            return None
        return stack.logits(rows)

    @property
    def activation_dtype(self) -> torch.dtype:
        """What the layers compute in: the norms' dtype (float32 under bf16 weights on the
        CPU: `common.models.precision`)."""
        return self.model.norm.weight.dtype

    def decode_stack(self) -> DecodeStack | None:
        """The native decode stack for the current weights and caches (None where it does
        not apply). It reads the linears' packed copies and the norms where they lie; it
        is set up again when the caches are rebound, a parameter it reads is replaced, its
        storage swapped or written in place, or a linear planned again (`Linear.plan`)."""
        if self._stack_linears is None:  # module lookups cost ~1 us each: once, not per step
            self._stack_linears = [(layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                                    layer.mlp.down_proj) for layer in self.model.layers]
            self._stack_flat = [lin for four in self._stack_linears for lin in four] + [self.lm_head]
        if self._stack_of is not None and self._stack_of == (self.kv_caches, self._stack_fingerprint()):
            return self._stack
        self._stack_watch()
        plans = [[lin.plan() for lin in four] for four in self._stack_linears]
        head = self.lm_head.plan()
        layers = []
        for layer, (k_cache, v_cache), four in zip(self.model.layers, self.kv_caches, plans):
            attn = layer.self_attn
            qkv_p, o_p, gate_up_p, down_p = (plan.packed for plan in four)
            layers.append(LayerTensors(
                input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
                qkv_p=qkv_p, qkv_b=attn.qkv_proj.bias,
                q_norm=None if attn.q_norm is None else attn.q_norm.weight,
                k_norm=None if attn.k_norm is None else attn.k_norm.weight,
                o_p=o_p, gate_up_p=gate_up_p, down_p=down_p, k_cache=k_cache, v_cache=v_cache,
                kinds=tuple(plan.kind for plan in four)))
        cfg = self.config
        dims = StackDims(hidden=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, norm_eps=cfg.rms_norm_eps,
                         qk_eps=cfg.rms_norm_eps, scale=cfg.head_dim ** -0.5)  # as DecoderLayer's
        rope = self.model.rope
        around = ModelTensors(self.model.embed_tokens.weight, rope.cos, rope.sin_signed, self.model.norm.weight,
                              head.packed, head.bias, self.lm_head.out_features, head.kind)
        layer_rows = min((plan.bf16_rows for four in plans for plan in four), default=kernels.crossover.NEVER)
        self._stack = (DecodeStack.build(layers, dims, around, layer_rows, head.bf16_rows)
                       if len(layers) == len(self.model.layers) else None)
        self._stack_of = (self.kv_caches, self._stack_fingerprint())
        return self._stack

    def _stack_watch(self) -> None:
        """What `_stack_fingerprint` reads, for the linears as they are now: every float
        linear's parameters (storage and version: its plan is a packed copy); a quantized
        linear's bias alone (its plan holds `quant`'s blocks, whatever its placeholder
        weight); the norms', embedding's and rotary tables' storage. A change of any
        linear's `quant` is `Linear.quant_epoch`, read every step."""
        floats = [lin for lin in self._stack_flat if lin.quant is None]
        read = [m for layer in self.model.layers
                for m in (layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm,
                          layer.self_attn.k_norm) if m is not None] + [self.model.embed_tokens, self.model.norm]
        versioned = [(m._parameters, name) for m in floats for name, p in m._parameters.items() if p is not None]
        quantized = [m for m in self._stack_flat if m.quant is not None]
        rest = [(m._parameters, name) for m in quantized for name, p in m._parameters.items()
                if p is not None and name != "weight"]
        rest += [(m._parameters, name) for m in read for name, p in m._parameters.items() if p is not None]
        rest += [(self.model.rope._buffers, name) for name in ("cos", "sin_signed")]
        self._stack_params = [list(col) for col in zip(*versioned, *rest)]  # [dicts], [names]
        self._stack_versioned = len(versioned)

    def _stack_fingerprint(self) -> tuple[list, list, int]:
        """What the stack was set up from (`_stack_watch` says which tensors), cheap enough
        to check every decode step: flat lists, each filled by a C-level `map`, no module
        attribute lookups or bytecode per item. Storage of each watched tensor, versions of
        the float linears' parameters, and `Linear.quant_epoch`. A linear's plan is made
        from exactly these (`Linear._key`), so a plan made again elsewhere shows here as
        what it was made for. Each object read costs: between two decode steps the
        weights streamed through have evicted it (on the 2-core VM the whole fingerprint
        took ~5x as long as warm), so it reads no module: with SmolLM2's 121 linears, one
        `quant` read per linear made the int4 fingerprint 2.6x as long."""
        params = list(map(dict.__getitem__, *self._stack_params))
        return (list(map(_DATA_PTR, params)), list(map(_VERSION, params[:self._stack_versioned])),
                Linear.quant_epoch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # [B, V]



def build_model(cfg: ModelConfig, max_positions: int, device: torch.device, dtype: torch.dtype) -> DecoderForCausalLM:
    """The model with every parameter allocated on `device` in `dtype` but not initialised,
    for `load_weights` to fill (it refuses a checkpoint that leaves one out): an 8B model
    is not first drawn at random, in float32, on the CPU. The modules are made on the meta
    device, then each parameter is given storage (a tied lm_head keeps sharing the
    embedding's); the rotary tables, which are computed rather than loaded, are computed
    first, on the CPU (the cast to the model's device moves them). Nothing runs an op under
    the meta device (the embedding is given its weight, the tables are made before): there
    ops go through torch's reference implementations, which import torch._dynamo, and that
    import took every worker ~3 s of start-up on the AVX2 EPYC (a P/D `serve` of the tiny
    model: ready in ~6.2 s, ~11.3 s before)."""
    rope = rotary_embedding(cfg, max_positions)
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg, rope)
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is None:
                continue
            if id(p) not in made:
                new = nn.Parameter(torch.empty(p.shape, dtype=dtype, device=device), requires_grad=p.requires_grad)
                new.__dict__.update(p.__dict__)  # shard_sizes (mark_shards), which load_weights reads
                made[id(p)] = new
            module._parameters[name] = made[id(p)]
    return model
