"""`serve --ray`'s edge, without a Ray cluster: the resource flags as Ray options, and the
flag combinations refused before anything connects to Ray (tests/deploy/test_ray.py runs
the real thing)."""
from __future__ import annotations

import pytest

from pdserve.common.config import ConfigError
from pdserve.router.cli.main import main
from pdserve.router.launch.ray import actor_options, dialable, parse_resources


def test_resources_are_a_json_object_of_numbers():
    assert parse_resources('{"prefill_pool": 1, "CPU": 2.5}', "--prefill-resources") == \
        {"prefill_pool": 1.0, "CPU": 2.5}
    assert parse_resources("{}", "--decode-resources") == {}
    for bad, why in (("prefill_pool", "JSON object"), ("[1]", "JSON object"), ('{"a": -1}', "'a' must be a number"),
                     ('{"a": "1"}', "'a' must be a number"), ('{"a": true}', "'a' must be a number"),
                     ('{"a": NaN}', "'a' must be a number")):
        with pytest.raises(ConfigError, match=why) as e:
            parse_resources(bad, "--prefill-resources")
        assert "--prefill-resources" in str(e.value)


def test_actor_options_take_cpus_per_thread_and_one_gpu_per_gpu_worker():
    cpu = actor_options({"prefill_pool": 1.0}, "cpu", threads=4)
    assert cpu == {"num_cpus": 4.0, "num_gpus": 0.0, "resources": {"prefill_pool": 1.0}, "lifetime": "detached",
                   "max_restarts": -1, "max_task_retries": 0}  # detached: it outlives the router actor
    gpu = actor_options({"decode_pool": 1.0, "CPU": 2.0, "memory": 1e9}, "cuda", threads=8)
    assert (gpu["num_cpus"], gpu["num_gpus"], gpu["memory"], gpu["resources"]) == (2.0, 1.0, 1e9, {"decode_pool": 1.0})
    with pytest.raises(ConfigError, match="needs a GPU"):
        actor_options({"GPU": 0.0}, "cuda", threads=1)


def test_a_wildcard_control_address_is_dialed_at_the_node_address():
    assert dialable("tcp://0.0.0.0:7000", "10.0.0.5") == "tcp://10.0.0.5:7000"
    assert dialable("tcp://[::]:7000", "10.0.0.5") == "tcp://10.0.0.5:7000"
    assert dialable("tcp://10.0.0.1:7000", "10.0.0.5") == "tcp://10.0.0.1:7000"


@pytest.mark.parametrize("argv, why", [
    (["--prefill-resources", '{"p": 1}'], "give --ray"),
    (["--router-resources", '{"r": 1}'], "give --ray"),
    (["--ray", "auto", "--secret-file", "s", "--router-resources", "[]"], "--router-resources must be a JSON object"),
    (["--ray", "auto", "--colocated", "2", "--secret-file", "s"], "not colocated"),
    (["--ray", "auto", "--prefill-devices", "cuda:0", "--secret-file", "s"], "do not apply under --ray"),
    (["--ray", "auto", "--restart", "--secret-file", "s"], "Ray restarts them"),
    (["--ray", "auto", "--kv-transfer", "gloo", "--secret-file", "s"], "cannot rejoin"),
    (["--ray", "auto"], "needs --secret-file"),
    (["--ray", "auto", "--secret-file", "s", "--decode-resources", "{"], "--decode-resources must be a JSON object"),
])
def test_serve_refuses_ray_flags_that_cannot_work(argv, why, capsys):
    assert main(["serve", "no-such-model", *argv]) == 2  # refused before the model or Ray is looked at
    assert why in capsys.readouterr().err


def test_serve_takes_the_router_actors_flags_apart_from_the_router_config():
    from pdserve.router.cli.flags import ROUTER_DEST, WORKER_DEST, given
    from pdserve.router.cli.main import build_parser
    args = build_parser().parse_args(["serve", "--ray", "auto", "--control-port", "7000", "--rejoin-timeout", "60",
                                      "--router-resources", '{"router_node": 1}'])
    assert given(args, ROUTER_DEST) == {"control_port": 7000}  # --router-resources places the actor, no config field
    assert given(args, WORKER_DEST) == {"rejoin_timeout_s": 60.0}  # how long a worker waits for the restarted router
    assert args.ray_router_resources == '{"router_node": 1}'
