"""Reading a DCP checkpoint directory without running code.

DCP itself unpickles its `.metadata` and its non-tensor entries with no restriction. Here `.metadata` goes
through an allow-list of DCP's own metadata classes (MetadataUnpickler), and every non-tensor entry must load
under weights_only first (WeightsOnlyBytes), as single files and meta.pt load (checkpoint.py)."""

import io
import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner


# What a DCP `.metadata` pickle may name: DCP's metadata records, torch.Size, dtypes and layouts, and the
# path DCP records as the checkpoint id. Nothing here runs code when called with pickled arguments.
_METADATA_GLOBALS = {
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
}


class MetadataUnpickler(pickle.Unpickler):
    """pickle with an allow-list, in the spirit of torch.load(weights_only=True), for DCP's `.metadata`."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                   torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def read_dcp_metadata(directory: str):
    """A DCP directory's `.metadata`, through MetadataUnpickler."""
    with open(os.path.join(directory, ".metadata"), "rb") as f:
        return MetadataUnpickler(f).load()


class SafeReader(FileSystemReader):
    """DCP's file reader, with `.metadata` read through MetadataUnpickler (DCP's own uses plain pickle)."""

    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import StorageMeta

        metadata = read_dcp_metadata(os.fspath(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class WeightsOnlyBytes:
    """A DCP load-planner mixin: a non-tensor entry (DCP unpickles those with weights_only=False) is loaded
    with weights_only=True here, and DCP is handed that plain data saved anew, never the file's own bytes."""

    def load_bytes(self, read_item, value):
        try:
            data = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            detail = next((line.strip() for line in str(e).splitlines() if "Unsupported global" in line), "")
            raise pickle.UnpicklingError(f"entry {read_item.dest_index.fqn} is not plain data and could run code "
                                         f"when loaded; refused. {detail}".strip()) from None
        clean = io.BytesIO()
        torch.save(data, clean)
        clean.seek(0)
        super().load_bytes(read_item, clean)


class SafeLoadPlanner(WeightsOnlyBytes, DefaultLoadPlanner):
    pass


class SafeWholeLoadPlanner(WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    """Reads everything a directory holds into an empty state dict (dcp_to_file)."""
