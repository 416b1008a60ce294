"""Point-to-point on copy engines (pipeline parallelism): send / recv / isend / irecv / batch_isend_irecv."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .groups import resolve_group, group_name_and_size


class P2POp(NamedTuple):
    """One point-to-point op of a batch: op is "send" or "recv" (or torch.distributed.isend / irecv), peer the other
    rank IN `group` (torch.distributed.P2POp objects are accepted too, with their global peer)."""

    op: object
    tensor: torch.Tensor
    peer: int
    group: object = None


class P2PWork:
    """What isend / irecv / batch_isend_irecv(..., async_op=True) return: wait() makes the current stream wait for the
    ops (no host wait) and raises if a CE op of the process failed (a peer that never arrived: the timeout error).
    is_completed() is True once wait() ran."""

    def __init__(self, ticket: int):
        self._ticket = ticket
        self._waited = ticket == 0

    def wait(self, timeout=None) -> bool:  # noqa: ARG002 (torch's Work.wait signature; the watchdog bounds the wait)
        if not self._waited:
            self._waited = True
            torch.ops.ce_overlap._p2p_wait(self._ticket)
        return True

    def is_completed(self) -> bool:
        return self._waited


def _p2p_kind(op) -> str:
    if op in ("send", "recv"):
        return op
    import torch.distributed as dist

    if op in (dist.isend, dist.send):
        return "send"
    if op in (dist.irecv, dist.recv):
        return "recv"
    raise RuntimeError(f"ce_overlap.runtime.batch_isend_irecv: op {op!r} is neither 'send' nor 'recv'")


def _p2p_batch(ops, group, async_op: bool) -> P2PWork:
    import torch.distributed as dist

    sends, send_peers, recvs, recv_peers = [], [], [], []
    for o in ops:
        if isinstance(o, dist.P2POp):  # torch's: peer is a global rank
            kind, tensor, grp = _p2p_kind(o.op), o.tensor, o.group if o.group is not None else group
            peer = dist.get_group_rank(resolve_group(grp), o.peer)
        else:
            kind, tensor, peer = _p2p_kind(o.op), o.tensor, int(o.peer)
            grp = o.group if o.group is not None else group
        if grp is not group and resolve_group(grp) is not resolve_group(group):
            raise RuntimeError("ce_overlap.runtime.batch_isend_irecv: every op of a batch must use the same group")
        (sends if kind == "send" else recvs).append(tensor)
        (send_peers if kind == "send" else recv_peers).append(peer)
    name, _ = group_name_and_size(group)
    if not sends and not recvs:  # this rank takes no part in the batch: nothing to enqueue, nothing to wait for
        return P2PWork(0)
    return P2PWork(int(torch.ops.ce_overlap._batch_p2p(sends, send_peers, recvs, recv_peers, name, async_op)))


def batch_isend_irecv(ops, group=None, async_op: bool = False) -> P2PWork:
    """Sends and receives over copy engines, as one batch (pipeline-parallel activations and gradients). Ops are
    P2POp("send" | "recv", tensor, peer) with `peer` a rank in `group`, or torch.distributed.P2POp objects. Every op of
    the batch starts after the current stream's work so far; sends and receives of one pair are matched in order, per
    direction (as NCCL's). Each direction between two ranks has its own stream, so a batch never deadlocks, whatever
    the order of its ops on either side. async_op=False (default): the current stream waits for the whole batch;
    True: it does not, and the returned work's wait() joins it later. Both tensors of a pair must have the same number
    of bytes. Zero-copy when both sides use one empty_symmetric buffer (the same offset); otherwise the sender pushes
    into the receiver's landing banks (CE_OVERLAP_P2P_MB) and the receiver copies out, pipelined. An empty batch (a
    rank with nothing to send or receive this time) is a no-op and returns a completed work."""
    return _p2p_batch(list(ops), group, async_op)


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    """Sends `tensor` to rank `dst` of `group`, stream-ordered (the current stream waits until it is sent). A send that
    its peer answers only after its own send to us would deadlock on the streams: batch them (batch_isend_irecv) or
    use isend / irecv."""
    batch_isend_irecv([P2POp("send", tensor, dst)], group)


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    """Receives into `tensor` from rank `src` of `group`, stream-ordered (see send)."""
    batch_isend_irecv([P2POp("recv", tensor, src)], group)


def isend(tensor: torch.Tensor, dst: int, group=None) -> P2PWork:
    """Asynchronous send: the current stream does not wait; wait() on the returned work joins it."""
    return batch_isend_irecv([P2POp("send", tensor, dst)], group, async_op=True)


def irecv(tensor: torch.Tensor, src: int, group=None) -> P2PWork:
    """Asynchronous receive: `tensor` holds the message once wait() on the returned work was called."""
    return batch_isend_irecv([P2POp("recv", tensor, src)], group, async_op=True)
