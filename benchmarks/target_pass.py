"""The target's training pass alone: its features at rounded batch lengths, eager, compiled, and as CUDA graphs.

    python benchmarks/target_pass.py --out FILE                 # SmolLM2's shape, random bf16 weights, on CUDA
    python benchmarks/target_pass.py --small --out FILE         # the tiny target on the CPU: the plumbing only

What `TargetModel` runs for `model.compile=false | true | reduce-overhead` in a training step: a features-only
forward (no mask, target layers [1, 27], autograd on as in training) of `--rows` rows, at each of `--lengths` in turn,
as rounded batches recur. Compilation is for CUDA only (`TargetModel.compiled_layers`): the CPU runs eager.
Each mode runs every length 3 times (compilation, CUDA-graph recording), then `--reps` rounds timed with CUDA events
(on the CPU: wall clock); the median and the minimum over all timed passes are reported, with the warm-up's wall time
and the largest difference from the eager features (bf16 rounding of compiled kernels).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dflash2.target.model import TargetModel
from dflash2.testing import tiny_target


def build(small: bool, device: torch.device) -> TargetModel:
    if small:
        return tiny_target(target_layer_ids=[1, 2], device=device)
    from omegaconf import OmegaConf

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from train_throughput import build_target  # its --random-weights SmolLM2, as the step benchmark builds it

    cfg = OmegaConf.create({"model": {"dtype": "bfloat16", "target_layer_ids": [1, 27], "compile": False}})
    return build_target("smollm2", cfg, False, device, random_weights=True)


def features(target: TargetModel, ids: torch.Tensor) -> torch.Tensor:
    return target(ids, logits=False).hidden


def timed(target: TargetModel, ids: torch.Tensor, lengths: list[int], reps: int) -> tuple[dict[str, float], dict]:
    cuda = ids.is_cuda
    start, out = time.perf_counter(), {}
    for n in lengths:
        for _ in range(3):
            out[n] = features(target, ids[:, :n])
    if cuda:
        torch.cuda.synchronize()
    warmup = time.perf_counter() - start
    times = []
    for _ in range(reps):
        for n in lengths:
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                features(target, ids[:, :n])
                end.record()
                torch.cuda.synchronize()
                times.append(begin.elapsed_time(end))
            else:
                t = time.perf_counter()
                features(target, ids[:, :n])
                times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    return {"median_ms": times[len(times) // 2], "min_ms": times[0], "warmup_s": warmup}, out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--small", action="store_true", help="the tiny target on the CPU: seconds")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--lengths", type=int, nargs="+", default=[3072, 2944, 2816, 2688])
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=None, help="model.compile values (default: all three on CUDA)")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.small or not torch.cuda.is_available() else "cuda")
    if args.small:
        args.lengths = [n // 64 for n in args.lengths]
    modes = args.modes or (["false", "true", "reduce-overhead"] if device.type == "cuda" else ["false"])
    target = build(args.small, device)
    ids = torch.randint(0, target.vocab_size, (args.rows, max(args.lengths)), device=device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    result: dict[str, Any] = {"device": name, "torch": torch.__version__, "rows": args.rows, "lengths": args.lengths}
    result["modes"] = {}
    eager = None
    for mode in modes:
        target.compile_features = {"false": False, "true": True}.get(mode, mode)
        row, out = timed(target, ids, args.lengths, args.reps)
        eager = eager or out  # the first mode (false by default) is the reference
        row["max_abs_diff_vs_first"] = max(float((out[n].float() - eager[n].float()).abs().max()) for n in out)
        result["modes"][mode] = row
        print(mode, {k: round(v, 3) for k, v in row.items()}, flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
