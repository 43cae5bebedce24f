"""Where a drafter loses to prompt lookup, for every greedy drafter run of evaluation sweeps, replayed from their
samples (`dflash2.evaluation.copy_gap`; evaluate.py records the same in each run's results.json, `copy_gap`).

    python benchmarks/copy_gap.py SWEEP_DIR [SWEEP_DIR ...] [--out FILE] [--max-ngram N]

A step is "copyable" when prompt lookup, proposing from the same committed tokens, would have had at least one
proposal accepted there. Per run (bench x drafter): the drafter's tau, the share of copyable steps, the drafter's
tau on copyable and on other steps, and the lookup's tau on the same copyable steps. It replays runs measured
before evaluate.py recorded the gap too, and other lookups (`--max-ngram`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from dflash2.decoding.lookup import PromptLookup
from dflash2.evaluation.copy_gap import copy_gap, replayable

KEYS = ["tau", "copyable_share", "tau_copyable", "tau_other", "lookup_tau_copyable"]


def run_gap(run_dir: Path, lookup: PromptLookup) -> dict[str, Any] | None:
    """The gap of one evaluation run (a folder with results.json and samples.jsonl); None where there is none."""
    results = json.loads((run_dir / "results.json").read_text())
    if not replayable(results["draft"], results["temperature"]):
        return None
    block_size = int(results["block_size"])
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    steps = [n for s in samples for n in s["accept_lengths"]]
    gap = copy_gap(samples, block_size, lookup)
    del gap["lookup"]  # the same for every run: written once, beside them
    head = {"bench": results["bench"], "draft": results["draft"]["name"], "block_size": block_size}
    return head | {"tau": sum(steps) / len(steps) if steps else None} | gap


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
    print(f"{'bench':<10} {'draft':<8} {'block':>5} " + " ".join(f"{k:>19}" for k in KEYS))
    for r in rows:
        cells = (f"{r[k]:>19.3f}" if r[k] is not None else f"{'-':>19}" for k in KEYS)
        print(f"{r['bench']:<10} {r['draft']:<8} {r['block_size']:>5} " + " ".join(cells))
    return rows


if __name__ == "__main__":
    main()
