"""infra/deploy.py and the region catalog across regions: which regions share a cluster state
(and so route to each other), what a worker advertises to other regions' gateways, an overlay
copied from another region, trace sampling, and the catalog's names and models."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from gateway.regions import CatalogError, RegionCatalog
from infra import deploy
from runtime.cli import build_parser
from tests.test_infra import K8S_VERSION, _by, _container, _env, _expand

SHARED = "rediss+cluster://state.example:6379"


def _catalog(tmp_path: Path, top: dict[str, Any] | None = None, **changes: dict[str, Any]) -> Path:
    """The packaged catalog with top-level fields `top` and `changes` ({region: settings}), a
    None value removing the setting."""
    raw = yaml.safe_load(deploy.DEFAULT_CATALOG.read_text())
    raw.update(top or {})
    for entry in raw["regions"]:
        for key, value in changes.get(entry["name"].replace("-", "_"), {}).items():
            if value is None:
                entry["settings"].pop(key, None)
            else:
                entry["settings"][key] = value
    path = tmp_path / "regions.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


def _main(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = deploy.main(args)
    out, err = capsys.readouterr()
    return code, out, err


# ----------------------------------------------------------------- one cluster state, or not
def test_a_region_with_a_redis_of_its_own_is_said_to_route_nowhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shipped catalog named no shared Redis, so every region's deploy ran a Redis of its
    own, and no region's gateways ever saw another's workers, while the catalog's header said
    they shared one cluster state. The deploy now says so, naming the regions it cannot reach."""
    code, out, err = _main(["us-east"], capsys)
    assert code == 0 and out, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("deploy: warning:")]
    assert "region 'us-east' runs a Redis of its own" in line, line
    assert "us-west" in line and "eu-west" in line and "top-level redis_url" in line, line
    assert "Deployment/redis" in {f"{r['kind']}/{r['metadata']['name']}" for r in yaml.safe_load_all(out)}  # fmt: skip
    # the catalog says it too, and no longer claims one cluster state for all
    header = deploy.DEFAULT_CATALOG.read_text().split("regions:\n")[0]
    assert "All regions share one logical cluster state" not in header
    assert "redis_url" in header and "flat network" in header and "worker_advertise_url" in header


def test_the_catalogs_redis_url_is_every_regions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A top-level redis_url: every region's pods read it, none runs a Redis of its own, and
    no warning; the gateways load such a catalog (the image's packaged copy can hold one)."""
    catalog = _catalog(tmp_path, {"redis_url": SHARED})
    assert RegionCatalog.load(catalog).redis_url == SHARED
    for region in ("us-east", "eu-west"):
        resources = deploy.render(region, catalog)
        assert _by(resources, "ConfigMap", "edgeinfer-config")["data"]["EDGEINFER_REDIS"] == SHARED
        assert not [r for r in resources if r["metadata"]["name"] == "redis"]
        code, _, err = _main([region, "--catalog", str(catalog)], capsys)
        assert code == 0 and "warning" not in err, err
    # the catalog the gateways are handed holds no Redis URL (no business of theirs)
    regions_map = _by(deploy.render("us-east", catalog), "ConfigMap", deploy.REGIONS_MAP)
    assert "redis" not in regions_map["data"]["regions.yaml"].split("regions:")[1]


@pytest.mark.parametrize(
    ("top", "region", "message"),
    [
        # a region naming another Redis than the one the catalog says all share
        ({"redis_url": SHARED}, {"redis_url": "redis://other.example:6379/0"},
         "settings.redis_url (redis://other.example:6379/0) names another Redis than the "
         "catalog's redis_url"),
        ({"redis_url": "rediss://:hunter2@state.example:6379"}, {},
         "the catalog's redis_url holds a password"),
        ({"redis_url": "http://state.example"}, {}, "the catalog's redis_url must be a redis://"),
    ],
)  # fmt: skip
def test_a_region_apart_from_the_catalogs_redis_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], top: dict[str, Any],
    region: dict[str, Any], message: str,
) -> None:  # fmt: skip
    catalog = _catalog(tmp_path, top, us_east=region)
    code, out, err = _main(["us-east", "--catalog", str(catalog)], capsys)
    assert code == 2 and out == "", err
    assert f"region 'us-east': {message}" in err and "hunter2" not in err, err


def test_regions_naming_other_redises_are_warned_about(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without a top-level redis_url, a region naming a Redis is warned about the regions that
    name none or another one (they keep a cluster state of their own)."""
    same = {"redis_url": "redis://state.example:6379/0"}
    catalog = _catalog(tmp_path, us_east=same, us_west=same,
                       eu_west={"redis_url": "redis://elsewhere.example:6379/0"})  # fmt: skip
    code, _, err = _main(["us-east", "--catalog", str(catalog)], capsys)
    assert code == 0, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("deploy: warning:")]
    assert "the regions local, eu-west, eu-central" in line and "us-west" not in line, line


def test_unknown_catalog_fields_are_refused(tmp_path: Path) -> None:
    """A misspelt top-level field (`redis-url:`) was ignored: each region ran its own Redis."""
    with pytest.raises(CatalogError, match=r"unknown field 'redis-url' .*regions, redis_url"):
        RegionCatalog.load(_catalog(tmp_path, {"redis-url": SHARED}))


# ------------------------------------------------------------------- what workers advertise
def _worker_args(resources: list[dict[str, Any]]) -> Any:
    c = _container(_by(resources, "StatefulSet", "worker"))
    return build_parser().parse_args(_expand(c["args"], _env(resources, c)))


def test_workers_advertise_the_regions_url(tmp_path: Path) -> None:
    """`http://$(POD_IP):9001` is reached from another cluster only over a flat network: a
    region can give its workers an address the other regions' gateways resolve."""
    assert _worker_args(deploy.render("us-east")).advertise_url == "http://10.1.2.3:9001"
    url = "https://$(POD_NAME).$(EDGEINFER_REGION).workers.example.com:9443"
    resources = deploy.render("us-east", _catalog(tmp_path, us_east={"worker_advertise_url": url}))
    for r in resources:
        kubernetes_validate.validate(r, K8S_VERSION, strict=True)
    args = _worker_args(resources)
    assert args.advertise_url == "https://pod-0.us-east.workers.example.com:9443"
    assert (args.host, args.port) == ("0.0.0.0", 9001)  # (it still listens on its pod)


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("https://workers.example.com", "neither $(POD_NAME) nor $(POD_IP)"),
        ("http://$(HOST_IP):9001", "the variables a worker pod has"),
        ("http://$POD_IP:9001", "the variables a worker pod has"),
        ("$(POD_IP):9001", "is not an http:// or https:// URL"),
        ("http://$(POD_IP):port", "worker_advertise_url"),
        (9001, "must be a string"),
    ],
)
def test_bad_advertise_urls_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: Any, message: str
) -> None:
    catalog = _catalog(tmp_path, us_east={"worker_advertise_url": url})
    code, out, err = _main(["us-east", "--catalog", str(catalog)], capsys)
    assert code == 2 and out == "", err
    assert "region 'us-east': settings.worker_advertise_url" in err and message in err, err


# ------------------------------------------------------------------------ a copied overlay
def _copied_overlay(tmp_path: Path, edit: dict[str, tuple[str, str]]) -> tuple[Path, Path]:
    """overlays/us-east copied to overlays/us-south, with `edit` ({file: (old, new)}) made to
    it, and us-south added to a catalog."""
    k8s = tmp_path / "infra" / "k8s"
    shutil.copytree(deploy.OVERLAYS.parent, k8s)
    shutil.copytree(deploy.INFRA / "otel", tmp_path / "infra" / "otel")
    overlay = k8s / "overlays" / "us-south"
    shutil.copytree(k8s / "overlays" / "us-east", overlay)
    for name, (old, new) in edit.items():
        f = overlay / name
        f.write_text(f.read_text().replace(old, new))
    raw = yaml.safe_load(deploy.DEFAULT_CATALOG.read_text())
    (east,) = [e for e in raw["regions"] if e["name"] == "us-east"]
    raw["regions"].append({"name": "us-south", "latitude": 29.76, "longitude": -95.37,
                           "settings": dict(east["settings"])})  # fmt: skip
    catalog = tmp_path / "regions.yaml"
    catalog.write_text(yaml.safe_dump(raw))
    return catalog, k8s / "overlays"


EVERYWHERE = {"namespace.yaml": ("us-east", "us-south"), "config.yaml": ("us-east", "us-south"),
              "kustomization.yaml": ("us-east", "us-south")}  # fmt: skip


@pytest.mark.parametrize(
    ("keep", "message"),
    [
        # unedited: us-south's manifests in us-east's namespace, as us-east: --apply replaced
        # us-east's gateways and workers
        (tuple(EVERYWHERE),
         ["the Namespace 'edgeinfer-us-east', not 'edgeinfer-us-south' (fix {o}/namespace.yaml)",
          "the resources' namespace 'edgeinfer-us-east', not 'edgeinfer-us-south' (fix "
          "{o}/kustomization.yaml (namespace:))",
          "EDGEINFER_REGION 'us-east', not 'us-south' (fix {o}/config.yaml)",
          "the pods' label edgeinfer.dev/region 'us-east', not 'us-south' (fix "
          "{o}/kustomization.yaml (labels:))"]),
        (("config.yaml",), ["EDGEINFER_REGION 'us-east', not 'us-south' (fix {o}/config.yaml)"]),
        (("namespace.yaml",), ["the Namespace 'edgeinfer-us-east', not 'edgeinfer-us-south' "
                               "(fix {o}/namespace.yaml)"]),
    ],
)  # fmt: skip
def test_an_overlay_copied_from_another_region_is_refused(
    tmp_path: Path, keep: tuple[str, ...], message: list[str]
) -> None:
    """(`render` raises before anything is printed, written or applied: `deploy.sh us-south
    --apply` leaves us-east as it was.)"""
    edit = {name: change for name, change in EVERYWHERE.items() if name not in keep}
    catalog, overlays = _copied_overlay(tmp_path, edit)
    o = overlays / "us-south"
    with pytest.raises(deploy.DeployError) as e:
        deploy.render("us-south", catalog, overlays)
    assert str(e.value) == (f"region 'us-south': the overlay {o} renders another region (a copy "
                            "of another region's overlay?): "
                            + "; ".join(m.format(o=o) for m in message)), e.value  # fmt: skip


def test_an_overlay_whose_namespace_or_pod_labels_are_another_regions_is_refused(
    tmp_path: Path,
) -> None:
    """The kustomization's `namespace:` and its pod template labels, each left as us-east's."""
    kustomization = "infra/k8s/overlays/us-south/kustomization.yaml"
    for case_name, old, what in (
        ("namespace", "namespace: edgeinfer-us-east",
         "the resources' namespace 'edgeinfer-us-east', not 'edgeinfer-us-south' (fix "
         "{o}/kustomization.yaml (namespace:))"),
        ("labels", "{edgeinfer.dev/region: us-east}",
         "the pods' label edgeinfer.dev/region 'us-east', not 'us-south' (fix "
         "{o}/kustomization.yaml (labels:))"),
    ):  # fmt: skip
        case = tmp_path / case_name
        text = (deploy.OVERLAYS / "us-east" / "kustomization.yaml").read_text()
        mixed = text.replace("us-east", "us-south").replace(old.replace("us-east", "us-south"), old)  # fmt: skip
        catalog, overlays = _copied_overlay(case, {k: v for k, v in EVERYWHERE.items()
                                                   if k != "kustomization.yaml"})  # fmt: skip
        (case / kustomization).write_text(mixed)
        with pytest.raises(deploy.DeployError) as e:
            deploy.render("us-south", catalog, overlays)
        assert str(e.value).endswith(what.format(o=overlays / "us-south")), e.value
    # edited throughout, it renders us-south
    catalog, overlays = _copied_overlay(tmp_path / "ok", EVERYWHERE)
    resources = deploy.render("us-south", catalog, overlays)
    assert _by(resources, "ConfigMap", "edgeinfer-config")["data"]["EDGEINFER_REGION"] == "us-south"


# --------------------------------------------------------------------------- trace sampling
def test_trace_sampling_is_a_region_setting(tmp_path: Path) -> None:
    """Every pod ran at the CLI's --otel-sample-ratio 1.0, and no setting changed it. The
    gateways, standing workers and the pool's workers take the region's; a region keeps a tenth
    of its traces by default, `local` (a dev cluster) all of them."""
    parser = build_parser()

    def ratios(resources: list[dict[str, Any]]) -> list[float]:
        got = []
        for kind, name in (("Deployment", "gateway"), ("StatefulSet", "worker"), ("Deployment", "pool")):  # fmt: skip
            c = _container(_by(resources, kind, name))
            args = parser.parse_args(_expand(c["args"], _env(resources, c)))
            if name == "pool":
                args = parser.parse_args(["worker", *args.worker_args.split()])
            got.append(args.otel_sample_ratio)
        return got

    assert ratios(deploy.render("us-east")) == [deploy.DEFAULT_SAMPLE_RATIO] * 3 == [0.1] * 3
    assert ratios(deploy.render("local")) == [1.0] * 3
    catalog = _catalog(tmp_path, us_east={"otel_sample_ratio": 0.02})
    assert ratios(deploy.render("us-east", catalog)) == [0.02] * 3
    catalog = _catalog(tmp_path, us_east={"otel_sample_ratio": 0})
    assert ratios(deploy.render("us-east", catalog)) == [0.0] * 3
    # the base alone (an overlay applied by hand) keeps the deploy's default
    base = yaml.safe_load((deploy.OVERLAYS.parent / "base" / "config.yaml").read_text())
    assert float(base["data"]["EDGEINFER_OTEL_SAMPLE_RATIO"]) == deploy.DEFAULT_SAMPLE_RATIO


@pytest.mark.parametrize("ratio", [1.5, -0.1, "half", True, None])
def test_bad_sample_ratios_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], ratio: Any
) -> None:
    raw = yaml.safe_load(deploy.DEFAULT_CATALOG.read_text())
    raw["regions"][1]["settings"]["otel_sample_ratio"] = ratio
    catalog = tmp_path / "regions.yaml"
    catalog.write_text(yaml.safe_dump(raw))
    code, out, err = _main([raw["regions"][1]["name"], "--catalog", str(catalog)], capsys)
    assert code == 2 and out == "", err
    assert "settings.otel_sample_ratio must be a number in [0, 1]" in err, err


# ------------------------------------------------------------------- names and models
@pytest.mark.parametrize(
    ("models", "message"),
    [
        (["a=/x", "a=/y"], "'a=/y': the model 'a' is already given by 'a=/x'"),
        (["a", "a"], "'a': the model 'a' is already given by 'a'"),
        (["x", "=/m/x"], "'=/m/x': the model 'x' is already given by 'x'"),
        (["a="], "'a=': no folder after '='"),
    ],
)
def test_a_catalogs_models_are_each_one_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], models: list[str], message: str
) -> None:
    """Two folders under one name: the pool served the last, the standing workers the first;
    `a=` was read as something else. The catalog is refused, by the gateways too."""
    catalog = _catalog(tmp_path, us_east={"models": models})
    with pytest.raises(CatalogError, match=r"regions\[1\] \(us-east\): settings\.models: ") as e:
        RegionCatalog.load(catalog)
    assert message in str(e.value)
    code, out, err = _main(["us-west", "--catalog", str(catalog)], capsys)
    assert code == 2 and out == "" and message in err, err


@pytest.mark.parametrize(
    ("name", "ok"),
    [("us-east", True), ("a", True), ("1", True), ("a" * 53, True),
     ("US_East", False), ("us_east", False), ("Us-east", False), ("a" * 54, False),
     ("-a", False), ("a-", False), ("a.b", False), ("", False)],
)  # fmt: skip
def test_region_names_are_namespace_labels(tmp_path: Path, name: str, ok: bool) -> None:
    """`US_East` rendered the namespace edgeinfer-US_East, and a 63-character name one of 73:
    both refused by Kubernetes at apply. A name is a DNS label that fits edgeinfer-NAME."""
    path = tmp_path / "regions.yaml"
    path.write_text(yaml.safe_dump({"regions": [{"name": name, "latitude": 0, "longitude": 0}]}))
    if ok:
        assert list(RegionCatalog.load(path).regions) == [name]
        assert len(f"edgeinfer-{name}") <= 63
    else:
        with pytest.raises(CatalogError, match="name must be at most 53 lower-case letters"):
            RegionCatalog.load(path)


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ([{"name": "a", "longitude": 0}], "regions[0] (a): latitude is missing"),
        ([{"name": "a", "latitude": 0}], "regions[0] (a): longitude is missing"),
        ([{"latitude": 0, "longitude": 0}], "regions[0]: name is missing"),
        ([{"name": "a", "latitude": 0, "longitude": 0}, {"name": "b", "latitude": 0, "longitude": 0},
          {"name": "a", "latitude": 1, "longitude": 1}],
         "regions[2] (a): duplicate region name: regions[0] is a too"),
    ],
)  # fmt: skip
def test_catalog_errors_say_what_is_missing_and_name_both_duplicates(
    tmp_path: Path, entries: list[dict[str, Any]], message: str
) -> None:
    path = tmp_path / "regions.yaml"
    path.write_text(yaml.safe_dump({"regions": entries}))
    with pytest.raises(CatalogError) as e:
        RegionCatalog.load(path)
    assert str(e.value) == f"{path}: {message}" or message in str(e.value), e.value
