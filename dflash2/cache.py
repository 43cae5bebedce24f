"""Where dflash2 keeps what it builds once and reuses: dequantized GGUF targets, the tiny test target, bench prompts."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """Where dflash2 keeps what it builds once and reuses: `$DFLASH2_CACHE`, else `~/.cache/dflash2` (honouring
    `XDG_CACHE_HOME`)."""
    root = os.environ.get("DFLASH2_CACHE")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "dflash2"


def model_folder(folder: Path, build: Callable[[Path], None]) -> Path:
    """`folder` (a transformers folder under `cache_root()`), made by `build(tmp)` on first use: built beside it and
    renamed into place, so a killed build leaves nothing and a concurrent one that won the race is kept."""
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".tmp-"))
    try:
        build(tmp)
        tmp.rename(folder)
    except OSError:
        if not (folder / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
