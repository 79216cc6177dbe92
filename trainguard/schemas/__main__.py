"""Regenerate the shipped JSON Schemas: ``python -m trainguard.schemas``."""
import json
from pathlib import Path

from trainguard.events import EVENT_TYPES, json_schema

if __name__ == "__main__":
    folder = Path(__file__).parent
    for kind in EVENT_TYPES:
        path = folder / f"{kind}.json"
        path.write_text(json.dumps(json_schema(kind), indent=2) + "\n")
        print(path)
