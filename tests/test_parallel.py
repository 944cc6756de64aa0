"""Tensor and pipeline parallelism (runtime.parallel, runtime.ranks): a model split over gloo
ranks that the engine starts itself answers as it does on one rank; each rank holds only its
share; a setting the model cannot take is refused before anything starts; a rank that dies ends
the engine (and a worker) with an error, never a hang."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import openai
import pytest
import torch

from runtime import ranks as ranks_module
from runtime.config import EngineConfig, ModelConfig
from runtime.llm import LLM
from runtime.loader import load_model
from runtime.model.layers import Linear
from runtime.parallel import ParallelConfig, RankPlace, balanced_stages
from runtime.ranks import RankedKVPages, RankFailure
from runtime.sampling_params import SamplingParams
from tests.stack import (
    SECRET,
    chat_model,
    get_json,
    spawned_ranks,
    start_gateway,
    start_worker,
    wait_until,
)

PROMPTS = [
    [1, 403, 407, 261, 378],  # "Once upon a time"
    [1, 300, 301, 302],
    [1, *range(20, 57)],  # 38 tokens: spans several 16-token blocks
    [1, 99],
    [1, 403, 407, 261, 378, 300, 301],  # shares a prefix with the first
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)


def _run(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    """Greedy tokens and the top-5 logprobs at every step, per prompt."""
    outs = llm.generate(PROMPTS, GREEDY)
    result = []
    for o in outs:
        c = o.outputs[0]
        assert c.logprobs is not None
        result.append((list(c.token_ids), [dict(lp.top) for lp in c.logprobs]))
    return result


def _close(llm: LLM) -> None:
    ranks = llm.engine.runner.ranks
    if ranks is not None:
        ranks.close()


def _same(a: list, b: list, atol: float = 1e-4) -> None:  # type: ignore[type-arg]
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb
        for sa, sb in zip(la, lb, strict=True):
            assert sa.keys() == sb.keys()
            for t in sa:
                assert abs(sa[t] - sb[t]) < atol, (t, sa[t], sb[t])


@pytest.fixture(scope="module")
def single(stories_dir: Path, tiny_model_dir):  # type: ignore[no-untyped-def]
    """Each model's answers on one rank, computed once."""
    made: dict[Path, list] = {}  # type: ignore[type-arg]

    def answers(model: Path) -> list:  # type: ignore[type-arg]
        if model not in made:
            made[model] = _run(LLM(model, kv_cache_bytes=4 << 20, num_threads=1))
        return made[model]

    return answers


# (model, tp, pp): stories260K (8 heads, 4 KV heads, 5 layers, tied); a random Llama (llama3 RoPE,
# untied, 2 KV heads) and Qwen2 (q/k/v bias, tied); tp=4 on Qwen2 replicates its 2 KV heads
CASES = [
    ("stories", 2, 1),
    ("stories", 1, 2),
    ("stories", 2, 2),
    ("stories", 1, 3),  # three lanes in flight round a ring of three stages
    ("llama", 2, 1),
    ("llama", 1, 2),
    ("qwen2", 2, 2),
    ("qwen2", 4, 1),
]


@pytest.mark.parametrize(("name", "tp", "pp"), CASES, ids=[f"{n}-tp{t}-pp{p}" for n, t, p in CASES])
def test_split_model_answers_as_one_rank(
    name: str, tp: int, pp: int, stories_dir: Path, tiny_model_dir, single
) -> None:  # type: ignore[no-untyped-def]
    model = stories_dir if name == "stories" else tiny_model_dir(name)
    llm = LLM(model, kv_cache_bytes=4 << 20, tp=tp, pp=pp)
    try:
        assert llm.engine.runner.ranks is not None
        assert llm.engine.runner.ranks.world_size == tp * pp
        got = _run(llm)
        _same(got, single(model))
        # the prefix cache works across the split: the 38-token prompt again finds its two
        # full blocks cached, and the answer is the same
        again = llm.generate([PROMPTS[2]], GREEDY)[0]
        assert again.num_cached_tokens == 32
        assert list(again.outputs[0].token_ids) == got[2][0]
    finally:
        _close(llm)


def test_split_model_with_bfloat16_weights_answers_as_one_rank(stories_dir: Path) -> None:
    """tp=2 (each rank's slice of the vocabulary looked up in bfloat16, widened, then summed)
    and pp=2 with bfloat16 weights under float32: one rank's answers with the same setting."""
    one = LLM(stories_dir, kv_cache_bytes=4 << 20, num_threads=1, weight_dtype="bfloat16")
    want = _run(one)
    for tp, pp in ((2, 1), (1, 2)):
        llm = LLM(stories_dir, kv_cache_bytes=4 << 20, tp=tp, pp=pp, weight_dtype="bfloat16")
        try:
            _same(_run(llm), want)
        finally:
            _close(llm)


def test_pipeline_keeps_a_step_in_flight_per_stage(stories_dir: Path, single) -> None:  # type: ignore[no-untyped-def]
    """pp=2: the engine launches a second lane's step before the first finishes, so both stages
    work at once; the answers are one rank's; a request aborted while its step is in flight
    frees its blocks and disturbs nothing else; KV transfer reads blocks meanwhile."""
    llm = LLM(stories_dir, kv_cache_bytes=4 << 20, pp=2)
    engine = llm.engine
    ranks = engine.runner.ranks
    assert ranks is not None
    try:
        assert engine.lanes == 2
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, GREEDY)
        engine.add_request("victim", [1, 500, 501], SamplingParams(max_tokens=200, ignore_eos=True))
        runner = engine.runner
        events: list[str] = []  # "L<lane>" at a launch, "F" at a finish
        launch, finish = runner.launch, runner.finish

        def launched(out, tables):  # type: ignore[no-untyped-def]
            events.append(f"L{out.scheduled[0].request.lane}")
            return launch(out, tables)

        def finished(step):  # type: ignore[no-untyped-def]
            events.append("F")
            flying = {s.request.request_id for _, o, _ in engine._in_flight for s in o.scheduled}
            if "victim#0" in flying and "victim" in engine._groups:  # launched, not finished
                done["victim"] = engine.abort("victim")
                # KV transfer reads blocks (a collective) while that step is in flight
                read = RankedKVPages(runner, ranks).read(slice(0, 5), [0, 1])
                assert read.shape == (5, 2, 2, 16, 4, 8) and read.abs().sum() > 0
            return finish(step)

        done: dict[str, object] = {}
        runner.launch, runner.finish = launched, finished  # type: ignore[method-assign]
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        # lanes alternate, and each launch but the first comes before the previous one finishes
        assert events[:5] == ["L0", "L1", "F", "L0", "F"], events[:8]
        got = []
        for i in range(len(PROMPTS)):
            c = done[f"r{i}"].outputs[0]  # type: ignore[attr-defined]
            got.append((list(c.token_ids), [dict(lp.top) for lp in c.logprobs]))
        _same(got, single(stories_dir))
        assert done["victim"].outputs[0].finish_reason == "abort"  # type: ignore[attr-defined]
        assert len(done["victim"].outputs[0].token_ids) < 200  # type: ignore[attr-defined]
        blocks = engine.blocks
        assert blocks.num_free_blocks == blocks.num_blocks  # nothing leaked
    finally:
        _close(llm)


def test_a_failed_sampling_step_leaves_the_pipeline_in_step(stories_dir: Path, single) -> None:  # type: ignore[no-untyped-def]
    """pp=2: a step that fails after its logits came back (here in sampling) consumed only
    itself; the step in flight behind it still finishes, and the next answers are one rank's."""
    llm = LLM(stories_dir, kv_cache_bytes=4 << 20, pp=2)
    engine, runner = llm.engine, llm.engine.runner
    sample, calls = runner._sample, [0]

    def failing(*args):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("a sampling bug")
        return sample(*args)

    try:
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, GREEDY)
        runner._sample = failing  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="a sampling bug"):
            while engine.has_unfinished():
                engine.step()
        for rid in engine.unfinished_request_ids():  # what the async engine does then
            engine.abort(rid)
        while engine.has_unfinished():  # the step still in flight comes back
            engine.step()
        runner._sample = sample  # type: ignore[method-assign]
        _same(_run(llm), single(stories_dir))
    finally:
        _close(llm)


def test_expert_parallel_engine_matches_one_rank(tmp_path_factory, stories_dir: Path) -> None:  # type: ignore[no-untyped-def]
    """A mixture-of-experts model through the engine: ep=2, and tp=2 with ep=2 (attention split,
    experts spread over the same ranks), answer as one rank does."""
    import shutil

    import transformers as tf

    from tests.test_moe import _config

    torch.manual_seed(4321)
    hf = tf.AutoModelForCausalLM.from_config(_config("qwen2_moe")).float()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() >= 2:
                p.mul_(3.0)
    d = tmp_path_factory.mktemp("qwen2_moe_engine")
    hf.save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories_dir / f, d / f)
    want = _run(LLM(d, kv_cache_bytes=4 << 20, num_threads=1))
    for tp, ep in ((1, 2), (2, 2)):
        llm = LLM(d, kv_cache_bytes=4 << 20, tp=tp, ep=ep)
        try:
            _same(_run(llm), want)
        finally:
            _close(llm)


def test_each_rank_holds_only_its_share(stories_dir: Path) -> None:
    """tp=2 x pp=2: every rank's parameters are its stage's layers and half of each split
    tensor, the values the whole model has there; summed over the ranks, the split tensors
    are the whole model's bytes once."""
    whole = load_model(stories_dir)
    full = dict(whole.named_parameters())
    par = ParallelConfig(tp=2, pp=2)
    cfg = ModelConfig.from_dir(stories_dir)
    stages = par.stages(cfg)
    total = 0
    seen_layers: set[int] = set()
    for rank in range(par.world_size):
        m = load_model(stories_dir, place=RankPlace(par, rank))
        place = m.place
        assert m.local_layers == stages[place.stage]
        seen_layers |= set(m.local_layers)
        params = dict(m.named_parameters())
        for name, p in params.items():
            total += p.numel()
            if name.startswith("layers."):
                assert int(name.split(".")[1]) in m.local_layers
        assert ("embed_tokens" in params) == place.first
        assert ("norm.weight" in params) == place.last
        if place.first:  # half the vocabulary's rows
            v = cfg.vocab_size // 2
            assert torch.equal(
                params["embed_tokens"], full["embed_tokens"][place.tp_rank * v :][:v]
            )
        i = m.local_layers.start
        attn = m.layers[i].self_attn
        q = cfg.num_heads * cfg.head_dim // 2
        kv = cfg.num_kv_heads * cfg.head_dim // 2
        t = place.tp_rank
        qkv_full = full[f"layers.{i}.self_attn.qkv_proj.weight"]
        qkv = attn.qkv_proj.weight
        assert qkv.shape == (q + 2 * kv, cfg.hidden_size)
        q_all, k_all = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        assert torch.equal(qkv[:q], qkv_full[t * q : (t + 1) * q])
        assert torch.equal(qkv[q : q + kv], qkv_full[q_all + t * kv :][:kv])
        assert torch.equal(qkv[q + kv :], qkv_full[q_all + k_all + t * kv :][:kv])
        o_full = full[f"layers.{i}.self_attn.o_proj.weight"]
        assert torch.equal(attn.o_proj.weight, o_full[:, t * q : (t + 1) * q])  # columns
        inter = cfg.intermediate_size // 2
        down_full = full[f"layers.{i}.mlp.down_proj.weight"]
        assert torch.equal(m.layers[i].mlp.down_proj.weight, down_full[:, t * inter :][:, :inter])
        assert isinstance(attn.o_proj, Linear) and attn.o_proj.reduce is not None
    assert seen_layers == set(range(cfg.num_layers))
    replicated = sum(  # norms: on both tp ranks of their stage
        p.numel() for n, p in full.items() if n.endswith("layernorm.weight") or n == "norm.weight"
    )
    assert total == sum(p.numel() for p in full.values()) + replicated


def test_stages_balanced_by_cost() -> None:
    assert balanced_stages([1.0] * 8, 2) == [range(0, 4), range(4, 8)]
    assert balanced_stages([1.0] * 8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    # the LM head on stage 0 costs 2 layers: stage 0 takes fewer (3 + 2 against 5)
    assert balanced_stages([1.0] * 8, 2, head=2.0) == [range(0, 3), range(3, 8)]
    # an expensive layer gets a stage of its own
    assert balanced_stages([1.0, 1.0, 6.0, 1.0, 1.0], 3) == [range(0, 2), range(2, 3), range(3, 5)]
    assert balanced_stages([5.0], 1) == [range(0, 1)]


def test_settings_a_model_cannot_take(stories_dir: Path, tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    cfg = ModelConfig.from_dir(stories_dir)  # 8 heads, 4 KV heads, intermediate 172, 5 layers
    with pytest.raises(ValueError, match=r"tp=3 does not divide the 8 attention heads"):
        ParallelConfig(tp=3).check(cfg)
    with pytest.raises(ValueError, match=r"tp=8 and the 4 key/value heads|intermediate size 172"):
        ParallelConfig(tp=8).check(cfg)
    with pytest.raises(ValueError, match=r"pp=6 is more than the 5 layers"):
        ParallelConfig(pp=6).check(cfg)
    with pytest.raises(ValueError, match=r"ep=2 needs a mixture-of-experts model"):
        ParallelConfig(ep=2).check(cfg)
    with pytest.raises(ValueError, match=r"ep=4 with tp=2: when both are above 1"):
        ParallelConfig(tp=2, ep=4)
    with pytest.raises(ValueError, match=r"tp must be an integer >= 1, got 0"):
        EngineConfig(model=str(stories_dir), tp=0)
    # refused before any rank starts: the engine raises at once
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=r"tp=3 does not divide"):
        LLM(stories_dir, tp=3)
    assert time.monotonic() - t0 < 5


def test_a_taken_port_is_named(stories_dir: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match=rf"rendezvous on 127.0.0.1:{port}"):
            LLM(stories_dir, tp=2, dist_port=port)
        # and on the command line, one line and exit status 2 (it was a traceback)
        from runtime.cli import main

        assert main(["generate", "--model", str(stories_dir), "--tp", "2", "--dist-port",
                     str(port), "--max-tokens", "1", "Once"]) == 2  # fmt: skip


def test_kv_of_a_split_model_moves_whole(stories_dir: Path) -> None:
    """KV transfer sees a tp=2 x pp=2 cache whole: the blocks it reads are the one-rank engine's
    (within float32 tolerance), and blocks it writes read back the same."""
    params = SamplingParams(temperature=0.0, max_tokens=1)
    one = LLM(stories_dir, kv_cache_bytes=4 << 20, num_threads=1)
    split = LLM(stories_dir, kv_cache_bytes=4 << 20, tp=2, pp=2)
    try:
        prompt = PROMPTS[2]
        for llm in (one, split):  # fresh engines: the prompt takes the same first blocks
            llm.generate([prompt], params)
        ranks = split.engine.runner.ranks
        assert ranks is not None
        pages = RankedKVPages(split.engine.runner, ranks)
        lay = pages.layout
        assert (lay.num_layers, lay.num_kv_heads) == (5, 4)
        # stage 0 holds the LM head too: 2 layers to stage 1's 3; 2 KV heads per tp rank
        assert sorted(pages.shares(), key=lambda s: (s[0].start, s[1].start)) == [
            (range(0, 2), range(0, 2)),
            (range(0, 2), range(2, 4)),
            (range(2, 5), range(0, 2)),
            (range(2, 5), range(2, 4)),
        ]
        blocks = [0, 1]
        data = pages.read(slice(0, lay.num_layers), blocks)  # (5, 2, 2, 16, 4, 8)
        single_blocks = one.engine.runner.kv.view(5, 2, -1, 16, 4, 8)[:, :, blocks]
        assert torch.allclose(data, single_blocks, atol=1e-5)
        assert data.abs().sum() > 0
        # a write into two free blocks reads back the same
        free = [7, 9]
        pages.write(slice(1, 4), free, memoryview(data[1:4].contiguous().numpy()).cast("B"))
        assert torch.equal(pages.read(slice(1, 4), free), data[1:4])
    finally:
        _close(split)


def test_a_dead_rank_fails_the_engine_not_hangs(stories_dir: Path) -> None:
    llm = LLM(stories_dir, kv_cache_bytes=4 << 20, tp=2)
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    told: list[str] = []
    ranks.on_failure.append(told.append)
    try:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
        ranks.procs[0].kill()
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=r"rank 1 of 2 exited"):
            for _ in range(100):  # the watchdog may see it before or during a step
                llm.generate([PROMPTS[1]], SamplingParams(max_tokens=4))
                time.sleep(0.05)
        assert time.monotonic() - t0 < 30
        # the watchdog thread records the failure (which the step raises at once) and then
        # calls the callbacks: on a loaded machine the raise can come first
        wait_until(lambda: told, 10, "the failure callback")
        assert "rank 1 of 2 exited" in told[0]
    finally:
        ranks.close()


def test_a_failed_start_stops_its_ranks(stories_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine that fails once its ranks are up (here: a KV cache too small for one block)
    stops them: the follower, still waiting for its KV cache's size, leaves cleanly, the process
    group goes, and a split engine started next in this process serves (it was refused: the
    default process group was still initialized; the follower died at exit, taking the stop for
    its setup)."""
    started: list[ranks_module.RankGroup] = []
    start = ranks_module.start_ranks

    def recorded(*args, **kwargs):  # type: ignore[no-untyped-def]
        pending, group = start(*args, **kwargs)
        started.append(group)
        return pending, group

    monkeypatch.setattr(ranks_module, "start_ranks", recorded)
    with pytest.raises(ValueError, match=r"kv_cache_bytes=10 holds no block"):
        LLM(stories_dir, tp=2, kv_cache_bytes=10)
    (group,) = started
    assert [p.exitcode for p in group.procs] == [0]  # stopped, not killed
    assert not {p.pid for p in group.procs} & set(_children(os.getpid()))
    assert not torch.distributed.is_initialized()
    llm = LLM(stories_dir, tp=2, kv_cache_bytes=4 << 20)
    try:
        out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        _close(llm)


CATALOG = """
regions:
  - {name: local, latitude: 50.11, longitude: 8.68, settings: {}}
"""


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` and that multiprocessing spawned as ranks."""
    return spawned_ranks(pid)


def test_worker_of_two_ranks_serves_and_dies_cleanly(
    tmp_path: Path, stories_dir: Path, redis_server
) -> None:  # type: ignore[no-untyped-def]
    """`edgeinfer worker --tp 2 --pp 2`: one registered worker of four ranks answers the openai
    client as a one-rank worker does; killing a rank ends it with an error and takes it out of
    the registry."""
    model = chat_model(stories_dir, tmp_path / "stories-chat")
    (tmp_path / "regions.yaml").write_text(CATALOG)
    one = start_worker("one", model, redis_server.url, tmp_path, served="stories-1")
    split = start_worker("split", model, redis_server.url, tmp_path, served="stories",
                         extra=["--tp", "2", "--pp", "2"])  # fmt: skip
    gateway = start_gateway("gw", redis_server.url, tmp_path / "regions.yaml", tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        messages = [{"role": "user", "content": "Tell me a story about a cat."}]
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["workers"] == 2, 30, "2 workers")
        answers = [
            client.chat.completions.create(
                model=m,
                messages=messages,
                max_tokens=16,
                temperature=0,  # type: ignore[arg-type]
            )
            .choices[0]
            .message.content
            for m in ("stories", "stories-1")
        ]
        assert answers[0] and answers[0] == answers[1]
        _, stats = get_json(f"{split.url}/internal/stats", SECRET)
        assert stats["parallel"] == {"tp": 2, "pp": 2, "ep": 1, "ranks": 4,
                                     "stages": [[0, 2], [2, 5]], "lanes": 2}  # fmt: skip
        _, stats = get_json(f"{one.url}/internal/stats", SECRET)
        assert stats["parallel"]["ranks"] == 1
        ranks = _children(split.popen.pid)
        assert len(ranks) == 3, ranks
        os.kill(ranks[1], signal.SIGKILL)
        code = split.popen.wait(timeout=30)
        assert code != 0
        assert "exited" in split.tail(40)
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["workers"] == 1, 10, "deregistered")
        for pid in ranks:  # no rank outlives its worker
            wait_until(lambda pid=pid: not Path(f"/proc/{pid}").exists()
                       or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2], 10,
                       f"rank {pid} gone")  # fmt: skip
        _, health = get_json(f"{one.url}/internal/health", SECRET)
        assert health["worker_id"]
    finally:
        gateway.stop()
        one.stop()
        if split.alive():
            split.kill()


def test_reader_skips_chunks_no_span_touches(tmp_path: Path) -> None:
    """A rank asks for its layers' bytes only; chunks of the file holding none are not read."""
    from runtime.shard_reader import Arena, FileRead, ReadStats, ShardReads, Span

    data = bytes(range(256)) * 64  # 16 KiB: four 4 KiB chunks
    path = tmp_path / "shard.bin"
    path.write_bytes(data)
    arena = Arena(8192)
    spans = [Span(9000, 9100, arena, 0), Span(12288, 16384, arena, 4096)]  # chunks 2 and 3
    stats = ReadStats()
    reads = ShardReads([FileRead(path, len(data), spans)], threads=1, direct=False,
                       chunk_bytes=4096, stats=stats)  # fmt: skip
    reads.wait(0)
    reads.close()
    assert stats.bytes == 8192  # not 16384
    assert bytes(arena.view[0:100]) == data[9000:9100]
    assert bytes(arena.view[4096:8192]) == data[12288:16384]


def test_disaggregation_between_workers_split_differently(
    tmp_path: Path, stories_dir: Path, redis_server
) -> None:  # type: ignore[no-untyped-def]
    """A tp=2 prefill worker and a pp=2 decode worker: the prompt's KV is gathered from the
    prefill side's two ranks, sent whole, and scattered over the decode side's two stages; the
    answers are the colocated engine's."""
    from tests.test_disagg import CATALOG as DISAGG_CATALOG
    from tests.test_disagg import STORY

    (tmp_path / "regions.yaml").write_text(DISAGG_CATALOG)
    url = redis_server.url
    prefill = start_worker("prefill", stories_dir, url, tmp_path, served="stories-disagg",
                           extra=["--role", "prefill", "--tp", "2"])  # fmt: skip
    decode = start_worker("decode", stories_dir, url, tmp_path, served="stories-disagg",
                          extra=["--role", "decode", "--pp", "2"])  # fmt: skip
    gateway = start_gateway("gw", url, tmp_path / "regions.yaml", tmp_path,
                            extra=["--disagg-min-tokens", "0"])  # fmt: skip
    reference = LLM(stories_dir, kv_cache_bytes=4_000_000, num_threads=1)
    try:
        wait_until(lambda: get_json(f"{gateway.url}/readyz")[1]["workers"] >= 2, 30, "workers")
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
        for prompt in (STORY, STORY * 3):
            raw = client.completions.with_raw_response.create(
                model="stories-disagg", prompt=prompt, max_tokens=16, temperature=0.0
            )
            text = raw.parse().choices[0].text
            assert raw.headers.get("x-edgeinfer-prefill-worker") == prefill.meta["worker_id"]
            assert raw.headers["x-edgeinfer-worker"] == decode.meta["worker_id"]
            want = reference.generate([prompt], SamplingParams(max_tokens=16, temperature=0.0))
            assert text == want[0].outputs[0].text
        _, stats = get_json(f"{prefill.url}/internal/stats", SECRET)
        assert stats["kv_pulls_served"] >= 2
    finally:
        gateway.stop()
        prefill.stop()
        decode.stop()


def test_micro_batches_cut_only_compute_bound_steps() -> None:
    from runtime.model_runner import MICRO_BATCH_TOKENS, _Chunk, micro_batches

    decodes = [_Chunk(f"d{i}", 10, [5], True) for i in range(8)]
    assert micro_batches(decodes, 2) == [decodes]  # memory-bound: one pass over the weights
    long = _Chunk("p", 0, list(range(200)), False)
    parts = micro_batches([*decodes, long], 2)
    assert len(parts) == min(4, 208 // MICRO_BATCH_TOKENS) == 3
    pieces = [c for part in parts for c in part if c.request_id == "p"]
    assert [c.start for c in pieces] == [0, 62, 132]  # the prefill cut where the parts end
    assert [t for c in pieces for t in c.ids] == long.ids
    assert all(not c.decode for c in pieces)
    assert sum(len(c.ids) for c in parts[0]) == 70  # 8 decode rows + 62 prompt tokens
    assert micro_batches([long], 1) == [[long]]


def test_pipeline_micro_batches_answer_as_one_rank(stories_dir: Path) -> None:
    """pp=2 on a step long enough to be cut into micro-batches (a 300-token prompt split
    mid-prompt, beside short ones): the answers are one rank's."""
    prompts = [[1, *[(7 * i) % 500 + 3 for i in range(300)]], PROMPTS[0], PROMPTS[2]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    want = LLM(stories_dir, kv_cache_bytes=4 << 20, num_threads=1).generate(prompts, params)
    llm = LLM(stories_dir, kv_cache_bytes=4 << 20, pp=2)
    try:
        got = llm.generate(prompts, params)
        for g, w in zip(got, want, strict=True):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            for a, b in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or [], strict=True):
                assert abs(a.logprob - b.logprob) < 1e-4
    finally:
        _close(llm)


def test_generate_command_splits_and_refuses(stories_dir: Path) -> None:
    """`edgeinfer generate --pp 2` prints what one rank prints; `--tp 3` on 8 heads exits 2
    naming the setting, before any rank starts."""
    import subprocess
    import sys

    from tests.stack import ROOT

    def run(*extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "runtime.cli", "generate", "--model", str(stories_dir),
               "--max-tokens", "12", "--threads", "1", *extra, "Once upon a time"]  # fmt: skip
        return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)

    one, split = run(), run("--pp", "2")
    assert one.returncode == 0 and split.returncode == 0, split.stderr
    assert split.stdout == one.stdout and "Once upon a time" in one.stdout
    bad = run("--tp", "3")
    assert bad.returncode == 2
    assert "tp=3 does not divide the 8 attention heads" in bad.stderr


def test_a_compressed_folder_is_not_split_by_tp(tmp_path: Path, stories_dir: Path) -> None:
    from runtime.compression import compress_model
    from runtime.config import ModelLoadError

    out = tmp_path / "compressed"
    compress_model(stories_dir, out, cast_bf16=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if not (out / f).exists():
            (out / f).write_bytes((stories_dir / f).read_bytes())
    with pytest.raises(ModelLoadError, match=r"cannot be split over tp=2 ranks"):
        load_model(out, place=RankPlace(ParallelConfig(tp=2), 0))
    # a pipeline rank decodes its layers' tensors whole: that works
    m = load_model(out, place=RankPlace(ParallelConfig(pp=2), 1))
    assert m.local_layers == range(2, 5) and m.embed_tokens is None


def test_the_ranks_rendezvous_and_followers_are_local_and_deaf_to_ctrl_c(stories_dir: Path) -> None:
    """The ranks' rendezvous store listens on the loopback interface only (it listened on every
    interface: anyone reaching the host could join the unauthenticated store, whose replies rank
    0 unpickles); a follower ignores SIGINT, which a terminal's Ctrl-C sends the whole process
    group (rank 0 drains and stops them itself: a follower killed by it first failed the
    requests in flight)."""
    llm = LLM(stories_dir, kv_cache_bytes=4 << 20, tp=2)
    ranks = llm.engine.runner.ranks
    assert ranks is not None
    try:
        port = f"{ranks.spec.port:04X}"
        listening = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with contextlib.suppress(OSError), open(table) as f:
                for line in f.readlines()[1:]:
                    local, state = line.split()[1], line.split()[3]
                    if state == "0A" and local.endswith(f":{port}"):
                        listening.append(local)
        assert listening == [f"0100007F:{port}"], listening
        follower = ranks.procs[0].pid
        with open(f"/proc/{follower}/status") as f:
            ignored = int(next(x for x in f if x.startswith("SigIgn:")).split()[1], 16)
        assert ignored >> (signal.SIGINT - 1) & 1
        assert llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    finally:
        ranks.close()
