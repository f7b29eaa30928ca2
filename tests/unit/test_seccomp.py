"""The seccomp program every command loads, run in a small classic-BPF interpreter.

The kernel runs the program on a ``struct seccomp_data`` (nr, arch, instruction pointer, six arguments); this
interpreter does the same for the instructions libseccomp emits, so the test checks the shipped bytes: what is
denied, what is allowed, what kills, and how many instructions an allowed call runs (the binary-tree layout).
"""

from __future__ import annotations

import errno
import struct

import pyseccomp
import pytest

from dsec.isolation.seccomp import CLONE_NEWUSER, DEFAULT_PROFILE, FICLONE, TIOCSTI

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
X32_SYSCALL_BIT = 0x40000000
SECCOMP_RET_ACTION_FULL = 0xFFFF0000
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_KILL_THREAD = 0x00000000
SECCOMP_RET_TRAP = 0x00030000


def run(program: bytes, nr: int, arch: int = AUDIT_ARCH_X86_64, args: tuple[int, ...] = ()) -> tuple[int, int]:
    """(return value, instructions executed) of ``program`` for one syscall."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    insns = [struct.unpack_from("<HBBI", program, off) for off in range(0, len(program), 8)]
    acc = x = 0
    mem = [0] * 16
    pc = steps = 0
    while True:
        code, jt, jf, k = insns[pc]
        steps += 1
        pc += 1
        cls = code & 0x07
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x60:  # BPF_LD | BPF_MEM
            acc = mem[k]
        elif code == 0x61:  # BPF_LDX | BPF_MEM
            x = mem[k]
        elif code == 0x02:  # BPF_ST
            mem[k] = acc
        elif code == 0x03:  # BPF_STX
            mem[k] = x
        elif code == 0x00:  # BPF_LD | BPF_IMM
            acc = k
        elif code == 0x01:  # BPF_LDX | BPF_IMM
            x = k
        elif code == 0x54:  # BPF_ALU | BPF_AND | BPF_K
            acc &= k
        elif code == 0x07:  # BPF_MISC | BPF_TAX
            x = acc
        elif code == 0x87:  # BPF_MISC | BPF_TXA
            acc = x
        elif code == 0x05:  # BPF_JMP | BPF_JA
            pc += k
        elif cls == 0x05:  # conditional jumps on K
            op = code & 0xF0
            if code & 0x08:
                raise AssertionError(f"unexpected jump on X: {code:#x}")
            taken = {0x10: acc == k, 0x20: acc > k, 0x30: acc >= k, 0x40: bool(acc & k)}[op]
            pc += jt if taken else jf
        elif code == 0x06:  # BPF_RET | BPF_K
            return k, steps
        else:
            raise AssertionError(f"instruction {code:#x} at {pc - 1} is not one the interpreter knows")


@pytest.fixture(scope="module")
def program() -> bytes:
    return DEFAULT_PROFILE.compile_bpf()


def nr_of(name: str) -> int | None:
    try:
        return int(pyseccomp.resolve_syscall(pyseccomp.system_arch(), name))
    except Exception:
        return None


def denied_without_args() -> list[tuple[str, int, int]]:
    out = []
    for rule in DEFAULT_PROFILE.rules:
        if rule.args:
            continue
        for name in rule.names:
            nr = nr_of(name)
            if nr is not None and nr >= 0:
                out.append((name, nr, rule.errno_ret))
    return out


def test_every_denied_syscall_gets_its_errno(program: bytes) -> None:
    denied = denied_without_args()
    assert len(denied) > 50
    for name, nr, err in denied:
        ret, _ = run(program, nr)
        assert ret == SECCOMP_RET_ERRNO | err, f"{name} ({nr}): {ret:#x}"
    assert run(program, nr_of("clone3") or -1)[0] == SECCOMP_RET_ERRNO | errno.ENOSYS


def test_allowed_syscalls_pass_in_a_few_instructions(program: bytes) -> None:
    """Every other native syscall is allowed, and reaching that verdict takes a tree's depth of comparisons:
    the kernel runs the program for all of them each time a filter is attached (every exec)."""
    denied = {nr for _, nr, _ in denied_without_args()} | {nr_of(n) for n in ("clone3", "ioctl", "clone",
                                                                              "unshare")}
    allowed = [nr for nr in range(460) if nr not in denied]
    steps = []
    for nr in allowed:
        ret, n = run(program, nr)
        assert ret == SECCOMP_RET_ALLOW, f"syscall {nr}: {ret:#x}"
        steps.append(n)
    assert len(denied) > 50
    # A chain compares against every denied number (~60 here); the tree needs ~log2 of that plus the arch checks.
    assert max(steps) <= 20, max(steps)


def test_argument_rules(program: bytes) -> None:
    ioctl, clone, unshare = nr_of("ioctl"), nr_of("clone"), nr_of("unshare")
    assert ioctl is not None and clone is not None and unshare is not None
    assert run(program, ioctl, args=(1, TIOCSTI))[0] == SECCOMP_RET_ERRNO | errno.EPERM
    assert run(program, ioctl, args=(1, FICLONE))[0] == SECCOMP_RET_ERRNO | errno.EPERM
    # The kernel reads the request as 32 bits: setting high bits must not walk past the rule.
    assert run(program, ioctl, args=(1, (1 << 32) | TIOCSTI))[0] == SECCOMP_RET_ERRNO | errno.EPERM
    assert run(program, ioctl, args=(1, 0x5401))[0] == SECCOMP_RET_ALLOW  # TCGETS
    assert run(program, clone, args=(CLONE_NEWUSER | 0x11,))[0] == SECCOMP_RET_ERRNO | errno.EPERM
    assert run(program, clone, args=(0x11,))[0] == SECCOMP_RET_ALLOW
    assert run(program, unshare, args=(CLONE_NEWUSER,))[0] == SECCOMP_RET_ERRNO | errno.EPERM
    assert run(program, unshare, args=(0x20000,))[0] == SECCOMP_RET_ALLOW  # CLONE_NEWNS alone


def test_other_abis_are_killed(program: bytes) -> None:
    """32-bit (int 0x80) and x32 calls never reach the rules: the classic ABI-confusion bypasses."""
    getpid = nr_of("getpid")
    assert getpid is not None
    kills = {SECCOMP_RET_KILL_PROCESS, SECCOMP_RET_KILL_THREAD}
    assert run(program, 20, arch=AUDIT_ARCH_I386)[0] & SECCOMP_RET_ACTION_FULL in kills  # i386 getpid
    assert run(program, getpid | X32_SYSCALL_BIT)[0] & SECCOMP_RET_ACTION_FULL in kills
    assert run(program, getpid)[0] == SECCOMP_RET_ALLOW
