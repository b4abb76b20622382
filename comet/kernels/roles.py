"""Thread-block specialization: which role a program of a layer kernel takes.

A layer kernel is launched with a constexpr ``ROLE``: ``ROLE_FUSED`` splits the grid (the
lowest ``n_comm`` program ids communicate, the rest compute; ``n_comm`` is read on the
device so one captured launch serves every split), ``ROLE_COMM``/``ROLE_COMPUTE`` give the
whole grid one role (the "communicate, then compute" schedule, and the virtual-rank driver
that launches producers before consumers).
"""

import triton
import triton.language as tl

from comet.constants import ROLE_COMM, ROLE_FUSED


@triton.jit
def assign_role(split_ptr, ROLE: tl.constexpr):
    """``(is_comm, programs_in_my_role, my_index_in_role)`` of this program."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    if ROLE == ROLE_FUSED:
        n_comm = tl.load(split_ptr).to(tl.int32)   # int64 on the host; loops need int32
        comm = pid < n_comm
        n_role = tl.where(comm, n_comm, programs - n_comm)
        role_pid = tl.where(comm, pid, pid - n_comm)
    else:
        comm = ROLE == ROLE_COMM
        n_role = programs
        role_pid = pid
    return comm, n_role, role_pid
