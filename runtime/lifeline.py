"""A child's tie to the process that started it: a pool manager (runtime.pool_manager) or
`edgeinfer up`. When that process is gone, however it ended (SIGKILL included), the child drains
and exits instead of serving on as an orphan that nothing will stop or scale down.

    parent: line = Lifeline()          a pipe; only the parent holds its write end
            spawn(..., pass_fds=line.pass_fds, env=env | line.env)
    child:  watch_lifeline(loop, on_lost)
            on_lost() runs once, when the pipe reports end-of-file: the parent is gone

A worker forked from a pool's warm template (runtime.zygote) inherits the read end through the
template, which the pool starts with it. The write end is close-on-exec, so no child holds it.
The child takes the variable out of its environment and makes the descriptor non-inheritable,
so processes it starts in turn (a split model's ranks) are not tied to its parent.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from collections.abc import Callable

log = logging.getLogger("edgeinfer.lifeline")

ENV = "EDGEINFER_LIFELINE_FD"


class Lifeline:
    """The parent's end: create it before the children and keep it for the process's life (its
    write end closes when the process ends, however it ends)."""

    def __init__(self) -> None:
        self.read_fd, self._write_fd = os.pipe2(os.O_CLOEXEC)

    @property
    def env(self) -> dict[str, str]:
        """What a child's environment needs (with `pass_fds`) to watch this lifeline."""
        return {ENV: str(self.read_fd)}

    @property
    def pass_fds(self) -> tuple[int, ...]:
        return (self.read_fd,)


def watch_lifeline(loop: asyncio.AbstractEventLoop, on_lost: Callable[[], None]) -> bool:
    """Call `on_lost()` from `loop` once the process that started this one is gone. Returns
    whether there is a lifeline to watch (none: started by hand, or by a test)."""
    raw = os.environ.pop(ENV, None)
    if raw is None:
        return False
    try:
        fd = int(raw)
        is_pipe = stat.S_ISFIFO(os.fstat(fd).st_mode)
    except (ValueError, OSError) as e:
        log.warning("%s=%r names no open descriptor (%s): not watching the parent", ENV, raw, e)
        return False
    if not is_pipe:
        log.warning("%s=%r is not a pipe: not watching the parent", ENV, raw)
        return False
    os.set_inheritable(fd, False)

    def readable() -> None:  # only end-of-file: nothing ever writes to it
        loop.remove_reader(fd)
        os.close(fd)
        on_lost()

    loop.add_reader(fd, readable)
    return True
