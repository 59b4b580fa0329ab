"""`recipes/ablation.py --backend ray` on a 2-node Ray cluster on this machine (`ray start --head` and `ray start
--address`, each node its own process group, 1 CPU each): a tiny ablation (2 configurations x 2 seeds, 2 steps) gives
the local backend's table, its runs land on both nodes, a rerun runs only what did not finish, and a worker killed
mid-sweep loses no finished run (Ray runs the lost one again on the other node); `recipes/kfold.py --backend ray`
gives the local numbers. Slow (a cluster and a few dozen tiny runs on 2 cores): marked ``slow``; skipped without
Ray."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from recipe_helpers import ROOT, env, free_port, ner_files

pytest.importorskip("ray", reason='Ray is not installed (pip install -e ".[ray]")')
pytestmark = pytest.mark.slow

RAY = [sys.executable, "-c", "from ray.scripts.scripts import main; main()"]  # the `ray` CLI of this Python
NODES = """\
import json, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level='ERROR')
print(json.dumps([[n['NodeID'], 'node:__internal_head__' in n['Resources']] for n in ray.nodes() if n['Alive']]))
"""


def ray_env() -> dict:
    # No token authentication, whatever ~/.ray holds (a token file left by an earlier local instance turns it on for
    # `ray start` but not for its clients).
    return {**env(), "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


def processes_naming(text: str) -> list[int]:
    """The processes whose command line holds ``text``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


class Cluster:
    """A Ray cluster of separate node processes on this machine; ``stop`` kills what they started, nothing else."""

    def __init__(self):
        # Short: Ray's socket paths under it must stay under the OS limit (108 bytes).
        self.temp = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
        self.address = f"127.0.0.1:{free_port()}"
        self.nodes: dict[str, subprocess.Popen] = {}

    def start_head(self) -> None:
        self.start("head", "--head", "--port", self.address.split(":")[1], "--temp-dir", str(self.temp),
                   "--include-dashboard", "false")  # fmt: skip
        self.head_id = self.wait_for(1)[0]

    def start(self, name: str, *flags: str) -> None:
        log = open(self.temp / f"{name}.log", "w")
        self.nodes[name] = subprocess.Popen(
            [*RAY, "start", "--num-cpus", "1", "--disable-usage-stats", "--block", *flags],
            stdout=log, stderr=subprocess.STDOUT, env=ray_env(), start_new_session=True,
        )  # fmt: skip

    def add_worker(self) -> str:
        """A second node; its node id."""
        known = set(self.wait_for(len(self.nodes)))
        self.start(f"worker{len(self.nodes)}", "--address", self.address)
        return next(n for n in self.wait_for(len(known) + 1) if n not in known)

    def wait_for(self, count: int, timeout: float = 120) -> list[str]:
        """The alive node ids once there are ``count`` of them, the head first."""
        deadline = time.time() + timeout
        while True:
            proc = subprocess.run([sys.executable, "-c", NODES, self.address], env=ray_env(), capture_output=True,
                                  text=True, timeout=120)  # fmt: skip
            if proc.returncode == 0:
                nodes = json.loads(proc.stdout.strip().splitlines()[-1])
                if len(nodes) == count:
                    return [n for n, head in nodes if head] + [n for n, head in nodes if not head]
            assert time.time() < deadline, f"no {count} Ray nodes: {proc.stderr[-2000:]}"
            time.sleep(2)

    def kill(self, name: str) -> None:
        """SIGKILL a node's process group (raylet, agents); the Ray workers it spawned (sessions of their own) end
        when their raylet is gone."""
        proc = self.nodes.pop(name)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()

    def session_processes(self) -> list[int]:
        """This cluster's processes: those whose command line names its temporary folder."""
        return processes_naming(str(self.temp))

    def stop(self) -> None:
        for proc in self.nodes.values():  # workers first, the head last
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in reversed(list(self.nodes.values())):
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid in self.session_processes():  # stragglers of this cluster only
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster():
    cluster = Cluster()
    try:
        cluster.start_head()
        cluster.worker_id = cluster.add_worker()
        yield cluster
    finally:
        cluster.stop()


def ablation_command(model: str, data: list[str], out: Path, *backend: str) -> list[str]:
    return [
        sys.executable, str(ROOT / "recipes" / "ablation.py"), "--recipe", "ner", "--seeds", "2", "--max_steps", "2",
        "--configurations", "baseline,fgm", "--no_yardstick", "--resamples", "200", "--output_dir", str(out),
        *backend, "--", "--model_name_or_path", model, *data, "--per_device_train_batch_size", "2",
        "--disable_tqdm", "true",
    ]  # fmt: skip


def comparable(out: Path) -> tuple[list[dict], list[str], dict]:
    """The table without its time and memory columns (they are measured, not computed), and every run's results."""
    data = json.loads((out / "ablation.json").read_text())
    rows = [
        {k: v for k, v in r.items() if "memory" not in k and "time" not in k and "step" not in k} for r in data["rows"]
    ]
    lines = ["|".join(line.split("|")[:-3]) for line in (out / "ablation.md").read_text().splitlines()]
    results = {}
    for config, by_lr in data["runs"].items():
        for lr, by_seed in by_lr.items():
            for seed, by_fold in by_seed.items():
                for record in by_fold.values():
                    kept = {k: v for k, v in record["results"].items() if "runtime" not in k and "per_second" not in k}
                    results[(config, lr, seed)] = kept
    return rows, lines, results


def nodes_of(out: Path) -> dict[str, str]:
    return {
        str(path.parent.relative_to(out)): json.loads(path.read_text())["node"]
        for path in out.rglob("ablation_run.json")
    }


@pytest.fixture(scope="module")
def local(tiny_model, tmp_path_factory):
    """The data flags and the output folder of the tiny ablation on the local backend: the reference."""
    tmp = tmp_path_factory.mktemp("sweep_local")
    data = ner_files(tmp)
    out = tmp / "local"
    proc = subprocess.run(ablation_command(tiny_model, data, out, "--jobs", "2"), cwd=ROOT, env=ray_env(),
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return data, out


def test_ray_backend_gives_the_local_table_and_spreads_over_both_nodes(cluster, tiny_model, local, tmp_path):
    data, local_out = local
    ray_out = tmp_path / "ray"
    command = ablation_command(tiny_model, data, ray_out, "--backend", "ray", "--ray_address", cluster.address)
    proc = subprocess.run(command, cwd=ROOT, env=ray_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The same numbers: the runs' own results and the table's metric and interval columns, to the last digit.
    assert comparable(ray_out) == comparable(local_out)
    # 4 model runs and the gazetteer, recorded per run on the node that ran it: both nodes took some.
    nodes = nodes_of(ray_out)
    assert len(nodes) == 5 and set(nodes.values()) == {cluster.head_id, cluster.worker_id}
    assert set(nodes_of(local_out).values()) == {os.uname().nodename}
    # Progress: a line per finished run naming its node, and the bar.
    lines = [line for line in proc.stdout.splitlines() if line.startswith("[sweep] ") and " done, " in line]
    assert len(lines) == 5 and all(" on node " in line for line in lines)
    assert "ablation: 100%" in proc.stderr and "5/5" in proc.stderr
    # Resume on Ray: a run that did not finish (its record gone) runs again, and only it.
    records = {p: p.read_bytes() for p in ray_out.rglob("ablation_run.json")}
    lost = ray_out / "fgm" / "lrdefault" / "seed2"
    (lost / "ablation_run.json").unlink()
    (lost / "all_results.json").unlink()
    again = subprocess.run(command, cwd=ROOT, env=ray_env(), capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "4 of 5 runs finished earlier" in again.stdout and "[sweep] fgm/lrdefault/seed2: " in again.stdout
    assert {p: p.read_bytes() for p in records if p.parent != lost} == {
        p: c for p, c in records.items() if p.parent != lost
    }
    assert comparable(ray_out) == comparable(local_out)


def test_kfold_on_ray_gives_the_local_folds_and_ensemble(cluster, tiny_model, tmp_path):
    """`recipes/kfold.py --backend ray`: the folds train as Ray tasks (on both nodes), this process ensembles them;
    every number of all_results.json equals the local backend's."""
    from test_kfold import NER_TRAIN, tiny_flags

    from recipe_helpers import TEST_CONLL

    (tmp_path / "train.conll").write_text(NER_TRAIN)
    (tmp_path / "test.conll").write_text(TEST_CONLL)

    def kfold(out: Path, *backend: str) -> dict:
        command = [sys.executable, str(ROOT / "recipes" / "kfold.py"), "--recipe", "ner", "--folds", "2", *backend,
                   "--output_dir", str(out), "--", *tiny_flags(tiny_model, "--crf", "false"), "--train_file",
                   str(tmp_path / "train.conll"), "--test_file", str(tmp_path / "test.conll")]  # fmt: skip
        proc = subprocess.run(command, cwd=ROOT, env=ray_env(), capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results = json.loads((out / "all_results.json").read_text())
        return {k: v for k, v in results.items() if "seconds" not in k and "runtime" not in k}

    on_ray = kfold(tmp_path / "ray", "--backend", "ray", "--ray_address", cluster.address)
    assert on_ray == kfold(tmp_path / "local", "--jobs", "2")
    nodes = {json.loads((tmp_path / "ray" / f"fold{k}" / "ablation_run.json").read_text())["node"] for k in (0, 1)}
    assert nodes == {cluster.head_id, cluster.worker_id}


def test_killing_a_worker_mid_sweep_loses_no_finished_run(cluster, tiny_model, local, tmp_path):
    """SIGKILL the worker node while a run is on it and another has finished: the finished runs stay as they are
    (not run again, then or on a rerun), the run that was on the lost node leaves no process behind, Ray runs its
    task again on the head node and the sweep completes, with the local table."""
    data, local_out = local
    out = tmp_path / "killed"
    command = ablation_command(tiny_model, data, out, "--backend", "ray", "--ray_address", cluster.address)
    driver = subprocess.Popen(command, cwd=ROOT, env=ray_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True)  # fmt: skip
    deadline = time.time() + 600
    while True:
        finished = {p.parent for p in out.rglob("ablation_run.json")}
        on_worker = [log.parent for log in out.rglob("ablation_log.txt") if log.parent not in finished
                     and cluster.worker_id in log.read_text()[:200]]  # fmt: skip
        if finished and on_worker:
            break
        assert driver.poll() is None and time.time() < deadline, "no moment with a run done and one on the worker"
        time.sleep(0.2)
    before = {p: p.read_bytes() for p in (d / "ablation_run.json" for d in finished)}
    cluster.kill("worker1")
    output, _ = driver.communicate(timeout=600)
    # Ray ran the lost task again on the node that was left, so the sweep itself finished.
    assert driver.returncode == 0, output[-3000:]
    # Nothing of the lost run is left running (its process died with the Ray worker that started it).
    assert not processes_naming(str(out))
    rerun = subprocess.run(command, cwd=ROOT, env=ray_env(), capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0 and "5 of 5 runs finished earlier" in rerun.stdout, rerun.stderr[-3000:]
    for path, content in before.items():
        assert path.read_bytes() == content, f"{path.parent} ran again"
    nodes = nodes_of(out)
    assert len(nodes) == 5
    assert nodes[str(on_worker[0].relative_to(out))] == cluster.head_id  # run again on the node that was left
    assert comparable(out) == comparable(local_out)
