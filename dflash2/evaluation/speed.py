"""`python speed.py`: how much faster speculative decoding makes the target, predicted from measured costs and
the drafter's acceptance, beside the speed-up measured by decoding (configs/speed.yaml).

The model (dflash2/evaluation/speed_model.py) predicts tokens/s from the cost of one draft, verify and target-alone
step (dflash2/decoding/costs.py), measured here at every batch and block size on the loops `decode` names, and the
committed-length histogram of each reply of an evaluate.py run; `measure=true` decodes each batch size to compare.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from dflash2.decoding import static as static_decode
from dflash2.decoding.costs import measure_costs
from dflash2.decoding.drafting import Drafter
from dflash2.evaluation import checks
from dflash2.evaluation import run as evaluation
from dflash2.evaluation.speed_model import expected_steps, fill, predict, tau_of, truncate
from dflash2.evaluation.speed_report import format_table
from dflash2.evaluation.timing import baseline_speed, speed, timed_passes
from dflash2.model import kernels
from dflash2.model.config import DFlash2Config
from dflash2.model.contract import BLOCK_SIZE_RULE, valid_block_size
from dflash2.model.drafter import DFlash2DraftModel
from dflash2.progress import quiet_libraries
from dflash2.target.manifest import MANIFEST_KEY
from dflash2.target.model import resolve_device

log = logging.getLogger(__name__)

OWN_KEYS = ("batch_sizes", "block_sizes", "results", "measure", "costs", "output")  # what evaluate.py has not


# ---------------------------------------------------------------------------------------------- the inputs
def acceptance_block(cfg: DictConfig) -> int:
    """The block the acceptance is decoded and the speed-up measured at: `block_size`, else the drafter's own
    (config.json only), or prompt lookup's default."""
    if cfg.drafter == checks.PLD:
        return checks.prompt_lookup(cfg)[1]
    return int(cfg.block_size or DFlash2Config.from_pretrained(Path(cfg.drafter).expanduser()).block_size)


def read_results(cfg: DictConfig) -> dict[int, dict[str, Any]]:
    """`results=`: block size -> {path, results} of each evaluate.py run given, refused unless it measured this
    drafter (same folder, or the same manifest), bench, temperature and selector setting, one run per block."""
    runs: dict[int, dict[str, Any]] = {}
    drafter = None if cfg.drafter == checks.PLD else Path(cfg.drafter).expanduser()
    config = None if drafter is None else DFlash2Config.from_pretrained(drafter)
    for given in cfg.results:
        path = Path(str(given)).expanduser()
        path = path / "results.json" if path.is_dir() else path
        try:
            results = json.loads(path.read_text())
            block, hist, draft = int(results["block_size"]), list(results["accept_hist"]), results["draft"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"results={given}: not an evaluate.py results.json ({e})") from None
        if config is None:
            same = draft.get("name") == checks.PLD and draft.get("path") is None
            selector = None
        else:
            manifest = config.extra.get(MANIFEST_KEY)
            same = draft.get("path") == str(drafter.resolve()) or (
                manifest is not None and draft.get("manifest") == manifest
            )
            selector = bool(cfg.selector) and config.use_selector
        wrong = [
            f"{key} {theirs!r} (here {ours!r})"
            for key, theirs, ours in (
                ("bench", results.get("bench"), cfg.bench.name),
                ("temperature", results.get("temperature"), float(cfg.temperature)),
                ("selector", draft.get("selector"), selector),
            )
            if theirs != ours
        ] + ([] if same else [f"drafter {draft.get('path') or draft.get('name')!r} (here drafter={cfg.drafter})"])
        if wrong:
            raise ValueError(f"results={given} measured another setting: " + ", ".join(wrong))
        if block in runs or len(hist) != block or not sum(hist):
            why = "a second run at that block" if block in runs else "its accept_hist does not fit it"
            raise ValueError(f"results={given}: block_size {block}, {why}; give one run per block size")
        if not (path.parent / "samples.jsonl").is_file():
            raise ValueError(f"results={given}: no samples.jsonl beside it (evaluate.py writes both): its replies")
        runs[block] = {"path": str(path), "results": results}
    return runs


def block_sizes(cfg: DictConfig, block: int, given: Mapping[int, Any]) -> list[Any]:
    """`block_sizes` as given, or null's default: `block` and its halves down to 4, plus the blocks of `results`."""
    if cfg.block_sizes is not None:
        return list(cfg.block_sizes)
    sizes, half = {block, *given}, block
    while half % 2 == 0 and half // 2 >= 4:
        half //= 2
        sizes.add(half)
    return sorted(sizes)


def check_settings(cfg: DictConfig) -> tuple[int, list[int], dict[int, dict[str, Any]]]:
    """Everything refusable before a target loads -> (the acceptance block, the blocks to predict at, `results`)."""
    checks.check_settings(cfg)  # the drafter, repeats, block_size, chat_template_kwargs, prompt lookup
    for key in ("costs.steps", "costs.runs"):
        value = OmegaConf.select(cfg, key)
        if type(value) is not int or value < 1:
            raise ValueError(f"{key}={value}: it must be an integer >= 1")
    sizes = cfg.batch_sizes
    if not sizes or any(type(b) is not int or b < 1 for b in sizes):
        raise ValueError(f"batch_sizes={_typed(sizes)}: a list of integers >= 1, such as [1,8,32,100]")
    block, given = acceptance_block(cfg), read_results(cfg)
    blocks = block_sizes(cfg, block, given)
    for b in blocks:
        if not valid_block_size(b):
            raise ValueError(f"block_sizes={_typed(cfg.block_sizes)} holds {b!r}: {BLOCK_SIZE_RULE}")
        if b > block and b not in given:
            raise ValueError(
                f"block_sizes={_typed(cfg.block_sizes)} holds {b}, above block {block} where the acceptance is "
                f"decoded: the truncation estimate only shortens blocks; give results=[<an evaluate.py run at "
                f"block_size={b}>] or leave {b} out"
            )
        if cfg.drafter == checks.PLD:
            try:
                checks.prompt_lookup(cfg)[0].slots(b)
            except ValueError as e:
                raise ValueError(f"block_sizes={_typed(cfg.block_sizes)} holds {b}: {e}") from None
    return block, sorted(set(blocks)), given


def _typed(value: Any) -> str:
    """A setting's value as it is typed on the command line: [1,8] for a list."""
    value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
    return json.dumps(value, separators=(",", ":")) if isinstance(value, list) else str(value)


def acceptance_run(cfg: DictConfig, block: int, run_dir: Path) -> dict[str, Any]:
    """The acceptance at `block`: an evaluate.py run of these settings (kept when `run_dir` holds it already)."""
    settings = OmegaConf.masked_copy(cfg, [k for k in cfg if k not in OWN_KEYS])
    with open_dict(settings):
        settings.block_size, settings.baseline, settings.repeats = block, False, 1
    results = evaluation.finished_run(settings, run_dir)
    if results is not None:
        log.info("kept the acceptance run in %s (same settings)", run_dir)
        return results
    log.info("decoding the acceptance at block %d into %s", block, run_dir)
    return evaluation.evaluate(settings, run_dir)


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
    cfg: DictConfig,
    turns: Any,
    target: Any,
    draft: Any,
    prompts: list[dict],
    settings: dict,
    block: int,
    use_selector: bool,
    batch: int,
) -> dict[str, Any]:
    """Speculative decoding and the target alone on the prompts cycled to whole batches of `batch`, timed as
    evaluate.py times them (`baseline=true`): tokens/s, speed-up, tau and, at T = 0, identical outputs."""
    batch_settings = dict(settings, batch_size=batch)
    cycled = fill(prompts, batch)
    passes, reference = timed_passes(cfg, turns, target, draft, cycled, batch_settings, block, use_selector, True)
    spec = speed(passes)
    base = baseline_speed(reference, passes, spec["tokens_per_s_passes"], settings["temperature"])
    samples = passes[0][0]
    return {
        "tokens_per_s": spec["tokens_per_s"],
        "target_tokens_per_s": base["tokens_per_s"],
        "speedup": base["speedup"],
        "tau": evaluation.acceptance_stats([s["accept_lengths"] for s in samples], block)["tau"],
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


def run(cfg: DictConfig) -> dict[str, Any]:
    """The command on a composed configs/speed.yaml: writes <output>/speed.json and returns what it holds."""
    quiet_libraries()
    block, blocks, given = check_settings(cfg)  # before anything loads or is written
    output = Path(cfg.output)
    path = Path(given[block]["path"]) if block in given else output / "acceptance" / "results.json"
    if block not in given:
        acceptance_run(cfg, block, path.parent)
    hists = histograms(block, blocks, given, path)

    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    device = resolve_device(cfg.get("device"))
    kernels.set_backend(cfg.kernels)
    target, draft, identity, _, use_selector = evaluation.load_run(cfg, device)
    chat_template_kwargs = evaluation.prompt_chat_template_kwargs(cfg, draft, target)
    prompts, settings = evaluation.bench_prompts(cfg), evaluation.decode_settings(cfg, target)
    first_turns = [
        evaluation.render(target.tokenizer, [{"role": "user", "content": p["turns"][0]}], chat_template_kwargs)
        for p in prompts
    ]
    token = {k: settings[k] for k in ("temperature", "top_k", "top_p")}
    timing = dict(steps=cfg.costs.steps, runs=cfg.costs.runs, warmup=int(bool(cfg.warmup)), seed=int(cfg.seed))
    batches = {b: fill(first_turns, b)[:b] for b in cfg.batch_sizes}  # the first prompts, cycled
    fast = static_decode.decode_mode(settings["decode"], settings["compile"], device)  # as the measured runs decode
    compiled = None if fast is None else fast.compile
    proposer = Drafter(target, draft, use_selector, compiled) if isinstance(draft, DFlash2DraftModel) else draft
    costs = measure_costs(target, proposer, batches, blocks, token, **timing, fast=fast)  # first: shapes warm up here
    measured = {}
    if cfg.measure:
        turns = functools.partial(evaluation.generate_turns, chat_template_kwargs=chat_template_kwargs)
        for b in cfg.batch_sizes:
            measured[b] = measure_speed(cfg, turns, target, draft, prompts, settings, block, use_selector, b)
    rows, best = compare(hists, costs, block, measured, fast is not None)
    result = {
        "bench": cfg.bench.name,
        "num_prompts": len(prompts),
        "temperature": settings["temperature"],
        "max_new_tokens": settings["max_new_tokens"],
        "device": str(device),
        "kernels": kernels.get_backend(),
        "draft": evaluation.describe_draft(cfg, draft, use_selector, block),
        "target": identity,
        "acceptance": {"block_size": block, "path": str(path)},
        "histograms": {str(b): h for b, h in hists.items()},
        "costs": costs,
        "rows": rows,
        "best_block": best,
        "config": evaluation.settings_of(cfg),
    }
    output.mkdir(parents=True, exist_ok=True)
    tmp = output / "speed.json.tmp"  # speed.json appears whole or not at all
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, output / "speed.json")
    print(format_table(result))
    print(f"wrote {output / 'speed.json'}")
    return result


def _errors(predicted: Mapping[str, float], measured: Mapping[str, Any] | None) -> dict[str, float] | None:
    """predicted / measured - 1 of tokens/s (both decoders) and of the speed-up."""
    if measured is None:
        return None
    keys = ("tokens_per_s", "target_tokens_per_s", "speedup")
    return {k: predicted[k] / measured[k] - 1 for k in keys if measured.get(k)}
