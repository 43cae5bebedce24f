"""Does a drafter serve as it validates? Its `tau_sim` on each bench's own text, beside the tau decoding measured there.

    python benchmarks/bench_tau_sim.py SWEEP_DIR EXPORT [--draft dflash2] [--max-anchors 64] [--out FILE]

At T=0 the output is the target's greedy text whatever proposes, so a T=0 sweep's samples hold each bench's text as
the target writes it. Rendered back into chats (the bench's prompts; the replies decoded from the output ids, a reply
cut at `max_new_tokens` marked truncated as the regeneration marks it), they are validated as the training validates
its held-out chats: the same target features, random anchors and blocks, teacher-forced. Per bench, `tau_sim` (and
acc_1 / acc_2 / acc_4 / acc_15) on that text beside the tau measured on it. The drop from the validation's `tau_sim`
to a bench's measured tau then splits in two:
- validation chats -> the bench's text, at random anchors: how well the training data covers that kind of text;
- the bench's text at random anchors -> the measured tau: where decoding anchors, and anything that serves
  differently from how it trains.

Runs on a CPU (fp32, no compile): `--max-anchors` bounds the blocks per chat to keep that short.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from train_throughput import compose_preset  # noqa: E402

from dflash2.data.benches import load_prompts  # noqa: E402
from dflash2.data.chat import load_conversations, tokenize_conversations  # noqa: E402
from dflash2.data.collate import BlockCollator  # noqa: E402
from dflash2.data.sampling import AnchoredRows  # noqa: E402

METRICS = ("tau_sim", "acc_1", "acc_2", "acc_4", "acc_15")


def bench_chats(run_dir: Path, tokenizer: Any) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """(results.json, chats) of one evaluation run at T=0; None for any other temperature."""
    results = json.loads((run_dir / "results.json").read_text())
    if results["temperature"] != 0:
        return None
    prompts = {p["id"]: p for p in load_prompts(results["bench"])}
    turns: dict[str, list[dict[str, Any]]] = {}
    for line in (run_dir / "samples.jsonl").read_text().splitlines():
        sample = json.loads(line)
        turns.setdefault(sample["id"], []).append(sample)
    chats = []
    for prompt_id, samples in turns.items():
        messages = []
        for sample in sorted(samples, key=lambda s: s["turn"]):
            out = sample["output_ids"]
            messages.append({"role": "user", "content": prompts[prompt_id]["turns"][sample["turn"]]})
            reply = {"role": "assistant", "content": tokenizer.decode(out, skip_special_tokens=True)}
            if len(out) >= results["max_new_tokens"]:
                reply["truncated"] = True  # its closing end-of-turn token is not the target's
            messages.append(reply)
        chats.append({"id": prompt_id, "messages": messages})
    return results, chats


def validate(
    module: Any, chats: list[dict[str, Any]], tokenizer: Any, max_length: int, max_anchors: int, work: Path
) -> dict[str, float]:
    """The module's validation metrics on `chats`, with the training's rendering, anchors and blocks."""
    import lightning as L

    path = work / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    rows = tokenize_conversations(
        load_conversations(str(path)), tokenizer, max_length, f"{path}|{path.stat().st_mtime_ns}", cache_dir=str(work)
    )
    cfg = module.draft.config
    collate = BlockCollator(cfg.block_size, cfg.mask_token_id, tokenizer.pad_token_id or 0)
    loader = torch.utils.data.DataLoader(AnchoredRows(rows, max_anchors, seed=0), batch_size=1, collate_fn=collate)
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    metrics = trainer.validate(module, dataloaders=loader, verbose=False)[0]
    return {k: float(metrics[f"val/{k}"]) for k in METRICS}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sweep", type=Path, help="a T=0 evaluation sweep of the export (results.json, samples.jsonl)")
    parser.add_argument("export", type=Path, help="the drafter's export folder")
    parser.add_argument("--draft", default="dflash2", help="the draft config the export was trained with")
    parser.add_argument("--preset", default="smollm2", help="train_throughput.py's preset of the target")
    parser.add_argument("--max-anchors", type=int, default=64)
    parser.add_argument("--out", type=Path, help="where the JSON goes (default: print only)")
    args = parser.parse_args(argv)
    logging.getLogger("lightning").setLevel(logging.WARNING)

    from dflash2.commands.train_groups import build_module, target_and_draft

    cfg = compose_preset(
        args.preset,
        small=False,
        extra=[
            f"draft={args.draft}",
            f"module.init_from={args.export.resolve()}",
            "model.dtype=float32",
            "model.compile=false",
            "module.compile=false",
        ],
    )
    target, draft = target_and_draft(cfg)  # on the CPU, as the model group loads it
    module = build_module(target, cfg, draft)
    rows = []
    for file in sorted(args.sweep.rglob("results.json")):
        found = bench_chats(file.parent, target.tokenizer)
        if found is None:
            continue
        results, chats = found
        if results["block_size"] != module.draft.config.block_size:
            continue  # the drafter validates at the block size it trained with
        with tempfile.TemporaryDirectory() as work:
            sim = validate(module, chats, target.tokenizer, cfg.data.max_length, args.max_anchors, Path(work))
        rows.append({"bench": results["bench"], "chats": len(chats), "tau": results["tau"], **sim})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        record = {"export": str(args.export), "max_anchors": args.max_anchors, "runs": rows}
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
