"""Checkpoints: Hugging Face weights (safetensors) in and out of a `HybridLM`.

A checkpoint directory holds `config.json` (a `BambaForCausalLM`, `GraniteMoeHybridForCausalLM`,
`NemotronHForCausalLM` or `Qwen3_5ForCausalLM` config) and either `model.safetensors` or shards
listed in `model.safetensors.index.json`. Tensor names are Hugging Face's as `save_pretrained`
writes them (`model.layers.3.mamba.in_proj.weight`, `backbone.layers.1.mixer.experts.0.up_proj.weight`,
`model.layers.0.linear_attn.in_proj_qkv.weight`, `lm_head.weight`, ...); the per-architecture
prefix and top-level renames are in `actors.layers.LAYOUTS`. Multi-token-prediction weights
(`mtp.*`) are ignored. Every problem with a checkpoint raises `CheckpointError`, whose message
names the file or tensor at fault.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from actors.config import ConfigError, ModelConfig
from actors.layers import LAYOUTS
from actors.model import HybridLM

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message names the missing/unexpected/misshapen thing."""


IGNORED_PREFIXES = ("mtp.",)  # multi-token-prediction heads: not used for serving


def hf_name(param_name: str, config: ModelConfig | None = None) -> str:
    """Hugging Face name of a `HybridLM` parameter: "layers.0.mamba.D" -> "model.layers.0.mamba.D"
    (Bamba; the architecture's prefix and renames otherwise, e.g. NemotronH's "backbone.")."""
    if param_name.startswith("lm_head."):
        return param_name
    layout = LAYOUTS[config.architecture if config is not None else "bamba"]
    top, _, rest = param_name.partition(".")
    return f"{layout.prefix}{layout.renames.get(top, top)}.{rest}"


def hf_state_dict(model: HybridLM) -> dict[str, Tensor]:
    """The model's parameters under Hugging Face names (views, not copies)."""
    return {hf_name(name, model.config): p for name, p in model.named_parameters()}


def load_hf_state_dict(model: HybridLM, state_dict: dict[str, Tensor]) -> None:
    """Copy Hugging Face-named tensors into `model` (cast to its dtype and device).

    Raises CheckpointError on a missing tensor, an unexpected tensor or a wrong shape. A tied
    model accepts (and ignores) an `lm_head.weight`, as transformers does.
    """
    expected = hf_state_dict(model)
    ignorable = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    ignorable |= {n for n in state_dict if n.startswith(IGNORED_PREFIXES)}
    _check_names(expected, state_dict, ignorable)
    for name, param in expected.items():
        if tuple(state_dict[name].shape) != tuple(param.shape):
            raise CheckpointError(f"tensor {name} has shape {tuple(state_dict[name].shape)}, "
                                  f"expected {tuple(param.shape)}")
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(state_dict[name])


def _check_names(expected: dict[str, Tensor], got: dict[str, Tensor], ignorable: set[str]) -> None:
    missing = [n for n in expected if n not in got]
    if missing:
        listed = ", ".join(f"{n} (expected shape {tuple(expected[n].shape)})" for n in missing[:5])
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {listed}")
    unexpected = sorted(n for n in got if n not in expected and n not in ignorable)
    if unexpected:
        listed = ", ".join(f"{n} (shape {tuple(got[n].shape)})" for n in unexpected[:5])
        raise CheckpointError(f"checkpoint has {len(unexpected)} unexpected tensor(s): {listed}")


def weights_fingerprint(state_dict: dict[str, Tensor], config: ModelConfig | None = None) -> str:
    """Deterministic, cheap hash of the weights (CRC32 of names and bytes in name order),
    prefixed by the config fingerprint when a config is given."""
    crc = 0
    for name in sorted(state_dict):
        t = state_dict[name].detach().cpu().contiguous().reshape(-1)
        crc = zlib.crc32(f"{name}:{t.dtype}:{tuple(state_dict[name].shape)}".encode(), crc)
        crc = zlib.crc32(t.view(torch.uint8).numpy().tobytes(), crc)
    prefix = f"{config.fingerprint()}-" if config is not None else ""
    return f"{prefix}{crc:08x}"


def load_checkpoint(path: str | Path, dtype: torch.dtype,
                    device: torch.device | str = "cpu") -> tuple[HybridLM, ModelConfig]:
    """Build a `HybridLM` from a Hugging Face checkpoint directory (any supported architecture).

    Example:
        model, config = load_checkpoint("ckpt/bamba-tiny", torch.bfloat16, "cuda")
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {root} does not exist")
    config = read_config(root)
    model = HybridLM(config, dtype, device)
    load_hf_state_dict(model, read_weights(root))
    return model, config


def read_config(root: Path) -> ModelConfig:
    """`config.json` of a checkpoint directory as a ModelConfig."""
    file = root / CONFIG_FILE
    if not file.is_file():
        raise CheckpointError(f"checkpoint {root} has no {CONFIG_FILE}")
    try:
        return ModelConfig.from_hf_dict(json.loads(file.read_text()), name=root.name)
    except (json.JSONDecodeError, ConfigError, TypeError) as exc:
        raise CheckpointError(f"{file}: {exc}") from exc


def read_weights(root: Path) -> dict[str, Tensor]:
    """All tensors of a checkpoint directory (single file or sharded), on the CPU."""
    if (root / WEIGHTS_FILE).is_file():
        return load_file(root / WEIGHTS_FILE)
    if not (root / INDEX_FILE).is_file():
        raise CheckpointError(f"checkpoint {root} has neither {WEIGHTS_FILE} nor {INDEX_FILE}")
    weights: dict[str, Tensor] = {}
    for shard in sorted(set(_read_index(root).values())):
        if not (root / shard).is_file():
            raise CheckpointError(f"checkpoint {root}: shard {shard} listed in {INDEX_FILE} "
                                  "is missing")
        weights.update(load_file(root / shard))
    return weights


def _read_index(root: Path) -> dict[str, str]:
    try:
        return dict(json.loads((root / INDEX_FILE).read_text())["weight_map"])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{root / INDEX_FILE}: no readable weight_map ({exc})") from exc


def save_checkpoint(path: str | Path, config: ModelConfig, state_dict: dict[str, Tensor]) -> Path:
    """Write `config.json` and `model.safetensors` (Hugging Face names; a tied lm_head is left
    out, as transformers does). Returns the directory."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG_FILE).write_text(json.dumps(config.to_hf_dict(), indent=2))
    tensors = {n: t.detach().cpu().contiguous() for n, t in state_dict.items()
               if not (config.tie_word_embeddings and n == "lm_head.weight")}
    save_file(tensors, root / WEIGHTS_FILE, metadata={"format": "pt"})
    return root
