"""The parts the QEMU backends (``microvm``, ``vm``) compose; neither backend inherits from the other.

- :mod:`~dsec.backends.qemu.machine`: QEMU processes, their cgroups, console, death and orphans;
- :mod:`~dsec.backends.qemu.qmp`: the QMP client;
- :mod:`~dsec.backends.qemu.templates`: cold boots, template snapshots, restores, saved states;
- :mod:`~dsec.backends.qemu.agent`: commands and a new guest's identity and confinement through the agent;
- :mod:`~dsec.backends.qemu.network`: a guest's NIC on a tap in its own network namespace;
- :mod:`~dsec.backends.qemu.accel`: KVM or TCG;
- :mod:`~dsec.backends.qemu.profile`: the :class:`~dsec.backends.qemu.profile.MachineProfile` protocol, what
  differs between machines (``microvm.MicroVMProfile``, ``vm.Q35Profile``);
- :mod:`~dsec.backends.qemu.backend`: :class:`~dsec.backends.qemu.backend.QemuBackend`, the parts composed.
"""
