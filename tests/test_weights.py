"""The safetensors reader (runtime/weights.py): bit-identical to `safetensors` on single and
sharded checkpoints with mixed dtypes and odd sizes, through O_DIRECT and through the page
cache; every lie a file can tell is an error naming it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.config import ModelLoadError
from runtime.weights import ReadStats, drop_page_cache, load_safetensors, read_header


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {  # sizes that are not multiples of anything; a bf16 of odd length misaligns the next
        "a.f32": torch.randn(7, 3, generator=g),
        "b.bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.f32": torch.randn(1001, generator=g),
        "d.f16": torch.randn(3, 3, generator=g).to(torch.float16),
        "e.i64": torch.tensor([-(2**40), 7]),
        "f.u8": torch.arange(13, dtype=torch.uint8),
        "g.big": torch.randn(300, 1111, generator=g),  # ~1.3 MB: several reads
        "h.empty": torch.empty(0, 4),
    }


def _save_packed(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """A valid safetensors file with the tensors packed in the given order, no padding (the
    `safetensors` writer orders by alignment; other writers need not, so a tensor may sit at
    an offset that is not a multiple of its element size)."""
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.int64: "I64", torch.uint8: "U8"}  # fmt: skip
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        blob = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}  # fmt: skip
        blobs.append(blob)
        offset += len(blob)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    path.write_bytes(len(body).to_bytes(8, "little") + body + b"".join(blobs))


def _read(
    files: list[Path], direct: bool, skip_cached: bool = True
) -> tuple[dict[str, torch.Tensor], ReadStats]:
    stats = ReadStats()
    loaded = load_safetensors(files, 3, direct, stats, skip_cached=skip_cached)
    return {name: t for _, name, t in loaded}, stats


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("shards", [1, 2])
def test_bit_identical_to_safetensors(tmp_path: Path, direct: bool, shards: int) -> None:
    files, want = [], {}
    for i in range(shards):
        t = _tensors(i)
        t = {f"s{i}.{k}": v for k, v in t.items()}
        f = tmp_path / f"model-{i}.safetensors"
        _save_packed(t, f)
        files.append(f)
        want.update(t)
        drop_page_cache(f)
    got, stats = _read(files, direct, skip_cached=False)  # O_DIRECT even where cached
    assert got.keys() == want.keys()
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(
            g.view(torch.uint8) if g.numel() else g, w.view(torch.uint8) if w.numel() else w
        ), name
    assert stats.bytes == sum(f.stat().st_size for f in files)
    assert stats.copied == 4 * shards  # c, e, g, h sit at offsets their element size misses
    if direct:  # ext4 allows O_DIRECT
        assert stats.direct == shards and stats.buffered == 0
    else:
        assert stats.buffered == shards


def test_cached_file_is_read_through_the_page_cache(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    save_file(_tensors(3), str(f))
    f.read_bytes()  # now cached
    got, stats = _read([f], direct=True)
    assert stats.buffered == 1 and stats.direct == 0
    assert torch.equal(got["g.big"], load_file(str(f))["g.big"])


def _rewrite_header(f: Path, edit) -> None:  # type: ignore[no-untyped-def]
    raw = f.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    body = json.dumps(header).encode()
    body += b" " * (-len(body) % 8)
    f.write_bytes(len(body).to_bytes(8, "little") + body + raw[8 + n :])


def test_lies_and_damage_are_errors_naming_the_file(tmp_path: Path) -> None:
    f = tmp_path / "m.safetensors"
    save_file(_tensors(4), str(f))
    good = f.read_bytes()

    f.write_bytes(good[:-100])
    with pytest.raises(
        ModelLoadError, match=r"m\.safetensors: truncated: its header needs \d+ bytes"
    ):
        read_header(f)

    f.write_bytes(good)
    _rewrite_header(f, lambda h: h["a.f32"].update(shape=[7, 4]))
    with pytest.raises(
        ModelLoadError, match=r"m\.safetensors: corrupt .*'a\.f32'.*needs 112 bytes"
    ):
        list(load_safetensors([f]))

    f.write_bytes(good)
    _rewrite_header(f, lambda h: h["a.f32"].update(dtype="F8_E9M9"))
    with pytest.raises(ModelLoadError, match=r"m\.safetensors: corrupt .*'a\.f32'"):
        list(load_safetensors([f]))

    f.write_bytes(b"\xff" * 16)
    with pytest.raises(
        ModelLoadError, match=r"m\.safetensors: corrupt safetensors file \(header of"
    ):
        list(load_safetensors([f]))

    f.write_bytes((12).to_bytes(8, "little") + b"not json!!!!")
    with pytest.raises(ModelLoadError, match=r"header is not JSON"):
        list(load_safetensors([f]))


def test_every_header_is_checked_before_any_read(tmp_path: Path) -> None:
    good, bad = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file(_tensors(5), str(good))
    save_file(_tensors(6), str(bad))
    bad.write_bytes(bad.read_bytes()[:-10])
    stats = ReadStats()
    with pytest.raises(ModelLoadError, match=r"b\.safetensors: truncated"):
        next(load_safetensors([good, bad], stats=stats))
    assert stats.bytes == 0  # nothing was read
