"""`--models` lists (`edgeinfer pool`, the deploy scripts' catalog settings): the standard library
only, as infra/deploy.py imports it on a host that has Python and PyYAML and nothing else."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path


def parse_models(spec: str, resolve: Callable[[str], str]) -> dict[str, str]:
    """`M1,M2` or `name=DIR,...` -> {served name: folder}; `resolve(name)` finds a bare name's
    folder (the model store)."""
    out: dict[str, str] = {}
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, _, folder = item.partition("=")
        path = folder or resolve(name)
        out[name or Path(path).name] = str(path)
    return out
