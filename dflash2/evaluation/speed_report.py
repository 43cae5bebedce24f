"""What `python speed.py` prints: the measured costs, and per batch and block size the predicted and measured
speeds with the block predicted fastest (the `speed.json` it writes holds every figure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

COST_KEYS = ("draft", "verify", "other", "step", "prefill")


def format_table(result: Mapping[str, Any]) -> str:
    """The costs (ms) and the speeds; * marks the block predicted fastest at each batch size."""
    costs = result["costs"]
    table = [
        [str(c["batch"]), "target", "-", *(_num(c[k] * 1e3, ".2f") for k in ("forward", *COST_KEYS[2:]))]
        for c in costs["target"]
    ]
    table += [
        [str(c["batch"]), str(c["block"]), *(_num(c[k] * 1e3, ".2f") for k in COST_KEYS)] for c in costs["speculative"]
    ]
    context = ", ".join(f"{c['mean']:.0f} at batch {c['batch']}" for c in costs["context"])
    lines = [f"costs (ms, medians; the target alone's forward is under verify; prompt tokens: {context})"]
    lines += _columns(["batch", "block", *COST_KEYS], table)
    lines += [
        "",
        f"speed over the target alone ({result['bench']}, T={result['temperature']:g}, up to "
        f"{result['max_new_tokens']} new tokens; * = the block predicted fastest at that batch size)",
    ]
    table = []
    for r in result["rows"]:
        p, m, error = r["predicted"], r["measured"] or {}, r["error"] or {}
        best = "*" if result["best_block"][str(r["batch"])] == r["block"] else ""
        table.append(
            [
                str(r["batch"]),
                f"{r['block']}{best}",
                r["histogram"],
                f"{r['tau']:.2f}",
                _num(p["tokens_per_s"], ".1f"),
                _num(m.get("tokens_per_s"), ".1f"),
                _num(p["speedup"], ".2f"),
                _num(m.get("speedup"), ".2f"),
                _num(error.get("speedup"), "+.0%"),
                _num(p["speedup_steady"], ".2f"),
            ]
        )
    head = ["batch", "block", "histogram", "tau", "pred tok/s", "meas tok/s", "pred x", "meas x", "error", "steady x"]
    lines += _columns(head, table)
    lines += [
        f"target alone at batch {r['batch']}: predicted {r['predicted']['target_tokens_per_s']:.1f} tokens/s, "
        f"measured {r['measured']['target_tokens_per_s']:.1f}"
        + (
            ""
            if r["measured"]["identical_outputs"] is None
            else f", identical greedy outputs {r['measured']['identical_outputs']:.0%}"
        )
        for r in result["rows"]
        if r["measured"]
    ]
    return "\n".join(lines)


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _columns(head: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(x) for x in column) for column in zip(head, *rows, strict=True)]
    return ["  ".join(x.rjust(w) for x, w in zip(cells, widths, strict=True)) for cells in (head, *rows)]
