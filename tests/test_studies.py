"""python study.py: the plan's checks (bad settings refused before anything runs, named as typed), the budget's
arithmetic and the probe's measurement, the runner's resume, `until` and stops (with the entry points replaced by a
stand-in that writes what each would), and the collect stage on hand-made work folders.

The rehearsals of the studies on the CPU, which run the real commands, are in tests/test_study_rehearsals.py.
"""

from __future__ import annotations

import functools
import json
import logging
import random
import shlex
import subprocess
import sys
import types
from pathlib import Path

import pandas as pd
import pytest
import torch
from omegaconf import OmegaConf

from dflash2.commands import compose
from dflash2.commands.study import run_study
from dflash2.commands.study_plan import make_plan, setting_label
from dflash2.studies.budget import budget_steps, max_time, run_seconds
from dflash2.studies.collect import ablation_table, collect
from dflash2.studies.plan import Drafter, Plan
from dflash2.studies.results import merged, record, taus
from dflash2.training import step_rate

ROOT = Path(__file__).resolve().parents[1]


def study_cfg(work: Path, *overrides: str):
    return compose("study", [f"dir={work}", *overrides])


# ---------------------------------------------------------------------------------------------- budget
def most_simulated_steps(budget: float, skip: int, warmup: float, rate: float, every, validation: float) -> int:
    """The longest run that fits `budget`, stepped through as trainer.max_time counts it: the warm-up spread over the
    first `skip` steps, then 1/rate a step; a validation every `every` steps, and one at the run's last step (never
    two at one step)."""
    t, validated, fits, n = 0.0, 0, 0, 0
    while True:
        n += 1
        t += warmup / skip if n <= skip else 1 / rate
        if t + (validated + 1) * validation > budget:  # the validations before n, and the one that ends the run
            return fits
        fits = n
        if every and n % every == 0:  # a run going on past n validated at n
            validated += 1


def test_budget_steps_by_hand():
    plain = {"skip": 0, "steps_per_s": 10.0, "warmup_s": 0.0, "validation_s": 0.0, "val_every": None}
    assert budget_steps(plain, minutes=1, margin=1.0) == 600  # floor(rate x budget x margin)
    assert budget_steps(plain, minutes=1, margin=0.9) == 540
    # 2 steps/s after 10 warm-up steps of 30 s, a 5 s validation every 50 steps and at the end, 300 s:
    # 450 steps take 30 + 440/2 + 9 x 5 = 295 s; 451 take 30 + 220.5 + 10 x 5 = 300.5 s.
    probe = {"skip": 10, "steps_per_s": 2.0, "warmup_s": 30.0, "validation_s": 5.0, "val_every": 50}
    assert run_seconds(450, probe) == 295 and run_seconds(451, probe) == 300.5
    assert budget_steps(probe, minutes=5, margin=1.0) == 450


def test_budget_steps_is_the_most_steps_a_simulated_run_fits():
    rng = random.Random(random.randrange(2**32))
    for _ in range(50):
        skip, rate = rng.randint(0, 30), rng.uniform(0.5, 12)
        every = rng.choice([None, rng.randint(1, 400)])
        probe = {"skip": skip, "steps_per_s": rate, "warmup_s": rng.uniform(0, 90) if skip else 0.0}
        probe |= {"validation_s": rng.uniform(0, 20), "val_every": every}
        minutes, margin = rng.uniform(0.5, 10), rng.uniform(0.8, 1.0)
        fits = most_simulated_steps(minutes * 60 * margin, skip, probe["warmup_s"], rate, every, probe["validation_s"])
        assert budget_steps(probe, minutes, margin) == max(1, fits), probe


def test_max_time_is_lightnings_days_hours_minutes_seconds():
    assert max_time(18) == "00:00:18:00" and max_time(0.05) == "00:00:00:03"
    assert max_time(61.5) == "00:01:01:30" and max_time(60 * 24 + 2) == "01:00:02:00"


def test_step_rate_leaves_validations_out_of_the_rate_and_the_warmup(tmp_path, monkeypatch):
    """A hand-made timeline: 2 warm-up steps of 3 s, then steps of 0.5 s; validations of 2 s (in the warm-up), 7 s
    (in the measured window) and 5 s (at the end, until fit ends)."""
    clock = types.SimpleNamespace(t=0.0)
    monkeypatch.setattr(step_rate.time, "perf_counter", lambda: clock.t)
    trainer = types.SimpleNamespace(
        global_step=0, sanity_checking=False, val_check_batch=5, is_global_zero=True, default_root_dir=str(tmp_path)
    )
    module = types.SimpleNamespace(device=torch.device("cpu"))
    callback = step_rate.StepRate(skip=2, steps=4)
    callback.on_train_start(trainer, module)

    def step(seconds: float) -> None:
        callback.on_train_batch_start(trainer, module, None, 0)
        clock.t += seconds
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, module, None, None, 0)

    def validate(seconds: float) -> None:
        callback.on_validation_start(trainer, module)
        clock.t += seconds

    step(3), validate(2), step(3), step(0.5), validate(7), step(0.5), step(0.5), step(0.5), validate(5)
    callback.on_train_end(trainer, module)
    result = json.loads((tmp_path / step_rate.STEP_RATE_FILE).read_text())
    assert result["steps_per_s"] == pytest.approx(2.0) and result["warmup_s"] == pytest.approx(6.0)
    assert result["validations_s"] == pytest.approx([2, 7, 5]) and result["validation_s"] == pytest.approx(5)
    assert result["measured_steps"] == 4 and result["val_every"] == 5 and result["steps"] == 6


def test_a_resumed_runs_step_rate_line_names_the_steps_its_json_measured(tmp_path, monkeypatch, caplog):
    """A run resumed at step N measures the steps after N + skip: the log line's step numbers are the run's own, as
    step_rate.json's start_step and skip say."""
    clock = types.SimpleNamespace(t=0.0)
    monkeypatch.setattr(step_rate.time, "perf_counter", lambda: clock.t)
    begun, skip, steps = random.randint(1, 300), random.randint(1, 5), random.randint(2, 6)
    trainer = types.SimpleNamespace(
        global_step=begun, sanity_checking=False, val_check_batch=float("inf"), is_global_zero=True,
        default_root_dir=str(tmp_path),
    )  # fmt: skip
    module = types.SimpleNamespace(device=torch.device("cpu"))
    callback = step_rate.StepRate(skip=skip, steps=steps)
    callback.on_train_start(trainer, module)
    for _ in range(skip + steps):
        callback.on_train_batch_start(trainer, module, None, 0)
        clock.t += 0.5
        trainer.global_step += 1
        callback.on_train_batch_end(trainer, module, None, None, 0)
    with caplog.at_level(logging.INFO, logger="dflash2.training.step_rate"):
        callback.on_train_end(trainer, module)
    result = json.loads((tmp_path / step_rate.STEP_RATE_FILE).read_text())
    assert result["start_step"] == begun and result["skip"] == skip and result["measured_steps"] == steps
    first = result["start_step"] + result["skip"]
    assert f"over steps {first}-{first + result['measured_steps']}, " in caplog.text, caplog.text


def test_a_resumed_runs_record_counts_the_runs_steps(tmp_path):
    """A training record of a resumed run: its steps are the run's in all (what its batch size turns into
    conversations), its minutes those of the part the log's summary reports."""
    from dflash2.studies.results import training

    begun, trained, batch = random.randint(1, 500), random.randint(1, 500), random.choice([2, 16])
    summary = f"steps       {trained} in 7.5 min (resumed at step {begun}: {begun + trained} in all)\n"
    log = tmp_path / "train.log"
    log.write_text("[x][INFO] - 1000 training and 256 validation chats\n" + summary)
    record = training(log, batch)
    assert record["steps"] == begun + trained and record["minutes"] == 7.5
    assert record["conversations"] == (begun + trained) * batch


# ---------------------------------------------------------------------------------------------- the plan
def test_the_studies_plan_their_gpu_runs_with_the_published_layers(tmp_path):
    """Each study's own settings pass every check here (the target's config.json, the benches' prompts, evaluate.py's
    settings), nothing run; the depth study's drafters read the published spread over SmolLM2's 30 layers."""
    depth = make_plan(study_cfg(tmp_path / "depth", "study=depth"))
    spread = {2: [1, 27], 3: [1, 14, 27], 5: [1, 8, 14, 20, 27], 8: [1, 5, 8, 12, 16, 20, 23, 27]}
    assert [(d.num_layers, d.layers) for d in depth.drafters.values()] == list(spread.items())
    for d in depth.drafters.values():
        assert f"draft.target_layer_ids={str(d.layers).replace(' ', '')}" in d.overrides
        assert d.steps == "auto" and "trainer.max_time=00:00:12:00" in d.overrides
    benches = {b for s in depth.sweeps for b in s.command[-1].removeprefix("bench=").split(",")}
    assert benches == {"gsm8k", "humaneval", "math500", "mbpp", "mtbench", "alpaca", "sharegpt"}
    assert {s.drafter for s in depth.sweeps} == {*depth.drafters, "pld"}
    assert all("temperature=0" in s.command and "block_size=16" in s.command for s in depth.sweeps)

    acceptance = make_plan(study_cfg(tmp_path / "acceptance", "study=acceptance"))
    assert list(acceptance.drafters) == ["dflash", "dflash2", "dflash2_warm"]
    warm = acceptance.drafters["dflash2_warm"]
    assert (
        warm.needs == "dflash"
        and f"module.init_from={tmp_path / 'acceptance' / 'exports' / 'dflash'}" in warm.overrides
    )
    assert all(d.steps == "auto" and "trainer.max_time=00:00:18:00" in d.overrides for d in acceptance.trained)
    assert all("temperature=0,1" in s.command and "block_size=16" in s.command for s in acceptance.sweeps)
    assert acceptance.speed is not None and "baseline=true" in acceptance.speed


def test_a_study_measures_each_drafter_with_prompt_lookup_beside_it(tmp_path):
    """study.hybrid=true: every drafter's sweeps also run the hybrid (`<name>+lookup` in the summary), prompt lookup's
    own do not."""
    plan = make_plan(study_cfg(tmp_path, "study=depth", "study.hybrid=true"))
    for sweep in plan.sweeps:
        assert ("hybrid=null,ngram" in sweep.command) == (sweep.drafter != "pld"), sweep.command


@pytest.mark.slow
def test_ablation_variants_are_valid_train_settings_each_changing_the_baseline(tmp_path):
    """Every variant composes with the GPU experiment, passes train.py's checks (make_plan runs them) and changes the
    baseline's config; steps and validations see the baseline's conversations whatever the batch."""
    plan = make_plan(study_cfg(tmp_path, "study=ablation"))
    assert plan.drafters["dflash_init"].given == str(ROOT / "artifacts" / "drafters" / "smollm2-dflash")
    base = plan.drafters["dflash2"]
    assert base.variant == [] and base.steps == 300
    for d in plan.trained:
        assert d.steps * d.batch_size == 300 * base.batch_size
        assert f"trainer.val_check_interval={75 * base.batch_size // d.batch_size}" in d.overrides
        if d.name != "dflash2":
            cfg = compose("train", [*d.overrides, "run_dir=unused"])
            reference = compose("train", [*base.overrides, "run_dir=unused"])
            assert OmegaConf.to_container(cfg, resolve=True) != OmegaConf.to_container(reference, resolve=True), d.name


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["study.drafters=[dflashh]"], "study.drafters=[dflashh]"),
        (["study.minutes=null", "study.rehearsal.minutes=null"], "study.steps=auto"),
        (["until=trian"], "until=trian"),
        (["study.features=fp16"], "study.features=fp16"),
        (['study.variants.dflash2=["draft.conv_group_size=3"]'], "draft.conv_group_size"),
        (['study.variants.dflash2=["draft.conv_group_size=3"]'], "study.variants.dflash2="),
        (['study.variants.dflash2_warm=["module.init_from=@nothing"]'], "@nothing names no drafter"),
        (['study.settings=["temprature=0"]'], "study.settings=temprature=0"),
        (["study.benches=[[gsm8k,gsm9k]]"], "study.benches="),
        (["study.exports.dflash=/no/such/export"], "study.exports.dflash=/no/such/export"),
        (["study.train_jobs=2"], "study.train_jobs=2"),
        (
            [
                "study=ablation",
                '+study.variants.b32=["data.batch_size=32"]',
                "study.drafters=[b32]",
                "study.rehearsal.steps=9",
            ],
            "study.steps=9",
        ),
        (["study.probe.margin=1.5"], "study.probe.margin=1.5"),
    ],
)
@pytest.mark.slow
def test_bad_settings_are_refused_before_anything_runs(tmp_path, monkeypatch, overrides, named):
    from dflash2.studies import runner

    monkeypatch.setattr(runner.subprocess, "Popen", lambda *a, **k: pytest.fail(f"a command ran: {a[0]}"))
    work = tmp_path / "work"
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]").replace("+", r"\+")):
        run_study(study_cfg(work, "rehearse=true", *overrides))
    assert not work.exists()


def test_a_study_without_a_work_folder_is_refused():
    with pytest.raises(ValueError, match="set dir=WORK_DIR"):
        run_study(compose("study", ["study=depth"]))


@pytest.mark.slow
def test_study_py_refuses_a_bad_setting_in_one_sentence(tmp_path):
    work = tmp_path / "work"
    command = [sys.executable, "study.py", "study=depth", f"dir={work}", "study.drafters=[layers4]"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and "study.drafters=[layers4]" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr and not work.exists()


def test_setting_labels_make_sweep_folders_without_commas():
    assert setting_label("temperature=0,1 block_size=16") == "t0-1_b16"
    assert setting_label("temperature=0 block_size=8 selector=false") == "t0_b8_selectorfalse"


ARCH = {False: "DFlash2DraftModel", True: "PromptLookup"}  # results.json's draft.architecture
COLUMNS = ["bench", "draft", "selector", "temperature", "block_size", "tau"]


def test_taus_take_t0_b16_with_the_selector():
    rng = random.Random(random.randrange(2**32))
    rows, want = [], {}
    for bench in ("gsm8k", "mtbench"):
        for draft, selector in (("pld", ""), ("dflash", "False"), ("dflash2", "True")):
            tau = rng.uniform(1, 4)
            want.setdefault(bench, {})[draft] = tau
            rows += [[bench, draft, selector, 0.0, 16, tau], [bench, draft, selector, 1.0, 16, rng.uniform(1, 4)]]
            rows.append([bench, draft, selector, 0.0, 8, rng.uniform(1, 4)])  # another block size: left out
        rows.append([bench, "dflash2", "False", 0.0, 16, rng.uniform(1, 4)])  # the selector off: not the drafter
    rng.shuffle(rows)
    got = taus(pd.DataFrame(rows, columns=COLUMNS))
    assert got.keys() == want.keys() and all(got[b] == pytest.approx(want[b]) for b in want)


def test_earlier_grids_fill_only_the_proposers_not_measured(tmp_path):
    """study.from: a summary.csv file or a work folder (a study's evaluate/, or a sweeps/ folder), the
    first one given first, each filling only proposers that neither the grid nor one before it measured."""
    here = pd.DataFrame([["gsm8k", "dflash2", "True", 0.0, 16, 2.0]], columns=COLUMNS)
    first = [["gsm8k", "pld", "", 0.0, 16, 3.0], ["gsm8k", "dflash2", "True", 0.0, 16, 9.0]]
    pd.DataFrame(first, columns=COLUMNS).to_csv(tmp_path / "first.csv", index=False)
    (tmp_path / "old" / "sweeps").mkdir(parents=True)
    second = [["gsm8k", "pld", "", 0.0, 16, 4.0], ["gsm8k", "dflash", "", 0.0, 16, 5.0]]
    pd.DataFrame(second, columns=COLUMNS).to_csv(tmp_path / "old" / "sweeps" / "summary.csv", index=False)
    table = taus(merged(here, [tmp_path / "first.csv", tmp_path / "old"]))
    assert table == {"gsm8k": {"dflash2": 2.0, "pld": 3.0, "dflash": 5.0}}


# ---------------------------------------------------------------------------------------------- the runner
class EntryPoints:
    """Stands in for the commands a study runs (subprocess.Popen in the runner): each writes what its entry point
    would (a run's checkpoint, logs, validations and step rate; an export; a sweep's results), and every argv is
    kept. `stop(args)` True makes that command stop as ^C would, after a training wrote its first checkpoint."""

    def __init__(self, rate: float = 4.0, stop=None, checkpoint_first: bool = True):
        self.ran: list[list[str]] = []
        self.rate, self.stop, self.checkpoint_first = rate, stop, checkpoint_first

    def popen(self, argv, cwd, env, stdout, stderr, pass_fds):
        assert Path(cwd) == ROOT and argv[0] == sys.executable and len(pass_fds) == 1  # the study's lock
        entry = self

        class Process:
            def wait(self, timeout=None):
                return entry.run(argv[1:], stdout)

            def terminate(self):
                pass

            kill = terminate

        return Process()

    def run(self, args: list[str], out) -> int:
        self.ran.append(args)
        kv = dict(a.lstrip("+").split("=", 1) for a in args if "=" in a)
        if args[:2] == ["-m", "dflash2.commands.regenerate"]:
            chats = [{"id": str(i), "messages": [{"role": "user", "content": "q"}]} for i in range(int(kv["limit"]))]
            Path(kv["output"]).parent.mkdir(parents=True, exist_ok=True)
            Path(kv["output"]).write_text("".join(json.dumps(c) + "\n" for c in chats))
        elif args[0] == "train.py":
            self.train(args, kv, out)
        elif args[0] == "export.py" and "check" in kv:
            return 0 if (Path(kv["check"]) / "config.json").is_file() else 1
        elif args[0] == "export.py":
            Path(kv["output_dir"]).mkdir(parents=True, exist_ok=True)
            (Path(kv["output_dir"]) / "config.json").write_text(json.dumps(tiny_export_config()))
        elif args[0] == "evaluate.py":
            if self.stop and self.stop(args):
                raise KeyboardInterrupt
            self.evaluate(kv)
        return 0

    def train(self, args: list[str], kv: dict[str, str], out) -> None:
        run, steps = Path(kv["run_dir"]), int(kv.get("trainer.max_steps", 7))
        if self.checkpoint_first:
            (run / "checkpoints").mkdir(parents=True, exist_ok=True)
            (run / "checkpoints" / "last.ckpt").write_text("state")
        if self.stop and self.stop(args):
            raise KeyboardInterrupt
        (run / ".hydra").mkdir(parents=True, exist_ok=True)
        data = {"batch_size": int(kv["data.batch_size"]), "path": kv["data.path"], "extra_paths": []}
        OmegaConf.save(OmegaConf.create({"data": data}), run / ".hydra" / "config.yaml")
        lines = f"20 training and 4 validation chats\nsteps       {steps} in 0.5 min\n"
        out.write(lines)
        (run / "train.log").write_text(lines)
        (run / "csv" / "version_0").mkdir(parents=True, exist_ok=True)
        metrics = {"step": steps - 1, "val/tau_sim": 1.5, "val/acc_1": 0.4, "val/acc_2": 0.3, "val/acc_15": 0.1}
        pd.DataFrame([metrics]).to_csv(run / "csv" / "version_0" / "metrics.csv", index=False)
        if "callbacks.step_rate.skip" in kv:
            skip = int(kv["callbacks.step_rate.skip"])
            rate = {"skip": skip, "measured_steps": int(kv["callbacks.step_rate.steps"]), "steps_per_s": self.rate}
            rate |= {"warmup_s": 0.5, "validations_s": [0.25], "validation_s": 0.25, "val_every": 3}
            (run / "step_rate.json").write_text(json.dumps(rate))

    def evaluate(self, kv: dict[str, str]) -> None:
        cells = [
            (drafter, bench, float(t))
            for drafter in kv["drafter"].split(",")
            for bench in kv["bench"].split(",")
            for t in kv.get("temperature", "0").split(",")
        ]
        for i, (drafter, bench, temperature) in enumerate(cells):
            name = Path(drafter).name
            results = {
                "bench": bench, "tau": 1.25, "temperature": temperature, "block_size": int(kv.get("block_size", 16)),
                "draft": {"name": name, "selector": name != "pld" or None, "architecture": ARCH[name == "pld"]},
                "tau_sim": None, "tau_gap": None,
                "num_prompts": 2, "num_steps": 4, "num_tokens": 5, "tokens_per_s": 9.0, "per_position_accept": [0.5],
            }  # fmt: skip
            if name != "pld" and temperature == 0:
                results["copy_gap"] = {"steps": 4, "copyable_share": 0.5, "tau_copyable": 1.5, "tau_other": 1.0}
            (Path(kv["hydra.sweep.dir"]) / str(i)).mkdir(parents=True, exist_ok=True)
            (Path(kv["hydra.sweep.dir"]) / str(i) / "results.json").write_text(json.dumps(results))


@functools.cache
def tiny_export_config() -> dict:
    """A DFlash drafter's config.json for the tiny target (the warm start reads its depth and layers)."""
    from dflash2.testing import tiny_draft_config, tiny_target

    return tiny_draft_config(tiny_target()).to_dict()


@pytest.fixture
def entry_points(monkeypatch):
    from dflash2.studies import runner

    entry = EntryPoints()
    monkeypatch.setattr(runner.subprocess, "Popen", entry.popen)
    return entry


def kinds(ran: list[list[str]]) -> list[str]:
    """Each command as `<entry point> <what it worked on>` (the run, export or sweep folder's name)."""
    out = []
    for args in ran:
        kv = dict(a.lstrip("+").split("=", 1) for a in args if "=" in a)
        what = next(kv[k] for k in ("run_dir", "check", "output_dir", "hydra.sweep.dir", "output") if k in kv)
        name = Path(what).name if args[0] != "evaluate.py" else f"{Path(what).parent.name}/{Path(what).name}"
        kind = "probe" if "/probes/" in what else "check" if "check" in kv else args[0].removesuffix(".py")
        kind = args[1].rpartition(".")[2] if args[0] == "-m" else kind
        out.append(f"{kind} {name}" + (" (resumed)" if args[0] == "train.py" and "ckpt_path" in kv else ""))
    return out


@pytest.mark.slow
def test_a_study_runs_its_stages_in_order_and_a_rerun_runs_nothing_again(tmp_path, entry_points):
    cfg = study_cfg(tmp_path, "study=acceptance", "rehearse=true")
    result = run_study(cfg)
    assert kinds(entry_points.ran[:8]) == [
        "probe dflash", "train dflash", "probe dflash2", "train dflash2",
        "export dflash", "check dflash", "probe dflash2_warm", "train dflash2_warm",  # the warm start after its init
    ]  # fmt: skip
    exports = ["export dflash2", "check dflash2", "export dflash2_warm", "check dflash2_warm"]
    assert sorted(kinds(entry_points.ran[8:12])) == sorted(exports)  # two at a time (study.jobs)
    grid = [
        f"evaluate {d}/t0-1_b16_{g}" for d in ("dflash", "dflash2", "dflash2_warm", "pld") for g in ("gsm8k", "mbpp")
    ]
    assert sorted(kinds(entry_points.ran[12:-1])) == sorted(grid)  # two at a time
    assert kinds(entry_points.ran)[-1] == f"evaluate {tmp_path.name}/speed"  # alone, after the grid
    # The budget: each training's max_steps from its probe's measurements, and both in the JSON.
    probe = {"skip": 1, "steps_per_s": entry_points.rate, "warmup_s": 0.5, "validation_s": 0.25, "val_every": 3}
    steps = budget_steps(probe, 0.05, 0.95)
    for args in (a for a in entry_points.ran if a[0] == "train.py" and "/runs/" in " ".join(a)):
        assert f"trainer.max_steps={steps}" in args and "trainer.max_time=00:00:00:03" in args
    saved = json.loads((tmp_path / "acceptance_vs_pld.json").read_text())
    assert saved == json.loads(json.dumps(result)) and saved["card"] == "cpu"
    for name in ("dflash", "dflash2", "dflash2_warm"):
        run = saved["training"][name]
        assert run["max_steps"] == steps and run["probe"]["steps_per_s"] == entry_points.rate
        assert run["steps"] == steps and run["budget_minutes"] == 0.05
        assert (
            run["command"] == saved["commands"][f"train.{name}"] and f"run_dir={tmp_path}/runs/{name}" in run["command"]
        )
    assert set(saved["tau"]) == {"gsm8k", "humaneval", "math500", "sharegpt", "mbpp", "mtbench", "alpaca"}
    assert set(saved["speed"]) == {"dflash", "dflash2", "dflash2_warm", "pld"}

    entry_points.ran.clear()
    again = run_study(cfg)
    assert entry_points.ran == [] and again == json.loads(json.dumps(result)) | {"card": "cpu"}


def test_until_stops_after_a_stage_and_the_rerun_goes_on(tmp_path, entry_points):
    overrides = ["study=depth", "rehearse=true", "study.drafters=[layers2,layers3]", "study.benches=[[gsm8k]]"]
    assert run_study(study_cfg(tmp_path, *overrides, "until=train")) is None
    assert kinds(entry_points.ran) == ["probe layers2", "train layers2", "probe layers3", "train layers3"]
    assert not (tmp_path / "depth.json").exists()
    entry_points.ran.clear()
    result = run_study(study_cfg(tmp_path, *overrides))
    exports = ["export layers2", "check layers2", "export layers3", "check layers3"]
    assert sorted(kinds(entry_points.ran[:4])) == sorted(exports)  # two at a time (study.jobs)
    grid = ["evaluate layers2/t0_b16_gsm8k", "evaluate layers3/t0_b16_gsm8k", "evaluate pld/t0_b16_gsm8k"]
    assert sorted(kinds(entry_points.ran[4:])) == grid
    assert [(d["name"], d["layers"], d["target_layer_ids"]) for d in result["depths"]] == [
        ("layers2", 2, [1, 1]), ("layers3", 3, [1, 1, 1])  # the spread over the tiny target's 4 layers
    ]  # fmt: skip


@pytest.mark.parametrize("checkpointed", [True, False])
def test_a_killed_training_resumes_from_its_last_checkpoint(tmp_path, entry_points, checkpointed):
    """Stopped during dflash2's training: the rerun keeps dflash and dflash2's probe, and resumes dflash2 from its
    last checkpoint with its own command (or starts it over, killed before its first checkpoint)."""
    overrides = ["study=acceptance", "rehearse=true", "study.drafters=[dflash,dflash2]", "until=train"]
    entry_points.checkpoint_first = checkpointed
    entry_points.stop = lambda args: "/runs/dflash2" in " ".join(args)
    with pytest.raises(KeyboardInterrupt):
        run_study(study_cfg(tmp_path, *overrides))
    assert kinds(entry_points.ran) == ["probe dflash", "train dflash", "probe dflash2", "train dflash2"]
    first = entry_points.ran[-1]
    entry_points.ran.clear()
    entry_points.stop = None
    run_study(study_cfg(tmp_path, *overrides))
    last = tmp_path / "runs" / "dflash2" / "checkpoints" / "last.ckpt"
    assert entry_points.ran == [[*first, f"ckpt_path={last}"] if checkpointed else first]
    commands = json.loads((tmp_path / "commands.json").read_text())
    assert shlex.split(commands["train.dflash2"]) == ["python", *first]  # the command as it started
    assert ("train.dflash2.resume" in commands) == checkpointed


def test_a_stopped_grid_runs_only_its_unfinished_sweeps_again(tmp_path, entry_points):
    overrides = [
        "study=ablation",
        "rehearse=true",
        "study.drafters=[dflash2,batch4]",
        "study.benches=[[gsm8k],[mtbench]]",
    ]
    entry_points.stop = lambda args: "/evaluate/batch4/" in " ".join(args)
    with pytest.raises(KeyboardInterrupt):
        run_study(study_cfg(tmp_path, *overrides, "study.rehearsal.jobs=1"))
    assert kinds(entry_points.ran)[0] == "tokenize unused"  # two trainings at a time: the chats rendered once first
    assert [k for k in kinds(entry_points.ran) if k.startswith("evaluate")] == [
        "evaluate dflash2/t0_b16_gsm8k", "evaluate dflash2/t0_b16_mtbench", "evaluate batch4/t0_b16_gsm8k"
    ]  # fmt: skip
    entry_points.ran.clear()
    entry_points.stop = None
    result = run_study(study_cfg(tmp_path, *overrides, "study.rehearsal.jobs=1"))
    assert kinds(entry_points.ran) == [
        "evaluate batch4/t0_b16_gsm8k", "evaluate batch4/t0_b16_mtbench", "evaluate pld/t0_b16_gsm8k",
        "evaluate pld/t0_b16_mtbench",
    ]  # fmt: skip
    # Steps and validations see the same conversations: batch4 takes 4 per step where the rehearsal's baseline takes 2.
    rows = {r["name"]: r for r in result["variants"]}
    assert rows["dflash2"]["steps"] == 4 and rows["batch4"]["steps"] == 2 and rows["batch4"]["batch_size"] == 4
    assert rows["batch4"]["tau"] == {"gsm8k": 1.25, "mtbench": 1.25} and result["pld"]["tau"]["gsm8k"] == 1.25


# ---------------------------------------------------------------------------------------------- collect
def hand_plan(work: Path, kind: str, drafters: list[Drafter], **study) -> Plan:
    """A plan for the collect stage alone: its kind, drafters (evaluated in this order) and study settings."""
    settings = OmegaConf.create({"collect": kind, "from": [], "minutes": None} | study)
    found = {d.name: d for d in drafters}
    return Plan(
        work, settings, None, False, [], work / "data.jsonl", [], None, [], found, list(found), [], None, None, [], 0,
        [], None,
    )  # fmt: skip


def write_run(folder: Path, bench: str, draft: str, temperature: float, tau: float, gap: bool = True, **more) -> None:
    """One evaluation run's results.json, with what the summary reads; its `copy_gap` null unless given, none at all
    without `gap` (results.json written before the key existed)."""
    folder.mkdir(parents=True)
    if gap:
        more.setdefault("copy_gap", None)
    results = {
        "bench": bench, "tau": tau, "temperature": temperature, "block_size": more.pop("block_size", 16),
        "draft": {
            "name": draft,
            "selector": more.pop("selector", None if draft == "pld" else True),
            "architecture": ARCH[draft == "pld"],
        },
        "tau_sim": None, "tau_gap": None, "num_prompts": 1, "num_steps": 3, "num_tokens": 4, "tokens_per_s": 1.0,
        "per_position_accept": [0.5], **more,
    }  # fmt: skip
    (folder / "results.json").write_text(json.dumps(results))


def test_acceptance_json_from_the_grid_the_training_logs_and_the_probes(tmp_path):
    """A work folder as the acceptance study leaves it: the T=0 block-16 taus by bench, each drafter's training record
    (its log's steps and minutes, conversations and epochs from its batch, the command as run, the probe's budget)
    and the goals; the card and the commands beside them."""
    rng = random.Random(random.randrange(2**63))
    benches, want, i = ["gsm8k", "humaneval", "mtbench"], {}, 0
    for bench in benches:
        for draft in ("pld", "dflash", "dflash2"):
            want.setdefault(bench, {})[draft] = tau = rng.uniform(1, 4)
            for temperature, block, value in (
                (0.0, 16, tau),
                (1.0, 16, rng.uniform(1, 4)),
                (0.0, 8, rng.uniform(1, 4)),
            ):
                i += 1
                write_run(
                    tmp_path / "evaluate" / draft / "s" / str(i), bench, draft, temperature, value, block_size=block
                )
        i += 1  # the selector off: another proposer than the drafter
        write_run(tmp_path / "evaluate" / "dflash2" / "s" / str(i), bench, "dflash2", 1.0, 9.0, selector=False)
    steps, chats, batch = rng.randint(100, 5000), rng.randint(1000, 20000), rng.choice([2, 16])
    (tmp_path / "logs").mkdir()
    log = f"[x][INFO] - {chats} training and 256 validation chats\nsteps       {steps} in 12.5 min\n"
    (tmp_path / "logs" / "train.dflash2.log").write_text(log)
    (tmp_path / "runs" / "dflash2" / ".hydra").mkdir(parents=True)
    config = f"data:\n  batch_size: {batch}\n  path: a.jsonl\n  extra_paths: [b.jsonl, c.jsonl]\n"
    (tmp_path / "runs" / "dflash2" / ".hydra" / "config.yaml").write_text(config)
    command = "python train.py experiment=gpu_smollm2 'data.extra_paths=[b.jsonl,c.jsonl]'"
    (tmp_path / "commands.json").write_text(json.dumps({"data": "gunzip ...", "train.dflash2": command}))
    rate = {"steps_per_s": rng.uniform(1, 9), "warmup_s": 60.0, "validation_s": 4.0, "val_every": 370, "skip": 20}
    budget = rate | {"measured_steps": 60, "minutes": 18, "margin": 0.95, "max_steps": steps, "probe_command": "p"}
    (tmp_path / "budgets.json").write_text(json.dumps({"dflash2": budget}))
    plan = hand_plan(tmp_path, "acceptance", [Drafter("dflash", given="/exports/dflash"), Drafter("dflash2")])
    result = collect(plan)
    assert json.loads((tmp_path / "acceptance_vs_pld.json").read_text()) == json.loads(json.dumps(result))
    assert result["tau"].keys() == want.keys() and result["card"] == "cpu"
    for bench in benches:
        assert result["tau"][bench] == pytest.approx(want[bench])
    run = result["training"]["dflash2"]
    assert run["steps"] == steps and run["minutes"] == 12.5 and run["conversations"] == steps * batch
    assert run["epochs"] == pytest.approx(steps * batch / chats) and run["data"] == "a.jsonl, b.jsonl, c.jsonl"
    assert run["command"] == command and result["commands"]["data"] == "gunzip ..."
    assert run["max_steps"] == steps and run["budget_minutes"] == 18
    assert run["probe"] == rate | {"measured_steps": 60, "margin": 0.95, "command": "p"}
    assert result["training"]["dflash"] == {"export": "/exports/dflash"}
    ratio = want["gsm8k"]["dflash2"] / want["gsm8k"]["pld"]
    goals = result["goals"]["dflash2"]
    assert result["goals"].keys() == {"dflash2"}  # dflash is no DFlash2 drafter
    assert goals["over_pld"]["gsm8k"] == pytest.approx(ratio) and goals["gsm8k_1.5x_pld"] == (ratio >= 1.5)
    assert goals["above_pld_everywhere"] == all(want[b]["dflash2"] > want[b]["pld"] for b in benches)
    over = [want[b]["dflash2"] / want[b]["dflash"] >= 1.25 for b in ("gsm8k", "humaneval")]
    assert goals["1.25x_dflash_gsm8k_humaneval"] == all(over)
    assert (tmp_path / "evaluate" / "summary.csv").is_file()


def test_ablation_json_reads_the_last_validation_and_the_measured_tau(tmp_path):
    """A run resumed once (two CSV versions), one never evaluated, PLD: each run's last validation and its tau."""
    rng = random.Random(random.randrange(2**63))
    benches, truth = ["gsm8k", "humaneval", "sharegpt"], {}
    for name in ("dflash2", "distill1", "dflash"):
        run = tmp_path / "runs" / name
        # Lightning's CSV `step` of a validation inside a fit is one behind the global step: steps 0, 2, 4, 6 here.
        vals = [
            {"step": s, "val/tau_sim": 1 + rng.random(), "val/loss_ce": rng.uniform(5, 10)}
            | {f"val/acc_{k}": rng.random() for k in (1, 2, 3)}
            for s in (0, 1, 3, 5)
        ]
        train_rows = [{"step": s, "train/loss": rng.random()} for s in (0, 2, 4)]
        for version, part in enumerate((vals[:3] + train_rows[:2], vals[3:] + train_rows[2:])):
            (run / "csv" / f"version_{version}").mkdir(parents=True)
            pd.DataFrame(part).to_csv(run / "csv" / f"version_{version}" / "metrics.csv", index=False)
        # A resumed run's train.log has the summary of each part; the last one is the run's.
        (run / "train.log").write_text("done\nsteps       4 in 1.5 min\n...\nsteps       6 in 2.5 min\n")
        truth[name] = vals[-1]
    i = 0
    for name in ("dflash2", "dflash", "pld"):
        for bench in benches:
            i += 1
            truth.setdefault(f"tau/{name}", {})[bench] = tau = 1 + rng.random()
            write_run(tmp_path / "evaluate" / name / "s" / str(i), bench, name, 0.0, tau)
    variants = {"dflash2": [], "distill1": ["objective.distill=1.0"], "dflash": ["draft=dflash"]}
    drafters = [Drafter(n, variant=o, batch_size=16) for n, o in variants.items()]
    result = collect(hand_plan(tmp_path, "ablation", drafters))
    assert [r["name"] for r in result["variants"]] == list(variants)
    for row in result["variants"]:
        last = truth[row["name"]]
        assert row["overrides"] == variants[row["name"]] and row["steps"] == 6 and row["train_minutes"] == 2.5
        for key in ("tau_sim", "acc_1", "acc_2", "acc_3", "loss_ce"):
            assert row[key] == pytest.approx(last[f"val/{key}"]), key
        assert row["tau"] == pytest.approx(truth.get(f"tau/{row['name']}", {}))
    assert result["pld"]["tau"] == pytest.approx(truth["tau/pld"])
    frame = ablation_table(result)
    assert list(frame.index) == [*variants, "pld"]
    gain = truth["dflash"]["val/tau_sim"] - truth["dflash2"]["val/tau_sim"]
    assert frame.loc["dflash", "d_tau_sim"] == pytest.approx(gain)
    assert pd.isna(frame.loc["distill1", "gsm8k"]) and pd.isna(frame.loc["pld", "tau_sim"])
    assert json.loads((tmp_path / "ablation.json").read_text()) == json.loads(json.dumps(result))


def test_depth_json_with_each_runs_copy_gap_given_or_replayed(tmp_path):
    """layers2's runs carry results.json's copy_gap; layers3's does not, and is replayed from its samples
    (benchmarks/copy_gap.py): prompt [1 2 3 4 1], output [2 3 4 9 9] in steps of 1, 1, 2 tokens, where the lookup
    proposes [3 4 1 2], [4 1 2 3] and [1 2 3 4] at the anchors 2, 3 and 4: 2, 1 and 0 of them match."""
    given = {"steps": 7, "copyable_share": 0.25, "tau_copyable": 3.0, "tau_other": 1.5, "lookup_tau_copyable": 6.0}
    given |= {"lookup": {"max_ngram": 3}}
    write_run(tmp_path / "evaluate" / "layers2" / "s" / "0", "gsm8k", "layers2", 0.0, 1.9, copy_gap=given)
    write_run(tmp_path / "evaluate" / "layers3" / "s" / "0", "gsm8k", "layers3", 0.0, 4 / 3, gap=False)
    sample = {"prompt_ids": [1, 2, 3, 4, 1], "output_ids": [2, 3, 4, 9, 9], "accept_lengths": [1, 1, 2]}
    (tmp_path / "evaluate" / "layers3" / "s" / "0" / "samples.jsonl").write_text(json.dumps(sample) + "\n")
    write_run(tmp_path / "evaluate" / "layers3" / "s" / "1", "gsm8k", "layers3", 1.0, 1.1)  # T=1: no gap
    write_run(tmp_path / "evaluate" / "pld" / "s" / "0", "gsm8k", "pld", 0.0, 2.2)
    budgets = {}
    for name, layers, val in (("layers2", [1, 27], 3.1), ("layers3", [1, 14, 27], 3.3)):
        run = tmp_path / "runs" / name
        (run / "csv" / "version_0").mkdir(parents=True)
        metrics = [{"step": 9, "val/tau_sim": val, "val/acc_1": 0.8, "val/acc_15": 0.4}, {"step": 9, "train/loss": 1}]
        pd.DataFrame(metrics).to_csv(run / "csv" / "version_0" / "metrics.csv", index=False)
        (run / "train.log").write_text(f"steps       {len(layers) * 100} in 11.9 min\n")
        budgets[name] = {"steps_per_s": len(layers), "minutes": 12, "margin": 0.95, "max_steps": len(layers) * 100}
        budgets[name] |= {"probe_command": "p"}
    (tmp_path / "budgets.json").write_text(json.dumps(budgets))
    drafters = [Drafter("layers2", num_layers=2, layers=[1, 27]), Drafter("layers3", num_layers=3, layers=[1, 14, 27])]
    result = collect(hand_plan(tmp_path, "depth", drafters, minutes=12))
    two, three = result["depths"]
    assert (two["layers"], two["target_layer_ids"], three["layers"], three["target_layer_ids"]) == (
        2, [1, 27], 3, [1, 14, 27]
    )  # fmt: skip
    assert (two["steps"], two["max_steps"], two["steps_per_s"], two["minutes"], two["train_minutes"]) == (
        200, 200, 2, 12, 11.9
    )  # fmt: skip
    assert (three["tau_sim"], three["acc_1"], three["acc_15"], three["tau"]) == (3.3, 0.8, 0.4, {"gsm8k": 4 / 3})
    assert two["copy_gap"]["gsm8k"] == given
    gap = three["copy_gap"]["gsm8k"]
    assert gap["steps"] == 3 and gap["copyable_share"] == pytest.approx(2 / 3) and gap["tau_copyable"] == 1.0
    assert gap["tau_other"] == 2.0 and gap["lookup_tau_copyable"] == pytest.approx((3 + 2) / 2)
    assert result["pld"]["tau"] == {"gsm8k": 2.2} and result["card"] == "cpu"
    kept = json.loads((tmp_path / "copy_gap.json").read_text())["runs"]
    assert sorted(r["draft"] for r in kept) == ["layers2", "layers3"]  # T=0 drafter runs only


def test_a_training_record_from_a_former_work_folder(tmp_path):
    """study.from's folders laid out with train.<name>.log at their root: it and the run's Hydra record give
    the steps, minutes and command; without the run's config (its batch size) no conversations nor epochs."""
    steps = random.randint(100, 5000)
    (tmp_path / "train.dflash.log").write_text(
        f"300 training and 256 validation chats\nsteps       {steps} in 19.5 min\n"
    )
    (tmp_path / "runs" / "dflash" / ".hydra").mkdir(parents=True)
    (tmp_path / "runs" / "dflash" / ".hydra" / "overrides.yaml").write_text("- experiment=gpu_smollm2\n- a=1\n")
    run = record(tmp_path, "dflash")
    assert run["steps"] == steps and run["minutes"] == 19.5 and "epochs" not in run and "conversations" not in run
    assert run["command"] == "python train.py experiment=gpu_smollm2 a=1"
    (tmp_path / "runs" / "dflash" / ".hydra" / "config.yaml").write_text("data:\n  batch_size: 4\n  path: a.jsonl\n")
    run = record(tmp_path, "dflash")
    assert run["conversations"] == 4 * steps and run["epochs"] == pytest.approx(4 * steps / 300)
    assert record(tmp_path, "dflash2") == {}


def test_a_second_study_in_the_same_folder_is_refused_while_one_runs(tmp_path, entry_points):
    from dflash2.commands.study import run as main
    from dflash2.studies import StudyFailed
    from dflash2.studies.runner import study_lock

    cfg = study_cfg(tmp_path, "study=depth", "rehearse=true", "study.drafters=[layers2]", "study.benches=[[gsm8k]]")
    with study_lock(tmp_path):  # as a study (or a command it started) holds it
        with pytest.raises(StudyFailed, match="still runs"):
            run_study(cfg)
        assert main(cfg) == 1
    assert entry_points.ran == []
    assert main(cfg) == 0 and (tmp_path / "depth.json").is_file()
