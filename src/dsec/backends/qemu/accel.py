"""Which accelerator a QEMU backend's guests use: forced, or the host's shared KVM-or-TCG decision.

Owns one backend's view of :class:`dsec.guest.accel.Accelerator` (waiting, bounded, for the decision, and
reporting it); must never probe KVM itself: the host's decision is made once, in the background.
"""

from __future__ import annotations

from pathlib import Path

from dsec.backends.base import Check
from dsec.errors import BackendUnavailable
from dsec.guest.accel import Accelerator, health

__all__ = ["AccelChoice", "accel_arg"]

# TCG's translation cache: QEMU's default (1 GiB) grows with every code path a long-lived guest runs and
# would end in the cgroup's OOM killer; 128 MiB holds a guest's working set of translated code.
_TCG_TB_MIB = 128


def accel_arg(accel: str) -> str:
    """The ``-accel`` value: KVM as is, TCG with its translation cache bounded (see ``_TCG_TB_MIB``)."""
    return accel if accel == "kvm" else f"{accel},tb-size={_TCG_TB_MIB}"


class AccelChoice:
    """``accel`` is ``"kvm"`` or ``"tcg"`` once decided (forced, or by the host's shared decision)."""

    def __init__(self, backend: str, forced: str | None) -> None:
        self.backend = backend
        self.accel = forced
        self.reason = "forced" if forced else ""
        self.decision: Accelerator | None = None
        """The host's decision this backend waits for (None when ``accel`` was forced or is decided)."""

    def begin(self, probe_kernel: Path | None) -> None:
        """At the backend's start: join the host's decision (in the background: the daemon serves meanwhile,
        creates wait for it); with no kernel to probe KVM with, TCG."""
        if self.accel is not None:
            return
        if probe_kernel is None:
            self.accel, self.reason = "tcg", "no guest kernel to probe KVM with"
        else:
            self.decision = Accelerator.shared(probe_kernel)

    def pending(self) -> str | None:
        return self.decision.pending() if self.accel is None and self.decision is not None else None

    async def wait(self) -> str:
        """KVM or TCG, waiting (bounded) for the host's decision if it is pending."""
        if self.accel is None:
            if self.decision is None:
                raise BackendUnavailable(f"{self.backend} backend is not started")
            verdict = await self.decision.wait_decided()
            self.accel, self.reason = verdict.accel, verdict.describe()
        return self.accel

    def components(self) -> dict[str, Check]:
        """The accelerator as a node component, as it is (:func:`dsec.guest.accel.health`)."""
        error, state, detail = health(self.accel, self.reason, self.decision)
        return {"accelerator": Check(error, detail, state)}
