"""``sglang-bcg``: ``bench`` (the main job), ``backends``, ``doctor``, ``switch``.

Exit codes (docs/getting-started.md): 0 success; 1 a broken plugin, out of memory, or ``switch`` failed; 2 a bad
argument or an ``--out`` that could not take the results (``--debug`` adds the traceback, never another code); 130
interrupted."""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from ._version import __version__
from ._words import parse_word
from .output.mode import MODES
from .bench.usage import UsageError, shown
from .errors import BackendRegistrationError

if TYPE_CHECKING:
    from .registry import BackendRegistry

_LONG_QUOTED = re.compile(r"'([^'\n]{80})[^'\n]+'")  #: a quoted value longer than an argparse message should echo


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as every other error of the command: one ``error:`` line."""

    def error(self, message: str) -> NoReturn:
        message = _LONG_QUOTED.sub(lambda m: f"'{m.group(1)}…'", " ".join(message.split()))
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _positive(value: str) -> int:
    n = 0
    with contextlib.suppress(ValueError):  # not a number, or more digits than Python converts
        n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {shown(value)}")
    return n


def _word(what: str, words: Iterable[str]) -> Callable[[str], str]:
    """An argparse ``type`` for a flag with ``choices=words``: the word in any case, with surrounding whitespace
    (:func:`.._words.parse_word`), as spelled in ``words``; another value is returned as given, for argparse's "invalid
    choice" error listing the choices."""
    table = {w.lower(): w for w in words}

    def parse(raw: str) -> str:
        try:
            return parse_word(raw, table, what, kind="a choice")
        except ValueError:
            return raw

    return parse


def _bench_parser(sub: argparse._SubParsersAction[Any]) -> None:
    from .bench.config import DTYPES
    from .bench.runner import GRAPH_TREES, REFERENCE_VARIANT, VARIANTS

    width = max(map(len, VARIANTS))
    epilog = "\n".join([  # one line per variant, then the reference row
        "variants (--variants; each one a row per backend, measured in the same run):",
        *(f"  {name.ljust(width)}  {v.meaning}" for name, v in VARIANTS.items()),
        f"{GRAPH_TREES} has no output modes: it ignores --variants and adds one row ({REFERENCE_VARIANT}).",
    ])
    p = sub.add_parser("bench", help="capture a model at SGLang's prefill sizes with each backend in each output mode",
                       epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    models = ("synthetic", "llama")
    p.add_argument("--model", choices=models, type=_word("--model", models), default="synthetic", help="synthetic: our "
                   "tokens-first decoder (default); llama: transformers' LlamaModel, random weights")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--backends", default="breakable,full,piecewise",
                   help="comma-separated backend names; graph-trees: torch.compile's reduce-overhead reference row")
    p.add_argument("--variants", help=f"comma-separated of {', '.join(VARIANTS)} (default: off,on,released on CPU, "
                                      "off,on,floor,guard on CUDA; each is explained below)")
    for flag, text in (("--hidden", "hidden size (default: 2880 on CUDA, 128 on CPU)"),
                       ("--layers", "decoder layers (default: 4 on CUDA, 2 on CPU)"),
                       ("--heads", "attention heads, dividing --hidden (default: 45 on CUDA, 4 on CPU; llama: 64 / 4)"),
                       ("--kv-heads", "key/value heads, dividing --heads (default: 5 on CUDA, 2 on CPU; llama: 8 / 2)"),
                       ("--head-dim", "llama only: head size (default: 64 on CUDA, 16 on CPU)"),
                       ("--intermediate", "MLP width (default: hidden, as gpt-oss-20b experts)")):
        p.add_argument(flag, type=_positive, help=text)
    p.add_argument("--dtype", choices=sorted(DTYPES), type=_word("--dtype", DTYPES),
                   help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--max-tokens", type=_positive, help="largest capture size, >= 4 and fitting in memory "
                                                        "(default: 16384 on CUDA, 256 on CPU)")
    p.add_argument("--repeats", type=_positive,
                   help="replays timed at the largest size (default: 50 on CUDA, 10 on CPU)")
    p.add_argument("--out", help="directory for bench.json and bench.png (created and locked up front; the pair is "
                                 "replaced as one)")
    p.add_argument("--no-progress", action="store_true", help="hide the capture progress bar")


def _bench(args: argparse.Namespace) -> int:
    from .bench.config import build_config
    from .bench.outdir import hold, write_pair
    from .bench.output import PLOT_SKIPPED, format_table, printable, row_line, write_json, write_plot
    from .bench.runner import GRAPH_TREES, cold_summary, graph_trees_row, run_variant, variants_for, warm_up

    registry = _registry()
    for b in registry.broken:  # before the checks: --backends may name one of its backends
        print(f"note: {b.describe()}; its backends are not available ({b.remedy()})", file=sys.stderr)
    cfg = build_config(args, [*registry.names(), GRAPH_TREES])  # every check, before any work
    with hold(cfg.out) if cfg.out else contextlib.nullcontext():  # refused when another live run holds --out
        if ":" in cfg.device:  # pragma: no cover - CUDA only: streams and pools on the chosen GPU
            torch.cuda.set_device(torch.device(cfg.device))
        config = cfg.summary()
        print(*cfg.notes, f"sglang-bcg bench on {cfg.device_name}: {config}", sep="\n", file=sys.stderr)
        start = time.perf_counter()
        cold = cold_summary(warm_up(cfg.workload, [b for b in cfg.backends if b != GRAPH_TREES], cfg.sizes))
        if cold is not None:
            err = cold["forecast_error"]
            print(f"  first schedule of this process ({cold['backend']}/{cold['variant']}, cold): lost "
                  f"{cold['lost_bytes'] / 2**20:,.1f} MiB, forecast with the driver's share "
                  f"{cold['forecast_bytes'] / 2**20:,.1f} MiB" + ("" if err is None else f" ({err * 100:+.1f} %)"),
                  file=sys.stderr)
        rows = []
        for backend in cfg.backends:
            for variant in variants_for(backend, cfg.variants):
                t0 = time.perf_counter()
                row = (graph_trees_row(cfg.workload, cfg.sizes, repeats=cfg.repeats, progress=cfg.progress)
                       if backend == GRAPH_TREES
                       else run_variant(backend, variant, cfg.workload, cfg.sizes, repeats=cfg.repeats,
                                        progress=cfg.progress))
                rows.append(row)
                print(f"  {backend}/{variant} done in {time.perf_counter() - t0:.1f} s: {row_line(row)}",
                      file=sys.stderr)
        print(printable(format_table(rows, timings_meaningful=cfg.gpu), sys.stdout.encoding))
        print(f"({time.perf_counter() - start:.1f} s)", file=sys.stderr)
        if cfg.out is not None:
            shared = (cfg.device_name, config, rows)
            wrote = write_pair(cfg.out, lambda p: write_json(p, *shared, timings_meaningful=cfg.gpu, cold=cold),
                               lambda p: write_plot(p, *shared, timings_meaningful=cfg.gpu))
            if len(wrote) == 1:
                print(PLOT_SKIPPED, file=sys.stderr)
            print("wrote " + " and ".join(str(p) for p in wrote), file=sys.stderr)
    return 0


def _registry() -> BackendRegistry:
    """The registry of the process's plugin manager, the broken plugins' warnings held back: the
    commands print the broken plugins themselves."""
    from .errors import PluginLoadWarning
    from .registry import build_registry

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PluginLoadWarning)
        return build_registry()


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="sglang-bcg", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"sglang-bcg {__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)
    _bench_parser(sub)
    sub.add_parser("backends", help="list registered backends and the module of each; exit 1 if a plugin is broken")
    sub.add_parser("doctor", help="check the SGLang integration (version, hook targets, entry point, flag)")
    switch = sub.add_parser("switch", help="switch (or --show) the output mode of a running SGLang server "
                            "(POST/GET /bcg/output_mode; the server needs --admin-api-key)")
    switch.add_argument("--url", required=True, help="the server, e.g. http://127.0.0.1:30000")
    switch.add_argument("--api-key", help="the server's --admin-api-key (default: $SGLANG_BCG_ADMIN_API_KEY)")
    switch.add_argument("--timeout", help="seconds the whole exchange may take: connecting, sending, "
                        "the answer's headers and body (default 900, at most 86400)")
    target = switch.add_mutually_exclusive_group(required=True)
    target.add_argument("mode", nargs="?", type=_word("mode", MODES), choices=MODES,
                        help="the new output mode (any case)")
    target.add_argument("--show", action="store_true", help="print the current mode and graph memory")
    switch.add_argument("--wait", action="store_true", help="with incremental capture, then wait until every "
                        "prefill size is captured between batches (a GET a second; --timeout bounds it all)")
    # Before the command and after it too (SUPPRESS: not overriding the first); doctor takes nothing else.
    for p, default in ((parser, False), *((command, argparse.SUPPRESS) for command in sub.choices.values())):
        p.add_argument("-v", "--verbose", action="store_true", default=default, help="debug logging; tracebacks")
        p.add_argument("--debug", action="store_true", default=default, help="show tracebacks of errors")
    return parser


def _error_line(exc: BaseException) -> tuple[str | None, int]:
    """The ``error:`` line and exit code of an error the command reports; ``None``: a bug (its traceback)."""
    if isinstance(exc, (UsageError, BackendRegistrationError)):
        return " ".join(str(exc).split()), 2
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted", 130
    text = str(exc).strip()
    if not isinstance(exc, torch.cuda.OutOfMemoryError) and "can't allocate memory" not in text:
        return None, 1
    first = text.splitlines()[0] if text else type(exc).__name__
    return f"out of memory ({first}); lower --max-tokens, --hidden or --layers (--debug: traceback)", 1


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING)
    try:
        if args.command == "bench":
            return _bench(args)
        if args.command == "backends":  # registered backends, then one BROKEN line per broken plugin (exit 1)
            from .registry import listing

            print(*listing(registry := _registry()), sep="\n")
            return 1 if registry.broken else 0
        if args.command == "switch":
            from .cli_switch import key_of, parse_timeout, parse_url, run

            parse_url(args.url)  # every argument checked before any network work
            key, timeout = key_of(args.api_key), parse_timeout(args.timeout)
            return run(args.url, key, None if args.show else args.mode, timeout, wait=args.wait)
        from .sglang.doctor import doctor_main

        return doctor_main([])
    except (UsageError, BackendRegistrationError, RuntimeError, KeyboardInterrupt) as exc:
        line, code = _error_line(exc)
        if line is None:
            raise
        if args.debug or args.verbose:  # the traceback, then the same line and exit code
            traceback.print_exc()
        print(f"error: {line}", file=sys.stderr)
        return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
