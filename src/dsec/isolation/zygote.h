/* dsec-zygote: what its parts share. One static binary built from zygote.c (the zygote's loop), zygote_setup.c
 * (the sandbox's root, Landlock and seccomp, made once), zygote_call.c (one call, in its clone), zygote_py.c (the
 * launcher of Python zygotes) and zygote_io.c (what the zygote and the launcher both do); isolation/binaries.py
 * compiles them together (ZYGOTE_PARTS). The protocol is in zygote.c.
 */
#ifndef DSEC_ZYGOTE_H
#define DSEC_ZYGOTE_H
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
#include <stddef.h>
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
#include <linux/types.h>

#define CTL_FD 100
#define LAUNCH_FD 101 /* the zygote's end of the launcher's socket */
#define STATUS_FD 3
#define ZYGOTE_PROG_FD 4
/* The default path of every command and of the Python zygote (isolation/oci_runtime.py: DEFAULT_PATH). */
#define DEFAULT_PATH "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define MAX_MSG ((2 << 20) + (64 << 10)) /* exec_client.MAX_MESSAGE: a command at the kernel's exec limit */

/* zygote.c */
extern int batched;              /* the zygote switched itself from SCHED_OTHER to SCHED_BATCH; calls switch back */
extern const char *tmpfs_opts;   /* the mount options of the /tmp of the next clone */

/* zygote_io.c: sockets, signals and children, the zygote's and the launcher's */
void send_failure(int sock, const char *what, int err);
void die(const char *what, int err);
int child_signals(void);
int poll_children(struct pollfd *pfd, nfds_t n, void (*reap)(void));
void reap_all(void);
int received_fd(struct msghdr *mh);
int take_fds(struct msghdr *mh, int *fds, int max);

/* zygote_setup.c: once, at start */
extern struct sock_fprog seccomp_prog; /* every call's filter (the container's DEFAULT_PROFILE) */
extern struct sock_fprog zygote_prog;  /* the Python zygote's own, looser filter (its calls' inits mount) */
extern cpu_set_t *call_cpus;           /* CPUS, or NULL: the commands keep the mask they inherit */
extern size_t call_cpus_size;
void parse_cpus(const char *hex);
void setup(char **argv);
void drop_bounding_set(void);
int restrict_landlock(void);

/* zygote_call.c: in the clone */
void run_call(int sock);

/* zygote_py.c: the launcher of Python zygotes */
pid_t start_launcher(void);

#endif
