"""The low-communication component's keys and rules (docs/lowcomm.md): replicas train apart
and synchronize every inner_steps optimizer steps."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from loomtrain.component import (REPLICATE, Built, Component, EngineTimeline, Refusal, Section, Switch,
                                 changed_keys)

# the [lowcomm] keys each algorithm reads; a key set away from its default for an algorithm
# that does not read it is refused (it would be silently ignored)
LOWCOMM_KEYS = {
    "none": (),
    "local_sgd": ("inner_steps",),
    "diloco": ("inner_steps", "outer_optimizer", "outer_lr", "outer_momentum"),
    "streaming_diloco": ("inner_steps", "outer_optimizer", "outer_lr", "outer_momentum",
                         "fragments", "overlap_steps", "quantize", "mix"),
    "noloco": ("inner_steps", "outer_lr", "outer_momentum", "outer_pull"),
    "dreamddp": ("inner_steps",),
    "hpsgd": ("overlap_steps",),
    "hierarchical": ("inner_steps", "overlap_steps", "adaptive_period"),
    "lordo": ("inner_steps", "outer_optimizer", "outer_lr", "outer_momentum", "rank"),
}

# the algorithms whose lost replica is restarted alone and rejoins (run.max_restarts > 0;
# lowcomm/replicas.py): one synchronous all-reduce per sync, which a re-formed group retries
REPLICA_ALGORITHMS = ("local_sgd", "diloco", "streaming_diloco")


def restarts_replicas(cfg) -> bool:
    """Whether a lost replica of this run is restarted alone (train/replica_launch.py)."""
    return (cfg.run.max_restarts > 0 and cfg.lowcomm.algorithm in REPLICA_ALGORITHMS
            and cfg.parallel.nproc > 1)


class LowcommConfig(Section):
    # low-communication data parallelism (lowcomm/, docs/lowcomm.md): replicas train apart
    # and synchronize every inner_steps optimizer steps; LOWCOMM_KEYS: the keys each one reads
    algorithm: Literal["none", "local_sgd", "diloco", "streaming_diloco", "noloco", "dreamddp",
                       "hpsgd", "hierarchical", "lordo"] = "none"
    inner_steps: int = Field(1, ge=1)  # H
    # DiLoCo's outer optimizer: "nesterov", SGD with Nesterov momentum; "sgd", without momentum
    outer_optimizer: Literal["sgd", "nesterov"] = "nesterov"
    outer_lr: float = Field(0.7, gt=0.0)  # DiLoCo's (Douillard et al. 2023)
    outer_momentum: float = Field(0.9, gt=0.0, lt=1.0)
    fragments: int = Field(1, ge=1)  # streaming DiLoCo: F fragments synced at staggered steps
    # optimizer steps a sync stays in flight while the replicas compute (0: wait at once)
    overlap_steps: int = Field(1, ge=0)
    quantize: Literal["none", "int8"] = "none"  # the pseudo-gradients on the wire
    # streaming DiLoCo: an overlapped sync lands as mix * local + (1 - mix) * global (the
    # paper's alpha; 0 replaces the local fragment); 1 would never adopt the global one
    mix: float = Field(0.5, ge=0.0, lt=1.0)
    rank: int = Field(16, ge=1)  # LoRDO: the rank r of the projected optimizer
    # NoLoCo's gamma: how hard an outer step pulls a replica towards its pair's mean outer
    # weights (0: no pull); 0.7, the paper's setting (equal to outer_lr)
    outer_pull: float = Field(0.7, ge=0.0)
    # hierarchical (DASO): the global period halves when the loss plateaus, from inner_steps
    # down to 1, then starts again at inner_steps (lowcomm/hierarchical.py)
    adaptive_period: bool = False

    @model_validator(mode="before")
    @classmethod
    def _lordo_averages(cls, values: Any) -> Any:
        """LoRDO's paper averages the replicas (arXiv 2602.04396, as DES-LOC): for
        algorithm="lordo" outer_optimizer defaults to "sgd", and then outer_lr to 1 (the
        mean); an explicit "nesterov" keeps DiLoCo's defaults."""
        if isinstance(values, dict) and values.get("algorithm") == "lordo":
            values = {"outer_optimizer": "sgd", **values}
            if values["outer_optimizer"] == "sgd":
                values.setdefault("outer_lr", 1.0)
        return values


_REPLICAS = "its replicas are whole fp32 models over dp"
# the algorithms whose replica may run in the sharded engine (parallel/zero/): in bf16, or
# ZeRO-sharded over the dp ranks of a node, whole or split over tp, pp and cp; each rank syncs
# its slices of the fp32 master weights with the ranks that hold the same slices in the other
# replicas (lowcomm/local_sgd.py)
SHARDED_REPLICAS = ("local_sgd", "diloco", "streaming_diloco", "noloco")
_SHARDED_WHY = (" that run in bf16 or are ZeRO-sharded (each rank syncs its slices of the fp32 "
                "master weights); HPSGD and DASO reduce the parameters' own gradients every "
                "step, DreamDDP syncs the whole model's layers timed in its own backward, and "
                "LoRDO steps its own low-rank optimizer, not ZeRO's elementwise one over slices")


class Lowcomm(EngineTimeline, Component):
    """Low-communication replicas over dp, each on its own rows, each whole or itself split
    over tp, cp and pp (each rank syncs its own pieces over dp; LoRDO's projections are the
    whole matrices'), and run by the sharded engine in bf16 or ZeRO-sharded over the dp ranks
    of a node (SHARDED_REPLICAS), checkpointed only where they are synchronized."""

    name = "lowcomm"
    section, keys = "lowcomm", LowcommConfig
    switches = (Switch("lowcomm.algorithm", "none"),)
    summary = "local SGD, DiLoCo, streaming DiLoCo, NoLoCo, DreamDDP, HPSGD, DASO, LoRDO"
    refuses = {**{other: Refusal(_REPLICAS) for other in ("packing", "balance")},
               **{other: Refusal("of its algorithms, only lowcomm.algorithm=" + ", ".join(
                   f'"{a}"' for a in SHARDED_REPLICAS) + " sync replicas" + _SHARDED_WHY,
                   when=lambda cfg: cfg.lowcomm.algorithm not in SHARDED_REPLICAS,
                   partly="with dreamddp, hpsgd, hierarchical or lordo")
                  for other in ("zero", "bf16")},
               "async_pipeline": Refusal("its runtime steps each stage's own optimizer after "
                                         "every micro-batch, across the steps where the "
                                         "replicas sync")}
    stage = REPLICATE  # before ZeRO and plain data parallelism: it takes the dp axis's place

    @classmethod
    def apply(cls, built: Built) -> None:
        """No gradient all-reduce: the replicas synchronize every inner_steps steps."""
        from loomtrain.lowcomm import apply_lowcomm
        from loomtrain.lowcomm.local_sgd import replica_shard_axis
        from loomtrain.parallel.zero.config import Zero, shard_built

        cfg = built.cfg
        if Zero.applies(cfg):  # each replica in the sharded engine: in bf16, or ZeRO over a node
            shard_built(built, replica_shard_axis(cfg.parallel))
        built.model, built.optimizer = apply_lowcomm(built.model, built.optimizer, built.mesh,
                                                     cfg.lowcomm, cfg.run.seed)
        if built.compressor is not None:  # applies_to="pseudo_gradients": the outer all-reduce
            built.model.compressor = built.compressor
        from loomtrain.lowcomm.state import LOWCOMM

        built.replicated, built.layout = True, LOWCOMM

    @classmethod
    def estimate(cls, plan) -> None:
        from loomtrain.lowcomm.estimate import estimate_lowcomm

        estimate_lowcomm(plan)

    @classmethod
    def loss_tokens(cls, built: Built, local_tokens: int, global_tokens: float) -> float:
        """The replicas step on their own rows: each normalizes by its own tokens (a
        ZeRO-sharded replica's: its ranks' together)."""
        return built.model.replica_tokens(local_tokens)

    @classmethod
    def after_step(cls, built: Built, done: int, last: bool, loss_sum, loss_tokens: float) -> None:
        """Every inner_steps steps, and after the last, the replicas synchronize."""
        built.model.observe_loss(loss_sum, loss_tokens)
        built.model.after_step(done, last=last)

    @classmethod
    def metrics(cls, built: Built, evaluated: bool) -> dict:
        return built.model.metrics()  # the algorithm's own figures (a spread, a ratio, ...)

    @classmethod
    def before_save(cls, built: Built) -> None:
        built.model.end_period()  # a stop between syncs: one model to save

    @classmethod
    def validate(cls, cfg) -> None:
        lc, p, t = cfg.lowcomm, cfg.parallel, cfg.train
        changed = [k for k in changed_keys(lc) if k != "algorithm"]
        unread = [k for k in changed if k not in LOWCOMM_KEYS[lc.algorithm]]
        if unread:
            readers = [a for a, keys in LOWCOMM_KEYS.items() if unread[0] in keys]
            raise ValueError(f"lowcomm.{unread[0]} is not read by lowcomm.algorithm="
                             f"{lc.algorithm!r}; it is a setting of "
                             f"{', '.join(repr(a) for a in readers)}: set lowcomm.algorithm to one "
                             "of them or leave the key at its default")
        if lc.outer_optimizer == "sgd" and "outer_momentum" in changed:
            raise ValueError('lowcomm.outer_momentum is the Nesterov momentum; lowcomm.'
                             'outer_optimizer="sgd" has none: use "nesterov" or leave it unset')
        if lc.algorithm == "noloco" and lc.outer_pull >= 2 * (1 + lc.outer_momentum):
            raise ValueError(
                f"lowcomm.outer_pull={lc.outer_pull} must be below 2 x (1 + lowcomm.outer_momentum) "
                f"= {2 * (1 + lc.outer_momentum):g}: NoLoCo's outer step maps the difference between "
                "two partners' weights through x <- (1 + momentum - pull) x - momentum x_prev, which "
                "grows instead of shrinking from that pull on, so paired replicas would move apart; "
                "the paper uses 0.7 (the default)")
        if lc.algorithm == "none":
            return
        if lc.algorithm == "hpsgd" and lc.overlap_steps > 1:
            raise ValueError(f"lowcomm.overlap_steps={lc.overlap_steps} with lowcomm.algorithm="
                             "'hpsgd': HPSGD keeps at most one step's synchronization in flight "
                             "while the next step computes (1, the paper's setting and the default; "
                             "0: wait for it at once, synchronous data parallelism with plain SGD); "
                             "set lowcomm.overlap_steps to 0 or 1")
        if lc.algorithm == "streaming_diloco":
            _check_streaming(lc, cfg.model)
        if lc.algorithm == "hierarchical":
            _check_hierarchical(lc, p)
        if lc.algorithm == "lordo" and t.optimizer != "adamw":
            raise ValueError(f'lowcomm.algorithm="lordo" replaces train.optimizer with its own '
                             f"low-rank AdamW (the moments of each matrix in a rank-lowcomm.rank "
                             f"subspace), built from train.lr, beta1, beta2 and weight_decay; "
                             f'train.optimizer={t.optimizer!r} has no moments to project: set '
                             f'train.optimizer="adamw"')
        if cfg.run.max_restarts:
            _check_restarts(cfg)
        if p.zero_stage or t.precision == "bf16":
            _check_sharded(cfg)
        every = cfg.checkpoint.every
        if every % lc.inner_steps:
            fit = -(-every // lc.inner_steps) * lc.inner_steps
            raise ValueError(f"checkpoint.every={every} must be a multiple of lowcomm.inner_steps="
                             f"{lc.inner_steps}: a checkpoint holds one model, so it is written where "
                             f"the replicas synchronize; set checkpoint.every={fit} (or 0: only at "
                             "the end and on a signal)")


def _check_restarts(cfg) -> None:
    """run.max_restarts > 0 restarts a lost replica alone (lowcomm/replicas.py): for the
    algorithms whose syncs are synchronous all-reduces that a re-formed group can retry
    (streaming DiLoCo's fragment syncs are waited for at once there: lowcomm/streaming.py)."""
    lc = cfg.lowcomm
    if lc.algorithm not in REPLICA_ALGORITHMS:
        raise ValueError(f"run.max_restarts={cfg.run.max_restarts} under [lowcomm] restarts a "
                         "lost replica alone, which works with lowcomm.algorithm=\"local_sgd\", "
                         f"\"diloco\" and \"streaming_diloco\"; lowcomm.algorithm={lc.algorithm!r}"
                         " is not supported yet: its synchronization is not a synchronous "
                         "all-reduce of whole fragments, which is what a re-formed group retries. "
                         "Set run.max_restarts=0 or one of those algorithms")
    p = cfg.parallel
    split = {k: getattr(p, k) for k in ("tp", "pp", "cp") if getattr(p, k) > 1}
    if split:
        key, value = next(iter(split.items()))
        raise ValueError(f"run.max_restarts={cfg.run.max_restarts} under [lowcomm] restarts a "
                         "lost replica alone, as one process that holds the whole model, and "
                         f"parallel.{key}={value} splits each replica over {value} processes: "
                         f"set run.max_restarts=0 or parallel.{key}=1")
    if cfg.compression.method != "none":
        raise ValueError("run.max_restarts > 0 with [compression] on DiLoCo's pseudo-gradients: "
                         "the compressor keeps what it dropped (error feedback) before the "
                         "all-reduce completes, so a sync retried after a lost replica would add "
                         "it twice; set compression.method=\"none\" or run.max_restarts=0")


def _check_sharded(cfg) -> None:
    """Replicas in the sharded engine (SHARDED_REPLICAS): with ZeRO, a replica is the dp ranks
    that share a node, which shard it (tp, pp and cp split it as they split any replica), and
    the replicas sync across nodes; not yet with compressed pseudo-gradients."""
    lc, p = cfg.lowcomm, cfg.parallel
    what = (f"parallel.zero_stage={p.zero_stage}" if p.zero_stage
            else 'train.precision="bf16"')
    if cfg.run.max_restarts:
        why = ("a ZeRO-sharded replica is several processes (a node's dp ranks), and the "
               "launcher restarts a lost replica as one process and re-forms the replicas' "
               "group with it (lowcomm/replicas.py), not a node's shard groups" if p.zero_stage
               else "the hand-over to a restarted replica (a peer's parameters, outer state "
               "and inner optimizer state) is written for the fp32 model, not for the sharded "
               "engine's fp32 master weights and its optimizer's slices")
        raise ValueError(f"{what} with run.max_restarts={cfg.run.max_restarts} under [lowcomm]: "
                         f"{why}; this is not supported yet: set run.max_restarts=0")
    if cfg.compression.method != "none":
        raise ValueError(f"{what} with lowcomm.algorithm={lc.algorithm!r} and [compression]: "
                         "compressing the pseudo-gradients of replicas run by the sharded engine "
                         "is not supported yet; set compression.method=\"none\"")
    if not p.zero_stage:
        return
    if p.ranks_per_node is None or p.ranks_per_node >= p.nproc:
        rpn = "unset" if p.ranks_per_node is None else p.ranks_per_node
        raise ValueError(f"{what} with lowcomm.algorithm={lc.algorithm!r}: each replica is the "
                         "ranks of one node, which shard it with ZeRO, and the replicas sync "
                         "across nodes, but parallel.ranks_per_node="
                         f"{rpn} puts all parallel.nproc={p.nproc} ranks on one node, a single "
                         "replica with no other to sync with; set parallel.ranks_per_node to a "
                         "divisor of nproc below it (e.g. 2), or parallel.zero_stage=0 (each "
                         "rank a whole replica)")
    if dp_nodes(p) == 1:
        raise ValueError(f"{what} with lowcomm.algorithm={lc.algorithm!r}: each replica is the "
                         "dp ranks that share a node, which shard it with ZeRO, and the replicas "
                         f"sync across nodes, but parallel.ranks_per_node={p.ranks_per_node} "
                         f"puts all parallel.dp={p.dp_size} dp ranks of a pipeline stage on one "
                         f"node (the nodes divide parallel.pp={p.pp}, not dp): a single replica "
                         "with no other to sync with. Set parallel.ranks_per_node to a divisor "
                         f"of parallel.dp x cp x tp = {p.dp_size * p.cp * p.tp} below it")
    if p.hierarchical:
        raise ValueError(f"parallel.hierarchical=true with lowcomm.algorithm={lc.algorithm!r}: "
                         "hierarchical ZeRO shards inside a node and reduces the gradients "
                         "across nodes every step, and here each node is a replica, which syncs "
                         "with the others only every lowcomm.inner_steps steps; sharding "
                         "hierarchically inside replicas of several nodes is not supported yet "
                         "(no key gives a replica's nodes); set parallel.hierarchical=false")


def dp_nodes(p) -> int:
    """How many nodes the dp ranks of one (pp, cp, tp) position spread over: the grid is
    (pp, dp, cp, tp), tp innermost, so a rank's dp peers are cp x tp ranks apart."""
    apart = p.cp * p.tp
    return len({d * apart // p.ranks_per_node for d in range(p.dp_size)})


def _check_streaming(lc: LowcommConfig, m) -> None:
    """Streaming DiLoCo (lowcomm/streaming.py): fragments are whole blocks, one sync of each
    per inner_steps steps at offsets H/F apart, and a sync lands before the next one starts."""
    if lc.fragments > m.n_layers:
        raise ValueError(f"lowcomm.fragments={lc.fragments} is more than the model's "
                         f"model.n_layers={m.n_layers} blocks: a fragment is made of whole blocks; "
                         f"set lowcomm.fragments to at most {m.n_layers}")
    if lc.inner_steps % lc.fragments:
        fit = -(-lc.inner_steps // lc.fragments) * lc.fragments
        raise ValueError(f"lowcomm.inner_steps={lc.inner_steps} must be a multiple of "
                         f"lowcomm.fragments={lc.fragments}: fragment p syncs at steps p*H/F "
                         f"(mod H), evenly staggered; set lowcomm.inner_steps={fit}")
    spacing = lc.inner_steps // lc.fragments
    if lc.overlap_steps >= spacing:
        raise ValueError(f"lowcomm.overlap_steps={lc.overlap_steps} must be less than "
                         f"lowcomm.inner_steps / lowcomm.fragments = {lc.inner_steps}/"
                         f"{lc.fragments} = {spacing}, the steps between two fragments' syncs, "
                         "so that one sync lands before the next starts; set lowcomm."
                         f"overlap_steps to at most {spacing - 1} (0: wait at once) or raise "
                         "lowcomm.inner_steps")


def _check_hierarchical(lc: LowcommConfig, p) -> None:
    """DASO syncs inside nodes every step and between them every inner_steps steps: it needs
    several nodes, one step of staleness at most, and a period that can change."""
    if p.ranks_per_node is None or p.ranks_per_node >= p.nproc:
        rpn = "unset" if p.ranks_per_node is None else p.ranks_per_node
        raise ValueError(f'lowcomm.algorithm="hierarchical" averages gradients inside each node and '
                         f"parameters between nodes, but parallel.ranks_per_node={rpn} puts all "
                         f"parallel.nproc={p.nproc} ranks on one node: set parallel.ranks_per_node "
                         "to a divisor of nproc below it (e.g. 2 ranks per node)")
    apart = p.cp * p.tp
    if dp_nodes(p) == 1:
        raise ValueError(f'lowcomm.algorithm="hierarchical" averages gradients inside each node '
                         f"and parameters between nodes, but parallel.ranks_per_node="
                         f"{p.ranks_per_node} puts all parallel.dp={p.dp_size} replicas of a "
                         f"pipeline stage on one node (the nodes divide parallel.pp={p.pp}, not "
                         "dp): nothing would cross nodes. Set parallel.ranks_per_node to a "
                         f"divisor of parallel.dp x cp x tp = {p.dp_size * apart} below it "
                         f"(e.g. cp x tp = {apart}: a node per replica and stage)")
    if lc.overlap_steps > 1:
        raise ValueError(f'lowcomm.overlap_steps={lc.overlap_steps} with lowcomm.algorithm='
                         '"hierarchical": its global sync is either waited for at once (0) or '
                         "merged one step stale (1, DASO's asynchronous mode); set 0 or 1")
    if lc.adaptive_period and lc.inner_steps == 1:
        raise ValueError("lowcomm.adaptive_period=true halves the global period from "
                         "lowcomm.inner_steps down to 1, but inner_steps=1 leaves nothing to "
                         "adapt: set lowcomm.inner_steps >= 2 or adaptive_period=false")
