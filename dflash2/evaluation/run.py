"""`python evaluate.py`: how many tokens per target step a drafter really gives, measured by speculative decoding.

One run = one drafter (or prompt lookup, `drafter=pld`, or the drafter with prompt lookup beside it, `hybrid=ngram`)
x one benchmark x one setting (temperature, block size, selector on/off). It writes `results.json` (acceptance
statistics, speed, who was evaluated) and `samples.jsonl` (one line per request) into its run folder, prints a table
and logs an offline W&B run. A drafter's greedy run also reports its copy gap (`dflash2.evaluation.copy_gap`): where
prompt lookup would have had a proposal accepted, and the taus there. A hybrid run reports what share of the steps each
proposer took and its tau there. `dflash2.evaluation.sweep` summarises a multirun.

The settings come checked and typed (`dflash2.evaluation.settings`); the command layer (dflash2/commands/evaluate.py)
builds them from the Hydra config and says how the target is built (`loading.TargetLoader`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from dflash2.decoding.proposer import SOURCES
from dflash2.decoding.speculative import Sampling
from dflash2.evaluation.copy_gap import copy_gap, replayable
from dflash2.evaluation.divergence import divergences
from dflash2.evaluation.loading import (
    Loaded,
    TargetLoader,
    describe_draft,
    load,
    prompt_chat_template_kwargs,
    read_tau_sim,
    stop_token_ids,
)
from dflash2.evaluation.report import divergence_line, format_table, log_wandb
from dflash2.evaluation.settings import EvaluationSettings
from dflash2.evaluation.timing import TimedPass, baseline_speed, speed, timed_passes
from dflash2.evaluation.turns import Decoder, generate_turns
from dflash2.model import kernels
from dflash2.target.manifest import MANIFEST_KEY

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- statistics
def acceptance_stats(accept_lengths: list[list[int]], block_size: int) -> dict[str, Any]:
    """tau = mean committed tokens per verify step; per_position_accept[k-1] = fraction of steps whose proposal k
    was accepted (k = 1..B-1); accept_hist[n-1] = steps that committed n tokens (n = 1..B)."""
    steps = [n for lengths in accept_lengths for n in lengths]
    hist = [0] * block_size
    for n in steps:
        hist[n - 1] += 1
    total = max(len(steps), 1)
    reached = [sum(hist[k:]) / total for k in range(1, block_size)]
    return {
        "tau": sum(steps) / total if steps else 0.0,
        "num_steps": len(steps),
        "per_position_accept": reached,
        "accept_hist": hist,
    }


def proposer_stats(samples: list[dict]) -> dict[str, dict[str, Any]] | None:
    """Of a run whose steps name their proposer (a hybrid's): per proposer, its steps, their share of all steps and
    its tau on them (None where it took none); None for a run of one proposer."""
    if not any("proposers" in s for s in samples):
        return None
    steps = [(who, n) for s in samples for who, n in zip(s.get("proposers", ()), s["accept_lengths"], strict=True)]
    out = {}
    for name in SOURCES:
        mine = [n for who, n in steps if who == name]
        out[name] = {
            "steps": len(mine),
            "share": len(mine) / len(steps) if steps else 0.0,
            "tau": sum(mine) / len(mine) if mine else None,
        }
    return out


# ---------------------------------------------------------------------------------------------- a run
def bench_prompts(settings: EvaluationSettings) -> list[dict]:
    """The bench's prompts (its first `limit`), refused when there are none."""
    from dflash2.data.benches import load_prompts

    prompts = load_prompts(settings.bench, settings.limit)
    if not prompts:
        raise ValueError(f"bench {settings.bench!r} with limit={settings.limit} has no prompts")
    return prompts


def decoder_of(settings: EvaluationSettings, loaded: Loaded, batch_size: int | None = None) -> Decoder:
    """How the run's passes decode (at `batch_size`, else the run's own)."""
    sampling = Sampling(
        temperature=settings.temperature,
        top_k=settings.top_k,
        top_p=settings.top_p,
        stop_ids=tuple(stop_token_ids(loaded.target, settings.stop_tokens)),
        batch_size=batch_size or settings.batch_size,
        # Beside the target alone at T = 0: each greedy choice's margin, to tell rounding from a bug where they differ.
        record_margins=settings.baseline and settings.temperature == 0,
    )
    return Decoder(
        loaded.target,
        loaded.proposer(settings),
        sampling,
        settings.max_new_tokens,
        settings.block_size,
        settings.decode,
    )


def set_up(settings: EvaluationSettings, load_target: TargetLoader) -> Loaded:
    """The process as the run wants it (threads, kernels), then the target and drafter."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    kernels.set_backend(settings.kernels)
    return load(settings, load_target)


def evaluate(settings: EvaluationSettings, load_target: TargetLoader, run_dir: str | Path) -> dict[str, Any]:
    """One evaluation run; writes results.json and samples.jsonl into run_dir and returns the results."""
    run_dir = Path(run_dir)
    loaded = set_up(settings, load_target)
    described = describe_draft(settings, loaded)
    chat_template_kwargs = prompt_chat_template_kwargs(settings, loaded)
    prompts = bench_prompts(settings)
    decoder = decoder_of(settings, loaded)

    def timed(d: Decoder) -> TimedPass:  # every pass renders the prompts alike
        return functools.partial(generate_turns, d, prompts, settings.multi_turn, chat_template_kwargs)

    passes, reference = timed_passes(
        timed(decoder),
        timed(decoder.alone()) if settings.baseline else None,
        settings.repeats,
        settings.warmup,
        settings.seed,
        settings.device,
    )
    samples = passes[0][0]
    results = {
        **acceptance_stats([s["accept_lengths"] for s in samples], settings.block_size),
        "tau_sim": tau_sim_of(loaded),
        "num_prompts": len(prompts),
        "num_requests": len(samples),
        "num_tokens": sum(len(s["output_ids"]) for s in samples),
        **speed(passes),
        "temperature": settings.temperature,
        "top_k": settings.top_k,
        "top_p": settings.top_p,
        "block_size": settings.block_size,
        "max_new_tokens": settings.max_new_tokens,
        "batch_size": settings.batch_size,
        "multi_turn": settings.multi_turn,
        "chat_template_kwargs": chat_template_kwargs,  # what the prompts were rendered with
        "bench": settings.bench,
        "kernels": kernels.get_backend(),
        "device": str(settings.device),
        "seed": settings.seed,
        "draft": described,
        "target": loaded.identity,
        "proposers": proposer_stats(samples),
    }
    # tau_sim was measured at the trained block size: a gap at another size would compare different things.
    comparable = results["tau_sim"] is not None and settings.block_size == described["trained_block_size"]
    results["tau_gap"] = results["tau_sim"] - results["tau"] if comparable else None
    # Where prompt lookup would have done as well, replayed from the greedy text (evaluation.copy_gap): no decoding.
    gap = replayable(described, settings.temperature)
    results["copy_gap"] = copy_gap(samples, settings.block_size) if gap else None
    if reference:
        results["baseline"] = baseline_speed(reference, passes, results["tokens_per_s_passes"], settings.temperature)
        if settings.temperature == 0:
            found = divergences(samples, reference[0][0], loaded.target.lm_head_weight.dtype)
            results["baseline"]["divergences"] = found
            if found["not_near_ties"]:
                log.error("%s", divergence_line(found))
    results["config"] = dict(settings.config)
    write_run(run_dir, samples, results)
    return results


def tau_sim_of(loaded: Loaded) -> float | None:
    """What the drafter's training predicts for the path it decodes: `tau_sim`, or with the selector off
    `tau_sim_top1`; None for prompt lookup, which nothing predicts."""
    if loaded.draft is None:
        return None
    argmax_path = loaded.draft.candidate_selector is not None and not loaded.use_selector
    manifest = loaded.draft.config.extra.get(MANIFEST_KEY)
    return read_tau_sim(manifest, "tau_sim_top1" if argmax_path else "tau_sim")


def write_run(run_dir: Path, samples: list[dict], results: dict[str, Any]) -> None:
    """samples.jsonl, then results.json, which appears whole or not at all: it marks the run as done."""
    run_dir.mkdir(parents=True, exist_ok=True)  # only now: a run that failed before leaves no folder behind
    with open(run_dir / "samples.jsonl", "w") as f:
        for s in samples:  # the margins served the divergence report; per token, they would double the file
            f.write(json.dumps({k: v for k, v in s.items() if k != "margins"}) + "\n")
    tmp = run_dir / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, run_dir / "results.json")


def finished_run(settings: EvaluationSettings, run_dir: str | Path) -> dict[str, Any] | None:
    """The results already in `run_dir` for exactly these settings (a rerun of a killed sweep), else None."""
    try:
        results = json.loads((Path(run_dir) / "results.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return results if results.get("config") == dict(settings.config) else None


def main(settings: EvaluationSettings, load_target: TargetLoader, run_dir: str | Path) -> dict[str, Any]:
    """evaluate.py: one run, or one run of a sweep. Rerunning a sweep into the same `hydra.sweep.dir` keeps the runs
    that already finished with the same settings, so a killed sweep resumes instead of starting over."""
    results = finished_run(settings, run_dir)
    if results is not None:
        kept = Path(run_dir) / "results.json"
        log.info("kept %s: measured before with these settings (delete it to redo)\n%s", kept, format_table(results))
        return results
    results = evaluate(settings, load_target, run_dir)
    if settings.wandb is not None:  # first: W&B's own lines then come before the table, which stays on screen
        log_wandb(settings, results, run_dir)
    # Logged, not printed: the job's evaluate.log keeps the table too.
    log.info("wrote %s and samples.jsonl\n%s", Path(run_dir) / "results.json", format_table(results))
    return results
