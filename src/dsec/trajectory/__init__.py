"""Trajectory log, replay matching and snapshot storage (see ``docs/design/trajectory.md``).

``store`` (SQLite / ``postgres``) keeps logs durably with group commit; ``digest`` defines a call's
identity; ``replay`` matches calls against a log; ``snapshots`` stores checkpoints. The engine glue is
``dsec.daemon.trajectories``; the SDK side is ``dsec._sdk.replay``.
"""
