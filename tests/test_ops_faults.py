"""What an operator runs, given options that cannot work together: each is refused at start-up
with one line naming the option (status 2), before anything starts, rather than accepted and
failing later (a worker that exits, a pool that starts failing workers again and again, a worker
registered where no gateway reaches it)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.redis_server import find_free_ports
from tests.stack import ROOT

UNREACHABLE_REDIS = "redis://127.0.0.1:1/0"  # (what `up` checks after its options: refused)


def _last_error(capsys: pytest.CaptureFixture[str]) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines, "nothing on stderr"
    return lines[-1]


@pytest.mark.parametrize("overlap", ["--port", "--dist-port"])
def test_up_refuses_its_own_flags_giving_one_port_twice(
    stories_dir: Path, overlap: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--port P+1 --worker-port P`: every port was free, so `up` started Redis, the worker and
    the gateway, and the worker's KV-transfer server (port P+1) or the gateway then failed to
    bind ("port 8080 is taken" stops it before anything starts, only for a foreign server). So
    did a --dist-port among the workers' ports."""
    from runtime.cli import main

    first = find_free_ports(4)
    given = {"--port": ["--port", str(first + 1)],  # the first worker's KV port
             "--dist-port": ["--port", str(first + 3), "--dist-port", str(first + 1)]}[overlap]  # fmt: skip
    argv = ["up", "--model", str(stories_dir), "--worker-port", str(first), *given,
            "--redis", UNREACHABLE_REDIS]  # fmt: skip
    assert main(argv) == 2
    err = _last_error(capsys)
    assert err.startswith("edgeinfer: error: ") and "do not overlap" in err, err
    assert overlap in err and "--worker-port" in err and str(first + 1) in err, err


def test_up_refuses_workers_with_roles(
    stories_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--workers 4 --roles prefill,decode` started two workers: --workers was ignored."""
    from runtime.cli import main

    argv = ["up", "--model", str(stories_dir), "--workers", "4", "--roles", "prefill,decode",
            "--redis", UNREACHABLE_REDIS]  # fmt: skip
    assert main(argv) == 2
    err = _last_error(capsys)
    assert err.startswith("edgeinfer: error: --workers and --roles"), err


def test_up_dist_port_0_gives_every_worker_a_free_port() -> None:
    """`--dist-port 0` (a free port) became --dist-port 1 for the second worker, 2 for the third:
    ports below 1024, which a worker not run as root cannot listen on."""
    from runtime.cli import build_parser
    from runtime.launcher import _engine_flags

    args = build_parser().parse_args(["up", "--dist-port", "0", "--workers", "3"])
    for worker in range(3):
        flags = _engine_flags(args, worker)
        assert flags[flags.index("--dist-port") + 1] == "0", flags
    args = build_parser().parse_args(["up", "--dist-port", "5000", "--workers", "2"])
    assert _engine_flags(args, 1)[-2:] == ["--dist-port", "5001"]  # (a port given: the next ones)


@pytest.mark.parametrize("url", ["10.0.0.5:9001", "localhost:9001", "http://", "http://h:99999"])
def test_worker_refuses_an_advertise_url_no_gateway_can_use(stories_dir: Path, url: str) -> None:
    """`--advertise-url 10.0.0.5:9001` (no scheme) was registered as the worker's URL, and it
    said it was ready: no gateway could reach it. (Its port is held here, so that a worker that
    accepts the URL stops at once too, unable to listen.)"""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "runtime.cli", "worker", "--model", str(stories_dir),
             "--no-redis", "--secret", "s", "--threads", "1", "--kv-cache-bytes", "1000000",
             "--port", str(port), "--advertise-url", url],
            cwd=ROOT, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    err = out.stderr.strip().splitlines()[-1]
    assert err.startswith(f"edgeinfer: error: --advertise-url {url!r}"), out.stderr


def test_an_empty_advertise_url_is_the_default() -> None:
    """`--advertise-url ""` (a deployment's empty variable) means the default URL, as the worker
    builds it: the check refused it."""
    from runtime.service_cli import _check_advertise_url

    _check_advertise_url("")
    _check_advertise_url(None)
    with pytest.raises(SystemExit):
        _check_advertise_url("localhost:9001")


@pytest.mark.parametrize(
    ("worker_args", "says"),
    [
        ("--bogus 1", "unrecognized arguments: --bogus 1"),
        ("--threads 0", "argument --threads: must be at least 1, got 0"),
        ("--dtype float8", "argument --dtype: invalid choice: 'float8'"),
        ("--draft-model /models/draft", "--draft-model needs --speculative draft"),
    ],
)
def test_pool_refuses_worker_args_a_worker_refuses(
    stories_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], worker_args: str, says: str,
) -> None:  # fmt: skip
    """--worker-args that `edgeinfer worker` refuses were taken: the pool started, and every
    worker it started for a request exited at once with a usage error, was started again after
    a backoff, and so on, while the requests waited for a worker that never came."""
    import runtime.pool_manager
    from runtime.cli import main

    configs: list[runtime.pool_manager.PoolConfig] = []

    async def serve(cfg: runtime.pool_manager.PoolConfig) -> None:
        configs.append(cfg)

    monkeypatch.setattr(runtime.pool_manager, "serve", serve)
    pool = ["pool", "--models", f"stories={stories_dir}", "--secret", "s", "--store",
            str(tmp_path), "--redis", UNREACHABLE_REDIS]  # fmt: skip
    assert main([*pool, "--worker-args", worker_args]) == 2
    err = _last_error(capsys)
    assert err.startswith(f"edgeinfer: error: --worker-args {worker_args!r}: "), err
    assert says in err, err
    assert configs == []  # no pool
    # what a worker takes, the pool takes
    assert main([*pool, "--worker-args", "--threads 2 --speculative ngram --spec-ngram 1 3"]) == 0
    assert configs[0].worker_args == ["--threads", "2", "--speculative", "ngram", "--spec-ngram",
                                      "1", "3"]  # fmt: skip
