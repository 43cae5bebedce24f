"""The test suite's own promise: a test that draws from `random` fails with the seed that replays it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).with_name("conftest.py")


@pytest.mark.slow
def test_a_failing_test_names_the_seed_that_replays_its_draws(pytester, monkeypatch):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(
        test_draw="""
        import random
        import torch

        def test_draw():
            seed = random.randrange(2**31)  # as the suite's tests seed their torch.Generator
            value = torch.randint(10**9, (), generator=torch.Generator().manual_seed(seed)).item()
            assert False, f"drew {value}"
        """
    )
    monkeypatch.delenv("DFLASH2_TEST_SEED", raising=False)
    first, second = pytester.runpytest_subprocess(), pytester.runpytest_subprocess()
    runs = [(first.stdout.str(), first), (second.stdout.str(), second)]
    drawn = []
    for out, result in runs:
        result.assert_outcomes(failed=1)
        seed = re.search(r"DFLASH2_TEST_SEED=(\d+) replays", out)
        assert seed, out
        drawn.append((int(seed.group(1)), re.search(r"drew (\d+)", out).group(1)))
    assert drawn[0] != drawn[1]  # a fresh seed each run (2**32 of them)
    monkeypatch.setenv("DFLASH2_TEST_SEED", str(drawn[0][0]))
    replay = pytester.runpytest_subprocess()
    assert re.search(r"drew (\d+)", replay.stdout.str()).group(1) == drawn[0][1]
