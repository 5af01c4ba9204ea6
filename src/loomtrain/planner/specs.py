"""Device and cluster specs: what the cost model needs to know about the hardware. Built-in GPU
kinds from the vendors' datasheets, `cpu-here` measured by `loom bench calibrate`
(calibrate.py), other hardware from a user's TOML (`load_device`). Each figure's source and
what each bandwidth means: docs/planner.md, "Device specs".
"""

from __future__ import annotations

import tomllib
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

GB = 1e9
GIB = 2 ** 30


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    peak_bf16_flops: float  # dense tensor-core (or CPU) peak, FLOP/s
    peak_fp32_flops: float
    mem_bytes: int  # device memory (cpu-here: the RAM its processes share, see `memory_per_process`)
    mem_bandwidth_bytes_per_s: float  # memory-bound ops (norms, softmax, the optimizer step)
    intra_node_bytes_per_s: float
    intra_node_latency_s: float
    inter_node_bytes_per_s: float
    inter_node_latency_s: float
    host_link_bytes_per_s: float  # offload: device <-> host
    matmul_efficiency: float = 0.6  # achieved fraction of peak on a large GEMM
    op_overhead_s: float = 5e-6  # fixed cost per operator launch (kernel launch; Python on CPU)
    # cpu-here only: processes share `cores`; matmul FLOP/s one process reaches when n run at
    # once, measured for n in the table's keys (None: one device per process, no sharing)
    cores: int | None = None
    flops_by_procs: tuple[tuple[int, float], ...] | None = None
    # cpu-here only: fitted alpha-beta per group size for gloo's ring (calibrate.py)
    collective_fit: tuple[tuple[int, float, float], ...] | None = None  # (n, alpha_s, bytes_per_s)
    # cpu-here only: the measured all-reduce times the fit approximates, (n, bytes, seconds);
    # comm_cost.py interpolates them (gloo's times are not a line in the size: 42-82% off)
    collective_table: tuple[tuple[int, int, float], ...] | None = None
    # cpu-here only: what a blocking collective costs between compute beyond its back-to-back
    # time (its peers' skew, waking gloo's threads), (processes running, n, seconds per call)
    sync_penalty: tuple[tuple[int, int, float], ...] | None = None
    # cpu-here only: the same for a ring shift (every rank sends to the next and receives from
    # the previous at once, as ring attention passes K and V), (processes running, seconds)
    shift_penalty: tuple[tuple[int, float], ...] | None = None
    # the attention core's achieved rate over the matmul rate (FLOPs counted over the full
    # causal square, as cost.py counts them); cpu-here: measured, GPUs: 1 (not known here)
    attention_efficiency: float = 1.0
    source: str = ""

    def peak_flops(self, precision: str) -> float:
        return self.peak_bf16_flops if precision == "bf16" else self.peak_fp32_flops

    def achieved_flops(self, precision: str, procs: int = 1) -> float:
        """The matmul rate one process reaches with `procs` processes on the machine: measured
        in fp32 (cpu-here, interpolated in n and held flat beyond the table) and scaled by the
        peaks' ratio for bf16, else peak x efficiency."""
        if self.flops_by_procs is None:
            return self.peak_flops(precision) * self.matmul_efficiency
        return self._fp32_rate(procs) * self.peak_flops(precision) / self.peak_fp32_flops

    def _fp32_rate(self, procs: int) -> float:
        table = sorted(self.flops_by_procs)
        if procs <= table[0][0]:
            return table[0][1]
        for (n0, f0), (n1, f1) in zip(table, table[1:]):
            if procs <= n1:  # aggregate rate n * f is what interpolates linearly
                agg = n0 * f0 + (n1 * f1 - n0 * f0) * (procs - n0) / (n1 - n0)
                return agg / procs
        n, f = table[-1]
        return n * f / procs

    def share(self, procs: int) -> float:
        """The fraction of its one-process speed each of `procs` processes keeps: 1 with one
        device per process; on cpu-here, where they share the cores, the measured matmul
        rate's fraction, which the memory-bound operators (norms, GELU, the optimizer step:
        they run on the same cores and memory) are charged too."""
        if self.flops_by_procs is None:
            return 1.0
        return self._fp32_rate(procs) / self._fp32_rate(1)

    def overhead_s(self, procs: int) -> float:
        """One operator's fixed cost with `procs` processes: Python and dispatch run on one
        core per process, so on cpu-here it grows only when processes outnumber the cores."""
        return self.op_overhead_s * (max(1.0, procs / self.cores) if self.cores else 1.0)

    def memory_per_process(self, procs: int) -> int:
        """Memory one of `procs` processes may use: a GPU's own memory, or on cpu-here the
        machine's RAM shared by the processes running on it."""
        return self.mem_bytes // max(1, procs) if self.cores else self.mem_bytes


@dataclass(frozen=True)
class ClusterSpec:
    device: DeviceSpec
    gpus: int
    gpus_per_node: int
    inter_node_bytes_per_s: float | None = None  # overrides the device's (--inter-node-gbps)

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    @property
    def inter_bytes_per_s(self) -> float:
        return self.inter_node_bytes_per_s or self.device.inter_node_bytes_per_s

    @property
    def mem_per_device(self) -> int:
        """The memory budget of one device (process): its node's processes share a cpu-here
        machine's RAM."""
        return self.device.memory_per_process(min(self.gpus, self.gpus_per_node))


# Datasheets (docs/planner.md, "Device specs"): NVIDIA A100 Tensor Core GPU datasheet (2021):
# 312 TFLOP/s bf16 dense, 19.5 TFLOP/s fp32, 40 GB at 1,555 GB/s or 80 GB at 2,039 GB/s,
# NVLink 600 GB/s (both directions: 300 per direction), PCIe Gen4 64 GB/s (32 per direction);
# DGX A100: 8 x 200 Gb/s HDR InfiniBand, one per GPU (25 GB/s). NVIDIA H100 datasheet (SXM):
# 989 TFLOP/s bf16 dense, 67 TFLOP/s fp32, 80 GB at 3.35 TB/s, NVLink 900 GB/s (450 per
# direction), PCIe Gen5 128 GB/s (64 per direction); DGX H100: 8 x 400 Gb/s ConnectX-7 (50 GB/s
# per GPU). NVIDIA H200 datasheet (SXM): the H100's compute and links, 141 GB at 4.8 TB/s.
# Latencies are typical figures, not datasheet ones: ~5 us per NVLink hop message, ~10 us
# across InfiniBand including the software stack (NCCL's own tuning tables use similar bases).
_A100 = dict(peak_bf16_flops=312e12, peak_fp32_flops=19.5e12, intra_node_bytes_per_s=300 * GB,
             intra_node_latency_s=5e-6, inter_node_bytes_per_s=25 * GB, inter_node_latency_s=10e-6,
             host_link_bytes_per_s=32 * GB)
_H100 = dict(peak_bf16_flops=989e12, peak_fp32_flops=67e12, intra_node_bytes_per_s=450 * GB,
             intra_node_latency_s=5e-6, inter_node_bytes_per_s=50 * GB, inter_node_latency_s=10e-6,
             host_link_bytes_per_s=64 * GB)
BUILTIN: dict[str, DeviceSpec] = {
    "a100-40g": DeviceSpec("a100-40g", mem_bytes=40 * GB, mem_bandwidth_bytes_per_s=1555 * GB,
                           source="NVIDIA A100 datasheet", **_A100),
    "a100-80g": DeviceSpec("a100-80g", mem_bytes=80 * GB, mem_bandwidth_bytes_per_s=2039 * GB,
                           source="NVIDIA A100 datasheet", **_A100),
    "h100-80g": DeviceSpec("h100-80g", mem_bytes=80 * GB, mem_bandwidth_bytes_per_s=3350 * GB,
                           source="NVIDIA H100 datasheet (SXM)", **_H100),
    "h200-141g": DeviceSpec("h200-141g", mem_bytes=141 * GB, mem_bandwidth_bytes_per_s=4800 * GB,
                            source="NVIDIA H200 datasheet (SXM)", **_H100),
}
CPU_HERE = "cpu-here"


def calibration_path() -> Path:
    """Where `loom bench calibrate` saves cpu-here ($XDG_CACHE_HOME or ~/.cache, loomtrain/)."""
    import os
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "loomtrain" / "cpu-here.toml"


def device_from_table(table: dict, where: str) -> DeviceSpec:
    """A DeviceSpec from a TOML table; ValueError naming the file, the key and the choices."""
    names = {f.name for f in fields(DeviceSpec)}
    unknown = sorted(set(table) - names)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} in a device spec; the keys are "
                         f"{', '.join(sorted(names))}")
    missing = [f.name for f in fields(DeviceSpec)
               if f.name not in table and f.default is MISSING and f.default_factory is MISSING]
    if missing:
        raise ValueError(f"{where}: a device spec needs {', '.join(missing)} (missing)")
    values = dict(table)
    for key in ("flops_by_procs", "collective_fit", "collective_table", "sync_penalty", "shift_penalty"):
        if values.get(key) is not None:
            values[key] = tuple(tuple(row) for row in values[key])
    return DeviceSpec(**values)


def load_device(kind: str) -> DeviceSpec:
    """A built-in kind, `cpu-here` (after `loom bench calibrate`), or a TOML file path holding
    one device table (the DeviceSpec keys)."""
    key = kind.lower()
    if key in BUILTIN:
        return BUILTIN[key]
    if key == CPU_HERE:
        path = calibration_path()
        if not path.is_file():
            raise ValueError(f"--gpu cpu-here is this machine as `loom bench calibrate` measures "
                             f"it, and {path} does not exist yet: run `loom bench calibrate` first")
        return device_from_table(tomllib.loads(path.read_text()), str(path))
    path = Path(kind)
    if path.suffix == ".toml":
        if not path.is_file():
            raise ValueError(f"--gpu {kind!r}: no such device spec file")
        try:
            table = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"--gpu {kind!r} is not valid TOML: {err}") from None
        return device_from_table(table, kind)
    raise ValueError(f"unknown device kind {kind!r}; choose one of {', '.join([*BUILTIN, CPU_HERE])} "
                     "or give a TOML file with a device spec (docs/planner.md)")
