/* dsec-zygote, one call: runs in the clone, pid 1 of the call's namespaces. Prepared before its request comes
 * (/proc, /tmp, every restriction), then it takes the request, becomes its user, runs the command and reports
 * (see zygote.c). */
#include "zygote.h"

#define MAX_GROUPS 256
#define MAX_FIELDS 65536

static void call_fail(const char *what, int err, int code) {
    char buf[600];
    int n = snprintf(buf, sizeof buf, "error %s: %s\n", what, strerror(err));
    if (n > 0)
        (void)!write(STATUS_FD, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
    _exit(code);
}

/* What failed while a call was being prepared, reported once it has a status pipe to report on. */
static const char *prep_what;
static int prep_errno;

static int prep_fail(const char *what) {
    prep_what = what;
    prep_errno = errno;
    return -1;
}

/* Every capability but the two that become the request's user (dropped right after, see become_user). */
static int drop_privileges(void) {
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    const __u32 keep = (1U << CAP_SETUID) | (1U << CAP_SETGID);
    struct __user_cap_data_struct data[2] = {{keep, keep, 0}, {0, 0, 0}};
    if (syscall(SYS_capset, &header, data) != 0)
        return prep_fail("drop capabilities");
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        return prep_fail("set no_new_privs");
    if (restrict_landlock() != 0)
        return prep_fail("landlock");
    if (seccomp_prog.len && prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &seccomp_prog, 0, 0) != 0)
        return prep_fail("load seccomp program");
    return 0;
}

/* Everything that does not depend on the request, done before it arrives: namespaces (by the clone),
   /proc, /tmp, hostname, and every restriction. */
static int prepare_call(void) {
    if (setsid() < 0)
        return prep_fail("setsid");
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0)
        return prep_fail("mount /proc");
    if (mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, tmpfs_opts) != 0)
        return prep_fail("mount /tmp");
    /* The OOM killer's first choice, like container commands: never the zygote's -1000 (where the host let
       it shield itself), which every call inherits. /proc/self of a non-dumpable process is host root's, so
       the clone is dumpable for the write: nothing else runs in its pid namespace yet to attach to it. Best
       effort (a host may refuse the write); Landlock keeps the command from writing it later. */
    if (prctl(PR_SET_DUMPABLE, 1, 0, 0, 0) == 0) {
        int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (oom >= 0) {
            (void)!write(oom, "500", 3);
            close(oom);
        }
        if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0)
            return prep_fail("set non-dumpable");
    }
    (void)!sethostname("sandbox", 7);
    umask(022);
    struct rlimit no_core = {0, 0};
    if (setrlimit(RLIMIT_CORE, &no_core) != 0)
        return prep_fail("set rlimits");
    /* The zygote's SCHED_BATCH (see main) ends here: the command is scheduled like any other process. */
    struct sched_param normal = {0};
    if (batched && syscall(SYS_sched_setscheduler, 0, SCHED_OTHER, &normal) != 0)
        return prep_fail("set scheduling policy");
    return drop_privileges();
}

/* The request's user ("UID" "GID[,GROUP...]"; absent: the namespace's root), then no capability at all: with
   SECBIT_NO_SETUID_FIXUP the kernel would leave them across setresuid. */
static void become_user(const char *uid_text, char *gid_text) {
    uid_t uid = 0;
    gid_t gid = 0, groups[MAX_GROUPS];
    size_t ngroups = 0;
    if (uid_text != NULL) {
        uid = (uid_t)strtoul(uid_text, NULL, 10);
        char *rest = strchr(gid_text, ',');
        if (rest)
            *rest++ = '\0';
        gid = (gid_t)strtoul(gid_text, NULL, 10);
        for (char *g = rest; g && *g && ngroups < MAX_GROUPS;) {
            char *next = strchr(g, ',');
            if (next)
                *next++ = '\0';
            groups[ngroups++] = (gid_t)strtoul(g, NULL, 10);
            g = next;
        }
    }
    if (setgroups(ngroups, groups) != 0 || setresgid(gid, gid, gid) != 0 || setresuid(uid, uid, uid) != 0)
        call_fail("become the sandbox user", errno, 127);
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct none[2] = {{0, 0, 0}, {0, 0, 0}};
    if (syscall(SYS_capset, &header, none) != 0)
        call_fail("drop capabilities", errno, 127);
}

static void set_limit(int resource, rlim_t soft, rlim_t hard) {
    struct rlimit rl = {soft, hard};
    if (setrlimit(resource, &rl) != 0)
        call_fail("set rlimits", errno, 127);
}

static char msg[MAX_MSG + 1];
static char *fields[MAX_FIELDS];

/* Wait for the request on ``sock``; returns its number of fields, 0 at end of file, -1 if malformed. */
static int receive(int sock, int *fds) {
    char cbuf[CMSG_SPACE(5 * sizeof(int))];
    struct iovec iov = {msg, MAX_MSG};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    ssize_t len;
    do
        len = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
    while (len < 0 && errno == EINTR);
    if (len < 0 || (len == 0 && mh.msg_controllen == 0))
        return 0;
    int nfds = take_fds(&mh, fds, 5);
    if (nfds < 0)
        return -1;
    if (nfds == 5) { /* a request larger than a datagram between us and the zygote carries: in a memfd */
        len = pread(fds[4], msg, MAX_MSG, 0);
        close(fds[4]);
        if (len <= 0)
            return -1;
    }
    msg[len] = 0;
    int n = 0;
    for (char *p = msg; p < msg + len && n < MAX_FIELDS; p += strlen(p) + 1)
        fields[n++] = p;
    return n;
}

/* The call's /tmp has no room left (under 64 KiB or no inode): what its disk verdict is read from. */
static int tmp_full(void) {
    struct statvfs st;
    if (statvfs("/tmp", &st) != 0)
        return 0;
    return (unsigned long long)st.f_bavail * st.f_frsize < 64 * 1024 || st.f_favail == 0;
}

/* The clone, pid 1 of a call's namespaces: prepares, waits for its request, runs it. */
void run_call(int sock) {
    /* The zygote blocked SIGCHLD for its signalfd and ignores SIGPIPE, its only disposition that is not the
       default (main reset the others once): the call gets a clean state. */
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    signal(SIGPIPE, SIG_DFL);
    /* getppid() is 0 here (the zygote is outside our pid namespace), so the usual "parent already gone"
       check cannot be made; a call orphaned in that instant is still killed at its timeout and by the
       cgroup sweep of destroy. */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0)
        _exit(127);
    close(CTL_FD);
    int prepared = prepare_call();
    /* Keep only the request socket: the zygote's other fds (other calls' status pipes) are not ours. */
    if (dup2(sock, CTL_FD) != CTL_FD)
        _exit(127);
    sock = CTL_FD;
    syscall(SYS_close_range, 3, CTL_FD - 1, 0);
    syscall(SYS_close_range, CTL_FD + 1, ~0U, 0);
    int fds[5];
    int nfields = receive(sock, fds);
    if (nfields <= 0)
        _exit(nfields == 0 ? 0 : 127); /* 0: the zygote is going away */
    close(sock);
    /* Park the received fds above 0-3 first: one of them may already sit on a number we dup onto. */
    for (int i = 0; i < 4; i++)
        if ((fds[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, CTL_FD + 1)) < 0)
            _exit(127);
    for (int i = 0; i < 4; i++)
        if (dup2(fds[i], i) < 0)
            _exit(127);
    if (fcntl(STATUS_FD, F_SETFD, FD_CLOEXEC) != 0)
        _exit(127);
    if (prepared != 0)
        call_fail(prep_what, prep_errno, 127);
    if (nfields < 7)
        call_fail("request", EINVAL, 127);
    rlim_t cpu = strtoull(fields[0], NULL, 10), fsize = strtoull(fields[1], NULL, 10),
           nofile = strtoull(fields[2], NULL, 10);
    const char *cwd = fields[4]; /* fields[3], the size of /tmp, was the zygote's to read */
    int argc = atoi(fields[5]);
    if (argc < 1 || 6 + argc >= nfields)
        call_fail("request argv", EINVAL, 127);
    char **cargv = &fields[6];
    int envc = atoi(fields[6 + argc]);
    if (envc < 0 || 7 + argc + envc > nfields)
        call_fail("request env", EINVAL, 127);
    char **cenv = &fields[7 + argc];
    int tail = 7 + argc + envc; /* the optional user and flags */
    if (nfields != tail && nfields != tail + 3)
        call_fail("request user", EINVAL, 127);
    if (tail >= MAX_FIELDS)
        call_fail("request", E2BIG, 127);
    int with_user = nfields == tail + 3;
    if (with_user && (atoi(fields[tail + 2]) & 1) && ioctl(0, TIOCSCTTY, 0) != 0)
        call_fail("make the terminal the controlling terminal", errno, 127);
    char *uid_text = with_user ? fields[tail] : NULL, *gid_text = with_user ? fields[tail + 1] : NULL;
    /* argv and envp in place, each ended by a NULL over the field after it (ENVC's, read above, and the
       user's, kept above): no copy on a heap page of the clone's own. */
    char **argv = cargv, **envp = cenv;
    fields[6 + argc] = NULL;
    fields[tail] = NULL;
    become_user(uid_text, gid_text);
    if (chdir(cwd) != 0) {
        char what[300];
        snprintf(what, sizeof what, "working directory '%s'", cwd);
        call_fail(what, errno, 127);
    }
    /* Only lowering from here on: no capability is needed. */
    set_limit(RLIMIT_NOFILE, nofile, nofile);
    if (fsize)
        set_limit(RLIMIT_FSIZE, fsize, fsize);
    if (cpu) /* SIGXCPU at the soft limit, SIGKILL a second later: a CPU-bound command cannot outlast it. */
        set_limit(RLIMIT_CPU, cpu, cpu + 1);

    /* vfork: the command shares our memory until its execve (no page tables copied, nothing to unmap at
       its exec); until then it only writes to its stack and, on failure, to the status fd. */
    pid_t child = vfork();
    if (child < 0)
        call_fail("fork", errno, 127);
    if (child == 0) {
        /* The command leaves the housekeeping CPUs; it stays on this one until the scheduler balances it. */
        if (call_cpus && sched_setaffinity(0, call_cpus_size, call_cpus) != 0)
            call_fail("set the sandbox's CPUs", errno, 127);
        execvpe(argv[0], argv, envp);
        int err = errno;
        char what[300];
        snprintf(what, sizeof what, "cannot execute '%s'", argv[0]);
        call_fail(what, err, err == ENOENT || err == ENOTDIR ? 127 : 126);
    }
    /* Only the command may hold its pipes: end-of-file must come when it and its children are done. */
    close(0);
    close(1);
    close(2);
    int wstatus = 0;
    for (;;) {
        int st;
        pid_t done = waitpid(-1, &st, 0);
        if (done == child) {
            wstatus = st;
            break;
        }
        if (done < 0 && errno != EINTR)
            break;
    }
    struct rusage ru;
    getrusage(RUSAGE_CHILDREN, &ru);
    long long cpu_us = (long long)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000LL + ru.ru_utime.tv_usec +
                       ru.ru_stime.tv_usec;
    char buf[160];
    int n = snprintf(buf, sizeof buf, "usage %lld %ld\ntmpfull %d\nexit %d\n", cpu_us, ru.ru_maxrss, tmp_full(),
                     wstatus);
    (void)!write(STATUS_FD, buf, (size_t)n);
    _exit(0); /* the kernel now kills whatever the command left in this pid namespace */
}
