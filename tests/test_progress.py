"""Off a terminal, a library module's plain tqdm bars are off while dflash2 calls into it, and only then."""

import io
import types

from tqdm.auto import tqdm

from dflash2 import progress


def test_a_modules_bars_are_off_off_a_terminal_and_restored_after(monkeypatch):
    module = types.SimpleNamespace(tqdm=tqdm)  # as transformers' GGUF conversion imports it
    out = io.StringIO()

    def draw() -> str:
        for _ in module.tqdm(range(3), desc="converting", file=out):
            pass
        return out.getvalue()

    monkeypatch.setattr(progress, "interactive", lambda: False)
    with progress.module_bars_off(module):
        assert draw() == ""
    assert module.tqdm is tqdm
    assert "converting" in draw()

    out.truncate(0)
    monkeypatch.setattr(progress, "interactive", lambda: True)
    with progress.module_bars_off(module):  # someone watches the terminal: the bar stays
        assert "converting" in draw()
