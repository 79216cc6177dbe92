"""One training rank in miniature, run by an environment's python: ``import trainguard``,
``trainguard.init``, steps, ``close``. Prints JSON: the time of each part and the modules loaded.

    python rank_probe.py JOB BOOTSTRAP PREFIX [STEPS [CLOSE_TIMEOUT]]

Used by the base-install test (against the test broker) and bench_import_cost.py."""
import json
import os
import sys
import time


def wait_for_module(name: str, timeout: float) -> None:
    """The collector creates its Kafka producer on its own thread; wait until it is loaded."""
    deadline = time.perf_counter() + timeout
    while name not in sys.modules and time.perf_counter() < deadline:
        time.sleep(0.001)


def third_party(modules) -> list:
    tops = {m.partition(".")[0] for m in modules}
    return sorted(t for t in tops if t not in sys.stdlib_module_names
                  and not t.startswith("_") and t != "trainguard")


def main(job: str, bootstrap: str, prefix: str, steps: int = 3,
         close_timeout: float = 10.0) -> dict:
    os.environ["TRAINGUARD_TOPIC_PREFIX"] = prefix
    before = set(sys.modules)
    t0 = time.perf_counter()
    import trainguard

    t1 = time.perf_counter()
    tg = trainguard.init(job=job, rank=0, world_size=1, local_rank=0, bootstrap=bootstrap)
    t2 = time.perf_counter()
    for step in range(int(steps)):
        with tg.step(step) as s:
            s.report(loss=1.0 / (step + 1), tokens=128)
    wait_for_module("confluent_kafka", 10.0)
    t3 = time.perf_counter()
    tg.close(timeout=close_timeout)
    loaded = set(sys.modules) - before
    return {"import_s": t1 - t0, "init_s": t2 - t1, "ready_s": t3 - t0,
            "modules": len(loaded), "third_party": third_party(loaded),
            "trainguard_modules": sorted(m for m in loaded if m.startswith("trainguard"))}


if __name__ == "__main__":
    args = sys.argv[1:]
    print(json.dumps(main(args[0], args[1], args[2], *(float(a) for a in args[3:]))))
