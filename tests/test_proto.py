"""The committed gRPC stubs must be what ``make proto`` generates from the .proto files."""

from pathlib import Path

from proto.generate import ROOT, generate


def test_stubs_are_fresh(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert fresh, "no .proto files generated anything"
    for path in fresh:
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.exists(), f"{committed.relative_to(ROOT)} missing: run `make proto`"
        assert committed.read_bytes() == path.read_bytes(), f"{committed.relative_to(ROOT)} is stale: run `make proto`"


def test_service_shape() -> None:
    from proto import checkpoint_pb2

    service = checkpoint_pb2.DESCRIPTOR.services_by_name["CheckpointEngine"]
    assert sorted(m.name for m in service.methods) == ["Abort", "Commit", "Prove", "Stage", "Status"]
    assert service.methods_by_name["Stage"].client_streaming
