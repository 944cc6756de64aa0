"""The memory a worker sizes its KV cache from: the host's, or its container's (memory cgroup)
where that is less; cgroup v1 and v2 trees written as the kernel shows them."""

from __future__ import annotations

from pathlib import Path

import pytest

import runtime.host_memory as hm
from runtime import LLM
from runtime.model_runner import kv_block_bytes

MB = 1 << 20


def _write(d: Path, **files: str | int) -> None:
    d.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (d / name.replace("_", ".", 1)).write_text(f"{value}\n")


def _self(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "self_cgroup"
    p.write_text(text)
    return p


def test_v2_the_tightest_limit_up_the_tree_less_the_working_set(tmp_path: Path) -> None:
    mount = tmp_path / "cg"
    _write(mount, cgroup_controllers="memory")  # the root: no memory.max
    pod = mount / "kubepods" / "pod1"
    _write(
        pod, memory_max=1000 * MB, memory_current=300 * MB, memory_stat="anon 1\ninactive_file 0"
    )
    ctr = pod / "ctr"
    # its own limit is looser; 100 MB of its usage is inactive page cache, reclaimed first
    _write(ctr, memory_max=4000 * MB, memory_current=250 * MB,
           memory_stat=f"anon {150 * MB}\ninactive_file {100 * MB}\nactive_file 5")  # fmt: skip
    me = _self(tmp_path, "0::/kubepods/pod1/ctr\n")
    assert hm.cgroup_headroom(mount, me) == 1000 * MB - 300 * MB  # the pod's limit binds
    _write(pod, memory_max="max")
    assert hm.cgroup_headroom(mount, me) == 4000 * MB - 150 * MB
    _write(ctr, memory_max="max")
    assert hm.cgroup_headroom(mount, me) is None  # no limit anywhere


def test_v2_namespaced_view_and_a_path_not_under_the_mount(tmp_path: Path) -> None:
    """A container's cgroup namespace shows `0::/` with its own cgroup at the mount; a host path
    that the mount does not hold (a bind-mounted view) also means the mount is the cgroup."""
    mount = tmp_path / "cg"
    _write(mount, memory_max=512 * MB, memory_current=12 * MB, memory_stat="inactive_file 2097152")
    assert hm.cgroup_headroom(mount, _self(tmp_path, "0::/\n")) == 502 * MB
    assert (
        hm.cgroup_headroom(mount, _self(tmp_path, "0::/system.slice/docker-1.scope\n")) == 502 * MB
    )


def test_v1_hierarchical_limit_and_hybrid_hosts(tmp_path: Path) -> None:
    """cgroup v1 (and a hybrid host, with a v2 line too): the memory controller's hierarchy,
    memory.stat's hierarchical_memory_limit, less usage less total_inactive_file."""
    mount = tmp_path / "cg"
    root = mount / "memory"
    _write(root, memory_limit_in_bytes=9223372036854771712, memory_usage_in_bytes=5 << 30,
           memory_stat="hierarchical_memory_limit 9223372036854771712\ntotal_inactive_file 0")  # fmt: skip
    me_text = "12:pids:/x\n4:memory:/docker/abc\n1:name=systemd:/\n0::/\n"
    me = _self(tmp_path, me_text)
    assert hm.cgroup_headroom(mount, me) is None  # the container's dir is not there: the root's
    ctr = root / "docker" / "abc"
    _write(ctr, memory_limit_in_bytes=9223372036854771712, memory_usage_in_bytes=700 * MB,
           memory_stat=f"inactive_file 0\nhierarchical_memory_limit {2048 * MB}\n"
                       f"total_inactive_file {200 * MB}")  # fmt: skip
    assert hm.cgroup_headroom(mount, me) == 2048 * MB - 500 * MB  # a parent's limit, inherited
    _write(ctr, memory_stat="total_inactive_file 0")  # an old kernel: no hierarchical line
    _write(ctr, memory_limit_in_bytes=1024 * MB)
    assert hm.cgroup_headroom(mount, me) == 324 * MB
    _write(ctr, memory_usage_in_bytes=2048 * MB)  # over its limit: nothing left, not negative
    assert hm.cgroup_headroom(mount, me) == -1024 * MB  # (available_memory: 0)


def test_unreadable_or_odd_files_leave_the_host_figure(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    mount = tmp_path / "cg"
    assert hm.cgroup_headroom(mount, tmp_path / "missing") is None
    me = _self(tmp_path, "0::/\n")
    assert hm.cgroup_headroom(mount, me) is None  # no mount
    _write(mount, memory_max="garbage", memory_current=1, memory_stat="")
    assert hm.cgroup_headroom(mount, me) is None
    _write(mount, memory_max=100 * MB, memory_current=200 * MB)
    monkeypatch.setattr(hm, "cgroup_headroom", lambda: -5)
    assert hm.available_memory() == 0  # never negative
    assert hm.host_available() > 0
    # (the host's figure fixed: MemAvailable moves between two reads whenever anything else on
    # the host allocates, and the comparisons below failed by a page now and then)
    monkeypatch.setattr(hm, "host_available", lambda: 3000 * MB)
    monkeypatch.setattr(hm, "cgroup_headroom", lambda: None)
    assert hm.available_memory() == 3000 * MB
    monkeypatch.setattr(hm, "cgroup_headroom", lambda: 1 << 60)
    assert hm.available_memory() == 3000 * MB  # the host's, where that is less


def test_the_kv_cache_is_sized_from_the_container_limit(
    stories_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine in a container whose limit leaves 64 MB gets a KV cache of its fraction of what
    is left once the weights are in, not of the host's memory."""
    monkeypatch.setattr(hm, "cgroup_headroom", lambda: 64 * MB)
    engine = LLM(stories_dir, kv_cache_fraction=0.5).engine
    weights = sum(p.nbytes for p in engine.model.parameters())
    block = kv_block_bytes(engine.model, engine.config.block_size, engine.kv_dtype)
    expected = int((64 * MB - weights) * 0.5) // block  # (the load counts a few more bytes)
    assert expected - 2 <= engine.blocks.num_blocks <= expected, (
        engine.blocks.num_blocks,
        expected,
    )
    monkeypatch.setattr(hm, "cgroup_headroom", lambda: None)  # the host's: far more
    assert LLM(stories_dir, kv_cache_fraction=0.5).engine.blocks.num_blocks > 4 * expected
