"""Turn a llama.cpp GGUF file (Llama architecture) into a Hugging Face model folder.

    model.gguf  ──import_gguf──►  out_dir/
        config.json                          LlamaForCausalLM, from the `llama.*` metadata
        generation_config.json               bos / eos ids (eos may be a list: eos, eot, eom)
        model-0000k-of-0000N.safetensors     dequantized weights under HF names
        model.safetensors.index.json         which shard holds which tensor
        tokenizer.json                       rebuilt from `tokenizer.ggml.*`
        tokenizer_config.json                special tokens, add_bos_token, chat_template
        chat_template.jinja                  when the file has a chat template
        edgeinfer_import.json                provenance; written last, marks a complete import

Three things differ between the two formats and are undone here:

1. Dimension order. GGUF lists a tensor's dims fastest-first (ne0 = row length), so a Linear
   weight of HF shape (out, in) is stored as [in, out]; we reverse the dims.
2. Rotary layout of q_proj / k_proj rows. HF rotates the two halves of each head
   (rotate_half); llama.cpp rotates adjacent pairs, so its converter interleaves each head's
   rows: HF row s * half + j (s in {0, 1}, j < half) becomes GGUF row 2 * j + s. We put
   every row back (`_unpermute_rows`).
3. Quantization. Blocks are dequantized with `gguf.quants.dequantize` to float32, then cast
   to `dtype`. float32 (the default) keeps the dequantized values exactly; bfloat16 / float16
   halve the folder but round them.

The whole folder is written into a temporary sibling, `.<name>.import-<id>`, and renamed into
place, so a crash leaves no half-written model. The sibling is locked while the import runs
(runtime.model_store.locked_folder): one left by an import killed outright is deleted by the
next sweep of the model store it is in (a pull or a remove there), a running one never.
Nothing is printed unless `progress` is given.

The tokenizer files are rebuilt by `runtime.gguf_tokenizer`; the errors and metadata access
shared by both modules live in `runtime.gguf_common`.
"""

from __future__ import annotations

import errno
import os
import re
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from runtime.gguf_common import (
    GGUFImportError,
    Metadata,
    UnsupportedGGUFError,
    token_ids,
    write_json,
)
from runtime.gguf_tokenizer import check_token_lists, write_tokenizer
from runtime.loader import IMPORT_MARKER  # last file written into a finished folder
from runtime.model_store import LOCK_NAME, locked_folder

IMPORTER_VERSION = 1  # bump when the folder layout changes, so caches re-import

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_Q = gguf.GGMLQuantizationType
SUPPORTED_TYPES = frozenset(
    {_Q.F32, _Q.F16, _Q.BF16, _Q.Q4_0, _Q.Q4_1, _Q.Q5_0, _Q.Q5_1, _Q.Q8_0}
    | {_Q.Q2_K, _Q.Q3_K, _Q.Q4_K, _Q.Q5_K, _Q.Q6_K}
)

# What the engine finds again in the float32 weights and reads packed (kernels.linear.pack)
PACKED_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"})

Progress = Callable[[str], None]


def tensor_types(reader: gguf.GGUFReader) -> dict[str, int]:
    """The file's tensors by type name, most first (e.g. {"Q4_K": 145, "F32": 61, "Q6_K": 25})."""
    counts: dict[str, int] = {}
    for t in reader.tensors:
        name = _Q(t.tensor_type).name
        counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def import_gguf(
    gguf_path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    shard_bytes: int = 200 * 2**20,
    dtype: str = "float32",
    progress: Progress | None = None,
) -> Path:
    """Convert `gguf_path` into a Hugging Face Llama folder at `out_dir`; returns `out_dir`.

    `out_dir` must not exist or be an empty directory. `shard_bytes` caps a safetensors shard
    (a single tensor larger than that gets a shard of its own). `dtype` is the weights' dtype
    on disk: "float32" (exact dequantized values), "bfloat16" or "float16".
    """
    src, dst = Path(gguf_path), Path(out_dir)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be > 0, got {shard_bytes}")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise FileExistsError(f"{dst}: already exists and is not an empty directory")
    try:
        return _import(src, dst, dtype, shard_bytes, progress or (lambda _msg: None))
    except GGUFImportError:
        raise
    except (TypeError, ValueError, ArithmeticError, IndexError, KeyError) as e:
        # what a valid but malformed file can still trip the conversion over where no check of
        # ours names it (a metadata value of an unexpected type, say): named with the file
        raise GGUFImportError(src, f"cannot be converted ({type(e).__name__}: {e})") from e


def _import(src: Path, dst: Path, dtype: str, shard_bytes: int, say: Progress) -> Path:
    """import_gguf once its arguments are checked. An I/O error (a full disk) is an OSError
    naming the file, safetensors' own included."""
    say(f"reading {src}")
    reader = _open(src)
    meta = Metadata(reader, src)
    config = _llama_config(meta, reader, src, dtype)
    jobs = _tensor_jobs(reader, config, src)
    check_token_lists(meta, config["vocab_size"], src)  # (before minutes of dequantizing)
    types = tensor_types(reader)
    say("tensor types: " + ", ".join(f"{n} {t}" for t, n in types.items()))
    packed = sorted(t for t in types if t in PACKED_TYPES)
    if packed and dtype == "float32":
        say(f"decode will read the {', '.join(packed)} matrices as their blocks (packed weights: "
            "exact float32 values, a fifth to a third of the bytes; AVX-512 CPUs)")  # fmt: skip

    dst.parent.mkdir(parents=True, exist_ok=True)
    # made like tempfile.mkdtemp's, but honouring the umask (the folder is meant to be shared),
    # locked, and removed however the block ends (after the rename: nothing left to remove)
    with locked_folder(dst.parent / f".{dst.name}.import-{uuid.uuid4().hex[:12]}") as tmp:
        write_json(tmp / "config.json", config)
        _write_weights(tmp, jobs, DTYPES[dtype], shard_bytes, say)
        file_mode = (tmp / "config.json").stat().st_mode & 0o777
        for shard in tmp.glob("*.safetensors"):
            shard.chmod(file_mode)  # safetensors creates its files owner-only
        say("building the tokenizer")
        write_tokenizer(tmp, meta, config, src)
        write_json(
            tmp / IMPORT_MARKER,
            {
                "importer_version": IMPORTER_VERSION,
                "source": src.name,
                "dtype": dtype,
                "tensor_types": types,
            },
        )
        (tmp / LOCK_NAME).unlink()  # not part of the model (the lock is held till the end)
        if dst.is_dir():
            dst.rmdir()  # empty (checked above); rename cannot replace a directory otherwise
        try:
            tmp.rename(dst)
        except OSError as e:  # another process finished first
            raise FileExistsError(f"{dst}: appeared while importing ({e})") from e
    say(f"imported {src.name} -> {dst}")
    return dst


# ---------------------------------------------------------------------------------------------
# Reading the file


def _open(src: Path) -> gguf.GGUFReader:
    if not src.is_file():
        raise FileNotFoundError(errno.ENOENT, "GGUF file not found", str(src))
    with src.open("rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise GGUFImportError(src, f"not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    _check_sizes(src)
    try:
        return gguf.GGUFReader(src)
    except (ValueError, IndexError, KeyError) as e:
        raise GGUFImportError(src, f"corrupt or truncated GGUF file ({e})") from e


# gguf.GGUFReader makes a numpy view per element of a metadata array, ~15-30 us and ~700 bytes
# each: SmolLM2's 147k (tokens, types, merges) take 4 s, and a 3M-entry array 40 s and 2 GB.
# The largest vocabularies (256k tokens, with types, scores and merges) stay well below these.
MAX_ARRAY_ENTRIES = 1 << 20  # one metadata array
MAX_METADATA_ENTRIES = 1 << 21  # all of them together
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9  # GGUF value types, as gguf.GGUFValueType numbers them


class _Unfollowed(Exception):
    """What _check_sizes leaves to gguf.GGUFReader to name."""


def _check_sizes(src: Path) -> None:
    """Walk the file's key/value section and tensor list (skipping what they hold) before
    gguf.GGUFReader does: refuse metadata arrays longer than it can take in reasonable time and
    memory, naming the key and its length, and a file too short for a tensor's data, naming the
    tensor, or for its metadata and tensor list (the reader's own words for those are numpy's).
    A value type GGUF has none of, or arrays nested deeper than 8, is left for the reader."""
    import mmap
    import struct

    with src.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 24:
            return
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    total, at = 0, 24  # after magic, version, tensor count, key/value count

    def skip(key: str, kind: int, count: int, depth: int) -> None:
        nonlocal total, at
        if kind in _SCALAR_BYTES:
            at += count * _SCALAR_BYTES[kind]
        elif kind == _STRING:
            for _ in range(count):
                (n,) = struct.unpack_from("<Q", buf, at)
                at += 8 + n
        elif kind == _ARRAY and depth < 8:
            for _ in range(count):
                item, length = struct.unpack_from("<IQ", buf, at)
                at += 12
                total += length
                if length > MAX_ARRAY_ENTRIES or total > MAX_METADATA_ENTRIES:
                    what = (f"has {length} entries" if length > MAX_ARRAY_ENTRIES
                            else f"brings the metadata arrays to {total} entries")  # fmt: skip
                    raise GGUFImportError(
                        src,
                        f"metadata {key!r} {what}; at most {MAX_ARRAY_ENTRIES} per array and "
                        f"{MAX_METADATA_ENTRIES} in all are read (no vocabulary needs more)",
                    )
                skip(key, item, length, depth + 1)
        else:
            raise _Unfollowed(f"value type {kind}")  # (the reader names it)
        if at > size:
            raise struct.error("past the end")

    try:
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        alignment = 32  # GGUF's default
        for _ in range(n_kv):
            (n,) = struct.unpack_from("<Q", buf, at)
            key = bytes(buf[at + 8 : at + 8 + min(n, 200)]).decode("utf-8", "replace")
            at += 8 + n
            (kind,) = struct.unpack_from("<I", buf, at)
            at += 4
            if key == "general.alignment" and kind == 4:  # uint32
                alignment = max(1, struct.unpack_from("<I", buf, at)[0])
            skip(key, kind, 1, 0)
        tensors = []
        for _ in range(n_tensors):
            (n,) = struct.unpack_from("<Q", buf, at)
            name = bytes(buf[at + 8 : at + 8 + min(n, 200)]).decode("utf-8", "replace")
            at += 8 + n
            (n_dims,) = struct.unpack_from("<I", buf, at)
            dims = struct.unpack_from(f"<{n_dims}Q", buf, at + 4)
            at += 4 + 8 * n_dims
            kind, offset = struct.unpack_from("<IQ", buf, at)
            at += 12
            tensors.append((name, dims, kind, offset))
    except struct.error:  # a read past the end of the file
        raise GGUFImportError(
            src,
            f"truncated: its metadata and tensor list run past the end of the file ({size} bytes)",
        ) from None
    except _Unfollowed:
        return
    finally:
        buf.close()
    data_start = -(-at // alignment) * alignment
    for name, dims, kind, offset in tensors:
        if kind not in gguf.GGML_QUANT_SIZES:
            continue  # (named as unsupported later)
        block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
        values = 1
        for d in dims:
            values *= d
        end = data_start + offset + values // block * block_bytes
        if end > size:
            raise GGUFImportError(
                src, f"truncated: tensor {name!r} needs bytes up to {end}, the file has {size}"
            )


def _llama_config(meta: Metadata, reader: gguf.GGUFReader, src: Path, dtype: str) -> dict[str, Any]:
    arch = meta.require("general.architecture")
    if arch != "llama":
        raise UnsupportedGGUFError(
            src, f"architecture {arch!r} is not supported (only 'llama' files can be imported)"
        )
    if meta.get("llama.expert_count", 0):
        raise UnsupportedGGUFError(src, "mixture-of-experts llama files are not supported")
    hidden = meta.count("llama.embedding_length")
    heads = meta.count("llama.attention.head_count")
    kv_heads = meta.count("llama.attention.head_count_kv", heads)
    head_dim = meta.count("llama.attention.key_length", hidden // heads)
    if meta.count("llama.attention.value_length", head_dim) != head_dim:
        raise UnsupportedGGUFError(src, "key and value head sizes differ")
    if head_dim % 2:  # rotary embeddings turn pairs of dims (and q/k rows come in pairs)
        raise UnsupportedGGUFError(src, f"head size {head_dim} is odd (rotary needs pairs)")
    rope_dims = meta.count("llama.rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise UnsupportedGGUFError(src, f"partial rotary ({rope_dims} of {head_dim} dims)")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise GGUFImportError(src, "tensor 'token_embd.weight' is missing")
    embd_dims = [int(d) for d in tensors["token_embd.weight"].shape]
    if len(embd_dims) != 2:
        raise GGUFImportError(
            src, f"tensor 'token_embd.weight' has dims {embd_dims}, expected 2 ([hidden, vocab])"
        )
    vocab = embd_dims[1]  # GGUF dims: [hidden, vocab]
    theta = meta.number("llama.rope.freq_base", 10000.0)
    tokens_meta = token_ids(meta)

    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta.count("llama.feed_forward_length"),
        "num_hidden_layers": meta.count("llama.block_count", least=0),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": meta.count("llama.context_length", 2048),
        "rms_norm_eps": meta.number("llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": "output.weight" not in tensors,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype,
        **{k: v for k, v in tokens_meta.items() if k in ("bos_token_id", "eos_token_id")},
    }
    if "pad_token_id" in tokens_meta:
        config["pad_token_id"] = tokens_meta["pad_token_id"]
    scaling = _rope_scaling(meta, tensors.get("rope_freqs.weight"), theta, head_dim, src)
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config


def _rope_scaling(
    meta: Metadata,
    rope_freqs: gguf.ReaderTensor | None,
    theta: float,
    head_dim: int,
    src: Path,
) -> dict[str, Any] | None:
    kind = meta.get("llama.rope.scaling.type")
    factor = meta.get("llama.rope.scaling.factor")
    if kind is None and meta.get("llama.rope.scale_linear") is not None:  # older files
        kind, factor = "linear", meta.get("llama.rope.scale_linear")
    if rope_freqs is not None:  # Llama 3.1+: llama.cpp stores per-dim divisors, not the recipe
        if kind not in (None, "none"):
            raise UnsupportedGGUFError(src, f"rope_freqs together with rope scaling {kind!r}")
        return _llama3_scaling(_dequantize(rope_freqs), theta, head_dim, src)
    if kind in (None, "none") or factor is None or float(factor) == 1.0:
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        original = meta.get("llama.rope.scaling.original_context_length")
        if original is not None:
            out["original_max_position_embeddings"] = int(original)
        return out
    raise UnsupportedGGUFError(src, f"rope scaling type {kind!r} is not supported")


def _llama3_scaling(divisors: np.ndarray, theta: float, head_dim: int, src: Path) -> dict[str, Any]:
    """Recover Llama 3 rope scaling from llama.cpp's `rope_freqs` tensor (one divisor per
    frequency). Only the ratios original_context / {low,high}_freq_factor show in the divisors,
    so we check them against the values every Llama 3.x release uses."""
    factor = float(divisors.max())
    low, high, original = 1.0, 4.0, 8192
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    smooth = (original / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < original / high,
        1.0,
        np.where(wavelen > original / low, factor, 1.0 / ((1 - smooth) / factor + smooth)),
    )
    if divisors.shape != expected.shape or not np.allclose(divisors, expected, rtol=1e-4):
        raise UnsupportedGGUFError(
            src,
            "rope_freqs.weight is not Llama 3 rope scaling with low_freq_factor 1, "
            "high_freq_factor 4, original context 8192",
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": original,
    }


# ---------------------------------------------------------------------------------------------
# Weights

_LAYER_TENSORS = {  # GGUF name inside blk.{i} -> HF name inside model.layers.{i}
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_IGNORED_TENSORS = {"rope_freqs.weight"}  # folded into config.json's rope_scaling
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass(slots=True)
class _TensorJob:
    hf_name: str  # parameter name in the HF folder
    tensor: gguf.ReaderTensor  # where its data sits in the GGUF file
    hf_shape: tuple[int, ...]  # the shape the HF model expects
    unpermute_heads: int  # q/k: heads whose rows llama.cpp interleaved; 0 = leave rows alone


def _tensor_jobs(reader: gguf.GGUFReader, config: dict[str, Any], src: Path) -> list[_TensorJob]:
    h, inter = config["hidden_size"], config["intermediate_size"]
    q_dim = config["num_attention_heads"] * config["head_dim"]
    kv_dim = config["num_key_value_heads"] * config["head_dim"]
    layer_shapes = {
        "input_layernorm": (h,),
        "self_attn.q_proj": (q_dim, h),
        "self_attn.k_proj": (kv_dim, h),
        "self_attn.v_proj": (kv_dim, h),
        "self_attn.o_proj": (h, q_dim),
        "post_attention_layernorm": (h,),
        "mlp.gate_proj": (inter, h),
        "mlp.up_proj": (inter, h),
        "mlp.down_proj": (h, inter),
    }
    blocks = {t.name.split(".")[1] for t in reader.tensors if t.name.startswith("blk.")}
    if config["num_hidden_layers"] > len(blocks):  # (4e9 was a loop of that many layers' names)
        raise GGUFImportError(
            src, f"llama.block_count is {config['num_hidden_layers']}, the file has tensors for "
            f"{len(blocks)} blocks"
        )  # fmt: skip
    expected: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        for name, shape in layer_shapes.items():
            expected[f"model.layers.{i}.{name}.weight"] = shape
    expected["model.norm.weight"] = (h,)
    if not config["tie_word_embeddings"]:
        expected["lm_head.weight"] = (config["vocab_size"], h)

    found: dict[str, _TensorJob] = {}
    for t in reader.tensors:
        if t.name in _IGNORED_TENSORS:
            continue
        match = _BLOCK.fullmatch(t.name)
        if match and match.group(2) in _LAYER_TENSORS:
            hf_name = f"model.layers.{match.group(1)}.{_LAYER_TENSORS[match.group(2)]}.weight"
        else:
            hf_name = _GLOBAL_TENSORS.get(t.name, "")
        if hf_name not in expected:
            raise UnsupportedGGUFError(src, f"tensor {t.name!r} has no place in a Llama model")
        if t.tensor_type not in SUPPORTED_TYPES:
            raise UnsupportedGGUFError(
                src, f"tensor {t.name!r} has type {t.tensor_type.name}, which is not supported"
            )
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF dims are fastest-first
        if shape != expected[hf_name]:
            raise GGUFImportError(
                src, f"tensor {t.name!r} has shape {shape}, expected {expected[hf_name]}"
            )
        heads = 0
        if hf_name.endswith("q_proj.weight"):
            heads = config["num_attention_heads"]
        elif hf_name.endswith("k_proj.weight"):
            heads = config["num_key_value_heads"]
        found[hf_name] = _TensorJob(hf_name, t, shape, heads)
    missing = [name for name in expected if name not in found]
    if missing:
        raise GGUFImportError(src, f"{len(missing)} tensors are missing, e.g. {missing[:3]}")
    return [found[name] for name in expected]  # HF order: embeddings, layers, norm, head


def _dequantize(t: gguf.ReaderTensor) -> np.ndarray:
    """The tensor as float32, in numpy (slowest-first) dim order."""
    if t.tensor_type == _Q.F32:
        values = np.array(t.data, dtype=np.float32)  # copy out of the memory map
    else:
        values = gguf.quants.dequantize(t.data, t.tensor_type)
    return values.reshape(tuple(int(d) for d in reversed(t.shape)))


def _unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleave (see the module docstring, point 2)."""
    half = w.shape[0] // n_heads // 2
    # rows of a head in GGUF order (j, s) -> HF order (s, j)
    grouped = w.reshape(n_heads, half, 2, *w.shape[1:])  # (heads, half, 2, in)
    return grouped.swapaxes(1, 2).reshape(w.shape)  # (heads * 2 * half, in)


def _write_weights(
    out: Path,
    jobs: list[_TensorJob],
    dtype: torch.dtype,
    shard_bytes: int,
    say: Progress,
) -> None:
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards: list[list[_TensorJob]] = [[]]
    size = 0
    for job in jobs:
        nbytes = int(np.prod(job.hf_shape)) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(job)
        size += nbytes

    weight_map: dict[str, str] = {}
    total = 0
    for k, shard in enumerate(shards, start=1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        say(f"writing {name} ({len(shard)} tensors)")
        tensors = dict(_converted(shard, dtype))
        try:
            save_file(tensors, str(out / name), metadata={"format": "pt"})
        except SafetensorError as e:  # (its I/O errors, a full disk say, are not OSErrors)
            raise OSError(f"{out / name}: cannot write ({e})") from e
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update(dict.fromkeys(tensors, name))
    write_json(
        out / "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def _converted(jobs: list[_TensorJob], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    for job in jobs:
        values = _dequantize(job.tensor)
        if job.unpermute_heads:
            values = _unpermute_rows(values, job.unpermute_heads)
        tensor = torch.from_numpy(np.ascontiguousarray(values)).to(dtype)
        if dtype == torch.float16 and bool(torch.isinf(tensor).any()):
            raise ValueError(f"{job.tensor.name}: values overflow float16; use bfloat16 or float32")
        yield job.hf_name, tensor
