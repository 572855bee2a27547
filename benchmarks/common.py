"""What every benchmark reports about the machine it ran on (design.md §9)."""
import os
import platform

import torch


def machine_info(**extra: str) -> dict:
    """CPU model, core count, GPU, torch and Python versions, plus any library versions the caller adds."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "torch": torch.__version__,
            "python": platform.python_version(), **extra}
