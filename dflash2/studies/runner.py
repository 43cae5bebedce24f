"""Running a study's plan: each stage's commands as subprocesses (what a user would type, from the repository's root),
each logged in WORK_DIR/study.log with its own output in WORK_DIR/logs/, recorded in WORK_DIR/commands.json, and
marked done in WORK_DIR/done/ once it succeeded, so that a rerun of the same study skips it.

Stopped (^C, a scheduler's SIGTERM), the runner stops the commands it started and exits; the rerun resumes a killed
training from its last checkpoint (`ckpt_path=`), a killed sweep keeps its finished runs (evaluate.py's own resume)
and a killed regeneration or feature cache goes on where it was (theirs).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

from dflash2.studies.plan import ROOT, show

log = logging.getLogger("dflash2.studies")


class StudyFailed(RuntimeError):
    """A command failed: the message names it and its log."""


def write_json(path: Path, data: Any) -> None:
    """Atomically: a reader (or a rerun after a kill) sees the old file or the new one, never a part."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: Path, default: Any = None) -> Any:
    return json.loads(path.read_text()) if path.is_file() else default


class Work:
    """The work folder: its done markers, its record of commands and budgets, and the commands running now."""

    def __init__(self, path: Path, rehearse: bool = False, lock: int | None = None) -> None:
        self.path, self.rehearse, self.lock_fd = path, rehearse, lock
        (path / "done").mkdir(parents=True, exist_ok=True)
        (path / "logs").mkdir(exist_ok=True)
        self.lock = threading.Lock()
        self.locks: dict[str, threading.Lock] = {}
        self.running: set[subprocess.Popen] = set()

    def done(self, key: str) -> bool:
        return (self.path / "done" / key).is_file()

    def mark(self, key: str) -> None:
        (self.path / "done" / key).touch()

    def once(self, key: str) -> threading.Lock:
        """A lock per item, for what two tasks may both need (a warm start's export)."""
        with self.lock:
            return self.locks.setdefault(key, threading.Lock())

    def update(self, name: str, key: str, value: Any) -> None:
        """Set `key` in the JSON record WORK_DIR/<name>.json (commands, budgets)."""
        with self.lock:
            record = read_json(self.path / f"{name}.json", {})
            record[key] = value
            write_json(self.path / f"{name}.json", record)

    def logfile(self, key: str) -> Path:
        return self.path / "logs" / f"{key}.log"

    def run(
        self, key: str, command: list[str], slot: int | None = None, gpus: int = 0, record: str | None = None
    ) -> None:
        """Run `command` (argv; `python` is this interpreter) from the repository's root, on GPU `slot` when there are
        GPUs, its output appended to WORK_DIR/logs/<key>.log and the command recorded in WORK_DIR/commands.json
        under `record` (default `key`); StudyFailed if it fails."""
        self.update("commands", record or key, show(command))
        logfile = self.logfile(key)
        env = dict(os.environ, OMP_NUM_THREADS="1" if self.rehearse else os.environ.get("OMP_NUM_THREADS", "2"))
        if gpus and slot is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(slot % gpus)
        if command[:2] == ["python", "train.py"]:
            env.setdefault("TORCH_LOGS", "recompiles")  # a stall in the progress log shows up as a recompilation
        where = f" on GPU {slot % gpus}" if gpus and slot is not None else ""
        log.info("%s%s: %s", key, where, show(command))
        argv = [sys.executable, *command[1:]] if command[0] == "python" else command
        with logfile.open("a") as out:
            out.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {show(command)}\n")
            out.flush()
            # The study's lock goes with each command: while one runs, even orphaned, no second study starts here.
            fds = () if self.lock_fd is None else (self.lock_fd,)
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, pass_fds=fds)
            with self.lock:
                self.running.add(proc)
            try:
                code = proc.wait()
            finally:
                with self.lock:
                    self.running.discard(proc)
        if code != 0:
            raise StudyFailed(f"{key} failed (exit {code}): see {logfile}")

    def stop(self) -> None:
        """Stop every command running: SIGTERM (a training ends as Lightning ends on it), SIGKILL after 30 s. The
        commands share the study's process group, so that a signal to the group reaches them all."""
        with self.lock:
            running = list(self.running)
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        deadline = time.time() + 30
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()


@dataclasses.dataclass
class Task:
    key: str
    run: Callable[[int], None]  # called with its slot (the GPU it takes)
    needs: frozenset[str] = frozenset()  # the keys of tasks that must finish first


def run_tasks(work: Work, tasks: list[Task], jobs: int, slots: int) -> None:
    """Run the tasks, at most `jobs` at once, each once the tasks it needs have finished, each on the least busy of
    `slots` slots; every task runs that can, and then StudyFailed names those that failed."""
    keys = {task.key for task in tasks}  # a need outside the list is met already (done before)
    pending = [dataclasses.replace(task, needs=task.needs & keys) for task in tasks]
    running, finished, failed = {}, set(), {}
    load = [0] * max(1, slots)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        try:
            while pending or running:
                for task in list(pending):
                    if task.needs & failed.keys():
                        pending.remove(task)
                        failed[task.key] = (
                            f"{task.key} not run: it needs {', '.join(sorted(task.needs & failed.keys()))}"
                        )
                    elif len(running) < jobs and task.needs <= finished:
                        pending.remove(task)
                        slot = load.index(min(load))
                        load[slot] += 1
                        running[pool.submit(task.run, slot)] = (task, slot)
                if not running:
                    break
                done, _ = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)  # wakes for signals too
                for future in done:
                    task, slot = running.pop(future)
                    load[slot] -= 1
                    try:
                        future.result()
                        finished.add(task.key)
                    except StudyFailed as e:
                        failed[task.key] = str(e)
                        log.error("FAILED %s", e)
        except BaseException:  # stopped: end the commands, so that the threads (and a rerun) do not wait on them
            work.stop()
            raise
    if failed:
        raise StudyFailed("; ".join(failed.values()))


@contextlib.contextmanager
def study_lock(work: Path) -> Iterator[int]:
    """WORK_DIR/.lock, held by the runner and every command it runs: a second study in the same folder is refused
    while either runs (two trainings of one run would write one checkpoint)."""
    fd = os.open(work / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StudyFailed(
                f"another study, or a command it started, still runs in {work}: wait for it or stop it first"
            ) from None
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def study_log(work: Path) -> Iterator[None]:
    """The runner's log lines into WORK_DIR/study.log too, with their times; SIGTERM stops the study as ^C does."""
    handler = logging.FileHandler(work / "study.log")
    handler.setFormatter(logging.Formatter("[%(asctime)s] %(message)s", "%Y-%m-%d %H:%M:%S"))
    log.addHandler(handler)
    if log.level == logging.NOTSET or log.level > logging.INFO:
        log.setLevel(logging.INFO)
    on_term = None
    if threading.current_thread() is threading.main_thread():
        on_term = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
        log.removeHandler(handler)
        handler.close()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
