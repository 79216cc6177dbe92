"""A bare Faust agent that only counts: ``stream.take_events(10000, within=0.2)`` over the
telemetry topic, no decoding. Prints ``RATE <events/s>`` after PROBE_EVENTS events. It
measures Faust's own per-message cost on this machine for bench_stream_throughput.py.

Run: python faust_take_probe.py worker -l error; settings from PROBE_* variables.
"""
import os
import sys
import time

import faust

app = faust.App(os.environ["PROBE_APP"], broker=os.environ["PROBE_BROKER"], store="memory://",
                web_enabled=False, topic_disable_leader=True, autodiscover=False,
                consumer_auto_offset_reset="earliest", datadir=os.environ["PROBE_DATADIR"],
                stream_buffer_maxsize=65536, broker_max_poll_records=10000,
                worker_redirect_stdouts=False)
source = app.topic(os.environ["PROBE_TOPIC"], key_serializer="raw", value_serializer="raw")
WANT = int(os.environ["PROBE_EVENTS"])
state = {"got": 0, "began": None}


@app.agent(source, concurrency=1)
async def count(stream):
    async for events in stream.take_events(10000, within=0.2):
        if state["began"] is None:
            state["began"] = time.perf_counter()
        state["got"] += len(events)
        if state["got"] >= WANT:
            rate = state["got"] / (time.perf_counter() - state["began"])
            print(f"RATE {rate:.0f}", flush=True)
            sys.stdout.flush()
            os._exit(0)


if __name__ == "__main__":
    app.main()
