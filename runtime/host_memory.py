"""How much memory this process can still take: the host's, or its container's where that is less.

A worker sizes its KV cache from the memory left once its weights are in (a fraction of it, by
default). /proc/meminfo's MemAvailable is the whole host's, also inside a container: a pod limited
to 4 GiB on a 64 GiB node would size a cache for ~60 GB, and the kernel's OOM killer would end
the worker once the cache filled past the limit (with `--kv-cache-commit eager`, at start-up).
So the memory cgroup's limit counts too, as the JVM and Go's runtime read it:

- cgroup v2 (`0::/path` in /proc/self/cgroup): memory.max of the process's cgroup and of every
  ancestor up to the mount, each less that cgroup's working set (memory.current less the
  inactive file pages of memory.stat, which the kernel reclaims before it kills anything:
  kubelet's "working set" measure); the tightest counts.
- cgroup v1 (a hierarchy with the `memory` controller): memory.stat's hierarchical_memory_limit
  (the tightest of the cgroup's and its ancestors') less memory.usage_in_bytes less
  total_inactive_file.

The cgroup's path is looked up under the mount (a host-wide mount shows every cgroup); where it
is not there, the mount itself is the process's cgroup (a container's namespaced or bind-mounted
view). Where no limit applies or nothing can be read: None, and the host's figure stands.
"""

from __future__ import annotations

import os
from pathlib import Path

CGROUP_MOUNT = Path("/sys/fs/cgroup")
SELF_CGROUP = Path("/proc/self/cgroup")
# cgroup v1 reports "no limit" as 2**63 - 1 rounded down to a page: anything this large is none
V1_UNLIMITED = 1 << 62


def host_available() -> int:
    """Bytes the kernel can give without swapping (MemAvailable), host-wide."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def available_memory() -> int:
    """Bytes this process can still allocate: the host's MemAvailable, or its memory cgroup's
    headroom where that is less."""
    host = host_available()
    limit = cgroup_headroom()
    return host if limit is None else max(0, min(host, limit))


def cgroup_headroom(mount: Path = CGROUP_MOUNT, self_cgroup: Path = SELF_CGROUP) -> int | None:
    """Bytes the process's memory cgroup can still take before its limit (see the module
    docstring); None where no limit applies or it cannot be read."""
    try:
        lines = self_cgroup.read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        if "memory" in controllers.split(","):
            v1 = path
        elif hierarchy == "0" and not controllers:
            v2 = path
    try:
        if v1 is not None:  # a hybrid host has both: the memory controller is v1's
            return _v1_headroom(_cgroup_dir(mount / "memory", v1))
        if v2 is not None:
            return _v2_headroom(mount, _cgroup_dir(mount, v2))
    except (OSError, ValueError):
        return None
    return None


def _cgroup_dir(mount: Path, path: str) -> Path:
    here = mount / path.lstrip("/")
    return here if path.strip("/") and here.is_dir() else mount


def _stat(directory: Path) -> dict[str, int]:
    out = {}
    for line in (directory / "memory.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out


def _v1_headroom(directory: Path) -> int | None:
    stat = _stat(directory)
    limit = stat.get("hierarchical_memory_limit")
    if limit is None:
        limit = int((directory / "memory.limit_in_bytes").read_text())
    if limit >= V1_UNLIMITED:
        return None
    usage = int((directory / "memory.usage_in_bytes").read_text())
    working = usage - stat.get("total_inactive_file", stat.get("inactive_file", 0))
    return limit - max(working, 0)


def _v2_headroom(mount: Path, directory: Path) -> int | None:
    tightest: int | None = None
    mount = mount.resolve()
    here = directory.resolve()
    while True:
        limit_file = here / "memory.max"
        if limit_file.is_file():  # (the root cgroup has none)
            text = limit_file.read_text().strip()
            if text != "max":
                current = int((here / "memory.current").read_text())
                working = current - _stat(here).get("inactive_file", 0)
                left = int(text) - max(working, 0)
                tightest = left if tightest is None else min(tightest, left)
        if here == mount or here.parent == here or mount not in here.parents:
            return tightest
        here = here.parent
