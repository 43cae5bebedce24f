"""One batched `generate` call as regeneration makes it, with a static cache: what a new shape costs.

    python benchmarks/generate_call.py [--batch 512] [--steps 64] [--cache 1024 3072] [--out FILE]
    python benchmarks/generate_call.py --small --batch 4 --steps 4 --cache 64 --widths 10 12   # the tiny target, CPU

`dflash2.data.regenerate.generate` on the embedded SmolLM2 in bf16, `--batch` prompts of `--width` random tokens,
end-of-sequence off so that every call decodes `--steps` tokens. For each cache length, two calls: the first
compiles the decode step (and on CUDA captures its graph), the second replays it. Then calls whose prompts have
other widths (`--widths`) at the first cache length, once padded to a fixed width as regeneration pads them
(`pad_to`) and once padded only to their own longest prompt: there each new width is a new shape. Times are wall
seconds of whole calls, synchronized.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

import torch
import transformers

from dflash2.data.regenerate import generate

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from decode_step import load_target  # noqa: E402  (sibling scripts)
from timing import sync  # noqa: E402


def timed_call(target: Any, prompts: list[list[int]], steps: int, cache: int, pad_to: int | None) -> float:
    sync()
    start = time.perf_counter()
    generate(target, prompts, steps, 0.0, "static", cache, pad_to)
    sync()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--width", type=int, default=150)
    ap.add_argument("--cache", type=int, nargs="+", default=[1024, 3072])
    ap.add_argument("--widths", type=int, nargs="*", default=[170, 190])
    ap.add_argument("--small", action="store_true", help="the tiny target (CPU-sized)")
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    target = load_target(args.small, "cuda" if torch.cuda.is_available() else "cpu")
    target.model.generation_config.eos_token_id = None  # every call decodes --steps tokens
    vocab = target.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = lambda width: [torch.randint(100, vocab - 1, (width,), generator=g).tolist() for _ in range(args.batch)]
    same = prompts(args.width)
    rows: list[dict[str, Any]] = []
    for cache in args.cache:
        for call in ("first", "second"):
            seconds = timed_call(target, same, args.steps, cache, None)
            rows.append({"cache": cache, "width": args.width, "padding": "none", "call": call, "seconds": seconds})
    cache = args.cache[0]
    for padding, pad_to in (("fixed", cache - args.steps), ("none", None)):
        for width in args.widths:
            seconds = timed_call(target, prompts(width), args.steps, cache, pad_to)
            rows.append({"cache": cache, "width": width, "padding": padding, "call": "new width", "seconds": seconds})
    for row in rows:
        row["ms_per_step"] = 1000 * row["seconds"] / args.steps
        print(
            f"cache {row['cache']:5d}  width {row['width']:4d}  padding {row['padding']:5s}  {row['call']:9s}  "
            f"{row['seconds']:7.2f} s  {row['ms_per_step']:7.1f} ms/step"
        )
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__}
    result = meta | {"settings": vars(args) | {"out": str(args.out)}, "calls": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
