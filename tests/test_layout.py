"""qurl/supervisor/layout.py: which process runs where on an 8-GPU node, refused with one line when it cannot run; and
what the launcher gives each of them (one NCCL setting for an nccl weight group)."""

import os

import pytest

from qurl.config import ConfigError, load_config
from qurl.supervisor.layout import plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEEPSCALER = os.path.join(ROOT, "configs", "deepscaler-1.5b-int8.yaml")
DAPO = os.path.join(ROOT, "configs", "dapo-7b-fp8.yaml")


def cfg(*overrides, path=None):
    return load_config(path, list(overrides), check_paths=False)


def error(*overrides, path=None) -> str:
    with pytest.raises(ConfigError) as info:
        cfg(*overrides, path=path)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_deepscaler_layout_is_four_replicas_and_a_four_rank_learner():
    learner, *servers = plan(cfg(path=DEEPSCALER), available_gpus=8)
    assert (learner.program, learner.gpus, learner.env) == (
        "qurl-learner",
        [4, 5, 6, 7],
        {"CUDA_VISIBLE_DEVICES": "4,5,6,7"},
    )
    assert [(s.name, s.gpus, s.env) for s in servers] == [
        (f"rollout-{i}", [i], {"QURL_SERVER_INDEX": str(i)}) for i in range(4)
    ]  # SGLang places by base_gpu_id


def test_dapo_layout_is_two_tp2_replicas_and_visible_devices_map_through():
    learner, *servers = plan(cfg(path=DAPO), available_gpus=8)
    assert [s.gpus for s in servers] == [[0, 1], [2, 3]] and learner.gpus == [4, 5, 6, 7]
    learner, *_ = plan(cfg(path=DAPO), visible=["7", "6", "5", "4", "3", "2", "1", "0"])
    assert learner.env["CUDA_VISIBLE_DEVICES"] == "3,2,1,0"


def test_cpu_layout_is_unchanged():
    learner, *servers = plan(cfg("cluster.rollout_servers=2", "cluster.learner_ranks=2"))
    assert learner.env == {} and [s.env for s in servers] == [{"QURL_SERVER_INDEX": "0"}, {"QURL_SERVER_INDEX": "1"}]


@pytest.mark.parametrize(
    "overrides,available,fragment",
    [
        ([], 4, "names GPU 4, but this node has 4 GPUs"),
        (["cluster.rollout_gpus=[0,1,2]"], 8, "not a multiple of rollout.tp_size=2"),
        (["cluster.rollout_servers=4"], 8, "one server per replica"),
        (["cluster.rollout_gpus=[0,1,4,5]"], 8, "share GPUs [4, 5]"),
        (["cluster.rollout_gpus=[0,0,1,2]"], 8, "lists GPU 0 twice"),
        (["cluster.learner_gpus=[4,5,6]"], 8, "one GPU per rank"),
        (["cluster.rollout_gpus=[]"], 8, "needs cluster.rollout_gpus"),
        (["sync.transport=cuda-ipc", "cluster.rollout_gpus=[4,5,6,7]"], 8, "set rollout.mem_fraction"),
    ],
)
def test_bad_layouts_are_refused_with_one_line(overrides, available, fragment):
    with pytest.raises(ConfigError) as info:
        plan(cfg(*overrides, path=DAPO), available_gpus=available)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_colocated_layout_shares_gpus_with_cuda_ipc():
    c = cfg("sync.transport=cuda-ipc", "cluster.rollout_gpus=[4,5,6,7]", "rollout.mem_fraction=0.4", path=DAPO)
    learner, *servers = plan(c, available_gpus=8)
    assert learner.gpus == [4, 5, 6, 7] and [s.gpus for s in servers] == [[4, 5], [6, 7]]


def test_torch_engine_refuses_tensor_parallelism():
    with pytest.raises(ConfigError, match="rollout.tp_size=2 needs rollout.engine=sglang"):
        plan(cfg("rollout.tp_size=2"))


@pytest.mark.parametrize("user", [{}, {"NCCL_CUMEM_ENABLE": "1"}])
def test_nccl_runs_give_the_learner_and_every_server_one_nccl_setting(monkeypatch, user):
    """SGLang sets NCCL_CUMEM_ENABLE=0 and NCCL_NVLS_ENABLE=0 in its processes where they are unset; the learner kept
    NCCL's default, and broadcasts between the two then fail. Now every child gets the same values (the user's wins)."""
    from qurl.supervisor.launcher import build_children

    for key in ("NCCL_CUMEM_ENABLE", "NCCL_NVLS_ENABLE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in user.items():
        monkeypatch.setenv(key, value)
    learner, servers = build_children(cfg("sync.transport=nccl", path=DAPO), "c.yaml", "out", available_gpus=8)
    want = {"NCCL_CUMEM_ENABLE": user.get("NCCL_CUMEM_ENABLE", "0"), "NCCL_NVLS_ENABLE": "0"}
    for child in (learner, *servers):
        assert {k: child.env.get(k) for k in want} == want, child.name
    learner, servers = build_children(cfg(path=DAPO), "c.yaml", "out", available_gpus=8)  # zmq: left alone
    assert "NCCL_NVLS_ENABLE" not in learner.env


@pytest.mark.parametrize(
    "overrides, user_threads, lends",
    [
        ([], None, True),  # the demo: async, one CPU rank beside a CPU server
        (["async.max_staleness=0"], None, False),  # synchronous: each side has every core already
        (["cluster.learner_ranks=2"], None, False),  # only rank 0 sees the servers' state
        (["cluster.lend_idle_cores=false"], None, False),
        ([], "1", False),  # the user's OMP_NUM_THREADS wins
    ],
)
def test_a_cpu_learner_may_borrow_idle_servers_cores(monkeypatch, overrides, user_threads, lends):
    from qurl.supervisor.launcher import build_children
    from qurl.supervisor.layout import LEND_CORES_ENV

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if user_threads is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", user_threads)
    demo = os.path.join(ROOT, "configs", "demo-cpu.yaml")
    learner, servers = build_children(cfg(*overrides, path=demo), "c.yaml", "out")
    assert (LEND_CORES_ENV in learner.env) == lends
    if lends:
        assert learner.env[LEND_CORES_ENV] == str(os.cpu_count())
    assert not any(LEND_CORES_ENV in s.env for s in servers)
    learner, _ = build_children(cfg(path=DAPO), "c.yaml", "out", available_gpus=8)  # GPUs: never
    assert LEND_CORES_ENV not in learner.env
