"""The feature cache on the tiny target: what it stores, that a step from it is the online step within the storage's
rounding, that a cache of other settings is refused by name, and that training and its resume run from it.

Bounds, from the formats: bf16 keeps 8 significant bits, so a stored value is within u = 2^-8 of the exact one,
relatively; fp8 e4m3 keeps 4 (3 stored), so u = 2^-4, down to its smallest normal 2^-6, below which its subnormals
are spaced 2^-9 (half a step: 2^-10). With the scale s = amax/448 of each token's layer, a value x comes back within
    eps(x) = u |x|                        (bf16)
    eps(x) = 2^-4 |x| + 2^-10 s           (fp8)
plus the float32 noise of the target running the rows in other batches (1e-5 of the layer's RMS, allowed for).
The loss moves, to first order, by sum_i dL/dx_i * delta_i, so |dL| <= B = sum_i |dL/dx_i| eps(x_i); the test allows
2 B for the higher orders. The gradient has no such closed bound: its change is compared with the change that
perturbing every feature by +-eps(x_i) with random signs causes (rounding errors are at most that and not aligned with
the gradient): within 2x of it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from training_setup import config

from dflash2.commands import train_checks as checks
from dflash2.commands.features import run as features_command
from dflash2.commands.train import run as train
from dflash2.commands.train_groups import build_data, target_and_draft
from dflash2.data import feature_store as fs
from dflash2.data import features as fc
from dflash2.training.module import DFlash2Module


@pytest.fixture(scope="module")
def setup(chats: Path, tmp_path_factory: pytest.TempPathFactory):
    """The run's config, target, draft config, tokenized rows and a bf16 and an fp8 cache of them."""
    root = tmp_path_factory.mktemp("features")
    cfg = config(chats, root / "run")
    target, draft = target_and_draft(cfg)
    rows = build_data(cfg, target, draft).rows()[0]
    fields = fs.binding(cfg.model, cfg.data, list(draft.target_layer_ids))
    caches = {}
    for dtype in fs.DTYPES:
        caches[dtype] = root / dtype
        fc.write_features(target, rows, caches[dtype], fields, dtype=dtype, batch_size=3, shard_rows=8)
    return cfg, target, draft, rows, caches


def eps_of(x: torch.Tensor, dtype: str, layers: int) -> torch.Tensor:
    """The format's bound on |stored - x| per value, [..., n*H] (see the module's docstring)."""
    if dtype == "bf16":
        return 2.0**-8 * x.abs()
    per_layer = x.unflatten(-1, (layers, -1))
    scale = per_layer.abs().amax(-1, keepdim=True) / fs.FP8_MAX
    return (2.0**-4 * per_layer.abs() + 2.0**-10 * scale).flatten(-2)


@pytest.mark.parametrize("dtype", fs.DTYPES)
def test_cache_holds_each_rows_features_to_its_last_trained_token_within_the_formats_rounding(setup, dtype):
    cfg, target, draft, rows, caches = setup
    store = fs.FeatureStore(caches[dtype])
    layers = len(draft.target_layer_ids)
    assert len(store) == len(rows) and store.manifest["target_layer_ids"] == list(draft.target_layer_ids)
    worst, sq, norm = 0.0, 0.0, 0.0
    for i in random.sample(range(len(rows)), 6):
        mask = torch.tensor(rows[i]["loss_mask"])
        n = int(mask.nonzero().max()) + 1
        cached = store.row(i)
        assert cached["features"].shape == (n, layers * target.hidden_size)
        exact = target(torch.tensor(rows[i]["input_ids"][:n])[None], logits=False).hidden[0].float()
        got = fs.dequantize(cached["features"], cached.get("feature_scales"), torch.float32)
        noise = 1e-5 * exact.pow(2).mean().sqrt()
        excess = (got - exact).abs() - eps_of(exact, dtype, layers) - noise
        worst = max(worst, float(excess.max()))
        sq, norm = sq + float((got - exact).pow(2).sum()), norm + float(exact.pow(2).sum())
    assert worst <= 0, f"{dtype}: a stored value is {worst:.3g} beyond the format's bound"
    print(f"{dtype}: features' relative RMS error {(sq / norm) ** 0.5:.3g}")


def step(module: DFlash2Module, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The training loss (ce + selector) of `batch` and the drafter's gradients."""
    module.zero_grad()
    out = module.draft_step(batch)
    loss = out.ce + (out.selector if out.selector is not None else 0)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in module.draft.parameters() if p.grad is not None]


def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return float(
        torch.cat([(x - y).flatten() for x, y in zip(a, b, strict=True)]).norm()
        / torch.cat([y.flatten() for y in b]).norm()
    )


@pytest.mark.slow
@pytest.mark.parametrize("dtype", fs.DTYPES)
def test_a_step_from_the_cache_is_the_online_step_within_the_formats_bound(setup, dtype):
    cfg, target, draft, rows, caches = setup
    torch.manual_seed(0)
    module = DFlash2Module(target, draft)
    batches = {}
    for name, folder in (("online", None), ("cached", caches[dtype])):
        data = build_data(cfg, target, draft) if folder is None else build_data_with(cfg, target, draft, folder)
        data.setup("fit")
        batches[name] = next(iter(data.val_dataloader()))  # validation: the same rows and anchors both times
    online, cached = batches["online"], batches["cached"]
    assert "features" in cached and "features" not in online
    short = cached["input_ids"].shape[1]  # the cache ends each row at its last trained token
    for key in ("anchors", "labels", "block_ids", "block_positions"):
        assert torch.equal(online[key], cached[key]), key
    real = cached["attention_mask"].bool()
    assert torch.equal(online["input_ids"][:, :short][real], cached["input_ids"][real])

    loss, grads = step(module, online)
    exact = target(online["input_ids"], logits=False).hidden.requires_grad_()
    exact_loss, _ = step(module, online | {"features": exact})  # the same step, through the cache's path
    assert torch.allclose(exact_loss, loss, rtol=1e-6), "the cache's path computes another step"
    feature_grad, x = exact.grad[:, :short], exact.detach()[:, :short]
    assert exact.grad[:, short:].abs().max() == 0, "a position past the cached ones was read"
    cached_loss, cached_grads = step(module, cached)

    eps = eps_of(x, dtype, len(draft.target_layer_ids)) * cached["attention_mask"][..., None]
    bound = float((feature_grad.abs() * eps).sum())
    signs = torch.randint(0, 2, x.shape, generator=torch.Generator().manual_seed(random.randrange(2**31))) * 2 - 1
    _, noisy_grads = step(module, cached | {"features": x + signs * eps, "feature_scales": None})
    d_loss, d_grad, d_noise = float((cached_loss - loss).abs()), rel(cached_grads, grads), rel(noisy_grads, grads)
    print(f"{dtype}: |dloss| {d_loss:.3g} (bound 2B = {2 * bound:.3g}), grads' relative change {d_grad:.3g} "
          f"(+-eps perturbation: {d_noise:.3g})")  # fmt: skip
    assert d_loss <= 2 * bound
    assert d_grad <= 2 * d_noise


def build_data_with(cfg, target, draft, folder: Path):
    from omegaconf import open_dict

    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.data.features = str(folder)
    return build_data(cfg, target, draft)


def test_copy_weighted_training_anchors_are_drawn_alike_from_the_cache(setup):
    """data.copy_anchor_weight with data.features: the cache holds every position training reads, so the weighted
    draws from its rows (cut after their last trained token) are the online run's, row by row and epoch by epoch."""
    from omegaconf import open_dict

    from dflash2.data.sampling import Draw

    cfg, target, draft, rows, caches = setup
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.data.copy_anchor_weight, cfg.data.max_anchors = 4.0, 3  # fewer anchors than positions: the weights count
    online, cached = build_data(cfg, target, draft), build_data_with(cfg, target, draft, caches["bf16"])
    for data in (online, cached):
        data.setup("fit")
    a, b = online.train_dataloader().dataset, cached.train_dataloader().dataset
    assert a.copy is not None and b.copy is not None and "features" in b[0]
    shorter = 0
    for row in range(len(a)):
        for epoch in range(2):
            x, y = a[Draw(row, epoch)], b[Draw(row, epoch)]
            assert torch.equal(x["anchors"], y["anchors"])
            shorter += len(y["input_ids"]) < len(x["input_ids"])
    assert shorter > 0  # some rows were cut, and drew alike all the same


def test_a_cache_of_other_settings_is_refused_by_the_setting_that_differs(setup, chats, tmp_path):
    cfg, target, draft, rows, caches = setup
    run = tmp_path / "run"
    cache = f"data.features={caches['bf16']}"
    checks.check_config(config(chats, run, cache))  # the run it was written for passes
    other = tmp_path / "other.jsonl"
    other.write_text(chats.read_text().replace('"0"', '"zero"', 1))
    for override, setting in [
        ("data.max_length=96", "data.max_length"),
        ("draft.target_layer_ids=[1,3]", "draft.target_layer_ids"),
        (f"data.path={other}", "data.path"),
        ("data.limit=10", "data.limit"),
        (f"data.extra_paths=[{other}]", "data.extra_paths"),  # written for data.path alone
    ]:
        with pytest.raises(ValueError, match=rf"data\.features=.*{setting.replace('.', '[.]')}"):
            checks.check_config(config(chats, run, cache, override))
    with pytest.raises(ValueError, match="objective.distill"):
        checks.check_config(config(chats, run, cache, "objective.distill=0.5"))


def test_extra_files_are_cached_after_the_main_files_rows_each_row_with_its_own_features(setup, chats, tmp_path):
    """`python -m dflash2.commands.features` with data.extra_paths: the training and validation rows of the run built
    from the cache are the online run's, and each finds the target's features of its own tokens (within bf16's
    rounding); a changed extra file is refused by name."""
    from hydra import compose, initialize_config_dir
    from training_setup import ROOT, tiny_overrides

    cfg, target, draft, rows, caches = setup
    extra = tmp_path / "extra.jsonl"
    records = [json.loads(line) for line in chats.read_text().splitlines()[:7]]  # 20 + 7 rows: shards of 8 mix them
    for r in records:  # other ids and other text: a row borrowing another's features shows
        r["id"] = f"extra-{r['id']}"
        r["messages"] = [m | {"content": " ".join(reversed(m["content"].split()))} for m in r["messages"]]
    extra.write_text("".join(json.dumps(r) + "\n" for r in records))
    run, folder = tmp_path / "run", tmp_path / "cache"
    argv = tiny_overrides(chats, run, f"data.extra_paths=[{extra}]")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        written = compose("features", overrides=[*argv, f"output={folder}", "shard_rows=8", "device=cpu"])
    manifest = features_command(written)
    assert manifest["rows"] == len(rows) + len(records) and manifest["extra_paths"] == [str(extra)]
    online = build_data(config(chats, run, f"data.extra_paths=[{extra}]"), target, draft)
    cached = build_data_with(config(chats, run, f"data.extra_paths=[{extra}]"), target, draft, folder)
    for dm in (online, cached):
        dm.setup()
    for split in ("train_rows", "val_rows"):
        assert getattr(cached, split)["id"] == getattr(online, split)["id"]
    assert sum(rid.startswith("extra-") for rid in cached.train_rows["id"]) == len(records)
    layers = len(draft.target_layer_ids)
    for row in [*cached.train_rows, *cached.val_rows]:
        stored = cached.features.row(row["feature_row"])["features"].float()
        ids = torch.as_tensor(row["input_ids"][: len(stored)])[None]
        with torch.no_grad():
            exact = target(ids, logits=False).hidden[0].float()
        assert (stored - exact).abs().le(eps_of(exact, "bf16", layers) + 1e-5 * exact.pow(2).mean().sqrt()).all()
    extra.write_text(extra.read_text().replace("extra-0", "extra-zero"))
    with pytest.raises(ValueError, match=r"data\.features=.*extra_sha256 \(set by data\.extra_paths"):
        checks.check_config(config(chats, run, f"data.features={folder}", f"data.extra_paths=[{extra}]"))


def test_the_writer_resumes_missing_shards_and_refuses_a_folder_of_other_settings(setup, tmp_path):
    cfg, target, draft, rows, caches = setup
    from safetensors.torch import load_file

    folder = tmp_path / "cache"
    fields = fs.binding(cfg.model, cfg.data, list(draft.target_layer_ids))
    fc.write_features(target, rows, folder, fields, dtype="fp8", shard_rows=8)
    first = load_file(folder / fs.shard_name(1))
    (folder / fs.shard_name(1)).unlink()
    with pytest.raises(ValueError, match=r"incomplete \(2 of 3 shards\)"):
        fs.FeatureStore(folder)
    before = (folder / fs.shard_name(0)).stat().st_mtime_ns
    fc.write_features(target, rows, folder, fields, dtype="fp8", shard_rows=8)  # the rerun
    assert (folder / fs.shard_name(0)).stat().st_mtime_ns == before  # kept, not rewritten
    again = load_file(folder / fs.shard_name(1))
    assert all(torch.equal(first[k].view(torch.uint8), again[k].view(torch.uint8)) for k in ("features",))
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]  # no temporary file left
    with pytest.raises(ValueError, match="dtype: 'fp8' there, 'bf16' now"):
        fc.write_features(target, rows, folder, fields, dtype="bf16", shard_rows=8)
    assert json.loads((folder / fs.MANIFEST).read_text())["dtype"] == "fp8"


@pytest.mark.slow
def test_training_runs_validates_and_resumes_from_the_cache_without_the_targets_layers(setup, chats, tmp_path):
    cfg, target, draft, rows, caches = setup
    run, cache = tmp_path / "run", f"data.features={caches['fp8']}"
    first = train(config(chats, run, cache, "trainer.max_steps=2", "trainer.max_epochs=5"))
    assert first["global_step"] == 2 and "val/tau_sim" in first["start"] and "val/tau_sim" in first["end"]
    resumed = train(config(chats, run, cache, "trainer.max_steps=3", "trainer.max_epochs=5",
                           f"ckpt_path={first['ckpt_path']}"))  # fmt: skip
    assert resumed["global_step"] == 3


def test_a_target_without_its_layers_is_the_target_to_the_drafter_and_refuses_to_run():
    """load(layers=False), as training from a cache builds it: the same embedding, norm, head, depth and identity as
    the whole target, no decoder layer in memory, and a forward that refuses; drop_layers frees a loaded one's."""
    from dflash2.target.manifest import target_identity
    from dflash2.target.model import TargetModel
    from dflash2.testing import tiny_target, tiny_target_path

    whole = TargetModel.load(tiny_target_path(), name="tiny", target_layer_ids=[1, 2])
    bare = TargetModel.load(tiny_target_path(), name="tiny", target_layer_ids=[1, 2], layers=False)
    assert len(bare.layers) == 0 and bare.num_layers == whole.num_layers == whole.config.num_hidden_layers
    assert target_identity("tiny", bare.config, bare.tokenizer) == target_identity(
        "tiny", whole.config, whole.tokenizer
    )
    kept = {k: v for k, v in whole.model.state_dict().items() if ".layers." not in k}
    assert bare.model.state_dict().keys() == kept.keys()
    assert all(torch.equal(bare.model.state_dict()[k], v) for k, v in kept.items())
    with pytest.raises(ValueError, match="target_layer_ids"):  # still checked against the target's depth
        TargetModel.load(tiny_target_path(), target_layer_ids=[whole.num_layers], layers=False)
    dropped = tiny_target(target_layer_ids=[1, 2])
    dropped.drop_layers()
    for target in (bare, dropped):
        assert len(target.layers) == 0 and target.embed_tokens.weight.numel() > 0
        with pytest.raises(RuntimeError, match="data.features"):
            target(torch.tensor([[1, 2, 3]]), logits=False)
