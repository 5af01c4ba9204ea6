"""`loom bench calibrate`: this machine, measured (measure.py), as the planner's `cpu-here`
device: the all-reduce times kept as the table comm_cost.py interpolates (and fitted to the
ring formula, for people: fit_alpha_beta), the sends fitted, the whole saved as a DeviceSpec
where `load_device("cpu-here")` reads it. Details and this machine's figures:
docs/planner-calibrate.md.
"""

from __future__ import annotations

import datetime
import os
import statistics
from dataclasses import asdict, replace
from pathlib import Path

from loomtrain.planner.comm_cost import all_reduce_s
from loomtrain.planner.measure import FULL, PENALTY_BYTES, QUICK, WORLD, Effort, measure
from loomtrain.planner.specs import CPU_HERE, ClusterSpec, DeviceSpec, calibration_path, load_device

__all__ = ["FULL", "QUICK", "Effort", "calibrate", "cpu_here", "fit_alpha_beta", "measure", "save",
           "spec_from", "summary", "usable_memory_bytes"]


def fit_alpha_beta(payload_bytes, times_s, n: int | None = None) -> tuple[float, float]:
    """(alpha_s, bytes_per_s) of Hockney's model as comm_cost.py applies it: a ring all-reduce
    over n ranks takes 2(n-1) alpha + 2(n-1)/n S / beta; n=None: a send, alpha + S / beta.

    Least squares on the relative error (each time weighted by 1/t^2), so 4-byte messages
    (alpha) count as much as 16 MiB ones (beta); an ordinary fit would let the large ones
    decide alone and leave alpha to their noise. A negative intercept is clipped to 0 and the
    slope refitted (non-negative least squares)."""
    sizes, times = [float(s) for s in payload_bytes], [float(t) for t in times_s]
    if len(set(sizes)) < 2 or len(sizes) != len(times) or min(times) <= 0:
        raise ValueError("fit_alpha_beta needs positive times at two message sizes at least")
    steps, share = (1, 1.0) if n is None else (2 * (n - 1), 2 * (n - 1) / n)
    w2 = [1 / t ** 2 for t in times]  # t = a + b S, fitted as sum w2 (a + b S - t)^2
    s0, s1 = sum(w2), sum(w * s for w, s in zip(w2, sizes))
    s2 = sum(w * s * s for w, s in zip(w2, sizes))
    r0, r1 = sum(w * t for w, t in zip(w2, times)), sum(w * s * t for w, s, t in zip(w2, sizes, times))
    det = s0 * s2 - s1 * s1
    a, b = (r0 * s2 - r1 * s1) / det, (s0 * r1 - s1 * r0) / det
    if a < 0:
        a, b = 0.0, r1 / s2
    if b <= 0:
        raise ValueError("the times do not grow with the message size: no bandwidth to fit")
    return a / steps, share / b


def calibrate(quick: bool = False, effort: Effort | None = None) -> DeviceSpec:
    """Measure this machine (about a minute; quick: 15-25 s) and return it as `cpu-here`."""
    return spec_from(measure(effort or (QUICK if quick else FULL)), "quick" if quick else "full")


def spec_from(found: dict, label: str = "") -> DeviceSpec:
    """`cpu-here` from `measure`'s figures: the fits, the peaks, the memory share."""
    sizes = found["message_bytes"]
    fits = tuple((n, *fit_alpha_beta(sizes, found[f"all_reduce_s_{n}"], n)) for n in (2, WORLD))
    latency_s, link_bytes_per_s = fit_alpha_beta(sizes, found["send_s"])
    by_procs = tuple((n, rate) for n, rate in found["flops_by_procs"])
    fp32 = max(found["large_fp32_flops"], by_procs[0][1])
    # bf16 faster than fp32 (this CPU has AVX512-BF16): its measured rate; slower: fp32's, since a peak
    # below what fp32 reaches would only make bf16's MFU look better than it is
    bf16 = found["large_bf16_flops"] if found["large_bf16_flops"] > fp32 else fp32
    cores = os.cpu_count() or 1
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = (f"measured by loom bench calibrate ({label}) on {when}: {cores} cores, load average "
              f"{found.get('load_average', float('nan')):.2g} before, bf16 large GEMM "
              f"{found['large_bf16_flops'] / 1e9:.3g} GFLOP/s"
              + ("" if bf16 > fp32 else " (slower than fp32: peak_bf16_flops = fp32's)"))
    table = tuple((n, int(size), float(t)) for n in (2, WORLD)
                  for size, t in zip(sizes, found[f"all_reduce_s_{n}"]))
    penalty = tuple((int(p), int(n), float(t)) for p, n, t in found["sync_penalty"])
    return DeviceSpec(
        name=CPU_HERE, peak_bf16_flops=bf16, peak_fp32_flops=fp32,
        mem_bytes=usable_memory_bytes(),
        mem_bandwidth_bytes_per_s=found["stream_bytes_per_s"],
        intra_node_bytes_per_s=link_bytes_per_s, intra_node_latency_s=latency_s,
        inter_node_bytes_per_s=link_bytes_per_s, inter_node_latency_s=latency_s,  # one machine
        host_link_bytes_per_s=found["stream_bytes_per_s"],  # "offload" is a copy in the same RAM
        matmul_efficiency=1.0, op_overhead_s=found["op_overhead_s"], cores=cores,
        flops_by_procs=by_procs, collective_fit=fits, collective_table=table,
        sync_penalty=penalty, attention_efficiency=found["attention_efficiency"],
        shift_penalty=_shift_penalty(found, latency_s, link_bytes_per_s), source=source)


def _shift_penalty(found: dict, latency_s: float, bytes_per_s: float) -> tuple[tuple[int, float], ...]:
    """Per process count: the median over PENALTY_BYTES of what a ring shift, started before
    compute and waited for after, exposed beyond the fitted send time of its bytes (the cost
    model charges a hop the send time plus this)."""
    return tuple((int(procs), max(0.0, statistics.median(
        t - (latency_s + size / bytes_per_s) for size, t in zip(PENALTY_BYTES, exposed))))
        for procs, exposed in found["shift_exposed_s"])


def usable_memory_bytes() -> int:
    """RAM a training run can take now: /proc/meminfo's MemAvailable (not MemTotal: other
    processes hold the rest), capped by the cgroup's memory.max in a container. The spec's
    mem_bytes is this: a cpu-here plan's processes share it (DeviceSpec.memory_per_process)."""
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
    usable = info.get("MemAvailable", info["MemTotal"])
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            usable = min(usable, int(limit))
    except OSError:
        pass
    return usable


def save(spec: DeviceSpec, path: str | Path | None = None) -> Path:
    """Write `spec` as the TOML table `device_from_table` reads (default: calibration_path(),
    where `load_device("cpu-here")` looks)."""
    import tomli_w

    path = Path(path) if path is not None else calibration_path()
    table = {k: [list(row) for row in v] if isinstance(v, tuple) else v
             for k, v in asdict(spec).items() if v is not None}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# this machine as the planner's cpu-here device (docs/planner-calibrate.md)\n"
                    + tomli_w.dumps(table))
    return path


def cpu_here(before=None) -> DeviceSpec:
    """This machine as the planner's `cpu-here`: the saved calibration, else a quick one
    (15-25 s) measured and saved first where `loom bench calibrate` saves it, so later calls
    read it. `before(path)`, if given, is called before measuring (to say so)."""
    path = calibration_path()
    if not path.is_file():
        if before is not None:
            before(path)
        save(calibrate(quick=True), path)
    return load_device(CPU_HERE)


def summary(spec: DeviceSpec, found: dict | None = None) -> str:
    """A few lines for people: the figures and, given the raw ones, how well the fits hold."""
    procs = ", ".join(f"{n} at once {f / 1e9:.3g} each" for n, f in spec.flops_by_procs)
    lines = [f"cpu-here: {spec.cores} cores, {spec.mem_bytes / 1e9:.3g} GB of RAM for its processes",
             f"matmul fp32, the default model's linear layers forward and backward (GFLOP/s per "
             f"process): {procs}; attention {spec.attention_efficiency:.2g}x that rate",
             f"peak fp32 {spec.peak_fp32_flops / 1e9:.3g} GFLOP/s, bf16 {spec.peak_bf16_flops / 1e9:.3g}"
             f" GFLOP/s; memory {spec.mem_bandwidth_bytes_per_s / 1e9:.3g} GB/s; "
             f"{spec.op_overhead_s * 1e6:.3g} us per operator",
             f"send/recv: {spec.intra_node_latency_s * 1e6:.3g} us + "
             f"{spec.intra_node_bytes_per_s / 1e9:.3g} GB/s"]
    for n, alpha, beta in spec.collective_fit:
        line = f"gloo all-reduce over {n}: alpha {alpha * 1e6:.3g} us, beta {beta / 1e9:.3g} GB/s"
        if found is not None:
            cluster = ClusterSpec(replace(spec, collective_table=None), n, n)  # the fit alone
            worst = max(abs(all_reduce_s(cluster, size, n, False) - t) / t
                        for size, t in zip(found["message_bytes"], found[f"all_reduce_s_{n}"]))
            line += f" (fit within {worst:.0%} of every measured size; the planner interpolates them)"
        lines.append(line)
    for procs_n, n, t in spec.sync_penalty or ():
        lines.append(f"sync penalty of a collective over {n} between compute, {procs_n} processes "
                     f"running: {t * 1e6:.3g} us per call")
    for procs_n, t in spec.shift_penalty or ():
        lines.append(f"sync penalty of a ring shift between compute, {procs_n} processes running: "
                     f"{t * 1e6:.3g} us per call")
    busy = found is not None and found.get("load_average", 0) > spec.cores / 2
    if busy:  # gloo's small messages go from ~0.04 to 1-3 ms one way on a busy 2-core machine
        lines.append(f"note: the load average was {found['load_average']:.2g} on {spec.cores} cores "
                     "before measuring: other processes were using the cores, and these figures "
                     "may include that contention; calibrate again when the machine is quiet")
    return "\n".join(lines)
