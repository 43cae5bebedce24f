"""`train.py`'s config on the tiny target, shared by the training and run tests (the chats fixture is in conftest)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

from dflash2.commands.resolvers import register_resolvers
from dflash2.testing import tiny_target_path

ROOT = Path(__file__).resolve().parents[1]
register_resolvers()


def tiny_overrides(chats: Path, run_dir: Path, *overrides: str) -> list[str]:
    """The command line of a small run on the tiny target, as train.py takes it; `overrides` come last."""
    if not any(o.startswith("draft=") for o in overrides):
        overrides = ("draft.selector_rank=8", "draft.selector_top_k=4", *overrides)
    return [
        "model=tiny",  # with its experiment, the test sizes of configs/quickstart/tiny.yaml
        f"model.path={tiny_target_path()}",
        "data=jsonl",
        f"data.path={chats}",
        "data.val_size=4",
        "data.batch_size=4",
        "data.max_length=128",
        "data.num_proc=1",
        "data.num_workers=0",
        f"data.cache_dir={run_dir}/cache",
        "trainer=cpu",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "logger=csv",
        f"run_dir={run_dir}",
        *overrides,
    ]


def config(chats: Path, run_dir: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose("train", overrides=tiny_overrides(chats, run_dir, *overrides))
