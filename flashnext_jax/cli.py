"""`flashnext` command line: `flashnext generate` runs one prompt through the engine (`LLM`: the same scheduler,
state store, sampling and MTP as the server; embedded demo model by default); `flashnext serve` is serving/cli.py."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from . import multihost
from .stages import add_pipeline_arguments, pipeline_kwargs


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--token-ids must be integers separated by commas, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--token-ids must not be empty")
    return ids


def _generate(args: argparse.Namespace) -> int:
    from serving.cli import configure_compilation_cache

    from . import api
    from .llm import LLM
    from .sampling import SamplingParams

    model_dir = Path(args.model) if args.model else api.DEMO_MODEL
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{str(model_dir)!r} is not a checkpoint directory")
    if args.prompt is not None and not args.prompt:
        raise ValueError("--prompt must not be empty")
    if args.prompt is not None and not (model_dir / "tokenizer.json").is_file():
        raise ValueError(f"{model_dir} has no tokenizer.json: pass --token-ids instead of --prompt")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                            seed=args.seed, max_tokens=args.max_new_tokens, ignore_eos=not args.stop_at_eos,
                            min_tokens=args.min_tokens)
    k = args.num_speculative_tokens
    multihost.initialize_from(args)  # before anything touches JAX
    configure_compilation_cache(args.compilation_cache)
    # one prompt, one context: no background compiles of wider page tables it may never reach (and no wait at
    # exit for one)
    llm = LLM(model_dir, dtype=args.dtype, max_num_seqs=1, compile_ahead=False, qsa_kv_offload=args.qsa_kv_offload,
              async_scheduling=args.async_scheduling,
              speculative_config={"method": "mtp", "num_speculative_tokens": k} if k else None,
              **pipeline_kwargs(args))
    prompt = args.token_ids if args.token_ids is not None else llm.tokenizer.encode(args.prompt)
    out = llm.generate(prompt, params)[0]
    if out.error:
        raise ValueError(out.error)
    print(f"prompt_token_ids: {out.prompt_token_ids}")
    print(f"output_token_ids: {out.token_ids}")
    if llm.tokenizer is not None:
        print(f"text: {out.text}")
    print(f"finish_reason: {out.finish_reason}")
    if k:
        print(f"mtp_acceptance_rate: {out.metrics['acceptance_rate']}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from serving.cli import (HelpWithDefaults, add_async_scheduling_flag, add_compilation_cache_flag,
                             add_qsa_kv_offload_flag, add_serve_parser)

    # -v before or after the subcommand: the subcommands share it (SUPPRESS: an absent -v there keeps the top's)
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                         help="log what the engine is doing")
    parser = argparse.ArgumentParser(prog="flashnext", description="Qwen3.8-Flash-Next on JAX",
                                     formatter_class=HelpWithDefaults)
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine is doing")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate for one prompt (greedy unless --temperature > 0)",
                         parents=[verbose], formatter_class=HelpWithDefaults)
    gen.add_argument("--model", help="checkpoint directory (default: the embedded demo model)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer.json)")
    src.add_argument("--token-ids", type=_parse_ids, help="prompt as token ids, e.g. 1,2,3")
    gen.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most")
    gen.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="activation / weight dtype")
    gen.add_argument("--stop-at-eos", action="store_true", help="stop early when EOS is generated")
    gen.add_argument("--min-tokens", type=int, default=0,
                     help="with --stop-at-eos: EOS cannot be generated before this many tokens (vLLM's min_tokens)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1 = off)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    gen.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    add_pipeline_arguments(gen)
    multihost.add_process_arguments(gen)
    gen.add_argument("--num-speculative-tokens", type=int, default=0,
                     help="MTP draft tokens per step (0 = off); greedy output is unchanged by it, sampled output keeps "
                          "its distribution")
    add_qsa_kv_offload_flag(gen)
    add_async_scheduling_flag(gen)
    add_compilation_cache_flag(gen)
    gen.set_defaults(func=_generate)
    add_serve_parser(sub, parents=[verbose])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
