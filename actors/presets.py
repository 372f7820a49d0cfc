"""Built-in model presets with seeded random weights, and `resolve_model` (preset or checkpoint).

- `tiny`: for tests and demos, trivially fast on a CPU (~0.25M parameters).
- `small`: for benchmarks (~37M parameters, 8 layers, attention at layers 2 and 5).
- `tiny-granite`, `tiny-nemotronh`, `tiny-qwen35`: `tiny`-sized GraniteMoeHybrid (Mamba2 +
  attention, experts + shared MLP, multipliers), NemotronH (M * - E blocks) and Qwen3.5 (three
  gated-delta-net layers then one gated attention layer), `tiny-qwen3next` (the same with MoE
  feed-forwards, layer 1 dense); usable everywhere `tiny` is, and
  saved in Hugging Face layout by `save_checkpoint` (transformers loads them).

Random weights are drawn so that a greedy decode is well defined: unit-scale projections, an LM
head scaled for logits of std ~3 (wide top-1/top-2 gaps), and norms, D, dt_bias, A_log and
biases moved away from their 1/0 defaults so that a mistake in any of them changes the output.
Saving a preset with `save_preset` (HF layout, with the preset's tokenizer files) and loading it
back gives the same model. Each preset ships a small byte-level BPE tokenizer with a ChatML chat
template (`actors/tokenizers/<preset>/`, trained by `actors/tokenizers/train.py`); the weights are
random, so text output is gibberish, but every text path runs end to end.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path

import torch
from torch import Tensor

from actors.config import ModelConfig
from actors.loader import CheckpointError, hf_state_dict, load_checkpoint, load_hf_state_dict, save_checkpoint
from actors.model import HybridLM
from raysched.tokenizer import preset_tokenizer_dir

_TINY_QWEN35 = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    attn_layer_indices=(3,), num_attention_heads=4, num_key_value_heads=2,
    mamba_n_heads=1, mamba_d_head=128, mamba_n_groups=1, mamba_d_state=1,
    max_position_embeddings=8192, rms_norm_eps=1e-6, partial_rotary_factor=0.25,
    architecture="qwen3_5_text", layer_kinds=("gdn", "gdn", "gdn", "attention"),
    attention_head_dim=32, attn_output_gate=True, qk_norm=True, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    name="tiny-qwen35")

PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        attn_layer_indices=(1,), num_attention_heads=4, num_key_value_heads=2,
        mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_chunk_size=16, max_position_embeddings=8192, eos_token_id=None, name="tiny"),
    "small": ModelConfig(
        vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
        attn_layer_indices=(2, 5), num_attention_heads=8, num_key_value_heads=2,
        mamba_n_heads=16, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=64, mamba_d_conv=4,
        mamba_chunk_size=128, max_position_embeddings=65536, eos_token_id=None, name="small"),
    "tiny-granite": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        attn_layer_indices=(1,), num_attention_heads=4, num_key_value_heads=2,
        mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_chunk_size=16, max_position_embeddings=8192, rms_norm_eps=1e-6, partial_rotary_factor=1.0,
        architecture="granitemoehybrid", layer_kinds=("mamba", "attention", "mamba", "mamba"),
        attention_multiplier=0.2, embedding_multiplier=1.5, residual_multiplier=0.7,
        logits_scaling=0.8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_intermediate_size=96, name="tiny-granite"),
    "tiny-nemotronh": ModelConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
        attn_layer_indices=(2,), num_attention_heads=4, num_key_value_heads=2,
        mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_chunk_size=16, max_position_embeddings=8192, time_step_limit=(0.001, math.inf),
        architecture="nemotron_h", layer_kinds=("mamba", "moe", "attention", "mlp", "mamba"),
        attention_head_dim=16, use_rope=False, mlp_activation="relu2", num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=64, shared_intermediate_size=96,
        routed_scaling_factor=1.3, name="tiny-nemotronh"),
    "tiny-qwen35": _TINY_QWEN35,
    "tiny-qwen3next": dataclasses.replace(  # Qwen3.5's layout, with sparse experts
        _TINY_QWEN35, architecture="qwen3_next", num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, shared_intermediate_size=96, mlp_only_layers=(1,),
        name="tiny-qwen3next"),
}


def init_state_dict(config: ModelConfig, seed: int) -> dict[str, Tensor]:
    """Seeded random fp32 weights under Hugging Face Bamba names (deterministic per seed)."""
    empty = HybridLM(config, torch.float32, "meta")
    shapes = {n: tuple(p.shape) for n, p in hf_state_dict(empty).items()}
    gen = torch.Generator().manual_seed(seed)
    return {name: _init_tensor(name, shapes[name], config, gen) for name in sorted(shapes)}


def _init_tensor(name: str, shape: tuple[int, ...], config: ModelConfig,
                 gen: torch.Generator) -> Tensor:
    """One tensor, drawn by what its name says it is."""
    def uniform(lo: float, hi: float) -> Tensor:
        return lo + (hi - lo) * torch.rand(shape, generator=gen)

    def normal(std: float) -> Tensor:
        return std * torch.randn(shape, generator=gen)

    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):  # Qwen3.5's / Qwen3-Next's norms scale by (1 + w)
        offset = config.architecture in ("qwen3_5_text", "qwen3_next") and "linear_attn" not in name
        return uniform(-0.2, 0.2) if offset else uniform(0.8, 1.2)
    if leaf == "A_log":
        return uniform(1.0, 16.0).log()  # A in [-16, -1]
    if leaf == "D":
        return uniform(0.5, 1.5)
    if leaf == "dt_bias":
        dt = torch.exp(uniform(math.log(1e-3), math.log(1e-1)))  # softplus(dt_bias) in [1e-3, 0.1]
        return dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    if leaf in ("bias", "e_score_correction_bias"):
        return normal(0.1)
    return normal(_weight_std(name, shape, config))


def _weight_std(name: str, shape: tuple[int, ...], config: ModelConfig) -> float:
    if "embed_tokens" in name:
        return 1.0
    if name.startswith("lm_head"):
        return 3.0 / math.sqrt(config.hidden_size)
    fan_in = shape[-1] if len(shape) == 3 and shape[1] != 1 else math.prod(shape[1:])  # experts (E, out, in)
    return 1.0 / math.sqrt(fan_in)  # unit-scale output for unit-scale input


def load_preset(name: str, dtype: torch.dtype, device: torch.device | str = "cpu",
                seed: int = 0) -> tuple[HybridLM, ModelConfig]:
    """A preset model with seeded random weights.

    Example:
        model, config = load_preset("tiny", torch.float32, "cpu")
    """
    if name not in PRESETS:
        raise CheckpointError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    config = PRESETS[name]
    model = HybridLM(config, dtype, device)
    load_hf_state_dict(model, init_state_dict(config, seed))
    return model, config




def save_preset(name: str, path: str | Path, seed: int = 0) -> Path:
    """Write a preset as a Hugging Face checkpoint directory: config.json, model.safetensors and
    the preset's tokenizer files (tokenizer.json, tokenizer_config.json). Returns the directory."""
    if name not in PRESETS:
        raise CheckpointError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    root = save_checkpoint(path, PRESETS[name], init_state_dict(PRESETS[name], seed))
    for file in sorted(preset_tokenizer_dir(name).glob("*.json")):
        shutil.copyfile(file, root / file.name)
    return root


def resolve_model(spec: str, dtype: torch.dtype,
                  device: torch.device | str = "cpu") -> tuple[HybridLM, ModelConfig]:
    """A preset name (seed 0) or a checkpoint directory -> (model, config)."""
    if spec in PRESETS:
        return load_preset(spec, dtype, device)
    if Path(spec).is_dir():
        return load_checkpoint(spec, dtype, device)
    raise CheckpointError(f"model {spec!r} is neither a preset ({', '.join(PRESETS)}) "
                          f"nor a checkpoint directory")
