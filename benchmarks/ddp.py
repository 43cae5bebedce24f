"""Data parallelism: the same training on one device and on N devices (Lightning DDP) at the same global batch.

    python benchmarks/ddp.py --data data/regenerated/smollm2.jsonl --steps 300 --out benchmarks/results/ddp.json
    python benchmarks/ddp.py --small --out /tmp/ddp.json     # tiny target, 2 CPU processes over gloo: a smoke test

Both runs are `python train.py experiment=gpu_smollm2 ...` with the same seed, data and number of optimizer steps;
the single device takes N times the rows per step that each DDP rank takes. Per run: the train/loss curve (under
DDP the logged loss is the mean over ranks, i.e. the global batch's) and trained tokens/s from the columns of
Lightning's ThroughputMonitor (train/time, train/lengths), counted after --warmup steps. Summary: the throughput
ratio DDP / single and how far apart the two loss curves are once smoothed over --smooth steps. The two runs
train the same global batches (rank r takes rows r, r + N, ... of each; the anchors are the rows' own), so their
curves agree step by step up to rounding, and under bf16 up to its noise; tests/test_ddp.py checks the fp32 parity
exactly (losses, gradients, validation, resume).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import subprocess
import sys
import tempfile

import pandas as pd
import torch

from dflash2.testing import tiny_target_path

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORDS = "the a of to in is it and for on with as was at by an be this that from or have not are".split()


def small_chats(path: pathlib.Path, n: int = 200) -> pathlib.Path:  # 8 steps stay in epoch 1
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(n):
            messages = []
            for _ in range(2):
                messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=8))})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=30))})
            f.write(json.dumps({"id": str(i), "messages": messages}) + "\n")
    return path


def run(name: str, overrides: list[str], run_dir: pathlib.Path, devices: int, warmup: int) -> dict:
    cmd = [sys.executable, "train.py", *overrides, f"run_dir={run_dir}", f"task_name=ddp_bench_{name}"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    metrics = pd.read_csv(next((run_dir / "csv").rglob("metrics.csv")))
    loss = metrics.dropna(subset=["train/loss"]).groupby("step")["train/loss"].last()
    clock = metrics.dropna(subset=["train/lengths"]).groupby("step")[["train/time", "train/lengths", "train/samples"]]
    clock = clock.last()
    rows_per_device = int(clock["train/samples"].iloc[-1])
    clock = clock[clock.index >= warmup]
    if len(clock) < 2:
        raise SystemExit(f"{name}: fewer than 2 logged steps after --warmup {warmup}; raise --steps")
    seconds = clock["train/time"].iloc[-1] - clock["train/time"].iloc[0]
    device_rate = (clock["train/lengths"].iloc[-1] - clock["train/lengths"].iloc[0]) / seconds
    return {
        "name": name,
        "command": " ".join(cmd[1:]),
        "devices": devices,
        "steps": loss.index.tolist(),
        "loss": loss.tolist(),
        "rows_per_device": rows_per_device,  # over the whole run
        "timed_steps": len(clock) - 1,
        "device_tokens_per_s": device_rate,
        "tokens_per_s": device_rate * devices,  # every rank trains a batch of the same make-up
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/ddp.json", help="where the JSON goes")
    parser.add_argument("--data", help="chat JSONL (e.g. the regenerated ShareGPT); --small makes its own")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default 300; --small: 8)")
    parser.add_argument("--warmup", type=int, help="steps left out of tokens/s (default 20; --small: 2)")
    parser.add_argument("--devices", type=int, default=2, help="DDP processes (one GPU each)")
    parser.add_argument("--rows", type=int, default=4, help="rows per step per DDP rank (single run: x devices)")
    parser.add_argument("--smooth", type=int, help="moving-average window for the curve gap (default 25; --small: 2)")
    parser.add_argument("--small", action="store_true", help="tiny target and data, CPU processes: a smoke test")
    parser.add_argument("--override", nargs="+", default=[], help="Hydra overrides for both runs")
    args = parser.parse_args(argv)
    steps = args.steps or (8 if args.small else 300)
    warmup = args.warmup if args.warmup is not None else (2 if args.small else 20)
    smooth = args.smooth or (2 if args.small else 25)
    with tempfile.TemporaryDirectory(prefix="dflash2-ddp-") as tmp:
        return measure(args, pathlib.Path(tmp), steps, warmup, smooth, parser)


def measure(args: argparse.Namespace, work: pathlib.Path, steps: int, warmup: int, smooth: int, parser) -> dict:
    if args.small:
        data = small_chats(work / "chats.jsonl")
        base = [
            "~experiment",  # the tiny target's own quickstart sizes, not the CPU quickstart's
            "+quickstart=tiny",
            "model=tiny",
            f"model.path={tiny_target_path()}",
            "data=jsonl",
            "data.max_length=128",
            "data.val_size=4",
            "data.num_workers=0",
        ]
        single_trainer = ["trainer=cpu"]
        ddp_trainer = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.precision=32-true"]
    else:
        if not args.data:
            parser.error("--data is required (a chat JSONL, e.g. from python -m dflash2.commands.regenerate)")
        data = pathlib.Path(args.data).resolve()
        base = ["experiment=gpu_smollm2", "data.extra_paths=[]"]  # the data given, alone
        single_trainer = ["trainer=gpu"]
        ddp_trainer = ["trainer=ddp"]
    common = [
        *base,
        f"data.path={data}",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=1000",
        f"trainer.val_check_interval={steps}",
        "validate_first=false",
        "logger=csv",
        "trainer.enable_progress_bar=false",
        *args.override,
    ]
    runs = [
        run(
            "single",
            [*common, *single_trainer, "trainer.devices=1", f"data.batch_size={args.rows * args.devices}"],
            work / "single",
            1,
            warmup,
        ),  # fmt: skip
        run(
            "ddp",
            [*common, *ddp_trainer, f"trainer.devices={args.devices}", f"data.batch_size={args.rows}"],
            work / "ddp",
            args.devices,
            warmup,
        ),  # fmt: skip
    ]
    curves = [pd.Series(r["loss"], index=r["steps"]).rolling(smooth, min_periods=1).mean() for r in runs]
    gap = (curves[1] - curves[0]).abs() / curves[0]
    result = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.small else "cpu",
        "global_rows_per_step": args.rows * args.devices,
        "smooth": smooth,
        "runs": runs,
        "throughput_ratio": runs[1]["tokens_per_s"] / runs[0]["tokens_per_s"],
        "smoothed_loss_gap_mean": float(gap.mean()),
        "smoothed_loss_gap_last": float(gap.iloc[-1]),
        "final_smoothed_loss": [float(c.iloc[-1]) for c in curves],
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\n{'run':>8}  devices  tokens/s  final smoothed loss")
    for r, c in zip(runs, curves, strict=True):
        print(f"{r['name']:>8}  {r['devices']:>7}  {r['tokens_per_s']:>8.4g}  {c.iloc[-1]:.4f}")
    mean, last = result["smoothed_loss_gap_mean"], result["smoothed_loss_gap_last"]
    print(f"throughput ratio {result['throughput_ratio']:.3f}; smoothed loss gap mean {mean:.3%}, last {last:.3%}")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
