"""The ``vlmshard`` command: one subcommand per stage, each a thin layer over a stage function.

Only the subcommand that runs is imported (its options module first, its stage when it runs),
so ``vlmshard --help`` and ``vlmshard pack --help`` start without torch, DeepSpeed or Ray.
"""

from __future__ import annotations

import argparse
import logging
import sys
from importlib import import_module

from vlmshard import __version__
from vlmshard.process import set_up_logging, skip_collection_at_exit
from vlmshard.stage import add_global_options

# name: (module, one-line help). Each module has DESCRIPTION, add_arguments(parser) and
# main(args) -> exit status.
SUBCOMMANDS = {
    "preprocess": ("vlmshard.preprocess.cli",
                   "tokenize conversations and count image tiles into the stats table"),
    "pack": ("vlmshard.packing.cli",
             "pack samples into micro-batches balanced within and across data-parallel ranks"),
    "write": ("vlmshard.shards.cli",
              "write a plan's micro-batches as pre-balanced WebDataset shards"),
    "verify": ("vlmshard.shards.verify_cli", "check shards: bytes, records, images, the plan"),
    "train": ("vlmshard.train.cli",
              "train on shards with DeepSpeed's pipeline engine; 'train profile' searches the "
              "stage partition"),
    "report": ("vlmshard.report.cli",
               "compare the balance of plans: table, JSON, HTML plots, measured waiting"),
    "simulate": ("vlmshard.simulate.cli",
                 "simulate a plan's epoch at cluster scale: time, GPU-days, bubbles, waiting"),
    "demo-data": ("vlmshard.demo.data",
                  "write the bundled demo dataset (scikit-image photos, generated conversations)"),
    "run": ("vlmshard.run",
            "run every stage from one config: preprocess, pack, write, verify, train, report"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser, with the options of ``command`` alone (the others are listed, not loaded)."""
    parser = argparse.ArgumentParser(
        prog="vlmshard",
        description="Pre-balanced WebDataset shards and balanced pipeline training for VLMs. "
                    "Run `vlmshard COMMAND --help` for a command's options.")
    parser.add_argument("--version", action="version", version=f"vlmshard {__version__}")
    add_global_options(parser, default=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == command:
            module = import_module(module_name)
            p.description = module.DESCRIPTION
            module.add_arguments(p)
            p.set_defaults(func=module.main)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """A command line parsed, nothing run; a bad one exits with the command's own usage (the
    top-level usage only when no command is named)."""
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in SUBCOMMANDS else None)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    skip_collection_at_exit()
    args = parse(sys.argv[1:] if argv is None else argv)
    set_up_logging(logging.DEBUG if args.verbose else logging.WARNING if args.quiet
                   else logging.INFO)
    func = args.func
    # ``quiet`` stays: the runner prints a stage's one line under it (``stage.run_command``)
    for key in ("verbose", "command", "func", "parser", "config_cls"):
        delattr(args, key)
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
