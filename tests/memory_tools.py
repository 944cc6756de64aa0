"""What the kernel says of a process's own memory, for tests: pages in memory, mapping flags."""

from __future__ import annotations

import ctypes
from pathlib import Path

PAGE = 4096


def resident_pages(addr: int, nbytes: int) -> int:
    """How many of the pages holding bytes [addr, addr + nbytes) are in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = addr // PAGE * PAGE
    n = -(-(addr + nbytes - start) // PAGE)
    vec = (ctypes.c_ubyte * n)()
    rc = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * PAGE), vec)
    assert rc == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def vm_flags(addr: int) -> list[str]:
    """The kernel's VmFlags of the mapping that holds `addr` (/proc/self/smaps): "hg" is
    madvise(MADV_HUGEPAGE)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):  # a mapping's header: lo-hi perms ...
            lo, hi = (int(x, 16) for x in first.split("-"))
            inside = lo <= addr < hi
        elif inside and first == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"{addr:#x} is not mapped")
