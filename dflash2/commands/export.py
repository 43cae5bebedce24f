"""`python export.py` (`dflash2-export`): export a training checkpoint to a servable drafter folder
(dflash2.export.writer), or check a folder against the contract (dflash2.export.check), on configs/export.yaml.

    python export.py ckpt_path=runs/my-run output_dir=exports/my-drafter
    python export.py check=exports/my-drafter
"""

from __future__ import annotations

import sys

from omegaconf import DictConfig

from dflash2.commands import command
from dflash2.export.check import lint
from dflash2.export.writer import export_checkpoint

USAGE = (
    "usage: python export.py ckpt_path=<run dir (its best by val/tau_sim) or .ckpt> output_dir=<dir> "
    "[max_shard_size=5GB] [overwrite=true] [allow_pickle=true]\n       python export.py check=<drafter dir>\n"
    "Quote paths that contain '=' (Lightning's epoch=1-step=10.ckpt) for Hydra: 'ckpt_path=\"<path>\"'"
)


def main() -> None:
    """The console entry; the exit status is the check's (or the export's)."""
    command("export", lambda cfg: sys.exit(run(cfg)))


def run(cfg: DictConfig) -> int:
    """`check=<dir>` lints a folder, `ckpt_path=... output_dir=...` exports one; returns the exit status."""
    if cfg.get("check"):
        report = lint(cfg.check)
        print(report.format())
        return 0 if report.ok else 1
    if not cfg.get("ckpt_path") or not cfg.get("output_dir"):
        print(USAGE)
        return 2
    try:
        out = export_checkpoint(
            cfg.ckpt_path,
            cfg.output_dir,
            cfg.get("max_shard_size", "5GB"),
            bool(cfg.get("overwrite", False)),
            bool(cfg.get("allow_pickle", False)),
        )
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"export failed: {e}")
        return 1
    print(lint(out).format())
    return 0


if __name__ == "__main__":
    main()
