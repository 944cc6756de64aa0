"""infra/otel, infra/prometheus, infra/grafana: the collector config wires only components it
defines, the Prometheus jobs find exactly the pods the rendered manifests annotate (relabeling
simulated offline, as Prometheus' pod discovery would present them), and every query on the
dashboard names metrics and labels that the code exports (kvstore/telemetry.py's catalog)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra import deploy
from kvstore import telemetry as names
from kvstore.telemetry import METRICS

INFRA = deploy.INFRA
COLLECTOR = INFRA / "otel" / "collector.yaml"
PROMETHEUS = INFRA / "prometheus" / "prometheus.yml"
DASHBOARD = INFRA / "grafana" / "edgeinfer.json"
REGIONS = sorted(deploy.load_catalog(deploy.DEFAULT_CATALOG))

# --------------------------------------------------------------------------- the collector

# component types of otelcol-contrib that the config may use (a typo is then an error here)
KNOWN = {
    "receivers": {"otlp"},
    "processors": {"memory_limiter", "batch", "filter", "transform"},
    "exporters": {"otlp_grpc", "otlp_http", "prometheus", "prometheusremotewrite", "debug"},
    "extensions": {"health_check"},
}


def _collector() -> dict[str, Any]:
    config = yaml.safe_load(COLLECTOR.read_text())
    assert isinstance(config, dict)
    return config


def test_collector_pipelines_use_defined_components() -> None:
    config = _collector()
    pipelines = config["service"]["pipelines"]
    assert set(pipelines) == {"traces", "metrics"}
    used: dict[str, set[str]] = {"receivers": set(), "processors": set(), "exporters": set()}
    for name, pipeline in pipelines.items():
        assert pipeline["receivers"] and pipeline["exporters"], name
        for section in used:
            for component in pipeline.get(section, []):
                assert component in (config.get(section) or {}), f"{name}: {section} {component}"
                used[section].add(component)
        # refuse data before the container's limit, batch just before export
        assert pipeline["processors"][0] == "memory_limiter", name
        assert pipeline["processors"][-1] == "batch", name
    for section, defined in used.items():
        assert set(config[section]) == defined, f"{section} defined but in no pipeline"
    assert set(config["service"]["extensions"]) == set(config["extensions"])
    for section, types in KNOWN.items():
        for component in config[section]:
            assert component.split("/")[0] in types, f"{section}: unknown type {component}"


def test_collector_endpoints() -> None:
    config = _collector()
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert protocols["http"]["endpoint"] == "0.0.0.0:4318"
    (traces,) = config["service"]["pipelines"]["traces"]["exporters"]
    assert traces.startswith("otlp_")
    # the tracing backend is a variable, with a default
    assert re.fullmatch(r"\$\{env:TRACES_OTLP_ENDPOINT:-https?://\S+\}",
                        config["exporters"][traces]["endpoint"])  # fmt: skip
    # the gRPC exporter dials TLS unless `insecure` (an http:// endpoint, Tempo's plaintext
    # port, got a TLS handshake and no trace arrived); https:// still gets TLS
    assert config["exporters"][traces].get("tls", {}).get("insecure") is True
    assert config["service"]["pipelines"]["metrics"]["exporters"] == ["prometheus"]
    prometheus = config["exporters"]["prometheus"]
    assert prometheus["endpoint"] == "0.0.0.0:8889"
    # job and instance come from service.name / service.instance.id; no resource attribute is
    # copied onto every series (the dashboard's labels are the processes' own)
    assert prometheus["resource_to_telemetry_conversion"] == {"enabled": False}


def test_collector_keeps_the_exported_names() -> None:
    """The exporter appends `_ratio` to gauges of unit "1": every such gauge is reset to no
    unit, so it keeps the name the processes' own /metrics gives it."""
    ratio_gauges = {m.name for m in METRICS if m.kind == "gauge" and m.unit == "1"}
    assert ratio_gauges == {names.KV_USAGE}
    (block,) = _collector()["processors"]["transform/units"]["metric_statements"]
    assert block["context"] == "metric"
    cleared = {m for s in block["statements"]
               for m in re.findall(r'^set\(unit, ""\) where name == "([\w.]+)"$', s)}  # fmt: skip
    assert cleared == ratio_gauges


def _resource_attributes(container: dict[str, Any]) -> dict[str, str]:
    (value,) = [e["value"] for e in container["env"] if e["name"] == "OTEL_RESOURCE_ATTRIBUTES"]
    return dict(pair.split("=", 1) for pair in value.split(","))


@pytest.mark.parametrize("region", REGIONS)
def test_collector_drops_only_what_prometheus_scrapes(region: str) -> None:
    """Metrics of pods that Prometheus scrapes directly are dropped at the collector (else
    counted twice); those of the pool's workers, which it cannot scrape, pass."""
    conditions = _collector()["processors"]["filter/scraped"]["metrics"]["metric"]
    dropped = set()
    for c in conditions:
        m = re.fullmatch(r'resource\.attributes\["([\w.]+)"\] == "([\w.-]+)"', c)
        assert m, c
        dropped.add((m[1], m[2]))
    resources = deploy.render(region)
    for r in resources:
        if r["kind"] not in ("Deployment", "StatefulSet"):
            continue
        template = r["spec"]["template"]
        for c in template["spec"]["containers"]:
            if c.get("command") != ["edgeinfer"]:
                continue
            attrs = set(_resource_attributes(c).items())
            scraped = (template["metadata"].get("annotations") or {}).get("prometheus.io/scrape")
            assert bool(attrs & dropped) == (scraped == "true"), (r["metadata"]["name"], attrs)


# --------------------------------------------------------------------------- Prometheus

JOBS = {"edgeinfer-gateway", "edgeinfer-worker", "edgeinfer-otlp", "otel-collector"}


def _prometheus() -> dict[str, Any]:
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert isinstance(config, dict)
    return config


def _sanitize(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


def _discovered(resources: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The targets Kubernetes pod discovery offers: one per container port of one pod per
    workload (a pod without ports: one, at its IP), with the meta labels Prometheus sets."""
    targets = []
    for i, r in enumerate(x for x in resources if x["kind"] in ("Deployment", "StatefulSet")):
        template = r["spec"]["template"]
        pod = {
            "__meta_kubernetes_namespace": r["metadata"]["namespace"],
            "__meta_kubernetes_pod_name": f"{r['metadata']['name']}-0",
            "__meta_kubernetes_pod_phase": "Running",
            "__metrics_path__": "/metrics",
        }
        for k, v in template["metadata"].get("labels", {}).items():
            pod[f"__meta_kubernetes_pod_label_{_sanitize(k)}"] = v
        for k, v in (template["metadata"].get("annotations") or {}).items():
            pod[f"__meta_kubernetes_pod_annotation_{_sanitize(k)}"] = v
        ip = f"10.0.0.{i + 1}"
        ports = [p for c in template["spec"]["containers"] for p in c.get("ports", [])]
        for p in ports or [None]:
            t = dict(pod, __address__=ip if p is None else f"{ip}:{p['containerPort']}")
            if p is not None:
                t["__meta_kubernetes_pod_container_port_name"] = p.get("name", "")
                t["__meta_kubernetes_pod_container_port_number"] = str(p["containerPort"])
            targets.append(t)
    return targets


def _relabel(target: dict[str, str], rules: list[dict[str, Any]]) -> dict[str, str] | None:
    """Prometheus' relabeling (replace, keep, drop), regexes anchored at both ends."""
    labels = dict(target)
    for rule in rules:
        action = rule.get("action", "replace")
        value = rule.get("separator", ";").join(labels.get(s, "") for s in rule.get("source_labels", []))  # fmt: skip
        m = re.fullmatch(rule.get("regex", "(.*)"), value)
        if action == "keep" and not m:
            return None
        if action == "drop" and m:
            return None
        if action == "replace" and m:
            out = m.expand(re.sub(r"\$(\d+)", r"\\g<\1>", rule.get("replacement", "$1")))
            if out:
                labels[rule["target_label"]] = out
            else:
                labels.pop(rule["target_label"], None)
        assert action in ("replace", "keep", "drop"), action
    return labels


def test_prometheus_jobs() -> None:
    config = _prometheus()
    jobs = [j["job_name"] for j in config["scrape_configs"]]
    assert sorted(jobs) == sorted(JOBS)
    for job in config["scrape_configs"]:
        assert job["kubernetes_sd_configs"] == [{"role": "pod"}]
        # the collector's exporter keeps the job its series came with (service.name)
        assert job.get("honor_labels", False) == (job["job_name"] == "edgeinfer-otlp")


@pytest.mark.parametrize("region", REGIONS)
def test_prometheus_finds_the_annotated_pods(region: str) -> None:
    resources = deploy.render(region)
    discovered = _discovered(resources)
    found: dict[str, set[tuple[str, str, str]]] = {}
    for job in _prometheus()["scrape_configs"]:
        for t in discovered:
            labels = _relabel(t, job["relabel_configs"])
            if labels is not None:
                assert labels["region"] == region and labels["namespace"] == f"edgeinfer-{region}"
                pod = labels["__meta_kubernetes_pod_name"]
                found.setdefault(job["job_name"], set()).add((pod, labels["__address__"].split(":")[-1], labels["__metrics_path__"]))  # fmt: skip
    assert found == {
        # the gateway's own metrics listener (--metrics-port), not its public HTTP port
        "edgeinfer-gateway": {("gateway-0", "9464", "/metrics")},
        "edgeinfer-worker": {("worker-0", "9001", "/metrics")},
        "edgeinfer-otlp": {("otel-collector-0", "8889", "/metrics")},
        "otel-collector": {("otel-collector-0", "8888", "/metrics")},
    }
    # the annotated ports are the ones the processes serve /metrics on
    for kind, name, flag, port in (("Deployment", "gateway", "--metrics-port", "9464"),
                                   ("StatefulSet", "worker", "--port", "9001")):  # fmt: skip
        (r,) = [x for x in resources if x["kind"] == kind and x["metadata"]["name"] == name]
        (c,) = r["spec"]["template"]["spec"]["containers"]
        assert c["args"][c["args"].index(flag) + 1] == port
        assert int(port) in [p["containerPort"] for p in c["ports"]]
    # and the gateway's public Service does not reach it (a 404 on the HTTP port: no metrics
    # for whoever reaches the LoadBalancer)
    by = {(x["kind"], x["metadata"]["name"]): x for x in resources}
    service, gateway = by["Service", "gateway"], by["Deployment", "gateway"]
    (c,) = gateway["spec"]["template"]["spec"]["containers"]
    assert c["args"][c["args"].index("--port") + 1] == "8080"
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert [named.get(p["targetPort"], p["targetPort"]) for p in service["spec"]["ports"]] == [8080]


# --------------------------------------------------------------------------- the dashboard

FUNCTIONS = {
    "abs", "absent", "absent_over_time", "avg_over_time", "ceil", "changes", "clamp", "clamp_max",
    "clamp_min", "count_over_time", "delta", "deriv", "exp", "floor", "histogram_quantile",
    "idelta", "increase", "irate", "label_replace", "last_over_time", "max_over_time",
    "min_over_time", "predict_linear", "quantile_over_time", "rate", "resets", "round", "scalar",
    "sort", "sort_desc", "sqrt", "sum_over_time", "time", "timestamp", "vector",
    # aggregations
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk",
    "topk", "quantile",
}  # fmt: skip
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless",
            "bool", "offset", "atan2", "inf", "nan"}  # fmt: skip
GENAI = {names.TTFT, names.TPOT, names.REQUEST_DURATION, names.TOKEN_USAGE}
# attributes each metric is recorded with (kvstore/telemetry.py and its callers), as labels
LABELS: dict[str, set[str]] = {
    names.TOKEN_USAGE: {"gen_ai_token_type"},
    names.KV_TRANSFER_BYTES: {"direction"},
    names.KV_TRANSFER_DURATION: {"direction", "error_type"},
    names.COLD_START: {"phase"},
    names.ROUTING: {"kind"},
    names.ERRORS: {"error_type"},
    names.REDIS_DURATION: {"operation", "error_type"},
    names.GATEWAY_WORKERS: {"worker_region", "model", "role"},
}


def _scrape_labels() -> set[str]:
    """job and instance, and the target labels the scrape config adds."""
    added = {rule["target_label"] for job in _prometheus()["scrape_configs"]
             for rule in job["relabel_configs"] if "target_label" in rule}  # fmt: skip
    return {"job", "instance"} | {label for label in added if not label.startswith("__")}


def _exported() -> dict[str, set[str]]:
    """Every series name the code exports -> the labels it carries."""
    common = {"edgeinfer_region", "otel_scope_name"} | _scrape_labels()
    out: dict[str, set[str]] = {}
    for spec in METRICS:
        labels = common | LABELS.get(spec.name, set())
        if spec.name in GENAI:
            labels |= {"gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model",
                       "error_type"}
        elif spec.who == "worker":
            labels |= {"edgeinfer_worker_id", "model"}
        if spec.kind == "histogram":
            out[spec.prometheus + "_bucket"] = labels | {"le"}
            out[spec.prometheus + "_sum"] = labels
            out[spec.prometheus + "_count"] = labels
        else:
            out[spec.prometheus] = labels
    return out


_STRING = r'"(?:[^"\\]|\\.)*"'
_MATCHER = re.compile(rf"\s*([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*({_STRING})\s*(,|$)")


def parse_promql(expr: str) -> tuple[list[tuple[str, dict[str, str]]], set[str]]:
    """(every selector as (metric, {label: matcher text}), the labels of by/without/on/ignoring/
    group_x clauses) of a PromQL expression; fails on what it cannot account for."""
    selectors: list[tuple[str, dict[str, str]]] = []

    def selector(m: re.Match[str]) -> str:
        body, matchers, at = m[2], {}, 0
        while at < len(body):
            mm = _MATCHER.match(body, at)
            assert mm, f"cannot parse the selector {{{body}}} in {expr!r}"
            matchers[mm[1]] = mm[2] + mm[3]
            at = mm.end()
        selectors.append((m[1], matchers))
        return " "

    rest = re.sub(rf"([a-zA-Z_:][\w:]*)\s*\{{((?:[^{{}}\"]|{_STRING})*)\}}", selector, expr)
    assert "{" not in rest and "}" not in rest, f"a selector without a metric name in {expr!r}"
    grouping: set[str] = set()

    def clause(m: re.Match[str]) -> str:
        grouping.update(x.strip() for x in m[2].split(",") if x.strip())
        return " "

    rest = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)", clause, rest)
    rest = re.sub(r"\[[^\]]*\]", " ", rest)  # ranges and subqueries: [5m], [$__rate_interval]
    rest = re.sub(_STRING, " ", rest)
    rest = re.sub(r"(?<![\w:])\d+(\.\d+)?(e[+-]?\d+|ms|[smhdwy])?(?![\w:])", " ", rest)  # 1.5, 5m
    for m in re.finditer(r"[a-zA-Z_:][\w:]*", rest):
        word = m[0]
        if rest[m.end() :].lstrip().startswith("("):
            assert word in FUNCTIONS, f"unknown function {word!r} in {expr!r}"
        else:
            assert word in KEYWORDS, f"{word!r} outside a selector in {expr!r}"
    assert "$" not in rest, f"a variable outside a selector or range in {expr!r}"
    return selectors, grouping


def test_parse_promql() -> None:
    selectors, grouping = parse_promql(
        'histogram_quantile(0.9, sum by (le, kind) (rate(a_bucket{job="x", m=~"$model", '
        'q="a}b,c"}[$__rate_interval]))) / on (kind) group_left() b{job="y"} offset 5m > bool 0.5e0'
    )
    assert selectors == [
        ("a_bucket", {"job": '="x"', "m": '=~"$model"', "q": '="a}b,c"'}),
        ("b", {"job": '="y"'}),
    ]
    assert grouping == {"le", "kind"}
    with pytest.raises(AssertionError, match="outside a selector"):
        parse_promql("sum(rate(bare_metric[5m]))")  # a metric with no selector is not checked
    with pytest.raises(AssertionError, match="unknown function"):
        parse_promql('rates(a{job="x"}[5m])')


def _dashboard() -> dict[str, Any]:
    dashboard = json.loads(DASHBOARD.read_text())
    assert isinstance(dashboard, dict)
    return dashboard


def _panels() -> list[dict[str, Any]]:
    return [p for p in _dashboard()["panels"] if p["type"] != "row"]


def test_dashboard_layout() -> None:
    dashboard = _dashboard()
    assert dashboard["uid"] == "edgeinfer"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"datasource", "region", "model"} <= set(variables)
    for name in ("region", "model"):
        assert variables[name]["multi"] and variables[name]["includeAll"]
        assert variables[name]["allValue"] == ".*"  # so that =~"$region" matches all
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        grid = p["gridPos"]
        assert grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] == "row":
            assert "targets" not in p
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], f"{p['title']}: no query"
        for t in p["targets"]:
            assert t["expr"].strip(), p["title"]
    titles = " | ".join(p["title"] for p in _panels()).lower()
    for topic in ("request rate", "errors", "time to first token", "time per output token",
                  "tokens/s", "kv-cache usage", "prefix-cache hit rate", "routing mix",
                  "workers per region", "cold starts per region", "kv transfer bytes/s",
                  "kv transfer duration", "redis latency", "running and waiting",
                  "preemptions"):  # fmt: skip
        assert topic in titles, topic


def _queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) for every query on the dashboard, variables' included."""
    out = [(p["title"], t["expr"]) for p in _panels() for t in p["targets"]]
    for v in _dashboard()["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", v["query"]["query"])
            assert m, v["query"]
            out.append((f"${v['name']}", m[1] + f" by ({m[2]})"))
    return out


def test_dashboard_queries_use_exported_metrics_and_labels() -> None:
    exported = _exported()
    by_name = {s.prometheus: s for s in METRICS}
    for title, expr in _queries():
        selectors, grouping = parse_promql(expr)
        assert selectors, f"{title}: no metric in {expr!r}"
        available: set[str] = set()
        for metric, matchers in selectors:
            assert metric in exported, f"{title}: {metric} is not exported"
            unknown = set(matchers) - exported[metric]
            assert not unknown, f"{title}: {metric} has no label {unknown}"
            available |= exported[metric]
            spec = by_name[re.sub(r"_(bucket|sum|count)$", "", metric)]
            job = {"gateway": '="edgeinfer-gateway"', "worker": '="edgeinfer-worker"'}
            if spec.who in job:  # each process kind's metrics from that job alone
                assert matchers.get("job") == job[spec.who], f"{title}: {metric} {matchers}"
            else:  # both: the job says whose view (request-level: the gateway's)
                want = job["worker"] if "worker" in title.lower() else job["gateway"]
                assert matchers.get("job") in (want, job["gateway"]), f"{title}: {metric}"
            if title.startswith("$"):
                continue
            region = matchers.get("edgeinfer_region", matchers.get("worker_region"))
            assert region == '=~"$region"', f"{title}: {metric} is not filtered by $region"
            for label in ("model", "gen_ai_request_model"):
                if label in exported[metric]:
                    assert matchers.get(label) == '=~"$model"', f"{title}: {metric} not by $model"
        unknown = grouping - available
        assert not unknown, f"{title}: grouping by {unknown}, which {expr!r} does not carry"


def test_dashboard_latency_panels_are_the_gateways() -> None:
    """What a client sees (TTFT, ITL, request duration) is measured at the gateway."""
    latency = {m.prometheus for m in METRICS if m.name in GENAI - {names.TOKEN_USAGE}}
    panels = [p for p in _panels() if any(n in t["expr"] for t in p["targets"] for n in latency)]
    assert len(panels) >= 3
    for p in panels:
        if "worker" in p["title"].lower():
            continue
        for t in p["targets"]:
            for metric, matchers in parse_promql(t["expr"])[0]:
                assert matchers["job"] == '="edgeinfer-gateway"', (p["title"], metric)


def test_grafana_provisioning() -> None:
    provider = yaml.safe_load((INFRA / "grafana/provisioning/dashboards/edgeinfer.yaml").read_text())  # fmt: skip
    (p,) = provider["providers"]
    assert p["type"] == "file" and p["options"]["path"].startswith("/")
    sources = yaml.safe_load((INFRA / "grafana/provisioning/datasources/prometheus.yaml").read_text())  # fmt: skip
    assert [s["type"] for s in sources["datasources"]] == ["prometheus"]


def test_config_files_are_where_the_readme_says() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for path in (COLLECTOR, PROMETHEUS, DASHBOARD):
        assert str(path.relative_to(INFRA.parent)) in readme
