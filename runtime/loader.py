"""Load a Hugging Face model folder (config, single or sharded safetensors) into our model.

    config.json, shard list (the manifest's, else the index's), every shard's header
      ─▶ build the model; map each checkpoint tensor to its parameter (q/k/v and gate/up into
         row ranges of fused ones, each expert's tensors into its rows of the layer's stacked
         experts; split over ranks (runtime.parallel), only this rank's layers, experts, and
         rows or columns of each tensor take memory: the reader skips the chunks of a shard that
         hold none of its bytes, and drops the rest of a chunk it reads); every shape, dtype, missing or unexpected tensor
         and the memory needed (rank 0 of a split model: every rank's, on this host) checked,
         naming the file   (all before any weight is read)
      ─▶ one arena per dtype holds every parameter; each parameter becomes a view of it, placed
         at the offset modulo 4096 at which its bytes sit in the file
      ─▶ runtime.shard_reader reads every shard, in file order, O_DIRECT, straight into the
         parameters (checking each chunk against the manifest, if any)   `start_load` returns
      ─▶ tensors stored in another dtype (bfloat16 on disk for a float32 model) land in a
         staging arena and are converted into place once, shard by shard   `PendingLoad.finish`

No copy after the read for a tensor stored in the model's dtype, except the few KiB where one
tensor ends and the next begins inside a 4096-byte block, and any piece of a fused parameter
whose file offset does not line up with its neighbours' (copied from the reader's scratch chunk,
on the reading thread). `start_load` returns as soon as the reads are queued, so a caller can
do other start-up work (imports, the tokenizer, the KV cache) while the drive works.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
import time
from collections.abc import Generator, Iterator, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from runtime.config import DTYPES, ModelConfig, ModelLoadError
from runtime.host_memory import available_memory
from runtime.manifest import (
    COMPRESSED_MANIFEST_NAME,
    check_shard_files,
    is_compressed,
    read_manifest,
)
from runtime.model import ExpertParallel, LlamaForCausalLM
from runtime.model.llama import is_layer_index
from runtime.model.moe import SINGLE
from runtime.parallel import RankPlace
from runtime.shard_reader import ALIGN, Arena, DeviceArena, FileRead, ReadStats, ShardReads, Span
from runtime.weights import Shard, TensorEntry, chunk_checks, read_header

# import-gguf's marker, the last file written into a folder it made (runtime.gguf_import); here so
# that the engine can tell such a folder without importing gguf
IMPORT_MARKER = "edgeinfer_import.json"
DEVICE_ALIGN = 256  # where a parameter starts in device memory (CUDA's allocations' alignment)

if TYPE_CHECKING:
    from runtime.ranks import RankGroup


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a folder: the shards named by the index, or the single file."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, RecursionError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from e
        # (a value that is no name stands as None: a list, unhashable, was a TypeError here)
        names = (
            {v if isinstance(v, str) else None for v in weight_map.values()}
            if isinstance(weight_map, dict)
            else {None}
        )
        plain = {n for n in names if isinstance(n, str) and n and Path(n).name == n}
        if plain != names:
            raise ModelLoadError(
                f"{index}: not a valid safetensors index (weight_map must map tensor names to "
                "file names in the model folder)"
            )
        files = [model_dir / name for name in sorted(plain)]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: missing (listed in {index.name})")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    if any(model_dir.glob("*.ei11")):
        raise ModelLoadError(
            f"{model_dir}: compressed shards (*.ei11) but no {COMPRESSED_MANIFEST_NAME}: the "
            "copy is incomplete; copy the whole folder again, or compress the model again"
        )
    raise ModelLoadError(
        f"{model_dir}: no model.safetensors or model.safetensors.index.json "
        "(for a GGUF file, run `edgeinfer import-gguf FILE OUT_DIR` first)"
    )


# Pages of weight bytes that a plain folder's revision hashes (model_revision), spread over all
# the shards' data: a bounded cost (one page read each, all queued at once) at any model size.
REVISION_SAMPLES = 64
_PAGE = 4096
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio: sample i sits at frac(i / phi) of the data


def model_revision(model_dir: str | Path) -> str:
    """A short fingerprint of a model folder's weights (16 hex digits): equal fingerprints lay
    out the same KV cache for the same tokens, so the prefix cache, the gateway's prefix index
    and prefill-to-decode KV transfer all key on it. Always config.json, then by kind of folder:

    - compressed (runtime.compression): its manifest's format, shards and every tensor's
      checksum (manifest_fingerprint).
    - pulled into the store (edgeinfer-manifest.json): the manifest's shard names, sizes and
      per-chunk checksums, which cover every byte of every shard, and its tensors
      (Manifest.fingerprint); not the name, when or from where it was pulled. The manifest is
      trusted without reading the shards because every load checks it: the loader refuses a
      shard whose size differs and verifies each chunk it reads against its checksum before the
      engine is up, so a worker whose files disagree with their manifest fails to start rather
      than serve under the manifest's revision.
    - a plain Hugging Face folder: every shard's size and safetensors header (names, dtypes,
      shapes, offsets), and REVISION_SAMPLES pages (4 KiB) of weight bytes spread over all the
      shards' data sections taken end to end, at offsets that depend on the sizes alone (a
      golden-ratio sequence: no period of the layout, such as a layer's tensors, lines up with
      it, and no gap between samples is wider than 2.2% of the data). Data of at most
      REVISION_SAMPLES pages is hashed whole. Plain buffered reads of one page each, readahead
      off and all of them queued at once (POSIX_FADV_WILLNEED), leaving out the pages the
      loader probes to tell a file in the page cache: whatever the model's size, 0.3 ms from
      the page cache, about 1 ms from a cold one on the dev VM's disk (5.5 ms read one by one).

      What the sample catches: a fine-tune (every tensor changes), or any change to a share f
      of the bytes spread through the layers (a LoRA merged into some projections), which gets
      about f * REVISION_SAMPLES samples (SmolLM2's v_proj, 2.5% of its bytes, gets 1), and any
      change to a stretch of the data longer than 2.2% of it (in a model of 30 layers, one
      layer retrained). What it does not catch: a change confined to bytes no sample reads (a
      few edited rows, the norms, one layer of a deeper model). For such weights, `edgeinfer
      pull` the folder (a checksum of every byte) or set EngineConfig.model_revision.

    Two copies of one model agree only within a kind: a plain folder and its pull (re-sharded:
    other bytes at each offset) are two revisions, which shares no KV but is never wrong."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    if is_compressed(model_dir):  # its manifest names every tensor with its checksum
        from runtime.compression import manifest_fingerprint

        h.update(manifest_fingerprint(model_dir))
        return h.hexdigest()[:16]
    manifest = read_manifest(model_dir)
    if manifest is not None:
        h.update(manifest.fingerprint())
        return h.hexdigest()[:16]
    with ExitStack() as stack:
        layout = []  # (descriptor, file size, where its data starts)
        for f in safetensors_files(model_dir):
            fd = os.open(f, os.O_RDONLY)
            stack.callback(os.close, fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead: a page a sample
            size = os.fstat(fd).st_size
            n = int.from_bytes(os.pread(fd, 8, 0), "little")
            h.update(size.to_bytes(8, "little"))
            h.update(os.pread(fd, min(n, 64 << 20), 8))
            layout.append((fd, size, min(8 + n, size)))
        for piece in _weight_samples(layout):
            h.update(piece)
    return h.hexdigest()[:16]


def _weight_samples(layout: list[tuple[int, int, int]]) -> Iterator[bytes]:
    """model_revision's sample of the weight bytes of shards given as (descriptor, size, data
    start): REVISION_SAMPLES pages, at offsets that depend on the sizes alone, in file order."""
    spans = [size - start for _, size, start in layout]
    total = sum(spans)
    if total <= REVISION_SAMPLES * _PAGE:  # small: all of it
        for fd, size, start in layout:
            yield os.pread(fd, size - start, start)
        return
    wanted = sorted((i * _GOLDEN % (1 << 64)) * total >> 64 for i in range(REVISION_SAMPLES))
    pages = []  # (descriptor, page)
    k, before = 0, 0  # the shard the next sample is in, and the data of the shards before it
    for at in wanted:
        while at >= before + spans[k]:
            before += spans[k]
            k += 1
        fd, size, start = layout[k]
        page = (start + at - before) // _PAGE
        # Not the pages the loader probes to tell a file in the page cache (shard_reader's
        # _cached: the middle and the last), or the next start would read the file buffered.
        while page > 0 and page in (size // 2 // _PAGE, (size - 1) // _PAGE):
            page -= 1
        pages.append((fd, page))
    for fd, page in pages:  # every read queued at once (from a cold drive, in parallel)
        os.posix_fadvise(fd, page * _PAGE, _PAGE, os.POSIX_FADV_WILLNEED)
    for fd, page in pages:
        yield os.pread(fd, _PAGE, page * _PAGE)


def resolve_dtype(requested: str, cfg: ModelConfig) -> torch.dtype:
    """The dtype to run in: the requested one, or the checkpoint's for "auto"."""
    if requested != "auto":
        return DTYPES[requested]
    name = cfg.torch_dtype.removeprefix("torch.")
    if name not in DTYPES:
        raise ModelLoadError(f"config.json: torch_dtype {cfg.torch_dtype!r} is not supported")
    return DTYPES[name]


@dataclass(slots=True)
class _Piece:
    """One checkpoint tensor (or the rows of it that are read) and the rows of a parameter it
    fills. Rows: of the parameter seen as 2-D (-1, last dim); of a 1-D one, its elements."""

    shard: Shard
    tensor: TensorEntry
    param: str
    row: int  # first row of the parameter it fills
    rows: int  # rows it fills
    begin: int  # its bytes in the file: all of the tensor's, or the rows read
    end: int
    nbytes: int  # its bytes in the parameter's dtype
    col_begin: int = 0  # bytes into each row where the read starts (a column slice)
    col_bytes: int | None = None  # bytes read of each row; None: whole rows, begin to end

    def file_spans(self) -> list[tuple[int, int]]:
        """[begin, end) of the bytes read: one range, or one per row of a column slice."""
        if self.col_bytes is None:
            return [(self.begin, self.end)]
        row_bytes = (self.end - self.begin) // self.rows
        firsts = range(self.begin + self.col_begin, self.end, row_bytes)
        return [(b, b + self.col_bytes) for b in firsts]


@dataclass(slots=True)
class PendingLoad:
    """A model whose weights are being read into it (`start_load`); `finish` waits for them."""

    model: LlamaForCausalLM
    model_dir: Path
    dtype: str  # as asked ("auto" or a name): the engine checks that it asked for the same
    stats: ReadStats
    reads: ShardReads | _Decoding
    nbytes: int  # memory the parameters take
    memory_before: int  # bytes available (host or container: host_memory) before any was allocated
    # memory the parameters of every rank on this host take: rank 0's load of a split model
    # counts all the ranks' (they share the host's memory, which memory_before was measured
    # before any of them took); any other load, nbytes
    host_nbytes: int
    revision: str = ""  # model_revision of the folder as start_load found it
    # per shard: (staged tensor in its file dtype, its place in the parameter) to convert
    conversions: list[list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=list)
    started: float = 0.0  # time.perf_counter() when start_load began
    queued: float = 0.0  # ... when it had checked everything and queued the reads
    placed: float = 0.0  # ... when finish had every weight in place
    ranks: RankGroup | None = None  # the other ranks of a split model (this is rank 0's load)
    weight_dtype: str = "auto"  # as asked, likewise

    def finish(self) -> LlamaForCausalLM:
        """Wait for every shard; convert what was stored in another dtype; the model, ready.
        Once done, a later call returns the model at once."""
        if self.placed:
            return self.model
        try:
            for i, conversions in enumerate(self.conversions):
                self.reads.wait(i)
                for staged, dest in conversions:
                    dest.copy_(staged)
                conversions.clear()  # the staging memory goes with the last reference to it
        finally:
            self.reads.close()
        self.placed = time.perf_counter()
        return self.model.eval()

    def close(self) -> None:
        """Give up (start-up failed elsewhere): stop the reads that are left."""
        self.reads.close()


def start_load(
    model_dir: str | Path,
    dtype: str = "auto",
    max_model_len: int | None = None,
    *,
    threads: int = 4,
    direct: bool = True,
    stats: ReadStats | None = None,
    ep: ExpertParallel = SINGLE,
    place: RankPlace | None = None,
    weight_dtype: str = "auto",
    device: str | torch.device = "cpu",
    staging: bool | None = None,
) -> PendingLoad:
    """Check a model folder, build the model, and start reading its weights into it (see the
    module docstring). `weight_dtype`: how the linear layers' weights, the embedding and the LM
    head are stored when not in the model's dtype ("auto": in it; see LlamaForCausalLM). Raises
    ModelLoadError naming the file and what was expected for anything wrong that can be seen
    without reading the weights; a corrupt or short read is raised by `finish`. `place`: this
    rank's part of the model, or `ep`: its share of the experts (ValueError if the model cannot
    be split so).

    `device`: where the parameters go. On a GPU they are read through pinned host buffers and
    copied on asynchronously as each chunk arrives (runtime.shard_reader.StagingRing), so that
    the copies overlap the reads and no host copy of the model is made; the model's buffers
    (e.g. rotary tables) stay on the host until the model is moved (`.to(device)`). A compressed
    folder is decoded on the host whatever the device. `staging`: whether to read through the
    staging buffers (default: on any device but the CPU; True on the CPU runs the GPU's path,
    for tests)."""
    t0 = time.perf_counter()
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"{path}: not a folder")
    cfg = ModelConfig.from_dir(path)
    # The weights' revision now, from the manifest and files about to be read, not once they
    # are in: a folder replaced meanwhile (`edgeinfer pull --force` of a new version) must not
    # lend its revision, which keys the prefix cache and KV transfer, to the old weights.
    revision = model_revision(path)
    torch_dtype = resolve_dtype(dtype, cfg)
    weights = torch_dtype if weight_dtype == "auto" else DTYPES[weight_dtype]
    if is_compressed(path):
        pending = _start_compressed(path, cfg, torch_dtype, weights, dtype, weight_dtype,
                                    max_model_len, threads, direct, stats, t0, ep, place)  # fmt: skip
        pending.revision = revision
        return pending
    manifest = read_manifest(path)
    files = check_shard_files(path, manifest) if manifest else safetensors_files(path)
    shards = [read_header(f) for f in files]  # every header before any weight
    target = torch.device(device)
    staged = target.type != "cpu" if staging is None else staging
    if not staged and place is None and ep is SINGLE:  # the whole model, into host memory: an
        # early (low) estimate, before building it, so that one tensor larger than the host
        # can hold is this error too, not the allocator's
        itemsize = min(torch_dtype.itemsize, weights.itemsize)
        need = sum(math.prod(t.shape) for s in shards for t in s.tensors) * itemsize
        if need > (have := available_memory()):
            raise ModelLoadError(f"{path}: the weights need {_size(need)} of memory (as "
                                 f"{torch_dtype}), only {_size(have)} is available")  # fmt: skip
    _check_sizes(path, cfg, shards)
    # (every rank of a split model loads into host memory: start_ranks puts none on a device)
    split = None if staged else _host_check(path, cfg, torch_dtype, weights, max_model_len, place,
                                            shards)  # fmt: skip
    model = _build(path, cfg, torch_dtype, max_model_len, ep, place, weights)
    pieces = _map_tensors(path, model, shards)

    params = dict(model.named_parameters())
    # in place from the drive, the host's; on a device, aligned as its allocator aligns
    at, end, stage_at, stage_end = _layout(pieces, params, in_line=not staged)
    # Tensors to convert are staged on the host (read in place, in their file dtype) and
    # converted as each shard's reads end, on the way to the device for a device load: staged
    # on a GPU, a float32 checkpoint would need twice its model's bytes there on top.
    host = torch.device("cpu")
    memory = [(end, target), (stage_end, host)] if staged else [(end + stage_end, host)]
    for need, where in memory:  # (the host's last: `have` is what PendingLoad records)
        have = _device_free(where)
        if need > have:
            what = "memory" if where.type == "cpu" else f"{where} memory"
            raise ModelLoadError(
                f"{path}: the weights need {_size(need)} of {what} (as {torch_dtype}"
                f"{', staged in their file dtype' if staged and where.type == 'cpu' else ''}), "
                f"only {_size(have)} is available"
            )
    arena = DeviceArena(end, target) if staged else Arena(end)
    staging_arena = Arena(stage_end) if stage_at else None
    whole, stage = arena.tensor(), staging_arena.tensor() if staging_arena else None
    for name, param in params.items():
        o = at[name]
        param.data = whole[o : o + param.nbytes].view(param.dtype).view(param.shape)

    spans: dict[Path, list[Span]] = {s.path: [] for s in shards}
    conversions: dict[Path, list[tuple[torch.Tensor, torch.Tensor]]] = {s.path: [] for s in shards}
    st = stats if stats is not None else ReadStats()
    for p in pieces:
        t, param = p.tensor, params[p.param]
        dest = _rows_view(param.data).narrow(0, p.row, p.rows)
        if t.dtype == param.dtype:
            o = at[p.param] + p.row * _row_bytes(param)
            for b, e in p.file_spans():  # a column slice: each row to its row of the parameter
                spans[p.shard.path].append(Span(b, e, arena, o))
                st.copied += staged or (o - b) % ALIGN != 0  # not in line with its bytes
                o += _row_bytes(param) if p.col_bytes is not None else 0
        else:
            assert staging_arena is not None and stage is not None
            o = stage_at[id(p)]
            packed = 0
            for b, e in p.file_spans():  # staged packed, row after row
                spans[p.shard.path].append(Span(b, e, staging_arena, o + packed))
                packed += e - b
            raw = stage[o : o + packed]
            conversions[p.shard.path].append((raw.view(t.dtype).view(dest.shape), dest))
            st.copied += 1
    chunk_bytes, verify = chunk_checks(manifest)
    if verify is not None:
        # Each header is read through the checks too: only the chunks with bytes some span
        # wants are read, and a rank whose tensors all lie past the header's chunk (a later
        # pipeline stage, or chunks smaller than the header) read nothing that checked the
        # header it was laid out by (names swapped in it loaded the wrong weights, silently)
        heads = Arena(sum(_round_to(s.data_start, ALIGN) for s in shards))
        o = 0
        for s in shards:
            spans[s.path].append(Span(0, s.data_start, heads, o))
            o += _round_to(s.data_start, ALIGN)
    for file_spans in spans.values():
        file_spans.sort(key=lambda span: span.begin)
    reads = ShardReads(
        [FileRead(s.path, s.size, spans[s.path]) for s in shards],
        threads=threads, direct=direct, chunk_bytes=chunk_bytes, verify=verify, stats=st,
    )  # fmt: skip
    return PendingLoad(
        model=model,
        model_dir=path,
        dtype=dtype,
        stats=st,
        reads=reads,
        nbytes=end,
        memory_before=have if split is None else split[0],
        host_nbytes=end if split is None else split[1],
        revision=revision,
        conversions=[conversions[s.path] for s in shards],
        started=t0,
        queued=time.perf_counter(),
        weight_dtype=weight_dtype,
    )


class _Decoding:
    """A compressed folder's reads and decodes (runtime.compression.load_compressed, straight
    into the parameters), run on a thread of their own so that `start_load` returns at once, as
    it does for a plain folder; `wait` and `close` as ShardReads has them."""

    def __init__(self, tensors: Generator[tuple[str, str, torch.Tensor]], stats: ReadStats) -> None:
        self._tensors = tensors
        self._stats = stats
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="weights-decode", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for _ in self._tensors:  # each one checked against its checksum before it comes
                self._stats.verified += 1
                if self._stop.is_set():
                    break
        except BaseException as e:  # raised to whoever waits
            self._error = e
        finally:
            self._tensors.close()  # the generator's own clean-up: its reads and buffers

    def wait(self, index: int) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _start_compressed(path: Path, cfg: ModelConfig, torch_dtype: torch.dtype,
                      weights: torch.dtype, dtype: str, weight_dtype: str,
                      max_model_len: int | None, threads: int, direct: bool,
                      stats: ReadStats | None, t0: float, ep: ExpertParallel,
                      place: RankPlace | None) -> PendingLoad:  # fmt: skip
    """A folder of Huffman-coded weights: every tensor checked against the model first (the
    same checks as a plain folder's), then read, checked and decoded into its parameter rows."""
    from runtime.compression import load_compressed, shard_headers

    model = _build(path, cfg, torch_dtype, max_model_len, ep, place, weights)
    if model.tp.size > 1:
        raise ModelLoadError(
            f"{path}: a compressed folder is decoded tensor by tensor, whole; it cannot be split "
            f"over tp={model.tp.size} ranks (serve the uncompressed folder with --tp)"
        )
    pieces = {p.tensor.name: p for p in _map_tensors(path, model, shard_headers(path))}
    for p in pieces.values():
        if (p.begin, p.end) != (p.tensor.begin, p.tensor.end):  # decoded whole, not in part
            raise ModelLoadError(
                f"{path}: tensor {p.tensor.name!r} holds every expert; a compressed folder "
                f"cannot be split over ep={ep.size} ranks (compress a per-expert checkpoint)"
            )
    split = _host_check(path, cfg, torch_dtype, weights, max_model_len, place, None)
    params = dict(model.named_parameters())
    nbytes, have = sum(p.nbytes for p in params.values()), available_memory()
    if nbytes > have:
        raise ModelLoadError(
            f"{path}: the weights need {_size(nbytes)} of memory (as {torch_dtype}), only "
            f"{_size(have)} is available"
        )
    if split is not None:  # (the memory before any rank's weights, as the plain load keeps it)
        have, host_nbytes = split
    else:
        host_nbytes = nbytes
    # The parameters in one arena, in the order they are decoded into (file order):
    # load_compressed commits its memory ahead of the decoding, much of it while the first
    # reads are still on the drive.
    order = list(dict.fromkeys([*(p.param for p in pieces.values()), *params]))
    offsets, end = {}, 0
    for name in order:
        offsets[name] = end
        end += -(-params[name].nbytes // 64) * 64
    arena = Arena(end)
    whole = arena.tensor()
    for name in order:
        param = params[name]
        o = offsets[name]
        param.data = whole[o : o + param.nbytes].view(param.dtype).view(param.shape)

    def into(name: str) -> torch.Tensor | None:
        p = pieces.get(name)
        if p is None:
            return None  # a tensor the model does not use (e.g. rotary tables): decoded apart
        return _rows_view(params[p.param].data).narrow(0, p.row, p.rows).view(p.tensor.shape)

    st = stats if stats is not None else ReadStats()
    tensors = load_compressed(path, threads=threads, direct=direct, stats=st, into=into,
                              commit=[arena])  # fmt: skip
    return PendingLoad(model, path, dtype, st, _Decoding(tensors, st), nbytes, have, host_nbytes,
                       conversions=[[]], started=t0, queued=time.perf_counter(),
                       weight_dtype=weight_dtype)  # fmt: skip


def load_model(
    model_dir: str | Path,
    dtype: str = "auto",
    max_model_len: int | None = None,
    stats: ReadStats | None = None,
    ep: ExpertParallel = SINGLE,
    place: RankPlace | None = None,
    weight_dtype: str = "auto",
) -> LlamaForCausalLM:
    """Build the model from a folder and load its weights; raises ModelLoadError naming the file.
    `stats` receives what the read did; `place`: this rank's part, or `ep`: its experts."""
    return start_load(model_dir, dtype, max_model_len, stats=stats, ep=ep, place=place,
                      weight_dtype=weight_dtype).finish()  # fmt: skip


def _build(path: Path, cfg: ModelConfig, dtype: torch.dtype, max_model_len: int | None,
           ep: ExpertParallel, place: RankPlace | None, weights: torch.dtype) -> LlamaForCausalLM:  # fmt: skip
    """The model config.json describes, its parameters not yet allocated memory (torch.empty):
    sizes beyond what the allocator can even reserve (10**8 experts, an expert's
    intermediate_size of 10**9, which _check_sizes cannot see in every checkpoint's layout)
    are a ModelLoadError naming config.json, not the allocator's RuntimeError."""
    try:
        return LlamaForCausalLM(cfg, dtype, max_model_len or cfg.max_model_len, ep, place, weights)
    except (MemoryError, RuntimeError) as e:
        if isinstance(e, RuntimeError) and "can't allocate memory" not in str(e):
            raise
        asked = re.search(r"allocate (\d+) bytes", str(e))
        what = f"{_size(int(asked[1]))} in one tensor" if asked else str(e)[:160]
        raise ModelLoadError(
            f"{path / 'config.json'}: the model it describes cannot be allocated ({what}); do "
            "its sizes match the checkpoint's?"
        ) from e


def _host_check(path: Path, cfg: ModelConfig, dtype: torch.dtype, weights: torch.dtype,
                max_model_len: int | None, place: RankPlace | None,
                shards: list[Shard] | None) -> tuple[int, int] | None:  # fmt: skip
    """Rank 0's load of a model split over ranks: that every rank's weights fit in the memory
    available, together. The ranks are processes of this host that load at once, and each
    checks only its own share: a model that did not fit started under tp or pp (each share
    passing on its own) and the kernel's OOM killer ended a rank mid-load. Each rank's part is
    built on the meta device (shapes, no memory) and laid out as its own load lays it out
    (from `shards`; None: a compressed folder's, its parameters in one arena), staging
    included. The memory is measured before rank 0 allocates anything, and the followers,
    which take the same steps before their reads, have then read next to nothing.

    (the memory available, the bytes every rank's parameters take) where checked; None for
    any other load (one rank, or a follower's)."""
    if place is None or place.rank != 0 or place.world_size == 1:
        return None
    have = available_memory()
    need = arenas = 0
    for rank in range(place.world_size):
        with torch.device("meta"):
            model = _build(path, cfg, dtype, max_model_len, SINGLE,
                           RankPlace(place.config, rank), weights)  # fmt: skip
        params = dict(model.named_parameters())
        if shards is None:  # (as _start_compressed counts them)
            end, stage_end = sum(p.nbytes for p in params.values()), 0
        else:
            _, end, _, stage_end = _layout(_map_tensors(path, model, shards), params)
        need += end + stage_end
        arenas += end
    if need > have:
        raise ModelLoadError(
            f"{path}: the weights need {_size(need)} of memory (as {dtype}; the shares of all "
            f"{place.world_size} ranks, which load at once on this host), only {_size(have)} "
            "is available"
        )
    return have, arenas


def _map_tensors(path: Path, model: LlamaForCausalLM, shards: list[Shard]) -> list[_Piece]:
    """Every checkpoint tensor the model uses, in file order, with the parameter rows it fills;
    errors name the file and tensor (unexpected, not a float, wrong shape, twice), or the
    model folder `path` (missing)."""
    params = dict(model.named_parameters())
    pieces: list[_Piece] = []
    for shard in shards:
        for t in shard.tensors:
            target = model.weight_target(t.name)
            if target is None:
                continue
            name = target.param
            if name not in params:
                raise ModelLoadError(
                    f"{shard.path}: unexpected tensor {t.name!r} for {model.cfg.architecture}"
                )
            if not t.dtype.is_floating_point:
                raise ModelLoadError(
                    f"{shard.path}: tensor {t.name!r} has dtype {t.dtype}; only float tensors "
                    "are supported (import quantized GGUF files with `edgeinfer import-gguf`)"
                )
            param = params[name]
            rows = _num_rows(param) if target.rows is None else target.rows
            if target.shape is not None:
                want = target.shape
            elif target.rows is None:
                want = tuple(param.shape)
            else:
                want = (rows,) if param.dim() <= 1 else (rows, param.shape[-1])
            if t.shape != want:
                raise ModelLoadError(
                    f"{shard.path}: tensor {t.name!r} has shape {t.shape}, config.json implies "
                    f"{want}"
                )
            row_bytes = t.shape[-1] * t.dtype.itemsize if len(t.shape) >= 2 else t.dtype.itemsize
            begin = t.begin + target.src_row * row_bytes
            end = begin + rows * row_bytes
            piece = _Piece(shard, t, name, target.row, rows, begin, end, 0)
            if target.cols is not None and target.cols != t.shape[-1]:
                piece.col_begin = target.src_col * t.dtype.itemsize
                piece.col_bytes = target.cols * t.dtype.itemsize
            read = sum(e - b for b, e in piece.file_spans())
            piece.nbytes = param.dtype.itemsize * read // t.dtype.itemsize
            pieces.append(piece)
    _check_coverage(path, model, params, pieces)
    return pieces


def _check_sizes(path: Path, cfg: ModelConfig, shards: list[Shard]) -> None:
    """The sizes config.json gives against the checkpoint's own, before a model is built from
    them: a config that cannot be meant (vocab_size 10**12, 20,000 layers) otherwise failed in
    the allocator, or after a minute building layers, not as the mismatch it is."""
    found = {t.name: (s.path, t.shape) for s in shards for t in s.tensors}
    h = cfg.hidden_size
    for name, want, what in (
        ("model.embed_tokens.weight", (cfg.vocab_size, h), "vocab_size x hidden_size"),
        ("model.layers.0.mlp.gate_proj.weight", (cfg.intermediate_size, h),
         "intermediate_size x hidden_size"),
        # (a head_dim of 10**9 failed allocating the fused qkv weight, not as this mismatch)
        ("model.layers.0.self_attn.q_proj.weight", (cfg.num_heads * cfg.head_dim, h),
         "num_attention_heads * head_dim x hidden_size"),
        ("model.layers.0.self_attn.k_proj.weight", (cfg.num_kv_heads * cfg.head_dim, h),
         "num_key_value_heads * head_dim x hidden_size"),
    ):  # fmt: skip
        if name in found and found[name][1] != want:
            file, shape = found[name]
            raise ModelLoadError(f"{file}: tensor {name!r} has shape {shape}, config.json ({what}) "
                                 f"implies {want}")  # fmt: skip
    parts = (n.split(".") for n in found)
    layers = {int(p[2]) for p in parts if p[:2] == ["model", "layers"] and len(p) > 2
              and is_layer_index(p[2])}  # fmt: skip
    if layers and cfg.num_layers > max(layers) + 1:
        raise ModelLoadError(f"{path / 'config.json'}: num_hidden_layers is {cfg.num_layers}, the "
                             f"checkpoint has layers 0-{max(layers)}")  # fmt: skip


def _check_coverage(
    path: Path, model: LlamaForCausalLM, params: Mapping[str, torch.Tensor], pieces: list[_Piece]
) -> None:
    """Every row of every parameter filled by exactly one piece: a tensor that is there twice
    (or two that overlap) is named with both files; missing ones are named as our parameters,
    with the checkpoint tensor expected where the model can say (an expert's)."""
    by_param: dict[str, list[_Piece]] = {name: [] for name in params}
    for p in pieces:
        by_param[p.param].append(p)
    missing: list[str] = []
    for name, group in by_param.items():
        group.sort(key=lambda p: p.row)
        covered = 0
        gap: int | None = None  # first row that no piece fills
        for prev, p in zip([None, *group], group, strict=False):
            if prev is not None and p.row < covered:
                raise ModelLoadError(
                    f"{p.shard.path}: tensor {p.tensor.name!r} is also in {prev.shard.path}"
                    + ("" if p.tensor.name == prev.tensor.name else f" (as {prev.tensor.name!r})")
                )
            if p.row > covered and gap is None:
                gap = covered
            covered = p.row + p.rows
        if covered < _num_rows(params[name]) and gap is None:
            gap = covered
        if gap is not None:
            hint = model.checkpoint_name(name, gap)
            missing.append(name + (f" ({hint})" if hint else ""))
    if missing:
        # (the message named no folder; an untied model's lm_head.weight, or an index or
        # manifest listing no tensors, left the user guessing)
        why = ""
        if pieces and "lm_head" in by_param and not by_param["lm_head"]:
            why = (
                f"; tie_word_embeddings is false (or not set) in {path / 'config.json'}, so the "
                "model needs its own lm_head.weight (true: the output layer is the embedding)"
            )
        if not pieces:
            why = (
                f"; none of the model's {len(params)} weights is there (does the index's "
                "weight_map, or the manifest, list the shards?)"
            )
        raise ModelLoadError(
            f"{path}: weights missing from the checkpoint: {', '.join(sorted(missing)[:8])}"
            + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            + why
        )


def _layout(
    pieces: list[_Piece], params: Mapping[str, torch.Tensor], in_line: bool = True
) -> tuple[dict[str, int], int, dict[int, int], int]:
    """Where everything goes: each parameter's offset in the arena and the arena's size; each
    piece to convert's offset (by id) in the staging arena and its size.

    `in_line`: a parameter sits where its largest piece stored in its own dtype sits in its
    file, modulo ALIGN, so that the reader can put that piece (and its neighbours, if the file
    keeps them as the parameter does) in place straight from the drive. Else (memory that reads
    reach through staging buffers: a GPU's) each starts on a DEVICE_ALIGN boundary, as the
    device's own allocations do, as its kernels' vector loads want. A piece to convert is
    staged on the host in its file dtype, in line with the file either way."""
    by_param: dict[str, list[_Piece]] = {}
    for p in pieces:  # parameters in the file order of their first piece
        by_param.setdefault(p.param, []).append(p)
    at: dict[str, int] = {}
    end = 0
    for name, group in by_param.items():
        dtype = params[name].dtype
        anchor = max((p for p in group if p.tensor.dtype == dtype and p.col_bytes is None),
                     key=lambda p: p.nbytes, default=None)  # fmt: skip
        row0 = anchor.begin - anchor.row * _row_bytes(params[name]) if anchor else 0
        at[name] = _congruent(end, row0, dtype.itemsize) if in_line else _round_to(end)
        end = at[name] + params[name].nbytes
    stage_at: dict[int, int] = {}
    stage_end = 0
    for p in pieces:
        dtype = params[p.param].dtype
        if p.tensor.dtype != dtype:
            first = p.file_spans()[0][0]
            stage_at[id(p)] = _congruent(stage_end, first, p.tensor.dtype.itemsize)
            stage_end = stage_at[id(p)] + p.nbytes * p.tensor.dtype.itemsize // dtype.itemsize
    return at, end, stage_at, stage_end


def _row_bytes(param: torch.Tensor) -> int:
    return (param.shape[-1] if param.dim() >= 2 else 1) * param.dtype.itemsize


def _num_rows(param: torch.Tensor) -> int:
    return param.numel() // param.shape[-1] if param.dim() >= 2 else max(param.numel(), 1)


def _rows_view(param: torch.Tensor) -> torch.Tensor:
    """The parameter as rows: (-1, last dim), or (numel,) for one of fewer dimensions."""
    return param.view(-1, param.shape[-1]) if param.dim() >= 2 else param.view(-1)


def _round_to(n: int, to: int = DEVICE_ALIGN) -> int:
    return -(-n // to) * to


def _device_free(device: torch.device) -> int:
    """Bytes free on a device: a GPU's as its driver reports them, else the host's."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return available_memory()


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _congruent(at_least: int, file_offset: int, itemsize: int) -> int:
    """The first offset >= at_least that sits where `file_offset` does modulo ALIGN (so that the
    reader can put the bytes there straight from the drive), if that is a multiple of itemsize;
    else the first 64-byte-aligned one (the bytes are then copied in)."""
    want = file_offset % ALIGN
    if want % itemsize:
        return -(-at_least // 64) * 64
    return at_least + (want - at_least) % ALIGN
