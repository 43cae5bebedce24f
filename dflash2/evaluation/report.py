"""What one evaluation run reports: the table `evaluate.py` logs, and its W&B run (acceptance curve, histogram).

A value a run cannot have is left out, never shown as NaN, and `missing` says why: the table prints it, and the
sweep's summary (`dflash2.evaluation.sweep`) writes it in its `note` column.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dflash2.evaluation.copy_gap import replayable

COPY_GAP_KEYS = ("copyable_share", "tau_copyable", "tau_other", "lookup_tau_copyable")  # its numbers, steps aside


def missing(results: dict[str, Any]) -> list[str]:
    """Every value of results.json that the run cannot have, with the reason, e.g. "no tau_gap: ..."."""
    r, draft, gap = results, results["draft"], results.get("copy_gap")
    why, no_gap = [], f"no copy gap ({', '.join(COPY_GAP_KEYS)})"
    if draft["architecture"] == "PromptLookup":
        why.append("no selector, tau_sim, tau_gap: prompt lookup is not trained")
    elif r.get("tau_sim") is None:
        why.append("no tau_sim, tau_gap: the drafter's export records no tau_sim")
    elif r.get("tau_gap") is None:
        why.append(
            f"no tau_gap: tau_sim is measured at the drafter's trained block size {draft['trained_block_size']}, "
            f"not at {r['block_size']}"
        )
    if draft["architecture"] == "PromptLookup":
        why.append(f"{no_gap}: this is prompt lookup's own run, the one the gap replays")
    elif not replayable(draft, r["temperature"]):
        why.append(f"{no_gap}: at T > 0 the output depends on what was proposed, so no step can be replayed")
    elif gap is None:  # a greedy drafter run always records it: this results.json was written before it did
        why.append(f"{no_gap}: results.json predates it (python benchmarks/copy_gap.py replays the samples)")
    elif gap["steps"] == 0:
        why.append("no tau_copyable, tau_other, lookup_tau_copyable: the run has no verify step")
    else:
        if gap["tau_copyable"] is None:
            why.append("no tau_copyable, lookup_tau_copyable: no step was copyable")
        if gap["tau_other"] is None:
            why.append("no tau_other: every step was copyable")
    if r.get("tokens_per_s") is None:
        why.append("no tokens_per_s: no timed pass took measurable time")
    return why


def copy_gap_line(gap: dict[str, Any]) -> str:
    """The copy gap in one line of the run's table."""

    def tau(key: str) -> str:
        return "-" if gap[key] is None else f"{gap[key]:.2f}"

    return (
        f"copyable steps {gap['copyable_share']:.0%} (lookup would accept): drafter tau {tau('tau_copyable')} there, "
        f"{tau('tau_other')} elsewhere; lookup {tau('lookup_tau_copyable')} there"
    )


def format_table(results: dict[str, Any]) -> str:
    r = results
    tau_sim = "-" if r.get("tau_sim") is None else f"{r['tau_sim']:.3f}"
    speed = "-" if r.get("tokens_per_s") is None else f"{r['tokens_per_s']:.1f}"
    head = ["bench", "draft", "selector", "T", "B", "prompts", "steps", "tau", "tau_sim", "tokens/s"]
    row = [
        r["bench"],
        r["draft"]["name"],
        "-" if r["draft"]["selector"] is None else str(r["draft"]["selector"]).lower(),
        f"{r['temperature']:g}",
        str(r["block_size"]),
        str(r["num_prompts"]),
        str(r["num_steps"]),
        f"{r['tau']:.3f}",
        tau_sim,
        speed,
    ]
    widths = [max(len(a), len(b)) for a, b in zip(head, row, strict=True)]
    lines = ["  ".join(a.ljust(w) for a, w in zip(cells, widths, strict=True)) for cells in (head, row)]
    curve = " ".join(f"{a:.2f}" for a in r["per_position_accept"])
    lines += [
        f"acceptance by slot 1..{r['block_size'] - 1}: {curve}",
        f"committed-length histogram 1..{r['block_size']}: {r['accept_hist']}",
    ]
    if r.get("copy_gap") and r["copy_gap"]["steps"]:
        lines.append(copy_gap_line(r["copy_gap"]))
    if r.get("baseline"):
        b = r["baseline"]
        lines.append(
            f"target alone: {b['tokens_per_s']:.1f} tokens/s, speed-up {b['speedup']:.3f}x"
            + (f" (median of {len(b['tokens_per_s_passes'])} passes)" if len(b["tokens_per_s_passes"]) > 1 else "")
            + (f", identical greedy outputs {b['identical_outputs']:.0%}" if "identical_outputs" in b else "")
        )
    return "\n".join(lines + missing(r))


def log_wandb(cfg: DictConfig, results: dict[str, Any], run_dir: str | Path) -> None:
    """One W&B run per evaluation (offline unless WANDB_MODE says otherwise), files under the run folder."""
    import wandb

    name = (
        f"{results['bench']}-T{results['temperature']:g}-B{results['block_size']}"
        f"{'-noselector' if results['draft']['selector'] is False else ''}"
    )
    run = wandb.init(
        project=cfg.wandb.project,
        name=name,
        dir=str(run_dir),
        job_type="evaluate",
        mode=os.environ.get("WANDB_MODE", cfg.wandb.mode),
        config=OmegaConf.to_container(cfg, resolve=True),
        reinit="finish_previous",
    )
    curve = wandb.Table(
        columns=["slot", "accept_rate"], data=[[k + 1, a] for k, a in enumerate(results["per_position_accept"])]
    )
    hist = wandb.Table(columns=["committed", "steps"], data=[[n + 1, c] for n, c in enumerate(results["accept_hist"])])
    run.log(
        {
            "acceptance_curve": wandb.plot.line(curve, "slot", "accept_rate", title="acceptance by slot"),
            "accept_hist": wandb.plot.bar(hist, "committed", "steps", title="committed tokens per step"),
            "acceptance_table": curve,
        }
    )
    run.summary.update(
        {
            k: results[k]
            for k in ("tau", "tau_sim", "tau_gap", "num_steps", "num_prompts", "tokens_per_s")
            if results.get(k) is not None
        }
        | {f"baseline/{k}": v for k, v in results.get("baseline", {}).items() if k in ("tokens_per_s", "speedup")}
        | {f"copy_gap/{k}": v for k, v in (results.get("copy_gap") or {}).items() if k != "lookup" and v is not None}
    )
    run.finish()
