"""Records the real data-loader straggler jobs that bench_detection_quality's
``loader_stragglers`` section analyzes (issue 19.3): 3-rank torchrun (gloo, CPU) jobs of
``examples/plain_ddp.py`` under ``--instrument`` (its batches read without a DataLoader),
``examples/hf_trainer.py`` and ``examples/lightning_job.py`` with their callbacks; in ``one``
rank 1's loader sleeps 0.1 s a batch, in ``all`` every rank's does.

``python bench/record_loader_jobs.py --bootstrap HOST:PORT`` writes
``tests/data/recordings/loader-<way>-<one|all>.jsonl.gz`` (a broker must answer there)."""
from __future__ import annotations

import argparse
import gzip
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

OUT = HERE.parent / "tests" / "data" / "recordings"


def main(argv=None) -> int:
    import test_integrations_torchrun as t
    from collector_harness import write_recording

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", required=True)
    args = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    for way in sorted(t.JOBS):
        for slow in t.SLOW_LOADERS:
            with tempfile.TemporaryDirectory() as tmp:
                code, out, events = t.run_job(way, slow, args.bootstrap, Path(tmp))
                if code != 0:
                    print(out[-3000:], file=sys.stderr)
                    return 1
                plain = write_recording(events, Path(tmp) / "r.jsonl")
                target = OUT / f"loader-{way}-{slow}.jsonl.gz"
                target.write_bytes(gzip.compress(plain.read_bytes(), mtime=0))
                print(f"{target}: {len(events)} events")
    return 0


if __name__ == "__main__":
    sys.exit(main())
