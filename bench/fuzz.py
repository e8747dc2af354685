"""Fuzz a live ``gpushare daemon --simulate 1``: latency datagrams and API socket frames.

Any local user can write to both sockets. This sends ``--datagrams`` random datagrams to the
latency socket (random bytes, deep nesting, long numbers, random JSON, near-valid messages with
hostile fields) and ``--frames`` random JSON lines to the API socket from an unprivileged account
(``nobody``): each connection says ``hello`` first, then random methods with random params, with
garbage lines, deep nesting and overlong lines mixed in. It reports what must stay at zero
(daemon crashes, dead or restarted threads, ``INTERNAL`` answers) and the daemon's RSS before
and after (flat). Prints a summary and writes bench/results/fuzz.json.

    .venv/bin/python bench/fuzz.py                      # 10^5 datagrams and 10^5 frames
    .venv/bin/python bench/fuzz.py --datagrams 2000 --frames 2000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.support.trusted import make_trusted_dir  # noqa: E402

OUT = REPO / "bench" / "results" / "fuzz.json"
METHODS = ["hello", "status", "list", "events", "submit", "cancel", "pause", "resume", "adopt",
           "release", "reload", "nope", "", "\ud800"]  # fmt: skip
HOSTILE = [2**63, -(2**63) - 1, 10**400, 1e308, -0.0, "\ud800", "²", "\x00", "a" * 5000,
           True, None, [], {}, "c1", "0", "../../etc/passwd", "GPU-0"]  # fmt: skip
FRAMES_PER_CONNECTION = 200


def rand_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(9 if depth < 3 else 6)
    if kind == 0:
        return rng.choice(HOSTILE)
    if kind == 1:
        return rng.randint(-(2**70), 2**70)
    if kind == 2:
        return rng.uniform(-1e6, 1e6)
    if kind == 3:
        return "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(12)))
    if kind == 4:
        return rng.choice([True, False, None])
    if kind == 5:
        return f"c{rng.randrange(5)}"
    if kind == 6:
        return [rand_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["cls", "argv", "gpu", "client_id", "since_id", "limit", "sm_pct", "env", "name",
            "source", "job_id", "pids", "all", "detach", "x"]  # fmt: skip
    return {rng.choice(keys): rand_json(rng, depth + 1) for _ in range(rng.randrange(5))}


def datagram(rng: random.Random) -> bytes:
    kind = rng.randrange(5)
    if kind == 0:
        return rng.randbytes(rng.randrange(600))
    if kind == 1:
        return rng.choice([b"[", b"{", b'{"v":1,"s":[', b"[{"]) * rng.randrange(1, 70000)
    if kind == 2:
        digits = b"9" * rng.randrange(1, 800)
        return rng.choice([b'{"v":1,"id":"c1","s":[%s]}', b'{"v":1,"id":"c1","n":%s}']) % digits
    if kind == 3:
        return json.dumps(rand_json(rng)).encode()
    msg = {
        "v": rng.choice([1, 1, 2]),
        "id": rand_json(rng),
        "s": rand_json(rng),
        "n": rand_json(rng),
    }
    return json.dumps(msg).encode("utf-8", "surrogatepass")


def frame(rng: random.Random) -> bytes:
    kind = rng.randrange(10)
    if kind == 0:
        # Never blank: the daemon skips a blank line without an answer.
        return b"!" + rng.randbytes(rng.randrange(200)).replace(b"\n", b" ") + b"\n"
    if kind == 1:
        return b"[" * rng.randrange(1, 100000) + b"\n"
    if kind == 2:
        return json.dumps(rand_json(rng)).encode("utf-8", "surrogatepass") + b"\n"
    req = {"id": rand_json(rng) if kind == 3 else rng.randrange(10**6),
           "method": rng.choice(METHODS), "params": rand_json(rng)}  # fmt: skip
    if kind == 4:
        req["params"] = {"since_id": rng.choice(HOSTILE), "limit": rng.choice(HOSTILE)}
    return json.dumps(req).encode("utf-8", "surrogatepass") + b"\n"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def api_call(sock_path: Path, method: str, params: dict[str, Any]) -> Any:
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(30)
        s.connect(str(sock_path))
        f = s.makefile("rwb")
        for i, (m, p) in enumerate(
            [("hello", {"api_version": 1, "client": "fuzz"}), (method, params)]
        ):
            f.write(json.dumps({"id": i, "method": m, "params": p}).encode() + b"\n")
            f.flush()
            reply = json.loads(f.readline())
        return reply["result"]


def fuzz_datagrams(path: Path, n: int, seed: int) -> int:
    rng = random.Random(seed)
    sent = 0
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as tx:
        tx.connect(str(path))
        for _ in range(n):
            data = datagram(rng)
            with contextlib.suppress(OSError):  # over the socket's size limit: EMSGSIZE
                tx.send(data)
                sent += 1
    return sent


def fuzz_frames_as(user: str, sock_path: Path, n: int, seed: int) -> dict[str, Any]:
    """In a child that drops to ``user``: ``n`` frames over connections of a few hundred each."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid:
        os.close(write_fd)
        with os.fdopen(read_fd, "rb") as pipe:
            text = pipe.read()
        os.waitpid(pid, 0)
        found: dict[str, Any] = json.loads(text or b'{"error": "no report"}')
        return found
    os.close(read_fd)
    code = 0
    try:
        pw = pwd.getpwnam(user)
        os.setgroups([])
        os.setgid(pw.pw_gid)
        os.setuid(pw.pw_uid)
        rng = random.Random(seed)
        counts = {"frames": 0, "answers": 0, "internal": 0, "closed_by_daemon": 0}
        while counts["frames"] < n:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(30)
                s.connect(str(sock_path))
                f = s.makefile("rwb")
                hello = {"id": 0, "method": "hello", "params": {"api_version": 1, "client": "fz"}}
                f.write(json.dumps(hello).encode() + b"\n")
                f.flush()
                f.readline()
                for _ in range(min(FRAMES_PER_CONNECTION, n - counts["frames"])):
                    counts["frames"] += 1
                    try:
                        f.write(frame(rng))
                        f.flush()
                        line = f.readline()
                    except OSError:
                        line = b""
                    if not line:
                        counts["closed_by_daemon"] += 1  # an overlong line ends the connection
                        break
                    counts["answers"] += 1
                    if b'"INTERNAL"' in line:
                        counts["internal"] += 1
        os.write(write_fd, json.dumps(counts).encode())
    except BaseException as exc:  # noqa: BLE001 - the child must always exit, never return
        os.write(write_fd, json.dumps({"error": repr(exc)}).encode())
        code = 1
    os._exit(code)


def start_daemon(base: Path) -> subprocess.Popen[bytes]:
    (base / "gpushare.toml").write_text(
        f"""version = 1
[paths]
runtime_dir = "{base}/run"
state_dir = "{base}/state"
[daemon]
admin_group = ""
[metrics]
enabled = false
[gate]
max_datagrams_per_s = 10000000
[mps]
control_binary = "/nonexistent/nvidia-cuda-mps-control"
"""
    )
    env = {**os.environ, "GPUSHARE_SOCKET": str(base / "run" / "gpushare.sock")}
    proc = subprocess.Popen(
        [sys.executable, "-c", "from gpushare.cli.app import main; main()", "daemon",
         "--simulate", "1", "--config", str(base / "gpushare.toml")],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=(base / "daemon.log").open("wb"),
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while not (base / "run" / "gpushare.sock").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the daemon did not start: {(base / 'daemon.log').read_text()}")
        time.sleep(0.1)
    return proc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datagrams", type=int, default=100_000)
    parser.add_argument("--frames", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--user", default="nobody", help="the unprivileged account sending frames")
    args = parser.parse_args()
    base = make_trusted_dir("gsf-")  # not /tmp: the daemon refuses a config there
    proc = start_daemon(base)
    sock = base / "run" / "gpushare.sock"
    try:
        os.chmod(base / "run", 0o755)
        api_call(sock, "status", {})
        # A warm-up of a twentieth of each (other seeds), so "before" is after the first-use
        # allocations (imports, caches) and the growth is what the fuzz itself costs.
        fuzz_datagrams(base / "run" / "latency.sock", args.datagrams // 20, args.seed + 1)
        fuzz_frames_as(args.user, sock, args.frames // 20, args.seed + 1)
        time.sleep(1.0)
        rss0 = rss_kib(proc.pid)
        t0 = time.monotonic()
        sent = fuzz_datagrams(base / "run" / "latency.sock", args.datagrams, args.seed)
        t_dgram = time.monotonic() - t0
        rss_mid = rss_kib(proc.pid)
        t0 = time.monotonic()
        frames = fuzz_frames_as(args.user, sock, args.frames, args.seed)
        t_frames = time.monotonic() - t0
        time.sleep(1.0)
        alive = proc.poll() is None
        info = api_call(sock, "status", {})["daemon"] if alive else {}
        rss1 = rss_kib(proc.pid) if alive else 0
        log = (base / "daemon.log").read_text()
        result = {
            "datagrams": {"sent": sent, "refused_by_kernel": args.datagrams - sent,
                          "seconds": round(t_dgram, 1),
                          "dropped_by_reason": info.get("datagram_drops", {})},
            "frames": {**frames, "seconds": round(t_frames, 1), "user": args.user},
            "daemon_crashed": not alive,
            "threads": info.get("threads", []),
            "dead_threads": sum(1 for t in info.get("threads", []) if not t["alive"]),
            "thread_restarts": info.get("thread_restarts"),
            "tracebacks_in_log": log.count('"exception"'),
            "rss_kib_before": rss0,
            "rss_kib_after_datagrams": rss_mid,
            "rss_kib_after": rss1,
            "rss_growth_pct": round(100.0 * (rss1 - rss0) / rss0, 1) if rss0 else None,
            "seed": args.seed,
        }  # fmt: skip
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(result, indent=2))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    ok = not result["daemon_crashed"] and result["dead_threads"] == 0
    return 0 if ok and frames.get("internal", 1) == 0 and "error" not in frames else 1


if __name__ == "__main__":
    raise SystemExit(main())
