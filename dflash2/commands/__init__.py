"""The commands: the one package that knows Hydra. Each command composes its config from the repository's configs/,
turns it into plain values and calls the library, which takes those values and imports neither Hydra nor OmegaConf.

    python train.py ...                          dflash2.commands.train       configs/train.yaml
    python export.py ...                         dflash2.commands.export      configs/export.yaml
    python evaluate.py [-m] ...                  dflash2.commands.evaluate    configs/evaluate.yaml
    python speed.py ...                          dflash2.commands.speed       configs/speed.yaml
    python study.py ...                          dflash2.commands.study       configs/study.yaml
    python -m dflash2.commands.regenerate ...    dflash2.commands.regenerate  configs/regenerate.yaml
    python -m dflash2.commands.sources ...       dflash2.commands.sources     configs/sources.yaml
    python -m dflash2.commands.recipe ...        dflash2.commands.recipe      configs/recipe.yaml
    python -m dflash2.commands.features ...      dflash2.commands.features    configs/features.yaml

Each is also a console script of the installed package (`dflash2-train`, `dflash2-regenerate`, ...: pyproject.toml).
Every command runs the same way (`command`): Hydra 1.3's behaviour, the libraries' warnings and progress bars kept out
of the output once for the process (`progress.quiet_libraries`), and bad input (`errors.BAD_INPUT`, whose message names
the setting and the fix) ending the command in that one sentence instead of a traceback. Each config names its Hydra job
(`hydra.job.name`: train.log, evaluate.log), which Hydra would otherwise name after the file that declares the task.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import typing
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import InstantiationException
from hydra.utils import get_object, instantiate
from omegaconf import DictConfig, OmegaConf

from dflash2.errors import BAD_INPUT
from dflash2.progress import quiet_libraries

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def exit_on_bad_input(task: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A command's task: bad input (a missing model or file, an invalid setting) is the user's to fix, and its message
    says how, so it ends the command with that sentence instead of a traceback."""

    @functools.wraps(task)
    def checked(cfg: Any) -> Any:
        try:
            return task(cfg)
        except BAD_INPUT as e:
            sys.exit(str(e))

    return checked


def command(config_name: str, task: Callable[[DictConfig], Any]) -> None:
    """Run `task` on configs/<config_name>.yaml composed with the command line's overrides (once per job under -m)."""
    quiet_libraries()  # before Hydra's callbacks too: their checks may load a target, with the libraries' bars
    hydra.main(version_base="1.3", config_path=str(CONFIGS), config_name=config_name)(exit_on_bad_input(task))()


def build(node: Any, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate(node, **kwargs)`, letting the object's own refusal of a bad setting (a ValueError or
    FileNotFoundError that names it) through instead of Hydra's wrapper around it."""
    try:
        return instantiate(node, **kwargs)
    except InstantiationException as e:
        if isinstance(e.__cause__, BAD_INPUT):
            raise e.__cause__ from None
        raise


def compose(name: str, overrides: list[str]) -> DictConfig:
    """configs/<name>.yaml with `overrides`, as its command composes it; also from inside another command's Hydra (a
    study checks the commands it will run), whose global state is put back afterwards."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from dflash2.commands.resolvers import register_resolvers

    register_resolvers()
    outer = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            return hydra_compose(name, overrides=overrides)
    finally:
        if outer is not None:
            GlobalHydra.instance().initialize(outer)


def check_numbers(node: DictConfig, skip: Collection[str] = (), prefix: str = "") -> None:
    """Refuse text where an object of the config takes a number (`optim.lr=abc`), naming the setting as typed and the
    fix, before anything is built: each node with a `_target_` is read against that callable's type hints, its
    settings hinted as numbers only (int, float, either or null; or a list of them) must not be strings. The object
    would otherwise fail when built, in a TypeError that names neither. `skip`: top-level groups whose objects name
    their own bad fields."""
    for key in node:
        child = node[key]
        if key in skip or not OmegaConf.is_dict(child):
            continue
        path = f"{prefix}{key}"
        if child.get("_target_"):
            _check_target_numbers(child, path)
        check_numbers(child, prefix=f"{path}.")


def _check_target_numbers(node: DictConfig, path: str) -> None:
    try:
        target = get_object(node._target_)
        call = target.__init__ if inspect.isclass(target) else target
        hints, parameters = typing.get_type_hints(call), inspect.signature(call).parameters
    except Exception:  # a target without readable hints (a C type, a forward reference): its own checks apply
        return
    for name, value in node.items():
        kind, many = _number_kind(hints.get(name))
        values = list(value) if many and OmegaConf.is_list(value) else [value]
        if kind is None or not any(isinstance(v, str) for v in values):
            continue
        default = parameters[name].default if name in parameters else None
        number = isinstance(default, int | float) and not isinstance(default, bool)
        example = f", e.g. {path}.{name}={default}" if number else ""
        if many and isinstance(default, tuple | list):
            example = f", e.g. {path}.{name}=[{','.join(map(str, default))}]"
        wanted = f"a list of {kind}s" if many else f"a{'n' if kind == 'integer' else ''} {kind}"
        typed = f"[{','.join(map(str, values))}]" if OmegaConf.is_list(value) else value
        raise ValueError(f"{path}.{name}={typed}: give {wanted} here{example}")


def _number_kind(hint: Any) -> tuple[str | None, bool]:
    """("integer" or "number", whether a list of them) of a hint that takes numbers only, (None, False) otherwise."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    args = tuple(a for a in args if a is not type(None))
    many = len(args) == 1 and typing.get_origin(args[0]) in (list, tuple)
    if many:
        args = tuple(a for a in typing.get_args(args[0]) if a is not Ellipsis)
    if not args or not all(a in (int, float) for a in args):
        return None, False
    return ("number" if float in args else "integer"), many
