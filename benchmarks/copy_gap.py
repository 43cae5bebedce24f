"""Where a drafter loses to prompt lookup: at every step a drafter took, what prompt lookup would have had accepted
from the same committed tokens, read from the samples of a T=0 evaluation sweep.

    python benchmarks/copy_gap.py SWEEP_DIR [SWEEP_DIR ...] [--out FILE]

At T=0 the output is the target's greedy text whatever proposes, so each step of a drafter's run can be replayed:
its committed tokens are the prompt and the output up to the step's anchor, and prompt lookup
(`dflash2.decoding.lookup`, the settings `evaluate.py drafter=pld` uses) proposes from them; its accept length there
is 1 + the proposals that match the output that follows. A step is "copyable" when that lookup would have had at
least one proposal accepted. Per run (bench x drafter): the drafter's tau, the share of copyable steps, the drafter's
tau on copyable and on other steps, and the lookup's tau on the same copyable steps. A drafter that uses its context
accepts about as much as the lookup where the text repeats itself.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from dflash2.decoding.lookup import PromptLookup


def lookup_accepts(
    prompt: list[int], output: list[int], accept_lengths: list[int], block_size: int, lookup: PromptLookup
) -> list[int]:
    """Prompt lookup's accept length at each of a run's steps: step i anchors at output[pos_i] (output[0] comes from
    the prefill, pos_0 = 0, pos_i+1 = pos_i + accept_lengths[i]) and commits what follows, up to the output's end."""
    starts, pos = [], 0
    for n in accept_lengths:
        starts.append(pos)
        pos += n
    full = torch.tensor(prompt + output, dtype=torch.long)
    lengths = torch.tensor([len(prompt) + s + 1 for s in starts])  # committed tokens, the anchor last
    # One row per step, each holding the whole text: the lookup reads only the first `lengths[i]` tokens of row i.
    proposals = lookup.lookup(full.expand(len(starts), -1), lengths, block_size)
    accepted = []
    for row, start in zip(proposals.tolist(), starts, strict=True):
        follows = output[start + 1 : start + block_size]
        k = 0
        while k < len(follows) and row[k] == follows[k]:
            k += 1
        accepted.append(min(1 + k, len(output) - 1 - start))  # the run stops at the output's end, bonus token or not
    return accepted


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def run_gap(run_dir: Path, lookup: PromptLookup) -> dict[str, Any] | None:
    """The gap of one evaluation run (a folder with results.json and samples.jsonl); None for prompt lookup's own
    runs and for runs at T > 0, where the output depends on what was proposed."""
    results = json.loads((run_dir / "results.json").read_text())
    if results["draft"]["name"] == "pld" or results["temperature"] != 0:
        return None
    block_size = int(results["block_size"])
    drafter, looked = [], []
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        sample = json.loads(line)
        steps = sample["accept_lengths"]
        drafter += steps
        looked += lookup_accepts(sample["prompt_ids"], sample["output_ids"], steps, block_size, lookup)
    copyable = [i for i, n in enumerate(looked) if n > 1]
    other = [i for i, n in enumerate(looked) if n == 1]
    return {
        "bench": results["bench"],
        "draft": results["draft"]["name"],
        "block_size": block_size,
        "steps": len(drafter),
        "tau": _mean(drafter),
        "copyable_share": len(copyable) / len(drafter) if drafter else None,
        "tau_copyable": _mean([drafter[i] for i in copyable]),
        "tau_other": _mean([drafter[i] for i in other]),
        "lookup_tau_copyable": _mean([looked[i] for i in copyable]),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweeps", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, help="where the JSON goes (default: print only)")
    parser.add_argument("--max-ngram", type=int, default=PromptLookup.max_ngram)
    args = parser.parse_args(argv)
    lookup = PromptLookup(max_ngram=args.max_ngram)
    rows = [
        gap
        for sweep in args.sweeps
        for file in sorted(sweep.rglob("results.json"))
        if (gap := run_gap(file.parent, lookup)) is not None
    ]
    if args.out:
        args.out.write_text(json.dumps({"lookup": vars(lookup), "runs": rows}, indent=2) + "\n")
    keys = ["tau", "copyable_share", "tau_copyable", "tau_other", "lookup_tau_copyable"]
    print(f"{'bench':<10} {'draft':<8} {'block':>5} " + " ".join(f"{k:>19}" for k in keys))
    for r in rows:
        cells = (f"{r[k]:>19.3f}" if r[k] is not None else f"{'-':>19}" for k in keys)
        print(f"{r['bench']:<10} {r['draft']:<8} {r['block_size']:>5} " + " ".join(cells))
    return rows


if __name__ == "__main__":
    main()
