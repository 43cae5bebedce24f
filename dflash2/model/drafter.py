"""The DFlash2 drafter, tensor for tensor what serving engines load (contract sections 3 and 4).

A block `[anchor, MASK, ...]` is embedded with the target's own embedding and attends, in every layer, to
itself (bidirectionally) and to the fused target features of the context (KV injection). The drafter owns
no embedding and no head.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from huggingface_hub import save_torch_state_dict
from safetensors.torch import load_file
from torch import nn

from dflash2.model.config import DFlash2Config, tensor_shapes
from dflash2.model.contract import SHARED_TENSORS, contract_name
from dflash2.model.conv import DFlashGroupedConv
from dflash2.model.selector import CandidateSelector

try:  # flex attention carries the block-sparse training mask on GPUs; a dense mask does the same elsewhere
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover - torch < 2.5
    BlockMask, flex_attention = None, None


@functools.cache
def compiled_flex_attention() -> Any:
    """Flex attention as it is meant to run: eager, it materialises the whole score matrix (gigabytes at training
    lengths); compiled, it is one block-sparse kernel. Dynamic shapes, because batches vary in length."""
    return torch.compile(flex_attention, dynamic=True)


# Flex attention's own forward tiles ran the training mask at 42 TFLOP/s on an H200 with SmolLM2's heads of 64; these
# ran it at 217, their backward as fast as before (BENCHMARKS.md, "Flex attention's forward tiles"). Measured for
# heads of 64 only: other head sizes keep flex attention's choice.
FLEX_KERNEL_OPTIONS = {64: {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3}}


Mask = Any  # bool tensor [b|1, 1, q, keys] (True = attend), a flex BlockMask, a {layer_type: mask} dict, or None


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: statistics in fp32, the weight applied in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Rotary(nn.Module):
    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__()
        rope_type = (cfg.rope_parameters or {}).get("rope_type", "default")
        if rope_type != "default":
            raise NotImplementedError(f"rope_parameters.rope_type={rope_type!r}: only the default RoPE is supported")
        d = cfg.head_dim
        inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [b, n] -> cos, sin [b, 1, n, head_dim] in fp32."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class DraftCache:
    """Context keys/values per layer, appended after every verify; stale slots are masked, never removed."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys[layer] is not None:
            k = torch.cat([self.keys[layer], k], dim=2)
            v = torch.cat([self.values[layer], v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]


def take_slots_(buffer: torch.Tensor, index: torch.Tensor, dim: int) -> None:
    """In place: slot j of each row (along `dim`) becomes its slot index[row, j], for j < index.shape[1]; the slots
    after those are left as they were. buffer [b, ..., slots (at dim), ...], index [b, n] (any slot of the row)."""
    shape = [1] * buffer.dim()
    shape[0], shape[dim] = index.shape
    sizes = list(buffer.shape)
    sizes[dim] = index.shape[1]
    gathered = buffer.gather(dim, index.view(shape).expand(sizes))  # a copy: the writes below cannot clobber a read
    buffer.narrow(dim, 0, index.shape[1]).copy_(gathered)


class StaticDraftCache(DraftCache):
    """The drafter's context cache (`DraftCache`) in buffers of `capacity` slots per row and layer (`keys[layer]`,
    `values[layer]`), allocated at the first update and written in place at a pointer: `reserve(c)` claims the next c
    slots for the forward that follows, whose every layer writes its context keys/values there. A step attends over
    the whole capacity, the slots past the pointer masked, as the target's static cache does: shapes and addresses
    stay fixed from step to step, which a compiled step (and a CUDA graph) needs, and no step copies the cache
    (DraftCache concatenates it). `reset()` empties it for the next batch and keeps its buffers, so that their
    addresses stay fixed from batch to batch too.

    The pointer lives on the device (`pointer`, where the next forward writes) and on the host (`slots`, the slots
    held): a step captured whole (dflash2/decoding/graphed.py) moves the device's itself, its graph then the same
    whatever the pointer's value, and its host keeps `slots` in step."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        super().__init__(num_layers)
        self.capacity, self.slots = capacity, 0
        self.pointer: torch.Tensor | None = None  # [1] long, on the buffers' device

    @property
    def length(self) -> int:
        return self.slots

    def allocated(self, rows: int) -> bool:
        """Whether the buffers are there for `rows` rows: a forward then only writes into them."""
        return all(k is not None and k.shape[0] == rows for k in self.keys)

    def reset(self) -> None:
        """Empty: the pointer back to slot 0, the buffers kept (what they hold is masked until written again)."""
        self.slots = 0

    def reserve(self, count: int, device: torch.device) -> None:
        """The next forward writes slots [length, length + count) of every row; the pointer moves past them."""
        if self.slots + count > self.capacity:
            needed = self.slots + count
            raise RuntimeError(f"the drafter's static cache holds {self.capacity} slots; {needed} were asked for")
        self.device_pointer(device).fill_(self.slots)
        self.slots += count

    def device_pointer(self, device: torch.device) -> torch.Tensor:
        """`pointer`, made on `device` the first time (at a fixed address, which a compiled step reads in place)."""
        if self.pointer is None or self.pointer.device != torch.device(device):
            self.pointer = torch.zeros(1, dtype=torch.long, device=device)
            torch._dynamo.mark_static_address(self.pointer)
        return self.pointer

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        held, shape = self.keys[layer], (*k.shape[:2], self.capacity, k.shape[3])
        if held is None or held.shape != shape or held.dtype != k.dtype or held.device != k.device:
            self.keys[layer], self.values[layer] = k.new_zeros(shape), v.new_zeros(shape)
            for buffer in (self.keys[layer], self.values[layer]):  # a compiled step mutates them in place, which
                torch._dynamo.mark_static_address(buffer)  # CUDA graphs allow at fixed addresses only
        index = self.pointer + torch.arange(k.shape[2], device=k.device)
        self.keys[layer].index_copy_(2, index, k)
        self.values[layer].index_copy_(2, index, v)
        return self.keys[layer], self.values[layer]

    def keep(self, index: torch.Tensor) -> None:
        """Make each row's slots `index[row]` ([b, n], in that order) its first n, and n the slots it holds."""
        for buffer in self.keys + self.values:
            if buffer is not None:
                take_slots_(buffer, index, 2)
        self.slots = index.shape[1]


class Attention(nn.Module):
    def __init__(self, cfg: DFlash2Config, layer: int) -> None:
        super().__init__()
        self.layer, self.heads, self.kv_heads, self.head_dim = (
            layer,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def _kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def context_kv(
        self, ctx: torch.Tensor | None, rope_c: tuple | None, cache: DraftCache | None, empty: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The context's keys/values for this layer (`empty` [b, kv_heads, 0, head_dim] when there is none), with what
        `cache` holds before them. Context is projected by this layer's k/v (with k_norm) but never normed or convolved
        itself, so it can enter the cache without a block (`DFlash2DraftModel.ingest`)."""
        kc, vc = (empty, empty) if ctx is None else self._kv(ctx, *rope_c)
        if cache is not None:
            kc, vc = cache.update(self.layer, kc, vc)
        return kc, vc

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor | None,
        rope_q: tuple,
        rope_c: tuple | None,
        mask: Mask,
        cache: DraftCache | None,
    ) -> torch.Tensor:
        b, q, _ = x.shape
        qh = self.q_norm(self.q_proj(x).view(b, q, self.heads, self.head_dim)).transpose(1, 2)
        qh = apply_rope(qh, *rope_q)
        kb, vb = self._kv(x, *rope_q)
        kc, vc = self.context_kv(ctx, rope_c, cache, empty=kb[:, :, :0])
        k, v = torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2)
        if BlockMask is not None and isinstance(mask, BlockMask):
            # Inside a compiled drafter flex attention is traced into its graph; a nested torch.compile would break it.
            eager = not qh.is_cuda or torch.compiler.is_compiling()
            attend = flex_attention if eager else compiled_flex_attention()
            options = FLEX_KERNEL_OPTIONS.get(self.head_dim) if qh.is_cuda else None
            out = attend(qh, k, v, block_mask=mask, enable_gqa=self.heads != self.kv_heads, kernel_options=options)
        else:
            out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(b, q, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DFlash2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DFlash2Config, layer: int) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[layer]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.attention_conv = self.mlp_conv = None
        if cfg.use_conv:
            args = (cfg.hidden_size, cfg.conv_kernel_size, cfg.conv_group_size)
            self.attention_conv, self.mlp_conv = DFlashGroupedConv(*args), DFlashGroupedConv(*args)

    def forward(
        self,
        h: torch.Tensor,
        ctx: torch.Tensor | None,
        rope_q: tuple,
        rope_c: tuple | None,
        mask: Mask,
        cache: DraftCache | None,
        block_size: int,
    ) -> torch.Tensor:
        if isinstance(mask, dict):
            mask = mask[self.layer_type]
        x = self.input_layernorm(h)
        if self.attention_conv is None:
            h = h + self.self_attn(x, ctx, rope_q, rope_c, mask, cache)
            return h + self.mlp(self.post_attention_layernorm(h))
        x, k_a = self.attention_conv.prepare(x, block_size)
        h = h + self.attention_conv.finish(self.self_attn(x, ctx, rope_q, rope_c, mask, cache), k_a, block_size)
        x, k_m = self.mlp_conv.prepare(self.post_attention_layernorm(h), block_size)
        return h + self.mlp_conv.finish(self.mlp(x), k_m, block_size)


class DFlash2DraftModel(nn.Module):
    def __init__(self, config: DFlash2Config) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = Rotary(config)
        self.candidate_selector = None
        if config.use_selector:
            self.candidate_selector = CandidateSelector(
                h,
                config.vocab_size,
                config.selector_rank,
                config.selector_top_k,
                config.output_multiplier,
                config.final_logit_softcapping,
            )

    def fuse(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Concatenated target features [b, c, n*H] -> one context vector per token [b, c, H]."""
        return self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        context: torch.Tensor | None = None,
        context_positions: torch.Tensor | None = None,
        attention_mask: Mask = None,
        cache: DraftCache | None = None,
        block_size: int | None = None,
    ) -> torch.Tensor:
        """Blocks [b, n*B, H] at absolute positions -> norm(h) [b, n*B, H]; rows 1..B-1 of a block propose.
        `block_size` is B for this call (engines pick it at run time); None = the one the drafter was trained with.
        Only the convolution's block-local taps depend on it."""
        block_size = self.config.block_size if block_size is None else block_size
        h = block_embeds.to(self.fc.weight.dtype)
        rope_q = self.rotary(block_positions)
        rope_c = self.rotary(context_positions) if context is not None else None
        for layer in self.layers:
            h = layer(h, context, rope_q, rope_c, attention_mask, cache, block_size)
        return self.norm(h)

    def ingest(self, context: torch.Tensor, context_positions: torch.Tensor, cache: DraftCache) -> None:
        """Fused context [b, c, H] at its positions into every layer's `cache`, with no block: what `forward` writes
        there before the block attends, for a step whose block some other proposer drafted."""
        rope_c = self.rotary(context_positions)
        empty = context.new_zeros(0)
        for layer in self.layers:
            layer.self_attn.context_kv(context, rope_c, cache, empty)

    # ------------------------------------------------------------------ checkpoints in the contract layout
    def save_pretrained(self, path: str | Path, max_shard_size: int | str = "5GB") -> None:
        """config.json + bf16 safetensors (shards and an index above max_shard_size); no embedding, no head."""
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.state_dict().items()}
        check_tensors(self.config, {k: tuple(v.shape) for k, v in state.items()}, path)
        self.config.save_pretrained(path)
        save_torch_state_dict(state, path, max_shard_size=max_shard_size, metadata={"format": "pt"})

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        **overrides: Any,
    ) -> DFlash2DraftModel:
        """Load a DFlash or DFlash2 folder. `overrides` change config fields, e.g. turning the conv and the
        selector on to warm-start DFlash2 from a plain DFlash checkpoint (the new parts start inert)."""
        saved = DFlash2Config.from_pretrained(path)
        tensors = read_safetensors(path)
        check_tensors(saved, {k: tuple(v.shape) for k, v in tensors.items()}, path)
        model = cls(saved.replace(**overrides) if overrides else saved)
        missing, unexpected = model.load_state_dict(tensors, strict=False)
        if unexpected:
            raise ValueError(f"{path}: tensors {unexpected} do not fit the requested config")
        # What may stay at its inert init: only parts that the saved config itself declares off.
        allowed = set(tensor_shapes(model.config)) - set(tensor_shapes(saved))
        if set(missing) - allowed:
            raise ValueError(f"{path}: missing tensors {sorted(set(missing) - allowed)}")
        return model.to(device=device, dtype=dtype)


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path} holds neither model.safetensors nor model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(path / name))
    return tensors


def check_tensors(cfg: DFlash2Config, found: dict[str, tuple[int, ...]], where: Any = "checkpoint") -> None:
    """Refuse, by name, any tensor an engine would silently ignore or any it would miss (contract section 3)."""
    expected = tensor_shapes(cfg)
    problems = []
    for name in sorted(set(found) - set(expected)):
        hint = ""
        if name.startswith(SHARED_TENSORS):
            hint = " (the drafter shares the target's embedding and head: drop it)"
        elif contract_name(name) != name:
            hint = f" (no 'model.' prefix, no .weight suffix on codebooks: rename to {contract_name(name)})"
        problems.append(f"unexpected tensor {name}{hint}")
    problems += [f"missing tensor {name} {list(expected[name])}" for name in sorted(set(expected) - set(found))]
    problems += [
        f"tensor {name} has shape {list(found[name])}, expected {list(shape)}"
        for name, shape in sorted(expected.items())
        if name in found and tuple(found[name]) != shape
    ]
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
