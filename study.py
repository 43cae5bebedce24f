"""Run a study end to end, resumably: `python study.py study=acceptance|ablation|depth dir=WORK_DIR [key=value ...]`
(see configs/study.yaml; rehearse=true for tiny sizes on the CPU, until=<stage> to stop after a stage)."""

from dflash2.commands import study

if __name__ == "__main__":
    study.main()
