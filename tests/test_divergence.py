"""The divergence report (dflash2/evaluation/divergence.py): both passes record each greedy choice's margin, and a reply
that leaves the target alone's is a near-tie only where both margins lie within the logits' rounding."""

import json
import random

import pytest
import torch
from test_evaluation import config, export_draft, read_run
from test_lookup import repeating_prompts

from dflash2.commands.evaluate import evaluate
from dflash2.decoding import speculative as spec
from dflash2.decoding import static as fast
from dflash2.decoding.lookup import PromptLookup
from dflash2.evaluation.divergence import divergences, first_difference, rounding
from dflash2.evaluation.report import divergence_line
from dflash2.testing import tiny_target


def reply(ids, margins, id_="a"):
    return {"id": id_, "turn": 0, "output_ids": ids, "margins": margins}


def test_rounding_is_the_dtypes_spacing_at_the_logits_scale():
    assert rounding(20.0, torch.bfloat16) == 2**-7 * 16  # 20 lies in [16, 32): bf16 steps of 1/8 there
    assert rounding(-3.0, torch.bfloat16) == 2**-7 * 2
    assert rounding(20.0, torch.float32) == 2**-23 * 16
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1 and first_difference([1, 2], [1, 2, 4]) == 2


def test_a_planted_near_tie_and_a_planted_clear_margin():
    tie = [(1.0, 20.0), (0.5, 21.0), (0.0, 19.5)]  # at token 2 the top two logits were equal in bf16
    clear = [(1.0, 20.0), (0.5, 21.0), (2.0, 19.5)]  # at token 2 the choice was by 2.0, sixteen bf16 steps
    speculative = [reply([5, 6, 7], tie, "tie"), reply([5, 6, 7], clear, "bug"), reply([5, 6], tie[:2], "same")]
    alone = [reply([5, 6, 9], tie, "tie"), reply([5, 6, 9], clear, "bug"), reply([5, 6], tie[:2], "same")]
    found = divergences(speculative, alone, torch.bfloat16)
    assert found["replies"] == 3 and found["differing"] == 2 and found["near_ties"] == 1
    (bug,) = found["not_near_ties"]
    assert bug["id"] == "bug" and bug["position"] == 2 and bug["margin_speculative"] == 2.0
    assert bug["rounding"] == 0.125
    line = divergence_line(found)
    assert "2 of 3 greedy replies differ" in line and "1 at a near-tie" in line and "NOT near-ties" in line
    assert "bug turn 0 at token 2" in line
    # In float32 the same margin of 0.0 is still a tie; 1e-3 is not (the spacing at 19.5 is 2e-6).
    near = [(1.0, 20.0), (0.5, 21.0), (1e-3, 19.5)]
    assert divergences([reply([5, 6, 7], near)], [reply([5, 6, 9], near)], torch.float32)["near_ties"] == 0


@pytest.mark.parametrize("path", ["plain", "static"])
def test_both_decoders_record_the_margin_each_greedy_token_was_chosen_by(path):
    """Each recorded (margin, top logit) is the one a fresh forward of the committed text gives at that token."""
    tiny = tiny_target(target_layer_ids=[1, 2])
    seed = random.randrange(10_000)
    print(f"seed {seed}")
    prompts = repeating_prompts(seed, 3, tiny.vocab_size)
    sampling = spec.Sampling(batch_size=2, record_margins=True)
    module = spec if path == "plain" else fast
    runs = [module.speculative_generate(tiny, PromptLookup(), prompts, 4, 12, sampling)]
    runs.append(module.target_generate(tiny, prompts, 12, sampling))
    for run in runs:
        for prompt, out in zip(prompts, run, strict=True):
            assert len(out.margins) == len(out.output_ids)
            with torch.no_grad():
                logits = tiny.forward(torch.tensor([prompt + out.output_ids])).logits[0, len(prompt) - 1 : -1]
            top = logits.float().topk(2, -1).values
            expected = torch.stack([top[:, 0] - top[:, 1], top[:, 0]], -1)
            torch.testing.assert_close(torch.tensor(out.margins), expected, rtol=1e-4, atol=1e-4)
    assert spec.speculative_generate(tiny, PromptLookup(), prompts, 4, 6, spec.Sampling())[0].margins == []


def test_an_evaluation_beside_the_target_alone_reports_its_divergences(tmp_path):
    draft = export_draft(tiny_target(), tmp_path / "draft")
    cfg = config(f"drafter={draft}", "bench.limit=2", "max_new_tokens=8", "baseline=true")
    results = evaluate(cfg, tmp_path / "run")
    found = results["baseline"]["divergences"]
    assert found["replies"] == 2 and found["differing"] == 0 and found["dtype"] == "float32"
    _, samples = read_run(tmp_path / "run")
    assert "margins" not in samples[0]  # in memory for the report only
    sampled = evaluate(config(f"drafter={draft}", "bench.limit=1", "max_new_tokens=4", "baseline=true",
                              "temperature=1"), tmp_path / "t1")  # fmt: skip
    assert "divergences" not in sampled["baseline"]  # sampled replies differ by design
    assert json.loads((tmp_path / "t1" / "results.json").read_text())["baseline"]["speedup"] > 0
