"""The ops: each module holds an op's pure-torch reference, its fallback and (on a GPU) its Triton kernels
with the ``torch.autograd.Function`` that runs them. No transformers imports here."""
