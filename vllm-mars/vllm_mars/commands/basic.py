"""``mars tiny-model``, ``mars policies`` and ``mars demo``."""

from __future__ import annotations

import argparse

from vllm_mars.options import dataclass_doc
from vllm_mars.policies import available_policies, get_policy_class
from vllm_mars.tiny_model import TinyModelSpec, build_tiny_model


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("tiny-model", help="build (or find) the tiny random Qwen3 model; prints its dir",
                       description="Build a seeded random-weight Qwen3-architecture model and an offline "
                                   "tokenizer with a chat template. No network; same bytes every time. "
                                   "Cached in the user cache dir ($MARS_CACHE_DIR overrides).")
    p.add_argument("dir", nargs="?", help="output dir (default: the user cache dir)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size, a multiple of 64 (default 128)")
    p.add_argument("--vocab", type=int, default=4096, help="tokenizer vocabulary (default 4096)")
    p.add_argument("--seed", type=int, default=0, help="weight and corpus seed (default 0)")
    p.add_argument("--force", action="store_true", help="rebuild even if it exists")
    p.set_defaults(func=_tiny_model)

    p = sub.add_parser("policies", help="list the registered scheduling policies and their options")
    p.set_defaults(func=_policies)

    p = sub.add_parser("demo", help="multi-turn requests through the CPU engine with MarsScheduler; "
                                    "prints a latency table")
    p.add_argument("--policy", default="fcfs", help="scheduling policy (see `mars policies`)")
    p.add_argument("--workflows", type=int, default=16, help="concurrent workflows (default 16)")
    p.add_argument("--turns", type=int, default=3, help="turns per workflow (default 3)")
    p.add_argument("--num-blocks", type=int, default=40,
                   help="KV blocks of 32 tokens; small enough to force preemption (default 40)")
    p.set_defaults(func=_demo)


def _tiny_model(args: argparse.Namespace) -> int:
    spec = TinyModelSpec(layers=args.layers, hidden=args.hidden, vocab=args.vocab, seed=args.seed)
    print(build_tiny_model(args.dir, spec, force=args.force))
    return 0


def _policies(args: argparse.Namespace) -> int:
    for name in available_policies():
        cls = get_policy_class(name)
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        print(f"{name:16s} {doc}")
        for field, default in dataclass_doc(cls.Config):
            print(f"{'':16s}   {field} = {default!r}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from vllm_mars.demo import run_demo

    return run_demo(policy=args.policy, workflows=args.workflows, turns=args.turns,
                    num_blocks=args.num_blocks)
