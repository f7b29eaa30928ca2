/*
 * dsec-init: pid 1 of a container sandbox.
 *
 * It only reaps orphans (commands run by the exec helper have a parent outside the
 * sandbox; their orphaned children are re-parented here) and exits on SIGTERM or
 * SIGINT from the host (never from inside the sandbox). It holds no socket, reads nothing and writes nothing: there is no agent
 * inside the sandbox that sandboxed code could talk to. Built statically so that it
 * runs in any image, including ones without a libc.
 */
#include <signal.h>
#include <stddef.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_signal(int sig) { (void)sig; }

int main(void) {
    sigset_t all;
    struct sigaction sa;
    int sig;

    /* pid 1 of a pid namespace drops signals whose handler is SIG_DFL: install one so
       that SIGTERM from the host and SIGCHLD are delivered to sigwait below. */
    sa.sa_handler = on_signal;
    sa.sa_flags = 0;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGCHLD, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigfillset(&all);
    sigprocmask(SIG_BLOCK, &all, NULL);
    prctl(PR_SET_NAME, "dsec-init", 0, 0, 0);
    for (;;) {
        siginfo_t info;
        sig = sigwaitinfo(&all, &info);
        if (sig < 0)
            continue;
        if (sig == SIGCHLD) {
            while (waitpid(-1, NULL, WNOHANG) > 0)
                ;
        } else if ((sig == SIGTERM || sig == SIGINT) && info.si_pid == 0) {
            /* Only the host may stop the sandbox: a sender outside our pid namespace shows as pid 0.
               `kill 1` from inside the sandbox is ignored. */
            _exit(0);
        }
    }
}
