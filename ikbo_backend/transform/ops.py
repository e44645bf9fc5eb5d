"""Runtime pieces the rewritten graphs call: joins of user rows (U) with candidate rows (B) through
the mapping `cand_to_user` [B], plus the one explicit replication (`index_rows`) that the pass emits
where it has no join for a consumer (and reports).

The joins (`linear_rows`, `rows_join`, `rows_matmul`, `rows_einsum`, the CPU add) read user rows a tile
of candidates at a time, at most a cache's worth of gathered user rows per tile (`_tile_bytes`: 1 MiB on a
CPU, a quarter of L2 on a GPU): no tensor of user data at B rows, except that where all of B fits one tile
the tile is all of B (a small copy).
`select_user_rows` reads each candidate's own selection of its user's rows; `compact_keys` turns any
per-user key mask into key lengths for `ikbo_attention`.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from kernels import PackedLinearCompress, add_user_rows, ikbo_attention, ikbo_self_target_attention
from kernels._common import through_dispatcher


def index_rows(user: torch.Tensor, cand_to_user: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """user[cand_to_user] (along `dim`, the row dim): the materialized replication (what the pass could not
    avoid)."""
    return user.index_select(dim, cand_to_user)


def merged_mapping(cand_to_user: torch.Tensor, heads: int, num_users=None) -> torch.Tensor:
    """The mapping of rows merged with a dim of `heads` (attention heads moved into the row dim): batch-major
    (`num_users` None) row b·h + j reads user row m[b]·h + j; head-major (heads stacked first) row j·B + b reads
    j·U + m[b]."""
    m = cand_to_user.long()
    j = torch.arange(int(heads), device=m.device)
    if num_users is None:
        return (m[:, None] * int(heads) + j).reshape(-1)
    return (j[:, None] * int(num_users) + m).reshape(-1)


def index_rows_tuple(users, cand_to_user):
    return tuple(index_rows(u, cand_to_user) for u in users)


def pack_user_rows(x: torch.Tensor, lengths: torch.Tensor, batch_first: bool):
    """pack_padded_sequence of user rows: lengths at least 1 (a user without candidates may have none; the rows of a
    user with candidates and length 0 would have failed the original's pack), any order."""
    lengths = lengths.to("cpu", torch.int64).clamp(min=1)
    return nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=False)


def packed_rows(packed, cand_to_user: torch.Tensor):
    """A packed sequence of user rows at B rows: padded, its rows replicated through the mapping, packed again
    (enforce_sorted off: the same order a pack of the replicated rows takes)."""
    padded, lengths = nn.utils.rnn.pad_packed_sequence(packed, batch_first=True)
    rows = cand_to_user.long()
    return nn.utils.rnn.pack_padded_sequence(
        padded.index_select(0, rows), lengths.index_select(0, rows.cpu()), batch_first=True, enforce_sorted=False
    )


def present_rows(user: torch.Tensor, cand_to_user: torch.Tensor) -> torch.Tensor:
    """The user rows with each row of a user without candidates replaced by a row of a user with some: the rows a
    module kept whole sees at U rows are then those the original's replica holds (a branch on a statistic of its
    rows, `x.abs().max() > t`, `isnan(x).any()`, decides as there; counts of equal rows differ). Rows stay where
    they were, so the mapping indexes the result as it indexes `user`; with no candidates at all, no rows."""
    if cand_to_user.shape[0] == 0:
        return user[:0]
    rows = cand_to_user.long()
    present = torch.zeros(user.shape[0], dtype=torch.bool, device=user.device)
    present[rows] = True
    positions = torch.arange(user.shape[0], device=user.device)
    return user.index_select(0, torch.where(present, positions, rows[0]))


def fast_path_taken(*tensors, grad: bool | None = None) -> torch.Tensor:
    """Whether torch's native attention fast path runs at this call (`nn.MultiheadAttention`,
    `nn.TransformerEncoderLayer` in eval, their static conditions met): enabled, no autocast, no torch function
    mode, and grad off or none of `tensors` (the input and the parameters) requiring it; `grad`: the grad mode the
    forward itself set around the module (`torch.no_grad()` inside it), else the caller's. A 0-dim bool tensor: the
    rows it gives NaN (a query with every key masked: its masked softmax is 0/0) are chosen by it on each call."""
    grad = torch.is_grad_enabled() if grad is None else grad
    present = [t for t in tensors if t is not None]
    taken = torch.backends.mha.get_fastpath_enabled() and not torch.is_autocast_enabled()
    taken = taken and not torch.overrides.has_torch_function(present)  # a torch function mode (torch.device(...))
    taken = taken and not (grad and any(t.requires_grad for t in present))
    return torch.tensor(taken)


def kv_heads_for(kv: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """K or V [U, Hkv, L, d] with each head repeated for the query heads [*, Hq, S, d] that share it, as SDPA's
    enable_gqa reads them (Hq a multiple of Hkv, checked by it); read from the shapes at each call."""
    groups = q.shape[-3] // kv.shape[-3]
    return kv if groups == 1 else kv.repeat_interleave(groups, dim=-3)


def mapping_rows(cand_to_user: torch.Tensor) -> int:
    """B, the number of candidates."""
    return cand_to_user.shape[0]


def readout_rows(x: torch.Tensor, index: torch.Tensor, cand_to_user: torch.Tensor) -> torch.Tensor:
    """x[arange(U), index] of user rows x [U, L, ...] and a per-user index [U]: `x[cand_to_user][arange(B),
    index[cand_to_user]]` at U rows. On the CPU an index out of range raises IndexError where a user with candidates
    reads it (as the replicated form does); for a user without candidates, whose row nobody reads, it reads position 0
    instead. On a GPU the values are not read on the host (no sync, CUDA graphs): indices are clamped to the row, where
    the replicated form's out-of-range read is a device-side assert."""
    n = x.shape[1]
    if x.device.type != "cpu":  # no host read of the values (a sync each call; none allowed under CUDA graphs)
        return x[torch.arange(x.shape[0], device=x.device), index.clamp(-n, n - 1)]
    bad = (index < -n) | (index >= n)
    if bad.any():
        if bad[cand_to_user].any():
            raise IndexError(f"index {int(index[cand_to_user][bad[cand_to_user]][0])} is out of bounds for size {n}")
        index = index.masked_fill(bad, 0)
    return x[torch.arange(x.shape[0], device=x.device), index]


def readout_at(x: torch.Tensor, cand_to_user: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[cand_to_user][arange(B), index] of user rows x [U, L, ...] and a per-candidate index [B], from the U·L
    flattened rows (each candidate's one position, not its user's L); out-of-range positions as in `readout_rows`."""
    n = x.shape[1]
    if x.device.type != "cpu":  # as readout_rows: clamped on the device, not checked on the host
        index = index.clamp(-n, n - 1)
    else:
        bad = (index < -n) | (index >= n)
        if bad.any():
            raise IndexError(f"index {int(index[bad][0])} is out of bounds for dimension 1 with size {n}")
    return x.flatten(0, 1)[cand_to_user.long() * n + index.long() % max(n, 1)]


def rep_shape(user_shape, cand_to_user: torch.Tensor) -> torch.Size:
    """Shape of user[cand_to_user] from the user tensor's shape."""
    return torch.Size((cand_to_user.shape[0], *user_shape[1:]))


def cat_shape(shapes, dim: int) -> torch.Size:
    """The shape of torch.cat(parts, dim) from the parts' shapes."""
    first = list(shapes[0])
    first[dim] = sum(s[dim] for s in shapes)
    return torch.Size(first)


class WidthsChanged(RuntimeError):
    """A concat the rewrite keeps as its parts met other widths than the example's (it splits at those)."""


@torch.fx.node.has_side_effect
def check_widths(parts, dim: int, widths: list) -> None:
    """Raises WidthsChanged where the parts' sizes along the concat dim differ from the example's (`Guarded` then
    runs the original model); reads shapes only."""
    if [int(p[dim]) for p in parts] != widths:
        raise WidthsChanged(f"concat parts of widths {[int(p[dim]) for p in parts]}, the rewrite's are {widths}")


@torch.fx.node.has_side_effect
def check_sizes(sizes, expected: list) -> None:
    """Raises WidthsChanged where sizes read from shapes differ from the example's (the rewrite computed an index
    from them once: `triu_indices(n, n, 1)` over n fields); reads shapes only."""
    if [int(s) for s in sizes] != expected:
        raise WidthsChanged(f"sizes {[int(s) for s in sizes]}, the rewrite's index was computed from {expected}")


@torch.fx.node.has_side_effect
def check_fold(shape, lead: int, sizes: list) -> None:
    """Raises WidthsChanged unless viewing a tensor of `shape` as `sizes` merges its first `lead` dims and keeps the
    rest (the rewrite keeps such a view unflattened; on the example it was one); reads shapes only."""
    shape, sizes = [int(s) for s in shape], [int(s) for s in sizes]
    if sizes.count(-1) == 1:
        known = math.prod(s for s in sizes if s != -1)
        sizes[sizes.index(-1)] = math.prod(shape) // known if known else -1
    if sizes != [math.prod(shape[:lead]), *shape[lead:]]:
        raise WidthsChanged(f"a view of {shape} as {sizes} does not merge its first {lead} dims, as on the example")


def split_merged(user_shape, merged, base, sizes, rest: bool = False) -> list:
    """The sizes that view user rows merged batch-major with h ([U·h, *r], read through `merged`, derived from `base`)
    as the model views the replica [B·h, *r]: `sizes` as it wrote them (None: B; a torch.Size: a replica's shape
    [U, …], its row count taken for B; `rest`: r appended, as `unflatten(0, sizes)` keeps it). Raises WidthsChanged
    unless that view has B rows, each holding one candidate's h merged rows, as on the example; reads shapes only."""
    user_shape, b = [int(s) for s in user_shape], int(base.shape[0])
    if not b:
        raise WidthsChanged("no candidates: a view of merged rows has no row split to check")
    h, r = int(merged.shape[0]) // b, user_shape[1:]
    if isinstance(sizes, torch.Size):
        sizes = [None, *sizes[1:]]
    full = [b if s is None else int(s) for s in sizes] + (r if rest else [])
    if full.count(-1) == 1:
        known = math.prod(s for s in full if s != -1)
        full[full.index(-1)] = b * h * math.prod(r) // known if known else -1
    if full[0] != b or math.prod(full[1:]) != h * math.prod(r):
        raise WidthsChanged(
            f"a view of {[b * h, *r]} as {full} does not group its rows by {b} candidates, as on the example"
        )
    return [user_shape[0] // h, *full[1:]]


@torch.fx.node.has_side_effect
def check_same_rows(view_shape, source_shape) -> None:
    """Raises WidthsChanged unless a view with an inferred row count (`x.view(-1, d)`) kept x's rows, as it did on
    the example (where x's other dims may have been 1)."""
    if int(view_shape[0]) != int(source_shape[0]):
        raise WidthsChanged(f"a view of {list(source_shape)} as {list(view_shape)} moves rows, unlike on the example")


def repeat_mapping(user: torch.Tensor, repeats) -> torch.Tensor:
    """The mapping of user.repeat_interleave(repeats, dim=0): row b comes from user row out[b]."""
    return torch.repeat_interleave(torch.arange(user.shape[0], device=user.device), repeats)


def expand_mapping(rows: int, user: torch.Tensor) -> torch.Tensor:
    """The mapping of user.expand(rows, ...) for a single user: all zeros."""
    return torch.zeros(rows, dtype=torch.int64, device=user.device)


def kv_len_from(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Key lengths of a prefix mask `arange(L) < lengths[:, None]`, as the IKBO attention takes them."""
    if lengths.is_floating_point():
        lengths = torch.ceil(lengths)  # j < 2.5 keeps keys 0, 1, 2
    return lengths.clamp(0, seq_len).long()


def linear_rows(x, weight, user, cand_to_user, extras=()) -> torch.Tensor:
    """F.linear(x, weight) + user[m] + Σ extras: the Type I linear over cat(user, candidate) features, its
    user part (`user`, bias included) computed at U rows. On a CPU each tile of candidates has its user rows
    read into the output, the broadcast `extras` (small candidate terms) added, and the candidate GEMM
    accumulated into it (one pass over the output, no user tensor at B rows); elsewhere linear +
    add_user_rows."""
    if torch.is_autocast_enabled(x.device.type):  # in the dtype autocast gives the original's linear
        x, weight, user, *extras = _autocast(x, weight, user, *extras)
    out_shape = (*x.shape[:-1], weight.shape[0])
    if (
        x.is_cuda
        or through_dispatcher(x, user, cand_to_user)
        or tuple(user.shape[1:]) != out_shape[1:]
        or user.dtype != x.dtype
    ):
        y = F.linear(x, weight)
        for e in extras:
            y = y + e
        return add_user_rows_broadcast(y, user, cand_to_user)
    out = x.new_empty(out_shape)
    mapping, rows = cand_to_user.long(), _tile_rows(user)
    weight_t = weight.t()
    for start in range(0, out.shape[0], rows):
        tile = slice(start, start + rows)
        block = out[tile]
        torch.index_select(user, 0, mapping[tile], out=block)
        for e in extras:
            block.add_(e[tile])
        block.view(-1, out_shape[-1]).addmm_(x[tile].reshape(-1, x.shape[-1]), weight_t)
    return out


def add_rows_(cand: torch.Tensor, user: torch.Tensor, cand_to_user: torch.Tensor) -> torch.Tensor:
    """cand[b] += user[m[b]] in place, a tile at a time, for a fresh candidate tensor nothing else reads (a
    GEMM's output); on CUDA the add_user_rows kernel."""
    if cand.is_cuda or through_dispatcher(cand, user, cand_to_user) or cand.shape[1:] != user.shape[1:]:
        return add_user_rows_broadcast(cand, user, cand_to_user)
    mapping = cand_to_user.long()
    rows = _tile_rows(user)
    if rows >= cand.shape[0]:
        return cand.add_(user.index_select(0, mapping))
    for start in range(0, cand.shape[0], rows):
        cand[start : start + rows].add_(user.index_select(0, mapping[start : start + rows]))
    return cand


def add_user_rows_broadcast(cand, user, cand_to_user, cand_sign: float = 1.0, user_sign: float = 1.0) -> torch.Tensor:
    """cand_sign·cand[b] + user_sign·user[m[b]] with broadcasting over the trailing dims (`add_user_rows`)."""
    if not cand.is_cuda:  # on a CPU the tiled join beats the sparse selection matmul of add_user_rows
        name = "add" if cand_sign == user_sign else "sub_cu" if user_sign != 1.0 else "sub_uc"
        out = rows_join(name, cand, user, cand_to_user)
        return -out if cand_sign == user_sign == -1.0 else out
    trailing = torch.broadcast_shapes(cand.shape[1:], user.shape[1:])
    dtype = torch.result_type(cand, user)
    cand = cand.to(dtype).expand(cand.shape[0], *trailing)
    user = user.to(dtype).expand(user.shape[0], *trailing)
    if cand_sign != 1.0:
        cand = -cand
    if user_sign != 1.0:
        user = -user
    return add_user_rows(cand, user, cand_to_user)


# ----------------------------------------------------------------------------- tiled joins
# A join reads, for each candidate b, its user's row user[m[b]]. The ops below do so a tile of candidates at
# a time: the tile's user rows are gathered into a buffer of at most TILE_BYTES (cache-resident on a CPU, like
# the registers of a fused kernel) and combined with the tile's candidate rows; no tensor of user data at B rows
# is made and nothing loops over users. They are custom ops (inference only), opaque to dispatch modes such as
# ReplicationDetector, like the kernels' IKBO ops.

TILE_BYTES = 1 << 20  # on a CPU: about a core's L2
GPU_TILE_L2_SHARE = 4  # on a GPU a tile is this share of its L2 (H200: 15 MiB of 60), so that a join of long user
# rows (SIM's 2,048-item history at E = 128: 512 KiB a candidate) is a few launches, not hundreds


@functools.cache
def _tile_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return TILE_BYTES
    return max(TILE_BYTES, torch.cuda.get_device_properties(device).L2_cache_size // GPU_TILE_L2_SHARE)


def _tile_rows(user: torch.Tensor) -> int:
    row_bytes = max(1, user[0].numel() * user.element_size()) if user.shape[0] else 1
    return max(1, _tile_bytes(user.device) // row_bytes)


def _tiled(out, cand_to_user, user, step):
    """out[t] = step(t, user rows of tile t) for tiles t of the candidates."""
    mapping = cand_to_user.long()
    rows = _tile_rows(user)
    if rows >= out.shape[0]:
        step(slice(None), user.index_select(0, mapping))
        return out
    for start in range(0, out.shape[0], rows):
        tile = slice(start, start + rows)
        step(tile, user.index_select(0, mapping[tile]))
    return out


JOINS = {  # name → (torch function, argument order: c = candidate rows, u = user rows, k = condition)
    "add": (torch.add, "cu"),
    "sub_cu": (torch.sub, "cu"),
    "sub_uc": (torch.sub, "uc"),
    "mul": (torch.mul, "cu"),
    "div_cu": (torch.div, "cu"),
    "div_uc": (torch.div, "uc"),
    "pow_cu": (torch.pow, "cu"),
    "pow_uc": (torch.pow, "uc"),
    "maximum": (torch.maximum, "cu"),
    "minimum": (torch.minimum, "cu"),
    "logaddexp": (torch.logaddexp, "cu"),  # log(e^c + e^u): logsumexp over a concat, joined
    "where_uc": (torch.where, "kuc"),  # k ? user : cand
    "where_cu": (torch.where, "kcu"),
    "eq": (torch.eq, "cu"),
    "ne": (torch.ne, "cu"),
    "lt_cu": (torch.lt, "cu"),
    "lt_uc": (torch.lt, "uc"),
    "le_cu": (torch.le, "cu"),
    "le_uc": (torch.le, "uc"),
    "gt_cu": (torch.gt, "cu"),
    "gt_uc": (torch.gt, "uc"),
    "ge_cu": (torch.ge, "cu"),
    "ge_uc": (torch.ge, "uc"),
    "and": (torch.bitwise_and, "cu"),  # boolean or integer operands, as `&` takes them
    "or": (torch.bitwise_or, "cu"),
    "xor": (torch.bitwise_xor, "cu"),
}
COMPARISONS = {"eq", "ne", "lt_cu", "lt_uc", "le_cu", "le_uc", "gt_cu", "gt_uc", "ge_cu", "ge_uc"}


def _join_args(op, cand, user, cond):
    fn, order = JOINS[op]
    return fn, [{"c": cand, "u": user, "k": cond}[x] for x in order]


def _join_empty(op, cand, user, cond, rows):
    shapes = [cand.shape[1:], user.shape[1:]] + ([] if cond is None else [cond.shape[1:]])
    dtype = torch.result_type(cand, user) if op != "pow_uc" else torch.result_type(user, cand)
    dtype = torch.bool if op in COMPARISONS else dtype
    return cand.new_empty((rows, *torch.broadcast_shapes(*shapes)), dtype=dtype)


def _rows_join(op, cand, user, cand_to_user, cond=None):
    if _tile_rows(user) >= cand.shape[0]:  # one tile: no output buffer to fill
        fn, args = _join_args(op, cand, user.index_select(0, cand_to_user.long()), cond)
        return fn(*args)
    out = _join_empty(op, cand, user, cond, cand.shape[0])

    def step(tile, rows):
        fn, args = _join_args(op, cand[tile], rows, None if cond is None else cond[tile])
        fn(*args, out=out[tile])

    return _tiled(out, cand_to_user, user, step)


@torch.library.custom_op("ikbo_transform::rows_join", mutates_args=())
def _rows_join_op(
    op: str, cand: torch.Tensor, user: torch.Tensor, cand_to_user: torch.Tensor, cond: torch.Tensor | None = None
) -> torch.Tensor:
    return _rows_join(op, cand, user, cand_to_user, cond)


@_rows_join_op.register_fake
def _(op, cand, user, cand_to_user, cond=None):
    return _join_empty(op, cand, user, cond, cand.shape[0])


def rows_join(op: str, cand, user, cand_to_user, cond=None) -> torch.Tensor:
    """JOINS[op] of cand[b] and user[m[b]] (and cond[b] for where) for every candidate b, broadcast over the
    trailing dims, a tile at a time (`ikbo_transform::rows_join`)."""
    if through_dispatcher(cand, user, cand_to_user, cond):
        return _rows_join_op(op, cand, user, cand_to_user, cond)
    return _rows_join(op, cand, user, cand_to_user, cond)


def _matmul_empty(cand, user, cand_left, rows):
    cand, user = _autocast(cand, user)
    a, b = (cand, user) if cand_left else (user, cand)
    batch = torch.broadcast_shapes(a.shape[1:-2], b.shape[1:-2])
    return cand.new_empty((rows, *batch, a.shape[-2], b.shape[-1]), dtype=torch.result_type(cand, user))


def _autocast(*tensors):
    """The float tensors in the dtype autocast runs matmuls in, where it is on for their device (a matmul with
    `out=` would not be cast), else as they are."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def _rows_matmul(cand, user, cand_to_user, cand_left):
    cand, user = _autocast(cand, user)
    if _tile_rows(user) >= cand.shape[0]:
        rows = user.index_select(0, cand_to_user.long())
        return torch.matmul(cand, rows) if cand_left else torch.matmul(rows, cand)
    out = _matmul_empty(cand, user, cand_left, cand.shape[0])

    def step(tile, rows):
        if cand_left:
            torch.matmul(cand[tile], rows, out=out[tile])
        else:
            torch.matmul(rows, cand[tile], out=out[tile])

    return _tiled(out, cand_to_user, user, step)


@torch.library.custom_op("ikbo_transform::rows_matmul", mutates_args=())
def _rows_matmul_op(
    cand: torch.Tensor, user: torch.Tensor, cand_to_user: torch.Tensor, cand_left: bool
) -> torch.Tensor:
    return _rows_matmul(cand, user, cand_to_user, cand_left)


@_rows_matmul_op.register_fake
def _(cand, user, cand_to_user, cand_left):
    return _matmul_empty(cand, user, cand_left, cand.shape[0])


def rows_matmul(cand, user, cand_to_user, cand_left: bool) -> torch.Tensor:
    """matmul(cand[b], user[m[b]]) (cand_left) or matmul(user[m[b]], cand[b]) for every b, a tile at a time
    (`ikbo_transform::rows_matmul`): cand [B, *batch, M, K], user [U, *batch, K, N] (or the transposes)."""
    if through_dispatcher(cand, user, cand_to_user):
        return _rows_matmul_op(cand, user, cand_to_user, cand_left)
    return _rows_matmul(cand, user, cand_to_user, cand_left)


def _einsum_empty(equation, cand, user, cand_first, rows):
    user_b = user[:1].expand(1, *user.shape[1:]) if user.shape[0] else user.new_zeros(1, *user.shape[1:])
    one = torch.einsum(equation, cand[:1], user_b) if cand_first else torch.einsum(equation, user_b, cand[:1])
    return one.new_empty((rows, *one.shape[1:]))


def _rows_einsum(equation, cand, user, cand_to_user, cand_first):
    if cand.shape[0] == 0:
        return _einsum_empty(equation, cand.new_zeros(1, *cand.shape[1:]), user, cand_first, 0)
    out = _einsum_empty(equation, cand, user, cand_first, cand.shape[0])

    def step(tile, rows):
        out[tile] = torch.einsum(equation, cand[tile], rows) if cand_first else torch.einsum(equation, rows, cand[tile])

    return _tiled(out, cand_to_user, user, step)


@torch.library.custom_op("ikbo_transform::rows_einsum", mutates_args=())
def _rows_einsum_op(
    equation: str, cand: torch.Tensor, user: torch.Tensor, cand_to_user: torch.Tensor, cand_first: bool
) -> torch.Tensor:
    return _rows_einsum(equation, cand, user, cand_to_user, cand_first)


@_rows_einsum_op.register_fake
def _(equation, cand, user, cand_to_user, cand_first):
    a, b = (cand, user) if cand_first else (user, cand)
    inputs, output = equation.replace(" ", "").split("->")
    sizes = {}
    for spec, t in zip(inputs.split(","), (a, b)):
        sizes.update(zip(spec, t.shape))
    sizes[output[0]] = cand.shape[0]
    return cand.new_empty([sizes[c] for c in output], dtype=torch.result_type(cand, user))


def rows_einsum(equation: str, cand, user, cand_to_user, cand_first: bool) -> torch.Tensor:
    """einsum(equation, cand[b], user[m[b]]) over operands that share their leading (row) index, a tile at a
    time (`ikbo_transform::rows_einsum`)."""
    if through_dispatcher(cand, user, cand_to_user):
        return _rows_einsum_op(equation, cand, user, cand_to_user, cand_first)
    return _rows_einsum(equation, cand, user, cand_to_user, cand_first)


def select_user_rows(
    user: torch.Tensor, cand_to_user: torch.Tensor, index: torch.Tensor, broadcast: bool = False
) -> torch.Tensor:
    """torch.gather(user[m], 1, index) without user[m]: out[b, k, ...] = user[m[b], index[b, k, ...], ...].
    Each candidate's own selection of its user's rows (a SIM-style search result), read from the U-row tensor.
    broadcast: torch.take_along_dim's form, index and user broadcast against each other past dim 1 (as views)."""
    if broadcast:
        trailing = torch.broadcast_shapes(index.shape[2:], user.shape[2:])
        index, user = index.expand(*index.shape[:2], *trailing), user.expand(*user.shape[:2], *trailing)
    length = user.shape[1]
    flat = user.flatten(0, 1)  # [U·L, ...]
    shift = (cand_to_user.long() * length).view(-1, *([1] * (index.dim() - 1)))
    rows = (index + shift).flatten(0, 1)  # [B·K, ...]
    return torch.gather(flat, 0, rows).unflatten(0, index.shape[:2])


ROW_REDUCTIONS = ("sum", "nansum", "mean", "nanmean", "amax", "amin", "logsumexp")


def reduce_rows(kind: str, user: torch.Tensor, cand_to_user: torch.Tensor, dims: tuple, keepdim: bool) -> torch.Tensor:
    """`kind` (ROW_REDUCTIONS) of user[cand_to_user] over `dims` (dim 0 among them) without it: each user row
    counted as often as candidates map to it (a bincount of the mapping, minlength U) — Σ_b u[m[b]] = Σ_u count_u ·
    u[u], a max over the users with candidates, logsumexp of u + log count_u — users without candidates left out
    (their values, NaN included, are never read). 16-bit floats accumulate in fp32, as torch's reductions do."""
    counts = torch.bincount(cand_to_user.long(), minlength=user.shape[0])
    shape = (-1,) + (1,) * (user.dim() - 1)
    present = (counts > 0).view(shape)
    if kind in ("amax", "amin"):
        high = kind == "amin"
        if user.dtype == torch.bool:
            fill = high
        elif user.is_floating_point():
            fill = float("inf") if high else float("-inf")
        else:
            fill = torch.iinfo(user.dtype).max if high else torch.iinfo(user.dtype).min
        return getattr(torch, kind)(torch.where(present, user, fill), dim=dims, keepdim=keepdim)
    low = user.is_floating_point() and user.element_size() < 4
    x = user.float() if low else user
    if kind == "logsumexp":
        shifted = torch.where(present, x + counts.to(x.dtype).log().view(shape), float("-inf"))
        out = torch.logsumexp(shifted, dim=dims, keepdim=keepdim)
        return out.to(user.dtype) if low else out
    keep = present & ~torch.isnan(x) if kind in ("nansum", "nanmean") else present
    weights = counts.to(x.dtype if x.is_floating_point() or x.is_complex() else torch.int64).view(shape)
    out = (torch.where(keep, x, 0) * weights).sum(dim=dims, keepdim=keepdim)
    if kind == "mean":
        out = out / (cand_to_user.shape[0] * math.prod(user.shape[d] for d in dims if d))
    elif kind == "nanmean":
        out = out / (keep.to(x.dtype) * weights).expand_as(x).sum(dim=dims, keepdim=keepdim)
    return out.to(user.dtype) if low else out


def rows_constant(factory, shape, rows, *args, **kwargs):
    """factory((U, *shape[1:]), ...): a tensor equal on every row, made at U rows (`rows` = U)."""
    return factory((rows, *shape[1:]), *args, **kwargs)


def key_mask(mask: torch.Tensor) -> torch.Tensor:
    """[U, L] bool of the keys each user attends to, from an SDPA mask over keys [U, 1, ..., L] (bool: True
    keeps a key; additive float: 0 keeps it)."""
    mask = mask.reshape(mask.shape[0], mask.shape[-1])
    return mask if mask.dtype == torch.bool else mask == 0


def empty_users(out: torch.Tensor, v: torch.Tensor, kv_len: torch.Tensor, cand_to_user, fill: str) -> torch.Tensor:
    """out, except for candidates whose user keeps no key: there what the original's softmax gives over scores that
    all got the same mask value — "mean": a finite fill that rounds the scores away (`check_rounds_away`), the mean of
    the user's values over all its keys; "nan": a softmax over −inf everywhere. v [U, H, L, d], out [B, H, S, d]."""
    if fill == "mean":
        user = v.mean(dim=-2, keepdim=True)
    else:
        user = torch.full_like(v[..., :1, :], float("nan"))
    cond = (kv_len == 0).index_select(0, cand_to_user.long()).view(-1, *[1] * (out.dim() - 1))
    return rows_join("where_uc", out, user.to(out.dtype), cand_to_user, cond)


MASKS_OUT = -1e4  # a finite fill at most this masks a key: exp(fill + s − max) is 0 for any score |s| < 5e3


def _ulp(value: float, dtype: torch.dtype) -> float:
    mantissa = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}.get(dtype, 52)
    return 2.0 ** (math.floor(math.log2(abs(value))) - mantissa)


@torch.fx.node.has_side_effect
def check_mask_values(mask: torch.Tensor, fill: float) -> None:
    """Raises WidthsChanged unless an additive mask holds only 0 and `fill`, as it did on the example where it was
    taken for a key mask (a bias of other values is not one); reads values: a device sync on CUDA."""
    if not bool(((mask == 0) | (mask == fill)).all()):
        raise WidthsChanged(f"an additive attention mask holds values other than 0 and {fill:g}, unlike on the example")


@torch.fx.node.has_side_effect
def check_rounds_away(q: torch.Tensor, k: torch.Tensor, kv_len: torch.Tensor, scale, fill: float, dtype) -> None:
    """Where a user keeps no key, the original's softmax over fill + scores is the mean of its values (what
    `empty_users` gives) only if every score rounds to `fill` when added in `dtype`: |s| ≤ max‖q‖ · max‖k‖ · |scale| <
    ulp(fill) / 2. Raises WidthsChanged otherwise, only where such a user exists (reads values: a sync on CUDA)."""
    if q.numel() == 0 or not bool((kv_len == 0).any()):
        return
    bound = q.float().norm(dim=-1).amax() * k.float().norm(dim=-1).amax() * abs(float(scale))
    if not float(bound) < _ulp(fill, dtype) / 2:
        raise WidthsChanged(f"a user without keys whose scores (|s| ≤ {float(bound):.3g}) do not all round to {fill:g}")


def attention(q, k, v, cand_to_user, kv_len=None, scale=None) -> torch.Tensor:
    """`ikbo_attention` with its inputs in the dtype autocast runs the original's SDPA / matmuls in, where it is on
    for their device: the op takes one dtype, and the original computes (and returns) the autocast dtype there."""
    q, k, v = _autocast(q, k, v)
    return ikbo_attention(q, k, v, cand_to_user, kv_len, scale)


def self_target_attention(user_q, cand_q, k, v, cand_to_user, kv_len=None, causal=True, scale=None):
    """`ikbo_self_target_attention` with its inputs cast as `attention` casts them."""
    user_q, cand_q, k, v = _autocast(user_q, cand_q, k, v)
    return ikbo_self_target_attention(user_q, cand_q, k, v, cand_to_user, kv_len, causal=causal, scale=scale)


def compact_keys(k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor):
    """(k, v, kv_len) with each user's kept keys moved to the front (stable), so a key mask of any shape
    becomes a key-length prefix: attention is the same function of the set of kept keys."""
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # [U, L]
    index = order[:, None, :, None]
    k = k.gather(2, index.expand(-1, k.shape[1], -1, k.shape[3]))
    v = v.gather(2, index.expand(-1, v.shape[1], -1, v.shape[3]))
    return k, v, keep.sum(dim=1)


class LinearCompress(nn.Module):
    """matmul(W, cat([user[m], cand], dim=1)) with W packed once: `kernels.PackedLinearCompress`."""

    def __init__(self, weight: torch.Tensor, num_user_tokens: int):
        super().__init__()
        self.packed = PackedLinearCompress.from_weight(weight, num_user_tokens)

    def forward(self, user, cand, cand_to_user):
        return self.packed(user, cand, cand_to_user)
