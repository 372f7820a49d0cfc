"""Text in and out: the checkpoint's tokenizer, its chat template, incremental detokenization and
stop strings (torch-free; the scheduler and the HTTP server use it).

    tok = load_tokenizer("tiny")                     # a preset's committed tokenizer, or a checkpoint dir
    ids = tok.encode("Hello")
    prompt = tok.chat_prompt([{"role": "user", "content": "Hi"}])
    stream = tok.text_stream(stop=("\\n\\n",))
    delta = stream.add(ids_so_far)                     # text safe to show now (UTF-8 whole, no stop prefix)
    delta += stream.finish()

A checkpoint directory brings `tokenizer.json` (read with `tokenizers.Tokenizer.from_file`) and
optionally `tokenizer_config.json` (eos token, chat template rendered with jinja2). Presets use the
small byte-level BPE tokenizers committed under `actors/tokenizers/<preset>/`
(trained by `actors/tokenizers/train.py`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from raysched.sampling import RequestError

PRESET_TOKENIZERS = Path(__file__).resolve().parent.parent / "actors" / "tokenizers"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


class TextTokenizer:
    """A `tokenizers.Tokenizer` plus what `tokenizer_config.json` says (eos token, chat template)."""

    def __init__(self, tokenizer: Tokenizer, config: Mapping[str, Any], source: str) -> None:
        self.raw = tokenizer
        self.config = dict(config)
        self.source = source
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token_id = None if self.eos_token is None else tokenizer.token_to_id(self.eos_token)
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self.raw.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (with the tokenizer's own special-token post-processing, if any)."""
        if not isinstance(text, str):
            raise RequestError(f"prompt: text must be a string, got {type(text).__name__}")
        return self.raw.encode(text).ids

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of `token_ids`, special tokens left out."""
        return self.raw.decode(list(token_ids), skip_special_tokens=True)

    def chat_prompt(self, messages: Any, add_generation_prompt: bool = True,
                    extra: Mapping[str, Any] | None = None) -> str:
        """Render OpenAI-style `messages` through the chat template; RequestError on bad messages.
        `extra`: more template variables (HTTP's `chat_template_kwargs`), never the ones set here."""
        template = self.config.get("chat_template")
        if not template:
            raise RequestError(f"messages: the tokenizer of {self.source} has no chat template")
        if self._template is None:
            self._template = _compile_template(template)
        return self._template.render({**(extra or {}), "messages": check_messages(messages),
                                      "add_generation_prompt": add_generation_prompt,
                                      "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""})

    def text_stream(self, stop: Sequence[str] = (), min_tokens: int = 0) -> TextStream:
        return TextStream(self, stop, min_tokens)


class TextStream:
    """Incremental, UTF-8-safe detokenization of one request's output, with stop strings.

    `add(ids)` feeds new tokens and returns the text that is safe to show: whole characters only
    (a character split across tokens waits for its last byte, via `DecodeStream`), and never a
    possible beginning of a stop string (the last `max(len(stop)) - 1` characters wait). Once a
    stop string appears, the text is cut before it, `stopped` is set, and later tokens are
    ignored; `num_tokens` is then the number of tokens up to the one that completed it.
    A stop string counts only once `min_tokens` tokens were added (the token that completes it
    counts), and only where it ends in text added then: one completed earlier stays in the text.
    `finish()` releases what was held back.
    """

    def __init__(self, tokenizer: TextTokenizer, stop: Sequence[str] = (), min_tokens: int = 0) -> None:
        self._tok = tokenizer
        self._min_tokens = min_tokens
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # everything decoded so far (cut at a stop string)
        self.token_ids: list[int] = []  # tokens consumed (up to the stop)
        self.stopped: str | None = None  # the stop string that ended it
        self._sent = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def add(self, token_ids: Iterable[int]) -> str:
        for token in token_ids:
            if self.stopped is not None:
                break
            self.token_ids.append(int(token))
            piece = self._decoder.step(self._tok.raw, int(token))
            if piece:
                self._append(piece)
        return self._release(final=self.stopped is not None)

    def finish(self) -> str:
        """The rest of the text (held-back characters, and an incomplete UTF-8 tail as U+FFFD)."""
        if self.stopped is None:
            full = self._tok.decode(self.token_ids)
            if full.startswith(self.text) and len(full) > len(self.text):
                self._append(full[len(self.text):])
        return self._release(final=True)

    def _append(self, piece: str) -> None:
        before = len(self.text)
        self.text += piece
        if len(self.token_ids) < self._min_tokens:
            return
        hits = [(i, s) for s in self._stop if (i := self.text.find(s, max(0, before - len(s) + 1))) >= 0]
        if hits:
            cut, self.stopped = min(hits)
            self.text = self.text[:cut]

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else max(self._sent, len(self.text) - self._holdback)
        delta, self._sent = self.text[self._sent:end], end
        return delta


def with_eos_stop(sampling: Mapping[str, Any], tokenizer: TextTokenizer | None) -> dict[str, Any]:
    """Sampling params that also stop at the tokenizer's eos token (the default for text prompts
    and for the HTTP server, as in vLLM); unchanged with `ignore_eos`, or without a tokenizer or
    eos token."""
    out = dict(sampling)
    eos = None if tokenizer is None or out.get("ignore_eos") else tokenizer.eos_token_id
    stops = list(out.get("stop_token_ids") or [])
    if eos is not None and eos not in stops:
        out["stop_token_ids"] = [*stops, eos]
    return out


def output_text(tokenizer: TextTokenizer, token_ids: Sequence[int], stop: Sequence[str] = (),
                min_tokens: int = 0) -> str:
    """The text of a request's output tokens, cut before the first stop string (see `TextStream`)."""
    stream = tokenizer.text_stream(stop, min_tokens)
    stream.add(token_ids)
    stream.finish()
    return stream.text


def check_messages(messages: Any) -> list[dict[str, str]]:
    """OpenAI chat messages as [{"role", "content"}] with text content; RequestError naming the
    first bad message otherwise. Content given as a list of text parts is joined."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages: must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise RequestError(f"messages[{i}]: must be an object, got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise RequestError(f"messages[{i}].role: must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        out.append({"role": role, "content": _content_text(content, i)})
    return out


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise RequestError(f"messages[{i}].content: must be a string or a list of text parts, got {content!r:.80}")


def _compile_template(source: str) -> Any:
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise RequestError(f"messages: {message}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as err:
        raise RequestError(f"messages: the chat template does not compile: {err}") from None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def preset_tokenizer_dir(name: str) -> Path:
    """Where a preset's committed tokenizer lives: the tiny presets of every architecture
    (`tiny-granite`, ...) share `tiny`'s, which fits their vocabulary."""
    return PRESET_TOKENIZERS / name.split("-", 1)[0]


def tokenizer_dir(model: str) -> Path | None:
    """Where the tokenizer files of `model` (a preset name or a checkpoint dir) live, if any."""
    preset = preset_tokenizer_dir(model)
    if "/" not in model and (preset / TOKENIZER_FILE).is_file():
        return preset
    path = Path(model)
    return path if (path / TOKENIZER_FILE).is_file() else None


@lru_cache(maxsize=8)
def load_tokenizer(model: str) -> TextTokenizer | None:
    """The tokenizer of a preset or checkpoint directory, or None when it ships none."""
    root = tokenizer_dir(model)
    if root is None:
        return None
    config_path = root / TOKENIZER_CONFIG_FILE
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    return TextTokenizer(Tokenizer.from_file(str(root / TOKENIZER_FILE)), config, str(root))


def require_tokenizer(model: str) -> TextTokenizer:
    """`load_tokenizer`, or a RequestError saying text needs a tokenizer this model lacks."""
    tok = load_tokenizer(model)
    if tok is None:
        raise RequestError(f"prompt: text needs a tokenizer, and model {model!r} has no {TOKENIZER_FILE}; "
                           f"send token ids instead")
    return tok
