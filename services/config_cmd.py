"""``rollwave config check``: the resolved config on stdout; an invalid one is a ConfigError (exit 2)."""

from __future__ import annotations

import argparse
import sys

from core.config import dump_config, load_config, refuse_secret_overrides


def check(args: argparse.Namespace) -> int:
    refuse_secret_overrides(args.overrides)
    sys.stdout.write(dump_config(load_config(args.config, args.overrides)))
    return 0
