"""Benchmarks: ``tokenselect bench attention`` (one layer), ``tokenselect bench e2e`` (whole model, one request) and
``tokenselect bench throughput`` (whole model, many long requests decoded together)."""

from . import attention, e2e, throughput


def add_parser(subparsers) -> None:
    bench = subparsers.add_parser("bench", help="time the kernels and the engine against dense attention",
                                  description="Speed benchmarks; ratios are against dense attention measured "
                                              "in the same run.")
    inner = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    attention.add_parser(inner)
    e2e.add_parser(inner)
    throughput.add_parser(inner)
