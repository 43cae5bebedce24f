"""How far ahead can a drafter copy? A CPU probe of how many slots a drafter copies from a looping context.

    python benchmarks/copy_probe.py [--layers 1 2 4 6] [--drafter dflash dflash2] [--steps 1500] [--lr 1e-2] [--out F]

SmolLM2's greedy replies loop (the regenerated set is full of them), which is where prompt lookup wins. This strips
the question down to loops alone: every row is a random prompt, then a random motif of P tokens (P drawn from
[--min-period, --max-period] per row) repeated to the row's end. Only positions after the first period are
trained, so every label is a copy from the context: slot k of the block at anchor a must give the token at a + k,
which is the token P (or 2P, ...) positions back. The target's features are an oracle of what a real target gives
on its own greedy text: at position i, the embedding of token i (a shallow layer) and the head's row of token i + 1
(a deep layer, which on greedy text points at the next token). Embedding and head are those of the random tiny
Qwen3 of `train_throughput.py --small`; the drafter is the experiment's at tiny sizes with the selector off, so
that `acc_k` is the head's argmax. Each drafter trains --steps steps on fresh rows, then `acc_k` is measured on
fresh rows, as its validation does: if a drafter copies one more slot per layer, `acc_k` falls off after slot
`layers` (DFlash2's convolution passes each slot's state to the next within a layer).
"""

from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import sys
from types import SimpleNamespace

import lightning as L
import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from train_throughput import DRAFTERS, build_module, build_target, compose_preset  # noqa: E402

from dflash2.data.anchors import sample_anchors  # noqa: E402
from dflash2.data.collate import BlockCollator  # noqa: E402

VOCAB, MASK, PROMPT = 512, 511, 16  # the tiny target's vocabulary and mask id (train_throughput's qwen3-8b --small)


def periodic_rows(n: int, length: int, periods: tuple[int, int], anchors: int, gen: torch.Generator) -> list[dict]:
    rows = []
    for _ in range(n):
        period = int(torch.randint(periods[0], periods[1] + 1, (), generator=gen))
        motif = torch.randint(4, MASK, (period,), generator=gen)
        reply = motif.repeat(-(-(length - PROMPT) // period))[: length - PROMPT]
        ids = torch.cat([torch.randint(4, MASK, (PROMPT,), generator=gen), reply])
        loss_mask = torch.zeros(length, dtype=torch.long)
        loss_mask[PROMPT + period :] = 1  # the first period is new text: nothing there can be copied
        rows.append({"input_ids": ids, "loss_mask": loss_mask, "anchors": sample_anchors(loss_mask, anchors, gen)})
    return rows


class Rows(torch.utils.data.IterableDataset):
    def __init__(self, collate: BlockCollator, args: argparse.Namespace, seed: int) -> None:
        self.collate, self.args, self.seed = collate, args, seed

    def __iter__(self):
        gen = torch.Generator().manual_seed(self.seed)
        a = self.args
        while True:
            yield self.collate(periodic_rows(a.batch_size, a.length, (a.min_period, a.max_period), a.anchors, gen))


def oracle_features(target, input_ids: torch.Tensor) -> SimpleNamespace:
    """[b, L, 2H]: token i's embedding, then the head's row of token i + 1 (zero past the row's end), as
    TargetOutput.hidden."""
    embed = target.embed_tokens(input_ids)
    head = torch.nn.functional.embedding(input_ids, target.lm_head_weight)
    ahead = torch.cat([head[:, 1:], torch.zeros_like(head[:, :1])], dim=1)
    return SimpleNamespace(hidden=torch.cat([embed, ahead], dim=-1), final_hidden=None)


def probe(drafter: str, layers: int, args: argparse.Namespace) -> dict:
    overrides = DRAFTERS[drafter] + [
        f"draft.num_hidden_layers={layers}",
        f"draft.block_size={args.block_size}",
        "draft.target_layer_ids=[1,3]",
        "draft.selector_rank=0",
        "draft.selector_top_k=0",
        f"optim.lr={args.lr}",
    ]
    cfg = compose_preset("qwen3-8b", small=True, extra=overrides)
    torch.manual_seed(0)
    target = build_target("qwen3-8b", cfg, small=True, device=torch.device("cpu"))
    module = build_module(target, cfg)
    module.target_pass = lambda batch: oracle_features(target, batch["input_ids"])
    collate = BlockCollator(args.block_size, MASK)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        gradient_clip_val=cfg.trainer.gradient_clip_val,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    loader = torch.utils.data.DataLoader(Rows(collate, args, seed=1), batch_size=None)
    trainer.fit(module, train_dataloaders=loader)
    module.eval()
    module.val_metrics.reset()
    with torch.no_grad():
        for batch in itertools.islice(Rows(collate, args, seed=2), args.eval_batches):
            module.validation_step(batch, 0)
    metrics = module.val_metrics.compute()
    acc = [metrics[f"acc_{k}"] for k in range(1, args.block_size)]
    print(
        f"{drafter:8s} {layers} layers: tau_sim {metrics['tau_sim']:.3f}  loss_ce {metrics['loss_ce']:.2f}  acc_k "
        + " ".join(f"{a:.2f}" for a in acc)
    )
    run = {"drafter": drafter, "layers": layers, "steps": args.steps, "lr": args.lr}
    return run | {"tau_sim": metrics["tau_sim"], "loss_ce": metrics["loss_ce"], "acc": acc}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 6], help="draft depths to probe")
    parser.add_argument("--drafter", nargs="+", choices=list(DRAFTERS), default=["dflash", "dflash2"])
    parser.add_argument("--steps", type=int, default=1500, help="training steps per drafter")
    parser.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (cosine, as the recipe)")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--length", type=int, default=192, help="tokens per row")
    parser.add_argument("--anchors", type=int, default=24, help="blocks per row")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--min-period", type=int, default=4)
    parser.add_argument("--max-period", type=int, default=24)
    parser.add_argument("--eval-batches", type=int, default=16)
    parser.add_argument("--out", default=None, help="a JSON of every drafter's acc_k")
    args = parser.parse_args(argv)
    result = {"args": vars(args), "runs": [probe(d, n, args) for d in args.drafter for n in args.layers]}
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
