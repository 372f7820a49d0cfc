"""Model hyper-parameters of a hybrid language model: Bamba, GraniteMoeHybrid, NemotronH, Qwen3.5.

`ModelConfig` mirrors the fields of Hugging Face's `BambaConfig` that change the computation,
under the same names, plus the fields the other architectures add (`architecture`,
`layer_kinds`, experts, multipliers, gated-delta-net sizes). `ModelConfig.from_hf_dict` reads a
checkpoint's `config.json` of any supported architecture (one reader per architecture, every
problem a `ConfigError` naming the key); derived sizes are properties.

Layer kinds (`layer_types`, one per layer): "attention" (K/V state), "mamba" (conv + SSM state),
"gdn" (gated delta net: conv + recurrent state), "mlp" and "moe" (no state). Each kind declares
its per-request state tensors (`StateTensor`); pools and snapshots are built from that list only.
Built-in presets live in `actors.presets`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = {  # HF architecture -> our architecture name (= HF model_type)
    "BambaForCausalLM": "bamba",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "NemotronHForCausalLM": "nemotron_h",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3NextForCausalLM": "qwen3_next",
}
LAYER_KINDS = ("attention", "mamba", "gdn", "mlp", "moe")
_RECURRENT_KINDS = {"bamba": ("mamba",), "granitemoehybrid": ("mamba",), "nemotron_h": ("mamba",),
                    "qwen3_5_text": ("gdn",), "qwen3_next": ("gdn",)}


@dataclass(frozen=True)
class StateTensor:
    """One per-request state tensor of a layer kind: `shape` per layer, fp32 or model dtype."""

    name: str  # unique over all kinds: pool attribute and snapshot part name
    kind: str  # the layer kind holding it
    shape: tuple[int, ...]
    fp32: bool


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
    # ---- beyond Bamba (defaults keep a Bamba config exactly as it was)
    architecture: str = "bamba"
    layer_kinds: tuple[str, ...] = ()  # one per layer; empty: from attn_layer_indices (Bamba)
    attention_head_dim: int | None = None  # None: hidden_size // num_attention_heads
    use_rope: bool = True
    attention_multiplier: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_output_gate: bool = False  # Qwen3.5: q_proj also yields a sigmoid gate per channel
    qk_norm: bool = False  # Qwen3.5: RMSNorm over each head of q and k
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    mlp_activation: str = "silu"  # silu (SwiGLU) | relu2 (NemotronH's plain MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    linear_chunk_size: int = 64  # chunk of the gated delta net's chunked prefill
    decoder_sparse_step: int = 1  # Qwen3-Next: MoE feed-forward on layers (i + 1) % step == 0
    mlp_only_layers: tuple[int, ...] = ()  # Qwen3-Next: dense SwiGLU on these layers
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        self._validate()

    # ---------------------------------------------------------------- derived sizes
    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def attention_scale(self) -> float:
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return self.head_dim ** -0.5

    @property
    def gdn_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def gdn_conv_dim(self) -> int:
        """Channels of the gated delta net's causal conv: q, k and v."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

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
        if self.layer_kinds:
            return self.layer_kinds
        attn = set(self.attn_layer_indices)
        return tuple("attention" if i in attn else "mamba" for i in range(self.num_hidden_layers))

    def layers_of_kind(self, kind: str) -> tuple[int, ...]:
        """Global ids of the layers of one kind, in order (a layer's index in its kind's pool)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == kind)

    @property
    def mamba_layer_indices(self) -> tuple[int, ...]:
        return self.layers_of_kind("mamba")

    @property
    def state_tensors(self) -> tuple[StateTensor, ...]:
        """Per-request state of the architecture's recurrent kinds (K/V is paged separately).

        Listed for every recurrent kind of the architecture, even one with no layers here (its
        tensors then have zero layers), so every config of an architecture has the same parts.
        """
        specs = {
            "mamba": (StateTensor("conv", "mamba", (self.conv_dim, self.mamba_d_conv - 1), False),
                      StateTensor("ssm", "mamba", (self.mamba_n_heads, self.mamba_d_head,
                                                   self.mamba_d_state), True)),
            "gdn": (StateTensor("gdn_conv", "gdn", (self.gdn_conv_dim, self.linear_conv_kernel_dim - 1),
                                False),
                    StateTensor("gdn_state", "gdn", (self.linear_num_value_heads, self.linear_key_head_dim,
                                                     self.linear_value_head_dim), True)),
        }
        return tuple(t for kind in _RECURRENT_KINDS[self.architecture] for t in specs[kind])

    @property
    def num_attention_layers(self) -> int:
        return len(self.attn_layer_indices)

    @property
    def num_mamba_layers(self) -> int:
        return self.num_hidden_layers - len(self.attn_layer_indices)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """K and V of every attention layer for one token."""
        return 2 * self.num_attention_layers * self.num_key_value_heads * self.head_dim * itemsize

    def state_bytes_per_slot(self, itemsize: int) -> int:
        """Recurrent state of one request (every state tensor of every layer; the name is kept
        from the Mamba-only days): conv states in the model dtype, SSM/recurrent states fp32."""
        total = 0
        for t in self.state_tensors:
            total += len(self.layers_of_kind(t.kind)) * math.prod(t.shape) * (4 if t.fp32 else itemsize)
        return total

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
        if self.architecture in ("qwen3_5_text", "qwen3_next"):  # no Mamba layers: its Mamba keys are unused
            positive = positive[:6] + ("max_position_embeddings",)
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
        self._validate_kinds()

    def _validate_kinds(self) -> None:
        if self.architecture not in _RECURRENT_KINDS:
            raise ConfigError(f"model config: architecture {self.architecture!r} is not one of "
                              f"{sorted(_RECURRENT_KINDS)}")
        kinds = self.layer_types
        if len(kinds) != self.num_hidden_layers:
            raise ConfigError(f"model config: layer_kinds has {len(kinds)} entries for "
                              f"num_hidden_layers {self.num_hidden_layers}")
        bad = sorted({k for k in kinds if k not in LAYER_KINDS})
        if bad:
            raise ConfigError(f"model config: layer_kinds {bad} unknown; kinds: {list(LAYER_KINDS)}")
        if self.layers_of_kind("attention") != tuple(sorted(self.attn_layer_indices)):
            raise ConfigError("model config: attn_layer_indices must list the attention layers of layer_kinds")
        allowed = {"bamba": {"attention", "mamba"}, "granitemoehybrid": {"attention", "mamba"},
                   "nemotron_h": {"attention", "mamba", "mlp", "moe"},
                   "qwen3_5_text": {"attention", "gdn"}, "qwen3_next": {"attention", "gdn"}}[self.architecture]
        if set(kinds) - allowed:
            raise ConfigError(f"model config: layer_kinds {sorted(set(kinds) - allowed)} not used by "
                              f"architecture {self.architecture}")
        if self.mlp_activation not in ("silu", "relu2"):
            raise ConfigError(f"model config: mlp_activation must be silu or relu2, got {self.mlp_activation!r}")
        if self.has_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(f"model config: num_experts_per_tok must be in 1..num_experts "
                              f"({self.num_experts}), got {self.num_experts_per_tok}")
        if "gdn" in kinds:
            self._validate_gdn()

    def _validate_gdn(self) -> None:
        for key in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                    "linear_value_head_dim", "linear_conv_kernel_dim", "linear_chunk_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"model config: {key} must be a positive integer, got {value!r}")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError("model config: linear_num_key_heads must divide linear_num_value_heads")

    def is_moe_layer(self, layer_id: int) -> bool:
        """Qwen3-Next: whether layer `layer_id`'s feed-forward is the sparse MoE block."""
        return (self.has_experts and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @property
    def has_experts(self) -> bool:
        """Whether the feed-forward has routed experts (Granite's every layer, NemotronH's "moe")."""
        return self.num_experts > 0

    # ---------------------------------------------------------------- HF config.json
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], name: str = "checkpoint") -> "ModelConfig":
        """Build from a Hugging Face `config.json` dict of any supported architecture."""
        archs = d.get("architectures") or []
        known = [SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES]
        arch = known[0] if known else d.get("model_type")
        readers = {"bamba": _bamba_kwargs, "granitemoehybrid": _granite_kwargs,
                   "nemotron_h": _nemotron_kwargs, "qwen3_5_text": _qwen35_kwargs,
                   "qwen3_next": _qwen3next_kwargs}
        if arch not in readers:
            raise ConfigError(f"unsupported architecture {archs or [d.get('model_type', '?')]}; "
                              f"supported: {list(SUPPORTED_ARCHITECTURES)}")
        try:
            return cls(**readers[arch](_Reader(d)), name=name)
        except TypeError as exc:  # a value of the wrong type deep in a computation
            raise ConfigError(f"config.json: {exc}") from exc

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` a transformers model with these hyper-parameters would carry."""
        writers = {"bamba": _bamba_hf, "granitemoehybrid": _granite_hf, "nemotron_h": _nemotron_hf,
                   "qwen3_5_text": _qwen35_hf, "qwen3_next": _qwen3next_hf}
        return writers[self.architecture](self)


class _Reader:
    """Typed access to config.json keys; a wrong type is a ConfigError naming the key."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.d = d

    def int(self, key: str, default: Any) -> Any:
        value = self.d.get(key, default)
        if value is None:
            value = default
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"config.json: {key} must be an integer, got {value!r}")
        return value

    def float(self, key: str, default: float) -> float:
        value = self.d.get(key, default)
        try:
            return _hf_float(default if value is None else value)
        except (TypeError, ValueError):
            raise ConfigError(f"config.json: {key} must be a number, got {value!r}") from None

    def bool(self, key: str, default: bool) -> bool:
        value = self.d.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"config.json: {key} must be true or false, got {value!r}")
        return value

    def kinds(self, key: str, mapping: dict[str, str]) -> tuple[str, ...]:
        value = self.d.get(key)
        if not isinstance(value, list) or not value:
            raise ConfigError(f"config.json: {key} must be a non-empty list of layer types")
        bad = sorted({v for v in value if v not in mapping})
        if bad:
            raise ConfigError(f"config.json: {key} has unsupported layer types {bad}; "
                              f"supported: {sorted(mapping)}")
        return tuple(mapping[v] for v in value)

    def rope(self) -> dict[str, Any]:
        rope = self.d.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default":
            raise ConfigError(f"config.json: rope_parameters.rope_type {rope['rope_type']!r} is not "
                              "supported (only default)")
        return rope

    def eos(self) -> int | None:
        eos = self.d.get("eos_token_id")
        return eos[0] if isinstance(eos, list) and eos else eos

    def time_step_limit(self, key: str = "time_step_limit") -> tuple[float, float]:
        limit = self.d.get(key) or (0.0, math.inf)
        if not isinstance(limit, (list, tuple)) or len(limit) != 2:
            raise ConfigError(f"config.json: {key} must be [min, max], got {limit!r}")
        return (_hf_float(limit[0]), _hf_float(limit[1]))


_HF_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "full_attention": "attention",
             "attention": "attention"}


def _common(r: _Reader) -> dict[str, Any]:
    """Keys every architecture spells alike."""
    heads = r.int("num_attention_heads", 32)
    return dict(vocab_size=r.int("vocab_size", 128000), hidden_size=r.int("hidden_size", 4096),
                num_attention_heads=heads, num_key_value_heads=r.int("num_key_value_heads", heads),
                max_position_embeddings=r.int("max_position_embeddings", 262144),
                attention_bias=r.bool("attention_bias", False),
                tie_word_embeddings=r.bool("tie_word_embeddings", False), eos_token_id=r.eos())


def _mamba_hf_names(r: _Reader, hidden: int) -> dict[str, Any]:
    """Mamba2 keys under Bamba's / Granite's names."""
    expand, m_heads = r.int("mamba_expand", 2), r.int("mamba_n_heads", 128)
    d_head = r.d.get("mamba_d_head", "auto")
    d_head = expand * hidden // m_heads if d_head in (None, "auto") else r.int("mamba_d_head", 0)
    return dict(mamba_n_heads=m_heads, mamba_d_head=d_head, mamba_n_groups=r.int("mamba_n_groups", 1),
                mamba_d_state=r.int("mamba_d_state", 256), mamba_d_conv=r.int("mamba_d_conv", 4),
                mamba_expand=expand, mamba_chunk_size=r.int("mamba_chunk_size", 256),
                mamba_conv_bias=r.bool("mamba_conv_bias", True),
                mamba_proj_bias=r.bool("mamba_proj_bias", False), time_step_limit=r.time_step_limit())


def _bamba_kwargs(r: _Reader) -> dict[str, Any]:
    c = _common(r)
    rope = r.rope()
    attn = r.d.get("attn_layer_indices") or []
    if not isinstance(attn, list) or not all(isinstance(i, int) for i in attn):
        raise ConfigError(f"config.json: attn_layer_indices must be a list of integers, got {attn!r}")
    return dict(c, architecture="bamba", intermediate_size=r.int("intermediate_size", 14336),
                num_hidden_layers=r.int("num_hidden_layers", 32), attn_layer_indices=tuple(attn),
                **_mamba_hf_names(r, c["hidden_size"]), rms_norm_eps=r.float("rms_norm_eps", 1e-5),
                rope_theta=r.float("rope_theta", rope.get("rope_theta", 10000.0)),
                partial_rotary_factor=_hf_float(rope.get("partial_rotary_factor", 0.5)),
                mlp_bias=r.bool("mlp_bias", False))


def _granite_kwargs(r: _Reader) -> dict[str, Any]:
    c = _common(r)
    kinds = r.kinds("layer_types", _HF_KINDS)
    rope = r.rope()
    pos = r.d.get("position_embedding_type")
    if pos not in (None, "rope"):
        raise ConfigError(f"config.json: position_embedding_type must be null or \"rope\", got {pos!r}")
    return dict(c, architecture="granitemoehybrid", layer_kinds=kinds,
                intermediate_size=r.int("intermediate_size", 11008), num_hidden_layers=len(kinds),
                attn_layer_indices=tuple(i for i, k in enumerate(kinds) if k == "attention"),
                **_mamba_hf_names(r, c["hidden_size"]), rms_norm_eps=r.float("rms_norm_eps", 1e-6),
                rope_theta=_hf_float(rope.get("rope_theta", 10000.0)), partial_rotary_factor=1.0,
                use_rope=pos == "rope", attention_multiplier=r.float("attention_multiplier", 1.0),
                embedding_multiplier=r.float("embedding_multiplier", 1.0),
                residual_multiplier=r.float("residual_multiplier", 1.0),
                logits_scaling=r.float("logits_scaling", 1.0),
                num_experts=r.int("num_local_experts", 8),
                num_experts_per_tok=r.int("num_experts_per_tok", 2),
                moe_intermediate_size=r.int("intermediate_size", 11008),
                shared_intermediate_size=r.int("shared_intermediate_size", 1024))


_NEMOTRON_KINDS = {**_HF_KINDS, "mlp": "mlp", "moe": "moe"}
_NEMOTRON_PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def _nemotron_kwargs(r: _Reader) -> dict[str, Any]:
    c = _common(r)
    if "layers_block_type" in r.d:
        kinds = r.kinds("layers_block_type", _NEMOTRON_KINDS)
    else:
        pattern = r.d.get("hybrid_override_pattern")
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(_NEMOTRON_PATTERN):
            raise ConfigError(f"config.json: hybrid_override_pattern must be letters of M * - E, "
                              f"got {pattern!r}")
        kinds = tuple(_NEMOTRON_PATTERN[ch] for ch in pattern)
    for key, allowed in (("n_group", 1), ("topk_group", 1)):
        if r.int(key, 1) != allowed:
            raise ConfigError(f"config.json: {key} {r.d[key]} is not supported (only {allowed})")
    if r.d.get("moe_latent_size") is not None:
        raise ConfigError("config.json: moe_latent_size is not supported (only null)")
    if r.d.get("mlp_hidden_act", "relu2") != "relu2":
        raise ConfigError(f"config.json: mlp_hidden_act {r.d['mlp_hidden_act']!r} is not supported (only relu2)")
    hidden, m_heads, m_dhead = c["hidden_size"], r.int("mamba_num_heads", 128), r.int("mamba_head_dim", 64)
    expand = m_heads * m_dhead // hidden if (m_heads * m_dhead) % hidden == 0 else 0
    if not expand:
        raise ConfigError("config.json: mamba_num_heads * mamba_head_dim must be a multiple of hidden_size")
    experts = r.int("n_routed_experts", 8) if "moe" in kinds else 0
    return dict(c, architecture="nemotron_h", layer_kinds=kinds, num_hidden_layers=len(kinds),
                attn_layer_indices=tuple(i for i, k in enumerate(kinds) if k == "attention"),
                intermediate_size=r.int("intermediate_size", 21504), mlp_activation="relu2",
                mlp_bias=r.bool("mlp_bias", False), attention_head_dim=r.int("head_dim", 128),
                use_rope=False, mamba_n_heads=m_heads, mamba_d_head=m_dhead,
                mamba_n_groups=r.int("n_groups", 8), mamba_d_state=r.int("ssm_state_size", 128),
                mamba_d_conv=r.int("conv_kernel", 4), mamba_expand=expand,
                mamba_chunk_size=r.int("chunk_size", 128), mamba_conv_bias=r.bool("use_conv_bias", True),
                mamba_proj_bias=r.bool("use_bias", False),
                time_step_limit=(r.float("time_step_min", 0.001), math.inf),
                rms_norm_eps=r.float("layer_norm_epsilon", 1e-5),
                num_experts=experts, num_experts_per_tok=r.int("num_experts_per_tok", 2) if experts else 0,
                moe_intermediate_size=r.int("moe_intermediate_size", 7688),
                shared_intermediate_size=r.int("moe_shared_expert_intermediate_size", 7688),
                routed_scaling_factor=r.float("routed_scaling_factor", 1.0),
                norm_topk_prob=r.bool("norm_topk_prob", True))


_QWEN_KINDS = {"linear_attention": "gdn", "full_attention": "attention"}


def _qwen35_kwargs(r: _Reader) -> dict[str, Any]:
    c = _common(r)
    n = r.int("num_hidden_layers", 32)
    if "layer_types" in r.d:
        kinds = r.kinds("layer_types", _QWEN_KINDS)
    else:
        every = r.int("full_attention_interval", 4)
        kinds = tuple("attention" if (i + 1) % every == 0 else "gdn" for i in range(n))
    rope = r.rope()
    if r.d.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act {r.d['hidden_act']!r} is not supported (only silu)")
    hidden = c["hidden_size"]
    return dict(c, architecture="qwen3_5_text", layer_kinds=kinds, num_hidden_layers=len(kinds),
                attn_layer_indices=tuple(i for i, k in enumerate(kinds) if k == "attention"),
                intermediate_size=r.int("intermediate_size", 12288),
                attention_head_dim=r.int("head_dim", 256), attn_output_gate=True, qk_norm=True,
                rope_theta=_hf_float(rope.get("rope_theta", 10000.0)),
                partial_rotary_factor=_hf_float(rope.get("partial_rotary_factor", 0.25)),
                rms_norm_eps=r.float("rms_norm_eps", 1e-6),
                linear_num_key_heads=r.int("linear_num_key_heads", 16),
                linear_num_value_heads=r.int("linear_num_value_heads", 32),
                linear_key_head_dim=r.int("linear_key_head_dim", 128),
                linear_value_head_dim=r.int("linear_value_head_dim", 128),
                linear_conv_kernel_dim=r.int("linear_conv_kernel_dim", 4),
                # unused by Qwen3.5 (no Mamba layers); any valid values
                mamba_n_heads=1, mamba_d_head=2 * hidden, mamba_n_groups=1, mamba_d_state=1)


def _qwen3next_kwargs(r: _Reader) -> dict[str, Any]:
    kw = _qwen35_kwargs(r)
    only = r.d.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ConfigError(f"config.json: mlp_only_layers must be a list of integers, got {only!r}")
    return dict(kw, architecture="qwen3_next", num_experts=r.int("num_experts", 512),
                num_experts_per_tok=r.int("num_experts_per_tok", 10),
                moe_intermediate_size=r.int("moe_intermediate_size", 512),
                shared_intermediate_size=r.int("shared_expert_intermediate_size", 512),
                norm_topk_prob=r.bool("norm_topk_prob", True),
                decoder_sparse_step=r.int("decoder_sparse_step", 1), mlp_only_layers=tuple(only))


def _hf_common(c: ModelConfig, arch: str, model_type: str) -> dict[str, Any]:
    return {"architectures": [arch], "model_type": model_type, "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size, "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "max_position_embeddings": c.max_position_embeddings, "attention_bias": c.attention_bias,
            "tie_word_embeddings": c.tie_word_embeddings, "eos_token_id": c.eos_token_id,
            "pad_token_id": 0, "bos_token_id": 1}


def _hf_mamba(c: ModelConfig) -> dict[str, Any]:
    return {"mamba_n_heads": c.mamba_n_heads, "mamba_d_head": c.mamba_d_head,
            "mamba_n_groups": c.mamba_n_groups, "mamba_d_state": c.mamba_d_state,
            "mamba_d_conv": c.mamba_d_conv, "mamba_expand": c.mamba_expand,
            "mamba_chunk_size": c.mamba_chunk_size, "mamba_conv_bias": c.mamba_conv_bias,
            "mamba_proj_bias": c.mamba_proj_bias, "time_step_limit": list(c.time_step_limit)}


def _bamba_hf(c: ModelConfig) -> dict[str, Any]:
    return {**_hf_common(c, "BambaForCausalLM", "bamba"), **_hf_mamba(c),
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
            "attn_layer_indices": list(c.attn_layer_indices), "rms_norm_eps": c.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                                "partial_rotary_factor": c.partial_rotary_factor},
            "mlp_bias": c.mlp_bias}


_HF_KIND_NAMES = {"attention": "full_attention", "mamba": "linear_attention", "gdn": "linear_attention",
                  "mlp": "mlp", "moe": "moe"}


def _granite_hf(c: ModelConfig) -> dict[str, Any]:
    return {**_hf_common(c, "GraniteMoeHybridForCausalLM", "granitemoehybrid"), **_hf_mamba(c),
            "intermediate_size": c.moe_intermediate_size, "num_hidden_layers": c.num_hidden_layers,
            "layer_types": [_HF_KIND_NAMES[k] for k in c.layer_types], "rms_norm_eps": c.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta},
            "position_embedding_type": "rope" if c.use_rope else None,
            "attention_multiplier": c.attention_scale, "embedding_multiplier": c.embedding_multiplier,
            "residual_multiplier": c.residual_multiplier, "logits_scaling": c.logits_scaling,
            "num_local_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
            "shared_intermediate_size": c.shared_intermediate_size}


def _nemotron_hf(c: ModelConfig) -> dict[str, Any]:
    return {**_hf_common(c, "NemotronHForCausalLM", "nemotron_h"),
            "layers_block_type": [_HF_KIND_NAMES[k] for k in c.layer_types],
            "intermediate_size": c.intermediate_size, "mlp_hidden_act": "relu2", "mlp_bias": c.mlp_bias,
            "head_dim": c.head_dim, "mamba_num_heads": c.mamba_n_heads, "mamba_head_dim": c.mamba_d_head,
            "n_groups": c.mamba_n_groups, "ssm_state_size": c.mamba_d_state, "conv_kernel": c.mamba_d_conv,
            "expand": c.mamba_expand, "chunk_size": c.mamba_chunk_size, "use_conv_bias": c.mamba_conv_bias,
            "use_bias": c.mamba_proj_bias, "time_step_min": c.time_step_limit[0],
            "layer_norm_epsilon": c.rms_norm_eps, "n_routed_experts": max(c.num_experts, 1),
            "num_experts_per_tok": max(c.num_experts_per_tok, 1),
            "moe_intermediate_size": c.moe_intermediate_size,
            "moe_shared_expert_intermediate_size": c.shared_intermediate_size,
            "routed_scaling_factor": c.routed_scaling_factor, "norm_topk_prob": c.norm_topk_prob,
            "n_group": 1, "topk_group": 1}


def _qwen3next_hf(c: ModelConfig) -> dict[str, Any]:
    return {**_qwen35_hf(c), "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
            "num_experts": c.num_experts, "num_experts_per_tok": c.num_experts_per_tok,
            "moe_intermediate_size": c.moe_intermediate_size,
            "shared_expert_intermediate_size": c.shared_intermediate_size,
            "norm_topk_prob": c.norm_topk_prob, "decoder_sparse_step": c.decoder_sparse_step,
            "mlp_only_layers": list(c.mlp_only_layers)}


def _qwen35_hf(c: ModelConfig) -> dict[str, Any]:
    return {**_hf_common(c, "Qwen3_5ForCausalLM", "qwen3_5_text"),
            "layer_types": [_HF_KIND_NAMES[k] for k in c.layer_types],
            "num_hidden_layers": c.num_hidden_layers, "intermediate_size": c.intermediate_size,
            "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "hidden_act": "silu",
            "rope_parameters": {"rope_type": "default", "rope_theta": c.rope_theta,
                                "partial_rotary_factor": c.partial_rotary_factor},
            "linear_num_key_heads": c.linear_num_key_heads,
            "linear_num_value_heads": c.linear_num_value_heads,
            "linear_key_head_dim": c.linear_key_head_dim,
            "linear_value_head_dim": c.linear_value_head_dim,
            "linear_conv_kernel_dim": c.linear_conv_kernel_dim}


def _hf_float(value: Any) -> float:
    """A float from config.json; transformers 5 writes inf as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)
