"""The target's decode step with transformers' SDPA and with dflash2's grouped attention (dflash2/target/attention.py).

    python benchmarks/decode_step.py [--batch 64 256 512] [--cache-len 3072] [--context 1024] [--out FILE]
    python benchmarks/decode_step.py --small --out /tmp/decode_step.json   # the tiny target: seconds on a CPU

One step is what `python -m dflash2.commands.regenerate cache_implementation=static` repeats: the embedded SmolLM2 in
bf16, a StaticCache of --cache-len positions of which --context are filled (the first row left-padded, so there is a
mask), one new token per row. On a GPU the forward is compiled the way transformers' generate compiles it
(mode="reduce-overhead", i.e. replayed as a CUDA graph) and timed with CUDA events; each figure is the median of
--steps steps after --warmup. Both attentions run in the same process on the same cache, and their logits are
checked first against the same step run in float32 with transformers' SDPA: the script stops if grouped attention
strays from that reference by more than twice what transformers' own bf16 SDPA does (bf16 alone moves the logits of
30 layers by a few tenths, so a fixed bound would measure the dtype, not the attention).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time
from typing import Any

import torch
import transformers
import yaml
from transformers import StaticCache

from dflash2.commands import build
from dflash2.target.model import TargetModel
from dflash2.testing import tiny_target

ROOT = pathlib.Path(__file__).resolve().parents[1]
ATTENTIONS = ("sdpa", "grouped_sdpa")


def load_target(small: bool, device: str, dtype: str = "bfloat16") -> TargetModel:
    if small:
        return tiny_target(device=device)
    cfg = yaml.safe_load((ROOT / "configs" / "model" / "smollm2.yaml").read_text())
    return build(cfg | {"dtype": dtype}, device=device)


def prefill(target: TargetModel, tokens: torch.Tensor, mask: torch.Tensor, cache_len: int) -> StaticCache:
    """A fresh static cache holding `tokens` (a full-length 2D mask keeps every step's shapes the same)."""
    context = tokens.shape[1]
    cache = StaticCache(config=target.model.config, max_cache_len=cache_len)
    with torch.no_grad():
        target.model(
            input_ids=tokens,
            attention_mask=mask,
            past_key_values=cache,
            cache_position=torch.arange(context, device=tokens.device),
            position_ids=(mask[:, :context].cumsum(1) - 1).clamp(min=0),
            logits_to_keep=1,
        )
    return cache


def decode(step: Any, token: torch.Tensor, mask: torch.Tensor, cache: StaticCache, position: int) -> torch.Tensor:
    """One decode step at cache `position` (every row one token further); returns its logits."""
    with torch.no_grad():
        out = step(
            input_ids=token,
            attention_mask=mask,
            past_key_values=cache,
            cache_position=torch.tensor([position], device=token.device),
            position_ids=mask[:, :position].sum(1, keepdim=True),
            logits_to_keep=1,
        )
    return out.logits.float()  # a copy: a replayed CUDA graph reuses its output buffer


def median_ms(
    step: Any, token: torch.Tensor, mask: torch.Tensor, cache: StaticCache, first: int, warmup: int, steps: int
) -> float:
    """Median ms of the decode steps after `warmup`, at positions first, first + 1, ... (CUDA events on a GPU, wall
    clock on a CPU)."""
    cuda = torch.cuda.is_available()
    times = []
    for i in range(warmup + steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            decode(step, token, mask, cache, first + i)
            end.record()
            torch.cuda.synchronize()
            ms = start.elapsed_time(end)
        else:
            t0 = time.perf_counter()
            decode(step, token, mask, cache, first + i)
            ms = (time.perf_counter() - t0) * 1e3
        if i >= warmup:
            times.append(ms)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--cache-len", type=int, default=3072, help="the static cache: regenerate's max_length")
    parser.add_argument("--context", type=int, default=1024, help="positions already filled")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="the tiny target, CPU-sized shapes")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "decode_step.json")
    args = parser.parse_args(argv)
    if args.small:
        args.cache_len, args.context = min(args.cache_len, 64), min(args.context, 24)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    target = load_target(args.small, device)
    reference = load_target(args.small, device, "float32")
    reference.model.set_attn_implementation("sdpa")
    if args.cache_len < args.context + 2 + args.warmup + args.steps:
        raise SystemExit("--cache-len must hold --context plus every decoded step")
    result = {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "target": "tiny" if args.small else "smollm2 bf16",
        "timer": "cuda_events_reduce_overhead" if device == "cuda" else "cpu_wall_eager",
        "cache_len": args.cache_len,
        "context": args.context,
        "rows": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for batch in args.batch:
        tokens = torch.randint(4, target.vocab_size, (batch, args.context), device=device)
        token = torch.randint(4, target.vocab_size, (batch, 1), device=device)
        mask = torch.ones(batch, args.cache_len, dtype=torch.long, device=device)
        mask[0, : args.context // 2] = 0  # left padding on one row, as in a batch of prompts
        row: dict[str, Any] = {"batch": batch}
        exact = decode(reference.model, token, mask, prefill(reference, tokens, mask, args.cache_len), args.context)
        for attention in ATTENTIONS:
            target.model.set_attn_implementation(attention)
            cache = prefill(target, tokens, mask, args.cache_len)
            step = torch.compile(target.model, mode="reduce-overhead") if device == "cuda" else target.model
            error = (decode(step, token, mask, cache, args.context) - exact).abs().max().item()  # also compiles
            row[f"{attention}_max_abs_error"] = error
            ms = median_ms(step, token, mask, cache, args.context + 1, args.warmup, args.steps)
            row[f"{attention}_ms"] = ms
            row[f"{attention}_tokens_per_s"] = batch / row[f"{attention}_ms"] * 1e3
            torch._dynamo.reset()  # the next attention compiles afresh
        if not row["grouped_sdpa_max_abs_error"] <= 2 * row["sdpa_max_abs_error"] + 1e-4:
            raise SystemExit(
                f"batch {batch}: grouped attention's logits are {row['grouped_sdpa_max_abs_error']:.4f} from the "
                f"float32 reference, transformers' SDPA's {row['sdpa_max_abs_error']:.4f}"
            )
        row["speedup"] = row["sdpa_ms"] / row["grouped_sdpa_ms"]
        result["rows"].append(row)
        # after every batch size, so a run cut off by a time limit keeps the rows it finished
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(
            f"batch {batch:4d}: sdpa {row['sdpa_ms']:.3f} ms, grouped {row['grouped_sdpa_ms']:.3f} ms, "
            f"x{row['speedup']:.2f}, {row['grouped_sdpa_tokens_per_s']:.0f} tokens/s; logits off the float32 "
            f"reference by {row['sdpa_max_abs_error']:.3f} and {row['grouped_sdpa_max_abs_error']:.3f}",
            flush=True,
        )
    return result


if __name__ == "__main__":
    main()
