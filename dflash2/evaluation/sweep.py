"""The summary of an evaluation sweep: one CSV row per run and two plots, written into the sweep folder.

`python evaluate.py -m ...` calls `SweepSummary.on_multirun_end` (a Hydra callback) once every run has finished;
`summarize_sweep(<sweep dir>)` does the same for any folder of runs, e.g. after adding runs by hand.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pandas as pd
from hydra.experimental.callback import Callback

log = logging.getLogger(__name__)
# matplotlib is imported by the functions that plot: 0.3 s that every evaluate.py start would pay otherwise, and its
# backend (Agg, summarize_sweep) must be chosen before pyplot is imported.

SUMMARY_CSV = "summary.csv"
TAU_PLOT = "tau_by_bench.png"
CURVE_PLOT = "per_position_accept.png"
COLUMNS = [
    "run",
    "bench",
    "draft",
    "selector",
    "temperature",
    "block_size",
    "tau",
    "tau_sim",
    "tau_gap",
    "num_prompts",
    "num_steps",
    "num_tokens",
    "tokens_per_s",
    "setting",
]


def setting_label(row: dict[str, Any]) -> str:
    """What distinguishes runs on one bench: temperature, block size, selector (and the draft when several).
    `selector` None: nothing to switch (prompt lookup)."""
    return f"T={row['temperature']:g} B={row['block_size']}{' no-selector' if row['selector'] is False else ''}"


def load_runs(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """Every results.json under sweep_dir (any depth), sorted by its folder."""
    runs = []
    for file in sorted(Path(sweep_dir).rglob("results.json")):
        results = json.loads(file.read_text())
        results["run"] = str(file.parent.relative_to(sweep_dir))
        runs.append(results)
    return runs


def summary_table(runs: list[dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for r in runs:
        row = {k: r.get(k) for k in COLUMNS}
        row.update(draft=r["draft"]["name"], selector=r["draft"]["selector"])
        row["setting"] = setting_label(row)
        rows.append(row)
    table = pd.DataFrame(rows, columns=COLUMNS)
    if table["draft"].nunique() > 1:
        table["setting"] = table["draft"] + " " + table["setting"]
    return table


def tau_figure(table: pd.DataFrame) -> Any:
    """Bars of tau per bench and setting, each with its drafter's `tau_sim` as a tick where that predicts it."""
    import matplotlib.pyplot as plt

    pivot = table.pivot_table(index="bench", columns="setting", values="tau", aggfunc="mean")
    # tau_sim predicts tau only at the block size it was measured at, i.e. where the run has a tau_gap.
    sim = table.assign(tau_sim=table["tau_sim"].where(table["tau_gap"].notna()))
    sim = sim.pivot_table(index="bench", columns="setting", values="tau_sim", aggfunc="mean", dropna=False)
    sim = sim.reindex(index=pivot.index, columns=pivot.columns)
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * len(pivot) + 0.12 * pivot.size), 4))
    pivot.plot.bar(ax=ax, rot=0, colormap="tab20" if pivot.shape[1] > 10 else None)
    # Each bar's own drafter's teacher-forced prediction (the train/serve gap): a mean over drafters means nothing.
    for bars, setting in zip(ax.containers, pivot.columns, strict=True):
        for bar, value in zip(bars, sim[setting], strict=True):
            if pd.notna(value):
                ax.hlines(value, bar.get_x(), bar.get_x() + bar.get_width(), colors="k", lw=2)
    if sim.notna().any().any():
        ax.plot([], [], "k-", lw=2, label="tau_sim")
    ax.set_ylabel("tau (committed tokens per verify step)")
    ax.set_title("measured acceptance length")
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.legend(fontsize="small", markerscale=0.3, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    return fig


def plot_tau(table: pd.DataFrame, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig = tau_figure(table)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_curves(runs: list[dict[str, Any]], table: pd.DataFrame, path: Path) -> None:
    import matplotlib.pyplot as plt

    benches = sorted(table["bench"].unique())
    fig, axes = plt.subplots(1, len(benches), figsize=(4.5 * len(benches), 3.6), squeeze=False, sharey=True)
    for r, label in zip(runs, table["setting"], strict=True):
        ax = axes[0, benches.index(r["bench"])]
        curve = r["per_position_accept"]
        ax.plot(range(1, len(curve) + 1), curve, marker="o", ms=3, label=label)
    for ax, bench in zip(axes[0], benches, strict=True):
        ax.set_title(bench)
        ax.set_xlabel("slot k")
        ax.set_ylim(0, 1.02)
        ax.legend(fontsize="x-small")
    axes[0, 0].set_ylabel("fraction of steps accepting slot k")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize_sweep(sweep_dir: str | Path) -> pd.DataFrame:
    """Write summary.csv, tau_by_bench.png and per_position_accept.png into sweep_dir; returns the table."""
    import matplotlib

    matplotlib.use("Agg")
    sweep_dir = Path(sweep_dir)
    runs = load_runs(sweep_dir)
    if not runs:
        raise FileNotFoundError(f"no results.json under {sweep_dir}: did the sweep's runs fail?")
    table = summary_table(runs)
    table.to_csv(sweep_dir / SUMMARY_CSV, index=False)
    plot_tau(table, sweep_dir / TAU_PLOT)
    plot_curves(runs, table, sweep_dir / CURVE_PLOT)
    return table


class SweepSummary(Callback):
    """Hydra callback: summarise the sweep folder when a multirun ends."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        try:
            table = summarize_sweep(sweep_dir)
        except FileNotFoundError as e:
            log.error("%s", e)
            return
        with pd.option_context("display.width", 160, "display.max_columns", 20):
            print(table.drop(columns=["run", "setting"]).to_string(index=False))
        print(f"wrote {sweep_dir / SUMMARY_CSV}, {TAU_PLOT} and {CURVE_PLOT}")
