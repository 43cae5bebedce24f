"""The fused head's top-K on one GPU: `grouped_topk` (dflash2/training/head.py) against `torch.topk`.

    python benchmarks/topk.py [--out benchmarks/results/topk.json]

The shape is one chunk of the fused head as training runs it: as many rows as 1 GiB of fp32 logits holds, K = 16,
bf16 scores, for SmolLM2's and Qwen3's vocabularies. Each is timed eagerly and under torch.compile (the head's
chunks are compiled in training), median after warm-up (`median_ms`), after checking that the values agree.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from dflash2.training.head import grouped_topk

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from timing import median_ms, print_table  # noqa: E402

VOCABS = {"smollm2": 49152, "qwen3": 151936}


def plain_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return scores.topk(k, dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/topk.json", help="where the JSON results go")
    parser.add_argument("--top-k", type=int, default=16, help="candidates per slot K")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/topk.py times the GPU: run it on a machine with CUDA")
    rows = []
    for name, vocab in VOCABS.items():
        n = 2**30 // (4 * vocab)  # the fused head's default chunk: 1 GiB of fp32 logits
        scores = (torch.randn(n, vocab, device="cuda") * 3).bfloat16()
        row = {"vocab": name, "rows": n, "k": args.top_k}
        for label, fn in (("topk", plain_topk), ("grouped", grouped_topk)):
            for mode, run in (("eager", fn), ("compiled", torch.compile(fn, dynamic=False))):
                vals, _ = run(scores, args.top_k)
                if not torch.equal(vals, scores.topk(args.top_k, dim=-1).values):
                    raise SystemExit(f"{label} ({mode}) gave other values than torch.topk for {name}")
                row[f"{label}_{mode}_ms"] = median_ms(lambda run=run, scores=scores: run(scores, args.top_k))
        rows.append(row)
    device = torch.cuda.get_device_name()
    print_table(rows, list(rows[0]), title=f"top-{args.top_k} of one fused-head chunk, bf16 ({device})")
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"torch": torch.__version__, "device": device, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
