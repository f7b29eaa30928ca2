/* dsec-zygote, start-up: what is made once for every call of the sandbox (see zygote.c): its root in a private
 * mount namespace, the Landlock ruleset's shape, the seccomp programs, the CPUs of its commands, and the empty
 * bounding set the calls inherit. Failures end the zygote (die). */
#include "zygote.h"
#include <sys/sysmacros.h>

#define CAP_LAST 63

struct sock_fprog seccomp_prog;
struct sock_fprog zygote_prog;
cpu_set_t *call_cpus;
size_t call_cpus_size;

void parse_cpus(const char *hex) {
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

/* A device node of /dev: made in the tmpfs (we are host root, in the host's user namespace, so the nodes work
   for the calls), or where that is refused (a host withholding CAP_MKNOD) the host's node bound over a file.
   Nodes keep the call's mount namespace at one mount for /dev instead of seven, which every call copies at
   its clone and tears down at its exit. */
static void make_dev_node(const char *path, const char *name, unsigned major, unsigned minor) {
    if (mknod(path, S_IFCHR | 0666, makedev(major, minor)) == 0) {
        if (chmod(path, 0666) != 0) /* past the umask */
            die("create /dev node", errno);
        return;
    }
    if (errno != EPERM)
        die("create /dev node", errno);
    int fd = open(path, O_CREAT | O_WRONLY | O_CLOEXEC, 0666);
    if (fd < 0)
        die("create /dev node", errno);
    close(fd);
    char src[64];
    snprintf(src, sizeof src, "/dev/%s", name);
    must_mount(src, path, NULL, MS_BIND, NULL);
}

static void build_dev(const char *newroot) {
    /* The numbers are the kernel's fixed ones (Documentation/admin-guide/devices.txt). */
    static const struct {
        const char *name;
        unsigned major, minor;
    } nodes[] = {{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0}};
    char dev[4096], path[4096];
    snprintf(dev, sizeof dev, "%s/dev", newroot);
    must_mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k");
    for (size_t i = 0; i < sizeof nodes / sizeof *nodes; i++) {
        snprintf(path, sizeof path, "%s/%s", dev, nodes[i].name);
        make_dev_node(path, nodes[i].name, nodes[i].major, nodes[i].minor);
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

/* In each call (its /tmp mounted): the ruleset made from what prepare_landlock kept, applied to itself; the
   zygote's handles closed. -1 with errno when it could not be. */
int restrict_landlock(void) {
    int fd = (int)syscall(SYS_landlock_create_ruleset, &ruleset, ruleset_size, 0);
    int tmp = open("/tmp", O_PATH | O_CLOEXEC);
    if (fd < 0 || tmp < 0 || add_rule(fd, workdir_fd, write_access) != 0 || add_rule(fd, tmp, write_access) != 0 ||
        add_rule(fd, dev_fd, dev_access) != 0 || syscall(SYS_landlock_restrict_self, fd, 0) != 0)
        return -1;
    close(fd);
    close(tmp);
    close(workdir_fd);
    close(dev_fd);
    return 0;
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

void setup(char **argv) {
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

/* Once, in the zygote (which never executes anything): every call inherits an empty bounding set, no
   ambient capabilities and locked securebits, so uid 0 of the user namespace cannot regain capabilities
   by exec. The zygote keeps its effective set, which the clones need to create their namespaces and
   mount; each call empties it below. */
void drop_bounding_set(void) {
    for (int cap = 0; cap <= CAP_LAST; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno != EINVAL)
            die("drop bounding capability", errno);
    if (prctl(PR_SET_SECUREBITS, SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP |
                                     SECBIT_NO_SETUID_FIXUP_LOCKED | SECBIT_KEEP_CAPS_LOCKED, 0, 0, 0) != 0)
        die("set securebits", errno);
    if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) != 0)
        die("clear ambient capabilities", errno);
}
