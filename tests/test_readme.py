"""What a newcomer runs first, as the README orders it: torch's CPU build before the install, then a like-for-like
first evaluation of the shipped, fully trained drafter; and every command that the README, docs/ and BENCHMARKS.md
show in their ```bash blocks composes (study.py's through configs/study.yaml, as the study runner itself composes)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "BENCHMARKS.md"]
# The config each documented command composes.
CONFIGS = {
    "train.py": "train",
    "export.py": "export",
    "evaluate.py": "evaluate",
    "speed.py": "speed",
    "study.py": "study",
    "-m dflash2.commands.regenerate": "regenerate",
    "-m dflash2.commands.sources": "sources",
    "-m dflash2.commands.recipe": "recipe",
    "-m dflash2.commands.features": "features",
}
SHIPPED = "artifacts/drafters/smollm2-dflash"


def commands(text: str) -> list[str]:
    """The shell lines of a page's ```bash blocks, in order, comments dropped and backslash-continued lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [line for line in lines if line]


def section(title: str) -> str:
    start = README.index(f"## {title}")
    return README[start : README.index("\n## ", start + 1)]


def test_the_cpu_build_of_torch_is_installed_before_the_quickstart_command():
    lines = commands(section("Quickstart"))
    torch_line = next(i for i, line in enumerate(lines) if re.search(r"pip install torch\b", line))
    first_install = next(i for i, line in enumerate(lines) if "pip install" in line and "torch" not in line)
    train = next(i for i, line in enumerate(lines) if "python train.py" in line)
    assert torch_line < first_install <= train, lines
    assert "--index-url https://download.pytorch.org/whl/cpu" in lines[torch_line]


def test_the_first_evaluation_is_the_shipped_drafter_beside_prompt_lookup_at_its_block_size():
    evaluations = [line for line in commands(README) if line.startswith("python evaluate.py")]
    first, second = evaluations[:2]
    assert f"drafter={SHIPPED} " in first and "drafter=pld" in second, evaluations[:2]
    settings = [dict(re.findall(r"(\S+?)=(\S+)", line)) for line in (first, second)]
    for key in ("bench", "bench.limit", "temperature"):  # the same prompts, decoded the same way
        assert settings[0].get(key) == settings[1].get(key), key
    config = ROOT / SHIPPED / "config.json"
    block = json.loads(config.read_text())["dflash_config"]["block_size"] if config.is_file() else 16
    from dflash2.evaluation.checks import PLD_BLOCK_SIZE

    assert int(settings[1].get("block_size", PLD_BLOCK_SIZE)) == block  # like for like
    assert "What the quickstart's drafter is for" in section("Quickstart")


def documented_commands() -> list[tuple[str, str, list[str]]]:
    """(page, config name, overrides) of every `python <entry point> k=v ...` line in the pages' ```bash blocks;
    a line with a placeholder for several settings (`<the run's settings>`, `[dtype=fp8]`) is left out."""
    found = []
    for page in PAGES:
        for line in commands(page.read_text()):
            for entry, config in CONFIGS.items():
                head = f"python {entry}"
                if line.startswith(head) and (line == head or line[len(head)] == " "):
                    rest = re.sub(r"<[^<>]*>", "PLACEHOLDER", line[len(head) :])  # <date>_<time>, <sweep dir>
                    words = shlex.split(rest)  # 'study.train_args=["objective.position_weights=decay"]' is one
                    if "-m" in words:  # a sweep: its first combination
                        words = [re.sub(r"=([^\[,]+),.*", r"=\1", w) for w in words if w != "-m"]
                    if all("=" in w and not w.startswith("[") for w in words):
                        found.append((page.name, config, words))
    return found


def test_the_pages_show_the_main_commands():
    configs = {config for _, config, _ in documented_commands()}
    assert {"train", "export", "evaluate", "speed", "study", "regenerate", "recipe"} <= configs, configs


@pytest.mark.parametrize("page,config,overrides", documented_commands())
def test_every_documented_command_names_settings_that_exist(page: str, config: str, overrides: list[str]):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        compose(config, overrides=overrides)  # an unknown key or group option raises here
