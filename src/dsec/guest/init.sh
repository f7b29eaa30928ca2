#!/bin/busybox sh
# /init of the microvm initramfs (busybox): load the modules the guest needs, mount the image read-only
# (EROFS on /dev/vda) under a tmpfs overlay, lock the guest kernel down, and hand pid 1 to dsec-agent
# inside that root.
# Kernel command line: dsec.disk=<bytes> (size of the writable layer); dsec.net=<address/prefix>:<gateway>
# (networked sandboxes only: their NIC's address, default route and resolver).
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do
    insmod "/modules/$m" || echo "dsec-init: insmod $m failed" >&2
done
disk=268435456
net=
for arg in $(cat /proc/cmdline); do
    case "$arg" in
        dsec.disk=*) disk=${arg#dsec.disk=} ;;
        dsec.net=*) net=${arg#dsec.net=} ;;
    esac
done
fail() { echo "dsec-init: $*" >&2; echo o > /proc/sysrq-trigger; sleep 5; }
# The NIC of a networked sandbox (the policy is enforced outside the VM, see dsec.isolation.network): the same
# address in every guest, so one template snapshot serves all of them; DNS goes to the gateway (the host's proxy).
setup_net() {
    n=0
    while [ ! -e /sys/class/net/eth0 ] && [ $n -lt 200 ]; do sleep 0.01; n=$((n + 1)); done
    ip addr add "$1" dev eth0 && ip link set eth0 up && ip route add default via "$2" \
        || fail "cannot configure eth0 ($1 via $2)"
    mkdir -p /newroot/etc && rm -f /newroot/etc/resolv.conf
    echo "nameserver $2" > /newroot/etc/resolv.conf || fail "cannot write /etc/resolv.conf"
}
mkdir -p /ro /rw /newroot
n=0
while [ ! -b /dev/vda ] && [ $n -lt 200 ]; do sleep 0.01; n=$((n + 1)); done
mount -t erofs -o ro /dev/vda /ro || fail "cannot mount the image (EROFS on /dev/vda)"
# The writable layer's inodes are limited like the container backend's (one per 16 KiB, at least 16,384):
# without nr_inodes an inode bomb would only stop at the guest's RAM.
inodes=$((disk / 16384))
[ "$inodes" -lt 16384 ] && inodes=16384
mount -t tmpfs -o "size=$disk,nr_inodes=$inodes,mode=0755" rw /rw || fail "cannot mount the writable layer"
mkdir /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/ro,upperdir=/rw/upper,workdir=/rw/work /newroot || fail "overlay mount failed"
# The overlay holds its own references to its layers: detach them, so that nothing reached through the
# initramfs's root (kernel threads' /proc/N/root) leads to the writable layer beneath protected paths.
umount -l /ro /rw || fail "cannot detach the overlay's layers"
for d in dev proc sys run tmp; do mkdir -p /newroot/$d; done
mount -t tmpfs -o mode=0755,size=16m,nr_inodes=4096 run /newroot/run
mkdir -p /newroot/run/dsec
[ -n "$net" ] && setup_net "${net%%:*}" "${net#*:}"
cp /dsec-agent /newroot/run/dsec/agent
port=
n=0
while [ -z "$port" ] && [ $n -lt 300 ]; do
    for p in /sys/class/virtio-ports/*; do
        [ "$(cat "$p/name" 2>/dev/null)" = dsec.agent ] && port=/dev/${p##*/}
    done
    [ -z "$port" ] && { sleep 0.01; n=$((n + 1)); }
done
[ -n "$port" ] || fail "no virtio-serial port named dsec.agent"
n=0
while [ ! -c "$port" ] && [ $n -lt 200 ]; do sleep 0.01; n=$((n + 1)); done
# Guest root must not stop, read or rewrite the agent (pid 1, the host's only channel into the VM): no
# ptrace of anything (Yama mode 3: not even with CAP_SYS_PTRACE, and it cannot be lowered until reboot,
# which also closes /proc/1/mem and process_vm_writev), no further kernel modules or kexec (one-way
# switches), and the lockdown LSM in integrity mode (no /dev/mem, /dev/port, iopl, MSR writes, unsigned
# kexec). What stays possible is documented in docs/security.md (guest root owns its own kernel).
echo 3 > /proc/sys/kernel/yama/ptrace_scope || fail "cannot set Yama's ptrace_scope"
echo 1 > /proc/sys/kernel/kexec_load_disabled || fail "cannot disable kexec"
echo 1 > /proc/sys/kernel/modules_disabled || fail "cannot disable module loading"
mkdir -p /sys/kernel/security
mount -t securityfs securityfs /sys/kernel/security 2>/dev/null
echo integrity > /sys/kernel/security/lockdown 2>/dev/null || echo "dsec-init: no lockdown LSM" >&2
umount /sys/kernel/security 2>/dev/null
# Loopback up in every guest (a sandbox's servers listen there, and the host's exposed ports reach them
# through the agent), and terminals: a devpts of the guest's own for commands run on a pty.
ip link set lo up || fail "cannot bring the loopback up"
mkdir -p /dev/pts
mount -t devpts -o newinstance,ptmxmode=0666,mode=0620,gid=5 devpts /dev/pts || fail "cannot mount devpts"
mount --move /dev /newroot/dev
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
# argv[2]: the image's read-only disk, which the agent mounts afresh for pristine execs.
exec switch_root /newroot /run/dsec/agent "$port" /dev/vda
