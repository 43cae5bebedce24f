import json
import os
import random
import shutil
from pathlib import Path

import pytest

# Before anything imports triton: without a GPU the kernels run through Triton's interpreter on the CPU.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORDS = (
    "the a cat dog runs jumps over under blue red big small fast slow code python number one two three "
    "four five six seven eight nine ten list item value print return"
).split()


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The test models are tiny: one thread runs them as fast, and a second thread competing for a busy core
    (CI has two) stalls every op."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SEED_ENV = "DFLASH2_TEST_SEED"


@pytest.fixture(autouse=True)
def random_seed(request: pytest.FixtureRequest) -> int:
    """Python's `random` and torch's default generator start every test from a seed of its own, drawn afresh (or
    $DFLASH2_TEST_SEED), so that what a test draws from them (sizes, a torch.Generator's seed, random weights) varies
    from run to run and a failure can be replayed: its report names the seed (pytest_runtest_makereport below)."""
    import torch

    seed = int(os.environ.get(SEED_ENV) or random.SystemRandom().randrange(2**32))
    random.seed(seed)
    torch.manual_seed(seed)
    request.node.random_seed = seed
    return seed


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report = outcome.get_result()
    seed = getattr(item, "random_seed", None)
    if report.failed and seed is not None:
        report.sections.append(("random seed", f"{SEED_ENV}={seed} replays this test's draws from `random` and torch"))


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random chat file, the same every run: two turns per chat, replies long enough for several blocks."""
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    with path.open("w") as f:
        for i in range(20):
            messages = []
            for _ in range(2):
                messages.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(4, 10)))})
                messages.append({"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(12, 30)))})
            f.write(json.dumps({"id": str(i), "messages": messages}) + "\n")
    return path
