/*
 * dsec-nsenter: the last step of an exec into a container sandbox, what runc's nsexec does.
 *
 * The exec helper (nsexec.c) starts this static binary in the sandbox's pid namespace
 * with:
 *   fd 0, 1, 2  the command's stdin, stdout, stderr
 *   fd 3        the status pipe (close-on-exec: it closes when the command starts)
 *   fd 4        a pidfd of the sandbox's init
 *   fd 5        the seccomp program (raw struct sock_filter array), or -1 / absent for none
 *   argv        dsec-nsenter UID GID[,GROUP...] CAPMASK NOFILE FLAGS CPUS CWD CGROUP_PROCS... -- COMMAND ARGS...
 *               GROUP: the user's supplementary groups
 *               FLAGS: bit 0 Landlock (confine_writes), bit 1 pristine (enter_pristine), bit 2 fd 0 is a
 *               terminal to make the command's controlling terminal (the helper made us a session leader), bit 3
 *               setuid: no no_new_privs, so setuid and file-capability binaries (sudo) raise privileges, up
 *               to the sandbox's root (SandboxSpec.allow_privilege_escalation)
 *               CPUS: "-", or the hexadecimal mask of the CPUs the command gets (isolation/affinity.py: the
 *               daemon and its helper are pinned to housekeeping CPUs, the command has the node's back)
 *   envp        the command's environment
 * It moves itself into the sandbox's cgroups, joins the sandbox's user, mount, network,
 * ipc, uts and cgroup namespaces, cuts its bounding set to CAPMASK,
 * confines writes with Landlock (confine_writes) and loads the seccomp program while it still holds
 * CAP_SYS_ADMIN in the sandbox's user namespace (the kernel's condition for both without no_new_privs),
 * becomes UID/GID, sets its capabilities to CAPMASK, no_new_privs (unless FLAGS says setuid), RLIMIT_NOFILE
 * and its CPUs, and execs the command; a pristine command first gets a
 * mount namespace of its own rooted at the image's read-only root (enter_pristine). On any failure it writes "error <what>: <why>" to fd 3 and exits
 * 127 (126 when the command exists but cannot be executed). It holds no secret and talks to
 * nobody: it is a few system calls between two execs.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/landlock.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define STATUS_FD 3
#define PIDFD 4
#define SECCOMP_FD 5
#define NS_FLAGS (CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWCGROUP)
#define CAP_LAST 63
#define FLAG_LANDLOCK 1
#define FLAG_PRISTINE 2
#define FLAG_TTY 4
#define FLAG_SETUID 8
#define MAX_GROUPS 256
#define PRISTINE_ROOT "/.dsec-pristine" /* the image's root, bind-mounted read-only by the backend */
#define ACCESS_FS_TRUNCATE (1ULL << 14) /* Landlock ABI 3; newer than some build hosts' headers */

static void fail(const char *what, int err, int code) {
    char buf[512];
    int n = snprintf(buf, sizeof buf, "error %s: %s\n", what, strerror(err));
    if (n > 0)
        (void)!write(STATUS_FD, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1);
    _exit(code);
}

static unsigned long long parse_u64(const char *s, int base, const char *what) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, base);
    if (errno || *end || end == s)
        fail(what, EINVAL, 127);
    return v;
}

/* CPUS (see the header): the command leaves the housekeeping CPUs it was spawned on. It stays on the
   current one until the scheduler balances it, so a short command starts and ends next to its parent. */
static void set_cpus(const char *hex) {
    if (strcmp(hex, "-") == 0)
        return;
    size_t len = strlen(hex), size = CPU_ALLOC_SIZE(len * 4 + 1);
    cpu_set_t *set = CPU_ALLOC(len * 4 + 1);
    if (set == NULL || len == 0)
        fail("cpu mask", set ? EINVAL : ENOMEM, 127);
    CPU_ZERO_S(size, set);
    for (size_t i = 0; i < len; i++) {
        char c = hex[len - 1 - i];
        int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (v < 0)
            fail("cpu mask", EINVAL, 127);
        for (int bit = 0; bit < 4; bit++)
            if (v & (1 << bit))
                CPU_SET_S(i * 4 + bit, size, set);
    }
    if (sched_setaffinity(0, size, set) != 0)
        fail("set the sandbox's CPUs", errno, 127);
    CPU_FREE(set);
}

static void join_cgroups(char **paths, int n) {
    for (int i = 0; i < n; i++) {
        int fd = open(paths[i], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "0", 1) != 1)
            fail(paths[i], errno, 127);
        close(fd);
    }
}

static void load_seccomp(void) {
    struct stat st;
    if (fstat(SECCOMP_FD, &st) != 0)
        return; /* no program passed */
    if (st.st_size <= 0 || st.st_size % sizeof(struct sock_filter) || st.st_size > (1 << 20))
        fail("seccomp program size", EINVAL, 127);
    struct sock_filter *filter = malloc((size_t)st.st_size);
    if (!filter)
        fail("seccomp program", ENOMEM, 127);
    if (pread(SECCOMP_FD, filter, (size_t)st.st_size, 0) != st.st_size)
        fail("read seccomp program", errno, 127);
    close(SECCOMP_FD);
    struct sock_fprog prog = {.len = (unsigned short)(st.st_size / sizeof(struct sock_filter)), .filter = filter};
    if (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog, 0, 0) != 0)
        fail("load seccomp program", errno, 127);
}

/* One rule, on the sandbox's root: writing, truncating, creating, removing, renaming and linking are
   allowed everywhere beneath it, device nodes never. The kernel interfaces a command must not write are
   closed by the mounts instead (the runtime config of a Landlock sandbox makes /proc and /dev read-only,
   /sys is read-only, the host's knobs are masked; /dev/shm, /dev/mqueue and /dev/pts are their own
   writable mounts), so what a command creates anywhere -- `mkdir /app && echo x > /app/f` -- it may write
   in the same command, and the ruleset costs five system calls rather than a walk of the root. What
   Landlock adds beyond the mounts: no device nodes even with CAP_MKNOD, and its ptrace scoping -- a command
   cannot ptrace or open /proc/1/{mem,ns,...} of the (unconfined) init, nor another command's (a sibling
   domain). Reads and executes are not handled: the mounts decide them. Without Landlock in the kernel
   this is a no-op (`dsec doctor` reports it). */
static void confine_writes(void) {
    int abi = (int)syscall(SYS_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);
    if (abi < 1)
        return;
    __u64 allowed = LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_REMOVE_DIR | LANDLOCK_ACCESS_FS_REMOVE_FILE |
                    LANDLOCK_ACCESS_FS_MAKE_DIR | LANDLOCK_ACCESS_FS_MAKE_REG | LANDLOCK_ACCESS_FS_MAKE_SOCK |
                    LANDLOCK_ACCESS_FS_MAKE_FIFO | LANDLOCK_ACCESS_FS_MAKE_SYM |
                    (abi >= 2 ? LANDLOCK_ACCESS_FS_REFER : 0) | (abi >= 3 ? ACCESS_FS_TRUNCATE : 0);
    struct landlock_ruleset_attr attr = {
        .handled_access_fs = allowed | LANDLOCK_ACCESS_FS_MAKE_CHAR | LANDLOCK_ACCESS_FS_MAKE_BLOCK};
    int ruleset = (int)syscall(SYS_landlock_create_ruleset, &attr, sizeof attr.handled_access_fs, 0);
    if (ruleset < 0)
        fail("landlock ruleset", errno, 127);
    int root = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (root < 0)
        fail("landlock: open /", errno, 127);
    struct landlock_path_beneath_attr rule = {.allowed_access = allowed, .parent_fd = root};
    if (syscall(SYS_landlock_add_rule, ruleset, LANDLOCK_RULE_PATH_BENEATH, &rule, 0) != 0)
        fail("landlock rule", errno, 127);
    close(root);
    if (syscall(SYS_landlock_restrict_self, ruleset, 0) != 0)
        fail("landlock restrict", errno, 127);
    close(ruleset);
}

#define PRISTINE_TOP "/tmp"                /* over-mounted in the command's own mount namespace only */
#define PRISTINE_MNT PRISTINE_TOP "/root"

static void bind_into(const char *dir) {
    char target[4096], what[4200];
    snprintf(target, sizeof target, "%s%s", PRISTINE_MNT, dir);
    /* Recursive: /proc and /sys carry the masked and read-only submounts, which must come along. */
    if (mount(dir, target, NULL, MS_BIND | MS_REC, NULL) != 0) {
        snprintf(what, sizeof what, "pristine: mount %s", dir);
        fail(what, errno, 127);
    }
}

static void mkdirs(char *path) {
    for (char *p = path + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(path, 0755) != 0 && errno != EEXIST)
            fail("pristine: create the working directory", errno, 127);
        *p = '/';
    }
    if (mkdir(path, 0755) != 0 && errno != EEXIST)
        fail("pristine: create the working directory", errno, 127);
}

/* A grader's command on the image's untouched root: in a private mount namespace (it dies with the
   command), an overlay whose lower layer is the image's read-only root and whose upper layer is a fresh
   tmpfs gets the sandbox's /proc, /dev, /sys, a fresh /tmp and the working directory, then becomes the
   root. Whatever the agent replaced in its own root (/bin/bash, python3, libraries, /etc) is not there;
   the workspace it produced is; what the grader writes outside the workspace is thrown away. */
static void enter_pristine(const char *cwd) {
    if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0)
        fail("pristine: private mount namespace", errno, 127);
    if (mount("tmpfs", PRISTINE_TOP, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0700,size=65536k") != 0)
        fail("pristine: scratch tmpfs on /tmp (the sandbox needs a /tmp directory)", errno, 127);
    if (mkdir(PRISTINE_TOP "/u", 0755) != 0 || mkdir(PRISTINE_TOP "/w", 0755) != 0 || mkdir(PRISTINE_MNT, 0755) != 0)
        fail("pristine: scratch directories", errno, 127);
    if (mount("overlay", PRISTINE_MNT, "overlay", MS_NOSUID | MS_NODEV,
              "lowerdir=" PRISTINE_ROOT ",upperdir=" PRISTINE_TOP "/u,workdir=" PRISTINE_TOP "/w,userxattr") != 0)
        fail("pristine: overlay over the image's root", errno, 127);
    bind_into("/proc");
    bind_into("/dev");
    bind_into("/sys");
    if (mount("tmpfs", PRISTINE_MNT "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777,size=65536k") != 0)
        fail("pristine: mount /tmp", errno, 127);
    if (strcmp(cwd, "/") != 0) {
        char target[4096];
        struct stat st;
        if (stat(cwd, &st) != 0 || !S_ISDIR(st.st_mode)) {
            snprintf(target, sizeof target, "working directory '%s'", cwd);
            fail(target, errno ? errno : ENOTDIR, 127);
        }
        if (snprintf(target, sizeof target, "%s%s", PRISTINE_MNT, cwd) >= (int)sizeof target)
            fail("pristine: working directory", ENAMETOOLONG, 127);
        mkdirs(target);
        bind_into(cwd);
    }
    if (chroot(PRISTINE_MNT) != 0 || chdir("/") != 0)
        fail("pristine: enter the image's root", errno, 127);
}

/* "GID[,GROUP...]": the primary group and the supplementary ones. */
static gid_t parse_groups(char *text, gid_t *groups, size_t *ngroups) {
    char *rest = strchr(text, ',');
    if (rest)
        *rest++ = '\0';
    gid_t gid = (gid_t)parse_u64(text, 10, "gid");
    *ngroups = 0;
    while (rest && *rest) {
        char *next = strchr(rest, ',');
        if (next)
            *next++ = '\0';
        if (*ngroups == MAX_GROUPS)
            fail("supplementary groups", E2BIG, 127);
        groups[(*ngroups)++] = (gid_t)parse_u64(rest, 10, "supplementary group");
        rest = next;
    }
    return gid;
}

int main(int argc, char **argv, char **envp) {
    if (argc < 10)
        fail("usage", EINVAL, 127);
    uid_t uid = (uid_t)parse_u64(argv[1], 10, "uid");
    gid_t groups[MAX_GROUPS];
    size_t ngroups;
    gid_t gid = parse_groups(argv[2], groups, &ngroups);
    unsigned long long caps = parse_u64(argv[3], 16, "capability mask");
    rlim_t nofile = (rlim_t)parse_u64(argv[4], 10, "nofile");
    int flags = (int)parse_u64(argv[5], 10, "flags");
    const char *cpus = argv[6], *cwd = argv[7];
    int sep = 8;
    while (sep < argc && strcmp(argv[sep], "--") != 0)
        sep++;
    if (sep + 1 >= argc)
        fail("no command", EINVAL, 127);
    argv[sep] = NULL;

    /* Not dumpable: until the final execve nothing in the sandbox may open our /proc/PID/mem (we hold
       capabilities there and have no seccomp filter yet). execve resets this for the command. */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0)
        fail("set non-dumpable", errno, 127);
    /* A terminal of the sandbox's own devpts on fd 0 (the daemon opened it there): the command's controlling
       terminal, so a shell gets job control and Ctrl-C reaches its foreground job. */
    if ((flags & FLAG_TTY) && ioctl(0, TIOCSCTTY, 0) != 0)
        fail("make the terminal the controlling terminal", errno, 127);
    /* Commands are the host OOM killer's first choice, like the sandbox's init (oomScoreAdj 500). */
    int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (oom < 0 || write(oom, "500", 3) != 3)
        fail("set oom_score_adj", errno, 127);
    close(oom);
    join_cgroups(&argv[8], sep - 8);
    if (setns(PIDFD, NS_FLAGS) != 0)
        fail("join sandbox namespaces", errno, 127);
    close(PIDFD);
    if (flags & FLAG_PRISTINE) {
        /* As the namespace's root (still every capability in it): host uid 0 has no mapping there, and
           files it created would be refused (EOVERFLOW). */
        if (setgroups(0, NULL) != 0 || setresgid(0, 0, 0) != 0 || setresuid(0, 0, 0) != 0)
            fail("pristine: become the namespace's root", errno, 127);
        enter_pristine(cwd);
    }
    /* Joining the user namespace reset the bounding set to full: cut it to the sandbox's set. This needs
       CAP_SETPCAP, so it happens before becoming the image's user (which may not be root). */
    for (int cap = 0; cap <= CAP_LAST; cap++)
        if (!(caps & (1ULL << cap)) && prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL)
            fail("drop bounding capability", errno, 127);
    /* Landlock and seccomp before giving up the namespace's CAP_SYS_ADMIN: with it the kernel installs both
       without no_new_privs, so they hold for a setuid command too (the filter allows every system call this
       helper makes from here on). Both survive execve, setuid or not; the bounding set caps what a setuid
       binary gains at CAPMASK, what user="root" gets anyway. */
    if (flags & FLAG_LANDLOCK)
        confine_writes();
    load_seccomp();
    if (setgroups(ngroups, groups) != 0 || setresgid(gid, gid, gid) != 0 || setresuid(uid, uid, uid) != 0)
        fail("become the sandbox user", errno, 127);
    /* A non-root user lost every capability in setresuid; it gets none back (as under docker). */
    if (uid != 0)
        caps = 0;
    umask(022);
    if (chdir(cwd) != 0) {
        char what[300];
        snprintf(what, sizeof what, "working directory '%s'", cwd);
        fail(what, errno, 127);
    }
    struct rlimit nofile_limit = {nofile, nofile}, no_core = {0, 0};
    if (setrlimit(RLIMIT_NOFILE, &nofile_limit) != 0 || setrlimit(RLIMIT_CORE, &no_core) != 0)
        fail("set rlimits", errno, 127);
    set_cpus(cpus);
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0)
        fail("clear ambient capabilities", errno, 127);
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2] = {
        {(__u32)caps, (__u32)caps, 0},
        {(__u32)(caps >> 32), (__u32)(caps >> 32), 0},
    };
    if (syscall(SYS_capset, &header, data) != 0)
        fail("set capabilities", errno, 127);
    if (!(flags & FLAG_SETUID) && prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        fail("set no_new_privs", errno, 127);
    /* Default dispositions for the command (ignored signals would survive execve). */
    for (int sig = 1; sig < NSIG; sig++)
        signal(sig, SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    if (fcntl(STATUS_FD, F_SETFD, FD_CLOEXEC) != 0)
        fail("status pipe", errno, 127);
    /* Nothing but stdio and the (close-on-exec) status pipe may reach the command. */
    syscall(SYS_close_range, STATUS_FD + 1, ~0U, 0);
    execvpe(argv[sep + 1], &argv[sep + 1], envp);
    int err = errno;
    char what[300];
    snprintf(what, sizeof what, "cannot execute '%s'", argv[sep + 1]);
    fail(what, err, err == ENOENT || err == ENOTDIR ? 127 : 126);
}
