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


def test_generate_keeps_prompts_apart_on_stdout_and_stops_on_ctrl_c(
    stories_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each completion ends its line on stdout (the newline went to stderr with the token
    count: piped, the completions ran together); Ctrl-C ends the command with 130 (it aborted
    the prompt it was on, then ran the next ones and exited 0)."""
    from runtime.cli import main

    args = ["generate", "--model", str(stories_dir), "--threads", "1", "--max-tokens", "3"]
    assert main([*args, "Once", "The dog"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.startswith(s) for line, s in zip(out, ["--- ", "Once", "--- ", "The dog"],
                                                  strict=True)] == [True] * 4, out  # fmt: skip
    import runtime.engine

    def interrupted(self):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    monkeypatch.setattr(runtime.engine.LLMEngine, "step", interrupted)
    assert main([*args, "Once", "The dog"]) == 130
    assert "The dog" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "--threads", "-1", "x"],
        ["generate", "--dist-port", "70000", "x"],
        ["pool", "--region", "r", "--events", "-3"],
        ["up", "--worker-port", "70000"],
        ["up", "--workers", "0"],
    ],
)
def test_bad_numbers_are_one_line_and_status_2(argv: list[str]) -> None:
    """Tracebacks before (torch's set_num_threads, a pybind TypeError, Redis' XREVRANGE, bind's
    OverflowError), or a refusal with exit status 1 (SystemExit with a message)."""
    out = subprocess.run([sys.executable, "-m", "runtime.cli", *argv], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(("edgeinfer: error:", "edgeinfer ")), out.stderr


def test_the_python_api_names_a_bad_argument(stories_dir: Path) -> None:
    """Settings of the wrong type fail with a ValueError naming them, before anything runs (a
    string was a conversation per character, a dict an AttributeError deep in the engine)."""
    from runtime import LLM, SamplingParams
    from runtime.sampling_params import InvalidRequestError

    with pytest.raises(ValueError, match=r"num_threads must be an integer >= 1, got -1"):
        LLM(str(stories_dir), num_threads=-1)
    with pytest.raises(ValueError, match=r"max_num_seqs must be an integer >= 1, got '4'"):
        LLM(str(stories_dir), max_num_seqs="4")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="include_stop_str_in_output"):
        SamplingParams(stop=[" time"], include_stop_str_in_output="no")  # type: ignore[arg-type]
    llm = LLM(str(stories_dir), kv_cache_bytes=1_000_000)
    for bad in ({"temperature": 0}, "abc", ["x"]):
        with pytest.raises(InvalidRequestError, match="sampling_params"):
            llm.generate(["Once"], bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="messages"):
        llm.chat("hello")  # type: ignore[arg-type]


def test_the_python_api_takes_what_it_took(stories_dir: Path, tmp_path: Path) -> None:
    """What the new checks must not refuse: numpy integers for counts, dist_port 0 (a free
    port), a conversation as a tuple of messages."""
    import numpy as np

    from runtime import LLM, SamplingParams
    from runtime.cli import build_parser
    from runtime.config import EngineConfig

    llm = LLM(str(chat_model(stories_dir, tmp_path / "chat")),
              kv_cache_bytes=np.int64(1_000_000), max_num_seqs=np.int32(4))  # type: ignore[arg-type]  # fmt: skip
    assert llm.engine.config.max_num_seqs == 4 and type(llm.engine.config.max_num_seqs) is int
    assert EngineConfig(model=str(stories_dir), dist_port=0).dist_port == 0
    assert build_parser().parse_args(["generate", "--dist-port", "0", "x"]).dist_port == 0
    params = SamplingParams(max_tokens=2, temperature=0)
    (out,) = llm.chat(({"role": "user", "content": "Hi"},), params)  # type: ignore[arg-type]
    assert len(out.outputs[0].token_ids) == 2
