"""How the feature cache could store the target's features: bytes per token against the error each way makes.

    python benchmarks/feature_storage.py [--conversations 16] [--max-length 1024] [--out FILE]
    python benchmarks/feature_storage.py --small --out /tmp/feature_storage.json    # the tiny target: seconds

Runs the target (the embedded SmolLM2 in float32, layers [1, 27] as `experiment=gpu_smollm2` captures them) over
the first `--conversations` conversations of a regenerated set, rendered as training renders them, and stores the
captured features each way: bf16 and fp8 e4m3 with a float32 scale per token and layer (what `python -m
dflash2.data.features` writes, `dtype=bf16|fp8`), and the ways tried and not kept: fp8 e5m2 and int8, each with the
same scales, and bf16 compressed losslessly with zlib. Per way: stored bytes per token, and per layer the relative
error sqrt(sum (stored - x)^2 / sum x^2) over every token and the largest error relative to its token's largest
value. Runs on a CPU: the figures depend on the features, not on the machine.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time
import zlib
from collections.abc import Callable
from typing import Any

import torch

from dflash2.data.chat import load_conversations
from dflash2.data.feature_store import bytes_per_token, dequantize, quantize, scale_tokens
from dflash2.target.chat_template import render_chat
from dflash2.target.model import TargetModel
from dflash2.testing import tiny_target

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "artifacts" / "data" / "smollm2_sharegpt_regenerated.jsonl.gz"


def scaled(x: torch.Tensor, layers: int, qmax: float, cast: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, n*H] with the cache's scale per token and layer (amax / qmax), cast, and back: what such a store reads."""
    values, scales = scale_tokens(x, layers, qmax)
    return (cast(values) * scales[..., None]).flatten(1)


def ways(layers: int) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], float]]:
    """name -> (store and read back, bytes per value); the 1-byte ways add a float32 scale per token and layer."""
    e5m2 = torch.float8_e5m2
    return {
        "bf16 (dtype=bf16)": (lambda x: dequantize(quantize(x, "bf16", layers)["features"], None, torch.float32), 2),
        "fp8 e4m3, scale per token and layer (dtype=fp8)": (
            lambda x: dequantize(**quantize(x, "fp8", layers), dtype=torch.float32),
            1,
        ),
        "fp8 e5m2, scale per token and layer": (
            lambda x: scaled(x, layers, torch.finfo(e5m2).max, lambda v: v.to(e5m2).float()),
            1,
        ),
        "int8, scale per token and layer": (lambda x: scaled(x, layers, 127.0, torch.round), 1),
    }


def errors(x: torch.Tensor, y: torch.Tensor, layers: int) -> list[dict[str, float]]:
    """Per layer: the relative error over all tokens, and the largest error relative to its token's largest value."""
    x, y = x.view(len(x), layers, -1), y.view(len(y), layers, -1)
    out = []
    for i in range(layers):
        diff = (y[:, i] - x[:, i]).double()
        amax = x[:, i].abs().amax(-1, keepdim=True).double()
        out.append(
            {
                "relative_error": float(diff.norm() / x[:, i].double().norm()),
                "max_error_over_token_amax": float((diff.abs() / amax).max()),
            }
        )
    return out


def display(path: pathlib.Path) -> str:
    """A path as the JSON records it: relative to the repository when inside it."""
    path = path.absolute()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--data", type=pathlib.Path, default=DATA)
    ap.add_argument("--small", action="store_true", help="the tiny target, random weights")
    ap.add_argument("--out", type=pathlib.Path)
    args = ap.parse_args(argv)
    layer_ids = [1, 2] if args.small else [1, 27]
    if args.small:
        target = tiny_target(target_layer_ids=layer_ids)
    else:
        target = TargetModel.load(None, name="smollm2", dtype="float32", target_layer_ids=layer_ids)
    chats = load_conversations(str(args.data), limit=args.conversations)
    features = []
    for messages in chats["messages"]:
        kwargs = target.chat_template_kwargs
        text = render_chat(target.tokenizer, messages, generation_prompt=False, chat_template_kwargs=kwargs)
        ids = target.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][:, : args.max_length]
        features.append(target(ids, logits=False).hidden[0].float())
    x = torch.cat(features)
    n = len(layer_ids)
    rows: list[dict[str, Any]] = []
    for name, (store, value_bytes) in ways(n).items():
        scales = 4 * n if value_bytes == 1 else 0  # a float32 scale per token and layer
        size = value_bytes * x.shape[1] + scales
        rows.append({"storage": name, "bytes_per_token": size, "layers": errors(x, store(x), n)})
    raw = x.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    start = time.perf_counter()
    packed = zlib.compress(raw, 6)
    pack_s = time.perf_counter() - start
    start = time.perf_counter()
    zlib.decompress(packed)
    unpack_s = time.perf_counter() - start
    rows.append(
        {
            "storage": "bf16, zlib level 6",
            "bytes_per_token": len(packed) / len(x),
            "layers": errors(x, x.to(torch.bfloat16).float(), n),
            "compress_tokens_per_s": len(x) / pack_s,
            "decompress_tokens_per_s": len(x) / unpack_s,
        }
    )
    assert rows[0]["bytes_per_token"] == bytes_per_token(x.shape[1] // n, n, "bf16")
    assert rows[1]["bytes_per_token"] == bytes_per_token(x.shape[1] // n, n, "fp8")
    for row in rows:
        layers = "  ".join(
            f"layer {i}: {e['relative_error']:.2e} (max {e['max_error_over_token_amax']:.2e})"
            for i, e in zip(layer_ids, row["layers"], strict=True)
        )
        print(f"{row['storage']:<50} {row['bytes_per_token']:>9.1f} B/token  {layers}")
    result = {
        "machine": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "target": "tiny" if args.small else "smollm2",
        "layers": layer_ids,
        "tokens": len(x),
        "date": time.strftime("%Y-%m-%d"),
        "settings": {k: str(v) for k, v in vars(args).items()} | {"data": display(args.data)},
        "storage": rows,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
