"""Programmatic dependent launch (PDL): a decode step's kernels overlap their neighbours.

A decode step at small batch is a chain of short kernels, each waiting for the one before.
Launched with PDL (Hopper and later), a kernel's programs start while its predecessor is
still running and stop at ``griddepcontrol.wait`` until the predecessor has finished and its
writes are visible. What a program does before that wait overlaps the predecessor: a linear
layer prefetches its slice of the weight into L2 there, so the weight streams from DRAM
while the latency-bound kernel before it (attention, a norm, the activation) leaves DRAM idle.

Rules every kernel launched with PDL keeps, so that no overlap can race:
- before ``wait_for_inputs`` it only reads memory no kernel writes (weights) or issues L2
  prefetches, which are hints and never change a value;
- it writes nothing before ``wait_for_inputs``;
- ``wait_for_inputs`` lets the next kernel launch only after this one's wait, so at most the
  predecessor is still running while a program is before its wait.

A kernel launched without PDL (cuBLAS, torch's own) keeps full stream order on both sides.
``kernels.backend.use_pdl`` decides whether a launch uses it (never on CPU, in Triton's
interpreter, before Hopper, or with ``PEGAINFER_PDL=0``).
"""

from __future__ import annotations

from kernels.backend import triton_jit

tl = None  # bound to triton.language by kernels.backend.load_triton()

# Bytes of one L2 line: a prefetch covers the line holding its address.
L2_LINE_BYTES = 128


@triton_jit
def wait_for_inputs(USE_PDL: tl.constexpr):
    """Block until the predecessor's writes are visible, then let the successor launch."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton_jit
def prefetch_l2(pointers):
    """Ask L2 for the line of every pointer of the tensor (a hint; nothing is loaded into
    registers). Duplicate addresses are harmless."""
    tl.inline_asm_elementwise(
        "mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];",
        "=r,l",
        [pointers],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


def launch_options(with_pdl: bool) -> dict[str, bool]:
    """Keyword arguments of a Triton launch: PDL asked for only where used, so a Triton
    without the option (or its interpreter) never sees it."""
    return {"launch_pdl": True} if with_pdl else {}
