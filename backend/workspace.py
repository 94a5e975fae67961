"""How the engine's workspace (``Settings.engine_memory_bytes``) is shared (torch-free).

One half holds a direction chunk's gradients at the recorded outputs (and as much in temporaries). The
other half holds what lives between chunks and between passes: a position's ghost moments M, kept from
one chunk to the next, and what a response's first pass and refining round keep for its exact pass (each
position's plans and the moments its round directions left). Those two share the half: while a later
position's kept bytes are held, a position's ghost moments have what is left of it.

Why halves: the chunk's speed is flat from half a GiB to a GiB of gradients (smaller chunks spend more
per direction on the backward's fixed work, larger ones touch memory for the first time), and the ghost
moments of a long context take every byte they get (each block that fits saves its direct form). Three
budgets of their own (chunk, moments, kept) would let a response's workspace reach three times the
setting.
The engine (``workers.fisher.directions``, ``workers.fisher.response``) and the memory estimate
(``backend.memory_estimate``) read the split from here.
"""

from __future__ import annotations


def chunk_bytes(workspace_bytes: int) -> int:
    """What one direction chunk's gradients may use."""
    return workspace_bytes // 2


def between_chunks_bytes(workspace_bytes: int) -> int:
    """What the ghost moments between chunks and a response's kept plans and moments may use together."""
    return workspace_bytes - chunk_bytes(workspace_bytes)
