"""The routed experts of a Qwen3.5 MoE block over a prompt, in blocks of one expert's rows, with a data-dependent block
count (issue 51): `layout.py` lays the (token, expert) pairs out (torch, static shapes), `kernel.py` is the NKI kernel
that runs only the filled blocks (dynamic loops bounded by registers), `reference.py` the PyTorch form of the same
call (every block of the static bound, what the cpu target and NxD run)."""
