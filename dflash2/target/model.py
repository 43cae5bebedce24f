"""The frozen target: a transformers causal LM whose chosen layers feed the drafter's context.

Only the hidden states of `target_layer_ids` are kept (forward hooks), never the whole
`output_hidden_states` stack: at 3k tokens and 36 layers that stack is most of the memory of a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash2.target.attention import NAME as GROUPED_SDPA
from dflash2.target.attention import use_grouped_sdpa
from dflash2.target.chat_template import KWARGS_KEY, check_chat_template_kwargs
from dflash2.target.inherited import dense_head_weight, draft_config_fields
from dflash2.target.locate import target_source
from dflash2.target.static_cache import TargetStaticCache, reused

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def compiled_step(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
    """`fn` under torch.compile `mode`, as a decode step runs: whole (`fullgraph`: a graph break would split the CUDA
    graph, so it fails loudly instead) and with fixed shapes (`dynamic=False`, each new shape a compile). Under a
    CUDA-graph mode each call starts a new step of the graphs, so its outputs live until the next call."""
    compiled = torch.compile(fn, mode=mode, dynamic=False, fullgraph=True)

    def step(*args: Any) -> Any:
        if mode in CUDA_GRAPH_MODES:
            torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args)

    return step


def compile_mode(value: bool | str | None) -> str | None:
    """`model.compile` as a torch.compile mode: false (or null) = eager, true = "default", or a mode by name.
    reduce-overhead adds CUDA graphs, one per batch shape, which `data.pad_to_multiple_of` keeps to a few dozen."""
    if value is None or value is False:
        return None
    if value is True:
        return "default"
    if value in COMPILE_MODES:
        return str(value)
    modes = ", ".join(COMPILE_MODES)
    raise ValueError(f"model.compile={value!r}: set it to true, false or one of torch.compile's modes ({modes})")


def resolve_device(name: str | torch.device | None) -> torch.device:
    """A `device` setting: auto (or null) = the GPU when there is one, else the CPU."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


@dataclasses.dataclass
class TargetOutput:
    logits: torch.Tensor | None  # [b, L, V], None when called with logits=False
    hidden: torch.Tensor | None  # [b, L, n*H], captured layers concatenated in target_layer_ids order
    past_key_values: Any = None
    final_hidden: torch.Tensor | None = None  # [b, L, H] after the final norm (the head's input), with final=True


class _StopForward(Exception):
    """Raised by the deepest hook when nothing after it is needed (no logits, no cache)."""


@dataclasses.dataclass(frozen=True)
class TargetSettings:
    """The `model` group's settings of a target (configs/model/*.yaml). `attn_implementation`: None = transformers'
    SDPA with the query heads of each key/value head folded together (`grouped_sdpa`, dflash2/target/attention.py);
    any name transformers knows (sdpa, eager, flash_attention_2...). `compile`: torch.compile the layers for the
    training features (`compile_mode`). `chat_template_kwargs`: the chat template's extra arguments the target is
    chatted with (`dflash2.target.chat_template`)."""

    name: str | None = None
    gguf_file: str | None = None
    target_layer_ids: list[int] | None = None
    dtype: str | torch.dtype | None = "auto"
    attn_implementation: str | None = None
    compile: bool | str | None = False
    mask_token_id: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TargetModel(nn.Module):
    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        target_layer_ids: list[int] | None = None,
        compile_features: bool | str = False,
        name: str | None = None,
        mask_token_id: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        # How this target is chatted with: its chat template's extra arguments (`model.chat_template_kwargs`).
        self.chat_template_kwargs = check_chat_template_kwargs(chat_template_kwargs, f"model.{KWARGS_KEY}") or {}
        # What the model group calls this target, and the id its drafters fill their slots with (a token the chat
        # template never produces: a drafter needs one set explicitly, and `draft.mask_token_id` null takes this one).
        self.name, self.mask_token_id = name, mask_token_id
        self.config = model.config
        # A target loaded without its decoder layers (`load(layers=False)`) keeps its depth in its config.
        self.num_layers = len(self.layers) or int(self.config.num_hidden_layers)
        self.vocab_size, self.hidden_size = self.embed_tokens.weight.shape
        dense_head_weight(model, self.hidden_size)  # refuse a quantized head now, not at the first step
        self.target_layer_ids = [int(i) for i in target_layer_ids or []]
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids: {bad} out of range [0, {self.num_layers - 1}] for this target "
                f"(id i is the output of decoder layer i)"
            )
        self._captured: dict[int, torch.Tensor] = {}
        self._capturing = False
        self._stop_after: int | None = None
        self.compile_features = compile_features  # model.compile; see `compiled_layers`
        self._compiled_forwards: tuple[str, list[Any]] | None = None  # (mode, one compiled forward per layer)
        self._static_caches: dict[tuple[int, int], TargetStaticCache] = {}  # the fast decode path's, by shape
        self._decode_steps: dict[str, Any] = {}  # torch.compile mode -> the compiled `_decode_step`
        # transformers 5.2x renamed `past_key_values` to `cache` (older 5.x only knows the former).
        params = inspect.signature(model.base_model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # transformers replaces hidden_states[-1] by the final-normed output, so the last layer's id is read
        # after the final norm, to keep "id i == hidden_states[i + 1]" exact for every i.
        final = getattr(model.base_model, "norm", None)
        layers = list(self.layers)  # none when loaded without them: nothing to capture, the forward refuses
        for i in sorted(set(self.target_layer_ids)) if layers else ():
            module = (layers[-1] if final is None else final) if i == self.num_layers - 1 else layers[i]
            module.register_forward_hook(self._make_hook(i))

    @property
    def compile_features(self) -> str | None:
        """The torch.compile mode of the training features' layers (None = eager), as `compile_mode` reads it."""
        return self._compile_mode

    @compile_features.setter
    def compile_features(self, value: bool | str | None) -> None:
        self._compile_mode = compile_mode(value)

    # Views into the wrapped model, not attributes: a second registration would duplicate them in state_dict.
    @property
    def layers(self) -> nn.ModuleList:
        return self.model.base_model.layers

    def drop_layers(self) -> None:
        """Free the decoder layers (their memory, on the device above all): training from a feature cache
        (data.features) reads only the embedding and head. The forward refuses to run from then on."""
        self.model.base_model.layers = nn.ModuleList()

    @property
    def embed_tokens(self) -> nn.Module:
        return self.model.get_input_embeddings()

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return dense_head_weight(self.model, self.hidden_size)

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(
        cls, path: str | None = None, *, device: str | torch.device = "cpu", layers: bool = True, **settings: Any
    ) -> TargetModel:
        """Load by hub id, local folder, GGUF file or None (the embedded SmolLM2) with the `model` group's settings
        (`TargetSettings`); what the group builds (configs/model/*.yaml, `dflash2.commands.build(cfg.model,
        target_layer_ids=..., device=...)`). `layers=False`: only the embedding, final norm and head are read from the
        weights, no decoder layer (training from a feature cache, data.features); the forward then refuses to run."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        s = TargetSettings(**settings)
        chat_template_kwargs = check_chat_template_kwargs(s.chat_template_kwargs, f"model.{KWARGS_KEY}")  # first
        path, kwargs = target_source(path, s.gguf_file)
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        if layers:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=_dtype(s.dtype, "auto"), **kwargs)
        else:
            model = _without_layers(path, _dtype(s.dtype, "auto"), kwargs)
        if s.attn_implementation in (None, GROUPED_SDPA):
            use_grouped_sdpa(model)
        elif s.attn_implementation != model.config._attn_implementation:
            model.set_attn_implementation(s.attn_implementation)
        return cls(
            model.to(device), tokenizer, s.target_layer_ids, s.compile or False, s.name, s.mask_token_id,
            chat_template_kwargs,
        )  # fmt: skip

    # ------------------------------------------------------------------ forward
    def _make_hook(self, layer_id: int):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if self._capturing:
                self._captured[layer_id] = output[0] if isinstance(output, tuple) else output
                if layer_id == self._stop_after:
                    raise _StopForward

        return hook

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = False,
        logits: bool = True,
        logits_at: torch.Tensor | None = None,
        final: bool = False,
    ) -> TargetOutput:
        """`logits_at` [b]: only each row's logits at that position ([b, V]); a prefill needs no more, and the
        full [b, L, V] tensor of a long prompt at a 150k vocabulary is gigabytes.

        `final` (with logits=False): also the final normed hidden state at every position, which soft-label
        distillation turns into the target's distributions one chunk of rows at a time, never as [b, L, V]."""
        if final and logits:
            raise ValueError("final=True returns the head's input instead of the logits: call it with logits=False")
        if not len(self.layers):
            raise RuntimeError(
                "the target was loaded without its layers (data.features): its features come from the cache"
            )
        inputs = dict(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache
        )
        if past_key_values is not None:
            inputs[self._cache_arg] = past_key_values
        if logits_at is not None:
            keep = torch.unique(logits_at)  # sorted; the model's own head (softcapping etc.) runs on these only
            inputs["logits_to_keep"] = keep
        # Training wants features only: skip the head, and the layers after the deepest captured one (unless the
        # final hidden state is wanted too).
        features = not logits and not use_cache and (bool(self.target_layer_ids) or final)
        self._stop_after = max(self.target_layer_ids) if features and not final else None
        self._captured.clear()
        self._capturing = True
        out = None
        try:
            with self.compiled_layers(features and input_ids.is_cuda):
                out = self.model(**inputs) if logits else self.model.base_model(**inputs)
        except _StopForward:
            pass
        finally:
            self._capturing = False
        hidden = torch.cat([self._captured[i] for i in self.target_layer_ids], -1) if self.target_layer_ids else None
        self._captured.clear()
        out_logits = out.logits if logits and out is not None else None
        if out_logits is not None and logits_at is not None:
            rows = torch.arange(out_logits.shape[0], device=out_logits.device)
            out_logits = out_logits[rows, torch.searchsorted(keep, logits_at)]
        return TargetOutput(
            logits=out_logits,
            hidden=hidden,
            past_key_values=out.get(self._cache_arg) if out is not None else None,
            final_hidden=out.last_hidden_state if final else None,
        )

    @contextlib.contextmanager
    def compiled_layers(self, on: bool = True) -> Iterator[None]:
        """Every decoder layer's forward under torch.compile while the block runs (`compile_features`: the training
        features, on CUDA): eagerly, a small target's forward is bound by launching its many small kernels. Per layer
        rather than the whole model, so that the layer loop, the stop after the deepest captured layer, the hooks and
        transformers' mask logic stay eager (compiled whole, transformers materialises a dense mask that keeps SDPA
        off its flash kernels); the layers share one graph. Under a CUDA-graph mode every layer call is one replay, and
        each forward starts a new step of the graphs: the features it returns are copies, not the graphs' buffers."""
        mode = self.compile_features
        if not on or mode is None:
            yield
            return
        if self._compiled_forwards is None or self._compiled_forwards[0] != mode:
            compiled = [torch.compile(layer.forward, dynamic=True, mode=mode) for layer in self.layers]
            self._compiled_forwards = (mode, compiled)
        if mode in CUDA_GRAPH_MODES:
            torch.compiler.cudagraph_mark_step_begin()
        for layer, forward in zip(self.layers, self._compiled_forwards[1], strict=True):
            layer.forward = forward  # an instance attribute: it shadows the class's forward until deleted below
        try:
            yield
        finally:
            for layer in self.layers:
                del layer.forward

    # ------------------------------------------------------------------ the fast decode path (decode=static)
    def static_cache(self, batch: int, capacity: int) -> TargetStaticCache:
        """An empty `TargetStaticCache` of `capacity` slots for `batch` rows (allocated by the first forward into it),
        the same one for the same shape (`reused`). The last two shapes are kept: the drafter's run and the target
        alone alternate in evaluate.py, and their capacities may differ."""
        return reused(self._static_caches, (batch, capacity), lambda: TargetStaticCache(self.config, capacity))

    def decode_step(self, mode: str | None = None) -> Any:
        """The forward of a decode step over a `static_cache`: `step(input_ids, attention_mask, position_ids, cache)`
        -> TargetOutput (logits of every position, captured hidden states), eager or under torch.compile `mode`.

        Compiled by `compiled_step`: a decode step's shapes are fixed by its batch's rows, the cache's capacity and the
        block, and the cache's buffers (static addresses) would pin their sizes anyway; each new shape is a compile."""

        def step(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any) -> TargetOutput:
            logits, hidden = forward(ids, mask, positions, cache)
            cache.length += ids.shape[1]
            return TargetOutput(logits=logits, hidden=hidden, past_key_values=cache)

        forward = self._decode_step
        if mode is not None:
            if mode not in self._decode_steps:
                self._decode_steps[mode] = compiled_step(self._decode_step, mode)
            forward = self._decode_steps[mode]
        return step

    def _decode_step(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = self.forward(ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True)
        return out.logits, out.hidden

    def train(self, mode: bool = True) -> TargetModel:
        # Lightning calls .train() on the whole module tree; the target must stay in eval (no dropout).
        return super().train(False)

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a reply: the tokenizer's eos and every eos of the generation config."""
        generation = getattr(self.model, "generation_config", None)
        eos = getattr(generation, "eos_token_id", None)
        return sorted({self.tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None})

    # ------------------------------------------------------------------ what the drafter inherits
    def draft_config_fields(self) -> dict[str, Any]:
        return draft_config_fields(self.config, self.hidden_size, self.vocab_size, self.num_layers)

    @property
    def source(self) -> str:
        """Where the weights came from, as an engine can load them: a hub id or an absolute local folder (for a GGUF,
        its dequantized copy); the bare name for the in-memory tiny test target."""
        name = self.config._name_or_path
        return str(Path(name).expanduser().absolute()) if name and Path(name).expanduser().is_dir() else name


# ---------------------------------------------------------------------- helpers
def _without_layers(path: str, dtype: Any, kwargs: dict[str, Any]) -> nn.Module:
    """The causal LM at `path` built with no decoder layer, so that transformers reads none of their weights (they are
    left unexpected in the files, on purpose); its config then gets the target's depth back, so that the target's
    identity (`dflash2.target.manifest.target_identity`) is the one a full load gives."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(path, **kwargs)
    depth = {"num_hidden_layers": config.num_hidden_layers}
    if isinstance(getattr(config, "layer_types", None), list):  # one entry per layer, where the config has them
        depth["layer_types"] = config.layer_types
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report would list every layer's weights as unexpected
    try:
        shallow = {key: [] if key == "layer_types" else 0 for key in depth}
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **shallow, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    for key, value in depth.items():
        setattr(model.config, key, value)
    return model


def _dtype(dtype: str | torch.dtype | None, default: Any) -> Any:
    if dtype in (None, "auto"):
        return default
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype))
