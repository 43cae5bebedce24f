"""The variants of benchmarks/ablation.sh and its table (what makes a drafter good at a fixed budget).

python benchmarks/ablation.py variants STEPS VAL [NAMES]   one line per variant: name, steps, validation interval,
                                                           then its train.py overrides
python benchmarks/ablation.py tokenize OVERRIDES...       fill the data cache once, for every run to read
python benchmarks/ablation.py table WORK_DIR [NAME,...]   WORK_DIR/ablation.json and the table on stdout

Every variant is the DFlash2 baseline (`experiment=gpu_smollm2`) with one thing changed, trained for the same steps on
the same data; plain DFlash is the reference below it and prompt lookup (PLD, training-free) the one beside it.
The budget is the data seen: STEPS is the baseline's count, and a variant with another `data.batch_size` trains and
validates at the same conversations (e.g. 4x more steps of 4), so every row has seen the same epochs.
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path
from typing import Any

import pandas as pd

VARIANTS: dict[str, list[str]] = {
    "dflash2": [],
    "sliding256": ["draft.layer_types=[sliding_attention,full_attention]", "draft.sliding_window=256"],
    "feature_scaling": ["module.feature_scaling=true"],
    "init_std002": ["module.init_std=0.02"],
    "betas0999": ["optim.betas=[0.9,0.999]"],
    "lr2x": ["optim.lr=1.2e-3"],
    "layers3": ["draft.num_hidden_layers=3", "draft.target_layer_ids=[1,14,27]"],
    "layers5": ["draft.num_hidden_layers=5", "draft.target_layer_ids=[1,8,14,20,27]"],
    "layers8": ["draft.num_hidden_layers=8", "draft.target_layer_ids=[1,5,8,12,16,20,23,27]"],
    "decay": ["objective.position_weights=decay"],  # the published slot weights; the recipe's are D-PACE's
    "distill1": ["objective.distill=1.0"],
    "distill05": ["objective.distill=0.5"],
    "selector_alpha05": ["objective.selector_alpha=0.5"],
    "selector_ramp": ["objective.selector_ramp_steps=600"],
    "batch4": ["data.batch_size=4"],  # the recipe's batch before 2026-12-02
    "dflash": ["draft=dflash"],
    # The warm start: only the conv and the selector train, on the DFlash export that ablation.sh's DFLASH_EXPORT names
    # (it replaces the placeholder).
    "warm": ["module.init_from=@DFLASH_EXPORT@", "module.train_backbone=false"],
}
BASELINE, PLD = "dflash2", "pld"
EXPERIMENT = Path(__file__).resolve().parents[1] / "configs" / "experiment" / "gpu_smollm2.yaml"
VAL_METRICS = ("tau_sim", "acc_1", "acc_2", "loss_ce", "loss_distill")  # and the last slot's acc_k (acc_15 at block 16)


def chosen(names: str | None) -> dict[str, list[str]]:
    """The variants named in a comma-separated list (all when empty), in the table's order."""
    wanted = [n for n in (names or "").split(",") if n] or list(VARIANTS)
    unknown = sorted(set(wanted) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"VARIANTS: unknown {unknown}; choose from {','.join(VARIANTS)}")
    return {n: VARIANTS[n] for n in VARIANTS if n in wanted}


def batch_size(overrides: list[str]) -> int:
    """Conversations per step of a variant: its `data.batch_size` override, else the experiment's."""
    from omegaconf import OmegaConf

    given = [int(o.split("=", 1)[1]) for o in overrides if o.startswith("data.batch_size=")]
    return given[-1] if given else int(OmegaConf.load(EXPERIMENT).data.batch_size)


def schedule(overrides: list[str], steps: int, val: int) -> tuple[int, int]:
    """(max_steps, val_check_interval) that see the conversations of the baseline's `steps` and `val`."""
    base, batch = batch_size([]), batch_size(overrides)
    if (steps * base) % batch or (val * base) % batch:
        raise SystemExit(
            f"STEPS={steps}, VAL={val}: both must be multiples of {batch // math.gcd(batch, base)}, so "
            f"that data.batch_size={batch} sees as many conversations as {base} per step"
        )
    return steps * base // batch, val * base // batch


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


def measured_tau(sweep_dir: Path) -> dict[str, float]:
    """bench -> measured tau of an evaluation sweep (its runs' results.json)."""
    from dflash2.evaluation.sweep import load_runs

    return {r["bench"]: float(r["tau"]) for r in load_runs(sweep_dir)} if sweep_dir.is_dir() else {}


def collect(work_dir: Path, variants: dict[str, list[str]]) -> dict[str, Any]:
    rows = []
    for name, overrides in variants.items():
        run = work_dir / "runs" / name
        rows.append(
            {
                "name": name,
                "overrides": overrides,
                "batch_size": batch_size(overrides),
                **train_summary(run),
                **final_validation(run),
                "tau": measured_tau(work_dir / "sweeps" / name),
            }
        )
    return {"variants": rows, PLD: {"tau": measured_tau(work_dir / "sweeps" / PLD)}}


def table(result: dict[str, Any]) -> pd.DataFrame:
    """One row per variant (and PLD): the final validation, its change from the baseline, the measured tau."""
    rows = [{k: v for k, v in r.items() if k not in ("overrides", "tau")} | r["tau"] for r in result["variants"]]
    frame = pd.DataFrame(rows).set_index("name")
    for column in ("batch_size", "steps"):
        if column in frame:
            frame[column] = frame[column].astype("Int64")
    base = frame["tau_sim"].get(BASELINE) if "tau_sim" in frame else None
    if base is not None and pd.notna(base):
        frame.insert(frame.columns.get_loc("tau_sim") + 1, "d_tau_sim", frame["tau_sim"] - base)
    pld = pd.DataFrame([result[PLD]["tau"]], index=[PLD]) if result[PLD]["tau"] else None
    return frame if pld is None else pd.concat([frame, pld])


def tokenize(overrides: list[str]) -> None:
    """Render and cache the chats as `train.py OVERRIDES` would, so that the runs started together only read it."""
    from hydra import compose, initialize_config_dir

    from dflash2.training.run import build_data, register_resolvers, target_and_draft

    register_resolvers()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    build_data(cfg, *target_and_draft(cfg)).prepare_data()


def main(argv: list[str]) -> None:
    command, args = (argv[0], argv[1:]) if argv else ("", [])
    if command == "variants" and len(args) >= 2:
        for name, overrides in chosen(args[2] if len(args) > 2 else None).items():
            print(name, *schedule(overrides, int(args[0]), int(args[1])), *overrides)
    elif command == "tokenize":
        tokenize(args)
    elif command == "table" and args:
        work_dir = Path(args[0])
        result = collect(work_dir, chosen(args[1] if len(args) > 1 else None))
        (work_dir / "ablation.json").write_text(json.dumps(result, indent=2) + "\n")
        print(table(result).to_string(float_format="{:.3f}".format))
        print(f"wrote {work_dir / 'ablation.json'}")
    else:
        raise SystemExit(__doc__)


def _num(value: Any) -> float | None:
    return None if value is None or pd.isna(value) else float(value)


if __name__ == "__main__":
    main(sys.argv[1:])
