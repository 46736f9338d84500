"""``rollwave config check``."""

from __future__ import annotations

import argparse
import sys

from core.config import dump_config, load_config_or_exit


def check(args: argparse.Namespace) -> int:
    cfg = load_config_or_exit(args.config, args.overrides)
    sys.stdout.write(dump_config(cfg))
    return 0
