"""infra/deploy.py and a Redis with a password: the password never sits in the catalog (kept in
git) nor in a ConfigMap; the deploy takes the URL from --redis-url-file or
$EDGEINFER_DEPLOY_REDIS_URL and renders it as the Secret edgeinfer-redis, which the gateway,
worker and pool read as EDGEINFER_REDIS, and whose change rolls them."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from infra import deploy
from kvstore.redis_server import LocalRedis, find_free_port
from tests.stack import ROOT, wait_until
from tests.test_infra import K8S_VERSION, _by, _container, _env, _expand

PODS = (("Deployment", "gateway"), ("StatefulSet", "worker"), ("Deployment", "pool"))
PASSWORD = "hunter2-s3cret"


def _catalog(tmp_path: Path, **changes: Any) -> Path:
    """The packaged catalog with `changes` ({region: settings to add}) made to it."""
    raw = yaml.safe_load(deploy.DEFAULT_CATALOG.read_text())
    for entry in raw["regions"]:
        entry["settings"].update(changes.get(entry["name"], {}))
    path = tmp_path / "regions.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = deploy.main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "url",
    ["rediss://:hunter2-s3cret@shared.example:6380/0",
     "redis://edge:hunter2-s3cret@shared.example:6379/0",
     "redis://shared.example:6379/0?password=hunter2-s3cret"],
)  # fmt: skip
def test_a_password_in_the_catalog_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str
) -> None:
    """It went into the region's ConfigMap (and sat in git): now refused, naming the region and
    the field, with the password hidden, and nothing printed."""
    code, out, err = _main(["local", "--catalog", str(_catalog(tmp_path, local={"redis_url": url}))],
                           capsys)  # fmt: skip
    assert code == 2 and out == "", (code, err)
    assert "region 'local': settings.redis_url holds a password" in err, err
    assert "--redis-url-file FILE or $EDGEINFER_DEPLOY_REDIS_URL" in err, err
    assert PASSWORD not in err


def test_another_regions_password_is_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rendering one region names a password another region's entry holds (the catalog is in
    git), and renders: that region's manifests are not these."""
    catalog = _catalog(tmp_path, **{"us-east": {"redis_url": f"rediss://:{PASSWORD}@x.example/0"}})
    code, out, err = _main(["local", "--catalog", str(catalog)], capsys)
    assert code == 0, err
    assert "deploy: warning: region 'us-east': settings.redis_url holds a password" in err, err
    assert PASSWORD not in out + err


def _rendered(out: Path) -> dict[str, dict[str, Any]]:
    """The files `--out` wrote, by KIND/NAME."""
    docs = {}
    for path in sorted(out.iterdir()):
        doc = yaml.safe_load(path.read_text())
        docs[f"{doc['kind']}/{doc['metadata']['name']}"] = doc | {"_path": path}
    return docs


@pytest.mark.parametrize("source", ["file", "env"])
def test_the_redis_url_becomes_a_secret_the_pods_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    source: str,
) -> None:  # fmt: skip
    url = f"rediss://:{PASSWORD}@shared.example:6380/0"
    # (the catalog may name the same Redis, without the password)
    catalog = _catalog(tmp_path, local={"redis_url": "rediss://shared.example:6380/0"})
    args = ["local", "--catalog", str(catalog), "--out", str(tmp_path / "out")]
    monkeypatch.delenv(deploy.REDIS_URL_ENV, raising=False)
    if source == "file":
        (tmp_path / "redis-url").write_text(url + "\n")
        args += ["--redis-url-file", str(tmp_path / "redis-url")]
    else:
        monkeypatch.setenv(deploy.REDIS_URL_ENV, url)
    code, _, err = _main(args, capsys)
    assert code == 0, err
    # where the URL came from is said (the variable is no region's own), its password not
    assert ("from --redis-url-file" if source == "file" else f"from ${deploy.REDIS_URL_ENV}") in err
    assert "shared.example" in err and PASSWORD not in err, err
    docs = _rendered(tmp_path / "out")
    secret = docs.pop("Secret/edgeinfer-redis")
    assert base64.b64decode(secret["data"]["url"]).decode() == url
    assert stat.S_IMODE(secret["_path"].stat().st_mode) & 0o077 == 0  # its owner's alone
    assert secret["metadata"]["namespace"] == "edgeinfer-local"
    assert secret["metadata"]["labels"][deploy.REGION_LABEL] == "local"
    for name, doc in docs.items():  # no other resource holds it, a ConfigMap least of all
        assert PASSWORD not in doc["_path"].read_text(), name
    assert "EDGEINFER_REDIS" not in docs["ConfigMap/edgeinfer-config"]["data"]
    assert "Deployment/redis" not in docs and "Service/redis" not in docs  # (a shared Redis)
    for kind, name in PODS:
        env = {e["name"]: e for e in _container(docs[f"{kind}/{name}"])["env"]}
        assert env["EDGEINFER_REDIS"]["valueFrom"]["secretKeyRef"] == {
            "name": "edgeinfer-redis", "key": "url"}  # fmt: skip
    for doc in [secret, *docs.values()]:
        doc.pop("_path")
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ({"file": "redis://a.example:6379/0\nredis://b.example:6379/0\n"},
         "must hold one line, the Redis URL; it holds 2"),
        ({"file": ""}, "must hold one line, the Redis URL; it holds 0"),
        ({"missing": True}, "cannot read --redis-url-file"),
        ({"file": "http://x.example/"}, "the Redis URL from --redis-url-file FILE or "
                                        "$EDGEINFER_DEPLOY_REDIS_URL must be a redis://"),
        ({"file": f"redis://:{PASSWORD}@a.example:6379/0", "env": "redis://b.example:6379/0"},
         "--redis-url-file and $EDGEINFER_DEPLOY_REDIS_URL both give the Redis URL"),
        ({"env": f"redis://:{PASSWORD}@elsewhere.example:6379/0"},
         "names another Redis than settings.redis_url (redis://shared.example:6379/0)"),
    ],
)  # fmt: skip
def test_a_bad_redis_url_source_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    setup: dict[str, Any], message: str,
) -> None:  # fmt: skip
    catalog = _catalog(tmp_path, local={"redis_url": "redis://shared.example:6379/0"})
    args = ["local", "--catalog", str(catalog), "--out", str(tmp_path / "out")]
    monkeypatch.delenv(deploy.REDIS_URL_ENV, raising=False)
    if "file" in setup or "missing" in setup:
        if "file" in setup:
            (tmp_path / "redis-url").write_text(setup["file"])
        args += ["--redis-url-file", str(tmp_path / "redis-url")]
    if "env" in setup:
        monkeypatch.setenv(deploy.REDIS_URL_ENV, setup["env"])
    code, out, err = _main(args, capsys)
    assert code == 2 and out == "", err
    assert "deploy: error: region 'local': " in err and message in err, err
    assert PASSWORD not in err
    assert not (tmp_path / "out").exists()  # nothing written


def _templates(resources: list[dict[str, Any]]) -> dict[str, Any]:
    return {f"{r['kind']}/{r['metadata']['name']}": r["spec"]["template"] for r in resources
            if r["kind"] in ("Deployment", "StatefulSet")}  # fmt: skip


def test_a_new_password_rolls_the_pods_that_read_it() -> None:
    """The pods read the Secret once, at start: a new password applied to the Secret alone
    reached none of them (they went on logging in with the old one, refused once the Redis
    changed it). The Secret's data is in the digest of each pod template that reads it."""
    before = _templates(deploy.render("local", redis_secret_url="redis://:old@r.example:6379/0"))
    again = _templates(deploy.render("local", redis_secret_url="redis://:old@r.example:6379/0"))
    after = _templates(deploy.render("local", redis_secret_url="redis://:new@r.example:6379/0"))
    assert again == before  # (no change, no rollout)
    for kind, name in PODS:
        key = f"{kind}/{name}"
        assert after[key] != before[key], f"{key}: same pod template, so no rollout"
        assert after[key]["metadata"]["annotations"][deploy.CONFIG_DIGEST]
    # a pod that reads no rendered Secret keeps its digest (what an upgrade of the deploy rolls)
    assert after["Deployment/otel-collector"] == before["Deployment/otel-collector"]
    plain = _templates(deploy.render("local"))
    assert plain["Deployment/otel-collector"] == before["Deployment/otel-collector"]


def _readyz(port: int) -> dict[str, Any]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return dict(json.loads(resp.read()))
    except urllib.error.HTTPError as e:  # 503: no worker; the body says whether Redis answers
        with e:
            return dict(json.loads(e.read()))


def test_the_rendered_gateway_logs_in_with_the_secrets_password(tmp_path: Path) -> None:
    """The gateway, run as its pod runs it (its args, the config map's environment, EDGEINFER_REDIS
    from the Secret), logs in to a Redis that asks for the password, and the password is not on
    its command line."""
    import redis

    with LocalRedis() as server:
        redis.Redis(port=server.port).config_set("requirepass", PASSWORD)
        with pytest.raises(redis.exceptions.AuthenticationError):  # (it does ask)
            redis.Redis(port=server.port).ping()
        url = f"redis://:{PASSWORD}@127.0.0.1:{server.port}/0"
        resources = deploy.render("local", redis_secret_url=url)
        c = _container(_by(resources, "Deployment", "gateway"))
        env = _env(resources, c)
        assert env["EDGEINFER_REDIS"] == url
        args = _expand(c["args"], env)
        catalog = tmp_path / "regions.yaml"
        catalog.write_text(_by(resources, "ConfigMap", "edgeinfer-regions")["data"]["regions.yaml"])
        port = find_free_port()
        for flag, value in (("--host", "127.0.0.1"), ("--port", str(port)),
                            ("--metrics-port", str(find_free_port())), ("--regions", str(catalog))):  # fmt: skip
            args[args.index(flag) + 1] = value
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("EDGEINFER_", "OTEL_"))}
        pod_env = {k: v for k, v in env.items() if k.startswith("EDGEINFER_")} | {"EDGEINFER_SECRET": "s"}  # fmt: skip
        log = tmp_path / "gateway.log"
        proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", *args], cwd=ROOT,
                                env=clean | pod_env, stdout=log.open("wb"),
                                stderr=subprocess.STDOUT)  # fmt: skip
        try:

            def redis_answers() -> bool:
                assert proc.poll() is None, f"the gateway exited: {log.read_text()}"
                try:
                    return bool(_readyz(port).get("redis"))
                except OSError:
                    return False

            wait_until(redis_answers, 30, "the rendered gateway's Redis to answer it")
            assert PASSWORD.encode() not in Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        finally:
            proc.terminate()
            proc.wait(10)


def test_an_unmarked_file_where_the_secret_goes_is_not_written_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--out where a file not written by the deploy (no marker line) has the name the Secret
    takes: the deploy said it left that file alone, then wrote the Secret into it, keeping its
    mode (0644: the password readable by all). Now it refuses, naming the file, and writes
    nothing over it."""
    monkeypatch.setenv(deploy.REDIS_URL_ENV, f"redis://:{PASSWORD}@shared.example:6379/0")
    out = tmp_path / "out"
    code, _, err = _main(["local", "--catalog", str(_catalog(tmp_path)), "--out", str(out)],
                         capsys)  # fmt: skip
    assert code == 0, err
    (secret,) = out.glob("*-secret-edgeinfer-redis.yaml")
    secret.unlink()
    secret.write_text("someone's own notes\n")
    secret.chmod(0o644)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, err = _main(["local", "--catalog", str(_catalog(tmp_path)), "--out", str(out)],
                         capsys)  # fmt: skip
    assert code == 2 and secret.name in err and "write over" in err, err
    assert secret.read_text() == "someone's own notes\n"
    # refused before anything was removed: the earlier render's files sorted before it stayed
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # a folder where a resource goes is refused the same way (it failed midway, files gone)
    secret.unlink()
    secret.mkdir()
    code, _, err = _main(["local", "--catalog", str(_catalog(tmp_path)), "--out", str(out)],
                         capsys)  # fmt: skip
    assert code == 2 and secret.name in err and "write over" in err, err
    assert sorted(p.name for p in out.iterdir()) == sorted(before)
