"""HybridLM against transformers' BambaForCausalLM (the reference), fp32.

Several prompts of different lengths go through ONE ragged prefill (one shorter than d_conv,
some longer than the chunk size), then decode together from a stand-in pool. Every prefill
position must be within 1e-4 of the reference and 32 greedy tokens identical to its cached
greedy decode.
"""

from __future__ import annotations

import pytest
import torch

from actors.loader import load_checkpoint
from tests.hf_reference import load_hf, make_hf_bamba, parity_with_hf

PROMPT_LENS = (2, 7, 19, 33)  # d_conv = 4, chunk = 8
NUM_TOKENS = 32
TOL = 1e-4

CASES = {
    # name: (attn_layer_indices, num_layers, BambaConfig overrides)
    "attention_at_1_and_3_with_biases": ([1, 3], 5, dict(mamba_proj_bias=True, attention_bias=True,
                                                          mlp_bias=True)),
    "attention_first_and_last_tied": ([0, 3], 4, dict(tie_word_embeddings=True, mamba_n_groups=1)),
    "all_attention": ([0, 1, 2], 3, dict(num_key_value_heads=1)),
    "no_attention": ([], 3, dict(mamba_n_groups=4, mamba_d_conv=3)),
}


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_and_greedy_match_transformers(tmp_path, case):
    attn, num_layers, overrides = CASES[case]
    path = make_hf_bamba(tmp_path, attn, num_layers, seed=7, **overrides)
    hf = load_hf(path)
    model, config = load_checkpoint(path, torch.float32)
    prompts = _prompts(config.vocab_size, seed=11)
    prefill_diff, decode_diff = parity_with_hf(hf, model, prompts, NUM_TOKENS)
    print(f"\n{case}: max |logit diff| prefill {prefill_diff:.3g}, decode {decode_diff:.3g}")
    assert prefill_diff <= TOL
    assert decode_diff <= TOL


def test_layer_kinds_follow_config(tmp_path):
    path = make_hf_bamba(tmp_path, [1, 3], 5, seed=1)
    model, config = load_checkpoint(path, torch.float32)
    kinds = ["attention" if layer.is_attention else "mamba" for layer in model.layers]
    assert tuple(kinds) == config.layer_types
    assert [layer.pool_index for layer in model.layers] == [0, 0, 1, 1, 2]
