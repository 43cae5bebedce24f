"""Measure a drafter's acceptance by real speculative decoding (see configs/evaluate.yaml).

python evaluate.py draft=exports/my-drafter bench=gsm8k bench.limit=20 temperature=0
python evaluate.py -m draft=exports/my-drafter bench=gsm8k,mtbench temperature=0,1 block_size=8,16
python evaluate.py -m draft=exports/my-drafter,pld bench=gsm8k,mtbench temperature=0   (pld: prompt lookup)
"""

import re
import sys

import hydra
from omegaconf import DictConfig


def draft_shorthand(argv: list[str]) -> list[str]:
    """`draft=<dir>` -> `draft.path=<dir>`: `draft` is a training config group, so Hydra would read it as one."""
    return [re.sub(r"^draft=", "draft.path=", a) for a in argv]


@hydra.main(version_base=None, config_path="configs", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from dflash2.evaluation import main as run
    from dflash2.target import TargetNotFoundError

    try:
        run(cfg, HydraConfig.get().runtime.output_dir)
    except (TargetNotFoundError, FileNotFoundError, ValueError) as e:
        sys.exit(str(e))  # bad input: the message names the setting and the fix, a traceback would bury it


if __name__ == "__main__":
    sys.argv = draft_shorthand(sys.argv)
    main()
