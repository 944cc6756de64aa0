"""On a CUDA GPU only (skipped elsewhere: CI has none): what the interpreter cannot show, on the
real device. Run on a lent GPU machine with `pytest tests/test_gpu.py` (EDGEINFER_STORIES names
stories260K where ../shared is not beside the repository).

- the Huffman decoder's Triton kernel, both ways (a lane per chunk, a lane per mark), gives the
  original bits of tensors large enough to fill the GPU;
- the engine on the GPU (Triton kernels, CUDA graphs) gives transformers' greedy tokens on the
  same bfloat16 weights, and the same tokens with its weights kept compressed (decoded inside
  the captured graphs).
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


def test_huffman_kernel_on_the_gpu_gives_the_original_bits() -> None:
    from kernels.huffman_decode import decode_triton, marks_reference, with_marks
    from runtime.compression import encode_bf16, parse_record

    gen = torch.Generator().manual_seed(0)
    for shape in [(4096, 4096), (1, 4097), (3, 1000, 7)]:
        t = (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)
        t.view(-1)[:3] = torch.tensor([float("nan"), float("inf"), -0.0])
        rec = encode_bf16(t)
        assert rec is not None
        coded = parse_record(torch.from_numpy(rec), t.numel()).to("cuda")
        poison = torch.full((t.numel(),), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = decode_triton(coded, out=poison.clone())
        assert torch.equal(_bits(got).cpu(), _bits(t)), shape
        for span in (128, 256, 512):
            marked = with_marks(coded, span)
            assert torch.equal(marked.marks.cpu(), marks_reference(coded, span)), (shape, span)
            got = decode_triton(marked, out=poison.clone())
            assert torch.equal(_bits(got).cpu(), _bits(t)), (shape, span)


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
    llm = LLM(stories_dir, device="cuda")
    assert llm.engine.runner.triton and llm.engine.runner.graphs is not None
    assert _greedy(llm) == want


def test_engine_on_the_gpu_with_weights_kept_compressed(stories_dir: Path) -> None:
    dense = _greedy(LLM(stories_dir, device="cuda"))
    llm = LLM(stories_dir, device="cuda", keep_weights_compressed=True)
    assert llm.engine.compressed is not None and llm.engine.runner.graphs is not None
    assert all(s.coded.marks is not None for b in llm.engine.compressed._blocks for s in b)
    assert _greedy(llm) == dense
