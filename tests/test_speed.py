"""python speed.py: the speed-up model against hand calculations, the truncation estimate, and the command end
to end on the tiny target (its JSON consistent with the costs it recorded)."""

import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from test_evaluation import config as evaluate_config
from test_evaluation import export_draft

from dflash2.commands.evaluate import evaluate
from dflash2.commands.speed import run as speed_run
from dflash2.decoding.static import FastDecode
from dflash2.evaluation import speed_model
from dflash2.evaluation.run import acceptance_stats
from dflash2.testing import tiny_target, tiny_target_path

ROOT = Path(__file__).resolve().parents[1]
MS = 1e-3


# ---------------------------------------------------------------------------------------------- the model by hand
def test_expected_steps_by_hand():
    # p(1) = p(2) = 1/4, p(3) = 1/2 (B = 3). K(m) = 1 + sum_n p(n) K(m - n), K(<= 0) = 0:
    # K(1) = 1; K(2) = 1 + K(1)/4 = 1.25; K(3) = 1 + K(2)/4 + K(1)/4 = 1.5625;
    # K(4) = 1 + K(3)/4 + K(2)/4 + K(1)/2 = 1 + 0.390625 + 0.3125 + 0.5 = 2.203125
    hist = [1, 1, 2]
    assert [speed_model.expected_steps(hist, m) for m in range(5)] == [0, 1, 1.25, 1.5625, 2.203125]
    assert speed_model.expected_steps([7, 0, 0], 5) == 5  # one token per step
    assert speed_model.expected_steps([0, 0, 3], 7) == 3  # three per step: 3, 6, then the cut last step
    assert speed_model.tau_of(hist) == (1 + 2 + 6) / 4


def test_expected_steps_match_a_simulation(random_seed):
    """The recursion against a plain loop drawing each step's committed length from the histogram."""
    rng = random.Random(random_seed)
    print("seed", random_seed)
    hist = [rng.randint(0, 9) for _ in range(rng.randint(2, 8))]
    hist[0] += 1
    tokens = rng.randint(1, 40)
    draws = 20_000
    total = 0
    for _ in range(draws):
        committed = 0
        while committed < tokens:
            committed += rng.choices(range(1, len(hist) + 1), weights=hist)[0]
            total += 1
    expected = speed_model.expected_steps(hist, tokens)
    assert total / draws == pytest.approx(expected, rel=0.03), (hist, tokens)


def test_costs_between_batch_sizes_by_hand():
    table = {2: 14.0, 4: 22.0}
    assert speed_model.cost_at(table, 3) == 18.0  # halfway between 2 and 4
    # flat below the smallest size
    assert speed_model.cost_at(table, 2) == 14.0 and speed_model.cost_at(table, 1) == 14.0
    assert speed_model.cost_at(table, 0.25) == 0.25 * 14.0  # a fractional last step: a quarter of one row's step
    assert speed_model.cost_at(table, 0) == 0 and speed_model.cost_at(table, 9) == 22.0


def test_replies_are_batched_as_the_decode_batches_them():
    a, b, c = (5, 1.0), (2, 1.0), (3, 1.0)
    # Two prompts, the first with two turns: turn 0 decodes both, turn 1 the first prompt's second turn alone.
    assert speed_model.request_batches([[a, b], [c]], 2) == [[a, c], [b]]
    # Batches of 3 cycle the prompts to fill them: [p0, p1, p0].
    assert speed_model.request_batches([[a, b], [c]], 3) == [[a, c, a], [b, b]]
    assert speed_model.cycled([1, 2, 3], 2) == [1, 2, 3, 1] and speed_model.cycled([1, 2], 2) == [1, 2]


def test_predictions_by_hand():
    """Hand-made costs (ms) at block 3 and two replies, their tokens and mean steps K from the recursion above:
    A = 5 tokens with K(4) = 2.203125, B = 2 tokens whose every step committed 1 (K(1) = 1)."""
    a, b = (5, speed_model.expected_steps([1, 1, 2], 4)), (2, speed_model.expected_steps([1, 0, 0], 1))
    spec = {1: {"step": 10 * MS, "prefill": 3 * MS}, 2: {"step": 14 * MS, "prefill": 4 * MS}}
    target = {1: {"step": 5 * MS, "prefill": 3 * MS}, 2: {"step": 6 * MS, "prefill": 4 * MS}}

    # Batch 1, reply A alone: T = 3 + 10 + 10 + 0.203125 * 10 = 25.03125 ms; the target alone 3 + 4 * 5 = 23 ms.
    got = speed_model.predict([[a]], 1, 2.25, spec, target)
    assert got["tokens_per_s"] == pytest.approx(5 / 25.03125e-3)
    assert got["target_tokens_per_s"] == pytest.approx(5 / 23e-3)
    assert got["speedup"] == pytest.approx(23 / 25.03125)
    assert got["speedup_steady"] == pytest.approx(2.25 * 5 / 10)  # tau * s_a(1) / s(1)

    # Batch 2, A and B together: live rows 2, 1 (B is done after one step), then A's fractional 0.203125:
    # T = 4 + 14 + 10 + 0.203125 * 10 = 30.03125 ms; the target alone runs both rows to A's end: 4 + 4 * 6 = 28 ms.
    got = speed_model.predict([[a], [b]], 2, 2.0, spec, target)
    assert got["tokens_per_s"] == pytest.approx(7 / 30.03125e-3)
    assert got["target_tokens_per_s"] == pytest.approx(7 / 28e-3)
    assert got["speedup"] == pytest.approx(28 / 30.03125)
    assert got["speedup_steady"] == pytest.approx(2.0 * 6 / 14)

    # The fast path keeps B's row to the batch's end: K = 2.203125 full steps, T = 4 + 2.203125 * 14 = 34.84375 ms.
    got = speed_model.predict([[a], [b]], 2, 2.0, spec, target, static=True)
    assert got["tokens_per_s"] == pytest.approx(7 / 34.84375e-3)
    assert got["target_tokens_per_s"] == pytest.approx(7 / 28e-3)
    # A second turn of A alone is a short batch, padded to 2 rows there: 4 + 2.203125 * 14 against 4 + 4 * 6.
    got = speed_model.predict([[a, a], [b]], 2, 2.0, spec, target, static=True)
    assert got["speedup"] == pytest.approx((28 + 28) / (34.84375 + 34.84375))

    # Batch 3 with costs measured at 2 and 4 (interpolated at 3): the prompts cycle to [A, B, A].
    spec = {2: {"step": 14 * MS, "prefill": 4 * MS}, 4: {"step": 22 * MS, "prefill": 8 * MS}}
    target = {2: {"step": 6 * MS, "prefill": 4 * MS}, 4: {"step": 8 * MS, "prefill": 6 * MS}}
    # live rows 3, 2, 2 * 0.203125 = 0.40625, whose step costs 0.40625 * s(1) = 0.40625 * 14 (flat below 2):
    # T = 6 + 18 + 14 + 5.6875 = 43.6875 ms; the target alone 5 + 4 * 7 = 33 ms; tokens 5 + 2 + 5 = 12.
    got = speed_model.predict([[a], [b]], 3, 2.0, spec, target)
    assert got["tokens_per_s"] == pytest.approx(12 / 43.6875e-3)
    assert got["target_tokens_per_s"] == pytest.approx(12 / 33e-3)
    assert got["speedup_steady"] == pytest.approx(2.0 * 7 / 18)


def test_truncation_by_hand():
    # At B = 4, 5 steps committed 1, 3 committed 2, 2 committed 3, 4 committed 4.
    hist = [5, 3, 2, 4]
    assert speed_model.truncate(hist, 4) == hist
    assert speed_model.truncate(hist, 3) == [5, 3, 2 + 4]  # 3 and 4 both commit 3 in a block of 3
    assert speed_model.truncate(hist, 2) == [5, 3 + 2 + 4]
    assert speed_model.tau_of(speed_model.truncate(hist, 2)) == pytest.approx((5 * 1 + 9 * 2) / 14)
    # The same from the steps themselves: min(n, B') of each.
    lengths = [1] * 5 + [2] * 3 + [3] * 2 + [4] * 4
    random.shuffle(lengths)
    assert speed_model.truncate(hist, 3) == acceptance_stats([[min(n, 3) for n in lengths]], 3)["accept_hist"]
    with pytest.raises(ValueError, match="2..4"):
        speed_model.truncate(hist, 5)


# ---------------------------------------------------------------------------------------------- the command
@pytest.fixture(scope="module")
def tiny():
    return tiny_target()


TINY = ["model=tiny", "bench=humaneval", "bench.limit=3", "max_new_tokens=8", "costs.steps=2", "costs.runs=1"]


def config(*overrides):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        return compose("speed", overrides=[*TINY, f"model.path={tiny_target_path()}", *overrides])


def speed_cli(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    command = [sys.executable, str(ROOT / "speed.py"), *TINY, f"model.path={tiny_target_path()}", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_the_command_writes_costs_predictions_and_measurements_that_agree(tiny, tmp_path):
    draft = export_draft(tiny, tmp_path / "draft")  # block 4
    out = tmp_path / "out"
    done = speed_cli(ROOT, f"drafter={draft}", "batch_sizes=[1,2]", "block_sizes=[2,3,4]", f"output={out}")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pred tok/s" in done.stdout and f"wrote {out / 'speed.json'}" in done.stdout
    result = json.loads((out / "speed.json").read_text())
    assert sorted(p.name for p in out.iterdir()) == ["acceptance", "speed.json"]  # no speed.json.tmp left
    acceptance = json.loads((out / "acceptance" / "results.json").read_text())  # an evaluate.py run at block 4
    assert acceptance["block_size"] == 4 and acceptance["batch_size"] == 8 and acceptance["num_prompts"] == 3

    costs = result["costs"]
    assert [c["batch"] for c in costs["target"]] == [1, 2]
    assert [(c["batch"], c["block"]) for c in costs["speculative"]] == [(b, B) for b in (1, 2) for B in (2, 3, 4)]
    for c in costs["target"]:
        assert c["step"] == pytest.approx(c["forward"] + c["other"]) and c["forward"] > 0
    for c in costs["speculative"]:
        assert c["step"] == pytest.approx(c["draft"] + c["verify"] + c["other"]) and c["draft"] > 0 < c["verify"]
    target = {c["batch"]: c for c in costs["target"]}
    spec = {(c["batch"], c["block"]): c for c in costs["speculative"]}

    # The histograms: measured at 4 (the acceptance run's), truncated below, reply by reply.
    hists = result["histograms"]
    assert hists["4"]["source"] == "measured" and hists["4"]["accept_hist"] == acceptance["accept_hist"]
    samples = [json.loads(line) for line in (out / "acceptance" / "samples.jsonl").read_text().splitlines()]
    for block in (2, 3):
        assert hists[str(block)]["source"] == "truncated from 4"
        cut = [[min(n, block) for n in s["accept_lengths"]] for s in samples]
        assert hists[str(block)]["accept_hist"] == acceptance_stats(cut, block)["accept_hist"]
    replies = hists["4"]["replies"]
    assert [turns[0][0] for turns in replies] == [len(s["output_ids"]) for s in samples]  # one turn each

    rows = {(r["batch"], r["block"]): r for r in result["rows"]}
    assert set(rows) == set(spec)
    for (b, block), row in rows.items():
        p, hist = row["predicted"], hists[str(block)]
        assert row["tau"] == hist["tau"] and row["histogram"] == hist["source"]
        assert p["speedup"] == pytest.approx(p["tokens_per_s"] / p["target_tokens_per_s"])
        assert p["speedup_steady"] == pytest.approx(hist["tau"] * target[b]["step"] / spec[b, block]["step"])
        if b == 1:  # one row per batch: T = prefill + K s per reply, the target alone prefill + (N - 1) s_a
            tokens = [turns[0][0] for turns in hist["replies"]]
            steps = [turns[0][1] for turns in hist["replies"]]
            for n, k in zip(tokens, steps, strict=True):
                assert (n - 1) / block <= k <= n - 1
            seconds = sum(spec[1, block]["prefill"] + k * spec[1, block]["step"] for k in steps)
            target_seconds = sum(target[1]["prefill"] + (n - 1) * target[1]["step"] for n in tokens)
            assert p["tokens_per_s"] == pytest.approx(sum(tokens) / seconds)
            assert p["target_tokens_per_s"] == pytest.approx(sum(tokens) / target_seconds)
        measured = row["measured"]
        if block != 4:
            assert measured is None and row["error"] is None  # measured at the acceptance block only
            continue
        assert measured["num_requests"] == math.ceil(3 / b) * b  # the prompts cycled to whole batches
        assert measured["identical_outputs"] == 1.0  # greedy: the target's own output
        assert measured["speedup"] == pytest.approx(measured["tokens_per_s"] / measured["target_tokens_per_s"])
        for key in ("tokens_per_s", "target_tokens_per_s", "speedup"):
            assert row["error"][key] == pytest.approx(p[key] / measured[key] - 1)
    for b in (1, 2):
        fastest = max((B for B in (2, 3, 4)), key=lambda B: rows[b, B]["predicted"]["tokens_per_s"])
        assert result["best_block"][str(b)] == fastest
        assert f"{fastest}*" in done.stdout


def test_results_of_evaluate_runs_replace_decoding(tiny, tmp_path, monkeypatch):
    from dflash2.evaluation import run as evaluation

    draft = export_draft(tiny, tmp_path / "draft")
    runs = {}
    for block in (4, 6):
        runs[block] = tmp_path / f"b{block}"
        evaluate(evaluate_config(f"drafter={draft}", f"block_size={block}", *TINY[2:4]), runs[block])
    monkeypatch.setattr(evaluation, "evaluate", lambda *a: pytest.fail("decoded the acceptance again"))
    out = tmp_path / "out"
    result = speed_run(
        config(f"drafter={draft}", f"results=[{runs[4]},{runs[6]}/results.json]", "batch_sizes=[2]", f"output={out}")
    )
    assert not (out / "acceptance").exists()
    hists = result["histograms"]
    assert list(hists) == ["4", "6"]  # block_sizes null: 4, no halves down to 4 below it, and the given 6
    for block in (4, 6):
        run = json.loads((runs[block] / "results.json").read_text())
        assert hists[str(block)]["source"] == "results.json" and hists[str(block)]["accept_hist"] == run["accept_hist"]
    assert [r["measured"] is not None for r in result["rows"]] == [True, False]


@pytest.mark.parametrize(
    "override, message",
    [
        ("batch_sizes=[0,8]", "batch_sizes=[0,8]: a list of integers >= 1"),
        ("block_sizes=[2,8]", "block_sizes=[2,8] holds 8, above block 4"),
        ("block_sizes=[1]", "block_sizes=[1] holds 1: a block holds the anchor"),
        ("costs.steps=0", "costs.steps=0"),
        ("repeats=0", "repeats=0"),
        ("results=[{tmp}/missing]", "results={tmp}/missing: not an evaluate.py results.json"),
    ],
)
def test_bad_settings_are_refused_before_loading_or_writing(tiny, tmp_path, monkeypatch, override, message):
    from dflash2.commands import evaluate as command

    draft = export_draft(tiny, tmp_path / "draft")
    monkeypatch.setattr(command, "_load_target", lambda *a: pytest.fail("the target was loaded first"))
    override, message = override.format(tmp=tmp_path), message.format(tmp=tmp_path)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        speed_run(config(f"drafter={draft}", override, f"output={tmp_path / 'out'}"))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_results_of_another_bench_are_refused_in_one_line(tiny, tmp_path):
    draft = export_draft(tiny, tmp_path / "draft")
    run = {"block_size": 4, "accept_hist": [3, 1, 0, 0], "bench": "mbpp", "temperature": 0.0}
    run["draft"] = {"path": str(draft.resolve()), "name": "draft", "selector": True}
    (tmp_path / "results.json").write_text(json.dumps(run))
    done = speed_cli(tmp_path, f"drafter={draft}", f"results=[{tmp_path / 'results.json'}]")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert "measured another setting: bench 'mbpp' (here 'humaneval')" in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "outputs").exists()


def test_the_fast_path_is_costed_and_measured_on_both_sides(tmp_path, monkeypatch):
    """decode=static: the costs and the measured runs both take the fixed-shape loops, with the target's own output."""
    from dflash2.decoding import speculative

    def plain(*args, **kwargs):
        raise AssertionError("a plain loop ran under decode=static")

    monkeypatch.setattr(speculative, "speculative_generate", plain)
    monkeypatch.setattr(speculative, "target_generate", plain)
    result = speed_run(config("drafter=pld", "block_size=4", "batch_sizes=[2]", "decode=static", f"output={tmp_path}"))
    (row,) = result["rows"]
    assert row["measured"]["identical_outputs"] == 1.0 and row["measured"]["tokens_per_s"] > 0
    assert result["config"]["decode"] == "static" and result["costs"]["speculative"][0]["verify"] > 0
    acceptance = json.loads((tmp_path / "acceptance" / "results.json").read_text())
    assert acceptance["config"]["decode"] == "static"  # the acceptance run decodes on the same path


def test_prompt_lookup_is_costed_and_predicted_without_measuring(tmp_path):
    result = speed_run(config("drafter=pld", "block_size=4", "batch_sizes=[2]", "measure=false", f"output={tmp_path}"))
    assert result["draft"]["name"] == "pld" and list(result["histograms"]) == ["4"]  # block 4 has no half >= 4
    (row,) = result["rows"]
    assert row["measured"] is None and row["error"] is None and row["predicted"]["tokens_per_s"] > 0
    (cost,) = result["costs"]["speculative"]
    assert cost["block"] == 4 and cost["draft"] > 0  # the lookup itself, timed as the proposer


@pytest.mark.parametrize("fast", [None, FastDecode()], ids=["plain", "static"])
def test_a_timing_run_times_its_steps_and_stops(tiny, fast):
    """`steps` steps are timed after the prefill's step; the decode stops at the next step's start, whatever budget.
    On the fast path the prefill is a `forward` and every step a `decode_step` call, timed alike."""
    from dflash2.decoding.costs import speculative_run, target_run
    from dflash2.decoding.lookup import PromptLookup

    calls = {"propose": 0, "forward": 0}

    class Counting(PromptLookup):
        def __call__(self, *args, **kwargs):
            calls["propose"] += 1
            return super().__call__(*args, **kwargs)

    class CountingTarget:
        def __init__(self, target):
            self.target = target

        def __getattr__(self, name):
            return getattr(self.target, name)

        def forward(self, *args, **kwargs):
            calls["forward"] += 1
            return self.target.forward(*args, **kwargs)

        def decode_step(self, mode=None):
            step = self.target.decode_step(mode)

            def counted(*args):
                calls["forward"] += 1
                return step(*args)

            return counted

    token = dict(temperature=0.0, top_k=0, top_p=1.0)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
    run = speculative_run(CountingTarget(tiny), Counting(), prompts, 4, token, steps=3, seed=0, fast=fast)
    assert {k: len(v) for k, v in run.items() if k != "prefill"} == {"forward": 3, "draft": 3, "other": 3}
    assert calls == {"propose": 4, "forward": 5}  # steps 0..3 proposed and verified, after the prompt's prefill
    assert min(run["other"]) >= 0 and run["prefill"] > 0 and min(run["forward"]) > 0

    calls.update(forward=0)
    run = target_run(CountingTarget(tiny), prompts, token, steps=3, seed=0, fast=fast)
    assert {k: len(v) for k, v in run.items() if k != "prefill"} == {"forward": 3, "draft": 3, "other": 3}
    assert calls["forward"] == 5 and run["draft"] == [0.0] * 3  # the prefill, then steps 0..3
