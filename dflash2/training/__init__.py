"""Training: the LightningModule (`module`), its losses, the recipe's objective and optimizer (`objectives`), the
drafter's config for a target (`drafter`), the checks run before anything loads (`checks`), the `python train.py`
driver (`run`), resume, the training checkpoint's schema (`checkpoint`) and a run's feature cache (`features`, the
`python -m dflash2.data.features` command)."""
