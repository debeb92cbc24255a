"""`kiln launch`: start `kiln pretrain` under torchrun here, or write the Slurm script or Kubernetes
manifest that starts it on a cluster.

Every path ends in the same torchrun line, so a run behaves the same wherever it is launched:
one torchrun agent per node, `--nproc-per-node` workers each, a c10d rendezvous across nodes, and
`--max-restarts` worker-group restarts. A restarted `kiln pretrain` resumes from the newest complete
checkpoint (`--resume auto` is its default), which is what makes restarts and requeues safe.

Importing this module must stay cheap (no torch): the CLI imports it to build its parser.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from kiln.config import RECIPE_HELP, finite_float
from kiln.errors import ConfigError
from kiln.parallel.config import ParallelConfig

DEVICES = ("auto", "cpu", "cuda")
K8S_KINDS = ("pytorchjob", "jobset")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SLURM_TIME = re.compile(r"^\d+(-\d{1,2}(:\d{2}){0,2}|(:\d{2}){0,2})$")  # M, M:S, H:M:S, D-H, D-H:M, D-H:M:S
_QUANTITY = re.compile(r"^\d+(\.\d+)?(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")  # Kubernetes resource quantity
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # RFC 1035 label (job names)
# torchrun (torch >= 2.5) lends its rendezvous store to the workers and keeps it across restarts, so
# restarted workers can read the previous attempt's addresses and fail to connect, or hang (pytorch
# issues 135712 and 167288; measured here: 4 of 8 gloo restarts failed, 0 of 10 with this set). With
# it, each attempt's rank 0 hosts a fresh store.
_FRESH_STORE_PER_ATTEMPT = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
# Words that the Slurm script fills in at run time, written there as "$var" instead of as literals.
# The endpoint's ':' keeps torchrun_argv from appending a port to it.
_RDZV_ENDPOINT_VAR, _RDZV_ID_VAR = "\0rdzv:endpoint", "\0rdzv_id"


@dataclass
class SlurmOptions:
    job_name: str = ""  # default: kiln-<recipe file stem>
    partition: str = ""
    account: str = ""
    qos: str = ""
    time: str = ""  # D-HH:MM:SS; empty: the partition's default limit
    cpus_per_task: int = 0  # one task per node; 0 leaves it to the cluster (all CPUs with exclusive)
    mem: str = ""  # per node, e.g. 480G; "0" asks for all of it
    exclusive: bool = True
    output: str = "kiln-%x-%j.out"  # %x job name, %j job id; appended to across requeues
    requeue_before_s: int = 300  # Slurm signals the script this long before the time limit; it requeues
    container_image: str = ""  # pyxis/enroot image for srun --container-image
    container_mounts: list[str] = field(default_factory=list)  # SRC:DST entries
    setup: list[str] = field(default_factory=list)  # shell lines run first (module load, venv)
    env: dict[str, str] = field(default_factory=dict)
    torchrun: str = "torchrun"  # how the nodes find torchrun, e.g. ".venv/bin/torchrun"


@dataclass
class K8sOptions:
    kind: str = "pytorchjob"  # pytorchjob (Kubeflow training operator) | jobset (JobSet controller)
    name: str = ""  # default: kiln-<recipe file stem>
    namespace: str = "default"
    image: str = ""  # container image with Kiln installed (required)
    cpu: str = ""  # per pod (= per node) requests and limits, e.g. "90", "900Gi"
    memory: str = ""
    shm_size: str = ""  # size limit of the in-memory /dev/shm volume; empty: no limit
    pvc: str = ""  # PersistentVolumeClaim holding the run folders (checkpoints must survive pods)
    mount_path: str = "/workspace"  # where the claim is mounted, and the container's working directory
    pod_restarts: int = 3  # whole-job retries after a pod fails (runPolicy.backoffLimit / failurePolicy)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class LaunchConfig:
    nodes: int = 1
    nproc_per_node: int = 1  # ranks per node: GPUs per node on GPU machines
    device: str = "auto"  # auto | cpu | cuda. auto: local runs use GPUs if any; cluster jobs ask for GPUs
    min_nodes: int = 0  # elastic lower bound on nodes; 0: a fixed-size job of `nodes`
    rdzv_endpoint: str = ""  # host[:port] of the rendezvous; multi-node local launches only
    rdzv_port: int = 29500
    rdzv_id: str = "kiln"
    max_restarts: int = 3  # torchrun worker-group restarts before it gives up
    monitor_interval: float = 5.0  # seconds between torchrun's checks of its workers
    torchrun_args: list[str] = field(default_factory=list)  # passed to torchrun as they are
    slurm: SlurmOptions = field(default_factory=SlurmOptions)
    k8s: K8sOptions = field(default_factory=K8sOptions)

    def validate(self) -> None:
        for key in ("nodes", "nproc_per_node", "rdzv_port"):
            if getattr(self, key) < 1:
                raise ConfigError(key, f"must be >= 1, got {getattr(self, key)}")
        if self.rdzv_port > 65535:
            raise ConfigError("rdzv_port", f"must be a TCP port (1-65535), got {self.rdzv_port}")
        if self.device not in DEVICES:
            raise ConfigError("device", f"must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not 0 <= self.min_nodes <= self.nodes:
            raise ConfigError(
                "min_nodes", f"must be between 0 (fixed size) and nodes={self.nodes}, got {self.min_nodes}"
            )
        if self.max_restarts < 0:
            raise ConfigError("max_restarts", f"must be >= 0, got {self.max_restarts}")
        if self.monitor_interval <= 0:
            raise ConfigError("monitor_interval", f"must be > 0 seconds, got {self.monitor_interval}")
        if not self.rdzv_id or not re.fullmatch(r"[A-Za-z0-9_.-]+", self.rdzv_id):
            raise ConfigError("rdzv_id", f"must be letters, digits, '.', '_' or '-', got {self.rdzv_id!r}")
        s, k = self.slurm, self.k8s
        if s.time and not _SLURM_TIME.match(s.time):
            raise ConfigError("slurm.time", f"must look like MM, HH:MM:SS or D-HH:MM:SS, got {s.time!r}")
        if s.cpus_per_task < 0:
            raise ConfigError("slurm.cpus_per_task", f"must be >= 0, got {s.cpus_per_task}")
        if s.requeue_before_s < 0:
            raise ConfigError("slurm.requeue_before_s", f"must be >= 0, got {s.requeue_before_s}")
        if k.kind not in K8S_KINDS:
            raise ConfigError("k8s.kind", f"must be one of {', '.join(K8S_KINDS)}, got {k.kind!r}")
        for key in ("cpu", "memory", "shm_size"):
            value = getattr(k, key)
            if value and not _QUANTITY.match(value):
                raise ConfigError(f"k8s.{key}", f"must be a Kubernetes quantity such as 8, 500m or 64Gi, got {value!r}")
        if k.pod_restarts < 0:
            raise ConfigError("k8s.pod_restarts", f"must be >= 0, got {k.pod_restarts}")
        for section, env in (("slurm.env", s.env), ("k8s.env", k.env)):
            for name in env:
                if not _ENV_NAME.match(name):
                    raise ConfigError(section, f"{name!r} is not an environment variable name")

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    @property
    def nnodes(self) -> str:
        """torchrun's --nnodes: a count, or MIN:MAX for an elastic job that may lose nodes."""
        return f"{self.min_nodes}:{self.nodes}" if 0 < self.min_nodes < self.nodes else str(self.nodes)


def torchrun_argv(
    cfg: LaunchConfig,
    program: Sequence[str],
    launcher: Sequence[str] = ("torchrun",),
    rdzv_endpoint: str | None = None,
    rdzv_id: str | None = None,
) -> list[str]:
    """The torchrun command line that starts `program` (a script and its arguments, or -m MODULE ...)."""
    cfg.validate()
    argv = [*launcher]
    endpoint = rdzv_endpoint if rdzv_endpoint is not None else cfg.rdzv_endpoint
    if cfg.nodes == 1 and not endpoint:
        # One node: torchrun hosts its own rendezvous on a free port, so concurrent jobs cannot collide.
        argv += ["--standalone", "--nnodes", "1"]
    else:
        if not endpoint:
            raise ConfigError(
                "rdzv_endpoint",
                f"a {cfg.nodes}-node launch needs the rendezvous host "
                "(HOST or HOST:PORT of the first node), reachable from every node",
            )
        if ":" not in endpoint:
            endpoint = f"{endpoint}:{cfg.rdzv_port}"
        argv += [
            "--nnodes",
            cfg.nnodes,
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-id",
            rdzv_id if rdzv_id is not None else cfg.rdzv_id,
        ]
    argv += [
        "--nproc-per-node",
        str(cfg.nproc_per_node),
        "--max-restarts",
        str(cfg.max_restarts),
        "--monitor-interval",
        f"{cfg.monitor_interval:g}",
        *cfg.torchrun_args,
        *program,
    ]
    return argv


def pretrain_program(recipe: str, overrides: Sequence[str] = ()) -> list[str]:
    return ["-m", "kiln.cli", "pretrain", str(recipe), *overrides]


def torchrun_command(
    cfg: LaunchConfig, recipe: str, overrides: Sequence[str] = (), launcher: Sequence[str] = ("torchrun",)
) -> list[str]:
    """argv of `torchrun ... -m kiln.cli pretrain RECIPE OVERRIDES...`."""
    return torchrun_argv(cfg, pretrain_program(recipe, overrides), launcher)


def run_torchrun(
    cfg: LaunchConfig, program: Sequence[str], env: dict[str, str] | None = None, timeout: float | None = None
) -> int:
    """Run torchrun on this machine (this interpreter's torch) and return its exit status.

    Past `timeout` seconds torchrun gets SIGTERM (it stops its workers) and TimeoutExpired is raised.
    """
    argv = torchrun_argv(cfg, program, launcher=(sys.executable, "-m", "torch.distributed.run"))
    child_env = dict([_FRESH_STORE_PER_ATTEMPT])
    child_env.update({**os.environ, **(env or {})})
    if _local_device(cfg) == "cpu":
        # The trainer takes a visible GPU when there is one; hiding them keeps a cpu launch on the CPU.
        child_env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.Popen(argv, env=child_env)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        proc.wait()
        raise
    except KeyboardInterrupt:
        # torchrun got the same Ctrl-C and is stopping its workers: killing it now would orphan them.
        proc.wait()
        raise


def _local_device(cfg: LaunchConfig) -> str:
    if cfg.device == "cpu":
        return "cpu"
    import torch

    gpus = torch.cuda.device_count()
    if cfg.device == "cuda" and gpus < cfg.nproc_per_node:
        raise ConfigError(
            "nproc_per_node",
            f"{cfg.nproc_per_node} processes on device cuda need as many GPUs; this machine has {gpus}",
        )
    if cfg.device == "auto" and 0 < gpus < cfg.nproc_per_node:
        raise ConfigError(
            "nproc_per_node", f"{cfg.nproc_per_node} processes but {gpus} GPU(s) here; lower it or pass --device cpu"
        )
    return "cuda" if gpus else "cpu"


def check_layout(parallel: ParallelConfig | None, cfg: LaunchConfig, recipe: str) -> None:
    """Fail before submitting a job whose recipe cannot lay itself out over the launched ranks.

    `parallel` is the recipe's [parallel] table, None when the recipe is not readable here (a script
    may name a path that exists only on the cluster).
    """
    if parallel is None:
        return
    world = cfg.world_size
    # ep is left out: expert parallelism reuses the dp_shard x cp ranks instead of adding its own.
    fixed = parallel.dp_replicate * parallel.tp * parallel.pp * parallel.cp
    layout = f"dp_replicate={parallel.dp_replicate} tp={parallel.tp} pp={parallel.pp} cp={parallel.cp}"
    if parallel.dp_shard == -1:
        if world % fixed:
            raise ConfigError(
                "parallel",
                f"{layout} (product {fixed}) does not divide the launch's "
                f"{cfg.nodes} nodes x {cfg.nproc_per_node} = {world} ranks",
                recipe,
            )
    elif fixed * parallel.dp_shard != world:
        raise ConfigError(
            "parallel",
            f"{layout} dp_shard={parallel.dp_shard} multiply to {fixed * parallel.dp_shard}, "
            f"but the launch has {cfg.nodes} nodes x {cfg.nproc_per_node} = {world} ranks",
            recipe,
        )
    try:  # the options the layout of this many ranks would not use; "auto" decides the device later
        parallel.check_options(world // fixed, None if cfg.device == "auto" else cfg.device)
    except ConfigError as err:
        raise err.within("parallel", recipe) from None


def _default_name(recipe: str) -> str:
    stem = re.sub(r"[^a-z0-9-]+", "-", Path(recipe).stem.lower()).strip("-")
    return f"kiln-{stem}"[:63].rstrip("-") if stem else "kiln"


def _shell_word(word: str) -> str:
    if word == _RDZV_ENDPOINT_VAR:
        return '"$rdzv_endpoint"'
    if word == _RDZV_ID_VAR:
        return '"$rdzv_id"'
    return shlex.quote(word)


def slurm_script(cfg: LaunchConfig, recipe: str, overrides: Sequence[str] = ()) -> str:
    """A complete sbatch script: one srun task per node, each running one torchrun agent."""
    cfg.validate()
    s = cfg.slurm
    gpus = cfg.device != "cpu"  # auto on a cluster means GPU nodes
    directives = [f"--job-name={s.job_name or _default_name(recipe)}", f"--nodes={cfg.nodes}", "--ntasks-per-node=1"]
    if gpus:
        directives.append(f"--gres=gpu:{cfg.nproc_per_node}")
    if s.cpus_per_task:
        directives.append(f"--cpus-per-task={s.cpus_per_task}")
    if s.mem:
        directives.append(f"--mem={s.mem}")
    if s.exclusive:
        directives.append("--exclusive")
    for flag in ("partition", "account", "qos", "time"):
        if getattr(s, flag):
            directives.append(f"--{flag}={getattr(s, flag)}")
    # A requeued job appends to the same log, so one file tells the whole story of the run.
    directives += [f"--output={s.output}", "--open-mode=append", "--requeue"]
    if s.requeue_before_s:
        # B: signals only the batch shell, whose trap requeues; the workers keep training until then.
        directives.append(f"--signal=B:USR1@{s.requeue_before_s}")

    program = pretrain_program(recipe, overrides)
    if cfg.nodes == 1:
        torchrun = torchrun_argv(cfg, program, launcher=shlex.split(s.torchrun))
    else:
        torchrun = torchrun_argv(
            cfg, program, launcher=shlex.split(s.torchrun), rdzv_endpoint=_RDZV_ENDPOINT_VAR, rdzv_id=_RDZV_ID_VAR
        )
    srun = ["srun", "--ntasks-per-node=1", f"--nodes={cfg.nodes}", "--kill-on-bad-exit=1", "--label"]
    if s.cpus_per_task:
        srun.append(f"--cpus-per-task={s.cpus_per_task}")  # srun does not inherit it from sbatch (Slurm >= 22.05)
    if s.container_image:
        srun.append(f"--container-image={s.container_image}")
        if s.container_mounts:
            srun.append(f"--container-mounts={','.join(s.container_mounts)}")
        srun.append("--container-workdir=" + "${SLURM_SUBMIT_DIR}")
    split = len(torchrun) - len(program)
    command = " \\\n  ".join(
        [
            " ".join(_shell_word(w) if "$" not in w else f'"{w}"' for w in srun),
            " ".join(_shell_word(w) for w in torchrun[:split]),
            " ".join(_shell_word(w) for w in torchrun[split:]),
        ]
    )

    lines = [
        "#!/bin/bash",
        f"# kiln pretrain {recipe}: {cfg.nodes} node(s) x {cfg.nproc_per_node} rank(s) = {cfg.world_size} ranks.",
        "# Written by `kiln launch slurm`; submit with `sbatch THIS_FILE` from the directory the recipe",
        "# paths are relative to.",
        *[f"#SBATCH {d}" for d in directives],
        "",
        "# No pipefail: `head -n1` may close the pipe before scontrol is done writing.",
        "set -eu",
        *s.setup,
    ]
    store_var, store_default = _FRESH_STORE_PER_ATTEMPT
    lines += [
        "",
        "# Each torchrun restart gets a fresh store, so restarted ranks never read stale peer addresses.",
        f'export {store_var}="${{{store_var}:-{store_default}}}"',
        *[f"export {name}={shlex.quote(value)}" for name, value in s.env.items()],
    ]
    if gpus:
        lines += [
            "",
            "# NCCL: collective errors raise (and torchrun restarts the group) instead of hanging.",
            'export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"',
            'export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"',
            "# If NCCL picks the wrong network, name the fast interfaces, e.g.:",
            "# export NCCL_SOCKET_IFNAME=ib0        # or ^lo,docker0 to exclude",
            "# export NCCL_IB_HCA=mlx5",
        ]
    else:
        lines += [
            "",
            "export CUDA_VISIBLE_DEVICES=  # CPU ranks: gloo collectives",
            "# If gloo picks the wrong network, name it: export GLOO_SOCKET_IFNAME=eth0",
        ]
    lines += [
        "",
        "# The first node of the allocation hosts the c10d rendezvous; every agent joins it there.",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        f'rdzv_endpoint="${{head_node}}:{cfg.rdzv_port}"',
        'rdzv_id="kiln-${SLURM_JOB_ID}"',
        'echo "kiln: job ${SLURM_JOB_ID} (requeue ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NUM_NODES} node(s),'
        ' rendezvous ${rdzv_endpoint}"',
        "",
        "# Near the time limit Slurm sends USR1 (see --signal): put the job back in the queue. The next",
        "# start runs the same command, and `kiln pretrain` resumes from the newest complete checkpoint.",
        "# Preemption with requeue needs nothing here: --requeue lets Slurm restart the job itself.",
        "requeue() {",
        '  echo "kiln: time limit near, requeueing job ${SLURM_JOB_ID}"',
        '  scontrol requeue "${SLURM_JOB_ID}"',
        "}",
        "trap requeue USR1",
        "",
        command + " &",
        "step=$!",
        "# `wait` returns early when a trapped signal arrives; keep waiting for the step itself,",
        "# then exit with its status.",
        'while kill -0 "$step" 2>/dev/null; do wait "$step" || true; done',
        'wait "$step"',
        "",
    ]
    return "\n".join(lines)


def k8s_manifest_dict(cfg: LaunchConfig, recipe: str, overrides: Sequence[str] = ()) -> dict:
    """The PyTorchJob (kubeflow.org/v1) or JobSet (jobset.x-k8s.io/v1alpha2) resource as a dict."""
    cfg.validate()
    k = cfg.k8s
    if not k.image:
        raise ConfigError("k8s.image", "a container image with Kiln installed is required")
    name = k.name or _default_name(recipe)
    if len(name) > 50 or not _DNS_LABEL.match(name):
        # 50, not 63: pod and service names append "-worker-NN" or "-node-0-NN" to it.
        raise ConfigError(
            "k8s.name",
            f"must be lowercase letters, digits and '-', start with a letter and be "
            f"at most 50 characters, got {name!r}",
        )
    elastic = 0 < cfg.min_nodes < cfg.nodes
    if k.kind == "jobset" and elastic:
        raise ConfigError(
            "min_nodes", "a JobSet runs a fixed number of pods; elastic node counts need k8s.kind = pytorchjob"
        )
    program = pretrain_program(recipe, overrides)
    if k.kind == "pytorchjob":
        # Elastic jobs are Worker-only (the operator scales Workers); fixed ones have Master + Workers.
        head = f"{name}-worker-0" if elastic else f"{name}-master-0"
    else:
        # JobSet pod hostnames are <jobset>-<replicatedJob>-<job index>-<pod index>.<subdomain = jobset name>.
        head = f"{name}-node-0-0.{name}"
    # On one node the head pod is this pod: a standalone rendezvous needs no address at all.
    endpoint = "" if cfg.nodes == 1 else f"{head}:{cfg.rdzv_port}"
    command = torchrun_argv(cfg, program, rdzv_endpoint=endpoint, rdzv_id=name)

    gpus = str(cfg.nproc_per_node) if cfg.device != "cpu" else ""
    resources = {key: value for key, value in (("nvidia.com/gpu", gpus), ("cpu", k.cpu), ("memory", k.memory)) if value}
    env = [{"name": n, "value": v} for n, v in dict([_FRESH_STORE_PER_ATTEMPT], **k.env).items()]
    if cfg.device == "cpu":
        env.append({"name": "CUDA_VISIBLE_DEVICES", "value": ""})
    # Collectives and data loader workers share memory through /dev/shm, which containers cap at 64 MiB.
    shm = {"medium": "Memory", **({"sizeLimit": k.shm_size} if k.shm_size else {})}
    volumes = [{"name": "dshm", "emptyDir": shm}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if k.pvc:
        volumes.append({"name": "runs", "persistentVolumeClaim": {"claimName": k.pvc}})
        mounts.append({"name": "runs", "mountPath": k.mount_path})
    container = {
        "name": "pytorch" if k.kind == "pytorchjob" else "trainer",
        "image": k.image,
        "command": command,
        "ports": [
            {
                "name": "pytorchjob-port" if k.kind == "pytorchjob" else "rendezvous",
                "containerPort": cfg.rdzv_port,
                "protocol": "TCP",
            }
        ],
        "volumeMounts": mounts,
        "env": env,
    }
    if k.pvc:
        # Recipes and run folders are read relative to the claim, so checkpoints outlive every pod.
        container["workingDir"] = k.mount_path
    if resources:
        container["resources"] = {"requests": dict(resources), "limits": dict(resources)}
    metadata = {"name": name, "namespace": k.namespace, "labels": {"app.kubernetes.io/managed-by": "kiln"}}

    if k.kind == "pytorchjob":

        def replica(count: int) -> dict:
            # OnFailure restarts a failed container in place; its torchrun rejoins the rendezvous.
            return {
                "replicas": count,
                "restartPolicy": "OnFailure",
                "template": {"spec": {"containers": [copy.deepcopy(container)], "volumes": copy.deepcopy(volumes)}},
            }

        if elastic:
            specs = {"Worker": replica(cfg.nodes)}
        else:
            specs = {"Master": replica(1)}
            if cfg.nodes > 1:
                specs["Worker"] = replica(cfg.nodes - 1)
        spec: dict = {
            "nprocPerNode": str(cfg.nproc_per_node),
            "runPolicy": {"backoffLimit": k.pod_restarts},
            "pytorchReplicaSpecs": specs,
        }
        if elastic:
            spec["elasticPolicy"] = {
                "rdzvBackend": "c10d",
                "rdzvHost": head,
                "rdzvPort": cfg.rdzv_port,
                "minReplicas": cfg.min_nodes,
                "maxReplicas": cfg.nodes,
                "maxRestarts": cfg.max_restarts,
            }
        return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": metadata, "spec": spec}

    job = {
        "parallelism": cfg.nodes,
        "completions": cfg.nodes,
        "completionMode": "Indexed",
        # A failed pod fails its Job at once, and the JobSet's failurePolicy restarts every pod together.
        "backoffLimit": 0,
        "template": {"spec": {"restartPolicy": "Never", "containers": [container], "volumes": volumes}},
    }
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "failurePolicy": {"maxRestarts": k.pod_restarts},
            "network": {"enableDNSHostnames": True},
            "replicatedJobs": [{"name": "node", "replicas": 1, "template": {"spec": job}}],
        },
    }


def k8s_manifest(cfg: LaunchConfig, recipe: str, overrides: Sequence[str] = ()) -> str:
    """The manifest as YAML text (JSON, itself valid YAML, where PyYAML is not installed)."""
    resource = k8s_manifest_dict(cfg, recipe, overrides)
    header = (
        f"# kiln pretrain {recipe}: {cfg.nodes} pod(s) x {cfg.nproc_per_node} rank(s).\n"
        "# Written by `kiln launch k8s`; apply with `kubectl apply -f THIS_FILE`.\n"
    )
    try:
        import yaml
    except ImportError:
        return header + json.dumps(resource, indent=2) + "\n"
    return header + yaml.safe_dump(resource, sort_keys=False, default_flow_style=False)


# --- the `kiln launch` command ------------------------------------------------------------------

# Config keys whose flag is not just the last part of the key with '-' for '_', so errors name the flag to fix.
_FLAGS = {"nproc_per_node": "--nproc", "slurm.requeue_before_s": "--requeue-before"}


def add_launch_parser(verbs: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `kiln launch {local,slurm,k8s}` on the CLI's verb subparsers."""
    p = verbs.add_parser("launch", help="pretrain under torchrun here, or write a Slurm script / Kubernetes manifest")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    helps = {
        "local": "run torchrun on this machine now (one node, or this node of a multi-node rendezvous)",
        "slurm": "write an sbatch script (to --out, else stdout)",
        "k8s": "write a Kubeflow PyTorchJob or JobSet manifest (to --out, else stdout)",
    }
    for action, help_text in helps.items():
        a = actions.add_parser(action, help=help_text)
        a.add_argument("recipe", nargs="?", default="tiny", help=RECIPE_HELP)
        a.add_argument("overrides", nargs="*", help="dotted overrides passed to `kiln pretrain`")
        a.add_argument(
            "--resume",
            default="auto",
            help="passed to `kiln pretrain`: auto (newest complete checkpoint), none, or a checkpoint path; "
            "anything but auto needs a job that does not restart (--max-restarts 0, and --requeue-before 0 "
            "or --pod-restarts 0)",
        )
        a.add_argument("--nodes", type=int, default=1)
        a.add_argument(
            "--nproc",
            "--nproc-per-node",
            "--gpus-per-node",
            dest="nproc",
            type=int,
            default=8 if action != "local" else 1,
            help="ranks per node (GPUs per node)",
        )
        a.add_argument("--device", choices=DEVICES, default="auto")
        a.add_argument("--min-nodes", type=int, default=0, help="elastic: keep training down to this many nodes")
        a.add_argument("--max-restarts", type=int, default=3, help="torchrun worker-group restarts")
        a.add_argument("--monitor-interval", type=finite_float, default=5.0)
        a.add_argument("--rdzv-port", type=int, default=29500)
        a.add_argument(
            "--torchrun-arg",
            action="append",
            default=[],
            metavar="ARG",
            help="extra torchrun argument (repeatable), e.g. --torchrun-arg=--log-dir=logs",
        )
        if action == "local":
            a.add_argument("--rdzv-endpoint", default="", help="HOST[:PORT] of the first node (multi-node)")
            a.add_argument("--rdzv-id", default="kiln", help="same on every node of one job")
            a.add_argument("--dry-run", action="store_true", help="print the torchrun command instead of running it")
            continue
        a.add_argument(
            "--env", action="append", default=[], metavar="NAME=VALUE", help="environment variable (repeatable)"
        )
        a.add_argument("--out", help="file to write (default: print)")
        if action == "slurm":
            for flag in ("partition", "account", "qos", "time", "mem", "job-name", "container-image"):
                a.add_argument(f"--{flag}", default="")
            a.add_argument("--cpus-per-task", type=int, default=0)
            a.add_argument("--no-exclusive", action="store_true", help="share nodes with other jobs")
            a.add_argument(
                "--requeue-before",
                type=int,
                default=300,
                metavar="SECONDS",
                help="requeue this long before the time limit; 0: never",
            )
            a.add_argument("--container-mount", action="append", default=[], metavar="SRC:DST")
            a.add_argument(
                "--setup",
                action="append",
                default=[],
                metavar="LINE",
                help="shell line run before launching (repeatable), e.g. 'source .venv/bin/activate'",
            )
            a.add_argument("--torchrun", default="torchrun", help="torchrun command on the nodes")
        else:
            a.add_argument("--kind", default="pytorchjob", help="pytorchjob | jobset")
            a.add_argument("--image", default="", help="container image with Kiln installed")
            for flag in ("name", "cpu", "memory", "shm-size"):
                a.add_argument(f"--{flag}", default="")
            a.add_argument("--namespace", default="default")
            a.add_argument("--pvc", default="", help="PersistentVolumeClaim for the run folders")
            a.add_argument("--mount-path", default="/workspace")
            a.add_argument("--pod-restarts", type=int, default=3)
    return p


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    cfg = LaunchConfig(
        nodes=args.nodes,
        nproc_per_node=args.nproc,
        device=args.device,
        min_nodes=args.min_nodes,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        rdzv_port=args.rdzv_port,
        torchrun_args=list(args.torchrun_arg),
    )
    if args.action == "local":
        cfg.rdzv_endpoint, cfg.rdzv_id = args.rdzv_endpoint, args.rdzv_id
        return cfg
    env: dict[str, str] = {}
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep:
            raise ConfigError("--env", f"expected NAME=VALUE, got {item!r}", "<command line>")
        env[name] = value
    if args.action == "slurm":
        cfg.slurm = SlurmOptions(
            job_name=args.job_name,
            partition=args.partition,
            account=args.account,
            qos=args.qos,
            time=args.time,
            cpus_per_task=args.cpus_per_task,
            mem=args.mem,
            exclusive=not args.no_exclusive,
            requeue_before_s=args.requeue_before,
            container_image=args.container_image,
            container_mounts=list(args.container_mount),
            setup=list(args.setup),
            env=env,
            torchrun=args.torchrun,
        )
    else:
        cfg.k8s = K8sOptions(
            kind=args.kind,
            name=args.name,
            namespace=args.namespace,
            image=args.image,
            cpu=args.cpu,
            memory=args.memory,
            shm_size=args.shm_size,
            pvc=args.pvc,
            mount_path=args.mount_path,
            pod_restarts=args.pod_restarts,
            env=env,
        )
    return cfg


def run_launch(args: argparse.Namespace, parallel: ParallelConfig | None = None) -> int:
    """`kiln launch ACTION ...`: returns the process exit status. `parallel` is the recipe's
    [parallel] table when the recipe is readable here (the caller loads the recipe)."""
    try:
        return _launch(args, parallel)
    except ConfigError as err:
        if err.source:  # named in a recipe (or already a flag): keep as it is
            raise
        flag = _FLAGS.get(err.key, "--" + err.key.split(".")[-1].replace("_", "-"))
        raise ConfigError(flag, err.message, "<command line>") from None


def pretrain_arguments(args: argparse.Namespace, cfg: LaunchConfig) -> list[str]:
    """The overrides and flags the launched `kiln pretrain` gets after its recipe.

    Every restart (torchrun's, a Slurm requeue, a pod restart) runs the same command again, and a
    restart must continue from the newest checkpoint: one told to resume from a fixed path, or from
    none, would go back there each time (and set the progress since aside). So a resume other than
    auto is passed only to a job that does not restart."""
    if args.resume == "auto":
        return list(args.overrides)
    restarts = {"--max-restarts": cfg.max_restarts}
    if args.action == "slurm":
        restarts["--requeue-before"] = cfg.slurm.requeue_before_s
    if args.action == "k8s":
        restarts["--pod-restarts"] = cfg.k8s.pod_restarts
    on = [f"{flag} {value}" for flag, value in restarts.items() if value]
    if on:
        raise ConfigError(
            "--resume",
            f"{args.resume!r} would be resumed again by every restart ({', '.join(on)}); "
            f"set {' and '.join(f'{flag} 0' for flag in restarts)}, or resume with auto",
            "<command line>",
        )
    return [*args.overrides, "--resume", args.resume]


def _launch(args: argparse.Namespace, parallel: ParallelConfig | None) -> int:
    cfg = config_from_args(args)
    cfg.validate()
    check_layout(parallel, cfg, args.recipe)
    arguments = pretrain_arguments(args, cfg)
    if args.action == "local":
        if args.dry_run:
            print(shlex.join(torchrun_command(cfg, args.recipe, arguments)))
            return 0
        return run_torchrun(cfg, pretrain_program(args.recipe, arguments))
    text = (slurm_script if args.action == "slurm" else k8s_manifest)(cfg, args.recipe, arguments)
    if not args.out:
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    if args.action == "slurm":
        out.chmod(0o755)
    print(f"wrote {out}", file=sys.stderr)
    return 0
