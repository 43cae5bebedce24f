"""What one evaluation run reports: the table `evaluate.py` logs, and its W&B run (acceptance curve, histogram).

A value a run cannot have is left out, never shown as NaN, and `missing` says why: the table prints it, and the
sweep's summary (`dflash2.evaluation.sweep`) writes it in its `note` column.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from dflash2.evaluation.copy_gap import replayable
from dflash2.evaluation.settings import EvaluationSettings

log = logging.getLogger(__name__)

COPY_GAP_KEYS = ("copyable_share", "tau_copyable", "tau_other", "lookup_tau_copyable")  # its numbers, steps aside
HYBRID_KEYS = ("lookup_share", "tau_lookup", "tau_drafter")  # a hybrid run's split of its steps (`hybrid_values`)


def missing(results: dict[str, Any]) -> list[str]:
    """Every value of results.json that the run cannot have, with the reason, e.g. "no tau_gap: ..."."""
    why = missing_tau_sim(results) + missing_copy_gap(results) + missing_proposers(results)
    if results.get("tokens_per_s") is None:
        why.append("no tokens_per_s: no timed pass took measurable time")
    return why


def missing_tau_sim(results: dict[str, Any]) -> list[str]:
    """Why a run has no tau_sim or tau_gap."""
    r, draft = results, results["draft"]
    if draft["architecture"] == "PromptLookup":
        return ["no selector, tau_sim, tau_gap: prompt lookup is not trained"]
    if r.get("tau_sim") is None:
        return ["no tau_sim, tau_gap: the drafter's export records no tau_sim"]
    if r.get("tau_gap") is None:
        return [
            f"no tau_gap: tau_sim is measured at the drafter's trained block size {draft['trained_block_size']}, "
            f"not at {r['block_size']}"
        ]
    return []


def missing_copy_gap(results: dict[str, Any]) -> list[str]:
    """Why a run has no copy gap, or some of its numbers."""
    draft, gap = results["draft"], results.get("copy_gap")
    no_gap = f"no copy gap ({', '.join(COPY_GAP_KEYS)})"
    if draft["architecture"] == "PromptLookup":
        return [f"{no_gap}: this is prompt lookup's own run, the one the gap replays"]
    if draft.get("hybrid"):
        return [f"{no_gap}: prompt lookup took its steps in this hybrid run (lookup_share, tau_lookup)"]
    if not replayable(draft, results["temperature"]):
        return [f"{no_gap}: at T > 0 the output depends on what was proposed, so no step can be replayed"]
    if gap is None:  # a greedy drafter run always records it: this results.json was written before it did
        return [f"{no_gap}: results.json predates it (python benchmarks/copy_gap.py replays the samples)"]
    if gap["steps"] == 0:
        return ["no tau_copyable, tau_other, lookup_tau_copyable: the run has no verify step"]
    why = []
    if gap["tau_copyable"] is None:
        why.append("no tau_copyable, lookup_tau_copyable: no step was copyable")
    if gap["tau_other"] is None:
        why.append("no tau_other: every step was copyable")
    return why


def hybrid_values(results: dict[str, Any]) -> dict[str, float | None]:
    """A hybrid run's HYBRID_KEYS (None each where the run is not a hybrid's, or its proposer took no step)."""
    stats = results.get("proposers") or {}
    lookup, drafter = stats.get("lookup") or {}, stats.get("drafter") or {}
    return {"lookup_share": lookup.get("share"), "tau_lookup": lookup.get("tau"), "tau_drafter": drafter.get("tau")}


NOT_HYBRID = f"no {', '.join(HYBRID_KEYS)}: not a hybrid run (hybrid=ngram: prompt lookup beside the drafter)"


def missing_proposers(results: dict[str, Any]) -> list[str]:
    """Why a hybrid run lacks one of its proposers' taus (a run of one proposer has none of HYBRID_KEYS: NOT_HYBRID,
    which a sweep's summary adds where it shows them)."""
    stats = results.get("proposers") or {}
    return [
        f"no tau_{name}: {name} took no step"
        for name in ("lookup", "drafter")
        if name in stats and stats[name]["tau"] is None
    ]


def proposers_line(stats: dict[str, dict[str, Any]]) -> str:
    """A hybrid run's split of the steps in one line of the run's table."""

    def part(name: str) -> str:
        s = stats[name]
        tau = "-" if s["tau"] is None else f"{s['tau']:.2f}"
        return f"{name} {s['share']:.0%} of the steps (tau {tau} there)"

    return "proposed by " + ", ".join(part(name) for name in ("lookup", "drafter"))


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
    if r.get("proposers"):
        lines.append(proposers_line(r["proposers"]))
    if r.get("baseline"):
        b = r["baseline"]
        lines.append(
            f"target alone: {b['tokens_per_s']:.1f} tokens/s, speed-up {b['speedup']:.3f}x"
            + (f" (median of {len(b['tokens_per_s_passes'])} passes)" if len(b["tokens_per_s_passes"]) > 1 else "")
            + (f", identical greedy outputs {b['identical_outputs']:.0%}" if "identical_outputs" in b else "")
        )
        if b.get("divergences", {}).get("differing"):
            lines.append(divergence_line(b["divergences"]))
    return "\n".join(lines + missing(r))


def divergence_line(found: dict[str, Any]) -> str:
    """The divergence report (dflash2/evaluation/divergence.py) in one line, each reply that is not a near-tie named."""
    line = (
        f"{found['differing']} of {found['replies']} greedy replies differ from the target alone's: "
        f"{found['near_ties']} at a near-tie (both margins within {found['dtype']} rounding)"
    )
    if not found["not_near_ties"]:
        return line
    named = ", ".join(
        f"{d['id']} turn {d['turn']} at token {d['position']} (margins {d['margin_speculative']}, "
        f"{d['margin_alone']}; rounding {d['rounding']:.3g})"
        for d in found["not_near_ties"]
    )
    return f"{line}; NOT near-ties, not explained by rounding: {named}"


def run_name(results: dict[str, Any]) -> str:
    """What tells one run of a sweep from another: bench, temperature, block, and the proposer's options."""
    draft = results["draft"]
    return (
        f"{results['bench']}-T{results['temperature']:g}-B{results['block_size']}"
        f"{'-noselector' if draft['selector'] is False else ''}{'-hybrid' if draft.get('hybrid') else ''}"
    )


def log_wandb(settings: EvaluationSettings, results: dict[str, Any], run_dir: str | Path) -> None:
    """One W&B run per evaluation (offline unless WANDB_MODE says otherwise), files under the run folder. W&B's own
    lines are kept off the terminal; one log line says where the run is."""
    import wandb

    run = wandb.init(
        project=settings.wandb.project,
        name=run_name(results),
        dir=str(run_dir),
        job_type="evaluate",
        mode=os.environ.get("WANDB_MODE", settings.wandb.mode),
        config=dict(settings.config),
        reinit="finish_previous",
        settings=wandb.Settings(silent=True),
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
        | {f"hybrid/{k}": v for k, v in hybrid_values(results).items() if v is not None}
    )
    where = run.dir
    run.finish()
    log.info("W&B run (%s) in %s", run.settings.mode, where)
