"""Export a training checkpoint to a servable drafter folder, or check a folder against the contract.

python export.py ckpt_path=runs/my-run output_dir=exports/my-drafter
python export.py check=exports/my-drafter
"""

import sys

import hydra
from omegaconf import DictConfig


@hydra.main(version_base=None, config_path="configs", config_name="export")
def main(cfg: DictConfig) -> None:
    from dflash2.export import main as run

    sys.exit(run(cfg))


if __name__ == "__main__":
    main()
