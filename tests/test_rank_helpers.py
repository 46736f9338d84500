"""The tests' rank launcher (``rank_helpers.spawn_ranks``): ranks forked from a fork server started by an earlier test
get what spawned ones would: the test's environment now, its stdout and stderr, its SIGINT disposition, and a rank's
failure raised in the test."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from rank_helpers import spawn_ranks


def _report(rank: int, out: Path) -> None:
    print(f"rank {rank} printed", flush=True)
    print(f"rank {rank} complained", file=sys.stderr, flush=True)
    said = {"env": os.environ.get("RANK_HELPERS_PROBE"), "preloaded": "trainer.worker" in sys.modules,
            "sigint_ignored": signal.getsignal(signal.SIGINT) == signal.SIG_IGN}
    (out / f"rank{rank}.json").write_text(json.dumps(said))


def _fail(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 was told to fail")


def test_ranks_get_the_test_s_environment_output_and_sigint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    spawn_ranks(_report, args=(tmp_path,), nprocs=1)  # the server is running from here on (if no test started it)
    for value, sigint in (("first", signal.SIG_IGN), ("second", signal.default_int_handler)):
        monkeypatch.setenv("RANK_HELPERS_PROBE", value)
        previous = signal.signal(signal.SIGINT, sigint)
        try:
            spawn_ranks(_report, args=(tmp_path,), nprocs=2)
        finally:
            signal.signal(signal.SIGINT, previous)
        said = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert said == [{"env": value, "preloaded": True, "sigint_ignored": sigint == signal.SIG_IGN}] * 2
    out, err = capfd.readouterr()
    assert out.count("rank 0 printed") == 3 and out.count("rank 1 printed") == 2
    assert err.count("rank 1 complained") == 2


def test_a_rank_s_failure_is_raised_in_the_test() -> None:
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 was told to fail"):
        spawn_ranks(_fail, nprocs=2)
