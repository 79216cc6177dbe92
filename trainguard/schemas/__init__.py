"""JSON Schemas of the SPEC §1 event types (generated: python -m trainguard.schemas)."""
