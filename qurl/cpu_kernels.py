"""The CPU kernels both processes use (csrc/decode_cpu.cpp). The torch engine's: RMSNorm, per-token int8 quantization,
SiLU x up, rotary with the cache write, decode attention, the temperature draw (sampling.py), an int8 linear by oneDNN's
GEMM in one call (quantize, GEMM, dequantize), and an int8 GEMM for decode batches (AMX tiles, AVX-512 VNNI or AVX2).
The learner's: the log-prob head's forward and backward (learner/logprobs.py), RMSNorm's, SwiGLU's and rotary's
(learner/fused.py), attention's forward and backward (learner/attention.py), a transpose for weight gradients
(learner/linear.py), and the per-row int8 quantization of a weight push (qurl/quant/absmax.py). One compiled module,
built once per CPU kind.

Built once per CPU kind with the machine's own vector instructions (`-march=native`), at set-up
(`python -m qurl.cpu_kernels`) or on first use; where no compiler is found the
engine keeps its torch operators, with one warning line. At decode shapes each kernel replaces a
chain of small torch ops whose dispatch costs more than their arithmetic (RESULTS §13).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import sys
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).parent / "csrc" / "decode_cpu.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]  # no fused multiply-adds: the torch ops round each op
log = logging.getLogger(__name__)


def build_dir() -> Path:
    """Where this build lives: `QURL_KERNELS_DIR` or ~/.cache/qurl/kernels, one folder per CPU flag set, torch and
    source (two checkouts of different sources would otherwise rebuild over each other's module)."""
    key = hashlib.sha256((" ".join(sorted(cpu_flags())) + torch.__version__).encode() + SOURCE.read_bytes())
    key = key.hexdigest()[:12]
    base = os.environ.get("QURL_KERNELS_DIR") or Path.home() / ".cache" / "qurl" / "kernels"
    return Path(base) / key


@functools.cache
def kernels() -> ModuleType | None:
    """The compiled module, built if needed; None (and one warning) where it cannot be built."""
    if os.environ.get("QURL_CPU_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        path = build_dir()
        path.mkdir(parents=True, exist_ok=True)
        if not (path / "qurl_decode_cpu.so").exists():  # a first use would otherwise stall for a minute unexplained
            log.warning("building the CPU kernels for this CPU kind in %s (once, about a minute)", path)
        return load("qurl_decode_cpu", [str(source_copy(path))], extra_cflags=FLAGS, build_directory=str(path))
    except Exception as e:  # no compiler, no ninja, a read-only cache: the torch operators still work
        log.warning("qurl CPU kernels unavailable (%s); the torch engine uses torch operators", str(e).splitlines()[0])
        return None


def source_copy(path: Path) -> Path:
    """The source, copied into its build folder: ninja's build file names the source's path, so checkouts of the same
    source at different paths would each rebuild the shared module (~40 s) if they built from their own copy."""
    copy, source = path / SOURCE.name, SOURCE.read_bytes()
    if not copy.exists() or copy.read_bytes() != source:
        tmp = path / f".{SOURCE.name}.{os.getpid()}"
        tmp.write_bytes(source)
        os.replace(tmp, copy)  # atomic: a process building beside this one reads one whole file or the other
    return copy


def usable(x: torch.Tensor) -> ModuleType | None:
    """The kernels if they apply to `x`: a CPU fp32 or bf16 tensor."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return None
    return kernels()


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (empty where /proc/cpuinfo is absent); read once, every int8 linear asks."""
    if not os.path.exists("/proc/cpuinfo"):
        return frozenset()
    with open("/proc/cpuinfo") as f:
        return frozenset(next((line.split(":", 1)[1] for line in f if line.startswith("flags")), "").split())


def int8_gemm_kernels() -> ModuleType | None:
    """The kernels if they have an int8 GEMM for this CPU (AMX, AVX-512 VNNI or AVX2): up to int8_gemm_max_rows rows
    it is faster than oneDNN's qlinear, or as fast (benchmarks/decode.py --gemm, RESULTS §13)."""
    k = kernels()
    return k if k is not None and k.int8_gemm else None


# The x86 CPU kinds qurl meets, as -march targets: the source compiles for each, whatever this machine is (each
# kind builds only its own paths with -march=native, so an error on another kind's path shows nowhere else).
CPU_KINDS = {"no-avx2": "x86-64", "avx2": "x86-64-v3", "avx512-vnni-bf16": "cooperlake"}


def check_cpu_kinds() -> list[str]:
    """The CPU kinds whose compile of the source fails, each with its first error line (g++ -fsyntax-only, parallel)."""
    import subprocess
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    includes = [f"-isystem{p}" for p in [*include_paths(), sysconfig.get_paths()["include"]]]
    cmd = ["g++", "-fsyntax-only", "-std=c++20", "-fopenmp", "-DTORCH_EXTENSION_NAME=check", *includes, str(SOURCE)]
    runs = {
        kind: subprocess.Popen([*cmd, f"-march={march}"], stderr=subprocess.PIPE, text=True)
        for kind, march in CPU_KINDS.items()
    }
    failed = []
    for kind, proc in runs.items():
        errors = [line for line in proc.communicate()[1].splitlines() if "error" in line]
        if proc.returncode != 0:
            failed.append(f"{kind} (-march={CPU_KINDS[kind]}): {errors[0] if errors else 'g++ failed'}")
    return failed


if __name__ == "__main__":
    if sys.argv[1:] == ["--check-cpu-kinds"]:
        if platform.machine() not in ("x86_64", "AMD64"):
            sys.exit(print(f"--check-cpu-kinds: skipped, the kinds are x86 and this machine is {platform.machine()}"))
        failures = check_cpu_kinds()
        sys.exit("\n".join(f"{SOURCE.name} does not compile for {f}" for f in failures) if failures else 0)
    sys.exit(0 if kernels() is not None else f"could not build {SOURCE} in {build_dir()}")
