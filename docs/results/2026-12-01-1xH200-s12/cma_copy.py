# process_vm_readv from a child process beside memmove, one core: N bytes (argv[1], default 16 MiB) in chunks of N, 1 MiB, 256 KiB, 64 KiB, into a cache-sized buffer or into one of N bytes; best of five.
import ctypes, os, time
libc = ctypes.CDLL(None, use_errno=True)
class iovec(ctypes.Structure):
    _fields_=[("base",ctypes.c_void_p),("len",ctypes.c_size_t)]
import sys
N = int(sys.argv[1]) if len(sys.argv) > 1 else 16<<20
src = ctypes.create_string_buffer(b"a"*N, N)
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(r); os.write(w, b"x"); os.close(w)
    time.sleep(5); os._exit(0)
os.close(w); os.read(r,1)
for chunk in [N, 1<<20, 256<<10, 64<<10]:
  dst = ctypes.create_string_buffer(chunk)
  big = ctypes.create_string_buffer(N)
  for target, name in [(dst, "into cache-size buf"), (big, "into N buf")]:
    best = 1e9
    for rep in range(5):
        t = time.perf_counter()
        off = 0
        while off < N:
            ln = min(chunk, N-off)
            dstaddr = ctypes.addressof(target) + (off if target is big else 0)
            l = iovec(dstaddr, ln); rm = iovec(ctypes.addressof(src)+off, ln)
            n = libc.process_vm_readv(pid, ctypes.byref(l), 1, ctypes.byref(rm), 1, 0)
            assert n == ln, (n, ctypes.get_errno())
            off += ln
        best = min(best, time.perf_counter()-t)
    print(f"cma chunk {chunk>>10} KiB {name}: {N/best/1e9:.2f} GB/s")
best=1e9
big = ctypes.create_string_buffer(N)
for rep in range(5):
    t=time.perf_counter(); ctypes.memmove(big, src, N); best=min(best,time.perf_counter()-t)
print(f"memmove N: {N/best/1e9:.2f} GB/s")
os.kill(pid, 9)
