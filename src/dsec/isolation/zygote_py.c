/*
 * The launcher of a function sandbox's Python zygotes (part of dsec-zygote; see zygote.c).
 *
 * The zygote forks it once, as the sandbox's root with every capability and a full bounding set, before it
 * empties its own bounding set and locks its securebits (after which nothing it executes could hold a
 * capability). The launcher does two things, on request:
 *   - Start a Python zygote. The zygote forwards the daemon's "python\0ARGV..." message with one fd (the
 *     Python zygote's control socket). The launcher clones a child into new pid, mount, ipc and uts namespaces
 *     (so the image's interpreter can neither see nor signal a process of the host or of another sandbox, nor
 *     share an IPC object with them), which
 *     mounts that pid namespace's /proc, loads the zygote's seccomp filter, sets no_new_privs and executes
 *     ARGV with fds 3 (the control socket), 4 (a socket to this launcher) and 5 (a memfd holding every
 *     call's seccomp program). A child that cannot start reports "error <what>: <why>" on the control socket.
 *   - Tell a Python zygote the host pid of a call it cloned, which the daemon needs to kill the call: the
 *     Python zygote sends one datagram with SCM_CREDENTIALS naming the call's pid in its own pid namespace;
 *     the kernel translates it into ours (the host's), and the answer is that number in decimal.
 * When the zygote closes its socket the launcher kills and reaps its Python zygotes (each the init of its
 * pid namespace: its calls die with it) and exits. It dies with the zygote (PDEATHSIG) and they with it.
 *
 * It uses the seccomp programs zygote_setup.c read, and zygote_io.c's loop and reports, as the zygote does.
 */
#include "zygote.h"

#define MAX_PY 8 /* Python zygotes at once: the live one, and ones draining after a mount change */
#define MAX_ARGS 64
#define MAX_LAUNCH 8192

static struct {
    pid_t pid;
    int q; /* our end of its pid-translation socket */
} py[MAX_PY];

/* In the child that becomes the Python zygote: report why it cannot start, and go. */
static void py_fail(int ctl, const char *what, int err) {
    send_failure(ctl, what, err);
    _exit(127);
}

/* Runs as pid 1 of the Python zygote's new pid namespace, in a copy of the sandbox's mount namespace. */
static void become_python(int ctl, int q, char **argv) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    for (int sig = 1; sig < NSIG; sig++)
        signal(sig, SIG_DFL);
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0)
        _exit(127);
    /* This pid namespace's own /proc, over the host's instance the zygote mounted for its calls. */
    if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0)
        py_fail(ctl, "mount /proc for the Python zygote", errno);
    int prog = (int)syscall(SYS_memfd_create, "dsec-seccomp", 0);
    size_t size = (size_t)seccomp_prog.len * sizeof(struct sock_filter);
    if (prog < 0 || write(prog, seccomp_prog.filter, size) != (ssize_t)size || lseek(prog, 0, SEEK_SET) != 0)
        py_fail(ctl, "hand over the seccomp program", errno);
    /* Park everything above the numbers it is given, then 3, 4, 5; close the rest. */
    int fds[3] = {ctl, q, prog};
    for (int i = 0; i < 3; i++)
        if ((fds[i] = fcntl(fds[i], F_DUPFD, 200)) < 0)
            py_fail(ctl, "arrange fds", errno);
    for (int i = 0; i < 3; i++)
        if (dup2(fds[i], 3 + i) != 3 + i)
            py_fail(fds[0], "arrange fds", errno);
    syscall(SYS_close_range, 6, ~0U, 0);
    ctl = 3;
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        py_fail(ctl, "set no_new_privs", errno);
    if (zygote_prog.len && prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &zygote_prog, 0, 0) != 0)
        py_fail(ctl, "load the zygote's seccomp program", errno);
    char *env[] = {DEFAULT_PATH, "LC_ALL=C.UTF-8", NULL};
    execvpe(argv[0], argv, env);
    int err = errno;
    char what[300];
    snprintf(what, sizeof what, "cannot execute '%s'", argv[0]);
    py_fail(ctl, what, err);
}

static void refuse(int ctl, const char *what, int err) {
    send_failure(ctl, what, err);
    close(ctl);
}

static void launch(int ctl, char *msg, ssize_t len) {
    char *argv[MAX_ARGS + 1];
    int argc = 0;
    for (char *p = msg + 7; p < msg + len && argc < MAX_ARGS; p += strlen(p) + 1) /* after "python\0" */
        argv[argc++] = p;
    argv[argc] = NULL;
    int slot = -1;
    for (int i = 0; i < MAX_PY && slot < 0; i++)
        if (py[i].pid == 0)
            slot = i;
    if (argc == 0 || slot < 0) {
        refuse(ctl, argc ? "start the Python zygote (too many at once)" : "start the Python zygote",
               argc ? EAGAIN : EINVAL);
        return;
    }
    int q[2], on = 1;
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, q) != 0) {
        refuse(ctl, "start the Python zygote", errno);
        return;
    }
    if (setsockopt(q[0], SOL_SOCKET, SO_PASSCRED, &on, sizeof on) != 0) {
        int err = errno;
        close(q[0]);
        close(q[1]);
        refuse(ctl, "start the Python zygote", err);
        return;
    }
    /* Its own ipc and uts namespaces too: the zygote's are still the host's (it only made a mount, user and network
       namespace), and the image's interpreter must share no System V IPC object with the host. */
    pid_t pid = (pid_t)syscall(SYS_clone, CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS | SIGCHLD, 0, 0, 0,
                               0);
    if (pid == 0) {
        close(q[0]);
        become_python(ctl, q[1], argv);
    }
    int err = errno;
    close(q[1]);
    if (pid < 0) {
        close(q[0]);
        refuse(ctl, "start the Python zygote", err);
        return;
    }
    close(ctl);
    py[slot].pid = pid;
    py[slot].q = q[0];
}

/* One question from a Python zygote: the host pid of the process its credentials name. */
static void translate(int i) {
    char buf[16], cbuf[CMSG_SPACE(sizeof(struct ucred))];
    struct iovec iov = {buf, sizeof buf};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
    ssize_t len = recvmsg(py[i].q, &mh, MSG_DONTWAIT);
    if (len < 0 && (errno == EAGAIN || errno == EINTR))
        return;
    if (len <= 0) {
        close(py[i].q);
        py[i].q = -1;
        return;
    }
    long host = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_CREDENTIALS) {
            struct ucred cred;
            memcpy(&cred, CMSG_DATA(c), sizeof cred);
            host = cred.pid; /* 0 when the process is not visible here (gone) */
        }
    int n = snprintf(buf, sizeof buf, "%ld", host);
    (void)!send(py[i].q, buf, (size_t)n, MSG_NOSIGNAL);
}

static void reap_python(void) {
    pid_t pid;
    while ((pid = waitpid(-1, NULL, WNOHANG)) > 0)
        for (int i = 0; i < MAX_PY; i++)
            if (py[i].pid == pid) {
                if (py[i].q >= 0)
                    close(py[i].q);
                py[i].pid = 0;
                py[i].q = -1;
            }
}

static void launcher_main(int sock) {
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) != 0)
        _exit(1);
    close(CTL_FD);
    signal(SIGPIPE, SIG_IGN);
    int sfd = child_signals();
    if (sfd < 0)
        _exit(1);
    static char msg[MAX_LAUNCH + 1];
    for (int i = 0; i < MAX_PY; i++)
        py[i].q = -1;
    for (;;) {
        struct pollfd pfd[2 + MAX_PY];
        pfd[0] = (struct pollfd){sock, POLLIN, 0};
        pfd[1] = (struct pollfd){sfd, POLLIN, 0};
        for (int i = 0; i < MAX_PY; i++)
            pfd[2 + i] = (struct pollfd){py[i].q, POLLIN, 0}; /* a negative fd is skipped */
        int polled = poll_children(pfd, 2 + MAX_PY, reap_python);
        if (polled < 0)
            break;
        if (polled == 0)
            continue;
        for (int i = 0; i < MAX_PY; i++)
            if (py[i].q >= 0 && pfd[2 + i].revents)
                translate(i);
        if (!pfd[0].revents)
            continue;
        char cbuf[CMSG_SPACE(sizeof(int))];
        struct iovec iov = {msg, MAX_LAUNCH};
        struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf, .msg_controllen = sizeof cbuf};
        ssize_t len = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
        if (len < 0 && errno == EINTR)
            continue;
        if (len <= 0)
            break; /* the zygote is going away */
        int ctl = received_fd(&mh);
        msg[len] = 0;
        if (ctl >= 0 && len > 7 && memcmp(msg, "python", 7) == 0)
            launch(ctl, msg, len);
        else if (ctl >= 0)
            close(ctl);
    }
    /* Each Python zygote is the init of its pid namespace: killing it ends its calls; reap them all. */
    for (int i = 0; i < MAX_PY; i++)
        if (py[i].pid > 0)
            kill(py[i].pid, SIGKILL);
    reap_all();
    _exit(0);
}

pid_t start_launcher(void) {
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) != 0)
        die("launcher socket", errno);
    pid_t pid = fork();
    if (pid < 0)
        die("start the Python launcher", errno);
    if (pid == 0) {
        close(sp[0]);
        launcher_main(sp[1]);
    }
    close(sp[1]);
    if (dup2(sp[0], LAUNCH_FD) != LAUNCH_FD || fcntl(LAUNCH_FD, F_SETFD, FD_CLOEXEC) != 0)
        die("launcher socket", errno);
    close(sp[0]);
    return pid;
}
