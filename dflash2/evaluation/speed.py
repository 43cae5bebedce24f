"""`python speed.py`: how much faster speculative decoding makes the target, predicted from measured costs and
the drafter's acceptance, beside the speed-up measured by decoding (configs/speed.yaml).

The model. A speculative step at batch b and block B takes s(b, B) = draft + verify + other seconds, the target
alone's step s_a(b) = forward + other, each batch's prefill P(b, B) and P_a(b): all measured (`dflash2.decoding.costs`).
The acceptance is the committed-length histogram at B of each reply (h_i(n) of its steps committed n tokens,
n = 1..B), from an evaluate.py run of the bench's prompts; their sum is the run's `accept_hist`, whose mean is tau.
Assumptions:

1. Batch: every row of a step commits its own accept length; a reply's steps commit n tokens with the frequency of
   its own histogram, drawn independently step after step. A step's time is set by the batch (how many rows are
   live), not by any one row: with all b rows live a step commits b * tau tokens on average in s(b, B).
2. Requests finish unevenly. Reply i of N_i tokens takes its first from the prefill and N_i - 1 from verify steps:
   K_i = K(N_i - 1) steps on average, K(m) = 1 + sum_n p_i(n) K(m - n), K(m <= 0) = 0 (a last step is cut at the
   budget or a stop token), p_i = h_i / sum h_i. Speculative decoding drops finished rows, so step j of a batch costs
   s(r_j, B) with r_j = sum_i clamp(K_i - j, 0, 1) live rows (a row's fractional last step happens with that
   probability); s is linear in the rows between measured batch sizes, flat below the smallest, r * s(1) for r < 1.
   The target alone decodes every row until the longest reply is done (`target_generate`): (max N_i - 1) s_a(b).
3. Host overhead: `other`, the part of a step beyond the draft and the verify forward (acceptance, commits, cache
   bookkeeping), measured per step like the forwards; each batch pays its prefill once.

Per batch of replies:  T = P(b, B) + sum_j s(r_j, B),  T_a = P_a(b) + (max_i N_i - 1) s_a(b); over the batches,
tokens/s = sum N / sum T, the target alone's sum N / sum T_a, and the speed-up sum T_a / sum T. The replies are the
acceptance run's, its prompts cycled to whole batches of b, as the measured runs decode them (turn by turn). Long
replies at full batches leave the steady speed-up tau * s_a(b) / s(b, B).

Other blocks B' use the replies of an evaluate.py run at B' (`results=`) where one is given, else the truncation
estimate: a step that committed n tokens at B commits min(n, B') at B' (the same first proposals, cut to the B' - 1
slots of the smaller block; positions in the text taken as alike, as in assumption 1), reply by reply. Each row of
the output says which it used.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
from omegaconf import DictConfig, OmegaConf, open_dict

from dflash2.decoding import static as static_decode
from dflash2.decoding.costs import measure_costs
from dflash2.decoding.speculative import Drafter
from dflash2.evaluation import checks
from dflash2.evaluation import run as evaluation
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

T = TypeVar("T")
OWN_KEYS = ("batch_sizes", "block_sizes", "results", "measure", "costs", "output")  # what evaluate.py has not


# ---------------------------------------------------------------------------------------------- the model
def tau_of(hist: Sequence[int]) -> float:
    """Mean committed tokens per step of a histogram (hist[n - 1] = steps that committed n tokens)."""
    return sum(n * h for n, h in enumerate(hist, 1)) / sum(hist)


def truncate(hist: Sequence[int], block_size: int) -> list[int]:
    """A histogram measured at a block of len(hist) estimated at `block_size` <= that: n committed -> min(n, B')."""
    if not 2 <= block_size <= len(hist):
        raise ValueError(f"truncation estimates blocks of 2..{len(hist)} from a histogram at {len(hist)}")
    return [*hist[: block_size - 1], sum(hist[block_size - 1 :])]


def expected_steps(hist: Sequence[int], tokens: int) -> float:
    """K(tokens): the mean number of steps that commit at least `tokens` tokens, each step committing n with the
    histogram's frequency (assumption 2 of the module's docstring); 0 for none."""
    if tokens <= 0:
        return 0.0
    total = sum(hist)
    p = [(n, h / total) for n, h in enumerate(hist, 1) if h]
    k = [0.0] * (tokens + 1)
    for m in range(1, tokens + 1):
        k[m] = 1 + sum(pn * k[max(m - n, 0)] for n, pn in p)
    return k[tokens]


def at(table: Mapping[int, float], rows: float) -> float:
    """A cost measured at some batch sizes, at `rows` live rows: linear between them, flat outside, r * cost(1) below
    one row (the share of the time a last, fractional, step happens)."""
    if rows <= 0:
        return 0.0
    if rows < 1:
        return rows * at(table, 1)
    sizes = sorted(table)
    if rows <= sizes[0] or rows >= sizes[-1]:
        return table[sizes[0] if rows <= sizes[0] else sizes[-1]]
    hi = bisect.bisect_left(sizes, rows)
    lo = hi - 1
    share = (rows - sizes[lo]) / (sizes[hi] - sizes[lo])
    return table[sizes[lo]] + share * (table[sizes[hi]] - table[sizes[lo]])


def fill(items: Sequence[T], batch: int) -> list[T]:
    """`items` cycled to whole batches of `batch`: every batch decoded is full."""
    return [items[i % len(items)] for i in range(-(-len(items) // batch) * batch)]


def request_batches(replies: Sequence[Sequence[T]], batch: int) -> list[list[T]]:
    """Replies by prompt and turn -> the replies of each batch decoded, as `generate_turns` batches the prompts cycled
    to whole batches: turn by turn, `batch` requests at a time of the prompts that have that turn."""
    prompts = fill(replies, batch)
    batches = []
    for turn in range(max(len(p) for p in prompts)):
        todo = [p[turn] for p in prompts if turn < len(p)]
        batches += [todo[i : i + batch] for i in range(0, len(todo), batch)]
    return batches


def predict(
    replies: Sequence[Sequence[tuple[int, float]]],
    batch: int,
    tau: float,
    spec: Mapping[int, Mapping[str, float]],
    target: Mapping[int, Mapping[str, float]],
) -> dict[str, float]:
    """Predicted tokens/s of speculative decoding and of the target alone at `batch`, and the speed-up.

    `replies`: (tokens, mean steps K) of each reply by prompt and turn, at one block; `tau` that block's; `spec`:
    batch size -> its draft/verify/other/step/prefill seconds (`costs.measure_costs`); `target`: batch size -> the
    target alone's forward/other/step/prefill."""
    step, prefill = _column(spec, "step"), _column(spec, "prefill")
    target_step, target_prefill = _column(target, "step"), _column(target, "prefill")
    tokens = seconds = target_seconds = 0.0
    for replies_of_batch in request_batches(replies, batch):
        rows, lengths = len(replies_of_batch), [n for n, _ in replies_of_batch]
        steps = [k for _, k in replies_of_batch]
        live = [sum(min(max(k - j, 0.0), 1.0) for k in steps) for j in range(math.ceil(max(steps)))]
        tokens += sum(lengths)
        seconds += at(prefill, rows) + sum(at(step, r) for r in live)
        target_seconds += at(target_prefill, rows) + (max(lengths) - 1) * at(target_step, rows)
    return {
        "tokens_per_s": tokens / seconds,
        "target_tokens_per_s": tokens / target_seconds,
        "speedup": target_seconds / seconds,
        "speedup_steady": tau * at(target_step, batch) / at(step, batch),
    }


def _column(costs: Mapping[int, Mapping[str, float]], key: str) -> dict[int, float]:
    return {b: c[key] for b, c in costs.items()}


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
) -> tuple[list[dict], dict[str, int]]:
    """One row per batch and block size: the prediction, the measurement (at `block`) and the error; and the block
    predicted fastest at each batch size."""
    target = {c["batch"]: c for c in costs["target"]}
    rows = []
    for b in target:
        for B, hist in hists.items():
            spec = {c["batch"]: c for c in costs["speculative"] if c["block"] == B}
            predicted = predict(hist["replies"], b, hist["tau"], spec, target)
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
    proposer = Drafter(target, draft, use_selector) if isinstance(draft, DFlash2DraftModel) else draft
    token = {k: settings[k] for k in ("temperature", "top_k", "top_p")}
    timing = dict(steps=cfg.costs.steps, runs=cfg.costs.runs, warmup=int(bool(cfg.warmup)), seed=int(cfg.seed))
    batches = {b: fill(first_turns, b)[:b] for b in cfg.batch_sizes}  # the first prompts, cycled
    fast = static_decode.decode_mode(settings["decode"], settings["compile"], device)  # as the measured runs decode
    costs = measure_costs(target, proposer, batches, blocks, token, **timing, fast=fast)  # first: shapes warm up here
    measured = {}
    if cfg.measure:
        turns = functools.partial(evaluation.generate_turns, chat_template_kwargs=chat_template_kwargs)
        for b in cfg.batch_sizes:
            measured[b] = measure_speed(cfg, turns, target, draft, prompts, settings, block, use_selector, b)
    rows, best = compare(hists, costs, block, measured)
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
