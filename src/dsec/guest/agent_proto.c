/* dsec-agent, frames and channels: writing frames to the host's port, the table of channels, and the parsing of
 * payloads every request shares (strings, paths, CREDS). */
#include "agent.h"

int port = -1;
struct chan chans[MAX_CHANS];

long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

void put32(unsigned char *p, uint32_t v) {
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}

uint32_t get32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static void write_all(int fd, const void *buf, size_t len) {
    const char *p = buf;
    while (len > 0) {
        ssize_t n = write(fd, p, len);
        if (n < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) { struct pollfd pf = {fd, POLLOUT, 0}; poll(&pf, 1, 1000); continue; }
            return; /* host gone: nothing to report to */
        }
        p += n; len -= (size_t)n;
    }
}

void send_frame(int type, uint32_t ch, const void *data, size_t len) {
    unsigned char hdr[9];
    put32(hdr, (uint32_t)(len + 5));
    hdr[4] = (unsigned char)type;
    put32(hdr + 5, ch);
    write_all(port, hdr, 9);
    if (len) write_all(port, data, len);
}

void send_error(uint32_t ch, int err, const char *what) {
    char buf[512];
    put32((unsigned char *)buf, (uint32_t)err);
    int n = snprintf(buf + 4, sizeof buf - 4, "%s: %s", what, strerror(err));
    if (n < 0) n = 0;
    if (n > (int)sizeof buf - 4) n = sizeof buf - 4;
    send_frame(T_ERROR, ch, buf, 4 + (size_t)n);
}

/* CREDIT payload: u32 bytes of the channel's stdin consumed (written to the command or socket, or dropped because
 * it stopped reading) since the last one. Sent in batches of CREDIT_MIN, and `now` (all of its stdin is out). */
void credit_stdin(struct chan *c, size_t n, int now) {
    if (!c->credit) return;
    c->owed += n;
    if (c->owed == 0 || (!now && c->owed < CREDIT_MIN)) return;
    unsigned char r[4];
    put32(r, (uint32_t)c->owed);
    send_frame(T_CREDIT, c->id, r, 4);
    c->owed = 0;
}

/* How much output the channel may send now: a chunk, or what its window has left (0: wait for OUT_CREDIT). */
size_t out_room(const struct chan *c) {
    if (!c->out_credit) return OUT_CHUNK;
    size_t left = c->out_unacked >= OUTPUT_WINDOW ? 0 : OUTPUT_WINDOW - c->out_unacked;
    return left < OUT_CHUNK ? left : OUT_CHUNK;
}

/* One frame of the channel's output (at most out_room), counted against its window. */
void send_output(struct chan *c, int type, const void *data, size_t len) {
    send_frame(type, c->id, data, len);
    if (c->out_credit) c->out_unacked += len;
}

/* OUT_CREDIT payload: u32 bytes of the channel's output the host consumed since its last one; OUT_CREDIT_RELEASE:
 * the host gave the channel up (what comes is dropped there), so stop counting. Late ones (the channel ended)
 * are ignored. */
void do_out_credit(uint32_t id, unsigned char *p, size_t len) {
    struct chan *c = find_chan(id);
    if (!c || len != 4) return;
    uint32_t n = get32(p);
    if (n == OUT_CREDIT_RELEASE) { c->out_credit = 0; c->out_unacked = 0; }
    else c->out_unacked -= n < c->out_unacked ? n : c->out_unacked;
    /* an exited command's drain counts from when its output may flow again (not from before it waited) */
    if (c->kind == T_EXEC && c->exited) c->exit_ms = now_ms();
}

struct chan *find_chan(uint32_t id) {
    for (int i = 0; i < MAX_CHANS; i++)
        if (chans[i].used && chans[i].id == id) return &chans[i];
    return NULL;
}

struct chan *new_chan(uint32_t id) {
    if (find_chan(id)) return NULL;
    for (int i = 0; i < MAX_CHANS; i++)
        if (!chans[i].used) {
            memset(&chans[i], 0, sizeof chans[i]);
            chans[i].used = 1;
            chans[i].id = id;
            chans[i].in_fd = chans[i].out_fd = chans[i].err_fd = chans[i].wfd = chans[i].tty = chans[i].sfd = -1;
            return &chans[i];
        }
    return NULL;
}

/* The guest's /proc as the agent found it at start (O_PATH): what it reads and writes there keeps working
 * when guest root unmounts or covers /proc (an unconfined vm's commands may). */
int proc_dir = AT_FDCWD;

/* The start of /proc/`name` (through proc_dir), NUL-terminated in `buf`; -1 when unreadable or empty. */
int read_proc(const char *name, char *buf, size_t size) {
    char path[64];
    if (proc_dir == AT_FDCWD) snprintf(path, sizeof path, "/proc/%s", name);
    int fd = openat(proc_dir, proc_dir == AT_FDCWD ? path : name, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, size - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    return 0;
}

/* The guest kernel's OOM-kill counter (/proc/vmstat oom_kill); -1 when unreadable. */
long oom_kills(void) {
    char buf[8192];
    if (read_proc("vmstat", buf, sizeof buf) != 0) return -1;
    char *p = strstr(buf, "\noom_kill ");
    return p ? atol(p + 10) : -1;
}

void close_fd(int *fd) {
    if (*fd >= 0) { close(*fd); *fd = -1; }
}

void free_chan(struct chan *c) {
    close_fd(&c->in_fd); close_fd(&c->out_fd); close_fd(&c->err_fd); close_fd(&c->wfd); close_fd(&c->tty);
    surface_free(c);
    free(c->inbuf); free(c->wpath);
    if (c->wtmp) { unlink(c->wtmp); free(c->wtmp); }
    c->used = 0;
}

/* Splits a payload of NUL-terminated strings; returns how many were found, -1 if malformed. */
int split_strings(char *p, size_t len, char **out, int max) {
    int n = 0;
    size_t i = 0;
    while (i < len) {
        if (n == max) return -1;
        out[n++] = p + i;
        char *z = memchr(p + i, 0, len - i);
        if (!z) return -1;
        i = (size_t)(z - p) + 1;
    }
    return n;
}

/* `visit` on each directory above `path` but /, outermost first; the first nonzero return ends the walk and is
   returned (-1 with ENAMETOOLONG when `path` is too long to walk). */
int each_parent(const char *path, int (*visit)(const char *dir)) {
    char buf[PATH_MAX];
    if (strlen(path) >= sizeof buf) { errno = ENAMETOOLONG; return -1; }
    strcpy(buf, path);
    for (char *s = buf + 1; *s; s++) {
        if (*s != '/') continue;
        *s = 0;
        int rc = visit(buf);
        if (rc != 0) return rc;
        *s = '/';
    }
    return 0;
}

static int make_dir(const char *dir) {
    mkdir(dir, 0755);
    return 0;
}

/* `path`'s parents made where missing (best effort: what fails shows in the operation that follows). */
void mkdirs(const char *path) {
    each_parent(path, make_dir);
}

void close_pair(int *fds) {
    close_fd(&fds[0]);
    close_fd(&fds[1]);
}

void send_text_error(uint32_t ch, int err, const char *text) {
    char buf[512];
    put32((unsigned char *)buf, (uint32_t)err);
    size_t n = strlen(text);
    if (n > sizeof buf - 4) n = sizeof buf - 4;
    memcpy(buf + 4, text, n);
    send_frame(T_ERROR, ch, buf, 4 + n);
}

int path_arg(uint32_t id, unsigned char *p, size_t len, char **path) {
    if (len == 0 || p[len - 1] != 0 || memchr(p, 0, len) != p + len - 1 || p[0] != '/') {
        send_error(id, EINVAL, "malformed path");
        return -1;
    }
    *path = (char *)p;
    return 0;
}


/* CREDS at `*p` (struct creds), consumed: 0, or -1 when malformed. */
int parse_creds(unsigned char **p, size_t *len, struct creds *c) {
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
