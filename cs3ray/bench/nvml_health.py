"""GPU health through NVML (the `pynvml` module of nvidia-ml-py): ECC errors, temperature, power and clocks.

A GPU is unhealthy when it has uncorrected ECC errors since boot, runs at or past its slowdown
temperature, or its clocks are held down by hardware (thermal or power-brake slowdown). A reading
the device does not support (ECC on consumer cards) is None, never a fault.
"""

from __future__ import annotations

from typing import Any

# nvmlClocksThrottleReasons bits that mean the hardware is holding the clocks down (nvml.h).
HW_SLOWDOWN, SW_THERMAL, HW_THERMAL, HW_POWER_BRAKE = 0x8, 0x20, 0x40, 0x80
_SLOWDOWN_BITS = {HW_SLOWDOWN: "hw slowdown", SW_THERMAL: "sw thermal", HW_THERMAL: "hw thermal",
                  HW_POWER_BRAKE: "power brake"}
DEFAULT_SLOWDOWN_C = 85  # where the device does not report its own slowdown threshold


def _read(fn, *args) -> Any:
    """`fn(*args)`, or None where the device does not support that reading."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - pynvml raises an NVMLError subclass per cause; any means "not read"
        return None


def read_devices(nvml: Any) -> list[dict[str, Any]]:
    """Every GPU NVML sees on this node, as a dict of its readings. `nvml` is the pynvml module."""
    # nvidia-ml-py 12.535 renamed "throttle" reasons "clocks event" reasons; older releases have only the first.
    reasons = (getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
               or getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None))
    nvml.nvmlInit()
    try:
        out = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(h)
            power = _read(nvml.nvmlDeviceGetPowerUsage, h)
            limit = _read(nvml.nvmlDeviceGetEnforcedPowerLimit, h)
            out.append({
                "index": i, "name": name.decode() if isinstance(name, bytes) else str(name),
                "temperature_c": _read(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU),
                "slowdown_c": _read(nvml.nvmlDeviceGetTemperatureThreshold, h,
                                    nvml.NVML_TEMPERATURE_THRESHOLD_SLOWDOWN),
                "power_w": None if power is None else power / 1000,  # NVML reports milliwatts
                "power_limit_w": None if limit is None else limit / 1000,
                "sm_clock_mhz": _read(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_SM),
                "sm_clock_max_mhz": _read(nvml.nvmlDeviceGetMaxClockInfo, h, nvml.NVML_CLOCK_SM),
                "mem_clock_mhz": _read(nvml.nvmlDeviceGetClockInfo, h, nvml.NVML_CLOCK_MEM),
                "ecc_uncorrected": _read(nvml.nvmlDeviceGetTotalEccErrors, h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                         nvml.NVML_VOLATILE_ECC),
                "ecc_corrected": _read(nvml.nvmlDeviceGetTotalEccErrors, h, nvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                                       nvml.NVML_VOLATILE_ECC),
                "throttle_reasons": _read(reasons, h) if reasons else None,
            })
        return out
    finally:
        nvml.nvmlShutdown()


def faults(device: dict[str, Any]) -> list[str]:
    """What is wrong with one GPU's readings (empty: healthy)."""
    out = []
    if device["ecc_uncorrected"]:
        out.append(f"{device['ecc_uncorrected']} uncorrected ECC errors")
    slowdown = device["slowdown_c"] or DEFAULT_SLOWDOWN_C
    if device["temperature_c"] is not None and device["temperature_c"] >= slowdown:
        out.append(f"{device['temperature_c']} C at or past its slowdown {slowdown} C")
    reasons = device["throttle_reasons"] or 0
    held = [why for bit, why in _SLOWDOWN_BITS.items() if reasons & bit]
    if held:
        out.append("clocks held down: " + ", ".join(held))
    return out


def summary(device: dict[str, Any]) -> str:
    """One GPU's readings in a line."""
    def val(key: str, unit: str, fmt: str = "{:.0f}") -> str:
        return "n/a" if device[key] is None else fmt.format(device[key]) + unit
    return (f"GPU {device['index']} {device['name']}: {val('temperature_c', ' C')}, {val('power_w', ' W')} of "
            f"{val('power_limit_w', ' W')}, SM {val('sm_clock_mhz', ' MHz')} of {val('sm_clock_max_mhz', ' MHz')}, "
            f"ECC {val('ecc_uncorrected', ' uncorrected', '{}')} / {val('ecc_corrected', ' corrected', '{}')}")


def node_health() -> list[dict[str, Any]] | str:
    """This node's GPUs read through pynvml, or why they cannot be (the module missing, NVML failing)."""
    try:
        import pynvml
    except ImportError:
        return "pynvml is not installed (pip install nvidia-ml-py)"
    try:
        return read_devices(pynvml)
    except Exception as exc:  # noqa: BLE001 - no driver, no library: the reason is the answer
        return f"NVML: {type(exc).__name__}: {exc}"
