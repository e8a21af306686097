"""The CPU kernels a decode runs with (``linear_kernel=auto``), each applied to an unmodified model for a ``with``
block: the linears' measured row plans and packed weights (linear_kernels.py), grouped-query attention that reads KV
heads in place (attention.py) and greedy verification's bfloat16 LM head (greedy_head.py). It imports only ``core``:
the engine (``decode``) runs with them, and nothing here knows a decode."""
