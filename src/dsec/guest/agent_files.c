/* dsec-agent, file operations: READ, WRITE, LIST and MKDIR as root, and FS (any of them, and more, as a user).
 *
 * Every request that acts as a user carries CREDS (agent_proto.c: parse_creds). The agent (single-threaded, root)
 * takes that user's filesystem ids and groups for the operation (setfsuid, setfsgid, setgroups) and returns to
 * its own after it, so the kernel checks the user's permission bits and what it creates is the user's. */
#include "agent.h"

#include <ftw.h>
#include <sys/fsuid.h>

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE 1
#endif
#ifndef SYS_renameat2
#define SYS_renameat2 316
#endif

enum { FS_STAT = 1, FS_MKDIR = 2, FS_REMOVE = 3, FS_RENAME = 4, FS_CHMOD = 5, FS_CHOWN = 6, FS_READ = 7,
       FS_LIST = 8, FS_WRITE = 9 };

/* The start of a LIST record and of a STAT reply: u8 kind | u32 mode | u64 size | u64 mtime_ns (21 bytes). */
static void put_entry(unsigned char *r, const struct stat *st) {
    r[0] = S_ISREG(st->st_mode) ? 'f' : S_ISDIR(st->st_mode) ? 'd' : S_ISLNK(st->st_mode) ? 'l' : 'o';
    put32(r + 1, (uint32_t)st->st_mode);
    uint64_t size = (uint64_t)st->st_size;
    uint64_t mt = (uint64_t)st->st_mtim.tv_sec * 1000000000ull + (uint64_t)st->st_mtim.tv_nsec;
    put32(r + 5, (uint32_t)(size >> 32)); put32(r + 9, (uint32_t)size);
    put32(r + 13, (uint32_t)(mt >> 32)); put32(r + 17, (uint32_t)mt);
}

/* ---- As root -------------------------------------------------------------------------------------- */

/* READ payload: u32 max_bytes (high) | u32 max_bytes (low) | path\0 */
void do_read(uint32_t id, unsigned char *p, size_t len) {
    char *path;
    if (len < 9 || path_arg(id, p + 8, len - 8, &path)) { if (len < 9) send_error(id, EINVAL, "read"); return; }
    uint64_t max = ((uint64_t)get32(p) << 32) | get32(p + 4);
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (fd < 0) { send_error(id, errno, path); return; }
    struct stat st;
    if (fstat(fd, &st) != 0) { send_error(id, errno, path); close(fd); return; }
    if (S_ISDIR(st.st_mode)) { send_error(id, EISDIR, path); close(fd); return; }
    if (!S_ISREG(st.st_mode)) { send_error(id, EINVAL, path); close(fd); return; }
    if ((uint64_t)st.st_size > max) { send_error(id, EFBIG, path); close(fd); return; }
    static char buf[OUT_CHUNK];
    uint64_t total = 0;
    for (;;) {
        ssize_t n = read(fd, buf, sizeof buf);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) { send_error(id, errno, path); close(fd); return; }
        if (n == 0) break;
        total += (uint64_t)n;
        if (total > max) { send_error(id, EFBIG, path); close(fd); return; }
        send_frame(T_DATA, id, buf, (size_t)n);
    }
    close(fd);
    send_frame(T_END, id, NULL, 0);
}

/* WRITE payload: u32 mode (0xffffffff: 0644) | path\0; data follows as STDIN frames, an empty one ends it. */
void do_write(uint32_t id, unsigned char *p, size_t len) {
    char *path;
    if (len < 6) { send_error(id, EINVAL, "write"); return; }
    if (path_arg(id, p + 4, len - 4, &path)) return;
    uint32_t mode = get32(p);
    struct chan *c = new_chan(id);
    if (!c) { send_error(id, EBUSY, "write channel"); return; }
    c->kind = T_WRITE;
    c->wmode = mode == 0xffffffffu ? 0644 : (mode_t)(mode & 07777);
    c->wpath = strdup(path);
    mkdirs(path);
    if (asprintf(&c->wtmp, "%s.dsec-tmp-%u", path, id) < 0) { c->wtmp = NULL; c->werr = ENOMEM; return; }
    struct stat st;
    if (lstat(path, &st) == 0 && S_ISDIR(st.st_mode)) { c->werr = EISDIR; free(c->wtmp); c->wtmp = NULL; return; }
    c->wfd = open(c->wtmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (c->wfd < 0) { c->werr = errno; free(c->wtmp); c->wtmp = NULL; }
}

/* LIST reply: DATA frames of records u8 type | u32 mode | u64 size | u64 mtime_ns | u16 namelen | name */
void do_list(uint32_t id, unsigned char *p, size_t len) {
    char *path;
    if (path_arg(id, p, len, &path)) return;
    int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) { send_error(id, errno, path); return; }
    DIR *d = fdopendir(dfd);
    if (!d) { send_error(id, errno, path); close(dfd); return; }
    static unsigned char buf[OUT_CHUNK];
    size_t used = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        struct stat st;
        if (fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0) continue;
        size_t nl = strlen(e->d_name);
        if (used + 27 + nl > sizeof buf) { send_frame(T_DATA, id, buf, used); used = 0; }
        unsigned char *r = buf + used;
        put_entry(r, &st);
        r[21] = (unsigned char)(nl >> 8); r[22] = (unsigned char)nl;
        memcpy(r + 23, e->d_name, nl);
        used += 23 + nl;
    }
    closedir(d);
    if (used) send_frame(T_DATA, id, buf, used);
    send_frame(T_END, id, NULL, 0);
}

/* MKDIR payload: path\0 (and its parents, each 0755). */
void do_mkdir(uint32_t id, unsigned char *p, size_t len) {
    char *path;
    if (path_arg(id, p, len, &path)) return;
    mkdirs(path);
    struct stat st;
    if (mkdir(path, 0755) != 0 && (errno != EEXIST || stat(path, &st) != 0 || !S_ISDIR(st.st_mode)))
        send_error(id, errno == EEXIST ? ENOTDIR : errno, path);
    else
        send_frame(T_END, id, NULL, 0);
}

static void finish_write(struct chan *c) {
    if (c->werr) { send_error(c->id, c->werr, c->wpath); free_chan(c); return; }
    if (fchmod(c->wfd, c->wmode) != 0 || close(c->wfd) != 0) {
        c->wfd = -1; send_error(c->id, errno, c->wpath); free_chan(c); return;
    }
    c->wfd = -1;
    if (c->wtmp && rename(c->wtmp, c->wpath) != 0) { send_error(c->id, errno, c->wpath); free_chan(c); return; }
    free(c->wtmp); c->wtmp = NULL;
    send_frame(T_END, c->id, NULL, 0);
    free_chan(c);
}

/* STDIN for a write (WRITE, FS WRITE): written to its file (empty: the end, the file is done); 0 for a channel of
   another kind. */
int write_input(struct chan *c, unsigned char *p, size_t len) {
    if (c->kind != T_WRITE) return 0;
    if (len == 0) { finish_write(c); return 1; }
    const unsigned char *q = p;
    size_t left = len;
    while (!c->werr && left > 0) {
        ssize_t n = write(c->wfd, q, left);
        if (n < 0) { if (errno != EINTR) c->werr = errno; continue; }
        q += n; left -= (size_t)n;
    }
    return 1;
}

/* ---- FS ------------------------------------------------------------------------------------------- */

void as_user(const struct creds *c) {
    if (c->uid == 0 && c->gid == 0 && c->ngroups == 0) return;
    setgroups((size_t)c->ngroups, c->groups);
    setfsgid(c->gid);
    setfsuid(c->uid);
}

void as_root(void) {
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
    put_entry(r, &st);
    put32(r + 21, st.st_uid); put32(r + 25, st.st_gid);
    r[29] = (unsigned char)(tl >> 8); r[30] = (unsigned char)tl;
    memcpy(r + 31, target, (size_t)tl);
    send_frame(T_DATA, id, r, 31 + (size_t)tl);
    send_frame(T_END, id, NULL, 0);
}

static int make_parent(const char *dir) {
    struct stat st;
    if (mkdir(dir, 0755) != 0 && (errno != EEXIST || stat(dir, &st) != 0 || !S_ISDIR(st.st_mode))) {
        if (errno == EEXIST) errno = ENOTDIR;
        return -1;
    }
    return 0;
}

/* mkdir -p of `path`'s parents (each created 0755); -1 with errno when a component cannot be made. */
static int make_parents(const char *path) {
    return each_parent(path, make_parent);
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
void do_fs(uint32_t id, unsigned char *p, size_t len) {
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
