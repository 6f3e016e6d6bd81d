"""``vlmshard report``: the balance metrics of one or more plans (DESIGN.md's definitions)."""

from __future__ import annotations

import argparse
import json

from .cli import format_metrics
from .metrics import REPORT_KEYS
from .plan import read_plan_json

HELP = "print the balance metrics of a plan"
DESCRIPTION = """\
Prints the metrics that vlmshard pack measured for PLAN_DIR: pad ratio, ViT / LLM / attention
dist ratios (OmniBal's Dist Ratio; 0 is perfect), fills of Qv and Qt, cost efficiency (1: no
rank ever waits), Spearman rho between step index and step mean length, and the counts."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan_dirs", nargs="+", metavar="PLAN_DIR", help="plan folder(s)")
    p.add_argument("--json", action="store_true", help="print JSON (a list for several plans)")


def main(args: argparse.Namespace) -> int:
    try:
        reports = [{k: read_plan_json(d)["metrics"][k] for k in REPORT_KEYS}
                   for d in args.plan_dirs]
    except (FileNotFoundError, KeyError) as e:
        raise SystemExit(f"vlmshard report: error: {e}") from None
    if args.json:
        print(json.dumps(reports[0] if len(reports) == 1 else reports, indent=1))
    else:
        for d, r in zip(args.plan_dirs, reports):
            print(f"== {d}\n{format_metrics(r)}")
    return 0
