"""The `edgeinfer` command line as a user meets it: chat's long conversations and its errors,
Ctrl-C while a model loads, and what --help says."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack import ROOT, chat_model


def _chat(model: Path, lines: list[str], *args: str) -> subprocess.CompletedProcess[str]:
    """`edgeinfer chat` on `model`, typing `lines`, then Ctrl-D."""
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli", "chat", "--model", str(model), "--threads", "1",
         "--kv-cache-bytes", "4000000", *args],
        cwd=ROOT, input="".join(f"{line}\n" for line in lines), capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def test_chat_goes_on_past_a_message_too_long_and_drops_its_oldest_turns(
    tmp_path: Path, stories_dir: Path
) -> None:
    model = chat_model(stories_dir, tmp_path / "stories-chat")
    # a context of 96 tokens: a turn here is ~24 prompt tokens and a reply of 16
    lines = ["Hi", "word " * 300, *["Tell me about the cat"] * 5, "Bye"]
    run = _chat(model, lines, "--max-model-len", "96", "--max-tokens", "16", "--system", "Be kind")
    assert run.returncode == 0, run.stderr
    # the over-long message: refused, said so, and the chat went on
    assert "maximum context length is 96 tokens" in run.stderr, run.stderr
    assert run.stderr.count("that message was not sent") == 1, run.stderr
    assert run.stdout.count("model> ") == len(lines) - 1, run.stdout
    assert "the conversation outgrew the model's context" in run.stderr, run.stderr


def test_chat_needs_a_chat_template_and_says_so_before_prompting(stories_dir: Path) -> None:
    run = _chat(stories_dir, ["Hi"])  # stories260K ships no chat template
    assert run.returncode == 2, run.stderr
    assert "has no chat template" in run.stderr and "edgeinfer generate" in run.stderr
    assert "you>" not in run.stdout and "Traceback" not in run.stderr, run.stdout + run.stderr


def test_ctrl_c_while_loading_exits_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from runtime import cli

    def interrupted(args: argparse.Namespace) -> None:
        raise KeyboardInterrupt  # as a Ctrl-C lands while the weights load

    monkeypatch.setattr(cli, "_build_llm", interrupted)
    try:
        code = cli.main(["chat"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C while loading ended `edgeinfer` with a traceback")
    assert code == 130
    assert "Traceback" not in capsys.readouterr().err


def _help(command: str) -> str:
    from runtime.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(sub.choices[command].format_help().split())  # (unwrapped)


def test_help_shows_defaults_and_environment_variables() -> None:
    gateway, up, worker = _help("gateway"), _help("up"), _help("worker")
    for text in (
        "--host HOST interface to listen on; 0.0.0.0 for every one (default 127.0.0.1)",
        "--port PORT port to listen on (default 8080)",
        "(413 above it) (default 1048576)",
        "$EDGEINFER_API_KEYS",
        "(408) (default 30.0)",
        "before it is closed (default 30.0)",
        "a streaming one ends with an error (default 10.0)",
        "(a client's sampled flag is obeyed) (default 1.0)",
    ):
        assert text in gateway, text
    for text in (
        "$EDGEINFER_REDIS",
        "$EDGEINFER_API_KEYS",
        "the gateway's port (default 8080)",
        "serve (default local)",
        "of the free GPU memory on CUDA (default 0.25)",
    ):
        assert text in up, text
    for text in ("heartbeats (default 2.0)", "seconds (default 10.0)", "(default 30.0)",
                 "waiting queue (default 4096)"):  # fmt: skip
        assert text in worker, text


@pytest.mark.parametrize("command", ["worker", "gateway", "up"])
@pytest.mark.parametrize("port", ["0", "70000", "http"])
def test_a_port_out_of_range_is_one_line(command: str, port: str) -> None:
    """`--port 70000` bound port 4464 and registered http://127.0.0.1:70000 (and `--port 0` a
    random port, registered as :0): gateways routed to URLs no one answered."""
    out = subprocess.run(
        [sys.executable, "-m", "runtime.cli", command, "--port", port],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "argument --port: " in out.stderr.splitlines()[-1], out.stderr


def test_worker_and_engine_limits_that_cannot_be_meant() -> None:
    from runtime.config import EngineConfig
    from runtime.worker import WorkerConfig

    with pytest.raises(ValueError, match="max_model_len must be >= 1"):
        EngineConfig(model=str(ROOT), max_model_len=-5)
    with pytest.raises(ValueError, match="drain_timeout_s must be >= 0"):
        WorkerConfig("m", "r", "mixed", "127.0.0.1", 1, "u", "s", None, drain_timeout_s=-1)
