"""Text in and out without Ray: the presets' tokenizers, the chat template, incremental UTF-8-safe
detokenization, stop strings, and OpenAI request parsing.

References are independent: a whole-sequence `decode` for the incremental stream, Python's own
string search for stop strings; negative controls show a naive per-token decode does split
characters, and that a missed holdback would leak a stop string's first characters.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from actors.presets import PRESETS, save_preset
from raysched.openai_api import APIError, parse_chat, parse_completion
from raysched.sampling import RequestError, SamplingParams
from raysched.tokenizer import load_tokenizer, output_text, with_eos_stop
from raysched.workload import load_workload

TEXT = "Grüße aus Köln: 日本語のテキスト, naïve café ☕ and plain ASCII."


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("tiny")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_tokenizer_fits_the_model_vocab(preset: str) -> None:
    t = load_tokenizer(preset)
    assert t is not None and t.vocab_size <= PRESETS[preset].vocab_size
    assert t.eos_token == "<|im_end|>" and t.eos_token_id is not None
    assert t.decode(t.encode(TEXT)) == TEXT  # byte-level: every string round-trips


def test_saved_preset_carries_its_tokenizer(tmp_path, tok) -> None:
    root = save_preset("tiny", tmp_path / "tiny-ckpt")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in root.iterdir()}
    from_dir = load_tokenizer(str(root))
    assert from_dir.encode(TEXT) == tok.encode(TEXT) and from_dir.eos_token_id == tok.eos_token_id
    assert load_tokenizer(str(tmp_path)) is None  # a directory without tokenizer.json has none


def test_incremental_detokenization_never_splits_a_character(tok) -> None:
    ids = tok.encode(TEXT)
    stream = tok.text_stream()
    deltas = [stream.add([i]) for i in ids] + [stream.finish()]
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    naive = [tok.decode([i]) for i in ids]  # negative control: per-token decode splits characters
    assert any("\ufffd" in piece for piece in naive)


def test_stop_string_cuts_before_it_and_holds_back_a_prefix(tok) -> None:
    ids = tok.encode(TEXT)
    stop = "Köln"
    stream = tok.text_stream([stop, "never there"])
    deltas = []
    for i in ids:
        deltas.append(stream.add([i]))
        if stream.stopped:
            break
    assert stream.stopped == stop and "".join(deltas) == TEXT[:TEXT.index(stop)]
    assert not any("K" in d for d in deltas)  # "K" could have started the stop string: held back
    # it stopped on the token that completed the stop string, not later
    assert stop in tok.decode(ids[:stream.num_tokens]) and stop not in tok.decode(ids[:stream.num_tokens - 1])
    assert output_text(tok, ids, [stop]) == TEXT[:TEXT.index(stop)]
    assert output_text(tok, ids, ["absent"]) == TEXT


def test_chat_template_renders_chatml(tok) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]
    assert tok.chat_prompt(messages) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                         "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(tok.chat_prompt(messages))
    assert ids.count(tok.raw.token_to_id("<|im_start|>")) == 3  # special tokens encode as one id each
    with pytest.raises(RequestError, match=r"messages\[1\].role"):
        tok.chat_prompt([{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}])


def test_stop_strings_are_validated() -> None:
    assert SamplingParams.from_dict({"stop": "\n"}).stop == ("\n",)
    for bad, match in (([""], r"stop\[0\]"), ([1], r"stop\[0\]"), (["x"] * 17, "at most 16"), ("", r"stop\[0\]")):
        with pytest.raises(RequestError, match=match):
            SamplingParams.from_dict({"stop": bad})


def test_text_prompts_in_a_trace(tmp_path, tok) -> None:
    lines = [{"prompt": "Hello world", "max_new_tokens": 4, "stop": ["x"]},
             {"prompt_ids": [1, 2], "max_new_tokens": 3}]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    (tmp_path / "w.yaml").write_text("trace: t.jsonl\n")
    from raysched.workload import build_requests, load_workload_config

    specs = build_requests(load_workload_config(tmp_path / "w.yaml"), 512, tok)
    assert list(specs[0].prompt_ids) == tok.encode("Hello world") and specs[0].prompt == "Hello world"
    assert specs[0].sampling.stop == ("x",) and tok.eos_token_id in specs[0].sampling.stop_token_ids
    assert specs[1].prompt is None and specs[1].sampling.stop_token_ids == ()  # ids: no eos default
    with pytest.raises(Exception, match="needs the model's tokenizer"):
        load_workload(tmp_path / "w.yaml", 512)


def test_openai_parsing(tok) -> None:
    p = parse_completion({"model": "tiny", "prompt": "Hi", "max_tokens": 5, "temperature": 0, "stop": "\n",
                          "stream": True, "return_token_ids": True}, tok, "tiny")
    assert p.prompt_ids == tok.encode("Hi") and p.stream and p.return_token_ids
    assert p.sampling["max_new_tokens"] == 5 and p.sampling["stop"] == ["\n"]
    assert p.sampling["stop_token_ids"] == [tok.eos_token_id]
    assert parse_completion({"prompt": [[3, 4]], "ignore_eos": True}, tok, "tiny").sampling["stop_token_ids"] == []
    chat = parse_chat({"messages": [{"role": "user", "content": "Hi"}]}, tok, "tiny")
    assert chat.prompt_ids == tok.encode(tok.chat_prompt([{"role": "user", "content": "Hi"}]))
    with pytest.raises(APIError) as err:
        parse_completion({"prompt": "Hi", "model": "other"}, tok, "tiny")
    assert err.value.status == 404
    with pytest.raises(APIError, match="model 'x' has no tokenizer"):
        parse_completion({"prompt": "Hi"}, None, "x")
    assert with_eos_stop({"stop_token_ids": [7]}, tok)["stop_token_ids"] == [7, tok.eos_token_id]


def test_text_and_serving_modules_do_not_import_torch() -> None:
    code = ("import sys; import raysched.serve, raysched.client, raysched.deployment, raysched.tokenizer, "
            "raysched.openai_api, raysched.metrics, raysched.scheduler; assert 'torch' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_min_tokens_defers_stop_strings_to_text_added_from_then_on(tok) -> None:
    ids = tok.encode(TEXT)
    stop = "Köln"
    first = tok.text_stream([stop])
    first.add(ids)
    assert first.stopped == stop  # control: without min_tokens it stops there
    late = tok.text_stream([stop], min_tokens=len(ids))  # every stop string is completed before
    late.add(ids)
    late.finish()
    assert late.stopped is None and late.text == TEXT and late.num_tokens == len(ids)
    at = first.num_tokens  # the token that completes the stop string
    exact = tok.text_stream([stop], min_tokens=at)  # that token counts: it stops on it
    exact.add(ids)
    assert exact.stopped == stop and exact.num_tokens == at
    assert output_text(tok, ids, [stop], min_tokens=at + 1) == TEXT  # one later: it stays in the text
