"""Handle: what dispatch returns for combine and cached re-dispatch (spec §4.8).

Tuple-like so that code typed against DeepEP's positional handle keeps working: its items are
(recv_src_rank, recv_src_token, recv_src_slot), but callers must not rely on positions; read the accessors.
Immutable; tied to the Buffer that made it."""


class Handle(tuple):
    def __new__(cls, impl, event=None):
        self = super().__new__(cls, (impl.recv_src_rank, impl.recv_src_token, impl.recv_src_slot))
        self._impl = impl
        self._event = event  # the dispatch's event: counts are final once it completed
        return self

    def _done(self):
        if self._event is not None:
            self._event.wait()
        return self._impl

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
        return self[0]

    @property
    def recv_src_token(self):
        """[num_rows] int32: source token index of each row, -1 for PAD and tail rows."""
        return self[1]

    @property
    def recv_src_slot(self):
        """[num_rows] int32: top-k slot of each row (expert_major), all -1 in rank_major."""
        return self[2]

    @property
    def dispatch_id(self):
        """The group-wide sequence number of the dispatch that made it."""
        return self._done().dispatch_id

    def __repr__(self):
        return (
            f"epcomm.Handle(receive_order={self.receive_order!r}, num_tokens={self.num_tokens}, "
            f"num_topk={self.num_topk}, num_experts={self.num_experts}, dispatch_id={self.dispatch_id})"
        )

    def __reduce__(self):
        raise TypeError("an epcomm Handle cannot be pickled: it is tied to its Buffer")
