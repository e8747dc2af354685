"""100 concurrent API clients while fuzzers send malformed frames to the same daemon."""

from __future__ import annotations

import json
import random
import socket
import threading
from collections.abc import Iterator

import pytest

from bench.support.daemon_helpers import DaemonProc
from gpushare.client import ApiClient

MAX_REQUEST = 4096


@pytest.fixture
def daemon() -> Iterator[DaemonProc]:
    d = DaemonProc('[control]\nperiod = "100ms"')
    d.config_path.write_text(
        d.config_text().replace("[daemon]\n", '[daemon]\nmax_request = "4K"\n')
    )
    d.start()
    yield d
    d.cleanup()


def _fuzz_frames(rng: random.Random) -> list[bytes]:
    hello = b'{"id":0,"method":"hello","params":{"api_version":1}}\n'
    return [
        b"{not json\n",
        bytes(rng.getrandbits(8) for _ in range(200)).replace(b"\n", b"") + b"\n",
        b"[" * 100_000 + b"\n",  # over the size bound
        b"[" * 3000 + b"]" * 3000 + b"\n",  # deep nesting under the bound
        b'"just a string"\n',
        b'{"method": null}\n',
        hello + b'{"id":1,"method":"nope"}\n',
        hello + b'{"id":1,"method":"status","params":{"gpu":5}}\n',
        hello + b'{"id":1,"method":"submit","params":{"cls":"offline","argv":"rm -rf /"}}\n',
        hello + b'{"id":1,"method":"cancel","params":{}}\n',
        hello + b'{"id":1,"method":"events","params":{"limit":-1}}\n',
        b'{"id":1,"method":"status"}\n',  # no hello
        b"\x00\x00\x00\n",
        b"x" * (MAX_REQUEST + 10),  # oversized, no newline
        b'{"id":1,"method":"hel',  # half a frame, then hang up
        b"",  # connect and close
    ]


def _fuzzer(path: str, seed: int, rounds: int, errors: list[str]) -> None:
    rng = random.Random(seed)
    for _ in range(rounds):
        for frame in _fuzz_frames(rng):
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(10)
                s.connect(path)
                with s:
                    s.sendall(frame)
                    s.shutdown(socket.SHUT_WR)
                    data = b""
                    while chunk := s.recv(65536):
                        data += chunk
                for line in data.splitlines():
                    reply = json.loads(line)
                    if "error" not in reply and reply.get("id") != 0:
                        errors.append(f"fuzz frame {frame[:40]!r} got a non-error reply {reply}")
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon hung up on an oversized frame: allowed
            except Exception as exc:
                errors.append(f"fuzzer: {exc!r}")


def _client(path: str, errors: list[str], barrier: threading.Barrier) -> None:
    try:
        barrier.wait(timeout=30)
        with ApiClient.connect(path, timeout_s=30) as api:
            for _ in range(5):
                st = api.call("status")
                if [g["index"] for g in st["gpus"]] != [0, 1]:
                    errors.append(f"bad status {st}")
            if not isinstance(api.call("list")["clients"], list):
                errors.append("bad list")
    except Exception as exc:
        errors.append(f"client: {exc!r}")


def test_100_clients_with_fuzzers(daemon: DaemonProc) -> None:
    errors: list[str] = []
    path = str(daemon.socket)
    barrier = threading.Barrier(100)
    threads = [threading.Thread(target=_client, args=(path, errors, barrier)) for _ in range(100)]
    threads += [threading.Thread(target=_fuzzer, args=(path, seed, 3, errors)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    # The daemon is still healthy and its state untouched by the fuzzing.
    assert daemon.proc is not None
    assert daemon.proc.poll() is None
    assert daemon.call("list", {"all": True})["clients"] == []
    assert daemon.call("status")["daemon"]["ready"] is True


def test_oversized_frame_gets_error_reply(daemon: DaemonProc) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(daemon.socket))
    with s:
        s.sendall(b'{"id":1,"method":"hello","params":{"api_version":1}}\n')
        s.sendall(b'{"id":2,"method":"status","params":{"gpu":"' + b"0" * 10_000 + b'"}}\n')
        f = s.makefile("rb")
        assert "result" in json.loads(f.readline())
        reply = json.loads(f.readline())
    assert reply["error"]["name"] == "TOO_LARGE"
    assert "max_request" in reply["error"]["message"]
