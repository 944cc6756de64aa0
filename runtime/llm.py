"""The offline Python API: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import numbers
import sys
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime.config import EngineConfig
from runtime.engine import LLMEngine, Prompt, RequestGroup
from runtime.loader import PendingLoad
from runtime.outputs import RequestOutput
from runtime.sampling_params import InvalidRequestError, SamplingParams, check_text
from runtime.tokenizer import NoChatTemplateError


class LLM:
    """Run a model over a batch of prompts with continuous batching.

    >>> llm = LLM("path/to/model")
    >>> out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
    >>> out[0].outputs[0].text
    """

    def __init__(
        self, model: str | Path, *, weights: PendingLoad | None = None, **engine_args: Any
    ):
        """`model`: a model folder, or the name of a model in the model store (`edgeinfer
        models`; the default model, SmolLM2-135M-Instruct, is imported on first use), as
        `--model` takes. `engine_args`: EngineConfig's fields. `weights`: the load of `model`
        that the caller started already (`runtime.loader.start_load(model, dtype)`, before its
        heavier imports, as `edgeinfer generate` does); by default the engine starts it."""
        if weights is None and not Path(model).expanduser().is_dir():
            from runtime.cli import _model_dir

            model = _model_dir(str(model))  # a store name; else an error naming what is there
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args), weights)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs in prompt order."""
        batch = _as_batch(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(batch)
        else:
            # (a dict or a string: its keys or characters were taken for one setting each)
            if isinstance(sampling_params, (str, bytes, dict)):
                raise InvalidRequestError(
                    "sampling_params", "must be a SamplingParams or a list of them, got "
                    f"{type(sampling_params).__name__}"
                )  # fmt: skip
            params_list = list(sampling_params)
            if len(params_list) != len(batch):
                raise InvalidRequestError(
                    "sampling_params",
                    f"{len(params_list)} given for {len(batch)} prompts; give one or one per prompt",
                )
            bad = next((p for p in params_list if not isinstance(p, SamplingParams)), None)
            if bad is not None:
                raise InvalidRequestError(
                    "sampling_params", f"must be SamplingParams, got {type(bad).__name__}"
                )
        # Validate everything before anything is queued, so a bad prompt queues nothing (each
        # prompt's text is checked as the engine tokenizes it, below, before any is queued).
        for p in params_list:
            p.validate()
        engine = self.engine
        groups = [
            engine.prepare_request(engine.next_request_id(), prompt, params, check_room=False)
            for prompt, params in zip(batch, params_list, strict=True)
        ]
        try:
            return self._run(groups, progress)
        except BaseException:  # (an interrupt too) what this call queued leaves the engine
            for g in groups:
                engine.abort(g.request_id)
            raise

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate. `messages`:
        one conversation (a list of {"role", "content"} messages), or a list of them. A content
        may be OpenAI's list of text parts, as the gateway takes it (`_text_parts`)."""
        if isinstance(messages, dict):
            messages = [messages]  # one message: a conversation of one

        def sequence(x: object) -> bool:  # (a string was a conversation per character)
            return isinstance(x, Sequence) and not isinstance(x, (str, bytes)) and bool(x)

        if not sequence(messages):
            raise InvalidRequestError(
                "messages", "must be a non-empty list of messages ({'role': ..., 'content': "
                f"...}}) or of conversations, got {type(messages).__name__}"
            )  # fmt: skip
        convs = [list(messages)] if isinstance(messages[0], dict) else [list(c) for c in messages]  # type: ignore[arg-type]
        if not all(sequence(c) and all(isinstance(m, dict) for m in c) for c in convs):
            raise InvalidRequestError("messages", "each conversation must be a non-empty list "
                                      "of message objects")  # fmt: skip
        prompts = []
        for n, conv in enumerate(convs):
            for i, m in enumerate(conv):  # (to name the message; the prompt is checked below)
                where = "messages" + f"[{n}]" * (len(convs) > 1) + f"[{i}]"
                _check_message(where, m)  # (went to the chat template unchecked)
                if isinstance(m.get("content"), list):  # (a copy: the caller's stays as it was)
                    m = conv[i] = {**m, "content": _text_parts(f"{where}.content", m)}
                if m.get("role") == "developer":  # OpenAI's new name for it, as the gateway
                    m = conv[i] = {**m, "role": "system"}  # sends it on (openai_api.py)
                for key, value in m.items():
                    if isinstance(value, str):
                        check_text(f"{where}.{key}", value)
            try:
                text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=True)  # type: ignore[arg-type]
            except NoChatTemplateError as e:  # (its own message points to the completions API)
                raise NoChatTemplateError(
                    f"{self.engine.config.model}: the model has no chat template, so `chat` "
                    "cannot make a prompt of a conversation; complete text with `generate`"
                ) from e
            check_text("messages", text)  # (a tool call's arguments, say)
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
        return self.generate(prompts, sampling_params)  # type: ignore[arg-type]

    def _run(self, groups: list[RequestGroup], progress: bool) -> list[RequestOutput]:
        """Step until every group is done, queueing them in order as the waiting queue has
        room (a batch may be larger than its bound)."""
        ids = [g.request_id for g in groups]
        queue = deque(groups)
        done: dict[str, RequestOutput] = {}
        start, generated, shown = time.monotonic(), 0, 0.0
        while len(done) < len(ids):
            while queue and self.engine.has_room(len(queue[0].seqs)):
                self.engine.enqueue(queue.popleft())
            if not self.engine.has_unfinished():
                missing = [i for i in ids if i not in done]
                raise RuntimeError(f"engine went idle with requests unfinished: {missing[:4]}")
            for out in self.engine.step():
                generated += sum(len(o.delta_token_ids) for o in out.outputs)
                if out.finished:
                    done[out.request_id] = out
            now = time.monotonic()
            if progress and (now - shown >= 0.5 or len(done) == len(ids)):
                shown = now
                rate = generated / max(now - start, 1e-9)
                print(
                    f"\r{len(done)}/{len(ids)} requests done, {generated} tokens, {rate:.1f} tok/s",
                    end="",
                    file=sys.stderr,
                )
        if progress:
            print(file=sys.stderr)
        return [done[i] for i in ids]


def _check_message(where: str, message: dict[str, Any]) -> None:
    """A message's role (a non-empty string) and content (a string, a list of content parts, or
    for the assistant null or absent, as with tool calls), as the gateway takes them
    (gateway/openai_api.py `_messages`): a message without a role, or with a number for its
    content, went to the chat template, which rendered it as it happened to (a turn with no
    role, a "5"), or failed with the template's own error."""
    role = message.get("role")
    if not isinstance(role, str) or not role:
        got = "none" if role is None else f"{type(role).__name__} {role!r}"[:80]
        raise InvalidRequestError(
            f"{where}.role", f"must be a non-empty string (user, assistant, system, tool, "
            f"developer), got {got}",
        )  # fmt: skip
    content = message.get("content")
    if content is None and role != "assistant":
        raise InvalidRequestError(f"{where}.content", f"is required for role {role!r}")
    if content is not None and not isinstance(content, (str, list)):
        raise InvalidRequestError(
            f"{where}.content",
            f"must be a string or a list of text parts, got {type(content).__name__}",
        )


def _text_parts(param: str, message: dict[str, Any]) -> str:
    """A message's content given as OpenAI's content parts, as the gateway makes it a string
    (gateway/openai_api.py `_content`), so that both give a conversation the same prompt: its
    text parts (and an assistant's refusal parts) joined with newlines, as vLLM joins them.
    Other parts (images, audio) are refused: the model would answer without them. (Left as a
    list, the chat template printed the list's repr into the prompt.)"""
    parts = message["content"]
    if not parts:
        raise InvalidRequestError(
            param, "must be a string or a non-empty list of text parts, got an empty list"
        )
    texts = []
    for j, part in enumerate(parts):
        where = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise InvalidRequestError(where, "must be a content part ({'type': 'text', "
                                      f"'text': ...}}), got {type(part).__name__}")  # fmt: skip
        kind = part.get("type")
        key = "refusal" if kind == "refusal" and message.get("role") == "assistant" else "text"
        if kind != key:
            raise InvalidRequestError(
                f"{where}.type", "only text content parts (and refusal parts in assistant "
                f"messages) are supported, got type {kind!r}"
            )  # fmt: skip
        text = part.get(key)
        if not isinstance(text, str):
            raise InvalidRequestError(
                f"{where}.{key}", f"must be a string, got {type(text).__name__}"
            )
        check_text(f"{where}.{key}", text)
        texts.append(text)
    return "\n".join(texts)


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if (isinstance(prompts, list) and prompts
            and all(type(t) is int or isinstance(t, numbers.Integral) for t in prompts)):  # fmt: skip
        return [prompts]  # type: ignore[list-item]  # (numpy's integers too: each was a prompt)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidRequestError("prompts", "give a prompt or a non-empty list of prompts")
    return list(prompts)  # type: ignore[arg-type]
