"""Tool calls in a model's own output format: parsed from text as it streams, and enforced.

Formats (a parser per model family, picked by name or from the chat template's text):

    hermes       Hermes, Qwen 2/2.5/3:  <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>
                 (one block per call; the text outside the blocks that hold a call is content)
    llama3_json  Llama 3.1-3.3:  {"name": ..., "parameters": {...}}  (the whole output; several
                 calls separated by "; "; an optional <|python_tag|> first)
    mistral      Mistral:  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]  (the array form;
                 the v11 form `[TOOL_CALLS]name[ARGS]{...}` is not parsed)

`ToolParser.parse(text, final, names)` reads the whole output so far and returns the content
before the tool region and the calls seen so far, each with its name (once the name is
complete), its arguments' raw JSON text so far, and the text after it that is no call (`after`);
`ToolCallStream` diffs consecutive parses into OpenAI deltas (content text, then per call
`{"index", "id", "type", "function": {"name", "arguments"}}` once its name is known and
`{"index", "function": {"arguments": more}}` as the arguments grow). A non-streamed answer is the
sum of the same deltas, so both answers agree by construction. Arguments are the model's own
JSON text, not re-serialized. Content that may still turn out to be the start of a call (a
partial marker, trailing whitespace before a call) is held back; at the end, a tool region in
which no call parsed is given back as content. Whether text is a call is settled by what comes
before its name, so that it does not depend on how the output is cut into steps: a key, a value
or a name that is not JSON (a bad literal or escape, NaN, Infinity) before the name goes out
makes it no call (content), and so does a name that is not one of the request's tools (OpenAI
only answers calls of the functions offered: a model that names another, or writes a JSON
object with a "name" in its prose, answers in text); once the name is out, the call stands
whatever follows (never retracted, nor its text sent again as content), its arguments the
model's text even when that is not JSON (the gateway then finishes "stop", not "tool_calls").
A call that closes without arguments has arguments "{}". Raw control characters in strings
(models write them in code) are JSON here, as they were. A marker that is a special token
reaches the stream as its id only (the detokenizer drops its text): its text goes where a whole
decode of the tokens before it ends, inside a step of several tokens too (speculative decoding).

A number is JSON whatever its size (1e400, an integer of 30 digits), as JSON's grammar has it
and as the grammar of a forced call (below) lets a model write it: the parser reads what that
grammar allows, the arguments stay the model's text, and the call is whole ("tool_calls"; it
finished "stop", as if cut off). The grammar is not bounded instead: llguidance cannot bound a
number to the 64-bit range (it fails to build the regex), nor the numbers a schema leaves free,
and in "auto" mode a model writes what it likes anyway. (A client that sends such a call back
in a conversation gets a 400 naming the field: the gateway cannot carry the number on to the
chat template, gateway/structured.py.)

What is no call is content, never dropped, wherever it stands: before the first call, or after
one (a call of a function not offered, text that is not a call's JSON, prose after the calls:
the call's `after`, sent as content once it cannot be the start of a call). A hermes block
stands alone, as each is delimited: a block that holds no call is content and a block after it
can be a call. In llama3_json and mistral the calls are one sequence of objects: the first
object that is no call ends it, and the rest of the output is content (before the first call:
all of it, as a tool region without a call). vLLM's parsers drop such text, or all the calls:
its hermes parser, unstreamed, makes the whole output content when one block is not JSON (and
calls any name); its newer parsers drop the calls of functions not offered. A streamed call
cannot be taken back, and dropping text loses what the model said, so edgeinfer gives what is
no call as content, streamed or not alike. With `parallel_tool_calls` false a completion ends at
its first call: what follows it is past the answer's end.

`tool_choice` "required" or a named function is enforced with a Lark grammar (llguidance) in the
same format: the marker text (or the marker's own special token, when the tokenizer has it) and
a JSON schema per tool, `{"name": {"const": ...}, "arguments": <the tool's parameters>}`, so the
output always parses into the declared arguments schema. Parameters that refer into themselves
(`$ref` "#/$defs/..." or "#", as pydantic writes nested models) are moved to the root's `$defs`,
under the tool's name, with their refs rebased, so that the refs still resolve. With
`parallel_tool_calls` false the grammar allows one call, and in "auto" mode a completion ends
once its first call is complete. A named function's call that max_tokens cuts before its name is
complete is still that call, with the arguments "" (as vLLM, which constrains only a named
call's arguments, always answers with the call), never the grammar's half-written text. Under
either, none of the output is content: what a cut leaves of a marker (a call's end, the next
call's start) is dropped, and so is a call of "required" cut before its name (no name to give
it: no call; vLLM's streamed "required" sends nothing of it); the calls before the cut stand.
In "auto" mode an end marker that max_tokens cut, after a hermes block's call, is that block's
(vLLM's hermes parser reads the end marker as one token, and a call's block is never content);
a block cut before its call's name is content there, as the text of a tool region with no call.

Torch-free (the worker imports it; tests drive it directly).
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any

from runtime.sampling_params import InvalidRequestError
from runtime.structured import (
    DATA_KEYWORDS,
    JSON_OPTIONS,
    MAX_JSON_DEPTH,
    SCHEMA_MAPS,
    json_depth,
)

PARSERS = ("hermes", "llama3_json", "mistral")
CONTEXT_TOKENS = 8  # the prompt's last tokens, decoded before the output (ToolCallStream.context)


@dataclass(slots=True)
class ParsedCall:
    """One tool call as parsed so far."""

    name: str | None  # None until the name's string is complete
    arguments: str  # the arguments' JSON text so far (complete once `complete`)
    complete: bool  # the call's object is closed
    # the output's text after the call, up to the next call, that is no call (a block or an
    # object naming a function not offered, or not JSON, or text): content, never dropped
    after: str = ""


class ToolParser:
    """One model family's tool-call format (see the module docstring)."""

    name = ""
    marker = ""  # text that opens the tool region ("" for llama3_json: it starts with "{")
    arg_keys: tuple[str, ...] = ("arguments", "parameters")
    marker_token_id: int | None = None  # the marker's special token, when the tokenizer has it
    end = ""  # text that closes a call ("" where the format has none)
    end_token_id: int | None = None  # the end's special token, when the tokenizer has it

    def parse(
        self,
        text: str,
        final: bool,
        names: frozenset[str] | None = None,
        scans: _Scans | None = None,
    ) -> tuple[str, list[ParsedCall], bool]:
        """(content, calls, in_tool_region) for the output text so far: the content before the
        tool region, and the calls (each with the content that follows it, `after`). `names`:
        the request's tools; an object that names another function is no call (None: any name
        is a call). `scans`: the completion's earlier scans (`_Scans`), for a text that grows
        step by step."""
        raise NotImplementedError

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        """A Lark grammar for calls of `tools`: one or more if `parallel`, else exactly one."""
        raise NotImplementedError

    # helpers shared by the formats
    def _call_schema(self, tools: list[dict[str, Any]]) -> dict[str, Any]:
        """The JSON schema of one call of any of `tools`. Parameters with local refs move to
        "$defs" at its root (a caller that nests this schema moves "$defs" to its own root)."""
        args_key = self.arg_keys[0]
        options, defs = [], {}
        for t in tools:
            fn = t["function"]
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            if "type" not in params:  # arguments are an object (without it, any JSON value is)
                params = {"type": "object", **params}
            base = "/$defs/" + fn["name"].replace("~", "~0").replace("/", "~1")  # JSON pointer
            # anchors are named per tool: every tool's parameters end up in one schema, where
            # two tools' anchors of one name would resolve to one of them
            if (moved := _rebased(params, base, f"_{fn['name']}.")) != params:
                # its refs now resolve against the call's schema, not against its own "$id"
                moved = {k: v for k, v in moved.items() if k != "$id"}
                defs[fn["name"]] = moved
                params = {"$ref": f"#{base}"}
            options.append(
                {
                    "type": "object",
                    "properties": {"name": {"const": fn["name"]}, args_key: params},
                    "required": ["name", args_key],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
        return {**schema, **({"$defs": defs} if defs else {}), "x-guidance": JSON_OPTIONS}

    def _marker_lark(self) -> str:
        if self.marker_token_id is not None:
            return f"<[{self.marker_token_id}]>"
        return json.dumps(self.marker)


class HermesParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    end = "</tool_call>"

    def parse(
        self,
        text: str,
        final: bool,
        names: frozenset[str] | None = None,
        scans: _Scans | None = None,
    ) -> tuple[str, list[ParsedCall], bool]:
        calls: list[ParsedCall] = []
        start = -1  # the tool region's start: the first block that holds (or may yet) a call
        pos = 0  # the end of the blocks read
        while (j := text.find(self.marker, pos)) >= 0:
            body_start = j + len(self.marker)
            # the end marker after the call's object: the text "</tool_call>" inside one of its
            # strings (code, say) is an argument, not the end
            v = _skip_ws(text, body_start)
            value_end = _scan_value(text, v, scans) if v < len(text) and text[v] == "{" else v
            k = text.find(self.end, body_start if value_end is None else value_end)
            if value_end is None and not final:
                k = -1  # (the object is still arriving; at the end, one that never closed
                # ends at the first end marker)
            block_end = k + len(self.end) if k >= 0 else len(text)
            # (in a block still open, what follows its object may be the end marker arriving;
            # at the end, an end marker that max_tokens cut is the block's, not text after it)
            body_end = k if k >= 0 else len(text) if final or value_end is None else value_end
            if k < 0 and final and value_end is not None:
                body_end -= _partial(text[value_end:], self.end)
            block = _calls_in(text[body_start:body_end], self.arg_keys, names, scans)
            if (k >= 0 or final) and all(c.name is None for c in block):
                # a block with no call in it (a function not offered, not JSON) is content
                # wherever it stands: before the first call as part of the text before it,
                # after one as the text after it (both were dropped). Each block stands alone:
                # a call after such a block is a call.
                if calls:
                    calls[-1].after += text[pos:block_end]
                pos = block_end
                if k < 0:
                    break
                continue
            if start < 0:
                start = j
            elif calls:
                calls[-1].after += text[pos:j]  # (the text between two calls)
            calls += block
            if k < 0:
                break  # (a block still arriving: whether it holds a call is not known yet)
            pos = block_end
        else:  # the text after the last block, once it cannot be the start of a marker
            if calls:
                tail = text[pos:]
                calls[-1].after += tail[: len(tail) - (0 if final else _partial(tail, self.marker))]
        if start < 0:
            return text[: len(text) - (0 if final else _partial(text, self.marker))], [], False
        return text[:start], calls, True

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        call = f'call: {self._marker_lark()} "\\n" body "\\n" {json.dumps(self.end)}'
        start = 'start: call ("\\n" call)*' if parallel else "start: call"
        return f"{start}\n{call}\nbody: %json {json.dumps(self._call_schema(tools))}\n"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    marker = "<|python_tag|>"
    arg_keys = ("parameters", "arguments")

    def parse(
        self,
        text: str,
        final: bool,
        names: frozenset[str] | None = None,
        scans: _Scans | None = None,
    ) -> tuple[str, list[ParsedCall], bool]:
        body = text.lstrip()
        if body.startswith(self.marker):  # the tag: a tool region, whatever follows
            return "", _calls_in(body[len(self.marker) :], self.arg_keys, names, scans), True
        if not final and self.marker.startswith(body):
            return "", [], False  # maybe the tag, still arriving (or only whitespace)
        if not body.startswith("{"):
            return text, [], False
        return "", _calls_in(body, self.arg_keys, names, scans), True

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        start = 'start: body ("; " body)*' if parallel else "start: body"
        return f"{start}\nbody: %json {json.dumps(self._call_schema(tools))}\n"


class MistralParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"

    def parse(
        self,
        text: str,
        final: bool,
        names: frozenset[str] | None = None,
        scans: _Scans | None = None,
    ) -> tuple[str, list[ParsedCall], bool]:
        start = text.find(self.marker)
        if start < 0:
            return text[: len(text) - (0 if final else _partial(text, self.marker))], [], False
        region = text[start + len(self.marker) :]
        return text[:start], _calls_in(region, self.arg_keys, names, scans), True

    def grammar(self, tools: list[dict[str, Any]], parallel: bool) -> str:
        call = self._call_schema(tools)
        array: dict[str, Any] = {
            "type": "array",
            "items": call,
            "minItems": 1,
            "x-guidance": JSON_OPTIONS,
        }
        if "$defs" in call:
            array["$defs"] = call.pop("$defs")
        if not parallel:
            array["maxItems"] = 1
        return f"start: {self._marker_lark()} body\nbody: %json {json.dumps(array)}\n"


_CLASSES: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def make_parser(name: str | None, template: str, special: dict[str, int]) -> ToolParser:
    """The parser named `name`, or the one the chat template's text points to (hermes when it
    names none). `special`: the tokenizer's special tokens as text -> id, so a marker that is one
    token is enforced as that token."""
    if name is None:
        if "[TOOL_CALLS]" in template:
            name = "mistral"
        elif "<|python_tag|>" in template or '"parameters": dictionary' in template:
            name = "llama3_json"
        else:
            name = "hermes"
    if name not in _CLASSES:
        raise ValueError(f"tool-call parser must be one of {PARSERS}, got {name!r}")
    parser = _CLASSES[name]()
    parser.marker_token_id = special.get(parser.marker)
    parser.end_token_id = special.get(parser.end) if parser.end else None
    return parser


def tool_grammar(
    parser: ToolParser, tools: list[dict[str, Any]], choice: object, parallel: bool
) -> str | None:
    """The grammar `tool_choice` asks for: None for "auto" / "none" (free text, parsed after),
    a grammar for "required" (one or more calls; one unless `parallel`) or a named function
    (exactly that call)."""
    if choice == "required":
        return parser.grammar(tools, parallel)
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        return parser.grammar([t for t in tools if t["function"]["name"] == name], False)
    return None


def _rebased(schema: Any, base: str, anchors: str = "") -> Any:
    """A copy of `schema` whose local refs ("#", "#/$defs/A", "#/properties/x") point where the
    same places will be once the schema moves to the JSON pointer `base` of a larger one, and
    whose anchors ("$anchor": "a", refs "#a") take the prefix `anchors`."""
    if isinstance(schema, list):
        return [_rebased(s, base, anchors) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebased(s, base, anchors) for name, s in value.items()}
        elif key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = f"#{base}{value[1:]}"
        elif key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = f"#{anchors}{value[1:]}"  # an anchor's name
        elif key == "$anchor" and isinstance(value, str):
            out[key] = anchors + value
        else:
            out[key] = value if key in DATA_KEYWORDS else _rebased(value, base, anchors)
    return out


def _check(tools: object, choice: object, parallel: object) -> None:
    """What this module reads of `tools`, `tool_choice` and `parallel_tool_calls` has the shape
    it expects, or an InvalidRequestError names the field. (The gateway validates them in full,
    schemas included: gateway/structured.py; this keeps a bad body sent to a worker itself a
    400, not a 500.)"""
    if not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls", "must be a boolean")
    if tools is None:
        return
    if not isinstance(tools, list):
        raise InvalidRequestError("tools", f"must be an array, got {type(tools).__name__}")
    names: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function":
            raise InvalidRequestError(
                f"tools[{i}]", "must be {'type': 'function', 'function': {'name': ...}}"
            )
        if not isinstance(fn.get("name"), str):
            raise InvalidRequestError(f"tools[{i}].function.name", "must be a string")
        if not isinstance(fn.get("parameters") or {}, dict):
            raise InvalidRequestError(
                f"tools[{i}].function.parameters", "must be a JSON schema object"
            )
        if json_depth(fn.get("parameters")) > MAX_JSON_DEPTH:  # (_rebased recurses through it)
            raise InvalidRequestError(
                f"tools[{i}].function.parameters", f"nests deeper than {MAX_JSON_DEPTH} levels"
            )
        names.add(fn["name"])
    if choice is None or choice in ("none", "auto", "required"):
        return
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or name not in names:
        raise InvalidRequestError(
            "tool_choice",
            "must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': "
            f"...}}}} naming one of the tools ({sorted(names)})",
        )


@dataclass(slots=True)
class _Sent:
    id: str  # the call's id, as the client will send it back in a `tool` message
    arguments: int = 0  # characters of arguments sent


@dataclass(slots=True)
class ToolCallStream:
    """One completion's output turned into content and tool-call deltas (OpenAI shapes)."""

    parser: ToolParser
    parallel: bool = True  # False: the first call is the only one (parallel_tool_calls)
    # the tokenizer's decode (special tokens dropped), and the prompt's last tokens: where the
    # marker's special token was in the text (see _with_markers)
    decode: Callable[[list[int]], str] | None = None
    context: list[int] = field(default_factory=list)
    # the request's tool names: an object naming another function is no call (None: any name)
    names: frozenset[str] | None = None
    # a named tool_choice's function: its grammar allows nothing but that call, so the output
    # is that call even where max_tokens cut it before its name was complete (None: not named)
    forced: str | None = None
    # tool_choice "required": its grammar allows nothing but calls (of any of the tools). With
    # either, none of the output is content: what max_tokens cut is no text, even unnamed
    required: bool = False
    text: str = ""  # the output so far, with the marker's text where its special token was
    content_sent: int = 0  # characters of content sent (`text` up to there)
    calls: list[_Sent] = field(default_factory=list)
    ended: bool = False  # not `parallel` and the call is complete: the completion ends here
    failed: bool = False  # parsing failed (`give_up`): the rest of the output is content
    step_start: int = 0  # len(text) before the step being fed
    token_ids: list[int] = field(default_factory=list)  # the output's tokens (with a marker id)
    fed: int = 0  # characters of output text fed (`text` without the markers)
    # (where in the output text, the token's index, which marker) for markers whose text has
    # not come yet (the detokenizer held back the text before them)
    markers_at: list[tuple[int, int, str]] = field(default_factory=list)
    scans: _Scans = field(default_factory=lambda: _Scans())  # where its scans stopped (parse)

    def feed(
        self, text: str, token_ids: list[int], final: bool
    ) -> tuple[str, list[dict[str, Any]]]:
        """Take a step's text (and its tokens); return (content delta, tool-call deltas)."""
        self.step_start = len(self.text)
        if self.failed:
            return self.give_up(text), []
        if self.parser.marker_token_id is not None or self.parser.end_token_id is not None:
            text = self._with_markers(text, token_ids)
        self.text += text
        content, calls, in_region = self.parser.parse(self.text, final, self.names, self.scans)
        if not self.parallel:  # (what follows the one call is past the completion's end)
            calls = calls[:1]
            self.ended = bool(calls) and calls[0].complete and calls[0].name is not None
        else:  # the text after each call that is no call: content, after the text before them
            content += "".join(c.after for c in calls)
        # (a call once announced stays: `parse` never takes one back, and this makes sure its
        # text is never given back as content too)
        named = bool(self.calls) or any(c.name is not None for c in calls)
        if final and self.forced is not None and not named:
            # Cut inside the grammar's text before the name was complete: still the named call,
            # with no arguments generated (vLLM constrains only a named call's arguments, and
            # answers with the call whatever the cut); never the grammar's half-written text.
            calls, content, named = [ParsedCall(self.forced, "", False)], "", True
        if self.required or self.forced is not None:
            # The output is the grammar's text, calls only: what a cut left of a marker or of a
            # call before its name (a second one's too) is no content, nor a call (its name
            # unknown; a named choice's one call is that call, above); the calls before stand.
            content = ""
        elif final and in_region and not named:
            content = self.text  # a tool region in which no call parsed: text after all
        elif not final or named:
            content = content.rstrip()  # whitespace before a call is not content
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(calls):
            if call.name is None:
                break  # calls are announced in order, each once its name is known
            if i == len(self.calls):
                self.calls.append(_Sent(f"call_{secrets.token_hex(12)}"))
                deltas.append(
                    {
                        "index": i,
                        "id": self.calls[i].id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                )
                self.calls[i].arguments = len(call.arguments)
            elif len(call.arguments) > self.calls[i].arguments:
                more = call.arguments[self.calls[i].arguments :]
                deltas.append({"index": i, "function": {"arguments": more}})
                self.calls[i].arguments = len(call.arguments)
        delta = content[self.content_sent :] if len(content) > self.content_sent else ""
        self.content_sent += len(delta)
        return delta, deltas

    def give_up(self, text: str) -> str:
        """Stop parsing (`feed` of the step's `text` raised, or had): return the output not
        yet sent as content, that step's text included; the calls already sent stand."""
        self.failed = True
        self.text = self.text[: self.step_start] + text
        delta = self.text[self.content_sent :]
        self.content_sent = len(self.text)
        return delta

    def _with_markers(self, text: str, token_ids: list[int]) -> str:
        """The step's text with the marker's text where its special token was (the detokenizer
        drops it): after as much output text as a whole decode of the tokens before it gives,
        which counts text the detokenizer still holds back (half a character, a possible stop
        string) and places a marker inside a step of several tokens (speculative decoding).
        Without `decode`, at the step's start."""
        parser = self.parser
        start = len(self.token_ids)
        self.token_ids += token_ids
        # the opening marker's token, and the closing one's (hermes' "</tool_call>": dropped, a
        # second call read as part of the first, and every call after the first was lost)
        for marker, marker_id in ((parser.marker, parser.marker_token_id),
                                  (parser.end, parser.end_token_id)):  # fmt: skip
            if marker_id is None or marker_id not in token_ids or marker in text:
                continue  # (in the text: not a special token)
            for k in (k for k, t in enumerate(token_ids) if t == marker_id):
                if self.decode is None:
                    at_char = self.fed
                else:
                    before = self.token_ids[: start + k]
                    at_char = _decoded_len(self.decode, self.context, before)
                self.markers_at.append((at_char, start + k, marker))
        self.markers_at.sort()  # by place in the text, then in the tokens
        pieces, at = [], 0
        while self.markers_at and self.markers_at[0][0] <= self.fed + len(text):
            where, _, marker = self.markers_at.pop(0)
            cut = min(max(where - self.fed, at), len(text))
            pieces += [text[at:cut], marker]
            at = cut
        self.fed += len(text)
        return "".join(pieces) + text[at:]


def _decoded_len(decode: Callable[[list[int]], str], context: list[int], ids: list[int]) -> int:
    """Characters of text `ids` decode to after `context` (so that the first keeps its leading
    space, as the detokenizer gives it after the prompt)."""
    head, whole = decode(context), decode(context + ids)
    return len(whole) - len(head) if whole.startswith(head) else len(decode(ids))


# ----------------------------------------------------------------------------- JSON scanning
# The parsers read the output anew at every step (a step adds a token or a few), so scanning a
# call's JSON again from its start made a long call quadratic: scanned a character at a time in
# Python, 20,000 characters of arguments cost ~14 s of the worker's event loop over the ~5,700
# steps they arrived in (2.4 ms a step by the end), a call of many small objects more. The scans
# run in regular expressions (strings, and the run of text to the next bracket or quote), and a
# value still arriving is scanned from where its scan at the step before stopped (_Scans).
# a string's characters from inside it: up to its closing quote, a lone backslash at the end of
# the text, or the end (possessive: a string still arriving fails without backtracking)
_STRING_REST = re.compile(r'[^"\\]*+(?:\\.[^"\\]*+)*+', re.DOTALL)
_STRUCTURE = re.compile(r'[{}\[\]"]')  # where a container's scan stops outside strings
_SCALAR = re.compile(r"[^,}\] \t\n\r]*+")  # a number, true, false, null (or junk) so far
_SPACE = re.compile(r"[ \t\n\r]*+")
_BETWEEN_CALLS = re.compile(r"[ \t\n\r,;\[\]]*+")
SCAN_KEPT_CHARS = 256  # values this long are kept (_Scans): shorter ones are scanned again


@dataclass(slots=True, frozen=True)
class _Scan:
    """Where a scan of the value at `at` in `text` stopped: `end`, the value's end, or None and
    the state to go on from at `j` once the text has grown (containers open, inside a string)."""

    text: str  # the text it read (a value read whole: up to its end)
    at: int
    end: int | None
    j: int = 0
    depth: int = 0
    in_string: bool = False


class _Scans:
    """One completion's scans of long values (`_scan_value`) still arriving or read whole: each
    holds for any text that starts with the text it read (the output only grows), so a later
    step goes on from where it stopped, or takes its end."""

    SIZE = 64  # scans kept, the least recently used dropped first

    def __init__(self) -> None:
        self._scans: list[_Scan] = []

    def find(self, s: str, at: int) -> _Scan | None:
        """The scan at `at` that read the most of `s` (moved to the front: recently used)."""
        best = None
        for scan in self._scans:
            if (scan.at == at and len(scan.text) <= len(s) and s.startswith(scan.text)
                    and (best is None or len(scan.text) > len(best.text))):  # fmt: skip
                best = scan
        if best is not None and best is not self._scans[0]:
            self._scans = [best, *(o for o in self._scans if o is not best)]
        return best

    def keep(self, new: _Scan, before: _Scan | None) -> None:
        """Keep `new`, in place of `before`, the scan it went on from. (Only that one: a value
        of the same text before it, a call repeated, is a scan of its own.)"""
        kept = [o for o in self._scans if o is not before]
        self._scans = [new, *kept[: self.SIZE - 1]]


def _partial(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def _skip_ws(s: str, i: int) -> int:
    return _SPACE.match(s, i).end()  # type: ignore[union-attr]  # (it matches "")


def _scan_string(s: str, i: int) -> int | None:
    """End (exclusive) of the JSON string starting at s[i] == '"'; None if unterminated."""
    j = _STRING_REST.match(s, i + 1).end()  # type: ignore[union-attr]  # (it matches "")
    return j + 1 if j < len(s) and s[j] == '"' else None


def _scan_value(s: str, i: int, scans: _Scans | None = None) -> int | None:
    """End (exclusive) of the JSON value starting at s[i]; None if it is not complete yet.
    `scans`: earlier scans of this value in a text `s` continues, to go on from."""
    c = s[i]
    if c not in '"{[':
        j = _SCALAR.match(s, i).end()  # type: ignore[union-attr]  # (it matches "")
        return j if j < len(s) else None  # a scalar at the very end may still grow
    before = scans.find(s, i) if scans is not None else None
    if before is not None:
        if before.end is not None:
            return before.end
        j, depth, in_string = before.j, before.depth, before.in_string
    else:
        j, depth, in_string = (i + 1, 0, True) if c == '"' else (i, 0, False)
    end = None
    while True:
        if in_string:
            j = _STRING_REST.match(s, j).end()  # type: ignore[union-attr]  # (it matches "")
            if j >= len(s) or s[j] != '"':  # (the end, or a lone backslash just before it)
                break
            j, in_string = j + 1, False
            if depth == 0:
                end = j
                break
            continue
        m = _STRUCTURE.search(s, j)
        if m is None:
            j = len(s)
            break
        j = m.start()
        if s[j] == '"':
            j, in_string = j + 1, True
            continue
        depth += 1 if s[j] in "{[" else -1
        j += 1
        if depth == 0:
            end = j
            break
    if scans is not None and (j if end is None else end) - i >= SCAN_KEPT_CHARS:
        read = s if end is None else s[:end]
        scans.keep(_Scan(read, i, end, j, depth, in_string), before)
    return end


def _calls_in(
    s: str, arg_keys: tuple[str, ...], names: frozenset[str] | None, scans: _Scans | None = None
) -> list[ParsedCall]:
    """The call objects in `s`, separated by whitespace, ',' ';' or inside '[ ]', up to the
    first that is no call or that ends unreadably (see `_call`). From the first that is no call
    (an object naming a function not offered or not JSON before its name, or text that is no
    object) the rest of `s` is the last call's `after`: content. (Nothing after it is read as
    a call: in a sequence of objects that is not JSON, where the next one starts is a guess.)"""
    calls: list[ParsedCall] = []
    i = 0
    while True:
        i = _BETWEEN_CALLS.match(s, i).end()  # type: ignore[union-attr]  # (it matches "")
        if i >= len(s):
            return calls
        is_object = s[i] == "{"
        end = _scan_value(s, i, scans) if is_object else None
        call = (
            _call(s[i : len(s) if end is None else end], arg_keys, names, scans)
            if is_object
            else None
        )
        if call is None:
            if calls:
                calls[-1].after = s[i:]
            return calls
        calls.append(call)
        if end is None or not call.complete:  # still arriving, or unreadable after its name
            return calls
        i = end


_NOT_JSON = object()  # _json_value's answer for text that is not one JSON value


def _json_value(text: str) -> Any:
    """The JSON value `text` holds, or _NOT_JSON: what a model writes is not to be trusted
    (Python's parser would also take NaN and Infinity). JSON as its grammar has it (RFC 8259),
    as llguidance generates it for a forced call: a number of any size is JSON, read as a
    Decimal, never converted (1e400 is no infinity, an integer of over 4,300 digits no error;
    a call's arguments are the model's text, so nothing is lost). Raw control characters inside
    strings are taken (`strict=False`): models write them in code."""
    try:
        return json.loads(text, strict=False, parse_constant=_refuse, parse_float=Decimal,
                          parse_int=Decimal)  # fmt: skip
    except (ValueError, RecursionError, ArithmeticError):  # (json.JSONDecodeError is a
        # ValueError; an exponent beyond Decimal's, 1e9999999999999999999, is an
        # InvalidOperation, an ArithmeticError: not JSON here)
        return _NOT_JSON


def is_json(text: str) -> bool:
    """`text` is one JSON value, as the parsers read JSON."""
    return _json_value(text) is not _NOT_JSON


def is_json_object(text: str) -> bool:
    """`text` is one JSON object, as the parsers read JSON (the gateway's test of a call's
    arguments: the same reading as the worker's)."""
    return isinstance(_json_value(text), dict)


def _refuse(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _call(
    s: str, arg_keys: tuple[str, ...], names: frozenset[str] | None, scans: _Scans | None = None
) -> ParsedCall | None:
    """The name and arguments of the (possibly partial) object `s` (s[0] == "{").

    Before the name, everything must be JSON (keys, whole values, the name itself), and the name
    one of `names` (unless None), or this is no call: None. Once the name is read it is a call
    whatever follows, as its deltas may be out: arguments that are not JSON are kept as the
    model's text, other keys are skipped (a second "name" too, a key that is not JSON too), and
    what is not even shaped like JSON (no key, no ':') ends the call there, incomplete. A call
    that closes without arguments has "{}"."""
    name: str | None = None
    args = ""
    i = 1
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return ParsedCall(name, args, False)
        if s[i] == "}":  # (an object that closed with no name is no call: text)
            return None if name is None else ParsedCall(name, args or "{}", True)
        if s[i] == ",":
            i += 1
            continue
        if s[i] != '"':
            return _unreadable(name, args)
        key_end = _scan_string(s, i)
        if key_end is None:
            return ParsedCall(name, args, False)
        key = _json_value(s[i:key_end])
        if key is _NOT_JSON and name is None:
            return None
        i = _skip_ws(s, key_end)
        if i >= len(s):
            return ParsedCall(name, args, False)
        if s[i] != ":":
            return _unreadable(name, args)
        i = _skip_ws(s, i + 1)
        if i >= len(s):
            return ParsedCall(name, args, False)
        end = _scan_value(s, i, scans)
        if key in arg_keys and not args and s[i] == "{":  # streamed as it grows
            args = s[i : len(s) if end is None else end]
        if end is None:
            return ParsedCall(name, args, False)
        is_args = key in arg_keys and not args
        value = _json_value(s[i:end]) if name is None or is_args else None
        if value is _NOT_JSON and name is None:
            return None  # (before the name, all of it is JSON)
        if key == "name" and name is None:
            name = value if isinstance(value, str) else None
            if name is not None and names is not None and name not in names:
                return None  # a function the request did not offer: no call (text)
        elif is_args and value is _NOT_JSON:  # the model's text (the gateway finishes "stop")
            args = s[i:end]
        elif is_args:  # whole: a string holding JSON, or another value (its text, as written)
            args = value if isinstance(value, str) else s[i:end]
        i = end


def _unreadable(name: str | None, args: str) -> ParsedCall | None:
    """A call's object that goes on in something not shaped like JSON: no call before its
    name, after it the call as read so far, incomplete (nothing after it is read)."""
    return None if name is None else ParsedCall(name, args, False)


class RequestTools:
    """A chat request's tools on the worker: the grammar its `tool_choice` asks for, and one
    `ToolCallStream` per completion (None for a request without tools or with "none")."""

    def __init__(
        self,
        parser: ToolParser,
        tools: list[dict[str, Any]],
        choice: object,
        parallel: bool,
        decode: Callable[[list[int]], str] | None = None,
    ) -> None:
        self.parser = parser
        self.tools = tools  # OpenAI tool objects, validated by the gateway
        self.choice = choice  # "auto" | "required" | {"type": "function", "function": {...}}
        self.parallel = parallel  # parallel_tool_calls: False allows one call per completion
        self.decode = decode  # the tokenizer's decode (ToolCallStream.decode)
        self.context: list[int] = []  # the prompt's last CONTEXT_TOKENS, once it is tokenized
        # the functions offered: a call of another is no call (ToolCallStream.names)
        self.names = frozenset(t["function"]["name"] for t in tools)
        self.streams: dict[int, ToolCallStream] = {}  # completion index -> its stream

    @classmethod
    def of(
        cls,
        tools: list[dict[str, Any]] | None,
        choice: object,
        parallel: object,
        tokenizer: Any,
        parser_name: str | None,
    ) -> RequestTools | None:
        """`tokenizer`: the model's runtime.tokenizer.Tokenizer (its template picks the format
        unless `parser_name` names one). InvalidRequestError, naming the field, for tools, a
        tool_choice or a parallel_tool_calls of the wrong shape."""
        _check(tools, choice, parallel)
        if not tools or choice == "none":
            return None
        try:
            template = tokenizer.chat_template_source(tools)
        except ValueError:  # no chat template (a prompt of token ids): the default format
            template = ""
        parser = make_parser(parser_name, template, tokenizer.added_tokens)
        return cls(parser, tools, choice, parallel is True, tokenizer.decode)

    def constrain(self, params: Any) -> None:
        """Set the grammar of "required" or a named function on `params` (SamplingParams)."""
        from runtime.structured import StructuredOutputsParams

        grammar = tool_grammar(self.parser, self.tools, self.choice, self.parallel)
        if grammar is None:
            return
        if params.structured_outputs is not None:
            raise InvalidRequestError(
                "tool_choice",
                "a required or named tool_choice cannot be combined with response_format or "
                "another output constraint",
            )
        params.structured_outputs = StructuredOutputsParams(grammar=grammar, param="tool_choice")

    def delta(
        self, index: int, text: str, token_ids: list[int], final: bool
    ) -> tuple[str, list[dict[str, Any]]]:
        """A completion's step output as (content delta, tool-call deltas)."""
        return self._stream(index).feed(text, token_ids, final)

    def give_up(self, index: int, text: str) -> str:
        """After `delta` raised on a step's `text` (a parser bug): the completion's output not
        yet sent as content; from here on its text is content (ToolCallStream.give_up)."""
        return self._stream(index).give_up(text)

    def _stream(self, index: int) -> ToolCallStream:
        stream = self.streams.get(index)
        if stream is None:
            forced = self.choice["function"]["name"] if isinstance(self.choice, dict) else None
            stream = ToolCallStream(self.parser, self.parallel, self.decode, self.context,
                                    self.names, forced, self.choice == "required")  # fmt: skip
            self.streams[index] = stream
        return stream

    def ended(self, index: int) -> bool:
        """The completion's one call (parallel_tool_calls false) is complete: it ends here."""
        stream = self.streams.get(index)
        return stream is not None and stream.ended
