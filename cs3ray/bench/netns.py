"""An emulated network link for benchmarks: two network namespaces joined by a veth pair shaped with tc.

Each end's egress goes through a token bucket (tbf) at the link's rate, so each direction gets
the rate on its own, like a full-duplex link. Both veth ends are created inside the namespaces,
so deleting the namespaces removes everything; namespaces left by a killed run (their creator's
pid is gone) are deleted before a new link is made. Needs root and iproute2.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from types import FrameType, TracebackType
from typing import Any

PREFIX = "cs3comm-"
ADDRS = ("10.250.0.1", "10.250.0.2")


def unavailable() -> str | None:
    """Why an emulated link cannot be made on this host, or None."""
    if os.geteuid() != 0:
        return "the emulated link needs root (network namespaces and tc); skipped"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the emulated link needs iproute2's `{tool}`, which is not installed; skipped"
    return None


def _run(*cmd: str) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if proc.returncode:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ours() -> list[str]:
    """Namespaces this module created that still exist."""
    names = [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]
    return [n for n in names if n.startswith(PREFIX)]


def clean_stale() -> list[str]:
    """Delete the namespaces (and with them the veth ends) of runs whose process is gone."""
    removed = []
    for name in ours():
        pid = name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            removed.append(name)
    return removed


def tbf_burst_bytes(gbps: float) -> int:
    """Token bucket depth: the bytes of 4 ms at the rate (one timer tick at HZ=250), at least 64 KiB."""
    return max(64 * 1024, int(gbps * 1e9 / 8 * 0.004))


class Link:
    """`with Link(1.0) as link:` two namespaces `link.ns` whose veth ends `link.dev` have `ADDRS`."""

    def __init__(self, gbps: float) -> None:
        pid = os.getpid()
        self.gbps = gbps
        self.ns = (f"{PREFIX}{pid}-a", f"{PREFIX}{pid}-b")
        self.dev = (f"c3c{pid}a", f"c3c{pid}b")  # interface names: at most 15 characters
        self._old_term: Any = None

    def exec_prefix(self, side: int) -> list[str]:
        """The command prefix that runs a program inside namespace `side` (0 or 1)."""
        return ["ip", "netns", "exec", self.ns[side]]

    def __enter__(self) -> Link:
        clean_stale()
        # A SIGTERM must still run the clean-up in __exit__.
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            try:
                self._old_term = signal.signal(signal.SIGTERM, _terminate)
            except ValueError:  # not the main thread: stale namespaces are cleaned by the next run
                pass
        try:
            for ns in self.ns:
                _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", self.dev[0], "netns", self.ns[0], "type", "veth",
                 "peer", "name", self.dev[1], "netns", self.ns[1])
            rate = f"{self.gbps * 1000:g}mbit"
            for ns, dev, addr in zip(self.ns, self.dev, ADDRS, strict=True):
                _run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _run("ip", "-n", ns, "link", "set", dev, "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", str(tbf_burst_bytes(self.gbps)), "latency", "50ms")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Delete both namespaces (which deletes the veth pair)."""
        for ns in self.ns:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
