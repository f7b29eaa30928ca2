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
 */
#define _GNU_SOURCE
/* Paths are checked to be short by the daemon; a truncated one could only fail to mount. */
#pragma GCC diagnostic ignored "-Wformat-truncation"
#include <errno.h>
#include <fcntl.h>
#include <linux/capability.h>
#include <linux/filter.h>
#include <linux/landlock.h>
#include <linux/securebits.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define CTL_FD 100
#define LAUNCH_FD 101 /* the zygote's end of the launcher's socket */
#define STATUS_FD 3
#define ZYGOTE_PROG_FD 4
#define MAX_CGROUP_FDS 4
/* The default path of every command and of the Python zygote (isolation/oci_runtime.py: DEFAULT_PATH). */
#define DEFAULT_PATH "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define MAX_MSG ((2 << 20) + (64 << 10)) /* exec_client.MAX_MESSAGE: a command at the kernel's exec limit */
#define MAX_GROUPS 256
#define MAX_CALLS 4096
#define MAX_FIELDS 65536
/* No CLONE_NEWNET: the calls share the sandbox's network namespace (loopback only, down), made once; creating
   and tearing one down was a third of each call's CPU. */
#ifndef CALL_NS
#define CALL_NS (CLONE_NEWPID | CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS)
#endif
#define CAP_LAST 63

static struct sock_fprog seccomp_prog; /* every call's filter (the container's DEFAULT_PROFILE) */
static struct sock_fprog zygote_prog;  /* the Python zygote's own, looser filter (its calls' inits mount) */
static int batched; /* the zygote switched itself from SCHED_OTHER to SCHED_BATCH; calls switch back */
static const char *tmpfs_bytes; /* TMPFS_BYTES: the size of each call's /tmp unless its request says another */
static const char *tmpfs_opts;  /* the mount options of the /tmp of the next clone */
static pid_t launcher;
static pid_t start_launcher(void); /* zygote_py.c */
static cpu_set_t *call_cpus; /* CPUS, or NULL: the commands keep the mask they inherit */
static size_t call_cpus_size;
static struct {
    pid_t pid;
    int status_fd;
} calls[MAX_CALLS];

/* -- start-up: errors go to the control socket, and the zygote exits --------------------------------- */

static void die(const char *what, int err) {
    char buf[600];
    int n = snprintf(buf, sizeof buf, "error %s: %s", what, strerror(err));
    if (n > 0)
        (void)!send(CTL_FD, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1, MSG_NOSIGNAL);
    _exit(1);
}

static void parse_cpus(const char *hex) {
    if (strcmp(hex, "-") == 0)
        return;
    size_t len = strlen(hex);
    call_cpus_size = CPU_ALLOC_SIZE(len * 4 + 1);
    if (len == 0 || (call_cpus = CPU_ALLOC(len * 4 + 1)) == NULL)
        die("cpu mask", len ? ENOMEM : EINVAL);
    CPU_ZERO_S(call_cpus_size, call_cpus);
    for (size_t i = 0; i < len; i++) {
        char c = hex[len - 1 - i];
        int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0)
            die("cpu mask", EINVAL);
        for (int bit = 0; bit < 4; bit++)
            if (v & (1 << bit))
                CPU_SET_S(i * 4 + bit, call_cpus_size, call_cpus);
    }
}

static void must_mount(const char *src, const char *dst, const char *type, unsigned long flags, const char *data) {
    if (mount(src, dst, type, flags, data) != 0) {
        char what[400];
        snprintf(what, sizeof what, "mount %s on %s", src ? src : type, dst);
        die(what, errno);
    }
}

static void bind_ro(const char *src, const char *dst, unsigned long extra) {
    must_mount(src, dst, NULL, MS_BIND, NULL);
    must_mount(NULL, dst, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | extra, NULL);
}

static void build_dev(const char *newroot) {
    static const char *nodes[] = {"null", "zero", "full", "random", "urandom", "tty"};
    char dev[4096], path[4096];
    snprintf(dev, sizeof dev, "%s/dev", newroot);
    must_mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k");
    for (size_t i = 0; i < sizeof nodes / sizeof *nodes; i++) {
        snprintf(path, sizeof path, "%s/%s", dev, nodes[i]);
        int fd = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0666);
        if (fd < 0)
            die("create /dev node", errno);
        close(fd);
        char src[64];
        snprintf(src, sizeof src, "/dev/%s", nodes[i]);
        must_mount(src, path, NULL, MS_BIND, NULL);
    }
    static const char *links[][2] = {
        {"/proc/self/fd", "fd"}, {"/proc/self/fd/0", "stdin"}, {"/proc/self/fd/1", "stdout"},
        {"/proc/self/fd/2", "stderr"}};
    for (size_t i = 0; i < sizeof links / sizeof *links; i++) {
        snprintf(path, sizeof path, "%s/%s", dev, links[i][1]);
        if (symlink(links[i][0], path) != 0)
            die("create /dev link", errno);
    }
    must_mount(NULL, dev, NULL, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k");
}

/* The Landlock ABI as of Linux 6.12, spelled out: build hosts may carry older kernel headers. */
struct ruleset_attr {
    __u64 handled_access_fs;
    __u64 handled_access_net;
    __u64 scoped;
};
#define ACCESS_FS_TRUNCATE (1ULL << 14)
#define ACCESS_NET_BIND_TCP (1ULL << 0)
#define ACCESS_NET_CONNECT_TCP (1ULL << 1)
#define SCOPE_ABSTRACT_UNIX_SOCKET (1ULL << 0)
#define SCOPE_SIGNAL (1ULL << 1)

static int landlock_abi(void) {
    return (int)syscall(SYS_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);
}

/* Writes anywhere but the workspace, /tmp and the device nodes are refused; reads and executes are
   left to the read-only mounts. TCP bind/connect are refused outright (ABI 4), and signals and
   abstract unix sockets cannot cross the call's domain (ABI 6). Landlock does not look at a mount
   point's rules for the filesystem mounted on it, so each call's fresh /tmp needs a rule of its own:
   the zygote prepares the ruleset's shape and the workspace and /dev handles once, each call builds
   its ruleset from them (a few microseconds). */
static struct ruleset_attr ruleset;
static size_t ruleset_size;
static __u64 write_access, dev_access;
static int workdir_fd = -1, dev_fd = -1;

static void prepare_landlock(const char *workdir) {
    int abi = landlock_abi();
    if (abi < 1)
        die("landlock", abi < 0 ? errno : EOPNOTSUPP);
    write_access = LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_REMOVE_DIR | LANDLOCK_ACCESS_FS_REMOVE_FILE |
                   LANDLOCK_ACCESS_FS_MAKE_CHAR | LANDLOCK_ACCESS_FS_MAKE_DIR | LANDLOCK_ACCESS_FS_MAKE_REG |
                   LANDLOCK_ACCESS_FS_MAKE_SOCK | LANDLOCK_ACCESS_FS_MAKE_FIFO | LANDLOCK_ACCESS_FS_MAKE_BLOCK |
                   LANDLOCK_ACCESS_FS_MAKE_SYM;
    if (abi >= 2)
        write_access |= LANDLOCK_ACCESS_FS_REFER;
    if (abi >= 3)
        write_access |= ACCESS_FS_TRUNCATE;
    dev_access = LANDLOCK_ACCESS_FS_WRITE_FILE | (abi >= 3 ? ACCESS_FS_TRUNCATE : 0);
    ruleset.handled_access_fs = write_access;
    ruleset_size = offsetof(struct ruleset_attr, handled_access_net);
    if (abi >= 4) {
        ruleset.handled_access_net = ACCESS_NET_BIND_TCP | ACCESS_NET_CONNECT_TCP;
        ruleset_size = offsetof(struct ruleset_attr, scoped);
    }
    if (abi >= 6) {
        ruleset.scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL;
        ruleset_size = sizeof ruleset;
    }
    workdir_fd = open(workdir, O_PATH | O_CLOEXEC);
    dev_fd = open("/dev", O_PATH | O_CLOEXEC);
    if (workdir_fd < 0 || dev_fd < 0)
        die("open workspace and /dev", errno);
    /* Fail at start, not at the first call, if the kernel refuses this ruleset. */
    int probe = (int)syscall(SYS_landlock_create_ruleset, &ruleset, ruleset_size, 0);
    if (probe < 0)
        die("landlock ruleset", errno);
    close(probe);
}

static int add_rule(int fd, int parent, __u64 access) {
    struct landlock_path_beneath_attr rule = {.allowed_access = access, .parent_fd = parent};
    return (int)syscall(SYS_landlock_add_rule, fd, LANDLOCK_RULE_PATH_BENEATH, &rule, 0);
}

static void read_program(int fd, struct sock_fprog *prog) {
    struct stat st;
    if (fstat(fd, &st) != 0)
        return; /* no program passed */
    if (st.st_size <= 0 || st.st_size % sizeof(struct sock_filter) || st.st_size > (1 << 20))
        die("seccomp program size", EINVAL);
    struct sock_filter *filter = malloc((size_t)st.st_size);
    if (!filter || pread(fd, filter, (size_t)st.st_size, 0) != st.st_size)
        die("read seccomp program", errno);
    close(fd);
    prog->len = (unsigned short)(st.st_size / sizeof(struct sock_filter));
    prog->filter = filter;
}

static void setup(char **argv) {
    const char *newroot = argv[1], *lowerdirs = argv[2], *workspace = argv[3], *workdir = argv[4],
               *support = argv[5];
    char path[4096], opts[8192];
    if (unshare(CLONE_NEWNS) != 0)
        die("new mount namespace", errno);
    must_mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL);
    /* Two or more lower layers and no upper: overlayfs mounts read-only. */
    snprintf(opts, sizeof opts, "lowerdir=%s", lowerdirs);
    must_mount("overlay", newroot, "overlay", MS_RDONLY | MS_NOSUID | MS_NODEV, opts);
    snprintf(path, sizeof path, "%s%s", newroot, workdir);
    must_mount(workspace, path, NULL, MS_BIND, NULL);
    must_mount(NULL, path, NULL, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV, NULL);
    snprintf(path, sizeof path, "%s/.dsec", newroot);
    bind_ro(support, path, MS_NODEV);
    build_dev(newroot);
    /* A proc instance must be visible for the calls (in their user namespace) to mount their own. */
    snprintf(path, sizeof path, "%s/proc", newroot);
    must_mount("proc", path, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
    if (chdir(newroot) != 0)
        die("enter new root", errno);
    if (syscall(SYS_pivot_root, ".", ".") != 0)
        die("pivot_root", errno);
    if (umount2(".", MNT_DETACH) != 0)
        die("detach old root", errno);
    if (chdir("/") != 0)
        die("chdir /", errno);
    prepare_landlock(workdir);
    read_program(STATUS_FD, &seccomp_prog);
    read_program(ZYGOTE_PROG_FD, &zygote_prog);
}

/* -- one call: runs in the clone, pid 1 of the call's namespaces ----------------------------------- */

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

/* Once, in the zygote (which never executes anything): every call inherits an empty bounding set, no
   ambient capabilities and locked securebits, so uid 0 of the user namespace cannot regain capabilities
   by exec. The zygote keeps its effective set, which the clones need to create their namespaces and
   mount; each call empties it below. */
static void drop_bounding_set(void) {
    for (int cap = 0; cap <= CAP_LAST; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL)
            die("drop bounding capability", errno);
    if (prctl(PR_SET_SECUREBITS, SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP |
                                     SECBIT_NO_SETUID_FIXUP_LOCKED | SECBIT_KEEP_CAPS_LOCKED, 0, 0, 0) != 0)
        die("set securebits", errno);
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0)
        die("clear ambient capabilities", errno);
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
    int fd = (int)syscall(SYS_landlock_create_ruleset, &ruleset, ruleset_size, 0);
    int tmp = open("/tmp", O_PATH | O_CLOEXEC);
    if (fd < 0 || tmp < 0 || add_rule(fd, workdir_fd, write_access) != 0 || add_rule(fd, tmp, write_access) != 0 ||
        add_rule(fd, dev_fd, dev_access) != 0 || syscall(SYS_landlock_restrict_self, fd, 0) != 0)
        return prep_fail("landlock");
    close(fd);
    close(tmp);
    close(workdir_fd);
    close(dev_fd);
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
    /* The OOM killer's first choice, like container commands (the zygote is shielded where the host
       allows it). Best effort: some hosts refuse it inside the user namespace; the largest process (a
       memory bomb) is the OOM killer's choice anyway. Landlock keeps the command from writing it. */
    int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (oom >= 0) {
        (void)!write(oom, "500", 3);
        close(oom);
    }
    (void)!sethostname("sandbox", 7);
    umask(022);
    struct rlimit no_core = {0, 0};
    if (setrlimit(RLIMIT_CORE, &no_core) != 0)
        return prep_fail("set rlimits");
    /* The zygote's SCHED_BATCH (see main) ends here: the command is scheduled like any other process. */
    struct sched_param normal = {0};
    if (batched && sched_setscheduler(0, SCHED_OTHER, &normal) != 0)
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

/* Take the fds out of a received message: four (stdin, stdout, stderr, status), then up to ``max`` - 4 more
   (the clone's: a fifth when the request itself came in a memfd, see dispatch; the zygote's: the cgroup.procs
   files of the call's own cgroup). Returns how many, -1 unless 4 to ``max`` came whole. */
static int take_fds(struct msghdr *mh, int *fds, int max) {
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
static void run_call(int sock) {
    /* The zygote blocked SIGCHLD for its signalfd and ignores SIGPIPE: the call gets a clean state. */
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    for (int sig = 1; sig < NSIG; sig++)
        signal(sig, SIG_DFL);
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
    int with_user = nfields == tail + 3;
    if (with_user && (atoi(fields[tail + 2]) & 1) && ioctl(0, TIOCSCTTY, 0) != 0)
        call_fail("make the terminal the controlling terminal", errno, 127);
    char **argv = calloc((size_t)argc + 1, sizeof *argv), **envp = calloc((size_t)envc + 1, sizeof *envp);
    if (!argv || !envp)
        call_fail("request", ENOMEM, 127);
    memcpy(argv, cargv, (size_t)argc * sizeof *argv);
    memcpy(envp, cenv, (size_t)envc * sizeof *envp);
    become_user(with_user ? fields[tail] : NULL, with_user ? fields[tail + 1] : NULL);
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

/* -- the zygote's loop ----------------------------------------------------------------------------- */

static int report(int fd, const char *fmt, long value) {
    char buf[64];
    int n = snprintf(buf, sizeof buf, fmt, value);
    return write(fd, buf, (size_t)n) == n ? 0 : -1;
}

/* One call cloned ahead of its request: its namespaces, mounts and restrictions are ready when the
   request comes, which takes them off the request's path. */
static struct {
    pid_t pid;
    int sock;
    int err;
} ready = {0, -1, 0};
static char default_opts[128];

/* Clone one call, whose /tmp is mounted with ``opts``; 0, or the errno of what failed. */
static int clone_call(const char *opts, pid_t *pid_out, int *sock_out) {
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) != 0)
        return errno;
    tmpfs_opts = opts; /* read by the clone, which has its own copy of our memory */
    pid_t pid = (pid_t)syscall(SYS_clone, CALL_NS | SIGCHLD, 0, 0, 0, 0);
    if (pid == 0) {
        close(sp[0]);
        run_call(sp[1]);
    }
    int err = errno;
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
    ready.err = clone_call(default_opts, &ready.pid, &ready.sock);
}

/* The sandbox's mounts changed (protected or hidden paths, a reveal): the call cloned ahead holds a copy of
   the old mount table, so it is replaced by one cloned now. Calls already running keep what they had. */
static void refresh(void) {
    if (ready.pid > 0) {
        kill(ready.pid, SIGKILL); /* reaped later as an unknown child */
        close(ready.sock);
    }
    ready.pid = 0;
    ready.sock = -1;
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
        if (calls[i].pid == 0)
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
        if (ready.pid == 0)
            clone_ahead();
        err = ready.err;
        pid = ready.pid;
        sock = ready.sock;
        ready.pid = 0;
        ready.sock = -1;
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
        calls[slot].pid = pid;
        calls[slot].status_fd = fds[3];
        if (report(fds[3], "pid %ld\n", pid) != 0)
            kill(pid, SIGKILL); /* the daemon hung up before it learnt the pid: nobody else could kill it */
        for (int i = 0; i < 3; i++)
            close(fds[i]);
        if (ready.pid == 0)
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
        if (pid == ready.pid) { /* died before its request: the next request clones again */
            close(ready.sock);
            ready.pid = 0;
            ready.sock = -1;
            continue;
        }
        if (pid == launcher) {
            launcher = 0; /* Python zygotes cannot be started any more: the daemon is told at its next try */
            continue;
        }
        for (int i = 0; i < MAX_CALLS; i++) {
            if (calls[i].pid != pid)
                continue;
            /* A call that ended normally reported its command's status itself. */
            if (!(WIFEXITED(st) && WEXITSTATUS(st) == 0))
                report(calls[i].status_fd, "exit %ld\n", st);
            close(calls[i].status_fd);
            calls[i].pid = 0;
            break;
        }
    }
}

/* "python\0ARGV..." with one fd, the Python zygote's control socket: for the launcher. */
static void forward_python(char *request, ssize_t len, struct msghdr *in) {
    int fd = -1;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(in); c; c = CMSG_NXTHDR(in, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(sizeof(int)))
            memcpy(&fd, CMSG_DATA(c), sizeof fd);
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
    batched = sched_getscheduler(0) == SCHED_OTHER && sched_setscheduler(0, SCHED_BATCH, &batch) == 0;
    /* A daemon that stopped listening to a call must not take the zygote down with SIGPIPE. */
    signal(SIGPIPE, SIG_IGN);
    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd < 0)
        return 1;
    static char request[MAX_MSG + 1];
    char cbuf[CMSG_SPACE((4 + MAX_CGROUP_FDS) * sizeof(int))];
    clone_ahead();
    for (;;) {
        struct pollfd pfd[2] = {{CTL_FD, POLLIN, 0}, {sfd, POLLIN, 0}};
        if (poll(pfd, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            break;
        }
        if (pfd[1].revents) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) > 0) {
            }
            reap();
        }
        if (!pfd[0].revents)
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
    if (ready.pid > 0)
        kill(ready.pid, SIGKILL);
    for (int i = 0; i < MAX_CALLS; i++)
        if (calls[i].pid > 0)
            kill(calls[i].pid, SIGKILL);
    /* Reap them before exiting: orphans go to the daemon (a child subreaper), which would keep them as
       zombies. Each is its namespace's init, so it is reaped once everything in its namespace is gone. */
    for (;;) {
        pid_t pid = waitpid(-1, NULL, 0);
        if (pid < 0 && errno != EINTR)
            break;
    }
    return 0;
}

/* The launcher of Python zygotes: one translation unit with the zygote (a file of its own to read). */
#include "zygote_py.c"
