"""infra/: every region in the catalog renders to manifests that validate offline against the
Kubernetes schemas, run commands the edgeinfer CLI accepts, and keep the deploy invariants
(probes, drain grace, GPUs, model store); bad input stops with exit 2, naming the region and the
field, and nothing is written or applied."""

from __future__ import annotations

import base64
import os
import re
import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.regions import RegionCatalog
from infra import deploy
from infra.kustomize import RenderError, build, merge
from runtime.cli import build_parser
from runtime.model_specs import parse_models

K8S_VERSION = "1.30.0"
REGIONS = sorted(RegionCatalog.load().regions)


def _by(resources: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (hit,) = [r for r in resources if r["kind"] == kind and r["metadata"]["name"] == name]
    return hit


def _container(resource: dict[str, Any]) -> dict[str, Any]:
    (c,) = resource["spec"]["template"]["spec"]["containers"]
    return c


def _expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of a container's args; an unknown variable fails the test."""

    def one(m: re.Match[str]) -> str:
        assert m[1] in env, f"$({m[1]}) is not in the container's environment"
        return env[m[1]]

    return [re.sub(r"\$\(([A-Z_]+)\)", one, a) for a in args]


def _env(resources: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    config = _by(resources, "ConfigMap", "edgeinfer-config")["data"]
    assert container["envFrom"] == [{"configMapRef": {"name": "edgeinfer-config"}}]
    env = dict(config)
    # (a key of a Secret the render holds, edgeinfer-redis: its value, as the kubelet reads it)
    secrets = {r["metadata"]["name"]: r["data"] for r in resources if r["kind"] == "Secret"}
    for e in container.get("env", []):
        ref = (e.get("valueFrom") or {}).get("secretKeyRef") or {}
        if ref.get("name") in secrets:
            env[e["name"]] = base64.b64decode(secrets[ref["name"]][ref["key"]]).decode()
        else:
            env[e["name"]] = e.get("value", "10.1.2.3" if e["name"] == "POD_IP" else "pod-0")
    return env


@pytest.mark.parametrize("region", REGIONS)
def test_region_renders_and_validates(region: str) -> None:
    resources = deploy.render(region)
    kinds = sorted(f"{r['kind']}/{r['metadata']['name']}" for r in resources)
    assert {"Deployment/gateway", "Service/gateway", "StatefulSet/worker", "Deployment/pool",
            "ConfigMap/edgeinfer-config", "Namespace/edgeinfer-" + region} <= set(kinds)  # fmt: skip
    for r in resources:
        kubernetes_validate.validate(r, K8S_VERSION, strict=True)
        if r["kind"] != "Namespace":
            assert r["metadata"]["namespace"] == f"edgeinfer-{region}"
        assert r["metadata"]["labels"]["edgeinfer.dev/region"] == region
    # kustomize's order: the namespace and the config before the pods that need them
    assert resources[0]["kind"] == "Namespace" and resources[1]["kind"] == "ConfigMap"
    # the printed form is the same manifests
    assert list(yaml.safe_load_all(deploy.to_yaml(resources))) == resources


def _check_commands(region: str, settings: dict[str, Any], resources: list[dict[str, Any]]) -> None:
    """Every pod's args parse as the edgeinfer command it runs, with the region's settings."""
    parser = build_parser()
    # the standing workers serve the first model under the name and from the folder the pool
    # would (`name=FOLDER` entries included)
    ((served_name, model),) = parse_models(settings["models"][0], resolve=str).items()
    for kind, name, command in (("Deployment", "gateway", "gateway"),
                                ("StatefulSet", "worker", "worker"), ("Deployment", "pool", "pool")):  # fmt: skip
        if name == "pool" and settings.get("pool_max_workers") == 0:
            assert not [r for r in resources if r["metadata"]["name"] == "pool"]
            continue
        c = _container(_by(resources, kind, name))
        assert c["image"] == settings["image"]
        assert c["command"] == ["edgeinfer"]
        env = _env(resources, c)
        args = parser.parse_args(_expand(c["args"], env))
        assert args.func.__name__ == f"cmd_{command}"
        assert args.region == region
        # the process reads the Redis URL from $EDGEINFER_REDIS: never on its command line,
        # where `ps` on the node would show a password
        assert args.redis is None and env["EDGEINFER_REDIS"].startswith("redis")
        assert not [a for a in c["args"] if "EDGEINFER_REDIS" in a]
        secret = {e["name"]: e for e in c["env"]}["EDGEINFER_SECRET"]
        assert secret["valueFrom"]["secretKeyRef"] == {"name": "edgeinfer-secret", "key": "secret"}
        if command == "worker":
            assert (args.model, args.served_model_name) == (model, served_name)
            assert (args.host, args.port) == ("0.0.0.0", 9001)
            assert args.advertise_url == "http://10.1.2.3:9001"
            # registry ids are cluster-wide: a pod name (worker-0) alone would collide
            assert args.worker_id == f"{region}-pod-0"
        if command == "pool":
            assert args.models.split(",") == settings["models"]
            assert args.max_workers == settings.get("pool_max_workers", 1)
            worker_flags = parser.parse_args(["worker", *args.worker_args.split()])
            assert worker_flags.drain_timeout == float(env["EDGEINFER_DRAIN_TIMEOUT"])
        if command == "gateway":
            assert (args.host, args.port) == ("0.0.0.0", 8080)
            # streams in flight at a rolling update finish within the workers' drain
            assert args.drain_timeout == float(env["EDGEINFER_DRAIN_TIMEOUT"])
            # /metrics on a port of its own, which the public Service does not reach
            assert args.metrics_port == 9464
            assert {"name": "metrics", "containerPort": 9464} in c["ports"]
            service = _by(resources, "Service", "gateway")
            named = {p["name"]: p["containerPort"] for p in c["ports"]}
            targets = [named.get(p["targetPort"], p["targetPort"]) for p in service["spec"]["ports"]]  # fmt: skip
            assert targets == [8080], targets


@pytest.mark.parametrize("region", REGIONS)
def test_pods_run_real_commands(region: str) -> None:
    _check_commands(region, RegionCatalog.load().regions[region].settings, deploy.render(region))


@pytest.mark.parametrize("region", REGIONS)
def test_deploy_invariants(region: str) -> None:
    settings = RegionCatalog.load().regions[region].settings
    resources = deploy.render(region)
    config = _by(resources, "ConfigMap", "edgeinfer-config")["data"]

    gateway = _container(_by(resources, "Deployment", "gateway"))
    # (Redis optional: a Redis outage must not take every gateway out of the Service)
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/readyz?redis=optional",
                                                    "port": "http"}  # fmt: skip
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert gateway["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    service = _by(resources, "Service", "gateway")
    assert service["spec"]["selector"] == {"app.kubernetes.io/name": "gateway"}

    worker_set = _by(resources, "StatefulSet", "worker")
    assert worker_set["spec"]["replicas"] == settings["workers"]
    drain = float(config["EDGEINFER_DRAIN_TIMEOUT"])
    gateway_pod = _by(resources, "Deployment", "gateway")["spec"]["template"]["spec"]
    prestop = float(gateway["lifecycle"]["preStop"]["exec"]["command"][1])
    assert gateway_pod["terminationGracePeriodSeconds"] > drain + prestop, region
    for kind, name in (("StatefulSet", "worker"), ("Deployment", "pool")):
        resource = _by(resources, kind, name)
        pod = resource["spec"]["template"]["spec"]
        c = _container(resource)
        prestop = float(c["lifecycle"]["preStop"]["exec"]["command"][1])
        assert pod["terminationGracePeriodSeconds"] > drain + prestop, (region, name)
        gpus = settings.get("gpus_per_worker", 0)
        assert c["resources"].get("limits", {}).get("nvidia.com/gpu", 0) == gpus
        # the model store is mounted where the worker looks up `--model NAME`
        (mount,) = [m for m in c["volumeMounts"] if m["name"] == "model-store"]
        assert mount["mountPath"] == config["EDGEINFER_STORE"]
    claims = worker_set["spec"]["volumeClaimTemplates"]
    assert [c["metadata"]["name"] for c in claims] == ["model-store"]
    assert claims[0]["spec"]["storageClassName"] == settings.get("store_class", "local-nvme")

    worker = _container(worker_set)
    for kind in ("readinessProbe", "livenessProbe"):  # (what they do: test_worker_api)
        probe = worker[kind]["exec"]["command"]
        assert probe[:2] == ["python", "-c"] and "/internal/health" in probe[2]
        compile(probe[2], kind, "exec")

    has_redis = any(r["metadata"]["name"] == "redis" for r in resources)
    assert has_redis == ("redis_url" not in settings)

    # no pod runs as root; the edgeinfer image's pods run as its user (uid 10001), and the
    # model store's volume is theirs (fsGroup)
    for r in resources:
        if r["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = r["spec"]["template"]["spec"]
        security = pod["securityContext"]
        name = r["metadata"]["name"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] != 0, name
        if _container(r).get("command") == ["edgeinfer"]:
            assert security["runAsUser"] == security["fsGroup"] == 10001, name


def _catalog(tmp_path: Path, region: str = "local", **settings: Any) -> Path:
    raw = yaml.safe_load(deploy.DEFAULT_CATALOG.read_text())
    for entry in raw["regions"]:
        if entry["name"] == region:
            for key, value in settings.items():
                if value is None:
                    entry["settings"].pop(key, None)
                else:
                    entry["settings"][key] = value
    path = tmp_path / "regions.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_catalog_settings_flow_into_manifests(tmp_path: Path) -> None:
    catalog = _catalog(tmp_path, workers=3, gpus_per_worker=1, drain_timeout=90,
                       redis_url="rediss://shared.example:6380/0", models=["a", "b"],
                       image="registry.example/ei@sha256:" + "ab" * 32)  # fmt: skip
    resources = deploy.render("local", catalog)
    for r in resources:
        kubernetes_validate.validate(r, K8S_VERSION, strict=True)
    assert not [r for r in resources if r["metadata"]["name"] == "redis"]
    config = _by(resources, "ConfigMap", "edgeinfer-config")["data"]
    assert config["EDGEINFER_REDIS"] == "rediss://shared.example:6380/0"
    assert (config["EDGEINFER_MODEL"], config["EDGEINFER_MODELS"]) == ("a", "a,b")
    worker = _by(resources, "StatefulSet", "worker")
    assert worker["spec"]["replicas"] == 3
    assert worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 90
    gateway = _by(resources, "Deployment", "gateway")
    assert gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 90
    c = _container(worker)
    assert c["image"] == "registry.example/ei@sha256:" + "ab" * 32
    assert c["resources"]["limits"] == {"memory": "32Gi", "nvidia.com/gpu": 1}


def test_model_folder_entries(tmp_path: Path) -> None:
    """`name=FOLDER` models: the standing workers load FOLDER and serve it as `name`, as the pool
    does (a folder given as --model's name would not be found in the store)."""
    catalog = _catalog(tmp_path, models=["tiny=/var/lib/edgeinfer/models/tiny", "b"])
    resources = deploy.render("local", catalog)
    config = _by(resources, "ConfigMap", "edgeinfer-config")["data"]
    assert (config["EDGEINFER_MODEL"], config["EDGEINFER_SERVED_MODEL_NAME"]) == (
        "/var/lib/edgeinfer/models/tiny", "tiny")  # fmt: skip
    _check_commands("local", RegionCatalog.load(catalog).regions["local"].settings, resources)


def test_pool_max_workers_0_deploys_no_pool(tmp_path: Path) -> None:
    catalog = _catalog(tmp_path, pool_max_workers=0)
    resources = deploy.render("local", catalog)
    assert "pool" not in {r["metadata"]["name"] for r in resources}
    for r in resources:
        kubernetes_validate.validate(r, K8S_VERSION, strict=True)
    _check_commands("local", RegionCatalog.load(catalog).regions["local"].settings, resources)


def test_deploy_sh_paths_are_the_callers(tmp_path: Path) -> None:
    """Relative --catalog and --out name files in the caller's directory, not the repository's."""
    import subprocess

    _catalog(tmp_path, workers=5)
    done = subprocess.run([str(deploy.INFRA / "deploy.sh"), "local", "--catalog", "regions.yaml",
                           "--out", "build/local"], cwd=tmp_path, capture_output=True, text=True,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    files = sorted((tmp_path / "build" / "local").glob("*.yaml"))
    assert [str(f.relative_to(tmp_path)) for f in files] == done.stdout.split()
    worker = [yaml.safe_load(f.read_text()) for f in files if "statefulset-worker" in f.name]
    assert worker[0]["spec"]["replicas"] == 5


@pytest.mark.parametrize(
    ("region", "settings", "field"),
    [
        ("mars-1", {}, "not in the catalog"),
        ("local", {"image": None}, "settings.image"),
        ("local", {"image": "Not An Image"}, "settings.image"),
        # references no pod can pull (InvalidImageName): rendered repo::latest, repo:0.1.0:x, ...
        ("local", {"image": "ghcr.io/edgeinfer/edgeinfer:"}, "settings.image"),
        ("local", {"image": "ghcr.io/edgeinfer/edgeinfer:0.1.0:x"}, "settings.image"),
        ("local", {"image": "ghcr.io//edgeinfer:1"}, "settings.image"),
        ("local", {"image": "ghcr.io/edgeinfer/"}, "settings.image"),
        ("local", {"image": "Edgeinfer/edgeinfer:1"}, "settings.image"),
        ("local", {"models": None}, "settings.models"),
        ("local", {"models": []}, "settings.models"),
        ("local", {"workers": None}, "settings.workers"),
        ("local", {"workers": -1}, "settings.workers"),
        ("local", {"gpus_per_worker": "one"}, "settings.gpus_per_worker"),
        ("local", {"pool_max_workers": -1}, "settings.pool_max_workers"),
        # no pool manager: the standing workers must serve the region, and only one model
        ("local", {"pool_max_workers": 0, "workers": 0}, "settings.pool_max_workers"),
        ("local", {"pool_max_workers": 0, "models": ["a", "b"]}, "settings.pool_max_workers"),
        ("local", {"redis_url": "http://x"}, "settings.redis_url"),
        ("local", {"store_size": "lots"}, "settings.store_size"),
        ("local", {"worker_cpu": "lots"}, "settings.worker_cpu"),
        ("local", {"worker_memory": "2 GB"}, "settings.worker_memory"),
        ("local", {"worker_memory": "64Gi"}, "settings.worker_memory_limit"),
        ("local", {"worker_memory_limit": "1Gi"}, "settings.worker_memory_limit"),
        ("local", {"gateway_service": "Ingress"}, "settings.gateway_service"),
        # a worker runs on one GPU (--tp above 1 runs on the CPU), and the pool's workers would
        # all run on its pod's first GPU: what deploy cannot serve is refused
        ("local", {"gpus_per_worker": 2}, "settings.gpus_per_worker"),
        ("local", {"gpus_per_worker": 1, "pool_max_workers": 2}, "settings.pool_max_workers"),
        ("local", {"otlp_endpoint": "otel-collector:4318"}, "settings.otlp_endpoint"),
        ("local", {"otlp_endpoint": 4318}, "settings.otlp_endpoint"),
        ("local", {"otlp_endpoint": "grpc://collector:4317"}, "settings.otlp_endpoint"),
        ("local", {"traces_endpoint": "tempo:4317"}, "settings.traces_endpoint"),
        (
            "local",
            {"traces_endpoint": "http://t:4317", "otlp_endpoint": "http://c:4318"},
            "settings.traces_endpoint",
        ),
    ],
)
def test_bad_input_exits_2_naming_region_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], region: str, settings: dict[str, Any],
    field: str,
) -> None:  # fmt: skip
    catalog = _catalog(tmp_path, **settings)
    out = tmp_path / "out"
    assert deploy.main([region, "--catalog", str(catalog), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"region {region!r}" in captured.err and field in captured.err
    assert not out.exists()


@pytest.mark.parametrize("region", REGIONS)
def test_telemetry_wiring(region: str) -> None:
    """Gateways and workers send OTLP to the region's collector, which runs on
    infra/otel/collector.yaml; Prometheus finds their /metrics by annotations."""
    resources = deploy.render(region)
    config = _by(resources, "ConfigMap", "edgeinfer-config")["data"]
    assert config["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"
    service = _by(resources, "Service", "otel-collector")
    assert 4318 in [p["port"] for p in service["spec"]["ports"]]
    collector = _by(resources, "Deployment", "otel-collector")
    c = _container(collector)
    (arg,) = [a for a in c["args"] if a.startswith("--config=")]
    (mount,) = c["volumeMounts"]
    (volume,) = collector["spec"]["template"]["spec"]["volumes"]
    assert volume["name"] == mount["name"]
    files = _by(resources, "ConfigMap", volume["configMap"]["name"])["data"]
    assert arg == f"--config={mount['mountPath']}/collector.yaml"
    assert files["collector.yaml"] == (deploy.INFRA / "otel" / "collector.yaml").read_text()
    assert {e["name"]: e["value"] for e in c["env"]}["TRACES_OTLP_ENDPOINT"] == "http://tempo:4317"
    for kind, name, port in (("Deployment", "gateway", 9464), ("StatefulSet", "worker", 9001)):
        template = _by(resources, kind, name)["spec"]["template"]
        annotations = dict(template["metadata"]["annotations"])
        assert annotations.pop(deploy.CONFIG_DIGEST)  # (test_a_config_change_rolls_the_pods)
        assert annotations == {
            "prometheus.io/scrape": "true", "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics"}  # fmt: skip
    for kind, name in (("Deployment", "gateway"), ("StatefulSet", "worker"), ("Deployment", "pool")):  # fmt: skip
        c = _container(_by(resources, kind, name))
        env = [e["name"] for e in c["env"]]
        # $(VAR) in a value expands only variables defined before it
        at = env.index("OTEL_RESOURCE_ATTRIBUTES")
        value = c["env"][at]["value"]
        for var in re.findall(r"\$\(([A-Z_]+)\)", value):
            assert var in env[:at], (name, var)
        assert f"k8s.{kind.lower()}.name={name}" in value.split(",")


def test_otlp_settings_flow_into_manifests(tmp_path: Path) -> None:
    resources = deploy.render("local", _catalog(tmp_path, otlp_endpoint="https://otel.example:4318/"))  # fmt: skip
    for r in resources:
        kubernetes_validate.validate(r, K8S_VERSION, strict=True)
    config = _by(resources, "ConfigMap", "edgeinfer-config")["data"]
    assert config["OTEL_EXPORTER_OTLP_ENDPOINT"] == "https://otel.example:4318"
    # an external collector replaces the region's own
    assert not [r for r in resources if r["metadata"]["name"].startswith("otel-collector")]
    resources = deploy.render("local", _catalog(tmp_path, traces_endpoint="https://tempo.example:4317"))  # fmt: skip
    c = _container(_by(resources, "Deployment", "otel-collector"))
    assert c["env"] == [{"name": "TRACES_OTLP_ENDPOINT", "value": "https://tempo.example:4317"}]
    assert _by(resources, "ConfigMap", "edgeinfer-config")["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"  # fmt: skip


def test_config_map_generator(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("A")
    spec: dict[str, Any] = {"configMapGenerator": [
        {"name": "c", "files": ["a.txt", "k=a.txt"], "options": {"disableNameSuffixHash": True}}]}  # fmt: skip
    assert build(spec, tmp_path) == [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"a.txt": "A", "k": "A"}}]  # fmt: skip
    opts = {"disableNameSuffixHash": True}
    for generator, error in (
        ({"name": "c", "files": ["a.txt"]}, "disableNameSuffixHash"),
        ({"name": "c", "files": ["../x"], "options": opts}, "outside"),
        ({"name": "c", "files": ["b.txt"], "options": opts}, "cannot read"),
        ({"name": "c", "literals": ["a=b"]}, "'literals'"),
    ):
        with pytest.raises(RenderError, match=error):
            build({"configMapGenerator": [generator]}, tmp_path)


def test_overlay_that_does_not_render(tmp_path: Path) -> None:
    k8s = tmp_path / "k8s"
    shutil.copytree(deploy.OVERLAYS.parent, k8s)
    shutil.copytree(deploy.INFRA / "otel", tmp_path / "otel")  # the base's collector config
    shutil.copy(deploy.INFRA / "regions.yaml", tmp_path / "regions.yaml")  # the region catalog
    (k8s / "overlays" / "local" / "config.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: no-such-config}\n"
    )
    with pytest.raises(deploy.DeployError, match=r"region 'local'.*patches\[0\].*no-such-config"):
        deploy.render("local", deploy.DEFAULT_CATALOG, k8s / "overlays")
    (k8s / "overlays" / "local" / "kustomization.yaml").write_text("resources: [../../base]\nhelmCharts: []\n")  # fmt: skip
    with pytest.raises(deploy.DeployError, match=r"region 'local'.*'helmCharts'"):
        deploy.render("local", deploy.DEFAULT_CATALOG, k8s / "overlays")
    shutil.rmtree(k8s / "overlays" / "local")
    with pytest.raises(deploy.DeployError, match=r"region 'local'.*no overlay"):
        deploy.render("local", deploy.DEFAULT_CATALOG, k8s / "overlays")


def test_print_and_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert deploy.main(["local"]) == 0
    printed = list(yaml.safe_load_all(capsys.readouterr().out))
    assert printed == deploy.render("local")
    assert deploy.main(["local", "--out", str(tmp_path / "m")]) == 0
    files = sorted((tmp_path / "m").glob("*.yaml"))
    assert [yaml.safe_load(f.read_text()) for f in files] == printed


def test_out_holds_exactly_the_latest_render(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Rendering again into an --out DIR replaces the earlier render's files: left there, with
    numbers shifted by a resource fewer, `kubectl apply -f DIR` applied an old Deployment after
    the new one (a rollback). Files the deploy did not write stay."""
    out = tmp_path / "m"
    assert deploy.main(["local", "--catalog", str(_catalog(tmp_path)), "--out", str(out)]) == 0
    (out / "kustomization.yaml").write_text("resources: []\n")
    (out / "notes.txt").write_text("mine\n")
    (out / "50-secret-db.yaml").write_text("kind: Secret\n")  # named like ours: still its own
    capsys.readouterr()
    # a shared Redis: no in-region Redis Deployment and Service, and the files after them shift
    catalog = _catalog(tmp_path, redis_url="redis://shared.example:6379/0")
    assert deploy.main(["local", "--catalog", str(catalog), "--out", str(out)]) == 0
    written = [Path(line) for line in capsys.readouterr().out.split()]
    assert sorted(out.glob("[0-9][0-9]-*.yaml")) == sorted([*written, out / "50-secret-db.yaml"])
    rendered = deploy.render("local", catalog)
    assert [yaml.safe_load(f.read_text()) for f in sorted(written)] == rendered
    assert {f.name for f in out.iterdir()} - {f.name for f in written} == {"kustomization.yaml", "notes.txt", "50-secret-db.yaml"}  # fmt: skip


def test_an_unwritable_out_exits_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    out = tmp_path / "file" / "m"  # (a folder under a file: NotADirectoryError, an OSError)
    assert deploy.main(["local", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("deploy: error: region 'local': cannot write") and str(out) in err


def _apply(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[list[str], str]:  # fmt: skip
    """`deploy.main([*args, "--apply"])` with a kubectl that records its argv and stdin."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    kubectl = bin_dir / "kubectl"
    kubectl.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/argv\ncat > {tmp_path}/stdin\n')
    kubectl.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert deploy.main([*args, "--apply"]) == 0
    return (tmp_path / "argv").read_text().split(), (tmp_path / "stdin").read_text()


def test_apply_pipes_to_kubectl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv, stdin = _apply(tmp_path, monkeypatch, "us-east")
    selector = "app.kubernetes.io/part-of=edgeinfer,edgeinfer.dev/region=us-east"
    assert argv == [
        "apply", "-f", "-", "--prune", "-l", selector,
        "--prune-allowlist=core/v1/ConfigMap", "--prune-allowlist=core/v1/Service",
        "--prune-allowlist=apps/v1/Deployment", "--prune-allowlist=apps/v1/StatefulSet"]  # fmt: skip
    applied = list(yaml.safe_load_all(stdin))
    assert applied == deploy.render("us-east")
    # `-l` filters what is applied too: a resource without the labels would not be
    assert all(_selected(r, selector) for r in applied)


def _selected(resource: dict[str, Any], selector: str) -> bool:
    """Whether `kubectl -l SELECTOR` (k=v,k=v) selects the resource."""
    labels = resource["metadata"].get("labels") or {}
    return all(labels.get(k) == v for k, v in (pair.split("=", 1) for pair in selector.split(",")))


def _gvk(resource: dict[str, Any]) -> str:
    """group/version/kind as --prune-allowlist names it (core/v1/ConfigMap)."""
    api = resource["apiVersion"]
    return f"{api if '/' in api else 'core/' + api}/{resource['kind']}"


@pytest.mark.parametrize(
    ("settings", "removed"),
    [
        ({"pool_max_workers": 0}, {"Deployment/pool"}),
        ({"redis_url": "redis://shared.example:6379/0"}, {"Deployment/redis", "Service/redis"}),
        ({"redis_url": "rediss+cluster://cluster.example:6380"},
         {"Deployment/redis", "Service/redis"}),
        ({"otlp_endpoint": "https://otel.example:4318"},
         {"Deployment/otel-collector", "Service/otel-collector", "ConfigMap/otel-collector-config"}),
    ],
)  # fmt: skip
def test_apply_prunes_what_a_setting_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, settings: dict[str, Any], removed: set[str]
) -> None:
    """A setting that drops a resource (the pool, the region's Redis, its collector): the
    earlier apply made it, and `kubectl apply --prune -l SELECTOR --prune-allowlist ...` deletes
    it only if it carries the selector's labels and its kind is allowed (plain `apply -f -` left
    it running: a pool manager starting workers nobody asked for, a Redis no one reads)."""
    argv, _ = _apply(tmp_path, monkeypatch, "local", "--catalog", str(_catalog(tmp_path, **settings)))  # fmt: skip
    assert argv[:4] == ["apply", "-f", "-", "--prune"], argv
    selector = argv[argv.index("-l") + 1]
    allow = {a.split("=", 1)[1] for a in argv if a.startswith("--prune-allowlist=")}
    before = deploy.render("local", _catalog(tmp_path))
    after = deploy.render("local", _catalog(tmp_path, **settings))
    names = {f"{r['kind']}/{r['metadata']['name']}" for r in after}
    gone = [r for r in before if f"{r['kind']}/{r['metadata']['name']}" not in names]
    assert {f"{r['kind']}/{r['metadata']['name']}" for r in gone} == removed
    for r in gone:
        assert _selected(r, selector) and _gvk(r) in allow, r["metadata"]
    for r in before + after:  # everything is applied (`-l` filters what is applied, too)
        assert _selected(r, selector), r["metadata"]
        # every namespaced kind may be pruned; the namespace (the operator's secret) never
        assert (_gvk(r) in allow) == (r["kind"] != "Namespace"), r["kind"]
    # the base's kinds, whatever a region renders of them
    assert {_gvk(r) for r in build(deploy.OVERLAYS.parent / "base")} == allow
    # another region's resources are not this region's to prune
    assert not _selected(deploy.render("us-east")[1], selector)


def test_local_region_fits_a_dev_cluster() -> None:
    """`local` schedules on kind (or minikube --cpus 4 --memory 8g): small requests, the dev
    clusters' StorageClass, a small store, no LoadBalancer. The other regions keep the
    production sizes of the base."""
    resources = deploy.render("local")
    cpu = memory = 0.0
    for r in resources:
        if r["kind"] in ("Deployment", "StatefulSet"):
            requests = _container(r)["resources"]["requests"]
            replicas = r["spec"]["replicas"]
            c = str(requests["cpu"])
            cpu += replicas * (float(c[:-1]) / 1000 if c.endswith("m") else float(c))
            m = re.fullmatch(r"([0-9.]+)(Mi|Gi)", requests["memory"])
            assert m, requests["memory"]
            memory += replicas * float(m[1]) * {"Mi": 2**20, "Gi": 2**30}[m[2]]
    assert cpu <= 3 and memory <= 6 * 2**30, (cpu, memory / 2**30)
    for kind, name in (("StatefulSet", "worker"), ("Deployment", "pool")):
        assert _container(_by(resources, kind, name))["resources"]["requests"] == {"cpu": "500m", "memory": "2Gi"}  # fmt: skip
    (claim,) = _by(resources, "StatefulSet", "worker")["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["storageClassName"] == "standard"
    assert claim["spec"]["resources"]["requests"]["storage"] == "5Gi"
    pool = _by(resources, "Deployment", "pool")["spec"]["template"]["spec"]
    (volume,) = [v for v in pool["volumes"] if "ephemeral" in v]  # (and the region catalog)
    assert volume["ephemeral"]["volumeClaimTemplate"]["spec"]["storageClassName"] == "standard"
    assert _by(resources, "Service", "gateway")["spec"]["type"] == "ClusterIP"

    base = build(deploy.OVERLAYS.parent / "base")
    for region in REGIONS:
        if region == "local":
            continue
        resources = deploy.render(region)
        assert _by(resources, "Service", "gateway")["spec"]["type"] == "LoadBalancer"
        for kind, name in (("StatefulSet", "worker"), ("Deployment", "pool")):
            got = _container(_by(resources, kind, name))["resources"]
            want = _container(_by(base, kind, name))["resources"]
            assert got["requests"] == want["requests"] == {"cpu": "4", "memory": "16Gi"}
            assert got["limits"]["memory"] == want["limits"]["memory"] == "32Gi"
        (claim,) = _by(resources, "StatefulSet", "worker")["spec"]["volumeClaimTemplates"]
        assert (claim["spec"]["storageClassName"], claim["spec"]["resources"]["requests"]["storage"]) == ("local-nvme", "200Gi")  # fmt: skip


def test_resource_settings_flow_into_manifests(tmp_path: Path) -> None:
    catalog = _catalog(tmp_path, worker_cpu=2, worker_memory="40Gi", worker_memory_limit="48Gi",
                       gateway_service="NodePort")  # fmt: skip
    resources = deploy.render("local", catalog)
    for r in resources:
        kubernetes_validate.validate(r, K8S_VERSION, strict=True)
    for kind, name in (("StatefulSet", "worker"), ("Deployment", "pool")):
        assert _container(_by(resources, kind, name))["resources"] == {
            "requests": {"cpu": "2", "memory": "40Gi"}, "limits": {"memory": "48Gi"}}  # fmt: skip
    assert _by(resources, "Service", "gateway")["spec"]["type"] == "NodePort"


def test_apply_without_kubectl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shutil.which("kubectl") is None
    assert deploy.main(["us-east", "--apply"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "region 'us-east'" in captured.err and "kubectl" in captured.err


def test_strategic_merge() -> None:
    base = {"containers": [{"name": "a", "env": [{"name": "X", "value": "1"}], "args": ["p"]}]}
    patch = {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}], "args": ["q"]},
                            {"name": "b"}]}  # fmt: skip
    assert merge(base, patch) == {"containers": [
        {"name": "a", "env": [{"name": "X", "value": "1"}, {"name": "Y", "value": "2"}], "args": ["q"]},
        {"name": "b"}]}  # fmt: skip
    assert merge({"a": 1, "b": 2}, {"b": None}) == {"a": 1}


def test_deploy_sh(tmp_path: Path) -> None:
    import subprocess

    script = deploy.INFRA / "deploy.sh"
    assert os.access(script, os.X_OK)
    done = subprocess.run([str(script), "nowhere"], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "region 'nowhere'" in done.stderr
    done = subprocess.run([str(script), "local"], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and list(yaml.safe_load_all(done.stdout)) == deploy.render("local")


def test_deploy_sh_runs_on_the_hosts_python(tmp_path: Path) -> None:
    """Without a .venv, deploy.sh runs the host's python3: Python 3.10 has no -P (it printed
    "Unknown option: -P" and stopped), and a python3 without PyYAML gets one line saying how to
    install it, not a traceback. Paths with spaces work."""
    import subprocess
    import sys

    repo = tmp_path / "a checkout"  # (no .venv in it)
    shutil.copytree(deploy.INFRA, repo / "infra", ignore=shutil.ignore_patterns("__pycache__"))
    for package in ("gateway", "runtime"):
        (repo / package).symlink_to(deploy.INFRA.parent / package)
    bin_dir = tmp_path / "host bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"
    env = {"PATH": f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin", "HOME": str(tmp_path)}
    caller = tmp_path / "the caller"
    caller.mkdir()

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(repo / "infra" / "deploy.sh"), *args], cwd=caller, env=env,
                              capture_output=True, text=True, check=False)  # fmt: skip

    # a Python 3.10 (this one, refusing -P as 3.10 does)
    python3.write_text(f"""#!/bin/sh
for a in "$@"; do [ "$a" = -P ] && {{ echo "Unknown option: -P" >&2; exit 2; }}; done
exec "{sys.executable}" "$@"
""")
    python3.chmod(0o755)
    done = run("local", "--out", "out dir")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.split("\n")) - 1 == len(deploy.render("local"))
    assert (caller / "out dir").is_dir()
    # a python3 without PyYAML (-S: no site-packages)
    python3.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    done = run("local")
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert "PyYAML" in line and "pip install pyyaml" in line, line


def test_deploy_needs_python_and_pyyaml_only(tmp_path: Path) -> None:
    """deploy.sh runs on the host's python3 where there is no virtual environment: rendering
    imports nothing beyond PyYAML (it imported the pool manager for its --models parser, and
    with it redis, orjson, opentelemetry...: ModuleNotFoundError on a plain host)."""
    import subprocess
    import sys

    code = ("import sys; from infra import deploy; deploy.main(['us-east', '--out', sys.argv[1]]);"
            " print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'redis', 'orjson',"
            " 'aiohttp', 'opentelemetry', 'numpy', 'xxhash', 'psutil', 'tokenizers'}))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], cwd=deploy.INFRA.parent,
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


def test_gateways_take_api_keys_and_gpu_regions_a_cuda_image() -> None:
    """A region's gateway is a public LoadBalancer: its API keys come from the secret (optional,
    key api-keys), or it served anyone; a region with GPUs runs the CUDA image."""
    catalog = RegionCatalog.load()
    for name in catalog.regions:
        resources = deploy.render(name)
        gateway = next(r for r in resources if r["kind"] == "Deployment"
                       and r["metadata"]["name"] == "gateway")  # fmt: skip
        env = {e["name"]: e for e in gateway["spec"]["template"]["spec"]["containers"][0]["env"]}
        ref = env["EDGEINFER_API_KEYS"]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": "edgeinfer-secret", "key": "api-keys", "optional": True}
        settings = catalog.regions[name].settings
        if settings.get("gpus_per_worker", 0):
            assert settings["image"].endswith("-cu130"), (name, settings["image"])


def test_base_renders_alone() -> None:
    """The base is a kustomization of its own (kubectl apply -k infra/k8s/base works too)."""
    names = {r["metadata"]["name"] for r in build(deploy.OVERLAYS.parent / "base")}
    assert names == {"edgeinfer-config", "redis", "gateway", "worker", "pool", "otel-collector",
                     "otel-collector-config"}  # fmt: skip


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl on PATH")
def test_kubectl_kustomize_builds_the_base_and_every_overlay() -> None:
    """The real kustomize (kubectl's) builds what this repository's renderer builds: a
    kustomization holding infra/ (for its region catalog) made `kubectl kustomize` and
    `kubectl apply -k` fail with "cycle detected", where infra/kustomize.py has no such check."""
    import subprocess

    for folder in [deploy.OVERLAYS.parent / "base",
                   *sorted(p for p in deploy.OVERLAYS.iterdir() if p.is_dir())]:  # fmt: skip
        done = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0, (folder, done.stderr[-2000:])
        kinds = {d["kind"] for d in yaml.safe_load_all(done.stdout) if d}
        assert {"Deployment", "ConfigMap"} <= kinds, (folder, kinds)


def test_gateway_metrics_port_keeps_metrics_off_the_public_port(tmp_path: Path) -> None:
    """`--metrics-port`: /metrics (model names, worker ids, regions, error rates; no API key
    asked) is served on its own listener, and the main port, a public LoadBalancer in a region,
    answers it 404; without the flag it stays on the main port (`make run`, one machine)."""
    import urllib.error
    import urllib.request

    from kvstore.redis_server import find_free_port
    from tests.stack import start_gateway

    def get(url: str) -> tuple[int, str, str]:
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                return resp.status, resp.headers.get("Content-Type", ""), resp.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, "", ""

    redis_url = f"redis://127.0.0.1:{find_free_port()}/0"  # (none there: the gateway starts anyway)
    metrics_port = find_free_port()
    gateway = start_gateway("gateway-metrics-port", redis_url, deploy.DEFAULT_CATALOG, tmp_path,
                            extra=["--metrics-port", str(metrics_port)])  # fmt: skip
    try:
        # a request the main port refuses (not JSON): counted, and shown on the metrics port
        bad = urllib.request.Request(f"{gateway.url}/v1/chat/completions", data=b"{",
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        with pytest.raises(urllib.error.HTTPError, match="400"):
            urllib.request.urlopen(bad, timeout=10)
        status, content_type, body = get(f"http://127.0.0.1:{metrics_port}/metrics")
        assert status == 200 and content_type.startswith("text/plain"), (status, content_type)
        assert "edgeinfer_gateway_errors_total{" in body, body
        assert get(f"{gateway.url}/metrics")[0] == 404
        assert get(f"{gateway.url}/healthz")[0] == 200
        # the metrics listener serves /metrics only
        assert get(f"http://127.0.0.1:{metrics_port}/healthz")[0] == 404
        assert f"/metrics on port {metrics_port}" in gateway.tail()
    finally:
        gateway.stop()
    gateway = start_gateway("gateway-default", redis_url, deploy.DEFAULT_CATALOG, tmp_path)
    try:
        assert get(f"{gateway.url}/metrics")[0] == 200
    finally:
        gateway.stop()


def _pod_templates(resources: list[dict[str, Any]]) -> dict[str, Any]:
    return {f"{r['kind']}/{r['metadata']['name']}": r["spec"]["template"] for r in resources
            if r["kind"] in ("Deployment", "StatefulSet")}  # fmt: skip


@pytest.mark.parametrize(
    "settings",
    [{"models": ["SmolLM2-135M-Instruct", "other"]}, {"redis_url": "redis://shared.example:6379/0"},
     {"otlp_endpoint": "http://otel.example:4318"}],
)  # fmt: skip
def test_a_config_change_rolls_the_pods(tmp_path: Path, settings: dict[str, Any]) -> None:
    """A container reads edgeinfer-config (envFrom) once, at start, and Kubernetes replaces pods
    only when their template changes: a setting that changed the config map alone reached no
    running process. With a redis_url, `--apply` pruned the region's Redis while every gateway,
    worker and pool went on calling redis://redis:6379. Each template that reads a config map
    carries its digest, so it changes with the config (and not otherwise)."""
    before = deploy.render("local", _catalog(tmp_path))
    assert _pod_templates(deploy.render("local", _catalog(tmp_path))) == _pod_templates(before)
    (tmp_path / "new").mkdir()
    after = deploy.render("local", _catalog(tmp_path / "new", **settings))
    old, new = _pod_templates(before), _pod_templates(after)
    for name in ("Deployment/gateway", "StatefulSet/worker", "Deployment/pool"):
        assert new[name] != old[name], f"{name}: same pod template, so no rollout"
        assert new[name]["metadata"]["annotations"][deploy.CONFIG_DIGEST]
    for r in after:
        kubernetes_validate.validate(r, K8S_VERSION, strict=True)


def _sa_east(tmp_path: Path) -> tuple[Path, Path]:
    """A region added to a catalog of the operator's own (`--catalog`), with its overlay: one that
    the image's packaged catalog does not have."""
    k8s = tmp_path / "infra" / "k8s"
    shutil.copytree(deploy.OVERLAYS.parent, k8s)
    shutil.copytree(deploy.INFRA / "otel", tmp_path / "infra" / "otel")
    shutil.copy(deploy.INFRA / "regions.yaml", tmp_path / "infra" / "regions.yaml")
    overlay = k8s / "overlays" / "sa-east"
    shutil.copytree(k8s / "overlays" / "local", overlay)
    for f in overlay.iterdir():
        f.write_text(f.read_text().replace("local", "sa-east"))
    raw = yaml.safe_load(deploy.DEFAULT_CATALOG.read_text())
    (local,) = [e for e in raw["regions"] if e["name"] == "local"]
    for entry in raw["regions"]:  # (a password: never in another region's manifests)
        if entry["name"] == "us-east":
            entry["settings"]["redis_url"] = "rediss://:hunter2@shared.example:6380/0"
    raw["regions"].append({"name": "sa-east", "latitude": -23.55, "longitude": -46.63,
                           "settings": dict(local["settings"], models=["tiny", "b"])})  # fmt: skip
    catalog = tmp_path / "my-regions.yaml"
    catalog.write_text(yaml.safe_dump(raw))
    return catalog, k8s / "overlays"


def test_gateways_read_the_catalog_they_were_deployed_from(tmp_path: Path) -> None:
    """A region deployed from `--catalog my-regions.yaml` (README) ran gateways that read the
    catalog inside their image: one without the new region stopped every gateway at start
    ("region 'sa-east' is not in the catalog"), a crash loop. The rendered gateway, run here as
    its pod would run it (its args, its config map's environment, its config-map volume), starts
    and serves on the catalog it was deployed from."""
    import subprocess
    import sys
    import urllib.request

    from kvstore.redis_server import find_free_port
    from tests.stack import ROOT, wait_until

    catalog, overlays = _sa_east(tmp_path)
    resources = deploy.render("sa-east", catalog, overlays)
    for r in resources:
        kubernetes_validate.validate(r, K8S_VERSION, strict=True)
    assert "hunter2" not in deploy.to_yaml(resources)
    # the gateways' catalog: every region's name, point of presence and models
    text = _by(resources, "ConfigMap", "edgeinfer-regions")["data"]["regions.yaml"]
    shipped = [(e["name"], e["latitude"], e["longitude"], e["settings"]["models"])
               for e in yaml.safe_load(text)["regions"]]  # fmt: skip
    source = RegionCatalog.load(catalog).regions.values()
    assert shipped == [(r.name, r.latitude, r.longitude, r.settings["models"]) for r in source]
    gateway = _by(resources, "Deployment", "gateway")
    c = _container(gateway)
    # the pod's volumes: each config map's files in a folder, where the container mounts them
    volumes = {v["name"]: v for v in gateway["spec"]["template"]["spec"].get("volumes", [])}
    mounts: dict[str, Path] = {}
    for m in c.get("volumeMounts", []):
        folder = tmp_path / "pod" / m["mountPath"].strip("/")
        folder.mkdir(parents=True)
        data = _by(resources, "ConfigMap", volumes[m["name"]]["configMap"]["name"])["data"]
        for key, text in data.items():
            (folder / key).write_text(text)
        mounts[m["mountPath"]] = folder
    env = _env(resources, c)
    args = _expand(c["args"], env)
    for mount, folder in mounts.items():
        args = [str(folder) + a[len(mount) :] if a.startswith(mount + "/") else a for a in args]
    port, metrics_port = find_free_port(), find_free_port()
    for flag, value in (("--host", "127.0.0.1"), ("--port", str(port)),
                        ("--metrics-port", str(metrics_port))):  # fmt: skip
        args[args.index(flag) + 1] = value
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("EDGEINFER_", "OTEL_"))}
    log = tmp_path / "gateway.log"
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", *args], cwd=ROOT,
                            env=clean | {"EDGEINFER_SECRET": "s", "EDGEINFER_REGION": "sa-east",
                                         "EDGEINFER_REDIS": f"redis://127.0.0.1:{find_free_port()}/0"},
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)  # fmt: skip

    def healthy() -> bool:
        assert proc.poll() is None, f"the gateway exited {proc.returncode}: {log.read_text()}"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    try:
        wait_until(healthy, 30, "the rendered gateway answers /healthz")
    finally:
        proc.terminate()
        proc.wait(10)
    assert "region sa-east" in log.read_text()


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        # the gateways refuse these catalogs at start (RegionCatalog.load): deploy rendered them
        # (a missing coordinate says so: "must be a number" sent one looking for a typo)
        ({"name": "local", "settings": {}}, "regions[7] (local): latitude is missing"),
        ({"name": "local", "latitude": 1, "longitude": 2},
         "regions[7] (local): duplicate region name: regions[0] is local too"),
        ({"name": "bad name!", "latitude": 1, "longitude": 2},
         "regions[7]: name must be at most 53 lower-case letters, digits and '-'"),
        # a misspelt field: the region's settings were left unread, and no one said so
        (
            {"name": "x", "latitude": 1, "longitude": 2, "setting": {"workers": 1}},
            "regions[7] (x): unknown field 'setting' (a region has name, latitude, longitude, settings)",
        ),
    ],
)
def test_a_catalog_the_gateways_refuse_is_not_deployed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], entry: dict[str, Any], message: str
) -> None:
    raw = yaml.safe_load(deploy.DEFAULT_CATALOG.read_text())
    raw["regions"].append(entry)
    catalog = tmp_path / "regions.yaml"
    catalog.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    assert deploy.main(["us-east", "--catalog", str(catalog), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"deploy: error: {catalog}: ") and message in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    ("key", "hint"),
    [("gpus", "did you mean gpus_per_worker?"), ("worker", "did you mean workers?"),
     ("replicas", "did you mean gateway_replicas?"), ("colour", "known: image, workers")],
)  # fmt: skip
def test_a_misspelt_setting_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, hint: str
) -> None:
    """`gpus: 1` for `gpus_per_worker: 1` rendered CPU workers on a GPU region, and said
    nothing."""
    setting: dict[str, Any] = {key: 1}
    catalog = _catalog(tmp_path, **setting)
    assert deploy.main(["local", "--catalog", str(catalog)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"region 'local': settings.{key} is not a setting ({hint}" in captured.err


def test_a_catalog_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    """A catalog saved in another encoding: deploy.sh ended in a UnicodeDecodeError traceback,
    and the gateway said only "'utf-8' codec can't decode byte 0xe9", naming no file."""
    import subprocess
    import sys

    from tests.stack import ROOT

    catalog = tmp_path / "regions.yaml"
    catalog.write_bytes(b"regions:\n  - name: caf\xe9\n    latitude: 0\n    longitude: 0\n")
    expected = f"{catalog}: cannot read the region catalog: not UTF-8"
    for argv in ([str(deploy.INFRA / "deploy.sh"), "local", "--catalog", str(catalog)],
                 [sys.executable, "-m", "runtime.cli", "gateway", "--regions", str(catalog),
                  "--redis", "redis://127.0.0.1:1/0"]):  # fmt: skip
        env = os.environ | {"EDGEINFER_SECRET": "s"}
        done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and expected in done.stderr, (argv[0], done.stderr)
        assert "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("image", "pulled"),
    [("edgeinfer", "edgeinfer:latest"), ("edgeinfer/edgeinfer:0.1.0", None),
     ("localhost:5000/ei:dev", None), ("localhost/ei", "localhost/ei:latest"),
     ("Registry.Example.com/team/ei__x:0.1.0-cu130", None),
     ("registry.example/ei@sha256:" + "ab" * 32, None),
     ("registry.example:443/ei:v1@sha256:" + "cd" * 32, "registry.example:443/ei@sha256:" + "cd" * 32)],
)  # fmt: skip
def test_image_references(tmp_path: Path, image: str, pulled: str | None) -> None:
    resources = deploy.render("local", _catalog(tmp_path, image=image))
    assert _container(_by(resources, "StatefulSet", "worker"))["image"] == (pulled or image)


def test_workers_and_the_pool_read_the_gateways_catalog(tmp_path: Path) -> None:
    """Standing workers and the pool manager got no catalog: a worker's --region typo registered
    a region the gateways put last (`edgeinfer worker` only warns without --regions). They now
    mount the gateways' catalog and pass it as --regions, so such a region is refused at start."""
    catalog, overlays = _sa_east(tmp_path)
    resources = deploy.render("sa-east", catalog, overlays)
    for kind, name in (("Deployment", "gateway"), ("StatefulSet", "worker"), ("Deployment", "pool")):
        r = _by(resources, kind, name)
        c = _container(r)
        args = c["args"]
        assert args[args.index("--regions") + 1] == f"{deploy.CATALOG_DIR}/regions.yaml", name
        (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == deploy.CATALOG_DIR]
        volumes = {v["name"]: v for v in r["spec"]["template"]["spec"]["volumes"]}
        assert volumes[mount["name"]]["configMap"]["name"] == deploy.REGIONS_MAP, name
        kubernetes_validate.validate(r, K8S_VERSION, strict=True)
    assert len([r for r in resources if r["metadata"]["name"] == deploy.REGIONS_MAP]) == 1
