"""DFlashDataModule: chats -> cached token rows -> batches of anchored blocks (contract section 7).

The DataModule, built from the data group's keys (`DataSettings`), reads and renders the chats, splits them into
training and validation rows and serves them through `AnchoredRows` and `GlobalBatchSampler` (dflash2.data.sampling),
batched by `BlockCollator` (dflash2.data.collate).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import datasets
import lightning as L
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from dflash2.data.anchors import IGNORE, CopyAnchors, check_copy_anchors
from dflash2.data.chat import (
    is_packaged_sharegpt,
    load_conversations,
    regenerated_with,
    sharegpt_path,
    tokenize_conversations,
)
from dflash2.data.collate import BlockCollator
from dflash2.data.feature_store import FeatureStore
from dflash2.data.sampling import AnchoredRows, GlobalBatchSampler
from dflash2.model.contract import check_block_size
from dflash2.target.chat_template import KWARGS_KEY, check_chat_template_kwargs, format_kwargs, one_setting, same_kwargs

log = logging.getLogger(__name__)


def check_drop_last(value: object) -> None:
    """`data.drop_last` must be a bool: whether each epoch's last, short training batch is dropped."""
    if not isinstance(value, bool):
        raise ValueError(f"data.drop_last={value!r}: set it to true or false")


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """configs/data's keys (data.max_length=...), every one but those train.py passes (the tokenizer and the drafter's
    block_size and mask_token_id): which chats, how they are rendered, split, anchored and batched. Checked when
    built."""

    path: str | None = None  # a JSON/JSONL file of chats; None = the embedded ShareGPT
    limit: int | None = None  # the first N conversations of `path`
    max_length: int = 3072  # tokens per chat after the chat template
    max_anchors: int = 512  # blocks per chat
    val_size: int | float = 0.05  # chats held out (an int) or a fraction (a float), by id
    batch_size: int = 1
    num_workers: int = 0
    num_proc: int | None = None  # processes tokenizing
    seed: int = 0  # the split and the validation anchors
    cache_dir: str | None = None  # where the rendered rows are cached; None = $HF_DATASETS_CACHE/dflash2
    name: str | None = None
    pad_to_multiple_of: int = 1  # BlockCollator's
    drop_last: bool = False  # drop each epoch's last, short training batch
    extra_paths: list[str] | tuple[str, ...] = ()  # more chat files, for training only
    features: str | None = None  # a cache of the target's features
    chat_template_kwargs: dict[str, Any] | None = None  # `resolve_chat_template_kwargs`' `requested`
    copy_anchor_weight: float = 1.0  # CopyAnchors'
    copy_anchor_min_match: int = 1

    def __post_init__(self) -> None:
        kwargs = check_chat_template_kwargs(self.chat_template_kwargs, f"data.{KWARGS_KEY}")
        object.__setattr__(self, "chat_template_kwargs", kwargs)
        check_drop_last(self.drop_last)
        if self.max_length < 2 or self.max_anchors < 1:
            raise ValueError(f"max_length={self.max_length} must be >= 2 and max_anchors={self.max_anchors} >= 1")


def batch_rows(batch: dict[str, torch.Tensor]) -> int:
    """Sequences in a collated batch (Lightning's ThroughputMonitor `batch_size_fn`)."""
    return batch["input_ids"].shape[0]


def trained_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Block slots with a label, i.e. the tokens a step trains on (ThroughputMonitor's `length_fn`)."""
    return int((batch["labels"] != IGNORE).sum())


def split_by_id(rows: datasets.Dataset, val: int, seed: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, validation): `val` conversations held out by their id, and with them every other row of that id, so
    that several replies to one prompt (regenerations with sampling, concatenated) never straddle the split. The
    validation rows are each held-out id's first. With unique ids this is `train_test_split(test_size=val, seed)`."""
    ids = rows["id"]
    first: dict[str, int] = {}
    for i, rid in enumerate(ids):
        first.setdefault(rid, i)
    if not 0 < val < len(first):
        raise ValueError(
            f"data.val_size: {val} held-out chats leave no training or no validation chats among the data's "
            f"{len(first)} distinct ids (the split is by conversation id); lower data.val_size, or give the records "
            "their own ids"
        )
    if len(first) == len(rows):
        split = rows.train_test_split(test_size=val, seed=seed, shuffle=True)
        return split["train"], split["test"]
    held = rows.select(list(first.values())).train_test_split(test_size=val, seed=seed, shuffle=True)["test"]
    out = set(held["id"])
    return rows.select([i for i, rid in enumerate(ids) if rid not in out]), held


def resolve_chat_template_kwargs(
    requested: dict[str, Any] | None, files: dict[str, datasets.Dataset], setting: str = f"data.{KWARGS_KEY}"
) -> dict[str, Any]:
    """The `chat_template_kwargs` training renders `files` (source -> its conversations) with: `requested` (the
    setting `data.chat_template_kwargs`), or where it is null the ones the files were regenerated with (none, {}, for
    chats that were not regenerated). Refused, naming both and the fix, when a file was regenerated with other ones
    than those it would be rendered with, or when the files were regenerated with different ones."""
    recorded = {source: regenerated_with(rows, source) for source, rows in files.items()}
    regenerated = {source: kwargs for source, kwargs in recorded.items() if kwargs is not None}
    if requested is None:
        what = f"{setting} is null (render as the data was regenerated), but the files were"
        fix = "train on files regenerated alike, or regenerate them with one setting"
        chosen = one_setting(list(regenerated.items()), what, fix)
        chosen = {} if chosen is None else chosen
        log.info(
            "rendering the chats with %s=%s (%s)",
            KWARGS_KEY,
            format_kwargs(chosen),
            "as the data was regenerated" if regenerated else "none: the chats were not regenerated",
        )
        return chosen
    for source, kwargs in regenerated.items():
        if not same_kwargs(kwargs, requested):
            raise ValueError(
                f"{setting}={format_kwargs(requested)} but {source} was regenerated with "
                f"{KWARGS_KEY}={format_kwargs(kwargs)}: the drafter would train on prompts rendered otherwise than the "
                f"replies were generated under. Set {setting}={format_kwargs(kwargs)} (or null: as the data was "
                f"regenerated), or regenerate the file with {KWARGS_KEY}={format_kwargs(requested)}"
            )
    log.info("rendering the chats with %s=%s", KWARGS_KEY, format_kwargs(requested))
    return dict(requested)


class DFlashDataModule(L.LightningDataModule):
    """Chats rendered with the target's template (`path=None`: the embedded ShareGPT), split once into train and
    validation rows; batches carry anchors and blocks, the attention mask is built on the model's device. `settings`
    are the data group's keys (`DataSettings`), kept in `hparams`.

    `chat_template_kwargs`: the template's extra arguments (`resolve_chat_template_kwargs`; null = as the data was
    regenerated). The ones rendered with replace it in `hparams`, which every checkpoint keeps and the export's
    manifest takes: evaluation then renders its prompts as training rendered the chats."""

    def __init__(self, tokenizer: Any, block_size: int, mask_token_id: int, **settings: Any) -> None:
        super().__init__()
        data = DataSettings(**settings)
        check_block_size(block_size)
        check_copy_anchors(data.copy_anchor_weight, data.copy_anchor_min_match, block_size)
        if not 0 <= mask_token_id < len(tokenizer):
            raise ValueError(f"mask_token_id={mask_token_id} is outside the tokenizer's {len(tokenizer)} ids")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the target's tokenizer has no chat template; use an instruct/chat target or set "
                "tokenizer.chat_template before building the data"
            )
        self.save_hyperparameters({"block_size": block_size, "mask_token_id": mask_token_id} | dataclasses.asdict(data))
        self.tokenizer = tokenizer
        self.features = None if data.features is None else FeatureStore(data.features)  # the target's, cached
        # Training anchors only: validation keeps drawing every position alike, so its metrics compare across runs.
        weight, min_match = data.copy_anchor_weight, data.copy_anchor_min_match
        self.copy = None if weight == 1 else CopyAnchors(weight, block_size, min_match)
        self.collate = BlockCollator(block_size, mask_token_id, tokenizer.pad_token_id or 0, data.pad_to_multiple_of)
        self._prepared: tuple[datasets.Dataset, list[datasets.Dataset]] | None = None
        self.train_rows: datasets.Dataset | None = None
        self.val_rows: datasets.Dataset | None = None
        self._train_loader: StatefulDataLoader | None = None
        self._train_loader_state: dict[str, Any] | None = None

    def rows(self) -> tuple[datasets.Dataset, list[datasets.Dataset]]:
        """The rows of `path` (split into training and validation) and of each `extra_paths` file (training only)."""
        h = self.hparams
        files = [(h.path, h.limit), *((p, None) for p in h.extra_paths)]
        loaded = [(sharegpt_path() if p is None else os.path.abspath(p), load_conversations(p, n)) for p, n in files]
        # Every file is read before any is rendered: a file regenerated otherwise is refused before the long part.
        h.chat_template_kwargs = resolve_chat_template_kwargs(h.chat_template_kwargs, dict(loaded))
        rows = [self._tokenized(source, chats, n) for (source, chats), (_, n) in zip(loaded, files, strict=True)]
        return rows[0], rows[1:]

    def _tokenized(self, source: str, conversations: datasets.Dataset, limit: int | None) -> datasets.Dataset:
        h = self.hparams
        stat = os.stat(source)
        source_key = f"{source}|{stat.st_size}|{stat.st_mtime_ns}|limit={limit}|n={len(conversations)}"
        rows = tokenize_conversations(
            conversations, self.tokenizer, h.max_length, source_key, h.num_proc, h.cache_dir, h.chat_template_kwargs
        )
        dropped = len(conversations) - len(rows)
        log.info(
            "%d chats tokenized (max_length=%d); %d dropped: no trainable reply within max_length",
            len(rows),
            h.max_length,
            dropped,
        )
        self._log_source(source, conversations["regenerated_by"])
        return rows

    def _log_source(self, source: str, regenerated_by: list[str]) -> None:
        models = sorted(set(regenerated_by) - {""})
        if is_packaged_sharegpt(source):
            log.warning("training on the original replies; regenerate with `python -m dflash2.commands.regenerate`")
        elif models and all(regenerated_by):
            log.info("training on replies regenerated by %s", ", ".join(models))
        else:
            log.info(
                "training on the replies stored in %s (%d of %d records carry `regenerated_by`, which "
                "`python -m dflash2.commands.regenerate` writes)",
                source,
                sum(map(bool, regenerated_by)),
                len(regenerated_by),
            )

    def prepare_data(self) -> None:
        # Rank 0 fills the datasets cache; setup() on the other ranks then only reads it. Trainer.validate and
        # Trainer.fit each call this: the second call has nothing to do.
        if self._prepared is None and self.train_rows is None:
            self._prepared = self.rows()

    def setup(self, stage: str | None = None) -> None:
        if self.train_rows is not None:
            return
        h = self.hparams
        rows, extras = self._prepared if self._prepared is not None else self.rows()
        if self.features is not None:
            rows, extras = self.features.attach(rows, extras)
        val = max(1, round(h.val_size * len(rows))) if isinstance(h.val_size, float) else int(h.val_size)
        # The split is `path`'s alone, so adding training files leaves the validation chats as they were.
        self.train_rows, self.val_rows = split_by_id(rows, val, h.seed)
        if extras:
            held = set(self.val_rows["id"])
            extras = [e.select([i for i, rid in enumerate(e["id"]) if rid not in held]) for e in extras]
            self.train_rows = datasets.concatenate_datasets([self.train_rows, *extras])
        log.info("%d training and %d validation chats", len(self.train_rows), len(self.val_rows))

    def _loader(self, rows: datasets.Dataset, train: bool) -> StatefulDataLoader:
        """data.batch_size rows per batch on each rank: under DDP the global batch is their sum, and the ranks train
        the global batches one process of that batch size trains, rows and anchors alike (GlobalBatchSampler)."""
        h = self.hparams
        copy = self.copy if train else None
        data = AnchoredRows(rows, h.max_anchors, seed=h.seed, fresh=train, features=self.features, copy=copy)
        world, rank = (self.trainer.world_size, self.trainer.global_rank) if self.trainer is not None else (1, 0)
        # validation always sees every chat
        sampler = GlobalBatchSampler(data, world, rank, train, h.seed, h.batch_size, drop_last=train and h.drop_last)
        return StatefulDataLoader(
            data,
            batch_size=h.batch_size,
            sampler=sampler,
            collate_fn=self.collate,
            num_workers=h.num_workers,
            persistent_workers=h.num_workers > 0,
            # Pinned, the batch's copy to the GPU (non-blocking in Lightning) does not wait for the step before.
            pin_memory=self.trainer is not None and self.trainer.strategy.root_device.type == "cuda",
        )

    def train_dataloader(self) -> StatefulDataLoader:
        self._train_loader = self._loader(self.train_rows, train=True)
        if self._train_loader_state is not None:
            self._train_loader.load_state_dict(self._train_loader_state)
            self._train_loader_state = None
        return self._train_loader

    # A checkpoint holds where the training epoch stands (its order and the next batch), so a run resumed mid-epoch
    # continues with the next batch instead of replaying the epoch from its start. Lightning's fit loop keeps a copy
    # too, but skips it when the loader was built before the restore, as `estimated_stepping_batches` (the learning
    # rate schedule) makes it; the datamodule's state is restored before that.
    def state_dict(self) -> dict[str, Any]:
        return {} if self._train_loader is None else {"train_loader": self._train_loader.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._train_loader_state = state_dict.get("train_loader")

    def val_dataloader(self) -> StatefulDataLoader:
        return self._loader(self.val_rows, train=False)
