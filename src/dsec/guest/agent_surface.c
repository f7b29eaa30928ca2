/* dsec-agent, the channels that are neither a command nor a file: directory watches (WATCH) and connections to
 * the guest's own loopback ports (CONNECT). Frames are in docs/design/microvm.md ("agent protocol"). */
#include "agent.h"

#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/inotify.h>
#include <sys/socket.h>

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
void do_watch(uint32_t id, unsigned char *p, size_t len) {
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

/* CONNECT payload: u16 port [| u8 flags]. The guest's own 127.0.0.1:port (the host's way in, whatever the guest's
 * network): STARTED once connected (or ERROR), then DATA frames of what the server sends, END when it is done; the
 * host's bytes come as STDIN frames (empty: end of the host's side). CANCEL closes it. flags: 1 credit the host's
 * bytes as the socket takes them (CREDIT), 2 keep the server's bytes within the window the host credits
 * (OUT_CREDIT: the socket is not read while it is full). */
void do_connect(uint32_t id, unsigned char *p, size_t len) {
    if (len != 2 && len != 3) { send_error(id, EINVAL, "malformed connect"); return; }
    struct chan *c = new_chan(id);
    if (!c) { send_error(id, EBUSY, "connect channel"); return; }
    c->kind = T_CONNECT;
    c->credit = len == 3 && (p[2] & 1);
    c->out_credit = len == 3 && (p[2] & 2);
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
        size_t sent = 0;
        while (c->inlen > 0) {
            ssize_t n = send(c->sfd, c->inbuf, c->inlen, MSG_NOSIGNAL);
            if (n < 0) {
                if (errno == EAGAIN || errno == EINTR) break;
                sent += c->inlen; c->inlen = 0; break;  /* the server's side is closed: dropped */
            }
            memmove(c->inbuf, c->inbuf + n, c->inlen - (size_t)n);
            c->inlen -= (size_t)n;
            sent += (size_t)n;
        }
        credit_stdin(c, sent, c->inlen == 0);
        if (c->inlen == 0 && c->in_eof) { shutdown(c->sfd, SHUT_WR); c->in_eof = 0; }
    }
    size_t room = out_room(c);
    if ((revents & (POLLIN | POLLHUP | POLLERR)) && room) {  /* (its window full: the server's bytes wait) */
        static char buf[OUT_CHUNK];
        ssize_t n = recv(c->sfd, buf, room, 0);
        if (n > 0) { send_output(c, T_DATA, buf, (size_t)n); return; }
        if (n < 0 && (errno == EAGAIN || errno == EINTR)) return;
        send_frame(T_END, c->id, NULL, 0);
        free_chan(c);
    }
}

/* STDIN for a connection: queued for the socket (empty: shut its sending side once the queue is out). */
int connect_input(struct chan *c, unsigned char *p, size_t len) {
    if (c->kind != T_CONNECT) return 0;
    if (len == 0) { c->in_eof = 1; if (c->inlen == 0) { shutdown(c->sfd, SHUT_WR); c->in_eof = 0; } return 1; }
    if (c->inlen + len > STDIN_BUF_MAX) return 1;  /* within the host's window (or an older host's): never this much */
    char *nb = realloc(c->inbuf, c->inlen + len);
    if (!nb) return 1;
    c->inbuf = nb;
    memcpy(c->inbuf + c->inlen, p, len);
    c->inlen += len;
    return 1;
}

/* ---- the main loop's part ------------------------------------------------------------------------- */

short surface_events(struct chan *c) {
    if (c->sfd < 0) return 0;
    if (c->kind == T_WATCH) return POLLIN;
    if (c->kind == T_CONNECT)
        return (short)(!c->exited ? POLLOUT : (out_room(c) ? POLLIN : 0) | (c->inlen > 0 || c->in_eof ? POLLOUT : 0));
    return 0;
}

void surface_ready(struct chan *c, short revents) {
    if (c->kind == T_WATCH) watch_ready(c);
    else if (c->kind == T_CONNECT) connect_ready(c, revents);
}

void surface_free(struct chan *c) {
    close_fd(&c->sfd);
    struct watched *w = c->extra;
    if (w) {
        for (int i = 0; i < w->n; i++) free(w->path[i]);
        free(w);
        c->extra = NULL;
    }
}
