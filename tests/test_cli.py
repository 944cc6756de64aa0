"""The `edgeinfer` command line as a user meets it: chat's long conversations and its errors,
Ctrl-C while a model loads, and what --help says."""

from __future__ import annotations

import argparse
import json
import shutil
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
        "(whose sampled flag is not obeyed); a worker follows its gateway's (default 1.0)",
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


@pytest.fixture
def gc_back_on():  # type: ignore[no-untyped-def]
    """generate and worker turn cyclic GC off while they start; a refusal leaves it off."""
    import gc

    yield
    gc.enable()


@pytest.mark.usefixtures("gc_back_on")
def test_a_max_model_len_past_the_models_is_refused_before_the_load(
    stories_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """--max-model-len 100000 on a 512-position model served 512 tokens, silently (the engine
    clamps it): now a one-line refusal naming the flag, the value and the model's limit, before
    the weights are read (and before `up` starts any worker)."""
    import runtime.launcher
    import runtime.ranks
    from runtime.cli import main

    def loaded(*args: object) -> None:
        pytest.fail("the model was loaded (or `up` went on) before the refusal")

    monkeypatch.setattr(runtime.ranks, "start_weights", loaded)
    monkeypatch.setattr(runtime.launcher, "up", loaded)
    for argv in (["generate", "x"], ["chat"], ["worker", "--secret", "s"], ["up"]):
        code = main([*argv, "--model", str(stories_dir), "--max-model-len", "100000"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err[-1] == (
            "edgeinfer: error: --max-model-len 100000 is greater than the model's context "
            f"length, 512 (max_position_embeddings in {stories_dir / 'config.json'}); give at "
            "most 512, or leave --max-model-len out for 512"
        ), (argv, err)
    from runtime.cli import check_max_model_len

    check_max_model_len(str(stories_dir), 512)  # the model's own length, and shorter: taken
    check_max_model_len(str(stories_dir), 96)
    # a sliding window bounds the context (full attention is exact within it): it is named
    mistral = tmp_path / "mistral"
    mistral.mkdir()
    config = json.loads((stories_dir / "config.json").read_text())
    (mistral / "config.json").write_text(json.dumps(
        config | {"architectures": ["MistralForCausalLM"], "sliding_window": 128}))  # fmt: skip
    with pytest.raises(SystemExit, match=r"--max-model-len 200 is greater than the model's "
                       r"context length, 128 \(its sliding_window in "):  # fmt: skip
        check_max_model_len(str(mistral), 200)


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["generate", "--temperature", "-1", "x"], "--temperature: must be >= 0, got -1.0"),
        (["generate", "--top-p", "0", "x"], "--top-p: must be in (0, 1], got 0.0"),
        (["generate", "--max-tokens", "0", "x"], "--max-tokens: must be at least 1, got 0"),
        (["chat", "--min-p", "2"], "--min-p: must be in [0, 1], got 2.0"),
        (["chat", "--top-k", "-2"], "--top-k: must be -1 (disabled) or >= 0, got -2"),
    ],
)
def test_sampling_options_are_checked_before_the_model_loads(
    argv: list[str], error: str, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """`generate --temperature -1` loaded the model (minutes, for a large one), then refused."""
    from runtime import cli

    def loaded(args: argparse.Namespace) -> None:
        pytest.fail("the model was loaded before the sampling options were checked")

    monkeypatch.setattr(cli, "_build_llm", loaded)
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"edgeinfer: error: {error}"


@pytest.fixture
def commands_that_record(monkeypatch: pytest.MonkeyPatch) -> list[argparse.Namespace]:
    """generate, chat, worker and up, each replaced by one that records its arguments."""
    from runtime import cli, service_cli

    ran: list[argparse.Namespace] = []

    def record(args: argparse.Namespace) -> int:
        ran.append(args)
        return 0

    for module, name in ((cli, "cmd_generate"), (cli, "cmd_chat"),
                         (service_cli, "cmd_worker"), (service_cli, "cmd_up")):  # fmt: skip
        monkeypatch.setattr(module, name, record)
    return ran


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["generate", "--draft-model", "/m/draft", "x"],
         "--draft-model needs --speculative draft; it was given without --speculative"),
        (["worker", "--speculative", "ngram", "--draft-model", "/m/draft"],
         "--draft-model needs --speculative draft; it was given with --speculative ngram"),
        (["chat", "--draft-kv-cache-bytes", "1000000"],
         "--draft-kv-cache-bytes needs --speculative draft; it was given without --speculative"),
        (["up", "--num-speculative-tokens", "3"],
         "--num-speculative-tokens needs --speculative ngram or draft; it was given without "
         "--speculative"),
        (["generate", "--spec-max-batch-tokens", "8", "x"],
         "--spec-max-batch-tokens needs --speculative ngram or draft; it was given without "
         "--speculative"),
        (["generate", "--speculative", "draft", "--draft-model", "/m/d", "--spec-ngram", "1",
          "3", "x"],
         "--spec-ngram needs --speculative ngram; it was given with --speculative draft"),
        (["worker", "--speculative", "draft"],
         "--speculative draft needs --draft-model DIR (the draft model's folder)"),
    ],
)  # fmt: skip
def test_speculative_options_without_their_method_are_refused(
    argv: list[str], error: str, commands_that_record: list[argparse.Namespace],
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """A draft model given without --speculative draft was ignored: no speculation, silently."""
    from runtime.cli import main

    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"edgeinfer: error: {error}"
    assert not commands_that_record


def test_speculative_options_keep_their_defaults(
    commands_that_record: list[argparse.Namespace],
) -> None:
    """The options default to None (so that only given ones are checked): not given, they are
    SpeculativeConfig's defaults, which --help states."""
    from runtime.cli import engine_kwargs, main
    from runtime.speculative import SpeculativeConfig

    for argv in (["generate", "x"], ["generate", "--speculative", "ngram", "x"],
                 ["worker", "--speculative", "draft", "--draft-model", "/m/draft"],
                 ["up", "--speculative", "ngram", "--num-speculative-tokens", "3",
                  "--spec-ngram", "1", "5", "--spec-max-batch-tokens", "16"]):  # fmt: skip
        assert main(argv) == 0, argv
    plain, ngram, draft, given = (engine_kwargs(a)["speculative"] for a in commands_that_record)
    assert plain is None
    assert SpeculativeConfig(**ngram) == SpeculativeConfig(method="ngram")  # type: ignore[arg-type]
    assert SpeculativeConfig(**draft) == SpeculativeConfig(method="draft", draft_model="/m/draft")  # type: ignore[arg-type]
    assert SpeculativeConfig(**given) == SpeculativeConfig(  # type: ignore[arg-type]
        method="ngram", num_tokens=3, ngram_min=1, ngram_max=5, max_batch_tokens=16
    )
    d, help_text = SpeculativeConfig(), _help("worker")
    assert f"--speculative (default {d.num_tokens})" in help_text
    assert f"--speculative ngram (default {d.ngram_min} {d.ngram_max})" in help_text
    assert f"with --speculative (default {d.max_batch_tokens})" in help_text
    assert f"--speculative draft (default {d.draft_kv_cache_bytes >> 20} MiB)" in help_text


def test_pool_worker_args_are_split_as_a_shell_would(
    stories_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """--worker-args was split at every space: a quoted path with spaces in it reached the
    worker as pieces, quotes and all."""
    import runtime.pool_manager
    from runtime.cli import main

    configs: list[runtime.pool_manager.PoolConfig] = []

    async def serve(cfg: runtime.pool_manager.PoolConfig) -> None:
        configs.append(cfg)

    monkeypatch.setattr(runtime.pool_manager, "serve", serve)
    pool = ["pool", "--models", f"stories={stories_dir}", "--secret", "s", "--store",
            str(tmp_path)]  # fmt: skip
    worker_args = "--threads 2 --speculative draft --draft-model '/models/my draft'"
    assert main([*pool, "--worker-args", worker_args]) == 0
    assert configs[0].worker_args == [
        "--threads", "2", "--speculative", "draft", "--draft-model", "/models/my draft"
    ]  # fmt: skip
    assert main([*pool, "--worker-args", ""]) == 0 and configs[1].worker_args == []
    # unbalanced quotes: one line naming the option, and no pool
    assert main([*pool, "--worker-args", "--draft-model '/models/my draft"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("edgeinfer: error: --worker-args ") and "No closing quotation" in err
    assert len(configs) == 2


@pytest.mark.parametrize("command", ["compress", "pull"])
def test_sigterm_mid_write_cleans_up_and_exits_143(
    tmp_path: Path, stories_dir: Path, command: str
) -> None:
    """`kill` (SIGTERM) of a command building a folder runs its cleanup as Ctrl-C does: exit
    143, no half-built hidden folder left (a compression's, outside any store, was never swept),
    nothing at the destination. The signal comes from inside, once the weights are written."""
    hook = {"compress": ("runtime.compression", "_copy_extras"),
            "pull": ("runtime.model_store", "_write_shard")}[command]  # fmt: skip
    args = {"compress": ["compress", "--cast-bf16", str(stories_dir), str(tmp_path / "out")],
            "pull": ["pull", str(stories_dir), "--store", str(tmp_path / "store")]}[command]  # fmt: skip
    code = (
        "import importlib, os, signal, sys\n"
        f"m = importlib.import_module({hook[0]!r})\n"
        f"real = getattr(m, {hook[1]!r})\n"
        "def then_term(*a, **k):\n"
        "    out = real(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return out\n"
        f"setattr(m, {hook[1]!r}, then_term)\n"
        "from runtime.cli import main\n"
        f"sys.exit(main({args!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 143, done.stderr[-2000:]
    assert "edgeinfer: terminated; nothing written" in done.stderr
    left = sorted(p.name for p in tmp_path.rglob("*"))
    assert left in ([], ["store"]), left


def test_the_sigterm_cleanup_is_undone_after_the_command(tmp_path: Path) -> None:
    """Called in-process (tests, a pool), a writing command leaves the caller's SIGTERM handler
    as it found it, even when it fails."""
    import signal

    from runtime.cli import main

    before = signal.getsignal(signal.SIGTERM)
    assert main(["pull", str(tmp_path / "nothing-here"), "--store", str(tmp_path)]) == 2
    assert signal.getsignal(signal.SIGTERM) is before


# A template that fails on some messages as chat templates do: an undefined call (a jinja2
# error), '+' of a string and an int (a TypeError), a division by zero
FAILING_TEMPLATE = (
    "{% for m in messages %}{% if m['content'] == 'undef' %}{{ nope() }}"
    "{% elif m['content'] == 'type' %}{{ m['content'] + 1 }}"
    "{% elif m['content'] == 'div' %}{{ 1 // 0 }}{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _template_model(stories_dir: Path, dst: Path, template: str) -> Path:
    dst.mkdir()
    for f in stories_dir.iterdir():
        (dst / f.name).symlink_to(f)
    (dst / "chat_template.jinja").write_text(template)
    return dst


def test_a_chat_template_error_refuses_the_message_and_the_chat_goes_on(
    tmp_path: Path, stories_dir: Path
) -> None:
    """A message the template fails on was the end of the chat (a ChatTemplateError: exit 2),
    or a traceback (a TypeError, a ZeroDivisionError raised while rendering)."""
    model = _template_model(stories_dir, tmp_path / "m", FAILING_TEMPLATE)
    run = _chat(model, ["Hi", "undef", "type", "div", "Bye"], "--max-tokens", "3")
    assert run.returncode == 0 and "Traceback" not in run.stderr, run.stderr
    assert run.stdout.count("model> ") == 2, run.stdout
    assert run.stderr.count("that message was not sent; the conversation goes on") == 3
    for why in ("'nope' is undefined", "TypeError: can only concatenate", "ZeroDivisionError"):
        assert f"chat template of {model} failed on the conversation: {why}" in run.stderr


def test_a_chat_template_that_does_not_compile_is_refused_before_prompting(
    tmp_path: Path, stories_dir: Path
) -> None:
    for name, template in [("m", "{% for m in messages %}{{ m }"),
                           ("deep", "{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")]:  # fmt: skip
        model = _template_model(stories_dir, tmp_path / name, template)
        run = _chat(model, ["Hi"])
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
        assert "its chat template does not compile" in run.stderr and "you>" not in run.stdout


def test_named_chat_templates_without_a_default_are_refused_before_prompting(
    tmp_path: Path, stories_dir: Path
) -> None:
    """Only named templates (tokenizer_config.json's list), none "default": one line, exit 2,
    before the first prompt (check_chat_template's NoChatTemplateError)."""
    model = tmp_path / "named"
    shutil.copytree(stories_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "tool_use", "template": "x"}]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    run = _chat(model, ["Hi"])
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert 'none is "default"' in run.stderr and "you>" not in run.stdout


def _cli(*argv: str | bytes, **kw: object) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *argv], cwd=ROOT,
                          capture_output=True, timeout=120, **kw)  # type: ignore[call-overload]  # fmt: skip


def test_text_that_is_not_utf8_is_one_line_and_the_chat_goes_on(
    tmp_path: Path, stories_dir: Path
) -> None:
    """Bytes that are not UTF-8 (a Latin-1 terminal, a file) arrive as lone surrogates, which
    the tokenizer failed on with a TypeError: a traceback."""
    gen = ["generate", "--model", str(stories_dir), "--threads", "1", "--max-tokens", "3"]
    for run in (_cli(*gen, b"caf\xe9"), _cli(*gen, input=b"caf\xe9")):
        err = run.stderr.decode()
        assert run.returncode == 2 and "Traceback" not in err, err
        assert "is not UTF-8 text" in err and "byte 0xe9" in err, err
    model = chat_model(stories_dir, tmp_path / "chat")
    run = _cli("chat", "--model", str(model), "--threads", "1", "--max-tokens", "3",
               input=b"caf\xe9\nHi\n")  # fmt: skip
    err = run.stderr.decode()
    assert run.returncode == 0 and "Traceback" not in err, err
    assert "message: is not UTF-8 text" in err and "conversation goes on" in err, err
    assert run.stdout.decode().count("model> ") == 1


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_a_closed_stdin_is_said_before_the_model_loads(stories_dir: Path, command: str) -> None:
    """`<&-`: sys.stdin is None (an AttributeError in generate, a RuntimeError in chat, both
    once the model had loaded)."""
    import os

    run = _cli(command, "--model", str(stories_dir), preexec_fn=lambda: os.close(0))
    err = run.stderr.decode()
    assert run.returncode == 2 and "Traceback" not in err, err
    assert "stdin" in err and "closed" in err and "loaded" not in err, err


def test_generate_into_a_closed_pipe_exits_quietly(stories_dir: Path) -> None:
    """`edgeinfer generate ... | head`: the reader gone, 141 (as SIGPIPE's) and nothing said;
    it was 'edgeinfer: error: [Errno 32] Broken pipe', status 2."""
    p = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "generate", "--model", str(stories_dir),
         "--threads", "1", "--max-tokens", "50", "Once", "The dog"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert p.stdout is not None
    p.stdout.close()  # (before its first write: the model loads first)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 141, err.decode()
    assert b"error" not in err and b"Traceback" not in err and b"Exception" not in err, err


def test_generate_says_it_reads_a_terminal_for_the_prompt(stories_dir: Path) -> None:
    """Without a prompt, generate read the terminal saying nothing, as if it hung."""
    import os

    leader, follower = os.openpty()
    p = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "generate", "--model", str(stories_dir),
         "--threads", "1", "--max-tokens", "2"],
        cwd=ROOT, stdin=follower, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    os.close(follower)
    os.write(leader, b"Once\n\x04")  # a line, then Ctrl-D
    out, err = p.communicate(timeout=120)
    os.close(leader)
    assert p.returncode == 0, err.decode()
    assert b"no prompt given: type one, then Ctrl-D" in err and out.startswith(b"Once\n")


def test_the_prompt_is_checked_before_the_engine_is_imported() -> None:
    """generate and chat check their text (UTF-8) before the model's load starts, and the load
    starts before the engine's imports so that the drive works during them: the check must not
    import the engine (it imported runtime.llm, torch and all, and the read began after them:
    generate's first token ~0.25 s later)."""
    script = ("import sys; from runtime.cli import _text_arg; _text_arg('prompt', 'hi'); "
              "print('torch' in sys.modules)")  # fmt: skip
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert run.stdout.strip() == "False", run.stderr[-2000:]
