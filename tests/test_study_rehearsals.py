"""Each study rehearsed end to end on the CPU (`python study.py study=... rehearse=true`): the real commands at tiny
sizes on the tiny random target, down to the study's JSON; then the same command again, which finds everything done.
Minutes each on 2 CPU cores: marked slow. Fewer drafters and benches than the studies' own, the paths all taken:
the probe and the budget, a warm start after its init's export, regeneration and the feature cache, batch scaling.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash2.model.config import default_target_layer_ids
from dflash2.testing import TINY_QWEN3

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]


def study(work: Path, *overrides: str) -> str:
    """`python study.py dir=WORK rehearse=true ...` as a user runs it; its output."""
    env = dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    command = [sys.executable, "study.py", f"dir={work}", "rehearse=true", *overrides]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3000)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return done.stdout + done.stderr


def rerun_runs_nothing(work: Path, *overrides: str) -> None:
    commands = (work / "commands.json").read_text()
    output = study(work, *overrides)
    assert "done before" in output and (work / "commands.json").read_text() == commands  # no command ran again


def test_the_depth_study_rehearses(tmp_path):
    overrides = ["study=depth", "study.drafters=[layers2,layers8]", "study.benches=[[gsm8k,mtbench]]"]
    study(tmp_path, *overrides)
    result = json.loads((tmp_path / "depth.json").read_text())
    depth = TINY_QWEN3["num_hidden_layers"]
    assert [(r["layers"], r["target_layer_ids"]) for r in result["depths"]] == [
        (n, default_target_layer_ids(depth, n)) for n in (2, 8)
    ]
    for row in result["depths"]:
        assert 1 <= row["steps"] <= row["max_steps"] and row["steps_per_s"] > 0 and row["minutes"] == 0.05
        assert row["tau"].keys() == {"gsm8k", "mtbench"} and all(t >= 1 for t in row["tau"].values())
        assert row["copy_gap"].keys() == {"gsm8k", "mtbench"} and 1 <= row["tau_sim"]
        command = result["commands"][f"train.{row['name']}"]
        assert (
            f"draft.num_hidden_layers={row['layers']}" in command and f"trainer.max_steps={row['max_steps']}" in command
        )
    assert result["pld"]["tau"].keys() == {"gsm8k", "mtbench"} and result["card"] == "cpu"
    rerun_runs_nothing(tmp_path, *overrides)


def test_the_acceptance_study_rehearses_with_regeneration_and_features(tmp_path):
    overrides = ["study=acceptance", "study.data.source=regenerate", "study.features=bf16", "study.benches=[[gsm8k]]"]
    study(tmp_path, *overrides)
    result = json.loads((tmp_path / "acceptance_vs_pld.json").read_text())
    assert set(result["tau"]["gsm8k"]) == {"pld", "dflash", "dflash2", "dflash2_warm"}
    for name, run in result["training"].items():
        assert run["probe"]["steps_per_s"] > 0 and 1 <= run["steps"] <= run["max_steps"], name
        assert f"data.features={tmp_path / 'features'}" in run["command"]
    assert f"module.init_from={tmp_path / 'exports' / 'dflash'}" in result["training"]["dflash2_warm"]["command"]
    assert set(result["speed"]) == {"pld", "dflash", "dflash2", "dflash2_warm"}
    assert all(s["identical_outputs"] == 1.0 for s in result["speed"].values())  # greedy: the target's own text
    assert (
        sum(1 for _ in (tmp_path / "data" / "train.jsonl").open()) == 24 and "data.regenerate.0" in result["commands"]
    )
    rerun_runs_nothing(tmp_path, *overrides)


def test_the_ablation_study_rehearses(tmp_path):
    overrides = ["study=ablation", "study.drafters=[batch4,warm]", "study.benches=[[humaneval]]"]
    study(tmp_path, *overrides)
    result = json.loads((tmp_path / "ablation.json").read_text())
    rows = {r["name"]: r for r in result["variants"]}
    assert list(rows) == ["batch4", "warm"]
    # The rehearsal's 4 steps count its batch of 2 conversations: at 4 per step the same conversations take 2 steps.
    assert rows["batch4"]["steps"] == 2 and rows["warm"]["steps"] == 4
    assert all(r["tau"].keys() == {"humaneval"} and r["tau_sim"] >= 1 for r in rows.values())
    assert "train.dflash" in result["commands"]  # the warm start's init, trained though not in the table
    assert result["pld"]["tau"].keys() == {"humaneval"}
