"""On a CUDA GPU only (skipped elsewhere: CI has none): what the interpreter cannot show, on the
real device. Run on a lent GPU machine with `pytest tests/test_gpu.py` (EDGEINFER_STORIES names
stories260K where ../shared is not beside the repository).

- the Huffman decoder's Triton kernels (a lane per chunk; a TileGroup of tensors coded on the
  GPU) give the original bits of tensors large enough to fill the GPU;
- the engine on the GPU (Triton kernels, CUDA graphs) gives transformers' greedy tokens on the
  same bfloat16 weights, and the same tokens with its weights kept compressed (decoded inside
  the captured graphs);
- weights read onto the GPU through pinned staging buffers and a copy stream are the bits a
  load into host memory gives, converted on the GPU where the file's dtype is not the model's,
  and a corrupt chunk is still named.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.llm import LLM
from runtime.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = [[1, 403, 407, 261, 378], [1, *range(20, 57)], [1, 99]]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int16)


def test_huffman_kernels_on_the_gpu_give_the_original_bits() -> None:
    from kernels.huffman_decode import decode_tiles, decode_triton
    from runtime.compression import encode_bf16, parse_record, tile_group

    gen = torch.Generator().manual_seed(0)
    tensors = []
    for shape in [(4096, 4096), (1, 4097), (3, 1000, 7), (1536, 576)]:
        t = (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)
        t.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
        rec = encode_bf16(t)
        assert rec is not None
        c = parse_record(torch.from_numpy(rec), t.numel()).to("cuda")
        got = decode_triton(c, out=torch.full_like(_bits(t), -1, device="cuda").view(t.dtype))
        assert torch.equal(_bits(got).cpu(), _bits(t)), shape
        tensors.append(t)
    # the tiles kernel (weights kept compressed), coded on the GPU
    starts, at = [], 0
    for t in tensors:
        starts.append(at)
        at += -(-t.numel() // 4) * 4 + 4
    group = tile_group([t.cuda() for t in tensors], starts)
    out = torch.full((group.numel,), float("nan"), dtype=torch.bfloat16, device="cuda")
    decode_tiles(group, out)
    for s, t in zip(starts, tensors, strict=True):
        assert torch.equal(_bits(out[s : s + t.numel()]).cpu(), _bits(t)), t.shape


def _greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]


def test_engine_on_the_gpu_gives_transformers_tokens(stories_dir: Path) -> None:
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(stories_dir, dtype=torch.bfloat16).to("cuda")
    want = []
    for p in PROMPTS:
        ids = torch.tensor([p], device="cuda")
        out = hf.generate(ids, max_new_tokens=24, do_sample=False, min_new_tokens=24)
        want.append(out[0, len(p) :].tolist())
    llm = LLM(stories_dir, device="cuda", cuda_graph_max_batch=8)
    assert llm.engine.runner.triton and llm.engine.runner.graphs is not None
    assert _greedy(llm) == want


def test_engine_on_the_gpu_with_weights_kept_compressed(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    model = tiny_model_dir("llama-wide")  # stories260K's tensors are too small to gain
    dense = _greedy(LLM(model, device="cuda", cuda_graph_max_batch=8))
    llm = LLM(model, device="cuda", cuda_graph_max_batch=8, keep_weights_compressed=True)
    assert llm.engine.compressed is not None and llm.engine.runner.graphs is not None
    assert all(b.group is not None for b in llm.engine.compressed._blocks)  # a launch a layer
    assert llm.engine.compressed._side is not None  # decoded a layer ahead
    assert llm.engine.runner.before_replay == llm.engine.compressed.join
    assert _greedy(llm) == dense


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculative_decoding_on_the_gpu(stories_dir: Path, method: str) -> None:
    """Greedy output with drafts (n-gram, or a draft model: the target drafting for itself, so
    its drafts are accepted) is the plain engine's; sampled requests with logprobs verify their
    drafts (drawn on the host; a seeded one does not speculate); a draft model runs on the GPU
    beside the target, its KV cache there too."""
    from runtime.draft import DraftProposer

    spec: dict[str, object] = {"method": method, "num_tokens": 4, "max_batch_tokens": 64}
    if method == "draft":
        spec["draft_model"] = str(stories_dir)
    plain = _greedy(LLM(stories_dir, device="cuda", cuda_graph_max_batch=8))
    llm = LLM(stories_dir, device="cuda", cuda_graph_max_batch=8, speculative=spec)
    assert _greedy(llm) == plain
    verified = llm.engine.stats()["spec_verifications"]
    sampled = SamplingParams(temperature=0.5, top_p=0.9, max_tokens=64, logprobs=2,
                             ignore_eos=True)  # fmt: skip
    # (64 tokens: stories260K's text repeats itself within them, so n-gram drafts come)
    for out in llm.generate(PROMPTS * 3, sampled):
        got = out.outputs[0]
        assert len(got.token_ids) == 64 and got.logprobs is not None and len(got.logprobs) == 64
    stats = llm.engine.stats()
    assert stats["spec_verifications"] > verified, stats
    assert method == "ngram" or stats["spec_accepted_tokens"] > 0, stats
    proposer = llm.engine.spec.proposer if llm.engine.spec is not None else None
    if method == "draft":
        assert isinstance(proposer, DraftProposer)
        assert proposer.model.device.type == "cuda" and proposer.runner.triton
        assert proposer.runner.kv.device.type == "cuda"


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_blocks_decoded_ahead_on_a_side_stream_answer_as_dense_in_any_order(ahead: int) -> None:
    """CompressedBlocks on a GPU decodes the blocks after the running one on a side stream,
    into other buffers: in order, out of order (a block alone, blocks skipped), eagerly and
    replayed from CUDA graphs (two, captured one after the other, as the engine does), every
    block computes with its own weights."""
    from runtime.compression import CompressedBlocks

    gen = torch.Generator().manual_seed(0)
    blocks = [torch.nn.Linear(512, 512, bias=False, dtype=torch.bfloat16) for _ in range(4)]
    for b in blocks:
        b.weight.data = (torch.randn(512, 512, generator=gen) * 0.02).to(torch.bfloat16)
    blocks = [b.cuda() for b in blocks]
    x = torch.randn(8, 512, generator=gen).to(torch.bfloat16).cuda()

    def run(order: list[int], h: torch.Tensor = x) -> torch.Tensor:
        for i in order:
            h = blocks[i](h) + h
        return h

    orders = [[0, 1, 2, 3], [2], [0, 2, 3], [3, 1, 0, 2], [3, 1], [0, 1, 2, 3], [1, 2, 3]]
    dense = [run(o) for o in orders]
    kept = CompressedBlocks(blocks, device="cuda", min_saving=0, ahead=ahead)
    assert kept._side is not None and len(kept._buffers) == 1 + ahead
    assert blocks[0].weight.numel() == 0 and "while one runs" in kept.summary()
    for _ in range(3):
        for order, want in zip(orders, dense, strict=True):
            assert torch.equal(run(order), want), order
    graphs, outs = [], []
    for order in ([0, 1, 2, 3], [1, 2, 3]):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run(order)  # (warm-up, as the engine's capture does)
            run([0])  # block 0 eagerly just before block 1 is captured: decoded ahead, not in it
        torch.cuda.current_stream().wait_stream(stream)
        graphs.append(torch.cuda.CUDAGraph())
        with torch.cuda.graph(graphs[-1]):
            outs.append(run(order, x.clone()))
    for _ in range(3):
        for graph, out, want in zip(graphs, outs, (dense[0], dense[6]), strict=True):
            assert torch.equal(run([3, 1]), dense[4])  # eager, between replays
            assert kept._pending  # (block 2 decoded ahead: no block waited on it)
            kept.join()  # what the engine's runner calls before a replay
            for buffer in kept._buffers:  # a graph must decode every block it reads
                buffer.fill_(float("nan"))
            out.zero_()
            graph.replay()
            assert torch.equal(out, want)
    kept.release()
    assert all(b.weight.numel() == 512 * 512 for b in blocks)
    assert [torch.equal(run(o), d) for o, d in zip(orders, dense, strict=True)] == [True] * 7


def test_weights_read_onto_the_gpu_are_the_checkpoints_bits(tiny_model_dir, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from runtime.config import ModelLoadError
    from runtime.loader import load_model, start_load
    from runtime.weights import ReadStats
    from tests.test_loader import _mixed_shards
    from tests.test_weights import flip_byte

    folder = tmp_path / "m"
    _mixed_shards(tiny_model_dir("llama-wide"), folder, 3)  # float32 and bfloat16 on disk
    host = dict(load_model(folder, "bfloat16").named_parameters())
    stats = ReadStats()
    model = start_load(folder, "bfloat16", stats=stats, device="cuda").finish()
    for name, param in model.named_parameters():
        assert param.device.type == "cuda" and torch.equal(param.cpu(), host[name]), name
    assert stats.verified > 3 and stats.copied_bytes > 0  # (the bfloat16 tensors: staged)

    shard = sorted(folder.glob("*.safetensors"))[1]
    flip_byte(shard, shard.stat().st_size - 100)
    with pytest.raises(ModelLoadError, match=rf"{shard.name}: checksum mismatch"):
        start_load(folder, "bfloat16", device="cuda").finish()
