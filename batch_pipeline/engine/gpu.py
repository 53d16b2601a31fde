"""GPU utilisation and memory during inference, sampled with NVML (nvidia-ml-py) where a GPU exists.

On machines without an NVIDIA GPU (or without nvidia-ml-py) every figure is simply absent.
"""

from __future__ import annotations

import threading
from typing import Any


def _nvml() -> Any | None:
    try:
        import pynvml  # provided by the nvidia-ml-py package

        pynvml.nvmlInit()
        return pynvml if pynvml.nvmlDeviceGetCount() > 0 else None
    except Exception:  # noqa: BLE001 - no driver, no library or no device: no GPU figures
        return None


class GpuSampler:
    """Samples every visible GPU's utilisation and memory in a background thread."""

    def __init__(self, interval: float = 2.0):
        self.interval = interval
        self._nvml = _nvml()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._util: list[float] = []
        self._peak_mem = 0

    def __enter__(self) -> "GpuSampler":
        if self._nvml is not None:
            self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        nvml = self._nvml
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        while not self._stop.wait(self.interval):
            try:
                util = [nvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles]
                used = sum(nvml.nvmlDeviceGetMemoryInfo(h).used for h in handles)
            except Exception:  # noqa: BLE001 - a transient NVML error loses one sample only
                continue
            self._util.append(sum(util) / len(util))
            self._peak_mem = max(self._peak_mem, used)

    def figures(self) -> dict[str, Any]:
        if self._nvml is None:
            return {}
        nvml = self._nvml
        count = nvml.nvmlDeviceGetCount()
        name = nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(0))
        return {
            "gpu_count": count,
            "gpu_name": name.decode() if isinstance(name, bytes) else str(name),
            "gpu_utilization_mean_pct": round(sum(self._util) / len(self._util), 1) if self._util else 0.0,
            "gpu_memory_peak_mb": round(self._peak_mem / 2**20, 1),
        }
