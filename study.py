"""Run a study end to end, resumably: `python study.py study=acceptance|ablation|depth dir=WORK_DIR [key=value ...]`
(see configs/study.yaml; rehearse=true for tiny sizes on the CPU, until=<stage> to stop after a stage)."""

import sys

import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="configs", config_name="study")
def main(cfg: DictConfig) -> None:
    from dflash2.studies import main as run

    sys.exit(run(cfg))


if __name__ == "__main__":
    main()
