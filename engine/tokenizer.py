"""Tokenizer, chat template and incremental detokenizer over the `tokenizers` library (no torch,
no transformers import at run time)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


class ChatTemplateError(ValueError):
    pass


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model directory {str(model_dir)!r}")
        self.backend = HFTokenizer.from_file(str(path))
        config_path = model_dir / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self.token_to_id(self.eos_token)
        source = _chat_template_source(model_dir, config)
        self.chat_template = None if source is None else _compile_chat_template(source)
        # The template writes tool calls in the Hermes/Qwen format (<tool_call>{...}</tool_call>),
        # so a model trained with it writes them so (what tool_choice "auto" parses).
        self.knows_tool_calls = source is not None and "<tool_call>" in source
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)

    def end_token_ids(self, model_eos: Iterable[int]) -> tuple[int, ...]:
        """The tokens that end a request unless ignore_eos: the model's EOS ids (its config and
        generation config) and this tokenizer's EOS token. One rule for the engine and the
        router, whose text must end where the workers' did."""
        eos = set(model_eos)
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        return tuple(sorted(eos))

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): a large prompt being
        # tokenized on one of the router's threads then stalls none of the others' streams.
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("this model's tokenizer has no chat template")
        for i, message in enumerate(messages):
            if not isinstance(message.get("role"), str) or not isinstance(
                message.get("content"), str
            ):
                raise ValueError(f"messages[{i}] needs string 'role' and 'content' fields")
        return self.chat_template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The template already writes every special token, as transformers' apply_chat_template.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools),
                           add_special_tokens=add_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary's string for one id (e.g. "Ġthe"), as transformers'
        convert_ids_to_tokens."""
        return self.backend.id_to_token(token_id) or ""

    def text_stream(self, prompt_ids: list[int], skip_special_tokens: bool = True) -> TextStream:
        return TextStream(self.backend, prompt_ids, skip_special_tokens)


class TextStream:
    """Incremental detokenization that never splits a multi-byte character: `step` returns ""
    until the bytes of a character are complete. Seeded with the prompt's tail so the first
    output token gets its leading-space handling right."""

    def __init__(self, backend: HFTokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self._backend = backend
        tail = list(prompt_ids[-8:])
        # A prompt may end inside a character (a continued request's prompt holds the output
        # so far, and an output can stop mid-character): seeded with those bytes, the stream
        # returned the whole seed's text with the token that completes the character. It is
        # seeded up to the last whole character and steps the rest, as if they were output.
        whole = len(tail)
        while whole and backend.decode(tail[:whole], skip_special_tokens).endswith("\ufffd"):
            whole -= 1
        self._stream = DecodeStream(ids=tail[:whole], skip_special_tokens=skip_special_tokens)
        for token_id in tail[whole:]:
            self.step(token_id)  # the prompt's text: not returned

    def step(self, token_id: int) -> str:
        return self._stream.step(self._backend, token_id) or ""


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # older configs store AddedToken dicts
        return value.get("content")
    return value


def _chat_template_source(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    return template if isinstance(template, str) else None


def _compile_chat_template(source: str) -> Any:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, indent=indent, ensure_ascii=False)
    return env.from_string(source)
