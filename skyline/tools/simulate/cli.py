"""Entry points of `skyline profile` and `skyline simulate` (called from skyline/cli.py)."""

from __future__ import annotations

import argparse


def main(args: argparse.Namespace, argv: list[str]) -> None:
    if args.command == "profile":
        from skyline.tools.simulate.profiler import main as profile_main

        profile_main(args, argv[1:])
        return
    from skyline.tools.simulate.run import main as run_main

    run_main(args, argv)
