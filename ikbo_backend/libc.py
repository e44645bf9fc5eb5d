"""libc's memmove and memset through ctypes.PyDLL, so that the GIL stays with the caller.

ctypes.memmove and numpy's larger copies release the GIL; where several model instances share one
interpreter (the python_inprocess backend) a waiting instance thread then takes it mid-request. The
CUDA-graph replays (cuda_graphs.py) and the in-process backend's output writes (inprocess/pb_utils.py)
copy with these instead.
"""

from __future__ import annotations

import ctypes

memmove = ctypes.PyDLL(None).memmove
memmove.argtypes, memmove.restype = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t), ctypes.c_void_p
memset = ctypes.PyDLL(None).memset
memset.argtypes, memset.restype = (ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t), ctypes.c_void_p
