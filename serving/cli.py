"""`flashnext serve`: the OpenAI-compatible server (uvicorn) over one model, with vLLM's flag names."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from flashnext_jax import multihost
from flashnext_jax.stages import add_pipeline_arguments, pipeline_kwargs

# vLLM's generation_config.json keys that become request defaults, by SamplingParams name
_GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
# test-only: make the engine's step raise after this many steps (tests/test_server_fault.py)
FAULT_AFTER_STEPS_ENV = "FLASHNEXT_TEST_FAULT_AFTER_STEPS"


class HelpWithDefaults(argparse.HelpFormatter):
    """--help shows each option's default (argparse's ArgumentDefaultsHelpFormatter also prints '(default: None)'
    and skips options without help text)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.option_strings and "(default" not in text and action.default not in (None, False, argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def add_compilation_cache_flag(p) -> None:
    p.add_argument("--compilation-cache", default=None,
                   help="directory of JAX's persistent compilation cache, so a restart does not compile the step "
                        "shapes again (about a minute each at the real model size); default: "
                        "$JAX_COMPILATION_CACHE_DIR or ~/.cache/flashnext/jax; 'off' disables it")


def add_qsa_kv_offload_flag(p) -> None:
    p.add_argument("--qsa-kv-offload", action="store_true",
                   help="keep the QSA layers' K/V pages in pinned host memory and fetch only the blocks the indexer "
                        "selects (for GPUs too small for the context's K/V; costs time per step: "
                        "docs/long-context.md)")


def add_async_scheduling_flag(p) -> None:
    p.add_argument("--async-scheduling", action="store_true",
                   help="launch each decode step before the previous one is committed, its tokens taken on the "
                        "device, so the host's work overlaps the GPU's (vLLM's flag; not with MTP or pipeline "
                        "stages; the n-gram table moves to the device: docs/real-size-decode.md)")


def add_serve_parser(sub, parents=()) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server", parents=list(parents),
                       formatter_class=HelpWithDefaults)
    p.add_argument("--model", help="checkpoint directory (default: the embedded demo model)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer <key>` on /v1 routes (default: $VLLM_API_KEY; unset: none)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="activation / weight dtype")
    p.add_argument("--max-num-seqs", type=int, default=8, help="requests in a batch at most")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192,
                   help="tokens per engine step (the prefill chunk size; vLLM's default)")
    p.add_argument("--max-model-len", type=int, help="context length (default: the model's max_position_embeddings)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the device memory the engine may use; the KV page pool gets what the weights "
                        "leave of it (on the CPU: see docs/engine-design.md)")
    p.add_argument("--enable-prefix-caching", action="store_true", help="reuse the state of shared prompt prefixes")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None,
                   help="a request's tokens and logprobs do not depend on what runs beside it (default: on; "
                        "~1.1x a decode step on the GPU: docs/batch-invariance.md)")
    p.add_argument("--block-size", type=int, default=16, help="KV-cache page size and prefix-snapshot granularity, in tokens")
    p.add_argument("--speculative-config", type=_json_object, default=None,
                   help='speculative decoding as JSON, e.g. \'{"method": "mtp", "num_speculative_tokens": 1}\'')
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="shorthand for --speculative-config with method mtp (0 = off)")
    p.add_argument("--precompile", action="store_true",
                   help="compile the decode and prefill step shapes at startup (progress bar), so no step compiles "
                        "while serving; prefill chunks are cut to --prefill-buckets")
    p.add_argument("--prefill-buckets", type=_buckets, default=None,
                   help="token counts prefill chunks are cut to, ascending, the last = --max-num-batched-tokens "
                        "(e.g. 512,2048,8192), or 'auto' (a 16th, a 4th and all of the chunk; the default with "
                        "--precompile); without either, chunks take any power of two")
    p.add_argument("--chat-template", help="chat template: a Jinja file, or the template itself (default: the "
                                           "model's chat_template.jinja / tokenizer_config.json)")
    p.add_argument("--generation-config", default="auto",
                   help="request defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens): "
                        "'auto' reads the model's generation_config.json, 'vllm' uses none, or a directory holding "
                        "a generation_config.json")
    p.add_argument("--tool-call-parser", choices=["hermes", "qwen3_xml"],
                   help="parse chat tool calls from the output in this format and enforce tool_choice 'required' / "
                        "a named function with its grammar; chat requests with 'tools' need it (unset: a 400)")
    p.add_argument("--reasoning-parser", choices=["qwen3"],
                   help="return the output's <think>...</think> block as reasoning_content; a response_format / "
                        "structured_outputs grammar then applies after </think>")
    p.add_argument("--limit-mm-per-prompt", type=_mm_limits, default=None,
                   help='images per prompt at most, as JSON: \'{"image": 4}\' (other modalities only 0); default: '
                        "the engine's image slots per request (8); a request over it is a 400")
    p.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="DOMAIN",
                   help="hosts http(s) image URLs may be fetched from (without it, only data: URLs: http(s) image "
                        "URLs are a 400)")
    p.add_argument("--max-image-pixels", type=int, default=None,
                   help="pixels of one image as decoded, before the processor resizes it; larger images are a 400 "
                        "(default: Pillow's decompression-bomb threshold, 89,478,485; not a vLLM flag)")
    p.add_argument("--max-image-bytes", type=_positive_int, default=None,
                   help="bytes of one image as encoded (a data: URL's payload, an http(s) download); larger images "
                        "are a 400 before they are decoded or downloaded whole (default: OpenAI's per-image limit, "
                        "20 MiB = 20971520; not a vLLM flag)")
    p.add_argument("--mm-processor-kwargs", type=_processor_kwargs, default=None,
                   help='the image processor\'s resize bounds instead of preprocessor_config.json\'s, as JSON: '
                        '\'{"max_pixels": 1003520}\' (min_pixels, max_pixels, or "size": {"shortest_edge", '
                        '"longest_edge"}); fewer pixels, fewer image tokens')
    add_pipeline_arguments(p)
    multihost.add_process_arguments(p)
    add_qsa_kv_offload_flag(p)
    add_async_scheduling_flag(p)
    add_compilation_cache_flag(p)
    p.set_defaults(func=serve)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _mm_limits(text: str) -> dict:
    from flashnext_jax.media import image_limit

    value = _json_object(text)
    try:
        image_limit(value)  # checked now, not after the model has loaded
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _processor_kwargs(text: str) -> dict:
    from flashnext_jax.vision_preprocess import check_processor_kwargs_names

    value = _json_object(text)
    try:  # the names now; the values against the model's processor once it has loaded
        check_processor_kwargs_names(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _buckets(text: str) -> str | tuple[int, ...]:
    if text == "auto":
        return text
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or comma-separated token counts, got {text!r}") from None


def configure_compilation_cache(option: str | None) -> str | None:
    """Turns on JAX's persistent compilation cache (see --compilation-cache); returns the directory or None."""
    import jax

    if option == "off":
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = option or os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(Path.home() / ".cache" / "flashnext" / "jax")
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    return path


def generation_defaults(option: str, model_dir: Path) -> dict:
    """--generation-config: request defaults by SamplingParams name (vLLM reads the same keys)."""
    if option == "vllm":
        return {}
    where = model_dir if option == "auto" else Path(option)
    f = where / "generation_config.json"
    if not f.is_file():
        if option == "auto":
            return {}
        raise FileNotFoundError(f"--generation-config {option}: no generation_config.json there")
    cfg = json.loads(f.read_text())
    return {ours: cfg[theirs] for theirs, ours in _GENERATION_CONFIG_KEYS.items() if cfg.get(theirs) is not None}


def default_sampling(defaults: dict):
    """The sampling a request gets from the generation defaults alone: its sampler is compiled at startup next to
    the model steps (--precompile), since most requests of such a server sample with it."""
    from flashnext_jax.sampling import SamplingParams

    return SamplingParams(**{k: v for k, v in defaults.items() if k in ("temperature", "top_p", "top_k", "min_p",
                                                                        "repetition_penalty")})


def speculative_config(args) -> dict | None:
    if args.speculative_config and args.num_speculative_tokens:
        raise ValueError("give --speculative-config or --num-speculative-tokens, not both")
    if args.num_speculative_tokens:
        return {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens}
    return args.speculative_config


def _chat_template(option: str) -> str:
    path = Path(option)
    return path.read_text() if len(option) < 4096 and path.is_file() else option


def _inject_fault_for_tests(llm) -> None:
    """FLASHNEXT_TEST_FAULT_AFTER_STEPS=N (tests only): the engine's step raises from step N on."""
    after = os.environ.get(FAULT_AFTER_STEPS_ENV)
    if after is None:
        return
    step, count = llm.engine.step, [0]

    def failing_step():
        count[0] += 1
        if count[0] > int(after):
            raise RuntimeError(f"injected engine fault ({FAULT_AFTER_STEPS_ENV}={after})")
        return step()

    llm.engine.step = failing_step


def serve(args: argparse.Namespace) -> int:
    import jax
    import uvicorn

    from flashnext_jax.api import DEMO_MODEL
    from flashnext_jax.llm import LLM

    from .app import create_app
    from .multiprocess import Leader

    model_dir = Path(args.model) if args.model else DEMO_MODEL
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    defaults = generation_defaults(args.generation_config, model_dir)
    multihost.initialize_from(args)  # before anything touches JAX
    configure_compilation_cache(args.compilation_cache)
    llm = LLM(str(model_dir), max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
              block_size=args.block_size, speculative_config=speculative_config(args), dtype=args.dtype,
              gpu_memory_utilization=args.gpu_memory_utilization, precompile=args.precompile,
              precompile_sampling=[default_sampling(defaults)], limit_mm_per_prompt=args.limit_mm_per_prompt,
              allowed_media_domains=args.allowed_media_domains, max_image_pixels=args.max_image_pixels,
              max_image_bytes=args.max_image_bytes, mm_processor_kwargs=args.mm_processor_kwargs,
              batch_invariant=args.batch_invariant, qsa_kv_offload=args.qsa_kv_offload,
              async_scheduling=args.async_scheduling, **pipeline_kwargs(args),
              **({} if args.prefill_buckets is None else {"prefill_buckets": args.prefill_buckets}))
    if args.chat_template:
        if llm.tokenizer is None:
            raise ValueError("--chat-template: this model has no tokenizer")
        llm.tokenizer.chat_template = _chat_template(args.chat_template)
    _inject_fault_for_tests(llm)
    if jax.process_index() > 0:  # stages in several processes: only process 0 serves HTTP
        return _follow(llm)
    api_key = args.api_key or os.environ.get("VLLM_API_KEY")
    app = create_app(llm, args.served_model_name or model_dir.name, exit_on_fault=True, api_key=api_key,
                     generation_defaults=defaults, tool_call_parser=args.tool_call_parser,
                     reasoning_parser=args.reasoning_parser)
    leader = Leader(llm, app.state.server.fault) if jax.process_count() > 1 else None
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    finally:
        if leader is not None:  # the other processes end with this one
            leader.close()
    return 0


def _follow(llm) -> int:
    """A process > 0 of a server over several processes: it steps with process 0 (serving/multiprocess.py) until
    process 0 shuts down (exit 0) or a process fails (exit 1, at once: not through jax.distributed's exit barrier,
    which would wait for a process 0 that may be gone)."""
    from .multiprocess import follow

    try:
        done = follow(llm)
    except Exception as e:  # noqa: BLE001 - reported, then the process ends
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
    print(f"followed process 0: {json.dumps(done, sort_keys=True)}", flush=True)
    return 0
