/* dsec-agent, commands: EXEC, EXEC_PRISTINE, EXEC_SYSTEM and EXEC_EXT start one each (pipes or a terminal, the
 * user, the commands' cgroup, the sandbox's namespaces after CONFINE); STDIN, SIGNAL and RESIZE reach it. */
#include "agent.h"

#include <termios.h>

/* ---- Commands' memory (vm: the agent is a systemd service with Delegate=yes) ---------------------------
 * The agent's unit has OOMScoreAdjust=-1000 (the OOM killer never takes it), which every child would inherit:
 * with all commands unkillable, a command eating the guest's memory made the kernel kill the desktop and
 * the services, then panic ("System is deadlocked on memory"). So each command's child puts its score back
 * to 0 and joins `commands`, a cgroup beside the agent's own with memory.max below the guest's RAM: a
 * command that eats memory meets that limit first and the memory cgroup's OOM killer ends the biggest
 * command process (counted in the guest's oom_kill, so the host reports limit="memory"), while the agent,
 * systemd and the desktop keep the memory they need. Without a delegated cgroup v2 (a microvm, where the
 * agent is pid 1 and the guest's RAM is only the command's) commands run where the agent is. */
static int cmd_procs_fd = -1;  /* <cgroup>/commands/cgroup.procs, open for writing from the start (a command may
                                  unmount /sys/fs/cgroup); -1 when there is none */

static int write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = write(fd, text, strlen(text));
    int saved = errno;
    close(fd);
    errno = saved;
    return n == (ssize_t)strlen(text) ? 0 : -1;
}

static long long meminfo_total(void) {
    char buf[4096];
    if (read_proc("meminfo", buf, sizeof buf) != 0) return -1;
    char *p = strstr(buf, "MemTotal:");
    return p ? atoll(p + 9) * 1024 : -1;
}

void setup_command_cgroup(void) {
    char buf[PATH_MAX], base[PATH_MAX], path[PATH_MAX + 64], num[32];
    int fd = open("/proc/self/cgroup", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 3 || strncmp(buf, "0::/", 4) != 0) return;  /* no cgroup v2 (or a hybrid): nothing to do */
    buf[n] = 0;
    buf[strcspn(buf, "\n")] = 0;
    if (strcmp(buf, "0::/") == 0) return;  /* the root cgroup: pid 1, not a delegated service */
    if (snprintf(base, sizeof base, "/sys/fs/cgroup%s", buf + 3) >= (int)sizeof base) return;
    char *leaf = strrchr(base, '/');
    if (leaf && strcmp(leaf, "/agent") == 0) *leaf = 0;  /* a restarted agent's leftover placement */
    long long total = meminfo_total();
    if (total <= 0) return;
    long long reserve = total / 4;
    if (reserve < 96ll << 20) reserve = 96ll << 20;
    if (reserve > 512ll << 20) reserve = 512ll << 20;
    if (total <= 2 * reserve) reserve = total / 2;
    snprintf(path, sizeof path, "%s/agent", base);
    if (mkdir(path, 0755) != 0 && errno != EEXIST) goto fail;
    snprintf(path, sizeof path, "%s/agent/cgroup.procs", base);
    snprintf(num, sizeof num, "%d\n", getpid());
    if (write_file(path, num) != 0) goto fail;
    snprintf(path, sizeof path, "%s/cgroup.subtree_control", base);
    if (write_file(path, "+memory\n") != 0) goto fail;
    snprintf(path, sizeof path, "%s/commands", base);
    if (mkdir(path, 0755) != 0 && errno != EEXIST) goto fail;
    snprintf(path, sizeof path, "%s/commands/memory.max", base);
    snprintf(num, sizeof num, "%lld\n", (total - reserve) & ~4095ll);
    if (write_file(path, num) != 0) goto fail;
    snprintf(path, sizeof path, "%s/commands/memory.swap.max", base);
    write_file(path, "0\n");  /* absent without swap accounting: nothing to limit then */
    snprintf(path, sizeof path, "%s/commands/cgroup.procs", base);
    cmd_procs_fd = open(path, O_WRONLY | O_CLOEXEC);
    if (cmd_procs_fd < 0) goto fail;
    return;
fail:
    dprintf(2, "dsec-agent: no memory cgroup for commands (%s): %s\n", path, strerror(errno));
}

/* In a command's child, first: an ordinary OOM score (not the agent's -1000) and the commands' cgroup. */
static void enter_command_cgroup(void) {
    int fd = openat(proc_dir, proc_dir == AT_FDCWD ? "/proc/self/oom_score_adj" : "self/oom_score_adj",
                    O_WRONLY | O_CLOEXEC);
    if (fd < 0 || write(fd, "0\n", 2) != 2) {
        dprintf(2, "dsec-agent: cannot reset the command's oom_score_adj: %s\n", strerror(errno));
        _exit(126);
    }
    close(fd);
    if (cmd_procs_fd >= 0 && write(cmd_procs_fd, "0\n", 2) != 2) {
        dprintf(2, "dsec-agent: cannot join the commands' memory cgroup: %s\n", strerror(errno));
        _exit(126);
    }
}

/* The image's read-only disk (argv[2], recorded before any command ran: microvm's EROFS root, a vm's second
   disk, its image's base attached read-only), for pristine execs. */
dev_t image_dev;

static void pristine_fail(const char *what) {
    dprintf(2, "dsec-agent: pristine exec: %s: %s\n", what, strerror(errno));
    _exit(126);
}

/* In a command's child, before it drops privileges: a private mount namespace whose root is the image as
   booted (its EROFS disk mounted afresh from the device number recorded at boot, so nothing the guest
   mounted or replaced since counts) under a throwaway tmpfs upper, with the guest's /proc, /sys, /dev, a
   fresh /tmp and the command's working directory bound in. */
static void enter_pristine(const char *cwd) {
    char path[PATH_MAX];
    if (!image_dev) { errno = ENOTSUP; pristine_fail("no image disk in this guest"); }
    if (unshare(CLONE_NEWNS) != 0) pristine_fail("new mount namespace");
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) pristine_fail("private mounts");
    /* The scratch tmpfs must allow device nodes: the image disk's node is made there. */
    if (mount("tmpfs", "/run", "tmpfs", MS_NOSUID, "mode=0700") != 0) pristine_fail("scratch tmpfs");
    const char *dirs[] = {"/run/img", "/run/upper", "/run/work", "/run/root"};
    for (size_t i = 0; i < sizeof dirs / sizeof *dirs; i++)
        if (mkdir(dirs[i], 0755) != 0) pristine_fail(dirs[i]);
    if (mknod("/run/disk", S_IFBLK | 0600, image_dev) != 0) pristine_fail("image disk node");
    /* microvm: the EROFS image; vm: the image's base disk, ext4, attached read-only (noload: no journal
       replay on a disk nothing may write) */
    if (mount("/run/disk", "/run/img", "erofs", MS_RDONLY | MS_NODEV | MS_NOSUID, NULL) != 0 &&
        mount("/run/disk", "/run/img", "ext4", MS_RDONLY | MS_NODEV | MS_NOSUID, "noload") != 0)
        pristine_fail("mount the image disk");
    if (mount("overlay", "/run/root", "overlay", MS_NOSUID | MS_NODEV,
              "lowerdir=/run/img,upperdir=/run/upper,workdir=/run/work") != 0)
        pristine_fail("overlay over the image");
    const char *binds[] = {"/proc", "/sys", "/dev"};
    for (size_t i = 0; i < sizeof binds / sizeof *binds; i++) {
        snprintf(path, sizeof path, "/run/root%s", binds[i]);
        mkdir(path, 0755);
        if (mount(binds[i], path, NULL, MS_BIND | MS_REC, NULL) != 0) pristine_fail(binds[i]);
    }
    mkdir("/run/root/tmp", 01777);
    if (mount("tmpfs", "/run/root/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777") != 0) pristine_fail("/tmp");
    if (strcmp(cwd, "/") != 0) {
        if (snprintf(path, sizeof path, "/run/root%s", cwd) >= (int)sizeof path) { errno = ENAMETOOLONG; pristine_fail(cwd); }
        mkdirs(path);
        mkdir(path, 0755);
        if (mount(cwd, path, NULL, MS_BIND | MS_REC, NULL) != 0) pristine_fail(cwd);
    }
    if (chdir("/run/root") != 0 || syscall(SYS_pivot_root, ".", ".") != 0) pristine_fail("pivot_root");
    if (umount2(".", MNT_DETACH) != 0 || chdir("/") != 0) pristine_fail("detach the guest's root");
}

/* ---- Starting one ---------------------------------------------------------------------------------- */

/* A new terminal of the guest's devpts; `o->pty == 2` (a shell session): raw, no echo, no signals from
 * typed bytes (the host signals the foreground job itself). */
static int open_terminal(const struct exec_opts *o, int *master, int *slave) {
    *master = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (*master < 0) return -1;
    int unlock = 0;
    char name[64];
    if (ioctl(*master, TIOCSPTLCK, &unlock) != 0 || ioctl(*master, TIOCGPTN, &unlock) != 0) goto fail;
    snprintf(name, sizeof name, "/dev/pts/%d", unlock);
    *slave = open(name, O_RDWR | O_NOCTTY | O_CLOEXEC);
    if (*slave < 0) goto fail;
    if (fchown(*slave, o->uid, o->gid) != 0 || fchmod(*slave, 0620) != 0) goto fail;
    struct winsize ws = {.ws_row = o->rows ? o->rows : 24, .ws_col = o->cols ? o->cols : 80};
    ioctl(*master, TIOCSWINSZ, &ws);
    if (o->pty == 2) {
        struct termios t;
        if (tcgetattr(*slave, &t) != 0) goto fail;
        cfmakeraw(&t);
        if (tcsetattr(*slave, TCSANOW, &t) != 0) goto fail;
    }
    return 0;
fail:
    {
        int e = errno;
        close_fd(master);
        close_fd(slave);
        errno = e;
    }
    return -1;
}

/* A process's pid as the commands see it (their pid namespace's last NSpid field); its own pid otherwise. */
static pid_t pid_in_commands(pid_t pid) {
    char name[64], buf[4096];
    snprintf(name, sizeof name, "%d/status", pid);
    if (read_proc(name, buf, sizeof buf) != 0) return pid;
    char *line = strstr(buf, "\nNSpid:");
    if (!line) return pid;
    line += 7;
    char *end = strchr(line, '\n');
    if (end) *end = 0;
    char *last = strrchr(line, '\t');
    return last ? (pid_t)atoi(last + 1) : pid;
}

/* Starts one command on channel `id` from `strs` (cwd, argv..., env..., NUL-terminated). */
static void start_command(uint32_t id, const struct exec_opts *o, int argc, int envc, char *p, size_t len) {
    int total = 1 + argc + envc;
    char **strs = calloc((size_t)total + 2, sizeof *strs);
    if (!strs) { send_error(id, ENOMEM, "exec"); return; }
    if (argc < 1 || split_strings(p, len, strs, total) != total) {
        free(strs); send_error(id, EINVAL, "malformed exec"); return;
    }
    struct chan *c = new_chan(id);
    if (!c) { free(strs); send_error(id, EBUSY, "exec channel"); return; }
    int in[2] = {-1, -1}, out[2] = {-1, -1}, err[2] = {-1, -1}, master = -1, slave = -1;
    if (o->pty && open_terminal(o, &master, &slave) != 0) {
        free(strs); free_chan(c); send_error(id, errno, "terminal"); return;
    }
    if ((!o->pty && pipe2(in, O_CLOEXEC)) || (o->pty != 1 && (pipe2(out, O_CLOEXEC) || pipe2(err, O_CLOEXEC)))) {
        int e = errno;
        close_pair(in); close_pair(out); close_pair(err); close_fd(&master); close_fd(&slave);
        free(strs); free_chan(c); send_error(id, e, "pipe"); return;
    }
    int in_pidns = confined && !o->system;
    if (in_pidns && setns(sandbox_pidns, CLONE_NEWPID) != 0) {
        int e = errno;
        close_pair(in); close_pair(out); close_pair(err); close_fd(&master); close_fd(&slave);
        free(strs); free_chan(c); send_error(id, e, "enter the sandbox's pid namespace"); return;
    }
    pid_t pid = fork();
    if (pid == 0) {
        setsid();
        if (slave >= 0) {
            dup2(slave, 0);
            if (o->pty == 1) { dup2(slave, 1); dup2(slave, 2); }
            if (ioctl(0, TIOCSCTTY, 0) != 0) {
                dprintf(2, "dsec-agent: cannot take the terminal: %s\n", strerror(errno));
                _exit(126);
            }
        } else {
            dup2(in[0], 0);
        }
        if (o->pty != 1) { dup2(out[1], 1); dup2(err[1], 2); }
        sigset_t all;
        sigemptyset(&all);
        sigprocmask(SIG_SETMASK, &all, NULL);
        enter_command_cgroup();  /* before the sandbox's namespace, where /sys is read-only */
        if (confined && !o->system && setns(sandbox_ns, CLONE_NEWNS) != 0) {
            dprintf(2, "dsec-agent: cannot enter the sandbox's mount namespace: %s\n", strerror(errno));
            _exit(126);
        }
        if (o->pristine)
            enter_pristine(strs[0]);
        if (confined && !o->system)
            drop_privileges();
        if (o->gid != 0 || o->uid != 0 || o->ngroups) {
            if (setgroups((size_t)o->ngroups, o->groups) != 0 || setgid(o->gid) != 0 || setuid(o->uid) != 0) {
                dprintf(2, "dsec-agent: cannot become %u:%u: %s\n", o->uid, o->gid, strerror(errno));
                _exit(126);
            }
        }
        char **argv = strs + 1, **envp = strs + 1 + argc + 1;
        memmove(envp, strs + 1 + argc, (size_t)envc * sizeof *envp);
        envp[envc] = NULL;
        argv[argc] = NULL;
        if (chdir(strs[0]) != 0) {
            dprintf(2, "dsec-agent: cannot enter %s: %s\n", strs[0], strerror(errno));
            _exit(126);
        }
        environ = envp;
        execvp(argv[0], argv);
        dprintf(2, "dsec-agent: cannot run %s: %s\n", argv[0], strerror(errno));
        _exit(errno == ENOENT ? 127 : 126);
    }
    int fork_errno = errno;
    if (in_pidns && setns(agent_pidns, CLONE_NEWPID) != 0) {
        dprintf(2, "dsec-agent: cannot return to its pid namespace: %s\n", strerror(errno));
        reboot(RB_POWER_OFF);
    }
    free(strs);
    close_fd(&in[0]); close_fd(&out[1]); close_fd(&err[1]); close_fd(&slave);
    c->kind = T_EXEC;
    c->credit = o->credit;
    c->out_credit = o->out_credit;
    c->in_fd = master >= 0 ? master : in[1];
    c->out_fd = o->pty == 1 ? dup(master) : out[0];
    c->err_fd = err[0];
    c->tty = master >= 0 ? dup(master) : -1;  /* for RESIZE and the foreground group, after stdin closes */
    if (pid < 0) { send_error(id, fork_errno, "fork"); free_chan(c); return; }
    c->pid = pid;
    c->oom_before = oom_kills();
    fcntl(c->in_fd, F_SETFL, O_NONBLOCK);
    if (c->out_fd >= 0) fcntl(c->out_fd, F_SETFL, O_NONBLOCK);
    if (c->err_fd >= 0) fcntl(c->err_fd, F_SETFL, O_NONBLOCK);
    if (o->report_pid) {
        unsigned char r[4];
        put32(r, (uint32_t)pid_in_commands(pid));
        send_frame(T_STARTED, id, r, 4);
    }
}

/* EXEC payload: u16 argc | u16 envc | u32 uid | u32 gid | cwd\0 argv[0]\0 ... env[0]\0 ...
   (EXEC_PRISTINE: the same, run on the image's untouched root, see enter_pristine; EXEC_SYSTEM: the host's
   own upkeep (a vm's clock, its disk's growth), never confined, whatever CONFINE did) */
void do_exec(uint32_t id, unsigned char *p, size_t len, int pristine, int system) {
    if (len < 12) { send_error(id, EINVAL, "malformed exec"); return; }
    struct exec_opts o = {.uid = get32(p + 4), .gid = get32(p + 8), .pristine = pristine, .system = system};
    int argc = (p[0] << 8) | p[1], envc = (p[2] << 8) | p[3];
    start_command(id, &o, argc, envc, (char *)p + 12, len - 12);
}

/* EXEC_EXT payload: u16 argc | u16 envc | u32 flags | u16 cols | u16 rows | CREDS | cwd\0 argv...\0 env...\0
 * flags: 1 pristine, 2 system, 4 terminal (stdin, stdout, stderr), 8 terminal stdin only (raw; a shell
 * session), 16 report the pid (STARTED: u32 pid in the commands' pid namespace, before any output), 32 credit
 * its stdin as it is consumed (CREDIT), 64 keep its output within the window the host credits (OUT_CREDIT). */
void do_exec_ext(uint32_t id, unsigned char *p, size_t len) {
    if (len < 12) { send_error(id, EINVAL, "malformed exec"); return; }
    int argc = (p[0] << 8) | p[1], envc = (p[2] << 8) | p[3];
    uint32_t flags = get32(p + 4);
    struct exec_opts o = {.cols = (unsigned short)((p[8] << 8) | p[9]), .rows = (unsigned short)((p[10] << 8) | p[11]),
                          .pristine = flags & 1, .system = !!(flags & 2),
                          .pty = flags & 4 ? 1 : flags & 8 ? 2 : 0, .report_pid = !!(flags & 16),
                          .credit = !!(flags & 32), .out_credit = !!(flags & 64)};
    p += 12; len -= 12;
    struct creds c;
    if (parse_creds(&p, &len, &c) != 0) { send_error(id, EINVAL, "malformed exec user"); return; }
    o.uid = c.uid; o.gid = c.gid; o.ngroups = c.ngroups;
    memcpy(o.groups, c.groups, sizeof c.groups);
    start_command(id, &o, argc, envc, (char *)p, len);
}

/* ---- A running one ---------------------------------------------------------------------------------- */

/* SIGNAL with a second byte: 1 = the terminal's foreground group, 2 = the same unless it is the command's
 * own group (a shell between jobs must not be killed by its own interrupt). */
void signal_command(struct chan *c, int signo, int how) {
    pid_t group = -1;
    if (c->tty >= 0 && ioctl(c->tty, TIOCGPGRP, &group) != 0) group = -1;
    if (group <= 0) group = c->pid;
    if (how == 2 && group == c->pid) return;
    kill(-group, signo);
}

/* RESIZE payload: u16 cols | u16 rows (the channel's terminal; SIGWINCH goes to its foreground job). */
void do_resize(uint32_t id, unsigned char *p, size_t len) {
    struct chan *c = find_chan(id);
    if (!c || c->tty < 0 || len != 4) return;
    struct winsize ws = {.ws_col = (unsigned short)((p[0] << 8) | p[1]), .ws_row = (unsigned short)((p[2] << 8) | p[3])};
    ioctl(c->tty, TIOCSWINSZ, &ws);
}

/* The stdin still waiting for a command that no longer takes it (EPIPE, or it exited): dropped, and credited. */
void drop_stdin(struct chan *c) {
    size_t dropped = c->inlen;
    c->inlen = 0;
    close_fd(&c->in_fd);
    credit_stdin(c, dropped, 1);
}

void flush_stdin(struct chan *c) {
    size_t written = 0;
    while (c->in_fd >= 0 && c->inlen > 0) {
        ssize_t n = write(c->in_fd, c->inbuf, c->inlen);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) break;
            credit_stdin(c, written, 0);
            drop_stdin(c);  /* EPIPE: the command stopped reading */
            return;
        }
        memmove(c->inbuf, c->inbuf + n, c->inlen - (size_t)n);
        c->inlen -= (size_t)n;
        written += (size_t)n;
    }
    credit_stdin(c, written, c->inlen == 0);
    if (c->in_eof && c->inlen == 0) close_fd(&c->in_fd);
}

/* STDIN for a command: written to its pipe or terminal as far as it takes it, the rest kept until it does (the
 * host's window bounds that; an older host's 8 MiB is refused). Empty: the end of its input. */
void do_stdin(uint32_t id, unsigned char *p, size_t len) {
    struct chan *c = find_chan(id);
    if (!c) return; /* the command already ended: its input is moot (the host's window closed with its EXIT) */
    if (connect_input(c, p, len)) return;
    if (write_input(c, p, len)) return;
    if (len == 0 && c->in_fd >= 0 && c->tty >= 0) {  /* a terminal's end of input is Ctrl-D */
        (void)!write(c->in_fd, "\x04", 1); return;
    }
    if (len == 0) { c->in_eof = 1; flush_stdin(c); return; }
    if (c->in_fd < 0) { credit_stdin(c, len, 1); return; }  /* it stopped reading: dropped */
    if (c->inlen + len > STDIN_BUF_MAX) { send_error(id, ENOBUFS, "stdin"); return; }
    char *nb = realloc(c->inbuf, c->inlen + len);
    if (!nb) { send_error(id, ENOMEM, "stdin"); return; }
    c->inbuf = nb;
    memcpy(c->inbuf + c->inlen, p, len);
    c->inlen += len;
    flush_stdin(c);
}
