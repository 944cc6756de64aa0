"""The local model store: models pulled once into a folder, re-sharded for fast parallel reads.

    <root>/                                     default ~/.cache/edgeinfer/models
        <name>/                                 what `edgeinfer pull SOURCE --name <name>` made
            model-00001-of-00004.safetensors    at most shard_bytes of tensor data each
            model.safetensors.index.json        tensor -> shard, as Hugging Face writes it
            config.json, tokenizer.json, ...    the source's other files, copied as they are
            edgeinfer-manifest.json             shards, sizes, checksums, tensors, and a
                                                checksum of every other file: written last
        .pull-<name>.<id>/                      a pull in progress (removed when it ends)
        .rm-<name>.<id>/model                   a model being removed
        .<name>.compress-<id>/                  `edgeinfer compress` writing into the store
        .<name>.import-<id>/                    `edgeinfer import-gguf` writing into the store

Each shard is a valid safetensors file laid out for the loader: the JSON header is padded with
spaces so the data starts at a multiple of 4096, and tensors are ordered by element size,
largest first, so every tensor's offset is a multiple of its element size and it can be a view
of an aligned read buffer without a copy. Dtypes stay as they are on disk.

A pull builds the whole model in a temporary folder inside the root (same filesystem), hashing
each shard as it writes it, and renames the finished folder into place: a reader sees the old
model or the new one, never a mix. A crash or Ctrl-C leaves nothing but that temporary folder,
which the pull removes on the way out. A pull holds a lock (flock) on a file in its temporary
folder for as long as it runs; a process killed outright (SIGKILL, a lost machine) leaves the
folder, with the lock gone, and the next pull or remove deletes such leftovers: at the edge, a
model's worth of disk is not left behind by an interrupted pull. A remove, `edgeinfer compress`
and `edgeinfer import-gguf` into the store lock their temporary folders the same way
(locked_folder), so their leftovers go too, and only theirs: never a folder still in use.

A pull or compression whose source is a model of a store (it has a manifest) checks what it reads
against the source's checksums: a corrupt model is refused, not copied into a new one with fresh
checksums that would hide the damage (see checked_source).

A model may be a symbolic link to a folder elsewhere: `rm` removes the link, never what it points
to. `pull` takes plain safetensors weights (or a GGUF); a compressed folder is refused: it comes
into the store by `edgeinfer compress ORIGINAL <store>/<name>`.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import fcntl
import json
import os
import re
import shutil
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from runtime.config import ModelLoadError
from runtime.manifest import (
    CHUNK_BYTES,
    COMPRESSED_MANIFEST_NAME,
    MANIFEST_NAME,
    ChunkHasher,
    Manifest,
    ShardEntry,
    TensorInfo,
    check_shard_files,
    file_digest,
    file_digests,
    is_compressed,
    read_manifest,
    tensors_in,
    verify_chunk,
    write_manifest,
)
from runtime.weights import TensorEntry, read_header

# 512 MiB: large enough that a 70B bf16 model is ~270 files and per-file costs (open, header
# parse, O_DIRECT set-up) vanish beside the read, small enough that one shard reads in about
# 0.1-0.25 s at NVMe speed, so the loader can place one shard while the next is read, and a
# corrupt shard costs only its own re-read.
DEFAULT_SHARD_BYTES = 512 << 20
ALIGN = 4096  # the data section of every shard starts at a multiple of this
INDEX_NAME = "model.safetensors.index.json"

Progress = Callable[[str], None]

_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}  # fmt: skip
# Files of a source folder that are weights in some format: never copied into the store.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".onnx")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
# The longest model name: the store's temporary folders add up to 23 characters to it
# (`.pull-<name>.<12 hex>`, `.<name>.compress-<12 hex>`, `.<name>.import-<12 hex>`), and a
# file name has 255 at most.
MAX_NAME = 200
# What interrupted pulls, removes, compressions and GGUF imports leave in the root (see `sweep`)
_LEFTOVER = re.compile(r"\.(pull|rm)-.+\.[0-9a-f]{12}|\..+\.(compress|import)-[0-9a-f]{12}")


class StoreError(ModelLoadError):
    """The store cannot do what was asked; the message names the model or file and what to do.
    (A ModelLoadError, so every entry point that reports those reports these too.)"""


@dataclass(frozen=True, slots=True)
class StoredModel:
    """One row of `ModelStore.list()`."""

    name: str
    path: Path
    total_bytes: int  # all of its shards
    shards: int
    source: str  # where it was pulled from ("" without a manifest)
    created: str  # when, UTC ISO 8601 ("" without a manifest)
    note: str = ""  # what is wrong with it, e.g. no manifest (not pulled by `edgeinfer pull`)


@dataclass(slots=True)
class _Meter:
    """Bytes done and the rate, reported at most every `every_s` seconds and once at the end
    (a pull of a large model runs for minutes; silence would look like a hang)."""

    total: int
    say: Progress
    verb: str  # what is done to the bytes: "written", "checked"
    done: int = 0
    every_s: float = 2.0
    t0: float = field(default_factory=time.monotonic)
    last: float = field(default_factory=time.monotonic)

    def advance(self, n: int, file: str) -> None:
        self.done += n
        now = time.monotonic()
        if self.done >= self.total or now - self.last >= self.every_s:
            self.last = now
            rate = self.done / max(now - self.t0, 1e-9) / 1e9
            self.say(
                f"{file}: {human_bytes(self.done)} of {human_bytes(self.total)} {self.verb} "
                f"({rate:.2f} GB/s)"
            )


class ModelStore:
    """A folder of pulled models, one sub-folder each (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()

    # ----- reading -------------------------------------------------------------------------

    def list(self) -> list[StoredModel]:
        """The models in the store, by name (folders without config.json or a manifest, and
        pulls in progress, are not models)."""
        if not self.root.is_dir():
            return []
        out = []
        for path in sorted(self.root.iterdir()):
            if path.name.startswith(".") or not path.is_dir():
                continue
            try:
                manifest = read_manifest(path)
            except ModelLoadError as e:
                out.append(StoredModel(path.name, path, 0, 0, "", "", f"corrupt manifest: {e}"))
                continue
            if manifest is not None:
                shards = len(manifest.shards)
                out.append(
                    StoredModel(
                        path.name,
                        path,
                        manifest.total_bytes,
                        shards,
                        manifest.source,
                        manifest.created,
                    )
                )
            elif is_compressed(path):  # `edgeinfer compress` output: its own manifest
                out.append(_compressed_row(path))
            elif (path / "config.json").is_file():
                files = list(path.glob("*.safetensors"))
                try:
                    size = sum(f.stat().st_size for f in files)
                except OSError as e:  # (a link to a file that is gone: this row, not the list)
                    out.append(StoredModel(path.name, path, 0, len(files), "", "",
                                           f"no manifest; unreadable: {e}"))  # fmt: skip
                    continue
                out.append(StoredModel(path.name, path, size, len(files), "", "", "no manifest"))
        return out

    def resolve(self, name_or_path: str) -> Path:
        """An existing folder as it is; otherwise the store's model of that name. A name the
        store does not have is an error listing what it has and how to pull."""
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            return path
        named = _NAME.fullmatch(name_or_path) is not None
        if named and (self.root / name_or_path).is_dir():
            return self.root / name_or_path
        if path.is_file() and path.suffix.lower() == ".gguf":  # (a name or a path)
            raise StoreError(
                f"{name_or_path}: no such model folder: it is a GGUF file; convert it into one "
                f"first: edgeinfer import-gguf {name_or_path} OUT_DIR (or into the store: "
                f"edgeinfer pull {name_or_path})"
            )
        if not named:  # a path, not a name
            what = "a file" if path.exists() else "nothing there"
            raise StoreError(
                f"{name_or_path}: no such model folder ({what}); give a Hugging Face model "
                "folder, or a model in the store (edgeinfer models; add one with: edgeinfer "
                "pull SOURCE)"
            )
        raise StoreError(
            f"{name_or_path!r} is neither a model folder nor a model in the store {self.root} "
            f"(it has: {self._names()}); pull it with: edgeinfer pull SOURCE --name {name_or_path}"
        )

    def verify(self, name: str, progress: Progress | None = None) -> builtins.list[str]:
        """Re-read every shard and every other file the manifest lists (config, tokenizer, ...)
        and check them against it: one line per problem (a missing, truncated or corrupt file,
        naming it and the bytes that differ); [] = sound. A manifest written before the other
        files got checksums has none for them: its shards are checked, and `progress` says the
        other files are not."""
        say = progress or (lambda _msg: None)
        folder = self.model_folder(name)
        if is_compressed(folder):  # `edgeinfer compress` output: a checksum per tensor
            from runtime.compression import read_manifest as read_compressed
            from runtime.compression import verify_compressed

            try:
                compressed = read_compressed(folder)
            except ModelLoadError as e:
                return [str(e)]
            total = sum(compressed.shards.values())
            meter = _Meter(total, say, "checked")
            return verify_compressed(folder, compressed, meter.advance)
        manifest = read_manifest(folder)
        if manifest is None:
            raise StoreError(
                f"{folder}: no {MANIFEST_NAME} (not pulled by `edgeinfer pull`), nothing to "
                f"check against; pull it again: edgeinfer pull SOURCE --name {name} --force"
            )
        meter = _Meter(manifest.total_bytes, say, "checked")
        problems = []
        for entry in manifest.shards:
            path = folder / entry.file
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                problems.append(f"{path}: missing (the manifest lists it with {entry.bytes} bytes)")
                continue
            if size != entry.bytes:
                what = "truncated" if size < entry.bytes else "wrong size"
                problems.append(f"{path}: {what}: {size} bytes, the manifest says {entry.bytes}")
                continue
            try:
                got = file_digests(path, manifest.chunk_bytes)
            except OSError as e:
                problems.append(f"{path}: cannot read ({e})")
                continue
            bad = [i for i, (a, b) in enumerate(zip(got, entry.xxh3_64, strict=True)) if a != b]
            if bad:
                ranges = ", ".join(
                    f"{i * manifest.chunk_bytes}..{min((i + 1) * manifest.chunk_bytes, size)}"
                    for i in bad
                )
                spans = [(i * manifest.chunk_bytes, (i + 1) * manifest.chunk_bytes) for i in bad]
                problems.append(
                    f"{path}: corrupt: checksum mismatch in bytes {ranges}{tensors_in(path, spans)}"
                )
            meter.advance(entry.bytes, entry.file)
        if manifest.files is None:
            say(f"{folder}: its manifest has no checksums of the other files (config, tokenizer, "
                "...): pulled by an older edgeinfer, they are not checked; pull it again with "
                "--force to cover them")  # fmt: skip
            return problems
        return problems + _check_files(folder, manifest.files)

    # ----- writing -------------------------------------------------------------------------

    def pull(
        self,
        source: str | os.PathLike[str],
        name: str | None = None,
        *,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
        force: bool = False,
        progress: Progress | None = None,
        origin: str | None = None,
    ) -> Path:
        """Write a model into the store and return its folder.

        `source`: a Hugging Face folder (model.safetensors, or shards with an index), a .gguf
        file (imported with runtime.gguf_import first), or the default model's name (from the
        installed package). `name` defaults to the folder's name or the file's stem. An existing
        model of that name is an error unless `force`, which replaces it atomically. `origin`
        is what the manifest records as the source (default: the source path)."""
        if shard_bytes <= 0:
            raise StoreError(f"shard size must be positive, got {shard_bytes}")
        say = progress or (lambda _msg: None)
        src, is_gguf, default_name = _classify(source)
        name = name or default_name
        _check_name(name, new=True)
        target = self.root / name
        if not is_gguf and is_compressed(src):
            raise _compressed_source(src, target)
        if not is_gguf:  # a config.json no load can read: refused now, nothing written
            read_config_json(src)
        if target.exists() and not force:
            raise _exists(target, name)
        self.sweep(say)
        try:  # (the staging folder too: a read-only store, a store path under a file, ...)
            with self.staging(name) as tmp:
                folder = src
                if is_gguf:
                    folder = _import_gguf(src, tmp / "gguf", lambda m: say(f"converting: {m}"))
                out = tmp / "model"
                out.mkdir()
                write_model(folder, out, name, origin or str(src.resolve()), shard_bytes, say)
                self._install(out, target, force)
        except OSError as e:
            raise StoreError(f"pulling {source} into {target}: {e}") from e
        say(f"pulled {name} into {target}")
        return target

    def remove(self, name: str) -> Path:
        """Delete a model from the store (renamed aside first, into a locked folder, so nobody
        sees half of it and no other pull's or remove's sweep deletes it under this one); a
        model that is a symbolic link loses the link, never what it points to."""
        _check_name(name)
        folder = self.root / name
        if not folder.is_symlink():  # (a link is removed even when it points nowhere)
            folder = self.model_folder(name)
        self.sweep()
        try:
            with locked_folder(self.root / f".rm-{name}.{uuid.uuid4().hex[:12]}") as aside:
                folder.rename(aside / "model")
                _delete(aside / "model")  # (here, not in locked_folder's cleanup: errors count)
        except OSError as e:
            raise StoreError(f"{folder}: cannot remove ({e})") from e
        return folder

    def sweep(self, progress: Progress | None = None) -> builtins.list[Path]:
        """Delete what killed pulls, removals, compressions and GGUF imports left in the root:
        a `.pull-*`, `.rm-*`, `.<name>.compress-*` or `.<name>.import-*` folder whose lock no
        live process holds (one that is a symbolic link: the link alone). Returns the paths
        deleted."""
        if not self.root.is_dir():
            return []
        gone = []
        for path in sorted(self.root.iterdir()):
            kind = _LEFTOVER.fullmatch(path.name)
            if kind is None:
                continue
            if path.is_symlink():  # not ours to follow: the link goes, its target stays
                size = 0
                with contextlib.suppress(OSError):
                    path.unlink()
            elif not path.is_dir() or not _abandoned(path):
                continue
            else:
                size = _tree_bytes(path)
                shutil.rmtree(path, ignore_errors=True)
            if not path.exists() and not path.is_symlink():
                gone.append(path)
                if progress is not None:
                    what = kind.group(2) or "pull or remove"
                    progress(f"deleted {path.name} ({human_bytes(size)}), left by an "
                             f"interrupted {what}")  # fmt: skip
        return gone

    @contextmanager
    def staging(self, name: str) -> Iterator[Path]:
        """A temporary folder inside the root (so a rename can move what is built in it into
        place), removed when the block ends, however it ends; locked while it exists, so that
        `sweep` leaves it alone (and deletes it once its process is gone without removing it)."""
        self.root.mkdir(parents=True, exist_ok=True)
        with locked_folder(self.root / f".pull-{name}.{uuid.uuid4().hex[:12]}") as tmp:
            yield tmp

    def model_folder(self, name: str) -> Path:
        """The folder of the store's model `name` (never a folder of that name elsewhere, such
        as in the working directory); StoreError listing the store's models if it has none."""
        _check_name(name)
        folder = self.root / name
        if not folder.is_dir():
            raise StoreError(
                f"{name!r} is not a model in the store {self.root} (it has: {self._names()})"
            )
        return folder

    def _names(self) -> str:
        return ", ".join(m.name for m in self.list()) or "no models yet"

    def _install(self, built: Path, target: Path, force: bool) -> None:
        """Rename `built` to `target`: atomically replacing an existing one when `force` (the
        old model ends up at `built`, removed with the staging folder), else never over one."""
        if not force:
            try:
                if _rename2(built, target, _RENAME_NOREPLACE):
                    return
            except FileExistsError:
                raise _exists(target, target.name) from None
            if target.exists():  # no renameat2 here: check, then rename (a small window)
                raise _exists(target, target.name)
            built.rename(target)
        elif not target.exists() or not _rename2(built, target, _RENAME_EXCHANGE):
            if target.exists():  # no atomic exchange here: move the old one aside first
                target.rename(built.with_name("old"))
            built.rename(target)


def write_model(
    src: Path, out: Path, name: str, origin: str, shard_bytes: int, say: Progress
) -> Manifest:
    """Re-shard the weights of Hugging Face folder `src` into the empty folder `out`, copy its
    other files, write the index and, last, the manifest. A `src` with a manifest (a model of a
    store) is checked against it as it is read (checked_source, _SourceReads)."""
    source = checked_source(src)
    tensors = _source_tensors(src, source)
    groups = plan_shards([t.end - t.begin for _, t in tensors], shard_bytes)
    total = sum(t.end - t.begin for _, t in tensors)
    manifest = Manifest(name, origin, CHUNK_BYTES,
                        created=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"))  # fmt: skip
    meter = _Meter(total, say, "written")
    with ExitStack() as stack:
        fds: dict[Path, int] = {}
        for path in {p for p, _ in tensors}:
            fds[path] = os.open(path, os.O_RDONLY)
            stack.callback(os.close, fds[path])
        reads = _SourceReads(fds, source)
        for k, group in enumerate(groups, start=1):
            file = f"model-{k:05d}-of-{len(groups):05d}.safetensors"
            # element size descending (stable: source order within a size)
            members = sorted((tensors[i] for i in group), key=lambda pt: -pt[1].dtype.itemsize)
            entry = _write_shard(out / file, members, reads, meter)
            manifest.shards.append(entry)
            for _, t in members:
                manifest.tensors[t.name] = TensorInfo(file, _ST_DTYPES[t.dtype], t.shape)
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.startswith(".") and _is_extra(f.name):
            shutil.copyfile(f, out / f.name)
    weight_map = {n: t.shard for n, t in manifest.tensors.items()}
    (out / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    shards = {s.file for s in manifest.shards}
    manifest.files = {f.name: file_digest(f) for f in sorted(out.iterdir())
                      if f.is_file() and f.name not in shards}  # fmt: skip
    write_manifest(out, manifest)
    return manifest


def plan_shards(sizes: list[int], shard_bytes: int) -> list[list[int]]:
    """Group tensors (by index, in order) into shards of at most `shard_bytes` of data (a
    tensor larger than that alone), balanced: as few shards as the limit allows, of about the
    same size (a 1.1 GB model at 512 MiB is 3 shards of ~370 MB, not 512 + 512 + 76)."""
    total = sum(sizes)
    target = -(-total // max(1, -(-total // shard_bytes)))
    groups: list[list[int]] = [[]]
    size = 0
    for i, n in enumerate(sizes):
        if groups[-1] and (size >= target or size + n > shard_bytes):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def human_bytes(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def parse_size(text: str) -> int:
    """'512MB' (10^6), '1GiB' (2^30), '64k' (2^10), '4096' -> bytes; ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*", text.lower())
    if not m:
        raise ValueError(f"{text!r} is not a size (e.g. 512MB, 1GiB, 65536)")
    number, prefix, unit = m.groups()
    power = " kmgt".index(prefix) if prefix else 0
    base = 1000 if unit == "b" else 1024  # MB is decimal; MiB and a bare M are binary
    return int(float(number) * base**power)


# ---------------------------------------------------------------------------------------------
# Sources


def read_config_json(folder: Path) -> dict[str, Any]:
    """A source folder's config.json as a JSON object; StoreError naming it for one that is not
    (unreadable, not JSON, nested past the parser's depth, a list), which no load could read.
    Not checked as a model's config (ModelConfig): the store keeps what this edgeinfer cannot
    run as well."""
    path = folder / "config.json"
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise StoreError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise StoreError(f"{path}: not a JSON object (got {type(raw).__name__})")
    return raw


def _classify(source: str | os.PathLike[str]) -> tuple[Path, bool, str]:
    """(path, is it a GGUF file, the model's default name) for a pull's source."""
    path = Path(source).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise StoreError(f"{path}: not a Hugging Face model folder (no config.json)")
        return path, False, path.resolve().name
    if path.is_file():
        with path.open("rb") as f:
            if path.suffix == ".gguf" or f.read(4) == b"GGUF":
                return path, True, path.stem
        raise StoreError(f"{path}: expected a Hugging Face model folder or a .gguf file")
    from runtime.model_cache import DEFAULT_MODEL, bundled_gguf_path

    if str(source) == DEFAULT_MODEL:
        return bundled_gguf_path(), True, DEFAULT_MODEL
    raise StoreError(
        f"{source}: no such folder or file (a pull's source is a Hugging Face model folder, "
        f"a .gguf file, or {DEFAULT_MODEL})"
    )


def _import_gguf(path: Path, out: Path, say: Progress) -> Path:
    from runtime.gguf_common import GGUFImportError
    from runtime.gguf_import import import_gguf

    try:
        return import_gguf(path, out, progress=say)
    except GGUFImportError as e:
        raise StoreError(str(e)) from e


def checked_source(folder: Path) -> Manifest | None:
    """The manifest of a folder about to be copied (by a pull, or `edgeinfer compress`), or
    None where it has none (a plain Hugging Face folder: nothing to check against). With one
    (a model of a store), its shards must be there at their sizes and its other files (config,
    tokenizer, ...) match their checksums, or a StoreError names the file: a corrupt model must
    not come out as a new one with fresh checksums that `verify` would pass. The shards' bytes
    are checked by whoever reads them, against the manifest returned."""
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    check_shard_files(folder, manifest)
    problems = _check_files(folder, manifest.files or {})
    if problems:
        raise StoreError(f"{problems[0]}: a corrupt model is not copied; pull it again")
    return manifest


def _source_tensors(folder: Path, manifest: Manifest | None) -> list[tuple[Path, TensorEntry]]:
    """Every tensor of a folder's safetensors files with the file it is in, file by file in
    file order; names must be unique, and match the index when there is one, and the manifest
    when there is one (a header that parses but says otherwise is a corrupt shard)."""
    from runtime.loader import safetensors_files

    out: list[tuple[Path, TensorEntry]] = []
    seen: dict[str, Path] = {}
    files = safetensors_files(folder) if manifest is None else check_shard_files(folder, manifest)
    for path in files:
        for t in read_header(path).tensors:
            if t.name in seen:
                raise StoreError(f"{path}: tensor {t.name!r} is also in {seen[t.name]}")
            seen[t.name] = path
            out.append((path, t))
            if manifest is not None:
                _check_listed(path, t, manifest)
    if manifest is not None and len(seen) != len(manifest.tensors):
        missing = sorted(set(manifest.tensors) - set(seen))
        raise StoreError(
            f"{folder}: corrupt: the manifest lists {len(manifest.tensors)} tensors, the shards' "
            f"headers {len(seen)} (e.g. not {missing[0]!r}); pull it again"
        )
    index = folder / INDEX_NAME
    if index.is_file():
        try:  # (checked by safetensors_files, but not where a manifest lists the shards)
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError(f"weight_map is a {type(weight_map).__name__}, not an object")
        except (OSError, ValueError, RecursionError, KeyError, TypeError) as e:
            raise StoreError(f"{index}: not a valid safetensors index ({e})") from e
        listed = set(weight_map)
        if listed != set(seen):
            odd = sorted(listed ^ set(seen))
            raise StoreError(
                f"{index}: lists {len(listed)} tensors, the shards hold {len(seen)} "
                f"({len(odd)} differ, e.g. {odd[:3]})"
            )
    return out


def _check_listed(path: Path, t: TensorEntry, manifest: Manifest) -> None:
    """A tensor of a shard's header as the manifest lists it, or a StoreError naming both."""
    got = TensorInfo(path.name, _ST_DTYPES[t.dtype], t.shape)
    want = manifest.tensors.get(t.name)
    if got != want:
        listed = "does not list it" if want is None else (
            f"has {want.dtype} {list(want.shape)} in {want.shard}")  # fmt: skip
        raise StoreError(
            f"{path}: corrupt: its header has tensor {t.name!r} as {got.dtype} "
            f"{list(got.shape)}, the manifest {listed}; pull it again"
        )


def _check_files(folder: Path, files: dict[str, str]) -> list[str]:
    """`verify` of the files a manifest lists beside the shards: one line per problem."""
    problems = []
    for file, want in sorted(files.items()):
        path = folder / file
        try:
            got = file_digest(path)
        except FileNotFoundError:
            problems.append(f"{path}: missing (the manifest lists it)")
            continue
        except OSError as e:
            problems.append(f"{path}: cannot read ({e})")
            continue
        if got != want:
            problems.append(
                f"{path}: corrupt: checksum mismatch (xxh3-64 {got}, the manifest says {want})"
            )
    return problems


def _is_extra(file: str) -> bool:
    """A file a pull copies as it is: anything but weights, the index and a manifest."""
    return file not in (INDEX_NAME, MANIFEST_NAME) and not file.endswith(_WEIGHT_SUFFIXES)


# ---------------------------------------------------------------------------------------------
# Writing a shard


class _SourceReads:
    """The reads of a pull's source files. A source with a manifest (a model of a store) is
    read a whole chunk (the manifest's chunk_bytes) at a time, checked against its checksum
    before any of its bytes are copied (ModelLoadError naming the shard and the byte range), and
    kept for the next reads, a few chunks at most: a shard's tensors are copied in its own file
    order (both sort by element size, stably), so each chunk is read once. Chunk 0, which holds
    the header that the copy was planned from, is checked before any of its file is copied.
    Without a manifest, plain reads into one buffer, nothing to check."""

    KEEP = 4  # chunks kept: those of the few source files one new shard draws from

    def __init__(self, fds: dict[Path, int], manifest: Manifest | None) -> None:
        self.fds = fds
        self.manifest = manifest
        self.buf = memoryview(bytearray(CHUNK_BYTES if manifest is None else 0))
        self.chunks: OrderedDict[tuple[Path, int], memoryview] = OrderedDict()
        self.headed: set[Path] = set()  # the files whose chunk 0 is checked

    def read(self, path: Path, pos: int, limit: int) -> memoryview:
        """Bytes of `path` from `pos`: at least one, at most `limit`."""
        if self.manifest is None:
            n = os.preadv(self.fds[path], [self.buf[: min(len(self.buf), limit)]], pos)
            if n == 0:
                raise ModelLoadError(f"{path}: truncated while reading (at byte {pos})")
            return self.buf[:n]
        if path not in self.headed:
            self._chunk(path, 0)
            self.headed.add(path)
        index, at = divmod(pos, self.manifest.chunk_bytes)
        chunk = self._chunk(path, index)
        if at >= len(chunk):  # (sizes are checked first: a file cut short meanwhile)
            raise ModelLoadError(f"{path}: truncated while reading (at byte {pos})")
        return chunk[at : at + limit]

    def _chunk(self, path: Path, index: int) -> memoryview:
        """Chunk `index` of `path`, read and checked once while it is kept."""
        assert self.manifest is not None
        key = (path, index)
        if key in self.chunks:
            self.chunks.move_to_end(key)
            return self.chunks[key]
        entry = self.manifest.shard(path.name)
        assert entry is not None  # (the files are the manifest's: checked_source)
        start = index * self.manifest.chunk_bytes
        size = max(0, min(self.manifest.chunk_bytes, entry.bytes - start))
        # the oldest kept chunk's buffer, when KEEP are kept: a few buffers for the whole pull
        buf = self.chunks.popitem(last=False)[1].obj if len(self.chunks) >= self.KEEP else None
        if not isinstance(buf, bytearray) or len(buf) < size:
            buf = bytearray(self.manifest.chunk_bytes)
        data = memoryview(buf)[:size]
        done = 0
        while done < size:
            n = os.preadv(self.fds[path], [data[done:]], start + done)
            if n == 0:
                raise ModelLoadError(f"{path}: truncated while reading (at byte {start + done})")
            done += n
        verify_chunk(self.manifest, path, index, data)
        self.chunks[key] = data
        return data


def _write_shard(
    path: Path,
    tensors: list[tuple[Path, TensorEntry]],
    reads: _SourceReads,
    meter: _Meter,
) -> ShardEntry:
    """Write one safetensors shard with its data at a multiple of ALIGN, hashing as it goes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for _, t in tensors:
        n = t.end - t.begin
        header[t.name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape),
                          "data_offsets": [offset, offset + n]}  # fmt: skip
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)  # the format allows trailing spaces in the header
    head = len(raw).to_bytes(8, "little") + raw
    hasher = ChunkHasher(CHUNK_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        _write_all(fd, memoryview(head), hasher)
        for src, t in tensors:
            pos = t.begin
            while pos < t.end:
                data = reads.read(src, pos, t.end - pos)
                _write_all(fd, data, hasher)
                pos += len(data)
                meter.advance(len(data), path.name)
        os.fsync(fd)  # the data is on the drive before the manifest says it is there
    finally:
        os.close(fd)
    return ShardEntry(path.name, len(head) + offset, hasher.digests())


def _write_all(fd: int, data: memoryview, hasher: ChunkHasher) -> None:
    hasher.update(data)
    while data:
        data = data[os.write(fd, data) :]


# ---------------------------------------------------------------------------------------------
# Names and renames


def _check_name(name: str, new: bool = False) -> None:
    """Refuse what is not a model name; a `new` one (a pull's) also over MAX_NAME characters
    (a model pulled under a longer name before the limit can still be used and removed)."""
    if not _NAME.fullmatch(name):
        raise StoreError(
            f"{name!r} is not a model name (letters, digits, '.', '_', '+', '-'; "
            f"not starting with '.', no '/')"
        )
    if new and len(name) > MAX_NAME:
        raise StoreError(
            f"{name[:40]!r}... is not a model name: {len(name)} characters, a name has "
            f"{MAX_NAME} at most; pick a shorter --name"
        )


def _compressed_source(src: Path, target: Path) -> StoreError:
    """The error for a pull of a compressed folder, naming what it was compressed from."""
    try:
        manifest = json.loads((src / COMPRESSED_MANIFEST_NAME).read_text())
        origin = str(manifest["source"])
        cast = " --cast-bf16" if manifest.get("cast_from") else ""  # as it was made
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        origin, cast = "", ""
    return StoreError(
        f"{src}: a compressed copy ({COMPRESSED_MANIFEST_NAME}); `edgeinfer pull` re-shards "
        f"plain safetensors weights and does not take compressed ones: pull the original, or "
        f"compress it into the store: edgeinfer compress{cast} {origin or 'ORIGINAL'} {target}"
    )


def _exists(target: Path, name: str) -> StoreError:
    return StoreError(
        f"{name!r} is already in the store ({target}); add --force to replace it, "
        f"or pick another --name"
    )


_RENAME_NOREPLACE, _RENAME_EXCHANGE = 1, 2  # linux/fs.h
_AT_FDCWD = -100


def _rename2(src: Path, dst: Path, flags: int) -> bool:
    """Linux renameat2(2): False where it is not available (another OS, an old kernel or a
    filesystem without it), so the caller falls back to plain renames."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), flags) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(dst))


def _compressed_row(path: Path) -> StoredModel:
    """A compressed folder's row, from its manifest (runtime/compression.py writes it), read
    here as JSON so that listing the store does not load the decoders."""
    try:
        raw = json.loads((path / COMPRESSED_MANIFEST_NAME).read_text(encoding="utf-8"))
        size = int(raw["compressed_bytes"])
        ratio = size / int(raw["bf16_bytes"]) if raw.get("bf16_bytes") else 0.0
        return StoredModel(path.name, path, size, len(raw["shards"]), str(raw["source"]),
                           str(raw["created"]), f"compressed, {ratio:.1%} of bfloat16")  # fmt: skip
    # (ArithmeticError: 1e400, a "bf16_bytes" of "0"; RecursionError: nested too deep)
    except (OSError, ValueError, LookupError, TypeError, ArithmeticError, RecursionError) as e:
        return StoredModel(path.name, path, 0, 0, "", "", f"corrupt compressed manifest: {e}")


LOCK_NAME = ".lock"  # in a temporary folder of the store: flock-ed while it is in use


@contextmanager
def locked_folder(path: Path) -> Iterator[Path]:
    """Make the folder `path`, hold a lock (flock) on its LOCK_NAME file while the block runs,
    and remove the folder when the block ends, however it ends (a rename out of it first is
    fine). While the lock is held, `ModelStore.sweep` leaves the folder alone; a process killed
    outright drops the lock, and the next sweep of the store deletes what it left."""
    path.mkdir()
    try:
        lock = os.open(path / LOCK_NAME, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # (new and ours alone: never waits)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        os.close(lock)


def _delete(path: Path) -> None:
    """A folder with what it holds; a symbolic link alone (never what it points to). What
    vanishes meanwhile is no error: another process (an older edgeinfer's sweep, which took
    every `.rm-*` folder) may be deleting the same folder."""
    if path.is_symlink():
        path.unlink(missing_ok=True)
        return
    for _ in range(8):  # (each round deletes what it gets to: it ends unless refilled)
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            if not os.path.lexists(path):
                return
    shutil.rmtree(path)  # still there: say why


def _abandoned(folder: Path) -> bool:
    """Whether no live process holds the lock of a temporary folder (one without a lock file,
    a minute old, is a process killed before it made it, or from before locks)."""
    try:
        fd = os.open(folder / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:  # (the lock comes just after its folder: give it a minute)
        try:
            return time.time() - folder.stat().st_mtime > 60
        except OSError:
            return False
    except OSError:
        return False  # unreadable: leave it to whoever can tell
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # a pull is running in it
    finally:
        os.close(fd)  # (closing the only descriptor drops the lock just taken)
    return True


def _tree_bytes(folder: Path) -> int:
    total = 0
    for base, _dirs, files in os.walk(folder):
        for f in files:
            with contextlib.suppress(OSError):  # (gone meanwhile)
                total += os.lstat(os.path.join(base, f)).st_size
    return total
