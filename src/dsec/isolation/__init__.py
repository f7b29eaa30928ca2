"""Host isolation primitives: cgroups, seccomp, capabilities, the exec helper and the sandbox init."""
