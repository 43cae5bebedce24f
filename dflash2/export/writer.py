"""Turn a training checkpoint into a folder that SGLang and vLLM serve unchanged (contract sections 2 and 3).

The folder is written next to its destination and renamed into place only after the linter passed it, so an
export either fully happens or leaves nothing behind: on an error or SIGTERM its temp folder is removed, and the
next export to the same place removes those of exports that were killed outright (SIGKILL, a power cut).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash2.export.check import lint
from dflash2.export.engines import SGLANG, V2_RUNNER, VLLM, review_engines, serve_flags
from dflash2.model.config import DFlash2Config
from dflash2.target.chat_template import KWARGS_KEY, format_kwargs
from dflash2.target.manifest import MANIFEST_KEY, METRICS_KEY, manifest_chat_template_kwargs
from dflash2.training.checkpoint import draft_from_checkpoint, find_checkpoint, load_checkpoint, plain, read_info

# Where a Lightning checkpoint keeps the datamodule's hyper-parameters (`CHECKPOINT_HYPER_PARAMS_KEY` of a
# LightningDataModule): DFlashDataModule's hold the chat template arguments training rendered the data with.
DATAMODULE_HPARAMS = "datamodule_hyper_parameters"

log = logging.getLogger(__name__)


def model_card(cfg: DFlash2Config, info: dict[str, Any]) -> str:
    """README.md of an export: provenance, validation metrics and how to serve it with SGLang and vLLM."""
    manifest = cfg.extra.get(MANIFEST_KEY) or {}
    target = manifest.get("target") or "<target model>"
    served = served_target(manifest)
    loaded = manifest.get("target_path")
    b = cfg.block_size
    kind = "DFlash2" if cfg.use_conv or cfg.use_selector else "DFlash"
    parts = []
    if cfg.use_conv:
        parts.append(f"grouped conv ({cfg.conv_kernel_size} taps, group {cfg.conv_group_size})")
    if cfg.use_selector:
        parts.append(f"candidate selector (rank {cfg.selector_rank}, top-{cfg.selector_top_k})")
    layers = f"{cfg.num_hidden_layers} draft layer{'' if cfg.num_hidden_layers == 1 else 's'}"
    shape = f"{layers}, hidden size {cfg.hidden_size}" + "".join(f", {p}" for p in parts)
    metrics = sorted((info.get("metrics") or {}).items(), key=lambda kv: _metric_order(kv[0]))
    kwargs = manifest_chat_template_kwargs(manifest)
    rendered = "not recorded" if kwargs is None else f"`{format_kwargs(kwargs)}`"
    table = "\n".join(["| metric | value |", "|---|---|"] + [f"| `{k}` | {_number(v)} |" for k, v in metrics])
    tags = ", ".join(dict.fromkeys(["speculative-decoding", "dflash", kind.lower()]))  # a DFlash drafter: one dflash
    front = ["library_name: dflash2", f"tags: [{tags}]"]
    # The Hub's base_model is a hub id: the served one when it is one; else the target's name, which names it.
    base = served if _is_hub_id(served) else manifest.get("target")
    front += [f"base_model: {base}"] if base else []
    return f"""---
{chr(10).join(front)}
---

# {kind} drafter for {target}

A block drafter for speculative decoding: it proposes {b - 1} tokens per step (block size {b}, anchor
included) from the hidden states of target layers {list(cfg.target_layer_ids)}, with the target's own embedding
and head. {shape}.

| | |
|---|---|
| target | `{target}`: `{served}`{f" (training loaded `{loaded}`)" if loaded and loaded != served else ""} |
| training data | {manifest.get("data_source", "unknown")} |
| chat template arguments | {rendered} |
| training steps | {info.get("step", manifest.get("training_steps", "unknown"))} |
| dflash2 version | {manifest.get("dflash2_version", "unknown")} |

## Validation metrics

{table if metrics else "None recorded."}

`tau_sim` is the acceptance length predicted from teacher-forced accuracies of the proposals decoding makes
(for DFlash2, the candidate selector's picks; `tau_sim_top1` is the plain argmax path, used with the selector
off); measured speculative decoding is usually a little lower.

{serving(cfg, served)}
Check the folder against the DFlash2 contract with `python export.py check=<this folder>`.
"""


def serving(cfg: DFlash2Config, served: str) -> str:
    """The card's serving section: the serve commands as SGLang 0.5.23 and vLLM 0.33.0 take them, and what they cannot
    serve (`dflash2.export.engines.review_engines`, the review `export.py check` prints)."""
    engines = review_engines(cfg.to_dict())
    b = cfg.block_size
    flags = serve_flags(cfg.extra.get(MANIFEST_KEY))
    parts = [
        f"""## Serving

Checked against the released source of {SGLANG} and {VLLM} (contract section 9). The engines count "draft
tokens" differently: SGLang's `--speculative-num-draft-tokens` is the block size B = {b}; vLLM's
`num_speculative_tokens` is the number of proposals, B - 1 = {b - 1} (vLLM reads no `dflash_config.block_size`)."""
    ]
    if flags:
        parts.append(
            "Training rendered its chats with the chat template arguments above: the commands pass them to every "
            "request (`--default-chat-template-kwargs`), so that served prompts read as the drafter's data did."
        )
    if engines.warnings:
        parts.append("Before serving:\n\n" + "\n".join(f"- {w}." for w in engines.warnings))
    if engines.sglang:
        parts.append(
            f"""{SGLANG}:

```bash
python -m sglang.launch_server --model-path {served} \\
    --speculative-algorithm DFLASH --speculative-draft-model-path <this folder> \\
    --speculative-num-draft-tokens {b}{flags}
```"""
        )
    else:
        parts.append(f"{SGLANG} cannot serve this drafter (see above).")
    if engines.vllm:
        runner = (
            f"on its V2 model runner only, which `{V2_RUNNER}` requires (the V1 runner refuses a DFlash2DraftModel "
            "or, for drafters mixing sliding and full layers, cannot serve them)"
            if engines.v2_runner
            else "on either model runner"
        )
        env = f"{V2_RUNNER} " if engines.v2_runner else ""
        spec = f'{{"method": "dflash", "model": "<this folder>", "num_speculative_tokens": {b - 1}}}'
        parts.append(
            f"""{VLLM}, {runner}:

```bash
{env}vllm serve {served} \\
    --speculative-config '{spec}'{flags}
```"""
        )
    else:
        parts.append(f"{VLLM} cannot serve this drafter (see above).")
    return "\n\n".join(parts) + "\n"


def served_target(manifest: dict[str, Any]) -> str:
    """What the card's serve commands load: the manifest's `serve_model` (a hub id, or a local folder the user gave);
    for a manifest without one, the folder training loaded unless that is a dequantized copy of the embedded
    SmolLM2 in some machine's cache, which is served as SmolLM2's hub id; else a placeholder to fill in."""
    from dflash2.target.locate import SMOLLM2_HUB_ID, is_dequantized_smollm2

    target = manifest.get("target") or "<target model>"
    placeholder = f"<hub id or folder of {target}>"
    if "serve_model" in manifest:
        return manifest["serve_model"] or placeholder
    loaded = manifest.get("target_path")
    if loaded and is_dequantized_smollm2(loaded):
        return SMOLLM2_HUB_ID
    if loaded and Path(loaded).parent.name == "gguf":  # another GGUF's dequantized copy: machine-local
        return placeholder
    return loaded or placeholder


def _is_hub_id(name: str) -> bool:
    return name.count("/") == 1 and not name.startswith((".", "/", "~", "<"))


def _metric_order(name: str) -> tuple[str, int]:
    """`val/acc_2` before `val/acc_10`: slots in their order, the other metrics by name."""
    stem, _, slot = name.rpartition("_")
    return (stem, int(slot)) if slot.isdigit() else (name, -1)


def _number(v: Any) -> str:
    v = v.item() if hasattr(v, "item") else v
    return f"{v:.4f}" if isinstance(v, float) else str(v)


def export_checkpoint(
    ckpt_path: str | Path,
    output_dir: str | Path,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    allow_pickle: bool = False,
) -> Path:
    """Write a training checkpoint as a servable folder (config.json, bf16 safetensors, README.md). `allow_pickle`:
    also load a checkpoint holding pickled objects (it runs their code; `load_checkpoint`)."""
    output_dir = Path(output_dir).absolute()
    if output_dir.exists() and not overwrite:
        raise FileExistsError(f"output_dir {output_dir} exists: pick another one or pass overwrite=true")
    file = find_checkpoint(ckpt_path)
    ckpt = load_checkpoint(file, allow_pickle)
    model = draft_from_checkpoint(ckpt, file)
    info = read_info(ckpt)
    if info.get("manifest"):
        # The metrics as data beside the identity, for evaluate.py's tau_sim (the model card shows them to people).
        metrics = {k: float(v) for k, v in (info.get("metrics") or {}).items()}
        model.config.extra[MANIFEST_KEY] = plain(info["manifest"]) | ({METRICS_KEY: metrics} if metrics else {})
        # The chat template arguments training rendered with (the datamodule's), which evaluation renders with.
        kwargs = plain((ckpt.get(DATAMODULE_HPARAMS) or {}).get(KWARGS_KEY))
        if isinstance(kwargs, dict):
            model.config.extra[MANIFEST_KEY][KWARGS_KEY] = kwargs

    output_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_killed_exports(output_dir)
    with _sigterm_raises(), _locked_temp_dir(output_dir) as tmp:
        quiet = logging.root.manager.disable
        logging.disable(logging.INFO)  # huggingface_hub announces the temp folder; we log the final one below
        try:
            model.save_pretrained(tmp, max_shard_size=max_shard_size)
        finally:
            logging.disable(quiet)
        (tmp / "README.md").write_text(model_card(model.config, info))
        report = lint(tmp)
        if not report.ok:
            raise ValueError(
                f"the exported folder breaks the contract (a dflash2 bug, please report it):\n{report.format()}"
            )
        _readable_by_all(tmp)
        _move_into_place(tmp, output_dir, overwrite)
    log.info("exported %s -> %s", file, output_dir)
    return output_dir


def _temp_prefix(output_dir: Path) -> str:
    return f".{output_dir.name}.export-"


@contextlib.contextmanager
def _locked_temp_dir(output_dir: Path) -> Iterator[Path]:
    """A temp folder beside `output_dir`, locked (flock) while this process writes it, removed unless it was moved
    into place. The kernel drops the lock when the process dies, however it dies: that marks a killed export's."""
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(output_dir), dir=output_dir.parent))
    fd = os.open(tmp, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left there once moved into place
        os.close(fd)


def _remove_killed_exports(output_dir: Path) -> None:
    """Remove the temp folders of exports to `output_dir` that died mid-way; a running one holds its lock."""
    for stale in output_dir.parent.glob(_temp_prefix(output_dir) + "*"):
        try:
            fd = os.open(stale, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # another export is writing it
        finally:
            os.close(fd)
        log.info("removing %s, left by an export that was killed", stale)
        shutil.rmtree(stale, ignore_errors=True)


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM (a scheduler's stop, `kill`) raises SystemExit while exporting, so the temp folder is cleaned up as
    on any error; by default Python dies on it without unwinding. Signals reach the main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)  # None: not set from Python


def _readable_by_all(folder: Path) -> None:
    """The modes a plain mkdir and file write give (the umask's), not mkdtemp's 0700 and safetensors' 0600 files, so
    that a serving container running as another user can read the export."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for file in folder.iterdir():
        file.chmod(0o666 & ~umask)


def _move_into_place(tmp: Path, output_dir: Path, overwrite: bool) -> None:
    if not output_dir.exists():
        tmp.rename(output_dir)
        return
    if not overwrite:  # it appeared while we were writing
        raise FileExistsError(f"output_dir {output_dir} exists: pick another one or pass overwrite=true")
    old = Path(tempfile.mkdtemp(prefix=f".{output_dir.name}.old-", dir=output_dir.parent))
    output_dir.rename(old / output_dir.name)
    try:
        tmp.rename(output_dir)
    except BaseException:
        (old / output_dir.name).rename(output_dir)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
