/*
 * dsec-rtshim: starts the OCI runtime (crun) for one container sandbox.
 *
 *   dsec-rtshim ERRFILE MASK CGROUP_PROCS... -- RUNTIME ARG...
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
 * On failure it writes "dsec-rtshim: <what>: <why>" to ERRFILE (created 0600; the runtime's own
 * stdio goes to the container's init, so it cannot carry the shim's errors) and exits 125.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/mount.h>
#include <unistd.h>

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

int main(int argc, char **argv) {
    int sep = 0;
    for (int i = 3; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0) {
            sep = i;
            break;
        }
    }
    if (argc < 5 || sep == 0 || sep + 1 >= argc) {
        fprintf(stderr, "usage: dsec-rtshim ERRFILE MASK CGROUP_PROCS... -- RUNTIME ARG...\n");
        return 125;
    }
    errfile = argv[1];
    for (int i = 3; i < sep; i++) {
        int fd = open(argv[i], O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "0", 1) != 1)
            fail(argv[i], errno);
        close(fd);
    }
    if (strcmp(argv[2], "1") == 0) {
        if (unshare(CLONE_NEWNS) != 0)
            fail("unshare the mount namespace", errno);
        if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0)
            fail("make the mount namespace private", errno);
        if (mount("/dev/null", CONTROLLERS, NULL, MS_BIND, NULL) != 0)
            fail("mask " CONTROLLERS, errno);
    }
    execv(argv[sep + 1], &argv[sep + 1]);
    fail(argv[sep + 1], errno);
    return 125;
}
