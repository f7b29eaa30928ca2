/* dsec-agent: what its parts share. The agent is one static binary built from agent.c (the main loop), agent_proto.c
 * (frames and channels), agent_exec.c (commands), agent_confine.c (CONFINE, REVEAL), agent_files.c (file
 * operations) and agent_surface.c (WATCH, CONNECT); isolation/binaries.py compiles them together
 * (guest/initramfs.py: AGENT_PARTS).
 *
 * Frame (both directions): u32 length (big-endian; counts the bytes after it) | u8 type | u32 channel
 * | payload. Types and payloads are documented in docs/design/microvm.md ("agent protocol").
 */
#ifndef DSEC_AGENT_H
#define DSEC_AGENT_H
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
    T_CONNECT = 23, T_OUT_CREDIT = 24,
    T_STDOUT = 0x81, T_STDERR = 0x82, T_EXIT = 0x83, T_DATA = 0x84, T_END = 0x85, T_ERROR = 0x86,
    T_READY = 0x87, T_STARTED = 0x88, T_CREDIT = 0x89,
};

/* What this agent can do, in READY's and PING's reply (the host falls back to the older protocol without a bit):
 * 1: stdin flow control (CREDIT frames for the channels that ask: EXEC_EXT flag 32, CONNECT flag 1);
 * 2: output flow control (OUT_CREDIT frames from the host on the channels that ask: EXEC_EXT flag 64, CONNECT
 * flag 2). */
#define AGENT_FEATURES 3u

#define MAX_IN ((2u << 20) + (64u << 10)) /* largest frame the host may send: a command at the kernel's limit */
#define MAX_GROUPS 64
#define OUT_CHUNK 65536        /* largest payload we send (the host rejects more) */
#define MAX_CHANS 512
#define STDIN_BUF_MAX (8u << 20) /* a channel's stdin not yet written: the host's window is well below it */
#define CREDIT_MIN 65536        /* consumed stdin is credited in batches of at least this (or once all is out) */
#define DRAIN_MS 200
/* Output (STDOUT, STDERR, a connection's DATA) a channel that asked may have sent and the host not yet credited
 * back (OUT_CREDIT): the host's OUTPUT_WINDOW (guest/protocol.py). Beyond it the channel's pipes or socket are not
 * read until credit comes, so a host consumer reading slowly holds the command, not the host's memory. */
#define OUTPUT_WINDOW (1u << 20)
#define OUT_CREDIT_RELEASE 0xFFFFFFFFu /* OUT_CREDIT's "stop counting": the host gave the channel up */

struct chan {
    uint32_t id;
    int used;
    int kind;             /* T_EXEC or T_WRITE */
    pid_t pid;            /* exec: process (group leader) */
    int in_fd, out_fd, err_fd;
    char *inbuf;          /* exec: stdin waiting for the pipe (connect: for the socket); write: unused */
    size_t inlen;
    int in_eof;
    int credit;           /* the host sends stdin within a window: credit what is consumed (CREDIT) */
    size_t owed;          /* stdin consumed (written, or dropped) and not yet credited */
    int out_credit;       /* the host credits our output: send at most OUTPUT_WINDOW un-credited (out_room) */
    size_t out_unacked;   /* output sent and not yet credited by the host */
    int exited, status;
    long long exit_ms;
    long oom_before;      /* exec: the guest's oom_kill count when it started */
    int wfd;              /* write: temp file (or the file itself, written as a user: FS WRITE) */
    int tty;              /* exec on a terminal: its master side (RESIZE, the foreground group) */
    int sfd;              /* watch: its inotify fd; connect: its socket (agent_surface.c) */
    void *extra;          /* watch: its directories (agent_surface.c) */
    char *wpath, *wtmp;
    mode_t wmode;
    int werr;
};

/* How one command starts (EXEC, EXEC_PRISTINE and EXEC_SYSTEM fill it from their payload; EXEC_EXT from its own). */
struct exec_opts {
    uid_t uid;
    gid_t gid;
    int ngroups;
    gid_t groups[MAX_GROUPS];
    int pristine, system;
    int pty;            /* 1: stdin, stdout and stderr on a new terminal; 2: only stdin (raw mode), pipes for the rest */
    unsigned short cols, rows;
    int report_pid;     /* send STARTED with its pid in the commands' pid namespace */
    int credit;         /* credit stdin as it is consumed (the host keeps a window) */
    int out_credit;     /* keep its output within the window the host credits */
};

/* The user a request acts as (CREDS: u32 uid | u32 gid | u16 ngroups | u32 group...). */
struct creds {
    uid_t uid;
    gid_t gid;
    int ngroups;
    gid_t groups[MAX_GROUPS];
};

#define CONFINED_DIR "/run/dsec-agent"
#define CONFINED_MARK CONFINED_DIR "/confined"

/* agent.c */
extern char *args_start;               /* the agent's argv strings (its /proc/<pid>/cmdline) */
extern size_t args_len;

/* agent_proto.c: frames, channels, payloads */
extern int port;
extern struct chan chans[MAX_CHANS];
extern int proc_dir;
long long now_ms(void);
void put32(unsigned char *p, uint32_t v);
uint32_t get32(const unsigned char *p);
void send_frame(int type, uint32_t ch, const void *data, size_t len);
void send_error(uint32_t ch, int err, const char *what);
void send_text_error(uint32_t ch, int err, const char *text);
void credit_stdin(struct chan *c, size_t n, int now);
size_t out_room(const struct chan *c);
void send_output(struct chan *c, int type, const void *data, size_t len);
void do_out_credit(uint32_t id, unsigned char *p, size_t len);
struct chan *find_chan(uint32_t id);
struct chan *new_chan(uint32_t id);
void close_fd(int *fd);
void close_pair(int *fds);
void free_chan(struct chan *c);
int split_strings(char *p, size_t len, char **out, int max);
int path_arg(uint32_t id, unsigned char *p, size_t len, char **path);
int parse_creds(unsigned char **p, size_t *len, struct creds *c);
int each_parent(const char *path, int (*visit)(const char *dir));
void mkdirs(const char *path);
int read_proc(const char *name, char *buf, size_t size);
long oom_kills(void);

/* agent_exec.c: commands */
extern dev_t image_dev;
void setup_command_cgroup(void);
void do_exec(uint32_t id, unsigned char *p, size_t len, int pristine, int system);
void do_exec_ext(uint32_t id, unsigned char *p, size_t len);
void do_stdin(uint32_t id, unsigned char *p, size_t len);
void do_resize(uint32_t id, unsigned char *p, size_t len);
void signal_command(struct chan *c, int signo, int how);
void flush_stdin(struct chan *c);
void drop_stdin(struct chan *c);

/* agent_confine.c: CONFINE and REVEAL */
extern int confined;
extern int sandbox_ns, sandbox_pidns, agent_pidns;
extern pid_t pidns_init;
void do_confine(uint32_t id, unsigned char *p, size_t len);
void do_reveal(uint32_t id);
void drop_privileges(void);

/* agent_files.c: file operations */
void do_read(uint32_t id, unsigned char *p, size_t len);
void do_write(uint32_t id, unsigned char *p, size_t len);
void do_list(uint32_t id, unsigned char *p, size_t len);
void do_mkdir(uint32_t id, unsigned char *p, size_t len);
void do_fs(uint32_t id, unsigned char *p, size_t len);
int write_input(struct chan *c, unsigned char *p, size_t len);
void as_user(const struct creds *c);
void as_root(void);

/* agent_surface.c: WATCH and CONNECT */
void do_watch(uint32_t id, unsigned char *p, size_t len);
void do_connect(uint32_t id, unsigned char *p, size_t len);
int connect_input(struct chan *c, unsigned char *p, size_t len);
short surface_events(struct chan *c);
void surface_ready(struct chan *c, short revents);
void surface_free(struct chan *c);

#endif
