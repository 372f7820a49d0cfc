"""Shared test helpers: tiny random transformers Bamba checkpoints as the correctness reference,
a stand-in state pool (plain tensors), and a greedy driver over `HybridLM`.

transformers is imported here (tests only), never by the `actors` package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from actors.batch import ForwardBatch
from actors.config import ModelConfig
from actors.model import HybridLM

HF_DEFAULTS = dict(
    vocab_size=256, hidden_size=32, intermediate_size=64, num_attention_heads=4,
    num_key_value_heads=2, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=8,
    mamba_d_conv=4, mamba_chunk_size=8, initializer_range=0.1, eos_token_id=None,
)


def make_hf_bamba(tmp_path: Path, attn_layer_indices: list[int], num_layers: int, seed: int,
                  **overrides) -> Path:
    """Save a seeded random `BambaForCausalLM` (fp32, safetensors) under tmp_path; return its dir.

    Norm weights, D, dt_bias, A_log and all biases are perturbed away from their defaults so a
    mix-up in any of them shows in the logits.
    """
    from transformers import BambaConfig, BambaForCausalLM

    kwargs = {**HF_DEFAULTS, **overrides}
    config = BambaConfig(num_hidden_layers=num_layers,
                         attn_layer_indices=list(attn_layer_indices) or None, **kwargs)
    torch.manual_seed(seed)
    model = BambaForCausalLM(config).eval()
    _perturb(model, seed)
    name = f"bamba_l{num_layers}_a{'-'.join(map(str, attn_layer_indices)) or 'none'}_s{seed}"
    path = Path(tmp_path) / name
    model.save_pretrained(path, safe_serialization=True)
    return path


def _perturb(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight"):  # away from its init (1, or 0 for (1 + w) norms)
                p.copy_(p + 0.2 * torch.randn(p.shape, generator=gen))
            elif leaf in ("D", "dt_bias"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif leaf == "A_log":
                p.copy_((0.5 + 4 * torch.rand(p.shape, generator=gen)).log())
            elif leaf in ("bias", "e_score_correction_bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def load_hf(path: Path) -> torch.nn.Module:
    """The transformers reference model of a checkpoint dir (any supported architecture), fp32."""
    import json

    import transformers

    arch = json.loads((Path(path) / "config.json").read_text())["architectures"][0]
    return getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()


def _has_attention(config) -> bool:
    kinds = getattr(config, "layers_block_type", None) or getattr(config, "layer_types", None)
    if kinds is None:
        return bool(config.attn_layer_indices)
    return "full_attention" in kinds


@torch.no_grad()
def hf_prefill_logits(hf: torch.nn.Module, prompt: list[int]) -> Tensor:
    """transformers' logits for every position of one unpadded prompt: (L, vocab) fp32."""
    return hf(input_ids=torch.tensor([prompt]), use_cache=False).logits[0].float()


@torch.no_grad()
def hf_greedy(hf: torch.nn.Module, prompt: list[int],
              num_tokens: int) -> tuple[list[int], list[Tensor]]:
    """Greedy decode with transformers: the tokens and each decode step's logits (vocab,).

    Token 1 comes from the prefill, tokens 2..num_tokens from one step each. Steps use the
    cache (with explicit position_ids, since RoPE would otherwise restart at 0), except for a
    model without attention layers: transformers 5.24 cannot build its causal mask from a cache
    holding only Mamba layers, so there every step recomputes the whole sequence.
    """
    if not _has_attention(hf.config):
        return _hf_greedy_uncached(hf, prompt, num_tokens)
    out = hf(input_ids=torch.tensor([prompt]), use_cache=True)
    cache, tokens, step_logits = out.cache, [int(out.logits[0, -1].argmax())], []
    for step in range(num_tokens - 1):
        pos = torch.tensor([[len(prompt) + step]])
        out = hf(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, position_ids=pos,
                 use_cache=True)
        cache = out.cache
        step_logits.append(out.logits[0, -1].float())
        tokens.append(int(step_logits[-1].argmax()))
    return tokens, step_logits


def _hf_greedy_uncached(hf: torch.nn.Module, prompt: list[int],
                        num_tokens: int) -> tuple[list[int], list[Tensor]]:
    tokens = [int(hf_prefill_logits(hf, prompt)[-1].argmax())]
    step_logits = []
    for _ in range(num_tokens - 1):
        step_logits.append(hf_prefill_logits(hf, prompt + tokens)[-1])
        tokens.append(int(step_logits[-1].argmax()))
    return tokens, step_logits


# ---------------------------------------------------------------------------- stand-in pool
@dataclass
class StandInPool:
    """Plain pool tensors with the layout `HybridLM` expects (see `actors.model.PoolTensors`):
    "k", "v" (attn layers, token slots, kv heads, head_dim) and each of `config.state_tensors`
    (layers of its kind, state slots, *shape)."""

    tensors: dict[str, Tensor]

    def tensor(self, name: str) -> Tensor:
        return self.tensors[name]

    def __getattr__(self, name: str) -> Tensor:  # pool.k, pool.conv, ... as on HybridPool
        try:
            return self.__dict__["tensors"][name]
        except KeyError:
            raise AttributeError(name) from None


def make_pool(config: ModelConfig, num_token_slots: int, num_mamba_slots: int,
              dtype: torch.dtype = torch.float32) -> StandInPool:
    """Zeroed pool tensors (slot 0 of each is left as padding by the drivers below)."""
    c = config
    kv = (c.num_attention_layers, num_token_slots, c.num_key_value_heads, c.head_dim)
    tensors = {"k": torch.zeros(kv, dtype=dtype), "v": torch.zeros(kv, dtype=dtype)}
    for t in c.state_tensors:
        shape = (len(c.layers_of_kind(t.kind)), num_mamba_slots, *t.shape)
        tensors[t.name] = torch.zeros(shape, dtype=torch.float32 if t.fp32 else dtype)
    return StandInPool(tensors)


# ---------------------------------------------------------------------------- greedy driver
@dataclass
class GreedyRun:
    """Output of `greedy_generate`, per request."""

    tokens: list[list[int]]  # generated tokens
    prefill_logits: list[Tensor]  # (L_i, vocab) every prompt position
    step_logits: list[list[Tensor]] = field(default_factory=list)  # per decode step, (vocab,)


def prefill_batch(prompts: list[list[int]], regions: list[Tensor],
                  mamba_slots: list[int]) -> ForwardBatch:
    """One ragged prefill of whole prompts; request i's tokens go to regions[i][:L_i]."""
    lens = [len(p) for p in prompts]
    return ForwardBatch(
        is_prefill=True, input_ids=torch.tensor([t for p in prompts for t in p]),
        positions=torch.cat([torch.arange(n) for n in lens]), seq_lens=lens,
        out_slots=torch.cat([r[:n] for r, n in zip(regions, lens)]),
        mamba_slots=torch.tensor(mamba_slots))


def decode_batch(last_tokens: list[int], lengths: list[int], regions: list[Tensor],
                 mamba_slots: list[int]) -> ForwardBatch:
    """One decode token per request; `lengths[i]` tokens of request i are already cached."""
    return ForwardBatch(
        is_prefill=False, input_ids=torch.tensor(last_tokens), positions=torch.tensor(lengths),
        seq_lens=[1] * len(lengths),
        out_slots=torch.stack([r[n] for r, n in zip(regions, lengths)]),
        mamba_slots=torch.tensor(mamba_slots),
        kv_slots=[r[: n + 1] for r, n in zip(regions, lengths)])


def greedy_generate(model: HybridLM, prompts: list[list[int]], num_tokens: int) -> GreedyRun:
    """Prefill all prompts in one ragged batch, then decode all requests together, greedily.

    Request i owns token slots [1 + i*stride, 1 + (i+1)*stride) and Mamba slot i + 1.
    """
    stride = max(map(len, prompts)) + num_tokens
    pool = make_pool(model.config, 1 + len(prompts) * stride, 1 + len(prompts), model.dtype)
    regions = [1 + i * stride + torch.arange(stride) for i in range(len(prompts))]
    mamba = [i + 1 for i in range(len(prompts))]
    logits = model.forward_all_logits(prefill_batch(prompts, regions, mamba), pool)  # (T, vocab)
    per_prompt = list(logits.split([len(p) for p in prompts]))
    run = GreedyRun([[int(l[-1].argmax())] for l in per_prompt], per_prompt,
                    [[] for _ in prompts])
    lengths = [len(p) for p in prompts]
    for _ in range(num_tokens - 1):
        step = model(decode_batch([t[-1] for t in run.tokens], lengths, regions, mamba), pool)
        for i, row in enumerate(step):
            run.step_logits[i].append(row)
            run.tokens[i].append(int(row.argmax()))
        lengths = [n + 1 for n in lengths]
    return run


def parity_with_hf(hf: torch.nn.Module, model: HybridLM, prompts: list[list[int]],
                   num_tokens: int) -> tuple[float, float]:
    """Run `prompts` through ours (one ragged prefill, then batched greedy decode) and through
    transformers one at a time; assert identical greedy tokens and return the largest
    |logit difference| of the prefill and of the decode steps."""
    run = greedy_generate(model, prompts, num_tokens)
    prefill_diff = decode_diff = 0.0
    for i, prompt in enumerate(prompts):
        ref_prefill = hf_prefill_logits(hf, prompt)  # (L, vocab)
        prefill_diff = max(prefill_diff, (ref_prefill - run.prefill_logits[i]).abs().max().item())
        ref_tokens, ref_steps = hf_greedy(hf, prompt, num_tokens)
        assert run.tokens[i] == ref_tokens, f"prompt {i} (length {len(prompt)}): greedy tokens differ"
        steps = torch.stack(run.step_logits[i]) - torch.stack(ref_steps)  # (num_tokens-1, vocab)
        decode_diff = max(decode_diff, steps.abs().max().item())
    return prefill_diff, decode_diff
