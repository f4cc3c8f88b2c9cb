"""Scale-out over processes (ZeRO-3 over the store's chunks): who this process is among the ranks a launcher
started (``world``: torchrun and ``accelerate launch`` set the same variables), and the collectives that move
chunk shards between ranks with the bytes they put on the wire counted (``collectives``). torch.distributed
does the transport: NCCL on GPUs, gloo on CPUs."""
