"""A kustomize build, in Python, for the part of kustomize that infra/k8s uses.

No kustomize or kubectl binary is needed to render a region: `build(kustomization)` reads a
`kustomization.yaml` (a folder, or a mapping already in memory) and returns the resources that
`kustomize build` would print, for these fields:

    resources          files (YAML, one or more documents) and folders holding a kustomization
    namespace          set on every namespaced resource
    labels             `pairs` added to every resource's labels (and, with `includeTemplates`,
                       its pod template's); never to selectors (`includeSelectors` is refused)
    images             name -> newName / newTag / digest, on containers and initContainers
    replicas           name -> count, on Deployments and StatefulSets
    patches            strategic-merge patches, from `path:` or inline `patch:`, applied to the
                       resource of the same kind and name (`$patch: delete` removes it)
    configMapGenerator `name` and `files` (`KEY=PATH` or `PATH`, keyed by the file's name), read
                       from inside the kustomization's folder as kustomize's load restrictor
                       allows; only with `options: {disableNameSuffixHash: true}`, since this
                       renderer does not add the content hash to the name

Anything else in a kustomization is refused with a `RenderError` naming the file and the field,
so an overlay that kustomize would render differently never renders here. Strategic merge
follows the Kubernetes merge keys for the lists these manifests hold (containers, env, ports,
volumes, volumeMounts, ...); other lists are replaced, as kustomize does.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

SUPPORTED = {
    "apiVersion",
    "kind",
    "resources",
    "namespace",
    "labels",
    "images",
    "replicas",
    "patches",
    "configMapGenerator",
}
# list field -> the key its items merge on (Kubernetes' patchMergeKey)
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "envFrom": None,
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "volumeClaimTemplates": None,
    "imagePullSecrets": "name",
    "tolerations": None,
}
CLUSTER_SCOPED = {"Namespace", "StorageClass", "ClusterRole", "ClusterRoleBinding", "PersistentVolume"}  # fmt: skip


# `kustomize build`'s output order (its "legacy" sort): a namespace before what lives in it,
# config before the pods that read it, so that `kubectl apply -f -` of the output works first time.
ORDER_FIRST = ["Namespace", "ResourceQuota", "StorageClass", "CustomResourceDefinition",
               "ServiceAccount", "PodSecurityPolicy", "Role", "ClusterRole", "RoleBinding",
               "ClusterRoleBinding", "ConfigMap", "Secret", "Endpoints", "Service", "LimitRange",
               "PriorityClass", "PersistentVolume", "PersistentVolumeClaim", "Deployment",
               "StatefulSet", "CronJob", "PodDisruptionBudget"]  # fmt: skip
ORDER_LAST = ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]


class RenderError(ValueError):
    """An overlay or base that does not render; the message names the file and the field."""


def build(
    kustomization: str | Path | dict[str, Any], base_dir: Path | None = None
) -> list[Resource]:
    """Render a kustomization: a folder holding `kustomization.yaml`, or a mapping in memory whose
    relative paths are resolved against `base_dir`."""
    if isinstance(kustomization, dict):
        if base_dir is None:
            raise ValueError("an in-memory kustomization needs base_dir")
        return _sorted(_build(kustomization, base_dir, "<in memory>"))
    folder = Path(kustomization)
    where = folder / "kustomization.yaml"
    spec = _load_one(where)
    return _sorted(_build(spec, folder, str(where)))


def _sorted(resources: list[Resource]) -> list[Resource]:
    def rank(r: Resource) -> tuple[int, str, str]:
        kind = str(r.get("kind"))
        if kind in ORDER_FIRST:
            at = ORDER_FIRST.index(kind)
        elif kind in ORDER_LAST:
            at = len(ORDER_FIRST) + 1 + ORDER_LAST.index(kind)
        else:
            at = len(ORDER_FIRST)
        return at, kind, str((r.get("metadata") or {}).get("name"))

    return sorted(resources, key=rank)


def _load_one(path: Path) -> dict[str, Any]:
    docs = _load(path)
    if len(docs) != 1:
        raise RenderError(f"{path}: expected one YAML document, found {len(docs)}")
    return docs[0]


def _load(path: Path) -> list[dict[str, Any]]:
    try:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    except OSError as e:
        raise RenderError(f"{path}: cannot read: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise RenderError(f"{path}: not valid YAML: {e}") from e
    for d in docs:
        if not isinstance(d, dict):
            raise RenderError(f"{path}: every document must be a mapping")
    return docs


def _build(spec: dict[str, Any], folder: Path, where: str) -> list[Resource]:
    unknown = sorted(set(spec) - SUPPORTED)
    if unknown:
        raise RenderError(f"{where}: field {unknown[0]!r} is not supported by this renderer")
    resources: list[Resource] = []
    for i, entry in enumerate(spec.get("resources") or []):
        if not isinstance(entry, str):
            raise RenderError(f"{where}: resources[{i}] must be a path")
        path = (folder / entry).resolve()
        if path.is_dir():
            resources += build(path)
        elif path.is_file():
            resources += _load(path)
        else:
            raise RenderError(f"{where}: resources[{i}]: {entry} does not exist")
    for i, generator in enumerate(spec.get("configMapGenerator") or []):
        resources.append(_config_map(generator, folder, f"{where}: configMapGenerator[{i}]"))
    for i, patch in enumerate(spec.get("patches") or []):
        resources = _patch(resources, _patch_doc(patch, folder, f"{where}: patches[{i}]"))
    for i, image in enumerate(spec.get("images") or []):
        _set_image(resources, image, f"{where}: images[{i}]")
    for i, rep in enumerate(spec.get("replicas") or []):
        _set_replicas(resources, rep, f"{where}: replicas[{i}]")
    for i, label in enumerate(spec.get("labels") or []):
        _add_labels(resources, label, f"{where}: labels[{i}]")
    namespace = spec.get("namespace")
    if namespace is not None:
        for r in resources:
            if r.get("kind") not in CLUSTER_SCOPED:
                r.setdefault("metadata", {})["namespace"] = namespace
    return resources


def _config_map(generator: Any, folder: Path, where: str) -> Resource:
    if not isinstance(generator, dict) or not isinstance(generator.get("name"), str):
        raise RenderError(f"{where}: needs a name")
    unknown = sorted(set(generator) - {"name", "files", "options"})
    if unknown:
        raise RenderError(f"{where}: field {unknown[0]!r} is not supported by this renderer")
    if generator.get("options") != {"disableNameSuffixHash": True}:
        raise RenderError(f"{where}: needs options: {{disableNameSuffixHash: true}} (this renderer "
                          "adds no content hash to the name)")  # fmt: skip
    root = folder.resolve()
    data: dict[str, str] = {}
    for j, entry in enumerate(generator.get("files") or []):
        if not isinstance(entry, str) or not entry:
            raise RenderError(f"{where}: files[{j}] must be KEY=PATH or PATH")
        key, _, rel = entry.partition("=") if "=" in entry else ("", "", entry)
        path = (folder / rel).resolve()
        if root not in path.parents:
            raise RenderError(f"{where}: files[{j}]: {rel} is outside {folder} (kustomize's "
                              "load restrictor refuses it)")  # fmt: skip
        try:
            data[key or path.name] = path.read_text()
        except OSError as e:
            raise RenderError(f"{where}: files[{j}]: cannot read {rel}: {e.strerror}") from e
    meta = {"name": generator["name"]}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def _patch_doc(patch: Any, folder: Path, where: str) -> tuple[dict[str, Any], str]:
    if not isinstance(patch, dict) or ("path" in patch) == ("patch" in patch):
        raise RenderError(f"{where}: needs exactly one of `path` or `patch`")
    if "target" in patch:
        raise RenderError(f"{where}: field 'target' is not supported by this renderer")
    if "path" in patch:
        return _load_one(folder / patch["path"]), f"{where} ({patch['path']})"
    try:
        doc = yaml.safe_load(patch["patch"])
    except yaml.YAMLError as e:
        raise RenderError(f"{where}: not valid YAML: {e}") from e
    if not isinstance(doc, dict):
        raise RenderError(f"{where}: must be a mapping")
    return doc, where


def _patch(resources: list[Resource], patch: tuple[dict[str, Any], str]) -> list[Resource]:
    doc, where = patch
    kind, name = doc.get("kind"), (doc.get("metadata") or {}).get("name")
    if not kind or not name:
        raise RenderError(f"{where}: a strategic-merge patch needs kind and metadata.name")
    hits = [r for r in resources if r.get("kind") == kind and r["metadata"].get("name") == name]
    if not hits:
        raise RenderError(f"{where}: no {kind} named {name!r} to patch")
    if doc.get("$patch") == "delete":
        return [r for r in resources if not any(r is h for h in hits)]
    for r in hits:
        merged = merge(r, doc)
        r.clear()
        r.update(merged)
    return resources


def merge(target: Any, patch: Any, field: str = "") -> Any:
    """Strategic merge of `patch` onto `target` (a new value; neither input is changed)."""
    if isinstance(target, dict) and isinstance(patch, dict):
        out = copy.deepcopy(target)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = merge(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    key = MERGE_KEYS.get(field)
    if isinstance(target, list) and isinstance(patch, list) and key:
        out_list = copy.deepcopy(target)
        for item in patch:
            same = [j for j, t in enumerate(out_list) if isinstance(t, dict) and t.get(key) == item.get(key)]  # fmt: skip
            if same:
                out_list[same[0]] = merge(out_list[same[0]], item)
            else:
                out_list.append(copy.deepcopy(item))
        return out_list
    return copy.deepcopy(patch)


def _pod_specs(r: Resource) -> list[dict[str, Any]]:
    spec = r.get("spec") or {}
    template = (spec.get("template") or {}).get("spec")
    if r.get("kind") == "Pod":
        return [spec]
    return [template] if isinstance(template, dict) else []


def _set_image(resources: list[Resource], image: Any, where: str) -> None:
    if not isinstance(image, dict) or not isinstance(image.get("name"), str):
        raise RenderError(f"{where}: needs a name")
    for r in resources:
        for pod in _pod_specs(r):
            for c in (pod.get("containers") or []) + (pod.get("initContainers") or []):
                current = c.get("image", "")
                repo = current.split("@")[0].rsplit(":", 1)[0] if ":" in current.split("/")[-1] else current.split("@")[0]  # fmt: skip
                if repo != image["name"]:
                    continue
                new = image.get("newName", repo)
                if "digest" in image:
                    c["image"] = f"{new}@{image['digest']}"
                elif "newTag" in image:
                    c["image"] = f"{new}:{image['newTag']}"
                else:
                    c["image"] = new + current[len(repo) :]


def _set_replicas(resources: list[Resource], rep: Any, where: str) -> None:
    if not isinstance(rep, dict) or not isinstance(rep.get("name"), str):
        raise RenderError(f"{where}: needs a name")
    count = rep.get("count")
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise RenderError(f"{where}: count must be a whole number >= 0, got {count!r}")
    hits = [r for r in resources if r["metadata"].get("name") == rep["name"]
            and r.get("kind") in ("Deployment", "StatefulSet", "ReplicaSet")]  # fmt: skip
    if not hits:
        raise RenderError(f"{where}: no Deployment or StatefulSet named {rep['name']!r}")
    for r in hits:
        r["spec"]["replicas"] = count


def _add_labels(resources: list[Resource], label: Any, where: str) -> None:
    if not isinstance(label, dict) or not isinstance(label.get("pairs"), dict):
        raise RenderError(f"{where}: needs `pairs`")
    if label.get("includeSelectors"):
        raise RenderError(f"{where}: field 'includeSelectors' is not supported by this renderer")
    pairs = {str(k): str(v) for k, v in label["pairs"].items()}
    for r in resources:
        r.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
        template = (r.get("spec") or {}).get("template")
        if label.get("includeTemplates") and isinstance(template, dict):
            template.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
