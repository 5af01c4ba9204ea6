"""Sequence and context parallelism over the mesh's `cp` axis (issue 6; in progress).

balance.py     pure: variable-length sequences dealt to ranks, long ones split across
               several, so that every rank's attention work is even (the ByteScale idea)
context.py     layouts (contiguous, zig-zag), the Ring of p2p shifts, SeqContext (positions,
               documents, position-based masks) and the dense reference attention
ring.py        ring attention: k, v blocks passed around the ring, online-softmax merge,
               masked tiles skipped (zig-zag balance), ring backward
ulysses.py     DeepSpeed-Ulysses: all-to-all from sequence shards to head shards and back
"""
