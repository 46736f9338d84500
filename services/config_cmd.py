"""``rollwave config check``."""

from __future__ import annotations

import argparse
import sys

from core.config import ConfigError, dump_config, load_config


def check(args: argparse.Namespace) -> int:
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(dump_config(cfg))
    return 0
