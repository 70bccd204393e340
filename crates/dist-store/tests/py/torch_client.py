"""PyTorch's own TCPStore client against a server at HOST PORT: every query type, a cancelled
wait, a blocking queue pop, 4 MiB values, 32 concurrent clients and (torch 2.15 and later) the
server-side barrier, timed out too. Exits non-zero on the first
failed check. The server side (a Rust test) has set "from_rust" first and reads "from_python"."""
import datetime
import sys
import threading
import time

import torch.distributed as dist

host, port = sys.argv[1], int(sys.argv[2])
T = datetime.timedelta(seconds=30)


def connect():
    return dist.TCPStore(host, port, is_master=False, timeout=T)


def check(cond, what):
    if not cond:
        print("FAIL", what, flush=True)
        sys.exit(1)
    print("ok", what, flush=True)


s = connect()
s2 = connect()
check(s.get("from_rust") == b"hello from rust", "get a key the rust client set")
s.set("a", "1")
check(s.get("a") == b"1", "set then get")
check(s.add("n", 5) == 5 and s.add("n", -2) == 3, "add returns the new value")
check(s.get("n") == b"3", "add keeps ascii decimal")
check(s.compare_set("cs", "x", "y") == b"x", "compare_set, missing key, expected non-empty: returns expected")
check(not s.check(["cs"]), "... and stores nothing")
check(s.compare_set("cs", "", "y") == b"y", "compare_set, missing key, expected empty: stores")
check(s.compare_set("cs", "z", "w") == b"y", "compare_set mismatch returns the current value")
check(s.compare_set("cs", "y", "w") == b"w", "compare_set match stores")
check(s.check(["a", "n"]) and not s.check(["a", "nope"]), "check")
t0 = time.monotonic()
try:
    s.wait(["never"], datetime.timedelta(milliseconds=300))
    check(False, "wait on a missing key times out")
except Exception as e:  # noqa: BLE001
    check("timeout" in str(e).lower(), f"wait on a missing key times out ({type(e).__name__})")
check(time.monotonic() - t0 < 5, "the timeout is the one asked for")
check(s.get("a") == b"1", "the connection works after a cancelled wait")


def later(f):
    def run():
        time.sleep(0.2)
        f()

    t = threading.Thread(target=run)
    t.start()
    return t


t = later(lambda: s2.set("late", "v"))
s.wait(["late"], T)
t.join()
check(True, "wait woken by another client's set")
t = later(lambda: s2.set("late2", "v"))
check(s.get("late2") == b"v", "get waits for the key")
t.join()
check(s.delete_key("a") and not s.delete_key("a"), "delete_key")
n = s.num_keys()
check(isinstance(n, int) and n >= 5, f"num_keys ({n})")
s.append("ap", "ab")
s.append("ap", "cd")
check(s.get("ap") == b"abcd", "append")
s.multi_set(["m1", "m2"], ["v1", "v2"])
check(s.multi_get(["m1", "m2"]) == [b"v1", b"v2"], "multi_set, multi_get")
s.queue_push("q", "i1")
s.queue_push("q", "i2")
check(s.queue_len("q") == 2, "queue_len")
check(s.queue_pop("q") == b"i1" and s.queue_pop("q", block=False) == b"i2", "queue_pop in order")
t = later(lambda: s2.queue_push("q2", "x"))
check(s.queue_pop("q2") == b"x", "blocking queue_pop woken by a push")
t.join()
try:
    s.queue_pop("q", block=False)
    check(False, "queue_pop of an empty queue raises")
except Exception as e:  # noqa: BLE001
    check("empty" in str(e).lower(), f"queue_pop of an empty queue raises ({type(e).__name__})")
keys = s.list_keys()
check("m1" in keys and "from_rust" in keys, f"list_keys ({len(keys)} keys)")
big = bytes(range(256)) * (4096 * 4)
s.set("big", big)
check(s.get("big") == big, "a 4 MiB value")


def worker():
    c = connect()
    for _ in range(20):
        c.add("ctr", 1)


ths = [threading.Thread(target=worker) for _ in range(32)]
for t in ths:
    t.start()
for t in ths:
    t.join()
check(s.add("ctr", 0) == 640, "32 concurrent clients, 20 adds each, exact")
if hasattr(s, "barrier"):  # BARRIER came with PyTorch 2.15
    t = later(lambda: s2.barrier("bar", 2))
    s.barrier("bar", 2, T)
    t.join()
    check(s.get("bar") == b"2", "barrier of two clients; its key holds the count")
    t0 = time.monotonic()
    try:
        s.barrier("tbar", 2, datetime.timedelta(milliseconds=300))
        check(False, "barrier short of its world size times out")
    except Exception as e:  # noqa: BLE001
        check("timeout" in str(e).lower(), f"barrier short of its world size times out ({type(e).__name__})")
    check(time.monotonic() - t0 < 5, "the barrier's timeout is the one asked for")
    check(s.get("n") == b"3", "the connection works after a cancelled barrier")
    s2.barrier("tbar", 2, T)
    check(True, "barrier: the timed-out arrival counts")
s.set("from_python", "hello from python")
print("done", flush=True)
