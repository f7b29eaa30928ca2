"""What runs inside a microvm: the guest kernel (fetched from Debian), the initramfs and the guest agent.

- :mod:`dsec.guest.kernel` fetches Debian's cloud kernel package and unpacks it into the guest
  directory (never installs it on the host).
- :mod:`dsec.guest.initramfs` builds the initramfs: static busybox, the kernel modules the guest needs
  (in dependency order), ``init.sh`` and the static C agent (``agent.c``).
- :mod:`dsec.guest.protocol` is the host side of the agent's framed protocol.
"""
