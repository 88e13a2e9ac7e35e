#!/usr/bin/env python3
# Measures how long a non-blocking send (or shutdown) on a TCP socket waits while another
# holder of the same socket is inside send(2) of memory whose pages fault in slowly (a
# file mapping whose pages were evicted, read at random): the socket lock is held for the
# copy. Run as: python3 scripts/lib/lane-socket-lock.py (writes 256 MiB under /var/tmp).
# Does a client's send() of slowly-faulting memory hold the socket lock, so that another
# holder's non-blocking send / shutdown on the same socket waits?
import mmap, os, socket, threading, time, ctypes
libc = ctypes.CDLL(None, use_errno=True)
path = "/var/tmp/locksock.bin"; size = 256 << 20
if not os.path.exists(path) or os.path.getsize(path) != size:
    with open(path, "wb") as f:
        for _ in range(size >> 20): f.write(os.urandom(1 << 20))
        f.flush(); os.fsync(f.fileno())
fd = os.open(path, os.O_RDONLY)
os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
m.madvise(mmap.MADV_RANDOM)
l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen(1)
c = socket.create_connection(l.getsockname()); s, _ = l.accept()
def drain():
    while s.recv(1 << 20): pass
threading.Thread(target=drain, daemon=True).start()
other = c.dup()
def client():
    t = time.time(); n = c.send(memoryview(m)); print(f"client send {n>>20} MiB took {time.time()-t:.2f}s")
th = threading.Thread(target=client); th.start()
time.sleep(0.2)
worst = 0
for i in range(150):
    t = time.perf_counter()
    try: other.send(b"x" * 64, socket.MSG_DONTWAIT)
    except BlockingIOError: pass
    worst = max(worst, time.perf_counter() - t)
    time.sleep(0.01)
print(f"worst MSG_DONTWAIT send on the same socket meanwhile: {worst*1000:.1f} ms")
t = time.perf_counter(); other.shutdown(socket.SHUT_RDWR); print(f"shutdown took {(time.perf_counter()-t)*1000:.1f} ms")
th.join()
os.unlink(path)
