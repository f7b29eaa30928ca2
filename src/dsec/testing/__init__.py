"""Test support shipped with DSec: a fake backend and the backend conformance suite.

``FakeBackend`` runs host processes in a directory standing in for a sandbox (no isolation: tests
only). ``check_backend(factory)`` runs :data:`CHECKS`, the behaviour every real backend must share.
Nothing here is used by the daemon in production.
"""

from dsec.testing.conformance import CHECKS, BackendFactory, check_backend, new_record, sandbox
from dsec.testing.fake import FakeBackend

__all__ = ["CHECKS", "BackendFactory", "FakeBackend", "check_backend", "new_record", "sandbox"]
