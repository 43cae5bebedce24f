"""Reading what a study's commands left: the grid's taus, each training's log and validations, the probes' budgets, the
copy gap of each T=0 run. For `study.from`, work folders laid out as sweeps/summary.csv and train.<name>.log read too.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from dflash2.studies.plan import ROOT

SETTING = {"temperature": 0.0, "block_size": 16}  # the cell every study's table reports
VAL_METRICS = ("tau_sim", "acc_1", "acc_2", "loss_ce", "loss_distill")  # and the last slot's acc_k (acc_15 at B=16)
GAP_KEYS = ("steps", "copyable_share", "tau_copyable", "tau_other", "lookup_tau_copyable")


def card() -> str:
    """The GPU the study ran on, or "cpu"."""
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def taus(summary: pd.DataFrame) -> dict[str, dict[str, float]]:
    """{bench: {draft: tau}} at T=0, block 16; a drafter with a selector is taken with it on (its rows with it off
    measure another proposer), one without (DFlash) or prompt lookup as it is."""
    rows = summary[(summary.temperature == SETTING["temperature"]) & (summary.block_size == SETTING["block_size"])]
    on = rows.selector.astype(str).isin(["True", "true", "1", "1.0"])
    out: dict[str, dict[str, float]] = {}
    for row, _on in sorted(zip(rows.itertuples(), on, strict=True), key=lambda r: r[1]):
        out.setdefault(row.bench, {})[row.draft] = float(row.tau)  # the selector-on row, sorted last, wins
    return out


def by_draft(table: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """{bench: {draft: tau}} -> {draft: {bench: tau}}."""
    out: dict[str, dict[str, float]] = {}
    for bench, row in table.items():
        for draft, tau in row.items():
            out.setdefault(draft, {})[bench] = tau
    return out


def summary_of(path: Path) -> Path:
    """An earlier grid's summary.csv: the file given, or the one in the work folder given (a study's evaluate/, or a
    sweeps/ folder)."""
    if not path.is_dir():
        return path
    return next((p for p in (path / "evaluate" / "summary.csv", path / "sweeps" / "summary.csv") if p.is_file()), path)


def merged(summary: pd.DataFrame, earlier: list[Path]) -> pd.DataFrame:
    """The grid's rows, then each earlier summary's rows of the proposers that neither the grid nor a file before it
    measured (their `draft` column)."""
    frames, have = [summary], set(summary.draft)
    for path in earlier:
        rows = pd.read_csv(summary_of(path))
        frames.append(rows[~rows.draft.isin(have)])
        have |= set(rows.draft)
    return pd.concat(frames, ignore_index=True)


def training(log: Path, batch_size: int | None) -> dict[str, Any]:
    """Steps, minutes, conversations seen and epochs from a train.py log (its summary and its data lines); neither of
    the last two without the run's batch size. A resumed run's steps are the run's in all (its summary's `N in all`),
    its minutes those of its last part."""
    text = log.read_text()
    steps = re.findall(r"steps\s+(\d+) in ([0-9.]+) min(?: \(resumed at step \d+: (\d+) in all\))?", text)
    chats = re.findall(r"(\d+) training and \d+ validation chats", text)
    out: dict[str, Any] = {"log": str(log)}
    if steps:
        trained, minutes, in_all = steps[-1]
        out["steps"], out["minutes"] = int(in_all or trained), float(minutes)
        if batch_size:
            out["conversations"] = out["steps"] * batch_size
            if chats:
                out["epochs"] = out["conversations"] / int(chats[-1])
    return out


def train_log(work: Path, name: str) -> Path:
    """A drafter's train.py output: a study's logs/train.<name>.log, or a train.<name>.log at the folder's root."""
    return next((p for p in (work / "logs" / f"train.{name}.log", work / f"train.{name}.log") if p.is_file()), work)


def record(work: Path, name: str, commands: dict[str, str] | None = None) -> dict[str, Any]:
    """A drafter's training record from a work folder: its log's figures, its data and its train.py command (as the
    study ran it, else from the run's Hydra record)."""
    log, hydra = train_log(work, name), work / "runs" / name / ".hydra"
    config = hydra / "config.yaml"
    data = (yaml.safe_load(config.read_text()) or {}).get("data") if config.is_file() else None
    out = training(log, int(data["batch_size"]) if data else None) if log.is_file() else {}
    if data and "path" in data:  # the file validated on, then the training-only ones
        out["data"] = ", ".join([str(data["path"]), *map(str, data.get("extra_paths") or [])])
    overrides = hydra / "overrides.yaml"
    if commands and f"train.{name}" in commands:
        out["command"] = commands[f"train.{name}"]
    elif overrides.is_file():
        out["command"] = "python train.py " + " ".join(
            line.removeprefix("- ").strip() for line in overrides.read_text().splitlines() if line.strip()
        )
    return out


def final_validation(run_dir: Path) -> dict[str, Any]:
    """The last validation of a run, from the CSV logger's metrics.csv (one per version: a resume adds one). Its
    `step` column is Lightning's count of logged batches, one behind the global step inside a fit: the steps come
    from train.log (`train_summary`)."""
    files = sorted(run_dir.glob("csv/version_*/metrics.csv"), key=lambda f: int(f.parent.name.split("_")[1]))
    rows = pd.concat([pd.read_csv(f) for f in files], ignore_index=True) if files else pd.DataFrame()
    rows = rows.dropna(subset=["val/tau_sim"]) if "val/tau_sim" in rows else rows.iloc[:0]
    if rows.empty:
        return {}
    last = rows.iloc[-1]  # versions in order (version_10 after version_9), rows in the order they were logged
    slots = sorted((c for c in rows.columns if re.fullmatch(r"val/acc_\d+", c)), key=lambda c: int(c.split("_")[1]))
    names = [f"val/{m}" for m in VAL_METRICS] + slots[-1:]
    return {n.removeprefix("val/"): _num(last.get(n)) for n in names}


def train_summary(run_dir: Path) -> dict[str, Any]:
    """The global step and wall time at the end of the run's last training (train.log: `steps  N in X min`); a
    resumed run's minutes are those of its last part."""
    log = run_dir / "train.log"
    found = re.findall(r"steps +(\d+) in ([0-9.]+) min", log.read_text()) if log.is_file() else []
    if not found:
        return {"steps": None, "train_minutes": None}
    return {"steps": int(found[-1][0]), "train_minutes": float(found[-1][1])}


def budget(work: Path, name: str) -> dict[str, Any]:
    """A drafter's budget and its probe (WORK_DIR/budgets.json), when steps=auto sized it."""
    found = (json.loads((work / "budgets.json").read_text()) if (work / "budgets.json").is_file() else {}).get(name)
    if not found:
        return {}
    probe = {
        k: found.get(k) for k in ("steps_per_s", "warmup_s", "validation_s", "val_every", "skip", "measured_steps")
    }
    return {
        "budget_minutes": found["minutes"],
        "max_steps": found["max_steps"],
        "probe": probe | {"margin": found["margin"], "command": found["probe_command"]},
    }


def copy_gap(run_dir: Path, results: dict[str, Any]) -> dict[str, Any] | None:
    """The copy gap of a T=0 drafter run: results.json's `copy_gap`, else replayed from its samples by
    benchmarks/copy_gap.py (`run_gap`); None for prompt lookup and T > 0, where there is nothing to replay."""
    if "copy_gap" in results:
        return results["copy_gap"]
    script = _copy_gap_script()
    lookup = script.PromptLookup()
    gap = script.run_gap(run_dir, lookup)
    return None if gap is None else {k: gap[k] for k in GAP_KEYS} | {"lookup": vars(lookup)}


def _copy_gap_script() -> Any:
    """benchmarks/copy_gap.py, a script of the repository (no package), loaded once."""
    if "benchmarks_copy_gap" not in sys.modules:
        spec = importlib.util.spec_from_file_location("benchmarks_copy_gap", ROOT / "benchmarks" / "copy_gap.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules["benchmarks_copy_gap"] = module
        spec.loader.exec_module(module)
    return sys.modules["benchmarks_copy_gap"]


def _num(value: Any) -> float | None:
    return None if value is None or pd.isna(value) else float(value)
