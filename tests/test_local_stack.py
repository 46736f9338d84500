"""LocalStack's supervision: a crashed component is restarted; one that refused its config (exit 2) is not."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from core.config import CONFIG_ERROR_EXIT
from services.launcher import ComponentSpec, LocalStack


def test_a_crash_restarts_but_a_config_refusal_does_not(tmp_path: Path) -> None:
    crashes = ComponentSpec("crashes", [sys.executable, "-c", "import sys; sys.exit(1)"])
    refuses = ComponentSpec("refuses", [sys.executable, "-c",
                                        f"import sys; print('error: x.y is bad'); sys.exit({CONFIG_ERROR_EXIT})"])
    with LocalStack([crashes, refuses], tmp_path / "logs", poll_s=0.05) as stack:
        deadline = time.monotonic() + 60
        while stack.restarts["crashes"] < 2 or "refuses" not in stack.refused:
            assert time.monotonic() < deadline, (stack.restarts, stack.refused)
            time.sleep(0.05)
        seen = stack.restarts["crashes"]
        time.sleep(1.0)
        assert stack.restarts["refuses"] == 0 and stack.refused == {"refuses"}
        assert stack.restarts["crashes"] > seen  # still restarting the crashing one
    assert (tmp_path / "logs" / "refuses.log").read_text().count("error: x.y is bad") == 1
