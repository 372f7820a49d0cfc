"""Checkpoint loading: every broken checkpoint raises a CheckpointError naming what is wrong;
sharded checkpoints, preset round trips and fingerprints work."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from actors.loader import (CheckpointError, hf_state_dict, load_checkpoint, save_checkpoint,
                           weights_fingerprint)
from actors.presets import init_state_dict, load_preset, resolve_model
from tests.hf_reference import greedy_generate, hf_prefill_logits, load_hf, make_hf_bamba

NAME = "model.layers.0.mamba.in_proj.weight"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_bamba(tmp_path_factory.mktemp("hf"), [1], 2, seed=5)


def _edited_copy(checkpoint, tmp_path, edit):
    """A copy of the checkpoint whose weights went through edit(state_dict)."""
    path = tmp_path / "edited"
    shutil.copytree(checkpoint, path)
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors")
    return path


def test_missing_tensor_is_named(checkpoint, tmp_path):
    path = _edited_copy(checkpoint, tmp_path, lambda w: w.pop(NAME))
    with pytest.raises(CheckpointError, match=rf"missing .*{NAME} \(expected shape \(\d+, 32\)\)"):
        load_checkpoint(path, torch.float32)


def test_wrong_shape_is_named_with_both_shapes(checkpoint, tmp_path):
    path = _edited_copy(checkpoint, tmp_path, lambda w: w.update({NAME: w[NAME][:-1]}))
    with pytest.raises(CheckpointError, match=rf"{NAME} has shape \(\d+, 32\), expected \(\d+, 32\)"):
        load_checkpoint(path, torch.float32)


def test_unexpected_tensor_is_named(checkpoint, tmp_path):
    extra = {"model.extra.weight": torch.ones(3)}
    path = _edited_copy(checkpoint, tmp_path, lambda w: w.update(extra))
    with pytest.raises(CheckpointError, match=r"unexpected .*model\.extra\.weight"):
        load_checkpoint(path, torch.float32)


def test_unknown_architecture(checkpoint, tmp_path):
    path = tmp_path / "llama"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="LlamaForCausalLM"):
        load_checkpoint(path, torch.float32)


def test_missing_dir_config_and_weights(checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere", torch.float32)
    path = tmp_path / "partial"
    shutil.copytree(checkpoint, path)
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(path, torch.float32)
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(path, torch.float32)


def test_sharded_checkpoint_loads_the_same_weights(checkpoint, tmp_path):
    path = tmp_path / "sharded"
    shutil.copytree(checkpoint, path)
    weights = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, shard_names in shards.items():
        save_file({n: weights[n] for n in shard_names}, path / file)
    index = {"weight_map": {n: f for f, ns in shards.items() for n in ns}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    sharded, _ = load_checkpoint(path, torch.float32)
    single, _ = load_checkpoint(checkpoint, torch.float32)
    assert weights_fingerprint(sharded.state_dict()) == weights_fingerprint(single.state_dict())
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors"):
        load_checkpoint(path, torch.float32)


def test_weights_fingerprint_is_deterministic_and_sensitive():
    config_weights = init_state_dict(load_preset("tiny", torch.float32)[1], seed=0)
    assert weights_fingerprint(config_weights) == weights_fingerprint(init_state_dict(
        load_preset("tiny", torch.float32)[1], seed=0))
    changed = dict(config_weights)
    changed[NAME] = changed[NAME].clone()
    changed[NAME][0, 0] += 1e-6
    assert weights_fingerprint(changed) != weights_fingerprint(config_weights)


def test_preset_saved_as_checkpoint_is_the_same_model(tmp_path):
    model, config = load_preset("tiny", torch.float32)
    path = save_checkpoint(tmp_path / "tiny", config, hf_state_dict(model))
    loaded, loaded_config = resolve_model(str(path), torch.float32, "cpu")
    assert loaded_config == config
    assert weights_fingerprint(loaded.state_dict()) == weights_fingerprint(model.state_dict())
    prompts = [[1, 2, 3, 4, 5], [9] * 20]
    assert greedy_generate(loaded, prompts, 4).tokens == greedy_generate(model, prompts, 4).tokens


def test_transformers_reads_a_saved_preset(tmp_path):
    """The checkpoint we write is a valid Bamba checkpoint: transformers agrees with us on it."""
    model, config = load_preset("tiny", torch.float32)
    path = save_checkpoint(tmp_path / "tiny", config, hf_state_dict(model))
    prompt = list(range(3, 40))
    ours = greedy_generate(model, [prompt], 1).prefill_logits[0]  # (L, vocab)
    assert (hf_prefill_logits(load_hf(path), prompt) - ours).abs().max().item() <= 1e-4


def test_resolve_model_rejects_unknown_names():
    with pytest.raises(CheckpointError, match="tiny, small"):
        resolve_model("no-such-model", torch.float32, "cpu")
    model, config = resolve_model("tiny", torch.float32, "cpu")
    assert config.name == "tiny" and model.config is config


def test_a_worker_builds_its_model_without_filling_parameters_it_loads_after():
    """Start-up cost: building the model skips `torch.nn.init`'s fills (on the meta device one
    imports torch._dynamo, ~1.4 s of every worker's start). Checked in a fresh process: after
    `build_engine` torch._dynamo is not loaded, and the engine's greedy tokens equal an engine's
    built with the fills on. Control: the same build with the fills on does load torch._dynamo."""
    import subprocess
    import sys

    script = """
import sys, torch
from actors import model
from actors.engine import build_engine
from raysched.sampling import SamplingParams
{patch}
engine = build_engine("tiny", kv_tokens=64, state_slots=2)
assert torch.nn.init.normal_.__module__ == "torch.nn.init"  # put back after the build
out = engine.generate([[5, 17, 42]], [SamplingParams(max_new_tokens=4)])
print("dynamo", "torch._dynamo" in sys.modules, "tokens", out[0])
"""
    filled = "import contextlib; model.unfilled_parameters = contextlib.nullcontext"

    def run(patch: str) -> str:
        done = subprocess.run([sys.executable, "-c", script.format(patch=patch)], capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    skipped, control = run(""), run(filled)
    assert skipped.startswith("dynamo False"), skipped
    assert control.startswith("dynamo True"), control
    assert skipped.split("tokens")[1] == control.split("tokens")[1]
