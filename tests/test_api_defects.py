"""What a user of the Python API and the CLI met at their edges: text that is not UTF-8 handed to
the engine itself, OpenAI-style content parts in `LLM.chat`, Ctrl-C at the chat prompt, and a
context-length refusal that named the API's field to a CLI user."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime import LLM, SamplingParams
from runtime.sampling_params import InvalidRequestError
from tests.stack import ROOT, chat_model

GREEDY = SamplingParams(temperature=0, max_tokens=2)


@pytest.fixture(scope="module")
def model(stories_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_model(stories_dir, tmp_path_factory.mktemp("api-defects") / "chat")


@pytest.fixture(scope="module")
def llm(model: Path) -> LLM:
    return LLM(str(model), kv_cache_bytes=1_000_000, num_threads=1)


def test_the_engine_refuses_text_that_is_not_utf8_naming_the_prompt(llm: LLM) -> None:
    """A prompt reaching the engine itself (the worker's path, an embedder's) with a lone
    surrogate was a TypeError from the tokenizer ('TextInputSequence must be str')."""
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match=r"^prompt: is not UTF-8 text: character 3 "
                       r"is '\\ud800', a lone surrogate") as err:  # fmt: skip
        engine.tokenize_prompt("hi \ud800")
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match=r"byte 0xff") as err:
        engine.add_request(engine.next_request_id(), "caf\udcff", GREEDY)
    assert err.value.param == "prompt" and not engine.has_unfinished()
    assert engine.tokenize_prompt("café 🙂")  # (UTF-8 text goes through)


def test_chat_takes_text_content_parts_as_the_gateway_does(llm: LLM) -> None:
    """Parts are joined with newlines (gateway/openai_api.py): the chat template printed the
    list's repr ("user: [{'type': 'text', ...}]") into the prompt."""
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": " there"}]
    conv = [
        {"role": "system", "content": [{"type": "text", "text": "Be kind"}]},
        {"role": "user", "content": parts},
        {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
        {"role": "user", "content": "Why?"},
    ]
    texts = ["Be kind", "hi\n there", "No.", "Why?"]
    flat = [{**m, "content": c} for m, c in zip(conv, texts, strict=True)]
    (got,), (want,) = llm.chat(conv, GREEDY), llm.chat(flat, GREEDY)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert conv[1]["content"] is parts  # (the caller's messages are left as they were)
    # one conversation of several: each named by its index
    (a, b) = llm.chat([flat, conv], GREEDY)
    assert a.prompt_token_ids == b.prompt_token_ids


def test_chat_takes_the_developer_role_as_system(llm: LLM) -> None:
    """OpenAI's "developer" role is the system's new name: the gateway sends it on as "system"
    (gateway/openai_api.py); LLM.chat gave it to the chat template as it was."""
    dev = [{"role": "developer", "content": "Be kind"}, {"role": "user", "content": "hi"}]
    sys_ = [{**dev[0], "role": "system"}, dev[1]]
    (got,), (want,) = llm.chat(dev, GREEDY), llm.chat(sys_, GREEDY)
    assert got.prompt_token_ids == want.prompt_token_ids
    assert dev[0]["role"] == "developer"  # (the caller's messages are left as they were)


@pytest.mark.parametrize(
    ("content", "param", "message"),
    [
        ([{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}],
         "messages[0].content[1].type", "only text content parts .* got type 'image_url'"),
        ([{"type": "refusal", "refusal": "no"}], "messages[0].content[0].type",
         "got type 'refusal'"),  # (from the assistant only)
        ([{"text": "a"}], "messages[0].content[0].type", "got type None"),
        ([{"type": "text", "text": 3}], "messages[0].content[0].text", "must be a string, got int"),
        (["a"], "messages[0].content[0]", "must be a content part"),
        ([], "messages[0].content", "non-empty list of text parts"),
        ([{"type": "text", "text": "caf\udce9"}], "messages[0].content[0].text",
         "is not UTF-8 text.*byte 0xe9"),
    ],
)  # fmt: skip
def test_chat_refuses_content_parts_it_cannot_show_naming_the_part(
    llm: LLM, content: list[object], param: str, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=message) as err:
        llm.chat([{"role": "user", "content": content}], GREEDY)
    assert err.value.param == param
    assert not llm.engine.has_unfinished()


def _read_until(fd: int, marker: bytes, count: int, timeout: float = 120) -> bytes:
    """What `fd` gives until `marker` has come `count` times."""
    seen, deadline = b"", time.monotonic() + timeout
    while seen.count(marker) < count:
        left = deadline - time.monotonic()
        assert left > 0 and select.select([fd], [], [], left)[0], f"no {marker!r}: {seen!r}"
        chunk = os.read(fd, 4096)
        assert chunk, f"output ended before {marker!r}: {seen!r}"
        seen += chunk
    return seen


def test_ctrl_c_at_the_chat_prompt_exits_130_without_a_traceback(model: Path) -> None:
    """It exited 0, as an empty line or Ctrl-D do, so a script could not tell an interrupted
    chat from one ended as asked."""
    # SIGINT's default action in the child, as a terminal's foreground command has it: a
    # command a non-interactive shell starts in the background (`nohup ... &`, how a CI run may
    # be started) inherits SIGINT ignored, and Python then leaves it ignored (no
    # KeyboardInterrupt: the chat sat in input() until stdin closed, and exited 0 at its EOF)
    p = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "chat", "--model", str(model), "--threads", "1",
         "--max-tokens", "2"],
        cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    assert p.stdin is not None and p.stdout is not None
    try:
        p.stdin.write(b"Hi\n")  # one turn first: Ctrl-C at the prompt, not during the load
        p.stdin.flush()
        out = _read_until(p.stdout.fileno(), b"you> ", 2)  # (its reply came between)
        # Ctrl-C once it is blocked reading stdin, as a person's comes: input() writes the
        # prompt, then reads, and a SIGINT between the two (a loaded host) only sets Python's
        # flag, which nothing checks while the read blocks (CPython's own window)
        wchan = Path(f"/proc/{p.pid}/wchan")
        deadline = time.monotonic() + 30
        while "pipe" not in wchan.read_text() and time.monotonic() < deadline:
            time.sleep(0.01)
        p.send_signal(signal.SIGINT)  # (stdin open: it waits in input())
        p.wait(timeout=60)  # (stdin open till then: at EOF it would exit 0, as Ctrl-D does)
        rest, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err.decode()
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err.decode()
    assert err.endswith(b"tok/s]\n\n"), err.decode()  # the newline after the prompt
    assert rest == b"", out + rest


def test_the_cli_names_max_tokens_as_its_option(model: Path) -> None:
    """The context-length refusal named the API's `max_tokens` where the user typed
    --max-tokens: 'max_tokens: ... (max_tokens: at most 62).'"""
    run = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "generate", "--model", str(model), "--threads",
         "1", "--max-model-len", "64", "--max-tokens", "100", "Once"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    refusal = "edgeinfer: error: --max-tokens: This model's maximum context length is 64 tokens"
    assert refusal in run.stderr and "(--max-tokens: at most 62)." in run.stderr, run.stderr
    assert "max_tokens" not in run.stderr, run.stderr
    run = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "chat", "--model", str(model), "--threads", "1",
         "--max-model-len", "64", "--max-tokens", "100"],
        cwd=ROOT, input="Hi\n", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert "edgeinfer: error: --max-tokens: This model's maximum context length" in run.stderr
    assert "max_tokens" not in run.stderr and "conversation goes on" in run.stderr, run.stderr


def test_the_cli_names_the_options_that_set_a_context_limit(model: Path) -> None:
    """A prompt too long for --max-model-len, or for the KV cache --kv-cache-bytes sized, was
    refused naming the limit only; the user could not tell that an option of theirs set it
    (stories260K's own context is 512 tokens)."""

    def refusal(*options: str, prompt: str = "Once upon a time " * 20) -> str:  # ~80 tokens
        run = subprocess.run(
            [sys.executable, "-m", "runtime.cli", "generate", "--model", str(model), "--threads",
             "1", "--max-tokens", "4", *options, prompt],
            cwd=ROOT, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert run.returncode == 2 and "Traceback" not in run.stderr, (options, run.stderr)
        return run.stderr

    err = refusal("--max-model-len", "64")
    assert "error: prompt: This model's maximum context length is 64 tokens" in err, err
    assert "(--max-model-len 64 sets it; the model's own is 512 tokens)" in err, err
    # 3 blocks of 16 tokens: keys and values, 5 layers, 4 KV heads of 8, float32
    err = refusal("--kv-cache-bytes", str(3 * 16 * 2 * 5 * 4 * 8 * 4))
    assert "This worker's KV cache holds 48 tokens" in err, err
    assert "(--kv-cache-bytes or --kv-cache-fraction sets the KV cache's size)" in err, err
    err = refusal(prompt="Once upon a time " * 150)  # the model's own limit: nothing to name
    assert "(--" not in err, err
