#!/usr/bin/python3
"""The escape suite's probe (crates/vrdma-cli/tests/escape.rs): run as root inside
`vrdma run`, it tries each way out it knows and prints one line per attempt:

    PROBE <name> blocked|ESCAPED <detail>

`ESCAPED` means the attempt got further than a sandboxed container may. Usage:
escape_probe.py HOST_RUN_DIR OTHER_VNIC HOST_MARKER_TAG
"""

import ctypes
import errno
import os
import signal
import socket
import struct
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

SYS = {  # x86_64 syscall numbers
    "ptrace": 101,
    "process_vm_readv": 310,
    "init_module": 175,
    "finit_module": 313,
    "unshare": 272,
    "fsopen": 430,
    "open_tree": 428,
    "add_key": 248,
    "bpf": 321,
    "pivot_root": 155,
    "getpid": 39,
}
X32_BIT = 0x40000000


def report(name, escaped, detail=""):
    print(f"PROBE {name} {'ESCAPED' if escaped else 'blocked'} {detail}".rstrip(), flush=True)


def err():
    e = ctypes.get_errno()
    return f"{errno.errorcode.get(e, e)}"


def syscall(name, *args):
    r = libc.syscall(ctypes.c_long(SYS[name]), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return r, ctypes.get_errno()


def attempt(name, fn):
    try:
        fn()
    except Exception as e:  # a bug in an attempt is an escape: the suite must not pass silently
        report(name, True, f"probe error: {e!r}")


def mounts(run_dir):
    def umount():
        rc = libc.umount2(b"/run/vrdma", 2)
        report("umount_run_vrdma", rc == 0, "umount2: " + ("ok" if rc == 0 else err()))

    def mount_over():
        rc = libc.mount(b"tmpfs", b"/run/vrdma", b"tmpfs", 0, None)
        report("mount_over_run_vrdma", rc == 0, "mount: " + ("ok" if rc == 0 else err()))

    def new_api():
        fd, e = syscall("fsopen", b"tmpfs", 0)
        report("fsopen", fd >= 0, "fsopen: " + ("ok" if fd >= 0 else errno.errorcode.get(e, str(e))))
        fd, e = syscall("open_tree", -100, b"/", 1 | 0x80000)  # OPEN_TREE_CLONE | O_CLOEXEC
        report("open_tree", fd >= 0, "open_tree: " + ("ok" if fd >= 0 else errno.errorcode.get(e, str(e))))

    def pivot():
        r, e = syscall("pivot_root", b"/tmp", b"/tmp")
        # EINVAL/EBUSY still means the permission check passed.
        report("pivot_root", e != errno.EPERM, "pivot_root: " + errno.errorcode.get(e, str(e)))

    attempt("umount_run_vrdma", umount)
    attempt("mount_over_run_vrdma", mount_over)
    attempt("fsopen", new_api)
    attempt("pivot_root", pivot)


def sockets(run_dir, other):
    paths = [
        f"{run_dir}/admin.sock",
        f"{run_dir}/vnics/{other}/control.sock",
        "/run/vrdma/admin.sock",
        "/run/vrdma/../admin.sock",
        "/run/vrdma/../vrdma/admin.sock",
        f"/run/vrdma/vnics/{other}/control.sock",
        f"/run/vrdma/../vnics/{other}/control.sock",
        f"/proc/1/root{run_dir}/admin.sock",
        f"/proc/self/root{run_dir}/admin.sock",
        f"/proc/1/root{run_dir}/vnics/{other}/control.sock",
        f"/proc/self/root/run/vrdma/admin.sock",
        "/run/vrdma/vnics",
    ]
    reached = []
    for p in paths:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(p)
            reached.append(p)
        except OSError:
            pass
        finally:
            s.close()
    # Whatever the probe can see: every socket file on the paths vrdmad uses.
    for root in ["/run", run_dir, "/var/run", "/tmp"]:
        for dirpath, _, files in os.walk(root):
            for f in files:
                full = os.path.join(dirpath, f)
                if full == "/run/vrdma/control.sock" or not f.endswith(".sock"):
                    continue
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(full)
                    reached.append(full)
                except OSError:
                    pass
                finally:
                    s.close()
    report("vrdma_sockets", bool(reached), "reached: " + ", ".join(reached) if reached else "none reachable")


def host_files(tag):
    wrote = []
    for d in ["/etc", "/root", "/var/tmp", "/tmp", "/usr/local", "/var/lib", "/proc/1/root/etc"]:
        p = f"{d}/vrdma-escape-{tag}"
        try:
            with open(p, "w") as f:
                f.write("escaped")
            wrote.append(p)
        except OSError:
            pass
    # /tmp and /var/tmp are private: writing there is allowed, the host must not see it
    # (the test checks the host). Everything else must be read-only.
    bad = [p for p in wrote if not (p.startswith("/tmp/") or p.startswith("/var/tmp/"))]
    report("write_host_files", bool(bad), "wrote: " + ", ".join(wrote))


def ptrace_and_vm():
    attached = []
    for pid in range(1, 400):
        if pid == os.getpid():
            continue
        r, e = syscall("ptrace", 16, pid, 0, 0)  # PTRACE_ATTACH
        if r == 0:
            attached.append(pid)
            # Detaching needs the tracee stopped: wait for the attach's SIGSTOP first, or the
            # stop lands after a failed detach and leaves the process stopped for good (its
            # container then never ends). SIGCONT in case a stop came some other way.
            try:
                os.waitpid(pid, 0x40000000)  # __WALL
            except OSError:
                pass
            syscall("ptrace", 17, pid, 0, 0)  # PTRACE_DETACH
            try:
                os.kill(pid, signal.SIGCONT)
            except OSError:
                pass
    report("ptrace_attach", bool(attached), f"attached: {attached}" if attached else "none")

    buf = ctypes.create_string_buffer(8)

    class Iovec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    local = Iovec(ctypes.cast(buf, ctypes.c_void_p), 8)
    read = []
    for pid in range(1, 400):
        if pid == os.getpid():
            continue
        # Any address: EFAULT means the permission check passed.
        remote = Iovec(0x400000, 8)
        r, e = syscall("process_vm_readv", pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if r >= 0 or e == errno.EFAULT:
            read.append(pid)
    report("process_vm_readv", bool(read), f"reached: {read}" if read else "none")


def modules():
    img = ctypes.create_string_buffer(b"\x7fELF" + b"\0" * 60)
    r, e = syscall("init_module", img, 64, b"")
    report("init_module", e not in (errno.EPERM, errno.ENOSYS), "init_module: " + errno.errorcode.get(e, str(e)))
    fd = os.open("/dev/null", os.O_RDONLY)
    r, e = syscall("finit_module", fd, b"", 0)
    os.close(fd)
    report("finit_module", e not in (errno.EPERM, errno.ENOSYS), "finit_module: " + errno.errorcode.get(e, str(e)))


def raw_sockets():
    for name, args in [
        ("socket_af_packet", (socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))),
        ("socket_af_packet_dgram", (socket.AF_PACKET, socket.SOCK_DGRAM, socket.htons(3))),
        ("socket_raw_inet", (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)),
        ("socket_raw_icmp", (socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)),
    ]:
        try:
            s = socket.socket(*args)
            s.close()
            report(name, True, "created")
        except OSError as e:
            report(name, False, errno.errorcode.get(e.errno, str(e.errno)))


def unshares():
    flags = {
        "user": 0x10000000,
        "mnt": 0x00020000,
        "net": 0x40000000,
        "pid": 0x20000000,
        "uts": 0x04000000,
        "ipc": 0x08000000,
        "cgroup": 0x02000000,
        "time": 0x00000080,
    }
    for ns, flag in flags.items():
        pid = os.fork()
        if pid == 0:
            r, e = syscall("unshare", flag)
            os._exit(0 if r == 0 else 1)
        _, st = os.waitpid(pid, 0)
        ok = os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0
        report(f"unshare_{ns}", ok, "unshared" if ok else "refused")
    # clone(2) with CLONE_NEWUSER, as a runtime would.
    pid = os.fork()
    if pid == 0:
        r, e = libc.syscall(ctypes.c_long(56), ctypes.c_long(0x10000000 | signal.SIGCHLD), None, None, None, None), 0
        if r == 0:
            os._exit(0)
        os._exit(0 if r > 0 else 1)
    _, st = os.waitpid(pid, 0)
    ok = os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0
    report("clone_newuser", ok, "cloned" if ok else "refused")


def siocgskns():
    # A socket of its own, then every descriptor it holds.
    own = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    got = []
    for fd in range(0, 1024):
        r = libc.ioctl(fd, 0x894C)  # SIOCGSKNS
        if r >= 0:
            got.append(fd)
            os.close(r)
    own.close()
    report("siocgskns", bool(got), f"netns handles from fds {got}" if got else "none")


def keys_and_bpf():
    r, e = syscall("add_key", b"user", b"vrdma-escape", b"x", 1, -2)  # KEY_SPEC_PROCESS_KEYRING
    report("add_key", r >= 0, "add_key: " + ("ok" if r >= 0 else errno.errorcode.get(e, str(e))))
    attr = ctypes.create_string_buffer(struct.pack("IIII", 1, 4, 4, 1) + b"\0" * 56)  # BPF_MAP_TYPE_HASH
    r, e = syscall("bpf", 0, attr, 72)
    report("bpf", r >= 0, "bpf(MAP_CREATE): " + ("ok" if r >= 0 else errno.errorcode.get(e, str(e))))


def x32():
    r, e = syscall("getpid") if False else (libc.syscall(ctypes.c_long(X32_BIT | SYS["getpid"])), ctypes.get_errno())
    report("x32_abi", r >= 0, "x32 syscalls " + ("work: a deny list keyed on x86_64 numbers can be bypassed" if r >= 0 else "are refused or off"))


def proc_and_dev():
    caps = [l for l in open("/proc/self/status") if l.startswith(("CapEff", "CapBnd", "NoNewPrivs", "Seccomp:"))]
    d = dict(l.split(":", 1) for l in caps)
    capeff = int(d["CapEff"].strip(), 16)
    report("capabilities", capeff != 0, "; ".join(l.strip() for l in caps))
    try:
        fd = os.open("/proc/sysrq-trigger", os.O_WRONLY)
        os.close(fd)
        report("proc_sysrq_trigger", True, "opened for writing")
    except OSError as e:
        report("proc_sysrq_trigger", False, errno.errorcode.get(e.errno, str(e.errno)))
    try:
        with open("/proc/kcore", "rb") as f:
            data = f.read(4)
        report("proc_kcore", bool(data), f"read {len(data)} bytes")
    except OSError as e:
        report("proc_kcore", False, errno.errorcode.get(e.errno, str(e.errno)))
    try:
        with open("/proc/sys/kernel/hostname", "w") as f:
            f.write("escaped")
        report("proc_sys_write", True, "wrote /proc/sys/kernel/hostname")
    except OSError as e:
        report("proc_sys_write", False, errno.errorcode.get(e.errno, str(e.errno)))
    allowed = {"null", "zero", "full", "random", "urandom", "tty", "pts", "shm", "infiniband", "ptmx", "fd", "stdin", "stdout", "stderr", "mqueue", "console"}
    extra = sorted(set(os.listdir("/dev")) - allowed)
    report("dev_nodes", bool(extra), f"host devices visible: {extra[:20]}" if extra else "only the sandbox's")


def fork_bomb(cap):
    children = []
    stop = None
    deadline = time.monotonic() + 20
    while len(children) < cap and time.monotonic() < deadline:
        try:
            pid = os.fork()
        except OSError as e:
            stop = errno.errorcode.get(e.errno, str(e.errno))
            break
        if pid == 0:
            signal.pause()
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    for pid in children:
        os.waitpid(pid, 0)
    report("fork_bomb", stop is None, f"forked {len(children)}, then {stop}" if stop else f"forked {len(children)} unhindered")


def memory(limit_mib):
    pid = os.fork()
    if pid == 0:
        chunks = []
        try:
            for _ in range(limit_mib // 64):
                b = bytearray(64 << 20)
                b[::4096] = b"\1" * len(b[::4096])
                chunks.append(b)
        except MemoryError:
            os._exit(3)
        os._exit(0)
    _, st = os.waitpid(pid, 0)
    allocated = os.WIFEXITED(st) and os.WEXITSTATUS(st) == 0
    how = "allocated and touched all" if allocated else (f"killed by signal {os.WTERMSIG(st)}" if os.WIFSIGNALED(st) else "MemoryError")
    report("memory_limit", allocated, f"{limit_mib} MiB: {how}")


def main():
    run_dir, other, tag = sys.argv[1], sys.argv[2], sys.argv[3]
    for name, fn in [
        ("mounts", lambda: mounts(run_dir)),
        ("sockets", lambda: sockets(run_dir, other)),
        ("files", lambda: host_files(tag)),
        ("ptrace", ptrace_and_vm),
        ("modules", modules),
        ("raw", raw_sockets),
        ("unshare", unshares),
        ("skns", siocgskns),
        ("keys", keys_and_bpf),
        ("x32", x32),
        ("proc", proc_and_dev),
        ("forkbomb", lambda: fork_bomb(1000)),
        ("memory", lambda: memory(2048)),
    ]:
        attempt(name, fn)
    print("PROBE done", flush=True)


main()
