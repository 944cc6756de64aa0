"""Render (and, with --apply, apply) one region's Kubernetes manifests.

    python -m infra.deploy REGION [--apply] [--out DIR] [--catalog FILE] [--redis-url-file FILE]
    infra/deploy.sh REGION [...]

Three layers, the way `kustomize build` stacks them: infra/k8s/base (gateway Deployment and
Service, worker StatefulSet, pool manager, in-region Redis, the config map), the region's overlay
infra/k8s/overlays/REGION (namespace, the region's name in the config), and on top the region's
catalog settings from infra/regions.yaml (the gateway package ships it as its default catalog),
as an in-memory kustomization (the equivalent of `kustomize edit set image / set replicas` plus
patches):

    image             the edgeinfer container image, REPO[:TAG] or REPO@DIGEST   (required)
    workers           standing worker pods (the StatefulSet's replicas)         (required)
    models            models served: the first by the standing workers, all     (required)
                      of them by the pool manager (scale from zero); each a name in the
                      model store, or NAME=FOLDER (served as NAME), as `edgeinfer pool` reads them
    gpus_per_worker   nvidia.com/gpu per worker pod and pool pod: 0 (the default: CPU) or 1. A
                      worker runs on one GPU (tensor parallelism, --tp, runs on the CPU only so
                      far), and the pool manager gives its workers no GPU each (they would all run
                      on its pod's first): with a GPU, pool_max_workers is 0 or 1
    redis_url         a shared Redis for the cluster state, without a password (one with a
                      password: --redis-url-file, below); absent: the catalog's top-level
                      redis_url, every region's (a region's own must name the same Redis);
                      neither: the region runs its own, and routes to no other region (a
                      warning says so when the catalog has others: see split_state)
    worker_advertise_url  the URL each standing worker registers for the gateways (default
                      http://$(POD_IP):9001), with $(POD_NAME) or $(POD_IP) in it: what the
                      other regions' gateways reach, where pod IPs are not routed between the
                      clusters (infra/regions.yaml)
    otel_sample_ratio the fraction of traces kept, 0 to 1: the gateways' and workers' (the pool's
                      too) --otel-sample-ratio (default 0.1, DEFAULT_SAMPLE_RATIO: not the
                      CLI's 1.0, see there)
    drain_timeout     worker --drain-timeout, seconds (default 30); grace periods follow it
    store_class, store_size   the model store's local NVMe StorageClass and size
                      (default local-nvme, 200Gi)
    worker_cpu, worker_memory   the CPU and memory each worker pod and the pool pod request
                      (default 4, 16Gi): what the scheduler must find free on one node
    worker_memory_limit   their memory limit (default 32Gi; at least worker_memory)
    gateway_replicas  (default 2)
    gateway_service   the gateway Service's type: LoadBalancer (the default: public), NodePort
                      or ClusterIP (in-cluster only: `kubectl port-forward svc/gateway 8080:80`)
    pool_max_workers  the pool manager's --max-workers (default 1); 0: no pool manager, the
                      standing workers serve the region (so workers >= 1 and one model)
    otlp_endpoint     where gateways and workers send traces and metrics (OTLP/HTTP), an
                      http(s):// URL; absent: the region runs its own collector
                      (infra/otel/collector.yaml) and they send to http://otel-collector:4318
    traces_endpoint   where that in-region collector sends traces (OTLP/gRPC), an http(s)://
                      URL (https: over TLS; default http://tempo:4317)

A setting the deploy does not know (a misspelling: `gpus: 1` for `gpus_per_worker: 1`) is refused,
and so is a catalog the gateways would refuse (gateway.regions.RegionCatalog: a duplicate name, a
region without coordinates, a name that is no DNS label of at most 53 characters, one model
listed twice), and an overlay that renders another region than the one asked for (a copied
overlay left unedited: its namespace, EDGEINFER_REGION or pod labels; the error names the file). The gateways read the catalog the region is rendered from (the
ConfigMap edgeinfer-regions, mounted at /etc/edgeinfer/catalog: their image's own copy lacks a
region or model added since it was built), and every pod template carries a digest of the config
maps its pods read (edgeinfer.dev/config-sha256): a container reads its environment once, at
start, so a setting that changes only the config (models, redis_url, otlp_endpoint) rolls the
pods that read it.

A Redis with a password: the catalog holds none (it is kept in git, and a redis_url goes into
the ConfigMap edgeinfer-config), so a redis_url with one (redis://:PW@host, ?password=PW) is
refused for the region rendered, and named in a warning for any other region. The URL with its
password is given to the deploy, `--redis-url-file FILE` or $EDGEINFER_DEPLOY_REDIS_URL, and
rendered as the Secret edgeinfer-redis (key `url`), which the gateway, worker and pool
containers read as EDGEINFER_REDIS (the processes read that variable; no pod passes --redis, so
no password is on a pod's command line); the config map then holds no Redis URL, and the region runs
no Redis of its own. A redis_url in the catalog as well must name the same Redis. The Secret's
data is in the pod templates' digest, so `--apply` of a new password rolls the pods. Printed
manifests and --out hold the Secret (--out writes its file readable by its owner alone);
--apply prunes no Secret: one an earlier render made stays, read by nothing.

Without --apply the manifests are printed (or written to --out DIR, one file per resource,
NN-KIND-NAME.yaml numbered in the order they apply: the namespace first); with --apply they are
piped to `kubectl apply -f - --prune -l app.kubernetes.io/part-of=edgeinfer,edgeinfer.dev/region=REGION`
with an allowlist of the kinds the base holds (PRUNE_KINDS; kubectl 1.26 or later): a resource
that an earlier apply made and a setting has since removed (the pool after pool_max_workers: 0,
the region's Redis after a redis_url, its collector after an otlp_endpoint) is deleted, not left
running. Every rendered resource carries both labels (the deploy adds them: `-l` also filters
what is applied); the Namespace is not in the allowlist (it holds the operator's secret), and
the workers' volume claims, which kubectl never applied, stay.

--out DIR holds exactly the latest render: the files an earlier render wrote there (named
NN-KIND-NAME.yaml, and marked so on their first line) are removed first, so that
`kubectl apply -f DIR` never applies a stale file, such as an old Deployment whose number a new
resource shifted past the current one's (a rollback); other files in DIR, named like those or
not, are left alone (`kubectl apply -f DIR` does not prune: --apply does). Bad input (an
unknown region, a missing or malformed setting, an overlay that does not render, no kubectl for
--apply) stops before anything is written or applied, with exit status 2 and a message naming
the region and field; so does an --out DIR that cannot be written (naming DIR).
"""

from __future__ import annotations

import argparse
import base64
import copy
import difflib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from gateway.regions import DEFAULT_CATALOG, CatalogError, RegionCatalog
from infra.kustomize import RenderError, Resource, build
from runtime.model_specs import parse_models
from runtime.proctitle import redact

INFRA = Path(__file__).resolve().parent
OVERLAYS = INFRA / "k8s" / "overlays"
GRACE_MARGIN_S = 20  # beyond the drain timeout: the preStop pause and the exit itself
# an image reference as container runtimes parse it (distribution's grammar): [HOST[:PORT]/]PATH,
# PATH lower-case components joined by '/', then :TAG and/or @DIGEST. A looser form let through
# `repo:` (rendered `repo::latest`), `repo:1:2` and `a//b`, which no pod can pull (InvalidImageName)
_PART = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
# (a registry host has a '.' or a port, or is localhost: `UPPER/x` is a path, and not lower-case)
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST = rf"(?:localhost(?::[0-9]+)?|{_LABEL}(?:\.{_LABEL})+(?::[0-9]+)?|{_LABEL}:[0-9]+)/"
_IMAGE = re.compile(rf"^(?P<repo>(?:{_HOST})?{_PART}(?:/{_PART})*)(?::(?P<tag>[\w][\w.-]{{0,127}}))?(?:@(?P<digest>sha256:[0-9a-f]{{64}}))?$")  # fmt: skip
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
_CPU = re.compile(r"^([0-9]+(\.[0-9]+)?|[0-9]+m)$")
_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15,
          "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}  # fmt: skip
SERVICE_TYPES = ("LoadBalancer", "NodePort", "ClusterIP")
# the labels every rendered resource carries, and `kubectl apply --prune -l` selects on
PART_OF = "app.kubernetes.io/part-of"
REGION_LABEL = "edgeinfer.dev/region"
# the kinds `--apply` prunes (group/version/kind): every namespaced kind the base holds, so that a
# resource a setting removed goes; never Namespace (it holds the operator's secret) nor Secret
PRUNE_KINDS = ("core/v1/ConfigMap", "core/v1/Service", "apps/v1/Deployment", "apps/v1/StatefulSet")
_WRITTEN = re.compile(r"^[0-9]{2,}-[a-z0-9]+-[a-z0-9.-]+\.yaml$")  # a file `write` names
# the first line of every file `write` writes: what the next render into the folder replaces
_MARK = "# written by infra/deploy.py --out; the next render into this folder replaces it"
# the settings region_layer reads (a misspelt one, `gpus: 1`, was ignored: CPU workers, no word)
SETTINGS = ("image", "workers", "models", "gpus_per_worker", "redis_url", "drain_timeout",
            "store_class", "store_size", "worker_cpu", "worker_memory", "worker_memory_limit",
            "gateway_replicas", "gateway_service", "pool_max_workers", "otlp_endpoint",
            "traces_endpoint", "otel_sample_ratio", "worker_advertise_url")  # fmt: skip
# the fraction of traces a deployed region keeps (settings.otel_sample_ratio). Not the CLI's 1.0:
# that suits one machine, where every request is somebody's test; a region in production at
# every request's ~8 spans would ship them all to the collector and the trace store. The
# catalog's `local` (a dev cluster) sets 1.0
DEFAULT_SAMPLE_RATIO = 0.1
# what a standing worker advertises to the gateways (settings.worker_advertise_url): its pod IP,
# which the gateways of its own cluster reach (and, on a flat network, other clusters'). Its
# variables are the worker container's, expanded by the kubelet: each pod's own address
DEFAULT_ADVERTISE_URL = "http://$(POD_IP):9001"
ADVERTISE_VARS = ("POD_NAME", "POD_IP", "POD_NAMESPACE", "EDGEINFER_REGION")
# on every pod template: a digest of the ConfigMaps the pod reads (envFrom, volumes), so that a
# changed setting rolls the pods (a container reads its environment once, at start; see render)
CONFIG_DIGEST = "edgeinfer.dev/config-sha256"
REGIONS_MAP = "edgeinfer-regions"  # the catalog the gateways read (render adds it)
CATALOG_DIR = "/etc/edgeinfer/catalog"  # where the gateways mount it
# the Secret the render makes from the Redis URL the operator gives (never the catalog: in git,
# and copied into a ConfigMap), and where the deploy reads that URL
REDIS_SECRET, REDIS_SECRET_KEY = "edgeinfer-redis", "url"
REDIS_URL_ENV = "EDGEINFER_DEPLOY_REDIS_URL"
REDIS_SOURCES = f"--redis-url-file FILE or ${REDIS_URL_ENV}"


class DeployError(ValueError):
    """Bad input to a deploy; the message names the region and the field."""


def load_catalog(path: Path) -> dict[str, dict[str, Any]]:
    """The catalog's regions by name, with their settings. Checked as the gateway checks it (the
    region's gateways read this file: one they refuse, a duplicate name or a region without
    coordinates, would stop every one of them at start)."""
    return {name: region.settings for name, region in _load(path).regions.items()}


def _load(path: Path) -> RegionCatalog:
    try:
        return RegionCatalog.load(path)
    except CatalogError as e:
        raise DeployError(str(e)) from e


def gateway_catalog(catalog: RegionCatalog) -> str:
    """The catalog as the region's gateways read it (the ConfigMap edgeinfer-regions): every
    region's name, point of presence and models, which is all a gateway reads of it. Not the
    file itself: the other regions' deploy settings (a redis_url with its password, collector
    endpoints) have no business in this region's namespace."""
    entries = []
    for r in catalog.regions.values():
        entry: dict[str, Any] = {"name": r.name, "latitude": r.latitude, "longitude": r.longitude}
        if "models" in r.settings:
            entry["settings"] = {"models": r.settings["models"]}
        entries.append(entry)
    header = ("# The region catalog the gateways read (--regions), rendered by infra/deploy.py: "
              "each region's\n# name, point of presence and models.\n")  # fmt: skip
    return header + yaml.safe_dump({"regions": entries}, sort_keys=False)


def _int(region: str, settings: dict[str, Any], key: str, default: int | None, low: int) -> int:
    value = settings.get(key, default)
    if value is None:
        raise DeployError(f"region {region!r}: settings.{key} is required")
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < low:  # fmt: skip
        raise DeployError(f"region {region!r}: settings.{key} must be a whole number >= {low}, got {value!r}")  # fmt: skip
    return int(value)


def _str(region: str, settings: dict[str, Any], key: str, default: str | None = None) -> str:
    value = settings.get(key, default)
    if value is None or value == "":
        raise DeployError(f"region {region!r}: settings.{key} is required")
    if not isinstance(value, str):
        raise DeployError(f"region {region!r}: settings.{key} must be a string, got {value!r}")
    return value


def _quantity(region: str, settings: dict[str, Any], key: str, default: str, form: re.Pattern[str]) -> str:  # fmt: skip
    """A Kubernetes quantity setting (a string, or a plain number in the YAML)."""
    value = settings.get(key, default)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not form.match(value):
        raise DeployError(f"region {region!r}: settings.{key} is not a quantity: {value!r}")
    return value


def _bytes(quantity: str) -> float:
    """A memory quantity (matched by _QUANTITY) in bytes."""
    m = re.match(r"^([0-9.]+)([A-Za-z]*)$", quantity)
    assert m, quantity
    return float(m[1]) * _UNITS[m[2]]


def _url(region: str, settings: dict[str, Any], key: str) -> str | None:
    """An optional http(s):// URL setting (absent: None)."""
    value = settings.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not re.match(r"^https?://[^\s/?#]+(/[^\s?#]*)?$", value):
        raise DeployError(f"region {region!r}: settings.{key} must be an http:// or https:// URL, got {value!r}")  # fmt: skip
    return value.rstrip("/")


REDIS_SCHEMES = ("redis://", "rediss://", "redis+cluster://", "rediss+cluster://")


def _check_redis_url(region: str, field: str, value: Any) -> None:
    if not isinstance(value, str) or not value.startswith(REDIS_SCHEMES):
        raise DeployError(f"region {region!r}: {field} must be a redis://, rediss:// or (a Redis "
                          "Cluster) redis+cluster:// or rediss+cluster:// URL")  # fmt: skip


def _has_password(url: str) -> bool:
    """Whether a Redis URL holds a password (redis://:PW@host, redis://USER:PW@host, or
    ?password=PW, which redis-py logs in with too): what runtime.proctitle.redact hides."""
    return redact([url])[0] != url


def _endpoint(url: str) -> tuple[str, str, str, list[str]]:
    """Where a Redis URL points: the URL less its user, password and `password=`."""
    parts = urlsplit(url)
    query = [q for q in parts.query.split("&") if q and not q.startswith(("password=", "username="))]  # fmt: skip
    return parts.scheme, parts.netloc.rpartition("@")[2], parts.path, query


def password_message(region: str, url: str, field: str = "settings.redis_url") -> str:
    """What is wrong with a catalog's redis_url that holds a password (an error for the region
    rendered, a warning for the others)."""
    return (f"region {region!r}: {field} holds a password ({redact([url])[0]}): the "
            "catalog is kept in git, and a region's redis_url goes into its ConfigMap "
            f"edgeinfer-config; give the URL with its password as {REDIS_SOURCES} (the render "
            f"puts it in the Secret {REDIS_SECRET}; infra/README.md), and keep settings.redis_url "
            "without it")  # fmt: skip


def catalog_warnings(catalog: Path, region: str, redis_secret_url: str | None = None) -> list[str]:  # fmt: skip
    """The other regions' passwords in the catalog (`region`'s own is an error: region_layer),
    and a catalog whose regions do not share one cluster state (see `split_state`)."""
    loaded = _load(catalog)
    warnings = [password_message(r.name, r.settings["redis_url"])
                for r in loaded.regions.values()
                if r.name != region and isinstance(r.settings.get("redis_url"), str)
                and _has_password(r.settings["redis_url"])]  # fmt: skip
    return warnings + split_state(loaded, region, redis_secret_url)


def split_state(catalog: RegionCatalog, region: str, redis_secret_url: str | None) -> list[str]:
    """Why `region`'s gateways will not route to the catalog's other regions, if they will not.

    A gateway finds another region's workers only in the Redis it reads (gateway/routing.py,
    its third step): regions share work only when they share a Redis. A region whose entry (and
    the catalog) names no redis_url runs a Redis of its own in its namespace, and so does every
    such region: each one then serves alone, whatever the catalog's coordinates say."""
    others = [name for name in catalog.regions if name != region]
    if not others:
        return []
    own = catalog.regions[region].settings.get("redis_url")
    url = redis_secret_url or own or catalog.redis_url
    fix = ("for cross-region routing, set the catalog's top-level redis_url to a Redis every "
           "region's pods reach, and give workers an address the other regions' gateways reach "
           "(settings.worker_advertise_url, or a flat network: infra/regions.yaml)")  # fmt: skip
    if not isinstance(url, str):
        return [f"region {region!r} runs a Redis of its own (neither the catalog nor the region "
                f"names a redis_url, and no {REDIS_SOURCES} was given): its gateways send work "
                f"only to its own workers, never to {', '.join(others)}, nor theirs to it; {fix}"]  # fmt: skip
    if isinstance(catalog.redis_url, str):
        return []  # (every region's: a region naming another is refused when rendered)
    apart = [name for name in others
             if not isinstance(other := catalog.regions[name].settings.get("redis_url"), str)
             or _endpoint(other) != _endpoint(url)]  # fmt: skip
    if not apart:
        return []
    return [f"region {region!r}: the regions {', '.join(apart)} name no redis_url or another "
            "Redis than this region's: unless each is deployed with "
            f"{REDIS_SOURCES} naming this one, they keep a cluster state of their own, and this "
            f"region's gateways never route to them; {fix}"]  # fmt: skip


def sample_ratio(region: str, settings: dict[str, Any]) -> float:
    """settings.otel_sample_ratio: the fraction of traces kept, in [0, 1]."""
    value = settings.get("otel_sample_ratio", DEFAULT_SAMPLE_RATIO)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise DeployError(f"region {region!r}: settings.otel_sample_ratio must be a number in "
                          f"[0, 1] (the fraction of traces kept), got {value!r}")  # fmt: skip
    return float(value)


def advertise_url(region: str, settings: dict[str, Any]) -> str:
    """settings.worker_advertise_url: the URL each standing worker registers for the gateways,
    with the kubelet's $(VAR)s (ADVERTISE_VARS), one of them the pod's own."""
    value = settings.get("worker_advertise_url", DEFAULT_ADVERTISE_URL)
    field = f"region {region!r}: settings.worker_advertise_url"
    if not isinstance(value, str):
        raise DeployError(f"{field} must be a string, got {value!r}")
    names = re.findall(r"\$\(([^)]*)\)", value)
    unknown = [n for n in names if n not in ADVERTISE_VARS]
    if unknown or "$" in re.sub(r"\$\([^)]*\)", "", value):
        raise DeployError(f"{field} {value!r}: the variables a worker pod has are "
                          f"{', '.join(f'$({n})' for n in ADVERTISE_VARS)}")  # fmt: skip
    if "POD_NAME" not in names and "POD_IP" not in names:
        raise DeployError(f"{field} {value!r} names neither $(POD_NAME) nor $(POD_IP): every "
                          "worker pod would advertise the same address")  # fmt: skip
    sample = {"POD_NAME": "worker-0", "POD_IP": "10.0.0.5", "POD_NAMESPACE": f"edgeinfer-{region}",
              "EDGEINFER_REGION": region}  # fmt: skip
    expanded = re.sub(r"\$\(([^)]*)\)", lambda m: sample[m[1]], value)
    try:
        parts = urlsplit(expanded)
        parts.port  # noqa: B018 (raises ValueError for a port that is not one)
    except ValueError as e:
        raise DeployError(f"{field} {value!r}: {e}") from e
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise DeployError(f"{field} {value!r} is not an http:// or https:// URL with a host, "
                          f"e.g. {DEFAULT_ADVERTISE_URL}")  # fmt: skip
    return value


def region_layer(
    region: str,
    settings: dict[str, Any],
    redis_secret_url: str | None = None,
    shared_redis_url: str | None = None,
) -> dict[str, Any]:
    """The catalog's settings for `region` as a kustomization over the region's overlay;
    `redis_secret_url`: the Redis URL (with its password) the pods read from the Secret
    REDIS_SECRET, which `render` adds (see the module docstring); `shared_redis_url`: the
    catalog's redis_url, every region's."""
    for key in settings:
        if key not in SETTINGS:
            near = (
                difflib.get_close_matches(str(key), SETTINGS, n=1)
                or [s for s in SETTINGS if str(key) in s][:1]
            )  # (gpus: gpus_per_worker)
            hint = f"did you mean {near[0]}?" if near else f"known: {', '.join(SETTINGS)}"
            raise DeployError(f"region {region!r}: settings.{key} is not a setting ({hint})")
    image = _str(region, settings, "image")
    m = _IMAGE.match(image)
    if not m:
        raise DeployError(f"region {region!r}: settings.image is not an image reference: {image!r}")
    models = settings.get("models")
    if not isinstance(models, list) or not models:
        raise DeployError(f"region {region!r}: settings.models is required (a non-empty list)")
    for name in models:
        if not isinstance(name, str) or not re.match(r"^[\w.=/-]+$", name):
            raise DeployError(f"region {region!r}: settings.models has a bad entry {name!r}")
    try:  # (as the pool manager reads them: one model twice, `=FOLDER` or `NAME=`, refused)
        parse_models(",".join(models), resolve=str)
    except ValueError as e:
        raise DeployError(f"region {region!r}: settings.models: {e}") from e
    ratio = sample_ratio(region, settings)
    advertise_url(region, settings)  # (checked here; `render` puts it in the workers' args)
    workers = _int(region, settings, "workers", None, 0)
    gpus = _int(region, settings, "gpus_per_worker", 0, 0)
    drain = _int(region, settings, "drain_timeout", 30, 1)
    gateways = _int(region, settings, "gateway_replicas", 2, 1)
    pool_max = _int(region, settings, "pool_max_workers", 1, 0)
    if not pool_max and not workers:
        raise DeployError(f"region {region!r}: settings.pool_max_workers is 0 (no pool manager) "
                          "and settings.workers is 0: nothing would serve the region")  # fmt: skip
    if not pool_max and len(models) > 1:
        raise DeployError(f"region {region!r}: settings.pool_max_workers is 0 (no pool manager), "
                          "so only the standing workers serve, the first of settings.models: "
                          "list one model")  # fmt: skip
    if gpus > 1:
        raise DeployError(f"region {region!r}: settings.gpus_per_worker is {gpus}, but a worker "
                          "runs on one GPU (tensor parallelism, --tp, runs on the CPU only so "
                          f"far: a worker given {gpus} GPUs would leave them idle); set 0 or 1")  # fmt: skip
    if gpus and pool_max > 1:
        raise DeployError(f"region {region!r}: settings.pool_max_workers is {pool_max} with "
                          "settings.gpus_per_worker: the pool manager gives its workers no GPU "
                          "each (all would run on its pod's first GPU, the others idle); set "
                          "pool_max_workers to 0 or 1")  # fmt: skip
    store_class = _str(region, settings, "store_class", "local-nvme")
    store_size = _str(region, settings, "store_size", "200Gi")
    if not _QUANTITY.match(store_size):
        raise DeployError(f"region {region!r}: settings.store_size is not a quantity: {store_size!r}")  # fmt: skip
    cpu = _quantity(region, settings, "worker_cpu", "4", _CPU)
    memory = _quantity(region, settings, "worker_memory", "16Gi", _QUANTITY)
    memory_limit = _quantity(region, settings, "worker_memory_limit", "32Gi", _QUANTITY)
    if _bytes(memory) > _bytes(memory_limit):
        raise DeployError(f"region {region!r}: settings.worker_memory_limit ({memory_limit}) is "
                          f"below settings.worker_memory ({memory})")  # fmt: skip
    service_type = _str(region, settings, "gateway_service", "LoadBalancer")
    if service_type not in SERVICE_TYPES:
        raise DeployError(f"region {region!r}: settings.gateway_service must be one of "
                          f"{', '.join(SERVICE_TYPES)}, got {service_type!r}")  # fmt: skip
    otlp_endpoint = _url(region, settings, "otlp_endpoint")
    traces_endpoint = _url(region, settings, "traces_endpoint")
    if otlp_endpoint and traces_endpoint:
        raise DeployError(f"region {region!r}: settings.traces_endpoint is for the in-region "
                          "collector, which settings.otlp_endpoint replaces; set one of them")  # fmt: skip
    redis_url = settings.get("redis_url")
    redis_field = "settings.redis_url"
    if redis_url is not None:
        _check_redis_url(region, "settings.redis_url", redis_url)
        if _has_password(redis_url):
            raise DeployError(password_message(region, redis_url))
    if shared_redis_url is not None:
        _check_redis_url(region, "the catalog's redis_url", shared_redis_url)
        if _has_password(shared_redis_url):
            raise DeployError(password_message(region, shared_redis_url, "the catalog's redis_url"))  # fmt: skip
        if redis_url is not None and _endpoint(redis_url) != _endpoint(shared_redis_url):
            raise DeployError(f"region {region!r}: settings.redis_url ({redis_url}) names "
                              f"another Redis than the catalog's redis_url ({shared_redis_url}), "
                              "which all its regions share: drop the region's (a region apart, "
                              "with a Redis of its own, goes in a catalog of its own)")  # fmt: skip
        if redis_url is None:
            redis_url, redis_field = shared_redis_url, "the catalog's redis_url"
    if redis_secret_url is not None:
        _check_redis_url(region, f"the Redis URL from {REDIS_SOURCES}", redis_secret_url)
        if redis_url and _endpoint(redis_url) != _endpoint(redis_secret_url):
            raise DeployError(f"region {region!r}: the Redis URL from {REDIS_SOURCES} "
                              f"({redact([redis_secret_url])[0]}) names another Redis than "
                              f"{redis_field} ({redis_url}): give the same one, or drop "
                              f"{redis_field}")  # fmt: skip
        redis_url = None  # (the Secret's URL is the one the pods read)
    external_redis = bool(redis_url or redis_secret_url)

    image_edit: dict[str, Any] = {"name": "edgeinfer", "newName": m["repo"]}
    if m["digest"]:
        image_edit["digest"] = m["digest"]
    else:
        image_edit["newTag"] = m["tag"] or "latest"
    # the standing workers' model as the pool reads it: NAME=FOLDER is FOLDER served as NAME
    ((served_name, model),) = parse_models(models[0], resolve=str).items()
    config: dict[str, str | None] = {
        "EDGEINFER_MODEL": model,
        "EDGEINFER_SERVED_MODEL_NAME": served_name,
        "EDGEINFER_MODELS": ",".join(models),
        "EDGEINFER_DRAIN_TIMEOUT": str(drain),
        "EDGEINFER_POOL_MAX_WORKERS": str(pool_max),
        "EDGEINFER_OTEL_SAMPLE_RATIO": str(ratio),
    }
    if redis_url:
        config["EDGEINFER_REDIS"] = redis_url
    elif redis_secret_url is not None:  # (null: the base's key removed, as kustomize does)
        config["EDGEINFER_REDIS"] = None
    if otlp_endpoint:
        config["OTEL_EXPORTER_OTLP_ENDPOINT"] = otlp_endpoint
    patches: list[dict[str, Any]] = [_inline({"apiVersion": "v1", "kind": "ConfigMap",
                                              "metadata": {"name": "edgeinfer-config"}, "data": config})]  # fmt: skip
    claim = {"storageClassName": store_class, "resources": {"requests": {"storage": store_size}}}
    pod_resources = {"requests": {"cpu": cpu, "memory": memory},
                     "limits": {"memory": memory_limit, **({"nvidia.com/gpu": gpus} if gpus else {})}}  # fmt: skip
    pods = [("StatefulSet", "worker")] + ([("Deployment", "pool")] if pool_max else [])
    # the gateways drain as long as the workers (--drain-timeout): their grace follows it too
    patches.append(_inline({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "gateway"},
                            "spec": {"template": {"spec": {"terminationGracePeriodSeconds": drain + GRACE_MARGIN_S}}}}))  # fmt: skip
    for kind, name in pods:
        pod: dict[str, Any] = {"terminationGracePeriodSeconds": drain + GRACE_MARGIN_S,
                               "containers": [{"name": name, "resources": pod_resources}]}  # fmt: skip
        spec: dict[str, Any] = {"template": {"spec": pod}}
        if kind == "StatefulSet":
            # volumeClaimTemplates has no merge key: the whole list is replaced, as in kustomize
            spec["volumeClaimTemplates"] = [{"metadata": {"name": "model-store"},
                                             "spec": {"accessModes": ["ReadWriteOnce"], **claim}}]  # fmt: skip
        else:
            pod["volumes"] = [{"name": "model-store", "ephemeral": {"volumeClaimTemplate": {
                "spec": {"accessModes": ["ReadWriteOnce"], **claim}}}}]  # fmt: skip
        patches.append(_inline({"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": name}, "spec": spec}))  # fmt: skip
    if service_type != "LoadBalancer":
        patches.append(_inline({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "gateway"},
                                "spec": {"type": service_type}}))  # fmt: skip
    if not pool_max:
        patches.append(_delete("apps/v1", "Deployment", "pool"))
    if redis_secret_url is not None:
        # the pods read EDGEINFER_REDIS from the Secret (the config map holds none then)
        from_secret = {"name": "EDGEINFER_REDIS", "valueFrom": {"secretKeyRef": {
            "name": REDIS_SECRET, "key": REDIS_SECRET_KEY}}}  # fmt: skip
        for kind, name in [("Deployment", "gateway"), *pods]:
            patches.append(_inline({"apiVersion": "apps/v1", "kind": kind, "metadata": {"name": name},
                                    "spec": {"template": {"spec": {"containers": [
                                        {"name": name, "env": [from_secret]}]}}}}))  # fmt: skip
    if external_redis:
        patches += [_delete("apps/v1", "Deployment", "redis"), _delete("v1", "Service", "redis")]
    if otlp_endpoint:
        patches += [_delete("apps/v1", "Deployment", "otel-collector"),
                    _delete("v1", "Service", "otel-collector"),
                    _delete("v1", "ConfigMap", "otel-collector-config")]  # fmt: skip
    elif traces_endpoint:
        container = {"name": "otel-collector",
                     "env": [{"name": "TRACES_OTLP_ENDPOINT", "value": traces_endpoint}]}  # fmt: skip
        patches.append(_inline({"apiVersion": "apps/v1", "kind": "Deployment",
                                "metadata": {"name": "otel-collector"},
                                "spec": {"template": {"spec": {"containers": [container]}}}}))  # fmt: skip
    return {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [f"overlays/{region}"],
        "images": [image_edit],
        "replicas": [{"name": "worker", "count": workers}, {"name": "gateway", "count": gateways}],
        "patches": patches,
        # what `apply` selects on to prune: on every resource, the namespace and the collector's
        # generated config map included, whatever the overlay labels
        "labels": [{"pairs": {PART_OF: "edgeinfer", REGION_LABEL: region}}],
    }


def _inline(doc: dict[str, Any]) -> dict[str, str]:
    return {"patch": yaml.safe_dump(doc, sort_keys=False)}


def _delete(api: str, kind: str, name: str) -> dict[str, str]:
    """A patch that removes a resource of the base (kustomize's `$patch: delete`)."""
    return _inline(
        {"apiVersion": api, "kind": kind, "metadata": {"name": name}, "$patch": "delete"}
    )


def render(
    region: str,
    catalog: Path = DEFAULT_CATALOG,
    overlays: Path = OVERLAYS,
    redis_secret_url: str | None = None,
) -> list[Resource]:
    """The region's manifests; raises DeployError naming the region and the field.
    `redis_secret_url`: the Redis URL, password and all, that the pods read from the Secret
    REDIS_SECRET (rendered with them), in place of the catalog's redis_url."""
    loaded = _load(catalog)
    regions = {name: r.settings for name, r in loaded.regions.items()}
    if region not in regions:
        raise DeployError(f"region {region!r}: not in the catalog {catalog} (known: {', '.join(regions)})")  # fmt: skip
    if not (overlays / region / "kustomization.yaml").is_file():
        raise DeployError(
            f"region {region!r}: no overlay at {overlays / region}/kustomization.yaml"
        )
    layer = region_layer(region, regions[region], redis_secret_url, loaded.redis_url)
    try:
        resources = build(layer, overlays.parent)
    except RenderError as e:
        raise DeployError(f"region {region!r}: the overlay does not render: {e}") from e
    _check_overlay(resources, region, overlays / region)
    _advertise(resources, advertise_url(region, regions[region]))
    _mount_catalog(resources, gateway_catalog(loaded))
    if redis_secret_url is not None:
        config = next(r for r in resources if r["kind"] == "ConfigMap"
                      and r["metadata"]["name"] == "edgeinfer-config")  # fmt: skip
        meta = {k: copy.deepcopy(v) for k, v in config["metadata"].items() if k in ("namespace", "labels")}  # fmt: skip
        _insert_config(resources, {
            "apiVersion": "v1", "kind": "Secret", "metadata": {"name": REDIS_SECRET, **meta},
            "type": "Opaque",
            "data": {REDIS_SECRET_KEY: base64.b64encode(redis_secret_url.encode()).decode()},
        })  # fmt: skip
    _digest_config(resources)
    return resources


def _check_overlay(resources: list[Resource], region: str, overlay: Path) -> None:
    """Refuse an overlay that renders another region: a copy of overlays/us-east left unedited
    as overlays/us-south rendered the namespace edgeinfer-us-east and EDGEINFER_REGION us-east,
    and `--apply` replaced us-east's gateways and workers with us-south's settings. The error
    names every wrong value and the overlay's file that sets it."""
    namespace = f"edgeinfer-{region}"
    wrong: dict[str, str] = {}  # what is wrong -> the file to fix (in order, once each)

    def check(what: str, got: Any, want: str, where: str) -> None:
        if got != want:
            wrong.setdefault(f"{what} {got!r}, not {want!r}", where)

    for r in resources:
        meta = r.get("metadata") or {}
        if r["kind"] == "Namespace":
            check("the Namespace", meta.get("name"), namespace, "namespace.yaml")
        else:
            check("the resources' namespace", meta.get("namespace"), namespace,
                  "kustomization.yaml (namespace:)")  # fmt: skip
        if r["kind"] == "ConfigMap" and meta.get("name") == "edgeinfer-config":
            check("EDGEINFER_REGION", (r.get("data") or {}).get("EDGEINFER_REGION"), region,
                  "config.yaml")  # fmt: skip
        template = (r.get("spec") or {}).get("template")
        if isinstance(template, dict):
            labels = (template.get("metadata") or {}).get("labels") or {}
            check(f"the pods' label {REGION_LABEL}", labels.get(REGION_LABEL), region,
                  "kustomization.yaml (labels:)")  # fmt: skip
    if wrong:
        problems = "; ".join(f"{what} (fix {overlay / where})" for what, where in wrong.items())
        raise DeployError(f"region {region!r}: the overlay {overlay} renders another region "
                          f"(a copy of another region's overlay?): {problems}")  # fmt: skip


def _advertise(resources: list[Resource], url: str) -> None:
    """The standing workers' --advertise-url: settings.worker_advertise_url. (Set in the args,
    where the kubelet expands $(POD_NAME) and $(POD_IP); a config map's value is not expanded.)"""
    for r in resources:
        if r["kind"] != "StatefulSet" or r["metadata"]["name"] != "worker":
            continue
        (c,) = [c for c in r["spec"]["template"]["spec"]["containers"] if c["name"] == "worker"]
        args = c["args"]
        at = args.index("--advertise-url")
        c["args"] = [*args[: at + 1], url, *args[at + 2 :]]


def _mount_catalog(resources: list[Resource], catalog: str) -> None:
    """The gateways read the catalog this render read (`--catalog FILE`, or infra/regions.yaml
    as it is now), as the ConfigMap REGIONS_MAP mounted at CATALOG_DIR, not their image's copy,
    which lacks a region or model added since the image was built (every gateway of such a region
    stopped at start: "region ... is not in the catalog"). Added here, after the build, not in
    the base: a kustomization reading infra/regions.yaml would have to hold infra/, which holds
    the base (`kubectl kustomize`: "cycle detected"), and `kubectl apply -k` of an overlay alone
    keeps the image's catalog, as before. The standing workers and the pool manager get it too:
    with it they refuse a `--region` it lacks (a typo registered a region the gateways put last)."""
    readers = {("Deployment", "gateway"), ("StatefulSet", "worker"), ("Deployment", "pool")}
    pods = [r for r in resources if (r["kind"], r["metadata"]["name"]) in readers]
    gateways = [r for r in pods if r["metadata"]["name"] == "gateway"]
    for g in pods:
        pod = g["spec"]["template"]["spec"]
        (c,) = [c for c in pod["containers"] if c["name"] == g["metadata"]["name"]]
        c["args"] = [*c.get("args", []), "--regions", f"{CATALOG_DIR}/regions.yaml"]
        c["volumeMounts"] = [*c.get("volumeMounts", []),
                             {"name": "regions", "mountPath": CATALOG_DIR, "readOnly": True}]  # fmt: skip
        pod["volumes"] = [*pod.get("volumes", []),
                          {"name": "regions", "configMap": {"name": REGIONS_MAP}}]  # fmt: skip
    if gateways:
        meta: dict[str, Any] = {"name": REGIONS_MAP, "labels": dict(gateways[0]["metadata"].get("labels", {}))}  # fmt: skip
        meta["labels"].pop("app.kubernetes.io/name", None)
        if "namespace" in gateways[0]["metadata"]:
            meta["namespace"] = gateways[0]["metadata"]["namespace"]
        _insert_config(resources, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
                                   "data": {"regions.yaml": catalog}})  # fmt: skip


def _insert_config(resources: list[Resource], doc: Resource) -> None:
    """`doc` (a ConfigMap or Secret) with the other config: before the workloads that read it,
    in apply order."""
    at = next((i for i, r in enumerate(resources)
               if r["kind"] in ("Service", "Deployment", "StatefulSet")), len(resources))  # fmt: skip
    resources.insert(at, doc)


def _digest_config(resources: list[Resource]) -> None:
    """Annotate each pod template with a digest of the ConfigMaps its pods read, and of the
    Secrets they read that the render holds (REDIS_SECRET).

    A container reads its environment (envFrom: edgeinfer-config) once, at start, and
    Kubernetes rolls a Deployment or StatefulSet only when its pod template changes: a setting
    that changes the config alone (models, redis_url, otlp_endpoint) was applied to the ConfigMap
    and to nothing that runs. With a redis_url, `--apply` pruned the region's Redis while every
    gateway and worker went on calling it; a new Redis password in the Secret reached no pod,
    which went on logging in with the old one. The digest changes with the config, so the
    template does, and the pods are replaced (kustomize's generated names, a hash suffix of the
    contents, do the same for ConfigMaps and Secrets; this renderer does not make them). The
    operator's own edgeinfer-secret is not rendered, so not in the digest: a change of it needs
    `kubectl rollout restart` (README)."""
    maps = {r["metadata"]["name"]: r.get("data") or {} for r in resources if r["kind"] == "ConfigMap"}  # fmt: skip
    # (keyed Secret/NAME: no config map's name holds a '/'; a pod that reads no rendered Secret
    # has the digest of its config maps alone, as before Secrets were rendered)
    secrets = {f"Secret/{r['metadata']['name']}": r.get("data") or {} for r in resources
               if r["kind"] == "Secret"}  # fmt: skip
    for r in resources:
        template = (r.get("spec") or {}).get("template")
        if not isinstance(template, dict):
            continue
        pod = template.get("spec") or {}
        volumes = pod.get("volumes") or []
        read = {v["configMap"]["name"] for v in volumes if "configMap" in v}
        read |= {f"Secret/{v['secret']['secretName']}" for v in volumes if "secret" in v}
        for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
            for e in c.get("envFrom") or []:
                read |= {e["configMapRef"]["name"]} if "configMapRef" in e else set()
                read |= {f"Secret/{e['secretRef']['name']}"} if "secretRef" in e else set()
            for e in c.get("env") or []:
                ref = e.get("valueFrom") or {}
                read |= {ref["configMapKeyRef"]["name"]} if "configMapKeyRef" in ref else set()
                read |= {f"Secret/{ref['secretKeyRef']['name']}"} if "secretKeyRef" in ref else set()  # fmt: skip
        read = {name for name in read if not name.startswith("Secret/") or name in secrets}
        if not read:
            continue
        data = json.dumps({name: {**maps, **secrets}.get(name) for name in sorted(read)}, sort_keys=True)  # fmt: skip
        annotations = template.setdefault("metadata", {}).setdefault("annotations", {})
        annotations[CONFIG_DIGEST] = hashlib.sha256(data.encode()).hexdigest()


def to_yaml(resources: list[Resource]) -> str:
    return yaml.safe_dump_all(resources, sort_keys=False)


def apply_command(kubectl: str, region: str) -> list[str]:
    """`kubectl apply` of the rendered manifests on stdin, pruning what an earlier apply of the
    region made and this render no longer holds (see the module docstring)."""
    selector = f"{PART_OF}=edgeinfer,{REGION_LABEL}={region}"
    allow = [f"--prune-allowlist={kind}" for kind in PRUNE_KINDS]
    return [kubectl, "apply", "-f", "-", "--prune", "-l", selector, *allow]


def apply(text: str, region: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        raise DeployError(f"region {region!r}: --apply needs kubectl on PATH; nothing was applied")
    done = subprocess.run(apply_command(kubectl, region), input=text, text=True, check=False)
    if done.returncode != 0:
        raise DeployError(f"region {region!r}: kubectl apply failed (exit {done.returncode})")


def write(resources: list[Resource], out: Path) -> list[Path]:
    """One file per resource in `out`, numbered in order, in place of an earlier render's (see
    the module docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    names = [f"{i:02d}-{r['kind'].lower()}-{r['metadata']['name']}.yaml"
             for i, r in enumerate(resources)]  # fmt: skip
    ours: list[Path] = []
    for old in sorted(out.iterdir()):  # (all checked before any is removed or written)
        if not _WRITTEN.match(old.name):
            continue
        marked = False
        if old.is_file() and not old.is_symlink():
            with old.open("rb") as f:
                marked = f.readline().rstrip(b"\n") == _MARK.encode()
        if marked:
            ours.append(old)
        elif old.name in names or old.is_symlink():  # (written over, a file kept its mode: a
            # Secret could be 0644; a link would be followed)
            raise DeployError(f"--out {out}: {old.name} is not deploy.py's (no marker line, or "
                              "not a plain file) and this render would write over it: remove or "
                              "move it")  # fmt: skip
        else:  # named like ours, but not marked: someone's own file (or an unmarked render)
            print(f"deploy: left {old} alone (not written by deploy.py); remove it if it is "
                  "an earlier render", file=sys.stderr)  # fmt: skip
    for old in ours:
        old.unlink()
    paths = []
    for name, r in zip(names, resources, strict=True):
        path = out / name
        text = f"{_MARK}\n" + yaml.safe_dump(r, sort_keys=False)
        # a Secret readable by its owner alone, from the first byte (a new file: removed above)
        mode = 0o600 if r["kind"] == "Secret" else 0o666
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        paths.append(path)
    return paths


def redis_secret_url(region: str, path: Path | None, env: str | None) -> str | None:
    """The Redis URL for the Secret REDIS_SECRET: from `path` (--redis-url-file) or `env`
    ($EDGEINFER_DEPLOY_REDIS_URL), one line; None when neither is given."""
    if path is not None and env:
        raise DeployError(f"region {region!r}: --redis-url-file and ${REDIS_URL_ENV} both give "
                          "the Redis URL; give one of them")  # fmt: skip
    if path is None:
        if not env:
            return None
        where, text = f"${REDIS_URL_ENV}", env
    else:
        where = f"--redis-url-file {path}"
        try:
            text = path.read_text()
        except OSError as e:
            raise DeployError(f"region {region!r}: cannot read {where}: {e.strerror}") from e
        except UnicodeDecodeError as e:
            raise DeployError(f"region {region!r}: cannot read {where}: not UTF-8") from e
    lines = text.strip().splitlines()
    if len(lines) != 1:
        raise DeployError(f"region {region!r}: {where} must hold one line, the Redis URL; it "
                          f"holds {len(lines)}")  # fmt: skip
    url = lines[0].strip()
    # (said: the variable is no region's own, and one left exported from another region's
    # deploy would point this region at that Redis, pruning its own)
    print(f"deploy: region {region!r}: the Redis URL {redact([url])[0]} from {where}",
          file=sys.stderr)  # fmt: skip
    return url


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="infra/deploy.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("region", help="a region name from the catalog")
    p.add_argument("--apply", action="store_true", help="kubectl apply the manifests")
    p.add_argument("--out", type=Path, default=None, help="write one file per resource here")
    p.add_argument("--catalog", type=Path, default=DEFAULT_CATALOG, help="region catalog YAML")
    p.add_argument("--redis-url-file", type=Path, default=None,
                   help="a file holding the region's Redis URL with its password (default "
                   f"${REDIS_URL_ENV}): rendered as the Secret {REDIS_SECRET}")  # fmt: skip
    args = p.parse_args(argv)
    try:
        secret_url = redis_secret_url(args.region, args.redis_url_file, os.environ.get(REDIS_URL_ENV))  # fmt: skip
        resources = render(args.region, args.catalog, redis_secret_url=secret_url)
        # (said once the deploy is done, last: after kubectl's own lines, where it is seen)
        warnings = catalog_warnings(args.catalog, args.region, secret_url)
        text = to_yaml(resources)
        if args.apply:
            apply(text, args.region)
        elif args.out is not None:
            try:
                paths = write(resources, args.out)
            except OSError as e:
                raise DeployError(f"region {args.region!r}: cannot write the manifests to "
                                  f"{args.out}: {e.strerror or e}") from e  # fmt: skip
            for path in paths:
                print(path)
        else:
            sys.stdout.write(text)
        for warning in warnings:
            print(f"deploy: warning: {warning}", file=sys.stderr)
    except DeployError as e:
        print(f"deploy: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
