"""`cs3 validate`'s parts that need no GPU: nccl-tests' busbw and the 80% go-live judgement, the link detected
from `nvidia-smi nvlink -s` text and an InfiniBand sysfs tree, NVML readings judged (a stand-in pynvml module:
no GPU exists here), and random 4 KiB O_DIRECT read IOPS measured on a real file."""

from __future__ import annotations

import math
import os
import subprocess
from types import SimpleNamespace

import pytest

from cs3ray.bench import iops, links, nvml_health, validate
from cs3ray.bench.comm import busbw_gbps

NVLINK_S = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)
\t Link 0: 26.562 GB/s
\t Link 1: 26.562 GB/s
\t Link 2: <inactive>
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)
\t Link 0: 26.562 GB/s
GPU 2: NVIDIA A10 (UUID: GPU-cccc)
\t Link 0: <inactive>
"""


def test_busbw_is_algbw_times_two_n_minus_one_over_n():
    # 1 GB in 1 s is 8 Gb/s of algbw; 8 ranks carry 2 * 7 / 8 of it on each link.
    assert busbw_gbps(1e9, 1.0, 8) == pytest.approx(8 * 2 * 7 / 8)
    assert busbw_gbps(1e9, 1.0, 2) == pytest.approx(8.0)  # two ranks: algbw itself
    assert busbw_gbps(1e9, 1.0, 1) == 0.0


def test_the_go_live_judgement_is_eighty_percent_of_the_link():
    assert links.meets_go_live(320.0, 400.0) and not links.meets_go_live(319.9, 400.0)
    assert links.utilization(200.0, 400.0) == 0.5
    with pytest.raises(ValueError):
        links.utilization(1.0, 0.0)
    # The item: busbw rounds over a named link below 80% FAIL as `not met`; above, PASS.
    link = links.named(400.0)
    slow = validate.judged("collective_busbw", "of link", "bw_utilization", validate.TARGETS["bw_utilization"],
                           [b / link.gbps for b in (250.0, 252.0, 249.0)], link.detail, difference=False)
    fast = validate.judged("collective_busbw", "of link", "bw_utilization", validate.TARGETS["bw_utilization"],
                           [b / link.gbps for b in (360.0, 362.0, 361.0)], link.detail, difference=False)
    assert (slow.passed, slow.verdict, slow.status) == (False, "not met", "fail")
    assert (fast.passed, fast.verdict, fast.status) == (True, "met", "pass")


def test_nvlink_totals_per_gpu_from_nvidia_smi():
    per_gpu = links.parse_nvlink(NVLINK_S)
    assert per_gpu == {0: pytest.approx(2 * 26.562 * 8), 1: pytest.approx(26.562 * 8)}  # GPU 2: no active link
    seen = links.nvlink(run=lambda *a, **k: subprocess.CompletedProcess(a, 0, NVLINK_S, ""), which=lambda _: "/bin/x")
    assert seen.gbps == pytest.approx(26.562 * 8) and seen.source == "nvlink"  # the slowest GPU's
    assert links.nvlink(which=lambda _: None) is None
    assert links.nvlink(run=lambda *a, **k: subprocess.CompletedProcess(a, 0, "", ""), which=lambda _: "/x") is None


def test_infiniband_share_per_rank_from_sysfs(tmp_path):
    def port(dev: str, n: int, rate: str, state: str) -> None:
        d = tmp_path / dev / "ports" / str(n)
        d.mkdir(parents=True)
        (d / "rate").write_text(rate + "\n")
        (d / "state").write_text(state + "\n")

    port("mlx5_0", 1, "400 Gb/sec (4X NDR)", "4: ACTIVE")
    port("mlx5_1", 1, "400 Gb/sec (4X NDR)", "4: ACTIVE")
    port("mlx5_2", 1, "200 Gb/sec (4X HDR)", "1: DOWN")
    assert links.parse_ib_rate("100 Gb/sec (4X EDR)") == 100.0 and links.parse_ib_rate("garbage") == 0.0
    assert links.infiniband_ports(str(tmp_path)) == [("mlx5_0/1", 400.0), ("mlx5_1/1", 400.0)]
    link = links.infiniband(8, str(tmp_path))
    assert link.gbps == 100.0 and link.source == "infiniband"  # 800 Gb/s over 8 GPUs
    assert links.infiniband(8, str(tmp_path / "none")) is None


class _FakeNvml(SimpleNamespace):
    """pynvml's calls as the real module names them, over two devices' readings (no GPU can exist here)."""

    NVML_TEMPERATURE_GPU, NVML_TEMPERATURE_THRESHOLD_SLOWDOWN = 0, 1
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
    NVML_MEMORY_ERROR_TYPE_CORRECTED, NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC = 0, 1, 0

    def __init__(self, devices):
        super().__init__(devices=devices, calls=[])

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self):
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.devices[i]

    def nvmlDeviceGetName(self, h):
        return h["name"].encode()

    def nvmlDeviceGetTemperature(self, h, sensor):
        return h["temp"]

    def nvmlDeviceGetTemperatureThreshold(self, h, kind):
        return 87

    def nvmlDeviceGetPowerUsage(self, h):
        return 350_000

    def nvmlDeviceGetEnforcedPowerLimit(self, h):
        return 700_000

    def nvmlDeviceGetClockInfo(self, h, clock):
        return 1980 if clock == self.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetMaxClockInfo(self, h, clock):
        return 1980

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        if h["ecc"] is None:
            raise RuntimeError("NVMLError_NotSupported")
        return h["ecc"] if kind == self.NVML_MEMORY_ERROR_TYPE_UNCORRECTED else 3

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return h["throttle"]


def test_nvml_readings_and_what_counts_as_a_fault():
    nvml = _FakeNvml([{"name": "H100", "temp": 41, "ecc": 0, "throttle": 0x1},
                      {"name": "H100", "temp": 90, "ecc": 2, "throttle": nvml_health.HW_THERMAL},
                      {"name": "RTX", "temp": 50, "ecc": None, "throttle": 0}])
    healthy, hot, consumer = nvml_health.read_devices(nvml)
    assert nvml.calls == ["init", "shutdown"]
    assert healthy["power_w"] == 350 and healthy["power_limit_w"] == 700 and healthy["sm_clock_mhz"] == 1980
    assert nvml_health.faults(healthy) == [] and "41 C" in nvml_health.summary(healthy)
    assert nvml_health.faults(hot) == ["2 uncorrected ECC errors", "90 C at or past its slowdown 87 C",
                                       "clocks held down: hw thermal"]
    assert consumer["ecc_uncorrected"] is None and nvml_health.faults(consumer) == []  # unsupported is no fault


def test_random_4k_reads_with_o_direct_on_a_real_file(tmp_path):
    if iops.filesystem(str(tmp_path)) in iops.MEMORY_FS:
        pytest.skip("tmp_path is on tmpfs here")
    rates, detail = iops.measure(str(tmp_path), 16, 0.3, 2, procs=2, threads=2)
    assert len(rates) == 2 and all(r > 0 and math.isfinite(r) for r in rates)
    assert "O_DIRECT" in detail and not os.listdir(tmp_path)  # the probe file is removed


def test_memory_filesystems_are_not_measured(tmp_path):
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("22 1 0:21 / / rw - ext4 /dev/vda rw\n"
                         f"30 22 0:25 / {tmp_path}/ram rw,nosuid - tmpfs tmpfs rw\n")
    assert iops.filesystem(str(tmp_path / "ram" / "x"), str(mountinfo)) == "tmpfs"
    assert iops.filesystem(str(tmp_path / "disk"), str(mountinfo)) == "ext4"
    if os.path.isdir("/dev/shm") and iops.filesystem("/dev/shm") == "tmpfs":
        with pytest.raises(iops.Unmeasurable, match="tmpfs"):
            iops.measure(f"/dev/shm/cs3-test-{os.getpid()}", 4, 0.1, 1)
        os.rmdir(f"/dev/shm/cs3-test-{os.getpid()}")


def test_unmeasurable_items_never_pass():
    check = validate._iops({"checkpoint storage": "s3://bucket/runs"}, validate.LEVELS["quick"])
    assert (check.passed, check.status, check.verdict, check.figure) == (False, "not measured", "not measured", None)
    assert "local filesystem" in check.detail
    gpu = validate._gpu_health({})
    assert (gpu.passed, gpu.status) == (False, "not measured") and "no GPU" in gpu.detail
    r = {"level": "quick", "passed": False, "failed": [], "not_measured": ["gpu_health"],
         "checks": {"gpu_health": validate.asdict(gpu)}}
    assert validate.rows(r)[0][1] == "NOT MEASURED"
    assert validate.markdown(r).startswith("# cs3 validate (quick): no item failed, 1 not measured")
