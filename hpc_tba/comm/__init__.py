"""The distributed layer: MPI transport of messages, torch.distributed groups, weight sync.

Everything that talks between processes lives here; roles use these classes and never call MPI
or torch.distributed directly.
"""
