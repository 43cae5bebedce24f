"""`python evaluate.py`: how many tokens per target step a drafter really gives, measured by speculative decoding.

One run = one drafter (or prompt lookup, `drafter=pld`) x one benchmark x one setting (temperature, block size,
selector on/off). It writes `results.json` (acceptance statistics, speed, who was evaluated) and `samples.jsonl`
(one line per request) into its run folder, prints a table and logs an offline W&B run. A drafter's greedy run also
reports its copy gap (`dflash2.evaluation.copy_gap`): where prompt lookup would have had a proposal accepted,
and the taus there. `dflash2.evaluation.sweep` summarises a multirun.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from dflash2.decoding import static as static_decode
from dflash2.decoding.lookup import PromptLookup
from dflash2.decoding.speculative import Generation, OnCommit, Sampling
from dflash2.evaluation.checks import PLD, check_drafter, check_settings, prompt_lookup
from dflash2.evaluation.copy_gap import copy_gap, replayable
from dflash2.evaluation.report import format_table, log_wandb
from dflash2.evaluation.timing import (
    baseline_speed,
    clock,
    graphs_compiled,
    speed,
    timed_passes,
    warn_compiles_in_pass,
)
from dflash2.groups import build
from dflash2.model import kernels
from dflash2.model.config import DFlash2Config
from dflash2.model.drafter import DFlash2DraftModel
from dflash2.progress import DecodeProgress, quiet_libraries
from dflash2.target.chat_template import KWARGS_KEY, check_chat_template_kwargs, format_kwargs, render_chat, same_kwargs
from dflash2.target.manifest import (
    MANIFEST_KEY,
    check_manifest,
    manifest_chat_template_kwargs,
    manifest_metric,
    target_identity,
)
from dflash2.target.model import resolve_device

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------------- loading
@functools.lru_cache(maxsize=1)  # the runs of a sweep (one process) share one target
def load_target(model_json: str, device: str) -> Any:
    """The `model` group's target (TargetModel.load), given as JSON so that the cache can key on it."""
    return build(json.loads(model_json), device=device)


def load_model_target(cfg: DictConfig, device: torch.device, layer_ids: list[int]) -> tuple[Any, dict[str, Any]]:
    """The target of the `model` group, capturing the features of `layer_ids`, and its identity."""
    model = OmegaConf.to_container(cfg.model, resolve=True) | {"target_layer_ids": list(layer_ids)}
    target = load_target(json.dumps(model, sort_keys=True), str(device))
    return target, target_identity(target.name, target.config, target.tokenizer)


def load_pair(cfg: DictConfig, device: torch.device) -> tuple[Any, DFlash2DraftModel, dict[str, Any]]:
    """The target of the `model` group and the drafter at `drafter`, refused when trained for another target."""
    draft_dir = Path(cfg.drafter).expanduser()
    # export.py check's contract check, from config.json and the safetensors headers: a damaged folder fails in one
    # sentence before a target loads, instead of in a safetensors traceback after.
    check_drafter(cfg.drafter)
    saved = DFlash2Config.from_pretrained(draft_dir)
    # The drafter decides which target layers it reads, whatever the model group suggests for training.
    target, identity = load_model_target(cfg, device, saved.target_layer_ids)
    check_manifest(saved.extra.get(MANIFEST_KEY), identity)
    if saved.hidden_size != target.hidden_size or saved.vocab_size > target.vocab_size:
        raise ValueError(
            f"{draft_dir}: drafter hidden_size/vocab_size {saved.hidden_size}/{saved.vocab_size} do not "
            f"fit target {cfg.model.name!r} ({target.hidden_size}/{target.vocab_size})"
        )
    draft = DFlash2DraftModel.from_pretrained(draft_dir, dtype=target.lm_head_weight.dtype, device=device).eval()
    return target, draft, identity


def describe_draft(
    cfg: DictConfig, draft: DFlash2DraftModel | PromptLookup, use_selector: bool, block_size: int
) -> dict[str, Any]:
    """The `draft` entry of results.json: what proposed, with the settings that shape its proposals."""
    if isinstance(draft, PromptLookup):
        return {
            "path": None,
            "name": PLD,
            "architecture": "PromptLookup",
            "selector": None,
            "conv": None,
            "trained_block_size": None,
            "manifest": None,
            "pld": draft.settings(block_size),
        }
    return {
        "path": str(Path(cfg.drafter).expanduser().resolve()),
        "name": Path(cfg.drafter).name,
        "architecture": draft.config.to_dict()["architectures"][0],
        "selector": use_selector,
        "conv": draft.config.use_conv,
        "trained_block_size": draft.config.block_size,
        "manifest": draft.config.extra.get(MANIFEST_KEY),
    }


def read_tau_sim(manifest: dict[str, Any] | None, name: str = "tau_sim") -> float | None:
    """The drafter's teacher-forced `tau_sim` as its export recorded it in config.json (`dflash2_manifest.metrics`),
    None when it did not. `name="tau_sim_top1"`: a DFlash2 drafter's argmax path, the one `selector=false` decodes."""
    return manifest_metric(manifest, name)


# ---------------------------------------------------------------------------------------------- prompts
def render(
    tokenizer: Any, messages: list[dict[str, str]], chat_template_kwargs: dict[str, Any] | None = None
) -> list[int]:
    """A conversation rendered with the target's chat template and `chat_template_kwargs`, ready for the assistant's
    reply: the text training rendered the drafter's data with begins the same way (`dflash2.target.chat_template`)."""
    if getattr(tokenizer, "chat_template", None):
        text = render_chat(tokenizer, messages, generation_prompt=True, chat_template_kwargs=chat_template_kwargs)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    log.warning("the target's tokenizer has no chat template: prompts are the plain user turns")
    return tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]


def prompt_chat_template_kwargs(cfg: DictConfig, draft: Any, target: Any) -> dict[str, Any]:
    """The chat template's extra arguments the prompts are rendered with: `chat_template_kwargs` when set, else the
    drafter's (its training's, recorded in its manifest), else none for a drafter that does not record them; for
    prompt lookup, which was never trained, the target's (`model.chat_template_kwargs`)."""
    asked = check_chat_template_kwargs(cfg.get(KWARGS_KEY), KWARGS_KEY)
    if not isinstance(draft, DFlash2DraftModel):
        return asked if asked is not None else dict(getattr(target, KWARGS_KEY, None) or {})
    trained = manifest_chat_template_kwargs(draft.config.extra.get(MANIFEST_KEY))
    if asked is None:
        if trained is None:
            log.info(
                "the drafter does not record the %s its training rendered with (exported before they were "
                "recorded): rendering the prompts with none, {}, as training did then",
                KWARGS_KEY,
            )
        return trained or {}
    if trained is not None and not same_kwargs(asked, trained):
        log.warning(
            "rendering the prompts with %s=%s, but the drafter was trained on chats rendered with %s: it is measured "
            "on text it was not trained on (%s=null renders as it was trained)",
            KWARGS_KEY,
            format_kwargs(asked),
            format_kwargs(trained),
            KWARGS_KEY,
        )
    return asked


def stop_token_ids(target: Any, extra_tokens: list[str]) -> list[int]:
    """The target's eos ids, plus chat end tokens named in the config."""
    vocab = target.tokenizer.get_vocab()
    return sorted({*target.eos_token_ids, *(vocab[t] for t in extra_tokens if t in vocab)})


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


# ---------------------------------------------------------------------------------------------- a run
def generate_turns(
    target: Any,
    draft: DFlash2DraftModel | PromptLookup | None,
    prompts: list[dict],
    settings: dict[str, Any],
    multi_turn: bool,
    generator: torch.Generator,
    warmup: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[dict], float]:
    """Decode every turn of every prompt (later turns see the earlier answers) -> (sample records, seconds); the
    prompts are rendered with `chat_template_kwargs` (`prompt_chat_template_kwargs`).

    `warmup` first decodes a few tokens of one prompt, untimed, so that one-off costs (CUDA context, Triton
    compilation, allocator growth) stay out of tokens/s."""
    tokenizer = target.tokenizer
    conversations = [[] for _ in prompts]
    samples, seconds = [], 0.0
    n_turns = max(len(p["turns"]) for p in prompts) if multi_turn else 1
    if warmup:  # before the progress bar too, whose tokens/s then counts what the timed passes count
        first = render(tokenizer, [{"role": "user", "content": prompts[0]["turns"][0]}], chat_template_kwargs)
        spare = torch.Generator(generator.device).manual_seed(0)
        decode(target, draft, [first], dict(settings, max_new_tokens=16), spare)
    requests = sum(min(len(p["turns"]), n_turns) for p in prompts)
    progress = DecodeProgress(requests, "decode" if draft is not None else "target alone")
    compiled = graphs_compiled()
    for turn in range(n_turns):
        todo = [i for i, p in enumerate(prompts) if turn < len(p["turns"])]
        for i in todo:
            conversations[i].append({"role": "user", "content": prompts[i]["turns"][turn]})
        prompt_ids = [render(tokenizer, conversations[i], chat_template_kwargs) for i in todo]
        start = clock(target)
        outputs = decode(target, draft, prompt_ids, settings, generator, progress)
        seconds += clock(target) - start
        for i, ids, out in zip(todo, prompt_ids, outputs, strict=True):
            answer = tokenizer.decode(out.output_ids, skip_special_tokens=True)
            conversations[i].append({"role": "assistant", "content": answer})
            samples.append(_sample(prompts[i]["id"], turn, ids, out))
    progress.close()
    warn_compiles_in_pass(compiled, "decode" if draft is not None else "target alone")
    return samples, seconds


def decode(
    target: Any,
    draft: DFlash2DraftModel | PromptLookup | None,
    prompt_ids: list[list[int]],
    settings: dict[str, Any],
    generator: torch.Generator,
    on_commit: OnCommit | None = None,
) -> list[Generation]:
    """Speculative decoding (a drafter or prompt lookup proposes), or the target alone when `draft` is None; on the
    fast path (dflash2/decoding/static.py) with decode=static."""
    sampling = Sampling(**{f.name: settings[f.name] for f in dataclasses.fields(Sampling)})
    length = settings["max_new_tokens"]
    device = target.lm_head_weight.device
    fast = static_decode.decode_mode(settings.get("decode", "plain"), settings.get("compile"), device)
    spec, alone = static_decode.decoders(fast)
    if draft is None:
        return alone(target, prompt_ids, length, sampling, generator, on_commit)
    block_size, use_selector = settings["block_size"], settings["use_selector"]
    return spec(target, draft, prompt_ids, block_size, length, sampling, use_selector, generator, on_commit)


def _sample(prompt_id: str, turn: int, prompt_ids: list[int], out: Generation) -> dict[str, Any]:
    return {
        "id": prompt_id,
        "turn": turn,
        "prompt_ids": prompt_ids,
        "output_ids": out.output_ids,
        "accept_lengths": out.accept_lengths,
    }


def load_run(cfg: DictConfig, device: torch.device) -> tuple[Any, DFlash2DraftModel | PromptLookup, dict, int, bool]:
    """What a run decodes with: (target, drafter or prompt lookup, the target's identity, block size, whether the
    candidate selector proposes); prompt lookup's settings are refused before a target loads."""
    if cfg.drafter == PLD:
        draft, block_size = prompt_lookup(cfg)  # bad settings fail here, before a target is loaded
        target, identity = load_model_target(cfg, device, [])  # no features to capture, no manifest to check
        return target, draft, identity, block_size, False
    target, draft, identity = load_pair(cfg, device)
    block_size = int(cfg.block_size or draft.config.block_size)
    use_selector = bool(cfg.selector) and draft.candidate_selector is not None
    if cfg.selector and draft.candidate_selector is None:
        log.info("the drafter has no candidate selector (plain DFlash): per-slot argmax / sampling")
    return target, draft, identity, block_size, use_selector


def bench_prompts(cfg: DictConfig) -> list[dict]:
    """The `bench` group's prompts (its first `bench.limit`), refused when there are none."""
    from dflash2.data.benches import load_prompts

    prompts = load_prompts(cfg.bench.name, cfg.bench.get("limit"))
    if not prompts:
        raise ValueError(f"bench {cfg.bench.name!r} with limit={cfg.bench.get('limit')} has no prompts")
    return prompts


def decode_settings(cfg: DictConfig, target: Any) -> dict[str, Any]:
    """How both decoders sample, stop and batch (`decode`'s settings; speculative decoding adds its block)."""
    return dict(
        max_new_tokens=int(cfg.max_new_tokens),
        temperature=float(cfg.temperature),
        top_k=int(cfg.top_k),
        top_p=float(cfg.top_p),
        stop_ids=stop_token_ids(target, list(cfg.stop_tokens)),
        batch_size=int(cfg.batch_size),
        decode=cfg.get("decode", "plain"),
        compile=cfg.get("compile", False),
    )


def evaluate(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """One evaluation run; writes results.json and samples.jsonl into run_dir and returns the results."""
    run_dir = Path(run_dir)
    check_settings(cfg)  # before anything loads (evaluate.py: before Hydra makes the run folder, CheckSettings)
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    device = resolve_device(cfg.get("device"))
    kernels.set_backend(cfg.kernels)
    target, draft, identity, block_size, use_selector = load_run(cfg, device)
    described = describe_draft(cfg, draft, use_selector, block_size)
    chat_template_kwargs = prompt_chat_template_kwargs(cfg, draft, target)
    turns = functools.partial(generate_turns, chat_template_kwargs=chat_template_kwargs)  # every pass renders alike
    prompts = bench_prompts(cfg)
    settings = decode_settings(cfg, target)
    seed = int(cfg.seed)
    passes, reference = timed_passes(
        cfg, turns, target, draft, prompts, settings, block_size, use_selector, bool(cfg.baseline)
    )
    samples = passes[0][0]
    num_tokens = sum(len(s["output_ids"]) for s in samples)
    tau_sim = None  # prompt lookup is not trained: nothing predicts its tau
    if isinstance(draft, DFlash2DraftModel):
        argmax_path = draft.candidate_selector is not None and not use_selector
        tau_sim = read_tau_sim(described["manifest"], "tau_sim_top1" if argmax_path else "tau_sim")
    results: dict[str, Any] = {
        **acceptance_stats([s["accept_lengths"] for s in samples], block_size),
        "tau_sim": tau_sim,
        "num_prompts": len(prompts),
        "num_requests": len(samples),
        "num_tokens": num_tokens,
        **speed(passes),
        "temperature": settings["temperature"],
        "top_k": settings["top_k"],
        "top_p": settings["top_p"],
        "block_size": block_size,
        "max_new_tokens": settings["max_new_tokens"],
        "batch_size": settings["batch_size"],
        "multi_turn": bool(cfg.multi_turn),
        KWARGS_KEY: chat_template_kwargs,  # what the prompts were rendered with
        "bench": cfg.bench.name,
        "kernels": kernels.get_backend(),
        "device": str(device),
        "seed": seed,
        "draft": described,
        "target": identity,
    }
    # tau_sim was measured at the trained block size: a gap at another size would compare different things.
    comparable = tau_sim is not None and block_size == described["trained_block_size"]
    results["tau_gap"] = tau_sim - results["tau"] if comparable else None
    # Where prompt lookup would have done as well, replayed from the greedy text (evaluation.copy_gap): no decoding.
    results["copy_gap"] = copy_gap(samples, block_size) if replayable(described, settings["temperature"]) else None
    if reference:
        results["baseline"] = baseline_speed(reference, passes, results["tokens_per_s_passes"], settings["temperature"])
    run_dir.mkdir(parents=True, exist_ok=True)  # only now: a run that failed before leaves no folder behind
    with open(run_dir / "samples.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")
    results["config"] = settings_of(cfg)
    tmp = run_dir / "results.json.tmp"  # results.json appears whole or not at all: it marks the run as done
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    os.replace(tmp, run_dir / "results.json")
    return results


def settings_of(cfg: DictConfig) -> dict[str, Any]:
    """What a run measured, for recognising it again: the resolved config without the W&B logging settings."""
    settings = OmegaConf.to_container(cfg, resolve=True)
    settings.pop("wandb", None)
    return settings


def finished_run(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any] | None:
    """The results already in `run_dir` for exactly these settings (a rerun of a killed sweep), else None."""
    try:
        results = json.loads((Path(run_dir) / "results.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return results if results.get("config") == settings_of(cfg) else None


def main(cfg: DictConfig, run_dir: str | Path) -> dict[str, Any]:
    """evaluate.py: one run, or one run of a sweep. Rerunning a sweep into the same `hydra.sweep.dir` keeps the runs
    that already finished with the same settings, so a killed sweep resumes instead of starting over."""
    # Logged, not printed: the job's evaluate.log keeps the table too.
    quiet_libraries()
    results = finished_run(cfg, run_dir)
    if results is not None:
        kept = Path(run_dir) / "results.json"
        log.info("kept %s: measured before with these settings (delete it to redo)\n%s", kept, format_table(results))
        return results
    results = evaluate(cfg, run_dir)
    log.info("wrote %s and samples.jsonl\n%s", Path(run_dir) / "results.json", format_table(results))
    if cfg.wandb.enabled:
        log_wandb(cfg, results, run_dir)
    return results
