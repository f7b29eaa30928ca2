/* dsec-agent: pid 1 of a microvm guest (a vm's systemd service). Runs commands and serves files for the host over
 * one virtio-serial port, multiplexing many concurrent operations ("channels") on it.
 *
 * Static, no dependencies beyond libc: it runs on images that have no Python or shell of their own.
 * Single-threaded poll loop; every fd is non-blocking except the port, whose writes block (the host
 * reads continuously and bounds what it keeps).
 *
 * This file is the main loop: reading requests from the port and dispatching them, pumping commands' output,
 * reaping them. The requests themselves are served by the other parts (agent.h lists them).
 */
#include "agent.h"

char *args_start;
size_t args_len;

/* IDENTITY payload: hostname\0 machine-id\0 seed bytes. Given to every clone restored from a snapshot. */
static void do_identity(uint32_t id, unsigned char *p, size_t len) {
    char *strs[2];
    unsigned char *z1 = memchr(p, 0, len);
    unsigned char *z2 = z1 ? memchr(z1 + 1, 0, len - (size_t)(z1 + 1 - p)) : NULL;
    if (!z2) { send_error(id, EINVAL, "malformed identity"); return; }
    strs[0] = (char *)p; strs[1] = (char *)z1 + 1;
    size_t seedlen = len - (size_t)(z2 + 1 - p);
    if (sethostname(strs[0], strlen(strs[0])) != 0) { send_error(id, errno, "sethostname"); return; }
    int fd = open("/etc/machine-id", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0444);
    if (fd >= 0) { dprintf(fd, "%s\n", strs[1]); close(fd); }
    if (seedlen > 0 && seedlen <= 512) {
        struct { int count; int size; unsigned char buf[512]; } ent;
        ent.count = (int)seedlen * 8; ent.size = (int)seedlen;
        memcpy(ent.buf, z2 + 1, seedlen);
        int rfd = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
        /* credits entropy and reseeds the CRNG so clones never share a random stream */
        if (rfd >= 0) { ioctl(rfd, RNDADDENTROPY, &ent); ioctl(rfd, RNDRESEEDCRNG); close(rfd); }
    }
    send_frame(T_END, id, NULL, 0);
}

static void handle(int type, uint32_t id, unsigned char *p, size_t len) {
    switch (type) {
    case T_EXEC: do_exec(id, p, len, 0, 0); break;
    case T_EXEC_PRISTINE: do_exec(id, p, len, 1, 0); break;
    case T_EXEC_SYSTEM: do_exec(id, p, len, 0, 1); break;
    case T_STDIN: do_stdin(id, p, len); break;
    case T_SIGNAL: {
        struct chan *c = find_chan(id);
        if (c && c->kind == T_EXEC && c->pid > 0 && len == 1) kill(-c->pid, p[0]);
        if (c && c->kind == T_EXEC && c->pid > 0 && len == 2) signal_command(c, p[0], p[1]);
        break;
    }
    case T_EXEC_EXT: do_exec_ext(id, p, len); break;
    case T_RESIZE: do_resize(id, p, len); break;
    case T_FS: do_fs(id, p, len); break;
    case T_WATCH: do_watch(id, p, len); break;
    case T_CONNECT: do_connect(id, p, len); break;
    case T_OUT_CREDIT: do_out_credit(id, p, len); break;
    case T_CANCEL: {
        struct chan *c = find_chan(id);
        if (c && c->kind != T_EXEC && c->kind != T_WRITE) free_chan(c);
        break;
    }
    case T_READ: do_read(id, p, len); break;
    case T_WRITE: do_write(id, p, len); break;
    case T_LIST: do_list(id, p, len); break;
    case T_IDENTITY: do_identity(id, p, len); break;
    case T_CONFINE: do_confine(id, p, len); break;
    case T_REVEAL: do_reveal(id); break;
    case T_PING: {  /* END: u32 features (AGENT_FEATURES; an older agent's is empty) */
        unsigned char r[4];
        put32(r, AGENT_FEATURES);
        send_frame(T_END, id, r, 4);
        break;
    }
    case T_MKDIR: do_mkdir(id, p, len); break;
    case T_SHUTDOWN:
        send_frame(T_END, id, NULL, 0);
        sync();
        reboot(RB_POWER_OFF);
        break;
    default: send_error(id, ENOSYS, "unknown request");
    }
}

static unsigned char *rbuf;
static size_t rlen;

static void read_port(void) {
    for (;;) {
        ssize_t n = read(port, rbuf + rlen, MAX_IN + 4 - rlen);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return; /* EAGAIN, or no host connected */
        rlen += (size_t)n;
        while (rlen >= 4) {
            uint32_t flen = get32(rbuf);
            if (flen < 5 || flen > MAX_IN) { rlen = 0; return; } /* desynchronised: drop what we have */
            if (rlen < 4 + flen) break;
            handle(rbuf[4], get32(rbuf + 5), rbuf + 9, flen - 5);
            memmove(rbuf, rbuf + 4 + flen, rlen - 4 - flen);
            rlen -= 4 + flen;
        }
    }
}

static int pump(struct chan *c, int *fd, int type) {
    static char buf[OUT_CHUNK];
    size_t room = out_room(c);  /* its other pipe may have filled the window in this round */
    if (!room) return 0;
    ssize_t n = read(*fd, buf, room);
    if (n > 0) { send_output(c, type, buf, (size_t)n); return 1; }
    if (n == 0 || (errno != EAGAIN && errno != EINTR)) close_fd(fd);
    return 0;
}

/* EXIT payload: i32 exit code (128+N when killed by N) | u8 signal | u8 flags (1: the guest OOM-killed
 * something while the command ran). */
static void finish_exec(struct chan *c) {
    unsigned char r[6];
    int code = WIFEXITED(c->status) ? WEXITSTATUS(c->status) : 128 + WTERMSIG(c->status);
    put32(r, (uint32_t)code);
    r[4] = WIFSIGNALED(c->status) ? (unsigned char)WTERMSIG(c->status) : 0;
    long oom = oom_kills();
    r[5] = (c->oom_before >= 0 && oom > c->oom_before) ? 1 : 0;
    send_frame(T_EXIT, c->id, r, 6);
    free_chan(c);
}

static void reap(void) {
    int status;
    pid_t pid;
    while ((pid = waitpid(-1, &status, WNOHANG)) > 0) {
        if (pid == pidns_init) {
            /* no command can be started confined any more (fork: ENOMEM), and none may start unconfined */
            dprintf(2, "dsec-agent: the init of the commands' pid namespace died: powering off\n");
            sync();
            reboot(RB_POWER_OFF);
        }
        for (int i = 0; i < MAX_CHANS; i++)
            if (chans[i].used && chans[i].kind == T_EXEC && chans[i].pid == pid) {
                chans[i].exited = 1; chans[i].status = status; chans[i].exit_ms = now_ms();
                /* the group outlives its leader only until the host says otherwise; stdin is moot now */
                drop_stdin(&chans[i]);
            }
    }
}

int main(int argc, char **argv) {
    const char *dev = argc > 1 ? argv[1] : "/dev/vport0p1";
    if (argc > 0) {
        args_start = argv[0];
        args_len = (size_t)(argv[argc - 1] + strlen(argv[argc - 1]) + 1 - argv[0]);
    }
    struct stat image;
    if (argc > 2 && stat(argv[2], &image) == 0 && S_ISBLK(image.st_mode))
        image_dev = image.st_rdev;
    struct stat mark;
    if (getpid() != 1 && stat(CONFINED_MARK, &mark) == 0) {
        /* an agent of this guest confined its commands and died (killed by one of them?): a new one would
           serve unconfined, so the guest ends here (the host reports its death) */
        dprintf(2, "dsec-agent: the confining agent of this guest died: powering off\n");
        sync();
        reboot(RB_POWER_OFF);
        return 1;
    }
    rbuf = malloc(MAX_IN + 4);
    int dir = open("/proc", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (dir >= 0) proc_dir = dir;
    setup_command_cgroup();
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGPIPE);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    sigdelset(&mask, SIGPIPE);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    for (int tries = 0; port < 0; tries++) {
        port = open(dev, O_RDWR | O_CLOEXEC | O_NOCTTY);
        if (port < 0) {
            if (tries > 200) { dprintf(2, "dsec-agent: cannot open %s: %s\n", dev, strerror(errno)); return 1; }
            usleep(10000);
        }
    }
    fcntl(port, F_SETFL, O_NONBLOCK);
    unsigned char features[4];
    put32(features, AGENT_FEATURES);
    send_frame(T_READY, 0, features, 4);
    struct pollfd pfd[2 + 3 * MAX_CHANS];
    struct { struct chan *c; int which; } map[2 + 3 * MAX_CHANS];
    for (;;) {
        int n = 0, timeout = -1;
        long long t = now_ms();
        pfd[n].fd = port; pfd[n].events = POLLIN; n++;
        pfd[n].fd = sfd; pfd[n].events = POLLIN; n++;
        for (int i = 0; i < MAX_CHANS; i++) {
            struct chan *c = &chans[i];
            if (!c->used) continue;
            if (c->kind != T_EXEC) {
                short events = surface_events(c);
                if (events) { pfd[n] = (struct pollfd){c->sfd, events, 0}; map[n].c = c; map[n].which = 3; n++; }
                continue;
            }
            /* Its window full: its pipes wait for the host's credit, and so does the drain after its exit (what
               it wrote before exiting is all sent, then EXIT; the clock counts only while output may flow). */
            int blocked = out_room(c) == 0;
            if (c->exited && blocked && (c->out_fd >= 0 || c->err_fd >= 0)) c->exit_ms = t;
            if (c->exited && ((c->out_fd < 0 && c->err_fd < 0) || t - c->exit_ms >= DRAIN_MS)) {
                finish_exec(c);
                continue;
            }
            if (c->exited && !blocked) {
                int left = (int)(DRAIN_MS - (t - c->exit_ms));
                if (timeout < 0 || left < timeout) timeout = left;
            }
            if (c->out_fd >= 0 && !blocked) {
                pfd[n] = (struct pollfd){c->out_fd, POLLIN, 0}; map[n].c = c; map[n].which = 1; n++;
            }
            if (c->err_fd >= 0 && !blocked) {
                pfd[n] = (struct pollfd){c->err_fd, POLLIN, 0}; map[n].c = c; map[n].which = 2; n++;
            }
            if (c->in_fd >= 0 && c->inlen > 0) {
                pfd[n] = (struct pollfd){c->in_fd, POLLOUT, 0}; map[n].c = c; map[n].which = 0; n++;
            }
        }
        if (poll(pfd, (nfds_t)n, timeout) < 0) continue;
        if (pfd[1].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0) {}
            reap();
        }
        for (int i = 2; i < n; i++) {
            if (!pfd[i].revents || !map[i].c->used) continue;
            struct chan *c = map[i].c;
            if (map[i].which == 3) surface_ready(c, pfd[i].revents);
            else if (map[i].which == 0) flush_stdin(c);
            else pump(c, map[i].which == 1 ? &c->out_fd : &c->err_fd, map[i].which == 1 ? T_STDOUT : T_STDERR);
        }
        if (pfd[0].revents & POLLIN) read_port();
        else if (pfd[0].revents & (POLLHUP | POLLERR)) {  /* host not connected (yet) */
            /* its credit will never come (a re-adopting host starts afresh): windows wait for nothing, as before */
            for (int i = 0; i < MAX_CHANS; i++) chans[i].out_credit = 0;
            usleep(20000);
        }
        reap();
    }
}
