"""`python -m kiln.data.slurm_task OUT --phase P | --resolve P | --finish`: one job of a Slurm curation.

The sbatch scripts of kiln.data.slurm_executor run this, never a user, so it is not a `kiln` verb:
everything it needs is in OUT/work/slurm/plan.json. An array task (--phase) reads its index from
SLURM_ARRAY_TASK_ID plus --offset (the array's first index, for phases split into several arrays).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kiln.data.curate import write_report
from kiln.data.slurm_executor import array_index, array_tasks, merged_stats, resolve
from kiln.errors import ConfigError, DataError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kiln.data.slurm_task", description="one job of a Slurm curation")
    p.add_argument("out", help="the curation's output folder (holds work/slurm/plan.json)")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--phase", type=int, help="run this phase's tasks of array task SLURM_ARRAY_TASK_ID")
    what.add_argument("--resolve", type=int, metavar="PHASE", help="the deduplicator's resolve after PHASE")
    what.add_argument("--finish", action="store_true", help="merge the stats and draw the funnel")
    p.add_argument("--offset", type=int, default=0, help="index of the array's first task in its phase")
    return p


def task(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    out = Path(args.out)
    try:
        if args.phase is not None:
            ran, skipped = array_tasks(out, args.phase, array_index(args.offset))
            print(f"[data] phase {args.phase}: {ran} task(s) run, {skipped} already done (marker found)")
        elif args.resolve is not None:
            resolve(out, args.resolve)
            print(f"[data] phase {args.resolve}: resolved")
        else:
            write_report(merged_stats(out), out)
    except (ConfigError, DataError) as err:
        print(f"kiln: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(task(sys.argv[1:]))
