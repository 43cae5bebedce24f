"""`python -m dflash2.commands.recipe` (`dflash2-recipe`): the recipe's training data for a target in one command
(contract section 7), chats and extra prompts answered, on configs/recipe.yaml.

    python -m dflash2.commands.recipe model=qwen3 model.path=/local/Qwen3-8B
    python train.py model=qwen3 model.path=/local/Qwen3-8B

The three steps `python -m dflash2.commands.regenerate` (ShareGPT), `python -m dflash2.commands.sources` and
`python -m dflash2.commands.regenerate input=<prompts>` take one after another, with the target loaded once:
1. the prompts (`prompts.*`, configs/prompts/recipe.yaml) are written to `prompts.output`; the same settings write
   the same bytes, so a rerun rewrites them unchanged;
2. the target answers `input` (null = the packaged ShareGPT, less the `sharegpt` bench's records) into `output`;
3. it answers the prompts into `extra_output`.
`output` and `extra_output` default to what `model=<model>`'s experiment trains on (data.path, data.extra_paths). Every
setting is checked before the target loads; both regenerations resume from what their outputs hold.
"""

from __future__ import annotations

from omegaconf import DictConfig

from dflash2.commands import command
from dflash2.commands.regenerate import checked_options, conversations_of, load_target, report
from dflash2.commands.sources import write_prompts
from dflash2.data.regenerate import regenerate


def main() -> None:
    """The console entry."""
    command("recipe", run)


def run(cfg: DictConfig) -> dict[str, int]:
    """The command on a composed configs/recipe.yaml; returns how many conversations each output was given."""
    if cfg.output == cfg.extra_output:
        raise SystemExit(f"output and extra_output are both {cfg.output!r}: give each its own file")
    options = checked_options(cfg, [cfg.output, cfg.extra_output])
    # Both inputs are read before the target loads, so a wrong setting fails in seconds, not after the load.
    chats = conversations_of(cfg, cfg.input)
    counts = write_prompts(cfg.prompts, prefix="prompts.")
    print(f"recipe: wrote {sum(counts.values())} prompts to {cfg.prompts.output}")
    work = [(cfg.output, chats), (cfg.extra_output, conversations_of(cfg, cfg.prompts.output))]
    target = load_target(cfg)
    written = {}
    for output, conversations in work:
        written[output] = regenerate(target, conversations, output, **options)
        print(f"recipe: {report(written[output], output, options)}")
    return written


if __name__ == "__main__":
    main()
