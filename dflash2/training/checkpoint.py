"""The training checkpoint's schema: what `DFlash2Module` writes into a Lightning checkpoint beside Lightning's own
keys, and how the drafter is rebuilt from it (export.py, tests). Nothing else spells these keys.

- `state_dict`: the drafter's tensors only, under `draft.` (the module keeps it as `self.draft`; the frozen target is
  never saved), with the contract's names after the prefix.
- `hyper_parameters.draft_config`: the drafter's `DFlash2Config.to_dict()`, as config.json will hold it.
- `dflash2`: `{"manifest": ..., "metrics": the latest validation's, "step": the optimizer step}`.
"""

from __future__ import annotations

import logging
import pickle
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash2.model.config import DFlash2Config, tensor_shapes
from dflash2.model.drafter import DFlash2DraftModel, check_tensors

PREFIX = "draft."
CONFIG_KEY = "draft_config"
INFO_KEY = "dflash2"
LAST = "last.ckpt"  # the latest state of a run (configs/callbacks/default.yaml)
TAU_SIM = "val/tau_sim"  # what the best checkpoint is the best by (the same file's model_checkpoint.monitor)

log = logging.getLogger(__name__)


def drafter_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The tensors a checkpoint keeps of a module's state: the drafter's."""
    return {k: v for k, v in state_dict.items() if k.startswith(PREFIX)}


def write_info(checkpoint: dict[str, Any], manifest: dict[str, Any], metrics: dict[str, float], step: int) -> None:
    checkpoint[INFO_KEY] = {"manifest": manifest, "metrics": dict(metrics), "step": int(step)}


def read_info(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The `dflash2` entry ({} for a checkpoint without one: not written by dflash2's training)."""
    return checkpoint.get(INFO_KEY) or {}


def find_checkpoint(path: str | Path) -> Path:
    """A .ckpt file as given. In a run dir (or its `checkpoints/`), the best checkpoint by `val/tau_sim`, as Lightning's
    `ckpt_path="best"` would take it: the validation metrics each checkpoint records (`dflash2.metrics`), the later
    step on a tie. Without recorded metrics, `last.ckpt`, else the checkpoint with the highest step. The log says
    which checkpoint was taken and why."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise FileNotFoundError(f"ckpt_path {path} does not exist: pass a .ckpt file or a training run dir")
    found = sorted(path.glob("*.ckpt")) + sorted(path.glob("checkpoints/*.ckpt"))
    if not found:
        raise FileNotFoundError(f"no .ckpt under {path} or {path / 'checkpoints'}: pass the checkpoint file")
    scored = [(tau, step, p) for p in found for tau, step in [_recorded(p)] if tau is not None]
    if scored:
        # Ties (a hard-linked last.ckpt is the same file as the best) go to the later step, then the best's own name.
        tau, step, best = max(scored, key=lambda t: (t[0], t[1], t[2].name != LAST))
        latest = max(scored, key=lambda t: (t[1], t[2].name == LAST))
        also = "" if latest[1] == step else f"; the latest, {latest[2].name}, has {latest[0]:.4f} at step {latest[1]}"
        log.info(
            "ckpt_path=%s: taking %s, the best by %s (%.4f at step %d%s); pass a .ckpt file to take another",
            path, best.relative_to(path), TAU_SIM, tau, step, also,
        )  # fmt: skip
        return best
    for candidate in (path / "checkpoints" / LAST, path / LAST):
        if candidate.is_file():
            log.info("ckpt_path=%s: taking %s (no checkpoint records %s)", path, candidate.relative_to(path), TAU_SIM)
            return candidate

    def step(p: Path) -> int:
        m = re.search(r"step=(\d+)", p.name)
        return int(m.group(1)) if m else -1

    best = max(found, key=step)
    if len(found) > 1 and step(best) < 0:
        raise ValueError(
            f"{path} holds several checkpoints and none is last.ckpt or names its step: pass one of "
            f"{[p.name for p in found]} as ckpt_path"
        )
    return best


def run_dir_of(ckpt_path: str | Path) -> Path:
    """The run folder of one of its checkpoints: <run>/checkpoints/last.ckpt -> <run>."""
    path = Path(ckpt_path).absolute()
    return path.parent.parent if path.parent.name == "checkpoints" else path.parent


def _recorded(path: Path) -> tuple[float | None, int]:
    """(val/tau_sim, step) that a checkpoint of dflash2's training records, (None, -1) for any other file. Reading
    them loads the pickled part alone: the tensors are memory-mapped and never read."""
    try:
        info = read_info(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
    except Exception:  # unreadable, or not a training checkpoint: not a candidate for "best"
        return None, -1
    tau = (info.get("metrics") or {}).get(TAU_SIM)
    return (float(tau), int(info.get("step", -1))) if isinstance(tau, int | float) else (None, -1)


def load_checkpoint(path: str | Path, allow_pickle: bool = False) -> dict[str, Any]:
    """torch.load of a training checkpoint, tensors and plain data only (`weights_only=True`), with the failure modes
    of a half-copied file turned into one clear message.

    A checkpoint that needs full unpickling (objects other than tensors and plain containers) is refused: unpickling
    runs whatever code the file names. dflash2's training writes plain data only; `allow_pickle=True` (export.py
    allow_pickle=true) loads another one fully, for a file the user trusts."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", mmap=True, weights_only=not allow_pickle)
    except pickle.UnpicklingError as e:
        # The safe unpickler names what it refused ("Unsupported global: GLOBAL omegaconf.dictconfig.DictConfig");
        # any other unpickling error is a damaged file.
        found = re.search(r"WeightsUnpickler error: (Unsupported [^\n]+?)(?: was not an allowed|\.\s|\n|$)", str(e))
        if allow_pickle or not found:
            raise _unreadable(path, e) from e
        raise ValueError(
            f"{path} holds pickled objects besides tensors and plain data ({found.group(1)}), and "
            "loading them would run any code the file names: dflash2's training never writes such a checkpoint; "
            "pass allow_pickle=true only if you trust this file"
        ) from None
    except Exception as e:  # zip / EOF errors from a truncated or foreign file all mean the same here
        raise _unreadable(path, e) from e


def _unreadable(path: Path, e: Exception) -> ValueError:
    reason = str(e).split(". ")[0]  # torch appends a paragraph of advice that says what we say below
    return ValueError(
        f"{path}: cannot read the checkpoint ({type(e).__name__}: {reason}); the file is truncated "
        "or not a Lightning checkpoint: re-copy it or point ckpt_path at another one"
    )


def plain(obj: Any) -> Any:
    """Mappings and lists of any kind (the config nodes a fully unpickled checkpoint may hold) as dicts and lists, so
    that the config serialises as plain JSON."""
    if isinstance(obj, Mapping):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return tuple(plain(v) for v in obj)
    if isinstance(obj, Sequence) and not isinstance(obj, str | bytes):
        return [plain(v) for v in obj]
    return obj


def draft_from_checkpoint(ckpt: dict[str, Any], where: Any = "checkpoint") -> DFlash2DraftModel:
    """Build the drafter of a training checkpoint, refusing by name anything the contract would not serve."""
    draft_config = (ckpt.get("hyper_parameters") or {}).get(CONFIG_KEY)
    if draft_config is None:
        raise ValueError(
            f"{where}: hyper_parameters.{CONFIG_KEY} is missing; it was not written by dflash2's "
            "training (which saves DFlash2Config.to_dict() there)"
        )
    try:
        cfg = DFlash2Config.from_dict(plain(draft_config))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: hyper_parameters.{CONFIG_KEY} is invalid: {e}") from e
    state = {k.removeprefix(PREFIX): v for k, v in drafter_state(ckpt.get("state_dict") or {}).items()}
    if not state:
        raise ValueError(f"{where}: state_dict holds no '{PREFIX}*' tensors; the drafter's weights are missing")
    not_float = [
        f"{k} ({getattr(v, 'dtype', type(v).__name__)})"
        for k, v in state.items()
        if not torch.is_tensor(v) or not v.is_floating_point()
    ]
    if not_float:
        raise ValueError(
            f"{where}: tensors {not_float} are not floating point; the checkpoint is corrupt or not a drafter's"
        )
    check_tensors(cfg, {k: tuple(v.shape) for k, v in state.items()}, where)
    # Build on the meta device and adopt the checkpoint's tensors: no random init, no second copy in memory.
    with torch.device("meta"):
        model = DFlash2DraftModel(cfg)
    model.load_state_dict({k: state[k] for k in tensor_shapes(cfg)}, strict=True, assign=True)
    model.rotary = type(model.rotary)(cfg)  # RoPE frequencies are a non-persistent buffer: recompute them for real
    if on_meta := [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]:
        raise RuntimeError(f"{on_meta} are not in the checkpoint and were left on the meta device (a dflash2 bug)")
    return model
