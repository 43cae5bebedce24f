"""The block-local grouped dynamic depthwise convolution of contract section 4: a Triton kernel and its reference.

With tokens flattened as [N, H], G groups of H / G channels (delta [N, T, G]) and p = n mod block_size:
    out[n, c] = sum over t < T with p - t >= 0 of (base[t, c] + delta[n, t, c // (H / G)]) * hidden[n - t, c]
"""

from __future__ import annotations

import torch

from dflash2.model.kernels._backend import triton, use_triton

if triton is not None:
    import triton.language as tl

    @triton.jit
    def _grouped_conv_kernel(  # noqa: PLR0913 - a Triton kernel takes each tensor, size and tile as its own argument
        hidden_ptr,
        delta_ptr,
        base_ptr,
        out_ptr,
        n_tokens,
        hidden_size,
        groups,
        block_size,
        TAPS: tl.constexpr,
        GROUP_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_J: tl.constexpr,
    ):
        # A program owns BLOCK_N tokens x BLOCK_G groups and walks each group's channels BLOCK_J at a time. Keeping
        # the group as its own tile axis loads each dynamic coefficient once and broadcasts it over the channels
        # (a per-channel gather of `delta` ran several times slower on an H200).
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        group = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
        j = tl.arange(0, BLOCK_J)
        row_ok = rows < n_tokens
        group_ok = group < groups
        position = rows % block_size
        rows64 = rows.to(tl.int64)  # training flattens more than 2**31 / H tokens
        for j0 in tl.static_range(0, GROUP_SIZE, BLOCK_J):
            channel = group[:, None] * GROUP_SIZE + (j0 + j)[None, :]
            channel_ok = group_ok[:, None] & (j0 + j < GROUP_SIZE)[None, :]
            acc = tl.zeros((BLOCK_N, BLOCK_G, BLOCK_J), dtype=tl.float32)
            for t in tl.static_range(TAPS):
                inside = row_ok & (position >= t)  # a tap never reaches into the previous block
                x_ptrs = hidden_ptr + (rows64 - t)[:, None, None] * hidden_size + channel[None, :, :]
                x = tl.load(x_ptrs, mask=inside[:, None, None] & channel_ok[None, :, :], other=0.0)
                d_ptrs = delta_ptr + (rows64 * TAPS + t)[:, None] * groups + group[None, :]
                d = tl.load(d_ptrs, mask=inside[:, None] & group_ok[None, :], other=0.0)
                b = tl.load(base_ptr + t * hidden_size + channel, mask=channel_ok, other=0.0)
                acc += (b.to(tl.float32)[None, :, :] + d.to(tl.float32)[:, :, None]) * x.to(tl.float32)
            out_ptrs = out_ptr + rows64[:, None, None] * hidden_size + channel[None, :, :]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None, None] & channel_ok[None, :, :])
else:
    _grouped_conv_kernel = None


def _grouped_conv_triton(
    hidden: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int
) -> torch.Tensor:
    hidden, delta, base = hidden.contiguous(), delta.contiguous(), base.contiguous()
    n_tokens, hidden_size = hidden.shape
    taps, groups = delta.shape[1], delta.shape[2]
    group_size = hidden_size // groups
    out = torch.empty_like(hidden)
    # 8 tokens x 128 channels with 4 warps was the fastest tile for H=4096, group 16 on an H200 (benchmarks/).
    block_n, block_j = 8, min(128, triton.next_power_of_2(group_size))
    block_g = min(max(1, 128 // block_j), triton.next_power_of_2(groups))
    grid = (triton.cdiv(n_tokens, block_n), triton.cdiv(groups, block_g))
    _grouped_conv_kernel[grid](
        hidden, delta, base, out, n_tokens, hidden_size, groups, block_size,
        TAPS=taps, GROUP_SIZE=group_size, BLOCK_N=block_n, BLOCK_G=block_g, BLOCK_J=block_j, num_warps=4,
    )  # fmt: skip
    return out


def _shifted(hidden: torch.Tensor, taps: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, T, H] with row n, tap t = hidden[n - t], zero where that leaves the block; the [N, T] validity)."""
    n = torch.arange(hidden.shape[0], device=hidden.device)
    t = torch.arange(taps, device=hidden.device)
    valid = (n % block_size)[:, None] >= t
    source = (n[:, None] - t).clamp(min=0)
    return torch.where(valid[..., None], hidden[source], 0.0), valid


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for fp64 inputs (gradcheck)


def _weights(delta: torch.Tensor, base: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, T, H] per-token taps: the static base plus the token's coefficient for the channel's group."""
    return base.to(dtype) + delta.to(dtype).repeat_interleave(base.shape[1] // delta.shape[2], dim=-1)


def grouped_conv_reference(
    hidden: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Plain PyTorch, vectorised over taps and autograd-capable; fp32 accumulation, output in hidden's dtype."""
    acc = _accumulator(hidden.dtype)
    x, _ = _shifted(hidden.to(acc), base.shape[0], block_size)
    return (_weights(delta, base, acc) * x).sum(1).to(hidden.dtype)


def _grouped_conv_backward(
    grad_out: torch.Tensor,
    hidden: torch.Tensor,
    delta: torch.Tensor,
    base: torch.Tensor,
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n_tokens, taps = hidden.shape[0], base.shape[0]
    acc = _accumulator(hidden.dtype)
    g = grad_out.to(acc)
    x, valid = _shifted(hidden.to(acc), taps, block_size)
    # d out[n, c] / d w[n, t, c] = hidden[n - t, c]: the weight grad, summed per group (delta) or over tokens (base).
    grad_w = g[:, None, :] * x
    grad_base = grad_w.sum(0)
    grad_delta = grad_w.unflatten(-1, (delta.shape[2], -1)).sum(-1)
    # hidden[m] feeds out[m + t] through w[m + t, t]: send each valid (n, t) contribution back to row n - t.
    to_source = torch.where(valid[..., None], _weights(delta, base, acc) * g[:, None, :], 0.0)
    grad_hidden = torch.zeros_like(g)
    for t in range(taps):
        grad_hidden[: n_tokens - t] += to_source[t:, t]
    return grad_hidden.to(hidden.dtype), grad_delta.to(delta.dtype), grad_base.to(base.dtype)


class _GroupedConv(torch.autograd.Function):
    """Forward by the chosen backend, backward in vectorised PyTorch from the saved inputs.

    The backward is a few elementwise passes over [N, T, H] that PyTorch already runs at memory speed, so it stays
    exact and readable; saving only the inputs also keeps training memory at that of one [N, H] activation.
    """

    @staticmethod
    def forward(ctx, hidden, delta, base, block_size, triton_forward):
        ctx.save_for_backward(hidden, delta, base)
        ctx.block_size = block_size
        run = _grouped_conv_triton if triton_forward else grouped_conv_reference
        return run(hidden, delta, base, block_size)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        grads = _grouped_conv_backward(grad_out, *ctx.saved_tensors, ctx.block_size)
        return *(g if ctx.needs_input_grad[i] else None for i, g in enumerate(grads)), None, None


def _check(hidden: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> None:
    """The tensors' shapes fit each other (which values are valid drafter fields is dflash2.model.contract's to say)."""
    if hidden.dim() != 2:
        raise ValueError(f"hidden must be [tokens, hidden], got shape {tuple(hidden.shape)}")
    n_tokens, hidden_size = hidden.shape
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if base.dim() != 2 or base.shape[0] < 1 or base.shape[1] != hidden_size:
        raise ValueError(f"base must be [taps >= 1, {hidden_size}], got shape {tuple(base.shape)}")
    groups = delta.shape[-1] if delta.dim() == 3 else 0
    if tuple(delta.shape) != (n_tokens, base.shape[0], groups) or not groups or hidden_size % groups:
        raise ValueError(
            f"delta must be [tokens, taps, groups] = [{n_tokens}, {base.shape[0]}, a divisor of {hidden_size}], got "
            f"shape {tuple(delta.shape)}"
        )
    if not hidden.device == delta.device == base.device:
        raise ValueError(f"hidden, delta and base are on {hidden.device}, {delta.device}, {base.device}")


def grouped_conv(hidden: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """hidden [N, H], delta [N, T, G], base [T, H] -> [N, H] in hidden's dtype (contract section 4): G groups of
    H / G channels share each token's dynamic coefficient."""
    _check(hidden, delta, base, block_size)
    if torch.compiler.is_compiling():
        # Under torch.compile inductor generates fused kernels for the reference, forward and backward alike.
        return grouped_conv_reference(hidden, delta, base, block_size)
    triton_forward = use_triton(hidden, _grouped_conv_kernel)
    return _GroupedConv.apply(hidden, delta, base, block_size, triton_forward)
