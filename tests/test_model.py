import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash2 import DFlash2Config, DFlash2DraftModel, DFlashGroupedConv, DraftCache
from dflash2.export.check import lint
from dflash2.model.selector import head_logits

FIXTURE = dict(  # the public DFlash2 fixture's dimensions
    hidden_size=6656,
    intermediate_size=17920,
    num_attention_heads=52,
    num_key_value_heads=4,
    head_dim=128,
    num_hidden_layers=5,
    num_target_layers=48,
    vocab_size=202048,
    mask_token_id=200000,
    block_size=16,
    target_layer_ids=[1, 12, 23, 34, 45],
    rope_theta=500000.0,
    conv_kernel_size=2,
    conv_group_size=16,
    selector_rank=256,
    selector_top_k=16,
)


def tiny_config(**over) -> DFlash2Config:
    base = dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_hidden_layers=2,
        num_target_layers=6,
        vocab_size=97,
        mask_token_id=96,
        block_size=4,
        target_layer_ids=[1, 3],
        rope_theta=10000.0,
        conv_kernel_size=3,
        conv_group_size=8,
        selector_rank=8,
        selector_top_k=4,
    )
    return DFlash2Config(**(base | over))


def randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def test_fixture_names_and_shapes_follow_the_contract_table():
    cfg = DFlash2Config(**FIXTURE)
    with torch.device("meta"):
        model = DFlash2DraftModel(cfg)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    # The contract's table, written out independently of tensor_shapes().
    h, hq, hkv, i, n, t, g, v, r = 6656, 52 * 128, 4 * 128, 17920, 5, 2, 6656 // 16, 202048, 256
    want = {
        "fc.weight": (h, n * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
        "candidate_selector.hidden_projection.weight": (r, h),
        "candidate_selector.predecessor_codebook": (v, r),
        "candidate_selector.successor_codebook": (v, r),
    }
    for layer in range(5):
        p = f"layers.{layer}."
        want |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (hq, h),
            p + "self_attn.k_proj.weight": (hkv, h),
            p + "self_attn.v_proj.weight": (hkv, h),
            p + "self_attn.o_proj.weight": (h, hq),
            p + "self_attn.q_norm.weight": (128,),
            p + "self_attn.k_norm.weight": (128,),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        for conv in ("attention_conv", "mlp_conv"):
            want |= {
                p + f"{conv}.base_kernel": (2, t, h),
                p + f"{conv}.kernel_projection.weight": (2 * t * g, h),
            }
    assert got == want
    d = cfg.to_dict()
    assert d["architectures"] == ["DFlash2DraftModel"] and d["is_causal"] is False
    assert d["dflash_config"]["target_layer_ids"] == FIXTURE["target_layer_ids"]
    assert DFlash2Config.from_dict(json.loads(json.dumps(d))) == cfg


def test_plain_dflash_declares_its_architecture_and_has_no_new_tensors():
    cfg = tiny_config(conv_kernel_size=0, conv_group_size=0, selector_rank=0, selector_top_k=0)
    names = DFlash2DraftModel(cfg).state_dict().keys()
    assert cfg.to_dict()["architectures"] == ["DFlashDraftModel"]
    assert not [n for n in names if "conv" in n or "selector" in n]


@pytest.mark.parametrize(
    "change, field",
    [
        (dict(conv_group_size=0), "conv_kernel_size/conv_group_size"),
        (dict(selector_top_k=0), "selector_rank/selector_top_k"),
        (dict(conv_group_size=5), "conv_group_size"),
        (dict(selector_top_k=6), "selector_top_k"),
        (dict(mask_token_id=97), "mask_token_id"),
        (dict(mask_token_id=None), "mask_token_id"),
        (dict(target_layer_ids=[1, 6]), "target_layer_ids"),
        (dict(block_size=1), "block_size"),
        (dict(output_multiplier=0.0), "output_multiplier"),
        (dict(layer_types=["full_attention", "sliding_attention"]), "sliding_window"),
    ],
)
def test_invalid_configs_name_the_field(change, field):
    with pytest.raises(ValueError, match=field.replace("/", ".")):
        tiny_config(**change)


def test_default_target_layer_ids_are_the_published_ones():
    cfg = tiny_config(num_target_layers=36, num_hidden_layers=5, target_layer_ids=None)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]


def test_save_load_round_trip_is_bit_exact(tmp_path):
    model = DFlash2DraftModel(tiny_config()).to(torch.bfloat16)
    randomise(model, 0)
    model.save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    assert "candidate_selector.predecessor_codebook" in stored
    loaded = DFlash2DraftModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def _corrupt(tmp_path, edit):
    model = DFlash2DraftModel(tiny_config())
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")


@pytest.mark.parametrize(
    "edit, name",
    [
        (
            lambda t: t.__setitem__(
                "candidate_selector.successor_codebook.weight", t.pop("candidate_selector.successor_codebook")
            ),
            "candidate_selector.successor_codebook.weight",
        ),
        (lambda t: t.pop("layers.1.mlp_conv.base_kernel"), "layers.1.mlp_conv.base_kernel"),
        (lambda t: t.__setitem__("fc.weight", t["fc.weight"][:, :-1].contiguous()), "fc.weight"),
        (lambda t: t.__setitem__("lm_head.weight", torch.zeros(97, 32)), "lm_head.weight"),
    ],
)
def test_loading_refuses_bad_tensors_by_name(tmp_path, edit, name):
    _corrupt(tmp_path, edit)
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        DFlash2DraftModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "stored, fix",
    [
        ("candidate_selector.successor_codebook.weight", "rename to candidate_selector.successor_codebook)"),
        ("model.candidate_selector.predecessor_codebook.weight", "rename to candidate_selector.predecessor_codebook)"),
        ("model.norm.weight", "rename to norm.weight)"),
        ("model.lm_head.weight", "drop it)"),
    ],
)
def test_loading_and_linting_diagnose_a_misnamed_tensor_alike(tmp_path, stored, fix):
    """A tensor under a common wrong name: the loader names the fix (the contract's name, or dropping the target's
    head), and the linter reports the same single fault."""
    fixed = stored.removeprefix("model.").removesuffix(".weight") if "codebook" in stored else stored[len("model.") :]

    def misname(t):
        t[stored] = t.pop(fixed) if fixed in t else torch.zeros(97, 32, dtype=torch.bfloat16)

    _corrupt(tmp_path, misname)
    with pytest.raises(ValueError, match=f"unexpected tensor {re.escape(stored)} .*{re.escape(fix)}"):
        DFlash2DraftModel.from_pretrained(tmp_path)
    report = lint(tmp_path)
    assert len(report.problems) == 1 and stored in report.problems[0], report.format()


def _inputs(cfg, seed, blocks=2, ctx_len=7, batch=2):
    g = torch.Generator().manual_seed(seed)
    q = blocks * cfg.block_size
    target_hidden = torch.randn(batch, ctx_len, len(cfg.target_layer_ids) * cfg.hidden_size, generator=g)
    embeds = torch.randn(batch, q, cfg.hidden_size, generator=g)
    positions = torch.arange(q).repeat(batch, 1) + ctx_len
    return target_hidden, embeds, positions, torch.arange(ctx_len).repeat(batch, 1)


def test_identity_init_proposes_exactly_what_plain_dflash_proposes(tmp_path):
    plain_cfg = tiny_config(conv_kernel_size=0, conv_group_size=0, selector_rank=0, selector_top_k=0)
    plain = DFlash2DraftModel(plain_cfg)
    randomise(plain, 1)
    plain.save_pretrained(tmp_path)
    warm = DFlash2DraftModel.from_pretrained(
        tmp_path, conv_kernel_size=3, conv_group_size=8, selector_rank=8, selector_top_k=4
    )
    plain = DFlash2DraftModel.from_pretrained(tmp_path)  # the same bf16-rounded weights on both sides
    assert warm.candidate_selector is not None and warm.layers[0].attention_conv is not None
    th, emb, pos, cpos = _inputs(plain_cfg, 2)
    with torch.no_grad():
        h_plain = plain(emb, pos, plain.fuse(th), cpos)
        h_warm = warm(emb, pos, warm.fuse(th), cpos)
    assert torch.equal(h_plain, h_warm)
    head = torch.randn(97, 32, generator=torch.Generator().manual_seed(3))
    b, bs = h_warm.shape[0], warm.config.block_size
    slots = h_warm.view(b, -1, bs, 32)[:, 0, 1:]  # the first block's proposing rows
    argmax = head_logits(slots, head, 97).argmax(-1)
    sel = warm.candidate_selector
    cand, unary = sel.compute_candidates(slots, head)
    scores = sel.build_lattice(cand, unary, slots, anchor_token_ids=torch.tensor([5, 6]))
    tokens, q = sel.walk(cand, scores, torch.rand(b, bs - 1), torch.zeros(b), torch.ones(b, dtype=torch.bool))
    assert torch.equal(tokens, argmax)


def test_conv_follows_the_contract_formula_position_by_position():
    torch.manual_seed(4)
    hidden, block, taps, group = 16, 5, 3, 4
    conv = DFlashGroupedConv(hidden, taps, group)
    randomise(conv, 5)
    x = torch.randn(3 * block, hidden)
    y, k1 = conv.prepare(x, block)
    z = torch.randn_like(x)
    out = conv.finish(z, k1, block)
    d = conv.kernel_projection(x).view(-1, 2, taps, hidden // group)
    for side, src, got in ((0, x, y), (1, z, out)):
        for n in range(x.shape[0]):
            for c in range(hidden):
                acc = sum(
                    (conv.base_kernel[side, t, c] + d[n, side, t, c // group]) * src[n - t, c]
                    for t in range(taps)
                    if n % block - t >= 0
                )
                torch.testing.assert_close(got[n, c], acc, rtol=1e-5, atol=1e-5)


def test_the_block_size_of_a_call_moves_the_block_boundaries_and_changes_nothing_else():
    model = DFlash2DraftModel(tiny_config(block_size=4))
    randomise(model, 6)
    th, emb, pos, cpos = _inputs(model.config, 7, blocks=2)
    with torch.no_grad():
        a = model(emb, pos, model.fuse(th), cpos)
        b = model(emb, pos, model.fuse(th), cpos, block_size=8)
        again = model(emb, pos, model.fuse(th), cpos, block_size=4)
    assert model.config.block_size == 4  # the call's B is not stored anywhere
    torch.testing.assert_close(again, a, rtol=0, atol=0)
    # Slots 4..7 are a new block's first slots at B=4 but reach back to slots 0..3 at B=8.
    assert not torch.allclose(a[:, 4:], b[:, 4:])
    with pytest.raises(ValueError, match="whole number of blocks of 3"):
        model(emb, pos, model.fuse(th), cpos, block_size=3)


def test_cached_context_equals_one_shot_context():
    model = DFlash2DraftModel(tiny_config())
    randomise(model, 8)
    th, emb, pos, cpos = _inputs(model.config, 9, blocks=1, ctx_len=9)
    with torch.no_grad():
        ctx = model.fuse(th)
        full = model(emb, pos, ctx, cpos)
        cache = DraftCache(model.config.num_hidden_layers)
        model(emb, pos, ctx[:, :5], cpos[:, :5], cache=cache)  # a first step fills the cache
        stepped = model(emb, pos, ctx[:, 5:], cpos[:, 5:], cache=cache)
    assert cache.length == 9
    torch.testing.assert_close(stepped, full, rtol=1e-5, atol=1e-5)


def test_masked_context_is_invisible_and_blocks_are_bidirectional():
    model = DFlash2DraftModel(tiny_config())
    randomise(model, 10)
    th, emb, pos, cpos = _inputs(model.config, 11, blocks=1, ctx_len=6)
    keys = 6 + model.config.block_size
    mask = torch.ones(2, 1, model.config.block_size, keys, dtype=torch.bool)
    mask[:, :, :, 4:6] = False  # the last two context tokens are hidden
    with torch.no_grad():
        a = model(emb, pos, model.fuse(th), cpos, attention_mask=mask)
        th2 = th.clone()
        th2[:, 4:] += 1.0
        b = model(emb, pos, model.fuse(th2), cpos, attention_mask=mask)
        emb2 = emb.clone()
        emb2[:, -1] += 1.0  # the last slot changes the first one: attention inside a block is bidirectional
        c = model(emb2, pos, model.fuse(th), cpos, attention_mask=mask)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a[:, 0], c[:, 0])
