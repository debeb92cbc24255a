"""`kiln launch`: torchrun command lines, the Slurm script and the Kubernetes manifests.

The command lines are read back with torchrun's own argument parser, the Slurm script is checked by
bash and run against stand-in `srun`/`scontrol` programs, and the manifests are parsed by the API
models of the Kubeflow training SDK (PyTorchJob, with the Kubernetes client's pod models) and of the
Kubeflow Trainer API package (JobSet), which are generated from those resources' OpenAPI schemas.
"""

import argparse
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from kiln.errors import ConfigError
from kiln.parallel.config import ParallelConfig
from kiln.parallel.launch import (
    K8sOptions,
    LaunchConfig,
    SlurmOptions,
    add_launch_parser,
    check_layout,
    k8s_manifest,
    k8s_manifest_dict,
    run_launch,
    run_torchrun,
    slurm_script,
    torchrun_command,
)

REPO = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash")


def torchrun_parse(argv, monkeypatch):
    """What torchrun itself makes of an argv (without the leading `torchrun`)."""
    import torch.distributed.run as run

    # config_from_args exports OMP_NUM_THREADS when it is unset; keep that out of this process.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    args = run.get_args_parser().parse_args(argv)
    config, _, cmd_args = run.config_from_args(args)
    return args, config, cmd_args


# --- torchrun command lines -------------------------------------------------------------------


def test_single_node_command_is_standalone(monkeypatch):
    cfg = LaunchConfig(nproc_per_node=4, max_restarts=2, monitor_interval=1.5)
    argv = torchrun_command(cfg, "recipes/tiny.toml", ["train.max_steps=50"])
    assert argv[0] == "torchrun"
    assert "--rdzv-endpoint" not in argv
    args, config, cmd_args = torchrun_parse(argv[1:], monkeypatch)
    assert args.standalone and (config.min_nodes, config.max_nodes) == (1, 1)
    assert config.nproc_per_node == 4 and config.max_restarts == 2 and config.monitor_interval == 1.5
    assert args.module and args.training_script == "kiln.cli"
    assert cmd_args[-4:] == ["kiln.cli", "pretrain", "recipes/tiny.toml", "train.max_steps=50"]


def test_multi_node_command_uses_c10d_rendezvous(monkeypatch):
    cfg = LaunchConfig(nodes=4, nproc_per_node=8, rdzv_endpoint="node-a", rdzv_port=29555, rdzv_id="job7")
    argv = torchrun_command(cfg, "r.toml")
    args, config, cmd_args = torchrun_parse(argv[1:], monkeypatch)
    assert not args.standalone
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (4, 4, 8)
    assert config.rdzv_backend == "c10d" and config.rdzv_endpoint == "node-a:29555" and config.run_id == "job7"
    assert config.max_restarts == 3
    assert cmd_args[-3:] == ["kiln.cli", "pretrain", "r.toml"]
    # An explicit port wins, and an elastic lower bound becomes torchrun's MIN:MAX.
    cfg = LaunchConfig(
        nodes=4, nproc_per_node=8, min_nodes=2, rdzv_endpoint="10.0.0.5:1234", torchrun_args=["--log-dir", "logs"]
    )
    args, config, _ = torchrun_parse(torchrun_command(cfg, "r.toml")[1:], monkeypatch)
    assert (config.min_nodes, config.max_nodes) == (2, 4)
    assert config.rdzv_endpoint == "10.0.0.5:1234" and args.log_dir == "logs"


def test_multi_node_without_endpoint_names_the_key():
    with pytest.raises(ConfigError) as err:
        torchrun_command(LaunchConfig(nodes=2), "r.toml")
    assert err.value.key == "rdzv_endpoint"


@pytest.mark.parametrize(
    "change, key",
    [
        (dict(nodes=0), "nodes"),
        (dict(nproc_per_node=0), "nproc_per_node"),
        (dict(device="tpu"), "device"),
        (dict(nodes=2, min_nodes=3), "min_nodes"),
        (dict(max_restarts=-1), "max_restarts"),
        (dict(monitor_interval=0), "monitor_interval"),
        (dict(rdzv_port=70000), "rdzv_port"),
        (dict(rdzv_id="a b"), "rdzv_id"),
        (dict(k8s=K8sOptions(kind="deployment")), "k8s.kind"),
        (dict(k8s=K8sOptions(memory="lots")), "k8s.memory"),
        (dict(k8s=K8sOptions(env={"1BAD": "x"})), "k8s.env"),
        (dict(slurm=SlurmOptions(time="two days")), "slurm.time"),
        (dict(slurm=SlurmOptions(cpus_per_task=-2)), "slurm.cpus_per_task"),
    ],
)
def test_invalid_config_names_the_key(change, key):
    with pytest.raises(ConfigError) as err:
        LaunchConfig(**change).validate()
    assert err.value.key == key


def test_manifest_needs_an_image_and_a_dns_name():
    with pytest.raises(ConfigError) as err:
        k8s_manifest_dict(LaunchConfig(), "r.toml")
    assert err.value.key == "k8s.image"
    with pytest.raises(ConfigError) as err:
        k8s_manifest_dict(LaunchConfig(k8s=K8sOptions(image="i", name="Kiln_Run")), "r.toml")
    assert err.value.key == "k8s.name"
    with pytest.raises(ConfigError) as err:
        k8s_manifest_dict(LaunchConfig(nodes=3, min_nodes=2, k8s=K8sOptions(image="i", kind="jobset")), "r.toml")
    assert err.value.key == "min_nodes"


# --- Slurm --------------------------------------------------------------------------------------

SLURM_CASES = {
    "two_gpu_nodes": LaunchConfig(
        nodes=2,
        nproc_per_node=8,
        slurm=SlurmOptions(
            partition="gpu",
            account="proj",
            time="1-12:00:00",
            cpus_per_task=96,
            mem="0",
            env={"HF_HOME": "/scratch/$USER's cache", "RUN_TAG": "a b"},
            setup=["source .venv/bin/activate"],
        ),
    ),
    "container": LaunchConfig(
        nodes=16,
        nproc_per_node=8,
        slurm=SlurmOptions(
            container_image="nvcr.io#nvidia/pytorch:25.01-py3", container_mounts=["/lustre:/lustre"], exclusive=False
        ),
    ),
    "one_cpu_node": LaunchConfig(nproc_per_node=4, device="cpu", slurm=SlurmOptions(requeue_before_s=0)),
}


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
@pytest.mark.parametrize("case", sorted(SLURM_CASES))
def test_slurm_script_passes_bash_n(case, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(slurm_script(SLURM_CASES[case], "recipes/big run.toml", ["train.lr=3e-4"]))
    result = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = script.read_text().splitlines()
    assert lines[0] == "#!/bin/bash"
    directives = [line for line in lines if line.startswith("#SBATCH")]
    # sbatch reads directives only before the first command.
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert all(lines.index(d) < first_command for d in directives)
    assert "#SBATCH --requeue" in directives and "#SBATCH --ntasks-per-node=1" in directives


def _stubs(tmp_path: Path, srun_waits: bool = False) -> dict:
    """Stand-ins for srun and scontrol that record how they were called."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text(
        textwrap.dedent("""\
        #!/bin/sh
        echo "$*" >> "$STUB_DIR/scontrol.log"
        case "$1" in
          show) printf 'node-a\\nnode-b\\n' ;;
          requeue) [ -f "$STUB_DIR/srun.pid" ] && kill "$(cat "$STUB_DIR/srun.pid")" ;;
        esac
        """)
    )
    (stubs / "srun").write_text(
        textwrap.dedent(f"""\
        #!/bin/sh
        printf '%s\\0' "$@" > "$STUB_DIR/srun.argv"
        printf '%s\\0' "$HF_HOME" "$RUN_TAG" "$NCCL_DEBUG" "$SETUP_RAN" "$TORCH_DISABLE_SHARE_RDZV_TCP_STORE" \\
            > "$STUB_DIR/srun.env"
        {
            'echo $$ > "$STUB_DIR/pid.tmp" && mv "$STUB_DIR/pid.tmp" "$STUB_DIR/srun.pid" && exec sleep 120'
            if srun_waits
            else "exit 0"
        }
        """)
    )
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "NCCL_", "TORCH_"))}
    return {
        **env,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "STUB_DIR": str(tmp_path),
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "2",
    }


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_slurm_script_runs_one_torchrun_per_node(tmp_path, monkeypatch):
    cfg = SLURM_CASES["two_gpu_nodes"]
    script = tmp_path / "job.sbatch"
    script.write_text(slurm_script(cfg, "recipes/big run.toml", ["train.lr=3e-4"]))
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "activate").write_text("export SETUP_RAN=yes\n")  # the recipe's setup line
    result = subprocess.run(
        [BASH, str(script)], env=_stubs(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "rendezvous node-a:29500" in result.stdout
    assert (tmp_path / "scontrol.log").read_text().split("\n")[0] == "show hostnames node-[a-b]"

    argv = (tmp_path / "srun.argv").read_text().split("\0")[:-1]
    split = argv.index("torchrun")
    srun_opts, torchrun = argv[:split], argv[split + 1 :]
    assert {"--ntasks-per-node=1", "--nodes=2", "--kill-on-bad-exit=1", "--cpus-per-task=96"} <= set(srun_opts)
    args, config, cmd_args = torchrun_parse(torchrun, monkeypatch)
    assert config.rdzv_endpoint == "node-a:29500" and config.run_id == "kiln-4242"
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node, config.max_restarts) == (2, 2, 8, 3)
    # The recipe path with a space arrives as one argument.
    assert cmd_args[-4:] == ["kiln.cli", "pretrain", "recipes/big run.toml", "train.lr=3e-4"]
    # Setup lines run first; exported values reach the step unchanged, quotes and dollar signs included;
    # NCCL gets a default, and torchrun a fresh rendezvous store per restart.
    assert (tmp_path / "srun.env").read_text().split("\0")[:-1] == ["/scratch/$USER's cache", "a b", "WARN", "yes", "1"]


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_slurm_script_single_node_is_standalone(tmp_path, monkeypatch):
    script = tmp_path / "job.sbatch"
    script.write_text(slurm_script(SLURM_CASES["one_cpu_node"], "r.toml"))
    text = script.read_text()
    assert "--gres" not in text and "#SBATCH --signal" not in text
    result = subprocess.run([BASH, str(script)], env=_stubs(tmp_path), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    argv = (tmp_path / "srun.argv").read_text().split("\0")[:-1]
    args, config, _ = torchrun_parse(argv[argv.index("torchrun") + 1 :], monkeypatch)
    assert args.standalone and config.nproc_per_node == 4


@pytest.mark.skipif(BASH is None, reason="bash is not installed")
def test_slurm_script_requeues_on_the_time_limit_signal(tmp_path):
    cfg = LaunchConfig(nodes=2, nproc_per_node=8, slurm=SlurmOptions(time="4:00:00", requeue_before_s=120))
    script = tmp_path / "job.sbatch"
    script.write_text(slurm_script(cfg, "r.toml"))
    assert "#SBATCH --signal=B:USR1@120" in script.read_text()
    proc = subprocess.Popen(
        [BASH, str(script)],
        env=_stubs(tmp_path, srun_waits=True),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60  # a hang guard, not a performance bound
        while not (tmp_path / "srun.pid").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        # What Slurm does before the time limit: USR1 to the batch shell only.
        os.kill(proc.pid, signal.SIGUSR1)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.returncode != 128 + signal.SIGTERM:  # the stand-in step was not ended by the requeue
            try:
                os.kill(int((tmp_path / "srun.pid").read_text()), signal.SIGKILL)
            except (OSError, ValueError):
                pass
    assert "requeueing job 4242" in out, (out, err)
    assert "requeue 4242" in (tmp_path / "scontrol.log").read_text().splitlines()
    # The step was ended by the requeue (the stub's SIGTERM), and the script reports the step's status.
    assert proc.returncode == 128 + signal.SIGTERM


# --- Kubernetes ---------------------------------------------------------------------------------


class _Response:
    def __init__(self, obj):
        self.data = json.dumps(obj)


def validate_pytorchjob(manifest: dict) -> None:
    """Parse with the kubeflow.org/v1 models of the training SDK and check the operator's own rules.

    The models check types and required fields; serializing the parsed object back must give the
    manifest again, so unknown keys (which the models drop) and coerced values are caught too.
    """
    from kubeflow.training import ApiClient

    api = ApiClient()
    job = api.deserialize(_Response(manifest), "KubeflowOrgV1PyTorchJob")
    assert api.sanitize_for_serialization(job) == manifest, "fields unknown to or changed by the PyTorchJob API"
    assert (manifest["apiVersion"], manifest["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    # The rules of the training operator's admission webhook.
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    assert set(specs) <= {"Master", "Worker"}
    if "Master" in specs:
        assert specs["Master"]["replicas"] == 1
    if "Worker" in specs:
        assert specs["Worker"]["replicas"] >= 1
    if "elasticPolicy" in manifest["spec"]:
        assert "Worker" in specs and "nProcPerNode" not in manifest["spec"]["elasticPolicy"]
    for spec in specs.values():
        containers = spec["template"]["spec"]["containers"]
        assert any(c["name"] == "pytorch" and c["image"] for c in containers)


def validate_jobset(manifest: dict) -> None:
    """Parse with the jobset.x-k8s.io/v1alpha2 models of the Kubeflow Trainer API package (round trip
    as above), and check the Job rules that the API server applies to each replicated Job."""
    from kubeflow_trainer_api.models.jobset_v1alpha2_job_set import JobsetV1alpha2JobSet

    parsed = JobsetV1alpha2JobSet.from_dict(manifest)
    assert parsed.to_dict() == manifest, "fields unknown to or changed by the JobSet API"
    assert (manifest["apiVersion"], manifest["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    names = [r["name"] for r in manifest["spec"]["replicatedJobs"]]
    assert len(set(names)) == len(names)
    for rjob in manifest["spec"]["replicatedJobs"]:
        job = rjob["template"]["spec"]
        assert job["template"]["spec"]["restartPolicy"] in ("Never", "OnFailure")
        if job.get("completionMode") == "Indexed":
            assert job.get("completions"), "an Indexed Job needs completions"


def _command(manifest: dict, replica: str | None = None) -> list[str]:
    if manifest["kind"] == "PyTorchJob":
        pod = manifest["spec"]["pytorchReplicaSpecs"][replica]["template"]["spec"]
    else:
        pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    return pod["containers"][0]["command"]


K8S_OPTS = dict(
    image="ghcr.io/acme/kiln:0.1",
    cpu="90",
    memory="900Gi",
    shm_size="64Gi",
    pvc="kiln-runs",
    env={"HF_HOME": "/workspace/hf"},
)


def test_pytorchjob_manifest_validates(monkeypatch):
    cfg = LaunchConfig(nodes=2, nproc_per_node=8, k8s=K8sOptions(**K8S_OPTS))
    manifest = yaml.safe_load(k8s_manifest(cfg, "recipes/big.toml", ["train.lr=3e-4"]))
    assert manifest == k8s_manifest_dict(cfg, "recipes/big.toml", ["train.lr=3e-4"])
    validate_pytorchjob(manifest)
    specs = manifest["spec"]["pytorchReplicaSpecs"]
    assert specs["Master"]["replicas"] + specs["Worker"]["replicas"] == 2
    assert manifest["spec"]["nprocPerNode"] == "8"
    for replica in ("Master", "Worker"):
        command = _command(manifest, replica)
        assert command[0] == "torchrun"
        _, config, cmd_args = torchrun_parse(command[1:], monkeypatch)
        # The operator names the Master's pod (and its service) <job>-master-0.
        assert config.rdzv_endpoint == "kiln-big-master-0:29500" and config.max_nodes == 2
        assert cmd_args[-4:] == ["kiln.cli", "pretrain", "recipes/big.toml", "train.lr=3e-4"]
    container = specs["Worker"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "8", "cpu": "90", "memory": "900Gi"}
    assert {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"} in container["env"]
    assert {"name": "HF_HOME", "value": "/workspace/hf"} in container["env"]


def test_pytorchjob_single_node_and_elastic_validate(monkeypatch):
    one = k8s_manifest_dict(LaunchConfig(nproc_per_node=2, device="cpu", k8s=K8sOptions(image="kiln")), "r.toml")
    validate_pytorchjob(one)
    assert list(one["spec"]["pytorchReplicaSpecs"]) == ["Master"]
    assert "--standalone" in _command(one, "Master")
    assert "resources" not in one["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]

    elastic = k8s_manifest_dict(
        LaunchConfig(nodes=4, min_nodes=2, nproc_per_node=8, max_restarts=5, k8s=K8sOptions(image="kiln")), "r.toml"
    )
    validate_pytorchjob(elastic)
    policy = elastic["spec"]["elasticPolicy"]
    assert (policy["minReplicas"], policy["maxReplicas"], policy["maxRestarts"]) == (2, 4, 5)
    assert list(elastic["spec"]["pytorchReplicaSpecs"]) == ["Worker"]
    _, config, _ = torchrun_parse(_command(elastic, "Worker")[1:], monkeypatch)
    assert (config.min_nodes, config.max_nodes) == (2, 4)
    assert config.rdzv_endpoint == f"{policy['rdzvHost']}:{policy['rdzvPort']}" == "kiln-r-worker-0:29500"


def test_jobset_manifest_validates(monkeypatch):
    cfg = LaunchConfig(nodes=2, nproc_per_node=8, k8s=K8sOptions(kind="jobset", **K8S_OPTS))
    manifest = yaml.safe_load(k8s_manifest(cfg, "recipes/big.toml"))
    validate_jobset(manifest)
    job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == job["completions"] == 2 and job["completionMode"] == "Indexed"
    assert manifest["spec"]["network"]["enableDNSHostnames"] is True
    _, config, _ = torchrun_parse(_command(manifest)[1:], monkeypatch)
    # JobSet pod hostnames: <jobset>-<replicatedJob>-<job index>-<pod index>.<jobset>.
    assert config.rdzv_endpoint == "kiln-big-node-0-0.kiln-big:29500" and config.max_nodes == 2


@pytest.mark.parametrize("kind", ["pytorchjob", "jobset"])
def test_validators_reject_broken_manifests(kind):
    """The checks above are not vacuous: a misspelled field, wrong types and a missing required field fail."""
    validate = validate_pytorchjob if kind == "pytorchjob" else validate_jobset
    good = k8s_manifest_dict(LaunchConfig(nodes=2, k8s=K8sOptions(kind=kind, image="kiln")), "r.toml")
    validate(good)

    broken = []
    m = copy.deepcopy(good)
    m["spec"]["replicaSpecs"] = m["spec"].pop("pytorchReplicaSpecs" if kind == "pytorchjob" else "replicatedJobs")
    broken.append(m)
    m = copy.deepcopy(good)
    _pod(m)["containers"][0]["ports"][0]["containerPort"] = "29500"
    broken.append(m)
    m = copy.deepcopy(good)
    del _pod(m)["containers"][0]["name"]
    broken.append(m)
    m = copy.deepcopy(good)
    _pod(m)["containers"][0]["command"] = " ".join(_pod(m)["containers"][0]["command"])
    broken.append(m)
    for m in broken:
        with pytest.raises((AssertionError, ValueError)):
            validate(m)


def _pod(manifest: dict) -> dict:
    if manifest["kind"] == "PyTorchJob":
        return manifest["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]
    return manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


# --- the command line ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln")
    add_launch_parser(parser.add_subparsers(dest="verb", required=True))
    return parser


def test_cli_writes_script_and_manifest(tmp_path, capsys):
    out = tmp_path / "jobs" / "big.sbatch"
    code = run_launch(
        _parser().parse_args(
            [
                "launch",
                "slurm",
                "--nodes",
                "2",
                "--nproc",
                "8",
                "--partition",
                "gpu",
                "--env",
                "A=1",
                "--out",
                str(out),
                "cluster/big.toml",
                "train.lr=1e-3",
            ]
        )
    )
    assert code == 0 and os.access(out, os.X_OK)
    assert "#SBATCH --partition=gpu" in out.read_text() and "export A=1" in out.read_text()
    assert subprocess.run([BASH or "bash", "-n", str(out)]).returncode == 0

    code = run_launch(
        _parser().parse_args(
            ["launch", "k8s", "--kind", "jobset", "--image", "kiln:1", "--nodes", "2", "cluster/big.toml"]
        )
    )
    assert code == 0
    validate_jobset(yaml.safe_load(capsys.readouterr().out))

    recipe = REPO / "recipes" / "tiny.toml"
    code = run_launch(
        _parser().parse_args(["launch", "local", "--nproc", "2", "--dry-run", str(recipe), "train.max_steps=50"])
    )
    assert code == 0
    printed = capsys.readouterr().out.split()
    assert printed[:2] == ["torchrun", "--standalone"] and printed[-2:] == [str(recipe), "train.max_steps=50"]


def test_cli_local_runs_torchrun_with_this_interpreter(monkeypatch):
    started = {}

    class Popen:
        def __init__(self, argv, env):
            started.update(argv=argv, env=env)

        def wait(self, timeout=None):
            return 7

    monkeypatch.setattr("kiln.parallel.launch.subprocess.Popen", Popen)
    code = run_launch(
        _parser().parse_args(
            ["launch", "local", "--nproc", "2", "--device", "cpu", "cluster/big.toml", "train.lr=1e-3"]
        )
    )
    assert code == 7  # torchrun's exit status is the command's
    assert started["argv"][:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert started["argv"][-5:] == ["-m", "kiln.cli", "pretrain", "cluster/big.toml", "train.lr=1e-3"]
    assert started["env"]["CUDA_VISIBLE_DEVICES"] == "" and "PATH" in started["env"]
    assert started["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_cli_passes_resume_through_to_the_launched_pretrain(monkeypatch, capsys):
    """`--resume PATH` reaches `kiln pretrain` in all three launchers (it used to be refused by the
    parser); since every restart reruns the same command, it needs a job that does not restart."""
    from kiln.cli import build_parser

    ckpt = "runs/big/pretrain/checkpoints/step-00000400"
    no_restarts = ["--max-restarts", "0"]
    run_launch(_parser().parse_args(["launch", "local", "--dry-run", *no_restarts, "--resume", ckpt, "r.toml", "a=1"]))
    _, _, cmd_args = torchrun_parse(capsys.readouterr().out.split()[1:], monkeypatch)
    pretrain = build_parser(["pretrain"]).parse_args(cmd_args[cmd_args.index("pretrain") :])
    assert (pretrain.recipe, pretrain.overrides, pretrain.resume) == ("r.toml", ["a=1"], ckpt)

    run_launch(
        _parser().parse_args(["launch", "slurm", *no_restarts, "--requeue-before", "0", "--resume", ckpt, "r.toml"])
    )
    assert f"pretrain r.toml --resume {ckpt}" in " ".join(capsys.readouterr().out.replace("\\\n", " ").split())
    run_launch(
        _parser().parse_args(
            ["launch", "k8s", "--image", "kiln:1", *no_restarts, "--pod-restarts", "0", "--resume", ckpt, "r.toml"]
        )
    )
    job = yaml.safe_load(capsys.readouterr().out)
    command = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"][0]["command"]
    assert command[-4:] == ["pretrain", "r.toml", "--resume", ckpt]

    for argv, restarting in (
        (["local"], "--max-restarts 3"),
        (["slurm", *no_restarts], "--requeue-before 300"),
        (["k8s", "--image", "kiln:1", *no_restarts], "--pod-restarts 3"),
    ):
        with pytest.raises(ConfigError) as err:
            run_launch(_parser().parse_args(["launch", *argv, "--resume", ckpt, "r.toml"]))
        assert err.value.key == "--resume" and restarting in err.value.message


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["launch", "local", "--nodes", "0"], "--nodes"),
        (["launch", "slurm", "--nproc", "0"], "--nproc"),
        (["launch", "k8s", "--image", "kiln", "--kind", "statefulset"], "--kind"),
        (["launch", "k8s", "--nodes", "2"], "--image"),
        (["launch", "local", "--nodes", "2"], "--rdzv-endpoint"),
        (["launch", "slurm", "--env", "NOVALUE"], "--env"),
    ],
)
def test_cli_errors_name_the_flag(argv, flag):
    with pytest.raises(ConfigError) as err:
        run_launch(_parser().parse_args(argv + ["cluster/none.toml"]))
    assert err.value.key == flag and err.value.source == "<command line>"


def test_recipe_layout_must_match_the_launch(tmp_path):
    recipe = str(tmp_path / "r.toml")
    check_layout(ParallelConfig(dp_shard=4, tp=4), LaunchConfig(nodes=2, nproc_per_node=8), recipe)  # 4 x 4 = 16
    with pytest.raises(ConfigError) as err:
        check_layout(ParallelConfig(dp_shard=4, tp=4), LaunchConfig(nodes=1, nproc_per_node=8), recipe)
    assert err.value.key == "parallel" and "16" in str(err.value) and "8 ranks" in str(err.value)
    check_layout(ParallelConfig(tp=4), LaunchConfig(nodes=3, nproc_per_node=8), recipe)  # dp_shard=-1: the rest
    with pytest.raises(ConfigError):
        check_layout(ParallelConfig(tp=4), LaunchConfig(nodes=1, nproc_per_node=6), recipe)
    check_layout(None, LaunchConfig(nodes=1, nproc_per_node=6), recipe)  # a recipe only on the cluster


# --- real torchrun ------------------------------------------------------------------------------

WORKER = """\
import json, os, sys
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
record = {"world": world, "sum": total.item(), "local_rank": int(os.environ["LOCAL_RANK"])}
with open(os.path.join(sys.argv[1], f"rank{rank}-attempt{attempt}.json"), "w") as f:
    json.dump(record, f)
dist.destroy_process_group()
# A rank that crashes on its first `fail_attempts` starts: torchrun must restart the whole group.
if rank == 1 and attempt < int(sys.argv[2]):
    sys.exit(3)
"""


def _run_workers(tmp_path: Path, max_restarts: int, fail_attempts: int) -> tuple[int, list[str]]:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cfg = LaunchConfig(nproc_per_node=2, device="cpu", max_restarts=max_restarts, monitor_interval=0.2)
    # The timeout only guards against a hang; a healthy launch takes seconds.
    code = run_torchrun(
        cfg, [str(script), str(tmp_path), str(fail_attempts)], env={"OMP_NUM_THREADS": "1"}, timeout=600
    )
    return code, sorted(p.name for p in tmp_path.glob("rank*.json"))


def test_torchrun_launches_two_ranks(tmp_path):
    code, files = _run_workers(tmp_path, max_restarts=0, fail_attempts=0)
    assert code == 0
    assert files == ["rank0-attempt0.json", "rank1-attempt0.json"]
    records = [json.loads((tmp_path / f).read_text()) for f in files]
    assert [r["local_rank"] for r in records] == [0, 1]
    assert all(r["world"] == 2 and r["sum"] == 3.0 for r in records)


@pytest.mark.slow
def test_torchrun_restarts_a_crashed_group(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    code, files = _run_workers(first, max_restarts=1, fail_attempts=1)
    assert code == 0
    assert files == ["rank0-attempt0.json", "rank0-attempt1.json", "rank1-attempt0.json", "rank1-attempt1.json"]
    # Without restarts the same crash ends the launch with a failure.
    code, files = _run_workers(second, max_restarts=0, fail_attempts=1)
    assert code != 0
    assert files == ["rank0-attempt0.json", "rank1-attempt0.json"]
