"""`flashnext serve`: the OpenAI-compatible server (uvicorn) over one model."""

from __future__ import annotations

import argparse
from pathlib import Path

from flashnext_jax.stages import add_pipeline_arguments, pipeline_kwargs


def add_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    p.add_argument("--model", help="checkpoint directory (default: the embedded demo model)")
    p.add_argument("--served-model-name", help="the model id clients send (default: the directory name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-speculative-tokens", type=int, default=0, help="MTP draft tokens (0 = off)")
    add_pipeline_arguments(p)
    p.add_argument("--compilation-cache", default=None,
                   help="directory of JAX's persistent compilation cache, so a restarted server does not compile "
                        "its step shapes again (about a minute each at the real model size); default: "
                        "$JAX_COMPILATION_CACHE_DIR or ~/.cache/flashnext/jax; 'off' disables it")
    p.set_defaults(func=serve)


def configure_compilation_cache(option: str | None) -> str | None:
    """Turns on JAX's persistent compilation cache (see --compilation-cache); returns the directory or None."""
    import os

    import jax

    if option == "off":
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = option or os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(Path.home() / ".cache" / "flashnext" / "jax")
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    return path


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from flashnext_jax.api import DEMO_MODEL
    from flashnext_jax.llm import LLM

    from .app import create_app

    model_dir = Path(args.model) if args.model else DEMO_MODEL
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    configure_compilation_cache(args.compilation_cache)
    spec = {"method": "mtp", "num_speculative_tokens": args.num_speculative_tokens} \
        if args.num_speculative_tokens else None
    llm = LLM(str(model_dir), max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
              block_size=args.block_size, speculative_config=spec, dtype=args.dtype, **pipeline_kwargs(args))
    app = create_app(llm, args.served_model_name or model_dir.name, exit_on_fault=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0
