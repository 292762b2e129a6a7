"""The trainer's side of weight sync, in one place. The settings come from one plan, resolved once from
the config (rlslurm/settings/weight_plan.py), which the rollout side reads too.

    delivery.py   WeightDelivery: what the trainer loop calls (publish, defer, wait, probe) and its state
    factory.py    the publisher the plan asks for
    base.py       the publisher interface, the two that send nothing, errors, options, roles, Transport
    tries.py      SyncPublisher: the bracket, tries and disk fallback around an engine transport
    broadcast.py  the broadcast transport (a group per pipeline stage; group.py builds it)
    ipc.py        the in-place transport of --colocate (CUDA IPC, memfd on CPU)
    buckets.py    a bucket's layout and request entry, shared by both transports
    disk.py       HF files on disk: --weight-sync disk, the fallback, --save-hf
    record.py     Delivered: which transport delivered each version
    probe.py      --verify-weight-sync's greedy comparison
"""
