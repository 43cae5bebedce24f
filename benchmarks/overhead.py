"""DFlash2's overhead on the production decode path: its own parts against a whole draft + verify step.

    python benchmarks/overhead.py [--batch 1 32] [--context 2048] [--out benchmarks/results/overhead.json]
    python benchmarks/overhead.py --small --out /tmp/overhead.json    # tiny shapes: seconds on a CPU

Shapes default to Qwen3-8B (hidden 4096, 32/8 heads of 128, intermediate 12288, 36 layers, vocab 151936) with the
published drafter (5 layers, B = 16, 2 conv taps, group 16, selector rank 256, K = 16), random bf16 weights. Per
batch size, every piece is a median after warm-up, replayed from a CUDA graph (triton.testing.do_bench_cudagraph,
device time as engines replay decode); a piece that cannot be captured is timed eagerly and says `graph: false`.
On a CPU every piece is the median wall time of a few eager calls instead, so the script can be smoke-tested.

  (a) the parts only DFlash2 runs: the grouped conv of every draft layer (prepare + finish at both sites), the
      full-vocabulary top-K of the draft logits, the selector's lattice and its walk;
  (b) one whole draft step, DFlash2 and the same drafter with conv and selector off (plain DFlash, argmax);
  (c) one target verify step: B tokens per request over a KV cache of --context tokens (a Qwen3-shaped decoder).

overhead_share = (a) / (DFlash2 draft + verify); differential_share = (DFlash2 draft - DFlash draft) / (DFlash2
draft + verify): the first charges DFlash2 for its parts alone, the second for everything that changes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dflash2.model import kernels
from dflash2.model.config import DFlash2Config, default_target_layer_ids
from dflash2.model.drafter import DFlash2DraftModel, DraftCache, RMSNorm, apply_rope
from dflash2.model.selector import head_logits

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from timing import graph_ms, median_ms, print_table  # noqa: E402

REP_MS = 200  # do_bench_cudagraph's measuring window per piece
CPU_REPEATS = 5
PARTS = ("conv", "topk", "lattice", "walk")
STEPS = ("dflash2_draft", "dflash_draft", "verify")


@dataclasses.dataclass(frozen=True)
class Shapes:
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 12288
    target_layers: int = 36
    vocab: int = 151936
    rope_theta: float = 1e6
    rms_eps: float = 1e-6
    draft_layers: int = 5
    block_size: int = 16
    taps: int = 2
    group_size: int = 16
    rank: int = 256
    top_k: int = 16


# 6 target layers so that 2 draft layers read two distinct ones ([1, 3]); everything else as small as it gets.
SMALL = Shapes(
    hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, target_layers=6, vocab=512,
    draft_layers=2, block_size=8, rank=16, top_k=8,
)  # fmt: skip


# ---------------------------------------------------------------------------------------------- timing
def measure(name: str, fn: Callable[[], object], device: torch.device) -> dict:
    """{"ms": median per call, "graph": whether it was replayed from a CUDA graph}."""
    if device.type != "cuda":
        fn()  # the first call pays for allocations and lazy initialisation
        times = []
        for _ in range(CPU_REPEATS):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return {"ms": 1e3 * statistics.median(times), "graph": False}
    for _ in range(3):  # Triton compiles, cuBLAS and SDPA pick their kernels: none of that may land in a capture
        fn()
    torch.cuda.synchronize()
    try:
        return {"ms": graph_ms(fn, rep=REP_MS), "graph": True}
    except RuntimeError as e:  # torch reports a failed capture as a RuntimeError (AcceleratorError included)
        torch.cuda.synchronize()
        print(f"WARNING: {name} could not be captured in a CUDA graph ({e}); timed eagerly", file=sys.stderr)
        ms = median_ms(fn, rep=REP_MS)
        return {"ms": ms, "graph": False, "capture_error": str(e)[:500]}


# ---------------------------------------------------------------------------------------------- the target
class VerifyLayer(nn.Module):
    """One Qwen3 decoder layer that attends over a preallocated KV cache."""

    def __init__(self, s: Shapes, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        kw = dict(bias=False, device=device, dtype=dtype)
        hq, hkv = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.head_dim, self.gqa = s.head_dim, s.heads != s.kv_heads
        self.input_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.rms_eps)
        self.q_norm, self.k_norm = RMSNorm(s.head_dim, s.rms_eps), RMSNorm(s.head_dim, s.rms_eps)
        self.q_proj, self.o_proj = nn.Linear(s.hidden, hq, **kw), nn.Linear(hq, s.hidden, **kw)
        self.k_proj, self.v_proj = nn.Linear(s.hidden, hkv, **kw), nn.Linear(s.hidden, hkv, **kw)
        self.gate_proj = nn.Linear(s.hidden, s.intermediate, **kw)
        self.up_proj = nn.Linear(s.hidden, s.intermediate, **kw)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, **kw)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> torch.Tensor:
        b, n, _ = h.shape
        x = self.input_layernorm(h)
        q = self.q_norm(self.q_proj(x).view(b, n, -1, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(b, n, -1, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(b, n, -1, self.head_dim).transpose(1, 2)
        # The block's keys/values go to the last n slots of the static cache, at fixed addresses, as an engine
        # writes them before attending; the graph then replays without any host work.
        cache_k[:, :, -n:].copy_(apply_rope(k, cos, sin))
        cache_v[:, :, -n:].copy_(v)
        # No mask: the block sees itself bidirectionally where a real verify is causal inside it. The work differs by
        # at most B / (context + B) of the scores, while a dense mask would take SDPA off its flash kernel (which
        # takes none) onto kernels that engines do not use for this.
        out = F.scaled_dot_product_attention(apply_rope(q, cos, sin), cache_k, cache_v, enable_gqa=self.gqa)
        h = h + self.o_proj(out.transpose(1, 2).reshape(b, n, -1))
        x = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VerifyDecoder(nn.Module):
    """A Qwen3-shaped target with random weights: embedding, layers over a static KV cache, final norm, head.

    The verify returns the logits of every block position and the hidden states of the drafter's target layers,
    which is what a DFlash verify must produce. The greedy acceptance after it is a few [b, B] integer ops that
    DFlash and DFlash2 share, so it is left out.
    """

    def __init__(self, s: Shapes, target_layer_ids: list[int], device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.shapes, self.target_layer_ids = s, target_layer_ids
        self.embed_tokens = nn.Embedding(s.vocab, s.hidden, device=device, dtype=dtype)
        self.layers = nn.ModuleList(VerifyLayer(s, device, dtype) for _ in range(s.target_layers))
        self.norm = RMSNorm(s.hidden, s.rms_eps)
        self.lm_head = nn.Linear(s.hidden, s.vocab, bias=False, device=device, dtype=dtype)
        self.to(device=device, dtype=dtype)  # the norms' gains, created in fp32, would promote activations
        exponents = torch.arange(0, s.head_dim, 2, dtype=torch.float32, device=device) / s.head_dim
        inv_freq = 1.0 / s.rope_theta**exponents
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # after .to(dtype): RoPE stays fp32

    def new_cache(self, batch: int, context: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys/values of `context` earlier tokens plus B slots for the block, per layer: [b, kv, context + B, d]."""
        s, w = self.shapes, self.lm_head.weight
        shape = (batch, s.kv_heads, context + s.block_size, s.head_dim)
        keys = [torch.randn(shape, device=w.device, dtype=w.dtype) for _ in self.layers]
        values = [torch.randn(shape, device=w.device, dtype=w.dtype) for _ in self.layers]
        return keys, values

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """ids, positions [b, B] -> (logits [b, B, V], features [b, B, n*H])."""
        freqs = positions.float().unsqueeze(-1) * self.inv_freq
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)
        cos, sin = emb.cos(), emb.sin()
        h = self.embed_tokens(ids)
        captured = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, keys[i], values[i])
            if i in self.target_layer_ids:
                captured[i] = h
        features = torch.cat([captured[i] for i in self.target_layer_ids], dim=-1)
        return self.lm_head(self.norm(h)), features


# ---------------------------------------------------------------------------------------------- the drafter
class StaticDraftCache(DraftCache):
    """The drafter's context keys/values in fixed buffers of `context` slots per layer.

    DraftCache grows by torch.cat at every draft step: new shapes and new addresses each time, which a CUDA graph
    cannot replay. Here the first context - B slots stand for the earlier context and `update` writes this step's
    B new context tokens into the last B slots, the way an engine's static cache does, then hands back the buffer.
    """

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
        super().__init__(len(keys))
        self.keys, self.values = keys, values

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = k.shape[2]
        self.keys[layer][:, :, -n:].copy_(k)
        self.values[layer][:, :, -n:].copy_(v)
        return self.keys[layer], self.values[layer]


def build_drafter(s: Shapes, dflash2: bool, device: torch.device, dtype: torch.dtype) -> DFlash2DraftModel:
    """The published drafter with random weights; dflash2=False turns the conv and the selector off."""
    cfg = DFlash2Config(
        hidden_size=s.hidden, intermediate_size=s.intermediate, num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads, head_dim=s.head_dim, num_hidden_layers=s.draft_layers,
        num_target_layers=s.target_layers, vocab_size=s.vocab, mask_token_id=s.vocab - 1, block_size=s.block_size,
        rope_theta=s.rope_theta, rms_norm_eps=s.rms_eps,
        conv_kernel_size=s.taps if dflash2 else 0, conv_group_size=s.group_size if dflash2 else 0,
        selector_rank=s.rank if dflash2 else 0, selector_top_k=s.top_k if dflash2 else 0,
    )  # fmt: skip
    with torch.device(device):
        draft = DFlash2DraftModel(cfg)
    # The conv and the successor codebook start inert (zeros); random values make the weights trained-like. The
    # time would not change: every matmul and kernel runs whatever the values.
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name.endswith(("kernel_projection.weight", "successor_codebook")):
                p.normal_(std=p.shape[-1] ** -0.5)
    return draft.to(dtype).eval().requires_grad_(False)


@dataclasses.dataclass
class DraftInputs:
    """What one draft step reads: the block, this step's new context (the last verify's B features), the cache."""

    block_ids: torch.Tensor  # [b, B] anchor then MASK
    block_positions: torch.Tensor  # [b, B]
    features: torch.Tensor  # [b, B, n*H] target features of the B slots the last verify added
    feature_positions: torch.Tensor  # [b, B]
    cache: StaticDraftCache
    anchors: torch.Tensor  # [b]
    uniforms: torch.Tensor  # [b, B-1]
    temperatures: torch.Tensor  # [b]
    greedy: torch.Tensor  # [b]


def draft_inputs(s: Shapes, target: VerifyDecoder, batch: int, context: int) -> DraftInputs:
    w = target.lm_head.weight
    device, dtype = w.device, w.dtype
    anchors = torch.randint(0, s.vocab - 1, (batch,), device=device)
    block_ids = torch.full((batch, s.block_size), s.vocab - 1, device=device)
    block_ids[:, 0] = anchors
    offsets = torch.arange(s.block_size, device=device).expand(batch, -1)
    shape = (batch, s.kv_heads, context, s.head_dim)
    layers = range(s.draft_layers)
    cache = StaticDraftCache(
        [torch.randn(shape, device=device, dtype=dtype) for _ in layers],
        [torch.randn(shape, device=device, dtype=dtype) for _ in layers],
    )
    n_features = len(target.target_layer_ids) * s.hidden
    return DraftInputs(
        block_ids=block_ids,
        block_positions=context + offsets,
        features=torch.randn(batch, s.block_size, n_features, device=device, dtype=dtype),
        feature_positions=context - s.block_size + offsets,
        cache=cache,
        anchors=anchors,
        uniforms=torch.rand(batch, s.block_size - 1, device=device),
        temperatures=torch.ones(batch, device=device),
        greedy=torch.ones(batch, dtype=torch.bool, device=device),  # temperature 0: the walk's greedy rows
    )


def draft_hidden(draft: DFlash2DraftModel, target: VerifyDecoder, x: DraftInputs) -> torch.Tensor:
    """The drafter's forward as speculative.decode_batch runs it, on the proposing slots -> [b, B-1, H].

    Two departures, both for graph capture: the context cache is static (StaticDraftCache), and no attention mask
    is passed. decode_batch's dense bool mask only hides the rejected slots its ragged cache keeps; an engine's
    cache holds none, and the mask would also take SDPA off its flash kernel.
    """
    context = draft.fuse(x.features)
    hidden = draft(target.embed_tokens(x.block_ids), x.block_positions, context, x.feature_positions, None, x.cache)
    return hidden[:, 1:]


def draft_step(draft: DFlash2DraftModel, target: VerifyDecoder, x: DraftInputs) -> torch.Tensor:
    """One greedy draft step -> proposals [b, B-1]: the calls of distributions.propose, with the walk's random
    inputs made up front (propose draws them from a torch.Generator, which a capture would have to register)."""
    hidden = draft_hidden(draft, target, x)
    selector = draft.candidate_selector
    if selector is None:
        return head_logits(hidden, target.lm_head.weight, draft.config.vocab_size).argmax(-1)
    candidates, unary = selector.compute_candidates(hidden, target.lm_head.weight)
    scores = selector.build_lattice(candidates, unary, hidden, x.anchors)
    return selector.walk(candidates, scores, x.uniforms, x.temperatures, x.greedy)[0]


def conv_sites(draft: DFlash2DraftModel, x: torch.Tensor) -> torch.Tensor:
    """Both convolutions of every layer, prepare then finish, as DecoderLayer runs them around its sublayers (a
    sublayer's output has the shape of its input, so the prepared input stands in for it)."""
    b = draft.config.block_size
    for layer in draft.layers:
        for conv in (layer.attention_conv, layer.mlp_conv):
            y, coeffs = conv.prepare(x, b)
            x = conv.finish(y, coeffs, b)
    return x


# ---------------------------------------------------------------------------------------------- one batch size
def batch_row(
    s: Shapes,
    target: VerifyDecoder,
    dflash2: DFlash2DraftModel,
    dflash: DFlash2DraftModel,
    batch: int,
    context: int,
) -> dict:
    device = target.lm_head.weight.device
    selector, head = dflash2.candidate_selector, target.lm_head.weight
    x = draft_inputs(s, target, batch, context)
    keys, values = target.new_cache(batch, context)
    verify_ids = torch.randint(0, s.vocab, (batch, s.block_size), device=device)

    # The parts run on the tensors a real step would hand them.
    hidden = draft_hidden(dflash2, target, x)
    logits = head_logits(hidden, head, s.vocab)
    candidates, unary = selector.compute_candidates(hidden, head)
    scores = selector.build_lattice(candidates, unary, hidden, x.anchors)
    block_in = torch.randn(batch, s.block_size, s.hidden, device=device, dtype=head.dtype)

    # One sanity pass (host syncs allowed here, never inside a timed piece).
    tokens = draft_step(dflash2, target, x)
    verify_logits, features = target(verify_ids, x.block_positions, keys, values)
    assert torch.isfinite(scores).all() and torch.isfinite(verify_logits).all(), "random weights overflowed"
    assert (tokens[..., None] == candidates).any(-1).all(), "the walk proposed a token outside its candidates"
    assert features.shape == x.features.shape, f"verify features {features.shape} vs drafter's {x.features.shape}"

    pieces = {
        # Under DFlash, argmax takes the top-K's place; the head matmul before it is shared, so it is not a part.
        "conv": lambda: conv_sites(dflash2, block_in),
        "topk": lambda: torch.topk(logits, s.top_k, dim=-1),
        "lattice": lambda: selector.build_lattice(candidates, unary, hidden, x.anchors),
        "walk": lambda: kernels.selector_walk(candidates, scores, x.uniforms, x.temperatures, x.greedy),
        "dflash2_draft": lambda: draft_step(dflash2, target, x),
        "dflash_draft": lambda: draft_step(dflash, target, x),
        "verify": lambda: target(verify_ids, x.block_positions, keys, values),
    }
    timed = {name: measure(f"{name} (batch {batch})", fn, device) for name, fn in pieces.items()}
    row: dict = {"batch": batch, "context": context}
    row.update({f"{name}_ms": t["ms"] for name, t in timed.items()})
    row["graph"] = {name: t["graph"] for name, t in timed.items()}
    errors = {name: t["capture_error"] for name, t in timed.items() if "capture_error" in t}
    if errors:
        row["capture_errors"] = errors
    row["parts_ms"] = sum(row[f"{p}_ms"] for p in PARTS)
    row["draft_verify_ms"] = row["dflash2_draft_ms"] + row["verify_ms"]
    row["overhead_share"] = row["parts_ms"] / row["draft_verify_ms"]
    row["differential_share"] = (row["dflash2_draft_ms"] - row["dflash_draft_ms"]) / row["draft_verify_ms"]
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/overhead.json", help="where the JSON results go")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32], help="requests per step")
    parser.add_argument("--context", type=int, help="tokens already in the KV caches (default 2048; --small: 32)")
    parser.add_argument("--small", action="store_true", help="tiny shapes (hidden 64, vocab 512): a CPU smoke test")
    args = parser.parse_args(argv)
    s = SMALL if args.small else Shapes()
    context = args.context or (32 if args.small else 2048)
    if context < s.block_size:
        parser.error(f"--context {context} must hold at least one block ({s.block_size} tokens)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16
    torch.manual_seed(0)
    ids = default_target_layer_ids(s.target_layers, s.draft_layers)
    with torch.no_grad():
        target = VerifyDecoder(s, ids, device, dtype).eval().requires_grad_(False)
        dflash2 = build_drafter(s, True, device, dtype)
        dflash = build_drafter(s, False, device, dtype)
        rows = []
        for batch in args.batch:
            rows.append(batch_row(s, target, dflash2, dflash, batch, context))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the next batch size's caches need the room
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "timer": "cuda_graph" if device.type == "cuda" else "cpu_wall",
        "kernel_backend": kernels.get_backend(),
        "shapes": dataclasses.asdict(s),
        "target_layer_ids": ids,
        "rows": rows,
    }
    if device.type == "cuda":
        import triton

        result["triton"] = triton.__version__
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"{result['device']}, torch {torch.__version__}, timer {result['timer']}")
    print(f"context {context} tokens, B = {s.block_size}, K = {s.top_k}, hidden {s.hidden}, vocab {s.vocab}")
    print("\nDFlash2-only parts of one draft step (ms)")
    print_table(rows, ["batch", *(f"{p}_ms" for p in PARTS), "parts_ms"], min_width=8)
    print("\nwhole steps (ms) and DFlash2's share of draft + verify")
    print_table(rows, ["batch", *(f"{p}_ms" for p in STEPS), "overhead_share", "differential_share"], min_width=8)
    eager = sorted({name for row in rows for name, g in row["graph"].items() if not g})
    if device.type == "cuda" and eager:
        print(f"\nWARNING: not captured in a CUDA graph, timed eagerly: {', '.join(eager)}")
    print(f"\nwrote {out}")
    return result


if __name__ == "__main__":
    main()
