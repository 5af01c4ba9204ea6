"""The pure half of the sparse all-reduce (comm/sparse.py): who owns which index, how a chunk
is laid out in bytes and what it costs in each format, what each scheme sends, and which
scheme to run.

Notation: N ranks, k pairs per rank (k_max the largest), numel elements, u distinct indices
over all ranks, b_i index bytes on the wire (`index_wire_dtype`), b_v value bytes.
"""

from __future__ import annotations

import functools
import itertools
import math
import sys
from dataclasses import dataclass

import numpy as np
import torch

PARTITIONS = ("hash", "range")
FORMATS = ("pairs", "bitmap", "dense")  # how an owner's sums travel; a tie goes to the earlier
# Knuth's multiplicative ("Fibonacci") hashing, TAOCP vol. 3, section 6.4: floor(2^32 / phi),
# odd, so multiplying by it modulo 2^32 permutes 32-bit keys.
FIBONACCI_32 = 2654435769
SKETCH_SIZE = 256  # at most this many bottom-k hashes per rank go with "auto"'s counts (2 KiB)
SKETCH_PER = 4096  # ... one per this many elements of out (`sketch_size`)
SKETCH_MIN = 16  # ... and none when fewer would fit
NO_HASH = 1 << 32  # fills the sketch of a rank with fewer pairs: above every hash
COLLECTIVES = {"allgather": 2, "balanced": 4}


# --- the partition of the index space -----------------------------------------------------------


def fibonacci_hash(indices: torch.Tensor) -> torch.Tensor:
    """h(i) = key(i) x 2654435769 mod 2^32 (int64), key(i) = (i xor (i >> 31)) mod 2^31.

    key(i) = i below 2^31, so h is injective there; every product stays below 2^63 (no signed
    overflow). h(i) / 2^32 is the golden-ratio sequence {i / phi} to 32 bits, the most evenly
    spread sequence for consecutive i (the three-distance theorem)."""
    key = (indices ^ (indices >> 31)) & ((1 << 31) - 1)
    return (key * FIBONACCI_32) & (NO_HASH - 1)


def owner_of(indices: torch.Tensor, n: int) -> torch.Tensor:
    """The rank (0..n-1) that owns each index under "balanced": floor(h(i) n / 2^32).

    A pure function of (index, n). The hash's high bits, by multiply-and-shift rather than
    h mod n, keep the golden-ratio spread: a contiguous hot range of L indices gives every owner
    L/n of them to within a few (2^22 indices over 4: 1048578, 1048576, 1048579, 1048571),
    where contiguous ranges of numel/n would give one rank all of them."""
    return (fibonacci_hash(indices) * n) >> 32


def partition_loads(indices: torch.Tensor, n: int, numel: int, how: str = "hash") -> list[int]:
    """Pairs landing on each of n ranks: "hash" as `owner_of` (the balanced scheme), "range"
    the naive contiguous ranges of ceil(numel / n) indices."""
    if how not in PARTITIONS:
        raise ValueError(f"partition how={how!r} is not one of {PARTITIONS}")
    owners = owner_of(indices, n) if how == "hash" else indices // math.ceil(numel / n)
    return torch.bincount(owners, minlength=n).tolist()


def index_wire_dtype(numel: int) -> torch.dtype:
    """The dtype indices travel as: int32 when every index fits, else int64."""
    return torch.int32 if numel < 2**31 else torch.int64


@dataclass(frozen=True)
class Layout:
    """The owners' partitions, one after another: `by_owner` holds P_0's indices in increasing
    order (the canonical order of its bitmaps and dense slices), then P_1's, ...; P_p starts at
    `offsets[p]` and holds `sizes[p]` indices. `slot[i]` is where index i sits in `by_owner`:
    sorting indices by slot sorts them by (owner, index), i's position in its partition is
    slot[i] - offsets[owner(i)], and out = (the partitions' values, concatenated)[slot]."""

    by_owner: torch.Tensor
    slot: torch.Tensor
    sizes: tuple[int, ...]
    offsets: tuple[int, ...]

    def members(self, p: int) -> torch.Tensor:
        return self.part(self.by_owner, p)

    def part(self, concatenated: torch.Tensor, p: int) -> torch.Tensor:
        """P_p's slice of a tensor laid out as `by_owner`."""
        return concatenated[self.offsets[p]:self.offsets[p] + self.sizes[p]]


@functools.lru_cache(maxsize=4)
def partition_layout(numel: int, n: int, device: torch.device) -> Layout:
    """The `Layout` of numel elements over n owners (int32 below 2^31 elements, so 8 bytes per
    element; one stable sort of numel owners, cached for the last few (numel, n, device))."""
    owners = owner_of(torch.arange(numel, device=device), n)
    dtype = index_wire_dtype(numel)
    by_owner = torch.sort(owners, stable=True).indices
    slot = torch.empty(numel, dtype=dtype, device=device)
    slot[by_owner] = torch.arange(numel, dtype=dtype, device=device)
    sizes = torch.bincount(owners, minlength=n).tolist()
    offsets = [0, *itertools.accumulate(sizes)][:n]
    return Layout(by_owner.to(dtype), slot, tuple(sizes), tuple(offsets))


# --- chunk formats -------------------------------------------------------------------------------


def chunk_bytes(fmt: str, count: int, size: int, index_bytes: int, value_bytes: int) -> int:
    """Bytes of `count` pairs of a partition of `size` elements sent as `fmt`: pairs
    count (b_i + b_v); bitmap ceil(size / 8) + count b_v (Zen's hash bitmap); dense size b_v."""
    if fmt == "pairs":
        return count * (index_bytes + value_bytes)
    if fmt == "bitmap":
        return math.ceil(size / 8) + count * value_bytes
    return size * value_bytes


def best_format(count: int, size: int, index_bytes: int, value_bytes: int,
                formats=FORMATS) -> str:
    """The format of `formats` with the fewest bytes: a pure function of counts, so a sender and
    every receiver pick the same. Bitmaps win from density count/size = 1/(8 b_i) (3% with
    int32 indices), dense slices only from 1 - 1/(8 b_v) (97% with fp32)."""
    return min(formats, key=lambda f: chunk_bytes(f, count, size, index_bytes, value_bytes))


@dataclass(frozen=True)
class Encoding:
    """Chunks as bytes. pairs: the positions (`index_dtype`), then the values; bitmap: bit j of
    byte b marks position 8b + j (`pack_bits`), then the values present in position order;
    dense: the value of every position. A position is an index in the partition (balanced) or
    in out."""

    index_dtype: torch.dtype
    value_dtype: torch.dtype

    def bytes(self, fmt: str, count: int, size: int) -> int:
        return chunk_bytes(fmt, count, size, self.index_dtype.itemsize, self.value_dtype.itemsize)

    def best(self, count: int, size: int, formats) -> str:
        return best_format(count, size, self.index_dtype.itemsize, self.value_dtype.itemsize,
                           formats)

    def encode(self, fmt: str, where, values, size: int) -> torch.Tensor:
        """`where`: for pairs the positions of `values`; for a bitmap a bool mask over the
        positions (`pack_bits`), `values` those present, in order; unused when dense, `values`
        then of every position."""
        if fmt == "pairs":
            head = where.to(self.index_dtype).view(torch.uint8)
        elif fmt == "bitmap":
            head = pack_bits(where)[:math.ceil(size / 8)]
        else:
            head = values.new_empty(0, dtype=torch.uint8)
        return torch.cat([head, values.contiguous().view(torch.uint8)])

    def decode(self, fmt: str, chunk: torch.Tensor, count: int, size: int):
        """(where, as `encode` takes it, or None when dense; values) of an `encode`d chunk,
        views into `chunk` where its bytes are aligned for the dtypes."""
        if fmt == "pairs":
            where = _from_bytes(chunk, 0, count, self.index_dtype)
            start = count * self.index_dtype.itemsize
        elif fmt == "bitmap":
            start = math.ceil(size / 8)
            where = unpack_bits(chunk[:start], size)
        else:
            where, start, count = None, 0, size
        return where, _from_bytes(chunk, start, count, self.value_dtype)


# Both bit codecs read 8 bytes as one int64 word, byte j its bits 8j..8j+7: little-endian, as
# on every device torch runs on (x86, ARM, CUDA).
assert sys.byteorder == "little"


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bit j of byte b = mask[8b + j], the mask (bool) padded with False to whole bytes.

    Each 8 bools read as one int64 word, whose byte j is 0 or 1, fold into its low byte by
    three shift-ors (w |= w >> 7, >> 14, >> 28): 0.18 ms per million positions here (one
    thread), where shifting each bool into place and summing took 0.9 ms. No copy when the
    mask's length is a multiple of 8 and it starts 8-aligned."""
    flat = mask.view(torch.uint8)
    if flat.numel() % 8 or flat.storage_offset() % 8:
        flat = torch.cat([flat, flat.new_zeros(-flat.numel() % 8)])
    word = flat.view(torch.int64)
    word = word | (word >> 7)  # byte k: entries k, k + 1 of the 8 in its bits 0, 1
    word |= word >> 14  # ... entries k .. k + 3 in bits 0 .. 3
    word |= word >> 28  # ... entries k .. k + 7 in bits 0 .. 7: byte 0 is the packed byte
    return (word & 0xFF).to(torch.uint8)


def unpack_bits(bitmap: torch.Tensor, size: int) -> torch.Tensor:
    """The bool mask of `size` positions that `pack_bits` packed into `bitmap` (uint8): one
    lookup per byte in a 256-entry table of int64 words whose byte j is bit j of the index,
    viewed as 8 bools: 0.06 ms per million positions here (one thread), where shifting and
    masking every bit took 0.4 ms."""
    words = _byte_to_bools(bitmap.device).index_select(0, bitmap.int())
    return words.view(torch.uint8).view(torch.bool)[:size]


@functools.lru_cache(maxsize=4)
def _byte_to_bools(device: torch.device) -> torch.Tensor:
    bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
    return (bits << (8 * torch.arange(8, device=device))).sum(1)


def true_positions(mask: torch.Tensor) -> torch.Tensor:
    """The positions of a 1-D bool mask's True entries, increasing (int64): `mask.nonzero()`,
    on CPU by numpy's `flatnonzero`, which vectorizes: 0.4 ms per million positions here
    against 3 ms by torch's (one thread). The same result either way."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().view(-1)


def _from_bytes(chunk: torch.Tensor, start: int, count: int, dtype) -> torch.Tensor:
    part = chunk[start:start + count * dtype.itemsize]
    if part.storage_offset() % dtype.itemsize:  # a view needs aligned bytes: copy to align
        part = part.clone()
    return part.view(dtype)


# --- the cost model and the choice ---------------------------------------------------------------


def independent_union(nnz_per_rank: int, numel: int, n: int) -> float:
    """E[u] for n independent uniform sets of nnz_per_rank indices: numel (1 - (1 - d)^n)."""
    return numel * (1 - (1 - min(nnz_per_rank / numel, 1.0)) ** n)


GAP_MAX = (1 << 15) - 1  # the largest gap an int16 holds


def gap_encode(sorted_indices: torch.Tensor, values: torch.Tensor):
    """(gaps, values) for sending indices as int16: the first index, then the differences of
    consecutive ones; a gap above 32,767 is bridged by filler pairs of gap 32,767 and value 0
    (adding 0 to an element is what the dense all-reduce does for every rank without an entry
    there, so the sum's bits do not change). Top-k at 1% density has gaps of ~100: 2 bytes an
    index instead of 4, and a filler only where a whole stretch of 32,767 values holds none.
    `gap_decode` inverts it (fillers included)."""
    if sorted_indices.numel() == 0:
        return sorted_indices, values
    d = torch.diff(sorted_indices, prepend=sorted_indices.new_zeros(1))
    fillers = ((d - 1) // GAP_MAX).clamp(min=0)  # before each entry
    slots = torch.cumsum(fillers + 1, 0) - 1  # each entry's place after its fillers
    total = int(slots[-1]) + 1
    out_gaps = torch.full((total,), GAP_MAX, dtype=torch.int64, device=d.device)
    out_gaps[slots] = d - fillers * GAP_MAX
    out_values = values.new_zeros(total)
    out_values[slots] = values
    return out_gaps, out_values


def gap_decode(gaps: torch.Tensor) -> torch.Tensor:
    """The positions of `gap_encode`'s pairs (int64), fillers included."""
    return gaps.long().cumsum(0)


def estimated_wire_bytes(scheme: str, nnz_per_rank: int, numel: int, n: int, *,
                         max_nnz: int | None = None, union: float | None = None,
                         index_bytes: int | None = None, value_bytes: int = 4,
                         gap_bytes: int | None = None) -> float:
    """Bytes one rank sends, with k_max = max_nnz (default nnz_per_rank), u = union (default
    `independent_union`), b_i = index_bytes (default `index_wire_dtype`), b_v = value_bytes,
    b_g = gap_bytes (allgather's index bytes: 2 when its indices travel as int16 gaps,
    `gap_encode`, fillers not counted; default b_i), s = ceil(numel / N), c = ceil(k_max / N), u_p = ceil(u / N), B(f, m) = `chunk_bytes`:

        allgather: 16 (N-1) + (N-1) k_max (b_g + b_v)
        balanced:  8 N (N-1) + (N-1) c (b_i + b_v) + 8 (N-1)
                   + (N-1) min(B(pairs, u_p), B(bitmap, u_p), B(dense, u_p))

    The terms are the phases in order: counts, pairs (allgather); counts, pairs to the owners,
    reduced counts, the owners' sums (balanced); allgather's counts are two per rank (16
    bytes: with and without gap fillers). Balanced's chunks are padded to its largest
    (sender, owner) count and its largest partition, taken here as the means a balanced hash
    gives."""
    k_max = nnz_per_rank if max_nnz is None else max_nnz
    u = independent_union(nnz_per_rank, numel, n) if union is None else union
    b_i = index_wire_dtype(numel).itemsize if index_bytes is None else index_bytes
    pair = b_i + value_bytes
    if scheme == "allgather":
        b_g = b_i if gap_bytes is None else gap_bytes
        return 16 * (n - 1) + (n - 1) * k_max * (b_g + value_bytes)
    size, u_p = math.ceil(numel / n), math.ceil(u / n)
    from_owners = min(chunk_bytes(f, u_p, size, b_i, value_bytes) for f in FORMATS)
    return 8 * n * (n - 1) + (n - 1) * math.ceil(k_max / n) * pair + 8 * (n - 1) \
        + (n - 1) * from_owners


def choose_scheme(nnz_per_rank: int, numel: int, n: int, *, max_nnz: int | None = None,
                  union: float | None = None, index_bytes: int | None = None,
                  value_bytes: int = 4, gap_bytes: int | None = None, latency_s: float = 1e-3,
                  gbps: float = 1.0) -> str:
    """The scheme with the lower estimated time, in the alpha-beta model of comm/link.py:

        T = collectives x latency_s + estimated_wire_bytes x 8 / (gbps 1e9),

    2 collectives for "allgather", 4 for "balanced"; a tie goes to "allgather".

    What the rule does: allgather sends every pair N-1 times; balanced sends it about once,
    then the union once per rank, as pairs, bitmap or dense slice. So balanced wins by overlap
    (u < N k), by bitmaps (union density above 1/(8 b_i) in a partition), and with N; allgather
    wins with few pairs, where its copies cost less than balanced's all-to-all plus the union,
    and its two fewer latencies decide. Under `independent_union`, numel 2^22, fp32, defaults,
    the lowest density at which it picks balanced is 25% for N = 2, 2.4% for N = 4 (at 10%:
    7.2 MB against 10.1 MB), 0.78% for N = 8, 0.33% for N = 16; overlap lowers it."""
    if n <= 1:
        return "allgather"
    kwargs = {"max_nnz": max_nnz, "union": union, "index_bytes": index_bytes,
              "value_bytes": value_bytes, "gap_bytes": gap_bytes}
    seconds = {
        scheme: COLLECTIVES[scheme] * latency_s
        + estimated_wire_bytes(scheme, nnz_per_rank, numel, n, **kwargs) * 8 / (gbps * 1e9)
        for scheme in ("allgather", "balanced")
    }
    return "balanced" if seconds["balanced"] < seconds["allgather"] else "allgather"


def sketch_size(numel: int) -> int:
    """How many hashes "auto" sends per rank for an out of `numel` elements: numel / 4096, at
    most 256, so the sketch costs at most 1/2048 of the dense fp32 tensor's bytes (top-k at 1%
    over 4 ranks: 0.8% of its pairs); none below 16 hashes (numel < 65,536), where the rule
    falls back to `independent_union`, a pure function of the density and N. A function of
    numel alone, so every rank sends the same row length."""
    size = min(SKETCH_SIZE, numel // SKETCH_PER)
    return size if size >= SKETCH_MIN else 0


def bottom_hashes(indices: torch.Tensor, size: int = SKETCH_SIZE) -> torch.Tensor:
    """The `size` smallest `fibonacci_hash`es of `indices`, filled up with 2^32: a bottom-k
    (KMV) sketch of the set, whose union over ranks estimates u (`estimate_union`)."""
    sketch = torch.full((size,), NO_HASH, dtype=torch.int64, device=indices.device)
    hashes = fibonacci_hash(indices)
    m = min(size, hashes.numel())
    sketch[:m] = torch.topk(hashes, m, largest=False).values
    return sketch


def estimate_union(sketches: torch.Tensor, size: int = SKETCH_SIZE) -> float:
    """u from every rank's `bottom_hashes` (Bar-Yossef et al., RANDOM 2002; Beyer et al.,
    SIGMOD 2007): the `size` smallest hashes of the union are among the ranks' own, and with
    h_k the k-th smallest, u ~ (k - 1) 2^32 / h_k (relative error about 1/sqrt(k - 2), 6% at
    256). Exact when the union holds fewer than `size` hashes: then every rank sent all."""
    hashes = torch.unique(sketches[sketches < NO_HASH])
    if hashes.numel() < size:
        return float(hashes.numel())
    return (size - 1) * float(NO_HASH) / (hashes[size - 1].item() + 1)
