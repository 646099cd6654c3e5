"""`hpc-tba data`: look at a downloaded data set, convert the papers' data sets to the tasks' rows.

    hpc-tba data show SRC                      # config sub-folders, splits, first row's columns
    hpc-tba data hh-rlhf SRC OUT [--subset S ...] [--split train --split test]
                         [--chosen-reward 1] [--rejected-reward 0] [--responses both|chosen]
    hpc-tba data tldr SRC OUT [--subset S] [--split ...] [--template '...{post}...TL;DR:']

SRC is a file or a folder in any layout tasks.layout reads (a `huggingface-cli download
--local-dir` folder, a hub cache entry `datasets--org--name`, save_to_disk output). OUT is a
folder: one `<split>.jsonl` per split, in the format of task=offline (hh-rlhf) or
task=preference (tldr); see hpc_tba.tasks.convert for the rules.
"""
from __future__ import annotations

import argparse
import sys

USAGE = "usage: hpc-tba data {show,hh-rlhf,tldr} SRC [OUT] [options] (hpc-tba data -h)"
DEFAULT_SPLITS = {"hh-rlhf": ("train", "test"), "tldr": ("train", "validation", "test")}


def _parser() -> argparse.ArgumentParser:
    from hpc_tba.tasks.convert import TLDR_TEMPLATE

    p = argparse.ArgumentParser(prog="hpc-tba data", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    show = sub.add_parser("show", help="config sub-folders, splits and the first row's columns")
    show.add_argument("src")
    for name, what in (("hh-rlhf", "HH-RLHF pairs -> task=offline rows (A-LoL, DPO)"),
                       ("tldr", "TL;DR layouts -> task=preference rows")):
        c = sub.add_parser(name, help=what)
        c.add_argument("src", help="the downloaded data set (file or folder)")
        c.add_argument("out", help="output folder: <split>.jsonl per split")
        c.add_argument("--subset", action="append", default=[],
                       help="config sub-folder(s) to read (default: all holding the split)")
        c.add_argument("--split", action="append", default=[],
                       help=f"split(s) to convert (default: those of {', '.join(DEFAULT_SPLITS[name])} "
                            "that exist)")
        if name == "hh-rlhf":
            c.add_argument("--chosen-reward", type=float, default=1.0)
            c.add_argument("--rejected-reward", type=float, default=0.0)
            c.add_argument("--responses", choices=("both", "chosen"), default="both",
                           help="both: a chosen and a rejected row per pair; chosen: only chosen")
        else:
            c.add_argument("--template", default=TLDR_TEMPLATE,
                           help="prompt from a post's fields {subreddit}, {title}, {post}")
    return p


def data_main(argv: list[str]) -> int:
    from hpc_tba.tasks.convert import convert
    from hpc_tba.tasks.layout import describe, sources
    from hpc_tba.tasks.records import DataError, first_row

    args = _parser().parse_args(argv)
    try:
        if args.cmd == "show":
            for subset, splits in describe(args.src).items():
                for split in splits:
                    files = sources(args.src, split, [] if subset == "." else [subset])
                    cols = ", ".join(sorted(first_row(files[0]))) if files else "?"
                    print(f"{subset}\t{split}\t{len(files)} file(s)\tcolumns: {cols}")
            return 0
        splits = args.split or [s for s in DEFAULT_SPLITS[args.cmd] if _has(args.src, s, args.subset)]
        if not splits:
            raise DataError(args.src, f"none of the splits {', '.join(DEFAULT_SPLITS[args.cmd])} "
                                      "found: name them with --split")
        opts = ({"chosen_reward": args.chosen_reward, "rejected_reward": args.rejected_reward,
                 "responses": args.responses} if args.cmd == "hh-rlhf" else {"template": args.template})
        report = convert(args.cmd, args.src, args.out, splits, subsets=args.subset, **opts)
    except (DataError, ValueError) as e:
        print(f"hpc-tba data: {e}", file=sys.stderr)
        return 2
    for split, counts in report.items():
        print(f"hpc-tba data: wrote {args.out}/{split}.jsonl "
              f"({', '.join(f'{k} {v}' for k, v in counts.items())})")
    return 0


def _has(src: str, split: str, subsets: list[str]) -> bool:
    from hpc_tba.tasks.layout import sources
    from hpc_tba.tasks.records import DataError

    try:
        return bool(sources(src, split, subsets))
    except DataError:
        return False
