/*
 * dsec-zygote: the pre-warmed parent of every call of one function sandbox.
 *
 * The daemon starts it as host root with
 *   fd 0        the control socket (SOCK_SEQPACKET)
 *   fd 3        every call's seccomp program (raw struct sock_filter array; absent for none)
 *   fd 4        the Python zygote's seccomp program (absent: the Python zygote runs unfiltered)
 *   argv        dsec-zygote NEWROOT LOWERDIRS WORKSPACE WORKDIR SUPPORT TMPFS_BYTES CPUS
 *               CPUS: "-", or the hexadecimal mask of the CPUs each command gets (isolation/affinity.py: the
 *               zygote runs on the daemon's housekeeping CPUs, the commands on the node's)
 * Once, at start, it builds the sandbox's root in a private mount namespace: a read-only
 * overlay of LOWERDIRS (the scaffold of mount points over the image root) on NEWROOT, the
 * host directory WORKSPACE bound writable on WORKDIR, SUPPORT bound read-only on /.dsec, a
 * read-only /dev of a few device nodes, and pivots into it. It prepares a Landlock ruleset
 * (writes only beneath WORKDIR, /tmp and /dev; no TCP) and reads the seccomp programs, then
 * enters a new user namespace, says "userns" on the socket and waits for "go" while the
 * daemon writes its uid/gid maps and moves it into the sandbox's cgroups. There it makes the
 * sandbox's one network namespace (loopback only, left down), which every call shares, and forks
 * the launcher of Python zygotes (zygote_py.c) while it still has a full bounding set.
 *
 * Each call is one clone() into new pid, mount, ipc and uts namespaces, made one call ahead: while a
 * call runs, the next one is cloned and prepares itself (pid 1 there) by mounting a fresh /proc and
 * /tmp, dropping every capability, setting no_new_privs, and restricting itself with Landlock and the
 * seccomp program; then it waits on its own socketpair. What is the same for every call is done once in
 * the zygote and inherited: the empty bounding and ambient sets and the locked securebits. The zygote
 * runs SCHED_BATCH (it never preempts the daemon or a running call at a wake-up); each clone returns to
 * SCHED_OTHER before its command. A request (NUL-separated "CPU_S FSIZE NOFILE TMP_BYTES CWD ARGC ARGV...
 * ENVC ENV... [UID GID[,GROUP...] FLAGS]" with four fds: stdin, stdout, stderr, status, then up to four
 * cgroup.procs files of the call's own cgroup, opened by the daemon; the user, and FLAGS bit 0: fd 0 is a
 * terminal to make the command's controlling terminal, are optional: root and no terminal) is forwarded to
 * the ready clone (a clone made for it when TMP_BYTES is not the sandbox's /tmp size) once the zygote wrote
 * the clone's pid into those cgroup files. The clone sets the request's rlimits, user and working directory,
 * vforks the command and waits for it. When the command exits it reports "usage CPU_US MAXRSS_KB",
 * "tmpfull 0|1" (its /tmp had no room left) and "exit WSTATUS" on the status fd and exits, which kills
 * whatever the command left behind (the end of a pid namespace's init). The zygote reports "pid HOSTPID"
 * when it dispatched, and "exit WSTATUS" of the clone when it did not report itself (killed at a limit).
 * Setup failures are "error <what>: <why>" lines. A "refresh" message (no fds) replaces the clone made
 * ahead, after the daemon changed the sandbox's mounts (protected and hidden paths) in our mount namespace.
 * A "python\0ARGV..." message with one fd is passed to the launcher, which starts a Python zygote on it.
 * The zygote exits, killing and reaping every call (and the launcher, which kills its Python zygotes),
 * when the control socket closes.
 *
 * This file is the zygote's loop: cloning calls ahead, dispatching requests to them, reaping them. The other
 * parts are listed in zygote.h.
 */
#include "zygote.h"

#define MAX_CGROUP_FDS 4
#define MAX_CALLS 4096
/* No CLONE_NEWNET: the calls share the sandbox's network namespace (loopback only, down), made once; creating
   and tearing one down was a third of each call's CPU. */
#ifndef CALL_NS
#define CALL_NS (CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS)
#endif

int batched;
const char *tmpfs_opts;
static const char *tmpfs_bytes; /* TMPFS_BYTES: the size of each call's /tmp unless its request says another */
static pid_t launcher;
/* What only the zygote's loop uses (the calls it runs, the one cloned ahead, the request it receives), in a
   mapping kept out of every clone (MADV_DONTFORK): after each clone every page both still map is
   copy-on-write, and the loop's next write to it would be a fault (~5 us on a VM) for nothing. */
static struct own {
    struct {
        pid_t pid;
        int status_fd;
    } calls[MAX_CALLS];
    /* One call cloned ahead of its request: its namespaces, mounts and restrictions are ready when the
       request comes, which takes them off the request's path. */
    struct {
        pid_t pid;
        int sock;
        int err;
    } ready;
    char request[MAX_MSG + 1];
} *own;

/* -- the zygote's loop ----------------------------------------------------------------------------- */

static int report(int fd, const char *fmt, long value) {
    char buf[64];
    int n = snprintf(buf, sizeof buf, fmt, value);
    return write(fd, buf, (size_t)n) == n ? 0 : -1;
}

static char default_opts[128];

/* Clone one call, whose /tmp is mounted with ``opts``; 0, or the errno of what failed. */
static int clone_call(const char *opts, pid_t *pid_out, int *sock_out) {
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) != 0)
        return errno;
    if (opts != tmpfs_opts) /* (written only when it changes: the page is the clone ahead's too) */
        tmpfs_opts = opts; /* read by the clone, which has its own copy of our memory */
    pid_t pid = (pid_t)syscall(SYS_clone, CALL_NS | SIGCHLD, 0, 0, 0, 0);
    if (pid == 0) {
        close(sp[0]);
        run_call(sp[1]);
    }
    int err = errno;
    if (tmpfs_opts != default_opts)
        tmpfs_opts = default_opts;
    close(sp[1]);
    if (pid < 0) {
        close(sp[0]);
        return err;
    }
    *pid_out = pid;
    *sock_out = sp[0];
    return 0;
}

static void clone_ahead(void) {
    own->ready.err = clone_call(default_opts, &own->ready.pid, &own->ready.sock);
}

/* The sandbox's mounts changed (protected or hidden paths, a reveal): the call cloned ahead holds a copy of
   the old mount table, so it is replaced by one cloned now. Calls already running keep what they had. */
static void refresh(void) {
    if (own->ready.pid > 0) {
        kill(own->ready.pid, SIGKILL); /* reaped later as an unknown child */
        close(own->ready.sock);
    }
    own->ready.pid = 0;
    own->ready.sock = -1;
    clone_ahead();
}

/* A request past what a datagram to the clone carries (its send buffer: the zygote, in its own user namespace,
   cannot raise it past net.core.wmem_max): the request in a memfd, sent as a fifth fd of an empty message. */
#define DATAGRAM_MAX (128 << 10)
static int request_memfd(const char *request, ssize_t len) {
    int fd = (int)syscall(SYS_memfd_create, "dsec-request", MFD_CLOEXEC);
    if (fd >= 0 && write(fd, request, (size_t)len) != len) {
        close(fd);
        return -1;
    }
    return fd;
}

/* The request's fourth field (the size of the call's /tmp), or NULL. */
static const char *tmp_field(char *request, ssize_t len) {
    char *p = request;
    for (int i = 0; i < 3; i++) {
        char *end = memchr(p, 0, (size_t)(request + len - p));
        if (!end)
            return NULL;
        p = end + 1;
    }
    return p < request + len && memchr(p, 0, (size_t)(request + len - p)) ? p : NULL;
}

/* Move the call into its own cgroup: its pid into each cgroup.procs the daemon opened. */
static int join_cgroups(pid_t pid, const int *cgfds, int n) {
    char buf[32];
    int len = snprintf(buf, sizeof buf, "%d", pid);
    for (int i = 0; i < n; i++)
        if (write(cgfds[i], buf, (size_t)len) != len)
            return errno ? errno : EIO;
    return 0;
}

/* Hand the request to the clone ``sock`` (in a memfd when it is bigger than a datagram); 0 or an errno. */
static int forward(int sock, char *request, ssize_t len, const int *fds) {
    int big = len > DATAGRAM_MAX ? request_memfd(request, len) : -1, nfds = big >= 0 ? 5 : 4;
    int all[5] = {fds[0], fds[1], fds[2], fds[3], big};
    char cbuf[CMSG_SPACE(5 * sizeof(int))];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov = {request, big >= 0 ? 0 : (size_t)len};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                        .msg_controllen = CMSG_SPACE(nfds * sizeof(int))};
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(nfds * sizeof(int));
    memcpy(CMSG_DATA(c), all, nfds * sizeof(int));
    ssize_t sent = sendmsg(sock, &mh, MSG_NOSIGNAL);
    int err = errno;
    if (big >= 0) {
        close(big);
        if (sent == 0)
            sent = len;
    }
    return sent == len ? 0 : err ? err : EIO;
}

static void dispatch(char *request, ssize_t len, int *fds, int nfds) {
    int slot = -1;
    for (int i = 0; i < MAX_CALLS && slot < 0; i++)
        if (own->calls[i].pid == 0)
            slot = i;
    const char *what = "start call";
    const char *tmp = tmp_field(request, len);
    pid_t pid = 0;
    int sock = -1, err = slot < 0 ? EAGAIN : tmp ? 0 : EINVAL;
    if (!err && strcmp(tmp, tmpfs_bytes) != 0) {
        /* Another size of /tmp than the call cloned ahead has: a clone of its own, made now. */
        char opts[128];
        snprintf(opts, sizeof opts, "mode=1777,size=%s", tmp);
        err = clone_call(opts, &pid, &sock);
    } else if (!err) {
        if (own->ready.pid == 0)
            clone_ahead();
        err = own->ready.err;
        pid = own->ready.pid;
        sock = own->ready.sock;
        own->ready.pid = 0;
        own->ready.sock = -1;
    }
    if (!err && pid > 0 && (err = join_cgroups(pid, fds + 4, nfds - 4)) != 0)
        what = "start call: join the call's cgroup";
    if (!err && pid > 0)
        err = forward(sock, request, len, fds);
    if (sock >= 0)
        close(sock);
    for (int i = 4; i < nfds; i++)
        close(fds[i]);
    if (!err && pid > 0) {
        own->calls[slot].pid = pid;
        own->calls[slot].status_fd = fds[3];
        if (report(fds[3], "pid %ld\n", pid) != 0)
            kill(pid, SIGKILL); /* the daemon hung up before it learnt the pid: nobody else could kill it */
        for (int i = 0; i < 3; i++)
            close(fds[i]);
        if (own->ready.pid == 0)
            clone_ahead(); /* the next call's, while this one runs */
        return;
    }
    if (pid > 0)
        kill(pid, SIGKILL); /* reaped later as an unknown child */
    char buf[200];
    int m = snprintf(buf, sizeof buf, "error %s: %s\n", what, slot < 0 ? "too many calls at once" : strerror(err));
    (void)!write(fds[3], buf, (size_t)m);
    for (int i = 0; i < 4; i++)
        close(fds[i]);
}

static void reap(void) {
    int st;
    pid_t pid;
    while ((pid = waitpid(-1, &st, WNOHANG)) > 0) {
        if (pid == own->ready.pid) { /* died before its request: the next request clones again */
            close(own->ready.sock);
            own->ready.pid = 0;
            own->ready.sock = -1;
            continue;
        }
        if (pid == launcher) {
            launcher = 0; /* Python zygotes cannot be started any more: the daemon is told at its next try */
            continue;
        }
        for (int i = 0; i < MAX_CALLS; i++) {
            if (own->calls[i].pid != pid)
                continue;
            /* A call that ended normally reported its command's status itself. */
            if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
                report(own->calls[i].status_fd, "exit %ld\n", st);
            close(own->calls[i].status_fd);
            own->calls[i].pid = 0;
            break;
        }
    }
}

/* "python\0ARGV..." with one fd, the Python zygote's control socket: for the launcher. */
static void forward_python(char *request, ssize_t len, struct msghdr *in) {
    int fd = received_fd(in);
    if (fd < 0)
        return;
    char cbuf[CMSG_SPACE(sizeof(int))];
    memset(cbuf, 0, sizeof cbuf);
    struct iovec iov = {request, (size_t)len};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(c), &fd, sizeof fd);
    if (launcher == 0 || sendmsg(LAUNCH_FD, &mh, MSG_NOSIGNAL) != len) {
        char buf[200];
        int m = snprintf(buf, sizeof buf, "error start the Python zygote: %s",
                         launcher ? strerror(errno) : "the sandbox's launcher is gone");
        (void)!send(fd, buf, (size_t)m, MSG_NOSIGNAL);
    }
    close(fd);
}

int main(int argc, char **argv) {
    if (argc != 8)
        return 2;
    /* Every disposition the daemon left ignored (SIGPIPE, SIGXFSZ survive exec) back to the default, once: a
       call then has only the zygote's own SIGPIPE to undo (a syscall per signal was each call's cost). */
    for (int sig = 1; sig < NSIG; sig++)
        signal(sig, SIG_DFL);
    if (dup2(0, CTL_FD) != CTL_FD || fcntl(CTL_FD, F_SETFD, FD_CLOEXEC) != 0)
        return 2;
    int null = open("/dev/null", O_RDONLY | O_CLOEXEC);
    dup2(null, 0);
    close(null);
    tmpfs_bytes = argv[6];
    snprintf(default_opts, sizeof default_opts, "mode=1777,size=%s", tmpfs_bytes);
    tmpfs_opts = default_opts;
    parse_cpus(argv[7]);
    /* A memory bomb in a call must never take the zygote (and so the sandbox) with it. Best effort:
       lowering needs CAP_SYS_RESOURCE, which some hosts withhold even from root; the calls raise
       theirs to 500 in any case, so the OOM killer picks them first. */
    int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (oom >= 0) {
        (void)!write(oom, "-1000", 5);
        close(oom);
    }
    /* Nothing in a call may open our memory or attach to us, whatever its uid. */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0)
        die("set non-dumpable", errno);
    setup(argv);
    if (unshare(CLONE_NEWUSER) != 0)
        die("new user namespace", errno);
    if (send(CTL_FD, "userns", 6, MSG_NOSIGNAL) != 6)
        return 1;
    char go[16];
    if (recv(CTL_FD, go, sizeof go, 0) != 2 || memcmp(go, "go", 2) != 0)
        return 1;
    if (setresgid(0, 0, 0) != 0 || setresuid(0, 0, 0) != 0)
        die("become the sandbox's root", errno);
    /* The sandbox's network namespace, owned by its user namespace: only a loopback device, which stays
       down (nothing in a call can raise it: no CAP_NET_ADMIN), and Landlock refuses TCP besides. */
    if (unshare(CLONE_NEWNET) != 0)
        die("new network namespace", errno);
    own = mmap(NULL, sizeof *own, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (own == MAP_FAILED || madvise(own, sizeof *own, MADV_DONTFORK) != 0)
        die("the zygote's own memory", errno);
    own->ready.sock = -1;
    launcher = start_launcher();
    drop_bounding_set();
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0)
        die("set non-dumpable", errno);
    if (send(CTL_FD, "ready", 5, MSG_NOSIGNAL) != 5)
        return 1;

    /* SCHED_BATCH: woken by a request, the zygote does not preempt the daemon that sent it (which has a
       little left to do before it sleeps), and cloning the next call ahead does not preempt the call that
       is running or the daemon collecting its result: on a 2-core host that work belongs in idle time.
       The clones return to SCHED_OTHER once prepared. Only from SCHED_OTHER (a daemon run under another
       policy passes its own on unchanged) and best effort: the policy only orders the work. */
    struct sched_param batch = {0};
    /* The raw syscalls: musl's wrappers of the sched_*scheduler calls answer ENOSYS. */
    batched = syscall(SYS_sched_getscheduler, 0) == SCHED_OTHER &&
              syscall(SYS_sched_setscheduler, 0, SCHED_BATCH, &batch) == 0;
    /* A daemon that stopped listening to a call must not take the zygote down with SIGPIPE. */
    signal(SIGPIPE, SIG_IGN);
    int sfd = child_signals();
    if (sfd < 0)
        return 1;
    char *request = own->request;
    char cbuf[CMSG_SPACE((4 + MAX_CGROUP_FDS) * sizeof(int))];
    clone_ahead();
    for (;;) {
        struct pollfd pfd[2] = {{CTL_FD, POLLIN, 0}, {sfd, POLLIN, 0}};
        int polled = poll_children(pfd, 2, reap);
        if (polled < 0)
            break;
        if (polled == 0 || !pfd[0].revents)
            continue;
        struct iovec iov = {request, MAX_MSG};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
        ssize_t len = recvmsg(CTL_FD, &mh, MSG_CMSG_CLOEXEC);
        if (len < 0 && errno == EINTR)
            continue;
        if (len <= 0)
            break; /* the daemon closed the socket (destroy, or it died): every call goes with us */
        if (mh.msg_controllen == 0 && len == 7 && memcmp(request, "refresh", 7) == 0) {
            refresh();
            continue;
        }
        if (len > 7 && memcmp(request, "python", 7) == 0) {
            forward_python(request, len, &mh);
            continue;
        }
        int fds[4 + MAX_CGROUP_FDS];
        int nfds = take_fds(&mh, fds, 4 + MAX_CGROUP_FDS);
        if (nfds >= 4)
            dispatch(request, len, fds, nfds);
    }
    close(LAUNCH_FD); /* the launcher kills and reaps its Python zygotes, then exits */
    if (own->ready.pid > 0)
        kill(own->ready.pid, SIGKILL);
    for (int i = 0; i < MAX_CALLS; i++)
        if (own->calls[i].pid > 0)
            kill(own->calls[i].pid, SIGKILL);
    /* Reap them before exiting: orphans go to the daemon (a child subreaper), which would keep them as
       zombies. Each is its namespace's init, so it is reaped once everything in its namespace is gone. */
    reap_all();
    return 0;
}
