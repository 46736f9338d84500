"""A trainer is given the time to stop that its stop takes: its ranks stop within a step but finish a checkpoint or a
push in flight, then record the stop and delete their lease. Kubernetes (30 s by default), docker-compose (10 s) and
torchrun (30 s between passing its ranks the SIGTERM and killing them) killed a big model's trainer first, its end
unrecorded and its lease left to lapse. The chart's ``trainer.terminationGracePeriodSeconds`` (schema-checked) and
compose's ``stop_grace_period`` set the time; torchrun waits a little less, so it ends before it is killed."""

from __future__ import annotations

import helm_python as helm
import pytest
from test_deploy import COMPOSE
from test_helm_render import containers, find, render


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container["env"] if "value" in e}


@pytest.mark.parametrize(("values", "grace"), [({}, 120), ({"trainer": {"terminationGracePeriodSeconds": 600}}, 600)])
def test_the_trainer_pod_has_its_grace_and_torchrun_a_little_less(values: dict, grace: int) -> None:
    trainer = find(render(values), "StatefulSet", "-trainer")
    assert trainer["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace
    container = containers(trainer)["trainer"]
    assert container["command"] == ["torchrun"]
    assert _env(container)["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(grace - 10)


@pytest.mark.parametrize("grace", [20, "120", 120.5])
def test_a_grace_too_short_or_not_whole_seconds_is_refused(grace: object) -> None:
    with pytest.raises(helm.HelmValuesError, match="trainer/terminationGracePeriodSeconds"):
        render({"trainer": {"terminationGracePeriodSeconds": grace}})


def _seconds(duration: str) -> int:
    """A compose duration of whole seconds or minutes (``120s``, ``2m``)."""
    return int(duration[:-1]) * {"s": 1, "m": 60}[duration[-1]]


@pytest.mark.parametrize("name", [n for n in COMPOSE["services"] if n.startswith("trainer")])
def test_compose_gives_each_trainer_time_to_stop_and_its_torchrun_a_little_less(name: str) -> None:
    service = COMPOSE["services"][name]
    grace = _seconds(service["stop_grace_period"])
    assert grace >= 60, name
    if service["command"][0] == "torchrun":
        assert 0 < int(service["environment"]["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < grace, name
