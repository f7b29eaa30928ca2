/* dsec-zygote, what the zygote and its launcher both do: report a failure on a socket, wait for requests and
 * children on one poll, take the fds a message carries, and reap every child before they exit. */
#include "zygote.h"

/* "error <what>: <why>" on `sock`, the one way a start-up failure is told. */
void send_failure(int sock, const char *what, int err) {
    char buf[600];
    int n = snprintf(buf, sizeof buf, "error %s: %s", what, strerror(err));
    if (n > 0)
        (void)!send(sock, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1, MSG_NOSIGNAL);
}

/* At start-up: errors go to the control socket, and the zygote (or the launcher, before it runs) exits. */
void die(const char *what, int err) {
    send_failure(CTL_FD, what, err);
    _exit(1);
}

/* SIGCHLD blocked and read from the signalfd returned (-1 when there is none). */
int child_signals(void) {
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    return signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
}

/* One wait on `pfd`, whose second entry is the signalfd of child_signals: children that ended are reaped
   (`reap`). 1 when something is ready, 0 when interrupted, -1 when polling failed. */
int poll_children(struct pollfd *pfd, nfds_t n, void (*reap)(void)) {
    if (poll(pfd, n, -1) < 0)
        return errno == EINTR ? 0 : -1;
    if (pfd[1].revents) {
        struct signalfd_siginfo si;
        while (read(pfd[1].fd, &si, sizeof si) > 0) {
        }
        reap();
    }
    return 1;
}

/* Every child reaped, once it has ended (each an init of its namespace: once everything there is gone). */
void reap_all(void) {
    for (;;) {
        pid_t pid = waitpid(-1, NULL, 0);
        if (pid < 0 && errno != EINTR)
            break;
    }
}

/* The one fd a message carries (SCM_RIGHTS), or -1. */
int received_fd(struct msghdr *mh) {
    int fd = -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(mh); c; c = CMSG_NXTHDR(mh, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int)))
            memcpy(&fd, CMSG_DATA(c), sizeof fd);
    return fd;
}

/* Take the fds out of a received message: four (stdin, stdout, stderr, status), then up to ``max`` - 4 more
   (the clone's: a fifth when the request itself came in a memfd, see dispatch; the zygote's: the cgroup.procs
   files of the call's own cgroup). Returns how many, -1 unless 4 to ``max`` came whole. */
int take_fds(struct msghdr *mh, int *fds, int max) {
    int nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(mh); c; c = CMSG_NXTHDR(mh, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int count = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < count; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
                if (nfds < max)
                    fds[nfds++] = fd;
                else
                    close(fd);
            }
        }
    if (nfds < 4 || (mh->msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        for (int i = 0; i < nfds; i++)
            close(fds[i]);
        return -1;
    }
    return nfds;
}
