"""Evaluation: one `evaluate.py` run (`run`), its table and W&B run (`report`) and a sweep's summary and plots
(`sweep`)."""
