"""Where a decode step's time goes, on the plain path and on the fast one (`decode=static`, dflash2/decoding/static.py):
the target's verify, the drafter's forward, DFlash2's heads (the grouped conv, dflash2/model/conv.py, and the candidate
selector, dflash2/model/selector.py) and the rest, the loop's own host work and its waits for the device.

    python benchmarks/decode_profile.py --drafter <export dir> [--batch 1] [--tokens 128] [--out FILE]
    python benchmarks/decode_profile.py --small --out /tmp/decode_profile.json   # the tiny target: seconds on a CPU

A drafter (an export folder; --small: a random DFlash2 drafter of the tiny target, conv and selector on) decodes the
first --batch prompts of --bench (--small: random prompts) for --tokens new tokens each (no stop token), greedy, through
`speculative_generate` as evaluate.py runs it: the plain loop, the fast one eager, and the fast one with the target's
and the drafter's steps compiled (--compile; default reduce-overhead, i.e. CUDA graphs, on a GPU, none on a CPU; the
conv inside the compiled drafter is then counted in `draft`). Each path decodes
once untimed (compiling), once counting the waits for the device (torch.cuda.set_sync_debug_mode, GPU only), then
once timed. The parts are wrapped from outside the loop: `verify`, the target's forward of the block; `conv_selector`,
DFlash2's heads: the conv's prepare/finish and the selector's candidates, lattice and walk, less the head matmul its
candidates start with (DFlash's argmax runs it too); `draft`, the rest of the drafter's step (its forward, the head,
the argmax or sampling, the mask and inputs). Per part and verify step: `host_ms`, the host's wall time inside it,
and on a GPU `device_ms`, the device's time between CUDA events recorded at its start and end (idle gaps where the
device waits for launches included). `other_host_ms` is the step's wall time less its parts' host time: the loop's
own work (acceptance, bookkeeping, compaction) and its waits for the device. Wall times start at the first draft,
after the prefill, and end after a final synchronisation. --trace DIR also writes a torch.profiler
Chrome trace of one more pass per path, with the parts as record_function ranges.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pathlib
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import transformers
import yaml

from dflash2.decoding import distributions, drafting, graphed
from dflash2.decoding import static as static_decode
from dflash2.decoding.speculative import Sampling, speculative_generate
from dflash2.model import kernels
from dflash2.model import selector as selector_module
from dflash2.model.drafter import DFlash2DraftModel

ROOT = pathlib.Path(__file__).resolve().parents[1]
PARTS = ("verify", "draft", "conv_selector")
SELECTOR_CALLS = ("compute_candidates", "build_lattice", "walk")
# --dflash2-parts: the published drafter's conv and selector shapes (benchmarks/overhead.py), switched on inert.
DFLASH2_PARTS = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=256, selector_top_k=16)


class Ranges:
    """Host time (perf_counter) and, on a GPU, CUDA events at the start and end of every call of the wrapped parts,
    each with the part it ran inside."""

    def __init__(self, cuda: bool, on_start: Callable[[], None] | None = None) -> None:
        self.cuda, self.on_start = cuda, on_start
        # name, the ranges it ran inside, begin, end, events
        self.calls: list[tuple[str, tuple[str, ...], float, float, list | None]] = []
        self.stack: list[str] = []
        self.start: float | None = None

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        if self.start is None and name == "drafter":  # the window opens at the first draft, after the prefill
            if self.on_start is not None:
                self.on_start()
            self.start = time.perf_counter()
        events = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)] if self.cuda else None
        inside = tuple(self.stack)
        self.stack.append(name)
        with torch.profiler.record_function(name):
            if events:
                events[0].record()
            begin = time.perf_counter()
            try:
                yield
            finally:
                end = time.perf_counter()
                if events:
                    events[1].record()
                self.stack.pop()
                self.calls.append((name, inside, begin, end, events))

    def wrap(self, fn: Callable, name: str) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            with self.range(name):
                return fn(*args, **kwargs)

        return wrapped

    def total(self, name: str, *within: str) -> tuple[float, float | None, int]:
        """(host ms, device ms or None on a CPU, calls) of the calls of `name` that ran inside every range of
        `within`, summed; synchronise first."""
        host, device, calls = 0.0, 0.0 if self.cuda else None, 0
        for call, inside, begin, end, events in self.calls:
            if call == name and all(w in inside for w in within):
                host, calls = host + (end - begin) * 1e3, calls + 1
                if events:
                    device += events[0].elapsed_time(events[1])
        return host, device, calls


@contextlib.contextmanager
def instrumented(
    target: Any, draft: DFlash2DraftModel, ranges: Ranges, fast: bool, compiled: bool = False
) -> Iterator[None]:
    """The parts wrapped, their attributes restored afterwards: the drafter's whole step (`Drafter.__call__`: its
    forward, the head, the selector or sampling), the conv and the selector inside it, the head matmul (speculative's
    and the selector's `head_logits`), and the verify. On the plain path the verify is `target.forward` (the prefill,
    which passes logits_at, is left out); on the fast path it is the step `target.decode_step` returns, wrapped
    outside the compiled function, which must not trace the timers. `compiled`: the drafter's forward is compiled too,
    so the conv inside it is not wrapped (its time counts as the draft's)."""
    patched: list[tuple[Any, str, Any, bool]] = []

    def patch(obj: Any, attr: str, value: Any) -> None:
        patched.append((obj, attr, getattr(obj, attr), attr in vars(obj)))
        setattr(obj, attr, value)

    wrap_verify(patch, target, ranges, fast)
    patch(drafting.Drafter, "__call__", ranges.wrap(drafting.Drafter.__call__, "drafter"))
    patch(graphed.WholeSteps, "__call__", ranges.wrap(graphed.WholeSteps.__call__, "whole"))
    wrap_heads(patch, draft, ranges, compiled)
    try:
        yield
    finally:
        for obj, attr, value, own in reversed(patched):
            if own:
                setattr(obj, attr, value)
            else:
                delattr(obj, attr)


def wrap_verify(patch: Callable[[Any, str, Any], None], target: Any, ranges: Ranges, fast: bool) -> None:
    """The verify: on the plain path `target.forward` less the prefill (which passes logits_at), on the fast path the
    step `target.decode_step` returns, wrapped outside the compiled function."""
    if fast:
        decode_step = target.decode_step
        patch(target, "decode_step", lambda mode=None: ranges.wrap(decode_step(mode), "verify"))
        return
    forward = target.forward

    def verify_forward(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("logits_at") is not None:
            return forward(*args, **kwargs)
        with ranges.range("verify"):
            return forward(*args, **kwargs)

    patch(target, "forward", verify_forward)


def wrap_heads(
    patch: Callable[[Any, str, Any], None], draft: DFlash2DraftModel, ranges: Ranges, compiled: bool
) -> None:
    """DFlash2's heads: the head matmul, the conv's prepare/finish (not inside a compiled drafter) and the selector."""
    for module in (distributions, selector_module):
        patch(module, "head_logits", ranges.wrap(module.head_logits, "head"))
    convs = [] if compiled else [c for layer in draft.layers for c in (layer.attention_conv, layer.mlp_conv)]
    for conv in filter(None, convs):
        patch(conv, "prepare", ranges.wrap(conv.prepare, "conv"))
        patch(conv, "finish", ranges.wrap(conv.finish, "conv"))
    if draft.candidate_selector is not None:
        for name in SELECTOR_CALLS:
            patch(draft.candidate_selector, name, ranges.wrap(getattr(draft.candidate_selector, name), "selector"))


def step_parts(ranges: Ranges, steps: int) -> dict[str, dict[str, float | None]]:
    """Per verify step: the verify; DFlash2's heads, the conv and the selector less the head matmul its candidates
    start with (DFlash's argmax runs the same matmul); the drafter's step less those heads."""
    verify, drafter = ranges.total("verify"), ranges.total("drafter")
    # The drafter's own: the same parts inside a whole step are that step's.
    conv, selector = ranges.total("conv", "drafter"), ranges.total("selector", "drafter")
    shared = ranges.total("head", "selector", "drafter")

    def combine(*signed: tuple[int, tuple]) -> dict[str, float | None]:
        host = sum(sign * part[0] for sign, part in signed)
        device = None if not ranges.cuda else sum(sign * part[1] for sign, part in signed)
        return {"host_ms": host / steps, "device_ms": None if device is None else device / steps}

    heads = ((1, conv), (1, selector), (-1, shared))
    parts = {
        "verify": combine((1, verify)),
        "draft": combine((1, drafter), *((-sign, part) for sign, part in heads)),
        "conv_selector": combine(*heads),
    }
    whole = ranges.total("whole")
    if whole[2]:  # the steps run whole: draft, verify and bookkeeping in one call, the host's read included
        parts["whole_step"] = combine((1, whole))
    return parts


def decode(target: Any, draft: DFlash2DraftModel, prompts: list[list[int]], tokens: int, block: int, path: dict) -> Any:
    sampling = Sampling(temperature=0.0, batch_size=len(prompts))
    if path["fast"] is None:
        return speculative_generate(target, draft, prompts, block, tokens, sampling)
    return static_decode.speculative_generate(target, draft, prompts, block, tokens, sampling, fast=path["fast"])


def count_syncs(run: Callable[[Ranges], Any]) -> int | None:
    """How many times a run waits for the device after its prefill (torch's sync debug mode warns at each wait);
    None on a CPU."""
    if not torch.cuda.is_available():
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opened: list[int] = []
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run(Ranges(True, on_start=lambda: opened.append(len(caught))))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught[opened[0] :])


def profile_path(target: Any, draft: DFlash2DraftModel, prompts: list[list[int]], args: Any, path: dict) -> dict:
    cuda = torch.cuda.is_available()
    compiled = path["fast"].compile if path["fast"] is not None else None

    def run(ranges: Ranges) -> Any:
        with instrumented(target, draft, ranges, fast=path["fast"] is not None, compiled=compiled is not None):
            return decode(target, draft, prompts, args.tokens, args.block_size, path)

    run(Ranges(cuda))  # compiles, captures, allocates
    syncs = count_syncs(run)
    ranges = Ranges(cuda)
    if cuda:
        torch.cuda.synchronize()
    out = run(ranges)
    if cuda:
        torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - ranges.start) * 1e3
    if args.trace:
        args.trace.mkdir(parents=True, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=activities) as prof:
            run(Ranges(cuda))
        prof.export_chrome_trace(str(args.trace / f"{path['name']}_batch{len(prompts)}.json"))
    steps = ranges.total("verify")[2] + ranges.total("whole")[2]
    parts = step_parts(ranges, steps)
    step_ms = wall_ms / steps
    num_tokens = sum(len(g.output_ids) for g in out)
    return {
        "compile": compiled,
        "steps": steps,
        "tokens": num_tokens,
        "tau": statistics.mean(n for g in out for n in g.accept_lengths),
        "wall_ms_per_step": step_ms,
        "tokens_per_s": num_tokens / wall_ms * 1e3,
        "parts": parts,
        "other_host_ms": step_ms - sum(p["host_ms"] for p in parts.values()),
        "syncs_per_step": None if syncs is None else syncs / steps,
        "output_ids": [g.output_ids for g in out],
    }


def target_alone(target: Any, prompts: list[list[int]], tokens: int, fast: Any) -> dict[str, Any]:
    """The target alone on the same prompts, greedy, on the fast loop of `fast` (once untimed: it compiles): its
    wall time per one-token step, which a speculative step is measured against."""
    sampling = Sampling(temperature=0.0, batch_size=len(prompts))
    static_decode.target_generate(target, prompts, tokens, sampling, fast=fast)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = static_decode.target_generate(target, prompts, tokens, sampling, fast=fast)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    steps = max(len(g.output_ids) for g in out) - 1  # after the prefill's token, one step per token
    return {"wall_ms_per_step": (time.perf_counter() - start) * 1e3 / steps, "compile": fast.compile}


def load(args: Any, device: torch.device) -> tuple[Any, DFlash2DraftModel, list[list[int]]]:
    """The target, the drafter and every prompt: --small builds the tiny ones, else SmolLM2 (--dtype) and an export."""
    if args.small:
        from dflash2.testing import tiny_draft_config, tiny_target

        target = tiny_target(target_layer_ids=[1, 2], device=device)
        parts = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
        draft = DFlash2DraftModel(tiny_draft_config(target, block_size=args.block_size, **parts))
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in draft.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        lengths = torch.randint(8, 24, (max(args.batch),), generator=g).tolist()
        prompts = [torch.randint(4, target.vocab_size, (n,), generator=g).tolist() for n in lengths]
        return target, draft.to(device).eval(), prompts
    from dflash2.commands import build
    from dflash2.data.benches import load_prompts
    from dflash2.evaluation.loading import render
    from dflash2.model.config import DFlash2Config
    from dflash2.target.manifest import MANIFEST_KEY, manifest_chat_template_kwargs

    saved = DFlash2Config.from_pretrained(args.drafter)
    model = yaml.safe_load((ROOT / "configs" / "model" / "smollm2.yaml").read_text())
    target = build(model | {"dtype": args.dtype, "target_layer_ids": saved.target_layer_ids}, device=device)
    parts = DFLASH2_PARTS if args.dflash2_parts else {}
    draft = DFlash2DraftModel.from_pretrained(args.drafter, target.lm_head_weight.dtype, device, **parts).eval()
    kwargs = manifest_chat_template_kwargs(draft.config.extra.get(MANIFEST_KEY)) or {}
    chats = load_prompts(args.bench, max(args.batch))
    prompts = [render(target.tokenizer, [{"role": "user", "content": c["turns"][0]}], kwargs) for c in chats]
    return target, draft, prompts


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", type=pathlib.Path, help="an export folder (export.py); not with --small")
    parser.add_argument("--small", action="store_true", help="the tiny target and a random drafter, CPU-sized")
    parser.add_argument("--batch", type=int, nargs="+", default=[1], help="requests per step")
    parser.add_argument("--tokens", type=int, help="new tokens per request (default 128; --small: 24)")
    parser.add_argument("--block-size", type=int, help="B (default: the drafter's; --small: 4)")
    parser.add_argument("--bench", default="gsm8k", help="whose prompts (not with --small)")
    parser.add_argument("--dtype", default="bfloat16", help="SmolLM2's (not with --small, which is float32)")
    parser.add_argument(
        "--dflash2-parts",
        action="store_true",
        help="a plain DFlash export with the conv and the selector switched on, inert (the same tokens): their time",
    )
    parser.add_argument(
        "--compile", help="the fast path's compile mode (default reduce-overhead on a GPU, none on a CPU); none: off"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, as evaluate.py's threads=1")
    parser.add_argument("--trace", type=pathlib.Path, help="also write torch.profiler Chrome traces into this folder")
    parser.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "results" / "decode_profile.json")
    args = parser.parse_args(argv)
    if args.small == (args.drafter is not None):
        parser.error("pass --drafter <export dir>, or --small")
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.tokens = args.tokens or (24 if args.small else 128)
    if args.small:
        args.block_size = args.block_size or 4
    target, draft, prompts = load(args, device)
    args.block_size = args.block_size or draft.config.block_size
    mode = args.compile or ("reduce-overhead" if device.type == "cuda" else "none")
    pieces = static_decode.FastDecode(whole_step=False)
    paths = [{"name": "plain", "fast": None}, {"name": "static", "fast": pieces}]
    if mode == "none":
        paths.append({"name": "whole", "fast": static_decode.FastDecode()})
    else:
        compiled = static_decode.decode_mode("static", mode, device)
        paths.append({"name": "static_compiled", "fast": dataclasses.replace(compiled, whole_step=False)})
        paths.append({"name": "whole_compiled", "fast": compiled})
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "timer": "cuda_events" if device.type == "cuda" else "cpu_wall",
        "kernels": kernels.get_backend(),
        "target": "tiny float32" if args.small else f"smollm2 {args.dtype}",
        "drafter": "random tiny" if args.small else str(args.drafter),
        "dflash2_parts_added": DFLASH2_PARTS if args.dflash2_parts else None,
        "bench": None if args.small else args.bench,
        "block_size": args.block_size,
        "max_new_tokens": args.tokens,
        "threads": args.threads,
        "rows": [],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for batch in args.batch:
        row: dict[str, Any] = {"batch": batch, "paths": {}}
        for path in paths:
            row["paths"][path["name"]] = profile_path(target, draft, prompts[:batch], args, path)
        row["target_alone"] = target_alone(target, prompts[:batch], args.tokens, paths[-1]["fast"])
        outputs = [p.pop("output_ids") for p in row["paths"].values()]
        row["identical_outputs"] = all(o == outputs[0] for o in outputs)
        result["rows"].append(row)
        args.out.write_text(json.dumps(result, indent=2) + "\n")  # after every batch size: a cut-off run keeps them
        alone = row["target_alone"]
        print(f"batch {batch:3d} target alone     {alone['wall_ms_per_step']:7.2f} ms/step (its last path's loop)")
        for name, p in row["paths"].items():
            shares = ", ".join(f"{k} {v['host_ms']:.2f}" for k, v in p["parts"].items())
            print(
                f"batch {batch:3d} {name:16s} {p['wall_ms_per_step']:7.2f} ms/step ({shares}, other "
                f"{p['other_host_ms']:.2f} host ms), tau {p['tau']:.2f}, {p['tokens_per_s']:.0f} tokens/s",
                flush=True,
            )
        if not row["identical_outputs"]:
            print(f"WARNING: batch {batch}: the paths' greedy outputs differ", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
