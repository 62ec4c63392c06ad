"""The ``phalanx`` command (also ``python -m phalanx``): ``run``, ``timeline``, ``doctor``.

``phalanx run ...`` is ``phalanxrun ...`` (same flags). ``phalanx doctor`` prints versions, transports,
the default backend, whether ``import horovod`` gives phalanx, and the checks that fail with their fixes
(``cli/doctor.py``).
``phalanx timeline summarize TRACE [TRACE ...] [--plot out.png] [--top N]`` prints per activity and tensor:
count, bytes, total and mean time and effective bandwidth (and per rank, with every rank's traces), and
draws a PNG. ``phalanx timeline merge OUT TRACE [TRACE ...]`` joins every rank's trace into one file for
chrome://tracing or Perfetto. Traces still being written are fine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from phalanx.errors import TimelineError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="phalanx", description="phalanx: distributed training with Horovod's "
                                     "API. 'phalanx COMMAND --help' for each command.")
    tools = parser.add_subparsers(dest="tool", required=True, metavar="COMMAND")
    tools.add_parser("run", add_help=False, help="run a command as N ranks: phalanxrun's flags "
                     "(phalanx run -np 2 python train.py; phalanx run --help)")
    tools.add_parser("doctor", help="versions, transports, and what to fix before a first job")
    timeline = tools.add_parser("timeline", help="read Chrome traces written by HOROVOD_TIMELINE")
    actions = timeline.add_subparsers(dest="action", required=True)
    summ = actions.add_parser("summarize", help="table per activity and tensor, and an optional picture")
    summ.add_argument("traces", nargs="+", metavar="TRACE", help="trace file(s): one per rank, segments")
    summ.add_argument("--plot", metavar="OUT.png", help="also draw communication against time as a PNG")
    summ.add_argument("--top", type=int, default=10, help="tensors per activity in the table (0: all)")
    merge = actions.add_parser("merge", help="merge every rank's trace into one file Chrome opens")
    merge.add_argument("out", metavar="OUT", help="the merged trace to write")
    merge.add_argument("traces", nargs="+", metavar="TRACE")
    return parser


def _summarize(args: argparse.Namespace) -> int:
    from phalanx.timeline.plot import default_title, render_png
    from phalanx.timeline.reader import load_trace
    from phalanx.timeline.summary import render

    trace = load_trace(args.traces)
    print(render(trace, top=args.top))
    if args.plot:
        try:
            render_png(trace.spans, args.plot, default_title(args.traces))
        except OSError as e:
            raise TimelineError(f"cannot write the picture {args.plot!r}: {e.strerror or e}") from e
        print(f"picture: {args.plot}")
    return 0


def _merge(args: argparse.Namespace) -> int:
    from phalanx.timeline.reader import merge

    count = merge(args.traces, args.out)
    print(f"{count} events from {len(args.traces)} file(s) written to {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``phalanx`` command; return its exit code (2: bad arguments, 1: unreadable trace or a failed
    doctor check; ``run``: phalanxrun's)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        from phalanx.cli import main as phalanxrun

        return phalanxrun.main(argv[1:], prog="phalanx run")
    args = _parser().parse_args(argv)
    if args.tool == "doctor":
        from phalanx.cli import doctor

        text, failed = doctor.report()
        print(text)
        return 1 if failed else 0
    try:
        if args.action == "merge":
            return _merge(args)
        return _summarize(args)
    except TimelineError as e:
        print(f"phalanx: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
