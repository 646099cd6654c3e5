"""The distributed layer: the typed messages (messages.py) and their transport (MPI, or in-process
threads), torch.distributed groups, weight sync.

Everything that talks between ranks lives here; roles use these classes (typed to
`comm.transport.Transport`) and never call MPI or torch.distributed directly.
"""
