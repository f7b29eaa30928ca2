/* dsec-agent: pid 1 of a microvm guest. Runs commands and serves files for the host over one
 * virtio-serial port, multiplexing many concurrent operations ("channels") on it.
 *
 * Static, no dependencies beyond libc: it runs on images that have no Python or shell of their own.
 * Single-threaded poll loop; every fd is non-blocking except the port, whose writes block (the host
 * reads continuously and bounds what it keeps).
 *
 * Frame (both directions): u32 length (big-endian; counts the bytes after it) | u8 type | u32 channel
 * | payload. Types and payloads are documented in docs/design.md ("microvm: agent protocol").
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <grp.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/reboot.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <linux/capability.h>
#include <linux/random.h>

enum {
    T_EXEC = 1, T_STDIN = 2, T_SIGNAL = 3, T_READ = 4, T_WRITE = 5, T_LIST = 6, T_IDENTITY = 7,
    T_SHUTDOWN = 8, T_PING = 9, T_MKDIR = 10, T_EXEC_PRISTINE = 11, T_EXEC_SYSTEM = 12,
    T_CONFINE = 16, T_REVEAL = 17, T_EXEC_EXT = 18, T_RESIZE = 19, T_FS = 20, T_WATCH = 21, T_CANCEL = 22,
    T_CONNECT = 23,
    T_STDOUT = 0x81, T_STDERR = 0x82, T_EXIT = 0x83, T_DATA = 0x84, T_END = 0x85, T_ERROR = 0x86,
    T_READY = 0x87, T_STARTED = 0x88,
};

#define MAX_IN ((2u << 20) + (64u << 10)) /* largest frame the host may send: a command at the kernel's limit */
#define MAX_GROUPS 64
#define OUT_CHUNK 65536        /* largest payload we send (the host rejects more) */
#define MAX_CHANS 512
#define STDIN_BUF_MAX (8u << 20)
#define DRAIN_MS 200

struct chan {
    uint32_t id;
    int used;
    int kind;             /* T_EXEC or T_WRITE */
    pid_t pid;            /* exec: process (group leader) */
    int in_fd, out_fd, err_fd;
    char *inbuf;          /* exec: stdin waiting for the pipe; write: unused */
    size_t inlen;
    int in_eof;
    int exited, status;
    long long exit_ms;
    long oom_before;      /* exec: the guest's oom_kill count when it started */
    int wfd;              /* write: temp file (or the file itself, written as a user: agent_surface.c) */
    int tty;              /* exec on a terminal: its master side (RESIZE, the foreground group) */
    int sfd;              /* watch: its inotify fd; connect: its socket (agent_surface.c) */
    void *extra;          /* watch: its directories (agent_surface.c) */
    char *wpath, *wtmp;
    mode_t wmode;
    int werr;
};

static int port = -1;
static struct chan chans[MAX_CHANS];
struct exec_opts;
static void start_command(uint32_t id, const struct exec_opts *o, int argc, int envc, char *p, size_t len);
/* agent_surface.c */
static void surface_free(struct chan *c);
static int open_terminal(const struct exec_opts *o, int *master, int *slave);
static void close_pair(int *fds);
static pid_t pid_in_commands(pid_t pid);
static int connect_input(struct chan *c, unsigned char *p, size_t len);

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void put32(unsigned char *p, uint32_t v) {
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}

static uint32_t get32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static void write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) { struct pollfd pf = {fd, POLLOUT, 0}; poll(&pf, 1, 1000); continue; }
            return; /* host gone: nothing to report to */
        }
        p += n; len -= (size_t)n;
    }
}

static void send_frame(int type, uint32_t ch, const void *data, size_t len) {
    unsigned char hdr[9];
    put32(hdr, (uint32_t)(len + 5));
    hdr[4] = (unsigned char)type;
    put32(hdr + 5, ch);
    write_all(port, hdr, 9);
    if (len) write_all(port, data, len);
}

static void send_error(uint32_t ch, int err, const char *what) {
    char buf[512];
    put32((unsigned char *)buf, (uint32_t)err);
    int n = snprintf(buf + 4, sizeof buf - 4, "%s: %s", what, strerror(err));
    if (n < 0) n = 0;
    if (n > (int)sizeof buf - 4) n = sizeof buf - 4;
    send_frame(T_ERROR, ch, buf, 4 + (size_t)n);
}

static struct chan *find_chan(uint32_t id) {
    for (int i = 0; i < MAX_CHANS; i++)
        if (chans[i].used && chans[i].id == id) return &chans[i];
    return NULL;
}

static struct chan *new_chan(uint32_t id) {
    if (find_chan(id)) return NULL;
    for (int i = 0; i < MAX_CHANS; i++)
        if (!chans[i].used) {
            memset(&chans[i], 0, sizeof chans[i]);
            chans[i].used = 1;
            chans[i].id = id;
            chans[i].in_fd = chans[i].out_fd = chans[i].err_fd = chans[i].wfd = chans[i].tty = chans[i].sfd = -1;
            return &chans[i];
        }
    return NULL;
}

/* The guest's /proc as the agent found it at start (O_PATH): what it reads and writes there keeps working
 * when guest root unmounts or covers /proc (an unconfined vm's commands may). */
static int proc_dir = AT_FDCWD;

/* The start of /proc/`name` (through proc_dir), NUL-terminated in `buf`; -1 when unreadable or empty. */
static int read_proc(const char *name, char *buf, size_t size) {
    char path[64];
    if (proc_dir == AT_FDCWD) snprintf(path, sizeof path, "/proc/%s", name);
    int fd = openat(proc_dir, proc_dir == AT_FDCWD ? path : name, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    return 0;
}

/* The guest kernel's OOM-kill counter (/proc/vmstat oom_kill); -1 when unreadable. */
static long oom_kills(void) {
    char buf[8192];
    if (read_proc("vmstat", buf, sizeof buf) != 0) return -1;
    char *p = strstr(buf, "\noom_kill ");
    return p ? atol(p + 10) : -1;
}

static void close_fd(int *fd) {
    if (*fd >= 0) { close(*fd); *fd = -1; }
}

static void free_chan(struct chan *c) {
    close_fd(&c->in_fd); close_fd(&c->out_fd); close_fd(&c->err_fd); close_fd(&c->wfd); close_fd(&c->tty);
    surface_free(c);
    free(c->inbuf); free(c->wpath);
    if (c->wtmp) { unlink(c->wtmp); free(c->wtmp); }
    c->used = 0;
}

/* Splits a payload of NUL-terminated strings; returns how many were found, -1 if malformed. */
static int split_strings(char *p, size_t len, char **out, int max) {
    int n = 0;
    size_t i = 0;
    while (i < len) {
        if (n == max) return -1;
        out[n++] = p + i;
        char *z = memchr(p + i, 0, len - i);
        if (!z) return -1;
        i = (size_t)(z - p) + 1;
    }
    return n;
}

static void mkdirs(const char *path) {
    char buf[PATH_MAX];
    if (strlen(path) >= sizeof buf) return;
    strcpy(buf, path);
    for (char *s = buf + 1; *s; s++)
        if (*s == '/') { *s = 0; mkdir(buf, 0755); *s = '/'; }
}

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

static void setup_command_cgroup(void) {
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
static dev_t image_dev;

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

/* ---- Confinement (microvm): commands without the capabilities that undo protections ------------------
 * After CONFINE, every command runs in a mount namespace of its own ("the sandbox's"), made once by the
 * agent, and without the capabilities that would let guest root undo what the agent set up there:
 * protected paths are read-only bind mounts (made in the agent's namespace first, so both have them; each
 * directory above them bound over itself, so none can be renamed away with the path inside),
 * hidden directories are covered by an empty read-only tmpfs in the sandbox's namespace only (the agent's
 * files API sees and writes beneath the cover), /proc/sys and /sys are read-only there, every mount below
 * them included (their writable knobs would run a helper as full root: core_pattern, uevent_helper, tracefs,
 * configfs...). Commands also run in a pid namespace of their own (start_pid_namespace): no process outside
 * it, the agent, a vm's services and its desktop included, is visible or reachable to them. The agent
 * becomes non-dumpable as a second line (its /proc entries refuse commands even if reached), and new user
 * namespaces are switched off for good (max_user_namespaces = 0, which /proc/sys read-only keeps so). */
#define CONFINED_DIR "/run/dsec-agent"
#define CONFINED_MARK CONFINED_DIR "/confined"
static int confined;
static int sandbox_ns = -1;            /* mount namespace of commands */
static int sandbox_pidns = -1;         /* pid namespace of commands (see start_pid_namespace) */
static int agent_pidns = -1;           /* the agent's own, for the forks that are not commands */
static pid_t pidns_init = -1;          /* its init, a child of the agent */
static char *args_start;               /* the agent's argv strings (its /proc/<pid>/cmdline) */
static size_t args_len;
#define MAX_HIDDEN 64
static char *hidden[MAX_HIDDEN];       /* still covered */
static int nhidden;

/* Capabilities no command keeps (bounding set), each because it undoes a protection or reaches past the
 * guest's own files: mounts and namespaces (SYS_ADMIN), open_by_handle_at around mounts (DAC_READ_SEARCH),
 * kernel modules, raw I/O, device nodes, ptrace, immutable flags, the clock, reboot, MAC, audit, BPF,
 * perf, syslog, rlimit/quotas overrides, network configuration, and SETPCAP (last: it drops the others).
 * Kept: CHOWN, DAC_OVERRIDE, FOWNER, FSETID, KILL, SETGID, SETUID, NET_BIND_SERVICE, NET_BROADCAST,
 * NET_RAW, IPC_LOCK, IPC_OWNER, SYS_CHROOT, SYS_NICE, LEASE, AUDIT_WRITE, SETFCAP: root installs packages,
 * chowns files and changes users as usual. */
static const int dropped_caps[] = {
    CAP_DAC_READ_SEARCH, CAP_LINUX_IMMUTABLE, CAP_NET_ADMIN, CAP_SYS_MODULE, CAP_SYS_RAWIO, CAP_SYS_PTRACE,
    CAP_SYS_PACCT, CAP_SYS_ADMIN, CAP_SYS_BOOT, CAP_SYS_RESOURCE, CAP_SYS_TIME, CAP_SYS_TTY_CONFIG, CAP_MKNOD,
    CAP_AUDIT_CONTROL, CAP_MAC_OVERRIDE, CAP_MAC_ADMIN, CAP_SYSLOG, CAP_WAKE_ALARM, CAP_BLOCK_SUSPEND,
    37 /* AUDIT_READ */, 38 /* PERFMON */, 39 /* BPF */, 40 /* CHECKPOINT_RESTORE */, CAP_SETPCAP,
};

/* In a command's child, after any pristine mounts and before it becomes its user: no way back. */
static void drop_privileges(void) {
    for (size_t i = 0; i < sizeof dropped_caps / sizeof *dropped_caps; i++)
        if (prctl(PR_CAPBSET_DROP, dropped_caps[i], 0, 0, 0) != 0 && errno != EINVAL) {
            dprintf(2, "dsec-agent: cannot drop capability %d: %s\n", dropped_caps[i], strerror(errno));
            _exit(126);
        }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) {
        dprintf(2, "dsec-agent: cannot set no_new_privs: %s\n", strerror(errno));
        _exit(126);
    }
}

static void send_text_error(uint32_t ch, int err, const char *text) {
    char buf[512];
    put32((unsigned char *)buf, (uint32_t)err);
    size_t n = strlen(text);
    if (n > sizeof buf - 4) n = sizeof buf - 4;
    memcpy(buf + 4, text, n);
    send_frame(T_ERROR, ch, buf, 4 + n);
}

/* 0 when `path` exists (dir: a directory, created if missing) and no component is a symbolic link (a link
 * the sandbox controls could later point elsewhere than the mount); else an error frame and -1. */
static int check_path(uint32_t id, const char *path, int dir) {
    char msg[PATH_MAX + 128], real[PATH_MAX];
    struct stat st;
    if (dir) { mkdirs(path); mkdir(path, 0755); }
    if (lstat(path, &st) != 0) {
        snprintf(msg, sizeof msg, "%s path %s does not exist in the sandbox", dir ? "hidden" : "protected", path);
        send_text_error(id, EINVAL, msg);
        return -1;
    }
    if (!realpath(path, real) || strcmp(real, path) != 0) {
        snprintf(msg, sizeof msg, "path %s passes through a symbolic link", path);
        send_text_error(id, EINVAL, msg);
        return -1;
    }
    if (dir && !S_ISDIR(st.st_mode)) {
        snprintf(msg, sizeof msg, "hidden path %s is not a directory", path);
        send_text_error(id, EINVAL, msg);
        return -1;
    }
    return 0;
}

static int bind_read_only(const char *path) {
    if (mount(path, path, NULL, MS_BIND | MS_REC, NULL) != 0) return -1;
    return mount(NULL, path, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL);
}

/* The mount id, parent id and mount point of a /proc/self/mountinfo line (fields 1, 2 and 5), the point
 * decoded in place (the kernel writes space, tab, newline and backslash as \ooo); -1 if malformed. */
static int mountinfo_fields(char *line, int *id, int *parent, char **point) {
    char *s = line;
    if (sscanf(line, "%d %d", id, parent) != 2) return -1;
    for (int field = 0; field < 4; field++) {
        s = strchr(s, ' ');
        if (!s) return -1;
        s++;
    }
    char *end = strchr(s, ' ');
    if (!end) return -1;
    *end = 0;
    char *w = s;
    for (char *r = s; *r; w++) {
        if (r[0] == '\\' && r[1] >= '0' && r[1] <= '3' && r[2] >= '0' && r[2] <= '7' && r[3] >= '0' && r[3] <= '7') {
            *w = (char)(((r[1] - '0') << 6) | ((r[2] - '0') << 3) | (r[3] - '0'));
            r += 4;
        } else {
            *w = *r++;
        }
    }
    *w = 0;
    *point = s;
    return 0;
}

/* bind_read_only, and every mount below it read-only too: a recursive bind keeps its submounts' own flags,
 * and under /sys and /proc/sys those are the writable ones that matter (tracefs, debugfs, configfs,
 * securityfs, bpf, cgroup, binfmt_misc, pstore, efivarfs). Only the mounts of the new bind's own tree (by
 * parent id): mounts hidden beneath another at the same path (the guest's /proc under a namespace's own)
 * are listed too, and their paths lead elsewhere. In the caller's mount namespace. */
#define MAX_MOUNTS 4096
static int bind_read_only_tree(const char *path) {
    static int ids[MAX_MOUNTS], parents[MAX_MOUNTS];
    static char *points[MAX_MOUNTS];
    if (bind_read_only(path) != 0) return -1;
    FILE *f = fopen("/proc/self/mountinfo", "re");
    if (!f) return -1;
    size_t cap = 0;
    char *line = NULL;
    int n = 0, top = -1, failed = 0;
    while (n < MAX_MOUNTS && getline(&line, &cap, f) > 0) {
        char *point;
        if (mountinfo_fields(line, &ids[n], &parents[n], &point) != 0) continue;
        points[n] = strdup(point);
        if (!points[n]) { failed = ENOMEM; break; }
        if (!strcmp(point, path)) top = ids[n];  /* the last one: the bind just made */
        n++;
    }
    free(line);
    fclose(f);
    if (!failed && n == MAX_MOUNTS) failed = E2BIG;
    if (!failed && top < 0) failed = ENOENT;
    for (int i = 0; !failed && i < n; i++) {
        int under = 0, at = parents[i];
        for (int depth = 0; depth < 64 && !under && ids[i] != top; depth++) {
            if (at == top) { under = 1; break; }
            int j = 0;
            while (j < n && ids[j] != at) j++;
            if (j == n) break;
            at = parents[j];
        }
        if (under && mount(NULL, points[i], NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL) != 0)
            failed = errno;
    }
    for (int i = 0; i < n; i++) free(points[i]);
    if (failed) errno = failed;
    return failed ? -1 : 0;
}

/* Each directory above `path` (but /) bound over itself, read-write: a mount point cannot be renamed or
 * removed (EBUSY), so no command can move a protected or hidden path away with its parent and put its own
 * directory where the grader looks (a mount moves with a renamed ancestor). Idempotent per directory. */
static char *pinned[1024];
static int npinned;

static int pin_ancestors(const char *path) {
    char buf[PATH_MAX];
    if (strlen(path) >= sizeof buf) { errno = ENAMETOOLONG; return -1; }
    strcpy(buf, path);
    for (char *s = buf + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        int seen = 0;
        for (int i = 0; i < npinned && !seen; i++) seen = !strcmp(pinned[i], buf);
        if (!seen) {
            if (npinned == (int)(sizeof pinned / sizeof *pinned)) { errno = E2BIG; return -1; }
            if (mount(buf, buf, NULL, MS_BIND | MS_REC, NULL) != 0) return -1;
            pinned[npinned++] = strdup(buf);
        }
        *s = '/';
    }
    return 0;
}

static void send_hidden(uint32_t id) {
    static char buf[OUT_CHUNK];
    size_t used = 0;
    for (int i = 0; i < nhidden; i++) {
        size_t n = strlen(hidden[i]) + 1;
        if (used + n > sizeof buf) break;
        memcpy(buf + used, hidden[i], n);
        used += n;
    }
    if (used) send_frame(T_DATA, id, buf, used);
    send_frame(T_END, id, NULL, 0);
}

/* In the commands' namespace: every block device node directly in `dir` covered by a bind of /dev/null on a
 * nodev mount (opening it: EACCES). A full VM's root disk is a writable block device whose filesystem holds
 * the protected files: raw writes (debugfs -w) would go around every mount. */
static int cover_block_devices(const char *dir) {
    char path[PATH_MAX];
    DIR *d = opendir(dir);
    if (!d) return errno == ENOENT ? 0 : -1;
    struct dirent *e;
    int failed = 0;
    while (!failed && (e = readdir(d)) != NULL) {
        struct stat st;
        if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) >= (int)sizeof path) continue;
        if (lstat(path, &st) != 0 || !S_ISBLK(st.st_mode)) continue;
        if (mount("/dev/null", path, NULL, MS_BIND, NULL) != 0 ||
            mount(NULL, path, NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL) != 0) failed = errno;
    }
    closedir(d);
    if (failed) errno = failed;
    return failed ? -1 : 0;
}

/* The commands' pid namespace: they see and signal only each other. Without it a command could read the
 * guest's other processes (/proc/<pid>/root of a service is its uncovered view of the disk, hidden paths
 * included, reachable after setuid to the service's user), kill the agent or a vm's Xorg (and answer as :0 in
 * its place to the session that restarts it), or signal services. Its init is a child of the agent that
 * mounts the namespace's own /proc in the sandbox's mount namespace (/proc/sys read-only again) and then
 * only waits (SIGCHLD ignored: the kernel reaps the orphans reparented to it); the kernel ignores the
 * signals its namespace sends it. The agent forks each command into it (setns of pid_for_children around
 * the fork). 0, or -1 with errno. */
static const char *pidns_step;  /* what failed, for CONFINE's error */

static int start_pid_namespace(void) {
    static const char *steps[] = {"pipe", "unshare", "namespace fd", "fork", "enter the mount namespace",
                                  "mount /proc", "/proc/sys read-only", "no word from its init"};
    int ready[2], err = 0, at[2] = {0, 0};  /* errno, step */
    pidns_step = steps[0];
    pid_t pid = -1;
    if (pipe2(ready, O_CLOEXEC) != 0) return -1;
    pidns_step = steps[1];
    agent_pidns = open("/proc/self/ns/pid", O_RDONLY | O_CLOEXEC);
    if (agent_pidns < 0 || unshare(CLONE_NEWPID) != 0) {
        err = errno;
        close(ready[0]); close(ready[1]);
        errno = err;
        return -1;
    }
    if ((pid = fork()) == 0) {  /* pid 1 of the new namespace */
        sigset_t none;
        sigemptyset(&none);
        signal(SIGCHLD, SIG_IGN);
        sigprocmask(SIG_SETMASK, &none, NULL);
        /* its name and command line its own (pidof and ps match an agent's argv[0]) */
        prctl(PR_SET_NAME, "dsec-pidns-init", 0, 0, 0);
        if (args_len > sizeof "dsec-pidns-init") {
            memset(args_start, 0, args_len);
            strcpy(args_start, "dsec-pidns-init");
        }
        prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
        if (setns(sandbox_ns, CLONE_NEWNS) != 0) at[1] = 4;
        else if (mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL) != 0) at[1] = 5;
        else if (bind_read_only_tree("/proc/sys") != 0) at[1] = 6;
        if (at[1]) at[0] = errno;
        if (write(ready[1], at, sizeof at) != sizeof at || at[0]) _exit(1);
        /* every descriptor, the port above all */
        if (syscall(SYS_close_range, 0u, ~0u, 0u) != 0)
            for (int fd = 0; fd < 65536; fd++) close(fd);
        for (;;) pause();
    }
    if (!err && pid < 0) { err = errno; pidns_step = steps[3]; }
    close(ready[1]);
    if (!err) {
        if (read(ready[0], at, sizeof at) != sizeof at) { at[0] = EIO; at[1] = 7; }
        if (at[0]) { err = at[0]; pidns_step = steps[at[1]]; }
    }
    close(ready[0]);
    /* (only now: the kernel shows pid_for_children once the namespace has its init) */
    if (!err && (sandbox_pidns = open("/proc/self/ns/pid_for_children", O_RDONLY | O_CLOEXEC)) < 0) {
        err = errno; pidns_step = steps[2];
    }
    /* the agent's other forks (its upkeep commands) stay in its own namespace */
    if (setns(agent_pidns, CLONE_NEWPID) != 0) {
        dprintf(2, "dsec-agent: cannot return to its pid namespace: %s\n", strerror(errno));
        reboot(RB_POWER_OFF);
    }
    if (pid > 0 && err) { kill(pid, SIGKILL); waitpid(pid, NULL, 0); }
    if (err) { errno = err; return -1; }
    pidns_init = pid;
    return 0;
}

/* CONFINE payload: "P/path\0" (protected) and "H/path\0" (hidden) strings, any number (none: just the
 * namespace and the dropped capabilities); a vm adds "C/path\0" (a directory covered for good by an empty
 * read-only tmpfs in the commands' namespace, when it exists: the control sockets of systemd, udev and D-Bus,
 * which would run anything as full root), "T/path\0" (covered by an empty writable tmpfs of the commands'
 * own: a vm's /run, where systemd, udev and modprobe read units, rules and install commands), "W/path\0"
 * (when any is given, the commands' root filesystem is read-only but for these directories: a vm's systemd,
 * services, desktop and the kernel's modprobe run as full root outside the confinement and execute what is
 * on that disk) and "B/dev\0" (the block devices there covered, see cover_block_devices). Before confining,
 * the agent leaves a mark in its own /run (no mark, no confinement): an agent started again in this guest (a
 * vm's systemd restarts one that died) powers the guest off rather than serve unconfined (see main). Reply: DATA with the still hidden paths (NUL-terminated), END.
 * A guest already confined (a restored snapshot of one) keeps its setup and only reports. */
static void do_confine(uint32_t id, unsigned char *p, size_t len) {
    char *strs[512];
    char msg[PATH_MAX + 64];
    if (confined) { send_hidden(id); return; }
    int n = split_strings((char *)p, len, strs, 512);
    if (n < 0) { send_error(id, EINVAL, "malformed confine"); return; }
    int nh = 0;
    for (int i = 0; i < n; i++) {
        if (!strchr("PHCTWB", strs[i][0]) || strs[i][1] != '/' || strs[i][2] == 0) {
            send_error(id, EINVAL, "malformed confine path"); return;
        }
        if (strs[i][0] == 'H' && ++nh > MAX_HIDDEN) { send_error(id, E2BIG, "hidden paths"); return; }
        if (strchr("PH", strs[i][0]) && check_path(id, strs[i] + 1, strs[i][0] == 'H') != 0) return;
    }
    /* the mark first: an agent that confined anything (or began to) is never followed by an unconfined one */
    mkdir(CONFINED_DIR, 0700);
    int fd = open(CONFINED_MARK, O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) {
        snprintf(msg, sizeof msg, "the confined mark %s: %s", CONFINED_MARK, strerror(errno));
        send_text_error(id, EIO, msg); return;
    }
    close(fd);
    for (int i = 0; i < n; i++)
        if (strchr("PH", strs[i][0]) && pin_ancestors(strs[i] + 1) != 0) {
            snprintf(msg, sizeof msg, "bind mount over a parent of %s: %s", strs[i] + 1, strerror(errno));
            send_text_error(id, EIO, msg); return;
        }
    for (int i = 0; i < n; i++)
        if (strs[i][0] == 'P' && bind_read_only(strs[i] + 1) != 0) {
            snprintf(msg, sizeof msg, "read-only bind mount of %s: %s", strs[i] + 1, strerror(errno));
            send_text_error(id, EIO, msg); return;
        }
    int root_ns = open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
    if (root_ns < 0 || unshare(CLONE_NEWNS) != 0) { send_error(id, errno, "sandbox mount namespace"); return; }
    const char *what = "private mounts";
    int failed = mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 ? errno : 0;
    const char *knobs[] = {"/proc/sys", "/sys"};  /* /proc/sysrq-trigger stays: it only ends this VM */
    for (size_t i = 0; !failed && i < sizeof knobs / sizeof *knobs; i++)
        if (bind_read_only_tree(knobs[i]) != 0) { failed = errno; what = knobs[i]; }
    /* W: the root read-only, and so every directory pinned above a grading path (its own mount) but those in
       a writable directory; then each writable directory bound over itself read-write (its mounts within,
       protected paths among them, keep their flags) */
    int read_only_root = 0;
    for (int i = 0; i < n; i++) read_only_root |= strs[i][0] == 'W';
    for (int p = 0; !failed && read_only_root && p < npinned; p++) {
        int writable = 0;
        for (int i = 0; i < n && !writable; i++) {
            size_t wl = strlen(strs[i] + 1);
            writable = strs[i][0] == 'W' && !strncmp(pinned[p], strs[i] + 1, wl) &&
                       (pinned[p][wl] == 0 || pinned[p][wl] == '/');
        }
        if (!writable && mount(NULL, pinned[p], NULL, MS_REMOUNT | MS_BIND | MS_RDONLY, NULL) != 0) {
            failed = errno; what = pinned[p];
        }
    }
    if (!failed && read_only_root && mount(NULL, "/", NULL, MS_REMOUNT | MS_BIND | MS_RDONLY, NULL) != 0) {
        failed = errno; what = "read-only root";
    }
    for (int i = 0; !failed && i < n; i++) {
        struct stat st;
        if (strs[i][0] != 'W' || lstat(strs[i] + 1, &st) != 0 || !S_ISDIR(st.st_mode)) continue;
        if (mount(strs[i] + 1, strs[i] + 1, NULL, MS_BIND | MS_REC, NULL) != 0 ||
            mount(NULL, strs[i] + 1, NULL, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV, NULL) != 0) {
            failed = errno; what = strs[i] + 1;
        }
    }
    for (int i = 0; !failed && i < n; i++)
        if (strs[i][0] == 'T' && mount("tmpfs", strs[i] + 1, "tmpfs", MS_NOSUID | MS_NODEV,
                                       "size=16m,mode=0755") != 0) { failed = errno; what = strs[i] + 1; }
    for (int i = 0; !failed && i < n; i++)
        if (strs[i][0] == 'H' && mount("tmpfs", strs[i] + 1, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                                       "size=4k,nr_inodes=16,mode=0755") != 0) { failed = errno; what = strs[i] + 1; }
    for (int i = 0; !failed && i < n; i++) {
        struct stat st;
        if (strs[i][0] == 'C' && lstat(strs[i] + 1, &st) == 0 && S_ISDIR(st.st_mode) &&
            mount("tmpfs", strs[i] + 1, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                  "size=4k,nr_inodes=16,mode=0755") != 0) { failed = errno; what = strs[i] + 1; }
        if (strs[i][0] == 'B' && cover_block_devices(strs[i] + 1) != 0) { failed = errno; what = strs[i] + 1; }
    }
    sandbox_ns = failed ? -1 : open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
    if (!failed && sandbox_ns < 0) { failed = errno; what = "namespace fd"; }
    if (setns(root_ns, CLONE_NEWNS) != 0 || chdir("/") != 0) {
        /* the agent is stranded in a half-made namespace: nothing it serves could be trusted */
        dprintf(2, "dsec-agent: cannot return to its mount namespace: %s\n", strerror(errno));
        reboot(RB_POWER_OFF);
    }
    close(root_ns);
    if (failed) {
        snprintf(msg, sizeof msg, "setting up the commands' mount namespace (%s): %s", what, strerror(failed));
        send_text_error(id, EIO, msg); return;
    }
    if (start_pid_namespace() != 0) {
        snprintf(msg, sizeof msg, "starting the commands' pid namespace (%s): %s", pidns_step, strerror(errno));
        send_text_error(id, EIO, msg); return;
    }
    fd = open("/proc/sys/user/max_user_namespaces", O_WRONLY | O_CLOEXEC);
    if (fd >= 0) { if (write(fd, "0\n", 2) != 2) { /* an older kernel: unshare-user stays seccomp-free */ } close(fd); }
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    for (int i = 0; i < n; i++)
        if (strs[i][0] == 'H') hidden[nhidden++] = strdup(strs[i] + 1);
    confined = 1;
    send_hidden(id);
}

/* REVEAL (no payload): uncover every hidden path in the sandbox's namespace and leave it read-only in both. */
static void do_reveal(uint32_t id) {
    char msg[PATH_MAX + 64];
    if (!confined) { send_error(id, EINVAL, "reveal before confine"); return; }
    int root_ns = open("/proc/self/ns/mnt", O_RDONLY | O_CLOEXEC);
    if (root_ns < 0 || setns(sandbox_ns, CLONE_NEWNS) != 0) { send_error(id, errno, "enter the sandbox's namespace"); return; }
    int failed = 0, at = 0;
    for (; at < nhidden && !failed; at++)
        if (umount2(hidden[at], 0) != 0 || bind_read_only(hidden[at]) != 0) failed = errno;
    if (setns(root_ns, CLONE_NEWNS) != 0 || chdir("/") != 0) {
        dprintf(2, "dsec-agent: cannot return to its mount namespace: %s\n", strerror(errno));
        reboot(RB_POWER_OFF);
    }
    close(root_ns);
    for (int i = 0; i < nhidden && !failed; i++)
        if (bind_read_only(hidden[i]) != 0) failed = errno;
    if (failed) {
        snprintf(msg, sizeof msg, "revealing %s: %s", hidden[at - 1], strerror(failed));
        send_text_error(id, EIO, msg);
        return;
    }
    for (int i = 0; i < nhidden; i++) free(hidden[i]);
    nhidden = 0;
    send_frame(T_END, id, NULL, 0);
}

/* How one command starts (EXEC, EXEC_PRISTINE and EXEC_SYSTEM fill it from their payload; EXEC_EXT, in
   agent_surface.c, from its own). */
struct exec_opts {
    uid_t uid;
    gid_t gid;
    int ngroups;
    gid_t groups[MAX_GROUPS];
    int pristine, system;
    int pty;            /* 1: stdin, stdout and stderr on a new terminal; 2: only stdin (raw mode), pipes for the rest */
    unsigned short cols, rows;
    int report_pid;     /* send STARTED with its pid in the commands' pid namespace */
};

/* EXEC payload: u16 argc | u16 envc | u32 uid | u32 gid | cwd\0 argv[0]\0 ... env[0]\0 ...
   (EXEC_PRISTINE: the same, run on the image's untouched root, see enter_pristine; EXEC_SYSTEM: the host's
   own upkeep (a vm's clock, its disk's growth), never confined, whatever CONFINE did) */
static void do_exec(uint32_t id, unsigned char *p, size_t len, int pristine, int system) {
    if (len < 12) { send_error(id, EINVAL, "malformed exec"); return; }
    struct exec_opts o = {.uid = get32(p + 4), .gid = get32(p + 8), .pristine = pristine, .system = system};
    int argc = (p[0] << 8) | p[1], envc = (p[2] << 8) | p[3];
    start_command(id, &o, argc, envc, (char *)p + 12, len - 12);
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

static void flush_stdin(struct chan *c) {
    while (c->in_fd >= 0 && c->inlen > 0) {
        ssize_t n = write(c->in_fd, c->inbuf, c->inlen);
        if (n < 0) {
            if (errno == EAGAIN || errno == EINTR) return;
            c->inlen = 0; close_fd(&c->in_fd); return;  /* EPIPE: the command stopped reading */
        }
        memmove(c->inbuf, c->inbuf + n, c->inlen - (size_t)n);
        c->inlen -= (size_t)n;
    }
    if (c->in_eof && c->inlen == 0) close_fd(&c->in_fd);
}

static void finish_write(struct chan *c) {
    if (c->werr) { send_error(c->id, c->werr, c->wpath); free_chan(c); return; }
    if (fchmod(c->wfd, c->wmode) != 0 || close(c->wfd) != 0) {
        c->wfd = -1; send_error(c->id, errno, c->wpath); free_chan(c); return;
    }
    c->wfd = -1;
    if (c->wtmp && rename(c->wtmp, c->wpath) != 0) { send_error(c->id, errno, c->wpath); free_chan(c); return; }
    free(c->wtmp); c->wtmp = NULL;
    send_frame(T_END, c->id, NULL, 0);
    free_chan(c);
}

static void do_stdin(uint32_t id, unsigned char *p, size_t len) {
    struct chan *c = find_chan(id);
    if (!c) return; /* the command already ended: its input is moot */
    if (connect_input(c, p, len)) return;
    if (c->kind == T_WRITE) {
        if (len == 0) { finish_write(c); return; }
        const unsigned char *q = p;
        size_t left = len;
        while (!c->werr && left > 0) {
            ssize_t n = write(c->wfd, q, left);
            if (n < 0) { if (errno != EINTR) c->werr = errno; continue; }
            q += n; left -= (size_t)n;
        }
        return;
    }
    if (len == 0 && c->in_fd >= 0 && c->tty >= 0) {  /* a terminal's end of input is Ctrl-D */
        (void)!write(c->in_fd, "\x04", 1); return;
    }
    if (len == 0) { c->in_eof = 1; flush_stdin(c); return; }
    if (c->in_fd < 0) return;
    if (c->inlen + len > STDIN_BUF_MAX) { send_error(id, ENOBUFS, "stdin"); return; }
    char *nb = realloc(c->inbuf, c->inlen + len);
    if (!nb) { send_error(id, ENOMEM, "stdin"); return; }
    c->inbuf = nb;
    memcpy(c->inbuf + c->inlen, p, len);
    c->inlen += len;
    flush_stdin(c);
}

static int path_arg(uint32_t id, unsigned char *p, size_t len, char **path) {
    if (len == 0 || p[len - 1] != 0 || memchr(p, 0, len) != p + len - 1 || p[0] != '/') {
        send_error(id, EINVAL, "malformed path");
        return -1;
    }
    *path = (char *)p;
    return 0;
}

/* READ payload: u32 max_bytes (high) | u32 max_bytes (low) | path\0 */
static void do_read(uint32_t id, unsigned char *p, size_t len) {
    char *path;
    if (len < 9 || path_arg(id, p + 8, len - 8, &path)) { if (len < 9) send_error(id, EINVAL, "read"); return; }
    uint64_t max = ((uint64_t)get32(p) << 32) | get32(p + 4);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) { send_error(id, errno, path); return; }
    struct stat st;
    if (fstat(fd, &st) != 0) { send_error(id, errno, path); close(fd); return; }
    if (S_ISDIR(st.st_mode)) { send_error(id, EISDIR, path); close(fd); return; }
    if (!S_ISREG(st.st_mode)) { send_error(id, EINVAL, path); close(fd); return; }
    if ((uint64_t)st.st_size > max) { send_error(id, EFBIG, path); close(fd); return; }
    static char buf[OUT_CHUNK];
    uint64_t total = 0;
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { send_error(id, errno, path); close(fd); return; }
        if (n == 0) break;
        total += (uint64_t)n;
        if (total > max) { send_error(id, EFBIG, path); close(fd); return; }
        send_frame(T_DATA, id, buf, (size_t)n);
    }
    close(fd);
    send_frame(T_END, id, NULL, 0);
}

/* WRITE payload: u32 mode (0xffffffff: 0644) | path\0; data follows as STDIN frames, an empty one ends it. */
static void do_write(uint32_t id, unsigned char *p, size_t len) {
    char *path;
    if (len < 6) { send_error(id, EINVAL, "write"); return; }
    if (path_arg(id, p + 4, len - 4, &path)) return;
    uint32_t mode = get32(p);
    struct chan *c = new_chan(id);
    if (!c) { send_error(id, EBUSY, "write channel"); return; }
    c->kind = T_WRITE;
    c->wmode = mode == 0xffffffffu ? 0644 : (mode_t)(mode & 07777);
    c->wpath = strdup(path);
    mkdirs(path);
    if (asprintf(&c->wtmp, "%s.dsec-tmp-%u", path, id) < 0) { c->wtmp = NULL; c->werr = ENOMEM; return; }
    struct stat st;
    if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode)) { c->werr = EISDIR; free(c->wtmp); c->wtmp = NULL; return; }
    c->wfd = open(c->wtmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (c->wfd < 0) { c->werr = errno; free(c->wtmp); c->wtmp = NULL; }
}

/* LIST reply: DATA frames of records u8 type | u32 mode | u64 size | u64 mtime_ns | u16 namelen | name */
static void do_list(uint32_t id, unsigned char *p, size_t len) {
    char *path;
    if (path_arg(id, p, len, &path)) return;
    int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) { send_error(id, errno, path); return; }
    DIR *d = fdopendir(dfd);
    if (!d) { send_error(id, errno, path); close(dfd); return; }
    static unsigned char buf[OUT_CHUNK];
    size_t used = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        struct stat st;
        if (fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
        size_t nl = strlen(e->d_name);
        if (used + 27 + nl > sizeof buf) { send_frame(T_DATA, id, buf, used); used = 0; }
        unsigned char *r = buf + used;
        r[0] = S_ISREG(st.st_mode) ? 'f' : S_ISDIR(st.st_mode) ? 'd' : S_ISLNK(st.st_mode) ? 'l' : 'o';
        put32(r + 1, (uint32_t)st.st_mode);
        uint64_t size = (uint64_t)st.st_size;
        uint64_t mt = (uint64_t)st.st_mtim.tv_sec * 1000000000ull + (uint64_t)st.st_mtim.tv_nsec;
        put32(r + 5, (uint32_t)(size >> 32)); put32(r + 9, (uint32_t)size);
        put32(r + 13, (uint32_t)(mt >> 32)); put32(r + 17, (uint32_t)mt);
        r[21] = (unsigned char)(nl >> 8); r[22] = (unsigned char)nl;
        memcpy(r + 23, e->d_name, nl);
        used += 23 + nl;
    }
    closedir(d);
    if (used) send_frame(T_DATA, id, buf, used);
    send_frame(T_END, id, NULL, 0);
}

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

#include "agent_surface.c"

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
    case T_PING: send_frame(T_END, id, NULL, 0); break;
    case T_MKDIR: {
        char *path;
        if (path_arg(id, p, len, &path)) break;
        mkdirs(path);
        struct stat st;
        if (mkdir(path, 0755) != 0 && (errno != EEXIST || stat(path, &st) != 0 || !S_ISDIR(st.st_mode)))
            send_error(id, errno == EEXIST ? ENOTDIR : errno, path);
        else
            send_frame(T_END, id, NULL, 0);
        break;
    }
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
    ssize_t n = read(*fd, buf, sizeof buf);
    if (n > 0) { send_frame(type, c->id, buf, (size_t)n); return 1; }
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
                close_fd(&chans[i].in_fd);
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
    send_frame(T_READY, 0, NULL, 0);
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
            if (c->exited && ((c->out_fd < 0 && c->err_fd < 0) || t - c->exit_ms >= DRAIN_MS)) {
                finish_exec(c);
                continue;
            }
            if (c->exited) {
                int left = (int)(DRAIN_MS - (t - c->exit_ms));
                if (timeout < 0 || left < timeout) timeout = left;
            }
            if (c->out_fd >= 0) { pfd[n] = (struct pollfd){c->out_fd, POLLIN, 0}; map[n].c = c; map[n].which = 1; n++; }
            if (c->err_fd >= 0) { pfd[n] = (struct pollfd){c->err_fd, POLLIN, 0}; map[n].c = c; map[n].which = 2; n++; }
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
        else if (pfd[0].revents & (POLLHUP | POLLERR)) usleep(20000); /* host not connected (yet) */
        reap();
    }
}
