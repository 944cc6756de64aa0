"""Process titles: what `ps`, `top` and `pgrep` show for a process.

A worker forked from a pool's template (runtime.zygote) would otherwise show the template's
command line, `python -m runtime.zygote --fd 7`, under every worker of the pool: an operator
could not tell them apart, or find the one on a port. `set_title` rewrites both names Linux
keeps for a process:

- the command line (`ps aux`, `ps -o args`, /proc/PID/cmdline): the bytes of the process's
  original argv, which the kernel reads from the process's own memory, between the addresses
  /proc/self/stat gives as arg_start and arg_end. The title is written there, cut to fit and
  padded with NULs; nothing is moved, so a title never grows past the original command line
  (the template starts with room to spare: ZygoteClient passes it --title-room).
- the short name (`top`, `ps -o comm`, `pgrep NAME`, /proc/PID/comm): prctl(PR_SET_NAME), 15
  bytes.

Elsewhere than Linux, or where /proc says something unexpected, it changes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
import sys
from pathlib import Path

PR_SET_NAME = 15
COMM_BYTES = 15  # the kernel's TASK_COMM_LEN less the NUL
SECRET_FLAGS = ("--secret", "--api-key")  # their values never go into a title


def _argv_area() -> tuple[int, int] | None:
    """[arg_start, arg_end) of this process, fields 48 and 49 of /proc/self/stat."""
    try:
        stat = Path("/proc/self/stat").read_bytes()
    except OSError:
        return None
    # after the name, which may hold spaces and parentheses: fields[0] is field 3
    fields = stat[stat.rindex(b")") + 2 :].split()
    if len(fields) < 47:
        return None
    start, end = int(fields[45]), int(fields[46])
    return (start, end) if 0 < start < end else None


def redact(argv: list[str]) -> list[str]:
    """`argv` with the value of each secret-bearing flag replaced, and the password of any URL
    (`redis://:pw@host`)."""
    out, hide = [], False
    for a in argv:
        if hide:
            out.append("***")
            hide = False
        elif a in SECRET_FLAGS:
            out.append(a)
            hide = True
        elif a.startswith(tuple(f"{f}=" for f in SECRET_FLAGS)):
            out.append(a.split("=", 1)[0] + "=***")
        else:
            out.append(_URL_QUERY_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", a)))
    return out


# a URL's password: from the user's ':' to the last '@' (a password may hold '@' or '/', which
# redis-py's parser takes; what follows the host is hidden too when it holds an '@': on the safe
# side), and a `password=` query parameter (redis-py logs in with it too)
_URL_PASSWORD = re.compile(r"(://[^/@:]*:).*@")
_URL_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*")


def set_title(title: str, short: str | None = None) -> bool:
    """Show `title` as this process's command line and `short` (default: the title's first
    word) as its name. Returns whether the command line changed (False: not Linux, or no room
    could be found safely)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    name = (short or title.split(" ", 1)[0]).encode()[:COMM_BYTES]
    libc.prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
    area = _argv_area()
    if area is None:
        return False
    start, end = area
    room = end - start
    try:
        current = Path("/proc/self/cmdline").read_bytes()
    except OSError:
        return False
    # what the kernel reads there must be what this process holds there: then the addresses
    # are this process's argv, and writing them touches nothing else
    if ctypes.string_at(start, room) != current[:room]:
        return False
    data = title.encode()[: room - 1]
    ctypes.memmove(start, data.ljust(room, b"\0"), room)
    return True
