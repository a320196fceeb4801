"""The committed stubs in pdserve_proto/ are exactly what proto/ generates (CI fails if stale)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_up_to_date(tmp_path):
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    gen = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = gen
    spec.loader.exec_module(gen)
    fresh = {p.name: p.read_bytes() for p in gen.generate(tmp_path) if p.is_file()}
    committed = {p.name: p.read_bytes() for p in (ROOT / "pdserve_proto").iterdir() if p.is_file()}
    stale = sorted(n for n in fresh if committed.get(n) != fresh[n])
    assert not stale, f"regenerate with `python scripts/gen_proto.py`: stale {stale}"
    assert set(committed) == set(fresh), sorted(set(committed) ^ set(fresh))


def test_import_name_does_not_collide_with_proto_plus():
    import pdserve_proto.pdserve_pb2 as pb

    assert pb.DESCRIPTOR.package == "pdserve.v1"
    assert "Generation" in pb.DESCRIPTOR.services_by_name
