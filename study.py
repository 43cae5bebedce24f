"""Run a study end to end, resumably: `python study.py study=acceptance|ablation|depth dir=WORK_DIR [key=value ...]`
(see configs/study.yaml; rehearse=true for tiny sizes on the CPU, until=<stage> to stop after a stage)."""

from dflash2 import cli

if __name__ == "__main__":
    cli.study()
