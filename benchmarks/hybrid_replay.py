"""What the hybrid proposer (dflash2/decoding/hybrid.py) accepts under each rule, replayed from greedy runs' text.

    python benchmarks/hybrid_replay.py RUN_DIR [RUN_DIR ...] [--drafter EXPORT] [--out FILE]

At T = 0 the output is the target's greedy text whatever proposes, so what any proposer would commit at any anchor of
a run's text is fixed by the text: prompt lookup's accept length there comes from the text alone
(`PromptLookup.matched_lengths`), and the drafter's from one drafter forward over the target's features of the tokens
before the anchor, as decoding computes it (`--drafter`). Walking the text from the first output token, each step
taking what its rule says, gives every rule's tau without decoding again; also the better of the two at every step
(what verifying both blocks in one target pass would commit), the drafter alone and lookup alone. The drafter alone's
walk must give the run's own accept lengths where the run decoded with that drafter (`drafter_matches_run`).

Without `--drafter` (a run whose drafter is not at hand), an estimate: the same walk, with the drafter's accept length
at an anchor taken from the run's step whose block covers it (`estimate` in the output; the full replay reports it too,
to compare the two).

Each RUN_DIR holds an evaluate.py run at T = 0 (results.json and samples.jsonl, or samples.jsonl.gz).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import itertools
import json
from pathlib import Path
from typing import Any

import torch

from dflash2.decoding.distributions import propose
from dflash2.decoding.drafting import draft_forward
from dflash2.decoding.hybrid import NgramRule
from dflash2.decoding.lookup import PromptLookup
from dflash2.model.drafter import DFlash2DraftModel, DraftCache

ROOT = Path(__file__).resolve().parents[1]
MIN_NGRAMS, MIN_TOKENS = (1, 2, 3), (1, 2, 4, 8, 12, 15)
ANCHORS_PER_FORWARD = 32


def read_run(run_dir: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    results = json.loads((run_dir / "results.json").read_text())
    plain, packed = run_dir / "samples.jsonl", run_dir / "samples.jsonl.gz"
    text = plain.read_text() if plain.is_file() else gzip.decompress(packed.read_bytes()).decode()
    return results, [json.loads(line) for line in text.splitlines()]


class Text:
    """One request's text (prompt, then output) with what lookup finds at every anchor."""

    def __init__(self, sample: dict[str, Any], block_size: int, lookup: PromptLookup) -> None:
        self.prompt, self.output = len(sample["prompt_ids"]), len(sample["output_ids"])
        self.tokens = torch.tensor(sample["prompt_ids"] + sample["output_ids"])
        self.block_size, self.run_steps = block_size, sample["accept_lengths"]
        self.follow, self.ngram = lookup.matches(self.tokens)
        committed = torch.arange(1, len(self.tokens) + 1)
        self.available = lookup.available(committed, self.follow, block_size)
        self.lookup = 1 + lookup.matched_lengths(self.tokens, block_size)
        self.drafter: torch.Tensor | None = None  # accept length at every anchor, `drafter_accepts`

    def anchors(self) -> range:
        """The text indices a verify step can anchor at: each output token but the last."""
        return range(self.prompt, self.prompt + self.output - 1)

    def walk(self, accept: Any) -> list[int]:
        """The steps of decoding this text when the step anchored at index a commits accept(a) tokens."""
        a, end, steps = self.prompt, self.prompt + self.output - 1, []
        while a < end:
            n = min(int(accept(a)), end - a)
            steps.append(n)
            a += n
        return steps

    def takes_lookup(self, a: int, rule: NgramRule) -> bool:
        return bool(rule.takes(self.ngram[a], self.available[a], self.block_size - 1))

    def run_anchors(self) -> list[int]:
        """The anchors of the run's own steps."""
        return [self.prompt + s for s in itertools.accumulate([0, *self.run_steps[:-1]])] if self.run_steps else []


@torch.no_grad()
def drafter_accepts(text: Text, target: Any, draft: DFlash2DraftModel, use_selector: bool) -> torch.Tensor:
    """The drafter's accept length at every anchor of the text [len(tokens)] (0 outside `anchors`): its proposals
    from the target's features of the tokens before the anchor, checked against the text that follows."""
    tokens, block = text.tokens, text.block_size
    features = target.forward(tokens[None]).hidden  # [1, L, n*H], every position's
    accepts = torch.zeros(len(tokens), dtype=torch.long)
    length = len(tokens)
    anchors = torch.tensor(text.anchors())
    for a in anchors.split(ANCHORS_PER_FORWARD):
        rows = len(a)
        positions = torch.arange(length).expand(rows, -1)
        key_mask = (positions < a[:, None]).long()  # the context: every token before the anchor
        block_ids = torch.full((rows, block), draft.config.mask_token_id)
        block_ids[:, 0] = tokens[a]
        block_positions = a[:, None] + torch.arange(block)
        hidden = draft_forward(
            draft,
            target.embed_tokens(block_ids),
            block_positions,
            features.expand(rows, -1, -1),
            positions,
            key_mask,
            a,
            positions,
            DraftCache(draft.config.num_hidden_layers),
        )
        head = target.lm_head_weight
        generator = torch.Generator().manual_seed(0)  # unused at T = 0
        proposals, _ = propose(draft, head, hidden[:, 1:], tokens[a], 0.0, use_selector, head.shape[0], generator)
        follows = (a[:, None] + 1 + torch.arange(block - 1)).clamp(max=length - 1)
        right = (proposals == tokens[follows]) & (a[:, None] + 1 + torch.arange(block - 1) < length)
        accepts[a] = 1 + right.long().cumprod(-1).sum(-1)
    return accepts


def tau(steps: list[int]) -> float | None:
    return sum(steps) / len(steps) if steps else None


def replay(texts: list[Text]) -> dict[str, Any]:
    """Every policy's tau over the texts: lookup alone, and with the drafter's accepts, the drafter alone, each rule,
    the better of the two at every step; each rule's estimate from the run's own steps."""
    out: dict[str, Any] = {"lookup_alone": tau([n for t in texts for n in t.walk(lambda a, t=t: t.lookup[a])])}
    rules = [NgramRule(m, k) for m in MIN_NGRAMS for k in MIN_TOKENS]
    out["estimate"] = {f"min_ngram={r.min_ngram} min_tokens={r.min_tokens}": estimate(texts, r) for r in rules}
    if texts[0].drafter is None:
        return out
    out["drafter_alone"] = tau([n for t in texts for n in t.walk(lambda a, t=t: t.drafter[a])])
    out["drafter_matches_run"] = sum(t.walk(lambda a, t=t: t.drafter[a]) == t.run_steps for t in texts) / len(texts)
    out["better_of_two"] = tau([n for t in texts for n in t.walk(lambda a, t=t: max(t.drafter[a], t.lookup[a]))])
    out["rules"] = {}
    for r in rules:
        taken, steps = [], []
        for t in texts:
            picks = []

            def accept(a: int, t: Text = t, picks: list = picks, r: NgramRule = r) -> int:
                picks.append(t.takes_lookup(a, r))
                return t.lookup[a] if picks[-1] else t.drafter[a]

            steps += t.walk(accept)
            taken += picks
        out["rules"][f"min_ngram={r.min_ngram} min_tokens={r.min_tokens}"] = {
            "tau": tau(steps),
            "lookup_share": sum(taken) / len(taken) if taken else None,
        }
    return out


def estimate(texts: list[Text], rule: NgramRule) -> float | None:
    """The walk with the drafter's accept length at an anchor guessed from the run: that of the run's step whose
    block covers the anchor (the drafter taken to do as well nearby as where it ran)."""
    steps = []
    for t in texts:
        anchors = t.run_anchors()

        def accept(a: int, t: Text = t, anchors: list[int] = anchors) -> int:
            if t.takes_lookup(a, rule):
                return int(t.lookup[a])
            return t.run_steps[bisect.bisect_right(anchors, a) - 1]

        steps += t.walk(accept)
    return tau(steps)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+", help="evaluate.py run folders at T = 0")
    parser.add_argument("--drafter", type=Path, help="the export the runs decoded with: replay it at every anchor")
    parser.add_argument("--out", type=Path, help="where the JSON goes (default: print only)")
    args = parser.parse_args(argv)
    target = draft = None
    if args.drafter is not None:
        import yaml

        from dflash2.commands import build
        from dflash2.model.config import DFlash2Config

        layers = list(DFlash2Config.from_pretrained(args.drafter).target_layer_ids)
        model = yaml.safe_load((ROOT / "configs" / "model" / "smollm2.yaml").read_text())  # the runs' target
        target = build(model | {"dtype": "float32", "target_layer_ids": layers})
        draft = DFlash2DraftModel.from_pretrained(args.drafter).eval()
    lookup, report = PromptLookup(), {"rules": "lookup takes the block where hybrid_rule passes", "benches": {}}
    for run_dir in args.runs:
        results, samples = read_run(run_dir)
        if results["temperature"] != 0:
            raise SystemExit(f"{run_dir}: a run at T={results['temperature']}; the replay needs greedy text (T=0)")
        texts = [Text(s, results["block_size"], lookup) for s in samples]
        if draft is not None:
            use_selector = bool(results["draft"].get("selector")) and draft.candidate_selector is not None
            for t in texts:
                t.drafter = drafter_accepts(t, target, draft, use_selector)
        report["benches"][results["bench"]] = {"run": str(run_dir), "run_tau": results["tau"]} | replay(texts)
        print(json.dumps({results["bench"]: report["benches"][results["bench"]]}, indent=1)[:2000])
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
