"""Every shipped launch config loads as `accelerate config` would write it, with the keys its setup needs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = ROOT / "accelerate_configs"

# name -> (distributed_type, mixed_precision, num_machines, use_cpu)
EXPECTED = {
    "cpu": ("NO", "no", 1, True),
    "one_process": ("NO", "no", 1, False),  # the README's: the GPU where there is one, else the CPU
    "single_gpu": ("NO", "no", 1, False),
    "multi_gpu": ("MULTI_GPU", "no", 1, False),
    "multi_gpu_fp16": ("MULTI_GPU", "fp16", 1, False),
    "multi_gpu_bf16": ("MULTI_GPU", "bf16", 1, False),
    "multi_node": ("MULTI_GPU", "bf16", 2, False),
    "fsdp": ("FSDP", "bf16", 1, False),
    "deepspeed_zero2": ("DEEPSPEED", "bf16", 1, False),
}
# The keys `accelerate config` writes for a local machine.
COMMON_KEYS = {
    "compute_environment",
    "debug",
    "distributed_type",
    "downcast_bf16",
    "enable_cpu_affinity",
    "machine_rank",
    "main_training_function",
    "mixed_precision",
    "num_machines",
    "num_processes",
    "rdzv_backend",
    "same_network",
    "tpu_env",
    "tpu_use_cluster",
    "tpu_use_sudo",
    "use_cpu",
}


def test_exactly_the_expected_files():
    assert sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_config_loads_with_its_keys(name):
    path = CONFIG_DIR / f"{name}.yaml"
    raw = yaml.safe_load(path.read_text())
    assert COMMON_KEYS <= set(raw), f"{name}: missing {sorted(COMMON_KEYS - set(raw))}"
    config = load_config_from_file(str(path))  # accelerate's own loader: unknown keys raise
    assert isinstance(config, ClusterConfig)
    distributed_type, mixed_precision, num_machines, use_cpu = EXPECTED[name]
    assert config.compute_environment.value == "LOCAL_MACHINE"
    assert config.distributed_type.value == distributed_type
    assert str(config.mixed_precision) == mixed_precision
    assert (config.num_machines, config.use_cpu, config.machine_rank) == (num_machines, use_cpu, 0)
    assert config.num_processes >= num_machines and config.num_processes % num_machines == 0
    if distributed_type == "NO":
        assert config.num_processes == 1
    if num_machines > 1:
        assert config.main_process_ip and isinstance(config.main_process_port, int)
    if distributed_type == "FSDP":
        fsdp = raw["fsdp_config"]
        assert fsdp["fsdp_sharding_strategy"] == "FULL_SHARD"
        assert fsdp["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
        # Trainer.save_model writes one full safetensors file with a full state dict.
        assert fsdp["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    if distributed_type == "DEEPSPEED":
        assert raw["deepspeed_config"]["zero_stage"] == 2


def test_accelerate_launch_accepts_cpu_config(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        "from accelerate import PartialState\n"
        "s = PartialState()\n"
        "print('STATE', s.distributed_type, s.num_processes, s.device)\n"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(CONFIG_DIR / "cpu.yaml"),
            str(script),
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "STATE DistributedType.NO 1 cpu" in proc.stdout
