"""Checkpoints: one file per step for single-device and DDP runs, a sharded DCP directory for FSDP2.

    python checkpoint.py to-file out/ckpt_00001000 ckpt.pt   # DCP directory -> single file
    python checkpoint.py to-dcp  ckpt.pt out/ckpt_00001000    # single file -> DCP directory

Both formats hold the same thing: the model and optimizer state dicts keyed by parameter name
(torch.distributed.checkpoint.state_dict's layout, the same for a plain, DDP or FSDP2 model), plus a
few plain entries (format version, step, data-loader position, RNG, configs): the "meta" part. So any run can resume from either, at
any world size: DCP reshards tensors to the loading run's layout. A single file loads with
torch.load(weights_only=True); a DCP directory keeps its meta in meta.pt, loaded the same way.
"""

import argparse
import os
import shutil
import sys

import torch
import torch.distributed.checkpoint as dcp

CHECKPOINT_VERSION = 1
META_FILE = "meta.pt"


class CheckpointError(Exception):
    """A checkpoint the user pointed us at cannot be used; the message is one line."""


def checkpoint_path(out_dir: str, step: int, sharded: bool) -> str:
    name = f"ckpt_{step:08d}"
    return os.path.join(out_dir, name if sharded else f"{name}.pt")


def checkpoint_step(path: str) -> int:
    return int(os.path.basename(path).removeprefix("ckpt_").removesuffix(".pt"))


def list_checkpoints(out_dir: str) -> list[str]:
    """Checkpoints in out_dir of either format, oldest first. Temporary (unfinished) ones are ignored."""
    if not os.path.isdir(out_dir):
        return []
    found = []
    for name in os.listdir(out_dir):
        stem = name.removesuffix(".pt")
        if name.startswith("ckpt_") and stem[5:].isdigit():
            found.append(os.path.join(out_dir, name))
    return sorted(found, key=checkpoint_step)


def _fsync_write(path: str, write) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_file(state: dict, path: str) -> None:
    """Write to a temporary file, fsync, then rename: a crash never leaves a half-written checkpoint."""
    _fsync_write(path, lambda f: torch.save(state, f))


def save_sharded(tensors: dict, meta: dict, path: str, is_main: bool, barrier) -> None:
    """Every rank writes its shards into a temporary directory; rank 0 renames it once all are done."""
    tmp = f"{path}.tmp"
    if is_main and os.path.exists(tmp):
        shutil.rmtree(tmp)
    barrier()
    dcp.save(tensors, checkpoint_id=tmp)
    if is_main:
        _fsync_write(os.path.join(tmp, META_FILE), lambda f: torch.save(meta, f))
        os.replace(tmp, path)
    barrier()


def _torch_load(path: str):
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot load checkpoint {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from None


def _check_meta(meta, path: str) -> dict:
    if not isinstance(meta, dict) or meta.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} is not a checkpoint of this trainer (format version {CHECKPOINT_VERSION})")
    return meta


def load_meta(path: str) -> dict:
    """The meta dict (step, loader, rng, configs) of a checkpoint of either format."""
    if os.path.isdir(path):
        return _check_meta(_torch_load(os.path.join(path, META_FILE)), path)
    state = _torch_load(path)
    if isinstance(state, dict):
        state = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
    return _check_meta(state, path)


def load_tensors(path: str, template: dict) -> dict:
    """{"model": ..., "optimizer": ...} from a checkpoint of either format.

    A file holds full tensors. A DCP directory is read into `template` (the loading run's own state
    dicts, sharded or not), which is how it reshards to a different world size.
    """
    if not os.path.isdir(path):
        state = _torch_load(path)
        return {"model": state["model"], "optimizer": state["optimizer"]}
    try:
        dcp.load(template, checkpoint_id=path)
    except Exception as e:
        raise CheckpointError(f"cannot load checkpoint {path}: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    return template


def remove(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def dcp_to_file(src_dir: str, dst: str) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    meta = load_meta(src_dir)
    tmp = f"{dst}.tensors.tmp"
    dcp_to_torch_save(src_dir, tmp)
    tensors = _torch_load(tmp)
    os.remove(tmp)
    save_file({**meta, "model": tensors["model"], "optimizer": tensors["optimizer"]}, dst)


def file_to_dcp(src: str, dst_dir: str) -> None:
    meta = load_meta(src)
    tensors = load_tensors(src, template={})
    save_sharded(tensors, meta, dst_dir, is_main=True, barrier=lambda: None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("direction", choices=["to-file", "to-dcp"])
    parser.add_argument("src")
    parser.add_argument("dst")
    args = parser.parse_args(argv)
    try:
        if os.path.exists(args.dst):
            raise CheckpointError(f"{args.dst} already exists")
        (dcp_to_file if args.direction == "to-file" else file_to_dcp)(args.src, args.dst)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
