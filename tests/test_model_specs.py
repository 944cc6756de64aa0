"""runtime.model_specs.parse_models: `--models` lists (`edgeinfer pool`, a region's catalog
settings). One served name is one model folder; an entry is a name, a folder, or NAME=FOLDER."""

from __future__ import annotations

import pytest

from runtime.cli import build_parser
from runtime.model_specs import parse_models


def _store(name: str) -> str:
    return f"/store/{name}"


def test_names_folders_and_renames() -> None:
    assert parse_models("a, b=/x/y ,,c", _store) == {"a": "/store/a", "b": "/x/y", "c": "/store/c"}
    assert parse_models("=/m/plain", _store) == {"plain": "/m/plain"}  # the folder's name


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        # two folders under one name: the last silently won, and the other was never served
        ("a=/x,a=/y", "'a=/y': the model 'a' is already given by 'a=/x'; list each model once"),
        ("a,a", "'a': the model 'a' is already given by 'a'"),
        ("a,a=/y", "'a=/y': the model 'a' is already given by 'a'"),
        # `=/m/x` is served as its folder's name: given twice that way too
        ("x,=/m/x", "'=/m/x': the model 'x' is already given by 'x'"),
        ("=/a/x, = /b/x", "'= /b/x': the model 'x' is already given by '=/a/x'"),
        ("=/", "'=/': no model name, and the folder has none to serve it as"),
        # `a=` looked `a` up in the store: not what was written
        ("a=", "'a=': no folder after '=' (NAME=FOLDER serves FOLDER as NAME)"),
        ("b,a= ", "'a=': no folder after '='"),
    ],
)
def test_a_bad_entry_is_refused_by_name(spec: str, message: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_models(spec, _store)
    assert str(e.value).startswith(message), e.value


def test_the_pool_refuses_them_in_one_line() -> None:
    args = build_parser().parse_args(["pool", "--models", "a=/x,a=/y"])
    with pytest.raises(SystemExit) as e:
        args.func(args)
    assert str(e.value) == ("edgeinfer: error: --models: 'a=/y': the model 'a' is already given "
                            "by 'a=/x'; list each model once")  # fmt: skip
