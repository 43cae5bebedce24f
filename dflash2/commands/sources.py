"""`python -m dflash2.commands.sources` (`dflash2-sources`): the extra training prompts (dflash2.data.sources), on
configs/sources.yaml.

    python -m dflash2.commands.sources [sources=[...]] [limit.<source>=N] [output=FILE]
"""

from __future__ import annotations

from omegaconf import DictConfig

from dflash2.commands import command
from dflash2.commands.train_groups import plain
from dflash2.data import sources


def main() -> None:
    """The console entry."""
    command("sources", run)


def run(cfg: DictConfig) -> dict[str, int]:
    """The command: the prompts, then where they went and how to answer them."""
    counts = write_prompts(cfg)
    print(
        f"sources: wrote {sum(counts.values())} prompts to {cfg.output}; answer them with "
        f"python -m dflash2.commands.regenerate input={cfg.output}"
    )
    return counts


def write_prompts(cfg: DictConfig, prefix: str = "") -> dict[str, int]:
    """dflash2.data.sources.build on a composed configs/prompts/recipe.yaml (the keys of configs/sources.yaml, or of
    the recipe's `prompts` with `prefix="prompts."`); returns the count of each source. A wrong setting exits in a
    sentence naming it."""
    try:
        return sources.build(
            plain(cfg.sources), cfg.output, cfg.get("cache_dir"), plain(cfg.get("limit")) or {}, cfg.seed, prefix
        )
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(str(e)) from None


if __name__ == "__main__":
    main()
