"""Measure a drafter's acceptance by real speculative decoding (see configs/evaluate.yaml).

python evaluate.py drafter=exports/my-drafter bench=gsm8k bench.limit=20 temperature=0
python evaluate.py -m drafter=exports/my-drafter bench=gsm8k,mtbench temperature=0,1 block_size=8,16
python evaluate.py -m drafter=exports/my-drafter,pld bench=gsm8k,mtbench temperature=0   (pld: prompt lookup)
"""

import sys

import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="configs", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from dflash2.evaluation import main as run
    from dflash2.locate import TargetNotFoundError

    try:
        run(cfg, HydraConfig.get().runtime.output_dir)
    except (TargetNotFoundError, FileNotFoundError, ValueError) as e:
        sys.exit(str(e))  # bad input: the message names the setting and the fix, a traceback would bury it


if __name__ == "__main__":
    main()
