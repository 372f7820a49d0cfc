"""The layer-kind registry: what each kind of layer builds, which pool tensors it owns, and how
each architecture arranges kinds into decoder blocks (module names follow Hugging Face's).

A kind's mixer has two entry points with one signature shape for every kind:

    prefill(module, x, batch, state, kernels)  # the next tokens of each sequence (x (T, hidden),
                                               # rows per `batch.segments`), on top of earlier ones
    decode(module, x, batch, state, kernels)  # one token per request (x (R, hidden))

where `state` is the tuple of the layer's slices of the pool tensors the kind declares
(`KindSpec.state`: attention ("k", "v"), mamba ("conv", "ssm"), gdn ("gdn_conv", "gdn_state"),
stateless kinds ()). Adding a kind means one entry here and its state tensors in
`ModelConfig.state_tensors`; pools, snapshots and the engine need no change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import Tensor, nn

from actors.attention import Attention
from actors.config import ModelConfig
from actors.ffn import GraniteMoE, GraniteSharedMLP, NemotronMoE, QwenNextMoE, ReluSquaredMLP, SwiGLU
from actors.gdn import GatedDeltaNet, GatedDeltaNetNext
from actors.mamba import Kernels, MambaMixer

Call = Callable[[nn.Module, Tensor, Any, tuple[Tensor, ...], Kernels], Tensor]


@dataclass(frozen=True)
class KindSpec:
    state: tuple[str, ...]  # pool tensor names this kind reads and writes
    build: Callable[[ModelConfig, torch.dtype], nn.Module]
    prefill: Call
    decode: Call


def _feed_forward(module: nn.Module, x: Tensor, _batch: Any, _state: tuple, kernels: Kernels) -> Tensor:
    return module(x, kernels)


def _mlp(config: ModelConfig, dtype: torch.dtype) -> nn.Module:
    if config.mlp_activation == "relu2":
        return ReluSquaredMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype)
    return SwiGLU(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype)


KINDS: dict[str, KindSpec] = {
    "attention": KindSpec(
        ("k", "v"), Attention,
        lambda m, x, b, st, kn: m.prefill(x, b.positions, b.out_slots, b.segments, st[0], st[1], kn),
        lambda m, x, b, st, kn: m.decode(x, b.positions, st[0], st[1], b.out_slots, b.kv_table, kn)),
    "mamba": KindSpec(
        ("conv", "ssm"), MambaMixer,
        lambda m, x, b, st, kn: m.prefill(x, b.segments, st[0], st[1], kn),
        lambda m, x, b, st, kn: m.decode(x, st[0], st[1], b.mamba_slots, kn, b.mamba_run)),
    "gdn": KindSpec(
        ("gdn_conv", "gdn_state"),
        lambda c, dtype: (GatedDeltaNetNext if c.architecture == "qwen3_next" else GatedDeltaNet)(c, dtype),
        lambda m, x, b, st, kn: m.prefill(x, b.segments, st[0], st[1], kn),
        lambda m, x, b, st, kn: m.decode(x, st[0], st[1], b.mamba_slots, kn, b.mamba_run)),
    "mlp": KindSpec((), _mlp, _feed_forward, _feed_forward),
    "moe": KindSpec((), NemotronMoE, _feed_forward, _feed_forward),
}


@dataclass(frozen=True)
class Layout:
    """How an architecture names and arranges a decoder block.

    Two-sublayer blocks: h += mixer(norm1(h)) * r;  h += sum(ffn parts)(norm2(h)) * r.
    One-sublayer blocks (NemotronH): h += mixer(norm(h)), the mixer being any kind.
    """

    prefix: str  # Hugging Face name prefix of the backbone
    renames: dict[str, str]  # our top-level module name -> Hugging Face's
    mixer_names: dict[str, str]  # kind -> attribute name of the mixer
    norm_names: tuple[str, ...]  # (pre-mixer,) or (pre-mixer, pre-ffn)
    ffn_names: tuple[str, ...] = ()  # feed-forward parts, summed in this order


LAYOUTS: dict[str, Layout] = {
    "bamba": Layout("model.", {}, {"attention": "self_attn", "mamba": "mamba"},
                    ("input_layernorm", "pre_ff_layernorm"), ("feed_forward",)),
    "granitemoehybrid": Layout("model.", {"final_layernorm": "norm"},
                               {"attention": "self_attn", "mamba": "mamba"},
                               ("input_layernorm", "post_attention_layernorm"),
                               ("block_sparse_moe", "shared_mlp")),
    "nemotron_h": Layout("backbone.", {"embed_tokens": "embeddings", "final_layernorm": "norm_f"},
                         {k: "mixer" for k in ("attention", "mamba", "mlp", "moe")}, ("norm",)),
    "qwen3_5_text": Layout("model.", {"final_layernorm": "norm"},
                           {"attention": "self_attn", "gdn": "linear_attn"},
                           ("input_layernorm", "post_attention_layernorm"), ("mlp",)),
    "qwen3_next": Layout("model.", {"final_layernorm": "norm"},
                         {"attention": "self_attn", "gdn": "linear_attn"},
                         ("input_layernorm", "post_attention_layernorm"), ("mlp",)),
}


def build_ffn(config: ModelConfig, name: str, dtype: torch.dtype, layer_id: int) -> nn.Module | None:
    """One feed-forward part of a two-sublayer block (None: absent in this config)."""
    if config.architecture == "qwen3_next" and config.is_moe_layer(layer_id):
        return QwenNextMoE(config, dtype)
    if name == "block_sparse_moe":
        return GraniteMoE(config, dtype) if config.has_experts else None
    if name == "shared_mlp":
        return GraniteSharedMLP(config, dtype)
    return SwiGLU(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype)
