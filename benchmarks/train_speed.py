"""The training-speed proof on one GPU (BENCHMARKS.md, "Training throughput"), in three parts:

    python benchmarks/train_speed.py --out OUT_DIR                       # JSON, logs and the CSV curves in OUT_DIR
    python benchmarks/train_speed.py --out OUT_DIR --parts epoch --epoch-override data.batch_size=16
    python benchmarks/train_speed.py --out OUT_DIR --dry-run             # the commands, none run

1. `equal`: the GPU tests (the fast path against the plain PyTorch path on CUDA, loss and gradients; the Triton
   kernels), while the plain and the fast path each train --steps steps on the regenerated ShareGPT set beside them:
   only their validation tau_sim at equal steps is used, so sharing the GPU costs nothing that is reported (the fast
   run also fills the compile cache that the later parts read);
2. `throughput`: alone on the GPU, step time, tokens/s, MFU, peak memory, compile time and a profile of the SmolLM2
   preset (benchmarks/train_throughput.py): fast DFlash2 and DFlash, plain DFlash2, and fast DFlash2 with the target
   eager (model.compile=false) and with the target's layers replayed as CUDA graphs (model.compile=reduce-overhead);
3. `epoch`: one epoch of the regenerated set with the fast path, alone: its wall time and validation curve.

Every training is `python train.py experiment=gpu_smollm2` on the regenerated set of artifacts/data (made one file
in OUT_DIR/work), logged to CSV, with torch.compile's recompiles in its log. A command that fails is named and the
parts after it still run; the exit status is then 1. OUT_DIR/train_speed.json lists every command, its exit status
and wall time.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA_PARTS = [
    f"artifacts/data/smollm2_sharegpt_regenerated{part}.jsonl.gz" for part in ("", "_part2", "_part3", "_part4")
]
PARTS = ("equal", "throughput", "epoch")
GPU_TESTS = ["tests/test_kernels.py", "tests/test_training.py", "tests/test_speculative.py", "tests/test_target.py"]
GPU_TESTS += ["-k", "triton or walk or conv or cuda or mixed"]
# The plain PyTorch path: no torch.compile, whole logits through autograd, the target eager.
PLAIN = ["module.compile=false", "objective.fused_head=false", "model.compile=false"]
# name: train_throughput.py's arguments for the SmolLM2 preset; each writes OUT_DIR/train_throughput_<name>.json.
THROUGHPUT = {
    name: arguments.split()
    for name, arguments in {
        "smollm2": "--drafter dflash2 dflash --variant fast --profile",
        "smollm2_plain": "--drafter dflash2 --variant plain --profile",
        "smollm2_eager_target": "--drafter dflash2 --variant fast --override model.compile=false",
        "smollm2_graphed_target": "--drafter dflash2 --variant fast --profile --override model.compile=reduce-overhead",
    }.items()
}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def tail(path: pathlib.Path, lines: int) -> None:
    """The last `lines` lines of a log, as the run left it."""
    if path.is_file():
        print("\n".join(path.read_text(errors="replace").splitlines()[-lines:]), flush=True)


class Runner:
    """Runs the commands from the repository's root (or only lists them, `dry_run`), each with its output in a log,
    and records each command, its exit status and its wall time."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run, self.records, self.started = dry_run, [], {}

    def start(self, name: str, command: list[str], output: pathlib.Path) -> subprocess.Popen | None:
        print("+", shlex.join(command), ">", output, flush=True)
        self.started[name] = time.time()
        if self.dry_run:
            self.records.append({"name": name, "command": command, "log": str(output)})
            return None
        # A training's log says what torch.compile compiled again, and why.
        env = os.environ | ({"TORCH_LOGS": "recompiles"} if "train.py" in command[1] else {})
        with output.open("w") as f:
            return subprocess.Popen(command, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)

    def wait(self, name: str, command: list[str], output: pathlib.Path, process: subprocess.Popen | None) -> bool:
        """Whether the command succeeded; a failure is named with its log."""
        if process is None:
            return True
        code = process.wait()
        wall = time.time() - self.started[name]
        self.records.append({"name": name, "command": command, "log": str(output), "exit": code, "wall_s": wall})
        if code:
            log(f"{name} failed (exit {code}): {output}")
        return code == 0

    def run(self, name: str, command: list[str], output: pathlib.Path) -> bool:
        return self.wait(name, command, output, self.start(name, command, output))


def train_command(name: str, work: pathlib.Path, overrides: Sequence[str]) -> list[str]:
    """`python train.py experiment=gpu_smollm2` on the regenerated set, logged to CSV, in work/runs/<name>."""
    return [
        *(sys.executable, "train.py", "experiment=gpu_smollm2", f"data.path={work / 'smollm2.jsonl'}"),
        *("data.extra_paths=[]", "logger=csv", "trainer.enable_progress_bar=false", f"run_dir={work / 'runs' / name}"),
        f"data.cache_dir={work / f'cache_{name}'}",
        *overrides,
    ]


def keep_training_outputs(name: str, work: pathlib.Path, out: pathlib.Path) -> None:
    """The run's validation curve (out/curve_<name>.csv) and its train.log (out/train_<name>.log)."""
    run_dir = work / "runs" / name
    for metrics in sorted(run_dir.rglob("metrics.csv")):
        shutil.copy(metrics, out / f"curve_{name}.csv")
    if (run_dir / "train.log").is_file():
        shutil.copy(run_dir / "train.log", out / f"train_{name}.log")


def regenerated_set(work: pathlib.Path) -> None:
    """The regenerated ShareGPT set of artifacts/data, its four files made one (kept for a rerun)."""
    target = work / "smollm2.jsonl"
    if target.is_file():
        return
    partial = target.with_suffix(".partial")
    with partial.open("wb") as f:
        for part in DATA_PARTS:
            f.write(gzip.decompress((ROOT / part).read_bytes()))
    partial.replace(target)


def equal_steps(runner: Runner, args: argparse.Namespace, work: pathlib.Path, out: pathlib.Path) -> bool:
    """The GPU tests, and beside them the plain and the fast path for --steps steps each."""
    log(f"GPU tests, and beside them the plain and the fast path for {args.steps} steps each")
    equal = [f"trainer.max_steps={args.steps}", f"trainer.val_check_interval={args.val}"]
    runs = {name: train_command(name, work, equal + extra) for name, extra in (("plain", PLAIN), ("fast", []))}
    started = {name: runner.start(name, command, work / f"train_{name}.log") for name, command in runs.items()}
    tests = [sys.executable, "-m", "pytest", "-q", "-p", "no:warnings", *GPU_TESTS]
    ok = runner.run("gpu_tests", tests, out / "gpu_tests.log")
    tail(out / "gpu_tests.log", 3)
    for name, command in runs.items():
        ok &= runner.wait(name, command, work / f"train_{name}.log", started[name])
        keep_training_outputs(name, work, out)
        tail(work / f"train_{name}.log", 4)
    return ok


def throughput(runner: Runner, out: pathlib.Path) -> bool:
    log("throughput")
    ok = True
    for name, arguments in THROUGHPUT.items():
        command = [sys.executable, "benchmarks/train_throughput.py", "--preset", "smollm2", *arguments]
        command += ["--out", str(out / f"train_throughput_{name}.json")]
        ok &= runner.run(f"throughput_{name}", command, out / f"throughput_{name}.log")
        tail(out / f"throughput_{name}.log", 3)
    return ok


def one_epoch(runner: Runner, args: argparse.Namespace, work: pathlib.Path, out: pathlib.Path) -> bool:
    log("one epoch with the fast path")
    started = time.time()
    ok = runner.run("epoch", train_command("epoch", work, ["trainer.max_epochs=1", *args.epoch_override]),
                    work / "train_epoch.log")  # fmt: skip
    keep_training_outputs("epoch", work, out)
    if ok and not runner.dry_run:
        (out / "epoch_wall.json").write_text(json.dumps({"epoch_wall_s": round(time.time() - started)}) + "\n")
    tail(work / "train_epoch.log", 4)
    return ok


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the folder the JSON, the logs and the CSV curves go to")
    parser.add_argument("--steps", type=int, default=400, help="equal: the steps each path trains")
    parser.add_argument("--val", type=int, default=200, help="equal: validate every this many steps")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="which parts run")
    parser.add_argument(
        "--epoch-override", nargs="+", default=[], help="epoch: more train.py overrides, e.g. data.batch_size=16"
    )
    parser.add_argument("--dry-run", action="store_true", help="list the commands; run and write nothing")
    args = parser.parse_args(argv)
    out = pathlib.Path(args.out).absolute()
    work = out / "work"
    runner = Runner(args.dry_run)
    if not args.dry_run:
        work.mkdir(parents=True, exist_ok=True)
        if {"equal", "epoch"} & set(args.parts):
            regenerated_set(work)
    ok = True
    if "equal" in args.parts:
        ok &= equal_steps(runner, args, work, out)
    if "throughput" in args.parts:
        ok &= throughput(runner, out)
    if "epoch" in args.parts:
        ok &= one_epoch(runner, args, work, out)
    result = {"parts": args.parts, "ok": ok, "commands": runner.records}
    if not args.dry_run:
        (out / "train_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    log("done" if ok else "done, with failures (above)")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
