"""The link a collective runs on, and how its bus bandwidth is judged against it.

Within a node GPUs talk over NVLink (`nvidia-smi nvlink -s` lists each GPU's links and their speed
per direction); across nodes over InfiniBand (each port's rate in /sys/class/infiniband/*/ports/*/rate).
All-reduce bus bandwidth as nccl-tests defines it (algbw x 2 (n-1) / n) is what each rank's link carries,
so it is compared with one rank's share of the link: a GPU's NVLink total within a node, and the node's
active InfiniBand ports over its GPUs across nodes. The go-live figure: busbw >= 80% of that link.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
from dataclasses import dataclass

GO_LIVE_FRACTION = 0.8  # the seeds' go-live figure: busbw at least 80% of the link
_GPU = re.compile(r"^GPU (\d+):")
_LINK = re.compile(r"^\s*Link \d+:\s*([\d.]+)\s*GB/s", re.IGNORECASE)
_RATE = re.compile(r"^\s*([\d.]+)\s*Gb/sec")


@dataclass
class Link:
    """One rank's share of a link in Gb/s, where it came from ('named', 'nvlink', 'infiniband') and what was seen."""

    gbps: float
    source: str
    detail: str


def utilization(busbw: float, link_gbps: float) -> float:
    """Bus bandwidth as a fraction of the link (Gb/s both)."""
    if link_gbps <= 0:
        raise ValueError(f"a link of {link_gbps} Gb/s: it must be positive")
    return busbw / link_gbps


def meets_go_live(busbw: float, link_gbps: float, fraction: float = GO_LIVE_FRACTION) -> bool:
    """Whether `busbw` reaches `fraction` of the link (the 80% go-live figure by default)."""
    return utilization(busbw, link_gbps) >= fraction


def parse_nvlink(text: str) -> dict[int, float]:
    """Each GPU's NVLink total in Gb/s per direction from `nvidia-smi nvlink -s` (inactive links, `<inactive>`,
    count nothing); GPUs without an active link are left out."""
    out: dict[int, float] = {}
    gpu = None
    for line in text.splitlines():
        if m := _GPU.match(line):
            gpu = int(m.group(1))
        elif gpu is not None and (m := _LINK.match(line)):
            out[gpu] = out.get(gpu, 0.0) + float(m.group(1)) * 8  # GB/s -> Gb/s
    return {g: v for g, v in out.items() if v > 0}


def nvlink(run=subprocess.run, which=shutil.which) -> Link | None:
    """The slowest GPU's NVLink total on this node, or None without nvidia-smi or active links."""
    if which("nvidia-smi") is None:
        return None
    try:
        proc = run(["nvidia-smi", "nvlink", "-s"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    per_gpu = parse_nvlink(proc.stdout) if proc.returncode == 0 else {}
    if not per_gpu:
        return None
    slowest = min(per_gpu.values())
    return Link(slowest, "nvlink", f"NVLink {slowest:,.0f} Gb/s per direction per GPU ({len(per_gpu)} GPUs with links)")


def parse_ib_rate(text: str) -> float:
    """Gb/s of a port's `rate` file, e.g. '400 Gb/sec (4X NDR)'; 0 where it names none."""
    m = _RATE.match(text)
    return float(m.group(1)) if m else 0.0


def infiniband_ports(root: str = "/sys/class/infiniband") -> list[tuple[str, float]]:
    """(device/port, Gb/s) of every ACTIVE InfiniBand port under `root` (RoCE ports included: the same verbs)."""
    ports = []
    for port in sorted(glob.glob(os.path.join(root, "*", "ports", "*"))):
        try:
            with open(os.path.join(port, "state")) as f:
                state = f.read()
            with open(os.path.join(port, "rate")) as f:
                rate = parse_ib_rate(f.read())
        except OSError:
            continue
        if "ACTIVE" in state.upper() and rate > 0:
            ports.append((f"{port.split(os.sep)[-3]}/{port.split(os.sep)[-1]}", rate))
    return ports


def infiniband(ranks_per_node: int, root: str = "/sys/class/infiniband") -> Link | None:
    """One rank's share of this node's active InfiniBand ports, or None without any."""
    ports = infiniband_ports(root)
    if not ports:
        return None
    total = sum(rate for _, rate in ports)
    share = total / max(1, ranks_per_node)
    return Link(share, "infiniband", f"InfiniBand {len(ports)} active port(s), {total:,.0f} Gb/s in all, "
                                     f"{share:,.0f} Gb/s per rank over {ranks_per_node}")


def named(gbps: float) -> Link:
    return Link(gbps, "named", f"--link-gbps {gbps:g}")
