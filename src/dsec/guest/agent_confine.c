/* dsec-agent, confinement (CONFINE, REVEAL): the commands' mount and pid namespaces, protected and hidden paths,
 * and the capabilities no command keeps. */
#include "agent.h"

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
int confined;
int sandbox_ns = -1;            /* mount namespace of commands */
int sandbox_pidns = -1;         /* pid namespace of commands (see start_pid_namespace) */
int agent_pidns = -1;           /* the agent's own, for the forks that are not commands */
pid_t pidns_init = -1;          /* its init, a child of the agent */
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
void drop_privileges(void) {
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

static int pin(const char *dir) {
    for (int i = 0; i < npinned; i++)
        if (!strcmp(pinned[i], dir)) return 0;
    if (npinned == (int)(sizeof pinned / sizeof *pinned)) { errno = E2BIG; return -1; }
    if (mount(dir, dir, NULL, MS_BIND | MS_REC, NULL) != 0) return -1;
    pinned[npinned++] = strdup(dir);
    return 0;
}

static int pin_ancestors(const char *path) {
    return each_parent(path, pin);
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
void do_confine(uint32_t id, unsigned char *p, size_t len) {
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
void do_reveal(uint32_t id) {
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
