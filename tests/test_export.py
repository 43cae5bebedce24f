"""Export of synthetic training checkpoints: exact reload, atomic writes, clear refusals, the manifest, the CLI."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast, Qwen3Config

from dflash2 import DFlash2Config, DFlash2DraftModel, tensor_shapes
from dflash2.export.check import LintReport
from dflash2.export.writer import export_checkpoint
from dflash2.model.drafter import read_safetensors
from dflash2.target.locate import SMOLLM2_HUB_ID
from dflash2.target.manifest import build_manifest, check_manifest, read_manifest, target_identity
from dflash2.training.checkpoint import draft_from_checkpoint, find_checkpoint, load_checkpoint

REPO = Path(__file__).resolve().parents[1]


def tiny_config(conv: bool = True, selector: bool = True) -> DFlash2Config:
    return DFlash2Config(
        hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_hidden_layers=2, num_target_layers=6, vocab_size=256, mask_token_id=255, block_size=4,
        rope_theta=10000.0, conv_kernel_size=2 if conv else 0, conv_group_size=8 if conv else 0,
        selector_rank=8 if selector else 0, selector_top_k=4 if selector else 0,
    )  # fmt: skip


def trained_model(cfg: DFlash2Config) -> DFlash2DraftModel:
    """A drafter whose every tensor (conv and selector included) is far from its inert initialisation."""
    model = DFlash2DraftModel(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + p)
    return model


def write_ckpt(path: Path, model: DFlash2DraftModel, manifest: dict | None = None, changes: dict | None = None) -> Path:
    """A Lightning checkpoint as dflash2's training writes it (drafter under `draft.`, config in hparams)."""
    state = {"draft." + k: v.detach().clone() for k, v in model.state_dict().items()}
    ckpt = {
        "epoch": 1,
        "global_step": 42,
        "pytorch-lightning_version": "2.5.0",
        "state_dict": state,
        "hyper_parameters": {"draft_config": model.config.to_dict(), "lr": 6e-4},
        "dflash2": {"manifest": manifest, "metrics": {"val/tau_sim": 3.25, "val/acc_1": 0.8}, "step": 42},
    }
    for (*parents, leaf), value in (changes or {}).items():  # key: path into the checkpoint; None deletes
        node = ckpt
        for p in parents:
            node = node[p]
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return path


def propose(model: DFlash2DraftModel, inputs: dict, lm_head: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Hidden states, candidates and the greedy selector walk of one batch of blocks."""
    with torch.no_grad():
        ctx = model.fuse(inputs["target_hidden"])
        hidden = model(inputs["embeds"], inputs["positions"], ctx, inputs["ctx_positions"])
        out = (hidden,)
        if model.candidate_selector is not None:
            sel, b = model.candidate_selector, model.config.block_size
            slots = hidden.view(-1, b, hidden.shape[-1])[:, 1:]
            cand, unary = sel.compute_candidates(slots, lm_head)
            scores = sel.build_lattice(cand, unary, slots, inputs["anchors"])
            n = cand.shape[0]
            tokens, _ = sel.walk(cand, scores, torch.rand(n, b - 1), torch.ones(n), torch.ones(n, dtype=torch.bool))
            out += (cand, scores, tokens)
    return out


def random_inputs(cfg: DFlash2Config, blocks: int = 2, context: int = 5) -> dict:
    h, b = cfg.hidden_size, cfg.block_size
    return {
        "target_hidden": torch.randn(1, context, len(cfg.target_layer_ids) * h, dtype=torch.bfloat16),
        "ctx_positions": torch.arange(context).unsqueeze(0),
        "embeds": torch.randn(1, blocks * b, h, dtype=torch.bfloat16),
        "positions": torch.arange(context, context + blocks * b).unsqueeze(0),
        "anchors": torch.randint(0, cfg.vocab_size, (blocks,)),
    }


def leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


def test_export_reloads_and_proposes_exactly_what_the_trained_model_does(tmp_path):
    cfg = tiny_config()
    model = trained_model(cfg)
    out = export_checkpoint(write_ckpt(tmp_path / "last.ckpt", model), tmp_path / "drafter")
    assert leftovers(tmp_path, {"last.ckpt", "drafter"}) == []
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md"}

    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert set(f.keys()) == set(tensor_shapes(cfg))
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == cfg.target_layer_ids

    reloaded = DFlash2DraftModel.from_pretrained(out, dtype=torch.bfloat16)
    in_memory = draft_from_checkpoint(load_checkpoint(tmp_path / "last.ckpt")).to(torch.bfloat16)
    reference = model.to(torch.bfloat16)
    inputs, lm_head = random_inputs(cfg), torch.randn(cfg.vocab_size, cfg.hidden_size, dtype=torch.bfloat16)
    want = propose(reference, inputs, lm_head)
    for candidate in (reloaded, in_memory):
        for got, expected in zip(propose(candidate, inputs, lm_head), want, strict=True):
            assert torch.equal(got, expected)

    card = (out / "README.md").read_text()
    for fact in ("--speculative-num-draft-tokens 4", '"num_speculative_tokens": 3', "val/tau_sim", "3.25", "42"):
        assert fact in card


def test_sharded_and_single_file_exports_hold_the_same_tensors(tmp_path):
    ckpt = write_ckpt(tmp_path / "last.ckpt", trained_model(tiny_config()))
    single = export_checkpoint(ckpt, tmp_path / "single")
    sharded = export_checkpoint(ckpt, tmp_path / "sharded", max_shard_size="40KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    a, b = read_safetensors(single), read_safetensors(sharded)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_plain_dflash_export_declares_dflash_without_dflash2_tensors(tmp_path):
    cfg = tiny_config(conv=False, selector=False)
    out = export_checkpoint(write_ckpt(tmp_path / "last.ckpt", trained_model(cfg)), tmp_path / "drafter")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    with safe_open(out / "model.safetensors", framework="pt") as f:
        names = list(f.keys())
    assert names and not [n for n in names if "conv" in n or "selector" in n]
    assert DFlash2DraftModel.from_pretrained(out).candidate_selector is None


SD = "state_dict"
CORRUPTIONS = {
    "truncated": (None, "truncated"),
    "integer tensor": ({(SD, "draft.fc.weight"): torch.zeros(64, 128, dtype=torch.int64)}, "fc.weight"),
    "missing key": ({(SD, "draft.layers.1.mlp.up_proj.weight"): None}, "layers.1.mlp.up_proj.weight"),
    "wrong shape": ({(SD, "draft.norm.weight"): torch.ones(63)}, "norm.weight"),
    "codebook with .weight": (
        {(SD, "draft.candidate_selector.successor_codebook"): None,
         (SD, "draft.candidate_selector.successor_codebook.weight"): torch.zeros(256, 8)},
        "successor_codebook",
    ),
    "no draft_config": ({("hyper_parameters", "draft_config"): None}, "draft_config"),
    "no drafter tensors": ({(SD,): {"target.embed_tokens.weight": torch.zeros(4, 4)}}, "draft."),
}  # fmt: skip


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_checkpoint_fails_clearly_and_leaves_nothing(tmp_path, corruption):
    changes, message = CORRUPTIONS[corruption]
    ckpt = write_ckpt(tmp_path / "last.ckpt", trained_model(tiny_config()), changes=changes)
    if changes is None:
        os.truncate(ckpt, ckpt.stat().st_size // 2)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        export_checkpoint(ckpt, tmp_path / "out" / "drafter")
    assert leftovers(tmp_path, {"last.ckpt"}) == []


class Touch:
    """Pickled, it names a call: unpickling it creates `marker`, i.e. runs code the file chose."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_checkpoint_with_pickled_code_is_refused_unless_allowed(tmp_path):
    """A checkpoint that only full unpickling reads is refused in one sentence naming allow_pickle, and nothing in it
    runs; with allow_pickle=true (a file the user trusts) it exports."""
    marker = tmp_path / "ran"
    ckpt = write_ckpt(
        tmp_path / "last.ckpt", trained_model(tiny_config()), changes={("hyper_parameters", "x"): Touch(marker)}
    )
    with pytest.raises(ValueError, match=r"holds pickled objects .*Unsupported global.*pass allow_pickle=true") as e:
        export_checkpoint(ckpt, tmp_path / "drafter")
    assert "\n" not in str(e.value) and not marker.exists() and leftovers(tmp_path, {"last.ckpt"}) == []
    done = run_cli(f"ckpt_path={ckpt}", f"output_dir={tmp_path / 'drafter'}")
    assert done.returncode == 1 and "allow_pickle=true" in done.stdout and not marker.exists()
    export_checkpoint(ckpt, tmp_path / "drafter", allow_pickle=True)
    assert marker.exists() and (tmp_path / "drafter" / "config.json").is_file()


def test_a_failing_lint_leaves_nothing_behind(tmp_path, monkeypatch):
    ckpt = write_ckpt(tmp_path / "last.ckpt", trained_model(tiny_config()))
    monkeypatch.setattr("dflash2.export.writer.lint", lambda path: LintReport(Path(path), problems=["injected fault"]))
    with pytest.raises(ValueError, match="injected fault"):
        export_checkpoint(ckpt, tmp_path / "drafter")
    assert leftovers(tmp_path, {"last.ckpt"}) == []


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    ckpt = write_ckpt(tmp_path / "last.ckpt", trained_model(tiny_config()))
    out = tmp_path / "drafter"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite"):
        export_checkpoint(ckpt, out)
    assert (out / "keep.txt").read_text() == "mine"
    export_checkpoint(ckpt, out, overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file()
    assert leftovers(tmp_path, {"last.ckpt", "drafter"}) == []


def test_export_is_readable_by_group_and_others(tmp_path):
    """A serving container running as another user reads the folder: the modes are the umask's, as for cp or mkdir."""
    umask = os.umask(0o022)
    try:
        out = export_checkpoint(write_ckpt(tmp_path / "last.ckpt", trained_model(tiny_config())), tmp_path / "drafter")
    finally:
        os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == dict.fromkeys(
        ["config.json", "model.safetensors", "README.md"], 0o644
    )


def test_sigterm_during_an_export_leaves_no_temp_folder(tmp_path):
    """SIGTERM arrives while the folder is being written (here: from the linter's call); the export stops, cleanly."""
    ckpt = write_ckpt(tmp_path / "last.ckpt", trained_model(tiny_config()))
    script = (
        "import os, signal, sys\n"
        "import dflash2.export.writer as export\n"
        "export.lint = lambda path: os.kill(os.getpid(), signal.SIGTERM)\n"
        "export.export_checkpoint(sys.argv[1], sys.argv[2])\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-c", script, str(ckpt), str(tmp_path / "drafter")], env=env, timeout=120)
    assert done.returncode == 128 + signal.SIGTERM
    assert leftovers(tmp_path, {"last.ckpt"}) == []


def test_an_export_removes_what_killed_exports_left_and_spares_a_running_one(tmp_path):
    ckpt = write_ckpt(tmp_path / "last.ckpt", trained_model(tiny_config()))
    killed, running = tmp_path / ".drafter.export-killed", tmp_path / ".drafter.export-running"
    for folder in (killed, running):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    other = tmp_path / ".other.export-killed"  # another destination's: not this export's to judge
    other.mkdir()
    fd = os.open(running, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # what a live export holds on its temp folder
    try:
        export_checkpoint(ckpt, tmp_path / "drafter")
    finally:
        os.close(fd)
    assert leftovers(tmp_path, {"last.ckpt"}) == sorted([running.name, other.name, "drafter"])


def test_the_model_card_serves_the_target_that_training_loaded(tmp_path):
    identity = target_identity("smollm2", *tiny_target())
    manifest = build_manifest(identity, "sharegpt", 42, target_path="/models/SmolLM2-135M-Instruct")
    out = export_checkpoint(
        write_ckpt(tmp_path / "last.ckpt", trained_model(tiny_config()), manifest), tmp_path / "drafter"
    )
    card = (out / "README.md").read_text()
    assert "--model-path /models/SmolLM2-135M-Instruct " in card and "vllm serve /models/SmolLM2-135M-Instruct " in card


@pytest.mark.parametrize(
    "recorded, served",
    [
        # trained on the embedded GGUF: its dequantized copy in that machine's cache is served as SmolLM2's hub id
        ({"target_path": "/home/u/.cache/dflash2/gguf/SmolLM2-135M-Instruct.Q4_1-6c734edd4904"}, SMOLLM2_HUB_ID),
        ({"target_path": "/x/gguf/SmolLM2-135M-Instruct.Q4_1-1", "serve_model": SMOLLM2_HUB_ID}, SMOLLM2_HUB_ID),
        ({"target_path": "/x/gguf/Other-Q8-123"}, "<hub id or folder of smollm2>"),  # no portable name known
        ({"target_path": "/x/gguf/Other-Q8-123", "serve_model": None}, "<hub id or folder of smollm2>"),
        ({"target_path": "/models/SmolLM2", "serve_model": "/models/SmolLM2"}, "/models/SmolLM2"),
    ],
)
def test_the_model_card_serves_a_hub_id_not_a_cache_folder(tmp_path, recorded, served):
    identity = target_identity("smollm2", *tiny_target())
    manifest = build_manifest(identity, "sharegpt", 42, **recorded)
    model = trained_model(tiny_config())
    out = export_checkpoint(write_ckpt(tmp_path / "last.ckpt", model, manifest), tmp_path / "d")
    card = (out / "README.md").read_text()
    assert f"--model-path {served} " in card and f"vllm serve {served} " in card
    assert "/gguf/" not in card.split("## Serving")[1]
    assert ("base_model: " + (served if served == SMOLLM2_HUB_ID else "smollm2")) in card


@pytest.mark.parametrize("layers", [1, 2])
def test_the_model_card_counts_draft_layers(layers):
    from dflash2.export.writer import model_card

    cfg = DFlash2Config.from_dict(tiny_config().to_dict() | {"num_hidden_layers": layers, "layer_types": None})
    card = model_card(cfg, {})
    assert f"{layers} draft layer{'s' if layers > 1 else ''}, hidden size" in card
    assert "1 draft layers" not in card


def test_a_run_records_what_engines_load_for_its_target(tmp_path):
    """The manifest names the target as engines load it: the embedded SmolLM2 as its hub id, a hub id as given, a local
    folder by its absolute path, and a GGUF by the repository its metadata names (None when it names none)."""
    from dflash2.target.locate import _smollm2_gguf, serve_model

    assert serve_model(None, "SmolLM2-135M-Instruct.Q4_1.gguf") == serve_model("smollm2", None) == SMOLLM2_HUB_ID
    assert serve_model("Qwen/Qwen3-8B", None) == "Qwen/Qwen3-8B"
    assert serve_model(str(tmp_path), None) == str(tmp_path.absolute())
    assert serve_model(str(_smollm2_gguf()), None) is None  # its metadata names no source repository


@pytest.mark.parametrize("conv", [False, True])
def test_the_model_card_tags_its_kind_once_and_lists_the_slots_in_order(conv):
    from dflash2.export.writer import model_card

    slots = torch.randperm(12).tolist()  # the metrics arrive in any order
    metrics = {f"val/acc_{k + 1}": 0.5 for k in slots} | {"val/tau_sim": 2.0, "val/loss_ce": 3.0}
    card = model_card(tiny_config(conv=conv, selector=conv), {"metrics": metrics})
    tags = next(line for line in card.splitlines() if line.startswith("tags:"))
    assert tags == ("tags: [speculative-decoding, dflash, dflash2]" if conv else "tags: [speculative-decoding, dflash]")
    listed = [line.split("`")[1] for line in card.splitlines() if line.startswith("| `val/acc_")]
    assert listed == [f"val/acc_{k}" for k in range(1, 13)]


def test_find_checkpoint_prefers_last_then_the_highest_step(tmp_path):
    run = tmp_path / "run" / "checkpoints"
    run.mkdir(parents=True)
    for name in ("epoch=0-step=900.ckpt", "epoch=1-step=1800.ckpt", "epoch=0-step=95.ckpt"):
        (run / name).touch()
    assert find_checkpoint(tmp_path / "run").name == "epoch=1-step=1800.ckpt"
    (run / "last.ckpt").touch()
    assert find_checkpoint(tmp_path / "run").name == "last.ckpt"
    with pytest.raises(FileNotFoundError, match="ckpt_path"):
        find_checkpoint(tmp_path / "missing")


def test_a_run_dir_exports_its_best_checkpoint_by_tau_sim_and_says_so(tmp_path, caplog):
    """As Lightning's ckpt_path="best": in a run dir the export takes the checkpoint with the highest recorded
    val/tau_sim (not last.ckpt, a later but worse state), logs which and why, and its config.json carries its
    metrics; a .ckpt file passed as ckpt_path is taken as given."""
    folder = tmp_path / "run" / "checkpoints"
    model = trained_model(tiny_config())

    def at(step: int, tau: float) -> dict:
        return {("global_step",): step, ("dflash2", "step"): step, ("dflash2", "metrics"): {"val/tau_sim": tau}}

    manifest = build_manifest(target_identity("tiny/target", *tiny_target()), "test", 2)
    write_ckpt(folder / "epoch=0-step=2.ckpt", model, manifest, changes=at(2, 1.5))
    write_ckpt(folder / "epoch=0-step=1.ckpt", model, manifest, changes=at(1, 1.25))
    write_ckpt(folder / "last.ckpt", model, manifest, changes=at(4, 1.4))
    with caplog.at_level(logging.INFO, logger="dflash2.training.checkpoint"):
        assert find_checkpoint(tmp_path / "run") == folder / "epoch=0-step=2.ckpt"
        assert find_checkpoint(folder) == folder / "epoch=0-step=2.ckpt"
    line = caplog.records[0].getMessage()
    assert "taking checkpoints/epoch=0-step=2.ckpt, the best by val/tau_sim (1.5000 at step 2; the latest, " in line
    assert "last.ckpt, has 1.4000 at step 4)" in line
    assert find_checkpoint(folder / "last.ckpt") == folder / "last.ckpt"
    out = export_checkpoint(tmp_path / "run", tmp_path / "drafter")
    assert read_manifest(out)["metrics"] == {"val/tau_sim": 1.5}
    # A tie, as when last.ckpt is the best's hard link: the later state, under the best's own name.
    os.remove(folder / "last.ckpt")
    os.link(folder / "epoch=0-step=2.ckpt", folder / "last.ckpt")
    assert find_checkpoint(tmp_path / "run") == folder / "epoch=0-step=2.ckpt"


# ---------------------------------------------------------------------- manifest
def tiny_target(extra_token: str | None = None, layers: int = 6) -> tuple[Qwen3Config, PreTrainedTokenizerFast]:
    vocab = {f"t{i}": i for i in range(250)} | {"<unk>": 250, "<|im_end|>": 251}
    if extra_token:
        vocab[extra_token] = len(vocab)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>", eos_token="<|im_end|>"
    )
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
    )
    return config, tok


def test_manifest_round_trips_and_refuses_another_target(tmp_path, caplog):
    identity = target_identity("tiny/target", *tiny_target())
    manifest = build_manifest(identity, data_source="sharegpt (regenerated)", steps=42, run="r1")
    out = export_checkpoint(
        write_ckpt(tmp_path / "last.ckpt", trained_model(tiny_config()), manifest), tmp_path / "drafter"
    )
    # The checkpoint's validation metrics ride along as data (evaluate.py's tau_sim reads them there).
    assert read_manifest(out) == manifest | {"metrics": {"val/tau_sim": 3.25, "val/acc_1": 0.8}}
    assert DFlash2DraftModel.from_pretrained(out).config.extra["dflash2_manifest"] == read_manifest(out)
    assert "tiny/target" in (out / "README.md").read_text()
    check_manifest(read_manifest(out), target_identity("tiny/target", *tiny_target()))

    config, tok = tiny_target()
    config._name_or_path, config.transformers_version = "/elsewhere/tiny", "0.0.1"  # volatile: same target
    check_manifest(manifest, target_identity("moved/copy", config, tok))
    with pytest.raises(ValueError, match="target_config_hash"):
        check_manifest(manifest, target_identity("tiny/target", *tiny_target(layers=7)))
    with pytest.raises(ValueError, match="vocab_hash"):
        check_manifest(manifest, target_identity("tiny/target", *tiny_target(extra_token="<new>")))
    with caplog.at_level(logging.WARNING, logger="dflash2.target.manifest"):
        check_manifest(None, identity)
    assert "dflash2_manifest" in caplog.text


def test_the_shipped_drafters_manifest_is_the_embedded_targets_identity(caplog):
    """artifacts/drafters/smollm2-dflash records the identity of the embedded SmolLM2 as training computes it (from
    the target's config.json and tokenizer alone), every part of it: evaluate.py checks the pairing unwarned."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer

    from dflash2.target.inherited import load_target_config
    from dflash2.target.locate import target_source

    model = OmegaConf.load(REPO / "configs" / "model" / "smollm2.yaml")
    path, kwargs = target_source(model.path, model.gguf_file)
    identity = target_identity(model.name, load_target_config(model), AutoTokenizer.from_pretrained(path, **kwargs))
    manifest = read_manifest(REPO / "artifacts" / "drafters" / "smollm2-dflash")
    assert {key: manifest.get(key) for key in identity} == identity
    with caplog.at_level(logging.WARNING, logger="dflash2.target.manifest"):
        check_manifest(manifest, identity)
    assert not caplog.records, caplog.text


def test_the_identity_is_the_vocabulary_not_the_special_tokens_roles(caplog):
    config, tok = tiny_target()
    identity = target_identity("tiny/target", config, tok)
    manifest = build_manifest(identity, data_source="sharegpt", steps=1)
    other_roles = tiny_target()[1]
    other_roles.eos_token, other_roles.pad_token = "t7", "t8"  # same ids, other roles: the same drafter fits
    check_manifest(manifest, target_identity("tiny/target", config, other_roles))
    swapped = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({**tok.get_vocab(), "t1": 2, "t2": 1}, unk_token="<unk>")),
        unk_token="<unk>",
        eos_token="<|im_end|>",
    )  # two ids trade tokens: the drafter would propose the wrong ones
    with pytest.raises(ValueError, match="vocab_hash"):
        check_manifest(manifest, target_identity("tiny/target", config, swapped))
    legacy = {k: v for k, v in manifest.items() if k != "vocab_hash"} | {"tokenizer_hash": "0" * 64}
    with caplog.at_level(logging.WARNING, logger="dflash2.target.manifest"):
        check_manifest(legacy, identity)  # written before vocab_hash: loads, with the unchecked part named
    assert "vocab_hash" in caplog.text


# ---------------------------------------------------------------------- CLI
def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, str(REPO / "export.py"), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_cli_exports_a_run_dir_and_checks_it(tmp_path):
    write_ckpt(tmp_path / "run" / "checkpoints" / "last.ckpt", trained_model(tiny_config()))
    out = tmp_path / "drafter"
    done = run_cli(f"ckpt_path={tmp_path / 'run'}", f"output_dir={out}")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "config.json").is_file()
    assert run_cli(f"check={out}").returncode == 0

    config = json.loads((out / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = config["vocab_size"]
    (out / "config.json").write_text(json.dumps(config))
    done = run_cli(f"check={out}")
    assert done.returncode == 1 and "mask_token_id" in done.stdout


# --- engine-ready exports: the card's serving section and the check, as SGLang 0.5.23 and vLLM 0.33.0 read them ----


def card_of(tmp_path: Path, cfg: DFlash2Config, manifest: dict | None = None, changes: dict | None = None) -> str:
    out = export_checkpoint(write_ckpt(tmp_path / "last.ckpt", trained_model(cfg), manifest, changes), tmp_path / "d")
    return (out / "README.md").read_text()


def serving_section(card: str) -> str:
    return card.split("## Serving")[1]


def test_the_card_names_the_engine_versions_and_the_v2_runner_a_dflash2_drafter_needs(tmp_path):
    manifest = build_manifest(target_identity("t", *tiny_target()), "x", 1, serve_model="org/target")
    serving = serving_section(card_of(tmp_path / "dflash2", tiny_config(), manifest))
    assert "SGLang 0.5.23" in serving and "vLLM 0.33.0" in serving and "contract section 9" in serving
    assert "python -m sglang.launch_server --model-path org/target \\\n" in serving
    assert "--speculative-algorithm DFLASH --speculative-draft-model-path <this folder>" in serving
    assert "--speculative-num-draft-tokens 4\n" in serving  # B, where vLLM takes B - 1
    assert "VLLM_USE_V2_MODEL_RUNNER=1 vllm serve org/target \\\n" in serving
    assert '"method": "dflash", "model": "<this folder>", "num_speculative_tokens": 3}' in serving
    assert "V2 model runner only" in serving and "Before serving" not in serving

    plain = serving_section(card_of(tmp_path / "dflash", tiny_config(conv=False, selector=False), manifest))
    assert "on either model runner" in plain and "VLLM_USE_V2_MODEL_RUNNER" not in plain
    assert "\nvllm serve org/target \\\n" in plain


def test_the_card_says_what_an_engine_cannot_serve(tmp_path):
    serving = serving_section(card_of(tmp_path / "conv", tiny_config(conv=True, selector=False)))
    assert "Before serving:\n\n- a conv-only DFlash2 drafter" in serving
    assert "SGLang 0.5.23 cannot serve this drafter" in serving and "vLLM 0.33.0 cannot serve this drafter" in serving
    assert "launch_server" not in serving and "vllm serve" not in serving

    serving = serving_section(card_of(tmp_path / "selector", tiny_config(conv=False, selector=True)))
    assert "a selector-only DFlash2 drafter" in serving and "launch_server" in serving
    assert "vLLM 0.33.0 cannot serve this drafter" in serving and "vllm serve" not in serving

    manifest = build_manifest(target_identity("t", *tiny_target()), "x", 1) | {
        "target_architectures": ["Qwen2ForCausalLM"]
    }
    serving = serving_section(card_of(tmp_path / "qwen2", tiny_config(), manifest))
    assert "- target architecture Qwen2ForCausalLM: SGLang 0.5.23 captures no layers" in serving


def test_the_export_records_the_chat_template_arguments_training_rendered_with(tmp_path):
    manifest = build_manifest(target_identity("t", *tiny_target()), "x", 1)
    hparams = {("datamodule_hyper_parameters",): {"chat_template_kwargs": {"enable_thinking": False}, "path": "x"}}
    card = card_of(tmp_path / "with", tiny_config(), manifest, hparams)
    assert read_manifest(tmp_path / "with" / "d")["chat_template_kwargs"] == {"enable_thinking": False}
    assert "| chat template arguments | `{enable_thinking: false}` |" in card
    flag = """--default-chat-template-kwargs '{"enable_thinking": false}'"""
    assert card.count(flag) == 2 and "--speculative-num-draft-tokens 4 " + flag in card

    # Trained with none: recorded as none, no flag. A checkpoint from before the setting existed: not recorded.
    none = card_of(
        tmp_path / "none", tiny_config(), manifest, {("datamodule_hyper_parameters",): {"chat_template_kwargs": {}}}
    )
    assert read_manifest(tmp_path / "none" / "d")["chat_template_kwargs"] == {} and "--default-chat" not in none
    old = card_of(tmp_path / "old", tiny_config(), manifest)
    assert "chat_template_kwargs" not in read_manifest(tmp_path / "old" / "d")
    assert "| chat template arguments | not recorded |" in old


def test_check_on_the_shipped_drafter_shows_how_the_engines_serve_it():
    done = run_cli(f"check={REPO / 'artifacts' / 'drafters' / 'smollm2-dflash'}")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].endswith("smollm2-dflash: OK")
    engines = [line for line in lines if line.startswith("  engines: ")]
    assert any("target architecture LlamaForCausalLM" in e and "capture its layers" in e for e in engines), lines
    assert any(
        "SGLang 0.5.23 serves it: --speculative-algorithm DFLASH --speculative-num-draft-tokens 16" in e
        for e in engines
    )
    assert any('vLLM 0.33.0 serves it on either model runner: "method": "dflash", "num_speculative_tokens": 15' in e
               for e in engines)  # fmt: skip
    assert not any(line.startswith("  warning: ") for line in lines)
