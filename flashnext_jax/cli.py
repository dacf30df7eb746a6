"""`flashnext` command line: `flashnext generate` runs greedy generation (embedded demo model by default)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--token-ids must be integers separated by commas, got {text!r}") from None


def _generate(args: argparse.Namespace) -> int:
    from . import api

    model_dir = Path(args.model) if args.model else api.DEMO_MODEL
    model = api.load(model_dir, dtype=args.dtype)
    tokenizer = None
    if (model_dir / "tokenizer.json").exists():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if args.token_ids is not None:
        ids = args.token_ids
    else:
        if tokenizer is None:
            raise ValueError(f"{model_dir} has no tokenizer.json: pass --token-ids instead of --prompt")
        ids = tokenizer.encode(args.prompt, add_special_tokens=False).ids
    new = model.generate(ids, max_new_tokens=args.max_new_tokens, stop_at_eos=args.stop_at_eos)
    print(f"prompt_token_ids: {list(map(int, ids))}")
    print(f"output_token_ids: {new}")
    if tokenizer is not None:
        print(f"text: {tokenizer.decode(new)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flashnext", description="Qwen3.8-Flash-Next on JAX")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine is doing")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="greedy generation for one prompt")
    gen.add_argument("--model", help="checkpoint directory (default: the embedded demo model)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer.json)")
    src.add_argument("--token-ids", type=_parse_ids, help="prompt as token ids, e.g. 1,2,3")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    gen.add_argument("--stop-at-eos", action="store_true", help="stop early when EOS is generated")
    gen.set_defaults(func=_generate)
    from serving.cli import add_serve_parser

    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
