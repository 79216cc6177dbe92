"""trainguard.streams — ``trainguard worker`` (the stream processors) and ``trainguard
record`` / ``trainguard replay``.

Topics (``<app>`` is the Faust app id ``<prefix>.<id>``; ``--id`` defaults to
``trainguard-worker``; every topic is created at startup, before anything subscribes):

=================================  =========  ===============================================
topic                              key        what
=================================  =========  ===============================================
``<prefix>.telemetry``             job/rank   SPEC telemetry in (``job/node`` for gpu, xid)
``<app>-summaries``                job        RankStage and NodeStage summaries, batched
                                              per job (:mod:`.logic`); as many partitions
                                              as telemetry; retention one day
``<prefix>.anomalies``             job        ``ev.encode(anomaly)``
``<prefix>.deadletter``            original   invalid input (:mod:`trainguard.deadletter`)
``<app>-rank-state``               job/rank   compacted; rank and node slots (data-only
                                              JSON, :mod:`.snapshots`)
                                              (partition of their telemetry; a node slot's
                                              key is ``job NUL node``)
``<app>-job-state-changelog``      job        compacted; the Faust table ``job-state`` of
                                              job slots, data-only (partition of the job's
                                              summaries)
=================================  =========  ===============================================

Two consumer groups: ``<app>-ranks`` (rank side, confluent-kafka batches, :mod:`.ranks`)
and ``<app>`` (job side, a Faust agent with ``concurrency=1``, :mod:`.app`), both on the
classic group protocol. One job's rank work spreads over all workers (by partition); its
cross-rank work runs where its summaries partition is. The GPU checks run per machine on
the rank side (``NodeStage``), so that they spread too.

State and restarts: each side snapshots the stages it changed (rank side every 2 s, job
side every 5 s), flushes, and only then commits its input offsets, so a committed offset
never passes a snapshot. After a crash the restored slots skip input they had already seen
(rank slots by telemetry offset; job slots by the source marks carried in every summary
item), so every event is applied exactly once. Anomalies are **at-least-once**: one found
after the last job snapshot is found again after the restart and sent again, with the same
id; consumers de-duplicate by ``id``.

Time: rank-side input is merged across partitions in event-time order (pausing partitions
that run ahead), and ``JobStage.advance`` runs every second on each job's own clock, its
newest event time moved on by the wall clock since it arrived (see
:meth:`.snapshots.JobSlot.now`): a backlog is judged in its own time, a job that goes
quiet is still found hung or silent.

Dead letters: JSON ``{"reason", "topic", "partition", "offset", "key_b64", "raw_b64",
"ts"}``; valid events of a non-telemetry type on the telemetry topic are dead-lettered too.
The worker never stops on input: a stage that raises is logged and counted
(``trainguard_stage_errors_total``). Metrics: ``GET /metrics`` on ``--metrics-port``
(``--web-port`` too; :mod:`.metrics`).
"""
