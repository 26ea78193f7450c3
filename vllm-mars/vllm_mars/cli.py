"""``mars``: the command line. Each subcommand lives in its own module with ``add_parser(sub)``;
heavy imports (vllm, torch) happen inside the command, so ``mars --help`` is instant."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

#: Modules that contribute subcommands; each defines ``add_parser(subparsers)`` which registers
#: its parsers and sets ``func`` (called with the parsed args, returns an exit code).
COMMAND_MODULES = [
    "vllm_mars.commands.basic",
    "vllm_mars.commands.agents",
    "vllm_mars.commands.driver",
    "vllm_mars.commands.workload",
    "vllm_mars.commands.admission",
    "vllm_mars.commands.serve",
    "vllm_mars.commands.experiment",
    "vllm_mars.commands.profile",
    # issue 5 (admission/sidecar) and issue 6 (driver) add their modules here
]


class _ArgumentError(Exception):
    """A command line argparse refused: reported as one line by :func:`main`."""


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (``mars CMD: error: ...``, exit 2) instead of the usage block
    and a SystemExit from inside the parser; subparsers inherit it."""

    def error(self, message: str):  # type: ignore[override]
        raise _ArgumentError(f"{self.prog}: error: {message}")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mars",
        description="vllm-mars: agent-centric serving on stock vLLM (admission control + scheduler plugin)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except _ArgumentError as e:
        print(e, file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        print(f"mars {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
