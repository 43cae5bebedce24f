"""GPU timings of dflash2's two Triton kernels against their PyTorch references.

    python benchmarks/decode_kernels.py [--out benchmarks/results/decode_kernels.json]

Every time is a median after warm-up: `*_ms` from triton.testing.do_bench (Python launch overhead included) and
`*_graph_ms` from do_bench_cudagraph (device time, as under CUDA graphs). Each shape is checked (kernel ==
reference) before it is timed and again after. The convolution is also compared with the memory floor: the bytes
it must move (hidden, coefficients, base, output) over the bandwidth of a device-to-device copy on the same GPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from dflash2.model import kernels

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from timing import graph_ms, median_ms, print_table  # noqa: E402

BATCHES = [2**i for i in range(9)]  # 1 .. 256 requests


def copy_bandwidth_gbs(device: torch.device, gib: int = 1) -> float:
    """Bytes read plus written per second by a large clone-like copy: what a memory-bound kernel can hope for."""
    src = torch.empty(gib * 2**30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.numel() / ms / 1e6


def walk_rows(device: torch.device, k: int, block_size: int) -> list[dict]:
    rows = []
    n_slots = block_size - 1
    for batch in BATCHES:
        candidate_ids = torch.randint(0, 150_000, (batch, n_slots, k), device=device)
        scores = 4 * torch.randn(batch, n_slots, k, k, device=device)
        uniforms = torch.rand(batch, n_slots, device=device)
        temperatures = 0.5 + torch.rand(batch, device=device)
        greedy_mask = torch.arange(batch, device=device) % 2 == 0  # greedy and sampled rows share the launch
        inputs = (candidate_ids, scores, uniforms, temperatures, greedy_mask)
        with kernels.backend("triton"):
            tokens, q = kernels.selector_walk(*inputs)
        ref_tokens, ref_q = kernels.selector_walk_reference(*inputs)
        torch.testing.assert_close(q, ref_q)
        assert torch.equal(tokens, ref_tokens), f"walk tokens differ from the reference at batch {batch}"
        with kernels.backend("triton"):
            run = lambda: kernels.selector_walk(*inputs)  # noqa: B023 (timed in this iteration)
            row = {"batch": batch, "K": k, "block_size": block_size}
            row.update(triton_ms=median_ms(run), triton_graph_ms=graph_ms(run))
            assert torch.equal(run()[0], ref_tokens), f"walk tokens changed after timing at batch {batch}"
        reference = lambda: kernels.selector_walk_reference(*inputs)  # noqa: B023
        row.update(torch_ms=median_ms(reference), torch_graph_ms=graph_ms(reference))
        rows.append(row)
    return rows


def conv_rows(
    device: torch.device, hidden_size: int, group_size: int, taps: int, block_size: int, copy_gbs: float
) -> list[dict]:
    rows = []
    groups = hidden_size // group_size
    reference = kernels.grouped_conv_reference
    for batch in BATCHES:
        n = batch * block_size
        hidden = torch.randn(n, hidden_size, device=device, dtype=torch.bfloat16)
        delta = 0.1 * torch.randn(n, taps, groups, device=device, dtype=torch.bfloat16)
        base = torch.randn(taps, hidden_size, device=device)
        args = (hidden, delta, base, block_size)
        with kernels.backend("triton"):
            out = kernels.grouped_conv(*args)
        torch.testing.assert_close(out, reference(*args), rtol=1.6e-2, atol=1e-2)
        torch._dynamo.reset()  # one compiled graph per shape, never the recompile-limit fallback to eager
        compiled = torch.compile(reference, dynamic=False)
        torch.testing.assert_close(compiled(*args), reference(*args), rtol=1.6e-2, atol=1e-2)
        moved = sum(x.numel() * x.element_size() for x in (hidden, delta, base, out))
        row = {"batch": batch, "tokens": n, "hidden": hidden_size, "groups": groups, "taps": taps, "bytes": moved}
        with kernels.backend("triton"):
            run = lambda: kernels.grouped_conv(*args)  # noqa: B023 (timed in this iteration)
            row.update(triton_ms=median_ms(run), triton_graph_ms=graph_ms(run))
            torch.testing.assert_close(run(), out, rtol=0, atol=0)  # timing must not have disturbed anything
        for name, fn in (("torch_eager", lambda: reference(*args)), ("torch_compile", lambda: compiled(*args))):  # noqa: B023
            row.update({f"{name}_ms": median_ms(fn), f"{name}_graph_ms": graph_ms(fn)})
        row["floor_ms"] = moved / copy_gbs / 1e6
        row["triton_graph_gbs"] = moved / row["triton_graph_ms"] / 1e6
        row["triton_graph_fraction_of_floor"] = row["floor_ms"] / row["triton_graph_ms"]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/decode_kernels.json", help="where the JSON results go")
    parser.add_argument("--hidden-size", type=int, default=4096, help="conv hidden size (Qwen3-8B: 4096)")
    parser.add_argument("--group-size", type=int, default=16, help="conv channels per dynamic coefficient")
    parser.add_argument("--taps", type=int, default=2, help="conv taps T")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block B")
    parser.add_argument("--top-k", type=int, default=16, help="selector candidates per slot K")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/decode_kernels.py times GPU kernels; no CUDA device is visible")
    import triton

    device = torch.device("cuda")
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth_gbs(device)
    walk = walk_rows(device, args.top_k, args.block_size)
    conv = conv_rows(device, args.hidden_size, args.group_size, args.taps, args.block_size, copy_gbs)
    result = {
        "device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
        "copy_bandwidth_gbs": copy_gbs, "selector_walk": walk, "grouped_conv": conv,
    }  # fmt: skip
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"{result['device']}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"device copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    print_table(walk, ["batch", "triton_ms", "triton_graph_ms", "torch_ms", "torch_graph_ms"], "selector_walk (ms)")
    print_table(
        conv,
        [
            "tokens",
            "triton_ms",
            "triton_graph_ms",
            "torch_eager_graph_ms",
            "torch_compile_graph_ms",
            "floor_ms",
            "triton_graph_gbs",
        ],  # fmt: skip
        f"grouped_conv bf16, H={args.hidden_size}, G={args.hidden_size // args.group_size}, T={args.taps} (ms)",
    )
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
