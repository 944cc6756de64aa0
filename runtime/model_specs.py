"""`--models` lists (`edgeinfer pool`, the deploy scripts' catalog settings): the standard library
only, as infra/deploy.py imports it on a host that has Python and PyYAML and nothing else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def parse_models(spec: str, resolve: Callable[[str], str]) -> dict[str, str]:
    """`M1,M2` or `name=DIR,...` -> {served name: folder}; `resolve(name)` finds a bare name's
    folder (the model store); `=DIR` serves DIR under its folder's name. Raises ValueError naming
    the entry for one with an empty folder (`name=`) and for a served name given twice
    (`a=/x,a=/y`, `a,a`, `a,=/m/a`): the last one silently won, and the other folder was never
    served."""
    out: dict[str, str] = {}
    given: dict[str, str] = {}  # served name -> the entry that gave it
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, eq, folder = (part.strip() for part in item.partition("="))
        if eq and not folder:
            raise ValueError(f"{item!r}: no folder after '=' (NAME=FOLDER serves FOLDER as NAME)")  # fmt: skip
        path = folder or resolve(name)
        name = name or Path(path).name  # `=FOLDER`: served as the folder's name, as a worker's
        if not name:
            raise ValueError(f"{item!r}: no model name, and the folder has none to serve it as")
        if name in given:
            raise ValueError(f"{item!r}: the model {name!r} is already given by {given[name]!r}; "
                             "list each model once")  # fmt: skip
        given[name] = item
        out[name] = str(path)
    return out
