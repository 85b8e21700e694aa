"""megassm-plan: rank the layouts of a cluster by predicted speed (docs/planner.md).

    megassm-plan --config configs/hybrid-7b.yaml --nodes 4 --gpus-per-node 8 [--gpu h100-80gb] [--network ib400]
                 [--global-batch 256] [--top 10] [--json] [--write recipe.yaml]
    megassm-plan calibrate --out configs/planner/h100-80gb.json       # on a GPU: the compute table
    megassm-plan calibrate --median A.json B.json C.json --out F.json  # each entry's median over several files
    megassm-plan validate                                             # the prediction beside every measured row
"""
from __future__ import annotations

import argparse
import sys

EXIT_OK, EXIT_CONFIG = 0, 2


def _calibrate(argv: list[str]) -> int:
    from megassm.planner import calibrate as cal

    ap = argparse.ArgumentParser(prog="megassm-plan calibrate", description="Measure the planner's compute table "
                                 "on the GPU at hand (minutes) and write it as JSON.")
    ap.add_argument("--out", required=True, help="the calibration file to write (e.g. configs/planner/h100-80gb.json)")
    ap.add_argument("--config", action="append", help="a config whose blocks to measure (repeatable; default: the "
                    "shipped 1.3B / 2.7B / 7B flavors)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop measuring after this many seconds (what is "
                    "not reached is listed in the file)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run: numbers meaningless)")
    ap.add_argument("--median", nargs="+", metavar="FILE", help="measure nothing: write each entry's median over "
                    "these calibration files of one GPU kind (no GPU needed)")
    args = ap.parse_args(argv)
    if args.median:
        return _median(args.median, args.out)
    try:
        table = cal.calibrate(args.config or cal.DEFAULT_CONFIGS, device=args.device, budget_s=args.budget_s,
                              log=lambda m: print(m, file=sys.stderr, flush=True))
    except RuntimeError as e:
        print(f"megassm-plan calibrate: {e}", file=sys.stderr)
        return EXIT_CONFIG
    cal.write(table, args.out)
    print(args.out)
    return EXIT_OK


def _median(paths: list[str], out: str) -> int:
    import json
    import os

    from megassm.planner import calibrate as cal

    tables = []
    for p in paths:
        try:
            with open(p) as f:
                tables.append(json.load(f))
        except (OSError, ValueError) as e:
            print(f"megassm-plan calibrate --median: {p}: {e}", file=sys.stderr)
            return EXIT_CONFIG
    try:
        table = cal.median_of(tables, [os.path.basename(p) for p in paths])
    except (ValueError, KeyError) as e:
        print(f"{e}", file=sys.stderr)
        return EXIT_CONFIG
    cal.write(table, out)
    print(out)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["calibrate"]:
        return _calibrate(argv[1:])
    from megassm.planner.plan import main as plan_main

    return plan_main(argv)


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
