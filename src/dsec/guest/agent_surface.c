/* dsec-agent, the sandbox surface: commands with a terminal, supplementary groups and a reported pid
 * (EXEC_EXT), terminal size and foreground signals, file operations as a user (FS), directory watches
 * (WATCH) and connections to the guest's own loopback ports (CONNECT). Included by agent.c (one static
 * binary, one translation unit): it uses agent.c's frames, channels and command start.
 *
 * Frames are in docs/design.md ("microvm: agent protocol"). Every request that acts as a user carries
 * CREDS: u32 uid | u32 gid | u16 ngroups | u32 group... The agent (single-threaded, root) takes that user's
 * filesystem ids and groups for the operation (setfsuid, setfsgid, setgroups) and returns to its own
 * after it, so the kernel checks the user's permission bits and what it creates is the user's. */
#include <ftw.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/fsuid.h>
#include <sys/inotify.h>
#include <sys/socket.h>
#include <termios.h>

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE 1
#endif
#ifndef SYS_renameat2
#define SYS_renameat2 316
#endif

enum { FS_STAT = 1, FS_MKDIR = 2, FS_REMOVE = 3, FS_RENAME = 4, FS_CHMOD = 5, FS_CHOWN = 6, FS_READ = 7,
       FS_LIST = 8, FS_WRITE = 9 };

struct creds {
    uid_t uid;
    gid_t gid;
    int ngroups;
    gid_t groups[MAX_GROUPS];
};

/* ---- small helpers used by start_command (agent.c) ------------------------------------------------- */

static void close_pair(int *fds) {
    close_fd(&fds[0]);
    close_fd(&fds[1]);
}

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

/* SIGNAL with a second byte: 1 = the terminal's foreground group, 2 = the same unless it is the command's
 * own group (a shell between jobs must not be killed by its own interrupt). */
static void signal_command(struct chan *c, int signo, int how) {
    pid_t group = -1;
    if (c->tty >= 0 && ioctl(c->tty, TIOCGPGRP, &group) != 0) group = -1;
    if (group <= 0) group = c->pid;
    if (how == 2 && group == c->pid) return;
    kill(-group, signo);
}

/* ---- EXEC_EXT ------------------------------------------------------------------------------------- */

static int parse_creds(unsigned char **p, size_t *len, struct creds *c) {
    if (*len < 10) return -1;
    c->uid = get32(*p);
    c->gid = get32(*p + 4);
    c->ngroups = ((*p)[8] << 8) | (*p)[9];
    if (c->ngroups > MAX_GROUPS || *len < 10 + 4 * (size_t)c->ngroups) return -1;
    for (int i = 0; i < c->ngroups; i++) c->groups[i] = get32(*p + 10 + 4 * i);
    *p += 10 + 4 * (size_t)c->ngroups;
    *len -= 10 + 4 * (size_t)c->ngroups;
    return 0;
}

/* EXEC_EXT payload: u16 argc | u16 envc | u32 flags | u16 cols | u16 rows | CREDS | cwd\0 argv...\0 env...\0
 * flags: 1 pristine, 2 system, 4 terminal (stdin, stdout, stderr), 8 terminal stdin only (raw; a shell
 * session), 16 report the pid (STARTED: u32 pid in the commands' pid namespace, before any output). */
static void do_exec_ext(uint32_t id, unsigned char *p, size_t len) {
    if (len < 12) { send_error(id, EINVAL, "malformed exec"); return; }
    int argc = (p[0] << 8) | p[1], envc = (p[2] << 8) | p[3];
    uint32_t flags = get32(p + 4);
    struct exec_opts o = {.cols = (unsigned short)((p[8] << 8) | p[9]), .rows = (unsigned short)((p[10] << 8) | p[11]),
                          .pristine = flags & 1, .system = !!(flags & 2),
                          .pty = flags & 4 ? 1 : flags & 8 ? 2 : 0, .report_pid = !!(flags & 16)};
    p += 12; len -= 12;
    struct creds c;
    if (parse_creds(&p, &len, &c) != 0) { send_error(id, EINVAL, "malformed exec user"); return; }
    o.uid = c.uid; o.gid = c.gid; o.ngroups = c.ngroups;
    memcpy(o.groups, c.groups, sizeof c.groups);
    start_command(id, &o, argc, envc, (char *)p, len);
}

/* RESIZE payload: u16 cols | u16 rows (the channel's terminal; SIGWINCH goes to its foreground job). */
static void do_resize(uint32_t id, unsigned char *p, size_t len) {
    struct chan *c = find_chan(id);
    if (!c || c->tty < 0 || len != 4) return;
    struct winsize ws = {.ws_col = (unsigned short)((p[0] << 8) | p[1]), .ws_row = (unsigned short)((p[2] << 8) | p[3])};
    ioctl(c->tty, TIOCSWINSZ, &ws);
}

/* ---- FS ------------------------------------------------------------------------------------------- */

static void as_user(const struct creds *c) {
    if (c->uid == 0 && c->gid == 0 && c->ngroups == 0) return;
    setgroups((size_t)c->ngroups, c->groups);
    setfsgid(c->gid);
    setfsuid(c->uid);
}

static void as_root(void) {
    setfsuid(0);
    setfsgid(0);
    setgroups(0, NULL);
}

static void send_stat(uint32_t id, const char *path) {
    struct stat st;
    if (lstat(path, &st) != 0) { send_error(id, errno, path); return; }
    unsigned char r[32 + PATH_MAX];
    char target[PATH_MAX];
    ssize_t tl = S_ISLNK(st.st_mode) ? readlink(path, target, sizeof target - 1) : 0;
    if (tl < 0) tl = 0;
    r[0] = S_ISREG(st.st_mode) ? 'f' : S_ISDIR(st.st_mode) ? 'd' : S_ISLNK(st.st_mode) ? 'l' : 'o';
    put32(r + 1, (uint32_t)st.st_mode);
    uint64_t size = (uint64_t)st.st_size;
    uint64_t mt = (uint64_t)st.st_mtim.tv_sec * 1000000000ull + (uint64_t)st.st_mtim.tv_nsec;
    put32(r + 5, (uint32_t)(size >> 32)); put32(r + 9, (uint32_t)size);
    put32(r + 13, (uint32_t)(mt >> 32)); put32(r + 17, (uint32_t)mt);
    put32(r + 21, st.st_uid); put32(r + 25, st.st_gid);
    r[29] = (unsigned char)(tl >> 8); r[30] = (unsigned char)tl;
    memcpy(r + 31, target, (size_t)tl);
    send_frame(T_DATA, id, r, 31 + (size_t)tl);
    send_frame(T_END, id, NULL, 0);
}

/* mkdir -p of `path`'s parents (each created 0755); -1 with errno when a component cannot be made. */
static int make_parents(const char *path) {
    char buf[PATH_MAX];
    if (strlen(path) >= sizeof buf) { errno = ENAMETOOLONG; return -1; }
    strcpy(buf, path);
    for (char *s = buf + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        struct stat st;
        if (mkdir(buf, 0755) != 0 && (errno != EEXIST || stat(buf, &st) != 0 || !S_ISDIR(st.st_mode))) {
            if (errno == EEXIST) errno = ENOTDIR;
            return -1;
        }
        *s = '/';
    }
    return 0;
}

static int remove_one(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)ftw;
    return (flag == FTW_DP ? rmdir(path) : unlink(path)) == 0 ? 0 : -1;
}

static void fs_write(uint32_t id, uint32_t mode, const char *path) {
    struct chan *c = new_chan(id);
    if (!c) { send_error(id, EBUSY, "write channel"); return; }
    c->kind = T_WRITE;
    c->wpath = strdup(path);
    c->wfd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (c->wfd < 0 && errno == ENOENT && make_parents(path) == 0)  /* missing parents made, as the user */
        c->wfd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    struct stat st;
    if (c->wfd < 0 && errno == EEXIST) {  /* written in place, as the user may: a read-only file stays refused */
        if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode)) { c->werr = EISDIR; return; }
        c->wfd = open(path, O_WRONLY | O_TRUNC | O_NOFOLLOW | O_CLOEXEC);
    }
    if (c->wfd < 0) { c->werr = errno; return; }
    c->wmode = mode != 0xffffffffu ? (mode_t)(mode & 07777) : fstat(c->wfd, &st) == 0 ? st.st_mode & 07777 : 0644;
}

/* FS payload: u8 op | CREDS | op arguments:
 *   STAT path\0; MKDIR u32 mode, u8 parents, path\0; REMOVE u8 recursive, path\0; RENAME u8 overwrite, from\0 to\0;
 *   CHMOD u32 mode, path\0; CHOWN u32 uid, u32 gid, path\0; READ u64 max, path\0 (as READ); LIST path\0 (as LIST);
 *   WRITE u32 mode (0xffffffff: keep, 0644 when new), path\0, data as STDIN frames (written in place).
 * Replies: STAT: DATA (u8 kind, u32 mode, u64 size, u64 mtime_ns, u32 uid, u32 gid, u16 len, symlink target)
 * END; READ, LIST as theirs; the others END; any failure ERROR with its errno. */
static void do_fs(uint32_t id, unsigned char *p, size_t len) {
    if (len < 1) { send_error(id, EINVAL, "malformed file request"); return; }
    int op = p[0];
    p++; len--;
    struct creds c;
    if (parse_creds(&p, &len, &c) != 0) { send_error(id, EINVAL, "malformed file request user"); return; }
    static const size_t fixed[] = {0, 0, 5, 1, 1, 4, 8, 8, 0, 4};
    if (op < FS_STAT || op > FS_WRITE || len <= fixed[op]) { send_error(id, EINVAL, "malformed file request"); return; }
    char *path, *to = NULL;
    if (op == FS_RENAME) {
        path = (char *)p + 1;
        char *z = memchr(path, 0, len - 1);
        if (!z || path[0] != '/') { send_error(id, EINVAL, "malformed rename"); return; }
        to = z + 1;
        if ((size_t)(to - (char *)p) >= len || !memchr(to, 0, len - (size_t)(to - (char *)p)) || to[0] != '/') {
            send_error(id, EINVAL, "malformed rename"); return;
        }
    } else if (path_arg(id, p + fixed[op], len - fixed[op], &path)) {
        return;
    }
    as_user(&c);
    int rc = 0;
    struct stat st;
    switch (op) {
    case FS_STAT: send_stat(id, path); break;
    case FS_READ: do_read(id, p, len); break;
    case FS_LIST: do_list(id, p, len); break;
    case FS_WRITE: fs_write(id, get32(p), path); break;
    case FS_MKDIR:
        if (p[4] && make_parents(path) != 0) { rc = -1; break; }
        if (mkdir(path, 0700) == 0) rc = chmod(path, get32(p) & 07777);
        else if (!(p[4] && errno == EEXIST && stat(path, &st) == 0 && S_ISDIR(st.st_mode))) rc = -1;
        if (rc == 0) send_stat(id, path);
        break;
    case FS_REMOVE:
        if (lstat(path, &st) != 0) rc = -1;
        else if (!S_ISDIR(st.st_mode)) rc = unlink(path);
        else if (p[0]) rc = nftw(path, remove_one, 16, FTW_DEPTH | FTW_PHYS);  /* (an overlay's files report
                                                                                their layer's device: no FTW_MOUNT) */
        else rc = rmdir(path);
        if (rc == 0) send_frame(T_END, id, NULL, 0);
        break;
    case FS_RENAME:
        rc = (int)syscall(SYS_renameat2, AT_FDCWD, path, AT_FDCWD, to, p[0] ? 0 : RENAME_NOREPLACE);
        if (rc == 0) send_stat(id, to);
        else if (errno == EEXIST) path = to;
        break;
    case FS_CHMOD:
        rc = chmod(path, get32(p) & 07777);
        if (rc == 0) send_stat(id, path);
        break;
    case FS_CHOWN:
        rc = chown(path, get32(p), get32(p + 4));
        if (rc == 0) send_stat(id, path);
        break;
    }
    if (rc != 0) send_error(id, errno, path);
    as_root();
}

/* ---- WATCH ---------------------------------------------------------------------------------------- */

#define MAX_WATCHED 8192
struct watched {
    int recursive;
    int n;
    int wd[MAX_WATCHED];
    char *path[MAX_WATCHED];
};

static void watch_add(struct chan *c, const char *path, int report);

/* Watch `dir` and, recursively, what is below it; `report`: what is found there is news (a create each). */
static void watch_tree(struct chan *c, const char *dir, int report) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char child[PATH_MAX];
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        if (snprintf(child, sizeof child, "%s/%s", strcmp(dir, "/") ? dir : "", e->d_name) >= (int)sizeof child)
            continue;
        struct stat st;
        int is_dir = lstat(child, &st) == 0 && S_ISDIR(st.st_mode);
        if (report) {
            unsigned char r[16 + PATH_MAX];
            size_t pl = strlen(child);
            r[0] = 'c'; r[1] = (unsigned char)is_dir; put32(r + 2, 0);
            r[6] = (unsigned char)(pl >> 8); r[7] = (unsigned char)pl;
            memcpy(r + 8, child, pl);
            send_frame(T_DATA, c->id, r, 8 + pl);
        }
        if (is_dir) watch_add(c, child, report);
    }
    closedir(d);
}

static void watch_add(struct chan *c, const char *path, int report) {
    struct watched *w = c->extra;
    if (w->n >= MAX_WATCHED) return;
    int wd = inotify_add_watch(c->sfd, path, IN_MODIFY | IN_ATTRIB | IN_MOVED_FROM | IN_MOVED_TO | IN_CREATE |
                                              IN_DELETE | IN_DELETE_SELF | IN_ONLYDIR);
    if (wd < 0) return;
    w->wd[w->n] = wd;
    w->path[w->n++] = strdup(path);
    if (w->recursive) watch_tree(c, path, report);
}

/* WATCH payload: u8 recursive | CREDS | path\0. Replies: END once the watch is in place (or ERROR), then DATA
 * frames of records u8 kind | u8 is_dir | u32 cookie | u16 len | path, one frame per batch the kernel gave:
 * kind c(reate) m(odify) d(elete) a(ttributes) f(moved from) t(moved to) x(the watched directory deleted)
 * o(verflow); the host pairs f and t by cookie within a frame. CANCEL ends it. */
static void do_watch(uint32_t id, unsigned char *p, size_t len) {
    if (len < 2) { send_error(id, EINVAL, "malformed watch"); return; }
    int recursive = p[0];
    p++; len--;
    struct creds cr;
    char *path;
    if (parse_creds(&p, &len, &cr) != 0) { send_error(id, EINVAL, "malformed watch user"); return; }
    if (path_arg(id, p, len, &path)) return;
    struct chan *c = new_chan(id);
    if (!c) { send_error(id, EBUSY, "watch channel"); return; }
    c->kind = T_WATCH;
    as_user(&cr);
    struct stat st;
    int err = 0;
    if (stat(path, &st) != 0) err = errno;
    else if (!S_ISDIR(st.st_mode)) err = ENOTDIR;
    if (!err) {  /* the user may read it (open checks the filesystem ids; access() would check root's) */
        int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (fd < 0) err = errno; else close(fd);
    }
    as_root();
    int ok = !err;
    if (!ok) { send_error(id, err, path); free_chan(c); return; }
    c->sfd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    struct watched *w = calloc(1, sizeof *w);
    if (c->sfd < 0 || !w) { send_error(id, c->sfd < 0 ? errno : ENOMEM, "inotify"); free(w); free_chan(c); return; }
    w->recursive = recursive;
    c->extra = w;
    watch_add(c, path, 0);
    if (w->n == 0) { send_error(id, errno, path); free_chan(c); return; }
    send_frame(T_END, id, NULL, 0);
}

static const char *watched_path(struct watched *w, int wd) {
    for (int i = 0; i < w->n; i++)
        if (w->wd[i] == wd) return w->path[i];
    return NULL;
}

static void watch_ready(struct chan *c) {
    static char buf[65536] __attribute__((aligned(__alignof__(struct inotify_event))));
    static unsigned char out[OUT_CHUNK];
    struct watched *w = c->extra;
    ssize_t n = read(c->sfd, buf, sizeof buf);
    if (n <= 0) return;
    size_t used = 0;
    for (char *q = buf; q < buf + n;) {
        struct inotify_event *ev = (struct inotify_event *)q;
        q += sizeof *ev + ev->len;
        char kind = ev->mask & IN_Q_OVERFLOW ? 'o' : ev->mask & IN_CREATE ? 'c' : ev->mask & IN_MODIFY ? 'm'
                  : ev->mask & IN_DELETE ? 'd' : ev->mask & IN_ATTRIB ? 'a' : ev->mask & IN_MOVED_FROM ? 'f'
                  : ev->mask & IN_MOVED_TO ? 't' : ev->mask & IN_DELETE_SELF ? 'x' : 0;
        const char *base = watched_path(w, ev->wd);
        if (!kind || (!base && kind != 'o')) continue;
        char path[PATH_MAX];
        if (kind == 'o') path[0] = 0;
        else if (snprintf(path, sizeof path, "%s%s%s", base, ev->len && ev->name[0] ? (strcmp(base, "/") ? "/" : "") : "",
                          ev->len ? ev->name : "") >= (int)sizeof path) continue;
        if (kind == 'x' && base != w->path[0]) continue;  /* a subdirectory's own end: its parent said so */
        size_t pl = strlen(path);
        if (used + 8 + pl > sizeof out) { send_frame(T_DATA, c->id, out, used); used = 0; }
        out[used] = (unsigned char)kind; out[used + 1] = !!(ev->mask & IN_ISDIR);
        put32(out + used + 2, ev->cookie);
        out[used + 6] = (unsigned char)(pl >> 8); out[used + 7] = (unsigned char)pl;
        memcpy(out + used + 8, path, pl);
        used += 8 + pl;
        if (w->recursive && (ev->mask & IN_ISDIR) && (ev->mask & (IN_CREATE | IN_MOVED_TO))) {
            if (used) { send_frame(T_DATA, c->id, out, used); used = 0; }
            watch_add(c, path, 1);
        }
    }
    if (used) send_frame(T_DATA, c->id, out, used);
}

/* ---- CONNECT -------------------------------------------------------------------------------------- */

/* CONNECT payload: u16 port. The guest's own 127.0.0.1:port (the host's way in, whatever the guest's network):
 * STARTED once connected (or ERROR), then DATA frames of what the server sends, END when it is done; the host's
 * bytes come as STDIN frames (empty: end of the host's side). CANCEL closes it. */
static void do_connect(uint32_t id, unsigned char *p, size_t len) {
    if (len != 2) { send_error(id, EINVAL, "malformed connect"); return; }
    struct chan *c = new_chan(id);
    if (!c) { send_error(id, EBUSY, "connect channel"); return; }
    c->kind = T_CONNECT;
    c->sfd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    struct sockaddr_in to = {.sin_family = AF_INET, .sin_port = htons((uint16_t)((p[0] << 8) | p[1])),
                             .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    if (c->sfd < 0 || (connect(c->sfd, (struct sockaddr *)&to, sizeof to) != 0 && errno != EINPROGRESS)) {
        send_error(id, errno, "connect");
        free_chan(c);
        return;
    }
    int one = 1;
    setsockopt(c->sfd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->exited = 0;  /* a connection's `exited`: connected (its outcome reported) */
}

static void connect_ready(struct chan *c, short revents) {
    if (!c->exited) {  /* the connect's outcome */
        int err = 0;
        socklen_t l = sizeof err;
        getsockopt(c->sfd, SOL_SOCKET, SO_ERROR, &err, &l);
        if (err) { send_error(c->id, err, "connect"); free_chan(c); return; }
        c->exited = 1;
        send_frame(T_STARTED, c->id, NULL, 0);
        return;
    }
    if (revents & POLLOUT) {
        while (c->inlen > 0) {
            ssize_t n = send(c->sfd, c->inbuf, c->inlen, MSG_NOSIGNAL);
            if (n < 0) { if (errno == EAGAIN || errno == EINTR) break; c->inlen = 0; break; }
            memmove(c->inbuf, c->inbuf + n, c->inlen - (size_t)n);
            c->inlen -= (size_t)n;
        }
        if (c->inlen == 0 && c->in_eof) { shutdown(c->sfd, SHUT_WR); c->in_eof = 0; }
    }
    if (revents & (POLLIN | POLLHUP | POLLERR)) {
        static char buf[OUT_CHUNK];
        ssize_t n = recv(c->sfd, buf, sizeof buf, 0);
        if (n > 0) { send_frame(T_DATA, c->id, buf, (size_t)n); return; }
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
        send_frame(T_END, c->id, NULL, 0);
        free_chan(c);
    }
}

/* STDIN for a connection: queued for the socket (empty: shut its sending side once the queue is out). */
static int connect_input(struct chan *c, unsigned char *p, size_t len) {
    if (c->kind != T_CONNECT) return 0;
    if (len == 0) { c->in_eof = 1; if (c->inlen == 0) { shutdown(c->sfd, SHUT_WR); c->in_eof = 0; } return 1; }
    if (c->inlen + len > STDIN_BUF_MAX) return 1;  /* the host waits for its own window: never this much */
    char *nb = realloc(c->inbuf, c->inlen + len);
    if (!nb) return 1;
    c->inbuf = nb;
    memcpy(c->inbuf + c->inlen, p, len);
    c->inlen += len;
    return 1;
}

/* ---- the main loop's part ------------------------------------------------------------------------- */

static short surface_events(struct chan *c) {
    if (c->sfd < 0) return 0;
    if (c->kind == T_WATCH) return POLLIN;
    if (c->kind == T_CONNECT) return (short)(!c->exited ? POLLOUT : POLLIN | (c->inlen > 0 || c->in_eof ? POLLOUT : 0));
    return 0;
}

static void surface_ready(struct chan *c, short revents) {
    if (c->kind == T_WATCH) watch_ready(c);
    else if (c->kind == T_CONNECT) connect_ready(c, revents);
}

static void surface_free(struct chan *c) {
    close_fd(&c->sfd);
    struct watched *w = c->extra;
    if (w) {
        for (int i = 0; i < w->n; i++) free(w->path[i]);
        free(w);
        c->extra = NULL;
    }
}
