/*
 * dsec-rtshim: starts the OCI runtime (crun) for one container sandbox.
 *
 *   dsec-rtshim ERRFILE MASK ROOT CGROUP_PROCS... -- RUNTIME ARG...
 *   dsec-rtshim --hold TAG
 *
 * DSec owns the sandbox's cgroups (it creates them with their limits and runs crun with
 * --cgroup-manager=disabled). This shim moves itself into them, so that crun, the
 * container's init and the init's cgroup namespace all start inside the sandbox's
 * cgroups, and then execs the runtime.
 *
 * MASK is "1" on a hybrid cgroup host whose v2 hierarchy holds a controller: crun refuses
 * to run there even when it is told not to manage cgroups at all. The shim then runs the
 * runtime in a private mount namespace where that one file
 * (/sys/fs/cgroup/unified/cgroup.controllers) reads empty. Nothing else changes: the
 * namespace dies with the runtime process, and the container pivots away from it.
 *
 * ROOT is "-" or "FD:PATH": FD (inherited) is a detached mount tree (open_tree(OPEN_TREE_CLONE) of the
 * sandbox's root: its overlay with the read-only image bind in it). The shim then runs the runtime in a
 * private mount namespace of its own and attaches the tree on PATH there (move_mount), so the sandbox's
 * root is mounted nowhere in the host's mount namespace: that table, which every new mount namespace
 * copies and crun reads, stays as small as the host's own. The namespace dies with the runtime process;
 * the container keeps its own copy of the root, the daemon reaches its copy through the holder below.
 *
 * --hold: the node's mount holder. It unshares a private mount namespace, names itself dsec-mntns and
 * sleeps until killed; the daemon attaches each sandbox's overlay and disk tmpfs in that namespace (out
 * of the host's table) and reaches them through /proc/<pid>/root. It outlives a daemon crash, so a
 * restarted daemon still reaches the sandboxes it re-adopts. TAG only names the home it serves.
 *
 * RUNTIME may be /proc/self/fd/N, N an inherited fd of a sealed memfd copy of the runtime that the daemon
 * keeps (procs.sealed_executable): crun finds itself running from a sealed copy and skips making one (the
 * CVE-2019-5736 defence it otherwise repeats at every start, a copy and a second exec). The shim execs it
 * with execveat(AT_EMPTY_PATH) after marking N close-on-exec, so neither the runtime nor the container it
 * starts holds the fd, and from Linux 6.14 on the runtime's name (comm) is the memfd's ("memfd:crun"), not "N".
 *
 * On failure it writes "dsec-rtshim: <what>: <why>" to ERRFILE (created 0600; the runtime's own
 * stdio goes to the container's init, so it cannot carry the shim's errors) and exits 125.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif

#define CONTROLLERS "/sys/fs/cgroup/unified/cgroup.controllers"

static const char *errfile = NULL;

static void fail(const char *what, int err) {
    char msg[512];
    int n = snprintf(msg, sizeof msg, "dsec-rtshim: %s: %s\n", what, strerror(err));
    int fd = errfile ? open(errfile, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600) : -1;
    if (fd < 0)
        fd = 2;
    if (n > 0 && write(fd, msg, (size_t)n) < 0)
        _exit(125);
    _exit(125);
}

/* The pid crun wrote to its --pid-file (the container's init), or 0. */
static pid_t read_pid(int argc, char **argv, int sep) {
    for (int i = sep + 1; i + 1 < argc; i++) {
        if (strcmp(argv[i], "--pid-file") == 0) {
            char buf[32] = {0};
            int fd = open(argv[i + 1], O_RDONLY | O_CLOEXEC);
            if (fd < 0)
                return 0;
            ssize_t n = read(fd, buf, sizeof buf - 1);
            close(fd);
            return n > 0 ? (pid_t)atoi(buf) : 0;
        }
    }
    return 0;
}

/* Whether our children are at most `init` (zombies count: they are what we wait for). */
static int only_child(pid_t init) {
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/self/task/%d/children", (int)getpid());
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return 1;
    buf[n] = 0;
    char *end = NULL;
    long first = strtol(buf, &end, 10);
    while (*end == ' ')
        end++;
    return *end == 0 && first == init;
}

/* N if the runtime is given as /proc/self/fd/N (an inherited fd of a sealed copy of it, see below), else -1. */
static int runtime_fd(const char *runtime) {
    const char *prefix = "/proc/self/fd/";
    if (strncmp(runtime, prefix, strlen(prefix)) != 0)
        return -1;
    char *end = NULL;
    long fd = strtol(runtime + strlen(prefix), &end, 10);
    return end != runtime + strlen(prefix) && *end == 0 && fd >= 3 && fd < 1 << 20 ? (int)fd : -1;
}

static int hold(void) {
    if (unshare(CLONE_NEWNS) != 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0) {
        perror("dsec-rtshim --hold: private mount namespace");
        return 125;
    }
    prctl(PR_SET_NAME, "dsec-mntns", 0, 0, 0);
    for (;;)
        pause();
}

int main(int argc, char **argv) {
    int sep = 0;
    if (argc == 3 && strcmp(argv[1], "--hold") == 0)
        return hold();
    for (int i = 4; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0) {
            sep = i;
            break;
        }
    }
    if (argc < 6 || sep == 0 || sep + 1 >= argc) {
        fprintf(stderr, "usage: dsec-rtshim ERRFILE MASK ROOT CGROUP_PROCS... -- RUNTIME ARG...\n"
                        "       dsec-rtshim --hold TAG\n");
        return 125;
    }
    errfile = argv[1];
    int root_fd = -1;
    const char *root_path = NULL;
    if (strcmp(argv[3], "-") != 0) {
        char *end = NULL;
        root_fd = (int)strtol(argv[3], &end, 10);
        if (end == argv[3] || *end != ':' || root_fd < 3 || end[1] != '/')
            fail("ROOT is neither - nor FD:/PATH", EINVAL);
        root_path = end + 1;
    }
    for (int i = 4; i < sep; i++) {
        int fd = open(argv[i], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "0", 1) != 1)
            fail(argv[i], errno);
        close(fd);
    }
    int mask = strcmp(argv[2], "1") == 0;
    if (mask || root_fd >= 0) {
        if (unshare(CLONE_NEWNS) != 0)
            fail("unshare the mount namespace", errno);
        if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0)
            fail("make the mount namespace private", errno);
    }
    if (mask && mount("/dev/null", CONTROLLERS, NULL, MS_BIND, NULL) != 0)
        fail("mask " CONTROLLERS, errno);
    if (root_fd >= 0) {
        if (syscall(SYS_move_mount, root_fd, "", AT_FDCWD, root_path, MOVE_MOUNT_F_EMPTY_PATH) != 0)
            fail("attach the sandbox's root", errno);
        close(root_fd);
    }
    /* The runtime runs as our child, and we are a subreaper while it does: the processes it forks and
       leaves behind are re-parented here, not to the daemon (a subreaper too, for the sandboxes' inits),
       which never waits for them: `crun run --detach` left one zombie per create there, for good. Once
       the runtime is done we collect its leftovers until only the container's init (named by the
       runtime's --pid-file) is left, for at most a second; the init is re-parented to the daemon when we
       exit. */
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0)
        fail("become a subreaper", errno);
    pid_t runtime = fork();
    if (runtime < 0)
        fail("fork", errno);
    if (runtime == 0) {
        prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0);
        int exe = runtime_fd(argv[sep + 1]);
        if (exe >= 0) {
            /* Close-on-exec first: neither the runtime nor the container it starts holds the copy. */
            if (fcntl(exe, F_SETFD, FD_CLOEXEC) != 0)
                fail(argv[sep + 1], errno);
            syscall(SYS_execveat, exe, "", &argv[sep + 1], environ, AT_EMPTY_PATH);
        } else {
            execv(argv[sep + 1], &argv[sep + 1]);
        }
        fail(argv[sep + 1], errno);
    }
    int status = 0;
    while (waitpid(runtime, &status, 0) < 0)
        if (errno != EINTR)
            fail("wait for the runtime", errno);
    pid_t init = read_pid(argc, argv, sep);
    for (int i = 0; i < 1000 && !only_child(init); i++) {
        while (waitpid(-1, NULL, WNOHANG) > 0)
            ;
        usleep(1000);
    }
    if (WIFEXITED(status))
        return WEXITSTATUS(status);
    return 125;
}
