"""What a training step draws: token rows whose anchors are drawn at fetch time (`AnchoredRows`), and each rank's
share of the rows' order (`GlobalBatchSampler`, whose `Draw`s `AnchoredRows` fetches)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import datasets
import torch
from torch.utils.data import Dataset, DistributedSampler

from dflash2.data.anchors import CopyAnchors, sample_anchors
from dflash2.data.feature_store import FeatureStore, truncate


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
