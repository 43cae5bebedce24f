"""How much of a chat file's training text prompt lookup would continue: the data side of the copy gap.

    python benchmarks/copyable_anchors.py FILE[:N] [FILE[:N] ...] [--block-size 16] [--max-length 3072]
        [--max-anchors 512] [--weights 2,4,8] [--out FILE]

Each file (its first N conversations with `:N`) is rendered and tokenized as training does it (the target's
tokenizer and chat template, data.max_length), and at every trainable anchor position (the token and the next one
trained) prompt lookup, with the settings of `evaluate.py drafter=pld`, proposes from the tokens up to the anchor. An
anchor is copyable when at least one of its proposals would be accepted (the first equals the trained token that
follows), the rule of `data.copy_anchor_weight` (dflash2.data.anchors.CopyAnchors) and of
benchmarks/copy_gap.py's copyable steps. Per file: the share of anchor positions that are copyable (and that match
at least m tokens), the mean matched length (proposals accepted in a row, out of B - 1) over the copyable ones and
over all, the histogram of matched lengths, the time the rule takes per conversation, and, since the weight only
changes the draw of a row with more anchor positions than data.max_anchors, how many rows and positions that is and
the share of copyable anchors among those drawn at each `--weights` w (one seeded draw per row, as epoch 0 of
training draws them).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import platform
import sys
import time
from typing import Any

import torch

from dflash2.data.anchors import CopyAnchors, sample_anchors, valid_anchor_positions
from dflash2.data.chat import load_conversations, tokenize_conversations

ROOT = pathlib.Path(__file__).resolve().parents[1]
THRESHOLDS = (1, 2, 4, 8, 15)


@functools.cache
def tokenizer_of(model: str | None) -> Any:
    """The tokenizer (and chat template) a target's training renders with: the embedded SmolLM2's by default."""
    from transformers import AutoTokenizer

    from dflash2.target.locate import smollm2_folder, target_source

    path, kwargs = (str(smollm2_folder()), {}) if model is None else target_source(model, None)
    return AutoTokenizer.from_pretrained(path, **kwargs)


def parse_input(text: str) -> tuple[pathlib.Path, int | None]:
    """FILE or FILE:N (its first N conversations)."""
    path, _, limit = text.rpartition(":")
    return (pathlib.Path(path), int(limit)) if path and limit.isdigit() else (pathlib.Path(text), None)


def display(path: pathlib.Path) -> str:
    """A path as the JSON records it: relative to the repository when inside it."""
    path = path.absolute()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def measure(
    path: pathlib.Path,
    limit: int | None,
    tokenizer: Any,
    block_size: int,
    max_length: int,
    max_anchors: int,
    weights: list[float],
    seed: int = 0,
    cache_dir: str | None = None,
) -> dict[str, Any]:
    """One file's figures (module docstring)."""
    chats = load_conversations(str(path), limit)
    stat = path.stat()
    key = f"{path.absolute()}|{stat.st_size}|{stat.st_mtime_ns}|limit={limit}|n={len(chats)}"
    rows = tokenize_conversations(chats, tokenizer, max_length, key, os.cpu_count(), cache_dir)
    rows = rows.with_format("torch", columns=["input_ids", "loss_mask"])
    copy = CopyAnchors(2.0, block_size)  # its rule; the weight is moot here
    slots = block_size - 1
    histogram = torch.zeros(slots + 1, dtype=torch.long)
    tokens = anchors = crowded_rows = crowded_anchors = 0
    drawn = {w: [0, 0] for w in [1.0, *weights]}  # w -> [copyable drawn, drawn]
    seconds = 0.0
    for i in range(len(rows)):
        ids, mask = rows[i]["input_ids"].long(), rows[i]["loss_mask"]
        start = time.perf_counter()
        matched = copy.lookup.matched_lengths(ids, block_size, counted=mask)
        seconds += time.perf_counter() - start
        valid = valid_anchor_positions(mask)
        histogram += torch.bincount(matched[valid], minlength=slots + 1)
        tokens, anchors = tokens + len(ids), anchors + len(valid)
        if len(valid) > max_anchors:
            crowded_rows, crowded_anchors = crowded_rows + 1, crowded_anchors + len(valid)
        copyable = matched >= 1
        for w, counts in drawn.items():
            generator = torch.Generator().manual_seed((seed * 1_000_003 + i) * 1_009 + 1)  # epoch 0's, as in training
            chosen = sample_anchors(mask, max_anchors, generator, None if w == 1 else torch.where(copyable, w, 1.0))
            counts[0] += int(copyable[chosen].sum())
            counts[1] += len(chosen)
    lengths = torch.arange(slots + 1, dtype=torch.double)
    n_copyable = int(histogram[1:].sum())
    return {
        "data": display(path),
        "limit": limit,
        "conversations": len(chats),
        "rows": len(rows),  # the conversations with a trainable reply within max_length
        "tokens": tokens,
        "anchor_positions": anchors,
        "copyable_anchors": n_copyable,
        "copyable_share": n_copyable / anchors,
        "share_matching_at_least": {str(m): int(histogram[m:].sum()) / anchors for m in THRESHOLDS if m <= slots},
        "mean_matched_copyable": float((histogram * lengths).sum()) / max(1, n_copyable),
        "mean_matched_all": float((histogram * lengths).sum()) / anchors,
        "matched_histogram": histogram.tolist(),  # anchor positions by matched length 0..B-1
        "rule_ms_per_conversation": 1000 * seconds / len(rows),
        "rule_seconds": seconds,
        "rows_over_max_anchors": crowded_rows,
        "anchor_positions_in_rows_over_max_anchors": crowded_anchors,
        "drawn_copyable_share": {f"{w:g}": c / max(1, n) for w, (c, n) in drawn.items()},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("inputs", nargs="+", help="chat files, FILE or FILE:N for the first N conversations")
    ap.add_argument("--model", help="the target whose tokenizer renders the chats (default: the embedded SmolLM2)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=3072)
    ap.add_argument("--max-anchors", type=int, default=512)
    ap.add_argument("--weights", default="2,4,8", help="data.copy_anchor_weight values whose draws to count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", help="where the rendered rows are cached (default: as training caches them)")
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # one row at a time: threads only add overhead at these sizes
    tokenizer = tokenizer_of(args.model)
    weights = [float(w) for w in args.weights.split(",") if w]
    files = []
    for text in args.inputs:
        path, limit = parse_input(text)
        file = measure(
            path, limit, tokenizer, args.block_size, args.max_length, args.max_anchors, weights, args.seed,
            args.cache_dir,
        )  # fmt: skip
        files.append(file)
        print(
            f"{file['data']}{'' if limit is None else f' (first {limit})'}: {file['rows']} rows, "
            f"{file['anchor_positions']} anchor positions, {100 * file['copyable_share']:.1f}% copyable, mean "
            f"matched {file['mean_matched_copyable']:.2f} of {args.block_size - 1} there "
            f"({file['mean_matched_all']:.2f} over all); rule {file['rule_ms_per_conversation']:.2f} ms/conversation; "
            f"{file['rows_over_max_anchors']} rows over max_anchors; drawn copyable share "
            + ", ".join(f"w={w}: {100 * s:.1f}%" for w, s in file["drawn_copyable_share"].items())
        )
    given = sys.argv[1:] if argv is None else argv
    result = {
        "command": " ".join(["python", "benchmarks/copyable_anchors.py", *given]),
        "machine": f"{os.cpu_count()}-core CPU ({platform.machine()})",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "tokenizer": args.model or "smollm2 (embedded)",
        "settings": {
            "block_size": args.block_size,
            "max_length": args.max_length,
            "max_anchors": args.max_anchors,
            "lookup": repr(CopyAnchors(2.0, args.block_size).lookup),  # evaluate.py drafter=pld's defaults
            "copyable": "at least one proposal accepted (matched >= 1, trained tokens only)",
            "seed": args.seed,
        },
        "files": files,
    }
    if args.out:
        tmp = args.out.with_suffix(args.out.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, args.out)
    return result


if __name__ == "__main__":
    main()
