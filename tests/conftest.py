import os
import shutil

import pytest

# Before anything imports triton: without a GPU the kernels run through Triton's interpreter on the CPU.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The test models are tiny: one thread runs them as fast, and a second thread competing for a busy core
    (CI has two) stalls every op."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
