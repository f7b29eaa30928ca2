"""The seccomp denylist applied to every sandboxed process, in one definition.

The same :class:`Profile` renders to the OCI JSON that runc loads for a container's
init and to a BPF program (compiled by libseccomp) that the exec helper loads for
every command joining the container, so both carry exactly the same restrictions.
Only the native x86-64 ABI is allowed: 32-bit (int 0x80) and x32 syscalls hit
libseccomp's bad-arch action (kill), which closes the classic ABI-confusion bypasses.

This module never loads a filter into the calling process.
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DEFAULT_PROFILE", "ZYGOTE_PROFILE", "ArgRule", "Profile", "Rule"]

log = logging.getLogger(__name__)

# ioctl request numbers (x86-64). FICLONE/FICLONERANGE/FIDEDUPERANGE share extents with
# another file and XFS_IOC_SWAPEXT swaps them: agents used these to rewrite files they
# could only read. TIOCSTI/TIOCLINUX inject input into a terminal.
XFS_IOC_SWAPEXT = 0xC0C0586D
FICLONE = 0x40049409
FICLONERANGE = 0x4020940D
FIDEDUPERANGE = 0xC0189436
TIOCSTI = 0x5412
TIOCLINUX = 0x541C
CLONE_NEWUSER = 0x10000000


@dataclass(frozen=True)
class ArgRule:
    """A condition on one syscall argument: ``(arg[index] & mask) == value`` when ``mask`` is set."""

    index: int
    value: int
    mask: int | None = None


@dataclass(frozen=True)
class Rule:
    """Deny ``names`` (with EPERM unless ``errno_ret`` says otherwise), optionally only when ``args`` match."""

    names: tuple[str, ...]
    errno_ret: int = errno.EPERM
    args: tuple[ArgRule, ...] = ()


@dataclass(frozen=True)
class Profile:
    """A default-allow filter with denied syscalls."""

    rules: tuple[Rule, ...] = field(default_factory=tuple)

    def allowing(self, *names: str) -> Profile:
        """This profile with ``names`` no longer denied."""
        kept = []
        for rule in self.rules:
            left = tuple(n for n in rule.names if n not in names)
            if left:
                kept.append(Rule(names=left, errno_ret=rule.errno_ret, args=rule.args))
        return Profile(rules=tuple(kept))

    def to_oci(self) -> dict[str, Any]:
        """The ``linux.seccomp`` section of an OCI runtime config."""
        syscalls = []
        for rule in self.rules:
            entry: dict[str, Any] = {
                "names": list(rule.names),
                "action": "SCMP_ACT_ERRNO",
                "errnoRet": rule.errno_ret,
            }
            if rule.args:
                entry["args"] = [
                    {
                        "index": a.index,
                        "value": a.mask if a.mask is not None else a.value,
                        "valueTwo": a.value if a.mask is not None else 0,
                        "op": "SCMP_CMP_MASKED_EQ" if a.mask is not None else "SCMP_CMP_EQ",
                    }
                    for a in rule.args
                ]
            syscalls.append(entry)
        return {"defaultAction": "SCMP_ACT_ALLOW", "architectures": ["SCMP_ARCH_X86_64"], "syscalls": syscalls}

    def compile_bpf(self) -> bytes:
        """The filter as a raw BPF program (array of ``struct sock_filter``), built by libseccomp.

        Laid out as a binary tree of syscall numbers (libseccomp's ``SCMP_FLTATR_CTL_OPTIMIZE`` 2) rather
        than a chain: the kernel runs the program once per syscall number of each architecture when it
        attaches a filter (``seccomp_cache_prepare``, to find the always-allowed ones), with interrupts off,
        and the exec helper's ``dsec-nsenter`` attaches it at every exec. A chain of one comparison per denied
        syscall cost 78 us per attach on a 2-vCPU VM, the tree 39 us (docs/design/container.md, the container
        backend's "Exec")."""
        import pyseccomp

        filt = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
        try:
            filt.set_attr(pyseccomp.Attr.CTL_OPTIMIZE, 2)
        except Exception as e:  # libseccomp < 2.5.0 knows no such attribute: the same filter as a chain
            log.warning("libseccomp cannot lay the seccomp filter out as a tree (%s): every exec attaches a chain", e)
        for rule in self.rules:
            for name in rule.names:
                try:
                    pyseccomp.resolve_syscall(pyseccomp.system_arch(), name)
                except Exception:
                    continue
                args = [
                    pyseccomp.Arg(a.index, pyseccomp.MASKED_EQ, a.mask, a.value)
                    if a.mask is not None
                    else pyseccomp.Arg(a.index, pyseccomp.EQ, a.value)
                    for a in rule.args
                ]
                filt.add_rule(pyseccomp.ERRNO(rule.errno_ret), name, *args)
        with tempfile.TemporaryFile() as tmp:
            filt.export_bpf(tmp)
            tmp.flush()
            os.lseek(tmp.fileno(), 0, os.SEEK_SET)
            return tmp.read()


def _deny(*names: str, err: int = errno.EPERM) -> Rule:
    return Rule(names=tuple(names), errno_ret=err)


DEFAULT_PROFILE = Profile(
    rules=(
        # Filesystem namespace and mount surgery.
        _deny("mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
              "fsconfig", "fsmount", "fspick", "mount_setattr"),
        # Kernel, modules, kexec, keys, BPF, perf, userfaultfd: the kernel attack surface.
        _deny("bpf", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
              "keyctl", "add_key", "request_key", "perf_event_open", "userfaultfd", "lookup_dcookie",
              "iopl", "ioperm", "swapon", "swapoff", "reboot", "syslog", "acct", "quotactl", "quotactl_fd",
              "nfsservctl", "uselib", "ustat", "sysfs", "_sysctl", "vm86", "vm86old", "create_module",
              "get_kernel_syms", "query_module", "kcmp", "fanotify_init", "open_by_handle_at",
              "name_to_handle_at", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "stime"),
        # Tracing and reading other processes' memory.
        _deny("ptrace", "process_vm_readv", "process_vm_writev", "process_madvise"),
        # Namespaces: joining any, or creating a user namespace (the gateway to most kernel bugs).
        _deny("setns"),
        Rule(names=("unshare",), args=(ArgRule(0, CLONE_NEWUSER, CLONE_NEWUSER),)),
        Rule(names=("clone",), args=(ArgRule(0, CLONE_NEWUSER, CLONE_NEWUSER),)),
        # clone3 passes flags in memory that seccomp cannot inspect: ENOSYS makes libc fall back to clone.
        _deny("clone3", err=errno.ENOSYS),
        # Dangerous ioctls. The kernel reads the request as a 32-bit int: compare the low 32 bits only,
        # or setting any of the upper 32 bits walks past the rule (CVE-2019-10063).
        *(Rule(names=("ioctl",), args=(ArgRule(1, req, 0xFFFFFFFF),))
          for req in (XFS_IOC_SWAPEXT, FICLONE, FICLONERANGE, FIDEDUPERANGE, TIOCSTI, TIOCLINUX)),
        # io_uring performs file and socket operations that seccomp never sees.
        _deny("io_uring_setup", "io_uring_enter", "io_uring_register"),
    )
)

ZYGOTE_PROFILE = DEFAULT_PROFILE.allowing("mount", "setns")
"""A function sandbox's Python zygote (the image's interpreter, with the capabilities of the sandbox's root over
its own namespaces): each call's init mounts its ``/proc`` and ``/tmp``, and the call joins the init's
namespaces, before it loads :data:`DEFAULT_PROFILE` on top of this one; everything else stays denied."""
