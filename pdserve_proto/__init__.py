"""Stubs generated from proto/pdserve_proto by scripts/gen_proto.py."""
