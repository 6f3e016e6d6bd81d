"""The ``vlmshard`` command: one subcommand per stage, each a thin layer over a stage function."""

from __future__ import annotations

import argparse
import logging
import sys

from vlmshard import __version__

# (name, module): each module has HELP, DESCRIPTION, add_arguments(parser) and main(args) -> int.
SUBCOMMANDS = [
    ("preprocess", "vlmshard.preprocess.cli"),
    ("pack", "vlmshard.packing.cli"),
    ("write", "vlmshard.shards.cli"),
    ("verify", "vlmshard.shards.verify"),
    ("train", "vlmshard.train.cli"),
    ("report", "vlmshard.report.report"),
    ("simulate", "vlmshard.simulate.cli"),
    ("demo-data", "vlmshard.preprocess.demo_data"),
    ("run", "vlmshard.run"),
]


def build_parser() -> argparse.ArgumentParser:
    import importlib

    parser = argparse.ArgumentParser(
        prog="vlmshard",
        description="Pre-balanced WebDataset shards and balanced pipeline training for VLMs.")
    parser.add_argument("--version", action="version", version=f"vlmshard {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in SUBCOMMANDS:
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(func=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    func = args.func
    for key in ("verbose", "quiet", "command", "func"):
        delattr(args, key)
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
