/*
 * dsec-callinit: pid 1 of one sb.call's pid namespace, started by the sandbox's Python zygote (pyzygote.py).
 *
 * The Python zygote makes a new pid namespace for its next child and spawns this (a vfork and an exec of a
 * small static binary: no copy of the interpreter), one call ahead of the request, as
 *   dsec-callinit TMPFS_OPTIONS      fd 3: a pipe to the zygote; fd 4: the calls' seccomp program (optional)
 * with the sandbox root's CAP_SYS_ADMIN as its only (ambient) capability. It gives the call its own mount,
 * ipc and uts namespaces, mounts the pid namespace's /proc and a fresh /tmp, sets the hostname, then drops
 * that capability, sets no_new_privs and loads the seccomp program, says "ok" on fd 3 (or "error <what>:
 * <why>") and closes it. The call itself (pid 2) is forked by the zygote into this pid namespace and joins
 * these namespaces; this process only reaps whatever the call orphans, until the zygote (or the daemon, at
 * a limit) kills it, which ends the pid namespace and everything left in it. It is not dumpable: nothing in
 * the call can open its memory.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define READY_FD 3
#define SECCOMP_FD 4

static void fail(const char *what) {
    char buf[300];
    int n = snprintf(buf, sizeof buf, "error %s: %s", what, strerror(errno));
    if (n > 0)
        (void)!write(READY_FD, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
    _exit(127);
}

static void load_seccomp(void) {
    struct stat st;
    if (fstat(SECCOMP_FD, &st) != 0)
        return;
    if (st.st_size <= 0 || st.st_size % sizeof(struct sock_filter) || st.st_size > (1 << 20)) {
        errno = EINVAL;
        fail("seccomp program size");
    }
    struct sock_filter *filter = malloc((size_t)st.st_size);
    if (!filter || pread(SECCOMP_FD, filter, (size_t)st.st_size, 0) != st.st_size)
        fail("read seccomp program");
    close(SECCOMP_FD);
    struct sock_fprog prog = {(unsigned short)(st.st_size / sizeof(struct sock_filter)), filter};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0) != 0)
        fail("load seccomp program");
}

static void nothing(int sig) {
    (void)sig;
}

int main(int argc, char **argv) {
    if (argc != 2)
        return 2;
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0)
        fail("set non-dumpable");
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0)
        fail("set the parent-death signal");
    if (unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS) != 0)
        fail("new mount, ipc and uts namespaces");
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0)
        fail("mount /proc");
    if (mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, argv[1]) != 0)
        fail("mount /tmp");
    (void)!sethostname("sandbox", 7);
    struct rlimit no_core = {0, 0};
    setrlimit(RLIMIT_CORE, &no_core);
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2] = {{0, 0, 0}, {0, 0, 0}};
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0 || syscall(SYS_capset, &header, data) != 0)
        fail("drop capabilities");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        fail("set no_new_privs");
    load_seccomp();
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = nothing;
    sigaction(SIGCHLD, &sa, NULL);
    sigset_t chld, unblocked;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, &unblocked);
    if (write(READY_FD, "ok", 2) != 2)
        _exit(1);
    close(READY_FD);
    /* Reap what the call orphans; between them, sleep until the next SIGCHLD (or until this process is killed). */
    for (;;) {
        while (waitpid(-1, NULL, WNOHANG) > 0) {
        }
        sigsuspend(&unblocked);
    }
}
