"""The drafter an evaluation names, checked before anything loads: an export folder that passes `export.py check`, or
prompt lookup (`drafter=pld`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash2.export.check import lint

PLD = "pld"  # drafter=pld: prompt lookup, the training-free baseline, in place of an export folder
PLD_BLOCK_SIZE = 16  # its block when block_size is null: 15 proposals, as in the PLD figure BENCHMARKS quotes

# Folders that passed `lint`, with what their files were then: a run's settings are checked before its run folder
# exists and again when the run builds them, and each check after the first reads only the files' sizes and times.
_linted: set[tuple[str, tuple[tuple[str, int, int], ...]]] = set()


def check_drafter(drafter: Any) -> None:
    """`drafter` as evaluate.py takes it, refused in one sentence naming it and the fix: unset, or a folder that fails
    `export.py check` (config.json and the safetensors headers only: a second, before any target loads)."""
    if not drafter or drafter == "???":
        raise ValueError("drafter is not set: pass drafter=<export dir> (a folder export.py wrote), or drafter=pld")
    if drafter == PLD:
        return
    folder = Path(str(drafter)).expanduser()
    key = (str(folder.resolve()), _files(folder))
    if key in _linted:
        return
    report = lint(folder)
    if not report.ok:
        raise ValueError(f"drafter={drafter} fails `export.py check`: " + "; ".join(report.problems))
    _linted.add(key)


def _files(folder: Path) -> tuple[tuple[str, int, int], ...]:
    """(name, size, modification time) of each file in `folder`: a folder rewritten since its check is checked again."""
    if not folder.is_dir():
        return ()
    return tuple(sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file()))
