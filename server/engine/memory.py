"""What the server's processes hold on a CPU host, item by item, for the startup line and /health
(read from the API process).

The whole is what the OS says: each process's private memory (`Private_Clean` +
`Private_Dirty` of /proc/<pid>/smaps_rollup: what it alone holds, shared libraries and the
page cache left out) for this process and every process under it (vLLM's EngineCore and
workers). The parts are what the engine was asked to hold: each model's weights as served
(read from its safetensors headers: integer tensors as stored, floating ones in the dtype
served) and the KV cache. The rest is the runtime (Python, torch and vLLM in each process,
the tokenizers, the allocator) and any copy of a weight the engine keeps beside it. Beside
those, the lookups' suffix trees (hybrid speculation) are planned for at their bound.
"""

import ctypes
import ctypes.util
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import psutil

from server.autopilot.suffix_tree import BYTES_PER_TOKEN

GB = 10**9
GIB = 2**30
# What the server's processes come to hold beyond the weights and the KV cache once the engine
# runs (Python, torch, vLLM, tokenizers, buffers). Measured with the embedded pair in bf16 on an
# AMD Zen 5, one rank: the front end 0.8 GB, the EngineCore's runtime 0.8 (0.9 after a load at
# four requests); the rest is margin for float32 activations and long prefills.
ENGINE_RUNTIME_BYTES = 25 * GB // 10
# Bytes per element of the safetensors dtypes a checkpoint stores.
STORED_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1}
FLOATING = ("F64", "F32", "F16", "BF16")
SERVED_BYTES = {"float32": 4, "bfloat16": 2}
HEAD = "lm_head.weight"  # an untied output head in a Hugging Face checkpoint


def weights_as_served(folder: Path, dtype: str, int8_head: bool = False) -> int:
    """Bytes of the checkpoint in `folder` once loaded in `dtype` ("bfloat16" or "float32");
    with `int8_head`, its output head (`lm_head.weight`) in int8 with a float32 scale per row."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as file:
            (length,) = struct.unpack("<Q", file.read(8))
            header = json.loads(file.read(length))
        for name, tensor in header.items():
            if name == "__metadata__":
                continue
            stored = tensor["dtype"]
            if int8_head and name == HEAD:
                rows, columns = tensor["shape"]
                total += rows * columns + rows * 4
                continue
            size = SERVED_BYTES[dtype] if stored in FLOATING else STORED_BYTES[stored]
            total += size * math.prod(tensor["shape"])
    return total


def lookup_trees_bound(index_tokens: int, max_num_seqs: int, max_model_len: int) -> int:
    """The most bytes the lookups' suffix trees hold: the tenants' reply trees (`index_tokens`)
    and one tree per running request, which holds at most its whole context."""
    return (index_tokens + max_num_seqs * max_model_len) * BYTES_PER_TOKEN


def private_bytes(pid: int) -> int:
    """What process `pid` alone holds (0 if it is gone)."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0
    kib = 0
    for line in text.splitlines():
        if line.startswith(("Private_Clean:", "Private_Dirty:")):
            kib += int(line.split()[1])
    return kib * 1024


def release_free_heap(_worker: object = None) -> None:
    """Hand the heap glibc keeps after frees back to the OS (`malloc_trim(0)`).

    Loading weights, tokenizers and the calibration's requests free hundreds of MB that
    glibc keeps for later mallocs in the middle of its arenas, where only `malloc_trim`
    returns them (docs/operations.md, "Memory on a CPU host"). Called once, at the end of
    startup, in the front end and, with one rank, in the engine's process (through vLLM's
    `collective_rpc`, which passes its worker as `_worker`). No-op without glibc.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return
    libc = ctypes.CDLL(name)
    if hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def server_processes() -> dict[str, int]:
    """Private bytes of this process and each one under it, by name (vLLM names its own)."""
    me = psutil.Process(os.getpid())
    held = {"front end": private_bytes(me.pid)}
    for child in me.children(recursive=True):
        try:
            name = child.name()
        except psutil.NoSuchProcess:
            continue
        held[f"{name.removeprefix('VLLM::')} {child.pid}"] = private_bytes(child.pid)
    return held


@dataclass(frozen=True)
class MemoryReport:
    processes: dict[str, int]  # private bytes by process
    weights: dict[str, int]  # bytes as served by model ("target", "draft")
    kv_cache: int
    lookup_trees: int  # the most the lookups' trees may come to hold (0: no lookups)

    @property
    def total(self) -> int:
        return sum(self.processes.values())

    @property
    def planned(self) -> int:
        """What the engine was asked to hold: weights as served and the KV cache."""
        return sum(self.weights.values()) + self.kv_cache

    def line(self) -> str:
        def gb(value: int) -> str:
            return f"{value / GB:.2f}"

        processes = ", ".join(f"{name} {gb(held)}" for name, held in self.processes.items())
        weights = ", ".join(f"{name} {gb(held)}" for name, held in self.weights.items())
        trees = f"; lookup trees up to {gb(self.lookup_trees)} more" if self.lookup_trees else ""
        return (
            f"memory: {gb(self.total)} GB held ({processes}) for {gb(self.planned)} GB planned "
            f"(weights as served: {weights}; KV cache {gb(self.kv_cache)}): "
            f"{self.total / self.planned:.2f}x; the rest ({gb(self.total - self.planned)} GB) "
            f"is the runtime of each process and copies of weights{trees}"
        )

    def as_dict(self) -> dict[str, object]:
        return {
            "held_bytes": self.total,
            "processes_bytes": self.processes,
            "weights_bytes": self.weights,
            "kv_cache_bytes": self.kv_cache,
            "lookup_trees_bound_bytes": self.lookup_trees,
            "held_over_planned": round(self.total / self.planned, 3),
        }


def kv_cache_room_gib(available: int, beside: int) -> int:
    """Whole GiB of KV cache a host with `available` bytes free can hold beside `beside` bytes
    (weights, lookup trees) and the engine processes' runtime."""
    return max(0, (available - beside - ENGINE_RUNTIME_BYTES) // GIB)
