"""The draft layers' training attention alone: flex attention over the training mask, under flex attention's kernel
options, at the shape of a training step.

    python benchmarks/draft_attention.py [--rows 16] [--out benchmarks/results/draft_attention.json]
    python benchmarks/draft_attention.py --small --out /tmp/draft_attention.json   # tiny, eager, forward only: a CPU

The shape is train_throughput.py's synthetic batch: --rows rows of --length tokens whose first eighth is an untrained
prompt, --anchors sorted random anchors in the rest, blocks of --block-size; SmolLM2's heads by default (9 query and
3 key/value heads of 64). The mask is the training mask (`flex_block_mask`). Each table row is one set of
`kernel_options` (the first is flex attention's own choice), compiled as the drafter compiles it (dynamic shapes),
in bf16: forward, and forward + backward, median after warm-up; its output against the first row's. TFLOP/s count
the (query, key) pairs the mask allows: per query head 4 * head_dim FLOPs a pair forward, 10 * head_dim more backward
(the scores recomputed, then four products). A set that fails to compile is recorded as such.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
from torch.nn.attention.flex_attention import flex_attention

from dflash2.data.anchors import flex_block_mask, sample_anchors

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from timing import print_table  # noqa: E402
from train_throughput import synthetic_loss_mask  # noqa: E402

CONFIGS: list[dict[str, Any]] = [
    {},
    {"ROWS_GUARANTEED_SAFE": True},  # every query sees its own block: no empty row to guard against
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    {"USE_TMA": True},
]


def training_blocks(rows: int, length: int, anchors: int, seed: int) -> torch.Tensor:
    """[rows, anchors] anchors drawn as train_throughput.py's synthetic batch draws them (`sample_anchors`, the first
    eighth of each row an untrained prompt)."""
    gen = torch.Generator().manual_seed(seed)
    loss_mask = synthetic_loss_mask(length)
    return torch.stack([sample_anchors(loss_mask, anchors, gen) for _ in range(rows)])


def attended_pairs(anchors: torch.Tensor, block_size: int) -> int:
    """(query, key) pairs the training mask allows: each slot sees the context before its anchor and its own block."""
    return int(((anchors + block_size) * block_size).sum())


def timed_ms(fn, cuda: bool) -> float:
    if cuda:
        from timing import median_ms

        return median_ms(fn, rep=100)
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/draft_attention.json", help="where the JSON goes")
    parser.add_argument("--rows", type=int, default=16, help="rows (conversations) per step")
    parser.add_argument("--length", type=int, default=3072, help="tokens per row")
    parser.add_argument("--anchors", type=int, default=512, help="blocks per row")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--heads", type=int, nargs=3, default=[9, 3, 64], metavar=("Q", "KV", "DIM"))
    parser.add_argument("--configs", type=json.loads, default=CONFIGS, help="a JSON list of kernel_options sets")
    parser.add_argument("--small", action="store_true", help="tiny shapes, eager, forward only (flex attention's CPU)")
    args = parser.parse_args(argv)
    if args.small:
        args.rows, args.length, args.anchors, args.block_size, args.heads = 2, 256, 8, 4, [4, 2, 16]
    cuda = torch.cuda.is_available() and not args.small
    if not cuda and not args.small:
        raise SystemExit("benchmarks/draft_attention.py times the GPU's kernels: run it with CUDA, or pass --small")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    heads, kv_heads, dim = args.heads
    anchors = training_blocks(args.rows, args.length, args.anchors, seed=0).to(device)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    mask = flex_block_mask(anchors, valid, args.length, args.block_size, BLOCK_SIZE=128 if cuda else 16)
    gen = torch.Generator().manual_seed(1)
    slots, keys = args.anchors * args.block_size, args.length + args.anchors * args.block_size
    q = torch.randn(args.rows, heads, slots, dim, generator=gen).to(device, dtype).requires_grad_(cuda)
    k, v = (
        torch.randn(args.rows, kv_heads, keys, dim, generator=gen).to(device, dtype).requires_grad_(cuda) for _ in "kv"
    )
    grad_out = torch.randn_like(q)
    flops = 4 * dim * heads * attended_pairs(anchors, args.block_size)
    rows, reference = [], None
    for options in args.configs:
        row: dict[str, Any] = {"kernel_options": json.dumps(options)}
        attend = functools.partial(
            flex_attention, block_mask=mask, enable_gqa=heads != kv_heads, kernel_options=options
        )
        if cuda:
            attend = torch.compile(attend, dynamic=True)
        try:
            out = attend(q, k, v)
            if reference is None:
                reference = out.detach().float()
            row["max_abs_diff"] = float((out.detach().float() - reference).abs().max())
            row["forward_ms"] = timed_ms(lambda attend=attend: attend(q, k, v), cuda)
            row["forward_tflops"] = flops / row["forward_ms"] / 1e9
            if cuda:
                row["forward_backward_ms"] = timed_ms(lambda attend=attend: attend(q, k, v).backward(grad_out), cuda)
                row["forward_backward_tflops"] = 3.5 * flops / row["forward_backward_ms"] / 1e9
        except Exception as e:  # noqa: BLE001 (a kernel option set this torch cannot compile is a result, not a crash)
            row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"
        rows.append(row)
    shape = {"rows": args.rows, "length": args.length, "anchors": args.anchors, "block_size": args.block_size}
    shape |= {"heads": heads, "kv_heads": kv_heads, "head_dim": dim}
    name = torch.cuda.get_device_name() if cuda else "cpu"
    result = {"torch": torch.__version__, "device": name, "dtype": str(dtype), "shape": shape, "rows": rows}
    columns = ["kernel_options", "forward_ms", "forward_backward_ms", "forward_tflops", "max_abs_diff"]
    table = [{c: r.get(c, "failed" if "error" in r else "-") for c in columns} for r in rows]
    print_table(table, columns, title=f"draft attention, {shape} ({name})")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
