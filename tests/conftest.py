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
