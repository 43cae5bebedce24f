"""The feature cache against the online target pass: bytes per token, write time, and the training step from it.

    python benchmarks/feature_cache.py --preset smollm2 qwen3-8b [--dtype bf16 fp8] --out FILE
    python benchmarks/feature_cache.py --small --out /tmp/feature_cache.json     # tiny targets: a CPU smoke test

Per preset (train_throughput.py's: the experiment's sizes, its synthetic full-length batch and its Lightning step
timer), the target first writes a cache of `--rows` rows (the batch's rows, repeated) with dflash2.data.features'
writer, once per storage dtype: `write_s` and `write_tokens_per_s` time it (the target pass, the quantization and
the files), `bytes_per_token` is measured on disk (shards over tokens) beside the formula's. Then the same batch
trains for --warmup + --steps steps online (the target runs its layers every step) and from each cache (its
layers dropped, as `train.py data.features=DIR` drops them; the batch carries the cached rows). `cache_speedup` is
the online step's median over the cached one's; `peak_memory_gib` on a GPU shows what dropping the layers frees.
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import sys
import tempfile
import time
from typing import Any

import datasets
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
import train_throughput as bench  # noqa: E402
from timing import sync  # noqa: E402

from dflash2.commands.train_groups import draft_config  # noqa: E402
from dflash2.data import feature_store as fs  # noqa: E402
from dflash2.data import features as fc  # noqa: E402
from dflash2.training.drafter import target_fields  # noqa: E402


def timed_steps(preset: str, target: Any, batch: dict, args: argparse.Namespace, overrides: list[str]) -> dict:
    """train_throughput's run_preset on this target and batch (its own builds replaced by them)."""
    build_target, synthetic_batch = bench.build_target, bench.synthetic_batch
    bench.build_target = lambda *a, **k: target
    bench.synthetic_batch = lambda *a, **k: batch
    try:
        run = bench.run_preset(preset, args.small, args.steps, args.warmup, 989.0, overrides)
    finally:
        bench.build_target, bench.synthetic_batch = build_target, synthetic_batch
    keep = ("step_s", "step_s_median", "phases_s_median", "peak_memory_gib", "losses", "device", "precision")
    return {k: run[k] for k in keep if k in run}


def run_preset(preset: str, args: argparse.Namespace, folder: pathlib.Path) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = bench.compose_preset(preset, args.small, args.override)
    torch.manual_seed(0)
    target = bench.build_target(preset, cfg, args.small, device, args.random_weights).to(device)
    draft = draft_config(cfg.draft, target_fields(target))
    pad = getattr(target.tokenizer, "pad_token_id", None) or 0
    batch = bench.synthetic_batch(cfg, draft, target.vocab_size, pad)
    b, length = batch["input_ids"].shape
    picks = [i % b for i in range(args.rows)]
    rows = datasets.Dataset.from_dict({k: [batch[k][i].tolist() for i in picks] for k in ("input_ids", "loss_mask")})
    layers = list(draft.target_layer_ids)
    fields = {"target": preset, "target_layer_ids": layers, "data_path": "synthetic", "max_length": length}
    result: dict[str, Any] = {
        "preset": preset,
        "experiment": bench.PRESETS[preset],
        "small": args.small,
        "target_layer_ids": layers,
        "hidden_size": target.hidden_size,
        "batch": {"rows": b, "seq_len": length},
        "rows_written": args.rows,
        "caches": {},
    }
    cached_batches = {}
    for dtype in args.dtype:
        out = folder / f"{preset}-{dtype}"
        sync()
        start = time.perf_counter()
        manifest = fc.write_features(
            target, rows, out, fields, dtype=dtype, batch_size=int(cfg.data.batch_size), shard_rows=args.rows
        )
        sync()
        seconds = time.perf_counter() - start
        disk = sum(p.stat().st_size for p in out.glob("shard-*.safetensors"))
        store = fs.FeatureStore(out)
        cached_batches[dtype] = batch | fs.pad_features([store.row(i) for i in range(b)], length)
        result["caches"][dtype] = {
            "tokens": manifest["tokens"],
            "write_s": seconds,
            "write_tokens_per_s": manifest["tokens"] / seconds,
            "bytes_per_token": disk / manifest["tokens"],
            "bytes_per_token_formula": fs.bytes_per_token(target.hidden_size, len(layers), dtype),
        }
    overrides = list(args.override)
    result["online"] = timed_steps(preset, target, batch, args, overrides)
    target.drop_layers()  # train.py with data.features loads none
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    online = result["online"]["step_s_median"]
    for dtype, cached in cached_batches.items():
        run = timed_steps(preset, target, cached, args, overrides)
        result["caches"][dtype] |= {"step": run, "cache_speedup": online / run["step_s_median"]}
    result["cache_speedup"] = {d: c["cache_speedup"] for d, c in result["caches"].items()}
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/feature_cache.json", help="where the JSON goes")
    parser.add_argument("--preset", nargs="+", choices=list(bench.PRESETS), default=["smollm2"])
    parser.add_argument("--dtype", nargs="+", choices=fs.DTYPES, default=list(fs.DTYPES))
    parser.add_argument("--rows", type=int, help="rows written to each cache (default 32; --small: 4)")
    parser.add_argument("--steps", type=int, help="timed steps (default 5; --small: 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 2; --small: 1)")
    parser.add_argument("--small", action="store_true", help="tiny targets and data: a CPU smoke test")
    parser.add_argument("--random-weights", action="store_true", help="smollm2: its architecture, random weights")
    parser.add_argument("--cache-dir", help="where the caches go (default: a temporary folder, removed after)")
    parser.add_argument("--override", nargs="+", default=[], help="Hydra overrides, e.g. data.max_anchors=256")
    args = parser.parse_args(argv)
    args.rows = args.rows or (4 if args.small else 32)
    args.steps = args.steps or (2 if args.small else 5)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.small else 2)
    bench.register_resolvers()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"torch": torch.__version__, "runs": []}
    for preset in args.preset:
        with tempfile.TemporaryDirectory(dir=args.cache_dir) as folder:
            result["runs"].append(run_preset(preset, args, pathlib.Path(folder)))
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        out.write_text(json.dumps(result, indent=2))  # after each preset: a later failure keeps the earlier ones
    for run in result["runs"]:
        for dtype, c in run["caches"].items():
            print(
                f"{run['preset']:>9} {dtype:>4}: {c['bytes_per_token']:.0f} bytes/token, write "
                f"{c['write_tokens_per_s']:.0f} tokens/s, step {c['step']['step_s_median']:.4g} s cached vs "
                f"{run['online']['step_s_median']:.4g} s online: cache_speedup {c['cache_speedup']:.3g}"
            )
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
