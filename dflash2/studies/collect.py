"""The collect stage: the grid's summary (WORK_DIR/evaluate/summary.csv and its plots), the copy gap of every T=0 run
(WORK_DIR/copy_gap.json) and the study's JSON, each with the GPU it ran on (`card`) and every command the study ran
(`commands`, as WORK_DIR/commands.json holds them):

acceptance  WORK_DIR/acceptance_vs_pld.json: per bench the T=0, B=16 tau of prompt lookup and each drafter (`tau`),
            per drafter its training (`training`: the command, its data, steps, minutes, conversations, epochs; with
            steps=auto the budget, the probe's rate and the sized max_steps), the goals of each DFlash2 drafter
            against them (`goals`), and with a speed stage each proposer's tokens/s beside the target's (`speed`)
ablation    WORK_DIR/ablation.json: per variant its overrides, batch, steps, minutes, last validation and measured
            tau, prompt lookup's beside
depth       WORK_DIR/depth.json: per depth its layers, target_layer_ids, steps, budget, step rate, last validation,
            tau and copy gap per bench, prompt lookup's tau beside
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pandas as pd

from dflash2.studies.plan import PLD, Plan
from dflash2.studies.results import (
    GAP_KEYS,
    SETTING,
    budget,
    by_draft,
    card,
    copy_gap,
    final_validation,
    merged,
    record,
    taus,
    train_log,
    train_summary,
)
from dflash2.studies.runner import read_json, write_json

log = logging.getLogger("dflash2.studies")
OUTPUT = {"acceptance": "acceptance_vs_pld.json", "ablation": "ablation.json", "depth": "depth.json"}


def collect(plan: Plan) -> dict[str, Any]:
    """Write the summary, the copy gaps and the study's JSON (OUTPUT); returns the JSON's content."""
    from dflash2.evaluation.sweep import load_runs, summarize_sweep

    work = plan.work
    summary = summarize_sweep(work / "evaluate")
    runs = load_runs(work / "evaluate")
    gaps = copy_gaps(work, runs)
    sweeps = {s.key for s in plan.sweeps}  # a sweep of other settings, run before, made none of these results
    commands = {
        k: v for k, v in read_json(work / "commands.json", {}).items() if k in sweeps or not k.startswith("evaluate.")
    }
    build = {"acceptance": acceptance, "ablation": ablation, "depth": depth}[plan.study["collect"]]
    result = build(plan, summary, gaps, commands) | {"card": card(), "commands": commands}
    write_json(work / OUTPUT[plan.study["collect"]], result)
    log.info("collect: wrote %s\n%s", work / OUTPUT[plan.study["collect"]], show(result, plan.study["collect"]))
    return result


def copy_gaps(work: Path, runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """{run folder: copy gap} of every T=0 drafter run, into WORK_DIR/copy_gap.json; a run replayed before is read
    back from there."""
    kept = {r["run"]: r for r in read_json(work / "copy_gap.json", {}).get("runs", [])}
    rows = []
    for r in runs:
        if r["draft"]["name"] == PLD or r["temperature"] != 0:
            continue
        found = kept.get(r["run"])
        if found is None:
            gap = copy_gap(work / "evaluate" / r["run"], r)
            if gap is None:
                continue
            found = {
                "run": r["run"],
                "bench": r["bench"],
                "draft": r["draft"]["name"],
                "selector": r["draft"]["selector"],
            }
            found |= {"block_size": r["block_size"], "tau": r["tau"], **gap}
        rows.append(found)
    write_json(work / "copy_gap.json", {"runs": rows})
    return {row["run"]: row for row in rows}


def at_setting(gaps: dict[str, dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """{draft: {bench: copy gap}} at T=0, B=16, a drafter's selector-on run winning as in `taus`."""
    out: dict[str, dict[str, Any]] = {}
    for row in sorted(gaps.values(), key=lambda g: bool(g["selector"])):
        if row["block_size"] == SETTING["block_size"]:
            out.setdefault(row["draft"], {})[row["bench"]] = {k: row.get(k) for k in (*GAP_KEYS, "lookup")}
    return out


def goals(table: dict[str, dict[str, float]], draft: str) -> dict[str, Any]:
    """The goals for one DFlash2 drafter (`dflash2` or `dflash2_warm`)."""

    def ratio(bench: str, a: str, b: str) -> float | None:
        row = table.get(bench, {})
        return row[a] / row[b] if a in row and b in row else None

    vs_pld = {bench: ratio(bench, draft, PLD) for bench in table}
    return {
        "over_pld": vs_pld,
        "over_dflash": {bench: ratio(bench, draft, "dflash") for bench in table},
        "gsm8k_1.5x_pld": (vs_pld.get("gsm8k") or 0) >= 1.5,
        "above_pld_everywhere": bool(vs_pld) and all((r or 0) > 1 for r in vs_pld.values()),
        "1.25x_dflash_gsm8k_humaneval": all((ratio(b, draft, "dflash") or 0) >= 1.25 for b in ("gsm8k", "humaneval")),
    }


def acceptance(plan: Plan, summary: pd.DataFrame, gaps: dict, commands: dict[str, str]) -> dict[str, Any]:
    """acceptance_vs_pld.json; `study.from` fills the proposers this grid did not measure, and the training records
    of the drafters an earlier folder trained."""
    work, earlier = plan.work, [Path(p).expanduser().absolute() for p in plan.study["from"] or []]
    table = taus(merged(summary, earlier))
    folders = [work, *(path for path in earlier if path.is_dir())]
    runs = {}
    for name in plan.evaluated:  # from the first folder that trained it
        if plan.drafters[name].given is not None:
            runs[name] = {"export": plan.drafters[name].given}
            continue
        home = next((f for f in folders if train_log(f, name).is_file()), work)
        runs[name] = record(home, name, commands if home == work else None) | budget(home, name)
    dflash2 = [name for name in plan.evaluated if name.startswith("dflash2")]
    result = {"setting": SETTING, "tau": table, "training": runs, "goals": {d: goals(table, d) for d in dflash2}}
    if earlier:
        result["from"] = [str(path) for path in earlier]
    if (work / "speed").is_dir():
        result["speed"] = speed(work / "speed")
    return result


def speed(folder: Path) -> dict[str, Any]:
    """{draft: its tokens/s and the target's alone, the speed-up, the share of identical greedy outputs}."""
    from dflash2.evaluation.sweep import load_runs

    out = {}
    for r in load_runs(folder):
        base = r.get("baseline") or {}
        out[r["draft"]["name"]] = {
            "bench": r["bench"], "temperature": r["temperature"], "block_size": r["block_size"],
            "tokens_per_s": r["tokens_per_s"], "target_tokens_per_s": base.get("tokens_per_s"),
            "speedup": base.get("speedup"), "identical_outputs": base.get("identical_outputs"),
        }  # fmt: skip
    return out


def ablation(plan: Plan, summary: pd.DataFrame, gaps: dict, commands: dict[str, str]) -> dict[str, Any]:
    tau = by_draft(taus(summary))
    rows = []
    for name in plan.evaluated:
        d, run = plan.drafters[name], plan.work / "runs" / name
        row = {"name": name, "overrides": d.variant, "batch_size": d.batch_size}
        rows.append(row | train_summary(run) | final_validation(run) | {"tau": tau.get(name, {})})
    return {"variants": rows, PLD: {"tau": tau.get(PLD, {})}}


def ablation_table(result: dict[str, Any], baseline: str = "dflash2") -> pd.DataFrame:
    """One row per variant (and PLD): the final validation, its change from the baseline, the measured tau."""
    rows = [{k: v for k, v in r.items() if k not in ("overrides", "tau")} | r["tau"] for r in result["variants"]]
    frame = pd.DataFrame(rows).set_index("name")
    for column in ("batch_size", "steps"):
        if column in frame:
            frame[column] = frame[column].astype("Int64")
    base = frame["tau_sim"].get(baseline) if "tau_sim" in frame else None
    if base is not None and pd.notna(base):
        frame.insert(frame.columns.get_loc("tau_sim") + 1, "d_tau_sim", frame["tau_sim"] - base)
    pld = pd.DataFrame([result[PLD]["tau"]], index=[PLD]) if result[PLD]["tau"] else None
    return frame if pld is None else pd.concat([frame, pld])


def depth(plan: Plan, summary: pd.DataFrame, gaps: dict, commands: dict[str, str]) -> dict[str, Any]:
    tau, gap = by_draft(taus(summary)), at_setting(gaps)
    rows = []
    for name in plan.evaluated:
        d, run = plan.drafters[name], plan.work / "runs" / name
        sized, trained = budget(plan.work, name), train_summary(run)
        rows.append(
            {
                "name": name, "layers": d.num_layers, "target_layer_ids": d.layers, "steps": trained["steps"],
                "max_steps": sized.get("max_steps"), "minutes": plan.study["minutes"],
                "train_minutes": trained["train_minutes"], "steps_per_s": sized.get("probe", {}).get("steps_per_s"),
                **final_validation(run), "tau": tau.get(name, {}), "copy_gap": gap.get(name, {}),
            }
        )  # fmt: skip
    return {"setting": SETTING, "minutes": plan.study["minutes"], "depths": rows, PLD: {"tau": tau.get(PLD, {})}}


def show(result: dict[str, Any], kind: str) -> str:
    """The study's table, for the log."""
    fmt = "{:.3f}".format
    if kind == "ablation":
        return ablation_table(result).to_string(float_format=fmt)
    if kind == "depth":
        rows = {r["name"]: {"layers": r["layers"], "steps": r["steps"], "tau_sim": r.get("tau_sim"), **r["tau"]}
                for r in result["depths"]}  # fmt: skip
        return pd.DataFrame(rows).T.to_string(float_format=fmt)
    return pd.DataFrame(result["tau"]).T.to_string(float_format=fmt)
