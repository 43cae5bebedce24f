"""Timing and tables shared by the benchmark scripts: medians after warm-up, as BENCHMARKS.md reports."""

from __future__ import annotations

from collections.abc import Callable


def sync() -> None:
    """Wait for the GPU's queued work (nothing to wait for on a CPU): wall-clock timings need it on both sides."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(fn: Callable[[], object], rep: int = 200) -> float:
    """Per call as Python sees it: launch overhead included, which dominates small shapes without CUDA graphs."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


def graph_ms(fn: Callable[[], object], rep: int = 200) -> float:
    """Per call replayed from a CUDA graph (how serving engines run decode): device time only."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep, return_mode="median")


def print_table(rows: list[dict], columns: list[str], title: str | None = None, min_width: int = 10) -> None:
    if title:
        print(f"\n{title}")
    widths = [max(min_width, len(c)) for c in columns]
    print("  ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)))
    for row in rows:
        cells = [
            f"{row[c]:>{w}.4f}" if isinstance(row[c], float) else f"{row[c]:>{w}}"
            for c, w in zip(columns, widths, strict=True)
        ]
        print("  ".join(cells))
