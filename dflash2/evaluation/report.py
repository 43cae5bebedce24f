"""What one evaluation run reports: the table `evaluate.py` logs, and its W&B run (acceptance curve, histogram)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


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
    if r.get("baseline"):
        b = r["baseline"]
        lines.append(
            f"target alone: {b['tokens_per_s']:.1f} tokens/s, speed-up {b['speedup']:.3f}x"
            + (f" (median of {len(b['tokens_per_s_passes'])} passes)" if len(b["tokens_per_s_passes"]) > 1 else "")
            + (f", identical greedy outputs {b['identical_outputs']:.0%}" if "identical_outputs" in b else "")
        )
    return "\n".join(lines)


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
    )
    run.finish()
