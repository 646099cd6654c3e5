"""Weight sync: learner rank 0 broadcasts the policy to every searcher, a bucket at a time.

The sync group is its own process group (learner rank 0 + all searchers) built from a TCPStore,
independent of the learners' default group that DeepSpeed uses, so ZeRO-3 collectives and weight
broadcasts never share a communicator. Backend `gloo` on CPU and `nccl` on GPU: same code.

Protocol, per sync: a header [version, flags, num_buckets, data on this group, the engine-group
generation of every searcher] posted on the host (a key of the
group's TCPStore: no receive is pending on the group between syncs), then each bucket's flat
buffer in manifest order, as consecutive broadcasts of at most `Manifest.piece_bytes` (the
sender posts each piece once gathered), in the manifest's wire dtype (fp32 by default, bf16 for large models on
GPU: half the bytes, and what the engine runs in anyway). The manifest (parameter names and shapes
in a fixed order, split into buckets of at most `bucket_bytes` on the wire, and the wire dtype) is
agreed once at setup, so no per-parameter message is ever sent and both sides size every buffer
the same way.

Sender: the ZeRO-3 gather of bucket i+1 (and of a bucket's later pieces) overlaps the broadcast
of bucket i (of its earlier pieces). Two flat staging
slots alternate; a slot is refilled only once the broadcast that last read it has completed.
Learner ranks other than 0 join only the gathers.

Receiver: a background thread receives bucket by bucket into bounded staging
(`searcher.staging`), so a broadcast completes while the engine is generating. At most one
version is staged per searcher, in the wire dtype (the engine's dtype by default):

    device, host:  sync memory = one whole version + one bucket   (manifest.total_bytes + B)
    stream:        sync memory = two buckets, three at most       (3 B)

where B is the manifest's largest bucket in bytes (at most `learner.sync_bucket_mb`, or one
parameter larger than that). `staging_bytes(manifest, staging)` is that formula, which the
planner counts; `WeightReceiver.peak_staging_bytes` is the measured peak. Device staging keeps
the version on the engine's device, host staging in (pinned, when CUDA exists) host memory, and
stream loads each bucket into the engine as it arrives (WeightReceiver's docstring).

- `manifest.py`: the header flags, the wire dtypes and the `Manifest` both sides agree on.
- `group.py`: the sync group (`new_group`) and the broadcasts from its rank 0.
- `sender.py`: `WeightSender`, the learner side (ZeRO-3 gathers overlapped with broadcasts).
- `staging.py`: the staging modes, their memory (`staging_bytes`, which the planner counts) and the
  forms a version is handed to the searcher in (`StagedWeights`, `StreamedWeights`).
- `receiver.py`: `WeightReceiver`, the searcher side (a thread receives into that staging).
- `engine_offers.py`: the receiver's end of an out-of-process engine's feed (`WorkerVersion`).
- `worker_groups.py`: out-of-process engines' workers join the broadcast themselves (one engine
  group per engine on the sync group's store, offers and decisions on the host); engine/worker_sync.py
  is their end.
- `feeds.py`: learner rank 0 holds `learner.sync_versions_held` host copies of recent versions and
  one feed thread per engine group broadcasts the newest to its engine at that engine's pace:
  `send()` never waits for an out-of-process engine.
"""
# The package's public names, from the module that defines each (importers use these).
from hpc_tba.comm.weight_sync.engine_offers import WorkerVersion
from hpc_tba.comm.weight_sync.group import (
    GROUP_TIMEOUT_S,
    attach_store,
    broadcast_async,
    new_group,
    post_header,
    stop_receivers,
    wait_header,
)
from hpc_tba.comm.weight_sync.manifest import FLAG_EVAL, FLAG_STOP, WIRE_DTYPES, Manifest, wire_dtype_name
from hpc_tba.comm.weight_sync.receiver import WeightReceiver
from hpc_tba.comm.weight_sync.sender import WeightSender
from hpc_tba.comm.weight_sync.staging import (
    STAGING_MODES,
    StagedWeights,
    StreamedWeights,
    resolve_staging,
    staging_bytes,
)

__all__ = ["FLAG_EVAL", "FLAG_STOP", "GROUP_TIMEOUT_S", "STAGING_MODES", "WIRE_DTYPES", "Manifest",
           "StagedWeights", "StreamedWeights", "WeightReceiver", "WeightSender", "WorkerVersion", "broadcast_async",
           "attach_store", "new_group", "post_header", "resolve_staging", "staging_bytes",
           "stop_receivers", "wait_header", "wire_dtype_name"]
