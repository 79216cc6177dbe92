"""A real faust-streaming app for the foundation test: counts telemetry events by type.

Run: python faust_counter_app.py worker; settings from the environment (test-only script).
"""
import json
import os

import faust

from trainguard import events as ev

BROKER = os.environ["COUNTER_BROKER"]
TOPIC = os.environ["COUNTER_TOPIC"]
OUT = os.environ["COUNTER_OUT"]

app = faust.App(os.environ["COUNTER_APP_ID"], broker=BROKER, store="memory://",
                web_enabled=False, topic_disable_leader=True,
                consumer_auto_offset_reset="earliest", datadir=os.environ["COUNTER_DATADIR"])
telemetry = app.topic(TOPIC, value_serializer="raw")
counts: dict = {}


@app.agent(telemetry, concurrency=1)
async def count(stream):
    async for value in stream:
        kind = ev.decode(value).type
        counts[kind] = counts.get(kind, 0) + 1
        with open(OUT + ".tmp", "w") as out:
            json.dump(counts, out)
        os.replace(OUT + ".tmp", OUT)


if __name__ == "__main__":
    app.main()
