"""Tiny seeded transformers checkpoints of the non-Bamba architectures (the parity references).

Each builder saves a `save_pretrained` checkpoint (fp32, safetensors) with every 1-D weight
perturbed away from its init (norms, A_log, dt_bias, D, biases, the router's correction bias)
and returns its directory. transformers is imported here (tests only).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.hf_reference import _perturb

COMMON = dict(vocab_size=256, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              initializer_range=0.1, eos_token_id=None, bos_token_id=None, pad_token_id=None)


def _granite(n: int):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    kinds = ["linear_attention", "full_attention", "linear_attention", "linear_attention"][:n]
    cfg = GraniteMoeHybridConfig(
        **COMMON, intermediate_size=16, num_hidden_layers=len(kinds), layer_types=kinds,
        mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=24,
        position_embedding_type="rope", embedding_multiplier=1.5, residual_multiplier=0.7,
        attention_multiplier=0.3, logits_scaling=0.8)
    return cfg, GraniteMoeHybridForCausalLM


def _nemotronh(n: int):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    kinds = ["linear_attention", "moe", "full_attention", "mlp", "linear_attention"][:n]
    cfg = NemotronHConfig(
        **COMMON, layers_block_type=kinds, head_dim=8, intermediate_size=48, mamba_num_heads=4,
        mamba_head_dim=16, n_groups=2, ssm_state_size=8, chunk_size=8, n_routed_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
        routed_scaling_factor=1.3)
    return cfg, NemotronHForCausalLM


def _qwen35(n: int):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        **COMMON, intermediate_size=48, num_hidden_layers=n, head_dim=16,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4)
    return cfg, Qwen3_5ForCausalLM


def _qwen3next(n: int):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(
        **COMMON, intermediate_size=48, num_hidden_layers=n, head_dim=16,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, mlp_only_layers=[1])
    return cfg, Qwen3NextForCausalLM


BUILDERS = {"granitemoehybrid": _granite, "nemotron_h": _nemotronh, "qwen3_5_text": _qwen35,
            "qwen3_next": _qwen3next}
NUM_LAYERS = {"granitemoehybrid": 4, "nemotron_h": 5, "qwen3_5_text": 4, "qwen3_next": 4}


def make_hf_arch(tmp_path: Path, arch: str, seed: int) -> Path:
    """Save a seeded random transformers model of `arch` under tmp_path; return its directory."""
    config, cls = BUILDERS[arch](NUM_LAYERS[arch])
    torch.manual_seed(seed)
    model = cls(config).eval()
    _perturb(model, seed)
    path = Path(tmp_path) / f"{arch}_s{seed}"
    model.save_pretrained(path, safe_serialization=True)
    return path
