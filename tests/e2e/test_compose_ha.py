"""compose.yaml's `ha` profile: a primary, a replica and three Sentinels, configured so that a cut-off primary refuses
writes before the Sentinels can elect another (min-replicas-max-lag below down-after-milliseconds), and a
scheduler command that turns LLMSERVE_REDIS_SENTINEL into --redis-sentinel (run here through sh with `echo` in place
of llmserve)."""

from __future__ import annotations

import os
import re
import subprocess

import yaml

from llmserve.cli import build_parser
from scheduler_svc.config import SchedulerConfig
from scheduler_svc.servers.process import config_from_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SERVICES = yaml.safe_load(open(os.path.join(ROOT, "compose.yaml")))["services"]
HA = ("redis-primary", "redis-replica", "sentinel-1", "sentinel-2", "sentinel-3")


def shell(command: str, **env) -> str:
    """The scheduler's command as its container's shell would expand it, with llmserve replaced by echo."""
    command = command.replace("$$", "$").replace("exec llmserve", "echo")
    command = command.replace("${LLMSERVE_MAX_NUM_BATCHED_TOKENS:-8192}", "8192")  # compose's own interpolation
    return subprocess.run(["sh", "-c", command], env={"PATH": os.environ["PATH"], "REDIS_PASSWORD": "pw", **env},
                          capture_output=True, text=True, check=True).stdout.split()


def test_ha_profile_services():
    for name in HA:
        assert SERVICES[name]["profiles"] == ["ha"], name
        assert SERVICES[name]["restart"] == "unless-stopped" and "healthcheck" in SERVICES[name], name
    down_after = None
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        cmd = SERVICES[name]["command"][-1]
        assert "--sentinel" in cmd and "sentinel monitor llmserve redis-primary 6379 2" in cmd, name
        down_after = int(re.search(r"down-after-milliseconds llmserve (\d+)", cmd)[1])
    for name in ("redis-primary", "redis-replica"):
        cmd = SERVICES[name]["command"][-1]
        assert "--appendonly yes" in cmd and "--min-replicas-to-write 1" in cmd, name
        lag_s = int(re.search(r"--min-replicas-max-lag (\d+)", cmd)[1])
        assert lag_s * 1000 < down_after, "a cut-off primary must refuse writes before a fail-over can happen"
    assert "--replicaof redis-primary 6379" in SERVICES["redis-replica"]["command"][-1]


def test_scheduler_command_follows_the_sentinel_variables():
    cmd = SERVICES["scheduler"]["command"][-1]
    plain = shell(cmd)
    assert "--redis-sentinel" not in plain and plain[plain.index("--redis-durability") + 1] == "none"
    ha = shell(cmd, LLMSERVE_REDIS_SENTINEL="sentinel-1:26379,sentinel-2:26379,sentinel-3:26379",
               LLMSERVE_REDIS_DURABILITY="replica")
    args = build_parser().parse_args(["scheduler", *ha[ha.index("scheduler") + 1:]])
    cfg = config_from_args(args)
    assert isinstance(cfg, SchedulerConfig)
    assert cfg.redis_sentinel == "sentinel-1:26379,sentinel-2:26379,sentinel-3:26379"
    assert cfg.redis_sentinel_master == "llmserve" and cfg.redis_durability == "replica"
    assert cfg.redis_url == "redis://:pw@redis:6379/0"  # its password goes to the Sentinels and data nodes
    cfg.validate()
