"""qurl/supervisor/environment.py: the machine checked before a run starts. The driver check on version strings
as NVIDIA and pip report them (no GPU here); /dev/shm and the disk through a real qurl-async start on a model whose
safetensors header claims a 1 TiB tensor (a sparse file: no disk is used). Each refusal is one line and exit 2."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
from launch import refusal, start

from qurl.supervisor.environment import checkpoint_bytes, driver_problem, model_tensors, push_bytes

EXIT_INPUT = 2
TIB = 1 << 40


@pytest.mark.parametrize(
    "driver, torch_version, cuda, sglang, needs, line",
    [
        (None, "2.14.1", "13.0", None, False, "this machine has no CUDA device (no NVIDIA driver: nvidia-smi is not"),
        ("580.65.06", "2.13.0+cpu", None, None, False, "torch 2.13.0+cpu is a CPU build"),
        ("580.65.06", "2.14.1", "13.0", None, True, "rollout.engine=sglang, but sglang is not installed"),
        (
            "580.82.07",
            "2.11.0+cu130",
            "13.0",
            ("0.5.23", "2.14.1"),
            True,
            "sglang 0.5.23 needs torch==2.14.1, but this environment has torch 2.11.0+cu130",
        ),
        (
            "535.104.05",
            "2.14.1",
            "13.0",
            ("0.5.23", "2.14.1"),
            True,
            "NVIDIA driver 535.104.05 is older than 580.65.06, the oldest that runs CUDA 13 (torch 2.14.1 and "
            "sglang 0.5.23, built for CUDA 13.0)",
        ),
        ("535.104.05", "2.11.0+cu130", "13.0", None, False, "NVIDIA driver 535.104.05 is older than 580.65.06"),
        ("570.133.20", "2.7.0+cu128", "12.8", None, False, ""),  # CUDA 12 runs on any 525.60.13 or newer
        ("580.95.05", "2.14.1", "13.0", ("0.5.23", "2.14.1"), True, ""),
    ],
)
def test_driver_against_the_cuda_of_torch_and_sglang(driver, torch_version, cuda, sglang, needs, line):
    problem = driver_problem(driver, torch_version, cuda, sglang, needs)
    assert (line in problem) if line else problem == "", problem
    assert "\n" not in problem


def test_gpus_asked_of_a_machine_without_a_driver_are_refused_before_start(demo_dir, tmp_path):
    proc = start(demo_dir, tmp_path / "run", 2, "cluster.learner_gpus=[0]")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INPUT, out
    assert refusal(out).startswith(
        "qurl-async: config error: cluster.learner_gpus=[0] but this machine has no CUDA device (no NVIDIA driver"
    ), out


def huge_model(demo_dir: Path, tmp_path: Path) -> Path:
    """The demo model plus a safetensors file whose header claims a 1 TiB fp32 tensor (sparse: no disk used)."""
    model = tmp_path / "huge-model"
    shutil.copytree(demo_dir / "model", model)
    header = json.dumps({"huge.weight": {"dtype": "F32", "shape": [1 << 20, 1 << 18], "data_offsets": [0, TIB]}})
    path = model / "model-extra.safetensors"
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode())
        f.truncate(8 + len(header) + TIB)
    return model


def test_a_disk_too_small_for_the_checkpoints_is_refused_before_start(demo_dir, tmp_path):
    run_dir = tmp_path / "run"
    proc = start(demo_dir, run_dir, 2, f"model.path={huge_model(demo_dir, tmp_path)}")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INPUT, out
    line = refusal(out)
    assert f"run.dir='{run_dir}'" in line and "but checkpoint.keep=2 needs" in line, line
    assert "needs 10995.1 GB (3 checkpoints of 3298.5 GB, fp32 weights and AdamW state, and hf/)" in line, line
    assert not run_dir.exists()  # refused before anything was written
    print(line)


def test_a_dev_shm_too_small_for_the_sglang_push_is_refused_before_start(demo_dir, tmp_path):
    run_dir = tmp_path / "run"
    model = huge_model(demo_dir, tmp_path)
    proc = start(demo_dir, run_dir, 2, f"model.path={model}", "rollout.engine=sglang", "rollout.dtype=bfloat16")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_INPUT, out
    line = refusal(out)
    assert "/dev/shm has" in line and "sync.transport=zmq hands SGLang each full weight push" in line, line
    assert (
        "(549.8 GB for this model, rollout.quant=int8); start the container with --shm-size=1100g or --ipc=host" in line
    )
    print(line)


def test_sizes_at_the_recipes_scale():
    """The estimates the checks use, at the 7B FP8 recipe's shapes (Qwen2.5-7B: 28 layers, hidden 3584, intermediate
    18944, vocabulary 152,064, untied head): an 8.7 GB push and a 91 GB checkpoint (field notes and README)."""
    h, inter, vocab, kv = 3584, 18944, 152064, 512
    tensors = {"model.embed_tokens.weight": ("BF16", (vocab, h)), "lm_head.weight": ("BF16", (vocab, h))}
    for i in range(28):
        p = f"model.layers.{i}."
        tensors.update(
            {
                p + "self_attn.q_proj.weight": ("BF16", (h, h)),
                p + "self_attn.k_proj.weight": ("BF16", (kv, h)),
                p + "self_attn.v_proj.weight": ("BF16", (kv, h)),
                p + "self_attn.o_proj.weight": ("BF16", (h, h)),
                p + "mlp.gate_proj.weight": ("BF16", (inter, h)),
                p + "mlp.up_proj.weight": ("BF16", (inter, h)),
                p + "mlp.down_proj.weight": ("BF16", (h, inter)),
            }
        )
    assert push_bytes(tensors, "fp8", "bfloat16") / 1e9 == pytest.approx(8.7, abs=0.1)
    assert checkpoint_bytes(tensors) / 1e9 == pytest.approx(91, abs=1)


def test_the_header_reader_sees_what_the_folder_holds(demo_dir):
    from safetensors.torch import load_file

    loaded = load_file(str(demo_dir / "model" / "model.safetensors"))
    assert model_tensors(str(demo_dir / "model")) == {
        k: ({"torch.float32": "F32", "torch.bfloat16": "BF16"}[str(v.dtype)], tuple(v.shape)) for k, v in loaded.items()
    }
