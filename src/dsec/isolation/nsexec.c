/*
 * dsec-nsexec: the exec helper. It starts each command inside a running container sandbox.
 *
 * This is what runc's nsexec does for `runc exec`, without paying runc's ~20-45 ms per call. There is one
 * small host process per daemon, started by the daemon and connected to it by a socketpair:
 *   argv   dsec-nsexec SOCKET_FD NSENTER_PATH CPUS
 *          CPUS: the hexadecimal mask commands get, or "-" (isolation/affinity.py)
 *   stdin  the seccomp program (raw struct sock_filter array; empty for none), read to EOF at start
 * Each request is one datagram of NUL-terminated fields, with four fds attached (the command's stdin,
 * stdout and stderr, and a status pipe):
 *   INIT_PID UID GID CAPMASK(hex) NOFILE FLAGS CWD NCGROUPS CGROUP_PROCS... ARGC ARGV... ENVC ENV...
 * (built by exec_client.py: encode_request). For each, the helper points its children at the sandbox's
 * pid namespace, vforks (no page-table copy) and execs the static dsec-nsenter (nsenter.c) there with the
 * command's pipes, and points its children home again. dsec-nsenter does the joining and the dropping and
 * execs the command. The helper reports "pid HOSTPID" on the status pipe, then, when the command's pidfd
 * says it exited, "exit WSTATUS"; a request it cannot start is answered "error <what>: <why>" there.
 * One bad request never takes the helper (and every other sandbox's running commands) down.
 *
 * Nothing of this runs inside the sandbox before the command itself: the helper's socket lives in the
 * host's mount namespace only, so sandboxed code cannot reach it; every fd the helper opens or receives is
 * close-on-exec, and the child replaces 0-2 (the daemon's) with the command's own. It is C, not Python: its CPU per exec is a fraction of a Python helper's.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define MAX_MESSAGE ((2 << 20) + (64 << 10)) /* exec_client.MAX_MESSAGE */
#define HIGH_FD 100           /* sources are parked above the fds dsec-nsenter expects (0-5) */
#define REAP_GRACE_MS 2000    /* a helper whose daemon hung up waits this long for its commands to exit */

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef F_ADD_SEALS
#define F_ADD_SEALS 1033
#define F_SEAL_SEAL 0x0001
#define F_SEAL_SHRINK 0x0002
#define F_SEAL_GROW 0x0004
#define F_SEAL_WRITE 0x0008
#endif
#ifndef MFD_ALLOW_SEALING
#define MFD_ALLOW_SEALING 2U
#endif

struct watch {
    int pidfd, pid, status;
};

static const char *nsenter, *cpus;
static int own_pidns = -1, bpf_fd = -1, epfd = -1, watching;
static char message[MAX_MESSAGE + 1];
static char *fields[MAX_MESSAGE]; /* a field is at least its NUL: pages touched only as used */

static int report(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int report(int fd, const char *fmt, ...) {
    char line[768];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        return -1;
    if (n > (int)sizeof line - 2)
        n = (int)sizeof line - 2;
    line[n++] = '\n';
    /* False when the daemon no longer listens (the command then runs on: the sandbox owns it). */
    return write(fd, line, (size_t)n) == n ? 0 : -1;
}

static void die(const char *what) {
    fprintf(stderr, "dsec-nsexec: %s: %s\n", what, strerror(errno));
    exit(1);
}

/* The seccomp program, read from stdin once, kept in a sealed memfd every dsec-nsenter gets as fd 5. */
static void load_bpf(void) {
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    if (!buf)
        die("seccomp program");
    for (;;) {
        if (len == cap && !(buf = realloc(buf, cap *= 2)))
            die("seccomp program");
        ssize_t n = read(0, buf + len, cap - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            die("read the seccomp program");
        if (n == 0)
            break;
        len += (size_t)n;
    }
    if (len) {
        bpf_fd = (int)syscall(SYS_memfd_create, "dsec-seccomp", MFD_CLOEXEC | MFD_ALLOW_SEALING);
        if (bpf_fd < 0 || write(bpf_fd, buf, len) != (ssize_t)len ||
            fcntl(bpf_fd, F_ADD_SEALS, F_SEAL_SEAL | F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE) != 0)
            die("seccomp memfd");
    }
    free(buf);
    /* Our stdin (the program's pipe, at EOF now) must not stay open where a new fd could reuse 0. */
    int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
    if (null < 0 || dup3(null, 0, O_CLOEXEC) < 0)
        die("stdin");
    close(null);
}

static int parse_int(const char *s, int base, long long lo, long long hi, long long *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, base);
    if (errno || *end || end == s || v < lo || v > hi)
        return -1;
    *out = v;
    return 0;
}

static void close_all(const int *fds, int n) {
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0)
            close(fds[i]);
}

struct child {
    const int *parked;
    char **argv, **envp;
    volatile int err; /* set by the child when it fails before or at its execve */
};

static char child_stack[64 * 1024] __attribute__((aligned(16)));

/* The child of a CLONE_VM | CLONE_VFORK clone: only system calls, then execve or _exit. */
static int child_main(void *arg) {
    struct child *c = arg;
    for (int i = 0; i < 6; i++)
        if (c->parked[i] >= 0 && dup2(c->parked[i], i) < 0) {
            c->err = errno;
            _exit(127);
        }
    if (setsid() < 0) {
        c->err = errno;
        _exit(127);
    }
    /* Our ignored SIGPIPE and SIGINT survive this execve: dsec-nsenter resets every disposition and the
       signal mask before it execs the command. */
    execve(nsenter, c->argv, c->envp);
    c->err = errno;
    _exit(127);
}

/* Start one request; on success the command is watched (its pidfd in the epoll set). fds: stdin, stdout,
   stderr, status. Takes ownership of all four. */
static void spawn(size_t size, int *fds) {
    int status = fds[3], nfields = 0;
    /* Fields: the datagram is a sequence of NUL-terminated strings. */
    if (size == 0 || message[size - 1] != '\0') {
        report(status, "error request: not NUL-terminated");
        close_all(fds, 4);
        return;
    }
    for (size_t at = 0; at < size; at += strlen(message + at) + 1)
        fields[nfields++] = message + at;
    long long init_pid, ncg, argc, envc;
    const int at = 8; /* the first cgroup.procs field */
    if (nfields < 9 || parse_int(fields[0], 10, 1, INT_MAX, &init_pid) ||
        parse_int(fields[7], 10, 0, 64, &ncg) || at + ncg >= nfields ||
        parse_int(fields[at + ncg], 10, 1, MAX_MESSAGE, &argc) || at + ncg + 1 + argc >= nfields ||
        parse_int(fields[at + ncg + 1 + argc], 10, 0, MAX_MESSAGE, &envc) ||
        at + ncg + 2 + argc + envc != nfields) {
        report(status, "error request: malformed (%d fields)", nfields);
        close_all(fds, 4);
        return;
    }
    /* dsec-nsenter UID GID CAPMASK NOFILE FLAGS CPUS CWD CGROUP_PROCS... -- COMMAND ARGS... (nsenter.c) */
    char **argv = calloc((size_t)(ncg + argc + 10), sizeof *argv), **envp = calloc((size_t)envc + 1, sizeof *envp);
    if (!argv || !envp) {
        report(status, "error request: out of memory");
        free(argv);
        free(envp);
        close_all(fds, 4);
        return;
    }
    int n = 0;
    argv[n++] = (char *)nsenter;
    for (int i = 1; i <= 5; i++)
        argv[n++] = fields[i];
    argv[n++] = (char *)cpus;
    argv[n++] = fields[6];
    for (int i = 0; i < ncg; i++)
        argv[n++] = fields[at + i];
    argv[n++] = "--";
    for (int i = 0; i < argc; i++)
        argv[n++] = fields[at + ncg + 1 + i];
    argv[n] = NULL;
    for (int i = 0; i < envc; i++)
        envp[i] = fields[at + ncg + 2 + argc + i];
    envp[envc] = NULL;

    int target = (int)syscall(SYS_pidfd_open, (pid_t)init_pid, 0), parked[6] = {-1, -1, -1, -1, -1, -1};
    int pid = 0, watchfd = -1;
    const char *failed = NULL;
    if (target < 0) {
        report(status, "error open sandbox init %lld: %s", init_pid, strerror(errno));
        goto out;
    }
    int sources[6] = {fds[0], fds[1], fds[2], fds[3], target, bpf_fd};
    for (int i = 0; i < 6; i++)
        if (sources[i] >= 0 && (parked[i] = fcntl(sources[i], F_DUPFD_CLOEXEC, HIGH_FD)) < 0) {
            report(status, "error park fds: %s", strerror(errno));
            goto out;
        }
    /* setns(CLONE_NEWPID) only changes where *children* are born, and a process may always go back to its
       own namespace: point the children at the sandbox, spawn, point them home again. */
    if (setns(target, CLONE_NEWPID) != 0) {
        report(status, "error join sandbox pid namespace: %s", strerror(errno));
        goto out;
    }
    struct child child = {.parked = parked, .argv = argv, .envp = envp, .err = 0};
    /* Like posix_spawn: the child shares our memory (no page-table copy) on a stack of its own, and we wait
       until it has exec'd dsec-nsenter (CLONE_VFORK). */
    pid = clone(child_main, child_stack + sizeof child_stack, CLONE_VM | CLONE_VFORK | SIGCHLD, &child);
    if (pid < 0)
        failed = "spawn";
    int spawn_errno = pid < 0 ? errno : child.err;
    if (setns(own_pidns, CLONE_NEWPID) != 0) {
        /* Cannot happen (a process may always return to its own pid namespace); if it did, every later child
           would be born in this sandbox: stop, the daemon restarts the helper. */
        fprintf(stderr, "dsec-nsexec: return to own pid namespace: %s\n", strerror(errno));
        _exit(1);
    }
    if (pid > 0 && spawn_errno) { /* the child could not exec dsec-nsenter */
        waitpid(pid, NULL, 0);
        pid = 0;
        failed = "spawn";
    }
    if (failed) {
        report(status, "error %s %s: %s", failed, nsenter, strerror(spawn_errno));
        goto out;
    }
    watchfd = (int)syscall(SYS_pidfd_open, pid, 0);
    if (watchfd < 0) {
        /* Started, but it cannot be watched (EMFILE): the daemon would never learn its exit. */
        int err = errno;
        kill(-pid, SIGKILL);
        waitpid(pid, NULL, 0);
        report(status, "error watch command: %s", strerror(err));
        goto out;
    }
    struct watch *w = malloc(sizeof *w);
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = w};
    if (!w || epoll_ctl(epfd, EPOLL_CTL_ADD, watchfd, &ev) != 0) {
        int err = w ? errno : ENOMEM;
        free(w);
        kill(-pid, SIGKILL);
        waitpid(pid, NULL, 0);
        close(watchfd);
        report(status, "error watch command: %s", strerror(err));
        goto out;
    }
    *w = (struct watch){.pidfd = watchfd, .pid = pid, .status = status};
    watching++;
    if (report(status, "pid %d", pid) != 0)
        /* The daemon hung up before it learnt the pid (a client cancelled within a millisecond): nobody
           could ever kill this command, so we do. It is still reaped through its pidfd. */
        kill(-pid, SIGKILL);
    status = -1; /* the watch owns it now */
out:
    close_all(parked, 6);
    if (target >= 0)
        close(target);
    close_all(fds, 3);
    if (status >= 0)
        close(status);
    free(argv);
    free(envp);
}

/* A command exited (its pidfd is readable): reap it, report, forget it. */
static void reap(struct watch *w) {
    int wstatus = 0;
    epoll_ctl(epfd, EPOLL_CTL_DEL, w->pidfd, NULL);
    close(w->pidfd);
    while (waitpid(w->pid, &wstatus, 0) < 0 && errno == EINTR)
        ;
    report(w->status, "exit %d", wstatus);
    close(w->status);
    free(w);
    watching--;
}

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000LL + ts.tv_nsec / 1000000;
}

/* The daemon closed its end: it is stopping, and has just killed the commands of the calls it cut off. Reap
   them before exiting: a child left unreaped becomes a zombie of whatever inherits it, and shows in the
   sandbox's process list as if its command still ran. Commands still running after the grace are left
   running, re-parented to the daemon (a subreaper). */
static void reap_dying(void) {
    long long end = now_ms() + REAP_GRACE_MS;
    struct epoll_event events[64];
    while (watching > 0) {
        long long left = end - now_ms();
        if (left <= 0)
            break;
        int n = epoll_wait(epfd, events, 64, (int)left);
        for (int i = 0; i < n; i++)
            if (events[i].data.ptr != NULL)
                reap(events[i].data.ptr);
    }
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: dsec-nsexec SOCKET_FD NSENTER_PATH CPUS (seccomp program on stdin)\n");
        return 2;
    }
    prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0);
    /* Commands are our children and we reap them ourselves (pidfd + waitpid). */
    signal(SIGCHLD, SIG_DFL);
    signal(SIGPIPE, SIG_IGN);
    signal(SIGINT, SIG_IGN);
    long long sockfd;
    if (parse_int(argv[1], 10, 0, INT_MAX, &sockfd)) {
        fprintf(stderr, "dsec-nsexec: bad socket fd %s\n", argv[1]);
        return 2;
    }
    int sock = (int)sockfd;
    if (fcntl(sock, F_SETFD, FD_CLOEXEC) != 0)
        die("socket");
    nsenter = argv[2];
    cpus = argv[3];
    load_bpf();
    own_pidns = open("/proc/self/ns/pid", O_RDONLY | O_CLOEXEC);
    epfd = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event sev = {.events = EPOLLIN, .data.ptr = NULL};
    if (own_pidns < 0 || epfd < 0 || epoll_ctl(epfd, EPOLL_CTL_ADD, sock, &sev) != 0)
        die("setup");
    union {
        char buf[CMSG_SPACE(8 * sizeof(int))];
        struct cmsghdr align;
    } control;
    struct epoll_event events[64];
    for (;;) {
        int n = epoll_wait(epfd, events, 64, -1);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            die("epoll_wait");
        for (int i = 0; i < n; i++) {
            if (events[i].data.ptr != NULL) {
                reap(events[i].data.ptr);
                continue;
            }
            struct iovec iov = {.iov_base = message, .iov_len = MAX_MESSAGE};
            struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                                 .msg_controllen = sizeof control.buf};
            ssize_t size = recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
            if (size < 0 && (errno == EINTR || errno == EAGAIN))
                continue;
            if (size < 0 || (size == 0 && msg.msg_controllen == 0)) { /* the daemon closed its end */
                if (size < 0)
                    fprintf(stderr, "dsec-nsexec: recvmsg: %s\n", strerror(errno));
                epoll_ctl(epfd, EPOLL_CTL_DEL, sock, NULL);
                reap_dying();
                return 0;
            }
            int fds[8], nfds = 0;
            for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
                if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
                    continue;
                int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
                for (int k = 0; k < count; k++) {
                    int fd;
                    memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof fd);
                    if (nfds < 8)
                        fds[nfds++] = fd;
                    else
                        close(fd);
                }
            }
            if (nfds != 4) {
                close_all(fds, nfds);
                continue;
            }
            if (msg.msg_flags & MSG_TRUNC) {
                /* The daemon refuses such requests before sending. */
                report(fds[3], "error request: the request is larger than %d bytes", MAX_MESSAGE);
                close_all(fds, 4);
                continue;
            }
            spawn((size_t)size, fds);
        }
    }
}
