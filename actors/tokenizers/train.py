"""Train the presets' byte-level BPE tokenizers offline (run once; the JSON files are committed).

    .venv/bin/python actors/tokenizers/train.py        # writes actors/tokenizers/{tiny,small}/

The corpus is this repository's own Markdown and Python files (sorted, so a rerun on the same
tree gives the same files). Each preset gets a vocabulary no larger than its model's
(`actors.presets.PRESETS[...].vocab_size`; repeated here so the script needs no torch), three
special tokens (`<|endoftext|>`, and `<|im_start|>` / `<|im_end|>` for the ChatML chat template;
`<|im_end|>` ends a turn and is the eos token) and a `tokenizer_config.json` in Hugging Face
layout. Preset models have random weights, so their text output is gibberish; the tokenizer
exists so that the text paths (prompts, chat template, stop strings, detokenization) run end to
end on them.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent
VOCAB_SIZES = {"tiny": 512, "small": 8192}  # the presets' vocab_size
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def corpus() -> list[str]:
    files = sorted(p for ext in ("*.md", "*.py") for p in ROOT.glob(f"**/{ext}")
                   if ".venv" not in p.parts and ".git" not in p.parts)
    return [p.read_text(encoding="utf-8", errors="replace") for p in files]


def train(vocab_size: int, texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def tokenizer_config() -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>", "additional_special_tokens": SPECIAL_TOKENS,
            "chat_template": CHAT_TEMPLATE}


def save(name: str, tok: Tokenizer) -> None:
    out = OUT / name
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=1) + "\n")
    print(f"{name}: vocab {tok.get_vocab_size()} (limit {VOCAB_SIZES[name]}) -> {out}")


def main() -> None:
    texts = corpus()
    for name, size in VOCAB_SIZES.items():
        tok = train(size, texts)
        assert tok.get_vocab_size() <= size
        save(name, tok)


if __name__ == "__main__":
    main()
