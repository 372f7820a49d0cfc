"""cluster.yaml is a complete Ray cluster-launcher file: a CPU head plus autoscaled GPU workers."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from raysched import ray_compat

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"

REQUIRED_KEYS = ("cluster_name", "max_workers", "provider", "auth", "available_node_types",
                 "head_node_type", "file_mounts", "setup_commands",
                 "head_start_ray_commands", "worker_start_ray_commands")


@pytest.fixture(scope="module")
def cluster() -> dict[str, Any]:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_has_every_key_ray_up_needs(cluster: dict[str, Any]) -> None:
    missing = [key for key in REQUIRED_KEYS if key not in cluster]
    assert not missing
    assert cluster["cluster_name"] == "raysched"


def test_provider_is_aws_us_west_2(cluster: dict[str, Any]) -> None:
    assert cluster["provider"]["type"] == "aws"
    assert cluster["provider"]["region"] == "us-west-2"


def test_head_node_type_is_a_cpu_only_node(cluster: dict[str, Any]) -> None:
    head = cluster["available_node_types"][cluster["head_node_type"]]
    assert head["resources"] == {"CPU": 8, "GPU": 0}


def test_worker_node_type_has_a_gpu_and_autoscales_from_zero(cluster: dict[str, Any]) -> None:
    workers = {name: spec for name, spec in cluster["available_node_types"].items()
               if name != cluster["head_node_type"]}
    assert len(workers) == 1
    (worker,) = workers.values()
    assert worker["resources"]["GPU"] >= 1 and worker["resources"]["CPU"] >= 1
    assert worker["min_workers"] == 0 and worker["max_workers"] <= cluster["max_workers"]
    assert worker["node_config"]["InstanceType"].startswith("g5.")


def test_project_is_mounted_and_installed_on_every_node(cluster: dict[str, Any]) -> None:
    assert cluster["file_mounts"] == {"~/raysched": "."}
    assert "pip install -e ~/raysched" in cluster["setup_commands"]


def test_ray_is_stopped_before_it_is_started(cluster: dict[str, Any]) -> None:
    head, worker = cluster["head_start_ray_commands"], cluster["worker_start_ray_commands"]
    assert head[0] == worker[0] == "ray stop"
    assert "ray start --head --port=6379" in head[1]
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head[1]
    assert "--dashboard-host=0.0.0.0" in head[1]
    assert "ray start --address=$RAY_HEAD_IP:6379" in worker[1]


def _validator() -> Any:
    validate = ray_compat.cluster_config_validator()
    if validate is None:
        pytest.skip("this Ray has no cluster.yaml schema check (ray.autoscaler._private.util)")
    return validate


def test_passes_rays_own_cluster_schema(cluster: dict[str, Any]) -> None:
    _validator()(copy.deepcopy(cluster))


def test_rays_schema_check_catches_a_misspelt_key(cluster: dict[str, Any]) -> None:
    validate = _validator()
    jsonschema = pytest.importorskip("jsonschema")
    broken = {**copy.deepcopy(cluster), "head_start_ray_comands": []}
    with pytest.raises(jsonschema.ValidationError, match="head_start_ray_comands"):
        validate(broken)
