"""Streamed tool calls: what parsing a call as it arrives costs the worker, per step.

The worker turns each step's text into content and tool-call deltas (runtime.tool_parsers.
ToolCallStream) on its event loop, so a parser that rescans the output at every step costs
time that grows with the output, and every stream on the worker waits for it. This streams one
hermes call (`<tool_call>` + its JSON + `</tool_call>`) in pieces of `--step-chars` characters
(about a token's worth) through ToolCallStream, for two payloads:
- `code`: one argument holding a long program (a JSON string full of escapes);
- `records`: an array of small objects (a brace or quote every few characters);
and prints the parse time per step (mean over the stream, and over its last tenth), beside the
peer: vLLM's hermes parser, which per step reads the call so far with `partial_json_parser`
(`loads` of the text after the marker, the work it does each step; the rest of its bookkeeping
not counted).

    .venv/bin/python -m bench.tool_calls [--chars 20000] [--step-chars 4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime.tool_parsers import HermesParser, ToolCallStream  # noqa: E402


def payloads(chars: int) -> dict[str, str]:
    """Hermes outputs of about `chars` characters each."""
    lines, n = [], 0
    while n < chars:
        lines.append(f'def f{len(lines)}(x):\n    return x * {len(lines)}  # "q" \\ t\n')
        n += len(json.dumps(lines[-1]))
    records, n = [], 0
    while n < chars:
        records.append({"id": len(records), "name": f"n{len(records)}", "ok": True})
        n += len(json.dumps(records[-1])) + 2
    calls = {"code": {"code": "".join(lines)}, "records": {"rows": records}}
    return {
        k: '<tool_call>\n{"name": "run", "arguments": ' + json.dumps(v) + "}\n</tool_call>"
        for k, v in calls.items()
    }


def ours(text: str, step: int) -> list[float]:
    """Seconds per step of ToolCallStream.feed; checks the streamed arguments are the call's."""
    stream, times, args = ToolCallStream(HermesParser()), [], ""
    for k in range(0, len(text), step):
        t = time.perf_counter()
        _, deltas = stream.feed(text[k : k + step], [], False)
        times.append(time.perf_counter() - t)
        args += "".join(d["function"]["arguments"] for d in deltas)
    _, deltas = stream.feed("", [], True)
    args += "".join(d["function"]["arguments"] for d in deltas)
    body = text[len("<tool_call>\n") : -len("\n</tool_call>")]
    assert json.loads(args) == json.loads(body)["arguments"], "the streamed arguments differ"
    return times


def peer(text: str, step: int) -> list[float] | None:
    """Seconds per step of partial_json_parser.loads of the call so far (None: not installed)."""
    try:
        import partial_json_parser
        from partial_json_parser.core.options import Allow
    except ImportError:
        return None
    times = []
    for k in range(step, len(text) + step, step):
        so_far = text[: min(k, len(text))]
        t = time.perf_counter()
        body = so_far[len("<tool_call>\n") :].split("</tool_call>")[0]
        if body:
            with contextlib.suppress(Exception):  # (vLLM's waits for more text too)
                partial_json_parser.loads(body, Allow.ALL)
        times.append(time.perf_counter() - t)
    return times


def _us(times: list[float], part: Callable[[list[float]], list[float]]) -> float:
    xs = part(times)
    return 1e6 * sum(xs) / len(xs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--chars", type=int, default=20000, help="each output's length (about)")
    p.add_argument("--step-chars", type=int, default=4, help="characters a step adds")
    args = p.parse_args(argv)
    print(f"bench/tool_calls.py {time.strftime('%Y-%m-%d %H:%M')}, {platform.machine()}, "
          f"Python {platform.python_version()}, steps of {args.step_chars} characters")  # fmt: skip
    print(f"{'payload':8s} {'chars':>6s} {'steps':>6s}  {'ours us/step':>12s} {'(last 10%)':>10s}"
          f"  {'peer us/step':>12s} {'(last 10%)':>10s}  {'peer/ours':>9s}  {'ours s':>6s}")  # fmt: skip
    last: Callable[[list[float]], list[float]] = lambda xs: xs[-max(1, len(xs) // 10) :]  # noqa: E731
    every: Callable[[list[float]], list[float]] = lambda xs: xs  # noqa: E731
    for name, text in payloads(args.chars).items():
        t_ours, t_peer = ours(text, args.step_chars), peer(text, args.step_chars)
        row = (f"{name:8s} {len(text):6d} {len(t_ours):6d}  {_us(t_ours, every):12.1f} "
               f"{_us(t_ours, last):10.1f}")  # fmt: skip
        if t_peer is None:
            row += "  (partial_json_parser is not installed: pip install partial-json-parser)"
        else:
            ratio = sum(t_peer) / sum(t_ours)
            row += f"  {_us(t_peer, every):12.1f} {_us(t_peer, last):10.1f}  {ratio:8.2f}x"
        print(row + f"  {sum(t_ours):6.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
