"""DFlashDataModule: chats -> cached token rows -> batches of anchored blocks (contract section 7)."""

from __future__ import annotations

import logging
import math
import os
from typing import Any, NamedTuple

import datasets
import lightning as L
import torch
from torch.utils.data import Dataset, DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from dflash2.data.anchors import (
    IGNORE,
    CopyAnchors,
    block_ids,
    block_labels,
    block_positions,
    check_copy_anchors,
    sample_anchors,
)
from dflash2.data.chat import (
    _same_file,
    load_conversations,
    regenerated_with,
    sharegpt_path,
    tokenize_conversations,
)
from dflash2.data.feature_store import FeatureStore, pad_features, truncate
from dflash2.model.contract import check_block_size
from dflash2.target.chat_template import KWARGS_KEY, check_chat_template_kwargs, format_kwargs, one_setting, same_kwargs

log = logging.getLogger(__name__)


class Draw(NamedTuple):
    """What `GlobalBatchSampler` yields: a row, the epoch its anchors are drawn for, and whether it only pads a
    rank's share (its blocks are then not trained nor scored)."""

    row: int
    epoch: int = 0
    padding: bool = False


class AnchoredRows(Dataset):
    """Token rows whose anchors are drawn at fetch time from (`seed`, row), fixed ones per row for validation (so
    validation metrics are comparable across steps); with `fresh`, from (`seed`, epoch, row) too: new ones every
    epoch, the same whichever rank or dataloader worker fetches the row. An int index is a `Draw` of epoch 0; with
    `seed=None` its anchors come from torch's global RNG. With `features` (data.features) each row carries the
    target's cached features. With `copy` (data.copy_anchor_weight) the anchors are drawn by its weights of the row's
    positions, computed from the row as fetched: cut to its cached positions or whole, the same weights, as no token
    after the last trained one counts in them."""

    def __init__(
        self,
        rows: datasets.Dataset,
        max_anchors: int,
        seed: int | None,
        fresh: bool = False,
        features: FeatureStore | None = None,
        copy: CopyAnchors | None = None,
    ):
        columns = ["input_ids", "loss_mask"] + ([] if features is None else ["feature_row"])
        self.rows = rows.with_format("torch", columns=columns)
        self.max_anchors, self.seed, self.fresh, self.features = max_anchors, seed, fresh, features
        self.copy = copy

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int | Draw) -> dict[str, Any]:
        draw = Draw(*index) if isinstance(index, tuple) else Draw(int(index))
        row = self.rows[draw.row]
        cached = {} if self.features is None else self.features.row(int(row["feature_row"]))
        row = truncate(row, cached) if cached else row  # data.features: the positions up to the last trained token
        generator = None
        if self.seed is not None:
            key = self.seed * 1_000_003 + draw.row
            generator = torch.Generator().manual_seed(key * 1_009 + draw.epoch + 1 if self.fresh else key)
        weights = None if self.copy is None else self.copy(row["input_ids"], row["loss_mask"])
        anchors = sample_anchors(row["loss_mask"], self.max_anchors, generator, weights)
        return {
            "input_ids": row["input_ids"].long(),
            "loss_mask": row["loss_mask"].long(),
            "anchors": anchors,
            **cached,
            "padding": draw.padding,
        }


class GlobalBatchSampler(DistributedSampler):
    """This rank's share of an order of the rows that does not depend on the number of ranks, so that N ranks of
    `batch_size` rows each train the global batches of N * batch_size rows that one process of that batch size
    trains: rank r takes rows r, r + N, r + 2N, ... of each. The order is the rows' own, or with `shuffle` a
    permutation drawn from (seed, epoch); with `drop_last` it is cut to whole global batches. It is padded to a
    multiple of N with padding draws (`Draw.padding`), which the collator gives no trained block: unlike
    DistributedSampler's repeated rows, no row counts twice in a loss or a metric.

    A DistributedSampler, so that Lightning keeps it instead of injecting its own; stateful, so that a run resumed
    mid-epoch continues the epoch's order (StatefulDataLoader saves where the epoch stands)."""

    def __init__(self, data: Dataset, num_replicas: int, rank: int, shuffle: bool, seed: int, batch_size: int = 1,
                 drop_last: bool = False) -> None:  # fmt: skip
        super().__init__(data, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        rows = len(data)
        self.rows = rows - rows % (num_replicas * batch_size) if drop_last else rows
        self.num_samples = math.ceil(self.rows / num_replicas)
        self.total_size = self.num_samples * num_replicas
        self.yielded, self.next_yielded = 0, 0

    def __iter__(self):
        n = len(self.dataset)
        order = list(range(n))
        if self.shuffle:
            order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        draws = [Draw(i, self.epoch) for i in order[: self.rows]]
        draws += [Draw(order[0], self.epoch, padding=True)] * (self.total_size - self.rows)
        self.yielded, self.next_yielded = self.next_yielded, 0
        for draw in draws[self.rank :: self.num_replicas][self.yielded :]:
            self.yielded += 1
            yield draw

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_yielded, self.epoch = state["yielded"], state["epoch"]


def batch_rows(batch: dict[str, torch.Tensor]) -> int:
    """Sequences in a collated batch (Lightning's ThroughputMonitor `batch_size_fn`)."""
    return batch["input_ids"].shape[0]


def trained_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Block slots with a label, i.e. the tokens a step trains on (ThroughputMonitor's `length_fn`)."""
    return int((batch["labels"] != IGNORE).sum())


class BlockCollator:
    """Right-pads rows and anchors and builds the block inputs, positions and labels of every anchor.

    `pad_to_multiple_of` rounds each batch's row length up to a multiple of it, and its block slots (anchors times B,
    in whole blocks) up to one too where B divides it: fewer distinct shapes, so the per-shape work on a GPU (cuDNN's
    attention plans, one for every new length) is done a few dozen times instead of once per batch, and flex
    attention's 128-wide tiles line up with the context's end and with the blocks. Right padding is what lets the
    target run without an attention mask (DFlash2Module.target_pass)."""

    def __init__(self, block_size: int, mask_token_id: int, pad_token_id: int = 0, pad_to_multiple_of: int = 1):
        check_pad_to_multiple_of(pad_to_multiple_of)
        self.block_size, self.mask_token_id, self.pad_token_id = block_size, mask_token_id, pad_token_id
        self.length_multiple = pad_to_multiple_of
        self.block_multiple = max(1, pad_to_multiple_of // block_size)

    def __call__(self, rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        length = _round_up(max(len(r["input_ids"]) for r in rows), self.length_multiple)
        blocks = _round_up(max(len(r["anchors"]) for r in rows), self.block_multiple)
        input_ids = _right_pad([r["input_ids"] for r in rows], length, self.pad_token_id)
        loss_mask = _right_pad([r["loss_mask"] for r in rows], length)
        attention_mask = _right_pad([torch.ones_like(r["input_ids"]) for r in rows], length)
        anchors = _right_pad([r["anchors"] for r in rows], blocks)
        anchor_valid = [torch.full_like(r["anchors"], not r.get("padding"), dtype=torch.bool) for r in rows]
        anchor_valid = _right_pad(anchor_valid, blocks)
        cached = pad_features(rows, length) if "features" in rows[0] else {}  # data.features
        return {
            **cached,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "anchors": anchors,
            "anchor_valid": anchor_valid,
            "block_ids": block_ids(input_ids, anchors, self.block_size, self.mask_token_id, anchor_valid),
            "block_positions": block_positions(anchors, self.block_size),
            "labels": block_labels(input_ids, loss_mask, anchors, self.block_size, anchor_valid),
        }


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


def check_pad_to_multiple_of(value: object) -> None:
    """`data.pad_to_multiple_of` must be an integer >= 1 (1 = no rounding)."""
    if not isinstance(value, int) or value < 1:
        raise ValueError(
            f"data.pad_to_multiple_of={value}: the multiple a batch's length is rounded up to must be an integer >= 1 "
            "(1 = no rounding; 128 on a GPU)"
        )


def check_drop_last(value: object) -> None:
    """`data.drop_last` must be a bool: whether each epoch's last, short training batch is dropped."""
    if not isinstance(value, bool):
        raise ValueError(f"data.drop_last={value!r}: set it to true or false")


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


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _right_pad(rows: list[torch.Tensor], length: int, value: int = 0) -> torch.Tensor:
    """[len_i] rows -> [rows, length], each padded on the right with `value`."""
    return torch.stack([torch.nn.functional.pad(r, (0, length - len(r)), value=value) for r in rows])


class DFlashDataModule(L.LightningDataModule):
    """Chats rendered with the target's template (`path=None`: the embedded ShareGPT), split once into train and
    validation rows; batches carry anchors and blocks, the attention mask is built on the model's device.

    `chat_template_kwargs`: the template's extra arguments (`resolve_chat_template_kwargs`; null = as the data was
    regenerated). The ones rendered with replace it in `hparams`, which every checkpoint keeps and the export's
    manifest takes: evaluation then renders its prompts as training rendered the chats."""

    def __init__(
        self,
        tokenizer: Any,
        block_size: int,
        mask_token_id: int,
        path: str | None = None,
        limit: int | None = None,
        max_length: int = 3072,
        max_anchors: int = 512,
        val_size: int | float = 0.05,
        batch_size: int = 1,
        num_workers: int = 0,
        num_proc: int | None = None,
        seed: int = 0,
        cache_dir: str | None = None,
        name: str | None = None,
        pad_to_multiple_of: int = 1,
        drop_last: bool = False,
        extra_paths: list[str] | tuple[str, ...] = (),
        features: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        copy_anchor_weight: float = 1.0,
        copy_anchor_min_match: int = 1,
    ):
        super().__init__()
        check_block_size(block_size)
        check_copy_anchors(copy_anchor_weight, copy_anchor_min_match, block_size)
        chat_template_kwargs = check_chat_template_kwargs(chat_template_kwargs, f"data.{KWARGS_KEY}")
        if not 0 <= mask_token_id < len(tokenizer):
            raise ValueError(f"mask_token_id={mask_token_id} is outside the tokenizer's {len(tokenizer)} ids")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the target's tokenizer has no chat template; use an instruct/chat target or set "
                "tokenizer.chat_template before building the data"
            )
        check_drop_last(drop_last)
        if max_length < 2 or max_anchors < 1:
            raise ValueError(f"max_length={max_length} must be >= 2 and max_anchors={max_anchors} >= 1")
        self.save_hyperparameters(ignore=["tokenizer"])
        self.tokenizer = tokenizer
        self.features = None if features is None else FeatureStore(features)  # the target's, cached
        # Training anchors only: validation keeps drawing every position alike, so its metrics compare across runs.
        self.copy = (
            None if copy_anchor_weight == 1 else CopyAnchors(copy_anchor_weight, block_size, copy_anchor_min_match)
        )
        self.collate = BlockCollator(block_size, mask_token_id, tokenizer.pad_token_id or 0, pad_to_multiple_of)
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
        if _same_file(source, sharegpt_path):
            log.warning("training on the original replies; regenerate with `python -m dflash2.data.regenerate`")
        elif models and all(regenerated_by):
            log.info("training on replies regenerated by %s", ", ".join(models))
        else:
            log.info(
                "training on the replies stored in %s (%d of %d records carry `regenerated_by`, which "
                "`python -m dflash2.data.regenerate` writes)",
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
