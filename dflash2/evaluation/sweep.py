"""The summary of an evaluation sweep: one CSV row per run and its plots, written into the sweep folder.

`python evaluate.py -m ...` calls `summarize_sweep` once every run has finished (the command's Hydra callback,
dflash2/commands/evaluate.py); it does the same for any folder of runs, e.g. after adding runs by hand. A value a run
cannot have (tau_gap away from the drafter's trained block size, the copy gap of prompt lookup or at T > 0, ...) is
an empty cell, and the row's `note` says why (`dflash2.evaluation.report.missing`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pandas as pd

from dflash2.evaluation.report import COPY_GAP_KEYS, HYBRID_KEYS, NOT_HYBRID, hybrid_values, missing

log = logging.getLogger(__name__)
# matplotlib is imported by the functions that plot: 0.3 s that every evaluate.py start would pay otherwise, and its
# backend (Agg, summarize_sweep) must be chosen before pyplot is imported.

SUMMARY_CSV = "summary.csv"
TAU_PLOT = "tau_by_bench.png"
CURVE_PLOT = "per_position_accept.png"
COPY_GAP_PLOT = "copy_gap.png"  # only when some run has a copy gap
HYBRID_PLOT = "hybrid.png"  # only when some run is a hybrid's
NOTE_SEPARATOR = "; "  # between the reasons of a row's note
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
    *COPY_GAP_KEYS,
    *HYBRID_KEYS,
    "num_prompts",
    "num_steps",
    "num_tokens",
    "tokens_per_s",
    "setting",
    "note",
]


def summary_columns(hybrid: bool) -> list[str]:
    """summary.csv's columns: the hybrid's split of the steps only where some run is a hybrid's."""
    return COLUMNS if hybrid else [c for c in COLUMNS if c not in HYBRID_KEYS]


def setting_label(row: dict[str, Any]) -> str:
    """What distinguishes runs on one bench: temperature, block size, selector (and the draft when several).
    `selector` None: nothing to switch (prompt lookup)."""
    return f"T={row['temperature']:g} B={row['block_size']}{' no-selector' if row['selector'] is False else ''}"


def draft_label(draft: dict[str, Any]) -> str:
    """results.json's `draft` as a proposer's name: the drafter's folder, `<folder>+lookup` with prompt lookup beside
    it (hybrid), or pld."""
    return draft["name"] + ("+lookup" if draft.get("hybrid") else "")


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
        row.update(draft=draft_label(r["draft"]), selector=r["draft"]["selector"])
        row.update({k: (r.get("copy_gap") or {}).get(k) for k in COPY_GAP_KEYS})
        row.update(hybrid_values(r))
        row["setting"] = setting_label(row)
        row["note"] = NOTE_SEPARATOR.join(missing(r))
        rows.append(row)
    hybrid = any(r.get("proposers") for r in runs)
    for r, row in zip(runs, rows, strict=True):  # the hybrid columns only where some run has them
        if hybrid and not r.get("proposers"):
            row["note"] = NOTE_SEPARATOR.join(filter(None, [row["note"], NOT_HYBRID]))
    table = pd.DataFrame(rows, columns=summary_columns(hybrid))
    numbers = ["tau", "tau_sim", "tau_gap", *COPY_GAP_KEYS, *(HYBRID_KEYS if hybrid else ()), "tokens_per_s"]
    table[numbers] = table[numbers].astype(float)  # None -> NaN: a column of them all is still numbers
    if table["draft"].nunique() > 1:
        table["setting"] = table["draft"] + " " + table["setting"]
    return table


def format_summary(table: pd.DataFrame) -> str:
    """The summary as the log shows it: "-" for an empty cell, and below the table why each is empty, with the rows
    (the table's index) it applies to."""
    shown = table.drop(columns=["run", "setting", "note"])
    shown["selector"] = shown["selector"].map(lambda on: "-" if on is None or pd.isna(on) else str(on).lower())
    with pd.option_context("display.width", 250, "display.max_columns", 30):
        lines = [shown.to_string(na_rep="-")]
    rows: dict[str, list[str]] = {}
    for index, note in zip(table.index, table["note"], strict=True):
        for reason in filter(None, note.split(NOTE_SEPARATOR)):
            rows.setdefault(reason, []).append(str(index))
    lines += [f"- {reason} (rows {', '.join(at)})" for reason, at in rows.items()]
    return "\n".join(lines)


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


def copy_gap_figure(table: pd.DataFrame) -> Any:
    """Per bench, each greedy drafter run's tau on the steps prompt lookup would have copied and on the others,
    beside the lookup's own tau on the copyable ones; None when no run has a copy gap."""
    rows = table[table["copyable_share"].notna()]
    if rows.empty:
        return None
    bars = {
        "drafter, copyable steps": "tau_copyable",
        "drafter, other steps": "tau_other",
        "prompt lookup, copyable steps": "lookup_tau_copyable",
    }
    return bars_by_bench(
        rows, "copyable_share", "{:.0%} copyable", bars,
        "copy gap: where prompt lookup would have had a proposal accepted (T=0)",
    )  # fmt: skip


def hybrid_figure(table: pd.DataFrame) -> Any:
    """Per bench, each hybrid run's tau, its lookup's and its drafter's on their own steps, and lookup's share of the
    steps; None when no run is a hybrid's."""
    if "lookup_share" not in table:
        return None
    bars = {"hybrid, all steps": "tau", "lookup's steps": "tau_lookup", "drafter's steps": "tau_drafter"}
    return bars_by_bench(
        table[table["lookup_share"].notna()], "lookup_share", "lookup {:.0%}", bars,
        "hybrid: prompt lookup's steps and the drafter's (share of steps under each label)",
    )  # fmt: skip


def bars_by_bench(rows: pd.DataFrame, share: str, shown: str, bars: dict[str, str], title: str) -> Any:
    """One panel per bench, in it a group of bars per run (`bars`: legend -> column), labelled with its setting and
    its `share` column as `shown` formats it."""
    import matplotlib.pyplot as plt

    benches = sorted(rows["bench"].unique())
    widest = max((rows["bench"] == b).sum() for b in benches)
    fig, axes = plt.subplots(1, len(benches), figsize=(max(4.5, 1.6 * widest + 1.5) * len(benches), 4), squeeze=False)
    for ax, bench in zip(axes[0], benches, strict=True):
        runs = rows[rows["bench"] == bench]
        labels = [f"{s}\n{shown.format(v)}" for s, v in zip(runs["setting"], runs[share], strict=True)]
        pd.DataFrame({name: runs[column].to_numpy() for name, column in bars.items()}, index=labels).plot.bar(
            ax=ax, rot=0, legend=False
        )
        ax.set_title(bench)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.tick_params(axis="x", labelsize="small")
    axes[0, 0].set_ylabel("tau (committed tokens per verify step)")
    axes[0, -1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def save_figure(fig: Any, path: Path) -> bool:
    """`fig` to `path`; no figure removes an earlier summary's file of that name (of runs no longer there)."""
    import matplotlib.pyplot as plt

    if fig is None:
        path.unlink(missing_ok=True)
        return False
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def summarize_sweep(sweep_dir: str | Path) -> pd.DataFrame:
    """Write summary.csv, tau_by_bench.png, per_position_accept.png and, when some run has one, copy_gap.png and
    hybrid.png into sweep_dir; returns the table."""
    import matplotlib

    matplotlib.use("Agg")
    sweep_dir = Path(sweep_dir)
    runs = load_runs(sweep_dir)
    if not runs:
        raise FileNotFoundError(f"no results.json under {sweep_dir}: did the sweep's runs fail?")
    table = summary_table(runs)
    table.to_csv(sweep_dir / SUMMARY_CSV, index=False)
    save_figure(tau_figure(table), sweep_dir / TAU_PLOT)
    plot_curves(runs, table, sweep_dir / CURVE_PLOT)
    save_figure(copy_gap_figure(table), sweep_dir / COPY_GAP_PLOT)
    save_figure(hybrid_figure(table), sweep_dir / HYBRID_PLOT)
    return table


def plots_written(sweep_dir: str | Path) -> list[str]:
    """The plots of the summary in `sweep_dir`, by name."""
    return [name for name in (TAU_PLOT, CURVE_PLOT, COPY_GAP_PLOT, HYBRID_PLOT) if (Path(sweep_dir) / name).is_file()]
