"""Evaluation: one `evaluate.py` run (`run`), the checks of its settings (`checks`), its timed passes and speeds
(`timing`), its table and W&B run (`report`) and a sweep's summary and plots (`sweep`)."""
