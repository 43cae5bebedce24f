"""evaluate.py: results.json agrees with samples.jsonl, multi-turn prompts, manifest refusal, a sweep + notebook."""

import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pandas as pd
import pytest
import torch
from hydra import compose, initialize_config_dir

from dflash2 import DFlash2DraftModel
from dflash2.commands.evaluate import evaluate, settings_of
from dflash2.decoding.lookup import PromptLookup
from dflash2.evaluation.copy_gap import lookup_accepts
from dflash2.evaluation.loading import read_tau_sim
from dflash2.evaluation.report import COPY_GAP_KEYS, format_table
from dflash2.evaluation.run import acceptance_stats
from dflash2.evaluation.sweep import (
    NOTE_SEPARATOR,
    copy_gap_figure,
    format_summary,
    summary_columns,
    summary_table,
)
from dflash2.target.manifest import MANIFEST_KEY, build_manifest, target_identity
from dflash2.testing import tiny_draft_config, tiny_target, tiny_target_path

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


def export_draft(target, folder, selector=True, manifest=None, tau_sim=None):
    """A random drafter for the `tiny` target, saved as an export folder; `tau_sim` is recorded as the export records
    it (config.json's dflash2_manifest.metrics), and a README's table says otherwise, to be ignored."""
    parts = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4) if selector else {}
    cfg = tiny_draft_config(target, **parts)
    if manifest is None:
        manifest = build_manifest(target_identity("tiny", target.config, target.tokenizer), "test", 0)
    if tau_sim is not None:
        manifest = manifest | {"metrics": {"val/tau_sim": tau_sim, "val/acc_1": 0.5}}
    cfg.extra[MANIFEST_KEY] = manifest
    draft = DFlash2DraftModel(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    draft.save_pretrained(folder)
    (Path(folder) / "README.md").write_text("| metric | value |\n|---|---|\n| `val/tau_sim` | 9.75 |\n")
    return folder


def config(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return compose(
            "evaluate",
            overrides=[
                "model=tiny",
                f"model.path={tiny_target_path()}",
                "bench=humaneval",
                "wandb.enabled=false",
                *overrides,
            ],
        )


def read_run(run_dir):
    results = json.loads((run_dir / "results.json").read_text())
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    return results, samples


def test_results_agree_with_samples(tiny, tmp_path):
    draft = export_draft(tiny, tmp_path / "draft", tau_sim=2.5)
    cfg = config(f"drafter={draft}", "bench.limit=3", "max_new_tokens=8", "block_size=8", "batch_size=2")
    evaluate(cfg, tmp_path / "run")
    results, samples = read_run(tmp_path / "run")
    assert len(samples) == results["num_prompts"] == results["num_requests"] == 3
    lengths = [n for s in samples for n in s["accept_lengths"]]
    assert results["num_steps"] == len(lengths) > 0
    assert results["tau"] == pytest.approx(sum(lengths) / len(lengths))
    assert results["tau"] == pytest.approx(1 + sum(results["per_position_accept"]))
    assert len(results["per_position_accept"]) == 7 and len(results["accept_hist"]) == 8
    assert sum(results["accept_hist"]) == results["num_steps"]
    assert results["num_tokens"] == sum(len(s["output_ids"]) for s in samples)
    for s in samples:
        assert set(s) >= {"id", "prompt_ids", "output_ids", "accept_lengths"}
        assert len(s["output_ids"]) == 1 + sum(s["accept_lengths"]) <= 8
        # The prompt is the chat template's rendering of the bench turn, ready for the assistant's answer.
        assert tiny.tokenizer.decode(s["prompt_ids"]).rstrip().endswith("assistant")
    assert results["tau_sim"] == 2.5 and results["tau_gap"] is None  # measured at B = 4, evaluated at B = 8
    assert results["block_size"] == 8 and results["temperature"] == 0 and results["bench"] == "humaneval"
    assert results["draft"]["selector"] is True and results["draft"]["trained_block_size"] == 4
    assert results["target"] == target_identity("tiny", tiny.config, tiny.tokenizer)
    assert results["tokens_per_s"] > 0
    # The copy gap: prompt lookup replayed at each step (dflash2.evaluation.copy_gap), split by hand here.
    looked = [n for s in samples for n in replay(s, 8)]
    copyable = [d for d, n in zip(lengths, looked, strict=True) if n > 1]
    other = [d for d, n in zip(lengths, looked, strict=True) if n == 1]
    gap = results["copy_gap"]
    assert gap["steps"] == len(lengths) and gap["copyable_share"] == pytest.approx(len(copyable) / len(lengths))
    assert gap["tau_copyable"] == (pytest.approx(sum(copyable) / len(copyable)) if copyable else None)
    assert gap["tau_other"] == (pytest.approx(sum(other) / len(other)) if other else None)
    lookup_there = [n for n in looked if n > 1]
    assert gap["lookup_tau_copyable"] == (pytest.approx(sum(lookup_there) / len(lookup_there)) if copyable else None)
    # drafter=pld's lookup with the default `pld` settings at the run's block size (as its own run records them)
    assert gap["lookup"] == {"max_ngram": 3, "min_ngram": 1, "num_tokens": 7, "filler": 0}
    table = format_table(results)
    assert f"copyable steps {gap['copyable_share']:.0%} (lookup would accept): drafter tau " in table
    assert "no tau_gap: tau_sim is measured at the drafter's trained block size 4, not at 8" in table
    assert "nan" not in table.lower()


def replay(sample, block_size):
    keys = ("prompt_ids", "output_ids", "accept_lengths")
    return lookup_accepts(*(sample[k] for k in keys), block_size, PromptLookup())


def test_a_rerun_keeps_finished_runs_of_the_same_settings(tiny, tmp_path, monkeypatch):
    """A killed sweep resumes: a run folder whose results.json has the same settings is kept, anything else runs."""
    from dflash2.evaluation import run as evaluation

    draft = export_draft(tiny, tmp_path / "draft")
    overrides = [f"drafter={draft}", "bench.limit=2", "max_new_tokens=6"]
    first = evaluate(config(*overrides), tmp_path / "run")
    assert first["config"]["bench"]["limit"] == 2 and "wandb" not in first["config"]
    calls = []
    real = evaluation.generate_turns
    monkeypatch.setattr(evaluation, "generate_turns", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert evaluate(config(*overrides, "wandb.project=elsewhere"), tmp_path / "run") == first
    assert calls == []  # nothing decoded again
    again = evaluate(config(*overrides, "temperature=1"), tmp_path / "run")
    assert calls == [1] and again["temperature"] == 1 and read_run(tmp_path / "run")[0] == again
    (tmp_path / "run" / "results.json").write_text('{"tau": 1.')  # a torn file does not count as finished
    assert evaluation.finished_run(settings_of(config(*overrides, "temperature=1")), tmp_path / "run") is None


def test_second_turns_follow_the_first_answers(tiny, tmp_path, monkeypatch):
    prompts = [{"id": "mt/1", "turns": ["Name a fruit.", "And a vegetable?"]}, {"id": "mt/2", "turns": ["Hi."]}]
    monkeypatch.setattr("dflash2.data.benches.load_prompts", lambda name, limit=None: prompts)
    draft = export_draft(tiny, tmp_path / "draft", selector=False)
    cfg = config(f"drafter={draft}", "max_new_tokens=6", "selector=false", "temperature=1", "baseline=true")
    results = evaluate(cfg, tmp_path / "run")
    _, samples = read_run(tmp_path / "run")
    assert [(s["id"], s["turn"]) for s in samples] == [("mt/1", 0), ("mt/2", 0), ("mt/1", 1)]
    second = tiny.tokenizer.decode(samples[2]["prompt_ids"])
    answer = tiny.tokenizer.decode(samples[0]["output_ids"], skip_special_tokens=True)
    assert "Name a fruit." in second and answer.strip() in second and second.index("And a vegetable?") > 0
    assert results["num_prompts"] == 2 and results["num_requests"] == 3 and results["tau_sim"] is None
    assert results["draft"]["selector"] is False and results["baseline"]["tokens_per_s"] > 0
    assert results["copy_gap"] is None  # sampled: the output depends on what was proposed
    assert "lookup_tau_copyable): at T > 0 the output depends on what was proposed" in format_table(results)


def test_repeated_passes_give_median_speeds_and_a_paired_speedup(tiny, tmp_path, monkeypatch):
    import statistics

    from dflash2.evaluation import run as evaluation

    draft = export_draft(tiny, tmp_path / "draft")
    calls = []
    real = evaluation.generate_turns
    monkeypatch.setattr(
        evaluation, "generate_turns", lambda d, *a, **k: calls.append((d.proposer is None, a[-1])) or real(d, *a, **k)
    )
    overrides = ["bench.limit=2", "max_new_tokens=6", "temperature=0", "baseline=true", "repeats=3"]
    results = evaluate(config(f"drafter={draft}", *overrides), tmp_path / "run")
    # drafter, then target alone, three times; one-off costs are paid before the first pass only
    assert calls == [(False, True), (True, True), (False, False), (True, False), (False, False), (True, False)]
    spec, base = results["tokens_per_s_passes"], results["baseline"]["tokens_per_s_passes"]
    assert len(spec) == len(base) == 3 and min(spec + base) > 0
    assert results["tokens_per_s"] == statistics.median(spec)
    assert results["baseline"]["tokens_per_s"] == statistics.median(base)
    assert results["baseline"]["speedup"] == pytest.approx(
        statistics.median(a / b for a, b in zip(spec, base, strict=True))
    )
    assert results["baseline"]["identical_outputs"] == 1.0
    with pytest.raises(ValueError, match="repeats=0"):
        evaluate(config(f"drafter={draft}", "repeats=0"), tmp_path / "run0")


def test_a_draft_for_another_target_is_refused(tiny, tmp_path):
    identity = target_identity("tiny", tiny.config, tiny.tokenizer) | {"target": "other", "vocab_hash": "0" * 64}
    draft = export_draft(tiny, tmp_path / "draft", manifest=build_manifest(identity, "test", 0))
    with pytest.raises(ValueError, match="trained for .*'other'"):
        evaluate(config(f"drafter={draft}", "bench.limit=1"), tmp_path / "run")


def test_prompt_lookup_runs_without_a_drafter(tiny, tmp_path):
    cfg = config("drafter=pld", "bench.limit=2", "max_new_tokens=8", "batch_size=2", "baseline=true")
    results = evaluate(cfg, tmp_path / "run")
    _, samples = read_run(tmp_path / "run")
    assert results["draft"]["name"] == "pld" and results["draft"]["architecture"] == "PromptLookup"
    assert results["draft"]["pld"] == {"max_ngram": 3, "min_ngram": 1, "num_tokens": 15, "filler": 0}
    assert results["draft"]["path"] is None and results["draft"]["manifest"] is None
    assert results["block_size"] == 16 and len(results["per_position_accept"]) == 15  # block_size null = 16
    assert results["tau_sim"] is None and results["tau_gap"] is None
    assert results["num_steps"] == sum(len(s["accept_lengths"]) for s in samples) > 0
    assert results["target"] == target_identity("tiny", tiny.config, tiny.tokenizer)
    assert results["baseline"]["identical_outputs"] == 1.0  # greedy: the target's own output
    assert results["copy_gap"] is None  # the lookup's own run is what the copy gap replays
    table = format_table(results)
    assert "copyable steps" not in table and "no selector, tau_sim, tau_gap: prompt lookup is not trained" in table
    assert "lookup_tau_copyable): this is prompt lookup's own run" in table

    results = evaluate(config("drafter=pld", "bench.limit=1", "max_new_tokens=4", "block_size=4"), tmp_path / "b4")
    assert results["block_size"] == 4 and results["draft"]["pld"]["num_tokens"] == 3


@pytest.mark.parametrize(
    "override, message",
    [
        ("pld.max_ngram=0", "pld.max_ngram=0"),
        ("pld.min_ngram=5", "pld.min_ngram=5 is above pld.max_ngram=3"),
        ("pld.num_tokens=16", "pld.num_tokens=16 does not fit a block of block_size=16"),
        ("block_size=1", "block_size=1: a block holds the anchor"),
    ],
)
def test_prompt_lookup_settings_are_checked_before_loading_a_target(tmp_path, monkeypatch, override, message):
    from dflash2.commands import evaluate as command

    monkeypatch.setattr(command, "_load_target", lambda *a: pytest.fail("the target was loaded first"))
    with pytest.raises(ValueError, match=message):
        evaluate(config("drafter=pld", override), tmp_path / "run")


def test_acceptance_stats_by_hand():
    stats = acceptance_stats([[1, 3], [4, 1, 2]], block_size=4)
    assert stats["accept_hist"] == [2, 1, 1, 1] and stats["num_steps"] == 5
    assert stats["per_position_accept"] == pytest.approx([3 / 5, 2 / 5, 1 / 5])
    assert stats["tau"] == pytest.approx(11 / 5)


def test_tau_sim_comes_from_the_exports_data_not_its_readme(tmp_path):
    """tau_sim is read from config.json's manifest (`metrics`, as the export writes it), never from the model card."""
    assert read_tau_sim(None) is None and read_tau_sim({"target": "tiny"}) is None
    metrics = {"val/tau_sim": 3.25, "val/tau_sim_top1": 2.5, "val/acc_1": 0.5}
    assert read_tau_sim({"metrics": metrics}) == 3.25
    # A DFlash2 drafter also records its argmax path, the comparator of a run with selector=false.
    assert read_tau_sim({"metrics": metrics}, "tau_sim_top1") == 2.5
    assert read_tau_sim({"metrics": {"val/tau_sim": "3.25"}}) is None  # not a number: not recorded


def test_an_evaluation_reads_tau_sim_from_config_json_alone(tiny, tmp_path):
    from dflash2.evaluation.loading import Loaded, describe_draft

    def described(folder):
        loaded = Loaded(tiny, DFlash2DraftModel.from_pretrained(folder), {}, True)
        return describe_draft(settings_of(config(f"drafter={folder}", "block_size=4")), loaded)

    draft = export_draft(tiny, tmp_path / "draft", tau_sim=1.75)
    assert "9.75" in (draft / "README.md").read_text()  # the card says otherwise: it is for people
    assert read_tau_sim(described(draft)["manifest"]) == 1.75
    bare = export_draft(tiny, tmp_path / "bare")
    assert read_tau_sim(described(bare)["manifest"]) is None


def evaluate_cli(cwd: Path, *args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    """`python evaluate.py ...` exactly as a user types it, off a terminal, W&B offline."""
    env = dict(os.environ, WANDB_MODE="offline", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    command = [sys.executable, str(ROOT / "evaluate.py"), *args]
    return subprocess.run(command, cwd=cwd, env=env, stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=600)


@pytest.fixture(scope="module")
def sweep(tiny, tmp_path_factory):
    """A drafter and prompt lookup x 2 benches x 2 temperatures, its output to a file as under nohup or a scheduler."""
    root = tmp_path_factory.mktemp("sweep")
    draft = export_draft(tiny, root / "draft", tau_sim=1.5)
    args = [
        f"drafter={draft},pld",
        "model=tiny",
        f"model.path={tiny_target_path()}",
        "bench=humaneval,sharegpt",
        "bench.limit=2",
        "temperature=0,1",
    ]
    with (root / "evaluate.out").open("w") as out:
        run = evaluate_cli(root, "-m", *args, "max_new_tokens=6", f"hydra.sweep.dir={root / 'multirun'}", stdout=out)
    assert run.returncode == 0, run.stderr[-3000:]
    (root / "evaluate.err").write_text(run.stderr)
    return root / "multirun", (root / "evaluate.out").read_text()


@pytest.mark.slow
def test_output_to_a_file_has_no_bar_frames_or_library_warnings(sweep):
    sweep_dir, stdout = sweep
    output = stdout + (sweep_dir.parent / "evaluate.err").read_text()
    assert "\r" not in output and "it/s]" not in output and "Loading weights" not in output
    for noise in ("Warning", "deprecated"):
        assert noise not in output, (noise, output)
    assert output.count("decode: 2/2 requests") == 8


@pytest.mark.slow
def test_sweep_writes_runs_summary_and_plots(sweep):
    sweep_dir, stdout = sweep
    table = pd.read_csv(sweep_dir / "summary.csv")
    assert len(table) == 8 and set(table["bench"]) == {"humaneval", "sharegpt"}
    drafter, lookup = table[table["draft"] == "draft"], table[table["draft"] == "pld"]
    for rows in (drafter, lookup):
        assert len(rows) == 4 and set(rows["temperature"]) == {0.0, 1.0}
    assert (drafter["tau_sim"] == 1.5).all() and lookup["tau_sim"].isna().all()
    assert (lookup["block_size"] == 16).all() and (lookup["tau"] >= 1).all()
    assert list(table.columns) == summary_columns(hybrid=False)
    greedy, sampled = drafter[drafter["temperature"] == 0], drafter[drafter["temperature"] == 1]
    assert greedy["copyable_share"].between(0, 1).all() and greedy["tau_other"].notna().all()
    assert sampled[list(COPY_GAP_KEYS)].isna().all().all() and lookup[list(COPY_GAP_KEYS)].isna().all().all()
    assert sampled["note"].str.contains("at T > 0 the output depends on what was proposed").all()
    assert lookup["note"].str.contains("prompt lookup is not trained").all()
    assert_every_empty_cell_explained(table)
    assert "NaN" not in stdout and "None" not in stdout
    assert "- no selector, tau_sim, tau_gap: prompt lookup is not trained (rows 4, 5, 6, 7)" in stdout
    for png in ("tau_by_bench.png", "per_position_accept.png", "copy_gap.png"):
        assert (sweep_dir / png).read_bytes()[:4] == b"\x89PNG"
    runs = sorted(p.parent for p in sweep_dir.rglob("results.json"))
    for run_dir in runs:
        results, samples = read_run(run_dir)
        assert results["num_steps"] == sum(len(s["accept_lengths"]) for s in samples)
        assert list(run_dir.glob("wandb/offline-run-*")), f"no offline W&B run under {run_dir}"
    assert "tau" in stdout and "summary.csv" in stdout


def assert_every_empty_cell_explained(table):
    """Each empty cell of summary.csv's rows is named in that row's note, before the reason's colon."""
    for _, row in table.iterrows():
        reasons = [] if pd.isna(row["note"]) else row["note"].split(NOTE_SEPARATOR)
        named = {name for reason in reasons for name in re.findall(r"[a-z_]+", reason.split(": ")[0])}
        empty = {column for column, value in row.items() if column != "note" and pd.isna(value)}
        assert empty <= named, (row["run"], empty - named, row["note"])


def hand_run(draft="a", block=16, temperature=0.0, tau_sim=2.0, gap=True, trained=16) -> dict:
    """A run as evaluate.py records it (what the summary reads): `gap` False for results.json written before the
    copy gap was."""
    lookup = draft == "pld"
    run = {
        "draft": {
            "name": draft,
            "architecture": "PromptLookup" if lookup else "DFlash2DraftModel",
            "selector": None if lookup else True,
            "trained_block_size": None if lookup else trained,
        },
        "run": f"{draft}-B{block}-T{temperature:g}",
        "bench": "gsm8k",
        "temperature": temperature,
        "block_size": block,
        "tau": 1.5 + torch.rand(()).item(),
        "tau_sim": None if lookup else tau_sim,
        "num_prompts": 2,
        "num_steps": 9,
        "num_tokens": 20,
        "tokens_per_s": 10.0,
    }
    run["tau_gap"] = run["tau_sim"] - run["tau"] if run["tau_sim"] is not None and block == trained else None
    if gap:
        replayed = not lookup and temperature == 0
        numbers = [torch.rand(()).item(), 2 + torch.rand(()).item(), 1 + torch.rand(()).item(), 4.0]
        gap = dict(zip(COPY_GAP_KEYS, numbers, strict=True)) | {"steps": 9, "lookup": PromptLookup().settings(block)}
        run["copy_gap"] = gap if replayed else None
    return run


def test_the_summary_says_why_each_cell_is_empty():
    runs = [
        hand_run(),  # everything there
        hand_run(block=8),  # tau_sim is measured at the trained block size only
        hand_run(temperature=1.0),
        hand_run(draft="b", tau_sim=None),
        hand_run(gap=False),  # a results.json written before the copy gap
        hand_run(draft="pld", tau_sim=None),
    ]
    runs[0]["copy_gap"]["tau_other"] = None  # every step was copyable
    table = summary_table(runs)
    assert table["note"][0] == "no tau_other: every step was copyable"
    assert table["note"][1] == "no tau_gap: tau_sim is measured at the drafter's trained block size 16, not at 8"
    assert pd.isna(table["tau_gap"][1]) and table["tau_sim"][1] == 2.0 and table["copyable_share"].notna()[1]
    assert table["note"][2].startswith("no copy gap (copyable_share, tau_copyable, tau_other, lookup_tau_copyable)")
    assert table["note"][3] == "no tau_sim, tau_gap: the drafter's export records no tau_sim"
    assert "results.json predates it" in table["note"][4] and table[list(COPY_GAP_KEYS)].iloc[4].isna().all()
    assert table["note"][5].startswith("no selector, tau_sim, tau_gap: prompt lookup is not trained; no copy gap")
    assert_every_empty_cell_explained(table)
    shown = format_summary(table)
    assert "NaN" not in shown and "None" not in shown
    assert "- no tau_gap: tau_sim is measured at the drafter's trained block size 16, not at 8 (rows 1)" in shown
    assert "(rows 2, 5)" not in shown and "at T > 0" in shown  # one reason per cause, each with its own rows


def test_copy_gap_plot_shows_each_greedy_drafter_run():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [hand_run(), hand_run(block=8), hand_run(draft="b"), hand_run(temperature=1.0), hand_run(draft="pld")]
    table = summary_table(runs)
    fig = copy_gap_figure(table)
    heights = sorted(round(p.get_height(), 6) for ax in fig.axes for c in ax.containers for p in c)
    gaps = [r["copy_gap"] for r in runs if r["copy_gap"]]
    assert len(gaps) == 3
    assert heights == sorted(round(g[k], 6) for g in gaps for k in COPY_GAP_KEYS[1:])
    plt.close(fig)
    assert copy_gap_figure(summary_table(runs[3:])) is None  # nothing to show: no plot


def fake_wandb(monkeypatch, tmp_path) -> dict:
    """A stand-in for the wandb module whose one run's summary is the dict returned."""
    summary = {}
    run = types.SimpleNamespace(
        log=lambda *a, **k: None,
        summary=summary,
        finish=lambda: None,
        dir=str(tmp_path),
        settings=types.SimpleNamespace(mode="offline"),
    )
    fake = types.SimpleNamespace(
        init=lambda **k: run,
        Settings=lambda **k: None,
        Table=lambda **k: None,
        plot=types.SimpleNamespace(line=lambda *a, **k: None, bar=lambda *a, **k: None),
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    return summary


def test_wandb_summary_has_the_copy_gap(monkeypatch, tmp_path):
    from dflash2.evaluation.report import log_wandb
    from dflash2.evaluation.settings import WandbSettings

    summary = fake_wandb(monkeypatch, tmp_path)
    settings = types.SimpleNamespace(wandb=WandbSettings(), config={})
    results = hand_run() | {"per_position_accept": [0.5], "accept_hist": [1, 1]}
    results["copy_gap"]["tau_other"] = None  # every step copyable: nothing to log there
    log_wandb(settings, results, tmp_path)
    gap = {k.removeprefix("copy_gap/"): v for k, v in summary.items() if k.startswith("copy_gap/")}
    assert gap == {k: v for k, v in results["copy_gap"].items() if k not in ("lookup", "tau_other")}
    summary.clear()
    log_wandb(settings, hand_run(temperature=1.0) | {"per_position_accept": [], "accept_hist": []}, tmp_path)
    assert summary and not [k for k in summary if k.startswith("copy_gap/")]


@pytest.mark.slow
def test_each_run_logs_its_progress_and_results_off_a_terminal(sweep):
    sweep_dir, stdout = sweep
    logs = [p.read_text() for p in sorted(sweep_dir.glob("*/evaluate.log"))]
    assert len(logs) == 8  # the drafter and prompt lookup x 2 benches x 2 temperatures
    for log in logs:  # the decode's first and last progress lines (one every 30 s between), then the table
        assert re.search(r"decode: 0/2 requests .*tokens/s, tau", log), log
        assert re.search(r"decode: 2/2 requests .* [0-9.]+ tokens/s, tau [0-9.]+", log), log
        assert "acceptance by slot" in log
    assert stdout.count("decode: 2/2 requests") == 8


@pytest.mark.slow
def test_a_damaged_drafter_fails_in_one_sentence_before_the_target_loads(tiny, tmp_path):
    draft = export_draft(tiny, tmp_path / "draft")
    os.truncate(draft / "model.safetensors", (draft / "model.safetensors").stat().st_size // 2)
    done = evaluate_cli(
        tmp_path,
        f"drafter={draft}",
        "model=tiny",
        f"model.path={tiny_target_path()}",
        "bench.limit=1",
        "wandb.enabled=false",
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr + done.stdout
    (line,) = done.stderr.strip().splitlines()  # what export.py check says, on one line
    assert f"drafter={draft}" in line and "model.safetensors is unreadable" in line
    assert not (tmp_path / "outputs").exists()  # refused before Hydra made the run folder


@pytest.mark.parametrize(
    "args, error",
    [
        (["-m", "drafter={draft},pld", "bench=gsm8k,mbpp"], "drafter={draft} fails `export.py check`"),
        (["drafter={tmp}/missing"], "drafter={tmp}/missing fails `export.py check`"),
        (["drafter=pld", "pld.max_ngram=0"], "pld.max_ngram=0"),
        (["drafter={draft}", "repeats=0"], "repeats=0"),
    ],
)
@pytest.mark.slow
def test_a_refused_start_leaves_no_run_or_sweep_folder(tiny, tmp_path, args, error):
    """A bad drafter (in a sweep too) or setting fails in one line before Hydra makes a run or sweep folder: nothing
    to clean up under outputs/ or multirun/."""
    draft = export_draft(tiny, tmp_path / "draft")
    if "repeats=0" not in args:
        (draft / "config.json").write_text("{")  # a damaged export
    fill = {"draft": draft, "tmp": tmp_path}
    done = evaluate_cli(tmp_path, *(a.format(**fill) for a in args), "model=tiny", f"model.path={tiny_target_path()}")
    assert done.returncode != 0 and "Traceback" not in done.stderr + done.stdout
    assert error.format(**fill) in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "multirun").exists()


@pytest.mark.slow
def test_notebook_runs_on_the_sweep(sweep, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("DFLASH2_SWEEP_DIR", str(sweep[0]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notebook = nbformat.read(ROOT / "notebooks" / "acceptance.ipynb", as_version=4)
    NotebookClient(notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs)


def test_tau_plot_ticks_each_bar_with_its_own_drafters_tau_sim():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dflash2.evaluation.sweep import tau_figure

    def run(draft: str, bench: str, block: int, tau: float, tau_sim: float) -> dict:
        gap = tau_sim - tau if block == 16 else None  # evaluate.py sets tau_gap only at the training block size
        return {
            "draft": {"name": draft, "selector": True, "architecture": "DFlash2DraftModel", "trained_block_size": 16},
            "bench": bench,
            "temperature": 0.0,
            "block_size": block,
            "tau": tau,
            "tau_sim": tau_sim,
            "tau_gap": gap,
        }

    sims = {"a": 1.1 + torch.rand(()).item(), "b": 1.1 + torch.rand(()).item()}
    runs = [
        run(d, bench, block, 1.0 + torch.rand(()).item(), sims[d])
        for d in sims
        for bench in ("gsm8k", "mbpp")
        for block in (16, 8)
    ]
    # Prompt lookup as evaluate.py records it: no tau_sim, no selector.
    lookup = {
        "tau_sim": None,
        "tau_gap": None,
        "draft": {"name": "pld", "selector": None, "architecture": "PromptLookup"},
    }
    runs += [run("pld", bench, 16, 1.0 + torch.rand(()).item(), 0.0) | lookup for bench in ("gsm8k", "mbpp")]
    table = summary_table(runs)
    fig = tau_figure(table)
    ax = fig.axes[0]
    ticks = sorted(round(seg[0][1], 6) for c in ax.collections for seg in c.get_segments())
    drafters = [r for r in runs if r["draft"]["name"] != "pld"]
    assert ticks == sorted(round(sims[r["draft"]["name"]], 6) for r in drafters if r["block_size"] == 16)
    bars = sorted(round(p.get_height(), 6) for c in ax.containers for p in c)
    assert bars == sorted(round(r["tau"], 6) for r in runs)
    assert not pd.isna(table["tau_sim"][: len(drafters)]).any()  # the table itself keeps tau_sim for every drafter
    assert set(table["setting"][len(drafters) :]) == {"pld T=0 B=16"}
    plt.close(fig)


@pytest.mark.slow
def test_evaluation_and_regeneration_import_no_lightning():
    """Decoding and regenerating need no training stack: importing them must not pull Lightning in."""
    code = "import sys, dflash2.evaluation.run, dflash2.data.regenerate; print('lightning' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


def test_a_graph_compiled_inside_a_timed_pass_is_reported(tiny, monkeypatch, caplog):
    """A timed pass that compiles (a shape the warm-up did not cover) says so; one that compiles nothing is quiet."""
    from torch._dynamo.utils import counters

    from dflash2.decoding.speculative import Generation
    from dflash2.evaluation.turns import generate_turns

    compiles = []

    class Decoder:  # the target alone, each pass compiling what `compiles` says
        target, proposer = tiny, None

        def __call__(self, prompt_ids, generator, on_commit=None):
            counters["stats"]["unique_graphs"] += compiles.pop() if compiles else 0
            return [Generation([5], []) for _ in prompt_ids]

    prompts = [{"id": "a", "turns": ["Hi."]}]
    for built, warned in ((0, False), (2, True)):
        caplog.clear()
        compiles.append(built)
        generate_turns(Decoder(), prompts, True, None, torch.Generator(), warmup=False)
        assert ("2 graph(s) compiled inside the timed pass" in caplog.text) is warned


def test_one_evaluation_lints_its_drafter_once(tiny, tmp_path, monkeypatch):
    """Hydra's callback checks the settings before the run folder exists, then the run builds them: the drafter folder
    is linted once for both, and again only when it changes."""
    from dflash2.commands.evaluate import CheckSettings
    from dflash2.evaluation import checks

    draft = export_draft(tiny, tmp_path / "draft")
    calls = []
    real = checks.lint
    monkeypatch.setattr(checks, "lint", lambda folder: calls.append(folder) or real(folder))
    cfg = config(f"drafter={draft}", "bench.limit=1", "max_new_tokens=4")
    CheckSettings().on_run_start(cfg)
    evaluate(cfg, tmp_path / "run")
    assert len(calls) == 1
    (draft / "config.json").write_text((draft / "config.json").read_text() + "\n")  # rewritten: checked again
    evaluate(config(f"drafter={draft}", "bench.limit=1", "max_new_tokens=3"), tmp_path / "run2")
    assert len(calls) == 2
