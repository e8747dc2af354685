"""A process that holds idle connections to the API socket: the abuse suite's and bench's attacker.

``HOLDER`` runs as another uid (standard library only): it opens N connections to the socket at
``argv[1]``, says nothing on them, waits ``argv[3]`` seconds (default 1), reports on stdout as one
JSON line how many it holds, how many failed and how many the daemon refused (closed at once), and
how long opening took; then it holds the rest until its stdin closes.
"""

from __future__ import annotations

HOLDER = r"""
import json, resource, select, socket, sys, time
path, n = sys.argv[1], int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
socks, failed, t0 = [], 0, time.monotonic()
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    deadline = time.monotonic() + 10
    while True:
        try:
            s.connect(path)
            socks.append(s)
            break
        except BlockingIOError:  # the listen backlog is full: wait for the daemon to accept
            if time.monotonic() > deadline:
                failed += 1
                s.close()
                break
            time.sleep(0.001)
        except OSError:
            failed += 1
            s.close()
            break
opened_s = time.monotonic() - t0
time.sleep(float(sys.argv[3]) if len(sys.argv) > 3 else 1.0)
poller = select.poll()
for s in socks:
    poller.register(s, select.POLLIN)
refused = len(poller.poll(0))
print(json.dumps({"connected": len(socks), "failed": failed, "refused": refused,
                  "open_s": round(opened_s, 3)}), flush=True)
sys.stdin.read()
"""
