"""The offline Python API: `LLM(model_dir).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import copy
import numbers
import sys
import threading
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
from runtime.tokenizer import NoChatTemplateError, Tokenizer


class LLM:
    """Run a model over a batch of prompts with continuous batching.

    >>> llm = LLM("path/to/model")
    >>> out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=32))
    >>> out[0].outputs[0].text

    `generate` and `chat` may be called from several threads: one call runs at a time (each
    steps the engine until its own requests finish), the others wait their turn. They refuse
    an engine that holds requests they did not queue (`engine.add_request`, an `AsyncLLM` over
    `llm.engine`): stepping it, they would take those requests' outputs from their owner.
    """

    def __init__(
        self, model: str | Path, *, weights: PendingLoad | None = None, **engine_args: Any
    ):
        """`model`: a model folder, or the name of a model in the model store (`edgeinfer
        models`; the default model, SmolLM2-135M-Instruct, is imported on first use), as
        `--model` takes. `engine_args`: EngineConfig's fields. `weights`: the load of `model`
        that the caller started already (`runtime.loader.start_load(model, dtype)`, before its
        heavier imports, as `edgeinfer generate` does); by default the engine starts it."""
        if weights is None:
            folder = Path(model).expanduser()  # ("~/m" was checked expanded, read unexpanded)
            if folder.is_dir():
                model = folder
            else:
                from runtime.cli import _model_dir

                model = _model_dir(str(model))  # a store name; else an error naming what is there
        self.engine = LLMEngine(EngineConfig(model=str(model), **engine_args), weights)
        self.tokenizer = self.engine.tokenizer
        self._lock = threading.Lock()  # held by the generate call that steps the engine

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (vLLM's name): edgeinfer's `runtime.tokenizer.Tokenizer`, with
        `encode`, `decode` and `apply_chat_template`, not a transformers tokenizer."""
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, or a list of token ids); outputs in prompt order.
        `progress` (or vLLM's name for it, `use_tqdm`): a progress line on stderr."""
        show = _progress(progress, use_tqdm)
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
        with self._lock:  # (another thread's call waits here for this one to finish)
            if others := engine.unfinished_request_ids():
                listed = ", ".join(others[:4]) + ", ..." * (len(others) > 4)
                raise RuntimeError(
                    f"llm.engine holds {len(others)} unfinished requests that generate did not "
                    f"queue ({listed}): generate steps every request the engine holds and "
                    "would take their outputs from whoever queued them (engine.add_request, "
                    "an AsyncLLM over llm.engine). Finish or abort them first, or queue every "
                    "request in one place"
                )  # fmt: skip
            outs = self._run(groups, show)
        for out, prompt in zip(outs, batch, strict=True):
            out.prompt = prompt if isinstance(prompt, str) else None  # (vLLM's: None for ids)
        return outs

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
        use_tqdm: bool | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template, then generate. `messages`:
        one conversation (a list of {"role", "content"} messages), or a list of them. A content
        may be OpenAI's list of text parts, as the gateway takes it (`_text_parts`).

        As vLLM's: `chat_template`, a Jinja template used in place of the model's;
        `add_generation_prompt`, end the prompt with the template's opening of an assistant
        turn; `continue_final_message`, end it with the last message's text instead (no end of
        its turn), for the model to continue (with add_generation_prompt=False). Each output's
        `prompt` is the rendered conversation."""
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):  # fmt: skip
            if not isinstance(flag, bool):
                raise InvalidRequestError(name, f"must be true or false, got {flag!r}")
        if add_generation_prompt and continue_final_message:  # (vLLM's rule)
            raise InvalidRequestError(
                "continue_final_message", "cannot be combined with add_generation_prompt: "
                "the prompt ends either with the last message or with a new assistant turn; "
                "pass add_generation_prompt=False to continue the last message"
            )  # fmt: skip
        tokenizer = self.tokenizer if chat_template is None else self._templated(chat_template)
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
        prompts, texts = [], []
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
                text = tokenizer.apply_chat_template(
                    conv,
                    add_generation_prompt=add_generation_prompt,
                )
            except NoChatTemplateError as e:  # (its own message points to the completions API)
                raise NoChatTemplateError(
                    f"{self.engine.config.model}: the model has no chat template, so `chat` "
                    "cannot make a prompt of a conversation without one (chat_template=...); "
                    "complete text with `generate`"
                ) from e
            if continue_final_message:
                text = _continued(text, conv[-1], where)  # (where: the last message's)
            check_text("messages", text)  # (a tool call's arguments, say)
            prompts.append(self.tokenizer.encode(text, add_special_tokens=False))
            texts.append(text)
        outs = self.generate(prompts, sampling_params, progress, use_tqdm=use_tqdm)
        for out, text in zip(outs, texts, strict=True):
            out.prompt = text  # (as vLLM's chat: the conversation as the template rendered it)
        return outs

    def _templated(self, source: object) -> Tokenizer:
        """The model's tokenizer with `source` for its chat template (chat's chat_template)."""
        from runtime.chat_template import TemplateSyntaxError, compile_template

        if not isinstance(source, str) or not source:
            got = f"{type(source).__name__} {source!r}"[:80]
            raise InvalidRequestError("chat_template", f"must be a non-empty string (a Jinja "
                                      f"template), got {got}")  # fmt: skip
        check_text("chat_template", source)
        try:  # (the tokenizer's own error names the model's files)
            compile_template(source)
        except (TemplateSyntaxError, RecursionError) as e:
            raise InvalidRequestError("chat_template", f"does not compile: {e}") from e
        tokenizer = copy.copy(self.tokenizer)  # (shares its compiled-template cache)
        tokenizer.chat_templates = {"default": source}
        return tokenizer

    def _run(self, groups: list[RequestGroup], progress: bool) -> list[RequestOutput]:
        """Step until every group is done, queueing them in order as the waiting queue has
        room (a batch may be larger than its bound). Only these groups' outputs count: an
        output of another request means another thread queues into or steps the engine, and
        a step that runs nothing means the groups wait for what will never come (KV blocks
        held by what this LLM did not queue): both raise RuntimeError rather than spin. On
        any error (an interrupt too) the groups queued are aborted: they leave the engine."""
        engine = self.engine
        ids = [g.request_id for g in groups]
        mine = set(ids)
        queue = deque(groups)
        queued: list[str] = []
        done: dict[str, RequestOutput] = {}
        start, generated, shown = time.monotonic(), 0, 0.0
        try:
            while len(done) < len(ids):
                while queue and engine.has_room(len(queue[0].seqs)):
                    engine.enqueue(queue[0])
                    queued.append(queue.popleft().request_id)
                if not engine.has_unfinished():
                    missing = [i for i in ids if i not in done]
                    raise RuntimeError(
                        f"the engine has nothing left to run, yet requests {missing[:4]} did "
                        "not finish here: another thread stepped llm.engine and took their "
                        "outputs (an AsyncLLM over it?); one engine takes one driver"
                    )  # fmt: skip
                for out in engine.step():
                    if out.request_id not in mine:  # (not ours to take, nor to drop)
                        raise RuntimeError(
                            f"a step of llm.engine returned an output of {out.request_id!r}, "
                            "which this generate did not queue: another thread queues "
                            "requests into the engine or steps it (an AsyncLLM over it?); "
                            "one engine takes one driver"
                        )  # fmt: skip
                    generated += sum(len(o.delta_token_ids) for o in out.outputs)
                    if out.finished:
                        done[out.request_id] = out
                if engine.last_step_idle and len(done) < len(ids):
                    waiting = [i for i in queued if i not in done]
                    raise RuntimeError(
                        f"the engine can run none of requests {waiting[:4]} (a step ran "
                        "nothing): the KV blocks they need are held by what generate did not "
                        "queue (KV imports reserved, KV exports held)"
                    )  # fmt: skip
                now = time.monotonic()
                if progress and (now - shown >= 0.5 or len(done) == len(ids)):
                    shown = now
                    rate = generated / max(now - start, 1e-9)
                    print(
                        f"\r{len(done)}/{len(ids)} requests done, {generated} tokens, "
                        f"{rate:.1f} tok/s",
                        end="",
                        file=sys.stderr,
                    )
        except BaseException:
            for rid in queued:  # (only this call's: an id another caller took is theirs)
                if rid not in done:
                    engine.abort(rid)
            raise
        if progress:
            print(file=sys.stderr)
        return [done[i] for i in ids]


def _progress(progress: object, use_tqdm: object) -> bool:
    """Whether to show the progress line: `progress`, or vLLM's `use_tqdm` (True or False)."""
    for name, value in (("progress", progress), ("use_tqdm", use_tqdm)):
        if value is not None and not isinstance(value, bool):
            raise InvalidRequestError(
                name, f"must be true or false (a progress line on stderr; a tqdm class is not "
                f"supported by edgeinfer), got {type(value).__name__}"
            )  # fmt: skip
    return bool(progress) or bool(use_tqdm)


def _continued(text: str, message: dict[str, Any], where: str) -> str:
    """`text`, the conversation rendered without a generation prompt, cut right after the last
    message's text (chat's continue_final_message), as transformers cuts it: the template may
    have stripped the text's outer spaces, so it is looked for stripped."""
    content = message.get("content")
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequestError(
            f"{where}.content", "continue_final_message continues the last message's text, "
            "and it has none (to begin a new assistant turn: add_generation_prompt=True)"
        )  # fmt: skip
    stripped = content.strip()
    at = text.rfind(stripped)
    if at < 0:
        raise InvalidRequestError(
            "continue_final_message", "the chat template does not render the last message's "
            "text as it is given, so the prompt cannot end with it"
        )  # fmt: skip
    kept = content.lstrip()
    if text[at : at + len(kept)] == content:  # (its trailing spaces rendered as given)
        return text[: at + len(kept)]
    return text[: at + len(stripped)]


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
