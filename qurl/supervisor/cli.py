"""Console entry points: parse `--config X.yaml [key=value ...]`, validate, then hand over."""

from __future__ import annotations

import argparse
import ctypes
import signal
import sys

from omegaconf import DictConfig

from qurl.config import ConfigError, load_config, to_yaml

# Exit codes every qurl process uses. qurl-async restarts a rollout server only for EXIT_FAULT (or a signal).
EXIT_FAULT = 1  # a fault that can pass: a crash, a timeout; resume or restart
EXIT_INPUT = 2  # config, input files or run folder wrong: every try fails the same way until an operator fixes it
EXIT_DIVERGED = 3  # weights non-finite, updates skipped step after step, or the mismatch alarm with mismatch.stop
_PR_SET_PDEATHSIG = 1


def parse(prog: str, argv: list[str] | None = None) -> DictConfig:
    """Load and validate the config, or exit 2 with one line naming the key."""
    parser = argparse.ArgumentParser(prog=prog, description="qurl: RL with quantized rollout")
    parser.add_argument("--config", required=True, help="YAML config file (see configs/)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. rollout.quant=none")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, check_paths=not args.print_config)
    except ConfigError as exc:
        print(f"{prog}: config error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_INPUT) from None
    if args.print_config:
        print(to_yaml(cfg), end="")
        raise SystemExit(0)
    return cfg


def die_with_parent() -> None:
    """Children get SIGTERM if their parent is killed, so no orphan outlives it (a Popen preexec_fn; Linux only)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
