"""``mars experiment run FILE``: a grid of workloads x rps x seeds x policies (vllm_mars/experiment)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from vllm_mars.commands.driver import _quiet_engine
from vllm_mars.experiment.grid import cell_dir, is_finished, recorded_runs, run_experiment, select_cells
from vllm_mars.experiment.limit import format_limit, limit_rows, load_limit
from vllm_mars.experiment.readme import update_readme
from vllm_mars.experiment.spec import check_limit, load_experiment
from vllm_mars.experiment.summary import (
    format_policy_summary,
    format_seed_groups,
    merge_records,
    policy_summary,
    profile_notes,
)

#: the repository's experiments folder
EXPERIMENTS = Path(__file__).resolve().parents[3] / "experiments"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("experiment", help="run an experiment grid from a TOML file (experiments/**/*.toml)")
    esub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    r = esub.add_parser("run", help="run every unfinished cell; write results.json, table.md and plots",
                        description="Each cell (workload, rps, seed) runs every policy of the file through the "
                                    "replay driver. Resumable: runs whose dir has summary.json are skipped, and so are "
                                    "runs results.json records without a run dir (a fresh clone; they stay in the table). "
                                    "Writes results.json, table.md (the paper's table shape) and plots to --out.")
    r.add_argument("file", help="experiment TOML file")
    r.add_argument("--out", default=None, help="output dir (default: runs/experiments/<name>)")
    r.add_argument("--only", default=None,
                   help="comma-separated globs over cell keys WORKLOAD/rpsR/seedS, e.g. 'ILR-3/*' or '*/seed0'")
    r.add_argument("--policies", default=None,
                   help="comma-separated: run only these of the file's policies now (the others stay to do)")
    r.add_argument("--rerun", default=None, metavar="POLICIES",
                   help="comma-separated: delete these policies' finished runs in the selected cells and run "
                        "them again (after a change to the code or defaults they run on)")
    r.add_argument("--jobs", type=int, default=1, help="cells run in parallel processes (default 1)")
    r.add_argument("--report", action="store_true",
                   help="run nothing: rewrite table.md, results.json and plots from the finished runs")
    r.add_argument("--limit", default=None, metavar="RESULTS.json",
                   help="the no-thrash limit (another experiment's results.json, e.g. experiments/results/"
                        "paper_grid_nothrash_kernels/results.json): table.md states per cell its mean E2E and "
                        "the share of the gap mars closes; overrides the file's `limit`")
    r.add_argument("--list", action="store_true", help="print the cells (and which are finished) and exit")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=_run)
    g = esub.add_parser("gap", help="print the gap-to-the-no-thrash-limit table of two results.json files",
                        description="Per cell of RESULTS also in LIMIT (same key and workload): the limit's mean "
                                    "E2E and the share of the gap mars closes, (baseline - mars) / (baseline - "
                                    "limit). Reads only the two files (no run dirs).")
    g.add_argument("results", help="an experiment's results.json (e.g. experiments/results/paper_grid/results.json)")
    g.add_argument("limit", help="the limit's results.json "
                                 "(e.g. experiments/results/paper_grid_nothrash_kernels/results.json)")
    g.set_defaults(func=_gap)
    s = esub.add_parser("summary", help="mars and its variants over many cells: ratios to the fastest baseline "
                                        "and to a reference policy",
                        description="Per mars policy (mars and every mars-* label) over the cells of the given "
                                    "results.json files: the geometric mean and lowest of its speedup over each "
                                    "cell's fastest baseline, the cells below 1 - tolerance, the cells where its "
                                    "goodput is more than the tolerance below the best baseline's, and its speedup "
                                    "over the reference policy, and over seeds: the seed groups behind the fastest "
                                    "baseline beyond seed noise (the 95%% interval of the mean over the seeds below "
                                    "1.0). Reads only the files (no run dirs).")
    s.add_argument("results", nargs="+", help="results.json files (their cells are pooled)")
    s.add_argument("--ref", default="mars", help="the reference policy (default mars)")
    s.add_argument("--baselines", default=None,
                   help="comma-separated: only these count as baselines (default: every policy that is not mars)")
    s.add_argument("--only", default=None,
                   help="comma-separated globs over cell keys WORKLOAD/rpsR/seedS (or EXPERIMENT:KEY)")
    s.add_argument("--tolerance", type=float, default=0.01, help="the margin of 'below' (default 0.01)")
    s.add_argument("--merge", action="store_true",
                   help="join the cells of different files that are the same run setup (same key, roots, "
                        "workload definition and replay settings) into one, named EXP1+EXP2:KEY, so that a "
                        "variant in one file is compared with the baselines of another; a label in several "
                        "files takes the first file's numbers. Notes under the table name the cells not "
                        "merged and the labels whose numbers differ")
    s.add_argument("--groups", action="store_true",
                   help="under the table, each seed group (the cells of one workload and load level that differ "
                        "only in their seed, from any of the files) with its geometric mean speedup over the "
                        "fastest baseline, the 95%% interval over its seeds and the verdict (behind, within "
                        "noise, ahead)")
    s.set_defaults(func=_summary)
    m = esub.add_parser("readme", help="regenerate the table of experiments in experiments/README.md from the "
                                       "TOML headers (name, status, description)")
    m.add_argument("dir", nargs="?", default=str(EXPERIMENTS), help="the experiments folder (default %(default)s)")
    m.add_argument("--check", action="store_true", help="write nothing; exit 1 when the table is out of date")
    m.set_defaults(func=_readme)


def _csv(value: str | None) -> list[str] | None:
    """A comma-separated option's items (None when the option was not given)."""
    return [x.strip() for x in value.split(",") if x.strip()] if value else None


def _gap(args: argparse.Namespace) -> int:
    rows, notes = limit_rows(load_limit(args.results), load_limit(args.limit))
    print("\n".join(format_limit(rows, notes, f"`{args.limit}`")))
    return 0


def _summary(args: argparse.Namespace) -> int:
    if not 0 <= args.tolerance < 1:
        raise ValueError(f"--tolerance {args.tolerance}: expected a share in [0, 1)")
    records = [load_limit(f) for f in args.results]
    notes = profile_notes(records, _csv(args.only))
    if args.merge:
        records, merged = merge_records(records, _csv(args.only))
        notes += merged
    rows = policy_summary(records, ref=args.ref, baselines=_csv(args.baselines), only=_csv(args.only),
                          tolerance=args.tolerance)
    if not rows:
        raise ValueError("no mars policy with a mean E2E in the selected cells")
    lines = format_policy_summary(rows, args.tolerance)
    if args.groups:
        lines += ["", *format_seed_groups(rows)]
    print("\n".join(lines + [f"note: {n}" for n in notes]))
    return 0


def _readme(args: argparse.Namespace) -> int:
    changed = update_readme(Path(args.dir), check=args.check)
    readme = Path(args.dir) / "README.md"
    if args.check:
        print(f"{readme}: {'out of date: run mars experiment readme' if changed else 'up to date'}")
        return 1 if changed else 0
    print(f"{readme}: {'written' if changed else 'unchanged'}")
    return 0


def _run(args: argparse.Namespace) -> int:
    _quiet_engine(args)
    exp = load_experiment(args.file)
    if args.limit:
        check_limit(Path(args.limit), "--limit")
        exp = replace(exp, limit=Path(args.limit).resolve())
    if args.jobs < 1:
        raise ValueError(f"--jobs {args.jobs}: expected >= 1")
    out = Path(args.out) if args.out else Path("runs") / "experiments" / exp.name
    only = _csv(args.only)
    if args.list:
        cells = select_cells(exp, only)
        recorded = recorded_runs(exp, out)
        for c in cells:
            state = "done" if is_finished(exp, out, c, recorded) else "todo"
            print(f"{state}  {c.key}  ({len(exp.policies_for(c.workload))} policies)  {cell_dir(out, c)}")
        print(f"{len(cells)} cells, {sum(len(exp.policies_for(c.workload)) for c in cells)} runs")
        return 0
    pols = _csv(args.policies)
    record = run_experiment(exp, out, only, jobs=args.jobs, progress=not args.no_progress and sys.stderr.isatty(),
                            policies=pols, execute=not args.report,
                            rerun=_csv(args.rerun) or ())
    for c in record["cells"]:
        sp = "-" if c.get("speedup") is None else f"{c['speedup']:.2f}x vs {c['baseline']}"
        print(f"{c['key']:32s} mars speedup {sp}")
    print(f"\n{len(record['cells'])} cells done, {len(record['missing'])} missing; "
          f"table: {out / 'table.md'}; results: {out / 'results.json'}")
    return 0
