"""Cluster recipes checked offline: the Slurm script (bash -n, shellcheck, a run against stub Slurm commands),
the Kubernetes manifests (schema validation, ports and hosts against the config, keys against the key layout),
and shell completion."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
from support.procs import ZCLAW
from support.shell import assert_valid_shell

from zclaw import config as config_mod
from zclaw.security import Security

ROOT = Path(__file__).resolve().parents[2]
SBATCH = ROOT / "deploy" / "slurm" / "zclaw.sbatch"
K8S = ROOT / "deploy" / "k8s"
yaml = pytest.importorskip("yaml")


def docs() -> List[Dict[str, Any]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return out


def find(kind: str, name: str) -> Dict[str, Any]:
    (d,) = [d for d in docs() if d["kind"] == kind and d["metadata"]["name"] == name]
    return d


def k8s_config(tmp_path: Path) -> Dict[str, Dict[str, Any]]:
    path = tmp_path / "zclaw.toml"
    path.write_text(find("ConfigMap", "zclaw-config")["data"]["zclaw.toml"])
    return config_mod.load(str(path), [])


# ------------------------------------------------------------------------------------------------- slurm


def test_sbatch_parses_and_passes_shellcheck() -> None:
    assert_valid_shell(SBATCH)


STUB_SRUN = """#!/usr/bin/env bash
# stands in for srun: records its arguments; the worker step runs its command once per task with SLURM_PROCID
echo "srun $*" >> "$STUB_LOG"
ntasks=1
for a in "$@"; do case "$a" in --ntasks=*) ntasks="${a#--ntasks=}";; esac; done
while [ $# -gt 0 ] && [[ "$1" == --* ]]; do shift; done
if [ "$1" = bash ]; then
  for ((i = 0; i < ntasks; i++)); do SLURM_PROCID=$i "$@"; done
else
  exec "$@"
fi
"""
# broker and learner stay up until every worker task has run (10 s at most): when they exit, the script
# stops the worker step, and on a loaded machine srun's stub may not have started all its tasks yet
STUB_ZCLAW = """#!/usr/bin/env bash
echo "zclaw $*" >> "$STUB_LOG"
case "$1" in
  worker) exit 0;;
  *) for _ in $(seq 100); do
       [ "$(grep -c '^zclaw worker' "$STUB_LOG")" -ge "$STUB_WORKERS" ] && break
       sleep 0.1
     done
     exit 0;;
esac
"""


def _stub(dir_: Path, name: str, text: str) -> None:
    p = dir_ / name
    p.write_text(text)
    p.chmod(p.stat().st_mode | stat.S_IEXEC)


def test_contract_sbatch_puts_broker_and_learner_on_the_first_node_workers_on_the_rest(
    tmp_path: Path
) -> None:
    """Slurm is not installed here: scontrol and srun are stubs that record what the script asks for."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    _stub(bin_, "scontrol", "#!/usr/bin/env bash\nprintf 'node1\\nnode2\\nnode3\\n'\n")
    _stub(bin_, "srun", STUB_SRUN)
    _stub(bin_, "zclaw-stub", STUB_ZCLAW)
    log = tmp_path / "calls.log"
    env = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", STUB_LOG=str(log), SLURM_JOB_ID="42",
               SLURM_JOB_NODELIST="node[1-3]", ZCLAW_BIN="zclaw-stub", ZCLAW_WORKERS_PER_NODE="2",
               ZCLAW_RUN_DIR=str(tmp_path / "run"), ZCLAW_KEYS_DIR="/shared/keys", STUB_WORKERS="4")
    out = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    calls = log.read_text().splitlines()
    sruns = [c for c in calls if c.startswith("srun")]
    assert any("--nodelist=node1" in c and " broker " in c for c in sruns)
    assert any("--nodelist=node1" in c and " learner " in c for c in sruns)
    (wstep,) = [c for c in sruns if " worker " in c]
    assert "--relative=1" in wstep and "--nodes=2" in wstep and "--ntasks=4" in wstep  # 2 nodes x 2 workers
    workers = [c for c in calls if c.startswith("zclaw worker")]
    assert sorted(c.split("--index ")[1] for c in workers) == ["0", "1", "2", "3"]
    for c in [c for c in calls if c.startswith("zclaw ")]:
        assert "network.broker_host=node1" in c and "network.learner_host=node1" in c
        assert "security.keys_dir=/shared/keys" in c and "--insecure" not in c
    learner = [c for c in calls if c.startswith("zclaw learner")][0]
    assert f"--run-dir {tmp_path / 'run'}" in learner and "--resume" not in learner

    # a requeued job resumes the learner from the run's checkpoint; without keys the servers bind --insecure
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "latest.pt").write_bytes(b"x")
    log.unlink()
    env.pop("ZCLAW_KEYS_DIR")
    out = subprocess.run(["bash", str(SBATCH)], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    calls = log.read_text().splitlines()
    assert "--resume" in [c for c in calls if c.startswith("zclaw learner")][0]
    assert all("--insecure" in c for c in calls if c.startswith(("zclaw broker", "zclaw learner")))


STUB_TORCHRUN = """#!/usr/bin/env bash
# stands in for torchrun: records its node rank (PET_NODE_RANK) and options, then runs the --no-python command
echo "torchrun node_rank=${PET_NODE_RANK:-unset} $*" >> "$STUB_LOG"
while [ $# -gt 0 ] && [ "$1" != --no-python ]; do shift; done
shift
exec "$@"
"""


def run_sbatch(tmp_path: Path, nodes: int, workers: int, **env: str) -> List[str]:
    """The script on ``nodes`` stub nodes; the calls it made (srun, torchrun, zclaw)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(parents=True, exist_ok=True)
    names = "\\n".join(f"node{i}" for i in range(1, nodes + 1))
    _stub(bin_, "scontrol", f"#!/usr/bin/env bash\nprintf '{names}\\n'\n")
    _stub(bin_, "srun", STUB_SRUN)
    _stub(bin_, "zclaw-stub", STUB_ZCLAW)
    _stub(bin_, "torchrun", STUB_TORCHRUN)
    log = tmp_path / "calls.log"
    full = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", STUB_LOG=str(log), SLURM_JOB_ID="42",
                SLURM_JOB_NODELIST=f"node[1-{nodes}]", ZCLAW_BIN="zclaw-stub",
                ZCLAW_RUN_DIR=str(tmp_path / "run"), STUB_WORKERS=str(workers), **env)
    out = subprocess.run(["bash", str(SBATCH)], env=full, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return log.read_text().splitlines()


def test_contract_sbatch_runs_learner_ranks_by_nproc_on_one_node_and_by_torchrun_on_several(
    tmp_path: Path
) -> None:
    # one learner node, 4 ranks: `zclaw learner --nproc 4` on the head node, workers on the other nodes
    calls = run_sbatch(tmp_path / "one", 3, 2, ZCLAW_LEARNER_RANKS_PER_NODE="4")
    (learner,) = [c for c in calls if c.startswith("zclaw learner")]
    assert "--nproc 4" in learner
    assert not [c for c in calls if c.startswith("torchrun")]
    (wstep,) = [c for c in calls if c.startswith("srun") and " worker " in c]
    assert "--relative=1" in wstep and "--nodes=2" in wstep

    # two learner nodes, 8 ranks each: torchrun on node1 and node2 (node rank = task id, so global rank 0 is
    # on node1, the learner_host), workers on the two nodes after them
    calls = run_sbatch(tmp_path / "two", 4, 2, ZCLAW_LEARNER_NODES="2", ZCLAW_LEARNER_RANKS_PER_NODE="8")
    (lstep,) = [c for c in calls if c.startswith("srun") and "torchrun" in c]
    assert "--nodelist=node1,node2" in lstep and "--nodes=2" in lstep and "--ntasks=2" in lstep
    runs = [c for c in calls if c.startswith("torchrun")]
    assert sorted(c.split()[1] for c in runs) == ["node_rank=0", "node_rank=1"]
    for c in runs:
        assert "--nnodes=2" in c and "--nproc-per-node=8" in c and "--master-addr=node1" in c
        assert "--no-python zclaw-stub learner" in c
    learners = [c for c in calls if c.startswith("zclaw learner")]
    assert len(learners) == 2 and not any("--nproc" in c for c in learners)
    assert all("network.learner_host=node1" in c for c in learners)
    (wstep,) = [c for c in calls if c.startswith("srun") and " worker " in c]
    assert "--relative=2" in wstep and "--nodes=2" in wstep and "--ntasks=2" in wstep


# --------------------------------------------------------------------------------------------- kubernetes


def test_k8s_manifests_pass_schema_validation() -> None:
    kv = pytest.importorskip("kubernetes_validate")
    for d in docs():
        kv.validate(d, kv.utils.latest_version(), strict=True)


def test_k8s_ports_and_hosts_match_the_config(tmp_path: Path) -> None:
    cfg = k8s_config(tmp_path)
    net = cfg["network"]
    defaults = config_mod.defaults()["network"]
    for key in ("ingest_port", "serve_port", "publish_port", "learner_port"):
        assert net[key] == defaults[key]
    wanted = {"zclaw-broker": {"ingest": net["ingest_port"], "serve": net["serve_port"]},
              "zclaw-learner": {"publish": net["publish_port"], "learner": net["learner_port"]}}
    assert net["broker_host"] == "zclaw-broker" and net["learner_host"] == "zclaw-learner"
    assert net["bind_host"] == "0.0.0.0"
    for name, ports in wanted.items():
        svc = find("Service", name)
        assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == ports
        dep = find("Deployment", name)
        assert svc["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
        (c,) = dep["spec"]["template"]["spec"]["containers"]
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == ports
        assert all(p["targetPort"] in ports for p in svc["spec"]["ports"])
    workers = find("Deployment", "zclaw-worker")
    assert workers["spec"]["replicas"] >= 1
    assert (workers["spec"]["selector"]["matchLabels"].items()
            <= workers["spec"]["template"]["metadata"]["labels"].items())


def test_k8s_multinode_learner_puts_rank_0_behind_the_learner_service() -> None:
    """deploy/k8s/multinode/learner.yaml replaces learner.yaml: torchrun in each StatefulSet pod, node rank =
    pod ordinal, meeting at pod 0, which the zclaw-learner Service alone selects (rank 0 publishes)."""
    kv = pytest.importorskip("kubernetes_validate")
    objs = [d for d in yaml.safe_load_all((K8S / "multinode" / "learner.yaml").read_text()) if d]
    for d in objs:
        kv.validate(d, kv.utils.latest_version(), strict=True)
    by = {(d["kind"], d["metadata"]["name"]): d for d in objs}
    sts, svc = by[("StatefulSet", "zclaw-learner")], by[("Service", "zclaw-learner")]
    ranks = by[("Service", "zclaw-learner-ranks")]
    assert svc["spec"]["selector"]["statefulset.kubernetes.io/pod-name"] == "zclaw-learner-0"
    assert ranks["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "zclaw-learner-ranks"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in svc["spec"]["selector"].items() if k.startswith("app."))
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    cmd = " ".join(c["args"][0].split())
    assert f"--nnodes {sts['spec']['replicas']}" in cmd
    assert f"--nproc-per-node {c['resources']['limits']['nvidia.com/gpu']}" in cmd
    assert '--node-rank "${HOSTNAME##*-}"' in cmd  # pod zclaw-learner-<i> is node i
    assert "--master-addr zclaw-learner-0.zclaw-learner-ranks" in cmd
    assert "--no-python zclaw learner --config /etc/zclaw/zclaw.toml --run-dir /runs/run" in cmd
    # the same ports and the same keys as the one-pod learner it replaces
    one = find("Service", "zclaw-learner")
    assert svc["spec"]["ports"] == one["spec"]["ports"]
    (single,) = find("Deployment", "zclaw-learner")["spec"]["template"]["spec"]["containers"]
    assert [p for p in c["ports"] if p["name"] != "rendezvous"] == single["ports"]
    secret = [v for v in sts["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert secret == [v for v in find("Deployment", "zclaw-learner")["spec"]["template"]["spec"]["volumes"]
                      if "secret" in v]


def test_k8s_every_role_finds_its_keys_in_its_mounted_secret(tmp_path: Path) -> None:
    """Lay out each pod's Secret items from real `zclaw keys generate` output; each role's Security loads."""
    keys = tmp_path / "keys"
    out = subprocess.run(ZCLAW + ["keys", "generate", str(keys), "--workers", "0", "--client", "worker"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    cfg = k8s_config(tmp_path)
    secret_keys = set(find("Secret", "zclaw-keys")["stringData"])
    for name, role, extra in (("zclaw-broker", "broker", {}), ("zclaw-learner", "learner", {}),
                              ("zclaw-worker", "worker", {"name": "worker"})):
        spec = find("Deployment", name)["spec"]["template"]["spec"]
        (vol,) = [v for v in spec["volumes"] if "secret" in v]
        assert vol["secret"]["secretName"] == "zclaw-keys"
        mounted = tmp_path / f"mount-{role}"
        for item in vol["secret"]["items"]:
            assert item["key"] in secret_keys
            src = keys / item["key"].replace(".", "/", 1)  # servers.broker.key -> servers/broker.key
            dst = mounted / item["path"]
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
        sec = dict(cfg["security"], keys_dir=str(mounted), **extra)
        Security.from_config({"security": sec}, role)  # raises ConfigError naming a missing file


# ------------------------------------------------------------------------------------------ completion


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_scripts(shell: str) -> None:
    out = subprocess.run(ZCLAW + ["completion", shell], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "_ZCLAW_COMPLETE" in out.stdout
    if shell == "bash":
        assert subprocess.run(["bash", "-n"], input=out.stdout, text=True).returncode == 0


def test_completion_completes_commands() -> None:
    script = shutil.which("zclaw", path=str(Path(sys.executable).parent)) or shutil.which("zclaw")
    if script is None:
        pytest.skip("the zclaw console script is not installed (pip install -e .)")
    env = dict(os.environ, _ZCLAW_COMPLETE="bash_complete", COMP_WORDS="zclaw st", COMP_CWORD="1")
    out = subprocess.run([script], env=env, capture_output=True, text=True, timeout=60)
    assert "status" in out.stdout
