"""Config schema: recipes load, bad values stop with exit 2 and one line naming the key."""

import os
import subprocess
import sys

import pytest
import torch
import yaml
from conftest import GPU_SGLANG

from qurl.config import ConfigError, get, int8_lm_head, load_config, rollout_dtype, to_yaml
from qurl.hardware import native_bf16

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = [
    os.path.join(ROOT, "configs", f) for f in sorted(os.listdir(os.path.join(ROOT, "configs"))) if f.endswith(".yaml")
]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    prog, *rest = args
    script = os.path.join(os.path.dirname(sys.executable), prog)  # the installed console script
    return subprocess.run([script, *rest], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_every_shipped_config_validates(path):
    cfg = load_config(path, check_paths=False)
    assert get(cfg, "algo.loss") in ("ppo", "decoupled", "tis", "acr")


def test_recipes_match_the_paper_settings():
    ds = load_config(os.path.join(ROOT, "configs/deepscaler-1.5b-int8.yaml"), check_paths=False)
    assert (get(ds, "rollout.quant"), get(ds, "algo.loss"), get(ds, "algo.kl_coef")) == ("int8", "acr", 1e-3)
    assert get(ds, "quant.invariant_scaling.s") == 1.5
    assert (len(ds.cluster.rollout_gpus), len(ds.cluster.learner_gpus)) == (4, 4)
    dapo = load_config(os.path.join(ROOT, "configs/dapo-7b-fp8.yaml"), check_paths=False)
    assert (get(dapo, "algo.eps_low"), get(dapo, "algo.eps_high")) == (0.2, 0.28)
    assert get(dapo, "algo.dynamic_sampling") and get(dapo, "algo.overlong.enable")
    assert (get(dapo, "rollout.quant"), get(dapo, "quant.fp8_granularity"), get(dapo, "algo.kl_coef")) == (
        "fp8",
        "block",
        0.0,
    )


def test_overrides_apply_and_async_is_spelled_async():
    cfg = load_config(None, ["async.max_staleness=0", "rollout.quant=none", "train.lr=3e-4"], check_paths=False)
    assert get(cfg, "async.max_staleness") == 0 and get(cfg, "rollout.quant") == "none"
    assert get(cfg, "train.lr") == pytest.approx(3e-4)
    text = to_yaml(cfg)
    assert "\nasync:\n  max_staleness: 0\n" in text and "async_" not in text
    assert load_config(None, [], check_paths=False) is not None
    reloaded = yaml.safe_load(text)
    assert reloaded["async"] == {"max_staleness": 0, "wait_timeout_s": 3600.0}


@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.quant=int4", "rollout.quant"),
        ("algo.eps_low=-0.1", "algo.eps_low"),
        ("algo.eps_high=-1", "algo.eps_high"),
        ("async.max_staleness=-1", "async.max_staleness"),
        ("rollout.n_samples=1", "rollout.n_samples"),
        ("algo.loss=grpo", "algo.loss"),
        ("train.lr=abc", "train.lr"),
        ("rollout.bogus=3", "rollout.bogus"),
        ("bogus.key=3", "bogus"),
        ("quant.invariant_scaling.s=0", "quant.invariant_scaling.s"),
        ("quant.invariant_scaling.targets=[qkv,attn]", "quant.invariant_scaling.targets"),
        ("transport.weights=tcp://0.0.0.0:5000", "transport.weights"),
        ("transport.control=http://x", "transport.control"),
        ("reward.name=os.system", "reward.name"),
        ("rollout.sampling.top_p=0", "rollout.sampling.top_p"),
        ("train.mini_batches=64", "train.mini_batches"),
        ("sync.full_every=0", "sync.full_every"),
        ("rollout.engine=sglang", "rollout.dtype"),  # the demo's float32 with a quantized SGLang engine
        ("train.lr=inf", "train.lr"),
        ("train.lr=nan", "train.lr"),
        ("algo.drift_kl_threshold=inf", "algo.drift_kl_threshold"),
        ("rollout.mem_fraction=nan", "rollout.mem_fraction"),
        ("data.train_files=a.jsonl", "data.train_files"),
        ("quant.lm_head=maybe", "quant.lm_head"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(os.path.join(ROOT, "configs/demo-cpu.yaml"), [override], check_paths=False)
    message = str(err.value)
    assert key in message and "\n" not in message


def test_non_loopback_is_allowed_with_a_secret():
    cfg = load_config(None, ["transport.weights=tcp://10.0.0.5:5000", "transport.secret=s3cret"], check_paths=False)
    assert get(cfg, "transport.weights").startswith("tcp://10.")


def test_missing_model_folder_and_data_files(tmp_path):
    with pytest.raises(ConfigError, match="model.path"):
        load_config(None, [f"model.path={tmp_path / 'nope'}"])
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ConfigError, match="data.train_files"):
        load_config(None, [f"model.path={tmp_path}", f"data.train_files=[{tmp_path / 'missing.jsonl'}]"])


def test_bad_yaml_files(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rollout: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad), check_paths=False)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("rollout:\n  quantization: int8\n")
    with pytest.raises(ConfigError, match="rollout.quantization"):
        load_config(str(unknown), check_paths=False)
    with pytest.raises(ConfigError, match="no such file"):
        load_config(str(tmp_path / "none.yaml"))


@pytest.mark.parametrize("prog", ["qurl-async", "qurl-learner", "qurl-rollout-server"])
def test_cli_print_config_and_exit_codes(prog):
    ok = run_cli(prog, "--config", "configs/demo-cpu.yaml", "--print-config", "async.max_staleness=1")
    assert ok.returncode == 0, ok.stderr
    assert yaml.safe_load(ok.stdout)["async"]["max_staleness"] == 1
    bad = run_cli(prog, "--config", "configs/demo-cpu.yaml", "--print-config", "rollout.quant=int4")
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "rollout.quant" in lines[0] and "none, int8, fp8" in lines[0]


@pytest.mark.parametrize(
    "override, key",
    [
        ("rollout.quant=int4", "rollout.quant"),
        ("algo.eps_low=-0.2", "algo.eps_low"),
        ("async.max_staleness=-1", "async.max_staleness"),
        ("rollout.n_samples=1", "rollout.n_samples"),
        ("rollout.quantisation=int8", "rollout.quantisation"),
        ("train.lr=fast", "train.lr"),
        ("model.path=/nonexistent/model", "model.path"),
    ],
)
def test_qurl_async_refuses_each_bad_override_with_exit_2(override, key):
    bad = run_cli("qurl-async", "--config", "configs/demo-cpu.yaml", override)
    lines = bad.stderr.strip().splitlines()
    assert bad.returncode == 2 and len(lines) == 1 and key in lines[0], bad.stderr


# -- sync.transport: zmq anywhere, cuda-ipc and nccl for SGLang replicas on GPUs ------------------------------------


def _cfg(*overrides):
    return load_config(None, list(overrides), check_paths=False)


def error(*overrides) -> str:
    with pytest.raises(ConfigError) as info:
        _cfg(*overrides)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_zmq_is_the_default_and_the_only_transport_on_cpu():
    assert _cfg().sync.transport == "zmq"
    for kind in ("cuda-ipc", "nccl"):
        assert "needs rollout.engine=sglang" in error(f"sync.transport={kind}")
        assert "on CPU use sync.transport=zmq" in error(
            f"sync.transport={kind}", "rollout.engine=sglang", "rollout.dtype=bfloat16"
        )
    assert "choose one of: zmq, cuda-ipc, nccl" in error("sync.transport=gloo")


def test_int8_lm_head_is_on_by_default_where_it_can_be():
    """quant.lm_head null: on for the torch engine's int8 rollout, off elsewhere; an explicit choice wins."""
    assert get(_cfg(), "quant.lm_head") is None
    assert int8_lm_head(_cfg("rollout.engine=torch", "rollout.quant=int8"))
    assert not int8_lm_head(_cfg("rollout.engine=torch", "rollout.quant=int8", "quant.lm_head=false"))
    assert not int8_lm_head(_cfg("rollout.engine=torch", "rollout.quant=none"))
    assert not int8_lm_head(_cfg("rollout.engine=sglang", "rollout.quant=int8", "rollout.dtype=bfloat16"))
    assert "quant.lm_head=true needs rollout.quant=int8" in error("rollout.quant=none", "quant.lm_head=true")


def test_rollout_dtype_auto_is_bf16_where_this_cpu_has_it_and_always_on_sglang():
    """rollout.dtype=auto: this CPU's native bf16 decides for the torch engine (each CPU kind checks its own answer);
    SGLang's quantized layers take bf16 only; an explicit choice passes through."""
    native = native_bf16(torch.device("cpu"))
    assert rollout_dtype(_cfg("rollout.dtype=auto")) == ("bfloat16" if native else "float32")
    assert rollout_dtype(_cfg("rollout.dtype=auto", "rollout.engine=sglang", "rollout.quant=int8")) == "bfloat16"
    assert rollout_dtype(_cfg("rollout.dtype=float32")) == "float32"
    assert "choose one of: float32, bfloat16, auto" in error("rollout.dtype=fp16")


def test_nccl_refuses_int8_and_cuda_ipc_stays_on_this_node():
    assert "cannot refit rollout.quant=int8" in error("sync.transport=nccl", *GPU_SGLANG, "rollout.quant=int8")
    assert _cfg("sync.transport=nccl", *GPU_SGLANG).sync.transport == "nccl"
    assert _cfg("sync.transport=cuda-ipc", *GPU_SGLANG, "rollout.quant=int8").rollout.quant == "int8"
    msg = error("sync.transport=cuda-ipc", *GPU_SGLANG, "transport.weights=tcp://10.0.0.2:5555", "transport.secret=k")
    assert "must be loopback or ipc://" in msg
    assert "sync.group_endpoint" in error("sync.group_endpoint=ipc:///tmp/x")
    assert "rollout.mem_fraction" in error("rollout.mem_fraction=1.5")
