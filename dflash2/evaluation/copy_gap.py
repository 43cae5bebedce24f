"""The copy gap: where a drafter loses to prompt lookup, read from a greedy run's samples.

At T = 0 the output is the target's greedy text whatever proposes, so every step of a drafter's run can be replayed: its
committed tokens are the prompt and the output up to the step's anchor, and prompt lookup (`dflash2.decoding.lookup`)
proposes from them; the lookup's accept length there is 1 + the proposals that match the output that follows. A step is
"copyable" when that lookup would have had at least one proposal accepted. A drafter that uses its context accepts about
as much as the lookup where the text repeats itself; where it accepts less, it loses to a rule that needs no training.
`evaluate.py` reports the gap of each greedy drafter run (results.json's `copy_gap`); `benchmarks/copy_gap.py` replays
the samples of sweeps measured before it did.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from dflash2.decoding.lookup import PromptLookup


def replayable(draft: Mapping[str, Any], temperature: float) -> bool:
    """Whether a run has a copy gap: a drafter's greedy run. At T > 0 the output depends on what was proposed, and
    prompt lookup's own run is the replay itself, as are the lookup steps of a hybrid run. `draft` is results.json's
    `draft` entry."""
    return draft["architecture"] != "PromptLookup" and not draft.get("hybrid") and temperature == 0


def lookup_accepts(
    prompt_ids: list[int], output_ids: list[int], accept_lengths: list[int], block_size: int, lookup: PromptLookup
) -> list[int]:
    """Prompt lookup's accept length at each of a run's steps: step i anchors at output[pos_i] (output[0] comes from
    the prefill, pos_0 = 0, pos_i+1 = pos_i + accept_lengths[i]) and commits what follows, up to the output's end."""
    if not accept_lengths:
        return []
    output = torch.tensor(output_ids, dtype=torch.long)
    steps = torch.tensor(accept_lengths, dtype=torch.long)
    starts = steps.cumsum(0) - steps  # each step's anchor, as an index into the output
    text = torch.cat([torch.tensor(prompt_ids, dtype=torch.long), output])
    committed = len(prompt_ids) + starts + 1  # the tokens each step proposes from, the anchor last
    # One row per step, each holding the whole text: the lookup reads only the first `committed[i]` tokens of row i.
    proposals = lookup.lookup(text.expand(len(starts), -1), committed, block_size)  # [steps, B - 1]
    follows = starts[:, None] + 1 + torch.arange(block_size - 1)  # where each proposal would stand in the output
    matches = (proposals == output[follows.clamp(max=len(output) - 1)]) & (follows < len(output))
    accepted = matches.long().cumprod(-1).sum(-1)  # the verify accepts proposals up to the first mismatch
    # The bonus token: the target's next one after the last accepted proposal, unless the output ended there.
    return torch.minimum(1 + accepted, len(output) - 1 - starts).tolist()


def _mean(values: list[int]) -> float | None:
    return sum(values) / len(values) if values else None


def copy_gap(
    samples: Iterable[Mapping[str, Any]], block_size: int, lookup: PromptLookup | None = None
) -> dict[str, Any]:
    """results.json's `copy_gap` of a greedy run from its samples (each with `prompt_ids`, `output_ids` and the
    drafter's `accept_lengths`): the steps, the share that lookup would have copied, the drafter's tau on those
    and on the others, and lookup's tau on those. `lookup`: by default the one `drafter=pld` uses with its default
    settings (configs/evaluate.yaml, group `pld`) at `block_size`; its settings are recorded under `lookup`."""
    lookup = PromptLookup() if lookup is None else lookup
    drafter, looked = [], []
    for s in samples:
        drafter += s["accept_lengths"]
        looked += lookup_accepts(s["prompt_ids"], s["output_ids"], s["accept_lengths"], block_size, lookup)
    copyable = [i for i, n in enumerate(looked) if n > 1]
    other = [i for i, n in enumerate(looked) if n == 1]
    return {
        "steps": len(drafter),
        "copyable_share": len(copyable) / len(drafter) if drafter else 0.0,
        "tau_copyable": _mean([drafter[i] for i in copyable]),
        "tau_other": _mean([drafter[i] for i in other]),
        "lookup_tau_copyable": _mean([looked[i] for i in copyable]),
        "lookup": lookup.settings(block_size),
    }
