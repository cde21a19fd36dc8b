"""Handle: what dispatch returns for combine and cached re-dispatch (docs/normal-mode.md, docs/python.md).

A Handle is tuple-like with the positional items of the peer its Buffer's flavor follows (docs/python.md,
"Positional handle items"): DeepEP's 6 items on one node and 10 across nodes (flavor "deepep"), the Ascend
port's 8 and 9 (flavor "ascend"). Items are computed from epcomm's routing when first read. String keys give
the dispatch's "topk_idx" and "topk_weights" in every layout, and with DEEP_USE_MODE=alltoall the keys of
the Ascend port's dict handle. The named accessors are the same in every layout. Immutable; tied to the Buffer
that made it; pass it back as it is (a tuple rebuilt from its items is rejected)."""
import operator

import torch

from ._errors import IndexError, InvalidUsageError, KeyError  # noqa: A004 - epcomm's, also the builtins

# Positional layouts: (flavor, several nodes) -> item names, in the peer's order.
LAYOUTS = {
    ("deepep", False): ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                        "recv_src_idx", "is_token_in_rank", "send_head"),
    ("deepep", True): ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
                       "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum",
                       "recv_gbl_channel_prefix_matrix", "recv_gbl_rank_prefix_sum", "recv_src_meta",
                       "send_rdma_head", "send_nvl_head"),
    ("ascend", False): ("rank_prefix_matrix", "channel_prefix_matrix", "recv_channel_prefix_matrix",
                        "recv_src_idx", "is_token_in_rank", "send_head", "topk_idx", "topk_weights"),
    ("ascend", True): ("recv_src_idx", "is_token_in_rank", "send_head", "topk_idx", "topk_weights",
                       "offset_inner", "offset_outer", "count_outer", "expand_scales"),
}
# DeepEP's send_nvl_head has a column per NVL peer of its node (its NUM_MAX_NVL_PEERS); epcomm's nodes may have
# more ranks, then it has one per rank.
DEEPEP_NVL_PEERS = 8
# The Ascend port allocates its per-token internode items for this many tokens (its MAX_BATCH_SIZE); rows past
# the dispatch's tokens hold "not sent" (docs/python.md).
ASCEND_MAX_BATCH = 4096
# The Ascend port's alltoall handle is a dict; these are its keys that epcomm's handle answers.
ALLTOALL_KEYS = ("input_splits", "output_splits", "topk_idx", "topk_weights", "num_local_experts",
                 "hidden_shape")


def _index_among_sent(sent):
    """[T, X] bool -> [T, X] i32: t's index among the tokens t' with sent[t', x], -1 where not sent[t, x]."""
    before = torch.cumsum(sent.to(torch.int32), 0) - 1
    return torch.where(sent, before, torch.full_like(before, -1)).to(torch.int32)


def _server_offsets(ids, expert_node, allowed):
    """[n, K] ids of n tokens (in token order) -> [n, E] i32: the position of pair (token, e) among the pairs for
    experts of e's node, ordered by expert then token; -1 where the token does not go to e or e is not allowed."""
    n, E = ids.shape[0], expert_node.shape[0]
    onehot = torch.zeros(n, E, dtype=torch.int64)
    valid = (ids >= 0) & allowed[ids.clamp(min=0)]
    onehot[torch.arange(n).unsqueeze(1).expand_as(ids)[valid], ids[valid]] = 1
    total = onehot.sum(0)
    before = torch.zeros(E, dtype=torch.int64)  # pairs for the experts of e's node before e
    for g in expert_node.unique().tolist():
        sel = (expert_node == g).to(torch.int64)
        before += (torch.cumsum(total * sel, 0) - total * sel) * sel
    pos = torch.cumsum(onehot, 0) - 1 + before
    return torch.where(onehot > 0, pos, torch.full_like(pos, -1)).to(torch.int32)


class Handle(tuple):
    def __new__(cls, impl, event=None, flavor="ascend", topk_idx=None, topk_weights=None, rank=0,
                node_of=None, alltoall=False, recv_topk_weights=None):
        self = super().__new__(cls, ())
        self._impl = impl
        self._event = event  # the dispatch's event: counts are final once it completed
        self._flavor = flavor
        self._topk = (topk_idx, topk_weights)
        self._recv_topk_weights = recv_topk_weights
        self._rank = rank
        self._node_of = list(node_of) if node_of is not None else [0] * len(impl.num_recv_rows_per_source)
        self._alltoall = alltoall
        self._layout = LAYOUTS[(flavor, max(self._node_of) > 0)]
        self._items = {}
        return self

    def _done(self):
        if self._event is not None:
            self._event.wait()
        return self._impl

    # ---- tuple protocol ----------------------------------------------------------------------------------

    def __len__(self):
        return len(self._layout)

    def __getitem__(self, key):
        if isinstance(key, str):
            return self._by_key(key)
        if isinstance(key, slice):
            return tuple(self[i] for i in range(*key.indices(len(self))))
        i = operator.index(key)
        n = len(self._layout)
        if i < -n or i >= n:
            raise IndexError(f"handle index {i} out of range: this {self._flavor} handle has {n} items "
                             f"({', '.join(self._layout)})")
        return self.item(self._layout[i])

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __contains__(self, value):
        return any(v is value for v in self)

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other

    __hash__ = object.__hash__

    def _by_key(self, key):
        if key in ("topk_idx", "topk_weights"):
            return self.item(key)
        if self._alltoall and key in ALLTOALL_KEYS:
            return self.item(key)
        keys = ALLTOALL_KEYS if self._alltoall else ("topk_idx", "topk_weights")
        raise KeyError(f"handle[{key!r}]: this handle's string keys are {', '.join(repr(k) for k in keys)}")

    @property
    def item_names(self):
        """The names of the positional items, in order (docs/python.md)."""
        return self._layout

    def item(self, name):
        """A positional item by its name (computed once, when first read)."""
        if name not in self._items:
            compute = getattr(self, "_item_" + name, None) if isinstance(name, str) else None
            if compute is None:
                raise InvalidUsageError(f"handle item {name!r}: not an item of any handle layout (this one has "
                                        f"{', '.join(self._layout)})")
            self._items[name] = compute()
        return self._items[name]

    # ---- positional items (docs/python.md; one channel) -----------------------------------------------------

    def _rows(self):
        """[R, R] int64: rows receiver d got from source s at [s, d], PAD excluded."""
        return self._done().num_rows_per_source_and_receiver

    def _in_rank(self):
        return self._done().is_token_in_rank.bool()

    def _item_rank_prefix_matrix(self):
        return self._rows().cumsum(0).to(torch.int32)

    def _item_channel_prefix_matrix(self):
        return self._rows()[self._rank].reshape(-1, 1).to(torch.int32)

    def _item_recv_channel_prefix_matrix(self):
        return torch.zeros(len(self._node_of), 1, dtype=torch.int32)

    def _item_recv_src_idx(self):
        return self.recv_src_token

    def _item_is_token_in_rank(self):
        t = self._in_rank()
        return t if self._flavor == "deepep" else t.to(torch.int32)

    def _item_send_head(self):
        """[T, R] i32: own token t's first row among the rows rank d receives from this rank, -1 if not sent."""
        in_rank = self._in_rank()
        if self.receive_order == "rank_major" or self._topk[0] is None:
            return _index_among_sent(in_rank)
        return self._expert_major_send_head(in_rank)

    def _expert_major_send_head(self, in_rank):
        # Rows from this rank at d: its (token, expert) pairs for d's experts, by expert, then by token.
        ids = self._topk[0].to(torch.int64)
        T, R = in_rank.shape
        E = self.num_experts
        pos = torch.full((T, R), -1, dtype=torch.int64)
        if T == 0 or E == 0:
            return pos.to(torch.int32)
        onehot = torch.zeros(T, E, dtype=torch.int64)
        valid = ids >= 0
        onehot[torch.arange(T).unsqueeze(1).expand_as(ids)[valid], ids[valid]] = 1
        L = E // R
        per_expert = onehot.sum(0)
        block = per_expert.reshape(R, L)
        start = torch.cat([torch.zeros(R, 1, dtype=torch.int64), block.cumsum(1)[:, :-1]], 1).reshape(E)
        row = start.unsqueeze(0) + onehot.cumsum(0) - 1  # [T, E]: position of (t, e) among d's rows from us
        row = torch.where(onehot > 0, row, torch.full_like(row, 1 << 62)).reshape(T, R, L).amin(2)
        return torch.where(in_rank, row, pos).to(torch.int32)

    def _item_topk_idx(self):
        return self._topk[0]

    def _item_topk_weights(self):
        return self._topk[1]

    def _per_node(self, per_rank):
        nodes = max(self._node_of) + 1
        out = torch.zeros(nodes, dtype=torch.int64)
        out.index_add_(0, torch.tensor(self._node_of), per_rank.to(torch.int64))
        return out

    def _in_node(self):
        """[T, M] bool: whether own token t goes to some rank of node m (it crosses to a node once)."""
        in_rank = self._in_rank()
        per_node = torch.zeros(in_rank.shape[0], max(self._node_of) + 1, dtype=torch.int64)
        per_node.index_add_(1, torch.tensor(self._node_of, dtype=torch.int64), in_rank.to(torch.int64))
        return per_node > 0

    def _item_rdma_channel_prefix_matrix(self):
        """[M, 1] i32: own tokens sent to node m (one token crosses to a node once)."""
        return self._in_node().sum(0).reshape(-1, 1).to(torch.int32)

    def _item_send_rdma_head(self):
        """[T, M] i32: own token t's index among this rank's tokens sent to node m, -1 if not sent there."""
        return _index_among_sent(self._in_node())

    def _ascend_rows(self):
        return max(self.num_tokens, ASCEND_MAX_BATCH)

    # Items built from other ranks' routing, which the dispatch recorded: the node masks of the received rows,
    # and, as proxy of this rank's rail peers (the ranks with its local index on the other nodes), the entries
    # of their windows this node needed (Handle::rail_entries, docs/python.md).

    def _node_ranks(self):
        me = self._node_of[self._rank]
        return [r for r, n in enumerate(self._node_of) if n == me]

    def _masks_needed(self, name):
        P = len(self._node_ranks())
        if P > 32:
            raise InvalidUsageError(f"handle item {name!r}: its node masks hold 32 ranks per node; this Buffer's "
                                    f"nodes have {P}")

    def _rail(self, m):
        """(T, tokens [n], masks [n], ids [n, K]) of the rail peer on node m: the entries it sent to this node,
        in token order; for this node, this rank's own tokens that go to some rank of it."""
        if m != self._node_of[self._rank]:
            return self._done().rail_entries(m)
        local = self._in_rank()[:, self._node_ranks()]
        tokens = local.any(1).nonzero().reshape(-1).to(torch.int32)
        bits = (local.to(torch.int64) << torch.arange(local.shape[1])).sum(1) if local.shape[1] <= 32 else None
        masks = bits[tokens.long()].to(torch.int32) if bits is not None else torch.zeros(0, dtype=torch.int32)
        ids = self._topk[0]
        ids = (ids[tokens.long()].to(torch.int32) if ids is not None
               else torch.zeros(len(tokens), 0, dtype=torch.int32))
        return self.num_tokens, tokens, masks, ids

    def _item_recv_rdma_channel_prefix_matrix(self):
        """[M, 1] i32: tokens the rail peer on node m sent to this node (m = ours: own tokens kept here)."""
        nodes = max(self._node_of) + 1
        return torch.tensor([len(self._rail(m)[1]) for m in range(nodes)], dtype=torch.int32).reshape(nodes, 1)

    def _item_send_nvl_head(self):
        """[sum_m n_m, max(P, 8)] i32: per entry of each rail peer (node order, then token order), its index
        among that peer's entries for the node's j-th rank, -1 where the token does not go there."""
        self._masks_needed("send_nvl_head")
        cols = max(len(self._node_ranks()), DEEPEP_NVL_PEERS)
        parts = []
        for m in range(max(self._node_of) + 1):
            masks = self._rail(m)[2].to(torch.int64)
            parts.append(_index_among_sent((masks.unsqueeze(1) >> torch.arange(cols)) & 1 > 0))
        return torch.cat(parts).to(torch.int32)

    def _item_recv_src_meta(self):
        """[num_rows, 8] u8: per row two int32, the source rank's node and the row's node mask (-1 and 0 for
        PAD and tail rows)."""
        self._masks_needed("recv_src_meta")
        src = self.recv_src_rank.to(torch.int64)
        node = torch.tensor(self._node_of, dtype=torch.int32)[src.clamp(min=0)]
        node = torch.where(src >= 0, node, torch.full_like(node, -1))
        meta = torch.stack([node, self._done().recv_node_masks], 1).contiguous()
        return meta.view(torch.uint8)

    def _item_offset_inner(self):
        """[M, max(T*, 4096), E] i32: slab m for the rail peer on node m (this rank for its node), docs/python.md."""
        if self._topk[0] is None:
            raise InvalidUsageError("handle item 'offset_inner': needs a dispatch with topk_idx")
        nodes, E, R = max(self._node_of) + 1, self.num_experts, len(self._node_of)
        rails = [self._rail(m) for m in range(nodes)]
        rows = max([ASCEND_MAX_BATCH] + [int(r[0]) for r in rails])
        out = torch.full((nodes, rows, E), -1, dtype=torch.int32)
        expert_node = torch.tensor(self._node_of, dtype=torch.int64).repeat_interleave(E // R)
        me = self._node_of[self._rank]
        for m, (_, tokens, _, ids) in enumerate(rails):
            if m == me:  # this rank's slab: all its tokens, every expert
                tokens, ids = torch.arange(self.num_tokens), self._topk[0]
            allowed = torch.ones(E, dtype=torch.bool) if m == me else expert_node == me
            out[m, tokens.long()] = _server_offsets(ids.to(torch.int64), expert_node, allowed)
        return out

    def _item_offset_outer(self):
        """[max(T, 4096), M] i32: send_rdma_head's value for own tokens, -1 in the rows past them."""
        out = torch.full((self._ascend_rows(), max(self._node_of) + 1), -1, dtype=torch.int32)
        out[:self.num_tokens] = self._item_send_rdma_head()
        return out

    def _item_count_outer(self):
        """[max(T, 4096)] i32: the number of nodes own token t goes to, 0 in the rows past them."""
        out = torch.zeros(self._ascend_rows(), dtype=torch.int32)
        out[:self.num_tokens] = self._in_node().sum(1).to(torch.int32)
        return out

    def _item_gbl_channel_prefix_matrix(self):
        return self._item_channel_prefix_matrix()

    def _item_recv_rdma_rank_prefix_sum(self):
        return self._per_node(torch.tensor(self.num_recv_rows_per_source)).cumsum(0).to(torch.int32)

    def _item_recv_gbl_channel_prefix_matrix(self):
        return self._item_recv_channel_prefix_matrix()

    def _item_recv_gbl_rank_prefix_sum(self):
        return torch.tensor(self.num_recv_rows_per_source, dtype=torch.int64).cumsum(0).to(torch.int32)

    def _item_expand_scales(self):
        """[num_rows] f32: the top-k weight of each received row (expert_major), 0 for PAD rows."""
        w = self._recv_topk_weights
        if w is None or w.dim() != 1:
            raise InvalidUsageError("handle item 'expand_scales': needs an expert_major dispatch with topk_weights "
                                    "(one weight per received row)")
        return w

    # alltoall keys (the Ascend port's dict handle)
    def _item_input_splits(self):
        return list(self._done().send_splits)

    def _item_output_splits(self):
        return list(self._done().recv_splits)

    def _item_num_local_experts(self):
        return self.num_experts // len(self._node_of)

    def _item_hidden_shape(self):
        return [self.num_tokens, self._done().hidden]

    # ---- named accessors (docs/normal-mode.md) ------------------------------------------------------------

    @property
    def flavor(self):
        """"ascend" or "deepep": whose positional layout this handle has."""
        return self._flavor

    @property
    def receive_order(self):
        """"expert_major" or "rank_major"."""
        return self._done().receive_order

    @property
    def num_tokens(self):
        """T: rows of the dispatched x on this rank."""
        return self._done().num_tokens

    @property
    def num_topk(self):
        return self._done().num_topk

    @property
    def num_experts(self):
        return self._done().num_experts

    @property
    def num_recv_rows(self):
        """N: the exact number of rows received (PAD rows included)."""
        return self._done().num_recv_rows

    @property
    def num_rows(self):
        """N, or num_worst_tokens when it was given: the rows of recv_x and of combine's x."""
        return self._done().num_rows

    @property
    def num_recv_tokens_per_expert(self):
        """The aligned per-local-expert list."""
        return list(self._done().num_recv_tokens_per_expert)

    @property
    def num_recv_pairs_per_expert(self):
        """cnt: (token, slot) pairs per local expert, before alignment."""
        return list(self._done().num_recv_pairs_per_expert)

    @property
    def num_recv_rows_per_source(self):
        """[num_ranks]: rows received from each rank, PAD excluded."""
        return list(self._done().num_recv_rows_per_source)

    @property
    def recv_src_rank(self):
        """[num_rows] int32: source rank of each row, -1 for PAD and tail rows."""
        return self._done().recv_src_rank

    @property
    def recv_src_token(self):
        """[num_rows] int32: source token index of each row, -1 for PAD and tail rows."""
        return self._done().recv_src_token

    @property
    def recv_src_slot(self):
        """[num_rows] int32: top-k slot of each row (expert_major), all -1 in rank_major."""
        return self._done().recv_src_slot

    @property
    def dispatch_id(self):
        """The group-wide sequence number of the dispatch that made it."""
        return self._done().dispatch_id

    def __repr__(self):
        return (
            f"epcomm.Handle(flavor={self._flavor!r}, receive_order={self.receive_order!r}, "
            f"num_tokens={self.num_tokens}, num_topk={self.num_topk}, num_experts={self.num_experts}, "
            f"dispatch_id={self.dispatch_id}, items={len(self)})"
        )

    def __reduce__(self):
        raise TypeError("an epcomm Handle cannot be pickled: it is tied to its Buffer")
