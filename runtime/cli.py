"""The `edgeinfer` command line: generate, chat, import-gguf; pull, models, verify, rm (the
local model store); compress (lossless bfloat16 weight compression); worker, gateway, up
(service_cli).

Environment variables are read here only: EDGEINFER_CACHE (edgeinfer's cache folder),
EDGEINFER_STORE (the model store; default: the cache folder's `models`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("EDGEINFER_CACHE", Path.home() / ".cache" / "edgeinfer"))
DEFAULT_STORE = Path(os.environ.get("EDGEINFER_STORE") or DEFAULT_CACHE / "models")


def port_arg(text: str) -> int:
    """An argparse type: a TCP port to listen on or meet at (1-65535)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid port {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 1-65535, got {value}")
    return value


def port_or_zero(text: str) -> int:
    """An argparse type: a port (1-65535), or 0 for a free one."""
    return 0 if text.strip() == "0" else port_arg(text)


def _at_least(least: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `least`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {value}")
        return value

    return parse


positive_int = _at_least(1)
non_negative_int = _at_least(0)


def positive_float(text: str) -> float:
    """An argparse type: a number > 0 (seconds, gigabytes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not value > 0 or value == float("inf"):  # (nan fails `> 0`)
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return value


def _fraction(text: str) -> float:
    """An argparse type: --kv-cache-fraction, in (0, 0.95] (EngineConfig's range)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if not 0 < value <= 0.95:
        raise argparse.ArgumentTypeError(f"must be in (0, 0.95], got {text}")
    return value


def name_flags(message: str, flags: dict[str, str]) -> str:
    """`message`, from a config class that names its fields (kv_cache_dtype='bfloat16',
    body_timeout_s), with the command-line flags the user typed instead: `field='value'` or
    `field=N` becomes `--flag value`, a field alone (or `field (--flag)`) the flag. A field
    right after `=` or a word character is left (tp=pp=ep=1 is a value, not three settings)."""
    for name, flag in flags.items():

        def setting(m: re.Match[str], flag: str = flag) -> str:
            return f"{flag} {m.group(1) if m.group(1) is not None else m.group(2)}"

        message = re.sub(rf"(?<![\w=-]){re.escape(name)}=(?:'([^']*)'|(-?[\d.]+))", setting,
                         message)  # fmt: skip
        message = re.sub(rf"(?<![\w=-]){re.escape(name)}\b(?!=)(?: \({re.escape(flag)}\))?",
                         flag, message)  # fmt: skip
    return message


# EngineConfig's and SpeculativeConfig's fields and the flags that set them (runtime.config's
# messages name the fields: the Python API's words). The speculative ones first: their messages
# say "speculative num_tokens"
ENGINE_FLAGS = {
    "speculative num_tokens": "--num-speculative-tokens",
    "speculative max_batch_tokens": "--spec-max-batch-tokens",
    "speculative draft_kv_cache_bytes": "--draft-kv-cache-bytes",
    "speculative draft_model": "--draft-model",
    "num_tokens": "--num-speculative-tokens",
    "keep_weights_compressed": "--keep-weights-compressed",
    "weight_dtype": "--weight-dtype",
    "kv_cache_dtype": "--kv-cache-dtype",
    "kv_cache_bytes": "--kv-cache-bytes",
    "kv_cache_fraction": "--kv-cache-fraction",
    "kv_cache_commit": "--kv-cache-commit",
    "max_num_seqs": "--max-num-seqs",
    "max_num_batched_tokens": "--max-num-batched-tokens",
    "max_model_len": "--max-model-len",
    "max_waiting": "--max-waiting",
    "num_threads": "--threads",
    "dist_port": "--dist-port",
    "dtype": "--dtype",
    "device": "--device",
    "tp": "--tp",
    "pp": "--pp",
    "ep": "--ep",
}


def engine_flags_message(message: str) -> str:
    """An EngineConfig (or SpeculativeConfig) refusal in the words of the command line."""
    if "ngram_min" in message or "ngram_max" in message:  # (--spec-ngram MIN MAX sets both)
        message = "--spec-ngram MIN MAX: " + message.replace("ngram_min", "MIN").replace(
            "ngram_max", "MAX"
        )
    return name_flags(message, ENGINE_FLAGS)


def _model_dir(arg: str | None, store: str | None = None) -> str:
    """The folder `--model` names: a folder path, a model in the store (`store`, default
    DEFAULT_STORE), or the default model (no `arg`), imported into the store on first use."""
    from runtime.model_store import ModelStore, StoreError

    models = ModelStore(store or DEFAULT_STORE)
    if arg:
        try:
            return str(models.resolve(arg))
        except StoreError:
            from runtime.model_cache import DEFAULT_MODEL

            if arg != DEFAULT_MODEL:  # the default model is imported when first named, too
                raise
    from runtime.model_cache import default_model_dir

    return str(default_model_dir(models.root))


def _store_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        default=None,
        help=f"model store folder (default: EDGEINFER_STORE or {DEFAULT_CACHE / 'models'})",
    )


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="model folder, or the name of a model in the store (edgeinfer models); default: "
        "SmolLM2-135M-Instruct, imported on first use",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="the dtype to run in (default auto: the checkpoint's; bfloat16 on CUDA)")  # fmt: skip
    p.add_argument("--weight-dtype", default="auto", choices=["auto", "bfloat16"],
                   help="store the linear weights, embedding and LM head in bfloat16 under "
                   "--dtype float32 on the CPU: half the bytes a decode step reads, float32 "
                   "products and sums (default auto: in --dtype)")  # fmt: skip
    p.add_argument("--kv-cache-bytes", type=positive_int, default=None,
                   help="bytes for the KV cache (default: --kv-cache-fraction of the memory)")  # fmt: skip
    p.add_argument("--kv-cache-fraction", type=_fraction, default=0.25,
                   help="the KV cache's share of the memory left once the weights are in, when "
                   "--kv-cache-bytes is not given: of the available RAM on the CPU (or of the "
                   "container's memory limit, where that leaves less), of the free GPU memory on "
                   "CUDA (default %(default)s)")  # fmt: skip
    p.add_argument("--kv-cache-commit", default="lazy", choices=["lazy", "eager"],
                   help="on the CPU, commit the KV cache's memory as blocks first use it (lazy, "
                   "the default: a fast start) or all at start-up (eager: no page faults while "
                   "serving)")  # fmt: skip
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16"],
                   help="the KV cache's element type: auto (the model's dtype: exact) or "
                   "bfloat16 under a float32 model on the CPU (twice the tokens in the same "
                   "memory, half the bytes decode attention reads; keys and values rounded to "
                   "bfloat16 when written)")  # fmt: skip
    p.add_argument("--max-num-seqs", type=positive_int, default=128,
                   help="requests in one batch at most (default 128)")  # fmt: skip
    p.add_argument("--max-num-batched-tokens", type=positive_int, default=2048,
                   help="tokens in one step at most: prompt chunks + decodes (default 2048)")  # fmt: skip
    p.add_argument("--max-model-len", type=non_negative_int, default=None,
                   help="context length, at most the model's (default, or 0: the model's)")  # fmt: skip
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads (default: torch's, one per physical core)")  # fmt: skip
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: CUDA when torch sees a GPU (bfloat16 weights, Triton kernels), "
                   "else the CPU")  # fmt: skip
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="on CUDA, run decode steps eagerly instead of replaying captured graphs")  # fmt: skip
    p.add_argument("--keep-weights-compressed", action="store_true",
                   help="keep the layers' bfloat16 weights Huffman-compressed in memory (about "
                   "two thirds of their bytes) and decode each layer's just before it runs: "
                   "more memory for the KV cache (on a GPU: a model larger than its memory); "
                   "lossless, slower steps")  # fmt: skip
    p.add_argument("--no-packed-weights", action="store_true",
                   help="on the CPU, read every float32 weight as it is, not the exact Q4_1 / "
                   "Q8_0 blocks found in a GGUF-imported model's weights")  # fmt: skip
    p.add_argument("--speculative", choices=["ngram", "draft"], default=None,
                   help="speculative decoding: ngram (prompt lookup) or draft (a small draft "
                   "model, --draft-model); default off")  # fmt: skip
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="the draft model's folder for --speculative draft (same tokenizer as "
                   "the model)")  # fmt: skip
    # The speculative-only options default to None (not given: SpeculativeConfig's defaults,
    # which their help states), so that one given without the --speculative it needs is refused
    # (check_speculative_flags) rather than ignored.
    p.add_argument("--draft-kv-cache-bytes", type=positive_int, default=None,
                   help="bytes for the draft model's KV cache, with --speculative draft "
                   "(default 64 MiB)")  # fmt: skip
    p.add_argument("--num-speculative-tokens", type=positive_int, default=None,
                   help="most draft tokens per request per step, with --speculative (default 4)")  # fmt: skip
    p.add_argument("--spec-ngram", type=positive_int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="n-gram lengths matched, shortest and longest, with --speculative ngram "
                   "(default 2 4)")  # fmt: skip
    p.add_argument("--spec-max-batch-tokens", type=positive_int, default=None,
                   help="no speculation when a step's decodes with drafts would exceed this "
                   "many tokens, with --speculative (default 32)")  # fmt: skip
    p.add_argument("--tp", type=positive_int, default=1,
                   help="tensor-parallel ranks: attention heads, MLP rows and vocabulary split "
                   "(default 1)")  # fmt: skip
    p.add_argument("--pp", type=positive_int, default=1,
                   help="pipeline-parallel stages: layers split, balanced by cost (default 1)")  # fmt: skip
    p.add_argument("--ep", type=positive_int, default=1,
                   help="expert-parallel ranks of a mixture-of-experts model; with --tp above 1, "
                   "equal to it (default 1)")  # fmt: skip
    p.add_argument("--dist-port", type=port_or_zero, default=None,
                   help="127.0.0.1 port where the ranks meet (default: a free one)")  # fmt: skip


def _sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most "
                   "(default 128)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (the default) is greedy; higher samples more freely")  # fmt: skip
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1: off)")
    p.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens "
                   "(default -1: off)")  # fmt: skip
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this share of the likeliest one (default 0: off)")  # fmt: skip
    p.add_argument("--seed", type=int, default=None, help="seed a sampled run (reproducible)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, object]:
    """EngineConfig fields from the options `_engine_args` adds (the model folder aside)."""
    return {
        "dtype": args.dtype,
        "weight_dtype": args.weight_dtype,
        "kv_cache_bytes": args.kv_cache_bytes,
        "kv_cache_fraction": args.kv_cache_fraction,
        "kv_cache_commit": args.kv_cache_commit,
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "num_threads": args.threads,
        "device": args.device,
        "cuda_graphs": not args.no_cuda_graphs,
        "packed_weights": not args.no_packed_weights,
        "keep_weights_compressed": args.keep_weights_compressed,
        "tp": args.tp,
        "pp": args.pp,
        "ep": args.ep,
        "dist_port": args.dist_port,
        "speculative": None if args.speculative is None else _speculative(args),
    }


def _speculative(args: argparse.Namespace) -> dict[str, object]:
    """SpeculativeConfig fields from the speculative options given (the rest: its defaults)."""
    ngram = args.spec_ngram or (None, None)
    fields = {
        "method": args.speculative,
        "num_tokens": args.num_speculative_tokens,
        "ngram_min": ngram[0],
        "ngram_max": ngram[1],
        "max_batch_tokens": args.spec_max_batch_tokens,
        "draft_model": args.draft_model,
        "draft_kv_cache_bytes": args.draft_kv_cache_bytes,
    }
    return {name: value for name, value in fields.items() if value is not None}


# Speculative-only options and the --speculative methods that use them (None: any method)
_SPECULATIVE_FLAGS = {
    "draft_model": ("--draft-model", "draft"),
    "draft_kv_cache_bytes": ("--draft-kv-cache-bytes", "draft"),
    "spec_ngram": ("--spec-ngram", "ngram"),
    "num_speculative_tokens": ("--num-speculative-tokens", None),
    "spec_max_batch_tokens": ("--spec-max-batch-tokens", None),
}


def check_speculative_flags(args: argparse.Namespace) -> None:
    """Refuse (a one-line SystemExit) a speculative-only option given without the --speculative
    method that uses it: it was ignored, silently. Only options given count: they default to
    None."""
    method = args.speculative
    for dest, (flag, needs) in _SPECULATIVE_FLAGS.items():
        if getattr(args, dest) is None or (method is not None and needs in (None, method)):
            continue
        wanted = f"--speculative {needs}" if needs else "--speculative ngram or draft"
        got = f"with --speculative {method}" if method else "without --speculative"
        raise SystemExit(f"edgeinfer: error: {flag} needs {wanted}; it was given {got}")
    if method == "draft" and args.draft_model is None:
        raise SystemExit("edgeinfer: error: --speculative draft needs --draft-model DIR (the "
                         "draft model's folder)")  # fmt: skip


def check_max_model_len(model_dir: str, max_model_len: int | None) -> None:
    """Refuse (a one-line SystemExit) a --max-model-len longer than the model's context, read
    from its config.json before anything loads, where the engine would refuse it (ValueError,
    the same words naming its max_model_len) only once it is reading the weights (each of
    `up`'s workers, say)."""
    if not max_model_len or max_model_len < 0:  # (0: the model's; below 0: EngineConfig's)
        return
    from runtime.config import ModelConfig

    refusal = ModelConfig.from_dir(model_dir).max_model_len_refusal(
        model_dir, max_model_len, "--max-model-len"
    )
    if refusal is not None:
        raise SystemExit(f"edgeinfer: error: {refusal}")


def engine_config(model_dir: str, args: argparse.Namespace, **more: object):  # type: ignore[no-untyped-def]
    """The EngineConfig the engine options ask for (its device and dtype resolved as the engine
    will), built without reading the model: a combination it refuses (--dtype float16 with
    --kv-cache-dtype bfloat16, say) is a one-line SystemExit naming the flags, not its fields."""
    from runtime.config import EngineConfig

    try:
        return EngineConfig(model=model_dir, **engine_kwargs(args), **more)  # type: ignore[arg-type]
    except ValueError as e:
        raise SystemExit(f"edgeinfer: error: {engine_flags_message(str(e))}") from None


def check_model_folder(model_dir: str, max_model_len: int | None = None) -> None:
    """Refuse (a one-line SystemExit) a folder that is no model folder (no config.json, or one
    that is no JSON object: ModelConfig.from_dir's words), and a --max-model-len past its
    context, before anything starts. Read here, not with ModelConfig: runtime.config imports
    torch (1.6 s and 200 MB, for the life of `up`, which loads no model itself)."""
    import json

    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise SystemExit(f"edgeinfer: error: --model: {path}: missing (is {model_dir} a Hugging "
                         "Face model folder?)")  # fmt: skip
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise SystemExit(f"edgeinfer: error: --model: {path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise SystemExit(f"edgeinfer: error: --model: {path}: not a JSON object")
    check_max_model_len(model_dir, max_model_len)


def start_weights_early(model_dir: str, args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """Start reading the weights as soon as the model folder is known (the imports and the
    engine's set-up go on meanwhile); split over ranks with --tp/--pp/--ep, the other ranks
    started first. A setting the model cannot take stops us here, before anything is served."""
    from runtime.ranks import start_weights

    check_max_model_len(model_dir, args.max_model_len)
    # the engine's own config: its device and dtype (bfloat16 on CUDA) resolved as it will be
    return start_weights(engine_config(model_dir, args))


def _build_llm(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    # As `edgeinfer worker` starts (service_cli.cmd_worker): no cyclic garbage collection while
    # starting (torch and the engine allocate hundreds of thousands of objects and no garbage to
    # speak of; the collector's passes over them cost ~0.2 s), and the weights read from as
    # soon as the model folder is known, while the engine's imports and set-up go on.
    import gc

    gc.disable()
    t0 = time.monotonic()
    model_dir = _model_dir(args.model, args.store)
    weights = start_weights_early(model_dir, args)
    from runtime.llm import LLM

    llm = LLM(model_dir, weights=weights, **engine_kwargs(args))
    gc.freeze()  # what start-up made is never scanned again
    gc.enable()
    print(f"loaded {llm.engine.config.model} in {time.monotonic() - t0:.1f}s", file=sys.stderr)
    return llm


def _params(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """The sampling options as SamplingParams, made before the model loads: a bad one is
    refused at once (a one-line SystemExit naming the option), not after the load."""
    from runtime.sampling_params import InvalidRequestError, SamplingParams

    try:
        return SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            seed=args.seed,
            stop=args.stop,
        )
    except InvalidRequestError as e:  # (each field of these is an option's dest)
        raise SystemExit(f"edgeinfer: error: --{e.param.replace('_', '-')}: {e.message}") from e


def _stream(llm, prompt: str | list[int], params, head: str = "") -> tuple[str, bool]:  # type: ignore[no-untyped-def]
    """Run one request, printing `head` once it is accepted (a request the engine refuses
    raises InvalidRequestError first), then the text as it is produced, then a newline (all on
    stdout; the token count on stderr). Returns the text, and whether Ctrl-C cut it short."""
    from runtime.sampling_params import InvalidRequestError

    engine = llm.engine
    rid = engine.next_request_id()
    try:
        engine.add_request(rid, prompt, params)
    except InvalidRequestError as e:  # (a context-length refusal: the API's field named)
        if e.code != "context_length_exceeded":
            raise
        # the options the user typed and can change: --max-tokens as _params names it, and
        # those that set the limit the request met
        message = e.message.replace("max_tokens", "--max-tokens") + _limit_options(engine)
        param = "--max-tokens" if e.param == "max_tokens" else e.param
        raise InvalidRequestError(param, message, e.code) from None
    print(head, end="", flush=True)
    text, tokens, t0, interrupted = "", 0, time.monotonic(), False
    try:
        while engine.has_unfinished():
            for out in engine.step():
                o = out.outputs[0]
                print(o.delta_text, end="", flush=True)
                text, tokens = o.text, len(o.token_ids)
    except KeyboardInterrupt:
        engine.abort(rid)
        print(" [interrupted]", end="")
        interrupted = True
    dt = time.monotonic() - t0
    print(flush=True)  # (the completion's line ends on stdout: piped, prompts stay apart)
    print(f"[{tokens} tokens, {tokens / max(dt, 1e-9):.1f} tok/s]", file=sys.stderr)
    return text, interrupted


def _text_arg(what: str, text: str) -> str:
    """`text` (a command-line argument or stdin, as Python decoded it) as the engine takes it: a
    one-line SystemExit naming `what` when it is not UTF-8 (the bytes that are not arrive as
    lone surrogates, a TypeError in the tokenizer: a traceback)."""
    # (runtime.sampling_params, not runtime.llm: this runs before the model's load starts, and
    # runtime.llm imports the engine, torch and all, which the load overlaps)
    from runtime.sampling_params import InvalidRequestError, check_text

    try:
        check_text(what, text)
    except InvalidRequestError as e:
        raise SystemExit(f"edgeinfer: error: {e}") from None
    return text


def _stdout_gone() -> int:
    """The exit status once stdout's reader has gone (`edgeinfer generate ... | head`): 141, a
    command killed by SIGPIPE's, said nowhere (it was 'edgeinfer: error: [Errno 32] Broken
    pipe', status 2). stdout is pointed at /dev/null first, so that the interpreter's last
    flush of what is left in its buffer does not fail too ('Exception ignored ...')."""
    with contextlib.suppress(OSError, ValueError):  # (no file descriptor: nothing to flush)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return 141


def _stdin_prompt() -> str:
    """The prompt read from stdin; a one-line SystemExit when there is none."""
    prompt = _text_arg("prompt (stdin)", sys.stdin.read())
    if not prompt:
        raise SystemExit("edgeinfer: error: no prompt: stdin was empty; give one as an "
                         "argument, or on stdin")  # fmt: skip
    return prompt


def cmd_generate(args: argparse.Namespace) -> int:
    params = _params(args)
    prompts = [_text_arg("prompt", p) for p in args.prompt]
    if not prompts and sys.stdin is None:  # (`<&-`: sys.stdin.read() was an AttributeError)
        raise SystemExit("edgeinfer: error: no prompt: give one as an argument, or on stdin "
                         "(which is closed)")  # fmt: skip
    if any(not p for p in prompts):  # (the engine refused it, once the model had loaded)
        raise SystemExit("edgeinfer: error: prompt: must not be empty")
    # stdin that is no terminal (a pipe, a file, /dev/null) is read before the model loads, so
    # that an empty one is refused at once; a terminal's after, once it says so
    if not prompts and not sys.stdin.isatty():
        prompts = [_stdin_prompt()]
    llm = _build_llm(args)
    if not prompts:
        print("no prompt given: type one, then Ctrl-D", file=sys.stderr)  # (as if it hung)
        prompts = [_stdin_prompt()]
    try:
        for prompt in prompts:
            if len(prompts) > 1:
                print(f"--- {prompt!r}")
            if _stream(llm, prompt, params, head=prompt)[1]:
                return 130  # Ctrl-C stops the command, not only the prompt it was on
    except BrokenPipeError:
        return _stdout_gone()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    system = _text_arg("--system", args.system) if args.system else None
    if sys.stdin is None:  # (`<&-`: input() was a RuntimeError, after the model had loaded)
        raise SystemExit("edgeinfer: error: edgeinfer chat reads your messages from stdin, "
                         "which is closed")  # fmt: skip
    llm = _build_llm(args)
    if not llm.tokenizer.has_chat_template:
        print(f"edgeinfer: error: {llm.engine.config.model} has no chat template, so `edgeinfer "
              "chat` cannot make a prompt of a conversation; complete text with it instead: "
              f"edgeinfer generate --model {args.model} 'Once upon a time'", file=sys.stderr)  # fmt: skip
        return 2
    _check_chat_template(llm)
    messages = [{"role": "system", "content": system}] if system else []
    print("chat with the model; an empty line or Ctrl-D ends", file=sys.stderr)
    try:
        while True:
            try:
                line = input("you> ").strip()
            except EOFError:
                print(file=sys.stderr)
                return 0
            except KeyboardInterrupt:  # (during a reply it stops the reply; here, the chat)
                print(file=sys.stderr)
                return 130  # as an interrupted command exits: a script sees it was not ended
            if not line:
                return 0
            messages = _chat_turn(llm, messages, line, params)
    except BrokenPipeError:
        return _stdout_gone()


def _check_chat_template(llm) -> None:  # type: ignore[no-untyped-def]
    """Refuse (a one-line SystemExit) a chat template that does not compile before the first
    prompt, as one that is missing is (it was refused once the user had typed a message)."""
    from runtime.tokenizer import TokenizerFileError

    try:  # (NoChatTemplateError, named templates none of them "default": main says it)
        llm.tokenizer.check_chat_template()
    except TokenizerFileError as e:  # ("chat template does not compile: ...")
        raise SystemExit(f"edgeinfer: error: {llm.engine.config.model}: its {e.message}") from None


def _limit_options(engine) -> str:  # type: ignore[no-untyped-def]
    """The options behind a context-length refusal where they set it, as a sentence to append
    (the engine's message names the limit, not the command line that chose it)."""
    said = []
    own = engine.model.cfg.max_model_len
    if engine.max_model_len < own:
        said.append(f"--max-model-len {engine.max_model_len} sets it; the model's own is {own} "
                    "tokens")  # fmt: skip
    capacity = engine.scheduler.capacity_tokens
    if capacity < engine.max_model_len:
        said.append("--kv-cache-bytes or --kv-cache-fraction sets the KV cache's size")
    return f" ({'; '.join(said)})" if said else ""


def _chat_turn(llm, history: list[dict[str, str]], line: str, params) -> list[dict[str, str]]:  # type: ignore[no-untyped-def]
    """Answer the user's `line` after `history`, streaming the reply. Returns the conversation
    to go on with: with the line and the reply, its oldest turns dropped if it outgrew the
    context (a system message kept); or `history` as it was, when the engine refuses the line
    (too long even alone, say), which is said."""
    from runtime.sampling_params import InvalidRequestError
    from runtime.tokenizer import ChatTemplateError

    try:
        _text_arg("message", line)
    except SystemExit as e:  # (a line typed in another encoding: the chat goes on)
        print(f"{e.code}\n(that message was not sent; the conversation goes on)", file=sys.stderr)
        return history
    messages = [*history, {"role": "user", "content": line}]
    first = int(messages[0]["role"] == "system")  # (kept)
    dropped = 0
    while True:
        try:
            rendered = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
            reply = _stream(llm, ids, params, head="model> ")[0]
            break
        except InvalidRequestError as e:
            if e.code == "context_length_exceeded" and len(messages) - first > 1:
                del messages[first : first + 2]  # the oldest turn: a message and its reply
                dropped += 1
                continue
            print(f"edgeinfer: error: {e}\n(that message was not sent; the conversation goes on)",
                  file=sys.stderr)  # fmt: skip
            return history
        except ChatTemplateError as e:  # (a ValueError: it ended the chat, exit status 2)
            print(f"edgeinfer: error: the chat template of {llm.engine.config.model} failed on "
                  f"the conversation: {e}\n(that message was not sent; the conversation goes on)",
                  file=sys.stderr)  # fmt: skip
            return history
    if dropped:
        print(f"[the conversation outgrew the model's context: its oldest {dropped} turn(s) "
              "were dropped]", file=sys.stderr)  # fmt: skip
    return [*messages, {"role": "assistant", "content": reply}]


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr)


@contextlib.contextmanager
def _clean_up_on_sigterm() -> Iterator[None]:
    """For a command that builds a folder to rename into place (import-gguf, pull, compress):
    SIGTERM (`kill`, a container stopping) exits 143 through the command's cleanup, as
    Ctrl-C does, instead of killing it outright and leaving the hidden half-built folder behind
    (in a folder that is not a store, nothing ever swept it). The previous handler is back
    afterwards; off the main thread (where no handler can be set) nothing changes."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(_signum: int, _frame: object) -> None:
        print("edgeinfer: terminated; nothing written", file=sys.stderr)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second one: at once
        raise SystemExit(128 + signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def cmd_import_gguf(args: argparse.Namespace) -> int:
    from runtime.gguf_common import GGUFImportError
    from runtime.gguf_import import import_gguf

    try:
        out = import_gguf(Path(args.file), Path(args.out_dir), dtype=args.dtype, progress=_progress)
    except GGUFImportError as e:
        print(f"edgeinfer: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, an output path under a file, ...: nothing was written
        print(f"edgeinfer: error: importing {args.file} into {args.out_dir}: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _store(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from runtime.model_store import ModelStore

    return ModelStore(args.store or DEFAULT_STORE)


def cmd_pull(args: argparse.Namespace) -> int:
    from runtime.model_store import DEFAULT_SHARD_BYTES

    try:
        path = _store(args).pull(
            args.source,
            args.name,
            shard_bytes=args.shard_size or DEFAULT_SHARD_BYTES,
            force=args.force,
            progress=_progress,
        )
    except KeyboardInterrupt:
        print("edgeinfer: interrupted; the store is as it was", file=sys.stderr)
        return 130
    print(path)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from runtime.model_store import human_bytes

    store = _store(args)
    rows = [("NAME", "SIZE", "SHARDS", "CREATED", "SOURCE")]
    for m in store.list():
        source = f"({m.note})" if m.note else m.source
        rows.append((m.name, human_bytes(m.total_bytes), str(m.shards), m.created or "-", source))
    if len(rows) == 1:
        print(f"no models in {store.root}; add one with: edgeinfer pull SOURCE", file=sys.stderr)
        return 0
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from runtime.manifest import is_compressed, read_manifest

    store = _store(args)
    problems = store.verify(args.name, progress=_progress)
    folder = store.model_folder(args.name)  # the store's, whatever the working folder holds
    compressed = is_compressed(folder)
    if problems:
        for line in problems:
            print(f"edgeinfer: error: {line}", file=sys.stderr)
        if compressed:
            print("compress it again, into an empty folder: edgeinfer compress SOURCE OUT_DIR",
                  file=sys.stderr)  # fmt: skip
        else:
            print(f"pull it again: edgeinfer pull SOURCE --name {args.name} --force",
                  file=sys.stderr)  # fmt: skip
        return 1
    covered = ""
    if compressed:
        from runtime.compression import read_manifest as read_compressed

        shards = len(read_compressed(folder).shards)
    else:
        manifest = read_manifest(folder)
        shards = len(manifest.shards) if manifest else 0
        if manifest is not None and manifest.files is None:
            covered = " (of the shards; its other files have no checksums: an older pull)"
    print(f"{args.name}: {shards} shard{'s' if shards != 1 else ''}, every checksum matches"
          f"{covered}")  # fmt: skip
    return 0


def cmd_compress(args: argparse.Namespace) -> int:
    from runtime.compression import compress_model
    from runtime.model_store import human_bytes

    s = compress_model(
        _model_dir(args.model, args.store),
        Path(args.out_dir),
        cast_bf16=args.cast_bf16,
        chunk_elems=args.chunk_elems,
        threads=args.threads,
        progress=_progress,
    )
    print(
        f"{s.out}: {human_bytes(s.compressed_bytes)}, {100 * s.ratio:.1f}% of bfloat16 "
        f"({human_bytes(s.bf16_bytes)}; exponent-entropy floor "
        f"{100 * s.entropy_floor_bytes / s.bf16_bytes:.1f}%); {s.huffman_tensors} tensors "
        f"coded, {s.raw_tensors} stored as they are"
    )
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    print(f"removed {_store(args).remove(args.name)}")
    return 0


def _size(text: str) -> int:
    from runtime.model_store import parse_size

    try:
        n = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 bytes")
    return n


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="edgeinfer", description="edge LLM inference runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete prompts with a model, streaming to stdout")
    _engine_args(g)
    _sampling_args(g)
    _store_arg(g)
    g.add_argument("prompt", nargs="*", help="prompt text, one prompt per argument (quote a "
                   "sentence: \"Once upon a time\"); none: one prompt read from stdin, as it is "
                   "(a trailing newline included)")  # fmt: skip
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="chat with a model in the terminal, using its chat template")
    _engine_args(c)
    _sampling_args(c)
    _store_arg(c)
    c.add_argument("--system", default=None, help="system message")
    c.set_defaults(func=cmd_chat, temperature=0.0)

    i = sub.add_parser("import-gguf", help="convert a GGUF file into a Hugging Face model folder")
    i.add_argument("file", help="the .gguf file (Llama architecture; F32, F16, Q8_0, Q4_0, "
                   "Q4_1, Q4_K, Q6_K and more, dequantized with the gguf package)")  # fmt: skip
    i.add_argument("out_dir", help="the folder to write (safetensors shards, tokenizer.json, "
                   "chat template); it must not exist yet, or be empty")  # fmt: skip
    i.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the weights' dtype in the folder (default float32: exact)")  # fmt: skip
    i.set_defaults(func=cmd_import_gguf)

    pl = sub.add_parser(
        "pull", help="write a model into the local store, re-sharded, with checksums"
    )
    pl.add_argument(
        "source",
        help="Hugging Face model folder, .gguf file, or SmolLM2-135M-Instruct (the bundled one)",
    )
    pl.add_argument("--name", default=None, help="name in the store (default: the source's)")
    pl.add_argument(
        "--shard-size",
        type=_size,
        default=None,
        help="largest shard, e.g. 256MB, 1GiB, 65536 (default 512MiB)",
    )
    pl.add_argument("--force", action="store_true", help="replace a model of the same name")
    _store_arg(pl)
    pl.set_defaults(func=cmd_pull)

    ls = sub.add_parser("models", help="list the models in the local store")
    _store_arg(ls)
    ls.set_defaults(func=cmd_models)

    v = sub.add_parser("verify", help="re-read a stored model and check every shard's checksums")
    v.add_argument("name", help="the name of a model in the store (edgeinfer models; not a "
                   "folder path)")  # fmt: skip
    _store_arg(v)
    v.set_defaults(func=cmd_verify)

    rm = sub.add_parser("rm", help="remove a model from the local store")
    rm.add_argument("name", help="the name of a model in the store (edgeinfer models; not a "
                    "folder path); a model that is a symbolic link loses the link alone")  # fmt: skip
    _store_arg(rm)
    rm.set_defaults(func=cmd_rm)

    z = sub.add_parser(
        "compress",
        help="write a losslessly compressed copy of a bfloat16 model (Huffman-coded exponents)",
    )
    z.add_argument("model", help="model folder, or the name of a model in the store")
    z.add_argument("out_dir", help="folder to write (must not exist, or be empty)")
    z.add_argument(
        "--cast-bf16",
        action="store_true",
        help="cast float32/float16 weights to bfloat16 first (rounds them: lossy)",
    )
    z.add_argument(
        "--chunk-elems",
        type=int,
        default=4096,
        help="values per independently decodable chunk (a multiple of 64; smaller: more "
        "parallel decoding, slightly larger files)",
    )
    z.add_argument("--threads", type=positive_int, default=2, help="encoding threads")
    _store_arg(z)
    z.set_defaults(func=cmd_compress)

    from runtime.service_cli import add_service_commands

    add_service_commands(sub, _engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # after the command: its usage, not the top level's (as parse_args did)
            words = sys.argv[1:] if argv is None else argv
            subparsers = next(
                a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
            )
            before = words[: words.index(args.command)] if args.command in words else []
            said = parser if set(unknown) & set(before) else subparsers.choices[args.command]
            said.error(f"unrecognized arguments: {' '.join(unknown)}")
        if hasattr(args, "speculative"):  # a command with the engine's options
            check_speculative_flags(args)
        if args.func in (cmd_import_gguf, cmd_pull, cmd_compress):
            with _clean_up_on_sigterm():
                return int(args.func(args))
        return int(args.func(args))
    except KeyboardInterrupt:  # Ctrl-C while a model loads, say: no traceback, the usual code
        print(file=sys.stderr)
        return 130
    except SystemExit as e:  # a command's own one-line refusal: exit status 2, as for the rest
        if isinstance(e.code, str) and e.code.startswith("edgeinfer: error:"):
            print(e.code, file=sys.stderr)
            return 2
        raise
    except Exception as e:
        # Imported only here: `runtime.config` imports torch, which a command imports itself
        # once it has set up for it (generate and worker: with cyclic GC off).
        from safetensors import SafetensorError

        from runtime.config import ModelLoadError
        from runtime.sampling_params import InvalidRequestError

        # ValueError: a setting that fails its config's check (each names the setting). OSError
        # and SafetensorError (safetensors' own I/O errors): a full disk, a read-only folder, a
        # name too long, wherever a command did not report it itself (the last resort)
        if isinstance(
            e, (ModelLoadError, InvalidRequestError, ValueError, OSError, SafetensorError)
        ):
            print(f"edgeinfer: error: {e}", file=sys.stderr)
            return 2
        import redis.exceptions

        if isinstance(e, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
            print(f"edgeinfer: error: cannot reach Redis ({e}); give its URL with --redis or "
                  "EDGEINFER_REDIS", file=sys.stderr)  # fmt: skip
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
