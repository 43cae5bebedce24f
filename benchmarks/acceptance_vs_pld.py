"""The acceptance table against the training-free baseline, from a finished `benchmarks/acceptance.sh` work folder.

    python benchmarks/acceptance_vs_pld.py WORK_DIR [--drafters dflash,dflash2,dflash2_warm] [--from CSV ...]

Reads WORK_DIR/sweeps/summary.csv (every grid run) and each drafter's training log, and writes
WORK_DIR/acceptance_vs_pld.json: for T=0 and block 16, per bench, {"pld": tau, "<drafter>": tau, ...}; per drafter
the training command, its data, optimizer steps, conversations seen, epochs and training minutes; and, for each
DFlash2 drafter (joint, warm start), the goals checked against them (at least 1.5x PLD on gsm8k and above PLD on
every bench, at least 1.25x DFlash on gsm8k and humaneval). `--from` adds the rows of earlier grids for the proposers
this grid did not measure (e.g. prompt lookup, whose T=0 runs the greedy text fixes, or a drafter trained and
measured on the same prompts before), each given as its summary.csv or as its acceptance.sh work folder, whose
training logs then also give those drafters' training records; the JSON names them under "from".
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import pandas as pd
from omegaconf import OmegaConf

SETTING = {"temperature": 0.0, "block_size": 16}


def taus(summary: pd.DataFrame) -> dict[str, dict[str, float]]:
    """{bench: {draft: tau}} at T=0, block 16; a drafter with a selector is taken with it on (its rows with it off
    measure another proposer), one without (DFlash) or prompt lookup as it is."""
    rows = summary[(summary.temperature == SETTING["temperature"]) & (summary.block_size == SETTING["block_size"])]
    on = rows.selector.astype(str).isin(["True", "true", "1", "1.0"])
    out: dict[str, dict[str, float]] = {}
    for row, _on in sorted(zip(rows.itertuples(), on, strict=True), key=lambda r: r[1]):
        out.setdefault(row.bench, {})[row.draft] = float(row.tau)  # the selector-on row, sorted last, wins
    return out


def training(log: Path, batch_size: int | None) -> dict[str, Any]:
    """Steps, minutes, conversations seen and epochs from a train.py log (its summary and its data lines); neither of
    the last two without the run's batch size."""
    text = log.read_text()
    steps = re.findall(r"steps\s+(\d+) in ([0-9.]+) min", text)
    chats = re.findall(r"(\d+) training and \d+ validation chats", text)
    out: dict[str, Any] = {"log": str(log)}
    if steps:
        out["steps"], out["minutes"] = int(steps[-1][0]), float(steps[-1][1])
        if batch_size:
            out["conversations"] = out["steps"] * batch_size
            if chats:
                out["epochs"] = out["conversations"] / int(chats[-1])
    return out


def goals(table: dict[str, dict[str, float]], draft: str) -> dict[str, Any]:
    """The goals for one DFlash2 drafter (`dflash2` or `dflash2_warm`)."""

    def ratio(bench: str, a: str, b: str) -> float | None:
        row = table.get(bench, {})
        return row[a] / row[b] if a in row and b in row else None

    vs_pld = {bench: ratio(bench, draft, "pld") for bench in table}
    return {
        "over_pld": vs_pld,
        "over_dflash": {bench: ratio(bench, draft, "dflash") for bench in table},
        "gsm8k_1.5x_pld": (vs_pld.get("gsm8k") or 0) >= 1.5,
        "above_pld_everywhere": bool(vs_pld) and all((r or 0) > 1 for r in vs_pld.values()),
        "1.25x_dflash_gsm8k_humaneval": all((ratio(b, draft, "dflash") or 0) >= 1.25 for b in ("gsm8k", "humaneval")),
    }


def summary_of(path: Path) -> Path:
    """An earlier grid's summary.csv: the file given, or the one in the work folder given."""
    return path / "sweeps" / "summary.csv" if path.is_dir() else path


def merged(summary: pd.DataFrame, earlier: list[Path]) -> pd.DataFrame:
    """The grid's rows, then each earlier summary's rows of the proposers that neither the grid nor a file before it
    measured (their `draft` column)."""
    frames, have = [summary], set(summary.draft)
    for path in earlier:
        rows = pd.read_csv(summary_of(path))
        frames.append(rows[~rows.draft.isin(have)])
        have |= set(rows.draft)
    return pd.concat(frames, ignore_index=True)


def record(work: Path, name: str) -> dict[str, Any]:
    """A drafter's training record from a work folder: its log's figures, its data and its train.py command."""
    log, hydra = work / f"train.{name}.log", work / "runs" / name / ".hydra"
    config = hydra / "config.yaml"
    data = OmegaConf.load(config).data if config.is_file() else None
    out = training(log, int(data.batch_size) if data else None) if log.is_file() else {}
    if data and "path" in data:  # the file validated on, then the training-only ones
        out["data"] = ", ".join([str(data.path), *map(str, data.get("extra_paths") or [])])
    overrides = hydra / "overrides.yaml"
    if overrides.is_file():
        out["command"] = "python train.py " + " ".join(
            line.removeprefix("- ").strip() for line in overrides.read_text().splitlines() if line.strip()
        )
    return out


def build(work: Path, drafters: list[str], earlier: list[Path] | None = None) -> dict[str, Any]:
    earlier = earlier or []
    table = taus(merged(pd.read_csv(work / "sweeps" / "summary.csv"), earlier))
    folders = [work, *(path for path in earlier if path.is_dir())]
    runs = {}
    for name in drafters:  # from the first folder that trained it
        home = next((f for f in folders if (f / f"train.{name}.log").is_file()), work)
        runs[name] = record(home, name)
    dflash2 = [name for name in drafters if name.startswith("dflash2")]
    result = {"setting": SETTING, "tau": table, "training": runs, "goals": {d: goals(table, d) for d in dflash2}}
    if earlier:
        result["from"] = [str(path) for path in earlier]
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path)
    parser.add_argument("--drafters", default="dflash,dflash2,dflash2_warm")
    parser.add_argument("--from", dest="earlier", nargs="*", type=Path, default=[], metavar="CSV_OR_WORK_DIR")
    args = parser.parse_args(argv)
    result = build(args.work, [d for d in args.drafters.split(",") if d], args.earlier)
    (args.work / "acceptance_vs_pld.json").write_text(json.dumps(result, indent=2) + "\n")
    names = ["pld", *[d for d in args.drafters.split(",") if d]]
    print("bench      " + " ".join(f"{n:>12}" for n in names))
    for bench, row in result["tau"].items():
        print(f"{bench:<10} " + " ".join(f"{row[n]:>12.3f}" if n in row else f"{'-':>12}" for n in names))
    return result


if __name__ == "__main__":
    main()
