"""Model hyper-parameters of a Bamba-style hybrid (Mamba2 + attention) language model.

`ModelConfig` mirrors the fields of Hugging Face's `BambaConfig` that change the computation,
under the same names, so a checkpoint's `config.json` maps onto it one to one
(`ModelConfig.from_hf_dict`). Derived sizes are properties. Built-in presets live in
`actors.presets`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("BambaForCausalLM",)


class ConfigError(ValueError):
    """A model configuration (or checkpoint config.json) is invalid; the message names the key."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # SwiGLU MLP width
    num_hidden_layers: int
    attn_layer_indices: tuple[int, ...]  # global ids of attention layers; all others are Mamba2
    num_attention_heads: int
    num_key_value_heads: int
    mamba_n_heads: int
    mamba_d_head: int
    mamba_n_groups: int
    mamba_d_state: int
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = 262144
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    eos_token_id: int | None = None
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        self._validate()

    # ---------------------------------------------------------------- derived sizes
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_expand * self.hidden_size

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: x, B and C."""
        return self.mamba_intermediate + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def in_proj_dim(self) -> int:
        """in_proj output, ordered [z | x | B | C | dt]."""
        return self.mamba_intermediate + self.conv_dim + self.mamba_n_heads

    @property
    def layer_types(self) -> tuple[str, ...]:
        attn = set(self.attn_layer_indices)
        return tuple("attention" if i in attn else "mamba" for i in range(self.num_hidden_layers))

    @property
    def mamba_layer_indices(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mamba")

    @property
    def num_attention_layers(self) -> int:
        return len(self.attn_layer_indices)

    @property
    def num_mamba_layers(self) -> int:
        return self.num_hidden_layers - len(self.attn_layer_indices)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """K and V of every attention layer for one token."""
        return 2 * self.num_attention_layers * self.num_key_value_heads * self.head_dim * itemsize

    def mamba_bytes_per_slot(self, itemsize: int) -> int:
        """Conv state (model dtype) + SSM state (fp32) of every Mamba layer for one request."""
        conv = self.conv_dim * (self.mamba_d_conv - 1) * itemsize
        ssm = self.mamba_n_heads * self.mamba_d_head * self.mamba_d_state * 4
        return self.num_mamba_layers * (conv + ssm)

    def fingerprint(self) -> str:
        """Stable hash of the computation-relevant fields (not the display name)."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "name"}
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    # ---------------------------------------------------------------- validation
    def _validate(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "mamba_n_heads", "mamba_d_head",
                    "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_chunk_size",
                    "mamba_expand", "max_position_embeddings")
        for key in positive:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model config: {key} must be a positive integer, got {value!r}")
        bad = [i for i in self.attn_layer_indices if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ConfigError(f"model config: attn_layer_indices {bad} outside 0..{self.num_hidden_layers - 1}")
        if len(set(self.attn_layer_indices)) != len(self.attn_layer_indices):
            raise ConfigError("model config: attn_layer_indices has duplicates")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError("model config: num_attention_heads must divide hidden_size")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("model config: num_key_value_heads must divide num_attention_heads")
        if self.mamba_n_heads * self.mamba_d_head != self.mamba_intermediate:
            raise ConfigError("model config: mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size")
        if self.mamba_n_heads % self.mamba_n_groups:
            raise ConfigError("model config: mamba_n_groups must divide mamba_n_heads")
        if self.rotary_dim % 2:
            raise ConfigError("model config: rotary dimension (head_dim * partial_rotary_factor) must be even")

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "checkpoint") -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict of a `BambaForCausalLM`."""
        archs = d.get("architectures") or [d.get("model_type", "?")]
        if "BambaForCausalLM" not in archs and d.get("model_type") != "bamba":
            raise ConfigError(f"unsupported architecture {archs}; supported: {list(SUPPORTED_ARCHITECTURES)}")
        hidden, n_heads = d.get("hidden_size", 4096), d.get("num_attention_heads", 32)
        expand, m_heads = d.get("mamba_expand", 2), d.get("mamba_n_heads", 128)
        d_head = d.get("mamba_d_head", "auto")
        if d_head in (None, "auto"):
            d_head = expand * hidden // m_heads
        rope = d.get("rope_parameters") or {}
        limit = d.get("time_step_limit") or (0.0, math.inf)
        eos = d.get("eos_token_id")
        return cls(
            vocab_size=d.get("vocab_size", 128000), hidden_size=hidden,
            intermediate_size=d.get("intermediate_size", 14336),
            num_hidden_layers=d.get("num_hidden_layers", 32),
            attn_layer_indices=tuple(d.get("attn_layer_indices") or ()),
            num_attention_heads=n_heads,
            num_key_value_heads=d.get("num_key_value_heads") or n_heads,
            mamba_n_heads=m_heads, mamba_d_head=d_head,
            mamba_n_groups=d.get("mamba_n_groups", 1), mamba_d_state=d.get("mamba_d_state", 256),
            mamba_d_conv=d.get("mamba_d_conv", 4), mamba_expand=expand,
            mamba_chunk_size=d.get("mamba_chunk_size", 256),
            mamba_conv_bias=bool(d.get("mamba_conv_bias", True)),
            mamba_proj_bias=bool(d.get("mamba_proj_bias", False)),
            time_step_limit=(_hf_float(limit[0]), _hf_float(limit[1])),
            rms_norm_eps=d.get("rms_norm_eps", 1e-5),
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor", 0.5)),
            max_position_embeddings=d.get("max_position_embeddings", 262144),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            eos_token_id=eos[0] if isinstance(eos, list) and eos else eos,
            name=name,
        )

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` a `BambaForCausalLM` with these hyper-parameters would carry."""
        return {
            "architectures": ["BambaForCausalLM"], "model_type": "bamba",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "attn_layer_indices": list(self.attn_layer_indices),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "mamba_n_heads": self.mamba_n_heads, "mamba_d_head": self.mamba_d_head,
            "mamba_n_groups": self.mamba_n_groups, "mamba_d_state": self.mamba_d_state,
            "mamba_d_conv": self.mamba_d_conv, "mamba_expand": self.mamba_expand,
            "mamba_chunk_size": self.mamba_chunk_size, "mamba_conv_bias": self.mamba_conv_bias,
            "mamba_proj_bias": self.mamba_proj_bias,
            "time_step_limit": list(self.time_step_limit), "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.attention_bias, "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings, "eos_token_id": self.eos_token_id,
            "pad_token_id": 0, "bos_token_id": 1,
        }


def _hf_float(value: Any) -> float:
    """A float from config.json; transformers 5 writes inf as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)
