"""`summit` command line."""

from __future__ import annotations

import argparse
import sys

DEFAULT_TINY_MODEL = "~/.cache/summit/models/tiny-llama"


def _make_tiny_model(ns: argparse.Namespace) -> int:
    from app.tiny_model import make_tiny_model

    print(make_tiny_model(ns.dir, seed=ns.seed))
    return 0


def _make_model_config(ns: argparse.Namespace) -> int:
    from app.tiny_model import make_model_config

    print(make_model_config(ns.preset, ns.dir))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="summit", description="Serve large open LLMs with vLLM on Ray Serve.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny-model", help="write the tiny random-weight Llama (real tokenizer) to DIR")
    p.add_argument("dir", nargs="?", default=DEFAULT_TINY_MODEL)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_make_tiny_model)

    p = sub.add_parser("make-model-config", help="write a real-shape config.json + tokenizer (for load_format: dummy)")
    p.add_argument("preset", help="llama-3.1-8b | llama-3.1-70b | llama-3.1-405b (or 8b, 70b, 405b)")
    p.add_argument("dir")
    p.set_defaults(func=_make_model_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return ns.func(ns)


if __name__ == "__main__":
    sys.exit(main())
