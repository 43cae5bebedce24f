"""Training: the LightningModule (`module`), its losses, the recipe's objective and optimizer (`objectives`), what a
drafter takes from a warm start and the target (`drafter`), the checks run before anything loads (`checks`), a run
from its built parts to its summary (`run`), the training checkpoint's schema (`checkpoint`) and the measured pace of
a run (`step_rate`). Building these from train.yaml is the command's (dflash2/commands/train.py)."""
