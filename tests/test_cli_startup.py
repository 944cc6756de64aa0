"""What the CLI refuses before anything starts or loads, in the words of the flags typed, and
what `edgeinfer up` prints to paste (a newcomer's walk through the README)."""

from __future__ import annotations

import io
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import orjson
import pytest

from gateway.regions import DEFAULT_CATALOG, RegionCatalog
from kvstore.redis_server import find_free_port
from tests.stack import ROOT, chat_model

KNOWN = ", ".join(sorted(RegionCatalog.load().regions))


class Loaded(Exception):
    """Raised where a command would go on to load the model or start the stack."""


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """generate, worker and up stopped where the model would load (or the stack start); worker
    and generate turn cyclic GC off while starting: it is turned back on afterwards."""
    import gc

    import runtime.launcher
    import runtime.ranks

    def loaded(*args: object, **kwargs: object) -> None:
        raise Loaded

    monkeypatch.setattr(runtime.ranks, "start_weights", loaded)
    monkeypatch.setattr(runtime.launcher, "up", loaded)
    monkeypatch.setenv("EDGEINFER_SECRET", "s")
    yield
    gc.enable()


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str, list[str]]:
    """runtime.cli.main(argv): its exit status (argparse's own exits included: SystemExit) and
    its stderr's lines; "loaded" where it went on to load the model (or start the stack)."""
    from runtime.cli import main

    try:
        code: int | str = main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 2
    except Loaded:
        code = "loaded"
    return code, capsys.readouterr().err.strip().splitlines()


# ------------------------------------------------------------------ `up`


@pytest.mark.usefixtures("no_load")
@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--model", "{tmp}"], "edgeinfer: error: --model: {tmp}/config.json: missing (is {tmp} "
         "a Hugging Face model folder?)"),
        (["--model", "{broken}"], "edgeinfer: error: --model: {broken}/config.json: not valid "
         "JSON"),
        (["--kv-cache-bytes", "-5"], "edgeinfer up: error: argument --kv-cache-bytes: must be "
         "at least 1, got -5"),
        (["--kv-cache-fraction", "2"], "edgeinfer up: error: argument --kv-cache-fraction: must "
         "be in (0, 0.95], got 2"),
        (["--dtype", "float16", "--kv-cache-dtype", "bfloat16"], "edgeinfer: error: "
         "--kv-cache-dtype bfloat16 takes a bfloat16 model, or a float32 one on the CPU; got "
         "--dtype float16, --device cpu"),
    ],
)  # fmt: skip
def test_up_refuses_a_folder_that_is_no_model_and_bad_engine_options_before_starting(
    args: list[str], error: str, tmp_path: Path, stories_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """`up --model /tmp` (and the engine options below) started Redis and the gateway; the
    worker died ~6 s later, its error printed twice, exit 1. Now: refused, exit 2, nothing
    started (`up` is never reached)."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    names = {"tmp": str(tmp_path), "broken": str(broken)}
    argv = ["up", "--device", "cpu", *[a.format(**names) for a in args]]
    if "--model" not in argv:
        argv += ["--model", str(stories_dir)]
    code, err = _main(argv, capsys)
    assert code == 2, err
    assert err[-1].startswith(error.format(**names)), err


# ------------------------------------------------------------------ `worker`


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


@pytest.mark.usefixtures("no_load")
def test_worker_refuses_a_taken_port_or_kv_port_before_loading(
    taken_port: int, stories_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The model loaded, then the server failed to bind (--kv-port: "[Errno 98] Address
    already in use", no flag named)."""
    base = ["worker", "--model", str(stories_dir), "--no-redis"]
    code, err = _main([*base, "--port", str(taken_port)], capsys)
    assert (code, err[-1]) == (2, (
        f"edgeinfer: error: --port {taken_port}: the worker cannot listen on "
        f"127.0.0.1:{taken_port}: address already in use; give another --port")), err  # fmt: skip
    code, err = _main([*base, "--port", str(find_free_port()), "--kv-port", str(taken_port)],
                      capsys)  # fmt: skip
    assert (code, err[-1]) == (2, (
        f"edgeinfer: error: --kv-port {taken_port}: the worker's KV-transfer server cannot "
        f"listen on 127.0.0.1:{taken_port}: address already in use; give another "
        "--kv-port")), err  # fmt: skip
    port = find_free_port()
    code, err = _main([*base, "--port", str(port), "--kv-port", str(port)], capsys)
    assert (code, err[-1]) == (2, f"edgeinfer: error: --kv-port {port} is --port too; give "
                               "another (0: a free one)"), err  # fmt: skip
    # free ports: it goes on to load
    assert _main([*base, "--port", str(find_free_port())], capsys)[0] == "loaded"


@pytest.mark.usefixtures("no_load")
@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--served-model-name", "a{b", "--no-redis"],
         "--served-model-name must not contain '{' or '}': 'a{b'"),
        (["--worker-id", "a{b"], "--worker-id must not contain '{' or '}': 'a{b'"),
        (["--worker-id", "w" * 257], "--worker-id is 257 characters long; the limit is 256"),
        (["--heartbeat", "0"], "--heartbeat must be > 0 seconds, got 0.0"),
        (["--heartbeat", "5", "--ttl", "4"], "--ttl (4.0) must be longer than --heartbeat "
         "(5.0): the registry entry would expire between heartbeats"),
        (["--drain-timeout", "-1"], "--drain-timeout must be at least 0, got -1.0"),
        (["--kv-hold", "0"], "--kv-hold must be > 0, got 0.0"),
        (["--max-body-bytes", "100"], "--max-body-bytes must be at least 1024, got 100"),
        (["--speculative", "ngram", "--spec-ngram", "4", "2"],
         "--spec-ngram MIN MAX: need 1 <= MIN <= MAX, got 4 and 2"),
    ],
)  # fmt: skip
def test_worker_refuses_what_its_registry_would_before_loading_naming_the_flag(
    args: list[str], error: str, stories_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--served-model-name 'a{b'` / `--worker-id 'a{b'` were refused only once the model had
    loaded, and only with Redis (--no-redis took them); `--heartbeat 0` said "need 0 <
    heartbeat_s < ttl_s", in WorkerConfig's words."""
    argv = ["worker", "--model", str(stories_dir), "--port", str(find_free_port()), *args]
    code, err = _main(argv, capsys)
    assert (code, err[-1]) == (2, f"edgeinfer: error: {error}"), err


def _catalog(path: Path, *regions: str) -> Path:
    path.write_text("regions:\n" + "".join(
        f"  - {{name: {r}, latitude: 1.0, longitude: 2.0, settings: {{}}}}\n" for r in regions))  # fmt: skip
    return path


@pytest.mark.usefixtures("no_load")
def test_worker_refuses_a_region_its_catalog_lacks_and_warns_without_one(
    tmp_path: Path, stories_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`worker --region eu-wset` (a typo) registered, and gateways routed to it as a remote
    region. Given the gateways' catalog (--regions, as a gateway is), a region it lacks is
    refused; without one, the packaged catalog's regions are checked and a region it lacks is
    warned about (a deployment's gateways may read a catalog of their own: their workers and
    pools are not given it)."""
    base = ["worker", "--model", str(stories_dir), "--port", str(find_free_port())]
    catalog = _catalog(tmp_path / "regions.yaml", "mars-north", "mars-south")
    code, err = _main([*base, "--region", "mars-nort", "--regions", str(catalog)], capsys)
    assert (code, err[-1]) == (2, "edgeinfer: error: --region 'mars-nort' is not in the region "
                               f"catalog {catalog} (known: mars-north, mars-south)"), err  # fmt: skip
    code, err = _main([*base, "--region", "mars-north", "--regions", str(catalog)], capsys)
    assert code == "loaded" and not err, err
    code, err = _main([*base, "--region", "eu-wset"], capsys)
    assert code == "loaded", err
    assert err[0] == (f"edgeinfer: warning: --region 'eu-wset' is not in the region catalog "
                      f"{DEFAULT_CATALOG} (known: {KNOWN}); gateways whose catalog lacks it "
                      "route to it as another region's (a typo?); give --regions FILE, the "
                      "gateways' catalog, to refuse a region it lacks"), err  # fmt: skip
    code, err = _main([*base, "--region", "eu-west"], capsys)
    assert code == "loaded" and not err, err
    code, err = _main([*base, "--regions", str(tmp_path / "none.yaml")], capsys)
    assert code == 2 and err[-1].startswith("edgeinfer: error: --regions"), err


@pytest.mark.parametrize("split", [[], ["--tp", "2"]], ids=["one rank", "tp=2"])
def test_the_worker_timeline_shows_the_ranks_start_apart_from_its_imports(
    tmp_path: Path, stories_dir: Path, split: list[str]
) -> None:
    """Split over ranks, a worker starts the others (spawns them, joins them, waits for each to
    read its share) between its imports: that counted as imports ("imports 0.00-4.44" at tp=2
    against 1.36 on one rank), and "weights read" was rank 0's share without saying so. It is a
    phase of its own; one rank's timeline is as it was."""
    log = tmp_path / "worker.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "worker", "--model", str(stories_dir), "--no-redis",
         "--port", str(find_free_port()), "--threads", "1", "--kv-cache-bytes", "4000000",
         *split],
        cwd=ROOT, env=os.environ | {"EDGEINFER_SECRET": "s", "PYTHONUNBUFFERED": "1"},
        stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        out = _wait_for(log, " ready: ", proc, 120)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # (its ranks too)
        proc.wait(30)
    line = next(x for x in out.splitlines() if x.startswith("start-up: "))
    t = r"(\d+\.\d\d)"
    read = r" \| weights read [\d.]+-[\d.]+ \("
    if not split:
        assert re.match(rf"start-up: imports 0\.00-{t} \| model set-up [\d.-]+{read}0\.00 GB at ",
                        line), line  # fmt: skip
        assert "rank" not in line, line
        return
    found = re.match(rf"start-up: imports 0\.00-{t}, {t}-{t} \| ranks started {t}-{t} \(rank 1 "
                     rf"of 2 spawned and joined, its share read\) \| model set-up [\d.-]+{read}"
                     r"rank 0's share, 1 of 2 ranks: 0\.00 GB at ", line)  # fmt: skip
    assert found, line
    first, resumed, done, started, joined = (float(x) for x in found.groups())
    assert (first, resumed) == (started, joined) and first < resumed <= done, line


# ------------------------------------------------------------------ generate


@pytest.mark.usefixtures("no_load")
def test_generate_refuses_an_empty_prompt_before_loading(
    stories_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`generate ""` and `generate </dev/null` loaded the model, then refused the prompt."""
    base = ["generate", "--model", str(stories_dir)]
    code, err = _main([*base, ""], capsys)
    assert (code, err[-1]) == (2, "edgeinfer: error: prompt: must not be empty"), err
    code, err = _main([*base, "Once", ""], capsys)
    assert (code, err[-1]) == (2, "edgeinfer: error: prompt: must not be empty"), err
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # (a pipe or /dev/null: no terminal)
    code, err = _main(base, capsys)
    assert (code, err[-1]) == (2, "edgeinfer: error: no prompt: stdin was empty; give one as an "
                               "argument, or on stdin"), err  # fmt: skip
    monkeypatch.setattr(sys, "stdin", io.StringIO("Once upon"))
    assert _main(base, capsys)[0] == "loaded"


def test_generate_reads_piped_stdin_as_the_prompt(stories_dir: Path) -> None:
    """Piped stdin, read before the model loads now, is still the prompt."""
    run = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "generate", "--model", str(stories_dir),
         "--threads", "1", "--max-tokens", "3"],
        cwd=ROOT, input="Once upon a time", capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("Once upon a time"), run.stdout


@pytest.mark.usefixtures("no_load")
@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--speculative", "ngram", "--spec-ngram", "4", "2"],
         "edgeinfer: error: --spec-ngram MIN MAX: need 1 <= MIN <= MAX, got 4 and 2"),
        (["--speculative", "ngram", "--num-speculative-tokens", "8", "--spec-max-batch-tokens",
          "4"], "edgeinfer: error: --spec-max-batch-tokens (4) must be at least 1 + "
         "--num-speculative-tokens (9)"),
        (["--dtype", "float16", "--kv-cache-dtype", "bfloat16"], "edgeinfer: error: "
         "--kv-cache-dtype bfloat16 takes a bfloat16 model, or a float32 one on the CPU; got "
         "--dtype float16, --device cpu"),
        (["--max-model-len", "-3"], "edgeinfer generate: error: argument --max-model-len: must "
         "be at least 0, got -3"),
        (["--tp", "0"], "edgeinfer generate: error: argument --tp: must be at least 1, got 0"),
    ],
)  # fmt: skip
def test_engine_options_are_refused_in_the_flags_words(
    args: list[str], error: str, stories_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--spec-ngram 4 2` said "need 1 <= ngram_min <= ngram_max": SpeculativeConfig's and
    EngineConfig's field names, which the command line does not have."""
    argv = ["generate", "--model", str(stories_dir), "--device", "cpu", *args, "x"]
    code, err = _main(argv, capsys)
    assert (code, err[-1]) == (2, error), err


def test_name_flags_keeps_values_and_prose() -> None:
    from runtime.cli import engine_flags_message

    assert engine_flags_message(
        "tp, pp and ep above 1 run on the CPU (gloo ranks); on CUDA (NCCL) they are not built "
        "yet: use device='cpu' or tp=pp=ep=1"
    ) == ("--tp, --pp and --ep above 1 run on the CPU (gloo ranks); on CUDA (NCCL) they are not "
          "built yet: use --device cpu or tp=pp=ep=1")  # fmt: skip
    assert engine_flags_message(
        "keep_weights_compressed (--keep-weights-compressed) needs bfloat16 weights: "
        "dtype='bfloat16' (--dtype bfloat16)"
    ) == "--keep-weights-compressed needs bfloat16 weights: --dtype bfloat16 (--dtype bfloat16)"
    assert engine_flags_message("max_model_len must be >= 1 (0: the model's), got -3") == (
        "--max-model-len must be >= 1 (0: the model's), got -3"
    )


def test_max_model_len_help_says_what_0_means() -> None:
    run = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "(default, or 0: the model's)" in " ".join(run.stdout.split()), run.stdout


@pytest.mark.usefixtures("no_load")
def test_a_gguf_file_given_as_the_model_says_how_to_import_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`generate --model some_file.gguf` said "no such model folder", with no hint."""
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    code, err = _main(["generate", "--model", str(gguf), "x"], capsys)
    assert (code, err[-1]) == (2, (
        f"edgeinfer: error: {gguf}: no such model folder: it is a GGUF file; convert it into "
        f"one first: edgeinfer import-gguf {gguf} OUT_DIR (or into the store: edgeinfer pull "
        f"{gguf})")), err  # fmt: skip
    monkeypatch.chdir(tmp_path)  # a bare file name, as typed in its folder
    code, err = _main(["generate", "--model", "tiny.gguf", "--store", str(tmp_path / "s"), "x"],
                      capsys)  # fmt: skip
    assert code == 2 and "edgeinfer import-gguf tiny.gguf OUT_DIR" in err[-1], err
    code, err = _main(["generate", "--model", str(tmp_path / "nothing"), "x"], capsys)
    assert code == 2 and err[-1].endswith(
        "no such model folder (nothing there); give a Hugging Face model folder, or a model in "
        "the store (edgeinfer models; add one with: edgeinfer pull SOURCE)"
    ), err


def test_an_unknown_flag_after_a_command_shows_that_commands_usage() -> None:
    """`generate --ignore-eos` printed the top-level usage (edgeinfer [-h] {generate,...})."""
    run = subprocess.run([sys.executable, "-m", "runtime.cli", "generate", "--ignore-eos", "x"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.startswith("usage: edgeinfer generate "), run.stderr
    assert run.stderr.strip().splitlines()[-1] == (
        "edgeinfer generate: error: unrecognized arguments: --ignore-eos"
    )
    run = subprocess.run([sys.executable, "-m", "runtime.cli", "--nope", "models"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1] == (
        "edgeinfer: error: unrecognized arguments: --nope"
    ), run.stderr


# ------------------------------------------------------------------ service commands


@pytest.mark.parametrize(
    ("argv", "error"),
    [
        (["gateway", "--body-timeout", "-1"], "edgeinfer: error: --body-timeout must be "
         "positive, got -1.0"),
        (["gateway", "--worker-idle-timeout", "0.5"], "edgeinfer: error: --worker-idle-timeout "
         "must be above the workers' 1 s keepalive, got 0.5"),
        (["gateway", "--client-write-timeout", "0"], "edgeinfer: error: --client-write-timeout "
         "must be positive, got 0.0"),
        (["gateway", "--max-request-seqs", "0"], "edgeinfer: error: --max-request-seqs must be "
         "at least 1, got 0"),
        (["gateway", "--metrics-port", "8080"], "edgeinfer: error: --metrics-port must differ "
         "from --port, both 8080: 0 serves /metrics on the main port"),
        (["rebalance", "--model", "m", "--prefill", "-1"], "edgeinfer rebalance: error: "
         "argument --prefill: must be at least 0, got -1"),
        (["drive-rate", "--gb", "0"], "edgeinfer drive-rate: error: argument --gb: must be a "
         "number > 0, got 0"),
        (["set-role", "notaurl", "mixed"], "edgeinfer: error: worker_url 'notaurl' is not an "
         "http:// or https:// URL with a host, e.g. http://10.0.0.5:9001"),
    ],
)  # fmt: skip
def test_service_commands_name_the_flag(
    argv: list[str], error: str, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """GatewayConfig's field names (body_timeout_s), a rebalance to -1 prefill workers ("has 0
    prefill/decode workers"), a drive read of 0 GB ("nothing read"), set-role's internal path
    ("unknown url type: 'notaurl/internal/role'")."""
    monkeypatch.setenv("EDGEINFER_SECRET", "s")
    monkeypatch.setenv("EDGEINFER_REDIS", f"redis://127.0.0.1:{find_free_port()}/0")
    code, err = _main(argv, capsys)
    assert (code, err[-1]) == (2, error), err


def test_set_role_on_an_unreachable_worker_is_an_error_with_status_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It said "cannot reach ..." without the `edgeinfer: error:` prefix and exited 1, where
    other commands' unreachable servers (Redis) exit 2."""
    monkeypatch.setenv("EDGEINFER_SECRET", "s")
    url = f"http://127.0.0.1:{find_free_port()}"
    code, err = _main(["set-role", url, "mixed"], capsys)
    assert (code, err[-1]) == (2, f"edgeinfer: error: cannot reach the worker at {url} "
                               "([Errno 111] Connection refused)"), err  # fmt: skip
    with socket.socket() as silent:  # reached, and no answer within --timeout
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        code, err = _main(["set-role", url, "mixed", "--timeout", "0.2"], capsys)
    assert (code, err[-1]) == (2, f"edgeinfer: error: the worker at {url} did not answer in "
                               "--timeout 0.2 s (its drain may still be going on)"), err  # fmt: skip


def test_pool_events_say_when_there_are_none_and_refuse_an_unknown_region(
    redis_server, tmp_path: Path, capsys: pytest.CaptureFixture[str],  # type: ignore[no-untyped-def]
) -> None:  # fmt: skip
    """`pool --region nowhere --events 5` (and a known region without events) printed nothing
    and exited 0."""
    base = ["pool", "--events", "5", "--redis", redis_server.url]
    code, err = _main([*base, "--region", "nowhere"], capsys)
    assert (code, err[-1]) == (2, "edgeinfer: error: no events in region 'nowhere': --region "
                               "'nowhere' is not in the region catalog "
                               f"{DEFAULT_CATALOG} "
                               f"(known: {KNOWN})"), err  # fmt: skip
    catalog = _catalog(tmp_path / "regions.yaml", "quiet-one")
    code, err = _main([*base, "--region", "quiet-one", "--regions", str(catalog)], capsys)
    assert (code, err) == (0, ["no events in region 'quiet-one'"])


def test_pool_passes_its_catalog_to_its_workers(
    tmp_path: Path, stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool of a region of its own catalog (--regions) starts its workers with it: they check
    their --region against it too."""
    import runtime.pool_manager

    seen: list[object] = []

    async def serve(cfg: object) -> None:
        seen.append(cfg)

    monkeypatch.setattr(runtime.pool_manager, "serve", serve)
    monkeypatch.setenv("EDGEINFER_SECRET", "s")
    catalog = _catalog(tmp_path / "regions.yaml", "quiet-one")
    from runtime.cli import main

    assert main(["pool", "--region", "quiet-one", "--regions", str(catalog), "--models",
                 f"stories={stories_dir}", "--worker-args", "--threads 1"]) == 0  # fmt: skip
    (cfg,) = seen
    assert cfg.worker_args == ["--threads", "1", "--regions", str(catalog)]  # type: ignore[attr-defined]
    assert main(["pool", "--region", "elsewhere", "--regions", str(catalog), "--models",
                 f"stories={stories_dir}"]) == 2  # fmt: skip
    assert len(seen) == 1


# ------------------------------------------------------------------ `up` runs


def _up(tmp_path: Path, *args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("EDGEINFER_")}
    return subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "up", *args],
        cwd=ROOT, env=clean | {"PYTHONUNBUFFERED": "1"} | env,
        stdout=(tmp_path / "up.log").open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def _wait_for(log: Path, text: str, proc: subprocess.Popen[bytes], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while text not in (out := log.read_text()):
        assert proc.poll() is None, out
        assert time.monotonic() < deadline, out
        time.sleep(0.1)
    return out


def _pasted(out: str) -> Callable[[], dict]:  # type: ignore[type-arg]
    """The curl `up` printed, as a user pastes it into a shell; returns its JSON answer."""
    start = out.index("  curl ")
    command = out[start : out.index("Ctrl-C stops everything")].strip()
    command = command.replace("\\\n", " ")

    def run() -> dict:  # type: ignore[type-arg]
        done = subprocess.run(["bash", "-c", command + " -sS"], capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return orjson.loads(done.stdout)  # type: ignore[no-any-return]

    assert shlex.split(command)[0] == "curl"
    return run


def test_up_prints_a_curl_that_works_for_a_model_without_a_chat_template_and_leaves_a_given_redis(
    tmp_path: Path, stories_dir: Path, redis
) -> None:  # type: ignore[no-untyped-def]
    """stories260K has no chat template: the /v1/chat/completions curl `up` printed answered
    400 "has no chat template; use /v1/completions". And with a Redis of one's own (--redis),
    Ctrl-C said "... then redis" though that Redis is left running (as it should be)."""
    port = find_free_port()
    proc = _up(tmp_path, "--model", str(stories_dir), "--port", str(port), "--threads", "1",
               "--kv-cache-bytes", "4000000", env={"EDGEINFER_REDIS": redis.url})  # fmt: skip
    log = tmp_path / "up.log"
    try:
        out = _wait_for(log, "Ctrl-C stops everything", proc, 90)
        assert f"curl http://127.0.0.1:{port}/v1/completions " in out, out
        answer = _pasted(out)()
        assert answer["object"] == "text_completion" and answer["choices"][0]["text"], answer
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out = log.read_text()
    assert re.search(r"stopping: gateway, then workers \(draining, \d+s at most\), leaving the "
                     r"given Redis running", out), out  # fmt: skip
    assert "then redis" not in out and "stopped redis-server" not in out, out
    import redis as redis_py

    with redis_py.Redis.from_url(redis.url) as client:  # (left running, as said)
        assert client.ping()


def test_up_prints_a_chat_curl_for_a_chat_model(tmp_path: Path, stories_dir: Path) -> None:
    """The printed example, for a model with a chat template and for one without (the check
    `up` makes once its stack is ready); the chat one as it was."""
    from runtime.launcher import _chat_template, _example

    chat = chat_model(stories_dir, tmp_path / "chat")
    assert _chat_template(str(chat)) and not _chat_template(str(stories_dir))
    base = "http://127.0.0.1:8080"
    assert _example(base, "m", "", True) == (
        f"  curl {base}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        "    -H 'x-session-affinity: my-session' \\\n"
        '    -d \'{"model": "m", "messages": [{"role": "user", "content": "Hello!"}], '
        '"max_tokens": 64}\'\n'
    )
    assert '"prompt": "Once upon a time"' in _example(base, "m", "", False)
