"""Hung training, noticed (docs/faults.md, fault 11): a watch thread in every Ray Train rank.

Ray Train restarts a worker group after a worker *dies* (FailureConfig); a rank that stops
without dying (a stopped process, a collective that never completes, a deadlock) keeps every
rank waiting, billing every GPU, until Ray's own worker health check gives up after 10
minutes (RAY_TRAIN_WORKER_HEALTH_CHECK_TIMEOUT_S), and only for a process that stops answering
Ray altogether. Here each rank's thread publishes, every BEAT_S, a record to the GCS internal
KV: its step, whether it is inside a checkpoint, a beat counter, and the longest gap between
two of its advances so far. The threads of ranks 0 and 1 (JUDGES) read the group's records in
one request and judge on their own clocks, so nodes' clocks need not agree:

- the bound is max(floor, factor x the longest gap between advances seen in this worker
  group), the gap of the kind in progress: steps, or a checkpoint (before this group has
  written one, a checkpoint gets CHECKPOINT_ALLOWANCE x the floor). The watch arms at this
  rank's first step in the group (model loading, compilation and the first collective are not
  steps);
- when no rank has advanced for longer than the bound, the ranks that stopped beating (their
  process stopped, or holds the GIL in native code) are named; else the ranks behind the
  others' step; else none can be told apart (every rank waits, e.g. in the collective);
- the verdict goes to the KV (the driver's summary and the failure policy read it) and one
  line to the run's log, and the judging rank exits (HUNG_EXIT): Ray Train sees a worker
  group error, ends the group (a stopped rank is killed with it) and starts a new one from the
  latest checkpoint. hangpolicy.HangAwarePolicy counts these apart from --max-failures.

A rank that is alone (--num-workers 1) has no peer to notice it: Ray's own health check is
what ends it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field

KV_NAMESPACE = b"rayfleet-train"
BEAT_S = 1.0
STALE_BEATS = 5          # a rank whose beat has not moved for this many BEAT_S stopped beating
MIN_FLOOR_S = 10.0       # the shortest --hang-floor-s: a few beats, and a step's report
DEFAULT_FLOOR_S = 300.0
MIN_FACTOR = 2.0
DEFAULT_FACTOR = 10.0
CHECKPOINT_ALLOWANCE = 4  # x the floor for a group's first checkpoint (none measured yet)
# The ranks that read the group's records and judge (every rank publishes its own): two, so
# that a hung judge has a peer to name it, and the GCS serves two reads a second, not one per
# rank, however large the group.
JUDGES = 2
HUNG_EXIT = 75


def record_key(job: str, run: str, group: str, rank: int) -> bytes:
    return f"watch:{job}:{run}:{group}:{rank}".encode()


def verdict_prefix(job: str, run: str) -> bytes:
    return f"hang:{job}:{run}:".encode()


def run_prefixes(job: str, run: str) -> tuple[bytes, bytes]:
    """Every key one run of one job writes: its ranks' records and its verdicts (a run name
    holds no ':', so no other run's keys share these prefixes)."""
    return f"watch:{job}:{run}:".encode(), verdict_prefix(job, run)


def verdict_key(job: str, run: str, group: str) -> bytes:
    return verdict_prefix(job, run) + group.encode()


@dataclass
class Settings:
    floor_s: float = DEFAULT_FLOOR_S
    factor: float = DEFAULT_FACTOR


@dataclass
class Seen:
    """What one rank's record showed, and when (the watcher's monotonic clock) it last
    changed: its beat counter and its progress (step and phase)."""
    record: dict
    beat_at: float
    advanced_at: float


@dataclass
class Progress:
    """This rank's own progress in this worker group: steps done, the phase it is in, and the
    longest gap between two of its advances of each kind."""
    step: int = 0
    steps_here: int = 0
    phase: str = "step"
    last: float = field(default_factory=time.monotonic)
    longest_step_s: float = 0.0
    longest_checkpoint_s: float | None = None

    def stepped(self, step: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self.steps_here:   # the first step's gap holds start-up, not a step
            self.longest_step_s = max(self.longest_step_s, now - self.last)
        self.step, self.steps_here, self.last = step, self.steps_here + 1, now

    def checkpointing(self, now: float | None = None) -> None:
        self.phase, self.last = "checkpoint", time.monotonic() if now is None else now

    def checkpointed(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.longest_checkpoint_s = max(self.longest_checkpoint_s or 0.0, now - self.last)
        self.phase, self.last = "step", now


def bound(records: list[dict], settings: Settings) -> tuple[float, str]:
    """(seconds, why): how long no rank may advance, for the phase in progress."""
    floor = settings.floor_s
    if any(r.get("phase") == "checkpoint" for r in records):
        seen = [r["longest_checkpoint_s"] for r in records
                if r.get("longest_checkpoint_s") is not None]
        if not seen:
            return floor * CHECKPOINT_ALLOWANCE, (f"{CHECKPOINT_ALLOWANCE} x the floor "
                                                  f"{floor:g} s for a first checkpoint")
        longest, kind = max(seen), "checkpoint"
    else:
        longest, kind = max((r.get("longest_step_s") or 0.0 for r in records), default=0.0), \
            "step"
    derived = settings.factor * longest
    if derived > floor:
        return derived, f"{settings.factor:g} x the longest {kind}, {longest:.1f} s"
    return floor, f"the floor; {settings.factor:g} x the longest {kind} is {derived:.1f} s"


def judge(seen: dict[int, Seen], world_size: int, now: float, settings: Settings,
          armed_at: float, beat_s: float = BEAT_S) -> dict | None:
    """The verdict when no rank of the group has advanced for longer than the bound, else
    None. A rank with no record at all counts as one that never beat since `armed_at`."""
    records = [s.record for s in seen.values()]
    if any(r.get("phase") == "done" for r in records):
        return None   # a rank has finished the run: the others are finishing it too
    limit, why = bound(records, settings)
    last_advance = max([s.advanced_at for s in seen.values()] + [armed_at])
    waited = now - last_advance
    if waited <= limit:
        return None
    missing = [r for r in range(world_size) if r not in seen]
    stale = sorted(missing + [r for r, s in seen.items()
                              if now - s.beat_at > STALE_BEATS * beat_s])
    steps = {r: s.record["step"] for r, s in seen.items()}
    if stale:
        ranks, how = stale, "stopped answering"
    elif len(set(steps.values())) > 1:
        low = min(steps.values())
        ranks, how = sorted(r for r, st in steps.items() if st == low), "fell behind"
    else:
        ranks, how = [], "waits with the others"
    return {"ranks": [{"rank": r, **{k: seen[r].record.get(k) for k in ("node", "pid", "step",
                                                                        "phase")}}
                      if r in seen else {"rank": r} for r in ranks],
            "how": how, "waited_s": round(waited, 1), "bound_s": round(limit, 1),
            "bound_why": why, "step": max(steps.values(), default=0)}


def describe(v: dict) -> str:
    """The verdict in one line, for the run's log and the summary."""
    if v["ranks"]:
        who = "; ".join(
            f"rank {r['rank']}" + (f" on {r['node']} (pid {r['pid']}) at step {r['step']}"
                                   + (" in a checkpoint" if r.get("phase") == "checkpoint"
                                      else "") if "node" in r else " never reported")
            for r in v["ranks"]) + f" {v['how']}"
    else:
        who = "every rank is waiting (a collective or I/O), no rank stands out"
    return (f"hung: no rank advanced for {v['waited_s']:g} s past step {v['step']} (bound "
            f"{v['bound_s']:g} s: {v['bound_why']}): {who}")


class Watch:
    """No watch: torchrun, one process, or --hang-floor-s 0."""

    def stepped(self, step: int) -> None:
        pass

    def checkpointing(self) -> None:
        pass

    def checkpointed(self) -> None:
        pass

    def finished(self) -> None:
        pass


NONE = Watch()


class RankWatch(Watch):
    """One rank's watch: `get`/`put`/`keys` reach the GCS KV (injected for tests), `exit`
    ends the process once a verdict is written."""

    def __init__(self, *, rank: int, world_size: int, job: str, run: str, group: str,
                 node: str, settings: Settings, kv, exit=os._exit, beat_s: float = BEAT_S):
        self.rank, self.world_size, self.settings = rank, world_size, settings
        self.job, self.run, self.group, self.node = job, run, group, node
        self.kv, self._exit, self.beat_s = kv, exit, beat_s
        self.progress = Progress()
        self._lock = threading.Lock()
        self.verdict: dict | None = None
        threading.Thread(target=_watch, args=(weakref.ref(self),), daemon=True,
                         name="rayfleet-hang-watch").start()

    def stepped(self, step: int) -> None:
        with self._lock:
            self.progress.stepped(step)

    def checkpointing(self) -> None:
        with self._lock:
            self.progress.checkpointing()

    def checkpointed(self) -> None:
        with self._lock:
            self.progress.checkpointed()

    def finished(self) -> None:
        """The run's last step and checkpoint are done: published at once, so that a peer
        still finishing never takes this rank's silence for a hang."""
        with self._lock:
            self.progress.phase = "done"
        try:
            self.kv.put(record_key(self.job, self.run, self.group, self.rank),
                        json.dumps(self.record(-1)).encode())
        except Exception:  # a GCS blip: the thread's next beat publishes it
            pass

    def record(self, beat: int) -> dict:
        with self._lock:
            p = self.progress
            return {"rank": self.rank, "node": self.node, "pid": os.getpid(), "step": p.step,
                    "steps_here": p.steps_here, "phase": p.phase, "beat": beat,
                    "longest_step_s": round(p.longest_step_s, 3),
                    "longest_checkpoint_s": p.longest_checkpoint_s}

    def read(self, seen: dict[int, Seen], now: float) -> None:
        """The group's records into `seen`, each change stamped with `now`."""
        keys = {record_key(self.job, self.run, self.group, r): r for r in range(self.world_size)}
        for key, raw in self.kv.get_many(list(keys)).items():
            r = keys[key]
            rec = json.loads(raw)
            old = seen.get(r)
            if old is None:
                seen[r] = Seen(rec, now, now)
                continue
            if rec["beat"] != old.record["beat"]:
                old.beat_at = now
            if (rec["step"], rec["phase"]) != (old.record["step"], old.record["phase"]):
                old.advanced_at = now
            old.record = rec

    def conclude(self, verdict: dict) -> None:
        self.verdict = verdict
        self.kv.put(verdict_key(self.job, self.run, self.group),
                    json.dumps({**verdict, "by": self.rank, "at": time.time()}).encode())
        first = min((r for r in range(self.world_size)
                     if r not in {v["rank"] for v in verdict["ranks"]}), default=self.rank)
        if self.rank == first:   # one line per verdict, from the lowest rank not named
            print(f"[rayfleet] {describe(verdict)}; ending the worker group to resume from "
                  f"the latest checkpoint", flush=True)
        sys.stdout.flush()
        self._exit(HUNG_EXIT)


def _watch(ref: weakref.ref) -> None:
    """Until the loop drops its RankWatch: publish this rank's record, read the group's, and
    judge once armed (this rank's first step in the group)."""
    seen: dict[int, Seen] = {}
    beat, armed_at = 0, None
    while (w := ref()) is not None:
        beat += 1
        now = time.monotonic()
        try:
            w.kv.put(record_key(w.job, w.run, w.group, w.rank), json.dumps(
                w.record(beat)).encode())
            if w.rank < JUDGES:
                w.read(seen, now)
        except Exception:  # a GCS blip: the next beat tries again, training goes on
            pass
        else:
            if w.rank < JUDGES and armed_at is None and w.progress.steps_here:
                armed_at = now
            if armed_at is not None and w.verdict is None:
                verdict = judge(seen, w.world_size, now, w.settings, armed_at, w.beat_s)
                if verdict is not None:
                    w.conclude(verdict)
        wait = w.beat_s
        del w
        time.sleep(wait)


class GcsKV:
    """The GCS internal KV through this worker's own connection."""

    def get(self, key: bytes) -> bytes | None:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(key, namespace=KV_NAMESPACE)

    def get_many(self, keys: list[bytes]) -> dict[bytes, bytes]:
        """The keys that exist, in one request (Ray's GCS client's multi-get)."""
        from ray.experimental import internal_kv

        return internal_kv.internal_kv_get_gcs_client().internal_kv_multi_get(
            keys, namespace=KV_NAMESPACE)

    def put(self, key: bytes, value: bytes) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(key, value, overwrite=True, namespace=KV_NAMESPACE)

    def verdicts(self, job: str, run: str) -> list[dict]:
        from ray.experimental import internal_kv

        keys = internal_kv._internal_kv_list(verdict_prefix(job, run), namespace=KV_NAMESPACE)
        found = [json.loads(v) for k in keys
                 if (v := internal_kv._internal_kv_get(k, namespace=KV_NAMESPACE))]
        return sorted(found, key=lambda v: v.get("at", 0))

    def forget(self, job: str, run: str) -> None:
        from ray.experimental import internal_kv

        for prefix in run_prefixes(job, run):
            internal_kv._internal_kv_del(prefix, del_by_prefix=True, namespace=KV_NAMESPACE)


def for_ray_worker(rank: int, world_size: int, run: str, settings: Settings | None) -> Watch:
    """This Ray Train rank's watch (NONE with one rank or the watch turned off)."""
    if settings is None or world_size < 2:
        return NONE
    import ray

    ctx = ray.get_runtime_context()
    # The worker group's placement group: one per group, shared by its ranks, new at each
    # restart (so a new group never reads the last one's records).
    pg = ray.util.get_current_placement_group()
    if pg is None:
        if rank == 0:
            print("[rayfleet] the hang watch is off: this worker runs outside a placement "
                  "group, so its group's records cannot be told apart", flush=True)
        return NONE
    node = ray.util.get_node_ip_address()
    return RankWatch(rank=rank, world_size=world_size, job=ctx.get_job_id(), run=run,
                     group=pg.id.hex(), node=f"{node} (node {ctx.get_node_id()[:8]})",
                     settings=settings, kv=GcsKV())
