"""Checkpoints, the bottom layer every stage may import: the folder format and its manifest,
atomic publish, the run's checkpoints root, sharded (DCP) save and load, and what Kiln refuses to
unpickle, and roots on object stores (kiln.checkpoint.remote). Nothing here imports a layer above it; the model side (a ModelConfig from the manifest,
older weight layouts) is kiln.model.weights."""

from kiln.checkpoint.format import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    MODEL_FILE,
    TRAIN_STATE_FILE,
    WEIGHTS_LAYOUT,
    CheckpointError,
    load_single_file_state,
    loaded_line,
    read_manifest,
    read_safetensors,
    save_weights,
    sha256_file,
    step_dirname,
    verify,
    write_manifest,
    write_safetensors,
)
from kiln.checkpoint.manager import CheckpointManager
from kiln.checkpoint.remote import (
    RemoteCheckpointManager,
    checkpoint_manager,
    complete_checkpoints,
    fetch_checkpoint,
    resolve_checkpoint,
)
from kiln.checkpoint.rng import capture_rng_state, restore_rng_state
from kiln.checkpoint.safety import SHARDED_DIR, WeightsOnlyLoadPlanner, check_sharded_pickles
from kiln.checkpoint.sharded import ShardedSaver, load_sharded, load_sharded_weights

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST_FILE",
    "MODEL_FILE",
    "SHARDED_DIR",
    "TRAIN_STATE_FILE",
    "WEIGHTS_LAYOUT",
    "CheckpointError",
    "CheckpointManager",
    "RemoteCheckpointManager",
    "ShardedSaver",
    "WeightsOnlyLoadPlanner",
    "capture_rng_state",
    "check_sharded_pickles",
    "checkpoint_manager",
    "complete_checkpoints",
    "fetch_checkpoint",
    "load_sharded",
    "load_sharded_weights",
    "load_single_file_state",
    "read_manifest",
    "read_safetensors",
    "resolve_checkpoint",
    "loaded_line",
    "restore_rng_state",
    "save_weights",
    "sha256_file",
    "step_dirname",
    "verify",
    "write_manifest",
    "write_safetensors",
]
