"""`python speed.py`: how much faster speculative decoding makes the target, predicted from measured costs and
the drafter's acceptance, beside the speed-up measured by decoding (configs/speed.yaml).

The model (dflash2/evaluation/speed_model.py) predicts tokens/s from the cost of one draft, verify and target-alone
step (dflash2/decoding/costs.py), measured here at every batch and block size on the loops `decode` names, and the
committed-length histogram of each reply of an evaluate.py run; `measure=true` decodes each batch size to compare.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dflash2.decoding.costs import Timing, measure_costs
from dflash2.evaluation import run as evaluation
from dflash2.evaluation.loading import Loaded, TargetLoader, describe_draft, prompt_chat_template_kwargs, render
from dflash2.evaluation.settings import EvaluationSettings, evaluation_settings
from dflash2.evaluation.speed_model import cycled, expected_steps, predict, tau_of, truncate
from dflash2.evaluation.speed_report import format_table
from dflash2.evaluation.timing import TimedPass, baseline_speed, speed, timed_passes
from dflash2.evaluation.turns import Decoder, generate_turns
from dflash2.model import kernels
from dflash2.model.config import DFlash2Config
from dflash2.model.contract import BLOCK_SIZE_RULE, valid_block_size
from dflash2.target.manifest import MANIFEST_KEY

log = logging.getLogger(__name__)

OWN_KEYS = ("batch_sizes", "block_sizes", "results", "measure", "costs", "output")  # what evaluate.py has not


@dataclasses.dataclass(frozen=True)
class SpeedSettings:
    """speed.py's settings (configs/speed.yaml), checked: the acceptance run's evaluation settings at the block the
    speed-up is measured at, the blocks predicted, the batch sizes, earlier runs' acceptance (`results`, block size ->
    {path, results}), whether to measure, how many steps and runs each cost takes, and the output folder."""

    acceptance: EvaluationSettings
    block_sizes: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    results: Mapping[int, dict[str, Any]]
    measure: bool
    steps: int
    runs: int
    output: Path
    config: Mapping[str, Any]


# ---------------------------------------------------------------------------------------------- the inputs
def speed_settings(values: Mapping[str, Any]) -> SpeedSettings:
    """speed.py's resolved config as plain values -> its settings; everything refusable before a target loads."""
    evaluate = {k: v for k, v in values.items() if k not in OWN_KEYS}
    acceptance = evaluation_settings(evaluate)  # the drafter, repeats, block_size, chat_template_kwargs, lookup
    for key in ("steps", "runs"):
        value = values["costs"][key]
        if type(value) is not int or value < 1:
            raise ValueError(f"costs.{key}={value}: it must be an integer >= 1")
    sizes = values["batch_sizes"]
    if not sizes or any(type(b) is not int or b < 1 for b in sizes):
        raise ValueError(f"batch_sizes={_typed(sizes)}: a list of integers >= 1, such as [1,8,32,100]")
    block, given = acceptance.block_size, read_results(values, acceptance)
    blocks = block_sizes(values.get("block_sizes"), block, given)
    for b in blocks:
        check_block(values.get("block_sizes"), b, block, given, acceptance)
    # The acceptance run: an evaluate.py run of these settings at `block`, one pass, no baseline.
    at_block = evaluate | {"block_size": block, "baseline": False, "repeats": 1}
    return SpeedSettings(
        acceptance=evaluation_settings(at_block),
        block_sizes=tuple(sorted(set(blocks))),
        batch_sizes=tuple(sizes),
        results=given,
        measure=bool(values["measure"]),
        steps=values["costs"]["steps"],
        runs=values["costs"]["runs"],
        output=Path(values["output"]),
        config=dict(values),
    )


def check_block(typed: Any, b: Any, block: int, given: Mapping[int, Any], acceptance: EvaluationSettings) -> None:
    """One of the blocks to predict at, refused where it cannot be: not a block, above the acceptance's without a
    run measured at it, or too small for prompt lookup."""
    if not valid_block_size(b):
        raise ValueError(f"block_sizes={_typed(typed)} holds {b!r}: {BLOCK_SIZE_RULE}")
    if b > block and b not in given:
        raise ValueError(
            f"block_sizes={_typed(typed)} holds {b}, above block {block} where the acceptance is decoded: the "
            f"truncation estimate only shortens blocks; give results=[<an evaluate.py run at block_size={b}>] or "
            f"leave {b} out"
        )
    if acceptance.is_lookup or acceptance.hybrid is not None:
        try:
            acceptance.lookup.slots(b)
        except ValueError as e:
            raise ValueError(f"block_sizes={_typed(typed)} holds {b}: {e}") from None


def read_results(values: Mapping[str, Any], acceptance: EvaluationSettings) -> dict[int, dict[str, Any]]:
    """`results=`: block size -> {path, results} of each evaluate.py run given, refused unless it measured this
    drafter (same folder, or the same manifest), bench, temperature and selector setting, one run per block."""
    runs: dict[int, dict[str, Any]] = {}
    drafter = None if acceptance.is_lookup else Path(acceptance.drafter).expanduser()
    config = None if drafter is None else DFlash2Config.from_pretrained(drafter)
    for given in values["results"]:
        path = Path(str(given)).expanduser()
        path = path / "results.json" if path.is_dir() else path
        try:
            results = json.loads(path.read_text())
            block, hist, draft = int(results["block_size"]), list(results["accept_hist"]), results["draft"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"results={given}: not an evaluate.py results.json ({e})") from None
        if config is None:
            same = draft.get("name") == acceptance.drafter and draft.get("path") is None
            selector = None
        else:
            manifest = config.extra.get(MANIFEST_KEY)
            same = draft.get("path") == str(drafter.resolve()) or (
                manifest is not None and draft.get("manifest") == manifest
            )
            selector = acceptance.selector and config.use_selector
        wrong = [
            f"{key} {theirs!r} (here {ours!r})"
            for key, theirs, ours in (
                ("bench", results.get("bench"), acceptance.bench),
                ("temperature", results.get("temperature"), acceptance.temperature),
                ("selector", draft.get("selector"), selector),
                ("hybrid", draft.get("hybrid") is not None, acceptance.hybrid is not None),
            )
            if theirs != ours
        ] + (
            [] if same else [f"drafter {draft.get('path') or draft.get('name')!r} (here drafter={acceptance.drafter})"]
        )
        if wrong:
            raise ValueError(f"results={given} measured another setting: " + ", ".join(wrong))
        if block in runs or len(hist) != block or not sum(hist):
            why = "a second run at that block" if block in runs else "its accept_hist does not fit it"
            raise ValueError(f"results={given}: block_size {block}, {why}; give one run per block size")
        if not (path.parent / "samples.jsonl").is_file():
            raise ValueError(f"results={given}: no samples.jsonl beside it (evaluate.py writes both): its replies")
        runs[block] = {"path": str(path), "results": results}
    return runs


def block_sizes(given_sizes: Any, block: int, given: Mapping[int, Any]) -> list[Any]:
    """`block_sizes` as given, or null's default: `block` and its halves down to 4, plus the blocks of `results`."""
    if given_sizes is not None:
        return list(given_sizes)
    sizes, half = {block, *given}, block
    while half % 2 == 0 and half // 2 >= 4:
        half //= 2
        sizes.add(half)
    return sorted(sizes)


def _typed(value: Any) -> str:
    """A setting's value as it is typed on the command line: [1,8] for a list."""
    return json.dumps(list(value), separators=(",", ":")) if isinstance(value, (list, tuple)) else str(value)


def acceptance_run(settings: SpeedSettings, load_target: TargetLoader, run_dir: Path) -> dict[str, Any]:
    """The acceptance at its block: an evaluate.py run of these settings (kept when `run_dir` holds it already)."""
    results = evaluation.finished_run(settings.acceptance, run_dir)
    if results is not None:
        log.info("kept the acceptance run in %s (same settings)", run_dir)
        return results
    log.info("decoding the acceptance at block %d into %s", settings.acceptance.block_size, run_dir)
    return evaluation.evaluate(settings.acceptance, load_target, run_dir)


def replies_of(results_path: str | Path, block: int) -> list[list[tuple[int, list[int]]]]:
    """Each prompt's replies by turn, (tokens, accept_hist at `block`), from the samples.jsonl beside a results.json
    (evaluate.py writes both)."""
    replies: dict[str, dict[int, tuple[int, list[int]]]] = {}
    for line in (Path(results_path).parent / "samples.jsonl").read_text().splitlines():
        s = json.loads(line)
        hist = evaluation.acceptance_stats([s["accept_lengths"]], block)["accept_hist"]
        replies.setdefault(s["id"], {})[s["turn"]] = (len(s["output_ids"]), hist)
    return [[turns[t] for t in sorted(turns)] for turns in replies.values()]


# ---------------------------------------------------------------------------------------------- the command
def measure_speed(
    settings: EvaluationSettings, loaded: Loaded, prompts: list[dict], chat_template_kwargs: Any, batch: int
) -> dict[str, Any]:
    """Speculative decoding and the target alone on the prompts cycled to whole batches of `batch`, timed as
    evaluate.py times them (`baseline=true`): tokens/s, speed-up, tau and, at T = 0, identical outputs."""
    decoder = evaluation.decoder_of(settings, loaded, batch)
    batches = cycled(prompts, batch)

    def timed(d: Decoder) -> TimedPass:
        return functools.partial(generate_turns, d, batches, settings.multi_turn, chat_template_kwargs)

    passes, reference = timed_passes(
        timed(decoder), timed(decoder.alone()), settings.repeats, settings.warmup, settings.seed, settings.device
    )
    spec = speed(passes)
    base = baseline_speed(reference, passes, spec["tokens_per_s_passes"], settings.temperature)
    samples = passes[0][0]
    return {
        "tokens_per_s": spec["tokens_per_s"],
        "target_tokens_per_s": base["tokens_per_s"],
        "speedup": base["speedup"],
        "tau": evaluation.acceptance_stats([s["accept_lengths"] for s in samples], settings.block_size)["tau"],
        "identical_outputs": base.get("identical_outputs"),
        "num_requests": len(samples),
        "num_tokens": sum(len(s["output_ids"]) for s in samples),
    }


def histograms(block: int, blocks: list[int], given: Mapping[int, Any], path: str | Path) -> dict[int, dict]:
    """What each block's prediction uses: its replies' (tokens, mean steps) by prompt and turn, their histogram and
    tau, and where they come from: the acceptance run at `block` (`path`), an evaluate.py run given in `results`
    (its own replies), or the acceptance run's replies with each one's histogram truncated."""
    measured = replies_of(path, block)
    out = {}
    for b in blocks:
        if b in given:
            replies, source = replies_of(given[b]["path"], b), {"source": "results.json", "path": given[b]["path"]}
        elif b == block:
            replies, source = measured, {"source": "measured", "path": str(path)}
        else:
            replies = [[(n, truncate(h, b)) for n, h in turns] for turns in measured]
            source = {"source": f"truncated from {block}"}
        hist = [sum(column) for column in zip(*(h for turns in replies for _, h in turns), strict=True)]
        if not sum(hist):
            raise ValueError(
                f"{source.get('path', path)}: no verify step at all (every reply ended at its first token)"
            )
        steps = [[(n, expected_steps(h, n - 1)) for n, h in turns] for turns in replies]
        out[b] = source | {"accept_hist": hist, "tau": tau_of(hist), "replies": steps}
    return out


def compare(
    hists: Mapping[int, dict],
    costs: Mapping[str, list[dict]],
    block: int,
    measured: Mapping[int, dict],
    static: bool = False,
) -> tuple[list[dict], dict[str, int]]:
    """One row per batch and block size: the prediction (of the fast path's loops with `static`), the measurement
    (at `block`) and the error; and the block predicted fastest at each batch size."""
    target = {c["batch"]: c for c in costs["target"]}
    rows = []
    for b in target:
        for B, hist in hists.items():
            spec = {c["batch"]: c for c in costs["speculative"] if c["block"] == B}
            predicted = predict(hist["replies"], b, hist["tau"], spec, target, static)
            here = measured.get(b) if B == block else None
            row = {"batch": b, "block": B, "histogram": hist["source"], "tau": hist["tau"], "predicted": predicted}
            rows.append(row | {"measured": here, "error": _errors(predicted, here)})
    best = {
        str(b): max((r for r in rows if r["batch"] == b), key=lambda r: r["predicted"]["tokens_per_s"])["block"]
        for b in target
    }
    return rows, best


def run(settings: SpeedSettings, load_target: TargetLoader) -> dict[str, Any]:
    """The command on its checked settings: writes <output>/speed.json and returns what it holds."""
    block, given = settings.acceptance.block_size, settings.results
    path = Path(given[block]["path"]) if block in given else settings.output / "acceptance" / "results.json"
    if block not in given:
        acceptance_run(settings, load_target, path.parent)
    hists = histograms(block, list(settings.block_sizes), given, path)

    # The measured runs decode as the acceptance run did, with the settings' own repeats and baseline.
    measured_settings = dataclasses.replace(settings.acceptance, repeats=settings.config["repeats"])
    loaded = evaluation.set_up(measured_settings, load_target)
    chat_template_kwargs = prompt_chat_template_kwargs(measured_settings, loaded)
    prompts = evaluation.bench_prompts(measured_settings)
    first_turns = [
        render(loaded.target.tokenizer, [{"role": "user", "content": p["turns"][0]}], chat_template_kwargs)
        for p in prompts
    ]
    s = measured_settings
    token = dict(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p)
    timing = Timing(steps=settings.steps, runs=settings.runs, warmup=int(s.warmup), seed=s.seed)
    batches = {b: cycled(first_turns, b)[:b] for b in settings.batch_sizes}  # the first prompts, cycled
    proposer = loaded.proposer(s)  # as the measured runs decode: the fast path's steps compiled alike
    costs = measure_costs(loaded.target, proposer, batches, list(settings.block_sizes), token, timing, s.decode)
    measured = {}
    if settings.measure:  # after the costs: the shapes have warmed up there
        for b in settings.batch_sizes:
            measured[b] = measure_speed(s, loaded, prompts, chat_template_kwargs, b)
    rows, best = compare(hists, costs, block, measured, s.decode is not None)
    result = {
        "bench": s.bench,
        "num_prompts": len(prompts),
        "temperature": s.temperature,
        "max_new_tokens": s.max_new_tokens,
        "device": str(s.device),
        "kernels": kernels.get_backend(),
        "draft": describe_draft(s, loaded),
        "target": loaded.identity,
        "acceptance": {"block_size": block, "path": str(path)},
        "histograms": {str(b): h for b, h in hists.items()},
        "costs": costs,
        "rows": rows,
        "best_block": best,
        "config": dict(settings.config),
    }
    settings.output.mkdir(parents=True, exist_ok=True)
    tmp = settings.output / "speed.json.tmp"  # speed.json appears whole or not at all
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, settings.output / "speed.json")
    print(format_table(result))
    print(f"wrote {settings.output / 'speed.json'}")
    return result


def _errors(predicted: Mapping[str, float], measured: Mapping[str, Any] | None) -> dict[str, float] | None:
    """predicted / measured - 1 of tokens/s (both decoders) and of the speed-up."""
    if measured is None:
        return None
    keys = ("tokens_per_s", "target_tokens_per_s", "speedup")
    return {k: predicted[k] / measured[k] - 1 for k in keys if measured.get(k)}
