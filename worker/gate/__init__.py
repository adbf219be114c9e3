"""Keyed deduplication: the gate that keeps, per key, one task running and at most one waiting."""
