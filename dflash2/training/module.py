"""The LightningModule: a frozen target feeds the drafter, which learns to propose whole blocks.

The target is kept out of the module tree on purpose: it is never saved, never wrapped by DDP/FSDP and never
optimised; only `self.draft` (contract tensor names under `draft.`) is in the checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import FSDPStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch.profiler import record_function
from torchmetrics import Metric

from dflash2.data.anchors import block_mask, teacher_positions
from dflash2.data.feature_store import cached_output
from dflash2.model.config import DFlash2Config
from dflash2.model.contract import DFLASH_FIELDS
from dflash2.model.drafter import DecoderLayer, DFlash2DraftModel
from dflash2.target.manifest import MANIFEST_KEY, build_manifest
from dflash2.training.checkpoint import CONFIG_KEY, drafter_state, read_info, write_info
from dflash2.training.checks import check_module_knobs
from dflash2.training.head import head_loss
from dflash2.training.losses import (
    DraftLosses,
    DraftSlots,
    RankMean,
    block_targets,
    metric_floats,
    metric_tensors,
    total_loss,
    trained_slots,
)
from dflash2.training.objectives import Objective, Optim, as_dict

log = logging.getLogger(__name__)

# Parameters DFlash2 adds on top of a DFlash backbone: what `module.train_backbone=false` still trains.
HEAD_PARTS = ("attention_conv", "mlp_conv", "candidate_selector")
# Structural fields a warm start takes from the draft config, not from the loaded folder: every dflash_config
# field but the target layers, which the folder's weights were trained on (resolve_drafter gives the config them).
WARM_START_FIELDS = tuple(f for f in DFLASH_FIELDS if f != "target_layer_ids")


class DraftMetrics(Metric):
    """Sums of the counts of `SlotLoss` over an epoch (and over ranks): accuracies are sum(correct)/sum(n)."""

    full_state_update = False

    def __init__(self, slots: int, selector: bool, distill: bool = False) -> None:
        super().__init__()
        names = ["ce_sum", "weight_sum"] + (["distill_sum"] if distill else [])
        if selector:
            names += ["topk_hit", "topk_total", "selector_hit", "selector_total", "selector_sum", "selector_weight_sum"]
        self.names = names
        self.per_slot = ["correct", "total"] + (["correct_top1"] if selector else [])
        for name in self.per_slot:
            self.add_state(name, torch.zeros(slots, dtype=torch.float64), dist_reduce_fx="sum")
        for name in names:
            self.add_state(name, torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, counts: dict[str, torch.Tensor]) -> None:
        for name in [*self.per_slot, *self.names]:
            setattr(self, name, getattr(self, name) + counts[name].detach().double())

    def compute(self) -> dict[str, float]:
        return metric_floats({name: getattr(self, name) for name in [*self.per_slot, *self.names]})


@dataclasses.dataclass(frozen=True)
class ModuleSettings:
    """configs/module's own keys (module.init_from=...), which shape training only, never the export."""

    init_from: str | None = None  # a DFlash or DFlash2 export folder to warm-start from
    train_backbone: bool = True  # false: train only the conv and the selector
    compile: bool = False  # torch.compile the drafter and the head's chunks (CUDA only)
    init_std: float | None = None  # N(0, init_std) for the backbone's Linear weights of a drafter built from scratch
    feature_scaling: bool = False  # at a fresh run's first step, scale fc's block of each target layer by 1/RMS


class DFlash2Module(L.LightningModule):
    """configs/module: the drafter of `draft_config` (or warm-started from `init_from`) trained against `target` by
    `objective` and `optim`. `settings` are the module group's keys (`ModuleSettings`): `init_std`,
    `feature_scaling` and `train_backbone` shape training only, never the export; `compile` runs the drafter and the
    head's chunks under torch.compile (CUDA only)."""

    def __init__(
        self,
        target: torch.nn.Module,
        draft_config: DFlash2Config,
        objective: Objective | None = None,
        optim: Optim | None = None,
        manifest: dict[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        super().__init__()
        knobs = ModuleSettings(**settings)
        self.save_hyperparameters(dataclasses.asdict(knobs))
        check_module_knobs(self.hparams)
        # Not a submodule: Lightning would otherwise save it, wrap it and hand it to the optimizer.
        object.__setattr__(self, "target", target)
        self.objective, self.optim = objective or Objective(), optim or Optim()
        self.manifest = manifest or {}
        self.draft = build_drafter(draft_config, knobs.init_from, knobs.init_std)
        # Plain data, so that a checkpoint loads with weights_only=True; the drafter's is what was actually built (a
        # warm start may change layers and ids).
        self.hparams[CONFIG_KEY] = self.draft.config.to_dict()
        self.hparams["objective"], self.hparams["optim"] = as_dict(self.objective), as_dict(self.optim)
        if not knobs.train_backbone:
            freeze_backbone(self.draft)
        self.slot_loss = self.objective.slot_loss(self.draft.config.block_size)
        slots, has_selector = self.draft.config.block_size - 1, self.draft.candidate_selector is not None
        self.val_metrics = DraftMetrics(slots, has_selector, self.objective.distill > 0)
        self.latest_metrics: dict[str, float] = {}
        # Until the first training step of a fresh run: a restored checkpoint clears it (on_load_checkpoint).
        self.scale_features_pending = knobs.feature_scaling

    # ------------------------------------------------------------------ the step
    def setup(self, stage: str) -> None:
        # Here, not in on_*_start hooks: those run under inference mode, and a target moved there would hold
        # inference tensors that autograd refuses to save (its head is in the drafter's graph).
        self.target.to(self.trainer.strategy.root_device)
        check_module_knobs(self.hparams, type(self.trainer.strategy).__name__)
        self.compile_draft()

    def compile_draft(self) -> None:
        if self.compiled and not getattr(self.draft, "_compiled_call_impl", None):
            # In place (nn.Module.compile): the parameter names, hence checkpoints and exports, stay the contract's.
            # Dynamic shapes: rows, anchors and lengths change from batch to batch.
            self.draft.compile(dynamic=True)

    @property
    def compiled(self) -> bool:
        """torch.compile the drafter and the head's chunks: on CUDA only (inductor's CPU code for flex attention does
        not build, and CPU tests run the same math eagerly)."""
        return bool(self.hparams.get("compile")) and self.device.type == "cuda"

    def target_pass(self, batch: dict[str, torch.Tensor]) -> Any:
        """The target's features of the batch (TargetOutput), with its final hidden states when distilling."""
        with record_function("target"):
            if "features" in batch:  # data.features: the target's, read from the cache; the target does not run
                return cached_output(batch, self.target.embed_tokens.weight.dtype)
            final = self.objective.distill > 0
            # No attention mask: rows are right-padded (BlockCollator), so under causal attention no real token sees a
            # pad, and the pads' own features are never read (`known` hides them from every block). Without a mask
            # the target's SDPA runs its causal flash kernel and builds no [b, 1, L, L] mask.
            return self.target(batch["input_ids"], logits=False, final=final)

    def block_hidden(self, batch: dict[str, torch.Tensor], features: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced draft output at the proposing slots 1..B-1 of every block: [b, n, B-1, H]. `features`: the
        target's, when `target_pass` ran already."""
        cfg = self.draft.config
        b, length = batch["input_ids"].shape
        n = batch["anchors"].shape[1]
        if features is None:
            features = self.target_pass(batch).hidden
        with record_function("target"):
            block_embeds = self.target.embed_tokens(batch["block_ids"])
        with record_function("block_mask"):
            mask = block_attention_mask(batch, length, cfg)
        with record_function("draft"):
            context = self.draft.fuse(features)
            context_positions = torch.arange(length, device=self.device).expand(b, length)
            # B is the drafter's own here: read inside the forward, a compiled graph holds it as a constant.
            hidden = self.draft(block_embeds, batch["block_positions"], context, context_positions, mask)
        return hidden.view(b, n, cfg.block_size, -1)[:, :, 1:]

    def on_before_batch_transfer(self, batch: dict[str, Any], dataloader_idx: int) -> dict[str, Any]:
        # Counted here, on the host: on the device, selecting the trained rows by a boolean index would stall the
        # host every step until the GPU caught up, so it could never queue a step ahead.
        return batch | {"trained_slots": trained_slots(batch)}

    def draft_step(self, batch: dict[str, torch.Tensor], rank_mean: RankMean = None) -> DraftLosses:
        """Teacher-forced pass over the batch's blocks -> DraftLosses (`rank_mean`: SlotLoss.forward's)."""
        cfg = self.draft.config
        b, n = batch["anchors"].shape
        target = self.target_pass(batch)
        slots = DraftSlots(
            hidden=self.block_hidden(batch, target.hidden),
            labels=block_targets(batch),
            anchor_ids=batch["block_ids"].view(b, n, cfg.block_size)[:, :, 0],
            teacher=self.teacher_hidden(batch, target.final_hidden),
            trained=batch.get("trained_slots"),
        )
        with record_function("losses"):
            head = self.target.lm_head_weight[: cfg.vocab_size]  # rows past the vocabulary are padding
            return self.slot_loss(slots, head, self.draft.candidate_selector, rank_mean, self.compiled)

    def teacher_hidden(self, batch: dict[str, torch.Tensor], final_hidden: torch.Tensor | None) -> torch.Tensor | None:
        """When distilling, the target's final hidden state at anchor + k - 1 for slot k of every block: slot k learns
        the target's distribution there. [b, n, B-1, H]; None without `final_hidden`."""
        if final_hidden is None:
            return None
        positions = teacher_positions(batch["anchors"], self.draft.config.block_size)
        rows = torch.arange(final_hidden.shape[0], device=self.device)[:, None, None]
        return final_hidden[rows, positions.clamp(max=final_hidden.shape[1] - 1)]

    def current_selector_alpha(self) -> float:
        return self.objective.alpha(self.global_step)

    def ranks(self) -> int:
        """The data-parallel ranks training together (1 without a Trainer)."""
        return self._trainer.world_size if self._trainer is not None else 1

    def rank_mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of `t` over the ranks (an all-reduce)."""
        return rank_sums({"t": t})["t"] / self.ranks()

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        # Under DDP, each rank's loss is its share of the global batch's (SlotLoss's rank_mean): DDP's mean of the
        # ranks' gradients is then the gradient one process takes on the global batch.
        out = self.draft_step(batch, rank_mean=self.rank_mean if self.ranks() > 1 else None)
        losses = {"loss": out.ce}
        if out.selector is not None:
            alpha = self.current_selector_alpha()
            losses |= {"loss": total_loss(out.ce, out.selector, alpha), "loss_selector": out.selector}
        summed = {k: v.detach() for k, v in (out.counts | losses).items()}
        if self.ranks() > 1:  # what is logged is the global batch's: its counts summed over the ranks, and the mean
            # of the ranks' shares of the losses, in one all-reduce (a mean of the ranks' ratios weighs rows unequally)
            summed = rank_sums(summed | {k: summed[k] / self.ranks() for k in losses})
        # Tensors, not floats: reading them would stall the step on the device; Lightning reads them when it logs.
        # loss_ce is the hard-label CE whatever `distill` is, so that runs stay comparable; loss_distill the soft one.
        stats = metric_tensors({k: summed[k] for k in out.counts})
        logs = {k: stats.pop(k) for k in ("loss_ce", "loss_distill") if k in stats}
        stats.pop("loss_selector", None)
        if out.selector is not None:
            logs |= {"loss_selector": summed["loss_selector"], "selector_alpha": alpha}
        logs |= {"loss": summed["loss"], **stats}
        self.log_dict(
            {f"train/{k}": v for k, v in logs.items()},
            on_step=True,
            on_epoch=False,
            prog_bar=False,
            batch_size=batch["input_ids"].shape[0],
            sync_dist=False,  # the same on every rank: the global batch's, comparable to one device
        )
        self.log("tau", stats["tau_sim"], prog_bar=True, logger=False, batch_size=batch["input_ids"].shape[0])
        return losses["loss"]

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_metrics.update(self.draft_step(batch).counts)

    def on_validation_epoch_end(self) -> None:
        metrics = self.val_metrics.compute()
        self.val_metrics.reset()
        metrics = {k: v for k, v in metrics.items() if not _isnan(v)}
        if "loss_selector" in metrics or "loss_distill" in metrics:  # the objective, as training_step's `loss`
            head = head_loss(metrics["loss_ce"], metrics.get("loss_distill"), self.objective.distill)
            metrics["loss"] = total_loss(head, metrics.get("loss_selector"), self.current_selector_alpha())
        # Already summed over ranks by the metric; sync_dist only averages identical values (and keeps Lightning quiet).
        self.log_dict({f"val/{k}": v for k, v in metrics.items()}, sync_dist=True)
        self.log("val_tau", metrics["tau_sim"], prog_bar=True, logger=False, sync_dist=True)
        if not self.trainer.sanity_checking:
            self.latest_metrics = {f"val/{k}": float(v) for k, v in metrics.items()}
            if self.trainer.is_global_zero:  # a log line, so train.log has it: the progress bar is gone off a terminal
                log.info("validation at step %d: %s", self.global_step, validation_line(metrics))

    # ------------------------------------------------------------------ feature scaling (module.feature_scaling)
    def on_train_batch_start(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        if self.scale_features_pending:
            self.scale_features_pending = False
            if self.global_step == 0:
                self.scale_features(batch)

    @torch.no_grad()
    def scale_features(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Scale fc's column block of target layer k by s_k = (1/rms_k) / mean_j(1/rms_j), rms_k the RMS of that
        layer's features over the batch's real tokens (summed over ranks), so that every layer enters the fused
        context at one scale; the mean keeps fc's norm, and hidden_norm after fc makes the absolute scale moot.
        Returns the RMS values [n]."""
        features = self.target_pass(batch).hidden
        n, h = len(self.draft.config.target_layer_ids), self.draft.config.hidden_size
        real = features[batch["attention_mask"].bool()].float().view(-1, n, h)
        sums = torch.cat([real.pow(2).sum((0, 2)), real.new_tensor([real.shape[0] * h])])
        if self._trainer is not None:
            sums = self.trainer.strategy.reduce(sums, reduce_op="sum")
        rms = (sums[:n] / sums[n]).sqrt()
        scale = rms.reciprocal() / rms.reciprocal().mean()
        fc = self.draft.fc.weight
        fc.view(h, n, h).mul_(scale.to(fc.dtype)[None, :, None])
        layers = self.draft.config.target_layer_ids
        log.info(
            "feature scaling: target layers %s have RMS %s over %d tokens; fc's column blocks scaled by %s",
            layers,
            " ".join(f"{v:.4g}" for v in rms.tolist()),
            int(sums[n]) // h,
            " ".join(f"{v:.4g}" for v in scale.tolist()),
        )
        return rms

    # ------------------------------------------------------------------ optimization
    def configure_optimizers(self) -> dict[str, Any]:
        total = int(self.trainer.estimated_stepping_batches)
        return self.optim.build(self.draft.named_parameters(), self.trainer.precision, total)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm=None
    ) -> None:
        # Lightning's mixed-precision plugin refuses to clip for a fused optimizer, because under fp16 its gradient
        # scaler leaves the gradients scaled until that optimizer's step. bf16-mixed has no scaler: the gradients are
        # the true ones here, so `optim.fused=true` clips through the plugin's base clipping, as a fp32 run does.
        plugin = self.trainer.precision_plugin
        mixed = type(plugin) is MixedPrecision and plugin.scaler is None  # FSDP's plugin clips across its shards
        if gradient_clip_val and mixed and getattr(optimizer, "_step_supports_amp_scaling", False):
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or "norm")
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)
            return
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # ------------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["state_dict"] = drafter_state(checkpoint["state_dict"])
        extra = {k: v for k, v in self.manifest.items() if k not in ("identity", "data_source")}
        manifest = build_manifest(
            self.manifest.get("identity", {}), self.manifest.get("data_source", "unknown"), self.global_step, **extra
        )
        write_info(checkpoint, manifest, self.latest_metrics, self.global_step)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.latest_metrics = dict(read_info(checkpoint).get("metrics") or {})
        self.scale_features_pending = False  # a resumed run's fc was scaled (or not) when it started


def rank_sums(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The (detached) tensors summed over the data-parallel ranks, in one all-reduce."""
    flat = torch.cat([t.detach().double().flatten() for t in tensors.values()])
    torch.distributed.all_reduce(flat)
    sizes = [t.numel() for t in tensors.values()]
    return {k: v.view_as(t).to(t.dtype) for (k, t), v in zip(tensors.items(), flat.split(sizes), strict=True)}


def validation_line(metrics: dict[str, float]) -> str:
    """`tau_sim 1.2061, loss 5.3125, ..., acc_1..7 0.226 0.040 ...`: the summary metrics, then the per-slot ones."""
    slots = sorted((k for k in metrics if k.startswith("acc_")), key=lambda k: int(k.removeprefix("acc_")))
    head = [f"{k} {metrics[k]:.4f}" for k in ("tau_sim", "tau_sim_top1", "loss") if k in metrics]
    head += [f"{k} {v:.4f}" for k, v in sorted(metrics.items()) if k not in (*slots, "tau_sim", "tau_sim_top1", "loss")]
    accuracies = " ".join(f"{metrics[k]:.3f}" for k in slots)
    return ", ".join(head) + (f", acc_1..{len(slots)} {accuracies}" if slots else "")


def build_drafter(config: DFlash2Config, init_from: str | None, init_std: float | None) -> DFlash2DraftModel:
    """The drafter to train: `config`'s, fresh (its backbone drawn from N(0, `init_std`) when set), or loaded from the
    export `init_from` with `config`'s structural fields."""
    config = config.replace(extra=dict(config.extra))
    config.extra.pop(MANIFEST_KEY, None)  # a warm start's manifest described another run
    if init_from:
        overrides = {f: getattr(config, f) for f in WARM_START_FIELDS}
        draft = DFlash2DraftModel.from_pretrained(init_from, **overrides)
        draft.config.extra.pop(MANIFEST_KEY, None)
        log.info("warm start from %s", init_from)
        return draft
    draft = DFlash2DraftModel(config)
    if init_std is not None:
        for linear in backbone_linears(draft):
            torch.nn.init.normal_(linear.weight, std=init_std)
    return draft


def backbone_linears(draft: DFlash2DraftModel) -> list[torch.nn.Linear]:
    """fc and every layer's attention and MLP projections: what `module.init_std` draws from N(0, init_std), as
    SpecForge and ModelOpt do. Not the conv's projection nor the selector: their inits are the contract's."""
    linears = [draft.fc]
    for layer in draft.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    return linears


def freeze_backbone(draft: DFlash2DraftModel) -> None:
    """Train only the DFlash2 additions (conv and selector); the DFlash backbone stays as loaded."""
    trainable = 0
    for name, p in draft.named_parameters():
        keep = name.split(".")[0] == "candidate_selector" or any(f".{part}." in name for part in HEAD_PARTS)
        p.requires_grad_(keep)
        trainable += p.numel() if keep else 0
    if not trainable:
        raise ValueError(
            "module.train_backbone=false leaves nothing to train: this drafter has neither conv nor "
            "selector (set draft.conv_kernel_size/selector_rank, or module.train_backbone=true)"
        )


def fsdp_strategy(**kwargs: Any) -> Any:
    """Lightning's FSDP, wrapping each draft decoder layer (Hydra cannot spell a set of classes)."""
    return FSDPStrategy(auto_wrap_policy={DecoderLayer}, use_orig_params=True, **kwargs)


def block_attention_mask(batch: dict[str, torch.Tensor], length: int, cfg: DFlash2Config) -> Any:
    """The training mask of contract section 7: flex BlockMask on CUDA, the equivalent dense bool mask elsewhere; one
    per layer type when some draft layers slide."""
    args = (batch["anchors"], batch["anchor_valid"], length, cfg.block_size, batch["attention_mask"])

    def build(window: int | None) -> Any:
        return block_mask(*args, window=window, flex=batch["anchors"].is_cuda)

    return cfg.attention_masks(build)


def _isnan(v: Any) -> bool:
    return isinstance(v, float) and math.isnan(v)
